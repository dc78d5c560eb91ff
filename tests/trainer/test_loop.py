"""The training loop end to end: a real 2-process torchrun (gloo) run of ``ferry train`` on the real stories260K
model and LLaMA-Factory's alpaca_en_demo, with no network at all (``unshare -rn``); plus the loop's pure pieces.
The run's helpers (``tiny_config``, ``run_ferry_train``, ...) live in :mod:`tests.support.helpers`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.helpers import (
    LORA_MODULES,
    run_ferry_train,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- pure pieces


def test_plan_steps_follows_the_global_batch():
    from trainer.batching import plan_steps
    from trainer.config import TrainConfig

    cfg = TrainConfig(
        model_name_or_path="m",
        dataset="d",
        output_dir="o",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_train_epochs=2.5,
    )
    plan = plan_steps(37, cfg, world_size=2)
    # 37 samples / 2 ranks -> 19 per rank (DistributedSampler pads) -> 10 micro-batches -> 4 steps (last has 1)
    assert (plan.micro_batches_per_epoch, plan.steps_per_epoch) == (10, 4)
    assert plan.total_steps == 10 and plan.num_epochs == 3  # ceil(2.5 * 4)
    assert plan.global_batch_size == 2 * 3 * 2
    cfg.max_steps = 7
    assert plan_steps(37, cfg, world_size=2).total_steps == 7


def test_lora_target_all_is_every_linear_but_the_head(stories_model):
    from transformers import AutoModelForCausalLM

    from trainer.modeling import find_all_linear_modules

    model = AutoModelForCausalLM.from_pretrained(stories_model)
    assert set(find_all_linear_modules(model)) == LORA_MODULES


def test_revision_is_the_snapshot_commit_when_the_model_comes_from_the_hf_cache(tmp_path):
    from trainer.modeling import resolved_revision

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    assert resolved_revision(snapshot, "main") == "0123abcd"
    assert resolved_revision(tmp_path / "plain-folder", None) is None
    assert resolved_revision(tmp_path / "plain-folder", "v1.0") == "v1.0"


def test_resumable_batch_sampler_skips_exactly_the_consumed_batches():
    from torch.utils.data import DistributedSampler

    from trainer.batching import ResumableBatchSampler

    sampler = DistributedSampler(range(23), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(4)
    batches = ResumableBatchSampler(sampler, batch_size=3)
    full = list(batches)
    assert len(full) == len(batches) == 4
    batches.skip = 2
    assert list(batches) == full[2:]
    assert list(batches) == full, "skip applies to one iteration only"


def test_batches_of_one_step_are_grouped_by_length_without_changing_the_step():
    """With gradient_accumulation_steps 3, each run of 3 micro-batches holds the same samples as without grouping,
    dealt out by length into batches of the same sizes (the epoch's last, short run too); the order of steps is
    the ungrouped one; skip (a resume at a step) lands on the same batches as the full iteration."""
    import random

    from torch.utils.data import DistributedSampler

    from trainer.batching import ResumableBatchSampler

    lengths = [random.Random(i).randint(5, 300) for i in range(41)]
    sampler = DistributedSampler(range(41), num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(1)
    plain = list(ResumableBatchSampler(sampler, batch_size=4))
    grouped_sampler = ResumableBatchSampler(sampler, batch_size=4, group=3, lengths=lengths)
    grouped = list(grouped_sampler)
    assert [len(b) for b in grouped] == [len(b) for b in plain] == [4, 4, 4, 4, 4, 1]
    for start in range(0, len(plain), 3):
        before, after = plain[start : start + 3], grouped[start : start + 3]
        assert sorted(i for b in after for i in b) == sorted(i for b in before for i in b)
        flat = [lengths[i] for b in after for i in b]
        assert flat == sorted(flat)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plain)
    assert sum(len(b) * max(lengths[i] for i in b) for b in grouped) < padded
    grouped_sampler.skip = 3
    assert list(grouped_sampler) == grouped[3:]


def test_shard_sampler_counts_every_eval_sample_once():
    from trainer.batching import ShardSampler

    shards = [list(ShardSampler(7, rank, 3)) for rank in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))


def test_summed_loss_over_global_token_count_is_the_mean_token_loss():
    from trainer.loss import causal_lm_loss_sum

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :3] = -100
    labels[2, 4] = -100
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    parts = causal_lm_loss_sum(logits[:1], labels[:1]) + causal_lm_loss_sum(logits[1:], labels[1:])
    n = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(parts / n, expected)


# ---------------------------------------------------------------------- the real run


@pytest.fixture(scope="module")
def offline_run(stories_model, llamafactory_data, tmp_path_factory):
    """One 2-process torchrun run of ``ferry train`` with no network: 24 train + 8 eval samples, 9 steps,
    eval every 3 steps, a checkpoint every 4 (save_total_limit 1), TensorBoard and plot_loss on."""
    work = tmp_path_factory.mktemp("loop")
    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        work,
        val_size=8,
        eval_steps=3,
        save_steps=4,
        save_total_limit=1,
        report_to="tensorboard",
        per_device_eval_batch_size=3,
        learning_rate=1e-2,
        plot_loss=True,
    )
    config = write_config(work / "config.yaml", cfg)
    proc = run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(work), cwd=work, offline=True)
    return work, Path(cfg["output_dir"]), proc


def test_offline_ddp_run_writes_every_output(offline_run):
    work, out, proc = offline_run
    assert "world size:          2" in proc.stdout
    report = json.loads((out / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["global_steps"] == 9 and report["global_batch_size"] == 4
    assert report["num_train_samples"] == 24 and report["num_eval_samples"] == 8
    assert report["tokens_seen"] > 0 and report["tokens_per_second"] > 0 and report["wall_time_s"] > 0
    assert report["data_stats"]["cache_hit"] is True  # the launcher tokenised; the workers only loaded the cache
    net = report["network"]  # the pre-flight all-reduce of both ranks
    assert len(net["bandwidth_per_rank"]) == 2 and net["slowest_bandwidth"] == min(net["bandwidth_per_rank"]) > 0
    assert net["iterations"] == 5  # timed after a full-size warm-up, the median reported
    assert report["fallbacks"] == [] and report["gpu_memory"] is None  # every start-up check passed; CPU
    for name in (
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "adapter/tokenizer.json",
        "adapter/tokenizer_config.json",
        "train_config.yaml",
        "metrics.jsonl",
        "loss.png",
    ):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-8"]  # save_total_limit 1
    assert list((out / "runs").rglob("events.out.tfevents.*")), "TensorBoard event file"
    resolved = yaml.safe_load((out / "train_config.yaml").read_text())
    assert resolved["lora_alpha"] == 16.0 and resolved["dataset"] == ["alpaca_en_demo"]

    adapter_cfg = json.loads((out / "adapter/adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(Path(resolved["model_name_or_path"]).resolve())
    assert adapter_cfg["revision"] is None  # a plain folder has no commit
    assert set(adapter_cfg["target_modules"]) == LORA_MODULES
    assert adapter_cfg["r"] == 8 and adapter_cfg["lora_alpha"] == 16

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6, 9]
    for r in evals:
        assert r["eval_perplexity"] == pytest.approx(torch.tensor(r["eval_loss"]).exp().item(), rel=1e-6)
    assert report["eval_loss_final"] == evals[-1]["eval_loss"]


def test_loss_falls_and_the_adapter_changes_the_model(offline_run, stories_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out, _ = offline_run
    report = json.loads((out / "train_report.json").read_text())
    assert report["eval_loss_final"] < report["eval_loss_first"]
    losses = train_losses(out)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3

    ids = torch.tensor([[1, 403, 261, 280, 370, 261, 407, 31, 2]])
    base = AutoModelForCausalLM.from_pretrained(stories_model)
    with torch.no_grad():
        before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, out / "adapter")
    with torch.no_grad():
        after = tuned(ids).logits
    assert (after - before).abs().max() > 1e-2


def test_a_finished_run_is_not_overwritten_by_accident(offline_run):
    work, out, _ = offline_run
    before = (out / "train_report.json").read_text()
    proc = run_ferry_train(work / "config.yaml", "--nproc-per-node", "1", env=worker_env(work), cwd=work, check=False)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ferry: error: ") and "finished run" in last and "overwrite_output_dir" in last
    assert (out / "train_report.json").read_text() == before


def test_plot_loss_draws_a_png_and_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """``plot_loss`` (off by default, as in LLaMA-Factory) draws loss.png from metrics.jsonl with matplotlib; where
    matplotlib cannot be imported the run says so in one line instead of failing at its very end."""
    from trainer.metrics import LOSS_PLOT, METRICS_FILE, MetricLogger

    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval_loss": 1.7}]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = MetricLogger(tmp_path)
    logger.finish()
    assert not (tmp_path / LOSS_PLOT).exists()  # the default: no plot
    logger.finish(plot_loss=True)
    assert (tmp_path / LOSS_PLOT).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / LOSS_PLOT).unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    logger.finish(plot_loss=True)
    assert not (tmp_path / LOSS_PLOT).exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ferry: plot_loss: matplotlib is not installed, so no {LOSS_PLOT} is drawn"]
