"""A folder of the user's own lm-eval task YAMLs whose ``data_files`` are relative to the YAML that names them.

lm-eval hands ``dataset_kwargs.data_files`` to ``datasets.load_dataset`` as written, and ``datasets`` reads a
relative path against the working directory: a task folder then works only when the command runs from one
place. A folder carried in a bundle (``ferry pack --dataset ./my_tasks``) is installed somewhere else, so
``ferry eval`` reads a relative ``data_files`` entry against the YAML's own folder when the file is there (and
not under the working directory): :func:`localized` copies the folder and writes those entries as absolute paths
into the copy's YAMLs. The YAMLs are rewritten through PyYAML's node tree (``compose`` / ``serialize``), which
keeps lm-eval's ``!function`` tags; everything else in the folder is copied unchanged.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _data_file_nodes(root: Any) -> Iterator[Any]:
    """Every scalar node under ``dataset_kwargs.data_files`` of a YAML document's top mapping."""
    import yaml

    if not isinstance(root, yaml.MappingNode):
        return
    for key, value in root.value:
        if getattr(key, "value", None) != "dataset_kwargs" or not isinstance(value, yaml.MappingNode):
            continue
        for inner_key, files in value.value:
            if getattr(inner_key, "value", None) == "data_files":
                yield from _scalars(files)


def _scalars(node: Any) -> Iterator[Any]:
    import yaml

    if isinstance(node, yaml.ScalarNode):
        yield node
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _scalars(item)
    elif isinstance(node, yaml.MappingNode):
        for _, item in node.value:
            yield from _scalars(item)


def _rewritten(yaml_path: Path) -> str | None:
    """The YAML's text with its YAML-relative ``data_files`` made absolute, or None when nothing changes (or the
    file is not a YAML mapping PyYAML can compose: lm-eval will say what is wrong with it)."""
    import yaml

    try:
        root = yaml.compose(yaml_path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    changed = False
    for node in _data_file_nodes(root):
        value = str(node.value)
        if "://" in value or Path(value).is_absolute() or Path(value).exists():
            continue
        beside = yaml_path.parent / value
        if beside.exists():
            node.value, node.style = str(beside.resolve()), None
            changed = True
    return yaml.serialize(root) if changed else None


def localized(folder: Path, scratch: Path) -> Path:
    """``folder`` itself when no task YAML in it names a YAML-relative data file; else a copy of it in
    ``scratch`` whose YAMLs name those files by absolute paths (into ``folder``)."""
    rewrites = {p: text for p in sorted(folder.rglob("*.y*ml")) if (text := _rewritten(p)) is not None}
    if not rewrites:
        return folder
    copy = scratch / folder.name
    shutil.copytree(folder, copy, symlinks=True)
    for path, text in rewrites.items():
        (copy / path.relative_to(folder)).write_text(text, encoding="utf-8")
    return copy


__all__ = ["localized"]
