"""do_predict + predict_with_generate (trainer/predict.py) on the real stories260K model and
LLaMA-Factory's alpaca_en_demo: the predictions file and the scores LLaMA-Factory reports, recomputed here with
the peer libraries (jieba, rouge-chinese, nltk) the way LLaMA-Factory 0.9.5's ComputeSimilarity calls them; and
2 gloo ranks under torchrun predict exactly what 1 process predicts (greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import (
    lf_scores,
    run_ferry_train,
    tiny_config,
    worker_env,
    write_config,
)

pytestmark = pytest.mark.budget(90, reason="predict runs on an adapter and on its export")

PREDICT_KEYS = {
    "do_predict": True,
    "predict_with_generate": True,
    "eval_dataset": "alpaca_en_demo",
    "do_sample": False,
    "max_new_tokens": 12,
    "per_device_eval_batch_size": 2,
}


@pytest.fixture(scope="module")
def runs(stories_model, llamafactory_data, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("predict")
    # 1 process: train a little, then predict 5 rows with the base model (do_eval) and the trained adapter
    trained = tiny_config(
        stories_model,
        llamafactory_data,
        work,
        output_dir=str(work / "trained"),
        max_samples=5,
        cutoff_len=512,
        num_train_epochs=1,
        do_eval=True,
        **PREDICT_KEYS,
    )
    proc = run_ferry_train(
        write_config(work / "trained.yaml", trained), "--nproc-per-node", "1", env=worker_env(work), cwd=work
    )
    (work / "trained" / "summary.txt").write_text(proc.stdout)
    # 2 gloo ranks under ferry train: prediction only (do_train: false) with that adapter
    ddp = dict(
        trained,
        output_dir=str(work / "ddp"),
        do_train=False,
        do_eval=False,
        adapter_name_or_path=str(work / "trained" / "adapter"),
    )
    run_ferry_train(write_config(work / "ddp.yaml", ddp), "--nproc-per-node", "2", env=worker_env(work), cwd=work)
    return {"trained": work / "trained", "ddp": work / "ddp", "config": trained}


def _rows(out: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text("utf-8").splitlines()]


def test_predictions_and_scores_as_llamafactory_reports_them(runs, llamafactory_data):
    rows = _rows(runs["trained"])
    demo = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text("utf-8"))[:5]
    assert len(rows) == 5 and all(set(r) == {"prompt", "predict", "label"} for r in rows)
    for row, sample in zip(rows, demo):
        # the alpaca template's prompt, as training renders it before the reply
        user = sample["instruction"] + ("\n" + sample["input"] if sample["input"] else "")
        assert row["prompt"].endswith(f"### Instruction:\n{user}\n\n### Response:\n")
        assert row["label"].strip() and sample["output"].startswith(row["label"][:20])
    assert any(r["predict"].strip() for r in rows), "the model generated text"
    results = json.loads((runs["trained"] / "predict_results.json").read_text())
    expected = lf_scores([(r["label"], r["predict"]) for r in rows])
    for key, value in expected.items():
        assert results[key] == pytest.approx(value, abs=1e-9), key
    assert results["predict_runtime"] > 0


def test_two_ranks_predict_what_one_process_predicts(runs):
    assert _rows(runs["ddp"]) == _rows(runs["trained"])
    one = json.loads((runs["trained"] / "predict_results.json").read_text())
    two = json.loads((runs["ddp"] / "predict_results.json").read_text())
    assert {k: v for k, v in two.items() if "bleu" in k or "rouge" in k} == {
        k: v for k, v in one.items() if "bleu" in k or "rouge" in k
    }


def test_predict_on_an_export_equals_predict_on_its_adapter(runs, stories_model, tmp_path):
    """do_predict with model_name_or_path = a ``ferry export`` folder and no adapter (as LLaMA-Factory users
    predict on a merged model) predicts what the trained adapter on its base predicts (greedy, float32)."""
    from exporter.export import export
    from exporter.options import ExportOptions

    merged = tmp_path / "merged"
    export(runs["trained"] / "adapter", merged, ExportOptions(base=stories_model, smoke=False))
    cfg = dict(
        runs["config"],
        model_name_or_path=str(merged),
        output_dir=str(tmp_path / "on-export"),
        do_train=False,
        do_eval=False,
    )
    cfg.pop("adapter_name_or_path", None)
    run_ferry_train(
        write_config(tmp_path / "on-export.yaml", cfg), "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path
    )
    assert _rows(tmp_path / "on-export") == _rows(runs["trained"])
    on_export = json.loads((tmp_path / "on-export" / "predict_results.json").read_text())
    on_adapter = json.loads((runs["trained"] / "predict_results.json").read_text())
    assert {k: v for k, v in on_export.items() if "bleu" in k or "rouge" in k} == {
        k: v for k, v in on_adapter.items() if "bleu" in k or "rouge" in k
    }


def test_run_summary_shows_base_and_tuned_scores(runs):
    base = json.loads((runs["trained"] / "base" / "predict_results.json").read_text())
    tuned = json.loads((runs["trained"] / "predict_results.json").read_text())
    summary = (runs["trained"] / "summary.txt").read_text()
    assert "bleu-4  rouge-1  rouge-2  rouge-l" in summary
    for label, scores in (("base model", base), ("tuned model", tuned)):
        line = next(x for x in summary.splitlines() if x.strip().startswith(label))
        assert line.split()[2:] == [
            f"{scores[k]:.4f}" for k in ("predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l")
        ]
    assert (runs["trained"] / "base" / "generated_predictions.jsonl").is_file()
    assert not (runs["ddp"] / "base").exists()  # no do_eval, no base row


def test_scores_of_known_pairs():
    from trainer.predict import similarity_scores

    pairs = [("The cat sat on the mat.", "The cat sat on a mat."), ("你好世界", "你好"), ("", "x"), ("abc", "")]
    ours = similarity_scores(pairs)
    assert {f"predict_{k}": v for k, v in ours.items()} == lf_scores(pairs)
    assert 0 < ours["bleu-4"] < 100 and ours["rouge-1"] > 0


def test_do_predict_needs_generate_and_eval_data(make_cfg):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="predict_with_generate"):
        make_cfg(do_predict=True, eval_dataset="alpaca_en_demo")
    with pytest.raises(ValidationError, match="eval_dataset"):
        make_cfg(do_predict=True, predict_with_generate=True)


def test_refuses_an_adapter_that_is_not_one_or_grew_the_vocabulary(make_cfg, tmp_path):
    import torch

    from ferry.errors import ConfigError
    from trainer.predict import load_predict_model

    cfg = make_cfg(do_predict=True, predict_with_generate=True, eval_dataset="alpaca_en_demo")
    with pytest.raises(ConfigError, match="holds no adapter_config.json"):
        load_predict_model(cfg, [str(tmp_path)], torch.device("cpu"))
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "ferry_vocab.json").write_text("{}")
    with pytest.raises(ConfigError, match="grew the vocabulary"):
        load_predict_model(cfg, [str(tmp_path)], torch.device("cpu"))


def test_chat_template_prompts_end_with_the_generation_prompt(make_cfg, stories_tokenizer, llamafactory_data):
    import copy

    from trainer.predict import build_rows

    tokenizer = copy.deepcopy(stories_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    cfg = make_cfg(
        template=None,
        max_samples=2,
        cutoff_len=4096,
        do_predict=True,
        predict_with_generate=True,
        eval_dataset="alpaca_en_demo",
    )
    demo = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text("utf-8"))[:2]
    rows = build_rows(cfg, tokenizer)
    assert [r.index for r in rows] == [0, 1]
    for row, sample in zip(rows, demo):
        user = sample["instruction"] + ("\n" + sample["input"] if sample["input"] else "")
        assert tokenizer.decode(row.input_ids) == f"<user>{user}<assistant>"
        assert tokenizer.decode(row.label_ids) == sample["output"]
