"""The LoRA algebra as pure functions on tensors: no files, no modules, no peft objects.

Every formula is peft 0.21's (``peft/tuners/lora/layer.py`` and ``peft/tuners/lora/variants.py``), so that a
merge here equals ``PeftModel.merge_and_unload()``; ``tests/exporter/test_lora_math.py`` checks it layer by layer.

Shapes, for a layer mapping ``in_features`` to ``out_features`` with LoRA rank ``r``:

* ``lora_A``: ``[r, in_features]``; ``lora_B``: ``[out_features, r]`` (for an embedding: ``lora_embedding_A``
  ``[r, num_embeddings]``, ``lora_embedding_B`` ``[embedding_dim, r]``).
* the base weight ``W``: ``[out_features, in_features]`` for ``nn.Linear``; ``[in_features, out_features]`` for
  a *fan_in_fan_out* layer (GPT-2's ``Conv1D``); ``[num_embeddings, embedding_dim]`` for ``nn.Embedding``
  (peft treats an embedding as fan_in_fan_out, so the same transpose rule covers it).
* DoRA's magnitude vector ``m``: ``[out_features]`` (``[embedding_dim]`` for an embedding).

All arithmetic is done in float32 and the result is returned in float32; callers cast to the output dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from ferry.errors import ExportError


def lora_scaling(lora_alpha: float, r: int, *, use_rslora: bool = False) -> float:
    """The factor LoRA's update is multiplied by: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA
    (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732; peft ``LoraLayer.update_layer``).

    Raises:
        ExportError: ``r`` is not a positive integer.
    """
    if r <= 0:
        raise ExportError(f"LoRA rank r must be positive, got {r}")
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def pattern_value(patterns: Mapping[str, float], module_name: str, default: float) -> float:
    """The value of ``rank_pattern`` / ``alpha_pattern`` that applies to ``module_name``, else ``default``.

    Matching is peft's ``get_pattern_key``: a pattern key matches when the module name ends with it at a dot
    boundary, the key being a regular expression (``re.match(rf"(.*\\.)?({key})$", name)``); the first key in
    mapping order wins.
    """
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _t(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """peft's ``transpose``: ``weight.T`` when ``fan_in_fan_out`` else ``weight`` (2-D tensors only)."""
    return weight.T if fan_in_fan_out else weight


def lora_delta(
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """``ΔW = transpose(B @ A, fan_in_fan_out) · scaling`` in float32, laid out like the base weight.

    Args:
        lora_A: ``[r, in_features]``, any float dtype.
        lora_B: ``[out_features, r]``, any float dtype.
        scaling: from :func:`lora_scaling`.
        fan_in_fan_out: the base weight is stored ``[in_features, out_features]`` (GPT-2 ``Conv1D``, and every
            ``nn.Embedding``).

    Returns:
        float32 ``[out_features, in_features]`` (or its transpose with ``fan_in_fan_out``).

    Raises:
        ExportError: the ranks of A and B differ.
    """
    if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] != lora_B.shape[1]:
        raise ExportError(
            f"lora_A {tuple(lora_A.shape)} and lora_B {tuple(lora_B.shape)} do not form a rank-r product "
            f"(expected A [r, in] and B [out, r])"
        )
    return _t(lora_B.float() @ lora_A.float(), fan_in_fan_out) * scaling


def dora_weight_norm(weight: torch.Tensor, delta: torch.Tensor, *, fan_in_fan_out: bool = False) -> torch.Tensor:
    """DoRA's ``||W + ΔW||`` per output row (Liu et al. 2024, https://arxiv.org/abs/2402.09353, eq. 5; peft
    ``DoraLinearLayer.get_weight_norm``): the L2 norm over ``in_features`` of the ``[out, in]`` view, float32
    ``[out_features]``. ``delta`` already includes the scaling and has the base weight's layout."""
    combined = _t(weight.float(), fan_in_fan_out) + _t(delta, fan_in_fan_out)
    return torch.linalg.norm(combined, dim=1)


def merge_weight(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """The merged weight of one layer, float32, same shape as ``weight``.

    Plain LoRA: ``W + ΔW``. DoRA (``magnitude`` given): ``(m / ||W + ΔW||) · (W + ΔW)`` with the norm per output
    row, exactly peft's ``DoraLinearVariant.merge_safe`` / ``DoraEmbeddingVariant.merge_safe``.

    Args:
        weight: the base weight (see the module docstring for its layout), any float dtype.
        lora_A, lora_B, scaling, fan_in_fan_out: as in :func:`lora_delta`.
        magnitude: DoRA's ``lora_magnitude_vector``, ``[out_features]``, or None for plain LoRA.

    Raises:
        ExportError: the adapter's shapes do not fit ``weight``.
    """
    if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] != lora_B.shape[1]:
        lora_delta(lora_A, lora_B, scaling)  # raises the rank error
    expected = (lora_A.shape[1], lora_B.shape[0]) if fan_in_fan_out else (lora_B.shape[0], lora_A.shape[1])
    if tuple(weight.shape) != expected:
        raise ExportError(
            f"adapter update has shape {expected} but the base weight is {tuple(weight.shape)}"
            + (" (fan_in_fan_out layer)" if fan_in_fan_out else "")
        )
    base = weight.float()
    if magnitude is None:
        # W + scaling · (B @ A) in one fused BLAS call: no separate ΔW tensor of the weight's size
        A, B = lora_A.float(), lora_B.float()
        left, right = (A.T, B.T) if fan_in_fan_out else (B, A)
        if base is weight:  # float32 input: leave the caller's tensor as it is
            return torch.addmm(base, left, right, alpha=scaling)
        return base.addmm_(left, right, alpha=scaling)  # a fresh float32 copy: update it in place
    delta = lora_delta(lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
    out_features = delta.shape[1] if fan_in_fan_out else delta.shape[0]
    if magnitude.numel() != out_features:
        raise ExportError(
            f"DoRA magnitude vector has {magnitude.numel()} entries but the layer has {out_features} output features"
        )
    norm = dora_weight_norm(base, delta, fan_in_fan_out=fan_in_fan_out)
    factor = magnitude.float().reshape(-1) / norm
    factor = factor.view(1, -1) if fan_in_fan_out else factor.view(-1, 1)
    return factor * (base + delta)


def merge_bias(bias: torch.Tensor, lora_B_bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """``lora_bias=True``: the merged bias ``b + scaling · b_B`` in float32, ``[out_features]`` (peft
    ``Linear.merge``).

    Raises:
        ExportError: the shapes differ.
    """
    if tuple(bias.shape) != tuple(lora_B_bias.shape):
        raise ExportError(f"lora_B bias {tuple(lora_B_bias.shape)} does not fit the base bias {tuple(bias.shape)}")
    return bias.float() + lora_B_bias.float() * scaling


def fused_expert_delta(
    lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, num_experts: int, *, out_first: bool = True
) -> torch.Tensor:
    """The update of a fused 3-D expert parameter from peft's ``target_parameters`` LoRA (peft 0.21
    ``ParamWrapper.get_delta_weight``), float32.

    Args:
        lora_A: ``[r · E, in_features]``; viewed as ``[E, r, in]``.
        lora_B: ``[out_features, r · E]``; viewed as ``[out, r, E]`` (peft's layout: expert index fastest).
        scaling: from :func:`lora_scaling`.
        num_experts: E.
        out_first: the parameter is ``[E, out, in]`` (transformers' ``gate_up_proj`` / ``down_proj``); else
            ``[E, in, out]``.

    Returns:
        float32 ``[E, out, in]`` (``out_first``) or ``[E, in, out]``, ``ΔW_e = scaling · B_e @ A_e``.

    Raises:
        ExportError: A and B do not split into ``num_experts`` rank-r blocks.
    """
    if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] != lora_B.shape[1] or lora_A.shape[0] % num_experts:
        raise ExportError(
            f"fused-expert LoRA A {tuple(lora_A.shape)} / B {tuple(lora_B.shape)} do not split into "
            f"{num_experts} experts"
        )
    A = lora_A.float().reshape(num_experts, -1, lora_A.shape[-1])
    B = lora_B.float().reshape(lora_B.shape[0], -1, num_experts)
    return torch.einsum("ore,eri->eoi" if out_first else "ore,eri->eio", B, A).mul_(scaling)  # in place: one copy
