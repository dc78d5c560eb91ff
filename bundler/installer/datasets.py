"""Dataset items: their folder under ``PREFIX/datasets``, LLaMA-Factory's ``dataset_info.json``, the hub cache.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

from bundler.format import DATASETS_CACHE_DIRNAME
from bundler.installer.fields import check_relpath
from bundler.installer.fs import atomic_symlink, atomic_text, make_temp_dir
from bundler.installer.hashing import size_and_sha256
from bundler.installer.place import Journal, place_hf
from ferry.errors import BundleError


def dataset_folder_name(repo_id: str, bundle_ids: list[str], state: dict) -> str:
    """The folder under ``PREFIX/datasets`` for a dataset: the repo's own name (``alpaca_en_demo`` for
    ``llamafactory/alpaca_en_demo`` or ``local/alpaca_en_demo``), or ``ORG--NAME`` when another dataset of this
    bundle, or one installed earlier from another repo, has the same name (so neither replaces the other).
    Repo ids are validated (:func:`check_repo_id`: no ``--``), so ``ORG--NAME`` is unambiguous."""
    name = repo_id.split("/")[-1]
    clash_here = sum(1 for other in bundle_ids if other.split("/")[-1] == name) > 1
    record = state.get("items", {}).get(f"dataset:{name}")
    clash_before = bool(record and record.get("repo_id", repo_id) != repo_id)
    return repo_id.replace("/", "--") if clash_here or clash_before else name


#: File types LLaMA-Factory loads (its FILEEXT2TYPE).
_DATA_EXTS = {".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt"}


def dataset_entries(item: dict, name: str, staged: Path) -> tuple[dict, list[str]]:
    """LLaMA-Factory ``dataset_info.json`` entries for a dataset item placed at ``datasets/<name>``.

    A ``dataset_info.json`` in the item is re-rooted (``file_name`` prefixed with ``<name>/``; other keys such
    as ``formatting``, ``columns``, ``tags`` kept); its entries without a ``file_name`` in the item (hub URLs)
    are skipped and returned as notes. A Hugging Face dataset repo in the hub layout (:func:`is_repo_layout`)
    that ``ferry pack`` could build a ``datasets`` cache of (the library reads it as one dataset) gets one entry
    ``{"<name>": {"hf_hub_url": "ORG/NAME"}}``, as LLaMA-Factory names hub datasets (ferry reads it from the hub
    cache, LLaMA-Factory through ``datasets.load_dataset``, both offline). Otherwise one entry per data file,
    named by its stem.

    Raises:
        BundleError: the item's dataset_info.json is not JSON; UnsafeArchiveError: a ``file_name`` in it is
            absolute or has ``..`` (it would point training outside the prefix).
    """
    files = [e["path"] for e in item["files"]]
    notes: list[str] = []
    entries: dict = {}
    if "dataset_info.json" in files:
        try:
            own = json.loads((staged / "dataset_info.json").read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"dataset {name}: dataset_info.json is not valid JSON: {exc}") from None
        for key, value in own.items() if isinstance(own, dict) else []:
            file_name = value.get("file_name") if isinstance(value, dict) else None
            if not isinstance(file_name, str) or not any(
                f == file_name or f.startswith(file_name.rstrip("/") + "/") for f in files
            ):
                notes.append(f"dataset_info entry {key!r} of {name} skipped (no local file in the bundle)")
                continue
            check_relpath(file_name.rstrip("/"), f"dataset {name}: dataset_info.json[{key!r}].file_name")
            entries[key] = {**value, "file_name": f"{name}/{file_name}"}
        return entries, notes
    if (
        item.get("source") == "hf"
        and is_repo_layout(files)
        and any(f.split("/")[0] == DATASETS_CACHE_DIRNAME for f in files)
    ):
        return {name: {"hf_hub_url": item["repo_id"]}}, notes
    data = [f for f in files if posixpath.splitext(f)[1].lower() in _DATA_EXTS and not f.startswith(".")]
    for f in data:
        stem = posixpath.splitext(posixpath.basename(f))[0]
        key = stem if stem not in entries else f"{name}/{stem}"
        entries[key] = {"file_name": f"{name}/{f}"}
    return entries, notes


def is_repo_layout(files: list[str]) -> bool:
    """Whether a dataset's files (POSIX paths) form a Hugging Face dataset repo that ``datasets`` loads as a
    whole: a ``README.md`` (card, maybe with ``configs``) or a ``data/`` folder at the top."""
    return any(f == "README.md" or f.startswith("data/") for f in files)


def hub_files(item: dict) -> list[dict]:
    """The item's files that belong to the repo (not the datasets cache ``ferry pack`` added)."""
    return [e for e in item["files"] if e["path"].split("/")[0] != DATASETS_CACHE_DIRNAME]


def place_hf_dataset(
    item: dict, dest: Path, prefix: Path, scratch: Path, *, reinstall: bool, journal: Journal | None = None
) -> dict:
    """Make an installed Hugging Face dataset folder ``dest`` (``PREFIX/datasets/<name>``) visible to the
    Hugging Face libraries, offline, without a second copy of its bytes:

    - ``PREFIX/hf-home/hub/datasets--ORG--NAME/`` (:func:`place_hf`: blobs, snapshot, refs as for models),
      its blobs hard links of the files in ``dest`` (copies where the file system refuses links), so that
      ``snapshot_download(repo_id, repo_type="dataset")`` and ``hf_hub_download`` find the repo;
    - ``PREFIX/hf-home/datasets/ORG___name`` -> ``../../datasets/<name>/.ferry-datasets-cache/ORG___name``, the
      ``datasets`` Arrow cache that ``ferry pack`` built (bundler/hub_datasets.py), where
      ``datasets.load_dataset("ORG/NAME")`` looks when offline. A real folder already there (the user's own
      cache) is left alone and reported.

    Returns ``{"hub_path", "arrow_cache", "repaired", "notes"}``.
    """
    files = hub_files(item)
    links = make_temp_dir("hub-dataset-", scratch)
    for entry in files:
        target = links / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(dest / entry["path"], target)
        except OSError:  # another file system under the prefix, or no hard links there
            shutil.copyfile(dest / entry["path"], target)
    placed = place_hf(
        {**item, "files": files},
        links,
        prefix / "hf-home" / "hub",
        scratch,
        repo_type="dataset",
        reinstall=reinstall,
        journal=journal,
    )
    shutil.rmtree(links, ignore_errors=True)
    notes: list[str] = []
    arrow = None
    cache_root = dest / DATASETS_CACHE_DIRNAME
    folders = sorted(p.name for p in cache_root.iterdir() if p.is_dir()) if cache_root.is_dir() else []
    for folder in folders:
        link = prefix / "hf-home" / "datasets" / folder
        want = os.path.relpath(cache_root / folder, link.parent)
        if os.path.lexists(link) and not os.path.islink(link):
            notes.append(
                f"{link} is a folder of its own (not ferry's): left alone, so datasets.load_dataset("
                f"{item['repo_id']!r}) offline reads that cache, not the installed revision"
            )
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (os.path.islink(link) and os.readlink(link) == want):
            if journal is not None:
                journal.keep(link)
            atomic_symlink(want, link)
        arrow = str(link)
    return {"hub_path": placed["path"], "arrow_cache": arrow, "repaired": placed["repaired"], "notes": notes}


def read_dataset_info(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        current = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); fix or remove it and install again") from None
    if not isinstance(current, dict):
        raise BundleError(f"{path}: expected a JSON object; fix or remove it and install again")
    return current


def _item_path(plans: list[dict], entry: dict) -> str:
    """The bundle path of the dataset item that a new ``dataset_info.json`` entry belongs to."""
    name = entry["file_name"].split("/")[0]
    return next(p["item"]["path"] for p in plans if p["kind"] == "dataset" and p["name"] == name)


def _entry_content(base: Path, entry: Any, rename: tuple[str, str] | None = None) -> Any:
    """What a ``dataset_info.json`` entry means: its keys other than ``file_name`` and the (path, sha256) of the
    data it names (a file, or every file of a folder) under ``base``. ``rename`` maps the entry's first path
    component (the installed folder name) to the item's folder in the staged bundle. Two entries with equal
    content name the same data, whatever folder holds it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str):
        return entry
    rel = entry["file_name"]
    if rename is not None:
        rel = rename[1] + rel[len(rename[0]) :]
    target = Path(os.path.realpath(base / rel))
    files: list[tuple[str, str]] = []
    if target.is_file():
        files.append(("", size_and_sha256(target)[1]))
    elif target.is_dir():
        for root, _, names in os.walk(target):
            for name in sorted(names):
                full = Path(root) / name
                files.append((os.path.relpath(full, target), size_and_sha256(full)[1]))
    else:
        return None
    return ({k: v for k, v in entry.items() if k != "file_name"}, sorted(files))


def taken_entries(entries: dict, info_path: Path, plans: list[dict], prefix: Path, staged: Path) -> list[str]:
    """The names among ``entries`` (new ``dataset_info.json`` entries of the staged bundle ``staged``) that the
    registry at ``info_path`` already gives to other data: another entry of that name whose content
    (:func:`_entry_content`: its keys and the sha256 of the data it names under ``PREFIX/datasets``) differs.
    ``plans`` are :func:`bundler.installer.plan.plan_install`'s, which say which item each entry belongs to.

    Raises:
        BundleError: the registry is not a JSON object (see :func:`read_dataset_info`).
    """
    current = read_dataset_info(info_path)
    return sorted(
        k
        for k, v in entries.items()
        if k in current
        and current[k] != v
        and (
            "file_name" not in v
            or _entry_content(prefix / "datasets", current[k])
            != _entry_content(staged, v, rename=(v["file_name"].split("/")[0], _item_path(plans, v)))
        )
    )


def merge_dataset_info(path: Path, entries: dict) -> None:
    """Merge ``entries`` into LLaMA-Factory's ``dataset_info.json`` at ``path`` (new entries win), atomically."""
    current = read_dataset_info(path)
    merged = {**current, **entries}
    if merged != current or not path.exists():
        atomic_text(path, json.dumps(merged, indent=2, ensure_ascii=False) + "\n")
