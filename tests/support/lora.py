"""A LoRA adapter with non-zero weights, for tests that need a tuned model different from its base."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.helpers import make_adapter


def random_adapter(model_dir: Path, out: Path) -> Path:
    """Save into ``out`` a LoRA adapter (r 8, alpha 32, q/v/o) on the model at ``model_dir``: peft's random B
    (:func:`tests.support.helpers.make_adapter`, seed 0) scaled by 0.05, a mild change that moves every score a
    little."""
    peft_model = make_adapter(model_dir, out, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"])
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    assert any(p.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)
    peft_model.save_pretrained(out)
    return out
