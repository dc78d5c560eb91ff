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
``manifest.json`` at the end (the manifest is the last member but one).

What it writes, under ``PREFIX``::

    PREFIX/
    ├── ferry.env                              `source` it: FERRY_HOME, HF_HOME, MODELSCOPE_CACHE, PATH and
    │                                          every offline switch (HF_HUB_OFFLINE=1, ...)
    ├── hf-home/hub/                           a Hugging Face cache (huggingface_hub.scan_cache_dir lists it)
    │   └── models--ORG--NAME/
    │       ├── blobs/<sha256>                 file contents, shared by every bundle holding the same bytes
    │       ├── snapshots/<revision>/<path>    relative symlinks ../../blobs/<sha256>
    │       └── refs/main                      the resolved revision
    ├── modelscope/models/ORG/NAME/...         ModelScope models (MODELSCOPE_CACHE; found offline by the SDK)
    ├── datasets/
    │   ├── <name>/...                         one folder per dataset item
    │   └── dataset_info.json                  LLaMA-Factory's dataset registry (merged across bundles)
    ├── venvs/<bundle_id>/                     one virtual environment per bundle with wheels
    ├── venv -> venvs/<bundle_id>              swapped atomically when a new one is complete
    └── .ferry/                                lock file and install records (state.json)

Atomicity: everything is first extracted (or copied) into ``PREFIX/.staging-XXXX`` while hashing, then
checked against the manifest; nothing outside the staging directory changes before every byte is
verified. Content then moves in by renames: blobs are content-addressed (an orphan blob is harmless),
snapshot and dataset folders appear whole, the ``venv`` link, ``ferry.env`` and the install record switch
last. Installing the same bundle twice changes nothing; a second bundle adds to the prefix.
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
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SUMS_NAME = "SHA256SUMS"
INSTALLER_NAME = "install.py"
LOCK_NAME = "requirements.lock"
ARCHIVE_SUFFIX = ".ferry.tar"
VOLUMES_SUMS_SUFFIX = ".ferry.sha256"
VOLUME_DIGITS = 3

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


def sha256_file(path: str | os.PathLike, progress: Progress | None = None) -> tuple[int, str]:
    """Stream ``path`` once; return ``(size in bytes, sha256 hex)``. ``progress(n)`` after each chunk."""
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
        _check_relpath(item["path"], f"{here}.path")
        _check_files(item.get("files"), f"{here}.files")
    _check_files(manifest.get("support_files", []), f"{where}: support_files")
    return manifest


def _check_files(files: Any, here: str) -> None:
    if not isinstance(files, list):
        raise BundleError(f"{here} must be a list")
    for j, entry in enumerate(files):
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
                and _HEX64.match(entry["sha256"])):
            raise BundleError(f"{here}[{j}] needs 'path' (string), 'size' (int) and 'sha256' (64 hex digits)")
        _check_relpath(entry["path"], f"{here}[{j}].path")


def _check_relpath(path: str, where: str) -> str:
    """Refuse absolute paths, ``..``, empty or non-normal components; return the path."""
    if (not path or path.startswith("/") or "\\" in path or "\x00" in path
            or posixpath.normpath(path) != path or path == "." or ".." in path.split("/")):
        raise UnsafeArchiveError(f"{where}: unsafe path {path!r} (absolute, '..' or not normalised)")
    return path


def expected_files(manifest: dict) -> dict[str, tuple[int, str]]:
    """Every file the manifest vouches for: bundle-relative POSIX path -> (size in bytes, sha256 hex).

    Covers every item file (``item.path/file.path``) and the support files (install.py, the wheel lock);
    not ``manifest.json`` and ``SHA256SUMS`` themselves.
    """
    out: dict[str, tuple[int, str]] = {}
    for entry in manifest.get("support_files", []):
        out[entry["path"]] = (entry["size"], entry["sha256"].lower())
    for item in manifest["items"]:
        for entry in item["files"]:
            out[posixpath.join(item["path"], entry["path"])] = (entry["size"], entry["sha256"].lower())
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
    for path in sorted(set(scan.observed) - set(expected) - {MANIFEST_NAME, SUMS_NAME}):
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
                if rel in (MANIFEST_NAME, SUMS_NAME):
                    data = full.read_bytes()
                    if rel == MANIFEST_NAME:
                        scan.manifest_bytes = data
                    else:
                        scan.sums_bytes = data
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
        if len(data) < n:  # a short read: the end of this volume (or a pipe); keep filling
            parts = [data]
            got = len(data)
            while got < n and self._fh is not None:
                more = self._fh.read(n - got)
                if not more:
                    self._next_volume()
                    continue
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self.offset += len(data)
        self.total += len(data)
        if self.progress and data:
            self.progress(len(data))
        return data

    def _next_volume(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self.index += 1
        self.offset = 0
        self._fh = open(self.volumes[self.index], "rb", buffering=0) if self.index < len(self.volumes) else None

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
        """Where the stream is: ``'byte N of VOLUME'``."""
        i = min(self.index, len(self.volumes) - 1)
        return f"byte {self.offset} of {self.volumes[i].name}"

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
    """Hash each volume against NAME.ferry.sha256 (only on the failure path, to name the culprit)."""
    problems = []
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
        _check_relpath(stripped, f"archive member {name!r}")
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
                if rel in (MANIFEST_NAME, SUMS_NAME):
                    if member.size > MAX_METADATA_BYTES:
                        raise BundleError(f"{rel} in the archive is {member.size} bytes: too large")
                    data = reader.read(member.size)
                    if len(data) != member.size:
                        raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
                    if rel == MANIFEST_NAME:
                        scan.manifest_bytes = data
                    else:
                        scan.sums_bytes = data
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


def _atomic_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
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


def place_hf(item: dict, src: Path, hub_dir: Path, scratch: Path, repo_type: str = "model") -> dict:
    """Place one item's staged files ``src/<path>`` into the Hugging Face cache ``hub_dir`` (HF_HOME/hub).

    Blobs move by rename to ``blobs/<sha256>`` unless an identical blob is already there (shared); the
    snapshot ``snapshots/<revision>/`` is built in ``scratch`` (the staging directory, same file system) and
    renamed in whole, or, when it
    already exists (another bundle, other include patterns), missing links are added one by one (each atomic).
    ``refs/main`` is written when the requested revision was ``main`` (or none) or no ``refs/main`` exists;
    a named branch or tag also gets ``refs/<name>``. Returns ``{"path", "blobs_added", "blobs_shared"}``.
    """
    repo_id = item.get("repo_id") or f"local/{posixpath.basename(item['path'])}"
    revision = item.get("revision") or "main"
    repo_dir = hub_dir / _repo_folder(repo_type, repo_id)
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    added = shared = 0
    for entry in item["files"]:
        blob = blobs / entry["sha256"]
        staged = src / entry["path"]
        if blob.exists():
            shared += 1
            continue
        os.replace(staged, blob)
        added += 1
    snapshots = repo_dir / "snapshots"
    snapshots.mkdir(exist_ok=True)
    snap = snapshots / revision
    if not snap.exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"snapshot-{revision}-", dir=scratch))
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
            link.parent.mkdir(parents=True, exist_ok=True)
            _atomic_symlink(want, link)
    refs = repo_dir / "refs"
    requested = item.get("revision_requested")
    if requested and requested != revision and requested != "main" and "/" not in requested:
        _write_ref(refs / requested, revision)
    if requested in (None, "", "main") or not (refs / "main").exists():
        _write_ref(refs / "main", revision)
    return {"path": str(snap), "blobs_added": added, "blobs_shared": shared}


def _write_ref(path: Path, revision: str) -> None:
    if path.is_file() and path.read_text().strip() == revision:
        return
    _atomic_text(path, revision)


def place_tree(src: Path, dest: Path, revision: str, state: dict, key: str, scratch: Path, **extra: str) -> str:
    """Move the staged folder ``src`` to ``dest`` in one rename. An existing ``dest`` recorded in ``state``
    with the same revision is kept (no-op); otherwise it is swapped out (renamed into ``scratch``, the staging
    directory that is deleted at the end, then the new one renamed in).
    ``extra`` is stored in the item's record (e.g. ``repo_id``). Returns ``'installed'``, ``'replaced'`` or
    ``'unchanged'``."""
    record = state.setdefault("items", {}).get(key)
    if dest.exists() and record and record.get("revision") == revision:
        return "unchanged"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        os.rename(src, dest)
        outcome = "installed"
    else:
        old = Path(tempfile.mkdtemp(prefix="replaced-", dir=scratch)) / dest.name
        os.rename(dest, old)
        os.rename(src, dest)
        outcome = "replaced"
    state["items"][key] = {"revision": revision, "path": str(dest), **extra}
    return outcome


def dataset_folder_name(repo_id: str, bundle_ids: list[str], state: dict) -> str:
    """The folder under ``PREFIX/datasets`` for a dataset: the repo's own name (``alpaca_en_demo`` for
    ``llamafactory/alpaca_en_demo`` or ``local/alpaca_en_demo``), or ``ORG--NAME`` when another dataset of this
    bundle, or one installed earlier from another repo, has the same name (so neither replaces the other)."""
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
    are skipped and returned as notes. Otherwise one entry per data file, named by its stem.
    """
    files = [e["path"] for e in item["files"]]
    notes: list[str] = []
    entries: dict = {}
    if "dataset_info.json" in files:
        try:
            own = json.loads((staged / "dataset_info.json").read_text("utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise BundleError(f"dataset {name}: dataset_info.json is not valid JSON: {exc}") from None
        for key, value in own.items() if isinstance(own, dict) else []:
            file_name = value.get("file_name") if isinstance(value, dict) else None
            if not file_name or not any(f == file_name or f.startswith(file_name.rstrip("/") + "/") for f in files):
                notes.append(f"dataset_info entry {key!r} of {name} skipped (no local file in the bundle)")
                continue
            entries[key] = {**value, "file_name": f"{name}/{file_name}"}
        return entries, notes
    data = [f for f in files if posixpath.splitext(f)[1].lower() in _DATA_EXTS and not f.startswith(".")]
    for f in data:
        stem = posixpath.splitext(posixpath.basename(f))[0]
        key = stem if stem not in entries else f"{name}/{stem}"
        entries[key] = {"file_name": f"{name}/{f}"}
    return entries, notes


def merge_dataset_info(path: Path, entries: dict) -> None:
    """Merge ``entries`` into LLaMA-Factory's ``dataset_info.json`` at ``path`` (new entries win), atomically."""
    current: dict = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError as exc:
            raise BundleError(f"{path} is not valid JSON ({exc}); fix or remove it and install again") from None
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
    """An exclusive ``flock`` on ``PREFIX/.ferry/lock`` for the whole install."""

    def __init__(self, prefix: Path) -> None:
        self.path = prefix / ".ferry" / "lock"

    def __enter__(self) -> "_Lock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise BundleError(f"another ferry install is running into {self.path.parent.parent}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()


def _load_state(prefix: Path) -> dict:
    path = prefix / ".ferry" / "state.json"
    if path.is_file():
        try:
            return json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError:
            return {}
    return {}


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


def install_staged(
    manifest: dict, staged: Path, prefix: Path, *, create_venv: bool = True,
    log: Callable[[str], None] = _say,
) -> dict:
    """Install a verified bundle staged at ``staged`` (the bundle folder inside ``PREFIX/.staging-XXXX``; that
    staging directory, on the same file system as ``prefix``, also holds temporary snapshot folders and
    replaced datasets, and the caller removes it).

    Steps (after verification, which the caller did while staging): build the venv (when the bundle has
    wheels and ``create_venv``), place models, ModelScope models and datasets, then switch ``PREFIX/venv``,
    write ``PREFIX/ferry.env``, hook ``activate``, and record the bundle in ``PREFIX/.ferry/state.json``.
    Returns a summary dict: ``{"bundle_id", "name", "models", "datasets", "venv", "already_installed"}``.

    Raises:
        BundleError: the bundle's wheels target another Python, venv creation or pip failed.
    """
    prefix = Path(prefix).absolute()
    scratch = Path(tempfile.mkdtemp(prefix="place-", dir=staged.parent))
    state = _load_state(prefix)
    already = manifest["bundle_id"] in state.get("bundles", {})
    summary: dict = {"bundle_id": manifest["bundle_id"], "name": manifest["name"], "models": [],
                     "datasets": [], "venv": None, "already_installed": already, "notes": []}
    wheels = [i for i in manifest["items"] if i["kind"] == "wheels" and i["files"]]
    venv_dir = prefix / "venvs" / manifest["bundle_id"]
    if wheels and create_venv:
        check_target(manifest)
        wheel_dir = staged / wheels[0]["path"]
        lock = staged / wheels[0]["path"] / LOCK_NAME
        if not lock.is_file():
            lock = staged / "wheels" / LOCK_NAME
        _create_venv(venv_dir, wheel_dir, lock, log)
    hub = prefix / "hf-home" / "hub"
    dataset_ids = [i.get("repo_id") or f"local/{posixpath.basename(i['path'])}"
                   for i in manifest["items"] if i["kind"] == "dataset"]
    for item in manifest["items"]:
        src = staged / item["path"]
        kind, source = item["kind"], item["source"]
        repo_id = item.get("repo_id") or f"local/{posixpath.basename(item['path'])}"
        revision = item.get("revision") or "main"
        if kind == "model" and source == "ms":
            owner, _, name = repo_id.partition("/")
            dest = prefix / "modelscope" / "models" / owner / name.replace(".", "___")
            outcome = place_tree(src, dest, revision, state, f"ms-model:{repo_id}", scratch)
            summary["models"].append({"repo_id": repo_id, "revision": revision, "path": str(dest),
                                      "outcome": outcome})
        elif kind == "model":
            placed = place_hf(item, src, hub, scratch)
            summary["models"].append({"repo_id": repo_id, "revision": revision, **placed})
        elif kind == "dataset":
            name = dataset_folder_name(repo_id, dataset_ids, state)
            entries, notes = dataset_entries(item, name, src)
            dest = prefix / "datasets" / name
            outcome = place_tree(src, dest, revision, state, f"dataset:{name}", scratch, repo_id=repo_id)
            merge_dataset_info(prefix / "datasets" / "dataset_info.json", entries)
            summary["datasets"].append({"name": name, "repo_id": repo_id, "path": str(dest), "outcome": outcome,
                                        "entries": sorted(entries)})
            summary["notes"].extend(notes)
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
    bundles = state.setdefault("bundles", {})
    if not already:
        bundles[manifest["bundle_id"]] = {"name": manifest["name"], "installed": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    state_text = json.dumps(state, indent=2, sort_keys=True) + "\n"
    state_file = prefix / ".ferry" / "state.json"
    if not state_file.is_file() or state_file.read_text("utf-8") != state_text:
        _atomic_text(state_file, state_text)
    return summary


def install_bundle(
    bundle: Path, prefix: Path, *, create_venv: bool = True, reference: Path | None = None,
    progress: Progress | None = None, log: Callable[[str], None] = _say,
) -> tuple[dict, Scan, dict]:
    """Verify and install ``bundle`` (a directory, archive or first volume) into ``prefix``.

    Every file is copied or extracted into ``PREFIX/.staging-XXXX`` while hashed (one read), checked against
    the manifest, then installed by :func:`install_staged`. The staging directory is removed at the end,
    on success or failure; stale ones from killed runs are removed first. Returns ``(manifest, scan,
    summary)``.

    Raises:
        InsufficientSpaceError: up front, when ``prefix`` cannot hold the bundle (plus its venv), or when the
            disk fills up part-way (another writer); nothing half-written is visible then either.
        IntegrityError / UnsafeArchiveError / BundleError: see :func:`check_bundle`; nothing was installed.
    """
    bundle = Path(bundle)
    prefix = Path(prefix).absolute()
    prefix.mkdir(parents=True, exist_ok=True)
    with _Lock(prefix):
        for stale in prefix.glob(".staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        needed = bundle_bytes(bundle)
        ensure_free_space(prefix, needed, f"installing {bundle.name}")
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=prefix))
        try:
            tree = staging / "bundle"
            tree.mkdir()
            manifest, scan = check_bundle(bundle, reference, progress, dest=tree)
            if create_venv and _wheel_bytes(manifest):
                ensure_free_space(prefix, WHEEL_EXPANSION * _wheel_bytes(manifest), "the bundle's venv")
            summary = install_staged(manifest, tree, prefix, create_venv=create_venv, log=log)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, FerryError):
                raise InsufficientSpaceError(
                    f"ran out of disk space in {prefix} while installing {bundle.name} ({exc}); what is already "
                    f"in place is complete and nothing half-written is visible: free some space and run the "
                    f"install again") from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return manifest, scan, summary


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
    """``python3 install.py --prefix DIR [--no-venv] [--verify-only] [--bundle DIR] [--manifest FILE]``."""
    parser = argparse.ArgumentParser(prog="install.py", description="Verify and install this ferry bundle "
                                     "(standard library only).")
    parser.add_argument("--prefix", type=Path, help="install root (required unless --verify-only)")
    parser.add_argument("--no-venv", action="store_true", help="do not create a venv from the bundle's wheels")
    parser.add_argument("--verify-only", action="store_true", help="check every byte and stop")
    parser.add_argument("--bundle", type=Path, default=Path(__file__).resolve().parent,
                        help="bundle directory or archive (default: the folder holding install.py)")
    parser.add_argument("--manifest", type=Path, help="a manifest brought over a separate channel")
    args = parser.parse_args(argv)
    if not args.verify_only and args.prefix is None:
        parser.error("--prefix is required (or use --verify-only)")
    try:
        total = bundle_bytes(args.bundle)
        if args.verify_only:
            _, scan = check_bundle(args.bundle, args.manifest, PercentProgress(total, "verify"))
            print(f"OK: {len(scan.observed)} files, {format_bytes(scan.bytes_read)} verified")
            return 0
        _, scan, summary = install_bundle(args.bundle, args.prefix, create_venv=not args.no_venv,
                                          reference=args.manifest, progress=PercentProgress(total, "install"))
    except FerryError as exc:
        print(f"install.py: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    for model in summary["models"]:
        print(f"model   {model['repo_id']} @ {model['revision']} -> {model['path']}")
    for dataset in summary["datasets"]:
        print(f"dataset {dataset['name']} -> {dataset['path']} ({', '.join(dataset['entries'])})")
    for note in summary["notes"]:
        print(f"note: {note}")
    if summary["venv"]:
        print(f"venv    {summary['venv']}")
    print(f"OK: {len(scan.observed)} files verified; now run: source {Path(args.prefix).absolute() / 'ferry.env'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
