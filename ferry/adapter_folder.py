"""The adapter folder: every record a trained LoRA adapter folder may hold, named and read in one place.

The trainer writes these files and the exporter, ``ferry chat`` and ``do_predict`` read them; both sides import
this module and neither imports the other. Standard library only at import (the records are small JSON files;
:func:`read_value_head` imports safetensors when called)::

    OUTPUT_DIR/                          ferry train's output_dir (LLaMA-Factory's holds the adapter files at its top)
    ├── adapter/                         ADAPTER_DIRNAME: the PEFT adapter (``peft.PeftModel.from_pretrained`` loads it)
    │   ├── adapter_config.json          ADAPTER_CONFIG   peft's LoraConfig (r, lora_alpha, target_modules, ...)
    │   ├── adapter_model.safetensors    ADAPTER_WEIGHTS  the LoRA factors
    │   ├── chat_template.jinja          CHAT_TEMPLATE    the prompt training rendered, for serving
    │   ├── ferry_base_adapters.json     STACK_RECORD     adapters merged into the base this one was trained on
    │   ├── ferry_quantization.json      QUANT_RECORD     the quantised base it was trained over (QLoRA)
    │   ├── value_head.safetensors       VALUE_HEAD_FILE  stage rm: the reward model's value head (also copied
    │   │                                                 into a merged export, as LLaMA-Factory does)
    │   ├── ferry_vocab.json             VOCAB_RECORD     tokens the run added and the embedding rows
    │   └── ferry_rope.json              ROPE_RECORD      the RoPE scaling training applied to the base
    ├── train_config.yaml                TRAIN_CONFIG     the resolved training config
    └── train_report.json                TRAIN_REPORT     the run's summary (datasets with sha256, losses, ...)

    EXPORT/ferry_export.json             EXPORT_RECORD    an export's lineage (base, adapter, datasets, vocabulary,
                                                          quantization); written by ferry export, read by smoke/GGUF

Record formats:

- ``ferry_base_adapters.json``: ``{"merged_into_base": [{"path": str, "sha256": str}, ...]}``, in merge order;
  ``sha256`` is that of the adapter's ``adapter_model.safetensors`` (it identifies an adapter across hosts).
- ``ferry_quantization.json``: ``{"quantization_bit": 4 | 8, "quantization_method", "quantization_type",
  "double_quantization", "bnb_4bit_quant_storage", "compute_dtype", "blocksize", "bitsandbytes_version", "device":
  "cuda" | "cpu", "llm_int8_threshold": float | None}`` (``device`` and ``llm_int8_threshold``, 8-bit only, are
  absent from records written before they were kept).
- ``value_head.safetensors``: LLaMA-Factory's (and trl's value-head) layout, :data:`VALUE_HEAD_KEYS`:
  ``v_head.summary.weight`` ``[1, hidden_size]`` and ``v_head.summary.bias`` ``[1]``, fp32; the score of a sequence
  is ``weight @ h + bias`` with ``h`` the backbone's last hidden state at its last token.
- ``ferry_vocab.json``: ``{"format": 1, "added": {token: id}, "base_rows": int, "rows": int, "trained": [module],
  "token_rows": [id]}``.

- ``ferry_rope.json``: :meth:`ferry.rope.RopeScaling.to_record`: ``{"format": 1, "rope_scaling": "linear" |
  "dynamic" | "yarn" | "llama3", "factor": float, "original_max_position_embeddings": int,
  "max_position_embeddings": int, "scaling": {"rope_type", "factor", ...}}``; whatever loads the base under the
  adapter applies it (:func:`ferry.rope.apply_to_config`), and a merged export's config.json carries it.

Every reader returns None (or [] for the stack) when its record is absent and raises :class:`ConfigError` naming
the file when it is present but malformed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError
from ferry.fsutil import atomic_write_text, sha256_file

ADAPTER_DIRNAME = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CHAT_TEMPLATE = "chat_template.jinja"
STACK_RECORD = "ferry_base_adapters.json"
QUANT_RECORD = "ferry_quantization.json"
VOCAB_RECORD = "ferry_vocab.json"
ROPE_RECORD = "ferry_rope.json"
EXPORT_RECORD = "ferry_export.json"
TRAIN_CONFIG = "train_config.yaml"
TRAIN_REPORT = "train_report.json"
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")


def adapter_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` when it holds ``adapter_config.json`` (an adapter folder, LLaMA-Factory's output_dir), else
    ``path/adapter`` (ferry's output_dir). A ``path`` that is no folder but a repo id (``ORG/NAME``, an adapter
    repository ``ferry install`` placed in the hub cache) is found with :func:`ferry.hub.resolve_model`, as
    peft's ``from_pretrained`` takes a repo id.

    Raises:
        ConfigError: neither holds an adapter_config.json.
        NotInstalledError: ``path`` is neither a folder nor an installed repo id.
    """
    base = Path(path).expanduser()
    if not base.exists() and str(path).count("/") == 1 and not str(path).startswith((".", "/", "~")):
        from ferry.hub import resolve_model

        base = resolve_model(path)
    for candidate in (base, base / ADAPTER_DIRNAME):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise ConfigError(f"adapter_name_or_path: {str(path)!r} holds no {ADAPTER_CONFIG} (nor does {path}/adapter)")


def _read_json(path: Path) -> Any:
    """The JSON value in ``path``, or None when the file does not exist.

    Raises:
        ConfigError: the file is not valid JSON.
    """
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None


def read_adapter_config(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``adapter_config.json`` of ``folder`` as a dict, or None when the folder has none.

    Raises:
        ConfigError: the file is not a JSON object.
    """
    path = Path(folder) / ADAPTER_CONFIG
    data = _read_json(path)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: not a peft adapter config (a JSON object)")
    return data


# ------------------------------------------------------------------------------------------- stacked adapters


def stack_entry(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``{"path", "sha256"}`` of an adapter folder: its absolute path and the sha256 of its weights file."""
    folder = Path(folder)
    return {"path": str(folder.resolve()), "sha256": sha256_file(folder / ADAPTER_WEIGHTS)}


def read_stack_record(folder: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The adapters merged into the base of ``folder`` (:data:`STACK_RECORD`), in merge order; [] when none.

    Raises:
        ConfigError: the record is malformed.
    """
    path = Path(folder) / STACK_RECORD
    data = _read_json(path)
    if data is None:
        return []
    try:
        chain = list(data["merged_into_base"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a ferry stack record: {exc}") from None
    if not all(isinstance(e, dict) and isinstance(e.get("sha256"), str) and "path" in e for e in chain):
        raise ConfigError(f"{path}: not a ferry stack record: every entry needs a path and a sha256")
    return chain


def merged_chain(adapters: list[Path]) -> list[dict[str, str]]:
    """What a base holds after merging ``adapters`` in order: each adapter's own record, then the adapter."""
    chain: list[dict[str, str]] = []
    for folder in adapters:
        chain += read_stack_record(folder) + [stack_entry(folder)]
    return chain


def write_stack_record(folder: str | os.PathLike[str], chain: list[dict[str, str]]) -> None:
    """Write :data:`STACK_RECORD` into ``folder`` atomically (nothing when ``chain`` is empty)."""
    if chain:
        atomic_write_text(Path(folder) / STACK_RECORD, json.dumps({"merged_into_base": chain}, indent=2) + "\n")


def check_stacked(adapter: str | os.PathLike[str], base: str | os.PathLike[str] | None) -> None:
    """Refuse to apply an adapter trained on top of merged adapters to a base that lacks them: the result would be
    a silently wrong model.

    Raises:
        ConfigError: ``adapter`` records merged adapters and ``base`` is not a merge of exactly those (by sha256).
    """
    needed = read_stack_record(adapter)
    if not needed:
        return
    have = read_stack_record(base) if base is not None and Path(base).is_dir() else []
    if [e["sha256"] for e in have] != [e["sha256"] for e in needed]:
        names = ",".join(e["path"] for e in needed)
        raise ConfigError(
            f"{adapter} was trained on a base with {len(needed)} adapter(s) merged into it ({names}): "
            f"export with a merge YAML listing adapter_name_or_path: {names},{adapter} (LLaMA-Factory's "
            f"rule), or the adapter alone would give a wrong model"
        )


# ------------------------------------------------------------------------------------ quantization, vocabulary


def read_quant_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The quantised base the adapter was trained over (:data:`QUANT_RECORD`), or None for a full-precision base.

    Raises:
        ConfigError: the record is malformed (not an object, or ``quantization_bit`` not 4 or 8).
    """
    path = Path(folder) / QUANT_RECORD
    data = _read_json(path)
    if data is not None and (not isinstance(data, dict) or data.get("quantization_bit") not in (4, 8)):
        raise ConfigError(f"{path}: not a ferry quantization record (quantization_bit 4 or 8, ...)")
    return data


def write_quant_record(folder: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Write :data:`QUANT_RECORD` into ``folder`` atomically."""
    atomic_write_text(Path(folder) / QUANT_RECORD, json.dumps(record, indent=2) + "\n")


def read_vocab_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The tokens a run added and the embedding rows (:data:`VOCAB_RECORD`), or None when no token was added.

    Raises:
        ConfigError: the record is malformed (``added`` an object of token -> id, ``base_rows`` and ``rows`` ints).
    """
    path = Path(folder) / VOCAB_RECORD
    data = _read_json(path)
    if data is None:
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("added"), dict)
        or not all(isinstance(v, int) for v in data["added"].values())
        or not isinstance(data.get("rows"), int)
        or not isinstance(data.get("base_rows"), int)
    ):
        raise ConfigError(f"{path}: not a ferry vocabulary record (added, base_rows, rows)")
    return data


def write_vocab_record(folder: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Write :data:`VOCAB_RECORD` into ``folder`` atomically (``format`` 1 added when missing)."""
    atomic_write_text(Path(folder) / VOCAB_RECORD, json.dumps({"format": 1, **record}, indent=2, sort_keys=True) + "\n")


def read_rope_record(folder: str | os.PathLike[str]) -> Any:
    """The RoPE scaling the adapter was trained with (:data:`ROPE_RECORD`, a :class:`ferry.rope.RopeScaling`), or
    None when training scaled nothing.

    Raises:
        ConfigError: the record is malformed, naming the file.
    """
    from ferry.rope import RopeScaling

    path = Path(folder) / ROPE_RECORD
    data = _read_json(path)
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a ferry RoPE record (an object with rope_scaling, factor, ...)")
    return RopeScaling.from_record(data, str(path))


def write_rope_record(folder: str | os.PathLike[str], scaling: Any) -> None:
    """Write :data:`ROPE_RECORD` (``scaling``: a :class:`ferry.rope.RopeScaling`) into ``folder`` atomically."""
    atomic_write_text(Path(folder) / ROPE_RECORD, json.dumps(scaling.to_record(), indent=2) + "\n")


# ------------------------------------------------------------------------------------------------- an export


def read_value_head(folder: str | os.PathLike[str], hidden_size: int) -> dict[str, Any] | None:
    """``folder/value_head.safetensors`` as ``{"weight": [1, hidden_size], "bias": [1]}`` fp32 CPU tensors, or
    None when the folder holds none.

    Raises:
        ConfigError: the file is unreadable, lacks a key, or its shapes do not fit ``hidden_size`` (names it).
    """
    path = Path(folder) / VALUE_HEAD_FILE
    if not path.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{path}: not a readable value head ({exc})") from None
    weight, bias = VALUE_HEAD_KEYS
    for key, shape in ((weight, (1, hidden_size)), (bias, (1,))):
        got = tuple(tensors[key].shape) if key in tensors else None
        if got != shape:
            raise ConfigError(f"{path}: {key} should have shape {list(shape)} for this model, got {got or 'none'}")
    return {"weight": tensors[weight].float(), "bias": tensors[bias].float()}


def read_export_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """An export folder's lineage (:data:`EXPORT_RECORD`), or None when the folder has none.

    Raises:
        ConfigError: the record is not a JSON object.
    """
    path = Path(folder) / EXPORT_RECORD
    data = _read_json(path)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: not a ferry export record (a JSON object)")
    return data


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIRNAME",
    "ADAPTER_WEIGHTS",
    "CHAT_TEMPLATE",
    "EXPORT_RECORD",
    "QUANT_RECORD",
    "ROPE_RECORD",
    "STACK_RECORD",
    "TRAIN_CONFIG",
    "TRAIN_REPORT",
    "VOCAB_RECORD",
    "adapter_folder",
    "check_stacked",
    "merged_chain",
    "read_adapter_config",
    "read_export_record",
    "read_quant_record",
    "read_rope_record",
    "read_stack_record",
    "read_vocab_record",
    "stack_entry",
    "write_quant_record",
    "write_rope_record",
    "write_stack_record",
    "write_vocab_record",
]
