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
