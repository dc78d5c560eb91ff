"""Reading a YAML config file that holds one ``KEY: VALUE`` mapping: ferry's training config and LLaMA-Factory's
merge and inference YAMLs.

Every mistake is one :class:`ferry.errors.ConfigError` line naming the file: missing, a folder, not UTF-8 (the line
and byte of the first bad byte), not YAML, not a mapping. A UTF-8 byte-order mark is accepted (editors on Windows
write one). An empty file is an empty mapping. :func:`decode_utf8` is also how the trainer reads dataset files,
with its own error type.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, FerryError


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of the config file ``path``, decoded as UTF-8 (a byte-order mark dropped).

    Raises:
        ConfigError: the file is missing, is a folder, or is not UTF-8 (naming the line and byte offset).
    """
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {str(file)!r} is a directory, not a YAML file")
    if not file.is_file():
        raise ConfigError(f"config file {str(file)!r} does not exist")
    return decode_utf8(file.read_bytes(), file)


def decode_utf8(data: bytes, path: str | os.PathLike[str], error: type[FerryError] = ConfigError) -> str:
    """``data`` (the bytes of the file ``path``) decoded as UTF-8, a leading byte-order mark dropped.

    Raises:
        error: one line naming the file, the line (1-based) and the byte offset of the first bad byte.
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{path}: line {line}: byte offset {exc.start}: not UTF-8 (byte 0x{data[exc.start]:02x}); "
            f"save the file as UTF-8"
        ) from None


def parse_yaml_mapping(text: str, file: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping that the YAML ``text`` (read from ``file``, which errors name) holds; empty text is ``{}``.

    Raises:
        ConfigError: not valid YAML, or not a mapping at its top.
    """
    import yaml

    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: expected a mapping of KEY: VALUE, got {type(loaded).__name__}")
    return loaded


def read_yaml_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``KEY: VALUE`` mapping of the YAML config file ``path``.

    Raises:
        ConfigError: as :func:`read_config_text` and :func:`parse_yaml_mapping`.
    """
    return parse_yaml_mapping(read_config_text(path), path)


__all__ = ["decode_utf8", "parse_yaml_mapping", "read_config_text", "read_yaml_mapping"]
