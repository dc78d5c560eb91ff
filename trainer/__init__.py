"""trainer: LoRA fine-tuning with PyTorch DistributedDataParallel under torchrun, fully offline.

Public API::

    TrainConfig, load_config(path, overrides)   trainer.config
    launch(cfg_path, overrides, ...)            trainer.launch (what `ferry train` calls)
    prepare_data(cfg, tokenizer)                trainer.data
    train(cfg) -> TrainReport                   trainer.loop   (inside a torchrun worker, or 1 process)

``trainer.config`` and ``trainer.launch`` are light and imported here, so validating a config or starting
torchrun does not wait for torch; ``prepare_data``, ``train`` and ``TrainReport`` import torch on first use.
(``launch`` is bound after its module is imported, so ``trainer.launch`` is the function.)
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer.config import TrainConfig, load_config
from trainer.launch import LaunchReport, launch

_LAZY = {"prepare_data": "trainer.data", "train": "trainer.loop", "TrainReport": "trainer.loop"}

__all__ = ["LaunchReport", "TrainConfig", "TrainReport", "launch", "load_config", "prepare_data", "train"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
