"""Installing a delta bundle: the files the isolated host already holds are not carried (bundler/delta.py packs).

Its ``from_base`` files are found in the prefix and re-hashed, its ``tensors`` files rebuilt from the installed
base file and the carried tensors, all in the staging area and before anything is placed (the fields:
bundler/installer/manifest.py). Standard library and ferry's foundation only (part of the generated
``install.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from bundler.format import DELTAS_DIRNAME
from bundler.installer.fs import check_inside
from bundler.installer.hashing import CHUNK_SIZE, HashWorker, Progress, copy_hashing, same_file
from bundler.installer.manifest import is_delta, parse_manifest, patch_path
from bundler.installer.prefix import installed_items
from bundler.installer.report import say
from bundler.installer.signature import read_head
from ferry.errors import BundleError, IntegrityError, UnsafeArchiveError
from ferry.fsutil import ensure_free_space, format_bytes


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
        with (
            open(patch_file, "rb", buffering=0) as pf,
            open(base_file, "rb", buffering=0) as bf,
            open(dest, "xb") as out,
        ):
            if os.fstat(bf.fileno()).st_size != patch["base_size"]:
                raise IntegrityError(
                    f"{entry['path']}: the installed base file {base_file} has "
                    f"{os.fstat(bf.fileno()).st_size} bytes, the delta was made against "
                    f"{patch['base_size']}: refused, nothing was installed"
                )
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
                f"drifted, or the bundle was altered): refused, nothing was installed"
            )
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest)
        raise


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
                check_inside(root, candidate, label)
            except UnsafeArchiveError:
                continue
            if (
                same_file(candidate, size, sha)
                if full
                else (os.path.isfile(candidate) and os.stat(candidate).st_size == size)
            ):
                checked[sha, full] = candidate
                return candidate
        raise IntegrityError(
            f"delta bundle {manifest['name']} (base {manifest['base'][:12]}): {label} (sha256 {sha[:12]}, "
            f"{size} bytes) is not in {prefix} with that content (missing, changed since the base was taken, "
            f"or the delta was packed for another prefix): refused, nothing was installed"
        )

    found = []
    for item in manifest["items"]:
        for e in item["files"]:
            label = f"{item.get('repo_id') or item['kind']}: {e['path']}"
            if e["delta"] == "from_base":
                found.append((item, e, find(e["sha256"], e["size"], label, rehash)))
            elif e["delta"] == "tensors":
                found.append(
                    (
                        item,
                        e,
                        find(e["patch"]["base_sha256"], e["patch"]["base_size"], f"{label} (its base file)", False),
                    )
                )
    return found


def early_delta_check(bundle: Path, prefix: Path) -> None:
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


def apply_delta(manifest: dict, tree: Path, prefix: Path, *, log: Callable[[str], None] = say) -> dict:
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
        check_inside(os.path.realpath(tree), dest, f"{item.get('repo_id') or item['kind']}: {e['path']}")
        if e["delta"] == "tensors":
            rebuild_file(e, tree / patch_path(item, e), source, dest)
            reused += e["size"] - e["patch"]["size"]
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:  # another file system, or no hard links there: a copy, hashed again
            worker = HashWorker()
            try:
                size, digest = copy_hashing(source, dest, worker, None)
            finally:
                worker.close()
            if (size, digest) != (e["size"], e["sha256"]):
                raise IntegrityError(
                    f"{item.get('repo_id') or item['kind']}: {e['path']}: {source} changed while "
                    f"it was copied: refused, nothing was installed"
                ) from None
        reused += e["size"]
    shutil.rmtree(tree / DELTAS_DIRNAME, ignore_errors=True)
    log(
        f"delta: {sum(1 for t in todo if t[1]['delta'] == 'from_base')} file(s) taken from {prefix}, "
        f"{sum(1 for t in todo if t[1]['delta'] == 'tensors')} rebuilt by tensor"
    )
    return {
        "from_base": sum(1 for t in todo if t[1]["delta"] == "from_base"),
        "reused_bytes": reused,
        "rebuilt": sum(1 for t in todo if t[1]["delta"] == "tensors"),
    }
