"""Check a bundle: one pass over a directory, archive or volumes, compared with its manifest and signature.

What ``ferry verify`` and ``install.py --verify-only`` run, and the first step of every install (which passes a
``dest`` to copy into while hashing). Standard library and ferry's foundation only (part of the generated
``install.py``).
"""

from __future__ import annotations

from pathlib import Path

from bundler.installer.archive import archive_volumes, scan_archive
from bundler.installer.hashing import Progress
from bundler.installer.manifest import parse_manifest
from bundler.installer.report import integrity_error
from bundler.installer.scan import Scan, check_scan, directory_size, scan_directory
from bundler.installer.signature import check_signature
from ferry.errors import BundleError, IntegrityError


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
    bundle: Path,
    reference: Path | None = None,
    progress: Progress | None = None,
    dest: Path | None = None,
    *,
    allowed_signers: Path | None = None,
    require_signature: bool = False,
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
        raise integrity_error(
            [*scan.volume_problems(), *exc.problems],  # type: ignore[attr-defined]  # the culprit first
            f"bundle {bundle} failed verification",
        ) from None
    except BundleError as exc:
        volume_problems = scan.volume_problems()
        if volume_problems:
            raise integrity_error([*volume_problems, str(exc)], f"bundle {bundle} failed verification") from None
        raise
    problems = check_signature(bundle, scan, problems, reference, allowed_signers, require_signature, dest)
    if problems:
        raise integrity_error([*scan.volume_problems(), *problems], f"bundle {bundle} failed verification")
    return manifest, scan
