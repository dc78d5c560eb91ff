"""What one pass over a bundle saw (:class:`Scan`), compared with the manifest and SHA256SUMS; bundle directories.

An archive is scanned by bundler/installer/archive.py, a directory here (:func:`scan_directory`): every regular
file is read once, hashed, and copied when a destination is given. Standard library and ferry's foundation only
(part of the generated ``install.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import stat
from pathlib import Path

from bundler.format import ARCHIVE_SUFFIX, MANIFEST_NAME, SIGNATURE_NAME, SUMS_NAME, VOLUMES_SUMS_SUFFIX
from bundler.installer.hashing import HashWorker, Progress, copy_hashing, size_and_sha256
from bundler.installer.manifest import expected_files, parse_manifest
from bundler.installer.report import integrity_error
from ferry.errors import BundleError

#: A line of coreutils' ``sha256sum`` output: ``HEX  PATH`` (or ``HEX *PATH``).
SUMS_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class Scan:
    """What one pass over a bundle saw: ``observed`` path -> (size, sha256) for every regular file, the bytes
    of ``manifest.json``, ``SHA256SUMS`` and ``manifest.json.sig`` (None when absent), problems found on the way
    (unexpected links), the bundle's top-level folder name (archives), the bytes read, and the signature checked
    against allowed signers (None when none was required)."""

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
        #: The good signature (bundler/installer/signature.py ``verify_signature``'s dict) once one was checked.
        self.signature: dict | None = None

    def volume_problems(self) -> list[str]:
        """On a failure, which volumes do not match ``NAME.ferry.sha256`` (empty for directories)."""
        return _volume_problems(self.volumes, self.volume_sums) if self.volumes else []


def _volume_problems(volumes: list[Path], expected: dict[str, str]) -> list[str]:
    """Name the culprits on the failure path, one line per broken volume: one whose size breaks the split, one that
    does not match NAME.ferry.sha256, or both in one line.

    The split: ``.000`` is the metadata head alone (bundler/writer.py), so the split size is the data volumes' own:
    the most common size among those before the last (which is not larger). With a single such volume its size is
    the reference; NAME.ferry.sha256, when it came across, still names it."""
    sizes = {v: v.stat().st_size for v in volumes}
    by_size: dict[Path, str] = {}
    middle = volumes[1:-1]
    split = None
    if middle:
        counts: dict[int, int] = {}
        for v in middle:
            counts[sizes[v]] = counts.get(sizes[v], 0) + 1
        split = max(counts, key=lambda size: (counts[size], size))
        for v in middle:
            if sizes[v] != split:
                by_size[v] = "truncated" if sizes[v] < split else "longer than the split size"
        if sizes[volumes[-1]] > split:
            by_size[volumes[-1]] = "longer than the split size: altered"
    problems = []
    for volume in volumes:
        want = expected.get(volume.name)
        mismatch = want is not None and size_and_sha256(volume)[1] != want
        how = by_size.get(volume)
        sums = f"{volume.name.split(ARCHIVE_SUFFIX)[0]}{VOLUMES_SUMS_SUFFIX}"
        if how and mismatch:
            problems.append(
                f"volume {volume.name} is {sizes[volume]} bytes where the split size is {split} ({how}) and does "
                f"not match its sha256 in {sums}"
            )
        elif how:
            problems.append(f"volume {volume.name} is {sizes[volume]} bytes where the split size is {split}: {how}")
        elif mismatch:
            problems.append(
                f"volume {volume.name} ({sizes[volume]} bytes) does not match its sha256 in {sums}: truncated or "
                "altered"
            )
    return problems


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
            raise integrity_error([str(own_error), *sums_problems], "bundle check failed")
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
        match = SUMS_LINE.match(line)
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


def keep_metadata(scan: Scan, rel: str, data: bytes) -> None:
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
    worker = HashWorker()
    try:
        for root, dirs, files in os.walk(bundle_dir):
            rel_root = os.path.relpath(root, bundle_dir)
            dirs.sort()
            for name in list(dirs):
                if os.path.islink(os.path.join(root, name)):
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
                    keep_metadata(scan, rel, data)
                    scan.observed[rel] = (len(data), hashlib.sha256(data).hexdigest())
                    if progress:
                        progress(len(data))
                    continue
                target = None if dest is None else dest / rel
                scan.observed[rel] = copy_hashing(full, target, worker, progress)
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
