"""trainer: LoRA fine-tuning with PyTorch DistributedDataParallel or FSDP2 under torchrun, fully offline.

Public API::

    TrainConfig, load_config(path, overrides)   trainer.config
    launch(cfg_path, overrides, ...)            trainer.launch (what `ferry train` calls)
    prepare_data(cfg, tokenizer)                trainer.data
    train(cfg) -> TrainReport                   trainer.stages (inside a torchrun worker, or 1 process)

The modules of a run, in the order it uses them::

    config        the keys, their defaults, limits and meaning (LLaMA-Factory's names)
    launch        ferry train: validate, tokenise once, start torchrun, wait
    data          dataset files -> tokenised examples (formats, templates, vocab)
    preference_data ranking (stage dpo, rm) and KTO datasets -> pair / feedback examples, as LLaMA-Factory's
                  processors
    vision, video image and video rows of vision-language models (pixels: the regularisation they share)
    stages        train(cfg): the recipe of cfg.stage
    recipe        FinetuneRecipe: the run, top to bottom (sft, pt)
      distributed   DistEnv: rank, device, process group
      modeling      base model + LoRA (fsdp, quant: sharded and 4-bit bases; targets: lora_target)
      batching      step plan, samplers, collate
      loss          IGNORE_INDEX, the summed token loss, the chunked head
      preference_loss PreferenceLossConfig, sequence_logps, the DPO family, KTO, reward-model losses
      checkpoint    checkpoint-STEP/ folders, resume
      metrics       metrics.jsonl, TensorBoard, progress, loss.png
    preference_recipe PreferenceRecipe: stage dpo, the same run on ranking pairs
    predict       do_predict: generated replies and their scores

``trainer.config`` and ``trainer.launch`` are light and imported here, so validating a config or starting
torchrun does not wait for torch; ``prepare_data``, ``train`` and ``TrainReport`` import torch on first use.
(``launch`` is bound after its module is imported, so ``trainer.launch`` is the function.)
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer.config import TrainConfig, load_config
from trainer.launch import LaunchReport, launch

_LAZY = {"prepare_data": "trainer.data", "train": "trainer.stages", "TrainReport": "trainer.recipe"}

__all__ = ["LaunchReport", "TrainConfig", "TrainReport", "launch", "load_config", "prepare_data", "train"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
