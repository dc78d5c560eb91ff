"""Fixtures of the trainer tests: a config factory on the real stories260K model and LLaMA-Factory demo data,
and the model's tokenizer loaded the way the trainer loads it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainer.config import TrainConfig


@pytest.fixture
def make_cfg(stories_model: Path, llamafactory_data: Path, tmp_path: Path) -> Callable[..., TrainConfig]:
    """``make_cfg(**keys)``: a TrainConfig on stories260K with dataset_dir = the demo data, output and
    tokenised cache under tmp_path (so no test shares a cache entry with another)."""

    def factory(**keys: Any) -> TrainConfig:
        base: dict[str, Any] = {
            "model_name_or_path": str(stories_model),
            "dataset": "alpaca_en_demo",
            "dataset_dir": str(llamafactory_data),
            "output_dir": str(tmp_path / "out"),
            "tokenized_path": str(tmp_path / "tokenized"),
            "cutoff_len": 256,
        }
        base.update(keys)
        return TrainConfig(**base)

    return factory


@pytest.fixture(scope="session")
def stories_tokenizer(stories_model: Path):
    """The stories260K tokenizer via trainer.data.load_tokenizer (no pad token upstream; pad = eos here)."""
    from trainer.data import load_tokenizer

    cfg = TrainConfig(model_name_or_path=str(stories_model), dataset="unused", output_dir="unused")
    return load_tokenizer(cfg)


#: The equivalence runs several test files assert on (test_ddp.py, test_fsdp.py, test_multinode.py): the same tiny
#: config (tests.support.helpers.tiny_config) with the global batch of 4 split differently. name -> (processes,
#: per_device_train_batch_size, gradient_accumulation_steps, extra keys); 1 process is ``python -m trainer``.
EQUIVALENCE_SHAPES: dict[str, tuple[int, int, int, dict[str, Any]]] = {
    "ddp_2x2": (2, 2, 1, {}),  # torchrun, 2 processes x batch 2 (DDP, static_graph)
    "ddp_2x1x2": (2, 1, 2, {}),  # torchrun, 2 processes x batch 1 x accumulation 2 (no_sync on the first)
    "plain_4": (1, 4, 1, {}),  # one plain process x batch 4 (no process group)
    "plain_2x2": (1, 2, 2, {}),  # one plain process x batch 2 x accumulation 2
    # FSDP2 over the same split as ddp_2x1x2, with activation checkpointing (recomputation must not change numbers)
    "fsdp_2x1x2": (
        2,
        1,
        2,
        {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_activation_checkpointing": True}},
    ),
}


@pytest.fixture(scope="session")
def equivalence_run(stories_model: Path, llamafactory_data: Path, tmp_path_factory) -> Callable[[str], Path]:
    """``equivalence_run(name) -> output_dir``: the run ``name`` of :data:`EQUIVALENCE_SHAPES`, trained on first
    use and shared by every test that asks (the files that ask share one xdist worker: SHARED_WORKER in
    tests/support/suite.py)."""
    from tests.support.helpers import run_ferry_train, run_plain_worker, tiny_config, worker_env, write_config

    work = tmp_path_factory.mktemp("equivalence")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nproc, batch, accum, extra = EQUIVALENCE_SHAPES[name]
            cfg = tiny_config(
                stories_model,
                llamafactory_data,
                work,
                output_dir=str(work / name),
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum,
                **extra,
            )
            config = write_config(work / f"{name}.yaml", cfg)
            if nproc > 1:
                run_ferry_train(config, "--nproc-per-node", str(nproc), env=worker_env(work), cwd=work)
            else:
                run_plain_worker(config, env=worker_env(work), cwd=work)
            done[name] = work / name
        return done[name]

    return get
