"""What a run reports about its GPUs and fallbacks: ``train_report.json``'s ``fallbacks`` (every feature the run
trains without, with the reason) and ``gpu_memory`` (peak bytes per rank, null on CPU), both in the run's summary
lines; and the CUDA allocator setting the workers start with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.helpers import tiny_config
from trainer.launch import ALLOC_CONF, ALLOC_CONF_ENV, LaunchReport, _worker_env


@pytest.fixture(scope="module")
def forced_run(stories_model, llamafactory_data, tmp_path_factory) -> Path:
    """One plain-process run (no torchrun, 2 steps) whose two start-up checks are made to fail: the chunked loss's
    probe (trainer.loss.chunked_loss_ok) and the one-row probe (padding_free: auto), as a false failure on a GPU
    would; the run trains on with the whole logits and padded rows."""
    from trainer.config import TrainConfig
    from trainer.modeling import OneRowProbe

    work = tmp_path_factory.mktemp("forced")
    saved = dict(os.environ)
    patch = pytest.MonkeyPatch()
    patch.setattr("trainer.loss.chunked_loss_ok", lambda *args, **kwargs: "forced failure")
    patch.setattr(
        "trainer.recipe.samples_stay_apart_in_one_row",
        lambda *args: OneRowProbe(False, diff=1.0, noise=0.0, bound=0.5, dtype="float32"),
    )
    try:
        from trainer.recipe import train

        cfg = tiny_config(stories_model, llamafactory_data, work, max_samples=8, max_steps=2, padding_free="auto")
        train(TrainConfig(**cfg))
    finally:
        patch.undo()
        os.environ.clear()
        os.environ.update(saved)
    return work / "out"


def test_forced_fallbacks_are_in_the_report_and_the_summary_lines(forced_run):
    report = json.loads((forced_run / "train_report.json").read_text())
    assert report["fallbacks"] == [
        {
            "feature": "padding_free",
            "reason": "the one-row probe moved a sample's logits by 1 when it followed another sample in one row "
            "(bound 0.5 in float32, the kernels' own noise 0); padded rows instead",
        },
        {"feature": "chunked_loss", "reason": "forced failure; computing the whole logits"},
    ]
    assert report["gpu_memory"] is None  # CPU: no GPU memory to report
    assert report["global_steps"] == 2 and report["train_loss_final"] > 0

    from trainer.recipe import FALLBACK_FEATURES, TrainReport

    assert {f["feature"] for f in report["fallbacks"]} <= set(FALLBACK_FEATURES)
    line = TrainReport(**report).summary_line()
    assert "\n" not in line and line.endswith("; fallbacks: padding_free, chunked_loss (see train_report.json)")
    launched = _launch_report(report)
    assert "fallback:            chunked_loss: forced failure; computing the whole logits" in launched.splitlines()
    assert "gpu memory" not in launched


def _launch_report(train_report: dict) -> str:
    return LaunchReport(
        config={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "dataset": ["d"]},
        world_size=2,
        nproc_per_node=2,
        nnodes=1,
        global_batch_size=4,
        steps_per_epoch=2,
        total_steps=2,
        num_train_samples=8,
        num_eval_samples=0,
        num_dropped_samples=0,
        tokens_per_step=100.0,
        trainable_params=1,
        total_params=2,
        command=[],
        dry_run=False,
        train_report=train_report,
    ).summary()


def test_peak_gpu_memory_per_rank_shows_the_largest_rank(forced_run):
    """On CUDA each rank's peaks (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) are gathered into
    the report; the summary lines name the rank with the largest reserved peak."""
    from trainer.recipe import TrainReport

    report = json.loads((forced_run / "train_report.json").read_text())
    report["gpu_memory"] = {
        "peak_allocated_bytes": [10 * 2**30, 12 * 2**30],
        "peak_reserved_bytes": [11 * 2**30, 14 * 2**30],
    }
    expected = "peak GPU memory 12.0 GiB allocated, 14.0 GiB reserved (rank 1)"
    assert f"gpu memory:          {expected}" in _launch_report(report).splitlines()
    assert f"; {expected};" in TrainReport(**report).summary_line()


def test_workers_get_expandable_segments_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    gate = tmp_path / "gate"
    assert ALLOC_CONF == "expandable_segments:True" and _worker_env(None, 2, gate)[ALLOC_CONF_ENV] == ALLOC_CONF
    assert _worker_env({ALLOC_CONF_ENV: "max_split_size_mb:128"}, 2, gate)[ALLOC_CONF_ENV] == "max_split_size_mb:128"
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:False")
    assert _worker_env(None, 2, gate)[ALLOC_CONF_ENV] == "expandable_segments:False"
    monkeypatch.delenv(ALLOC_CONF_ENV)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")  # torch's newer name wins: leave it alone
    assert ALLOC_CONF_ENV not in _worker_env(None, 2, gate)
