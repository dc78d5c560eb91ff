"""What vLLM's LoRA serving takes: :func:`vllm_lora_fit` reads a PEFT adapter's ``adapter_config.json``.

vLLM serves a PEFT adapter next to its base (``vllm serve BASE --enable-lora --lora-modules NAME=DIR``) only when the
adapter is plain LoRA on linear layers. :func:`vllm_lora_fit` names what vLLM's LoRA loader refuses (its
``PEFTHelper`` validation and its supported-module lists):

* ``modules_to_save`` (whole modules trained and stored beside the LoRA weights; vllm#9280), and peft's
  ``trainable_token_indices`` (trainable tokens): not loaded;
* DoRA (``use_dora``): not supported;
* LoRA on the input embedding or the output head (``embed_tokens``, ``lm_head``, ``wte``...), and LoRA on
  parameters (peft ``target_parameters``, fused MoE experts): not served by current vLLM;
* ``bias`` other than ``none``: needs ``--enable-lora-bias``;
* the rank: ``--max-lora-rank`` must be at least the largest rank (default 16; vLLM accepts 1, 8, 16, 32, 64, 128,
  256, 320, 512), so the command names the smallest value that fits; above 512 it does not fit.

When the adapter does not fit, ``ferry export --adapter-only`` says so in one line and points to the merged model,
which vLLM always serves; ``ferry chat`` with ``infer_backend: vllm`` refuses it (:mod:`serving.engines`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

#: ``--max-lora-rank`` values vLLM accepts.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_MAX_LORA_RANK = 16
_EMBEDDING_NAMES = (
    "embed_tokens",
    "lm_head",
    "wte",
    "word_embeddings",
    "embed_in",
    "embed_out",
    "tok_embeddings",
    "output",
)


@dataclass
class VllmFit:
    """Whether vLLM's LoRA serving takes the adapter: ``fits``; ``max_lora_rank`` to pass (None when it does not
    fit on rank); ``extra_flags`` it needs; ``reasons``: one line per refusal."""

    fits: bool
    rank: int
    max_lora_rank: int | None
    extra_flags: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def line(self, merged_hint: str) -> str:
        """One line for the export's summary."""
        if self.fits:
            flags = " ".join([f"--max-lora-rank {self.max_lora_rank}", *self.extra_flags])
            return f"vLLM serves this adapter with --enable-lora {flags}"
        return f"vLLM's LoRA serving does not take this adapter ({'; '.join(self.reasons)}): serve {merged_hint}"


def _targets(config: dict[str, Any]) -> list[str]:
    value = config.get("target_modules") or []
    return [value] if isinstance(value, str) else list(value)


def vllm_lora_fit(adapter_config: dict[str, Any] | str | os.PathLike, rope: Any = None) -> VllmFit:
    """Check a PEFT LoRA adapter (its ``adapter_config.json`` as a dict, or the folder) against vLLM's LoRA
    serving rules (module docstring). A folder without adapter_config.json is checked as an empty config.

    ``rope``: the RoPE scaling the adapter was trained with (a :class:`ferry.rope.RopeScaling`; read from a
    folder's ``ferry_rope.json``). vLLM builds the base from its own config.json, unstretched, and applies the
    adapter there: outputs at every position would differ from training's, so such an adapter does not fit.

    Raises:
        ConfigError: the folder's adapter_config.json or ferry_rope.json is malformed
            (:func:`ferry.adapter_folder.read_adapter_config`, :func:`ferry.adapter_folder.read_rope_record`).
    """
    if not isinstance(adapter_config, dict):
        from ferry.adapter_folder import read_adapter_config, read_rope_record

        folder = adapter_config
        adapter_config = read_adapter_config(folder) or {}
        if rope is None and os.path.isdir(folder):
            rope = read_rope_record(folder)
    cfg = adapter_config
    ranks = [int(cfg.get("r") or 8), *[int(v) for v in (cfg.get("rank_pattern") or {}).values()]]
    rank = max(ranks)
    reasons: list[str] = []
    flags: list[str] = []
    if cfg.get("modules_to_save"):
        reasons.append(f"modules_to_save {sorted(cfg['modules_to_save'])} (vllm#9280)")
    if cfg.get("trainable_token_indices"):
        reasons.append("trainable tokens (trainable_token_indices)")
    if cfg.get("use_dora"):
        reasons.append("DoRA (use_dora)")
    if cfg.get("target_parameters"):
        reasons.append(f"LoRA on parameters (target_parameters {cfg['target_parameters']})")
    targets = _targets(cfg)
    on_embeddings = sorted({t for t in targets for e in _EMBEDDING_NAMES if t == e or t.endswith("." + e)})
    if on_embeddings:
        reasons.append(f"LoRA on the embedding / output head ({', '.join(on_embeddings)})")
    if (cfg.get("bias") or "none") != "none":
        flags.append("--enable-lora-bias")
    if cfg.get("peft_type", "LORA") != "LORA":
        reasons.append(f"peft_type {cfg.get('peft_type')} (vLLM serves LoRA)")
    if rope is not None:
        reasons.append(
            f"trained with rope_scaling {rope.rope_type} (factor {rope.factor:g}), which vLLM would not apply to "
            "the base"
        )
    max_rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        reasons.append(f"rank {rank} > vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}")
    return VllmFit(not reasons, rank, max_rank, flags, reasons)


__all__ = ["VLLM_DEFAULT_MAX_LORA_RANK", "VLLM_MAX_LORA_RANKS", "VllmFit", "vllm_lora_fit"]
