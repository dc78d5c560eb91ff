"""The causal-LM loss: the label convention, the summed token loss, and the same loss without the whole logits.

Labels are unshifted ``[batch, seq_len]`` int64 (``labels[:, t]`` is the target of position ``t - 1``) and
:data:`IGNORE_INDEX` where no loss is taken (prompt, padding, the first token of a packed sample): the one value
:mod:`trainer.data` writes, the collate pads with and every loss here ignores. :func:`causal_lm_loss_sum` sums the
token cross-entropy over whole logits; the recipe divides it by :func:`count_trainable_tokens` of the global batch.

A causal LM's largest tensor is its logits, ``[batch, seq_len, vocab]``: with a 151,936-token vocabulary, cutoff
1024 and 4 sequences that is 2.5 GB in fp32, held for backward by the cross-entropy. :class:`ChunkedHead` computes
the same summed token loss from the hidden states instead: only the positions that have a label are kept, and
they go through the output head and the cross-entropy a chunk of rows at a time, each chunk under
non-reentrant ``torch.utils.checkpoint`` so that backward recomputes that chunk's logits rather than keeping
them. Peak memory then holds one chunk's logits (``chunk_tokens x vocab``, fp32) instead of all of them, and the
cross-entropy's gradient is formed in place in that buffer (:class:`_SummedCrossEntropy`).

It works inside the model's own forward: while a step runs, the output head's ``forward`` is replaced by one that
computes the loss sum from the hidden states it is given, and hands that ``[1, 1, 1]`` loss back where the
logits would go. So DDP and FSDP2 see an ordinary forward of the wrapped model (the head's parameters are
gathered, the loss is reachable from the output), and the head is called as the model would call it: tied
embeddings, a LoRA or ``modules_to_save`` wrapper on ``lm_head`` all behave as they do unchunked.

What a family does to the logits after the head (Gemma-2/3's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``, ...) cannot be seen from inside the head: :func:`chunked_loss_ok`
probes the model once (the chunked loss of a short sample against the model's own logits' loss, within
:func:`probe_bound` for the compute dtype) and the recipe falls back to the whole logits where they differ, with
one line and an entry in ``train_report.json``'s ``fallbacks``. ``enable_liger_kernel`` (LLaMA-Factory's key)
uses liger-kernel's fused linear cross-entropy on CUDA when it is installed, the head is a plain frozen
``nn.Linear`` and the same probe passes, and this chunked path elsewhere (again a recorded fallback).

The same chunks serve preference training, which needs each labelled token's log-probability rather than their
summed loss: :func:`labelled_rows` selects the rows and :func:`chunked_token_logps` returns ``[n]`` per-token
log-probabilities through the head a chunk at a time (:mod:`trainer.preference_loss` sums them per sequence).

Labelled positions: the collate computes them on the CPU (:func:`loss_positions`, shipped with the batch as
``loss_positions``), so the loss selects its rows by a tensor whose length the host already knows: no
``nonzero()`` on the device, which would wait for the GPU every micro-batch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

#: The label of a position without a loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``, which
#: transformers and LLaMA-Factory use too). Defined here alone; every module that writes or reads labels imports it.
IGNORE_INDEX = -100

#: Elements of one chunk's fp32 logits off CUDA (2**24: 64 MiB); the chunk is at least 128 tokens. A step holds
#: about two such buffers at once (:class:`_SummedCrossEntropy`); measured on CPU with vocab 151,936 (128-row
#: chunks against 441-row ones of 2**26), the step's transient fell from 0.86 to 0.15 GiB at the same speed.
CHUNK_ELEMENTS = 1 << 24

#: On CUDA one chunk's fp32 logits may take this share of the GPU's memory (at least the CPU's 64 MiB): 1.1 GiB
#: on a 141 GB H200 (1,940 rows at a 151,936 vocabulary), 640 MiB on an 80 GB card, 190 MiB on 24 GB. Each chunk
#: costs a fixed train of kernels (head matmul, cast, logsumexp, gather, sum; again in the recomputing backward),
#: so 8 x 2,048 labelled tokens in 128-row chunks launched about 128 such trains a step where these take about 9;
#: the chunk's transient stays well below the whole logits' (8 x 2,048 x 151,936 fp32: 10 GB).
CUDA_CHUNK_SHARE = 1 / 128


#: Unit roundoff ``u = 2**-p`` of a float dtype with ``p`` significand bits (the implicit bit included): the
#: largest relative error of rounding one real number to it. bfloat16 keeps 8 bits (7 stored), so one bf16
#: operation is off by up to 2**-8 = 0.39 % of its value; float16 keeps 11, float32 24.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def unit_roundoff(dtype: torch.dtype) -> float:
    """:data:`UNIT_ROUNDOFF` of ``dtype`` (float64 and other dtypes: float32's)."""
    return UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32])


def loss_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance between two summed losses computed from logits in ``dtype``: ``1e-4`` in float32 (fp32
    summation order, measured ~1e-6), ``4u`` where the dtype's unit roundoff ``u`` (:func:`unit_roundoff`) makes
    that larger: bfloat16 ``2**-6`` (1.6 %), float16 ``2**-9`` (0.2 %).

    Why ``4u``: each token's term ``logsumexp(z) - z_t`` is computed in fp32 from logits rounded to ``dtype``, a
    relative error of at most ``u`` per logit, so each path's sum is off from the exact one by about ``u`` of its
    size; two paths (another GEMM shape, another kernel) differ by up to twice that, and the factor 2 left covers
    the rounding of the last hidden states. bfloat16 keeps 8 significand bits: ``u = 2**-8``."""
    return max(1e-4, 4 * unit_roundoff(dtype))


def probe_bound(expected: float, dtype: torch.dtype) -> float:
    """How far (nats) a start-up probe's summed loss may lie from ``expected`` (the fp32 cross-entropy of the
    model's own logits, computed in ``dtype``): ``1e-5 + loss_rtol(dtype) * |expected|``. The probe's tokens are
    arbitrary, so its loss is about ``ln(vocab)`` per position: a missing or extra position moves the sum by a
    sixth of it and a cap or scale on the logits by more, far beyond the bound in any dtype."""
    return 1e-5 + loss_rtol(dtype) * abs(expected)


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices ``[n]`` int64 into ``labels.reshape(-1)`` (and so into the hidden states' rows,
    ``hidden.reshape(-1, hidden_size)``) of the positions whose next token has a label: ``labels[:, t + 1] !=
    IGNORE_INDEX``, ``labels`` ``[batch, seq_len]`` int64 unshifted. ``n`` is :func:`count_trainable_tokens`.

    A data-dependent shape: called on the CPU by the collate (``trainer.batching``), where it costs no device
    sync; :func:`chunked_loss_sum` computes it on the device only when the batch does not carry it."""
    shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    return (shift != IGNORE_INDEX).nonzero().squeeze(1)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (nats, fp32 scalar) over positions whose label is not :data:`IGNORE_INDEX`.

    Args:
        logits: ``[batch, seq_len, vocab]`` (any float dtype; computed in fp32).
        labels: ``[batch, seq_len]`` int64, unshifted (``labels[:, t]`` is the target of position ``t - 1``).

    The caller divides by the trainable-token count of the whole global batch (:func:`count_trainable_tokens`),
    so the mean does not depend on how tokens fall across micro-batches and ranks.
    """
    # Shift the labels, not the logits (as transformers' ForCausalLMLoss): slicing [batch, seq_len, vocab]
    # would copy the largest tensor of the step; the padded last position is ignored.
    labels = labels.to(logits.device)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_trainable_tokens(labels: torch.Tensor) -> int:
    """Number of positions that contribute to the next-token loss: ``labels[..., 1:] != IGNORE_INDEX`` (labels
    ``[batch, seq_len]`` int64, unshifted). The recipe divides the summed cross-entropy by this (all-reduced)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def chunk_budget_bytes(device: torch.device) -> int:
    """Bytes one chunk's fp32 logits may take on ``device``: :data:`CUDA_CHUNK_SHARE` of a GPU's memory (at least
    ``4 * CHUNK_ELEMENTS``), ``4 * CHUNK_ELEMENTS`` (64 MiB) elsewhere."""
    floor = 4 * CHUNK_ELEMENTS
    if device.type != "cuda":
        return floor
    total = torch.cuda.get_device_properties(device).total_memory
    return max(floor, int(total * CUDA_CHUNK_SHARE))


def chunk_tokens_for(vocab_size: int, budget_bytes: int = 4 * CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one chunk's fp32 logits ``[rows, vocab_size]`` stay within ``budget_bytes``
    (:func:`chunk_budget_bytes`), at least 128 rows."""
    return max(128, int(budget_bytes) // (4 * max(int(vocab_size), 1)))


class _SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), targets, reduction="sum")`` for rows that all have a target, holding one
    logits-sized buffer where autograd's holds up to four (the logits, log_softmax's output, nll's scattered
    gradient, log_softmax's input gradient).

    Forward: ``sum_i logsumexp(z_i) - z_i[t_i]`` (nats, fp32 scalar). Backward: ``d/dz_i = softmax(z_i) -
    onehot(t_i)`` (the textbook gradient of the softmax cross-entropy, e.g. Goodfellow et al., "Deep Learning",
    section 6.2.2.3), computed in place in the saved fp32 logits: under the chunk's checkpoint those are the
    recomputed ones, which nothing else holds. ``logits`` ``[n, vocab]`` any float dtype, ``targets`` ``[n]``
    int64 in ``[0, vocab)``; the gradient returns in the logits' dtype.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, targets[:, None]).squeeze(1)
        ctx.in_dtype = logits.dtype
        ctx.save_for_backward(z, targets, lse)
        return (lse - picked).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        z, targets, lse = ctx.saved_tensors
        g = z.sub_(lse[:, None]).exp_()  # softmax, in place
        g.scatter_add_(1, targets[:, None], torch.full_like(targets[:, None], -1, dtype=g.dtype))
        g.mul_(grad)
        return g.to(ctx.in_dtype), None


def _chunk_loss(head_forward: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return F.cross_entropy(head_forward(hidden).float(), targets, reduction="sum")
    return _SummedCrossEntropy.apply(head_forward(hidden), targets)


def labelled_rows(
    hidden: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden-state rows that have a next-token label, their targets and where they sit.

    Args:
        hidden: ``[batch, seq_len, hidden]`` final hidden states (any float dtype).
        labels: ``[batch, seq_len]`` int64, unshifted; :data:`IGNORE_INDEX` marks positions without a loss.
        positions: :func:`loss_positions` of ``labels`` if the collate computed it on the CPU (no device sync),
            else None (computed here with ``nonzero()``).

    Returns:
        ``(rows [n, hidden], targets [n] int64, positions [n] int64)``: ``positions`` are flat indices into
        ``hidden.reshape(-1, hidden_size)``, so ``positions // seq_len`` is each row's sequence.
    """
    labels = labels.to(hidden.device, non_blocking=True)
    shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    keep = loss_positions(labels) if positions is None else positions.to(hidden.device, non_blocking=True)
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)
    return rows, shift.index_select(0, keep), keep


class _TokenLogProbs(torch.autograd.Function):
    """``log_softmax(logits.float())[i, t_i]`` per row (nats, fp32 ``[n]``), holding one logits-sized buffer.

    The per-row sibling of :class:`_SummedCrossEntropy` (whose rows are summed and negated). Backward:
    ``d/dz_i = g_i * (onehot(t_i) - softmax(z_i))`` for the incoming per-row gradient ``g``, formed in place in the
    saved fp32 logits (the recomputed ones under a chunk's checkpoint). ``logits`` ``[n, vocab]`` any float dtype,
    ``targets`` ``[n]`` int64 in ``[0, vocab)``; the gradient returns in the logits' dtype.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, targets[:, None]).squeeze(1)
        ctx.in_dtype = logits.dtype
        ctx.save_for_backward(z, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        z, targets, lse = ctx.saved_tensors
        g = z.sub_(lse[:, None]).exp_().neg_()  # -softmax, in place
        g.scatter_add_(1, targets[:, None], torch.ones_like(targets[:, None], dtype=g.dtype))
        g.mul_(grad[:, None])
        return g.to(ctx.in_dtype), None


def _chunk_token_logps(head_forward: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        logits = head_forward(hidden).float()
        return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return _TokenLogProbs.apply(head_forward(hidden), targets)


def chunked_token_logps(
    head_forward: Any, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Log-probability (nats, fp32 ``[n]``) of each target under ``head_forward(rows)``, ``chunk_tokens`` rows
    of logits at a time; under grad mode each chunk is checkpointed as in :func:`chunked_loss_sum`.

    Args:
        head_forward: the output head's forward, ``[n, hidden] -> [n, vocab]``.
        rows: ``[n, hidden]`` hidden states (:func:`labelled_rows`).
        targets: ``[n]`` int64 token ids.
        chunk_tokens: rows of logits per chunk (at least 1).
    """
    parts = []
    for part, part_targets in zip(rows.split(chunk_tokens), targets.split(chunk_tokens)):
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_token_logps, head_forward, part, part_targets, use_reentrant=False))
        else:
            parts.append(_chunk_token_logps(head_forward, part, part_targets))
    if not parts:
        return rows.new_zeros((0,), dtype=torch.float32)
    return torch.cat(parts)


def chunked_loss_sum(
    head_forward: Any,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    liger: bool = False,
    head: torch.nn.Module | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy (nats, fp32 scalar) of ``head_forward(hidden)`` against ``labels``,
    without ever holding more than ``chunk_tokens`` rows of logits.

    Args:
        head_forward: the output head's own forward, ``[n, hidden] -> [n, vocab]``.
        hidden: ``[batch, seq_len, hidden]`` final hidden states (any float dtype).
        labels: ``[batch, seq_len]`` int64, unshifted (``labels[:, t]`` is the target of position ``t - 1``);
            :data:`IGNORE_INDEX` marks positions without a loss.
        chunk_tokens: rows of logits per chunk.
        liger: use liger-kernel's fused linear cross-entropy (``head`` must be a plain ``nn.Linear``).
        positions: :func:`loss_positions` of ``labels`` (``[n]`` int64), computed on the CPU by the collate: the
            loss then makes no host-device sync (its shapes come from ``positions``' length, which the host
            knows). None: computed here with ``nonzero()`` (one sync; the start-up probe, tests).

    Equal to :func:`causal_lm_loss_sum` of ``head(hidden)`` and ``labels`` up to fp32 summation order; gradients
    likewise. Under grad mode every chunk is checkpointed (its logits are recomputed in backward).
    """
    rows, targets, _ = labelled_rows(hidden, labels, positions)
    if liger:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        assert head is not None
        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
        return fn(head.weight, rows, targets, head.bias).float()
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, part_targets in zip(rows.split(chunk_tokens), targets.split(chunk_tokens)):
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head_forward, part, part_targets, use_reentrant=False)
        else:
            total = total + _chunk_loss(head_forward, part, part_targets)
    # A batch without any labelled position still has to reach the head's parameters (DDP / FSDP expect
    # every step to produce their gradients): add a zero that depends on them.
    if rows.size(0) == 0:
        total = total + 0.0 * head_forward(hidden.reshape(-1, hidden.size(-1))[:1]).float().sum()
    return total


class ChunkedHead:
    """Installs the chunked loss into a causal LM's output head for the duration of :meth:`loss_mode`.

    ``model`` is the unwrapped model (a peft model or a transformers ``*ForCausalLM``); its
    ``get_output_embeddings()`` is the module whose ``forward`` is replaced. Use::

        head = ChunkedHead(peft_model, chunk_tokens=chunk_tokens_for(vocab))
        with head.loss_mode(labels):
            out = wrapped_model(**inputs)        # DDP / FSDP / plain
        loss_sum = head.loss(out.logits)         # fp32 scalar, as causal_lm_loss_sum

    Raises:
        ValueError: the model has no output embeddings module.
    """

    def __init__(self, model: PeftModel | PreTrainedModel, chunk_tokens: int, liger: bool = False) -> None:
        module = model.get_output_embeddings()
        if module is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
        self.module: torch.nn.Module = module
        self.chunk_tokens = chunk_tokens
        self.liger = liger
        self._labels: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._labels is None:  # called outside loss_mode (generation, a probe): the head as it is
            return type(self.module).forward(self.module, hidden)
        orig = type(self.module).forward.__get__(self.module)
        self._result = chunked_loss_sum(
            orig, hidden, self._labels, self.chunk_tokens, self.liger, self.module, positions=self._positions
        )
        self._labels = self._positions = None  # the head runs once per forward
        return self._result.reshape(1, 1, 1)

    @contextlib.contextmanager
    def loss_mode(self, labels: torch.Tensor, positions: torch.Tensor | None = None) -> Iterator[None]:
        """While inside, the head turns its hidden states into the summed loss against ``labels``
        (``[batch, seq_len]``, unshifted) instead of into logits; ``positions``: the batch's
        :func:`loss_positions` (see :func:`chunked_loss_sum`)."""
        self._labels, self._positions, self._result = labels, positions, None
        self.module.forward = self._forward
        try:
            yield
        finally:
            self._labels = self._positions = None
            del self.module.forward

    def loss(self, model_logits: torch.Tensor, check_value: bool = False) -> torch.Tensor:
        """The summed loss of the last forward (fp32 scalar): ``model_logits``, the model's ``.logits``, which
        is the head's result as the model passed it on (DDP hands back a copy of its outputs, so the copy is what
        returns: its backward runs DDP's hooks). ``check_value``: also require it to equal the head's result
        exactly (one host sync; :func:`chunked_loss_ok` checks so once, on the unwrapped model).

        Raises:
            RuntimeError: the head was not called in this forward, or the model changed what it returned (a
                family that post-processes its logits: use the whole logits).
        """
        result, self._result = self._result, None
        changed = result is None or model_logits.numel() != 1
        if result is not None and not changed and check_value:
            changed = not torch.equal(model_logits.reshape(()).float(), result.reshape(()))
        if changed:
            raise RuntimeError("the model post-processes its logits; the chunked loss does not apply")
        return model_logits.reshape(()).float()


def chunked_loss_ok(
    model: PeftModel | PreTrainedModel,
    head: ChunkedHead,
    device: torch.device,
    amp: contextlib.AbstractContextManager,
    dtype: torch.dtype = torch.float32,
) -> str | None:
    """Probe: the chunked loss of one short sample against the loss of the model's own logits (no grad), both
    computed under ``amp`` in the compute ``dtype``, the cross-entropy in fp32 on both sides.

    Returns None where they agree within :func:`probe_bound` for ``dtype``, else the reason to use the whole
    logits (a family that scales or soft-caps its logits, a head not called as a module, values further apart
    than the dtype's rounding explains), one line naming both values and the bound.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens = torch.arange(1, 9, device=device)[None] % max(vocab, 2)
    labels = tokens.clone()
    labels[0, :2] = IGNORE_INDEX
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            with amp:
                whole = model(input_ids=tokens, use_cache=False).logits
            shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
            expected = F.cross_entropy(
                whole.float().reshape(-1, whole.size(-1)), shift, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            try:
                with head.loss_mode(labels), amp:
                    out = model(input_ids=tokens, use_cache=False)
                got = head.loss(out.logits, check_value=True)
            except RuntimeError as exc:
                return str(exc)
    finally:
        model.train(was_training)
    bound = probe_bound(float(expected), dtype)
    if not abs(float(got) - float(expected)) <= bound:
        return (
            f"chunked loss {float(got):.6g} != the model's own {float(expected):.6g} (more than "
            f"{bound:.3g} apart, the bound for {str(dtype).removeprefix('torch.')})"
        )
    return None


def liger_available(device: torch.device, head: torch.nn.Module) -> str | None:
    """None where liger-kernel's fused linear cross-entropy can run for ``head``, else why not (one line)."""
    if device.type != "cuda":
        return f"liger-kernel runs on CUDA only (device {device.type})"
    if type(head) is not torch.nn.Linear or any(p.requires_grad for p in head.parameters()):
        return f"liger-kernel needs a frozen nn.Linear head (this one is {type(head).__name__})"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def setup_head(
    model: PeftModel | PreTrainedModel,
    device: torch.device,
    amp: contextlib.AbstractContextManager,
    enable_liger_kernel: bool,
    verbose: bool,
    *,
    dtype: torch.dtype = torch.float32,
    fallbacks: list[dict[str, str]] | None = None,
) -> ChunkedHead | None:
    """The :class:`ChunkedHead` the recipe uses for ``model`` (unwrapped), or None to use the whole logits.

    ``enable_liger_kernel``: liger-kernel's fused loss where it can run and passes :func:`chunked_loss_ok`, else
    ferry's chunked loss. Every fallback (``liger_kernel``: to the chunked loss; ``chunked_loss``: to the whole
    logits) is appended to ``fallbacks`` as ``{"feature", "reason"}`` and, on ``verbose`` (rank 0), printed as one
    line. ``dtype``: the compute dtype, for the probe's bound (:func:`probe_bound`)."""
    record = fallbacks if fallbacks is not None else []
    vocab = model.get_output_embeddings()
    if vocab is None or getattr(vocab, "weight", None) is None:
        _fall_back(record, "chunked_loss", "the model has no lm_head module", "; computing the whole logits", verbose)
        return None
    chunk = chunk_tokens_for(vocab.weight.shape[0], chunk_budget_bytes(device))
    if enable_liger_kernel:
        why = liger_available(device, vocab)
        if why is None:
            head = ChunkedHead(model, chunk, liger=True)
            failed = chunked_loss_ok(model, head, device, amp, dtype)
            if failed is None:
                return head
            why = f"its fused loss fails the start-up check ({failed})"
        _fall_back(record, "liger_kernel", why, "; using ferry's chunked loss", verbose, key="enable_liger_kernel")
    head = ChunkedHead(model, chunk)
    why = chunked_loss_ok(model, head, device, amp, dtype)
    if why is not None:
        _fall_back(record, "chunked_loss", why, "; computing the whole logits", verbose)
        return None
    return head


def _fall_back(
    fallbacks: list[dict[str, str]], feature: str, why: str, instead: str, verbose: bool, key: str = "loss"
) -> None:
    """Append ``{"feature", "reason"}`` to ``fallbacks``; on ``verbose`` print ``ferry: KEY: WHY INSTEAD``."""
    fallbacks.append({"feature": feature, "reason": why + instead})
    if verbose:
        print(f"ferry: {key}: {why}{instead}", file=sys.stderr)


__all__ = [
    "CHUNK_ELEMENTS",
    "CUDA_CHUNK_SHARE",
    "IGNORE_INDEX",
    "UNIT_ROUNDOFF",
    "ChunkedHead",
    "causal_lm_loss_sum",
    "chunk_budget_bytes",
    "chunk_tokens_for",
    "chunked_loss_ok",
    "chunked_loss_sum",
    "chunked_token_logps",
    "count_trainable_tokens",
    "labelled_rows",
    "liger_available",
    "loss_positions",
    "loss_rtol",
    "probe_bound",
    "setup_head",
    "unit_roundoff",
]
