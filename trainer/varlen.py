"""Padding-free rows without the flash-attn package: an attention function over torch's own varlen kernel.

A padding-free micro-batch is one row ``[1, total_tokens]`` of its samples laid end to end, the position ids
restarting at each sample. Attention must stay inside each sample. transformers' ``sdpa`` gets that only through a
``[1, 1, T, T]`` block-diagonal mask built from the position ids (a device sync per forward, and cuDNN's masked
kernel ran 2.4x slower than padded rows on an H200); the flash-attn package splits the row natively but is a
CUDA build a target often lacks. PyTorch 2.10 and later carry the same flash kernel as
``torch.nn.attention.varlen.varlen_attn``, which takes the samples' boundaries as ``cu_seq_lens`` (cumulative
lengths ``[n_samples + 1]`` int32) and the longest sample as a host integer.

:func:`varlen_attention_forward` is that kernel behind transformers' attention interface (``AttentionInterface``,
registered as :data:`ATTENTION_NAME` by :func:`use_varlen`). The collate
(:func:`trainer.batching.collate_with_token_count` with ``cu_seq_lens``) ships the boundaries with the batch as
transformers' own flattening collator names them (``cu_seq_lens_q/k``, ``max_length_q/k``), so no step looks for
them on the device. transformers builds no mask for a registered attention of its own, so nothing else is spent.

On CPU, or where the batch carries no boundaries (the start-up probes), the same function computes the reference:
``sdpa`` with ``is_causal`` over each sample separately, which the packed path must equal (tests compare both with
padded rows, loss and every gradient). ``flash_attn: varlen`` asks for this function on any device;
``padding_free: auto`` picks it on CUDA when torch has the kernel (:func:`varlen_unavailable` says why not).
It serves training forwards only: it takes no attention mask and no KV cache, and refuses a query shorter than its
keys; ferry's generation (``do_predict``, export, chat) loads its own model with transformers' default attention.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from ferry.errors import TrainingError

#: The name the attention function is registered under (``model.config._attn_implementation``).
ATTENTION_NAME = "ferry_varlen"


@functools.cache
def _kernel() -> tuple[Any, dict[str, Any]] | None:
    """torch's ``varlen_attn`` and the keywords this torch takes (causal: 2.10 ``is_causal=True``, later
    ``window_size=(-1, 0)``; ``enable_gqa`` where the signature has it, else ``"repeat_kv"`` set: K/V heads are
    repeated for the query groups), or None when this torch has no such kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        keywords: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        keywords = {"is_causal": True}
    else:
        return None
    keywords["enable_gqa" if "enable_gqa" in params else "repeat_kv"] = True
    return varlen_attn, keywords


def varlen_unavailable(device: torch.device, dtype: torch.dtype, config: Any) -> str | None:
    """Why torch's varlen kernel cannot run ``config``'s attention on ``device`` in compute dtype ``dtype`` (one
    line), or None when it can.

    Needs CUDA, a torch with ``torch.nn.attention.varlen`` (2.10+), bf16 or fp16 compute (the flash kernel has no
    fp32 path) and causal full attention in every layer (:func:`unsupported_attention`).
    """
    if device.type != "cuda":
        return "torch's varlen attention runs on CUDA only"
    if _kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or later)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the flash kernel computes in bf16 or fp16, this run in {str(dtype).removeprefix('torch.')}"
    return unsupported_attention(config)


def unsupported_attention(config: Any) -> str | None:
    """What in ``config`` (a transformers ``PretrainedConfig``) the varlen function does not compute, or None:
    sliding-window or chunked layers, logit soft-capping, attention dropout, non-causal attention."""
    text = getattr(config, "get_text_config", lambda: config)()
    layer_types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if layer_types:  # the layers say which attend through a window (Gemma 2/3, Qwen2 with use_sliding_window)
        other = set(layer_types) - {"full_attention"}
        if other:
            return f"{text.model_type} has {', '.join(sorted(other))} layers"
    elif window and getattr(text, "use_sliding_window", True):  # Mistral, Phi-3: a window in every layer
        return f"{text.model_type} uses a sliding window of {window} tokens"
    if getattr(text, "attn_logit_softcapping", None):
        return f"{text.model_type} soft-caps its attention logits"
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention_dropout {text.attention_dropout} (the kernel has no dropout)"
    if getattr(text, "is_causal", True) is False:
        return f"{text.model_type} attends bidirectionally"
    return None


def cu_seq_lens_of(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sample boundaries of packed rows from their position ids ``[batch, seq_len]`` (a new sample wherever the
    ids do not increase by one, and at each row's start): ``(cu_seq_lens [n + 1] int32, longest sample)`` over the
    flattened rows. Reads the ids on the host (one device sync): for probes and tests, not for steps."""
    ids = position_ids.detach().to("cpu", torch.int64)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1] + 1
    flat = starts.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([flat, torch.tensor([ids.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


#: This torch's kernel and keywords, looked up once at import: the attention function reads the constant (a cached
#: call inside a ``torch.compile``-d layer would break its graph).
_KERNEL = _kernel()


def _device_kernel(query: torch.Tensor) -> tuple[Any, dict[str, Any]] | None:
    """The varlen kernel for ``query``'s device (and its keywords), or None: the reference computes."""
    return _KERNEL if query.is_cuda else None


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``sdpa`` with ``is_causal`` over each sample of ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``; returns
    ``[T, Hq, D]``."""
    bounds = cu.tolist()
    gqa = q.size(1) != k.size(1)
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
    return torch.cat(parts, dim=1).transpose(0, 1)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention kept within each sample of packed rows (transformers' attention-interface signature).

    Args:
        module: the attention layer (``num_key_value_groups`` tells GQA).
        query: ``[batch, heads, seq_len, head_dim]``; ``key``/``value``: ``[batch, kv_heads, seq_len, head_dim]``.
        attention_mask: must be None (transformers builds none for this function).
        dropout: must be 0 (the kernel has none; :func:`unsupported_attention` refuses such models up front).
        scaling: the softmax scale (``head_dim ** -0.5`` when None).
        kwargs: ``cu_seq_lens_q`` ``[n + 1]`` int32 and ``max_length_q`` (int) from the collate; else
            ``position_ids`` ``[batch, seq_len]`` (boundaries read on the host), else each row is one sample.

    Returns:
        ``([batch, seq_len, heads, head_dim], None)``: on CUDA torch's varlen flash kernel (fp32 inputs, which
        autocast leaves in some layers, computed in bf16 as autocast computes sdpa), elsewhere the per-sample
        ``sdpa`` reference.

    Raises:
        TrainingError: a mask, a cache (query shorter than the keys), dropout, a sliding window or soft-capping
            reached it.
    """
    batch, heads, seq_len, head_dim = query.shape
    if attention_mask is not None or key.size(2) != seq_len or dropout:
        raise TrainingError(
            f"{ATTENTION_NAME} attention takes whole packed training rows only (no attention mask, no KV cache, "
            "no dropout); generate with the model loaded afresh"
        )
    if kwargs.get("sliding_window") or kwargs.get("softcap"):  # refused up front (unsupported_attention)
        raise TrainingError(f"{ATTENTION_NAME} attention computes neither a sliding window nor soft-capping")
    cu: torch.Tensor | None = kwargs.get("cu_seq_lens_q")
    longest = int(kwargs.get("max_length_q") or 0)
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            cu, longest = cu_seq_lens_of(position_ids.expand(batch, -1))
        else:
            cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32)
            longest = seq_len
    flat = [t.transpose(1, 2).reshape(-1, t.size(1), head_dim) for t in (query, key, value)]  # [T, H, D]
    q, k, v = flat
    kernel = _device_kernel(query)
    if kernel is None:
        out = _reference(q, k, v, cu, scaling)
    else:
        varlen_attn, keywords = kernel
        keywords = dict(keywords)
        groups = q.size(1) // k.size(1)
        if keywords.pop("repeat_kv", False):  # a torch whose kernel takes equal heads only
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        else:
            keywords["enable_gqa"] = groups > 1
        cu = cu.to(query.device, torch.int32, non_blocking=True)
        dtype = torch.bfloat16 if q.dtype == torch.float32 and q.is_cuda else q.dtype
        out = varlen_attn(
            q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, longest, longest, scale=scaling, **keywords
        ).to(query.dtype)
    return out.reshape(batch, seq_len, heads, head_dim), None


def use_varlen(model: Any) -> bool:
    """Register :func:`varlen_attention_forward` with transformers and switch ``model`` (a transformers model, or
    a peft model around one) to it. Returns whether the model took it (a model whose attention does not go
    through transformers' attention interface keeps its own)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(ATTENTION_NAME)
    return getattr(base.config, "_attn_implementation", None) == ATTENTION_NAME


def drop_varlen(model: Any) -> bool:
    """Switch ``model`` (as for :func:`use_varlen`) back to transformers' ``sdpa``; returns False (what the
    recipe's ``varlen`` becomes)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation("sdpa")
    return False


__all__ = [
    "ATTENTION_NAME",
    "drop_varlen",
    "cu_seq_lens_of",
    "unsupported_attention",
    "use_varlen",
    "varlen_attention_forward",
    "varlen_unavailable",
]
