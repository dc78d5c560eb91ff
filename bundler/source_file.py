"""The packer's record of one file to carry, shared by the sources (bundler.sources) and the dataset cache builder
(bundler.hub_datasets) so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class SourceFile:
    """One file of an item: ``rel`` (POSIX, relative to the item folder), ``src`` (local path to read),
    ``size`` in bytes, and ``expected_sha256`` when the hub states one (LFS files)."""

    rel: str
    src: Path
    size: int
    expected_sha256: str | None = None
