"""``stage: kto`` end to end: LLaMA-Factory's kto_en_demo (from its pinned sdist) on the real stories260K model.

The loss itself is checked against trl's KTOTrainer in test_preference_loss.py and the tokenised rows (judged and
KL) against LLaMA-Factory in test_preference_data.py; here: the loop that joins them, one process against 2 gloo
ranks, LLaMA-Factory's own example, and the export of the adapter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import adapter_tensors, run_ferry_train, run_plain_worker, worker_env, write_config
from tests.trainer.test_dpo import dpo_config, rows

pytestmark = pytest.mark.budget(90, reason="LLaMA-Factory's kto example trained on 2 ranks and exported")

KTO_KEYS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins")


def kto_config(stories_model: Path, work: Path, **overrides: Any) -> dict[str, Any]:
    """16 rows of LLaMA-Factory's kto_en_demo cut to 128 tokens, 4 held out; LoRA r8 on every linear; 4 steps of
    4 samples, eval every 2."""
    cfg = dpo_config(stories_model, work, stage="kto", dataset="kto_en_demo", per_device_train_batch_size=4)
    cfg.update(gradient_accumulation_steps=1)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def kto_runs(stories_model: Path, tmp_path_factory) -> dict[str, Path]:
    """The same 4 steps twice: one plain process (batch 4), and ``ferry train`` on 2 gloo ranks under FSDP2
    full_shard (batch 2 each: the same 4 samples per step, and the KL, averaged over the ranks, the same mean) with
    no network. (DDP runs in LLaMA-Factory's example below.)"""
    work = tmp_path_factory.mktemp("kto")
    one = write_config(work / "one.yaml", kto_config(stories_model, work / "one"))
    run_plain_worker(one, env=worker_env(work / "one"), cwd=work)
    two = write_config(
        work / "two.yaml", kto_config(stories_model, work / "two", per_device_train_batch_size=2, fsdp="full_shard")
    )
    run_ferry_train(two, "--nproc-per-node", "2", env=worker_env(work / "two"), cwd=work, offline=True)
    return {"one": work / "one" / "out", "two": work / "two" / "out"}


def test_the_first_step_is_one_half_and_every_kto_metric_is_logged(kto_runs):
    """At step 1 the LoRA B matrices are zero: the policy is its reference, every log-ratio and the KL are 0, so
    each sample costs 1 - sigmoid(0) = 0.5 (weights 1)."""
    logged = rows(kto_runs["one"])
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert train[0]["kl"] == 0.0 and train[0]["rewards/chosen"] == 0.0
    for r in train:
        assert all(math.isfinite(r[k]) for k in KTO_KEYS if k in r), r
        assert r["kl"] >= 0.0
    assert any(r["loss"] != 0.5 for r in train[1:])
    evals = [r for r in logged if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_pairs"] == 4 for r in evals)
    report = json.loads((kto_runs["one"] / "train_report.json").read_text())
    assert report["stage"] == "kto" and report["num_train_samples"] == 12 and report["num_eval_samples"] == 4


def test_two_fsdp_ranks_train_what_one_process_trains(kto_runs):
    """2 gloo ranks under FSDP2 (the KL all-reduced over them) equal one process: losses, KL and the adapter (within
    test_ddp.py's bounds: the batches pad to other lengths, so the sums round differently)."""
    from tests.support.helpers import assert_same_adapter

    one = [r for r in rows(kto_runs["one"]) if "loss" in r]
    two = [r for r in rows(kto_runs["two"]) if "loss" in r]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-7)
    assert [r["kl"] for r in two] == pytest.approx([r["kl"] for r in one], rel=1e-4, abs=1e-7)
    # After 4 steps lora_B is small (a few lr), so AdamW's amplified rounding noise on ~0 gradients weighs more in
    # its relative norm than after test_ddp's 12 steps: measured on a Xeon with AMX (2026-11-28) 1.8e-4 relative
    # Frobenius on two tensors, 1.1e-5 absolute (1% of lr), with the losses equal to 1e-6.
    assert_same_adapter(
        adapter_tensors(kto_runs["two"] / "adapter"),
        adapter_tensors(kto_runs["one"] / "adapter"),
        rel_frobenius=5e-4,
        max_abs=1e-4,
    )


def test_precomputed_reference_log_probabilities_train_what_the_live_reference_trains(
    kto_runs, stories_model, tmp_path
):
    """``precompute_ref_log_probs`` with ``ref_model`` (the base folder): the reference's log-probabilities of every
    judged and KL row are computed once and the model freed; losses, KL, eval and the adapter equal the plain run's,
    whose reference (the disabled adapter) runs on both kinds of rows at every step."""
    from tests.support.helpers import assert_same_adapter

    cfg = kto_config(stories_model, tmp_path, ref_model=str(stories_model), precompute_ref_log_probs=True)
    stderr = run_plain_worker(write_config(tmp_path / "pre.yaml", cfg), env=worker_env(tmp_path), cwd=tmp_path)
    assert "reference log-probabilities of 16 pairs precomputed" in stderr and "ref_model freed" in stderr
    got, want = rows(tmp_path / "out"), rows(kto_runs["one"])
    for key in ("loss", "kl", "eval_loss", "eval_kl"):
        assert [r[key] for r in got if key in r] == pytest.approx(
            [r[key] for r in want if key in r], rel=1e-5, abs=1e-7
        ), key
    assert_same_adapter(
        adapter_tensors(tmp_path / "out" / "adapter"),
        adapter_tensors(kto_runs["one"] / "adapter"),
        rel_frobenius=1e-5,
        max_abs=1e-5,
    )


def test_llamafactorys_kto_example_trains_unchanged_on_two_ranks_and_exports(stories_model, tmp_path):
    """LLaMA-Factory's train_lora/qwen3_lora_kto.yaml trains unchanged on 2 gloo ranks
    (:func:`tests.trainer.test_dpo.run_llamafactory_example`); its adapter exports and passes the smoke check."""
    from exporter import ExportOptions
    from exporter.export import export
    from tests.trainer.test_dpo import run_llamafactory_example

    out = run_llamafactory_example("qwen3_lora_kto.yaml", stories_model, tmp_path)
    report = json.loads((out / "train_report.json").read_text())
    assert (report["stage"], report["world_size"], report["global_steps"]) == ("kto", 2, 2)
    first = [r for r in rows(out) if "loss" in r][0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)
    exported = export(out / "adapter", tmp_path / "merged", ExportOptions(max_new_tokens=4, progress=False))
    assert exported.smoke["passed"] and exported.smoke["logits_match"]


def test_kto_refuses_a_dpo_loss_in_one_line(tmp_path, stories_model):
    from ferry.errors import ConfigError
    from trainer.config import load_config

    config = write_config(tmp_path / "kto.yaml", kto_config(stories_model, tmp_path, pref_loss="orpo"))
    with pytest.raises(ConfigError, match="pref_loss: applies to stage dpo") as err:
        load_config(config)
    assert "\n" not in str(err.value)
