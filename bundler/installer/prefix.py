"""What an installed prefix holds, read back: drift checks (``--verify-prefix``), items, the state document.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path

from bundler.format import NLTK_DATA_DIRNAME, STATE_FORMAT, WHEEL_STORE_DIRNAME
from bundler.installer.fs import check_inside, prefix_busy
from bundler.installer.hashing import Progress, size_and_sha256
from bundler.installer.manifest import content_id, manifest_digest, parse_manifest
from bundler.installer.modelscope import ms_model_dir
from bundler.installer.place import (
    completing_command,
    interrupted_label,
    journal_completed,
    journal_path,
    read_journal,
    repo_folder,
)
from bundler.installer.records import load_state, render_env_file, same_content
from bundler.installer.safetensors import tensor_digests
from bundler.installer.venv import check_venv
from ferry.errors import BundleError, UnsafeArchiveError
from ferry.serving_tools import TOOL_FILES


def engine_venvs(wheels: dict, prefix: Path, bundle_id: str) -> dict[str, tuple[str, Path]]:
    """The serving engines a wheels item carries (validated with the manifest,
    :func:`bundler.installer.manifest.validate_manifest`): name -> (its lock's path under wheels/, the environment
    ``PREFIX/venvs/<bundle_id>.engine-NAME`` it installs into)."""
    engines = wheels.get("engines") or {}
    return {name: (engines[name]["lock"], prefix / "venvs" / f"{bundle_id}.engine-{name}") for name in sorted(engines)}


def tool_files(manifest: dict) -> list[str]:
    """Names of the serving tools in the manifest's wheels item (only names of :data:`TOOL_FILES` whose pinned
    sha256 the manifest states)."""
    return sorted(
        f["path"]
        for i in manifest["items"]
        if i["kind"] == "wheels"
        for f in i["files"]
        if TOOL_FILES.get(f["path"]) == f["sha256"]
    )


def _record_key(item: dict, items_state: dict) -> str | None:
    """The key of a ModelScope model's or dataset's install record in ``state.json``'s ``items``:
    ``ms-model:ORG/NAME``, or the ``dataset:NAME`` whose record holds this repo with this content (None when
    none does)."""
    if item["kind"] == "model":
        return f"ms-model:{item['repo_id']}"
    if item["source"] == "nltk":
        return f"nltk:{item['repo_id']}"
    return next(
        (
            k
            for k, v in items_state.items()
            if k.startswith("dataset:") and v.get("repo_id") == item["repo_id"] and same_content(v, item)
        ),
        None,
    )


def _interrupted_install(prefix: Path) -> list[str]:
    """One line when an install's :class:`~bundler.installer.place.Journal` is in ``prefix``: an install is
    running, or one was interrupted (named, with the command that completes it)."""
    try:
        journal = read_journal(prefix)
    except BundleError as exc:
        return [str(exc)]
    if journal is None or journal_completed(prefix, journal):  # (complete: what it replaced is not yet deleted)
        return []
    what = interrupted_label(journal)
    if prefix_busy(prefix):
        return [f"in progress: {what} is replacing folders right now; verify again when it has finished"]
    return [
        f"interrupted: {what} did not complete ({journal_path(prefix)}): `{completing_command(journal, prefix)}` "
        "completes it; until then the next ferry command that reads the prefix puts the earlier install back"
    ]


def verify_prefix(prefix: Path, progress: Progress | None = None) -> dict:
    """Re-hash every installed file of ``prefix`` against the manifests recorded there, offline.

    Checks, for every bundle in ``PREFIX/.ferry/state.json`` (its manifest copy in ``.ferry/manifests``): each
    hub model's snapshot links and the blobs they reach (size and sha256), each dataset and ModelScope folder
    that this bundle placed last (missing, changed and extra files), the bundle's venv against the wheels'
    RECORD hashes (and each serving engine's environment), and ``ferry.env``; an install that is running or was
    interrupted comes first among the problems. Returns ``{"bundles", "files", "bytes", "problems"}`` (problems
    empty when nothing drifted).

    Raises:
        NotInstalled-like BundleError: ``prefix`` holds no install record.
    """
    prefix = Path(prefix).absolute()
    state_file = prefix / ".ferry" / "state.json"
    if not state_file.is_file():
        raise BundleError(f"{prefix} holds no ferry install record ({state_file} is missing)")
    state = load_state(prefix)
    audit = _PrefixAudit(prefix, progress, state.get("items", {}), _interrupted_install(prefix))
    bundles = state.get("bundles", {})
    for bundle_id, record in sorted(bundles.items()):
        audit.bundle(bundle_id, record)
    env_file = prefix / "ferry.env"
    if not env_file.is_file():
        audit.problems.append("missing: ferry.env")
    elif env_file.read_text("utf-8", errors="replace") != render_env_file(prefix):
        audit.problems.append("changed: ferry.env (differs from what ferry install writes)")
    return {"bundles": len(bundles), "files": audit.counts[0], "bytes": audit.counts[1], "problems": audit.problems}


class _PrefixAudit:
    """One :func:`verify_prefix` pass: ``problems`` found so far, ``counts`` (files, bytes) hashed, and ``seen``,
    the files already checked (a blob or a kept wheel shared by several bundles is hashed once)."""

    def __init__(self, prefix: Path, progress: Progress | None, items_state: dict, problems: list[str]) -> None:
        self.prefix, self.progress, self.items_state = prefix, progress, items_state
        self.problems = problems
        self.counts = [0, 0]  # files, bytes
        self.seen: set[tuple[str, str]] = set()

    def file(self, path: Path, entry: dict, label: str) -> None:
        """Hash ``path`` against the manifest ``entry`` (size and sha256); a problem named by ``label`` when it is
        missing, unreadable or changed."""
        if not os.path.lexists(path):
            self.problems.append(f"missing: {label}")
            return
        try:
            size, digest = size_and_sha256(path, self.progress)
        except OSError as exc:
            self.problems.append(f"unreadable: {label} ({exc.strerror})")
            return
        self.counts[0] += 1
        self.counts[1] += size
        if size != entry["size"] or digest != entry["sha256"]:
            self.problems.append(
                f"changed: {label} ({size} bytes, sha256 {digest[:12]}; the manifest says "
                f"{entry['size']} bytes, {entry['sha256'][:12]})"
            )

    def bundle(self, bundle_id: str, record: dict) -> None:
        """Check what the bundle ``bundle_id`` installed against its manifest copy in ``.ferry/manifests``: its
        models and datasets, serving tools, venv and kept wheels."""
        copy = self.prefix / ".ferry" / "manifests" / f"{bundle_id}.json"
        if not copy.is_file():
            self.problems.append(
                f"bundle {record.get('name')} ({bundle_id}): no manifest copy in {copy.parent} "
                f"(installed by an older ferry: install it again to record it)"
            )
            return
        try:
            manifest = parse_manifest(copy.read_bytes(), str(copy))
        except BundleError as exc:
            self.problems.append(str(exc))
            return
        if record.get("manifest_sha256") not in (None, manifest_digest(manifest)):
            self.problems.append(f"changed: {copy} (differs from the install record)")
        for item in manifest["items"]:
            if item["kind"] == "model" and item["source"] != "ms":  # hub and local models live in the HF cache
                self.hub_model(item)
            elif item["kind"] in ("model", "dataset"):
                self.folder(item, bundle_id)
        self.tools(manifest)
        if any(i["kind"] == "wheels" and i["files"] for i in manifest["items"]):
            venv = self.prefix / "venvs" / bundle_id
            if venv.is_dir():
                check_venv(venv, self.problems, self.counts)
            for item in (i for i in manifest["items"] if i["kind"] == "wheels"):
                for name, (_, engine) in engine_venvs(item, self.prefix, bundle_id).items():  # their own venvs
                    if engine.is_dir():
                        check_venv(engine, self.problems, self.counts)
                    elif venv.is_dir():  # the bundle's venv was built, so its engines were too
                        self.problems.append(f"missing: serving engine {name}'s environment {engine}")
            if record.get("wheel_store"):  # installed by a ferry that keeps the wheels (for delta bundles)
                self.kept_wheels(manifest)

    def hub_model(self, item: dict) -> None:
        """A hub model's snapshot links in ``PREFIX/hf-home/hub`` and the blobs they reach."""
        snap = self.prefix / "hf-home" / "hub" / repo_folder("model", item["repo_id"]) / "snapshots" / item["revision"]
        for entry in item["files"]:
            rel = os.path.relpath(snap / entry["path"], self.prefix)
            if (rel, entry["sha256"]) in self.seen:
                continue
            self.seen.add((rel, entry["sha256"]))
            self.file(snap / entry["path"], entry, rel)

    def folder(self, item: dict, bundle_id: str) -> None:
        """A dataset's or ModelScope model's folder, when ``bundle_id`` placed it last: missing, changed and extra
        files."""
        key = _record_key(item, self.items_state)
        placed = self.items_state.get(key or "", {})
        if placed.get("bundle_id", bundle_id) != bundle_id or not same_content(placed, item):
            return  # replaced later by another bundle (checked against that one)
        prefix = self.prefix
        dest = Path(
            placed.get("path") or ms_model_dir(prefix, item["repo_id"], item.get("revision_requested") or "master")
        )
        check_inside(os.path.realpath(prefix), dest, f"the recorded folder of {item['repo_id']}")
        for entry in item["files"]:
            self.file(dest / entry["path"], entry, os.path.relpath(dest / entry["path"], prefix))
        listed = {e["path"] for e in item["files"]}
        for root, _, names in os.walk(dest):
            for name in names:
                rel = posixpath.normpath(os.path.relpath(os.path.join(root, name), dest).replace(os.sep, "/"))
                if rel not in listed:
                    self.problems.append(f"extra file: {os.path.relpath(os.path.join(root, name), prefix)}")

    def tools(self, manifest: dict) -> None:
        """The serving tools the bundle's wheels item carries, in ``PREFIX/tools``."""
        for item in manifest["items"]:
            for entry in item["files"] if item["kind"] == "wheels" else []:
                if (
                    entry["path"] in tool_files(manifest)
                    and ("tools/" + entry["path"], entry["sha256"]) not in self.seen
                ):
                    self.seen.add(("tools/" + entry["path"], entry["sha256"]))
                    self.file(self.prefix / "tools" / entry["path"], entry, "tools/" + entry["path"])

    def kept_wheels(self, manifest: dict) -> None:
        """The bundle's wheels kept in ``PREFIX/wheels/<sha256>``."""
        for item in (i for i in manifest["items"] if i["kind"] == "wheels"):
            for entry in item["files"]:
                stored = self.prefix / WHEEL_STORE_DIRNAME / entry["sha256"]
                if (str(stored), entry["sha256"]) not in self.seen:
                    self.seen.add((str(stored), entry["sha256"]))
                    self.file(stored, entry, f"{WHEEL_STORE_DIRNAME}/{entry['sha256']} ({entry['path']})")


def _under(folder: Path, field: str) -> Callable[[dict], Path]:
    """The path of a manifest file entry inside ``folder``, named by the entry's ``field`` (``sha256`` or ``path``)."""
    return lambda entry: folder / entry[field]


def installed_items(prefix: Path) -> list[dict]:
    """Every item recorded in ``prefix`` and where its files are, from ``.ferry/state.json`` and the manifest
    copies in ``.ferry/manifests`` (nothing is hashed): one dict per distinct item, ``{"kind", "source",
    "repo_id", "revision", "revision_requested", "files": [{"path", "size", "sha256", "at"}]}`` where ``at`` is
    the installed file (``hf-home/hub/.../blobs/<sha256>`` for hub models, the dataset or ModelScope folder's
    file, ``wheels/<sha256>`` for wheels kept by the install). Items replaced later by other content, and
    wheels of bundles installed before ferry kept them, are left out; unreadable manifest copies are skipped.
    """
    prefix = Path(prefix).absolute()
    state = load_state(prefix)
    items_state = state.get("items", {})
    out: dict[tuple, dict] = {}
    hub = prefix / "hf-home" / "hub"
    for bundle_id, record in sorted(state.get("bundles", {}).items()):
        copy = prefix / ".ferry" / "manifests" / f"{bundle_id}.json"
        try:
            manifest = parse_manifest(copy.read_bytes(), str(copy))
        except (OSError, BundleError):
            continue
        for item in manifest["items"]:
            kind, source = item["kind"], item["source"]
            locate: Callable[[dict], Path]  # where an installed file of the item lies, from its manifest entry
            if kind == "wheels":
                if not record.get("wheel_store"):
                    continue
                key: tuple = ("wheels",)
                locate = _under(prefix / WHEEL_STORE_DIRNAME, "sha256")
            elif kind == "model" and source != "ms":
                repo = hub / repo_folder("model", item["repo_id"])
                key = (kind, source, item["repo_id"], item["revision"])
                locate = _under(repo / "blobs", "sha256")
            else:
                skey = _record_key(item, items_state)
                placed = items_state.get(skey or "", {})
                if not skey or not same_content(placed, item):
                    continue  # replaced later by other content
                # where plan_install puts it, under this prefix (the recorded absolute path names the prefix
                # it was installed into, which may have moved since)
                if source == "nltk":
                    dest = prefix / NLTK_DATA_DIRNAME / item["repo_id"]
                elif kind == "dataset":
                    dest = prefix / "datasets" / skey.split(":", 1)[1]
                else:
                    dest = ms_model_dir(prefix, item["repo_id"], item.get("revision_requested") or "master")
                key = (kind, source, item["repo_id"], item["revision"], content_id(item))
                locate = _under(dest, "path")
            entry = out.setdefault(
                key,
                {
                    "kind": kind,
                    "source": source,
                    "repo_id": item.get("repo_id"),
                    "revision": item.get("revision"),
                    "revision_requested": item.get("revision_requested"),
                    "files": {},
                },
            )
            for e in item["files"]:
                name = e["path"] if kind != "wheels" else e["path"]
                entry["files"].setdefault(
                    (name, e["sha256"]), {"path": name, "size": e["size"], "sha256": e["sha256"], "at": locate(e)}
                )
    result = []
    for entry in out.values():
        entry["files"] = sorted(entry["files"].values(), key=lambda f: (f["path"], f["sha256"]))
        result.append(entry)
    return result


def prefix_state(prefix: Path, *, trust_recorded: bool = False, progress: Progress | None = None) -> dict:
    """The state document of ``prefix`` (what ``ferry state`` writes): every installed file's size and sha256,
    per item and wheel, from the records of :func:`installed_items`. By default every file is read again
    (a missing file is left out, a changed one listed with what it holds now) and each safetensors file gets
    its tensor table (``tensors``: name -> ``[start, end, sha256]``, what a delta carries tensors against);
    ``trust_recorded`` takes sizes and digests from the records and only checks that each file exists (no
    tensor tables then). Install-specific values (bundle ids, times, the prefix's path) are left out, so two
    prefixes holding the same files give equal documents::

        {"format": "ferry-state", "version": 1, "trust_recorded": false,
         "items": [{"kind", "source", "repo_id", "revision", "revision_requested",
                    "files": [{"path", "size", "sha256", ["tensors"]}]}],
         "wheels": [{"path", "size", "sha256"}]}

    Raises:
        BundleError: ``prefix`` holds no install record.
    """
    prefix = Path(prefix).absolute()
    if not (prefix / ".ferry" / "state.json").is_file():
        raise BundleError(f"{prefix} holds no ferry install record ({prefix / '.ferry' / 'state.json'} is missing)")
    root = os.path.realpath(prefix)
    hashed: dict[str, tuple[int, str, dict | None]] = {}

    def observe(f: dict) -> dict | None:
        at = f["at"]
        try:
            check_inside(root, at, f"the recorded file {f['path']}")
        except UnsafeArchiveError:
            return None
        if trust_recorded:
            return {"path": f["path"], "size": f["size"], "sha256": f["sha256"]} if os.path.isfile(at) else None
        real = os.path.realpath(at)
        if real not in hashed:
            try:
                if f["path"].endswith(".safetensors"):
                    hashed[real] = tensor_digests(Path(real), progress)
                else:
                    size, digest = size_and_sha256(real, progress)
                    hashed[real] = (size, digest, None)
            except OSError:
                return None
        size, digest, tensors = hashed[real]
        out = {"path": f["path"], "size": size, "sha256": digest}
        if tensors is not None:
            out["tensors"] = tensors
        return out

    items, wheels = [], {}
    for item in installed_items(prefix):
        files = [o for o in (observe(f) for f in item["files"]) if o is not None]
        if item["kind"] == "wheels":
            for f in files:
                wheels[(f["path"], f["sha256"])] = f
            continue
        items.append(
            {**{k: item[k] for k in ("kind", "source", "repo_id", "revision", "revision_requested")}, "files": files}
        )
    items.sort(key=lambda i: (i["kind"], i["source"], i["repo_id"] or "", i["revision"] or ""))
    return {
        "format": STATE_FORMAT,
        "version": 1,
        "trust_recorded": trust_recorded,
        "items": items,
        "wheels": [wheels[k] for k in sorted(wheels)],
    }
