"""Fixtures for the exporter tests: real base models on disk and PEFT adapters built on them with peft itself.

Adapters get non-zero ``lora_B`` (``init_lora_weights=False``) and, for DoRA, a perturbed magnitude vector, so
that a merge is never trivially the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]  # attention (c_attn, attn.c_proj) and MLP (c_fc, mlp.c_proj)


def make_adapter(base_dir: Path, out_dir: Path, *, seed: int = 0, **lora_kwargs):
    """Build a LoRA adapter on ``base_dir`` with peft, save it to ``out_dir`` and return the in-memory
    PeftModel (float32, CPU) for reference computations."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.1 * torch.randn_like(param))
    peft_model.save_pretrained(out_dir)
    return peft_model


def merged_reference(peft_model) -> dict[str, torch.Tensor]:
    """peft's own merge of ``peft_model`` (a deep copy is merged; the argument stays usable)."""
    import copy

    return {k: v.detach().clone() for k, v in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}


@pytest.fixture()
def stories_copy(stories_model: Path, tmp_path: Path) -> Path:
    """A writable copy of the real stories260K model."""
    dest = tmp_path / "stories260K"
    shutil.copytree(stories_model, dest)
    for path in dest.rglob("*"):
        path.chmod(0o644)
    dest.chmod(0o755)
    return dest


@pytest.fixture(scope="session")
def gpt2_model(tmp_path_factory) -> Path:
    """A tiny random-init GPT-2 (Conv1D layers, i.e. fan_in_fan_out; tied embeddings) saved as safetensors."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    out = tmp_path_factory.mktemp("gpt2") / "tiny-gpt2"
    model.save_pretrained(out)
    return out
