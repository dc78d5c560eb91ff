"""``packing``, ``neat_packing`` and ``num_samples`` against LLaMA-Factory 0.9.5's own output on the real data
(tests/golden/data.json, made by tests/golden/make_data_goldens.py through LLaMA-Factory's ``get_train_args`` +
``get_dataset``): the same packed rows (grouping, order, labels, position ids), the same attention between the
samples of a row (checked on the real stories260K model), and the same sampled rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.batching import collate
from trainer.data import prepare_data
from trainer.formats import load_samples, resolve_datasets, sampling_rng
from trainer.loss import IGNORE_INDEX

pytestmark = pytest.mark.budget(90, reason="a neat_packing run through ferry train")

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "data.json").read_text(encoding="utf-8"))


def _strip_padding(row: dict[str, list[int]]) -> dict[str, list[int]]:
    """LLaMA-Factory's row without its right padding (position id 0 from the end; no sample is 1 token long)."""
    n = len(row["position_ids"])
    while n > 0 and row["position_ids"][n - 1] == 0:
        n -= 1
    assert all(x == IGNORE_INDEX for x in row["labels"][n:]) and n < len(row["position_ids"])
    return {k: v[:n] for k, v in row.items()}


@pytest.fixture(scope="module")
def packed(stories_model: Path, llamafactory_data: Path, tmp_path_factory):
    """mode -> (ferry's PreparedData, LLaMA-Factory's rows) for each packing mode of the golden."""
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer

    work = tmp_path_factory.mktemp("packing")
    out = {}
    tokenizer = None
    for mode, case in GOLDEN["packing"].items():
        cfg = TrainConfig(
            model_name_or_path=str(stories_model),
            dataset_dir=str(llamafactory_data),
            output_dir=str(work / "out"),
            tokenized_path=str(work / "tok"),
            **GOLDEN["packing_keys"],
            **case["keys"],
        )
        tokenizer = tokenizer or load_tokenizer(cfg)
        out[mode] = (prepare_data(cfg, tokenizer), case["rows"])
    return out


def _assert_rows_equal(ours_rows, lf_rows, mode: str) -> None:
    assert len(ours_rows) == len(lf_rows)
    cutoff = GOLDEN["packing_keys"]["cutoff_len"]
    for ours, theirs in zip(ours_rows, lf_rows):
        assert len(theirs["input_ids"]) == cutoff  # LLaMA-Factory pads every row to cutoff_len
        theirs = _strip_padding(theirs)
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]
        assert ours["position_ids"] == theirs["position_ids"]
        if mode.startswith("neat_packing"):  # its attention mask numbers the samples 1, 2, ...: so do the restarts
            segments, k = [], 0
            for p in ours["position_ids"]:
                k += p == 0
                segments.append(k)
            assert theirs["attention_mask"] == segments
        else:
            assert set(theirs["attention_mask"]) == {1}


@pytest.mark.parametrize("mode", list(GOLDEN["packing"]))
def test_packed_rows_equal_llamafactory(packed, mode: str) -> None:
    data, lf_rows = packed[mode]
    assert len(lf_rows) < data.stats["num_train_samples"]
    _assert_rows_equal(list(data.train), lf_rows, mode)
    if mode == "packing+train_on_prompt":  # a later sample's first token stays a label, as in LLaMA-Factory
        assert any(
            r["labels"][i] != IGNORE_INDEX for r in data.train for i, p in enumerate(r["position_ids"]) if i and p == 0
        )


def test_val_size_splits_llamafactorys_samples(packed) -> None:
    """val_size: the same samples in eval and in train (in the same order: the packed train rows are equal);
    LLaMA-Factory packs the eval samples too, ferry evaluates them one by one: packed alike, they are its rows."""
    from trainer.data import _split, pack_examples

    case = GOLDEN["packing"]["neat_packing+val_size"]
    n = len(case["split_train"]) + len(case["split_eval"])
    train, evals = _split([[i] for i in range(n)], case["keys"]["val_size"], GOLDEN["packing_keys"]["seed"])
    assert (train, evals) == (case["split_train"], case["split_eval"])
    data, _ = packed["neat_packing+val_size"]
    assert data.stats["num_eval_samples"] == len(case["split_eval"])
    cutoff = GOLDEN["packing_keys"]["cutoff_len"]
    _assert_rows_equal(pack_examples(list(data.eval), cutoff - 1), case["eval_rows"], "neat_packing")


def _lf_mask(row: dict[str, list[int]], neat: bool) -> torch.Tensor:
    """The attention mask LLaMA-Factory's collator gives the model: the 2-D mask as is (plain packing), or
    ``prepare_4d_attention_mask`` of the sample numbers (neat_packing, eager/sdpa): [1, 1, L, L] float."""
    mask = torch.tensor([row["attention_mask"]])
    if not neat:
        return mask
    same = (mask[:, None, None, :] == mask[:, None, :, None]) & (mask != 0)[:, None, None, :]
    allowed = same & torch.tril(torch.ones(mask.shape[1], mask.shape[1], dtype=torch.bool))
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("mode", ["packing", "neat_packing"])
def test_packed_rows_attend_as_in_llamafactory(packed, stories_model: Path, mode: str) -> None:
    """The logits of ferry's collated batch equal those of LLaMA-Factory's padded rows under its masks; and the
    two modes differ (plain packing lets a sample see the one before it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_model, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    data, lf_rows = packed[mode]
    rows = [i for i, r in enumerate(data.train) if r["position_ids"].count(0) > 1][:2]
    assert rows, "the golden holds rows with several samples"
    cross = mode == "packing"
    batch = collate([data.train[i] for i in rows], pad_token_id=2, cross_sample_attention=cross)
    assert ("attention_mask" in batch) is cross
    with torch.no_grad():
        ours = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        other = model(
            **{
                k: v
                for k, v in collate(
                    [data.train[i] for i in rows], pad_token_id=2, cross_sample_attention=not cross
                ).items()
                if k != "labels"
            },
            use_cache=False,
        ).logits
        for b, i in enumerate(rows):
            lf = lf_rows[i]
            theirs = model(
                input_ids=torch.tensor([lf["input_ids"]]),
                position_ids=torch.tensor([lf["position_ids"]]),
                attention_mask=_lf_mask(lf, neat=not cross),
                use_cache=False,
            ).logits
            n = len(data.train[i]["input_ids"])
            assert torch.allclose(ours[b, :n], theirs[0, :n], atol=1e-4), (mode, i)
            assert not torch.allclose(other[b, :n], theirs[0, :n], atol=1e-3)


@pytest.mark.parametrize("seed", list(GOLDEN["num_samples"]))
def test_num_samples_picks_llamafactorys_rows(llamafactory_data: Path, tmp_path: Path, seed: str) -> None:
    """Two datasets with num_samples in one list (the second asks for more rows than it holds): the same rows,
    in the same order, as LLaMA-Factory's loader under the same seed."""
    info = {
        name: {**entry, "file_name": str(llamafactory_data / entry["file_name"])}
        for name, entry in GOLDEN["num_samples_info"].items()
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    rng = sampling_rng(int(seed))  # what prepare_data does: one stream, the datasets in order
    for spec, (name, expected) in zip(resolve_datasets(list(info), tmp_path), GOLDEN["num_samples"][seed].items()):
        rows = [int(s.origin.rsplit("row ", 1)[1]) - 1 for s in load_samples(spec, stage="sft", rng=rng)]
        assert rows == expected, name
    assert max(map(len, GOLDEN["num_samples"][seed].values())) > 91  # identity has 91 rows: expansion covered


def test_num_samples_rows_reach_training(make_cfg, stories_tokenizer, llamafactory_data: Path, tmp_path: Path) -> None:
    """prepare_data trains on exactly those rows: its examples equal the examples of the golden rows."""
    seed, picks = next(iter(GOLDEN["num_samples"].items()))
    info = {
        name: {**entry, "file_name": str(llamafactory_data / entry["file_name"])}
        for name, entry in GOLDEN["num_samples_info"].items()
    }
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    (sampled / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    # the same rows written out in the picked order, read without num_samples
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    plain = {}
    for name, entry in GOLDEN["num_samples_info"].items():
        rows = json.loads((llamafactory_data / entry["file_name"]).read_text(encoding="utf-8"))
        (chosen / entry["file_name"]).write_text(json.dumps([rows[i] for i in picks[name]]), encoding="utf-8")
        plain[name] = {"file_name": entry["file_name"]}
    (chosen / "dataset_info.json").write_text(json.dumps(plain), encoding="utf-8")
    keys = dict(dataset=",".join(info), template="default", cutoff_len=64, seed=int(seed))
    got = prepare_data(make_cfg(dataset_dir=str(sampled), **keys), stories_tokenizer)
    want = prepare_data(make_cfg(dataset_dir=str(chosen), **keys), stories_tokenizer)
    assert got.stats["num_train_samples"] == sum(map(len, picks.values()))
    assert list(got.train) == list(want.train)


def test_neat_packing_trains_through_ferry_train(stories_model: Path, llamafactory_data: Path, tmp_path: Path) -> None:
    """One real `ferry train` (torchrun, 1 worker, 2 steps) with neat_packing (plain packing runs in
    tests/trainer/test_fsdp.py): the rows are the golden's."""

    from tests.support.helpers import run_ferry_train, tiny_config, worker_env, write_config

    cfg = tiny_config(
        stories_model, llamafactory_data, tmp_path, **GOLDEN["packing_keys"], neat_packing=True, max_steps=2
    )
    proc = run_ferry_train(
        str(write_config(tmp_path / "c.yaml", cfg)),
        "--nproc-per-node",
        "1",
        env=worker_env(tmp_path),
        cwd=tmp_path,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["global_steps"] == 2 and report["data_stats"]["neat_packing"] is True
    assert report["data_stats"]["num_train_sequences"] == len(GOLDEN["packing"]["neat_packing"]["rows"])
