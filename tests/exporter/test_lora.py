"""The LoRA algebra on bare tensors: scaling rules, pattern matching as peft's, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from peft.utils.other import get_pattern_key

from exporter.lora import lora_scaling, merge_weight, pattern_value
from ferry.errors import ExportError


def test_scaling_plain_and_rslora():
    assert lora_scaling(16, 8) == 2.0
    assert lora_scaling(16, 8, use_rslora=True) == pytest.approx(16 / math.sqrt(8))
    with pytest.raises(ExportError, match="rank r must be positive"):
        lora_scaling(16, 0)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj",
        "model.layers.10.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "transformer.h.0.attn.c_proj",
        "model.layers.0.self_attn.v_proj",
    ],
)
def test_pattern_matching_is_peft_s(name):
    patterns = {r"layers\.0\.self_attn\.q_proj": 6, "down_proj": 2, "c_proj": 3}
    key = get_pattern_key(list(patterns), name)
    assert pattern_value(patterns, name, default=4) == patterns.get(key, 4)


def test_fan_in_fan_out_is_the_transpose():
    torch.manual_seed(0)
    W, A, B = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    plain = merge_weight(W, A, B, 0.5)
    conv1d = merge_weight(W.T.contiguous(), A, B, 0.5, fan_in_fan_out=True)
    assert torch.allclose(plain, W + 0.5 * B @ A, atol=1e-6) and torch.allclose(conv1d, plain.T, atol=1e-6)
    # DoRA with m equal to the row norms of W + ΔW is plain LoRA
    m = torch.linalg.norm(W + 0.5 * B @ A, dim=1)
    assert torch.allclose(merge_weight(W, A, B, 0.5, magnitude=m), plain, atol=1e-5)
    assert torch.allclose(merge_weight(W, A, B, 0.5, magnitude=2 * m), 2 * plain, atol=1e-5)


def test_shape_errors():
    W, A, B = torch.zeros(6, 5), torch.zeros(2, 5), torch.zeros(6, 2)
    with pytest.raises(ExportError, match="do not form a rank-r product"):
        merge_weight(W, A, torch.zeros(6, 3), 1.0)
    with pytest.raises(ExportError, match=r"adapter update has shape \(6, 5\) but the base weight is \(5, 6\)"):
        merge_weight(W.T, A, B, 1.0)
    with pytest.raises(ExportError, match="DoRA magnitude vector has 5 entries"):
        merge_weight(W, A, B, 1.0, magnitude=torch.ones(5))
