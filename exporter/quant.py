"""Exporting an adapter trained over a quantised base (QLoRA, :mod:`trainer.quant`).

The adapter folder carries ``ferry_quantization.json`` (bits, NF4/FP4/int8, double quantisation, compute dtype).
Two merges, chosen by ``ferry export --merge-into``:

- ``original`` (default): ``W + scaling · B A`` into the ORIGINAL full-precision shards, as for any adapter. The
  4-bit weights are never the merge target: merging into them and quantising again throws the update away (the
  update is far below one quantisation step) or adds a second rounding.
- ``dequantized``: ``dequant(quant(W)) + scaling · B A``, computed shard by shard from the original weights with
  bitsandbytes' own quantise / dequantise (:func:`trainer.quant.quant_dequant`, proven equal to the weights a
  transformers-loaded bitsandbytes model computes with). The merged model then computes exactly what base + adapter
  computed in training; worth it when the adapter learned to compensate the quantisation error.

Which weights transformers quantises: every ``nn.Linear`` except the output head (its ``get_keys_to_not_convert``);
:func:`quantized_linear_names` finds them on a meta-device model built from config.json.

The smoke check (:mod:`exporter.smoke`) builds "base as trained" the same way (:func:`dequantize_base_`) and
measures the quantisation noise: how far the quantised base's logits lie from the full-precision base's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ferry.errors import ExportError

#: ``--merge-into`` choices.
MERGE_INTO = ("original", "dequantized")


def quantized_linear_names(model: torch.nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that bitsandbytes replaces on load: all but the output
    head (by identity with ``get_output_embeddings()`` and by the name ``lm_head``)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name.split(".")[-1] != "lm_head"
    ]


def meta_quantized_names(base_dir: Path, trust_remote_code: bool) -> list[str]:
    """:func:`quantized_linear_names` of the base in ``base_dir`` built on the meta device (no weight read)."""
    from transformers import AutoConfig

    from ferry.architecture import auto_model_class

    config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    return quantized_linear_names(model)


#: bitsandbytes' default LLM.int8 outlier threshold (transformers' ``BitsAndBytesConfig.llm_int8_threshold``): what a
#: record written before the threshold was recorded trained with.
DEFAULT_INT8_THRESHOLD = 6.0


def trained_on_cuda(record: dict[str, Any]) -> bool:
    """Whether the adapter of ``record`` trained on CUDA: its ``device``, or for a record without one, a 16-bit
    compute dtype (ferry trains in float32 on CPU)."""
    if record.get("device"):
        return record["device"] == "cuda"
    return record.get("compute_dtype") in ("bfloat16", "float16")


def check_merge_into(merge_into: str, record: dict[str, Any] | None, adapter_dir: Path) -> None:
    """Refuse an unknown ``merge_into``; ``dequantized`` for an adapter trained over a full-precision base; and
    ``dequantized`` for an 8-bit adapter trained on CUDA with an outlier threshold above 0 (``llm_int8_threshold``,
    6.0 by default): there bitsandbytes computes LLM.int8, the input columns holding a value above the threshold
    in 16-bit and the rest quantised to int8 row by row, so what training computed depends on the inputs and no
    dequantised weight (int8 per row, no outliers) reproduces it. The original weights are the honest target.

    Raises:
        ExportError: one line.
    """
    if merge_into not in MERGE_INTO:
        raise ExportError(f"--merge-into {merge_into!r}: choose {' or '.join(MERGE_INTO)}")
    if merge_into != "dequantized":
        return
    if record is None:
        raise ExportError(
            f"--merge-into dequantized: {adapter_dir} was not trained over a quantized base (no "
            f"ferry_quantization.json); merge into the original weights"
        )
    threshold = record.get("llm_int8_threshold")
    threshold = DEFAULT_INT8_THRESHOLD if threshold is None else float(threshold)
    if record.get("quantization_bit") == 8 and trained_on_cuda(record) and threshold > 0:
        raise ExportError(
            f"--merge-into dequantized: {adapter_dir} was trained over an 8-bit base on CUDA, where bitsandbytes "
            f"computes LLM.int8 with outlier threshold {threshold:g} (input columns above it in 16-bit, the rest "
            f"in int8), which no dequantized weight reproduces; use --merge-into original"
        )


def dequantize_base_(model: torch.nn.Module, record: dict[str, Any]) -> int:
    """Replace, in place, every weight bitsandbytes would quantise in a full-precision ``model`` by
    ``dequant(quant(W))`` per ``record`` (fp32 result cast to the weight's dtype). Returns how many."""
    from trainer.quant import quant_dequant

    modules = dict(model.named_modules())
    names = quantized_linear_names(model)
    with torch.no_grad():
        for name in names:
            weight = modules[name].weight
            weight.copy_(quant_dequant(weight.detach().cpu(), record).to(weight.dtype))
    return len(names)


__all__ = [
    "DEFAULT_INT8_THRESHOLD",
    "MERGE_INTO",
    "check_merge_into",
    "dequantize_base_",
    "meta_quantized_names",
    "quantized_linear_names",
    "trained_on_cuda",
]
