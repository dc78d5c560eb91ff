"""Reading a YAML config file that holds one ``KEY: VALUE`` mapping: ferry's training config and LLaMA-Factory's
merge and inference YAMLs.

Every mistake is one :class:`ferry.errors.ConfigError` line naming the file: missing, a folder, not UTF-8 (the line
and byte of the first bad byte), not YAML (the line and column), a key given twice, not a mapping. A UTF-8
byte-order mark is accepted (editors on Windows write one). An empty file is an empty mapping. :func:`decode_utf8`
is also how the trainer reads dataset files, with its own error type.
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


def _unique_key_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently),
    naming both lines. Merge keys (``<<``) are left to PyYAML."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    continue
                if first is not None:
                    where = f"lines {first} and {line}" if first != line else f"both on line {line}"
                    message = f"key {key!r} is given twice ({where}); keep one"
                    raise yaml.constructor.ConstructorError(None, None, message, key_node.start_mark)
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def parse_yaml_mapping(text: str, file: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping that the YAML ``text`` (read from ``file``, which errors name) holds; empty text is ``{}``.

    Raises:
        ConfigError: not valid YAML (one line: the file, the line and column, YAML's reason), a key given twice
            in one mapping, or not a mapping at its top.
    """
    import yaml

    try:
        loaded = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or "cannot be parsed").split())
        if "given twice" not in problem:
            problem = f"not valid YAML ({problem})"
        raise ConfigError(f"{file}: {where}{problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {' '.join(str(exc).split())}") from None
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


def split_names(value: Any) -> Any:
    """A config value that names one thing or several, as LLaMA-Factory's keys do (``lora_target: q_proj,v_proj``,
    ``dataset: a, b``, or a YAML list): ``"a, b,c"`` -> ``["a", "b", "c"]`` (empty parts dropped); a list or tuple
    -> its items as stripped strings; None stays None; any other type is returned as it is, for the caller's
    validation to refuse with a typed message."""
    if value is None:
        return None
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return [str(part).strip() for part in value]
    return value


__all__ = ["decode_utf8", "parse_yaml_mapping", "read_config_text", "read_yaml_mapping", "split_names"]
