"""A LoRA adapter with non-zero weights, for tests that need a tuned model different from its base."""

from __future__ import annotations

from pathlib import Path


def random_adapter(model_dir: Path, out: Path) -> Path:
    """Save a LoRA adapter on the model at ``model_dir`` into ``out``: peft's random B
    (``init_lora_weights=False``) scaled by 0.05, a mild change that moves every score a little."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    assert any(p.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)
    peft_model.save_pretrained(out)
    return out
