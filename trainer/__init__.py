"""trainer: LoRA fine-tuning with PyTorch DistributedDataParallel under torchrun, fully offline.

Public API::

    TrainConfig, load_config(path, overrides)   trainer.config
    prepare_data(cfg, tokenizer)                trainer.data
    train(cfg) -> TrainReport                   trainer.loop   (inside a torchrun worker, or 1 process)
    launch(cfg_path, overrides, ...)            trainer.launch (what `ferry train` calls)
"""

from __future__ import annotations

from trainer.config import TrainConfig, load_config
from trainer.data import prepare_data
from trainer.loop import TrainReport, train
from trainer.launch import LaunchReport, launch

__all__ = [
    "LaunchReport",
    "TrainConfig",
    "TrainReport",
    "launch",
    "load_config",
    "prepare_data",
    "train",
]
