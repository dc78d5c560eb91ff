"""Fixtures for the exporter tests: real base models on disk and PEFT adapters built on them with peft itself.

Adapters get non-zero ``lora_B`` (``init_lora_weights=False``) and, for DoRA, a perturbed magnitude vector, so
that a merge is never trivially the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch


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
