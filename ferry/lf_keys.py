"""LLaMA-Factory's own keys, by command, as its parsers take them (``ferry/lf_keys.json``).

The table is read from LLaMA-Factory 0.9.5's argument dataclasses (``llamafactory/hparams``) by
``tests/golden/make_lf_keys.py``, never written by hand; tests/test_lf_keys.py checks that it still is that output.
``train``: the keys of its training parser of its own (transformers' ``TrainingArguments`` are not listed);
``infer``: ``llamafactory-cli chat`` and ``export`` (model, data, fine-tuning and generation arguments); ``eval``.
Each key has its default when that is a literal (``"literal": true``) and the dataclass that declares it.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

#: The commands of the table.
COMMANDS = ("train", "infer", "eval")


@functools.cache
def _table() -> dict[str, Any]:
    return json.loads(resources.files("ferry").joinpath("lf_keys.json").read_text(encoding="utf-8"))


def lf_keys(command: str) -> dict[str, dict[str, Any]]:
    """``{key: {"default": ..., "literal": bool, "class": ...}}`` of LLaMA-Factory's parser for ``command``
    (:data:`COMMANDS`).

    Raises:
        KeyError: an unknown command.
    """
    return _table()["commands"][command]


#: Keys of LLaMA-Factory's chat and export parsers that ferry does not apply there and that change which model is
#: loaded or what it computes: at any value but LLaMA-Factory's default they are refused, never ignored.
CHANGES_THE_MODEL = {
    "model_revision": "ferry loads the installed snapshot of the model (the revision its bundle carried); leave "
    "model_revision out, or pack and install that revision",
    "rope_scaling": "ferry loads the base with the RoPE scaling its adapter was trained with (the adapter's "
    "ferry_rope.json), never another: set rope_scaling in the training config, or leave it out here",
    "quantization_bit": "LLaMA-Factory loads the model quantized with bitsandbytes; ferry loads it in infer_dtype: "
    "leave quantization_bit out",
}


def _trained_rope_type(data: dict[str, Any]) -> str | None:
    """The ``rope_scaling`` the YAML's last adapter (``adapter_name_or_path``) was trained with (its
    ``ferry_rope.json``), or None (no adapter, none found, or no record)."""
    from ferry.adapter_folder import adapter_folder, read_rope_record
    from ferry.errors import FerryError
    from ferry.yaml_config import split_names

    names = split_names(data.get("adapter_name_or_path"))
    if not isinstance(names, list) or not names:
        return None
    try:
        record = read_rope_record(adapter_folder(names[-1]))
    except FerryError:
        return None  # the adapter itself is checked, with its own message, where it is loaded
    return None if record is None else str(record.rope_type)


def refuse_model_changes(data: dict[str, Any], where: str, used: tuple[str, ...] = ()) -> None:
    """Refuse a key of :data:`CHANGES_THE_MODEL` (other than those in ``used``, which the caller applies) that
    ``data`` sets to anything but LLaMA-Factory's default; ``rope_scaling`` equal to the scaling the adapter was
    trained with (its ``ferry_rope.json``, :mod:`ferry.rope`) is what ferry applies anyway, and passes.

    Raises:
        ConfigError: ``WHERE: KEY: why, and what to do`` in one line.
    """
    from ferry.errors import ConfigError

    infer = lf_keys("infer")
    for key, message in CHANGES_THE_MODEL.items():
        if key in data and key not in used and data[key] != infer[key]["default"]:
            if key == "rope_scaling" and data[key] == _trained_rope_type(data):
                continue  # the scaling the adapter was trained with, which ferry applies
            raise ConfigError(f"{where}: {key}: {data[key]!r}: {message}")


def lf_version() -> str:
    """The LLaMA-Factory release the table was read from."""
    return str(_table()["llamafactory"])


__all__ = ["CHANGES_THE_MODEL", "COMMANDS", "lf_keys", "lf_version", "refuse_model_changes"]
