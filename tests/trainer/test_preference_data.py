"""Preference data (``trainer.preference_data``) against LLaMA-Factory 0.9.5's own examples
(tests/golden/preference.json, made by tests/golden/make_preference_goldens.py through its ``get_train_args`` +
``get_dataset`` for ``stage: dpo`` and ``stage: kto``): the same token ids and labels, row for row, in six templates
(one efficient_eos), with and without truncation; and each bad input refused in one line naming the file, the row
and the key."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from ferry.errors import ConfigError, DataError
from trainer.formats import resolve_datasets
from trainer.preference_data import kl_partners, load_preference_samples, preference_examples

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "preference.json").read_text(encoding="utf-8"))


#: LLaMA-Factory 0.9.5's OpenAIDatasetConverter appends this to every system prompt of an openai-format row without
#: tools (a switch of one model family), for sft as for dpo; ferry's openai reader does not. The golden's openai rows
#: are given to ferry with it written into their system message, so that everything else is compared exactly.
LF_OPENAI_SYSTEM_SUFFIX = "\ndetailed thinking off"


def _as_llamafactory_reads(name: str, rows: list[dict]) -> list[dict]:
    if GOLDEN["dataset_info"].get(name.removesuffix(".json"), {}).get("formatting") != "openai":
        return rows
    out = json.loads(json.dumps(rows))
    for row in out:
        assert row["messages"][0]["role"] == "system" and not row.get("tools")
        row["messages"][0]["content"] += LF_OPENAI_SYSTEM_SUFFIX
    return out


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory) -> Path:
    """The golden's dataset files and dataset_info.json, as LLaMA-Factory read them: the rows the golden names
    ("sources") of LLaMA-Factory's own demo files, read from its pinned sdist (hash-checked), and the written ones."""
    from tests.support.pinned_sdist import LLAMAFACTORY

    root = tmp_path_factory.mktemp("preference-data")
    files = dict(GOLDEN["files"])
    for name, source in GOLDEN["sources"].items():
        raw = (LLAMAFACTORY.path() / "data" / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == source["sha256"], name
        every = json.loads(raw)
        files[name] = [every[i] for i in source["rows"]]
    for name, rows in files.items():
        rows = _as_llamafactory_reads(name, rows)
        (root / name).write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    (root / "dataset_info.json").write_text(json.dumps(GOLDEN["dataset_info"]), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def template_and_tokenizer(stories_model: Path):
    """template name -> (ferry's configured template, the stories260K tokenizer loaded by ferry for it)."""
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer, template_for

    cache: dict[str, Any] = {}

    def get(name: str):
        if name not in cache:
            cfg = TrainConfig(
                model_name_or_path=str(stories_model), dataset="x", output_dir="x", template=name, resize_vocab=True
            )
            cache[name] = (template_for(cfg), load_tokenizer(cfg))
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _pinned_date(monkeypatch):
    from trainer.templates import tools

    monkeypatch.setattr(tools, "today", lambda: datetime.datetime(*GOLDEN["pinned_date"]))


def _case_id(case: dict) -> str:
    return "-".join([case["stage"], *(str(v) for v in case["keys"].values())])


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_examples_equal_llamafactorys(case: dict, golden_data: Path, template_and_tokenizer) -> None:
    keys = case["keys"]
    template, tokenizer = template_and_tokenizer(keys["template"])
    ours = preference_examples(
        GOLDEN["stage_datasets"][case["stage"]].split(","),
        str(golden_data),
        case["stage"],
        template,
        tokenizer,
        cutoff_len=keys["cutoff_len"],
        batch_size=keys.get("preprocessing_batch_size", 1000),
        num_workers=keys.get("preprocessing_num_workers"),
    )
    assert len(ours) == len(case["examples"])
    for k, (mine, theirs) in enumerate(zip(ours, case["examples"])):
        assert mine == theirs, (k, {c: (mine[c], theirs[c]) for c in theirs if mine[c] != theirs[c]})


def test_goldens_cover_truncation_tools_and_both_kto_tags() -> None:
    truncated = [c for c in GOLDEN["cases"] if c["keys"]["cutoff_len"] < 100]
    assert truncated and all(
        max(len(v) for e in c["examples"] for k, v in e.items() if k.endswith("input_ids")) == c["keys"]["cutoff_len"]
        for c in truncated
    )
    assert {e["kto_tags"] for c in GOLDEN["cases"] if c["stage"] == "kto" for e in c["examples"]} == {True, False}
    assert {c["keys"]["template"] for c in GOLDEN["cases"]} >= {
        "default",
        "llama3",
        "qwen",
        "qwen3",
        "falcon",
    }  # efficient_eos


@pytest.mark.parametrize(
    ("n", "batch_size", "workers", "expected"),
    [
        (4, 1000, None, [3, 0, 1, 2]),
        (7, 3, 2, [2, 0, 1, 3, 6, 4, 5]),  # shards [0..3] and [4..6]: batches [0,1,2], [3], [4,5,6]
        (2, 1000, 8, [0, 1]),  # more workers than rows: one row each, its own partner
    ],
)
def test_kl_partners_rotate_within_each_batch(n: int, batch_size: int, workers, expected: list[int]) -> None:
    assert kl_partners(n, batch_size, workers) == expected


# ---------------------------------------------------------------------- refusals


def _dataset(tmp_path: Path, entry: dict, rows: list[dict]) -> Path:
    (tmp_path / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json", **entry}}), encoding="utf-8")
    return tmp_path


_PAIRS = {"ranking": True, "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}
_SHAREGPT_PAIRS = {
    "ranking": True,
    "formatting": "sharegpt",
    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
}
_KTO = {"columns": {"prompt": "instruction", "response": "output", "kto_tag": "label"}}


def _human(text: str) -> list[dict]:
    return [{"from": "human", "value": text}]


@pytest.mark.parametrize(
    ("stage", "entry", "rows", "fragment"),
    [
        (
            "dpo",
            _SHAREGPT_PAIRS,
            [
                {"conversations": _human("a"), "chosen": {"from": "gpt", "value": "b"}, "rejected": None},
                {"conversations": _human("c"), "chosen": {"from": "gpt", "value": "d"}},
            ],
            "row 1: no rejected reply (column 'rejected', columns.rejected)",
        ),
        (
            "dpo",
            _PAIRS,
            [
                {"instruction": "ok", "chosen": "x", "rejected": "y"},
                {"instruction": " ", "chosen": "x", "rejected": "y"},
            ],
            "row 2: empty prompt",
        ),
        ("rm", _PAIRS, [{"instruction": "q", "chosen": "same", "rejected": "same"}], "row 1: chosen and rejected are"),
        (
            "dpo",
            _SHAREGPT_PAIRS,
            [
                {
                    "conversations": _human("a"),
                    "chosen": {"from": "human", "value": "b"},
                    "rejected": {"from": "gpt", "value": "c"},
                }
            ],
            "row 1: column 'chosen' (columns.chosen): role 'human' is not a reply role",
        ),
        (
            "dpo",
            _SHAREGPT_PAIRS,
            [
                {
                    "conversations": [*_human("a"), {"from": "gpt", "value": "b"}],
                    "chosen": {"from": "gpt", "value": "c"},
                    "rejected": {"from": "gpt", "value": "d"},
                }
            ],
            "row 1: the conversation before chosen/rejected must end with a user turn",
        ),
        ("dpo", _PAIRS, [{"instruction": "q", "chosen": "x", "rejected": ""}], "row 1: the rejected reply"),
        (
            "kto",
            _KTO,
            [{"instruction": "q", "output": "a", "label": "true"}],
            "row 1: column 'label' (columns.kto_tag) must be a JSON boolean",
        ),
        ("kto", _KTO, [{"instruction": "q", "output": "a", "label": 1}], r"got int 1"),
        (
            "kto",
            _KTO,
            [{"instruction": "q", "output": "a", "label": True}, {"instruction": "q", "output": "a"}],
            "row 2: column 'label' (columns.kto_tag) must be a JSON boolean, true (desirable) or false (undesirable), "
            "got nothing",
        ),
        (
            "kto",
            _KTO,
            [{"instruction": "q", "output": "a", "label": True}, {"instruction": "q", "output": "b", "label": "no"}],
            "row 2: column 'label' (columns.kto_tag) must be a JSON boolean, true (desirable) or false (undesirable), "
            "got str 'no'",
        ),
        (
            "kto",
            _KTO,
            [{"instruction": "q", "output": "a", "label": True}, {"instruction": "q", "output": "b", "label": 0}],
            "row 2: column 'label' (columns.kto_tag) must be a JSON boolean, true (desirable) or false (undesirable), "
            "got int 0",
        ),
        ("kto", _KTO, [{"instruction": "q", "output": " ", "label": True}], "row 1: the judged reply"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_key(
    tmp_path: Path, stage: str, entry: dict, rows: list[dict], fragment: str
) -> None:
    root = _dataset(tmp_path, entry, rows)
    (spec,) = resolve_datasets(["d"], root, stage)
    with pytest.raises(DataError) as err:
        list(load_preference_samples(spec, stage))  # type: ignore[arg-type]
    message = str(err.value)
    assert str(root / "d.json") in message and fragment in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("stage", "entry", "fragment"),
    [
        ("sft", _PAIRS, "key 'ranking': a ranking (chosen/rejected) dataset cannot train stage: sft; set stage: dpo"),
        ("kto", _PAIRS, "key 'ranking': a ranking (chosen/rejected) dataset cannot train stage: kto"),
        ("dpo", {}, 'not a ranking dataset, so stage: dpo cannot use it: set "ranking": true'),
        ("rm", _KTO, 'not a ranking dataset, so stage: rm cannot use it: set "ranking": true'),
        ("kto", {}, "no columns.kto_tag, so stage: kto has no desirable/undesirable label"),
        ("sft", _KTO, "columns.kto_tag: a KTO (desirable/undesirable) dataset cannot train stage: sft"),
        ("dpo", {"ranking": True, "columns": {"chosen": "c"}}, "columns.rejected: a ranking dataset must name"),
    ],
)
def test_stage_and_dataset_kind_must_agree(tmp_path: Path, stage: str, entry: dict, fragment: str) -> None:
    """LLaMA-Factory's "The dataset is not applicable in the current training stage", as one line naming the key."""
    root = _dataset(tmp_path, entry, [{"instruction": "q", "output": "a"}])
    with pytest.raises(ConfigError) as err:
        resolve_datasets(["d"], root, stage)
    assert f"dataset_info.json: dataset 'd': {fragment}" in str(err.value) and "\n" not in str(err.value)


def test_ranking_dataset_is_refused_by_prepare_data_for_sft(make_cfg, stories_tokenizer, golden_data: Path) -> None:
    from trainer.data import prepare_data

    with pytest.raises(ConfigError, match="dataset 'dpo_en_demo': key 'ranking'.*set stage: dpo"):
        prepare_data(make_cfg(dataset="dpo_en_demo", dataset_dir=str(golden_data)), stories_tokenizer)


def test_pairs_cut_by_cutoff_len_are_counted_as_truncated(make_cfg, stories_tokenizer) -> None:
    """``num_truncated`` of a ranking dataset (32 pairs of LLaMA-Factory's dpo_en_demo): the pairs whose prompt plus
    longer reply exceed ``cutoff_len``, as the same pairs tokenised without a cut measure them."""
    from tests.support.pinned_sdist import LLAMAFACTORY
    from trainer.data import prepare_data

    def pairs(cutoff_len: int) -> Any:
        cfg = make_cfg(
            stage="dpo",
            dataset="dpo_en_demo",
            dataset_dir=str(LLAMAFACTORY.path() / "data"),
            max_samples=32,
            cutoff_len=cutoff_len,
            template="default",
        )
        return prepare_data(cfg, stories_tokenizer)

    whole = pairs(100_000)
    assert whole.stats["num_truncated"] == 0
    lengths = whole.train.lengths()
    longer = [max(lengths[i], lengths[i + 1]) for i in range(0, len(lengths), 2)]
    expected = sum(n > 256 for n in longer)
    assert 0 < expected < len(longer) == 32
    assert pairs(256).stats["num_truncated"] == expected


#: golden bad-row dataset -> (ferry's refusal, what LLaMA-Factory 0.9.5 made of the same rows)
_LF_ON_BAD_ROWS = {
    "no_rejected_sharegpt": ("row 2: no rejected reply", {"llamafactory_examples": 1}),  # dropped with a warning
    "no_rejected_alpaca": ("row 2: no rejected reply", {"llamafactory_examples": 1}),
    "empty_prompt": ("row 2: empty prompt", {"llamafactory_examples": 2}),  # trained
    "same_reply": ("row 2: chosen and rejected are the same reply", {"llamafactory_examples": 2}),
    "user_role_reply": ("row 2: column 'chosen' (columns.chosen): role 'human'", {"llamafactory_examples": 2}),
    "kto_tag_string": ("row 3: column 'label' (columns.kto_tag) must be a JSON boolean", {}),  # datasets fails
    "kto_tag_strings": ("row 1: column 'label' (columns.kto_tag) must be a JSON boolean", {}),  # every row dropped
    # LLaMA-Factory tells desirable from undesirable by an empty reply: the desirable row is trained as undesirable
    "kto_empty_reply": (
        "row 3: the judged reply (the last turn) is empty",
        {"llamafactory_examples": 3, "llamafactory_kto_tags": [True, False, False]},
    ),
}


@pytest.mark.parametrize("name", list(GOLDEN["bad_rows"]))
def test_what_llamafactory_drops_or_trains_wrongly_is_refused(tmp_path: Path, name: str) -> None:
    """The rows of each golden bad-row dataset: LLaMA-Factory's outcome as recorded, ferry's refusal in one line."""
    case = GOLDEN["bad_rows"][name]
    fragment, outcome = _LF_ON_BAD_ROWS[name]
    assert {k: v for k, v in case.items() if k.startswith("llamafactory_") and k != "llamafactory_error"} == outcome
    assert ("llamafactory_error" in case) is (not outcome)
    root = _dataset(tmp_path, case["entry"], case["rows"])
    (spec,) = resolve_datasets(["d"], root, case["stage"])
    with pytest.raises(DataError) as err:
        list(load_preference_samples(spec, case["stage"]))
    assert str(root / "d.json") in str(err.value) and fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "stage"), [("dpo_en_demo", "dpo"), ("kto_en_demo", "kto")])
def test_llamafactorys_demo_files_read_whole(tmp_path: Path, name: str, stage: str) -> None:
    """Every row of the real demo file (the golden's rows come from it; read from LLaMA-Factory 0.9.5's own source
    distribution, hash-pinned in tests/support/pinned_sdist.py) reads under LLaMA-Factory's own entry; KTO's labels
    are its 150 desirable and 150 undesirable."""
    from tests.support.pinned_sdist import LLAMAFACTORY

    source = LLAMAFACTORY.path() / "data" / f"{name}.json"
    assert hashlib.sha256(source.read_bytes()).hexdigest() == GOLDEN["sources"][f"{name}.json"]["sha256"]
    entry = {**GOLDEN["dataset_info"][name], "file_name": str(source)}
    (tmp_path / "dataset_info.json").write_text(json.dumps({name: entry}), encoding="utf-8")
    (spec,) = resolve_datasets([name], tmp_path, stage)
    samples = list(load_preference_samples(spec, stage))  # type: ignore[arg-type]
    assert len(samples) == 300
    if stage == "kto":
        assert sum(s.desirable for s in samples) == 150  # type: ignore[union-attr]
