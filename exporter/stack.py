"""Adapters trained on top of merged adapters (``adapter_name_or_path`` with several adapters, or with
``create_new_adapter``): the record of which adapters their base holds, and the check that keeps such an adapter
off a base without them (the export would be a silently wrong model). Used by the trainer when it writes the
adapter and by :func:`exporter.export.export` before it merges."""

from __future__ import annotations

import os
from pathlib import Path

from ferry.errors import ConfigError


#: Written into an adapter folder trained on top of merged adapters (``adapter_name_or_path`` with
#: ``create_new_adapter``, or several adapters), and into an intermediate base of a stacked merge: the adapters merged
#: into its base, in order, as ``{"merged_into_base": [{"path", "sha256"}]}`` (sha256 of adapter_model.safetensors).
STACK_RECORD = "ferry_base_adapters.json"


def stack_entry(folder: Path) -> dict[str, str]:
    """``{"path", "sha256"}`` of an adapter folder (the sha256 of its adapter_model.safetensors identifies it across
    hosts, wherever it was copied)."""
    from ferry.fsutil import sha256_file

    return {"path": str(folder.resolve()), "sha256": sha256_file(folder / "adapter_model.safetensors")}


def stack_record(folder: Path) -> list[dict[str, str]]:
    """The adapters merged into ``folder``'s base (``STACK_RECORD``), [] when none are recorded."""
    import json

    file = Path(folder) / STACK_RECORD
    if not file.is_file():
        return []
    try:
        return list(json.loads(file.read_text(encoding="utf-8"))["merged_into_base"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{file}: not a ferry stack record: {exc}") from None


def merged_chain(adapters: list[Path]) -> list[dict[str, str]]:
    """What a base holds after merging ``adapters`` in order: each one's own record, then itself."""
    chain: list[dict[str, str]] = []
    for folder in adapters:
        chain += stack_record(folder) + [stack_entry(folder)]
    return chain


def write_stack_record(folder: Path, chain: list[dict[str, str]]) -> None:
    """Write ``STACK_RECORD`` into ``folder`` (nothing when ``chain`` is empty)."""
    import json

    from ferry.fsutil import atomic_write_text

    if chain:
        atomic_write_text(Path(folder) / STACK_RECORD, json.dumps({"merged_into_base": chain}, indent=2) + "\n")


def check_stacked(adapter: str | os.PathLike, base: str | os.PathLike | None) -> None:
    """Refuse to apply an adapter trained on top of merged adapters to a base that lacks them (a silently wrong
    model otherwise).

    Raises:
        ConfigError: the adapter records merged adapters and ``base`` is not a merge of exactly those (by sha256).
    """
    needed = stack_record(Path(adapter))
    if not needed:
        return
    have = stack_record(Path(base)) if base is not None and Path(str(base)).is_dir() else []
    if [e["sha256"] for e in have] != [e["sha256"] for e in needed]:
        names = ",".join(e["path"] for e in needed)
        raise ConfigError(f"{adapter} was trained on a base with {len(needed)} adapter(s) merged into it ({names}): "
                          f"export with a merge YAML listing adapter_name_or_path: {names},{adapter} (LLaMA-Factory's "
                          f"rule), or the adapter alone would give a wrong model")


def adapter_folder(path: str | os.PathLike) -> Path:
    """``path`` when it holds adapter_config.json (LLaMA-Factory's output_dir, an adapter folder), else
    ``path/adapter`` (ferry's output_dir).

    Raises:
        ConfigError: neither holds an adapter_config.json.
    """
    base = Path(path).expanduser()
    for candidate in (base, base / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise ConfigError(f"adapter_name_or_path: {str(path)!r} holds no adapter_config.json (nor does {path}/adapter)")
