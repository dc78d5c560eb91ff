"""Placing verified content into the prefix: the Hugging Face cache, whole folders, the wheel store.

Everything moves in from the staging directory by renames (or hard links); a folder that is replaced is swapped
out through the :class:`Journal`, so an install killed half-way is rolled back by the next one. Standard library
and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from bundler.format import WHEEL_STORE_DIRNAME
from bundler.installer.fields import check_relpath
from bundler.installer.fs import atomic_symlink, atomic_text, make_temp_dir
from bundler.installer.hashing import same_file, same_inode
from bundler.installer.manifest import content_id
from bundler.installer.records import same_content
from ferry.constants import INSTALL_JOURNAL
from ferry.errors import BundleError
from ferry.faults import kill_point


def repo_folder(repo_type: str, repo_id: str) -> str:
    """huggingface_hub's cache folder name: ``models--ORG--NAME`` (as ``repo_folder_name``)."""
    return "--".join([f"{repo_type}s", *repo_id.split("/")])


def place_hf(
    item: dict,
    src: Path,
    hub_dir: Path,
    scratch: Path,
    repo_type: str = "model",
    reinstall: bool = False,
    journal: Journal | None = None,
) -> dict:
    """Place one item's staged files ``src/<path>`` into the Hugging Face cache ``hub_dir`` (HF_HOME/hub).

    Blobs move by rename to ``blobs/<sha256>`` unless an identical blob is already there (shared; its bytes
    are re-hashed, and a corrupt or truncated one is replaced: a re-install repairs); the snapshot
    ``snapshots/<revision>/`` is built in ``scratch`` (the staging directory, same file system) and renamed in
    whole, or, when it already exists (another bundle, other include patterns), missing or wrong links are
    set one by one (each atomic). ``refs/main`` is written only when ``main`` itself was packed (the requested
    revision was ``main`` or none); a named branch or tag gets ``refs/<name>`` (a changed ref is kept in
    ``journal`` first). ``reinstall``: this item's
    bundle was installed before, so a missing snapshot file is a repair. Returns ``{"path",
    "blobs_added", "blobs_shared", "repaired"}`` (``repaired``: installed files that were missing or wrong).
    """
    repo_id = item["repo_id"]
    revision = item["revision"]
    repo_dir = hub_dir / repo_folder(repo_type, repo_id)
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    added = shared = 0
    repaired: list[str] = []
    for entry in item["files"]:
        blob = blobs / entry["sha256"]
        staged = src / entry["path"]
        if blob.exists() and (same_inode(staged, blob) or same_file(blob, entry["size"], entry["sha256"])):
            shared += 1  # (a delta's staged link of this very blob was hashed before the install began)
            continue
        if os.path.lexists(blob):
            repaired.append(f"{repo_id}: {entry['path']} (blob {entry['sha256'][:12]} was corrupt)")
        os.replace(staged, blob)
        added += 1
    snapshots = repo_dir / "snapshots"
    snapshots.mkdir(exist_ok=True)
    snap = snapshots / revision
    if not snap.exists():
        tmp = make_temp_dir(f"snapshot-{revision}-", scratch)
        try:
            for entry in item["files"]:
                link = tmp / entry["path"]
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.relpath(blobs / entry["sha256"], (snap / entry["path"]).parent), link)
            os.rename(tmp, snap)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    else:
        for entry in item["files"]:
            link = snap / entry["path"]
            want = os.path.relpath(blobs / entry["sha256"], link.parent)
            if os.path.islink(link) and os.readlink(link) == want:
                continue
            if os.path.lexists(link):
                repaired.append(f"{repo_id}: {entry['path']} (snapshot link was wrong)")
            elif reinstall:  # this bundle placed it before: it went missing
                repaired.append(f"{repo_id}: {entry['path']} (snapshot file was missing)")
            link.parent.mkdir(parents=True, exist_ok=True)
            atomic_symlink(want, link)
    refs = repo_dir / "refs"
    requested = item.get("revision_requested")
    if requested and requested != revision and requested != "main":
        _write_ref(refs / requested, revision, journal)
    if requested in (None, "", "main"):
        _write_ref(refs / "main", revision, journal)
    return {"path": str(snap), "blobs_added": added, "blobs_shared": shared, "repaired": repaired}


def _write_ref(path: Path, revision: str, journal: Journal | None) -> None:
    if path.is_file() and path.read_text().strip() == revision:
        return
    if journal is not None:
        journal.keep(path)
    atomic_text(path, revision)
    kill_point("install:ref")


def _tree_matches(dest: Path, item: dict) -> list[str]:
    """Files of ``item`` that are missing or differ under an installed folder ``dest`` (re-hashed)."""
    return [e["path"] for e in item["files"] if not same_file(dest / e["path"], e["size"], e["sha256"])]


def journal_path(prefix: Path) -> Path:
    """Where an install that is swapping folders keeps its :class:`Journal`: ``PREFIX/.ferry/journal.json``."""
    return prefix / INSTALL_JOURNAL


def read_journal(prefix: Path) -> dict | None:
    """The journal an install left in ``prefix`` (a dict), or None when there is none.

    Raises:
        BundleError: the journal is there but unreadable (named, with what to do).
    """
    path = journal_path(prefix)
    try:
        journal = json.loads(path.read_text("utf-8"))
        list(journal["entries"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        raise BundleError(
            f"{path} is unreadable: an earlier install was interrupted; inspect "
            f"{prefix / '.ferry' / 'replaced'} and remove the journal"
        ) from None
    return journal


def interrupted_label(journal: dict) -> str:
    """``"the install of NAME (from SOURCE, started TIME)"`` for messages, or ``"an earlier install"`` for a
    journal written by an older ferry that did not record the bundle."""
    if not journal.get("bundle"):
        return "an earlier install"
    where = f"from {journal['source']}, " if journal.get("source") else ""
    return f"the install of {journal['bundle']} ({where}started {journal.get('started', '?')})"


def journal_completed(prefix: Path, journal: dict) -> bool:
    """True when the install that left ``journal`` wrote its install record (``state.json`` is the one it named):
    only its clean-up is undone."""
    state = prefix / ".ferry" / "state.json"
    want = journal.get("state_sha256")
    return bool(want) and state.is_file() and hashlib.sha256(state.read_bytes()).hexdigest() == want


def completing_command(journal: dict, prefix: Path) -> str:
    """The command that installs an interrupted journal's bundle again (which first puts the earlier install
    back, then completes this one); a generic one for a journal written by an older ferry."""
    source = journal.get("source") or "BUNDLE"
    flag = " --replace-datasets" if journal.get("replace_datasets") else ""
    return f"ferry install {source} --prefix {prefix}{flag}"


class Journal:
    """What an install changed in place, kept until the install is complete (``PREFIX/.ferry/journal.json``).

    Before a dataset or ModelScope folder is replaced, the journal records ``{"dest", "old"}`` and the old folder
    moves to ``PREFIX/.ferry/replaced/`` (not into the staging area, which the next install deletes). Before a
    small file or link that readers follow is first changed (``datasets/dataset_info.json``, a hub repo's
    ``refs/*``, the ``venv`` link, ``ferry.env``, the ``datasets`` Arrow-cache links), :meth:`keep` records its
    text, its target or its absence. Just before the install record (``state.json``) is written, :meth:`completing`
    records that record's sha256; :meth:`commit` then deletes the old folders and the journal.

    An install killed in between leaves the journal, and :meth:`roll_back` (the next install, or any command that
    reads the prefix) finishes it: when ``state.json`` is the one the journal names, the install had completed
    and only its clean-up is done; otherwise every old folder, file and link is put back, so the prefix again
    matches its install record (nothing is lost, however often installs are killed). What an install only adds
    (blobs, snapshots, a new venv, kept wheels) is left: nothing the record names reaches it.
    """

    def __init__(
        self, prefix: Path, bundle: str | None = None, source: str | None = None, replace_datasets: bool = False
    ) -> None:
        self.prefix = prefix
        self.path = journal_path(prefix)
        self.bundle, self.source, self.replace_datasets = bundle, source, replace_datasets
        self.entries: list[dict] = []
        self.kept: dict[str, dict] = {}
        self.state_sha256: str | None = None

    def _save(self) -> None:
        record = {
            "bundle": self.bundle,  # the bundle's name and where it was installed from: what an interrupted
            "source": self.source,  # install is named by (`ferry verify --prefix`, the roll-back's line)
            "started": self.started,
            "replace_datasets": self.replace_datasets,
            "entries": self.entries,
            "kept": self.kept,
            "state_sha256": self.state_sha256,
        }
        atomic_text(self.path, json.dumps(record, indent=2) + "\n")

    @functools.cached_property
    def started(self) -> str:
        """When the install first changed something in place (UTC, ISO 8601)."""
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def keep(self, path: Path) -> None:
        """Remember the small text file or symbolic link ``path`` (its text, its target, or that it is absent)
        before this install first changes it."""
        rel = str(path.relative_to(self.prefix))
        if rel in self.kept:
            return
        if os.path.islink(path):
            self.kept[rel] = {"link": os.readlink(path)}
        elif path.is_file():
            self.kept[rel] = {"text": path.read_text("utf-8")}
        else:
            self.kept[rel] = {}
        self._save()

    def completing(self, state_text: str) -> None:
        """Record the sha256 of the install record about to be written: once it is in place, the install is
        complete, whatever of the clean-up a kill left undone."""
        if self.entries or self.kept:  # (else there is nothing to put back or clean up)
            self.state_sha256 = hashlib.sha256(state_text.encode("utf-8")).hexdigest()
            self._save()

    def swap(self, src: Path, dest: Path) -> None:
        """Replace the folder ``dest`` by ``src``: the old one is recorded and kept in ``.ferry/replaced``."""
        self.retire(dest)
        kill_point("install:swap-aside")
        os.rename(src, dest)
        kill_point("install:swap-in")

    def retire(self, path: Path) -> None:
        """Move the folder ``path`` out of the way (deleted by :meth:`commit`, put back by :meth:`roll_back`)."""
        aside = self.prefix / ".ferry" / "replaced"
        aside.mkdir(parents=True, exist_ok=True)
        old = make_temp_dir("old-", aside) / path.name
        self.entries.append({"dest": str(path.relative_to(self.prefix)), "old": str(old.relative_to(self.prefix))})
        self._save()
        os.rename(path, old)

    def commit(self) -> None:
        """The install is complete: drop what was swapped out and the journal."""
        shutil.rmtree(self.prefix / ".ferry" / "replaced", ignore_errors=True)
        kill_point("install:commit")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def roll_back(self, log: Callable[[str], None]) -> str | None:
        """Finish an install that was killed before it completed (see the class docstring): ``"completed"`` when
        it had written its install record (only the clean-up was left), ``"restored"`` when the earlier install
        was put back (one ``log`` line per folder, file or link), None when there was no journal.

        Raises:
            BundleError: the journal is unreadable (:func:`read_journal`).
        """
        journal = read_journal(self.prefix)
        if journal is None:
            shutil.rmtree(self.prefix / ".ferry" / "replaced", ignore_errors=True)
            return None
        what = interrupted_label(journal)
        if journal_completed(self.prefix, journal):
            self.commit()
            log(f"{what} had completed; removed what it replaced")
            return "completed"
        for entry in reversed(journal["entries"]):
            dest, old = (
                self.prefix / check_relpath(entry["dest"], "journal"),
                self.prefix / check_relpath(entry["old"], "journal"),
            )
            if not os.path.lexists(old):
                continue
            if os.path.lexists(dest):
                shutil.rmtree(dest, ignore_errors=True)
            os.rename(old, dest)
            log(f"restored {dest} ({what} was interrupted before it completed)")
        kept = dict(journal.get("kept") or {})
        if journal.get("info_saved"):  # a journal of an earlier ferry: dataset_info.json alone
            text = journal.get("dataset_info")
            kept["datasets/dataset_info.json"] = {} if text is None else {"text": text}
        for rel, before in kept.items():
            if _put_back(self.prefix / check_relpath(rel, "journal"), before):
                log(f"restored {self.prefix / rel} ({what} was interrupted before it completed)")
        self.commit()
        return "restored"


def _put_back(path: Path, before: dict) -> bool:
    """Make the file or link ``path`` what :meth:`Journal.keep` recorded; True when it changed it."""
    if "link" in before:
        if os.path.islink(path) and os.readlink(path) == before["link"]:
            return False
        atomic_symlink(before["link"], path)
    elif "text" in before:
        if not os.path.islink(path) and path.is_file() and path.read_text("utf-8") == before["text"]:
            return False
        atomic_text(path, before["text"])
    else:
        if not os.path.lexists(path):
            return False
        os.unlink(path)
    return True


def place_tree(src: Path, dest: Path, item: dict, state: dict, key: str, journal: Journal, **extra: str) -> str:
    """Move the staged folder ``src`` to ``dest`` in one rename. An installed ``dest`` recorded in ``state``
    with the same content (:func:`content_id`) is re-hashed: kept when every file matches (``'unchanged'``),
    else replaced by the staged copy (``'repaired'``). A ``dest`` with other content is swapped through ``journal``
    (``'replaced'``); the caller decides beforehand whether replacing is allowed. ``extra`` is stored in the
    item's record (e.g. ``repo_id``). Returns ``'installed'``, ``'replaced'``, ``'repaired'`` or ``'unchanged'``.
    """
    record = state.setdefault("items", {}).get(key)
    revision = item["revision"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and same_content(record, item):
        if not _tree_matches(dest, item):
            return "unchanged"
        journal.swap(src, dest)
        return "repaired"
    if not os.path.lexists(dest):
        os.rename(src, dest)
        outcome = "installed"
    else:
        journal.swap(src, dest)
        outcome = "replaced"
    state["items"][key] = {"revision": revision, "content": content_id(item), "path": str(dest), **extra}
    return outcome


def keep_wheels(item: dict, staged: Path, prefix: Path, repaired: list[str]) -> None:
    """Keep the wheels item's files (wheels and lock files) as ``PREFIX/wheels/<sha256>`` (hard links of the
    staged files, which the staging area's removal leaves in place): a later delta bundle takes its
    unchanged wheels from there. One that is there with other bytes is replaced (and reported)."""
    store = prefix / WHEEL_STORE_DIRNAME
    store.mkdir(parents=True, exist_ok=True)
    for entry in item["files"]:
        src, kept = staged / entry["path"], store / entry["sha256"]
        if os.path.lexists(kept):
            if same_inode(src, kept) or same_file(kept, entry["size"], entry["sha256"]):
                continue
            repaired.append(f"wheels: {entry['path']} (kept copy {entry['sha256'][:12]} was corrupt)")
        tmp = store / f".{entry['sha256']}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, kept)
