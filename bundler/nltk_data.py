"""NLTK data packages for the isolated host: fetched with NLTK's own downloader, carried as dataset items.

Some lm-eval tasks' helpers call ``nltk.download("punkt_tab")`` unless ``nltk.data.find`` already finds the
package (ifeval does, at import). Offline that call fails, so ``ferry pack`` carries the package the call names
(bundler/eval_tasks.py finds the literal id) and ``ferry install`` puts it where ``nltk.data.find`` looks:

- **Online**: :func:`fetch_nltk_packages` asks NLTK's ``Downloader`` for each id. It reads NLTK's index
  (``nltk_index_url`` of the spec, default :data:`DEFAULT_INDEX`, NLTK's own), downloads the package's zip,
  checks it against the sha256 (else md5) the index states, and unzips it with NLTK's own size and path limits.
  NLTK refuses indexes and packages on loopback or private addresses (its SSRF guard): an internal mirror is
  named as a ``file://`` index on a mounted folder, which ferry authorises for NLTK's path sandbox.
- **In the bundle**: one dataset item per package, ``source: nltk``, ``repo_id: SUBDIR/ID`` (the resource path
  ``nltk.data.find`` takes, ``tokenizers/punkt_tab``), ``revision``: the sha256 of the package's zip,
  ``path: datasets/nltk/SUBDIR/ID``, its files the unzipped package (every file hashed like any other).
- **On the isolated host**: ``PREFIX/nltk_data/SUBDIR/ID/`` (a real folder: NLTK's sandbox does not follow a
  link out of its data root), and ``ferry.env`` exports ``NLTK_DATA=PREFIX/nltk_data``.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bundler.source_file import SourceFile
from bundler.sources import PreparedItem
from ferry.errors import NotInstalledError, SourceError
from ferry.fsutil import sha256_file

#: NLTK's own index (``nltk.downloader.Downloader.DEFAULT_URL``).
DEFAULT_INDEX = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/index.xml"
#: Folder of the pack cache (``OUT/.ferry-cache/nltk/``) the packages are downloaded into.
CACHE_SUBDIR = "nltk"


def _downloader(index_url: str) -> Any:
    """NLTK's ``Downloader`` over ``index_url``; a ``file://`` index's folder is added to NLTK's data path so
    its path sandbox lets the downloader read the index and the packages it names there."""
    try:
        import nltk
        from nltk.downloader import Downloader
    except ImportError:
        raise NotInstalledError("carrying NLTK data needs nltk on this host: pip install 'nltk>=3.9.1'") from None
    parsed = urllib.parse.urlparse(index_url)
    if parsed.scheme == "file":
        folder = str(Path(urllib.parse.unquote(parsed.path)).parent)
        if folder not in nltk.data.path:
            nltk.data.path.append(folder)
    return Downloader(server_index_url=index_url)


def _package_info(downloader: Any, package_id: str, index: str, needed_by: str) -> Any:
    """The index's record of ``package_id``.

    Raises:
        SourceError: the index cannot be read or does not list it (naming the package, who needs it, the index).
    """
    try:
        return downloader.info(package_id)
    except Exception as exc:  # NLTK: ValueError (not listed), URLError / PermissionError (index unreadable)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SourceError(
            f"NLTK package {package_id!r} (needed by {needed_by}): index {index}: {type(exc).__name__}: {first}"
        ) from None


def describe_packages(needs: dict[str, list[str]], index_url: str | None = None) -> list[str]:
    """``ferry pack --dry-run`` lines: each package's zip size and sha256 as the index states them, and the tasks
    that need it (the index is read; no package is downloaded).

    Raises:
        NotInstalledError, SourceError: as :func:`fetch_nltk_packages`.
    """
    from ferry.fsutil import format_bytes

    index = index_url or DEFAULT_INDEX
    downloader = _downloader(index)
    lines = []
    for package_id, users in needs.items():
        info = _package_info(downloader, package_id, index, ", ".join(users))
        digest = getattr(info, "sha256_checksum", None) or f"md5 {info.checksum}"
        lines.append(
            f"eval      nltk:{info.subdir}/{package_id}@{digest[:12]}  {format_bytes(int(info.size))}  "
            f"tasks: {', '.join(users)}"
        )
    return lines


def fetch_nltk_packages(
    ids: Sequence[str], cache_dir: Path, index_url: str | None = None, *, users: dict[str, list[str]] | None = None
) -> list[PreparedItem]:
    """One dataset item per NLTK package id (``punkt_tab``), downloaded and unzipped under
    ``cache_dir/nltk/<sha256 of the zip>/`` (a re-run with the same package downloads nothing new).

    ``users``: the tasks that need each id, recorded on the item (``eval_tasks``) and named in errors.

    Raises:
        NotInstalledError: nltk is not installed here.
        SourceError: the index cannot be read, does not list the id, lists a package NLTK keeps zipped, or the
            download fails its checksum (NLTK's reason, naming the id and the index).
    """
    index = index_url or DEFAULT_INDEX
    downloader = _downloader(index)
    root = Path(cache_dir) / CACHE_SUBDIR
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # NLTK authorises only private download folders
    items = []
    for package_id in dict.fromkeys(ids):
        needed_by = ", ".join((users or {}).get(package_id, [])) or "the spec"
        info = _package_info(downloader, package_id, index, needed_by)
        if not hasattr(info, "subdir"):  # a collection: its members are what a task reads
            raise SourceError(f"NLTK id {package_id!r} (needed by {needed_by}) is a collection: name its packages")
        if not getattr(info, "unzip", True):
            raise SourceError(f"NLTK package {package_id!r} is used zipped; ferry carries unzipped packages only")
        stated = getattr(info, "sha256_checksum", None) or info.checksum
        folder = root / str(stated)
        folder.mkdir(mode=0o700, exist_ok=True)
        try:
            ok = downloader.download(info, download_dir=str(folder), quiet=True, raise_on_error=True)
        except Exception as exc:  # NLTK raises ValueError for checksum, size and unzip refusals
            raise SourceError(f"NLTK package {package_id!r} from {index}: {exc}") from None
        if not ok:
            raise SourceError(f"NLTK package {package_id!r} from {index}: the download failed")
        items.append(_item(info, folder, users=(users or {}).get(package_id, [])))
    return items


def _item(info: Any, folder: Path, *, users: list[str]) -> PreparedItem:
    """The dataset item of a downloaded package: its unzipped folder, revision = the zip's sha256."""
    subdir, package_id = str(info.subdir), str(info.id)
    unzipped = folder / subdir / package_id
    archive = folder / subdir / f"{package_id}.zip"
    if not unzipped.is_dir() or not archive.is_file():
        raise SourceError(f"NLTK package {package_id!r}: the downloader left no folder {unzipped}")
    files = []
    for path in sorted(p for p in unzipped.rglob("*") if p.is_file()):
        files.append(SourceFile(path.relative_to(unzipped).as_posix(), path, path.stat().st_size))
    if not files:
        raise SourceError(f"NLTK package {package_id!r} unzipped to no files")
    licence = getattr(info, "license", None)
    return PreparedItem(
        kind="dataset",
        source="nltk",
        spec=f"nltk:{package_id}",
        repo_id=f"{subdir}/{package_id}",
        revision_requested=None,
        revision=sha256_file(archive),
        path=f"datasets/nltk/{subdir}/{package_id}",
        files=files,
        license=None if licence in (None, "Unknown") else str(licence),
        eval_tasks=[{"task": task, "config": None, "version": None} for task in users],
    )


__all__ = ["CACHE_SUBDIR", "DEFAULT_INDEX", "fetch_nltk_packages"]
