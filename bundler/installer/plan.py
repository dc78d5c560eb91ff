"""Where every item of a bundle goes in the prefix, resolved and proven to lie inside it before the first write.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from bundler.format import NLTK_DATA_DIRNAME, WHEEL_STORE_DIRNAME
from bundler.installer.datasets import dataset_folder_name, read_dataset_info
from bundler.installer.fs import check_inside
from bundler.installer.manifest import manifest_digest
from bundler.installer.modelscope import ms_model_dir
from bundler.installer.place import repo_folder
from bundler.installer.records import same_content
from ferry.errors import BundleError


def plan_install(manifest: dict, prefix: Path, state: dict, *, replace_datasets: bool = False) -> list[dict]:
    """Where every item of a validated ``manifest`` goes under ``prefix``, checked before the first write.

    Returns one plan per item: ``{"item", "kind", "dest"}`` (+ ``"name"``, ``"key"`` for datasets and
    ModelScope models, ``"repo_dir"`` for hub models). Every destination (venv, snapshot, blobs, refs, dataset
    and ModelScope folders, dataset_info.json, ferry.env, the install record) is resolved with the symbolic
    links already present in the prefix and must lie inside it.

    Raises:
        UnsafeArchiveError: a destination resolves outside the prefix (the field and the path are named).
        BundleError: the same bundle_id is installed with other content; a dataset name, or an entry of
            ``dataset_info.json``, is taken by other content and ``replace_datasets`` is not set.
    """
    root = os.path.realpath(prefix)
    record = state.get("bundles", {}).get(manifest["bundle_id"])
    if record and record.get("manifest_sha256") not in (None, manifest_digest(manifest)):
        raise BundleError(
            f"bundle ID {manifest['bundle_id']} ({manifest['name']}) already installed with "
            f"different content: refused (a forged or altered bundle re-uses a genuine bundle's id)"
        )
    checks: list[tuple[Path, str]] = [
        (prefix / "venv", "the venv link"),
        (prefix / "venvs" / manifest["bundle_id"], "the bundle's venv"),
        (prefix / "ferry.env", "ferry.env"),
        (prefix / ".ferry" / "state.json", "the install record"),
        (prefix / "datasets" / "dataset_info.json", "dataset_info.json"),
        (prefix / WHEEL_STORE_DIRNAME, "the wheel store"),
    ]
    plans: list[dict] = []
    dataset_ids = [i["repo_id"] for i in manifest["items"] if i["kind"] == "dataset"]
    read_dataset_info(prefix / "datasets" / "dataset_info.json")  # an unreadable registry: refused up front
    hub = prefix / "hf-home" / "hub"
    for i, item in enumerate(manifest["items"]):
        kind, source = item["kind"], item["source"]
        here = f"items[{i}] ({item.get('repo_id') or kind})"
        if kind == "wheels":
            continue
        if kind == "model" and source == "ms":
            plan, more = _plan_ms_model(item, prefix, here)
        elif kind == "model":
            plan, more = _plan_hub_model(item, hub, here)
        elif source == "nltk":  # NLTK data: PREFIX/nltk_data/SUBDIR/ID, where NLTK_DATA (ferry.env) points
            plan, more = _plan_nltk(item, prefix, here)
        else:
            name = dataset_folder_name(item["repo_id"], dataset_ids, state)
            plan, more = _plan_dataset(item, name, prefix, hub, here)
        plans.append(plan)
        checks += more
        if plan["kind"] in ("nltk", "dataset"):
            _check_replace(state.get("items", {}).get(plan["key"]), item, plan["dest"], plan["name"], replace_datasets)
    for path, what in checks:
        check_inside(root, path, what)
    return plans


#: A plan of :func:`plan_install` and the destinations it writes, each with what it is (for the error).
_Planned = tuple[dict, list[tuple[Path, str]]]


def _plan_ms_model(item: dict, prefix: Path, here: str) -> _Planned:
    """A ModelScope model: its folder in modelscope-hub's layout under ``PREFIX/modelscope``."""
    dest = ms_model_dir(prefix, item["repo_id"], item.get("revision_requested") or "master")
    plan = {"item": item, "kind": "ms-model", "dest": dest, "key": f"ms-model:{item['repo_id']}"}
    return plan, [(dest, f"{here}: the ModelScope folder")]


def _plan_hub_model(item: dict, hub: Path, here: str) -> _Planned:
    """A hub (or local) model in the Hugging Face cache ``hub``: its blobs, refs and snapshot, and the folders of
    the snapshot's files when an earlier install left the snapshot there."""
    repo_dir = hub / repo_folder("model", item["repo_id"])
    plan = {"item": item, "kind": "hf-model", "repo_dir": repo_dir, "dest": repo_dir}
    checks = [
        (repo_dir / "blobs", f"{here}: blobs"),
        (repo_dir / "refs", f"{here}: refs"),
        (repo_dir / "snapshots" / item["revision"], f"{here}: the snapshot"),
    ]
    requested = item.get("revision_requested")
    if requested:
        checks.append((repo_dir / "refs" / requested, f"{here}: refs/{requested}"))
    snap = repo_dir / "snapshots" / item["revision"]
    if snap.is_dir():
        checks += [((snap / e["path"]).parent, f"{here}: {e['path']}") for e in item["files"]]
    return plan, checks


def _plan_nltk(item: dict, prefix: Path, here: str) -> _Planned:
    """NLTK data: ``PREFIX/nltk_data/SUBDIR/ID``."""
    dest = prefix / NLTK_DATA_DIRNAME / item["repo_id"]
    key = f"nltk:{item['repo_id']}"
    plan = {"item": item, "kind": "nltk", "dest": dest, "name": item["repo_id"], "key": key}
    return plan, [(dest, f"{here}: the NLTK data folder")]


def _plan_dataset(item: dict, name: str, prefix: Path, hub: Path, here: str) -> _Planned:
    """A dataset: its folder ``PREFIX/datasets/NAME`` and, for a hub dataset (also placed in the hub cache, its
    datasets cache linked: :func:`place_hf_dataset`), the hub cache's folders."""
    dest = prefix / "datasets" / name
    key = f"dataset:{name}"
    plan = {"item": item, "kind": "dataset", "dest": dest, "name": name, "key": key}
    checks = [(dest, f"{here}: the dataset folder")]
    if item["source"] == "hf":
        repo_dir = hub / repo_folder("dataset", item["repo_id"])
        checks += [
            (repo_dir / "blobs", f"{here}: blobs"),
            (repo_dir / "refs", f"{here}: refs"),
            (repo_dir / "snapshots" / item["revision"], f"{here}: the snapshot"),
            (prefix / "hf-home" / "datasets", f"{here}: the datasets cache"),
        ]
        if item.get("revision_requested"):
            checks.append(
                (repo_dir / "refs" / item["revision_requested"], f"{here}: refs/{item['revision_requested']}")
            )
    return plan, checks


def _check_replace(old: dict | None, item: dict, dest: Path, name: str, replace_datasets: bool) -> None:
    """Refuse to replace a dataset (or NLTK) folder installed with other content unless ``replace_datasets``.

    Raises:
        BundleError: naming the dataset, its folder and both revisions.
    """
    if not replace_datasets and os.path.lexists(dest) and not same_content(old, item):
        was = f"revision {old['revision'][:12]}" if old and old.get("revision") else "unknown content"
        raise BundleError(
            f"dataset {name!r} is already installed at {dest} with other content ({was}; "
            f"this bundle has {item['revision'][:12]}): refused; install with "
            f"--replace-datasets to replace it"
        )
