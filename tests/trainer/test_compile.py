"""``torch_compile``: every decoder layer compiled (regional compilation), one graph for all of them, training what
the eager run trains; refused with fsdp in one line.

The compiled run is the eager one-process run of tests/trainer/conftest.py (``plain_4``: 12 steps of 4 samples,
gradient checkpointing on) with ``torch_compile`` added. Its backend is ``aot_eager``: dynamo captures each layer
and AOTAutograd builds its forward and backward graphs, which run torch's own kernels, so the numbers must be the
eager run's; inductor's generated kernels are the GPU check's to time (they round differently)."""

from __future__ import annotations

import json

import pytest

from ferry.errors import ConfigError
from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_plain_worker,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)


def test_compiled_layers_train_what_eager_trains_with_one_graph(
    equivalence_run, stories_model, llamafactory_data, tmp_path
):
    eager = equivalence_run("plain_4")
    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        tmp_path,
        per_device_train_batch_size=4,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    run_plain_worker(write_config(tmp_path / "c.yaml", cfg), env=worker_env(tmp_path), cwd=tmp_path)
    out = tmp_path / "out"
    losses, reference = train_losses(out), train_losses(eager)
    assert len(losses) == 12 and losses == pytest.approx(reference, rel=1e-5)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(eager / "adapter"), rel_frobenius=1e-4, max_abs=1e-4
    )
    report = json.loads((out / "train_report.json").read_text())
    compiled = report["torch_compile"]
    # stories260K has 5 decoder layers; they share one compiled graph (a second only if dynamo had to recompile)
    assert compiled["backend"] == "aot_eager" and compiled["layers"] == 5, compiled
    assert 1 <= compiled["graphs"] <= 2, compiled
    assert report["checkpointed_layers"] == 5 and report["fallbacks"] == []
    assert json.loads((eager / "train_report.json").read_text())["torch_compile"] is None


def test_torch_compile_with_fsdp_is_refused_in_one_line(tmp_path):
    from trainer.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: m\ndataset: d\noutput_dir: o\ntorch_compile: true\nfsdp: full_shard\n")
    with pytest.raises(ConfigError, match="torch_compile is not supported with fsdp") as info:
        load_config(config)
    assert "\n" not in str(info.value)
