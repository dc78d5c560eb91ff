"""``stage: rm`` end to end: LLaMA-Factory's dpo_en_demo pairs (from its pinned sdist) on the real stories260K model.

The reference for the numbers is trl's RewardTrainer (a pinned test dependency): the adapter ferry trained, merged
into a ``LlamaForSequenceClassification`` whose ``score`` is ferry's value head, evaluated by trl on the same
tokenised pairs, must give ferry's eval loss, accuracy and margin. LLaMA-Factory's value-head file layout is
checked key by key; 2 gloo ranks must equal one process; a killed run must resume exactly.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.helpers import run_ferry_train, run_plain_worker, worker_env, write_config
from tests.trainer.test_dpo import dpo_config, rows

pytestmark = pytest.mark.budget(90, reason="LLaMA-Factory's reward example trained on 2 ranks and exported")

REWARD_KEYS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


def rm_config(stories_model: Path, work: Path, **overrides: Any) -> dict[str, Any]:
    """stage rm on dpo_config's 16 pairs (4 held out), 4 steps, eval every 2."""
    return dpo_config(stories_model, work, stage="rm", **overrides)


def no_dropout_copy(stories_model: Path, folder: Path) -> Path:
    """stories260K with ``summary_dropout_prob: 0`` in its config (the value head's dropout, trl's key): dropout
    draws differ between one process and 2 ranks, so the comparisons run without it."""
    shutil.copytree(stories_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["summary_dropout_prob"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def rm_runs(stories_model: Path, tmp_path_factory) -> dict[str, Path]:
    """The same 4 steps twice: one plain process (batch 2 x accumulation 2), and ``ferry train`` on 2 gloo ranks
    (DDP, batch 1 x accumulation 2: the same global batch of 4 pairs) with no network, saving a checkpoint
    every 2 steps; its last rank is killed after step 3 and torchrun restarts both from checkpoint-2. The model's
    value head has no dropout (:func:`no_dropout_copy`)."""
    work = tmp_path_factory.mktemp("rm")
    stories_model = no_dropout_copy(stories_model, work / "model")
    one = write_config(work / "one.yaml", rm_config(stories_model, work / "one"))
    run_plain_worker(one, env=worker_env(work / "one"), cwd=work)
    two_cfg = rm_config(stories_model, work / "two", per_device_train_batch_size=1, save_strategy="steps", save_steps=2)
    two = write_config(work / "two.yaml", two_cfg)
    run_ferry_train(
        two,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        env=worker_env(work / "two", FERRY_TEST_KILL_AT_STEP="3"),
        cwd=work,
        offline=True,
    )
    return {"one": work / "one" / "out", "two": work / "two" / "out", "work": work}


def test_reward_model_logs_trls_metrics_and_saves_llamafactorys_value_head(rm_runs):
    from safetensors import safe_open

    logged = rows(rm_runs["one"])
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert all(math.isfinite(r[k]) for k in REWARD_KEYS), r
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
    evals = [r for r in logged if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_pairs"] == 4 for r in evals)
    assert all(f"eval_{k}" in r for r in evals for k in REWARD_KEYS)
    report = json.loads((rm_runs["one"] / "train_report.json").read_text())
    assert report["stage"] == "rm" and report["num_train_samples"] == 12 and report["num_eval_samples"] == 4

    adapter = rm_runs["one"] / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    with safe_open(str(adapter / "value_head.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    hidden = json.loads((rm_runs["work"] / "model" / "config.json").read_text())["hidden_size"]
    assert shapes == {"v_head.summary.weight": (1, hidden), "v_head.summary.bias": (1,)}
    assert dtypes == {"F32"}
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert not any("v_head" in k for k in f.keys())  # the adapter file is peft's alone


def test_two_killed_ranks_resume_to_what_one_process_trains(rm_runs):
    """DDP over 2 gloo ranks (the value head inside the wrapped module), killed after step 3 and resumed from
    checkpoint-2 (its value_head.safetensors and optimizer state), equals one process: losses, metrics, eval and
    the saved value head."""
    from safetensors.torch import load_file

    report = json.loads((rm_runs["two"] / "train_report.json").read_text())
    assert report["resumed_from"] == str(rm_runs["two"] / "checkpoint-2") and report["world_size"] == 2

    one, two = rows(rm_runs["one"]), rows(rm_runs["two"])
    for a, b in zip([r for r in one if "loss" in r], [r for r in two if "loss" in r], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert b["accuracy"] == a["accuracy"]
    for a, b in zip([r for r in one if "eval_loss" in r], [r for r in two if "eval_loss" in r], strict=True):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4, abs=1e-5)
    h1 = load_file(str(rm_runs["one"] / "adapter" / "value_head.safetensors"))
    h2 = load_file(str(rm_runs["two"] / "adapter" / "value_head.safetensors"))
    torch.testing.assert_close(h2["v_head.summary.weight"], h1["v_head.summary.weight"], rtol=1e-4, atol=1e-5)
    # the bias cancels in r_chosen - r_rejected: its gradient is rounding noise, which AdamW turns into steps of
    # up to lr each, so only that bound holds between two world sizes
    bias_drift = (h2["v_head.summary.bias"] - h1["v_head.summary.bias"]).abs().item()
    assert bias_drift <= 4 * 1e-3 * 1.01
    assert (rm_runs["two"] / "checkpoint-2" / "value_head.safetensors").is_file()


def test_eval_equals_trls_reward_trainer(rm_runs, tmp_path):
    """trl's RewardTrainer evaluates the reward model ferry trained (its adapter merged into a
    ``LlamaForSequenceClassification`` whose ``score`` holds ferry's value-head weight: the bias cancels in the
    pairwise loss, and trl's head has none) on ferry's own tokenised eval pairs: loss, accuracy and margin equal
    the last eval row ferry logged."""
    from datasets import Dataset
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from trainer.config import load_config
    from trainer.data import load_tokenizer, prepare_data
    from trainer.preference_recipe import PairStore

    work = rm_runs["work"]
    cfg = load_config(work / "one.yaml")
    tokenizer = load_tokenizer(cfg)
    pairs = PairStore(prepare_data(cfg, tokenizer).eval)
    assert len(pairs) == 4
    # trl finds each row's last token as the last one that is not its pad token: pick a token no row holds
    unused = next(t for t in range(len(tokenizer)) if all(t not in r["input_ids"] for p in pairs for r in p))
    dataset = Dataset.from_list([{"chosen_ids": c["input_ids"], "rejected_ids": r["input_ids"]} for c, r in pairs])

    merged = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    merged = PeftModel.from_pretrained(merged, str(rm_runs["one"] / "adapter")).merge_and_unload()
    model = AutoModelForSequenceClassification.from_pretrained(str(work / "model"), num_labels=1)
    model.model.load_state_dict(merged.model.state_dict())  # the backbone, LoRA merged
    head = load_file(str(rm_runs["one"] / "adapter" / "value_head.safetensors"))
    with torch.no_grad():
        model.score.weight.copy_(head["v_head.summary.weight"])
    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_eval_batch_size=4,
        report_to="none",
        pad_token=tokenizer.convert_ids_to_tokens(unused),
        max_length=None,
        bf16=False,
        use_cpu=True,
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=dataset, eval_dataset=dataset, processing_class=tokenizer
    )
    theirs = trainer.evaluate()
    ours = [r for r in rows(rm_runs["one"]) if "eval_loss" in r][-1]
    assert theirs["eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-5, abs=1e-6)
    assert theirs["eval_accuracy"] == pytest.approx(ours["eval_accuracy"], abs=1e-6)
    assert theirs["eval_margin"] == pytest.approx(ours["eval_margin"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reward_model_exports_with_its_value_head_and_the_smoke_check_scores_a_pair(rm_runs, tmp_path, dtype):
    """``ferry export`` of the rm adapter: the value head is copied beside the merged weights byte for byte and
    listed in SHA256SUMS and ferry_export.json; the smoke check scores its pair with the merged model equal to
    base + adapter through peft (bfloat16: within the measured rounding noise)."""
    from exporter import ExportOptions
    from exporter.export import export
    from ferry.fsutil import sha256_file

    adapter = rm_runs["one"] / "adapter"
    out = tmp_path / "merged"
    report = export(adapter, out, ExportOptions(dtype=dtype, max_new_tokens=4, progress=False))
    assert (out / "value_head.safetensors").read_bytes() == (adapter / "value_head.safetensors").read_bytes()
    digest = sha256_file(out / "value_head.safetensors")
    assert f"{digest}  value_head.safetensors" in (out / "SHA256SUMS").read_text()
    assert json.loads((out / "ferry_export.json").read_text())["value_head"]["sha256"] == digest
    reward = report.smoke["reward"]
    assert math.isfinite(reward["chosen"]) and math.isfinite(reward["rejected"])
    assert reward["max_abs_diff"] <= reward["tolerance"]
    assert reward["chosen"] == pytest.approx(reward["reference_chosen"], abs=reward["tolerance"])
    assert json.loads((out / "smoke_report.json").read_text())["reward"] == reward


def test_a_value_head_of_the_wrong_shape_is_refused_naming_the_file(rm_runs, tmp_path):
    from safetensors.torch import save_file

    from exporter import ExportOptions
    from exporter.export import export
    from ferry.errors import ConfigError

    adapter = tmp_path / "adapter"
    shutil.copytree(rm_runs["one"] / "adapter", adapter)
    save_file(
        {"v_head.summary.weight": torch.zeros(1, 3), "v_head.summary.bias": torch.zeros(1)},
        adapter / "value_head.safetensors",
    )
    with pytest.raises(
        ConfigError, match=r"value_head\.safetensors: v_head\.summary\.weight should have shape \[1, 64\]"
    ):
        export(adapter, tmp_path / "merged", ExportOptions(max_new_tokens=2, progress=False))


def test_llamafactorys_reward_example_trains_unchanged_on_two_ranks_and_exports(stories_model, tmp_path):
    """LLaMA-Factory's train_lora/qwen3_lora_reward.yaml with only the model, data folder, output folder and sizes
    changed (its template must fit stories260K's tokenizer; fp32 on CPU) trains on 2 gloo ranks; its adapter and
    value head export and pass the smoke check."""
    from exporter import ExportOptions
    from exporter.export import export
    from tests.trainer.test_dpo import run_llamafactory_example

    run_llamafactory_example("qwen3_lora_reward.yaml", stories_model, tmp_path)
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert (report["stage"], report["world_size"], report["global_steps"]) == ("rm", 2, 2)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows(tmp_path / "out") if "loss" in r)
    exported = export(
        tmp_path / "out" / "adapter", tmp_path / "merged", ExportOptions(max_new_tokens=4, progress=False)
    )
    assert (
        exported.smoke["passed"] and exported.smoke["reward"]["max_abs_diff"] <= exported.smoke["reward"]["tolerance"]
    )


def test_a_run_that_continues_a_reward_adapter_starts_from_its_value_head(rm_runs, tmp_path):
    """adapter_name_or_path naming an rm adapter folder: its value_head.safetensors is the starting head (as
    LLaMA-Factory loads it), said in one line."""
    adapter = rm_runs["one"] / "adapter"
    cfg = rm_config(
        rm_runs["work"] / "model", tmp_path, adapter_name_or_path=str(adapter), max_steps=1, eval_strategy="no"
    )
    stderr = run_plain_worker(write_config(tmp_path / "continue.yaml", cfg), env=worker_env(tmp_path), cwd=tmp_path)
    assert f"ferry: value head: from {adapter / 'value_head.safetensors'}" in stderr
