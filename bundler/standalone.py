#!/usr/bin/env python3
"""Verify and install a ferry bundle on the isolated host. Standard library only.

This module is copied into every bundle as ``install.py`` and must run with a bare ``python3`` (>= 3.10)::

    cd NAME && python3 install.py --prefix /opt/ferry [--no-venv] [--verify-only]

``ferry verify`` / ``ferry install`` (bundler.verify, bundler.install) call the same functions with progress
bars. When ferry is importable its error classes and ``OFFLINE_ENV`` are used; otherwise look-alikes of the
same names are defined here (a test keeps the copies equal to the canonical ones).

What it reads (see bundler/format.py): a bundle directory ``NAME/``, an archive ``NAME.ferry.tar``, or its
volumes ``NAME.ferry.tar.000``, ``.001``, ... (listed in ``NAME.ferry.sha256``) read as one stream.
Archives are read once, forward only, as ``tarfile.open(mode='r|')`` would (tarfile's own header parser, no
seeks, so volumes and pipes work), but member data goes straight from the stream to a background thread that
hashes it (and writes it, when installing) while the next chunk is read. Every member is compared with
``manifest.json`` at the end. The archive starts with its metadata (manifest.json, manifest.json.sig when
signed, sbom.cdx.json), so ``ferry inspect`` and the signature pre-check read a few hundred kB; the
verdict still comes from the full pass.

What it writes, under ``PREFIX``::

    PREFIX/
    ├── ferry.env                              `source` it: FERRY_HOME, HF_HOME, MODELSCOPE_CACHE, PATH and
    │                                          every offline switch (HF_HUB_OFFLINE=1, ...)
    ├── hf-home/hub/                           a Hugging Face cache (huggingface_hub.scan_cache_dir lists it)
    │   ├── models--ORG--NAME/
    │   │   ├── blobs/<sha256>                 file contents, shared by every bundle holding the same bytes
    │   │   ├── snapshots/<revision>/<path>    relative symlinks ../../blobs/<sha256>
    │   │   └── refs/main, refs/<tag>          the resolved revision; refs/main only when main was packed
    │   └── datasets--ORG--NAME/               hub datasets, the same way (blobs: hard links of datasets/<name>)
    ├── hf-home/datasets/ORG___name -> ../../datasets/<name>/.ferry-datasets-cache/ORG___name
    │                                          the `datasets` Arrow cache ferry pack built: what
    │                                          datasets.load_dataset("ORG/NAME") reads offline
    ├── modelscope/models/ORG--NAME/snapshots/<revision>/   ModelScope models (MODELSCOPE_CACHE, modelscope-hub's
    │                                          layout; venvs get a hook that makes the SDK honour MODELSCOPE_OFFLINE)
    ├── datasets/
    │   ├── <name>/...                         one folder per dataset item (hub datasets: the repo's files and
    │   │                                      .ferry-datasets-cache/)
    │   └── dataset_info.json                  LLaMA-Factory's dataset registry (merged across bundles)
    ├── venvs/<bundle_id>/                     one virtual environment per bundle with wheels
    ├── wheels/<sha256>                        every wheel and lock file installed (hard links of the staged
    │                                          files): what a delta bundle's unchanged wheels are taken from
    ├── tools/<file>                           serving tools carried in wheels/ (TOOL_FILES: llama.cpp's converter
    │                                          sdist for `ferry export --format gguf`)
    ├── venv -> venvs/<bundle_id>              swapped atomically when a new one is complete
    └── .ferry/                                install records: state.json, manifests/<bundle_id>.json, and while
                                               an install runs journal.json + replaced/ (folders swapped out)

Atomicity: everything is first extracted (or copied) into ``PREFIX/.staging-XXXX`` while hashing, then
checked against the manifest; nothing outside the staging directory changes before every byte is
verified. Content then moves in by renames: blobs are content-addressed (an orphan blob is harmless),
snapshot and dataset folders appear whole, the ``venv`` link, ``ferry.env`` and the install record switch
last; a folder swapped out stays in ``.ferry/replaced`` until then (``Journal``). Installing the same bundle
twice re-hashes what it installed and repairs missing or corrupt files; a second bundle adds to the prefix.

Trust: every manifest field that reaches a path (bundle name and id, repo ids, revisions, item and file paths)
is validated (:func:`validate_manifest`) before anything is written, by ``ferry verify`` and ``install.py``
alike, and every destination is resolved and proven to lie inside the prefix (:func:`plan_install`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import posixpath
import queue
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

# --------------------------------------------------------------------------------------------------------------
# Errors and constants: ferry's own when importable, look-alikes otherwise.
# --------------------------------------------------------------------------------------------------------------

try:  # pragma: no cover - which branch runs depends on where the file lives
    from ferry.errors import (
        BundleError,
        FerryError,
        InsufficientSpaceError,
        IntegrityError,
        PrefixError,
        UnsafeArchiveError,
    )
except ImportError:  # running as a bundle's install.py with a bare python3

    class FerryError(Exception):  # type: ignore[no-redef]
        """Base class of every error ferry raises on purpose."""

        exit_code = 1

    class BundleError(FerryError):  # type: ignore[no-redef]
        """A bundle is unusable: unreadable, unknown format version, missing manifest."""

        exit_code = 6

    class IntegrityError(BundleError):  # type: ignore[no-redef]
        """Bytes on disk do not match the manifest."""

        exit_code = 7

    class UnsafeArchiveError(BundleError):  # type: ignore[no-redef]
        """An archive member would escape the destination."""

        exit_code = 8

    class InsufficientSpaceError(FerryError, OSError):  # type: ignore[no-redef]
        """Too little free disk space for a large write."""

        exit_code = 9

    class PrefixError(FerryError, PermissionError):  # type: ignore[no-redef]
        """An install prefix cannot be used: read-only, owned by another account, or drifted."""

        exit_code = 13


#: Copy of ferry.constants.OFFLINE_ENV for a bare python3 (tests/bundler keep it equal to the canonical one).
FALLBACK_OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "DO_NOT_TRACK": "1",
    "DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "WANDB_DISABLED": "true",
    "MODELSCOPE_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
try:  # pragma: no cover
    from ferry.constants import OFFLINE_ENV
except ImportError:
    OFFLINE_ENV = dict(FALLBACK_OFFLINE_ENV)

#: Copies of bundler/format.py's constants (a test keeps them equal).
FORMAT_VERSION = 2
FULL_FORMAT_VERSION = 1
DELTAS_DIRNAME = "deltas"
WHEEL_STORE_DIRNAME = "wheels"
STATE_FORMAT = "ferry-state"
MANIFEST_NAME = "manifest.json"
SUMS_NAME = "SHA256SUMS"
INSTALLER_NAME = "install.py"
LOCK_NAME = "requirements.lock"
ARCHIVE_SUFFIX = ".ferry.tar"
VOLUMES_SUMS_SUFFIX = ".ferry.sha256"
VOLUME_DIGITS = 3
DATASETS_CACHE_DIRNAME = ".ferry-datasets-cache"

#: Read and hash size in bytes: big enough that hashlib releases the GIL and syscalls are few.
CHUNK_SIZE = 1024 * 1024
#: Small members kept in memory while streaming (manifest.json, SHA256SUMS); larger ones are refused.
MAX_METADATA_BYTES = 64 * 1024 * 1024
#: Wheels unpack to roughly this many times their size in a venv (for the up-front free-space check).
WHEEL_EXPANSION = 3

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SUMS_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")

Progress = Callable[[int], None]


def format_bytes(n: float) -> str:
    """Human-readable size with binary units: ``format_bytes(1536) == '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _integrity(problems: list[str], what: str) -> IntegrityError:
    """An IntegrityError whose message lists every problem (one per line); ``.problems`` holds the list."""
    shown = problems[:200]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    err = IntegrityError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(shown) + more)
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------------------------------------------
# Hashing: a background worker hashes (and writes) chunks while the caller reads the next one.
# --------------------------------------------------------------------------------------------------------------


class _Worker:
    """One background thread running submitted callables in order.

    ``hashlib.update`` and file writes release the GIL on buffers over 2 KiB, so the caller's reads (tar
    parsing, ``read``) overlap with hashing and writing. At most ``depth`` chunks wait in the queue (memory
    bound: ``depth * CHUNK_SIZE`` bytes). An exception in the worker is re-raised by the next
    :meth:`submit` or by :meth:`drain`.
    """

    def __init__(self, depth: int = 8) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ferry-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:
                    task()
            except BaseException as exc:  # handed to the caller thread
                self._error = exc
            finally:
                self._queue.task_done()

    def submit(self, task: Callable[[], Any]) -> None:
        """Run ``task()`` in the worker after every earlier task."""
        if self._error is not None:
            raise self._error
        self._queue.put(task)

    def drain(self) -> None:
        """Wait until every submitted task has run; re-raise the first worker exception."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the thread (after the queued tasks)."""
        self._queue.put(None)
        self._thread.join()


def _hash_file(path: str | os.PathLike, progress: Progress | None = None) -> tuple[int, Any]:
    """Stream ``path`` once; return ``(size in bytes, the sha256 hash object)``. ``progress(n)`` per chunk."""
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(CHUNK_SIZE)
            if not chunk:
                break
            hasher.update(chunk)
            size += len(chunk)
            if progress:
                progress(len(chunk))
    return size, hasher


def sha256_file(path: str | os.PathLike, progress: Progress | None = None) -> tuple[int, str]:
    """Stream ``path`` once; return ``(size in bytes, sha256 hex)``. ``progress(n)`` after each chunk."""
    size, hasher = _hash_file(path, progress)
    return size, hasher.hexdigest()


def _copy_hashing(src: Path, dest: Path | None, worker: _Worker, progress: Progress | None) -> tuple[int, str]:
    """Read ``src`` once, hash it (and write it to ``dest``, created exclusively) in ``worker``."""
    hasher = hashlib.sha256()
    size = 0
    out = None
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        out = open(dest, "xb")
    try:
        with open(src, "rb", buffering=0) as fh:
            while True:
                chunk = fh.read(CHUNK_SIZE)
                if not chunk:
                    break
                size += len(chunk)
                worker.submit(_sink(hasher, out, chunk))
                if progress:
                    progress(len(chunk))
        worker.drain()
    finally:
        if out is not None:
            out.close()
    return size, hasher.hexdigest()


def _sink(hasher: Any, out: Any, chunk: bytes) -> Callable[[], None]:
    def task() -> None:
        hasher.update(chunk)
        if out is not None:
            out.write(chunk)

    return task


# --------------------------------------------------------------------------------------------------------------
# The manifest.
# --------------------------------------------------------------------------------------------------------------


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> dict:
    """Parse and check a manifest's bytes (format of bundler/format.py).

    Raises:
        BundleError: not JSON, a required key is missing or has the wrong type (the key is named), or the
            ``format_version`` is newer than this reader (upgrade ferry).
        UnsafeArchiveError: a listed path is absolute or contains ``..``.
    """
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: expected a JSON object at the top level")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"{where}: 'format_version' must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{where}: bundle format_version {version} is newer than this ferry reads ({FORMAT_VERSION}); "
            f"upgrade ferry (or run the install.py shipped inside the bundle)"
        )
    for key, kind in (("name", str), ("bundle_id", str), ("items", list)):
        if not isinstance(manifest.get(key), kind):
            raise BundleError(f"{where}: '{key}' must be a {kind.__name__}")
    for i, item in enumerate(manifest["items"]):
        here = f"{where}: items[{i}]"
        if not isinstance(item, dict):
            raise BundleError(f"{here} must be an object")
        for key in ("kind", "source", "path"):
            if not isinstance(item.get(key), str):
                raise BundleError(f"{here}.{key} must be a string")
        check_relpath(item["path"], f"{here}.path")
        _check_files(item.get("files"), f"{here}.files")
    _check_files(manifest.get("support_files", []), f"{where}: support_files")
    validate_manifest(manifest, where)
    validate_delta(manifest, where)
    return manifest


def _check_files(files: Any, here: str) -> None:
    if not isinstance(files, list):
        raise BundleError(f"{here} must be a list")
    for j, entry in enumerate(files):
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
                and _HEX64.match(entry["sha256"])):
            raise BundleError(f"{here}[{j}] needs 'path' (string), 'size' (int) and 'sha256' (64 hex digits)")
        check_relpath(entry["path"], f"{here}[{j}].path")


def check_relpath(path: Any, where: str) -> str:
    """A bundle-relative POSIX path, checked: a non-empty string, relative, normalised (no ``.``, ``..`` or empty
    components, no trailing ``/``), no backslash, no control character (NUL, newline, ...), valid UTF-8 (no
    lone surrogates from ``\\udXXX`` escapes). Returns the path.

    Raises:
        UnsafeArchiveError: naming ``where`` and the offending value.
    """
    if not isinstance(path, str):
        raise UnsafeArchiveError(f"{where}: expected a path string, got {type(path).__name__}")
    why = None
    if not path:
        why = "empty"
    elif path.startswith("/"):
        why = "absolute"
    elif "\\" in path:
        why = "a backslash"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        why = "a control character (NUL, newline, ...)"
    elif ".." in path.split("/"):
        why = "a '..' component"
    elif posixpath.normpath(path) != path or path == ".":
        why = "not normalised ('.', '//' or a trailing '/')"
    else:
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            why = "not valid UTF-8"
    if why:
        raise UnsafeArchiveError(f"{where}: unsafe path {path!r} ({why})")
    return path


# --------------------------------------------------------------------------------------------------------------
# Every manifest field that reaches a path or a command is untrusted input.
# --------------------------------------------------------------------------------------------------------------

#: huggingface_hub's ``REPO_ID_REGEX`` (utils/_validators.py), used by its ``validate_repo_id``; mirrored here
#: for a bare python3 (tests/bundler keep it equal to the library's).
REPO_ID_REGEX = re.compile(
    r"""
    (\b[\w\-.]{1,96}\b/)? # optional namespace (username or organization)
    \b               # starts with a word boundary
    [\w\-.]{1,96}    # repo_name: alphanumeric + . _ -
    \b               # ends with a word boundary
    """,
    flags=re.VERBOSE | re.ASCII,
)
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_BUNDLE_ID = re.compile(r"^[0-9a-f]{32}$")
_BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: The item kinds and the sources each may come from.
ITEM_SOURCES = {"model": ("hf", "ms", "local"), "dataset": ("hf", "ms", "local"), "wheels": ("uv", "pip")}


def check_repo_id(value: Any, where: str) -> str:
    """``ORG/NAME`` or ``NAME`` by huggingface_hub's ``validate_repo_id`` rules: 1-96 characters of
    ``[A-Za-z0-9._-]`` per part, at most one ``/``, no ``--`` or ``..``, not ending in ``.git``, not starting or
    ending with ``-`` or ``.``.

    Raises:
        UnsafeArchiveError: naming ``where`` and the value.
    """
    ok = (isinstance(value, str) and value.count("/") <= 1 and REPO_ID_REGEX.fullmatch(value) is not None
          and "--" not in value and ".." not in value and not value.endswith(".git"))
    if not ok:
        raise UnsafeArchiveError(f"{where}: invalid repo id {value!r} (huggingface_hub's rule: 'NAME' or "
                                 f"'ORG/NAME' of letters, digits, '-', '_', '.'; no '--' or '..')")
    return value


def check_ref_name(value: Any, where: str) -> str:
    """A revision: a 40-hex commit, or a ref name by ``git check-ref-format --allow-onelevel`` rules (no ``..``,
    no component starting with ``.`` or ending in ``.lock``, no leading, trailing or double ``/``, no control
    character, space, ``~ ^ : ? * [ \\``, no ``@{``, not ``@``, not ending in ``.``; at most 255 bytes).

    Raises:
        UnsafeArchiveError: naming ``where`` and the value.
    """
    if isinstance(value, str) and _HEX40.match(value):
        return value
    why = None
    if not isinstance(value, str) or not value:
        why = "not a non-empty string"
    elif len(value.encode("utf-8", "surrogatepass")) > 255:
        why = "longer than 255 bytes"
    elif any(ord(c) < 0x21 or ord(c) == 0x7F or c in "~^:?*[\\" for c in value):
        why = "a control character, space or one of ~ ^ : ? * [ \\"
    elif ".." in value or "@{" in value or value == "@":
        why = "'..', '@{' or '@'"
    elif value.startswith("/") or value.endswith("/") or "//" in value:
        why = "a leading, trailing or double '/'"
    elif value.endswith("."):
        why = "a trailing '.'"
    elif any(part.startswith(".") or part.endswith(".lock") for part in value.split("/")):
        why = "a component starting with '.' or ending in '.lock'"
    else:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            why = "not valid UTF-8"
    if why:
        raise UnsafeArchiveError(f"{where}: invalid revision {value!r} ({why}; git check-ref-format rules)")
    return value


def validate_manifest(manifest: dict, where: str = MANIFEST_NAME) -> None:
    """Check every manifest field that reaches a path or a command (see bundler/format.py for the schema).

    The bundle ``name`` (``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128), ``bundle_id`` (32 lowercase hex, a uuid4),
    each item's ``kind``/``source`` pair, ``repo_id`` (:func:`check_repo_id`; ``local/NAME`` for local sources,
    none for wheels), ``revision`` and ``revision_requested`` (:func:`check_ref_name`; hub and local revisions
    are 40-hex commits), ``path`` (``KINDs/...`` or ``wheels``, never inside another item's), and every
    file path (:func:`check_relpath`), with no two files at the same bundle path or one file where another
    needs a folder.

    Raises:
        UnsafeArchiveError: the first offending field, named as ``items[3].repo_id`` with its value.
        BundleError: a field of the wrong type.
    """
    name = manifest.get("name")
    if not (isinstance(name, str) and _BUNDLE_NAME.match(name) and ".." not in name):
        raise UnsafeArchiveError(f"{where}: invalid bundle name {name!r} (letters, digits, '.', '_', '-'; "
                                 f"at most 128, starting with a letter or digit)")
    if not (isinstance(manifest.get("bundle_id"), str) and _BUNDLE_ID.match(manifest["bundle_id"])):
        raise UnsafeArchiveError(f"{where}: invalid bundle_id {manifest.get('bundle_id')!r} (32 lowercase hex "
                                 f"digits expected)")
    item_paths: list[str] = []
    for i, item in enumerate(manifest["items"]):
        here = f"{where}: items[{i}]"
        kind, source = item["kind"], item["source"]
        if source not in ITEM_SOURCES.get(kind, ()):
            raise UnsafeArchiveError(f"{here}: unknown kind/source {kind!r}/{source!r} (expected one of "
                                     + ", ".join(f"{k}/{s}" for k, v in ITEM_SOURCES.items() for s in v) + ")")
        path = item["path"]
        if kind == "wheels":
            if path != "wheels":
                raise UnsafeArchiveError(f"{here}.path: {path!r} (wheels live in 'wheels')")
        else:
            repo_id = check_repo_id(item.get("repo_id"), f"{here}.repo_id")
            if source == "local" and not repo_id.startswith("local/"):
                raise UnsafeArchiveError(f"{here}.repo_id: {repo_id!r} (local items are named 'local/NAME')")
            if source == "ms" and "/" not in repo_id:
                raise UnsafeArchiveError(f"{here}.repo_id: {repo_id!r} (ModelScope ids are 'ORG/NAME')")
            revision = check_ref_name(item.get("revision"), f"{here}.revision")
            if source in ("hf", "local") and not _HEX40.match(revision):
                raise UnsafeArchiveError(f"{here}.revision: {revision!r} (a 40-hex commit expected for "
                                         f"{source} items)")
            if item.get("revision_requested") is not None:
                check_ref_name(item["revision_requested"], f"{here}.revision_requested")
            if not path.startswith(f"{kind}s/"):
                raise UnsafeArchiveError(f"{here}.path: {path!r} (expected under '{kind}s/')")
        item_paths.append(path)
    ordered = sorted(item_paths)
    for a, b in zip(ordered, ordered[1:]):
        if a == b or b.startswith(a + "/"):
            raise UnsafeArchiveError(f"{where}: item paths {a!r} and {b!r} overlap")
    every = sorted(expected_files(manifest, target=True))  # raises on duplicates
    for a, b in zip(every, every[1:]):
        if b.startswith(a + "/"):
            raise UnsafeArchiveError(f"{where}: {a!r} is a file and also a folder of {b!r}")
    for path in every:
        if path in (MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME):
            raise UnsafeArchiveError(f"{where}: a listed file is named {path!r}, which the bundle itself uses")


def expected_files(manifest: dict, target: bool = False) -> dict[str, tuple[int, str]]:
    """Every file the bundle holds and the manifest vouches for: bundle-relative POSIX path -> (size in bytes,
    sha256 hex).

    Covers every item file (``item.path/file.path``) and the support files (install.py, the wheel lock);
    not ``manifest.json`` and ``SHA256SUMS`` themselves. In a delta bundle (:func:`is_delta`) a ``from_base``
    file is not in the bundle, and a ``tensors`` file is carried as its patch ``deltas/ITEM/FILE``; with
    ``target`` the full target's paths are listed instead (what an install of the bundle holds).
    """
    out: dict[str, tuple[int, str]] = {}
    listed = [(e["path"], e) for e in manifest.get("support_files", [])]
    for item in manifest["items"]:
        for e in item["files"]:
            mode = "carried" if target else e.get("delta", "carried")
            if mode == "carried":
                listed.append((posixpath.join(item["path"], e["path"]), e))
            elif mode == "tensors" and isinstance(e.get("patch"), dict):
                listed.append((patch_path(item, e), e["patch"]))
    for path, entry in listed:
        if path in out:
            raise UnsafeArchiveError(f"{MANIFEST_NAME}: {path!r} is listed twice")
        out[path] = (entry["size"], entry["sha256"].lower())
    return out


# --------------------------------------------------------------------------------------------------------------
# Comparing what was read with the manifest.
# --------------------------------------------------------------------------------------------------------------


class Scan:
    """What one pass over a bundle saw: ``observed`` path -> (size, sha256) for every regular file, the bytes
    of ``manifest.json`` and ``SHA256SUMS`` (None when absent), problems found on the way (unexpected links),
    the bundle's top-level folder name (archives), and the bytes read."""

    def __init__(self) -> None:
        self.observed: dict[str, tuple[int, str]] = {}
        self.manifest_bytes: bytes | None = None
        self.sums_bytes: bytes | None = None
        self.signature_bytes: bytes | None = None  # manifest.json.sig, when the bundle is signed
        self.problems: list[str] = []
        self.top: str | None = None
        self.bytes_read = 0
        self.volumes: list[Path] = []
        self.volume_sums: dict[str, str] = {}

    def volume_problems(self) -> list[str]:
        """On a failure, which volumes do not match ``NAME.ferry.sha256`` (empty for directories)."""
        return _volume_problems(self.volumes, self.volume_sums) if self.volumes else []


def check_scan(scan: Scan, reference: dict | None = None, reference_name: str = "") -> tuple[dict, list[str]]:
    """Compare a :class:`Scan` with the manifest; return ``(manifest, problems)``.

    ``reference``: a manifest brought over a separate channel; it is then the reference and the bundle's own
    ``manifest.json`` must equal it. Problems name the file: ``missing``, ``extra``, ``truncated``,
    ``size mismatch``, ``sha256 mismatch``, and ``SHA256SUMS`` lines that disagree.

    Raises:
        BundleError: no manifest at all, or it is unreadable and SHA256SUMS does not explain why.
    """
    problems = list(scan.problems)
    own: dict | None = None
    own_error: BundleError | None = None
    if scan.manifest_bytes is None:
        if reference is None:
            raise BundleError(f"the bundle has no {MANIFEST_NAME}: not a ferry bundle, or it was cut short")
        problems.append(f"missing: {MANIFEST_NAME}")
    else:
        try:
            own = parse_manifest(scan.manifest_bytes)
        except BundleError as exc:
            own_error = exc
    manifest = reference if reference is not None else own
    sums_problems = _check_sums(scan)
    if manifest is None:
        assert own_error is not None
        if sums_problems:  # e.g. a flipped byte in manifest.json: SHA256SUMS names it
            raise _integrity([str(own_error), *sums_problems], "bundle check failed")
        raise own_error
    if reference is not None and own is not None and own != reference:
        problems.append(f"{MANIFEST_NAME} in the bundle differs from the reference manifest {reference_name}")
    elif reference is not None and own_error is not None:
        problems.append(str(own_error))
    expected = expected_files(manifest)
    for path, (size, digest) in sorted(expected.items()):
        seen = scan.observed.get(path)
        if seen is None:
            problems.append(f"missing: {path}")
        elif seen[0] < size:
            problems.append(f"truncated: {path} ({seen[0]} of {size} bytes)")
        elif seen[0] != size:
            problems.append(f"size mismatch: {path} ({seen[0]} bytes, manifest says {size})")
        elif seen[1] != digest:
            problems.append(f"sha256 mismatch: {path} (got {seen[1]}, manifest says {digest})")
    for path in sorted(set(scan.observed) - set(expected) - {MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME}):
        problems.append(f"extra file: {path} (not in the manifest)")
    problems.extend(sums_problems)
    return manifest, problems


def _check_sums(scan: Scan) -> list[str]:
    """Problems with SHA256SUMS against what was read (it lists every file but itself)."""
    if scan.sums_bytes is None:
        return [f"missing: {SUMS_NAME}"]
    problems = []
    listed = set()
    try:
        text = scan.sums_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return [f"{SUMS_NAME} is not UTF-8 text"]
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _SUMS_LINE.match(line)
        if not match:
            problems.append(f"{SUMS_NAME} line {lineno}: not 'SHA256  PATH': {line[:80]!r}")
            continue
        digest, path = match.group(1).lower(), match.group(2)
        listed.add(path)
        seen = scan.observed.get(path)
        if seen is None:
            problems.append(f"{SUMS_NAME} line {lineno}: lists {path!r}, which is not in the bundle")
        elif seen[1] != digest:
            problems.append(f"{SUMS_NAME} line {lineno}: sha256 of {path} differs ({path} or {SUMS_NAME} altered)")
    for path in sorted(set(scan.observed) - listed - {SUMS_NAME}):
        problems.append(f"{SUMS_NAME} does not list {path}")
    return problems


# --------------------------------------------------------------------------------------------------------------
# Bundle directories.
# --------------------------------------------------------------------------------------------------------------


def _keep_metadata(scan: Scan, rel: str, data: bytes) -> None:
    """Keep the bytes of a metadata file (manifest.json, SHA256SUMS, manifest.json.sig) in ``scan``, not on
    disk: they are read once here and checked from memory."""
    attr = {MANIFEST_NAME: "manifest_bytes", SUMS_NAME: "sums_bytes", SIGNATURE_NAME: "signature_bytes"}[rel]
    setattr(scan, attr, data)


def scan_directory(bundle_dir: Path, dest: Path | None = None, progress: Progress | None = None) -> Scan:
    """Read every file under ``bundle_dir`` once, hashing it (and copying it to ``dest/<path>`` when given).

    Symbolic links and special files are never followed; they are reported as problems.
    """
    bundle_dir = Path(bundle_dir)
    scan = Scan()
    worker = _Worker()
    try:
        for root, dirs, files in os.walk(bundle_dir):
            rel_root = os.path.relpath(root, bundle_dir)
            dirs.sort()
            for name in list(dirs):
                full = os.path.join(root, name)
                if os.path.islink(full):
                    rel = posixpath.normpath(posixpath.join(rel_root.replace(os.sep, "/"), name))
                    scan.problems.append(f"extra file: {rel} (a symbolic link; bundles hold regular files only)")
                    dirs.remove(name)
            for name in sorted(files):
                full = Path(root) / name
                rel = posixpath.normpath(posixpath.join(rel_root.replace(os.sep, "/"), name))
                st = full.lstat()
                if not stat.S_ISREG(st.st_mode):
                    scan.problems.append(f"extra file: {rel} (not a regular file)")
                    continue
                if rel in (MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME):
                    data = full.read_bytes()
                    _keep_metadata(scan, rel, data)
                    scan.observed[rel] = (len(data), hashlib.sha256(data).hexdigest())
                    if progress:
                        progress(len(data))
                    continue
                target = None if dest is None else dest / rel
                scan.observed[rel] = _copy_hashing(full, target, worker, progress)
                scan.bytes_read += scan.observed[rel][0]
    finally:
        worker.close()
    return scan


def directory_size(bundle_dir: Path) -> int:
    """Total bytes of the regular files under ``bundle_dir`` (for progress totals)."""
    total = 0
    for root, _, files in os.walk(bundle_dir):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


# --------------------------------------------------------------------------------------------------------------
# Archives and volumes.
# --------------------------------------------------------------------------------------------------------------


def archive_volumes(path: Path) -> tuple[str, list[Path], dict[str, str]]:
    """Resolve ``NAME.ferry.tar`` or ``NAME.ferry.tar.000`` into ``(NAME, volume paths, expected sha256 by
    file name)``. Volumes come from ``NAME.ferry.sha256`` when it exists beside them, else from the
    consecutive ``.NNN`` files on disk.

    Raises:
        BundleError: not an archive name, no such file, or a volume is missing (named).
    """
    path = Path(path)
    name = path.name
    split = False
    if re.search(re.escape(ARCHIVE_SUFFIX) + r"\.\d+$", name):
        base = name.rsplit(".", 1)[0]
        split = True
    elif name.endswith(ARCHIVE_SUFFIX):
        base = name
    else:
        raise BundleError(f"{path}: not a bundle (expected a directory, NAME{ARCHIVE_SUFFIX} or "
                          f"NAME{ARCHIVE_SUFFIX}.000)")
    bundle_name = base[: -len(ARCHIVE_SUFFIX)]
    folder = path.parent
    sums_path = folder / f"{bundle_name}{VOLUMES_SUMS_SUFFIX}"
    expected: dict[str, str] = {}
    if sums_path.is_file():
        for line in sums_path.read_text("utf-8", errors="replace").splitlines():
            match = _SUMS_LINE.match(line.strip())
            if match:
                expected[posixpath.basename(match.group(2))] = match.group(1).lower()
    if split:
        listed = sorted(n for n in expected if n.startswith(base + ".") and n[len(base) + 1:].isdigit())
        if listed:
            names = listed
        else:
            names = []
            index = 0
            while (folder / f"{base}.{index:0{VOLUME_DIGITS}d}").exists():
                names.append(f"{base}.{index:0{VOLUME_DIGITS}d}")
                index += 1
            if not names:
                raise BundleError(f"{path}: no such volume")
        volumes = [folder / n for n in names]
        missing = [str(v) for v in volumes if not v.is_file()]
        if missing:
            raise BundleError(f"missing volume(s) of {base}: {', '.join(missing)}")
        if listed:
            suffixes = [int(n[len(base) + 1:]) for n in names]
            gaps = sorted(set(range(len(suffixes))) - set(suffixes))
            if gaps:
                raise BundleError(f"missing volume(s) of {base}: "
                                  + ", ".join(f"{base}.{g:0{VOLUME_DIGITS}d}" for g in gaps))
    else:
        if not path.is_file():
            raise BundleError(f"{path}: no such archive")
        volumes = [path]
    return bundle_name, volumes, expected


class VolumeReader:
    """The volumes of a split archive (or one archive) read as one forward-only byte stream.

    ``read(n)`` returns exactly ``n`` bytes unless the stream ends (it crosses volume boundaries), ``tell()``
    is the position in the whole stream, ``position()`` names the volume and offset for error messages, and
    ``progress(n)`` is called for every read.
    """

    def __init__(self, volumes: list[Path], progress: Progress | None = None) -> None:
        self.volumes = list(volumes)
        self.progress = progress
        self.index = 0
        self.offset = 0
        self.total = 0
        self._fh = open(self.volumes[0], "rb", buffering=0) if self.volumes else None

    def read(self, n: int) -> bytes:
        if self._fh is None:
            return b""
        data = self._fh.read(n)
        self.offset += len(data)
        if len(data) < n:  # a short read: the end of this volume (or a pipe); keep filling
            parts = [data]
            got = len(data)
            while got < n and self._fh is not None:
                more = self._fh.read(n - got)
                if not more:
                    self._next_volume()
                    continue
                self.offset += len(more)
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self.total += len(data)
        if self.progress and data:
            self.progress(len(data))
        return data

    def _next_volume(self) -> None:
        assert self._fh is not None
        self._fh.close()
        if self.index + 1 >= len(self.volumes):  # the end: keep pointing at the last byte of the last volume
            self._fh = None
            return
        self.index += 1
        self.offset = 0
        self._fh = open(self.volumes[self.index], "rb", buffering=0)

    def tell(self) -> int:
        return self.total

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (tar padding); raises tarfile.ReadError when the stream ends first."""
        while n > 0:
            got = len(self.read(min(n, CHUNK_SIZE)))
            if not got:
                raise tarfile.ReadError("unexpected end of data")
            n -= got

    def position(self) -> str:
        """Where the stream is: ``'byte N of VOLUME'`` (the volume being read and the bytes read from it)."""
        return f"byte {self.offset} of {self.volumes[self.index].name}"

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _TarHeaders:
    """What :meth:`tarfile.TarInfo.fromtarfile` needs of a TarFile to parse the next header (ustar, pax and
    GNU long names, as ``TarFile`` in ``'r|'`` mode does) from a forward-only stream. Member data is then read
    straight from the stream, without tarfile's buffer copies."""

    def __init__(self, fileobj: VolumeReader) -> None:
        self.fileobj = fileobj
        self.offset = 0  # where the next header starts (set by tarfile after each member)
        self.pax_headers: dict[str, str] = {}  # global pax headers
        self.encoding = "utf-8"
        self.errors = "surrogateescape"

    def next(self) -> tarfile.TarInfo | None:
        """The next member, or None at the end-of-archive marker.

        Raises:
            tarfile.ReadError: the stream ends without an end marker, or a header is corrupt.
        """
        if self.fileobj.tell() < self.offset:
            self.fileobj.skip(self.offset - self.fileobj.tell())
        try:
            return tarfile.TarInfo.fromtarfile(self)  # type: ignore[arg-type]
        except tarfile.EOFHeaderError:
            return None
        except tarfile.EmptyHeaderError:
            raise tarfile.ReadError("unexpected end of data (no end-of-archive marker)") from None
        except tarfile.HeaderError as exc:
            raise tarfile.ReadError(f"corrupt tar header: {exc}") from None


def _volume_problems(volumes: list[Path], expected: dict[str, str]) -> list[str]:
    """Name the culprit on the failure path: a volume whose size breaks the split (every volume but the last has
    the size of the first; the last is not larger), and each volume that does not match NAME.ferry.sha256."""
    problems = []
    if len(volumes) > 1:
        sizes = [v.stat().st_size for v in volumes]
        for volume, size in zip(volumes[1:-1], sizes[1:-1]):
            if size != sizes[0]:
                how = "truncated" if size < sizes[0] else "longer than the split size"
                problems.append(f"volume {volume.name} is {size} bytes but the volumes before the last are "
                                f"{sizes[0]} bytes: {how}")
        if sizes[-1] > sizes[0]:
            problems.append(f"volume {volumes[-1].name} is {sizes[-1]} bytes, more than the split size "
                            f"{sizes[0]}: altered")
    for volume in volumes:
        want = expected.get(volume.name)
        if want is None:
            continue
        size, digest = sha256_file(volume)
        if digest != want:
            problems.append(f"volume {volume.name} ({size} bytes) does not match its sha256 in "
                            f"{volume.name.split(ARCHIVE_SUFFIX)[0]}{VOLUMES_SUMS_SUFFIX}: truncated or altered")
    return problems


def _member_path(member: tarfile.TarInfo, scan: Scan) -> str:
    """The member's path inside the bundle (top folder stripped), after the safety checks.

    Raises:
        UnsafeArchiveError: absolute, ``..``, not normalised, or outside the bundle's single top folder.
    """
    name = member.name
    stripped = name.rstrip("/") if member.isdir() else name
    try:
        check_relpath(stripped, f"archive member {name!r}")
    except UnsafeArchiveError:
        raise UnsafeArchiveError(f"unsafe archive member {name!r}: absolute path or '..' (refused)") from None
    top, _, rest = stripped.partition("/")
    if scan.top is None:
        scan.top = top
    elif top != scan.top:
        raise UnsafeArchiveError(f"archive member {name!r} is outside the bundle folder {scan.top + '/'!r}")
    return rest


def scan_archive(
    archive: Path, dest: Path | None = None, progress: Progress | None = None,
) -> Scan:
    """Stream ``archive`` (``NAME.ferry.tar`` or its first volume, all volumes as one stream) once, forward only.

    Headers are parsed by tarfile's own :meth:`tarfile.TarInfo.fromtarfile` (ustar, pax, GNU long names) as
    in ``tarfile.open(mode='r|')``; member data is read straight from the stream in 1 MiB chunks (tarfile's
    stream buffer copies every byte three times, which halves throughput).

    Every regular member is hashed while read; with ``dest`` it is also written to ``dest/<path>`` (the top
    folder ``NAME/`` stripped), created exclusively, never through a link. Directory members are created
    under ``dest``. Nothing is written outside ``dest``.

    Raises:
        UnsafeArchiveError: an absolute or ``..`` member, a symbolic or hard link pointing outside the bundle,
            a device file or FIFO, a duplicate member (each named).
        IntegrityError: the stream is truncated or corrupt; the volume that does not match
            ``NAME.ferry.sha256`` is named when that file is present.
        BundleError: a volume is missing.
    """
    _, volumes, expected = archive_volumes(Path(archive))
    scan = Scan()
    scan.volumes, scan.volume_sums = volumes, expected
    seen: set[str] = set()
    reader = VolumeReader(volumes, progress)
    headers = _TarHeaders(reader)
    worker = _Worker()
    try:
        try:
            while True:
                member = headers.next()
                if member is None:
                    break
                rel = _member_path(member, scan)
                if member.name.rstrip("/") in seen:
                    raise UnsafeArchiveError(f"duplicate archive member {member.name!r} (refused)")
                seen.add(member.name.rstrip("/"))
                if member.isdir():
                    if dest is not None and rel:
                        _safe_mkdir(dest, rel)
                    continue
                if member.issym() or member.islnk():
                    _check_link(member, rel, scan.top or "")
                    scan.problems.append(f"extra file: {rel} (a link; bundles hold regular files only)")
                    continue
                if not member.isreg():
                    raise UnsafeArchiveError(
                        f"archive member {member.name!r} is a device file, FIFO or other special file (refused)")
                if not rel:
                    raise UnsafeArchiveError(f"archive member {member.name!r} is a file at the top level")
                if member.sparse is not None:
                    raise UnsafeArchiveError(f"archive member {member.name!r} is a sparse file (refused)")
                if reader.tell() != member.offset_data:
                    raise tarfile.ReadError(f"member {member.name!r}: data does not follow its header")
                if rel in (MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME):
                    if member.size > MAX_METADATA_BYTES:
                        raise BundleError(f"{rel} in the archive is {member.size} bytes: too large")
                    data = reader.read(member.size)
                    if len(data) != member.size:
                        raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
                    _keep_metadata(scan, rel, data)
                    scan.observed[rel] = (len(data), hashlib.sha256(data).hexdigest())
                    continue
                out = None
                if dest is not None:
                    parent = _safe_mkdir(dest, posixpath.dirname(rel)) if "/" in rel else dest
                    out = open(parent / posixpath.basename(rel), "xb")
                hasher = hashlib.sha256()
                size = 0
                try:
                    while size < member.size:
                        chunk = reader.read(min(CHUNK_SIZE, member.size - size))
                        if not chunk:
                            break
                        size += len(chunk)
                        worker.submit(_sink(hasher, out, chunk))
                    worker.drain()
                finally:
                    if out is not None:
                        out.close()
                if size != member.size:
                    raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
                scan.observed[rel] = (size, hasher.hexdigest())
                scan.bytes_read += size
            # A zero block in the middle (a shifted or truncated volume) looks like the end marker: anything
            # but zero padding after it means the stream is corrupt.
            where = reader.position()
            while True:
                rest = reader.read(CHUNK_SIZE)
                if not rest:
                    break
                if rest.count(0) != len(rest):
                    scan.problems.append(f"archive {Path(archive).name} holds data after its end marker "
                                         f"(near {where}): a volume is truncated, shifted or corrupt")
                    break
        except (tarfile.TarError, EOFError) as exc:
            where = reader.position()
            problems = _volume_problems(volumes, expected)
            detail = f"archive {Path(archive).name} is truncated or corrupt at {where}: {exc}"
            raise _integrity([detail, *problems], "archive check failed") from None
    finally:
        worker.close()
        reader.close()
    if scan.top is None:
        raise BundleError(f"archive {archive} is empty")
    return scan


def _check_link(member: tarfile.TarInfo, rel: str, top: str) -> None:
    """Refuse a symbolic or hard link whose target leaves the bundle folder ``top``."""
    target = member.linkname
    if member.issym():  # relative to the link's own folder
        resolved = posixpath.normpath(posixpath.join(top, posixpath.dirname(rel), target))
    else:  # hard links name another member, relative to the archive root
        resolved = posixpath.normpath(target)
    if (target.startswith("/") or resolved == ".." or resolved.startswith("../")
            or resolved.split("/")[0] != top or resolved == top):
        kind = "symbolic" if member.issym() else "hard"
        raise UnsafeArchiveError(f"archive member {member.name!r} is a {kind} link to {target!r}, outside "
                                 f"the bundle (refused)")


def _safe_mkdir(root: Path, rel: str) -> Path:
    """Create ``root/rel`` component by component, refusing any existing component that is not a real
    directory (so nothing can be written through a link)."""
    current = root
    for part in rel.split("/"):
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeArchiveError(f"{current} exists and is not a directory (refused)")
    return current


def scan_bundle(bundle: Path, dest: Path | None = None, progress: Progress | None = None) -> Scan:
    """Scan a bundle directory, archive or first volume (see :func:`scan_directory`, :func:`scan_archive`)."""
    bundle = Path(bundle)
    if bundle.is_dir():
        return scan_directory(bundle, dest, progress)
    return scan_archive(bundle, dest, progress)


def bundle_bytes(bundle: Path) -> int:
    """Bytes one pass over ``bundle`` will read (directory files, or the archive or all its volumes)."""
    bundle = Path(bundle)
    if bundle.is_dir():
        return directory_size(bundle)
    _, volumes, _ = archive_volumes(bundle)
    return sum(v.stat().st_size for v in volumes)


def check_bundle(
    bundle: Path, reference: Path | None = None, progress: Progress | None = None, dest: Path | None = None,
    *, allowed_signers: Path | None = None, require_signature: bool = False,
) -> tuple[dict, Scan]:
    """Read ``bundle`` once and check every byte against its manifest (or ``reference``).

    Returns ``(manifest, scan)``. Raises IntegrityError listing every problem, or BundleError /
    UnsafeArchiveError (see :func:`scan_archive`).
    """
    ref = None
    if reference is not None:
        ref = parse_manifest(Path(reference).read_bytes(), str(reference))
    scan = scan_bundle(bundle, dest, progress)
    try:
        manifest, problems = check_scan(scan, ref, str(reference) if reference else "")
    except IntegrityError as exc:
        raise _integrity([*exc.problems, *scan.volume_problems()],  # type: ignore[attr-defined]
                         f"bundle {bundle} failed verification") from None
    except BundleError as exc:
        volume_problems = scan.volume_problems()
        if volume_problems:
            raise _integrity([str(exc), *volume_problems], f"bundle {bundle} failed verification") from None
        raise
    problems = check_signature(bundle, scan, problems, reference, allowed_signers, require_signature, dest)
    if problems:
        raise _integrity([*problems, *scan.volume_problems()], f"bundle {bundle} failed verification")
    return manifest, scan


# --------------------------------------------------------------------------------------------------------------
# Free space.
# --------------------------------------------------------------------------------------------------------------


def ensure_free_space(directory: Path, needed_bytes: int, what: str) -> None:
    """Raise InsufficientSpaceError up front when ``directory`` (or its nearest existing ancestor) has fewer
    than ``needed_bytes`` bytes free. The message says how much is needed and where."""
    probe = Path(directory).absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise InsufficientSpaceError(
            f"{what} needs {format_bytes(needed_bytes)} in {probe} but only {format_bytes(free)} is free")


def _wheel_bytes(manifest: dict) -> int:
    return sum(f["size"] for item in manifest["items"] if item["kind"] == "wheels" for f in item["files"])


# --------------------------------------------------------------------------------------------------------------
# Installing.
# --------------------------------------------------------------------------------------------------------------


def _repo_folder(repo_type: str, repo_id: str) -> str:
    """huggingface_hub's cache folder name: ``models--ORG--NAME`` (as ``repo_folder_name``)."""
    return "--".join([f"{repo_type}s", *repo_id.split("/")])


#: Permission bits of what an install writes: readable by every account (a shared prefix installed by root),
#: or, with ``private``, by the installing account alone. Applied through the umask for the whole install, so
#: the venv pip builds gets them too, and explicitly where tempfile creates 0600/0700 entries.
SHARED_UMASK, PRIVATE_UMASK = 0o022, 0o077


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_text(path: Path, text: str) -> None:
    """Write ``path`` through a temp file ``.NAME.XXXX.tmp`` beside it and one rename (mode 0666 & ~umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _atomic_symlink(target: str, link: Path) -> None:
    """Point ``link`` at ``target`` (relative), replacing what is there in one rename."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}.lnk")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _mkdtemp(prefix: str, dir: Path) -> Path:
    """``tempfile.mkdtemp`` with the install's permission bits (mkdtemp itself makes 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    os.chmod(path, 0o777 & ~_umask())
    return path


def _same_file(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` (followed through links) holds exactly ``size`` bytes with this sha256."""
    try:
        if os.stat(path).st_size != size:
            return False
        return sha256_file(path)[1] == sha256
    except OSError:
        return False


def place_hf(item: dict, src: Path, hub_dir: Path, scratch: Path, repo_type: str = "model",
             reinstall: bool = False) -> dict:
    """Place one item's staged files ``src/<path>`` into the Hugging Face cache ``hub_dir`` (HF_HOME/hub).

    Blobs move by rename to ``blobs/<sha256>`` unless an identical blob is already there (shared; its bytes
    are re-hashed, and a corrupt or truncated one is replaced: a re-install repairs); the snapshot
    ``snapshots/<revision>/`` is built in ``scratch`` (the staging directory, same file system) and renamed in
    whole, or, when it already exists (another bundle, other include patterns), missing or wrong links are
    set one by one (each atomic). ``refs/main`` is written only when ``main`` itself was packed (the requested
    revision was ``main`` or none); a named branch or tag gets ``refs/<name>``. ``reinstall``: this item's
    bundle was installed before, so a missing snapshot file is a repair. Returns ``{"path",
    "blobs_added", "blobs_shared", "repaired"}`` (``repaired``: installed files that were missing or wrong).
    """
    repo_id = item["repo_id"]
    revision = item["revision"]
    repo_dir = hub_dir / _repo_folder(repo_type, repo_id)
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    added = shared = 0
    repaired: list[str] = []
    for entry in item["files"]:
        blob = blobs / entry["sha256"]
        staged = src / entry["path"]
        if blob.exists() and (_same_inode(staged, blob) or _same_file(blob, entry["size"], entry["sha256"])):
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
        tmp = _mkdtemp(f"snapshot-{revision}-", scratch)
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
            _atomic_symlink(want, link)
    refs = repo_dir / "refs"
    requested = item.get("revision_requested")
    if requested and requested != revision and requested != "main":
        _write_ref(refs / requested, revision)
    if requested in (None, "", "main"):
        _write_ref(refs / "main", revision)
    return {"path": str(snap), "blobs_added": added, "blobs_shared": shared, "repaired": repaired}


def _write_ref(path: Path, revision: str) -> None:
    if path.is_file() and path.read_text().strip() == revision:
        return
    _atomic_text(path, revision)


def content_id(item: dict) -> str:
    """sha1 (40 hex) over an item's sorted ``(path, sha256)`` pairs: what its files are, whatever its revision
    name says (a ModelScope ``master`` re-packed later names other bytes). Equal to
    ``bundler.sources.local_revision`` of the same files (a test keeps them equal)."""
    h = hashlib.sha1()
    for rel, digest in sorted((e["path"], e["sha256"]) for e in item["files"]):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def _same_content(record: dict | None, item: dict) -> bool:
    """Whether an install record describes ``item``'s files (records of older installs hold a revision only)."""
    if not record:
        return False
    if "content" in record:
        return record["content"] == content_id(item)
    return record.get("revision") == item["revision"]


def _tree_matches(dest: Path, item: dict) -> list[str]:
    """Files of ``item`` that are missing or differ under an installed folder ``dest`` (re-hashed)."""
    return [e["path"] for e in item["files"] if not _same_file(dest / e["path"], e["size"], e["sha256"])]


class Journal:
    """Folders an install swapped out, kept until the install is complete (``PREFIX/.ferry/journal.json``).

    Before a dataset or ModelScope folder is replaced, the journal records ``{"dest", "old"}``; the old folder
    moves to ``PREFIX/.ferry/replaced/`` (not into the staging area, which the next install deletes) and the
    text of ``datasets/dataset_info.json`` is saved once. :meth:`commit` (after the install record is written)
    deletes the old folders and the journal. An install killed in between leaves the journal: the next install
    calls :meth:`roll_back` first, which puts every old folder back and restores dataset_info.json, so the
    prefix again matches its install record (nothing is lost, however often installs are killed).
    """

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.path = prefix / ".ferry" / "journal.json"
        self.entries: list[dict] = []
        self.info_before: str | None = None
        self.info_saved = False

    def _save(self) -> None:
        _atomic_text(self.path, json.dumps({"entries": self.entries, "info_saved": self.info_saved,
                                            "dataset_info": self.info_before}, indent=2) + "\n")

    def save_dataset_info(self, info: Path) -> None:
        """Remember ``info``'s text (or its absence) before the first change to it."""
        if self.info_saved:
            return
        self.info_before = info.read_text("utf-8") if info.is_file() else None
        self.info_saved = True
        self._save()

    def swap(self, src: Path, dest: Path) -> None:
        """Replace the folder ``dest`` by ``src``: the old one is recorded and kept in ``.ferry/replaced``."""
        self.retire(dest)
        os.rename(src, dest)

    def retire(self, path: Path) -> None:
        """Move the folder ``path`` out of the way (deleted by :meth:`commit`, put back by :meth:`roll_back`)."""
        aside = self.prefix / ".ferry" / "replaced"
        aside.mkdir(parents=True, exist_ok=True)
        old = _mkdtemp("old-", aside) / path.name
        self.entries.append({"dest": str(path.relative_to(self.prefix)), "old": str(old.relative_to(self.prefix))})
        self._save()
        os.rename(path, old)

    def commit(self) -> None:
        """The install is complete: drop what was swapped out and the journal."""
        shutil.rmtree(self.prefix / ".ferry" / "replaced", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def roll_back(self, log: Callable[[str], None]) -> None:
        """Undo an install that was killed before it completed (see the class docstring)."""
        if not self.path.is_file():
            shutil.rmtree(self.prefix / ".ferry" / "replaced", ignore_errors=True)
            return
        try:
            journal = json.loads(self.path.read_text("utf-8"))
            entries = list(journal["entries"])
        except (OSError, ValueError, KeyError, TypeError):
            raise BundleError(f"{self.path} is unreadable: an earlier install was interrupted; inspect "
                              f"{self.prefix / '.ferry' / 'replaced'} and remove the journal") from None
        for entry in reversed(entries):
            dest, old = self.prefix / check_relpath(entry["dest"], "journal"), \
                self.prefix / check_relpath(entry["old"], "journal")
            if not os.path.lexists(old):
                continue
            if os.path.lexists(dest):
                shutil.rmtree(dest, ignore_errors=True)
            os.rename(old, dest)
            log(f"restored {dest} (an earlier install was interrupted before it completed)")
        if journal.get("info_saved"):
            info = self.prefix / "datasets" / "dataset_info.json"
            if journal.get("dataset_info") is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(info)
            else:
                _atomic_text(info, journal["dataset_info"])
        self.commit()


def place_tree(src: Path, dest: Path, item: dict, state: dict, key: str, journal: Journal,
               **extra: str) -> str:
    """Move the staged folder ``src`` to ``dest`` in one rename. An installed ``dest`` recorded in ``state``
    with the same content (:func:`content_id`) is re-hashed: kept when every file matches (``'unchanged'``),
    else replaced by the staged copy (``'repaired'``). A ``dest`` with other content is swapped through ``journal``
    (``'replaced'``); the caller decides beforehand whether replacing is allowed. ``extra`` is stored in the
    item's record (e.g. ``repo_id``). Returns ``'installed'``, ``'replaced'``, ``'repaired'`` or ``'unchanged'``.
    """
    record = state.setdefault("items", {}).get(key)
    revision = item["revision"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and _same_content(record, item):
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
                    f == file_name or f.startswith(file_name.rstrip("/") + "/") for f in files):
                notes.append(f"dataset_info entry {key!r} of {name} skipped (no local file in the bundle)")
                continue
            check_relpath(file_name.rstrip("/"), f"dataset {name}: dataset_info.json[{key!r}].file_name")
            entries[key] = {**value, "file_name": f"{name}/{file_name}"}
        return entries, notes
    if item.get("source") == "hf" and is_repo_layout(files) and any(
            f.split("/")[0] == DATASETS_CACHE_DIRNAME for f in files):
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


def place_hf_dataset(item: dict, dest: Path, prefix: Path, scratch: Path, *, reinstall: bool) -> dict:
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
    links = _mkdtemp("hub-dataset-", scratch)
    for entry in files:
        target = links / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(dest / entry["path"], target)
        except OSError:  # another file system under the prefix, or no hard links there
            shutil.copyfile(dest / entry["path"], target)
    placed = place_hf({**item, "files": files}, links, prefix / "hf-home" / "hub", scratch, repo_type="dataset",
                      reinstall=reinstall)
    shutil.rmtree(links, ignore_errors=True)
    notes: list[str] = []
    arrow = None
    cache_root = dest / DATASETS_CACHE_DIRNAME
    folders = sorted(p.name for p in cache_root.iterdir() if p.is_dir()) if cache_root.is_dir() else []
    for folder in folders:
        link = prefix / "hf-home" / "datasets" / folder
        want = os.path.relpath(cache_root / folder, link.parent)
        if os.path.lexists(link) and not os.path.islink(link):
            notes.append(f"{link} is a folder of its own (not ferry's): left alone, so datasets.load_dataset("
                         f"{item['repo_id']!r}) offline reads that cache, not the installed revision")
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (os.path.islink(link) and os.readlink(link) == want):
            _atomic_symlink(want, link)
        arrow = str(link)
    return {"hub_path": placed["path"], "arrow_cache": arrow, "repaired": placed["repaired"], "notes": notes}


def _read_dataset_info(path: Path) -> dict:
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
        rel = rename[1] + rel[len(rename[0]):]
    target = Path(os.path.realpath(base / rel))
    files: list[tuple[str, str]] = []
    if target.is_file():
        files.append(("", sha256_file(target)[1]))
    elif target.is_dir():
        for root, _, names in os.walk(target):
            for name in sorted(names):
                full = Path(root) / name
                files.append((os.path.relpath(full, target), sha256_file(full)[1]))
    else:
        return None
    return ({k: v for k, v in entry.items() if k != "file_name"}, sorted(files))


def merge_dataset_info(path: Path, entries: dict) -> None:
    """Merge ``entries`` into LLaMA-Factory's ``dataset_info.json`` at ``path`` (new entries win), atomically."""
    current = _read_dataset_info(path)
    merged = {**current, **entries}
    if merged != current or not path.exists():
        _atomic_text(path, json.dumps(merged, indent=2, ensure_ascii=False) + "\n")


def prefix_env(prefix: str | os.PathLike) -> dict[str, str]:
    """The variables ``PREFIX/ferry.env`` sets: FERRY_HOME, HF_HOME, MODELSCOPE_CACHE, FERRY_DATASET_DIR,
    every :data:`OFFLINE_ENV` switch and, when ``PREFIX/venv`` exists, ``PATH`` with its ``bin`` first
    (followed by the current ``$PATH``)."""
    prefix = Path(prefix).absolute()
    env = {
        "FERRY_HOME": str(prefix),
        "HF_HOME": str(prefix / "hf-home"),
        "MODELSCOPE_CACHE": str(prefix / "modelscope"),
        "FERRY_DATASET_DIR": str(prefix / "datasets"),
        **OFFLINE_ENV,
    }
    if (prefix / "venv").exists():
        env["PATH"] = f"{prefix / 'venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


def render_env_file(prefix: Path) -> str:
    """The text of ``PREFIX/ferry.env`` (POSIX shell; ``source`` it)."""
    env = prefix_env(prefix)
    lines = ["# Written by ferry install. Use: source " + _sh(str(Path(prefix).absolute() / "ferry.env"))]
    for key, value in env.items():
        if key == "PATH":
            lines.append(f'export PATH={_sh(str(Path(prefix).absolute() / "venv" / "bin"))}:"$PATH"')
        else:
            lines.append(f"export {key}={_sh(value)}")
    return "\n".join(lines) + "\n"


def _sh(value: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:@%+=,-]+", value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Lock:
    """An exclusive ``flock`` on the prefix directory itself for the whole install (nothing is created in the
    prefix to hold it, so a refused install leaves the prefix exactly as it was)."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix

    def __enter__(self) -> "_Lock":
        import fcntl

        self.fd = os.open(self.prefix, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise BundleError(f"another ferry install is running into {self.prefix}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def _load_state(prefix: Path) -> dict:
    path = prefix / ".ferry" / "state.json"
    if path.is_file():
        try:
            state = json.loads(path.read_text("utf-8"))
            return state if isinstance(state, dict) else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}
    return {}


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces): what an install record remembers,
    so the same ``bundle_id`` with other content is recognised whatever the formatting."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _create_venv(venv_dir: Path, wheels_dir: Path, lock: Path, log: Callable[[str], None]) -> None:
    """``python -m venv venv_dir`` and ``pip install --no-index --find-links wheels --require-hashes -r lock``.
    A complete venv holds ``.ferry-complete``; an incomplete one (killed earlier) is rebuilt."""
    if (venv_dir / ".ferry-complete").exists():
        log(f"venv {venv_dir} already complete")
        return
    shutil.rmtree(venv_dir, ignore_errors=True)
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating venv {venv_dir}")
    proc = subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(venv_dir, ignore_errors=True)
        raise BundleError(f"'{sys.executable} -m venv {venv_dir}' failed (install the python3-venv package, "
                          f"or use --no-venv): {proc.stderr.strip()[-2000:]}")
    python = venv_dir / "bin" / "python"
    cmd = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels_dir),
           "--require-hashes", "--disable-pip-version-check", "--no-input", "-r", str(lock)]
    log("installing wheels: " + " ".join(cmd))
    # The bundle's wheels alone: no PIP_* variable and no pip.conf (a host's find-links or index would
    # otherwise be consulted too; PIP_CONFIG_FILE=os.devnull makes pip skip every configuration file).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        shutil.rmtree(venv_dir, ignore_errors=True)
        raise BundleError(f"pip install from the bundle's wheels failed ({lock}):\n"
                          f"{(proc.stdout + proc.stderr).strip()[-4000:]}")
    (venv_dir / ".ferry-complete").write_text("ok\n")


def _hook_activate(venv_dir: Path, prefix: Path) -> None:
    """Make ``venv/bin/activate`` source ``PREFIX/ferry.env`` (once)."""
    activate = venv_dir / "bin" / "activate"
    if not activate.is_file():
        return
    line = f". {_sh(str(prefix / 'ferry.env'))}  # ferry: offline environment\n"
    text = activate.read_text()
    if line not in text:
        with open(activate, "a") as fh:
            fh.write("\n" + line)


def check_target(manifest: dict) -> None:
    """Refuse, before anything is installed, a bundle whose wheels cannot run on this interpreter and host.

    Compares the manifest's ``target`` (written by ``ferry pack``: ``python`` ``X.Y``, ``implementation``
    ``cp``, ``platforms`` pip tags) with ``sys.version_info``, ``sys.implementation`` and this host: OS and
    architecture (``platform.machine()``, a 32-bit interpreter on x86_64 counts as i686), the glibc version
    (``os.confstr('CS_GNU_LIBC_VERSION')``) for ``manylinux_X_Y`` / ``manylinux2014`` / ``manylinux2010`` /
    ``manylinux1``, the musl version (the loader's banner) for ``musllinux_X_Y``, ``platform.mac_ver()`` for
    ``macosx_X_Y``, and ``win_amd64`` / ``win_arm64`` / ``win32``; ``linux_ARCH`` checks OS and architecture
    only (the rules of PEP 600, 656 and packaging.tags, in the standard library). A target tag it cannot read
    is refused too. A manifest without ``target`` passes.

    Raises:
        BundleError: one line naming the bundle's target and this host's, and what to do.
    """
    import platform as _platform

    target = manifest.get("target") or {}
    here_py = f"{sys.version_info.major}.{sys.version_info.minor}"
    here_impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
    machine = _platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if sys.platform.startswith("linux") else "arm64"}.get(
        machine, machine)
    if machine == "x86_64" and sys.maxsize <= 2 ** 32:
        machine = "i686"
    glibc: tuple[int, int] | None = None
    musl: tuple[int, int] | None = None
    if sys.platform.startswith("linux"):
        try:
            found = re.match(r"glibc (\d+)\.(\d+)", os.confstr("CS_GNU_LIBC_VERSION") or "")
            glibc = (int(found[1]), int(found[2])) if found else None
        except (ValueError, OSError, AttributeError):
            glibc = None
        if glibc is None:
            for loader in Path("/lib").glob("ld-musl-*.so.1"):
                try:
                    banner = subprocess.run([str(loader)], capture_output=True, text=True, timeout=10).stderr
                except (OSError, subprocess.SubprocessError):
                    continue
                found = re.search(r"Version (\d+)\.(\d+)", banner)
                if found:
                    musl = (int(found[1]), int(found[2]))
                    break
    mac = None
    if sys.platform == "darwin":
        mac = tuple(int(x) for x in ((_platform.mac_ver()[0] or "0.0") + ".0").split(".")[:2])
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}

    def fits(tag: str) -> bool:
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
        if m:
            need, arch = (int(m[1]), int(m[2])), m[3]
        else:
            m = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
            need, arch = (legacy[m[1]], m[2]) if m else (None, None)
        if need is not None:
            return glibc is not None and glibc >= need and arch == machine
        m = re.fullmatch(r"musllinux_(\d+)_(\d+)_(\w+)", tag)
        if m:
            return musl is not None and musl >= (int(m[1]), int(m[2])) and m[3] == machine
        m = re.fullmatch(r"linux_(\w+)", tag)
        if m:
            return sys.platform.startswith("linux") and m[1] == machine
        m = re.fullmatch(r"macosx_(\d+)_(\d+)_(\w+)", tag)
        if m:
            arches = {"universal2": {"arm64", "x86_64"}, "intel": {"x86_64"}}.get(m[3], {m[3]})
            return mac is not None and mac >= (int(m[1]), int(m[2])) and machine in arches
        if tag in ("win_amd64", "win_arm64", "win32"):
            return sys.platform == "win32" and machine == {"win_amd64": "x86_64", "win_arm64": "arm64",
                                                          "win32": "i686"}[tag]
        return tag == "any"

    needs, have = [], []
    python = target.get("python")
    if python and python != here_py:
        needs.append(f"Python {python}")
        have.append(f"Python {here_py} ({sys.executable})")
    impl = target.get("implementation")
    if impl and impl != here_impl:
        needs.append(f"implementation {impl}")
        have.append(f"implementation {here_impl}")
    platforms = [p for p in target.get("platforms") or [] if isinstance(p, str)]
    if platforms and not any(fits(p) for p in platforms):
        needs.append("platform " + " or ".join(platforms))
        libc = (f"glibc {glibc[0]}.{glibc[1]}" if glibc else f"musl {musl[0]}.{musl[1]}" if musl
                else f"macOS {mac[0]}.{mac[1]}" if mac else "no glibc or musl found")
        have.append(f"{sys.platform} {machine}, {libc}")
    if needs:
        torch = f", torch build {target['torch']}" if target.get("torch") else ""
        if glibc:
            host_tag = f"manylinux_{glibc[0]}_{glibc[1]}_{machine}"
        elif musl:
            host_tag = f"musllinux_{musl[0]}_{musl[1]}_{machine}"
        elif mac:
            host_tag = f"macosx_{mac[0]}_{mac[1]}_{machine}"
        elif sys.platform == "win32":
            host_tag = {"x86_64": "win_amd64", "arm64": "win_arm64"}.get(machine, "win32")
        else:
            host_tag = f"linux_{machine}"
        raise BundleError(
            f"this bundle's wheels target {', '.join(needs)}{torch}, but this host has {', '.join(have)}: run "
            f"install.py with python{python or here_py} on a host that matches, pack again for this host "
            f"(ferry pack --python-version {here_py} --platform {host_tag}), or use --no-venv")


#: ModelScope's SDK (modelscope 1.40 over modelscope-hub 0.5) has no offline switch of its own: no environment
#: variable makes ``snapshot_download`` or ``AutoModelForCausalLM.from_pretrained("ORG/NAME")`` skip the network;
#: only the keyword ``local_files_only=True`` does. This module, placed in the venv's site-packages with the
#: ``.pth`` line that imports it (see :func:`ms_offline_hook_files`), adds that keyword to the SDK's download
#: entry points whenever ``MODELSCOPE_OFFLINE`` is true (ferry.env sets it), read at each call.
MS_OFFLINE_HOOK_MODULE = "_ferry_modelscope_offline"
_MS_OFFLINE_HOOK_SOURCE = '''"""Written by ferry install: ModelScope's SDK honours MODELSCOPE_OFFLINE=1 (stdlib).

modelscope >= 1.38 downloads through modelscope_hub.compat, whose snapshot_download / model_file_download
(and the dataset variants) list the repository on the network unless called with local_files_only=True, and no
environment variable sets that (modelscope 1.40.2, modelscope-hub 0.5.1). While MODELSCOPE_OFFLINE is 1/true/
yes/on at call time, this hook passes local_files_only=True to them, so the SDK answers from $MODELSCOPE_CACHE
at once or raises its CacheNotFound error. A function without that keyword (another SDK version) is left as it
is. Remove this file and {module}.pth to turn the hook off.
"""

import importlib.machinery
import os
import sys

_TARGETS = {{
    "modelscope_hub.compat.snapshot_download": ("snapshot_download", "dataset_snapshot_download"),
    "modelscope_hub.compat.file_download": ("model_file_download", "dataset_file_download"),
}}


def offline():
    return os.environ.get("MODELSCOPE_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _forcing(func):
    import functools
    import inspect

    try:
        if "local_files_only" not in inspect.signature(func).parameters:
            return func
    except (TypeError, ValueError):
        return func

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if offline():
            kwargs["local_files_only"] = True
        return func(*args, **kwargs)

    wrapper.__ferry_offline__ = True
    return wrapper


def _patch(module):
    for attr in _TARGETS.get(module.__name__, ()):
        func = getattr(module, attr, None)
        if callable(func) and not getattr(func, "__ferry_offline__", False):
            setattr(module, attr, _forcing(func))


class _Finder:
    """Finds the targets as the path finder does, then patches them right after they are executed (before
    any ``from ... import`` of their functions elsewhere)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install():
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(type(f).__name__ == "_Finder" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:  # never break interpreter start-up
    pass
'''.format(module=MS_OFFLINE_HOOK_MODULE)


def ms_offline_hook_files() -> dict[str, str]:
    """Files to write into a venv's ``site-packages`` (``sysconfig.get_path("purelib", vars={"base": VENV,
    "platbase": VENV})``) so that ModelScope's SDK in that venv stays offline while ``MODELSCOPE_OFFLINE`` is
    true: ``{"_ferry_modelscope_offline.py": <hook source>, "_ferry_modelscope_offline.pth": "import ..."}``
    (file name -> text). Python runs the ``.pth`` line at start-up (the ``site`` module); the hook costs one
    dictionary look-up per import until ``modelscope_hub.compat`` is imported.

    Why a hook: modelscope 1.40.2 / modelscope-hub 0.5.1 read no offline variable at all (modelscope_hub/
    constants.py registers every variable they read; none is an offline switch), and
    ``AutoModelForCausalLM.from_pretrained("ORG/NAME")`` calls ``snapshot_download`` without
    ``local_files_only`` (modelscope/utils/hf_util/patcher.py ``get_model_dir``), which lists the repository on
    modelscope.cn and fails after ~22 s of retries on an isolated host.
    """
    return {
        f"{MS_OFFLINE_HOOK_MODULE}.py": _MS_OFFLINE_HOOK_SOURCE,
        f"{MS_OFFLINE_HOOK_MODULE}.pth": f"import {MS_OFFLINE_HOOK_MODULE}\n",
    }


def ms_model_dir(prefix: Path, repo_id: str, revision: str) -> Path:
    """Where a ModelScope model ``ORG/NAME`` at ``revision`` (the name asked for, ``master`` by default; the
    manifest's ``revision_requested``) goes in a prefix: ``PREFIX/modelscope/models/ORG--NAME/snapshots/REVISION``,
    the layout modelscope-hub (>= 0.1, used by modelscope >= 1.38) writes and reads under ``$MODELSCOPE_CACHE``
    (modelscope_hub/_download.py ``_repo_cache_dir_path``, ``_resolve_cached_snapshot``). The files go there
    as they are (no blobs, links or metadata files: the SDK reads none).

    The SDK looks this folder up by revision: ``from_pretrained("ORG/NAME")`` asks for ``master``
    (patcher.py ``_ms_revision``), ``snapshot_download("ORG/NAME")`` for ``master``, then ``main``, then the
    only snapshot present. A model packed at another revision is found by passing ``revision=`` (else the
    SDK names the revisions it has). The older layout ``models/ORG/NAME___`` (dots as ``___``) is still read,
    before this one and whatever the revision asked: an install must not leave one behind for the same repo.

    Raises:
        BundleError: ``repo_id`` is not ``ORG/NAME`` or ``revision`` is not a safe relative name.
    """
    owner, _, name = repo_id.partition("/")
    bad = {"", ".", ".."}
    if owner in bad or name in bad or "/" in name or "\\" in repo_id:
        raise BundleError(f"ModelScope repo id {repo_id!r} is not ORG/NAME")
    parts = revision.split("/")
    if not revision or revision.startswith("/") or any(p in bad for p in parts) or "\\" in revision:
        raise BundleError(f"ModelScope revision {revision!r} of {repo_id} is not a safe relative name")
    return Path(prefix) / "modelscope" / "models" / f"{owner}--{name}" / "snapshots" / Path(*parts)


def _inside(root_real: str, path: Path, what: str) -> None:
    """Refuse ``path`` unless it, with every symbolic link already on disk resolved, lies inside ``root_real``
    (the prefix's own real path)."""
    real = os.path.realpath(path)
    if real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep):
        raise UnsafeArchiveError(f"{what} would be written at {path}, which resolves to {real}, outside the "
                                 f"prefix {root_real} (refused; nothing was installed)")


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
        raise BundleError(f"bundle ID {manifest['bundle_id']} ({manifest['name']}) already installed with "
                          f"different content: refused (a forged or altered bundle re-uses a genuine bundle's id)")
    checks: list[tuple[Path, str]] = [
        (prefix / "venv", "the venv link"), (prefix / "venvs" / manifest["bundle_id"], "the bundle's venv"),
        (prefix / "ferry.env", "ferry.env"), (prefix / ".ferry" / "state.json", "the install record"),
        (prefix / "datasets" / "dataset_info.json", "dataset_info.json"),
        (prefix / WHEEL_STORE_DIRNAME, "the wheel store"),
    ]
    plans: list[dict] = []
    dataset_ids = [i["repo_id"] for i in manifest["items"] if i["kind"] == "dataset"]
    _read_dataset_info(prefix / "datasets" / "dataset_info.json")  # an unreadable registry: refused up front
    hub = prefix / "hf-home" / "hub"
    for i, item in enumerate(manifest["items"]):
        kind, source = item["kind"], item["source"]
        here = f"items[{i}] ({item.get('repo_id') or kind})"
        if kind == "wheels":
            continue
        if kind == "model" and source == "ms":
            dest = ms_model_dir(prefix, item["repo_id"], item.get("revision_requested") or "master")
            plans.append({"item": item, "kind": "ms-model", "dest": dest, "key": f"ms-model:{item['repo_id']}"})
            checks.append((dest, f"{here}: the ModelScope folder"))
        elif kind == "model":
            repo_dir = hub / _repo_folder("model", item["repo_id"])
            plans.append({"item": item, "kind": "hf-model", "repo_dir": repo_dir, "dest": repo_dir})
            checks += [(repo_dir / "blobs", f"{here}: blobs"), (repo_dir / "refs", f"{here}: refs"),
                       (repo_dir / "snapshots" / item["revision"], f"{here}: the snapshot")]
            requested = item.get("revision_requested")
            if requested:
                checks.append((repo_dir / "refs" / requested, f"{here}: refs/{requested}"))
            snap = repo_dir / "snapshots" / item["revision"]
            if snap.is_dir():
                checks += [((snap / e["path"]).parent, f"{here}: {e['path']}") for e in item["files"]]
        else:
            name = dataset_folder_name(item["repo_id"], dataset_ids, state)
            dest = prefix / "datasets" / name
            key = f"dataset:{name}"
            plans.append({"item": item, "kind": "dataset", "dest": dest, "name": name, "key": key})
            checks.append((dest, f"{here}: the dataset folder"))
            if source == "hf":  # also placed in the hub cache, its datasets cache linked (place_hf_dataset)
                repo_dir = hub / _repo_folder("dataset", item["repo_id"])
                checks += [(repo_dir / "blobs", f"{here}: blobs"), (repo_dir / "refs", f"{here}: refs"),
                           (repo_dir / "snapshots" / item["revision"], f"{here}: the snapshot"),
                           (prefix / "hf-home" / "datasets", f"{here}: the datasets cache")]
                if item.get("revision_requested"):
                    checks.append((repo_dir / "refs" / item["revision_requested"],
                                   f"{here}: refs/{item['revision_requested']}"))
            old = state.get("items", {}).get(key)
            if not replace_datasets and os.path.lexists(dest) and not _same_content(old, item):
                was = f"revision {old['revision'][:12]}" if old and old.get("revision") else "unknown content"
                raise BundleError(f"dataset {name!r} is already installed at {dest} with other content ({was}; "
                                  f"this bundle has {item['revision'][:12]}): refused; install with "
                                  f"--replace-datasets to replace it")
    for path, what in checks:
        _inside(root, path, what)
    return plans


def install_staged(
    manifest: dict, staged: Path, prefix: Path, *, create_venv: bool = True,
    log: Callable[[str], None] = _say, replace_datasets: bool = False,
) -> dict:
    """Install a verified bundle staged at ``staged`` (the bundle folder inside ``PREFIX/.staging-XXXX``; that
    staging directory, on the same file system as ``prefix``, also holds temporary snapshot folders, and the
    caller removes it).

    Steps (after verification, which the caller did while staging): plan and check every destination
    (:func:`plan_install`), build the venv (when the bundle has wheels and ``create_venv``), place models,
    ModelScope models and datasets (re-hashing what an earlier install placed: missing or corrupt files are
    repaired), keep the wheels in ``PREFIX/wheels`` (:func:`keep_wheels`), then switch ``PREFIX/venv``, write
    ``PREFIX/ferry.env``, hook ``activate``, record the bundle
    and its manifest in ``PREFIX/.ferry`` (``state.json``, ``manifests/<bundle_id>.json``) and drop what was
    swapped out (:class:`Journal`). Returns a summary dict: ``{"bundle_id", "name", "models", "datasets",
    "venv", "already_installed", "repaired", "notes"}``.

    Raises:
        UnsafeArchiveError, BundleError: see :func:`plan_install`; nothing was written.
        BundleError: the bundle's wheels target another Python, venv creation or pip failed; a dataset entry
            of dataset_info.json is taken (without ``replace_datasets``).
    """
    prefix = Path(prefix).absolute()
    scratch = _mkdtemp("place-", staged.parent)
    state = _load_state(prefix)
    plans = plan_install(manifest, prefix, state, replace_datasets=replace_datasets)
    already = manifest["bundle_id"] in state.get("bundles", {})
    summary: dict = {"bundle_id": manifest["bundle_id"], "name": manifest["name"], "models": [],
                     "datasets": [], "venv": None, "already_installed": already, "notes": [], "repaired": []}
    info_path = prefix / "datasets" / "dataset_info.json"
    # Entries of dataset_info.json first: a name taken by other content is refused before anything moves.
    all_entries: dict = {}
    for plan in plans:
        if plan["kind"] == "dataset":
            entries, notes = dataset_entries(plan["item"], plan["name"], staged / plan["item"]["path"])
            plan["entries"] = entries
            summary["notes"].extend(notes)
            all_entries.update(entries)
    current_info = _read_dataset_info(info_path)
    taken = sorted(k for k, v in all_entries.items() if k in current_info and current_info[k] != v
                   and ("file_name" not in v or _entry_content(prefix / "datasets", current_info[k]) != _entry_content(
                       staged, v, rename=(v["file_name"].split("/")[0], _item_path(plans, v)))))
    if taken and not replace_datasets:
        raise BundleError(f"{info_path}: entr{'y' if len(taken) == 1 else 'ies'} {', '.join(map(repr, taken))} "
                          f"already name other data: refused; install with --replace-datasets to replace them")
    wheels = [i for i in manifest["items"] if i["kind"] == "wheels" and i["files"]]
    venv_dir = prefix / "venvs" / manifest["bundle_id"]
    if wheels and create_venv:
        check_target(manifest)
        wheel_dir = staged / wheels[0]["path"]
        lock = staged / wheels[0]["path"] / LOCK_NAME
        if not lock.is_file():
            lock = staged / "wheels" / LOCK_NAME
        _create_venv(venv_dir, wheel_dir, lock, log)
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv_dir), "platbase": str(venv_dir)}))
        for file_name, text in ms_offline_hook_files().items():
            if not (purelib / file_name).is_file() or (purelib / file_name).read_text("utf-8") != text:
                _atomic_text(purelib / file_name, text)
    if wheels:  # kept in PREFIX/wheels/<sha256>: what a later delta bundle's from_base wheels are taken from
        keep_wheels(wheels[0], staged / wheels[0]["path"], prefix, summary["repaired"])
    for name in tool_files(manifest):  # serving tools (ferry/serving_tools.py) into PREFIX/tools, by rename
        (prefix / "tools").mkdir(exist_ok=True)
        if os.path.isfile(staged / "wheels" / name):
            os.replace(staged / "wheels" / name, prefix / "tools" / name)
    journal = Journal(prefix)
    for plan in plans:
        item = plan["item"]
        src = staged / item["path"]
        if plan["kind"] == "ms-model":
            earlier = (state.get("items", {}).get(plan["key"]) or {}).get("path")
            outcome = place_tree(src, plan["dest"], item, state, plan["key"], journal)
            if earlier and Path(earlier) != plan["dest"] and os.path.isdir(earlier):
                # an older layout (models/ORG/NAME___), which the SDK reads first whatever revision is asked
                _inside(os.path.realpath(prefix), Path(earlier), f"the earlier folder of {item['repo_id']}")
                journal.retire(Path(earlier))
            summary["models"].append({"repo_id": item["repo_id"], "revision": item["revision"],
                                      "path": str(plan["dest"]), "outcome": outcome})
        elif plan["kind"] == "hf-model":
            placed = place_hf(item, src, prefix / "hf-home" / "hub", scratch, reinstall=already)
            summary["repaired"].extend(placed.pop("repaired"))
            summary["models"].append({"repo_id": item["repo_id"], "revision": item["revision"], **placed})
        else:
            if plan["entries"]:
                journal.save_dataset_info(info_path)
            outcome = place_tree(src, plan["dest"], item, state, plan["key"], journal, repo_id=item["repo_id"])
            merge_dataset_info(info_path, plan["entries"])
            summary["datasets"].append({"name": plan["name"], "repo_id": item["repo_id"], "path": str(plan["dest"]),
                                        "outcome": outcome, "entries": sorted(plan["entries"])})
            if item["source"] == "hf":
                hub = place_hf_dataset(item, plan["dest"], prefix, scratch, reinstall=already)
                summary["repaired"].extend(hub.pop("repaired"))
                summary["notes"].extend(hub.pop("notes"))
                summary["datasets"][-1].update(hub)
        if summary[("datasets" if plan["kind"] == "dataset" else "models")][-1].get("outcome") == "repaired":
            summary["repaired"].append(f"{item['repo_id']}: folder {plan['dest']} (files were missing or corrupt)")
    if wheels and create_venv:
        link = prefix / "venv"
        want = os.path.join("venvs", manifest["bundle_id"])
        if not (link.is_symlink() and os.readlink(link) == want):
            _atomic_symlink(want, link)
        _hook_activate(venv_dir, prefix)
        summary["venv"] = str(link)
    elif (prefix / "venv").exists():
        summary["venv"] = str(prefix / "venv")
    env_text = render_env_file(prefix)
    env_file = prefix / "ferry.env"
    if not env_file.is_file() or env_file.read_text() != env_text:
        _atomic_text(env_file, env_text)
    manifest_copy = prefix / ".ferry" / "manifests" / f"{manifest['bundle_id']}.json"
    if not manifest_copy.is_file():
        _atomic_text(manifest_copy, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    bundles = state.setdefault("bundles", {})
    if not already:
        bundles[manifest["bundle_id"]] = {"name": manifest["name"], "installed": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bundles[manifest["bundle_id"]]["manifest_sha256"] = manifest_digest(manifest)
    if wheels:
        bundles[manifest["bundle_id"]]["wheel_store"] = True
    for plan in plans:  # which bundle placed what: `ferry verify --prefix` checks each item against it
        key = plan.get("key") or f"hf-model:{plan['item']['repo_id']}@{plan['item']['revision']}"
        record = state.setdefault("items", {}).setdefault(key, {"revision": plan["item"]["revision"],
                                                                "content": content_id(plan["item"]),
                                                                "path": str(plan["dest"])})
        if _same_content(record, plan["item"]):
            record["bundle_id"] = manifest["bundle_id"]
    state_text = json.dumps(state, indent=2, sort_keys=True) + "\n"
    state_file = prefix / ".ferry" / "state.json"
    if not state_file.is_file() or state_file.read_text("utf-8") != state_text:
        _atomic_text(state_file, state_text)
    journal.commit()
    return summary


def _clean_stray_temps(prefix: Path) -> list[str]:
    """Remove what a killed install leaves: staging folders, ``.NAME.XXXX.tmp`` files of atomic writes and
    ``.NAME.PID.TID.lnk`` links (ferry.env, state.json, dataset_info.json, refs/*, the venv link). Runs under
    the prefix lock, so no other install owns them. Returns the removed paths."""
    removed = []
    for stale in prefix.glob(".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(str(stale))
    candidates = [prefix, prefix / ".ferry", prefix / ".ferry" / "manifests", prefix / "datasets",
                  prefix / WHEEL_STORE_DIRNAME]
    hub = prefix / "hf-home" / "hub"
    if hub.is_dir():
        for repo in hub.glob("*--*"):
            refs = repo / "refs"
            if refs.is_dir():
                candidates += [Path(root) for root, _, _ in os.walk(refs)]
    for folder in candidates:
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".") and (path.name.endswith(".tmp") or path.name.endswith(".lnk")):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(str(path))
    return removed


def _writable_prefix(prefix: Path) -> None:
    """Create ``prefix`` if needed and check that this account can write into it (one line otherwise)."""
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise PrefixError(f"cannot create the prefix {prefix}: permission denied (choose another --prefix, or "
                          f"run as its owner)") from None
    except OSError as exc:
        raise PrefixError(f"cannot create the prefix {prefix}: {exc.strerror}") from None
    if os.statvfs(prefix).f_flag & os.ST_RDONLY:
        raise PrefixError(f"the prefix {prefix} is on a read-only file system: choose another --prefix")
    if not os.access(prefix, os.W_OK | os.X_OK):
        st = prefix.stat()
        raise PrefixError(f"the prefix {prefix} is not writable by this account (uid {os.getuid()}; owner uid "
                          f"{st.st_uid}, mode {stat.filemode(st.st_mode)}): choose another --prefix, or run as "
                          f"its owner")
    probe = prefix / f".ferry-write-test.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PrefixError(f"the prefix {prefix} cannot be written: {exc.strerror} (a read-only file system?)") from None


def _early_target_check(bundle: Path) -> None:
    """Refuse a bundle whose wheels cannot run here from its metadata head (a few hundred kB), before its
    payload is copied into staging; :func:`install_staged` checks again against the verified manifest."""
    try:
        head = read_head(bundle)
        manifest = parse_manifest(head["manifest"]) if head.get("manifest") else None
    except (BundleError, OSError):
        return  # not metadata-first, or unreadable: the full pass decides
    if manifest and any(i["kind"] == "wheels" and i["files"] for i in manifest["items"]):
        check_target(manifest)


def install_bundle(
    bundle: Path, prefix: Path, *, create_venv: bool = True, reference: Path | None = None,
    progress: Progress | None = None, log: Callable[[str], None] = _say, private: bool = False,
    replace_datasets: bool = False, allowed_signers: Path | None = None, require_signature: bool = False,
) -> tuple[dict, Scan, dict]:
    """Verify and install ``bundle`` (a directory, archive or first volume) into ``prefix``.

    Every file is copied or extracted into ``PREFIX/.staging-XXXX`` while hashed (one read), checked against
    the manifest (every field validated, :func:`validate_manifest`), then installed by :func:`install_staged`.
    The staging directory is removed at the end, on success or failure; stale ones and stray temp files from
    killed runs are removed first, and an install killed half-way is rolled back (:class:`Journal`).
    A delta bundle (:func:`is_delta`) is completed in the staging directory by :func:`apply_delta` after its
    carried files are verified and before anything is placed: every ``from_base`` file must be in the prefix
    with its sha256, and ``tensors`` files are rebuilt and checked.
    What is written is readable by every account (directories 0755, files 0644, whatever the caller's umask),
    or with ``private`` by the installing account alone (0700 / 0600). Returns ``(manifest, scan, summary)``.

    Raises:
        PrefixError: the prefix cannot be created or written (read-only, another owner), in one line.
        InsufficientSpaceError: up front, when ``prefix`` cannot hold the bundle (plus its venv), or when the
            disk fills up part-way (another writer); nothing half-written is visible then either.
        IntegrityError / UnsafeArchiveError / BundleError: see :func:`check_bundle` and :func:`plan_install`;
            nothing was installed, nothing outside the prefix was touched.
        IntegrityError (one line): a delta's ``from_base`` file the prefix lacks or that drifted, a rebuilt
            file whose sha256 differs (:func:`apply_delta`); nothing was installed.
    """
    bundle = Path(bundle)
    prefix = Path(prefix).absolute()
    old_mask = os.umask(PRIVATE_UMASK if private else SHARED_UMASK)
    created = not os.path.lexists(prefix)
    try:
        _writable_prefix(prefix)
        _inside(os.path.realpath(prefix), prefix / ".ferry", "the prefix's .ferry folder")
        with _Lock(prefix):
            _clean_stray_temps(prefix)
            Journal(prefix).roll_back(log)
            needed = bundle_bytes(bundle)
            ensure_free_space(prefix, needed, f"installing {bundle.name}")
            if create_venv:
                _early_target_check(bundle)
            if not (allowed_signers or require_signature or (prefix / ".ferry" / POLICY_NAME).is_file()):
                _early_delta_check(bundle, prefix)  # (with signers, the signature is checked first)
            staging = _mkdtemp(".staging-", prefix)
            try:
                tree = staging / "bundle"
                tree.mkdir()
                manifest, scan = check_bundle(bundle, reference, progress, dest=tree)
                check_prefix_policy(prefix, bundle, scan, tree, reference, allowed_signers, require_signature)
                delta = None
                if is_delta(manifest):  # every from_base file checked in the prefix, before anything is placed
                    delta = apply_delta(manifest, tree, prefix, log=log)
                if create_venv and _wheel_bytes(manifest):
                    ensure_free_space(prefix, WHEEL_EXPANSION * _wheel_bytes(manifest), "the bundle's venv")
                summary = install_staged(manifest, tree, prefix, create_venv=create_venv, log=log,
                                         replace_datasets=replace_datasets)
                summary["delta"] = delta
                record_prefix_policy(prefix, allowed_signers)
            except PermissionError as exc:
                raise PrefixError(f"permission denied writing {exc.filename or prefix} while installing "
                                  f"{bundle.name}: the prefix or part of it belongs to another account or is "
                                  f"read-only") from None
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, FerryError):
                    raise InsufficientSpaceError(
                        f"ran out of disk space in {prefix} while installing {bundle.name} ({exc}); what is "
                        f"already in place is complete and nothing half-written is visible: free some space and "
                        f"run the install again") from None
                if exc.errno == errno.EROFS and not isinstance(exc, FerryError):
                    raise PrefixError(f"{prefix} is on a read-only file system") from None
                raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        if created:  # a refused first install leaves no empty prefix behind
            with contextlib.suppress(OSError):
                os.rmdir(prefix)
        raise
    finally:
        os.umask(old_mask)
    return manifest, scan, summary


# --------------------------------------------------------------------------------------------------------------
# Checking an installed prefix for drift.
# --------------------------------------------------------------------------------------------------------------


def _record_digest(path: Path) -> tuple[int, str]:
    """A file's size and sha256 in pip's RECORD form (``sha256=`` urlsafe base64 without padding)."""
    import base64

    size, hasher = _hash_file(path)
    return size, base64.urlsafe_b64encode(hasher.digest()).rstrip(b"=").decode()


def _check_venv(venv: Path, problems: list[str], counts: list[int]) -> None:
    """Re-hash every file a wheel installed into ``venv`` against its ``*.dist-info/RECORD`` (PEP 376 / 627:
    ``path,sha256=<urlsafe-b64>,size``); files RECORD lists without a hash (RECORD itself, ``.pyc``) are
    skipped."""
    if not (venv / ".ferry-complete").is_file():
        problems.append(f"venv {venv} is incomplete (no .ferry-complete): re-install the bundle")
        return
    import csv

    for record in sorted(venv.glob("lib/python*/site-packages/*.dist-info/RECORD")):
        site = record.parent.parent
        with open(record, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
        for row in rows:
            if len(row) < 3 or not row[1].startswith("sha256="):
                continue
            path = os.path.normpath(site / row[0])
            rel = os.path.relpath(path, venv)
            if not os.path.isfile(path):
                problems.append(f"missing: venv file {rel} ({record.parent.name})")
                continue
            size, digest = _record_digest(Path(path))
            counts[0] += 1
            counts[1] += size
            if digest != row[1][len("sha256="):] or (row[2] and int(row[2]) != size):
                problems.append(f"changed: venv file {rel} ({record.parent.name})")


#: Copy of ferry/serving_tools.py's TOOL_FILES (a test keeps them equal): file name -> sha256 of the serving tools a
#: bundle's wheels/ may carry; install places them in PREFIX/tools/.
TOOL_FILES = {"llama_cpp_python-0.3.36.tar.gz": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}


def tool_files(manifest: dict) -> list[str]:
    """Names of the serving tools in the manifest's wheels item (only names of :data:`TOOL_FILES` whose pinned
    sha256 the manifest states)."""
    return sorted(f["path"] for i in manifest["items"] if i["kind"] == "wheels" for f in i["files"]
                  if TOOL_FILES.get(f["path"]) == f["sha256"])


def verify_prefix(prefix: Path, progress: Progress | None = None) -> dict:
    """Re-hash every installed file of ``prefix`` against the manifests recorded there, offline.

    Checks, for every bundle in ``PREFIX/.ferry/state.json`` (its manifest copy in ``.ferry/manifests``): each
    hub model's snapshot links and the blobs they reach (size and sha256), each dataset and ModelScope folder
    that this bundle placed last (missing, changed and extra files), the bundle's venv against the wheels'
    RECORD hashes, and ``ferry.env``. Returns ``{"bundles", "files", "bytes", "problems"}`` (problems empty when
    nothing drifted).

    Raises:
        NotInstalled-like BundleError: ``prefix`` holds no install record.
    """
    prefix = Path(prefix).absolute()
    state_file = prefix / ".ferry" / "state.json"
    if not state_file.is_file():
        raise BundleError(f"{prefix} holds no ferry install record ({state_file} is missing)")
    state = _load_state(prefix)
    problems: list[str] = []
    counts = [0, 0]  # files, bytes
    seen: set[tuple[str, str]] = set()
    items_state = state.get("items", {})

    def check(path: Path, entry: dict, label: str) -> None:
        if not os.path.lexists(path):
            problems.append(f"missing: {label}")
            return
        try:
            size, digest = sha256_file(path, progress)
        except OSError as exc:
            problems.append(f"unreadable: {label} ({exc.strerror})")
            return
        counts[0] += 1
        counts[1] += size
        if size != entry["size"] or digest != entry["sha256"]:
            problems.append(f"changed: {label} ({size} bytes, sha256 {digest[:12]}; the manifest says "
                            f"{entry['size']} bytes, {entry['sha256'][:12]})")

    bundles = state.get("bundles", {})
    for bundle_id, record in sorted(bundles.items()):
        copy = prefix / ".ferry" / "manifests" / f"{bundle_id}.json"
        if not copy.is_file():
            problems.append(f"bundle {record.get('name')} ({bundle_id}): no manifest copy in {copy.parent} "
                            f"(installed by an older ferry: install it again to record it)")
            continue
        try:
            manifest = parse_manifest(copy.read_bytes(), str(copy))
        except BundleError as exc:
            problems.append(str(exc))
            continue
        if record.get("manifest_sha256") not in (None, manifest_digest(manifest)):
            problems.append(f"changed: {copy} (differs from the install record)")
        for item in manifest["items"]:
            kind, source = item["kind"], item["source"]
            if kind == "model" and source != "ms":  # hub and local models live in the HF cache
                snap = prefix / "hf-home" / "hub" / _repo_folder("model", item["repo_id"]) / "snapshots" / item["revision"]
                for entry in item["files"]:
                    rel = os.path.relpath(snap / entry["path"], prefix)
                    if (rel, entry["sha256"]) in seen:
                        continue
                    seen.add((rel, entry["sha256"]))
                    check(snap / entry["path"], entry, rel)
            elif kind in ("model", "dataset"):
                key = f"ms-model:{item['repo_id']}" if kind == "model" else next(
                    (k for k, v in items_state.items() if k.startswith("dataset:") and v.get("repo_id") == item["repo_id"]
                     and _same_content(v, item)), None)
                placed = items_state.get(key or "", {})
                if placed.get("bundle_id", bundle_id) != bundle_id or not _same_content(placed, item):
                    continue  # replaced later by another bundle (checked against that one)
                dest = Path(placed.get("path") or ms_model_dir(prefix, item["repo_id"],
                                                               item.get("revision_requested") or "master"))
                _inside(os.path.realpath(prefix), dest, f"the recorded folder of {item['repo_id']}")
                for entry in item["files"]:
                    check(dest / entry["path"], entry, os.path.relpath(dest / entry["path"], prefix))
                listed = {e["path"] for e in item["files"]}
                for root, _, names in os.walk(dest):
                    for name in names:
                        rel = posixpath.normpath(os.path.relpath(os.path.join(root, name), dest).replace(os.sep, "/"))
                        if rel not in listed:
                            problems.append(f"extra file: {os.path.relpath(os.path.join(root, name), prefix)}")
        for item in manifest["items"]:
            for entry in item["files"] if item["kind"] == "wheels" else []:
                if entry["path"] in tool_files(manifest) and ("tools/" + entry["path"], entry["sha256"]) not in seen:
                    seen.add(("tools/" + entry["path"], entry["sha256"]))
                    check(prefix / "tools" / entry["path"], entry, "tools/" + entry["path"])
        if any(i["kind"] == "wheels" and i["files"] for i in manifest["items"]):
            venv = prefix / "venvs" / bundle_id
            if venv.is_dir():
                _check_venv(venv, problems, counts)
            if record.get("wheel_store"):  # installed by a ferry that keeps the wheels (for delta bundles)
                for item in (i for i in manifest["items"] if i["kind"] == "wheels"):
                    for entry in item["files"]:
                        stored = prefix / WHEEL_STORE_DIRNAME / entry["sha256"]
                        if (str(stored), entry["sha256"]) not in seen:
                            seen.add((str(stored), entry["sha256"]))
                            check(stored, entry, f"{WHEEL_STORE_DIRNAME}/{entry['sha256']} ({entry['path']})")
    env_file = prefix / "ferry.env"
    if not env_file.is_file():
        problems.append("missing: ferry.env")
    elif env_file.read_text("utf-8", errors="replace") != render_env_file(prefix):
        problems.append("changed: ferry.env (differs from what ferry install writes)")
    return {"bundles": len(bundles), "files": counts[0], "bytes": counts[1], "problems": problems}

# --------------------------------------------------------------------------------------------------------------
# Signatures.
# --------------------------------------------------------------------------------------------------------------
#
# ``ferry pack --sign KEY`` signs manifest.json's exact bytes with ``ssh-keygen -Y sign -n ferry-bundle``; the
# signature is the member ``manifest.json.sig`` (second in the archive) and the file ``NAME.ferry.sig``
# beside the bundle. Checking it needs ``ssh-keygen -Y find-principals`` and ``-Y verify`` (OpenSSH >= 8.2)
# and an OpenSSH allowed_signers file; the principal it names is the signer shown to the user. A prefix
# policy is that file copied to ``PREFIX/.ferry/allowed_signers``: every later install into the prefix must
# then carry a valid signature by one of those signers.

#: Copies of bundler/format.py's constants (a test keeps them equal).
SIGNATURE_NAME = "manifest.json.sig"
SIGNATURE_SUFFIX = ".ferry.sig"
SBOM_NAME = "sbom.cdx.json"
SIGNATURE_NAMESPACE = "ferry-bundle"
POLICY_NAME = "allowed_signers"
#: The metadata members an archive starts with, in this order (the signature only when signed).
HEAD_MEMBERS = (MANIFEST_NAME, SIGNATURE_NAME, SBOM_NAME)

_NO_SSHSIG = ("checking bundle signatures needs ssh-keygen -Y (OpenSSH >= 8.2){found}: verify on a host that has "
              "it (ssh-keygen -Y verify -f ALLOWED_SIGNERS -I SIGNER -n ferry-bundle -s manifest.json.sig "
              "< manifest.json), bring that manifest.json here and pass it with --manifest FILE instead")


def ssh_keygen(args: list[str], data: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``ssh-keygen ARGS`` with ``data`` on stdin; return the finished process (bytes output).

    Raises:
        BundleError: ssh-keygen is missing or too old for ``-Y`` (one line saying how to verify elsewhere).
    """
    try:
        proc = subprocess.run(["ssh-keygen", *args], input=data, capture_output=True, timeout=120)
    except FileNotFoundError:
        raise BundleError(_NO_SSHSIG.format(found=", and ssh-keygen is not installed here")) from None
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0 and re.search(r"(illegal|unknown|invalid) option -- Y|unsupported operation|"
                                          r"Unsupported operation|Usage: ssh-keygen -Y", err):
        raise BundleError(_NO_SSHSIG.format(found=", which this host's ssh-keygen lacks"))
    return proc


def _signature_key(data: bytes, sig_file: Path) -> str | None:
    """``'ED25519 key SHA256:...'`` when ``sig_file`` is a well-formed signature over ``data`` (not checked
    against any allowed signer: ``ssh-keygen -Y check-novalidate``), else None."""
    proc = ssh_keygen(["-Y", "check-novalidate", "-n", SIGNATURE_NAMESPACE, "-s", str(sig_file)], data)
    match = re.search(r"with (\S+ key \S+)", proc.stdout.decode("utf-8", "replace"))
    return match.group(1) if proc.returncode == 0 and match else None


def verify_signature(data: bytes, signature: bytes, allowed_signers: Path, what: str = MANIFEST_NAME) -> dict:
    """Check ``signature`` (an SSHSIG armoured ``ssh-keygen -Y sign -n ferry-bundle`` signature) over the exact
    bytes ``data`` against the OpenSSH ``allowed_signers`` file.

    Returns ``{"principal": signer identity from allowed_signers, "key": "ED25519 key SHA256:...",
    "allowed_signers": path}``.

    Raises:
        IntegrityError: (one line) the signature does not match ``data`` (altered after signing: forged or
            damaged), or its key is not listed in ``allowed_signers`` (wrong signer).
        BundleError: ``allowed_signers`` cannot be read, ssh-keygen is missing or older than 8.2.
    """
    allowed_signers = Path(allowed_signers)
    if not allowed_signers.is_file():
        raise BundleError(f"{allowed_signers}: no such allowed_signers file")
    with tempfile.TemporaryDirectory(prefix="ferry-sig-") as tmp:
        sig_file = Path(tmp) / SIGNATURE_NAME
        sig_file.write_bytes(signature)
        key = _signature_key(data, sig_file)
        if key is None:
            raise _signature_refused(f"the signature of {what} does not match its bytes ({what} was altered "
                                     f"after signing: a forged or damaged bundle)")
        found = ssh_keygen(["-Y", "find-principals", "-s", str(sig_file), "-f", str(allowed_signers)])
        principals = [p for p in found.stdout.decode("utf-8", "replace").split() if p]
        if found.returncode != 0 or not principals:
            raise _signature_refused(f"{what} is signed by {key}, which is not an allowed signer in "
                                     f"{allowed_signers} (wrong signer)")
        for principal in principals:
            proc = ssh_keygen(["-Y", "verify", "-f", str(allowed_signers), "-I", principal, "-n",
                               SIGNATURE_NAMESPACE, "-s", str(sig_file)], data)
            if proc.returncode == 0:
                return {"principal": principal, "key": key, "allowed_signers": str(allowed_signers)}
    raise _signature_refused(f"the signature of {what} by {key} does not verify against {allowed_signers} "
                             f"for namespace {SIGNATURE_NAMESPACE!r}")


def _signature_refused(reason: str) -> IntegrityError:
    err = IntegrityError(f"signature check failed: {reason}; refused")
    err.problems = [reason]  # type: ignore[attr-defined]
    return err


def _bundle_base(bundle: Path) -> tuple[Path, str]:
    """(folder holding the bundle, NAME) for a bundle directory, ``NAME.ferry.tar`` or its volume."""
    bundle = Path(bundle)
    if bundle.is_dir():
        return bundle.absolute().parent, bundle.absolute().name
    name = re.sub(re.escape(ARCHIVE_SUFFIX) + r"(\.\d+)?$", "", bundle.name)
    return bundle.absolute().parent, name


def read_head(bundle: Path) -> dict:
    """The metadata of a bundle without reading its content: ``{"manifest", "signature", "sbom"}`` (bytes or
    None), ``"signature_source"`` (where the signature came from), ``"members"`` (head member names read)
    and ``"bytes_read"`` (bytes read from the bundle, for the < 1 % promise of ``ferry inspect``).

    An archive (or its first volume) is read from the start up to the first header of a content member; the
    signature falls back to ``NAME.ferry.sig`` beside the bundle.

    Raises:
        BundleError: no manifest.json among the first members (an archive packed before ferry wrote metadata
            first: use ``ferry verify``), or a missing archive.
        UnsafeArchiveError / IntegrityError: a corrupt or unsafe head.
    """
    bundle = Path(bundle)
    head: dict = {"manifest": None, "signature": None, "sbom": None, "signature_source": None, "members": [],
                  "bytes_read": 0}
    if bundle.is_dir():
        for key, name in (("manifest", MANIFEST_NAME), ("signature", SIGNATURE_NAME), ("sbom", SBOM_NAME)):
            path = bundle / name
            if path.is_file() and not path.is_symlink():
                head[key] = path.read_bytes()
                head["members"].append(name)
                head["bytes_read"] += len(head[key])
        if head["signature"] is not None:
            head["signature_source"] = str(bundle / SIGNATURE_NAME)
    else:
        if re.search(re.escape(ARCHIVE_SUFFIX) + r"\.\d+$", bundle.name):  # a volume: the later ones may be absent
            if not bundle.is_file():
                raise BundleError(f"{bundle}: no such volume")
            stem, _, index = bundle.name.rpartition(".")
            volumes = [bundle]
            while (bundle.parent / f"{stem}.{int(index) + len(volumes):0{len(index)}d}").is_file():
                volumes.append(bundle.parent / f"{stem}.{int(index) + len(volumes):0{len(index)}d}")
        else:
            _, volumes, _ = archive_volumes(bundle)
        reader = VolumeReader(volumes)  # forward only: opens .001 only when a tiny head spans volumes
        headers = _TarHeaders(reader)
        scan = Scan()
        try:
            while True:
                member = headers.next()
                if member is None:
                    break
                rel = _member_path(member, scan)
                if rel not in HEAD_MEMBERS or not member.isreg():
                    break
                if member.size > MAX_METADATA_BYTES:
                    raise BundleError(f"{rel} in {bundle.name} is {member.size} bytes: too large")
                data = reader.read(member.size)
                if len(data) != member.size:
                    raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
                head[{MANIFEST_NAME: "manifest", SIGNATURE_NAME: "signature", SBOM_NAME: "sbom"}[rel]] = data
                head["members"].append(rel)
        except (tarfile.TarError, EOFError) as exc:
            if head["manifest"] is None or reader._fh is not None:  # else: the head volume alone is here
                raise _integrity([f"{bundle.name}: corrupt archive head at {reader.position()}: {exc}"],
                                 "archive check failed") from None
        finally:
            head["bytes_read"] = reader.total
            reader.close()
        if head["signature"] is not None:
            head["signature_source"] = f"{bundle.name}:{SIGNATURE_NAME}"
    if head["manifest"] is None:
        raise BundleError(f"{bundle}: {MANIFEST_NAME} is not among the first members (packed by an older ferry or "
                          f"another tool); use ferry verify, which reads the whole bundle")
    if head["signature"] is None:
        folder, name = _bundle_base(bundle)
        beside = folder / f"{name}{SIGNATURE_SUFFIX}"
        if beside.is_file():
            head["signature"] = beside.read_bytes()
            head["signature_source"] = str(beside)
            head["bytes_read"] += len(head["signature"])
    return head


def _scanned_signature(bundle: Path, scan: Scan, dest: Path | None) -> bytes | None:
    """The signature bytes belonging to a scanned bundle: the ``manifest.json.sig`` member the scan read (kept
    in memory, so exactly the bytes SHA256SUMS was checked against), else ``NAME.ferry.sig`` beside the
    bundle, else None."""
    if scan.signature_bytes is not None:
        return scan.signature_bytes
    folder, name = _bundle_base(bundle)
    beside = folder / f"{name}{SIGNATURE_SUFFIX}"
    return beside.read_bytes() if beside.is_file() else None


def check_signature(
    bundle: Path, scan: Scan, problems: list[str], reference: Path | None = None,
    allowed_signers: Path | None = None, require_signature: bool = False, dest: Path | None = None,
) -> list[str]:
    """Called by :func:`check_bundle` right after the scan was compared with the manifest (which cannot list its
    own signature; :func:`check_scan` leaves that member out, SHA256SUMS lists it): when ``allowed_signers`` is
    given, check the signature over the exact manifest bytes that are then
    trusted (``reference``'s when given, else the bundle's own). Sets ``scan.signature`` (the dict of
    :func:`verify_signature`, or None) and returns the remaining problems.

    Raises:
        IntegrityError: (one line) unsigned, forged or wrong signer while a signature is required.
        BundleError: ``require_signature`` without ``allowed_signers``; ssh-keygen missing or too old.
    """
    scan.signature = None  # type: ignore[attr-defined]
    if problems or (allowed_signers is None and not require_signature):
        return problems
    if allowed_signers is None:
        raise BundleError("a signature is required but no allowed_signers file was given (--allowed-signers FILE)")
    signature = _scanned_signature(bundle, scan, dest)
    if signature is None:
        raise _signature_refused(f"{bundle} is not signed (no {SIGNATURE_NAME} inside, no "
                                 f"{_bundle_base(bundle)[1]}{SIGNATURE_SUFFIX} beside it) and a signature "
                                 f"by {allowed_signers} is required")
    data = Path(reference).read_bytes() if reference is not None else scan.manifest_bytes
    assert data is not None
    scan.signature = verify_signature(data, signature, allowed_signers,  # type: ignore[attr-defined]
                                      str(reference) if reference is not None else MANIFEST_NAME)
    return problems


def precheck_signature(bundle: Path, allowed_signers: Path, reference: Path | None = None) -> dict | None:
    """Refuse an unsigned, forged or wrongly signed bundle from its metadata head alone, before its payload
    is read (a 100 GB bundle is then refused in a second, not after the full pass). The check after the
    scan (:func:`check_signature`) stays the one that counts; this one only saves time. Returns the
    :func:`verify_signature` dict, or None when the bundle is not laid out metadata-first (then only the
    later check decides).

    Raises:
        IntegrityError: (one line) unsigned, forged or wrong signer.
        BundleError: ssh-keygen missing or older than 8.2; an unreadable allowed_signers file.
    """
    try:
        head = read_head(bundle)
    except BundleError:
        return None
    if head["signature"] is None:
        raise _signature_refused(f"{bundle} is not signed (no {SIGNATURE_NAME} inside, no "
                                 f"{_bundle_base(bundle)[1]}{SIGNATURE_SUFFIX} beside it) and a signature "
                                 f"by {allowed_signers} is required")
    data = Path(reference).read_bytes() if reference is not None else head["manifest"]
    return verify_signature(data, head["signature"], allowed_signers,
                            str(reference) if reference is not None else MANIFEST_NAME)


def check_prefix_policy(
    prefix: Path, bundle: Path, scan: Scan, staged: Path, reference: Path | None = None,
    allowed_signers: Path | None = None, require_signature: bool = False,
) -> dict | None:
    """Called by :func:`install_bundle` once the staged bundle matched its manifest: apply the prefix's
    signature policy (:func:`record_prefix_policy` records a new one once the install is complete).

    The policy is ``PREFIX/.ferry/allowed_signers``. When it exists, the bundle must carry a valid signature
    by one of its signers (a different ``allowed_signers`` file is refused: replace the policy file by hand
    to change it). Otherwise ``allowed_signers`` (when given) is checked, and copied there after the install,
    so that every later install into the prefix requires a signature. ``require_signature`` alone needs one of the two. Returns
    the signature dict of :func:`verify_signature`, or None when no signature was required.

    Raises:
        IntegrityError: unsigned, forged or wrong signer under a policy (one line); nothing is installed.
        BundleError: a conflicting allowed_signers file, or ``require_signature`` with no signers at all.
    """
    policy = Path(prefix) / ".ferry" / POLICY_NAME
    signers = allowed_signers
    if policy.is_file():
        if allowed_signers is not None and Path(allowed_signers).read_bytes() != policy.read_bytes():
            raise BundleError(f"{prefix} already pins its signers in {policy}, which differs from "
                              f"{allowed_signers}; edit or replace {policy} to change the policy")
        signers = policy
    elif require_signature and allowed_signers is None:
        raise BundleError(f"--require-signature: {prefix} has no signer policy ({policy}); pass "
                          f"--allowed-signers FILE")
    if signers is None:
        return None
    check_signature(bundle, scan, [], reference, signers, True, dest=staged)
    return scan.signature  # type: ignore[attr-defined]


def record_prefix_policy(prefix: Path, allowed_signers: Path | None) -> None:
    """After a complete install: copy ``allowed_signers`` to ``PREFIX/.ferry/allowed_signers`` when the prefix
    has no policy yet (a failed install records none)."""
    policy = Path(prefix) / ".ferry" / POLICY_NAME
    if allowed_signers is not None and not policy.is_file():
        _atomic_text(policy, Path(allowed_signers).read_text("utf-8"))


# --------------------------------------------------------------------------------------------------------------
# Delta bundles: the files the isolated host already holds are not carried (bundler/delta.py packs them).
# --------------------------------------------------------------------------------------------------------------
#
# A delta manifest (``format_version`` 2) lists the full target, as a full bundle's, plus ``base``: the sha256 of
# the base document it was packed against (a ``ferry state`` document or an earlier manifest.json). Every file
# of every item says how it travels, in ``delta``:
#
#   "carried"    in the bundle at ITEM/FILE, as in a full bundle;
#   "from_base"  not in the bundle: the prefix holds a file with this sha256 (a model blob, a dataset file, a
#                wheel kept in PREFIX/wheels/<sha256>); install links (or copies) it into the staging area;
#   "tensors"    a .safetensors file rebuilt byte for byte from the installed file ``patch.base_sha256`` and the
#                carried member deltas/ITEM/FILE (the new header and the changed tensors): ``patch.segments``
#                lists [source, offset, length] in file order, source "patch" (bytes of the carried member)
#                or "base" (bytes of the installed file). The rebuilt file's sha256 is checked before it is
#                placed.
#
# After this the staging area holds the full target, and the install goes on exactly as for a full bundle.

#: Largest safetensors JSON header read (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
DELTA_MODES = ("carried", "from_base", "tensors")


def is_delta(manifest: dict) -> bool:
    """Whether ``manifest`` describes a delta bundle (it names a ``base``)."""
    return manifest.get("base") is not None


def patch_path(item: dict, entry: dict) -> str:
    """Bundle path of the carried tensors of a ``tensors`` file: ``deltas/ITEM_PATH/FILE_PATH``."""
    return posixpath.join(DELTAS_DIRNAME, item["path"], entry["path"])


def validate_delta(manifest: dict, where: str = MANIFEST_NAME) -> None:
    """Check the delta fields of a manifest (see the section comment): ``base`` a sha256, ``delta`` one of
    :data:`DELTA_MODES` on every file of a delta manifest and on none of a full one, each ``tensors`` file's
    ``patch`` (``size``, ``sha256``, ``base_sha256``, ``base_size``, ``segments``) consistent: every segment
    lies inside the carried member or the base file and together they make exactly the file's size.

    Raises:
        UnsafeArchiveError: the first offending field, named (``items[0].files[3].patch.segments[2]``).
        BundleError: a delta manifest whose ``format_version`` is below 2.
    """
    base = manifest.get("base")
    if base is None:
        for i, item in enumerate(manifest["items"]):
            for j, entry in enumerate(item["files"]):
                if "delta" in entry or "patch" in entry:
                    raise UnsafeArchiveError(f"{where}: items[{i}].files[{j}] has delta fields but the manifest "
                                             f"names no base")
        return
    if not (isinstance(base, str) and _HEX64.match(base)):
        raise UnsafeArchiveError(f"{where}: base {base!r} (the sha256 of the base document, 64 hex digits)")
    if manifest["format_version"] < 2:
        raise BundleError(f"{where}: a delta bundle (base {base[:12]}) needs format_version 2, not "
                          f"{manifest['format_version']}")
    for i, item in enumerate(manifest["items"]):
        for j, entry in enumerate(item["files"]):
            here = f"{where}: items[{i}].files[{j}]"
            mode = entry.get("delta")
            if mode not in DELTA_MODES:
                raise UnsafeArchiveError(f"{here}.delta: {mode!r} (one of {', '.join(DELTA_MODES)})")
            if mode != "tensors":
                if "patch" in entry:
                    raise UnsafeArchiveError(f"{here}.patch: only 'tensors' files carry a patch")
                continue
            _check_patch(entry, f"{here}.patch")


def _nonneg(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_patch(entry: dict, here: str) -> None:
    patch = entry.get("patch")
    if not isinstance(patch, dict):
        raise UnsafeArchiveError(f"{here}: missing (a 'tensors' file needs its patch)")
    for key in ("sha256", "base_sha256"):
        if not (isinstance(patch.get(key), str) and _HEX64.match(patch[key])):
            raise UnsafeArchiveError(f"{here}.{key}: {patch.get(key)!r} (64 hex digits)")
    for key in ("size", "base_size"):
        if not _nonneg(patch.get(key)):
            raise UnsafeArchiveError(f"{here}.{key}: {patch.get(key)!r} (a byte count)")
    segments = patch.get("segments")
    if not isinstance(segments, list):
        raise UnsafeArchiveError(f"{here}.segments: expected a list of [source, offset, length]")
    total = 0
    for k, seg in enumerate(segments):
        if not (isinstance(seg, list) and len(seg) == 3 and seg[0] in ("patch", "base") and _nonneg(seg[1])
                and _nonneg(seg[2]) and seg[2] > 0):
            raise UnsafeArchiveError(f"{here}.segments[{k}]: {seg!r} (expected [\"patch\" or \"base\", offset, "
                                     f"length > 0])")
        limit = patch["size"] if seg[0] == "patch" else patch["base_size"]
        if seg[1] + seg[2] > limit:
            what = "the carried tensors" if seg[0] == "patch" else f"the base file {patch['base_sha256'][:12]}"
            raise UnsafeArchiveError(f"{here}.segments[{k}]: bytes {seg[1]}..{seg[1] + seg[2]} lie outside "
                                     f"{what} ({limit} bytes)")
        total += seg[2]
    if total != entry["size"]:
        raise UnsafeArchiveError(f"{here}.segments: they make {total} bytes, the file has {entry['size']}")


# -- safetensors, by tensor ------------------------------------------------------------------------------------


def safetensors_tensors(fh: Any, size: int, where: str) -> list[tuple[str, int, int]]:
    """The tensors of an open safetensors file of ``size`` bytes: ``(name, start, end)`` absolute byte offsets,
    sorted by ``start`` (the format: an 8-byte little-endian header length N, N bytes of JSON mapping each
    tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to byte 8 + N, and an optional
    ``__metadata__``). Leaves ``fh`` after the header.

    Raises:
        BundleError: not a safetensors file, offsets outside the file or overlapping (``where`` named).
    """
    import struct

    fh.seek(0)
    raw = fh.read(8)
    if len(raw) != 8:
        raise BundleError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        raise BundleError(f"{where}: not a safetensors file (header length {n} of a {size}-byte file)")
    try:
        header = json.loads(fh.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{where}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BundleError(f"{where}: safetensors header is not a JSON object")
    start = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_nonneg(o) for o in offsets)
                and offsets[0] <= offsets[1] and start + offsets[1] <= size):
            raise BundleError(f"{where}: tensor {name!r} has data_offsets {offsets!r} outside the file")
        out.append((name, start + offsets[0], start + offsets[1]))
    out.sort(key=lambda t: (t[1], t[2]))
    for a, b in zip(out, out[1:]):
        if b[1] < a[2]:
            raise BundleError(f"{where}: tensors {a[0]!r} and {b[0]!r} overlap")
    return out


def tensor_digests(path: Path, progress: Progress | None = None) -> tuple[int, str, dict[str, list] | None]:
    """Read ``path`` once: ``(size, sha256 of the file, tensors)`` where, for a safetensors file, ``tensors``
    maps each tensor name to ``[start, end, sha256 of its bytes]`` (absolute offsets), else None."""
    size = os.stat(path).st_size
    with open(path, "rb", buffering=0) as fh:
        try:
            spans = safetensors_tensors(fh, size, str(path))
        except BundleError:
            spans = None
        fh.seek(0)
        whole = hashlib.sha256()
        tensors: dict[str, list] = {}
        pending = list(spans or [])
        current: list = []  # [name, start, end, hasher] of tensors overlapping the chunk
        pos = 0
        while True:
            chunk = fh.read(CHUNK_SIZE)
            if not chunk:
                break
            whole.update(chunk)
            end = pos + len(chunk)
            while pending and pending[0][1] < end:
                name, t0, t1 = pending.pop(0)
                current.append([name, t0, t1, hashlib.sha256()])
            view = memoryview(chunk)
            for t in list(current):
                lo, hi = max(t[1], pos), min(t[2], end)
                if lo < hi:
                    t[3].update(view[lo - pos:hi - pos])
                if t[2] <= end:
                    tensors[t[0]] = [t[1], t[2], t[3].hexdigest()]
                    current.remove(t)
            pos = end
            if progress:
                progress(len(chunk))
        for t in current + [[n, a, b, hashlib.sha256()] for n, a, b in pending]:  # empty tensors at the end
            tensors[t[0]] = [t[1], t[2], t[3].hexdigest()]
    return pos, whole.hexdigest(), (tensors if spans is not None else None)


def rebuild_file(entry: dict, patch_file: Path, base_file: Path, dest: Path, progress: Progress | None = None) -> None:
    """Write ``dest`` (created exclusively) from ``entry["patch"]["segments"]``, streaming one chunk at a time
    from the carried ``patch_file`` and the installed ``base_file``, and check its size and sha256 against
    ``entry`` (the manifest's). A mismatch removes ``dest``.

    Raises:
        IntegrityError: one line naming the file: the base file has another size, or the rebuilt bytes do not
            have the manifest's sha256 (the installed base file drifted, or the bundle was altered).
    """
    patch = entry["patch"]
    hasher = hashlib.sha256()
    written = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(patch_file, "rb", buffering=0) as pf, open(base_file, "rb", buffering=0) as bf, \
                open(dest, "xb") as out:
            if os.fstat(bf.fileno()).st_size != patch["base_size"]:
                raise IntegrityError(f"{entry['path']}: the installed base file {base_file} has "
                                     f"{os.fstat(bf.fileno()).st_size} bytes, the delta was made against "
                                     f"{patch['base_size']}: refused, nothing was installed")
            for source, offset, length in patch["segments"]:
                fh = pf if source == "patch" else bf
                fh.seek(offset)
                while length:
                    chunk = fh.read(min(CHUNK_SIZE, length))
                    if not chunk:
                        raise IntegrityError(f"{entry['path']}: {source} ended early while rebuilding")
                    hasher.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    length -= len(chunk)
                    if progress:
                        progress(len(chunk))
        if written != entry["size"] or hasher.hexdigest() != entry["sha256"]:
            raise IntegrityError(
                f"{entry['path']}: rebuilt from the installed {base_file} and the carried tensors it has sha256 "
                f"{hasher.hexdigest()[:12]}, the manifest says {entry['sha256'][:12]} (the installed base file "
                f"drifted, or the bundle was altered): refused, nothing was installed")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest)
        raise


# -- what a prefix holds ---------------------------------------------------------------------------------------


def installed_items(prefix: Path) -> list[dict]:
    """Every item recorded in ``prefix`` and where its files are, from ``.ferry/state.json`` and the manifest
    copies in ``.ferry/manifests`` (nothing is hashed): one dict per distinct item, ``{"kind", "source",
    "repo_id", "revision", "revision_requested", "files": [{"path", "size", "sha256", "at"}]}`` where ``at`` is
    the installed file (``hf-home/hub/.../blobs/<sha256>`` for hub models, the dataset or ModelScope folder's
    file, ``wheels/<sha256>`` for wheels kept by the install). Items replaced later by other content, and
    wheels of bundles installed before ferry kept them, are left out; unreadable manifest copies are skipped.
    """
    prefix = Path(prefix).absolute()
    state = _load_state(prefix)
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
            if kind == "wheels":
                if not record.get("wheel_store"):
                    continue
                key: tuple = ("wheels",)
                locate = lambda e: prefix / WHEEL_STORE_DIRNAME / e["sha256"]  # noqa: E731
            elif kind == "model" and source != "ms":
                repo = hub / _repo_folder("model", item["repo_id"])
                key = (kind, source, item["repo_id"], item["revision"])
                locate = lambda e, repo=repo: repo / "blobs" / e["sha256"]  # noqa: E731
            else:
                skey = f"ms-model:{item['repo_id']}" if kind == "model" else next(
                    (k for k, v in items_state.items() if k.startswith("dataset:")
                     and v.get("repo_id") == item["repo_id"] and _same_content(v, item)), None)
                placed = items_state.get(skey or "", {})
                if not skey or not _same_content(placed, item):
                    continue  # replaced later by other content
                # where plan_install puts it, under this prefix (the recorded absolute path names the prefix
                # it was installed into, which may have moved since)
                dest = (prefix / "datasets" / skey.split(":", 1)[1] if kind == "dataset" else
                        ms_model_dir(prefix, item["repo_id"], item.get("revision_requested") or "master"))
                key = (kind, source, item["repo_id"], item["revision"], content_id(item))
                locate = lambda e, dest=dest: dest / e["path"]  # noqa: E731
            entry = out.setdefault(key, {
                "kind": kind, "source": source, "repo_id": item.get("repo_id"), "revision": item.get("revision"),
                "revision_requested": item.get("revision_requested"), "files": {}})
            for e in item["files"]:
                name = e["path"] if kind != "wheels" else e["path"]
                entry["files"].setdefault((name, e["sha256"]), {"path": name, "size": e["size"],
                                                                "sha256": e["sha256"], "at": locate(e)})
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
            _inside(root, at, f"the recorded file {f['path']}")
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
                    size, digest = sha256_file(real, progress)
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
        items.append({**{k: item[k] for k in ("kind", "source", "repo_id", "revision", "revision_requested")},
                      "files": files})
    items.sort(key=lambda i: (i["kind"], i["source"], i["repo_id"] or "", i["revision"] or ""))
    return {"format": STATE_FORMAT, "version": 1, "trust_recorded": trust_recorded, "items": items,
            "wheels": [wheels[k] for k in sorted(wheels)]}


# -- installing a delta ---------------------------------------------------------------------------------------


def locate_base_files(manifest: dict, prefix: Path, *, rehash: bool = True) -> list[tuple[dict, dict, Path]]:
    """Find, in manifest order, the installed file each ``from_base`` file and each ``tensors`` file's base
    comes from (:func:`installed_items`; every candidate must resolve inside ``prefix``). With ``rehash`` a
    ``from_base`` file must have its size and sha256 (re-hashed); without, and for ``tensors`` bases always, its
    size (the rebuilt file's sha256 is checked instead). Returns ``(item, file entry, installed path)``.

    Raises:
        IntegrityError: one line naming the first file the prefix does not hold (missing, drifted, or a delta
            packed for another prefix).
    """
    prefix = Path(prefix).absolute()
    root = os.path.realpath(prefix)
    where: dict[str, list[Path]] = {}
    for item in installed_items(prefix):
        for f in item["files"]:
            where.setdefault(f["sha256"], []).append(f["at"])
    checked: dict[tuple[str, bool], Path] = {}

    def find(sha: str, size: int, label: str, full: bool) -> Path:
        if (sha, full) in checked:
            return checked[sha, full]
        for candidate in where.get(sha, []):
            try:
                _inside(root, candidate, label)
            except UnsafeArchiveError:
                continue
            if _same_file(candidate, size, sha) if full else (
                    os.path.isfile(candidate) and os.stat(candidate).st_size == size):
                checked[sha, full] = candidate
                return candidate
        raise IntegrityError(
            f"delta bundle {manifest['name']} (base {manifest['base'][:12]}): {label} (sha256 {sha[:12]}, "
            f"{size} bytes) is not in {prefix} with that content (missing, changed since the base was taken, "
            f"or the delta was packed for another prefix): refused, nothing was installed")

    found = []
    for item in manifest["items"]:
        for e in item["files"]:
            label = f"{item.get('repo_id') or item['kind']}: {e['path']}"
            if e["delta"] == "from_base":
                found.append((item, e, find(e["sha256"], e["size"], label, rehash)))
            elif e["delta"] == "tensors":
                found.append((item, e, find(e["patch"]["base_sha256"], e["patch"]["base_size"],
                                            f"{label} (its base file)", False)))
    return found


def _early_delta_check(bundle: Path, prefix: Path) -> None:
    """Refuse a delta bundle whose base files are not in ``prefix`` from its metadata head (a few hundred kB),
    before its payload is copied into staging: presence and size only; :func:`apply_delta` checks again,
    re-hashing, against the verified manifest."""
    try:
        head = read_head(bundle)
        manifest = parse_manifest(head["manifest"]) if head.get("manifest") else None
    except (BundleError, OSError):
        return  # not metadata-first, or unreadable: the full pass decides
    if manifest and is_delta(manifest):
        locate_base_files(manifest, prefix, rehash=False)


def apply_delta(manifest: dict, tree: Path, prefix: Path, *, log: Callable[[str], None] = _say) -> dict:
    """Complete the verified, staged delta bundle ``tree`` (inside ``PREFIX/.staging-XXXX``) into the full
    target, before anything is placed: every ``from_base`` file is found in ``prefix`` (:func:`installed_items`)
    and re-hashed, in manifest order; then each is hard-linked into ``tree`` (copied where links fail) and every
    ``tensors`` file is rebuilt there (:func:`rebuild_file`, its sha256 checked). Only the staging area is
    written. Returns ``{"from_base": files, "reused_bytes", "rebuilt": files}``.

    Raises:
        IntegrityError: one line naming the first ``from_base`` file the prefix does not hold with its sha256
            (missing, drifted, or a delta packed for another base), or a rebuilt file whose sha256 differs.
        InsufficientSpaceError: the rebuilt files do not fit.
    """
    prefix = Path(prefix).absolute()
    todo = locate_base_files(manifest, prefix, rehash=True)
    rebuilt_bytes = sum(e["size"] for _, e, _ in todo if e["delta"] == "tensors")
    ensure_free_space(prefix, rebuilt_bytes, f"rebuilding {format_bytes(rebuilt_bytes)} of safetensors files")
    reused = 0
    for item, e, source in todo:
        dest = tree / item["path"] / e["path"]
        _inside(os.path.realpath(tree), dest, f"{item.get('repo_id') or item['kind']}: {e['path']}")
        if e["delta"] == "tensors":
            rebuild_file(e, tree / patch_path(item, e), source, dest)
            reused += e["size"] - e["patch"]["size"]
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:  # another file system, or no hard links there: a copy, hashed again
            worker = _Worker()
            try:
                size, digest = _copy_hashing(source, dest, worker, None)
            finally:
                worker.close()
            if (size, digest) != (e["size"], e["sha256"]):
                raise IntegrityError(f"{item.get('repo_id') or item['kind']}: {e['path']}: {source} changed while "
                                     f"it was copied: refused, nothing was installed")
        reused += e["size"]
    shutil.rmtree(tree / DELTAS_DIRNAME, ignore_errors=True)
    log(f"delta: {sum(1 for t in todo if t[1]['delta'] == 'from_base')} file(s) taken from {prefix}, "
        f"{sum(1 for t in todo if t[1]['delta'] == 'tensors')} rebuilt by tensor")
    return {"from_base": sum(1 for t in todo if t[1]["delta"] == "from_base"), "reused_bytes": reused,
            "rebuilt": sum(1 for t in todo if t[1]["delta"] == "tensors")}


def _same_inode(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same file (a hard link of it), without following a link at ``a``."""
    try:
        sa, sb = os.lstat(a), os.stat(b)
    except OSError:
        return False
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def keep_wheels(item: dict, staged: Path, prefix: Path, repaired: list[str]) -> None:
    """Keep the wheels item's files (wheels and lock files) as ``PREFIX/wheels/<sha256>`` (hard links of the
    staged files, which the staging area's removal leaves in place): a later delta bundle takes its
    unchanged wheels from there. One that is there with other bytes is replaced (and reported)."""
    store = prefix / WHEEL_STORE_DIRNAME
    store.mkdir(parents=True, exist_ok=True)
    for entry in item["files"]:
        src, kept = staged / entry["path"], store / entry["sha256"]
        if os.path.lexists(kept):
            if _same_inode(src, kept) or _same_file(kept, entry["size"], entry["sha256"]):
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


# --------------------------------------------------------------------------------------------------------------
# Command line (install.py).
# --------------------------------------------------------------------------------------------------------------


class PercentProgress:
    """Prints ``label: NN% (X of Y)`` to stderr every 10 %: the stdlib stand-in for a progress bar."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.shown = -1

    def __call__(self, n: int) -> None:
        self.done += n
        step = min(100, self.done * 100 // self.total) // 10 * 10
        if step > self.shown:
            self.shown = step
            _say(f"{self.label}: {step:3d}% ({format_bytes(self.done)} of {format_bytes(self.total)})")


def main(argv: list[str] | None = None) -> int:
    """``python3 install.py --prefix DIR [--no-venv] [--private] [--replace-datasets] [--bundle DIR]
    [--manifest FILE]``, ``python3 install.py --verify-only`` or ``python3 install.py --verify-prefix DIR``."""
    parser = argparse.ArgumentParser(prog="install.py", description="Verify and install this ferry bundle "
                                     "(standard library only).")
    parser.add_argument("--prefix", type=Path, help="install root (required unless --verify-only)")
    parser.add_argument("--no-venv", action="store_true", help="do not create a venv from the bundle's wheels")
    parser.add_argument("--verify-only", action="store_true", help="check every byte and stop")
    parser.add_argument("--verify-prefix", type=Path, metavar="DIR",
                        help="re-hash an installed prefix against its recorded manifests and stop")
    parser.add_argument("--private", action="store_true",
                        help="make what is installed readable by this account only (0700/0600; default 0755/0644)")
    parser.add_argument("--replace-datasets", action="store_true",
                        help="replace installed datasets of the same name whose content differs")
    parser.add_argument("--bundle", type=Path, default=Path(__file__).resolve().parent,
                        help="bundle directory or archive (default: the folder holding install.py)")
    parser.add_argument("--manifest", type=Path, help="a manifest brought over a separate channel")
    parser.add_argument("--allowed-signers", type=Path, metavar="FILE",
                        help="OpenSSH allowed_signers file: require a valid signature by one of its signers "
                             "(installing records it in PREFIX/.ferry as the prefix's policy)")
    parser.add_argument("--require-signature", action="store_true",
                        help="refuse an unsigned bundle (needs --allowed-signers or a prefix policy)")
    parser.add_argument("--state", type=Path, metavar="DIR",
                        help="write the state document of an installed prefix (what `ferry pack --base` "
                             "packs a delta bundle against) to --output and stop")
    parser.add_argument("--output", "-o", type=Path, metavar="FILE", help="with --state: the file to write")
    parser.add_argument("--trust-recorded", action="store_true",
                        help="with --state: take digests from the install records instead of re-hashing")
    args = parser.parse_args(argv)
    if not (args.verify_only or args.verify_prefix or args.state) and args.prefix is None:
        parser.error("--prefix is required (or use --verify-only / --verify-prefix / --state)")
    if args.state and args.output is None:
        parser.error("--state needs --output FILE")
    try:
        if args.state:
            document = prefix_state(args.state, trust_recorded=args.trust_recorded)
            _atomic_text(args.output, json.dumps(document, indent=1, sort_keys=True) + "\n")
            print(f"OK: {args.output}: {len(document['items'])} item(s), {len(document['wheels'])} wheel file(s)")
            return 0
        if args.verify_prefix:
            found = verify_prefix(args.verify_prefix)
            if found["problems"]:
                raise _integrity(found["problems"], f"prefix {args.verify_prefix} drifted from its manifests")
            print(f"OK: {found['bundles']} bundle(s), {found['files']} installed files, "
                  f"{format_bytes(found['bytes'])} match their manifests")
            return 0
        total = bundle_bytes(args.bundle)
        if args.verify_only:
            _, scan = check_bundle(args.bundle, args.manifest, PercentProgress(total, "verify"),
                                   allowed_signers=args.allowed_signers, require_signature=args.require_signature)
            signature = getattr(scan, "signature", None)
            if signature:
                print(f"signature: good, by {signature['principal']} ({signature['key']})")
            print(f"OK: {len(scan.observed)} files, {format_bytes(scan.bytes_read)} verified")
            return 0
        _, scan, summary = install_bundle(args.bundle, args.prefix, create_venv=not args.no_venv,
                                          reference=args.manifest, progress=PercentProgress(total, "install"),
                                          private=args.private, replace_datasets=args.replace_datasets,
                                          allowed_signers=args.allowed_signers,
                                          require_signature=args.require_signature)
    except FerryError as exc:
        print(f"install.py: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    for model in summary["models"]:
        print(f"model   {model['repo_id']} @ {model['revision']} -> {model['path']}")
    for dataset in summary["datasets"]:
        via = f"; datasets.load_dataset({dataset['repo_id']!r})" if dataset.get("arrow_cache") else ""
        print(f"dataset {dataset['name']} -> {dataset['path']} ({', '.join(dataset['entries'])}{via})")
    for note in summary["notes"]:
        print(f"note: {note}")
    for fixed in summary["repaired"]:
        print(f"repaired: {fixed}")
    if summary["venv"]:
        print(f"venv    {summary['venv']}")
    if summary.get("delta"):
        print(f"delta   {summary['delta']['from_base']} file(s) taken from the prefix, {summary['delta']['rebuilt']} "
              f"rebuilt by tensor, {format_bytes(summary['delta']['reused_bytes'])} reused")
    print(f"OK: {len(scan.observed)} files verified; now run: source {Path(args.prefix).absolute() / 'ferry.env'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
