"""lm-eval's index of its built-in tasks, built once per lm-eval install and read back from ferry's cache.

``lm_eval.tasks.TaskManager`` parses every task YAML lm-eval ships (about 14,000 files, ~10 s on 2 cores) each
time it is made: in ``ferry pack --eval``, ``ferry eval`` and in every rank of ``ferry eval --nproc-per-node N``.
Within :func:`cached_builtin_index`, the part of that index that covers lm-eval's own ``tasks/`` folder comes
from ``FERRY_CACHE/lm-eval-index/<key>.json``: written the first time from lm-eval's own
``TaskIndex.build`` (so the entries are lm-eval's), read back in about a second. The key is a sha256 over
lm-eval's version, the folder's own path (the entries name YAML files by absolute path) and the path, size and
modification time of every YAML under it, so an upgraded, edited or other install gets its own index. Other
folders (``include_path``) are indexed by lm-eval as always, and override built-in names as lm-eval lets them.
A cache file that cannot be read is rebuilt; an index that is not plain JSON is not cached.

Written against lm-eval 0.4.13 (``lm_eval.tasks._index.TaskIndex``, ``Entry``, ``Kind``); the ``eval`` extra
pins that version.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ferry.constants import ferry_cache_dir
from ferry.fsutil import atomic_write_text

#: Folder of ``FERRY_CACHE`` holding the cached indexes.
CACHE_SUBDIR = "lm-eval-index"
log = logging.getLogger(__name__)


@contextmanager
def cached_builtin_index() -> Iterator[None]:
    """Within the block, ``TaskManager(...)`` takes the index of lm-eval's built-in tasks from ferry's cache."""
    from lm_eval.tasks import _index

    descriptor = _index.TaskIndex.__dict__["build"]
    build = _index.TaskIndex.build
    builtin = Path(_index.__file__).parent

    def cached_build(paths: Iterable[Path], *, resolve_includes: bool = True) -> dict[str, Any]:
        roots = [Path(p) for p in paths]
        if not roots or roots[0] != builtin or not resolve_includes:
            return build(roots, resolve_includes=resolve_includes)
        index = builtin_index(builtin, build)
        for name, entry in (build(roots[1:]) if roots[1:] else {}).items():  # include_path wins, as in lm-eval
            if name in index:
                log.warning(
                    "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path, index[name].yaml_path
                )
            index[name] = entry
        return index

    _index.TaskIndex.build = staticmethod(cached_build)
    try:
        yield
    finally:
        _index.TaskIndex.build = descriptor


def builtin_index(root: Path, build: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """lm-eval's index of ``root`` (its ``tasks/`` folder) as ``build([root])`` gives it, through the cache."""
    from lm_eval.tasks._index import Entry, Kind

    path = ferry_cache_dir() / CACHE_SUBDIR / f"{_key(root)}.json"
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return {
            row["name"]: Entry(
                name=row["name"],
                kind=Kind[row["kind"]],
                yaml_path=None if row["yaml_path"] is None else Path(row["yaml_path"]),
                cfg=row["cfg"],
                tags=set(row["tags"]),
            )
            for row in rows
        }
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet, or unreadable: built again below
    index = build([root])
    rows = [
        {
            "name": entry.name,
            "kind": entry.kind.name,
            "yaml_path": None if entry.yaml_path is None else str(entry.yaml_path),
            "cfg": entry.cfg,
            "tags": sorted(entry.tags),
        }
        for entry in index.values()
    ]
    try:
        atomic_write_text(path, json.dumps(rows))
    except (TypeError, ValueError, OSError) as exc:  # not plain JSON, or the cache is not writable: not cached
        log.debug("lm-eval's task index is not cached: %s", exc)
    return index


def _key(root: Path) -> str:
    """sha256 over lm-eval's version, the folder ``root`` itself and every task YAML's path, size and mtime under
    it. The folder is in the key because the entries hold absolute YAML paths: two installs of one release (uv
    links the same files, mtimes and all, into every venv) must not read each other's paths."""
    from importlib.metadata import version

    h = hashlib.sha256(f"lm-eval {version('lm-eval')}\n{root.resolve()}\n".encode())
    for yaml_path in sorted(root.glob("**/*.yaml")):
        stat = yaml_path.stat()
        h.update(f"{yaml_path.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


__all__ = ["CACHE_SUBDIR", "builtin_index", "cached_builtin_index"]
