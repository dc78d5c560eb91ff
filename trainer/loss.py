"""The causal-LM loss without the whole logits tensor.

The largest tensor of a fine-tuning step is usually the logits, ``[batch, seq_len, vocab]``: with Qwen's
151,936-token vocabulary, 4 sequences of 1,024 tokens hold 2.5 GB of fp32 logits, and the cross-entropy keeps
more copies of that size for its backward. Here the model's forward stops before the output head: the head
returns its input (the last hidden states, ``[batch, seq_len, hidden]``), and :class:`ChunkedHeadLoss` projects
the hidden states of the trained positions onto the vocabulary a chunk of positions at a time, summing the
cross-entropy. Backward recomputes each chunk's logits, so at most one chunk's logits (``chunk x vocab`` fp32,
:data:`CHUNK_BYTES`) is alive at any time. The loss and gradients are those of the whole-logits path (the same
matmuls, per row), up to fp32 summation order.

It applies where the model's output is exactly ``head(hidden)``: a plain ``nn.Linear`` head (LoRA layers,
``modules_to_save`` and trainable-token wrappers on the head keep the whole-logits path) and no post-processing
of the logits in the model's forward (Gemma-2/3 soft-capping, Cohere's logit scale). :func:`head_is_plain`
checks both on the real model once, on a short input, and says which it is in one line when it is not.
On CUDA, ``enable_liger_kernel: true`` (LLaMA-Factory's key) uses liger-kernel's fused linear cross-entropy
instead, when it is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

#: Bytes of fp32 logits one chunk may hold (the chunk's row count follows from the vocabulary size).
CHUNK_BYTES = 256 * 1024 * 1024


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk: as many as fit ``chunk_bytes`` of fp32 logits, at least 1."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``hidden @ weight.T + bias`` in the hidden states' dtype (as autocast's linear), returned in fp32."""
    w = weight.to(hidden.dtype)
    b = bias.to(hidden.dtype) if bias is not None else None
    return F.linear(hidden, w, b).float()


class ChunkedHeadLoss(torch.autograd.Function):
    """Summed cross-entropy (nats, fp32 scalar) of ``targets`` under ``hidden @ weight.T (+ bias)``, computed and
    differentiated a chunk of rows at a time.

    Inputs: ``hidden`` ``[n, hidden]`` (the trained positions' last hidden states, any float dtype),
    ``weight`` ``[vocab, hidden]``, ``bias`` ``[vocab]`` or None, ``targets`` ``[n]`` int64 (no ignored entries),
    ``rows`` (positions per chunk). Gradients flow to ``hidden`` and, when they require it, ``weight`` / ``bias``.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), rows):
            logits = _logits(hidden[start:start + rows], weight, bias)
            total += F.cross_entropy(logits, targets[start:start + rows], reduction="sum")
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets)
        ctx.has_bias, ctx.rows = bias is not None, rows
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor):  # noqa: ANN205 - autograd's signature
        hidden, weight, bias, targets = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.size(0), dtype=torch.float32, device=weight.device) if need_b else None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.size(0), ctx.rows):
            h = hidden[start:start + ctx.rows]
            t = targets[start:start + ctx.rows]
            # d(sum of -log softmax[t]) / d logits = softmax - onehot(t)
            d = torch.softmax(_logits(h, weight, bias), dim=-1)
            d[torch.arange(t.size(0), device=t.device), t] -= 1.0
            d = (d * grad_total).to(hidden.dtype)
            if need_h:
                grad_h[start:start + ctx.rows] = d @ w
            if need_w:
                grad_w += (d.t() @ h).float()
            if need_b:
                grad_b += d.float().sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None


def head_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Linear, *,
                  rows: Optional[int] = None) -> torch.Tensor:
    """Summed next-token cross-entropy (nats, fp32 scalar) over positions whose label is not -100, from the last
    hidden states: equal to ``causal_lm_loss_sum(head(hidden), labels)`` without the whole logits.

    Args:
        hidden: [batch, seq_len, hidden] the model's last hidden states (what the head would project).
        labels: [batch, seq_len] int64, unshifted (``labels[:, t]`` is the target of position ``t - 1``).
        head: the output projection (``nn.Linear``, weight ``[vocab, hidden]``).
        rows: positions per chunk (default: :func:`chunk_rows` of the vocabulary).
    """
    labels = labels.to(hidden.device)
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    keep = shifted != IGNORE_INDEX
    flat = hidden.reshape(-1, hidden.size(-1))[keep]
    rows = rows or chunk_rows(head.weight.size(0))
    return ChunkedHeadLoss.apply(flat, head.weight, head.bias, shifted[keep], rows)


def _identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


@contextlib.contextmanager
def head_returns_hidden(head: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``head(x)`` returns ``x``: the model's forward yields its last hidden states where it
    yields logits. The module, its parameters and their names are unchanged (only the instance's ``forward``
    is swapped), so DDP's and FSDP's hooks and checkpoints see the same model."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The model's output projection (``get_output_embeddings()``, through peft and DDP wrappers), or None."""
    inner = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    getter = getattr(inner, "get_output_embeddings", None)
    return getter() if callable(getter) else None


def head_is_plain(model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
    """Whether the chunked loss reproduces ``model``'s logits: its head is a plain ``nn.Linear`` and its forward
    returns ``head(hidden)`` unchanged. The check runs the model in eval mode on 4 tokens, with and without the
    head swapped out (:func:`head_returns_hidden`), and compares the logits (fp32, 1e-5 relative).

    Returns ``(plain, reason)``; ``reason`` names what stands in the way (for one log line) when not plain.
    """
    head = output_head(model)
    if head is None:
        return False, "the model has no output head (get_output_embeddings)"
    if type(head) is not torch.nn.Linear:
        return False, f"the output head is a {type(head).__name__} (LoRA or trained rows on the head)"
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([[1, 2, 3, 4]], device=device) % head.weight.size(0)
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits.float()
            with head_returns_hidden(head):
                hidden = model(input_ids=ids, use_cache=False).logits
            ours = _logits(hidden.to(head.weight.dtype), head.weight, head.bias)
    finally:
        model.train(was_training)
    if full.shape != ours.shape:
        return False, "the model's logits are not the head's output"
    scale = float(full.abs().max()) or 1.0
    if float((full - ours).abs().max()) > 1e-5 * scale + 1e-6:
        return False, "the model changes the head's output (logit soft-capping or scaling)"
    return True, ""


def liger_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Linear) -> Optional[torch.Tensor]:
    """The same sum through liger-kernel's fused linear cross-entropy (CUDA, Triton), or None when liger-kernel
    is not importable here."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    labels = labels.to(hidden.device)
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    return fn(head.weight, hidden.reshape(-1, hidden.size(-1)), shifted, head.bias).float()
