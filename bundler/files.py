"""The unit every source hands to the bundle writer: one file of an item on local disk.

Its own module so that the sources (``bundler.sources``) and the builders they call (``bundler.hub_datasets``)
both import it and import runs one way: sources -> hub_datasets -> files.
"""

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


__all__ = ["SourceFile"]
