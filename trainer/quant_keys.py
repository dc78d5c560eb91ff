"""The checks of the QLoRA keys (``quantization_bit`` and friends) that :class:`trainer.config.TrainConfig` runs on
validation, apart from :mod:`trainer.quant` so that the config imports no model code (trainer.quant builds
sharded models through trainer.fsdp, which imports the config)."""

from __future__ import annotations

import sys
from typing import Any

#: ``quantization_method`` values ferry supports.
SUPPORTED_METHODS = ("bnb",)


def check_config(cfg: Any) -> list[tuple[str, str]]:
    """Problems of the quantisation keys of ``cfg`` (a :class:`trainer.config.TrainConfig`) as ``(key, message)``
    pairs, empty when none; :class:`trainer.config.TrainConfig` raises them as one line."""
    problems: list[tuple[str, str]] = []
    if cfg.quantization_bit is None:
        for key in ("quantization_type", "double_quantization", "bnb_4bit_quant_storage"):
            default = type(cfg).model_fields[key].default
            if getattr(cfg, key) != default:
                problems.append((key, "has no effect without quantization_bit: 4 or 8"))
        return problems
    if cfg.quantization_method not in SUPPORTED_METHODS:
        problems.append(
            (
                "quantization_method",
                f"{cfg.quantization_method!r} is not supported; ferry quantises "
                f"on the fly with bnb (bitsandbytes) only",
            )
        )
    if cfg.quantization_bit == 8 and cfg.quantization_type != "nf4":
        problems.append(("quantization_type", "applies to quantization_bit: 4 only (8-bit is int8)"))
    if cfg.fsdp and cfg.quantization_bit == 8:
        problems.append(
            (
                "fsdp",
                "over an 8-bit base is not supported (int8 rows with their scales do not shard); "
                "use quantization_bit: 4 or DDP",
            )
        )
    if cfg.fsdp and cfg.quantization_bit == 4 and cfg.bnb_4bit_quant_storage is not None:
        wanted = "float16" if cfg.fp16 else "bfloat16"
        if cfg.bnb_4bit_quant_storage == "uint8":
            problems.append(
                (
                    "bnb_4bit_quant_storage",
                    f"uint8 cannot be sharded by FSDP2 (it flattens and "
                    f"all-gathers floating-point storage only); set {wanted}",
                )
            )
        elif (cfg.bf16 or cfg.fp16) and cfg.bnb_4bit_quant_storage != wanted:
            problems.append(
                (
                    "bnb_4bit_quant_storage",
                    f"{cfg.bnb_4bit_quant_storage} under fsdp with "
                    f"{'fp16' if cfg.fp16 else 'bf16'}: FSDP2 would cast the packed "
                    f"4-bit bytes to {wanted} on CUDA and ruin them; set {wanted}",
                )
            )
    if cfg.use_dora:
        problems.append(("use_dora", "over a quantization_bit base is not supported; set use_dora: false"))
    return problems


def quant_storage(cfg: Any) -> str:
    """The dtype name the packed 4-bit weights are stored in: ``bnb_4bit_quant_storage``, else bfloat16 under
    fsdp (FSDP2 shards floating-point storage only; float16 with ``fp16``, so that its ``param_dtype`` cast on
    CUDA leaves the packed bytes alone) and uint8 otherwise (bitsandbytes' default)."""
    if cfg.bnb_4bit_quant_storage is not None:
        return cfg.bnb_4bit_quant_storage
    if not cfg.fsdp:
        return "uint8"
    return "float16" if cfg.fp16 else "bfloat16"  # = FSDP2's param_dtype on CUDA, so it casts nothing


def keep_bitsandbytes_out(cfg: Any) -> bool:
    """In a fresh worker process (``python -m trainer``) of a run without ``quantization_bit``: mark bitsandbytes
    as absent (``sys.modules["bitsandbytes"] = None``, Python's import-system rule: ``import`` then raises
    ImportError and ``importlib.util.find_spec`` returns None), before peft is imported.

    Why: peft imports bitsandbytes whenever it is installed (``peft.helpers``), and bitsandbytes imports
    ``torch._inductor`` for its CPU kernels: about 1.0 s of a worker's 4.3 s of imports, measured here (2 cores,
    torch 2.13, peft 0.21.2, bitsandbytes 0.50.2), for a module only ``quantization_bit`` uses. Both peft
    (``is_bnb_available``) and transformers (``is_bitsandbytes_available``) then see it as not installed.

    Returns True when it marked it; False (and changes nothing) with ``quantization_bit`` or
    ``ref_model_quantization_bit`` set, or when bitsandbytes is already imported. Never call it in a process that
    may later need bitsandbytes (the launcher, a test process): it lasts for the life of the interpreter.
    """
    if cfg.quantization_bit is not None or getattr(cfg, "ref_model_quantization_bit", None) is not None:
        return False
    if "bitsandbytes" in sys.modules:
        return False
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    return True


__all__ = ["SUPPORTED_METHODS", "check_config", "keep_bitsandbytes_out", "quant_storage"]
