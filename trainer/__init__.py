"""trainer: LoRA fine-tuning with PyTorch DistributedDataParallel under torchrun, fully offline.

Public API (imported lazily so that ``import trainer`` costs nothing before torch is needed)::

    TrainConfig, load_config(path, overrides)   trainer.config
    prepare_data(cfg, tokenizer)                trainer.data
    train(cfg) -> TrainReport                   trainer.loop   (inside a torchrun worker, or 1 process)
    launch(cfg_path, overrides, ...)            trainer.launch (what `ferry train` calls)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "trainer.config",
    "load_config": "trainer.config",
    "prepare_data": "trainer.data",
    "train": "trainer.loop",
    "TrainReport": "trainer.loop",
    "launch": "trainer.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
