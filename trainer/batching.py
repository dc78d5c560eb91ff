"""From tokenised examples to the micro-batches of each optimizer step.

::

    PreparedData.train ──DistributedSampler (seed, epoch)──> this rank's indices
      ──ResumableBatchSampler (skip on resume, length-grouped within a step)──> index lists
      ──collate_with_token_count (padded rows, or one flattened row when cheaper)──> batch tensors

:func:`plan_steps` says how many optimizer steps a run takes (the launcher's ``--dry-run`` and the recipe agree
by both calling it); :class:`ShardSampler` gives each rank its own eval samples without duplicates. The cost
helpers (:func:`attention_pair_cost`, :func:`flattening_saves`) decide, per micro-batch, whether laying its samples
end to end in one row (``padding_free``) costs less compute than padding them to the longest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, Sampler

from ferry.errors import TrainingError
from trainer.loss import IGNORE_INDEX, loss_positions
from trainer.vision import add_image_inputs

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.data import Example
    from trainer.video import VideoProcessing
    from trainer.vision import ImageProcessing


# ====================================================================== the step plan


@dataclass
class StepPlan:
    """How many steps a run takes.

    ``micro_batches_per_epoch`` = ceil(ceil(num_samples / world_size) / per_device_train_batch_size) (what each
    rank's DistributedSampler + DataLoader yields); ``steps_per_epoch`` = ceil(micro_batches_per_epoch /
    gradient_accumulation_steps) (the last step of an epoch may use fewer micro-batches); ``total_steps`` =
    max_steps when > 0, else ceil(num_train_epochs * steps_per_epoch) (transformers' rule);
    ``global_batch_size`` in sequences per optimizer step.
    """

    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    num_epochs: int
    global_batch_size: int


def plan_steps(num_samples: int, cfg: TrainConfig, world_size: int) -> StepPlan:
    """The :class:`StepPlan` of ``num_samples`` training examples on ``world_size`` processes.

    Raises:
        TrainingError: there are no training examples.
    """
    if num_samples <= 0:
        raise TrainingError("no training examples left after tokenisation (all dropped or empty dataset)")
    per_rank = math.ceil(num_samples / world_size)
    micro = math.ceil(per_rank / cfg.per_device_train_batch_size)
    steps_per_epoch = math.ceil(micro / cfg.gradient_accumulation_steps)
    if cfg.max_steps > 0:
        total = cfg.max_steps
    else:
        total = max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))
    return StepPlan(
        micro_batches_per_epoch=micro,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        num_epochs=math.ceil(total / steps_per_epoch),
        global_batch_size=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size,
    )


# ====================================================================== samplers


class ResumableBatchSampler(Sampler[list[int]]):
    """``BatchSampler(sampler, batch_size)`` whose next iteration can skip its first ``skip`` batches, and whose
    batches within one optimizer step are grouped by length.

    Resuming mid-epoch sets ``skip`` to the micro-batches already consumed in that epoch; since the
    DistributedSampler's order depends only on (seed, epoch), the resumed run sees exactly the samples the
    uninterrupted run would have seen next. Skipping happens on index lists: no sample is loaded or collated.
    ``len()`` is the full epoch's batch count.

    With ``lengths`` (tokens per sample) and ``group`` > 1 (``gradient_accumulation_steps``: the micro-batches of
    one optimizer step), the samples of each run of ``group`` consecutive batches from the epoch's start are
    dealt out again by length: sorted (stable), then cut into batches of the same sizes in the same order. Each
    micro-batch then pads to a length near its own samples' instead of the longest of a random draw. The step
    still sees the same samples, and its loss and gradients (sums over its tokens, divided by the step's token
    count, :meth:`trainer.recipe.FinetuneRecipe._optimizer_step`) are the same up to float summation order; the
    data order across steps is untouched. This is transformers' ``group_by_length`` idea, but inside a step, so it
    changes no step's result. Steps never cross an epoch's end and a resume starts at a step, so ``skip`` is a
    whole number of groups.
    """

    def __init__(
        self, sampler: Sampler[int], batch_size: int, *, group: int = 1, lengths: Sequence[int] | None = None
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.group = max(1, int(group))
        self.lengths = lengths
        self.skip = 0

    def _grouped(self, batches: Iterator[list[int]]) -> Iterator[list[int]]:
        lengths = self.lengths
        assert lengths is not None
        while True:
            run = list(itertools.islice(batches, self.group))
            if not run:
                return
            ordered = sorted((i for batch in run for i in batch), key=lambda i: lengths[i])
            start = 0
            for batch in run:
                yield ordered[start : start + len(batch)]
                start += len(batch)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(BatchSampler(self.sampler, self.batch_size, drop_last=False))
        if self.lengths is not None and self.group > 1:
            batches = self._grouped(batches)
        skip, self.skip = self.skip, 0
        return itertools.islice(batches, skip, None)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)  # type: ignore[arg-type]


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of ``range(num_samples)`` for evaluation: ``rank, rank + world_size, ...``.

    Unlike ``DistributedSampler`` it never pads with duplicates, so summed eval losses count every sample
    exactly once (ranks may get one sample less; evaluation has no per-batch collectives, so that is safe).
    """

    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# ====================================================================== padded or flattened rows


def attention_pair_cost(config: Any) -> float:
    """Attention cost of one (query, key) pair relative to the linear-layer cost of one token, per decoder
    layer, from a transformers model config (multiply-adds; forward, the backward scales both alike).

    Per token the linear layers do ``h * (q + 2 kv) + q * h`` (the q, k, v and o projections) plus the MLP,
    ``3 h i`` when ``intermediate_size`` is set (gated: gate, up, down) else ``8 h^2``; each pair costs
    ``2 q`` (one row of ``Q K^T`` and of ``P V``). The same accounting as Kaplan et al. 2020, "Scaling Laws for
    Neural Language Models", Table 1 (forward FLOPs ~ 2N + 2 n_layer n_ctx d_attn). For the benchmark's Llama
    (h 512, i 1536, 8 heads, 4 KV heads) it is 1024 / 3,145,728 = 3.3e-4.
    """
    h = int(getattr(config, "hidden_size", 0) or 0)
    if h <= 0:
        return 1.0 / (6 * 4096)  # no hidden_size: a 7B-sized guess (only decides a batch layout)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or h // heads)
    q = heads * head_dim
    kv = int(getattr(config, "num_key_value_heads", 0) or heads) * head_dim
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    linear = h * (q + 2 * kv) + q * h + (3 * h * inter if inter else 8 * h * h)
    return 2.0 * q / linear


def flattening_saves(lengths: list[int], pair_cost: float) -> bool:
    """Whether one row of ``sum(lengths)`` tokens costs less than ``len(lengths)`` rows padded to the longest.

    Cost of a layout with rows of ``n`` tokens: ``n * (1 + pair_cost * n)`` per row (linear layers per token
    plus attention over the whole row: with a block-diagonal or padding mask every pair is computed);
    ``pair_cost`` from :func:`attention_pair_cost` (0: flatten whenever there is padding). A batch without
    padding is never flattened.
    """
    total, longest = sum(lengths), max(lengths)
    padded = len(lengths) * longest * (1.0 + pair_cost * longest)
    return total * (1.0 + pair_cost * total) < padded


def collate(
    examples: Sequence[Example],
    pad_token_id: int,
    *,
    flatten: bool = False,
    cross_sample_attention: bool = False,
    causal: bool = False,
) -> dict[str, torch.Tensor]:
    """Pad a list of examples into a batch (right padding).

    Returns int64 tensors ``input_ids``, ``labels`` (:data:`~trainer.loss.IGNORE_INDEX` on padding) and
    ``position_ids``, each ``[batch, seq_len]`` with ``seq_len`` the longest example; plus ``attention_mask``
    ``[batch, seq_len]`` (1 on tokens, 0 on padding) when no example in the batch is packed, or always with
    ``cross_sample_attention`` (LLaMA-Factory's plain ``packing``: a row's samples attend to the ones before
    them, causally, while their position ids restart; ``flatten`` must then be False).

    Packed batches carry no ``attention_mask``: transformers 5 (``masking_utils.find_packed_sequence_indices``)
    then reads the sample boundaries from the position ids (a new sample wherever they do not increase by 1)
    and builds a block-diagonal causal mask for the ``sdpa`` and ``eager`` kernels. Padding gets position ids
    0, 1, ... of its own, so it forms a separate block that no real token attends to. transformers does this
    detection only when no KV cache is passed: call the model with ``use_cache=False`` (or set
    ``model.config.use_cache = False``); with a cache (Llama's default ``use_cache=True`` creates one even in
    training) samples of a packed row silently attend to each other (tests/trainer/test_packing.py shows both).

    Flash-attention kernels detect packing only in a flattened batch of one row; pass ``flatten=True``
    with ``flash_attention_2``/``_3``: every example is concatenated into ``[1, total_tokens]`` without padding
    (the first label of each example becomes IGNORE_INDEX so no example is predicted from the previous one).

    ``causal``: the caller's model attends causally and nothing but the model reads the batch (the SFT and
    pretraining recipes). A batch whose rows each hold one sample (position ids 0..n-1) then carries neither
    ``attention_mask`` nor ``position_ids``: with right padding no real token can attend to a pad that comes
    after it, the model's default positions (``arange(seq_len)``) are the rows' own, and the pads' outputs carry
    no label. transformers then builds no ``[batch, 1, L, L]`` mask: ``sdpa`` runs with ``is_causal`` and native
    GQA (with a mask it repeats K/V per query head), and no device sync looks for packed rows. The loss and every
    gradient equal those of the masked batch (fp32 on CPU: the loss bit for bit; the gradients too with eager,
    within 1e-6 relative with sdpa, whose causal kernel sums in another order; tests/trainer/test_packing.py).

    ``model(**{k: v for k, v in batch.items() if k != "labels"})`` is valid for a ``LlamaForCausalLM``.

    Raises:
        ValueError: no examples; ``flatten`` together with ``cross_sample_attention``.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    if flatten and cross_sample_attention:
        raise ValueError("a flattened batch keeps samples apart: it cannot have cross-sample attention")
    if flatten:
        flat_ids = [t for e in examples for t in e["input_ids"]]
        flat_labels = [t for e in examples for t in [IGNORE_INDEX, *e["labels"][1:]]]
        flat_pos = [t for e in examples for t in e["position_ids"]]
        return {
            "input_ids": torch.tensor([flat_ids], dtype=torch.int64),
            "labels": torch.tensor([flat_labels], dtype=torch.int64),
            "position_ids": torch.tensor([flat_pos], dtype=torch.int64),
        }
    lengths = [len(e["input_ids"]) for e in examples]
    batch, seq_len = len(examples), max(lengths)
    input_ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.int64)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((batch, seq_len), dtype=torch.int64)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.int64)
    packed, plain = False, True
    for row, (e, n) in enumerate(zip(examples, lengths)):
        input_ids[row, :n] = torch.tensor(e["input_ids"], dtype=torch.int64)
        labels[row, :n] = torch.tensor(e["labels"], dtype=torch.int64)
        pos = torch.tensor(e["position_ids"], dtype=torch.int64)
        position_ids[row, :n] = pos
        position_ids[row, n:] = torch.arange(seq_len - n)
        attention_mask[row, :n] = 1
        packed = packed or bool((pos[1:] == 0).any())
        plain = plain and torch.equal(pos, torch.arange(n))
    if causal and plain and not cross_sample_attention:
        return {"input_ids": input_ids, "labels": labels}
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if not packed or cross_sample_attention:
        out["attention_mask"] = attention_mask
    return out


def collate_with_token_count(
    examples: list[dict[str, list[int]]],
    pad_token_id: int,
    flatten: bool = False,
    pair_cost: float | None = None,
    cross_sample_attention: bool = False,
    with_positions: bool = False,
    causal: bool = False,
    cu_seq_lens: bool = False,
    images: ImageProcessing | None = None,
    image_token_id: int | None = None,
    videos: VideoProcessing | None = None,
    video_token_id: int | None = None,
) -> dict[str, Any]:
    """:func:`collate` plus ``num_tokens``: the batch's non-padding tokens (int64 scalar), for tokens/s. A
    module-level function (picklable for ``dataloader_num_workers > 0``).

    Args:
        flatten: always one ``[1, total_tokens]`` row (flash-attention kernels need it for packed samples).
        pair_cost: padding-free batching: one row when :func:`flattening_saves` says it is cheaper under this
            cost ratio (:func:`attention_pair_cost`); None: padded rows (unless ``flatten``).
        cross_sample_attention: LLaMA-Factory's plain ``packing`` (see :func:`collate`): padded rows with an
            attention mask, never flattened.
        with_positions: also ``loss_positions``, the labelled positions as flat indices ``[n]`` int64
            (:func:`trainer.loss.loss_positions`), computed here on the CPU so that the loss needs no device sync
            to find them, and ``token_counts``, float64 ``[2]``: the trainable tokens (``n``) and ``num_tokens``,
            which the step sums and all-reduces without building a tensor from Python numbers (the recipe's
            batches; it keeps both out of the forward).
        causal: rows of one sample each carry no ``attention_mask`` and no ``position_ids`` (see :func:`collate`).
        cu_seq_lens: a flattened batch also carries its samples' boundaries as transformers' flattening collator
            names them: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (cumulative lengths ``[n_samples + 1]`` int32, from
            the position ids, so a packed example's own samples count) and ``max_length_q`` / ``max_length_k``
            (the longest sample, a Python int). Flash-attention kernels and :mod:`trainer.varlen` then split the
            row without looking for the boundaries on the device.
        images, image_token_id: image rows (:mod:`trainer.vision`; padded rows only): a batch whose examples name
            images also carries ``pixel_values`` (float32 ``[patches, patch_dim]``) and ``image_grid_thw`` (int64
            ``[n_images, 3]``), the images of every row in row order, and ``mm_token_type_ids`` (int32
            ``[batch, seq_len]``, 1 on ``image_token_id``), from which the model computes its M-RoPE positions
            (such a batch carries no ``position_ids``). A batch of text rows carries none of them.
        videos, video_token_id: video rows (:mod:`trainer.video`): likewise ``pixel_values_videos``,
            ``video_grid_thw`` (and ``second_per_grid_ts``), 2 in ``mm_token_type_ids`` on ``video_token_id``.

    Raises:
        DataError: an image of the batch cannot be read (it changed on disk after tokenisation).
        ValueError: images in a flattened batch, or without ``images`` / ``image_token_id``.
    """
    if cross_sample_attention:
        flatten = False
    elif not flatten and pair_cost is not None:
        flatten = flattening_saves([len(e["input_ids"]) for e in examples], pair_cost)
    batch: dict[str, Any] = collate(
        examples, pad_token_id, flatten=flatten, cross_sample_attention=cross_sample_attention, causal=causal
    )
    if any(e.get("images") or e.get("videos") for e in examples) and batch["input_ids"].size(0) != len(examples):
        raise ValueError("a batch with images or videos needs padded rows (one per example)")
    add_image_inputs(batch, examples, images, image_token_id, videos, video_token_id)
    num_tokens = sum(len(e["input_ids"]) for e in examples)
    batch["num_tokens"] = torch.tensor(num_tokens, dtype=torch.int64)
    if cu_seq_lens and batch["input_ids"].size(0) == 1 and "position_ids" in batch:
        from trainer.varlen import cu_seq_lens_of

        cu, longest = cu_seq_lens_of(batch["position_ids"])
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if with_positions:
        batch["loss_positions"] = loss_positions(batch["labels"])
        batch["token_counts"] = torch.tensor([batch["loss_positions"].numel(), num_tokens], dtype=torch.float64)
    return batch


__all__ = [
    "ResumableBatchSampler",
    "ShardSampler",
    "StepPlan",
    "attention_pair_cost",
    "collate",
    "collate_with_token_count",
    "flattening_saves",
    "plan_steps",
]
