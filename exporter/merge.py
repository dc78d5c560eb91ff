"""The streaming merge: the base's shards through a :class:`exporter.plan.MergePlan` into the output writer.

The loop only moves tensors: :class:`exporter.io.CheckpointReader` reads one stored tensor at a time,
:class:`exporter.io.ShardedSafetensorsWriter` appends it to its output file, and what happens to a tensor in between
is the LoRA algebra of :mod:`exporter.lora` (pure functions on tensors). A tensor the plan leaves alone and whose
dtype stays is copied as bytes (``writer.copy``), never built.

Per stored tensor, in this order: a base weight saved with the adapter replaces the stored one; a ``modules_to_save``
tensor replaces it; ``merge_into="dequantized"`` rounds it as bitsandbytes did in training; trained token rows go
in; then the update: fused experts, ``W + ΔW`` (DoRA rescaled), or the LoRA bias. The result is cast to the output
dtype, and float16 overflow is refused. An untied head that the checkpoint does not store is written last, from the
input embedding as the base stores it.
"""

from __future__ import annotations

from typing import Any

import torch

from exporter.io import CheckpointReader, ShardedSafetensorsWriter
from exporter.lora import fused_expert_delta, merge_bias, merge_weight
from exporter.plan import MergePlan
from exporter.vocab import apply_token_rows
from ferry.errors import ExportError


class ShardMerge:
    """One pass over the base's shards (:meth:`run`), writing every planned tensor.

    ``progress``: anything with ``update(nbytes)`` (a tqdm bar), told the bytes of each tensor written;
    ``quant_record``: the adapter's ``ferry_quantization.json`` for ``merge_into="dequantized"``.

    Peak memory: the tensor being merged, plus, for fused experts, one fused parameter's update split into the
    parts not yet written.
    """

    def __init__(
        self,
        plan: MergePlan,
        reader: CheckpointReader,
        writer: ShardedSafetensorsWriter,
        progress: Any,
        quant_record: dict[str, Any] | None = None,
    ) -> None:
        self.plan, self.reader, self.writer, self.progress = plan, reader, writer, progress
        self.quant_record = quant_record
        self.untie_source: torch.Tensor | None = None  # the input embedding as stored, for an untied head
        self.fused_parts: dict[str, dict[str, torch.Tensor]] = {}  # fused parameter -> its parts not yet written

    def run(self) -> None:
        """Write every tensor of the plan, shard by shard, then the untied head.

        Raises:
            ExportError: a merged float16 tensor overflows, or the writer was handed an unplanned tensor.
        """
        plan = self.plan
        for file in self.reader.files:
            with self.reader.open(file) as shard:
                for key in self.reader.keys_in(file):
                    if key in plan.drop:
                        continue
                    info = self.reader.infos[key]
                    if (
                        shard.locate is not None
                        and not plan.changes(key)
                        and (plan.out_dtype == info.dtype or not info.dtype.is_floating_point)
                    ):
                        self.writer.copy(key, *shard.locate(key))  # unchanged: bytes copied, never a tensor
                        self.progress.update(info.nbytes)
                        continue
                    tensor = self.merged(key, shard.get)
                    self.writer.write(key, tensor)
                    self.progress.update(tensor.numel() * tensor.element_size())
                    del tensor
        if plan.untie_head is not None:
            self.writer.write(plan.untie_head, self.untied_head(plan.untie_head).to(plan.out_dtype))
            self.untie_source = None

    def merged(self, key: str, read: Any) -> torch.Tensor:
        """Stored tensor ``key`` as written: ``read(key)`` (or the adapter's saved copy), changed as planned and
        cast to the output dtype.

        Raises:
            ExportError: the merged tensor overflows float16.
        """
        plan = self.plan
        tensor = plan.overrides[key] if key in plan.overrides else read(key)
        if key == plan.untie_source:
            self.untie_source = tensor
        tensor = plan.copies.get(key, tensor)
        if key in plan.requant:  # --merge-into dequantized (exporter/quant.py)
            from trainer.quant import quant_dequant

            assert self.quant_record is not None  # requant is only planned from a quantization record
            tensor = quant_dequant(tensor, self.quant_record)
        if key in plan.token_rows:  # peft trainable_token_indices: trained rows replace the base's
            tensor = apply_token_rows(tensor, *plan.token_rows[key], plan.grown.rows if plan.grown else 0)
        if key in plan.fused:
            tensor = self.fused_part(key).add_(tensor.float())
        elif key in plan.lora:
            m = plan.lora[key]
            tensor = merge_weight(tensor, *m.pair(), m.scaling, fan_in_fan_out=m.fan_in_fan_out, magnitude=m.magnitude)
        elif key in plan.bias:
            tensor = merge_bias(tensor, plan.bias[key].bias_update(), plan.bias[key].scaling)
        if not tensor.dtype.is_floating_point:
            return tensor
        tensor = tensor.to(plan.out_dtype)
        # the adapter is checked finite on load and float32 / bfloat16 share float32's range, so only float16
        # (max 65504) can overflow here
        if plan.out_dtype == torch.float16 and plan.updates(key) and not bool(torch.isfinite(tensor).all()):
            raise ExportError(
                f"merged {key!r} overflows float16 (|w| > 65504): export with --dtype bfloat16 or float32"
            )
        return tensor

    def fused_part(self, key: str) -> torch.Tensor:
        """The float32 update of stored tensor ``key`` from the fused-expert LoRA it belongs to: the whole fused
        update is computed when the first of its stored tensors is reached, split with transformers' reversed
        converter (:meth:`exporter.layout.KeyMap.split_delta`), and each part is freed once taken."""
        runtime = self.plan.fused[key]
        parts = self.fused_parts
        if runtime not in parts:
            m = self.plan.fused_modules[runtime]
            delta = fused_expert_delta(*m.pair(), m.scaling, m.num_experts, out_first=m.out_first)
            key_map = self.plan.key_map
            parts[runtime] = key_map.split_delta(runtime, delta) if runtime in key_map.groups else {key: delta}
        part = parts[runtime].pop(key)
        if not parts[runtime]:
            del parts[runtime]
        return part

    def untied_head(self, head: str) -> torch.Tensor:
        """The head ``head`` of untied embeddings that the checkpoint does not store: the adapter's copy of it, else
        the base's input embedding plus the head's own LoRA (if any), else the base's input embedding."""
        plan, source = self.plan, self.untie_source
        if head in plan.copies:
            return plan.copies[head]
        assert source is not None  # the input embedding is read (and kept) before the head is written
        m = plan.lora.get(head)
        if m is None:
            return source
        return merge_weight(
            plan.overrides.get(head, source),
            *m.pair(),
            m.scaling,
            fan_in_fan_out=m.fan_in_fan_out,
            magnitude=m.magnitude,
        )


__all__ = ["ShardMerge"]
