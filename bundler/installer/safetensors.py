"""Safetensors files read by tensor: the byte range and sha256 of every tensor (what delta bundles carry).

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from bundler.installer.hashing import CHUNK_SIZE, Progress
from bundler.installer.manifest import is_count
from ferry.errors import BundleError

#: Largest safetensors JSON header read (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


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
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]
            and start + offsets[1] <= size
        ):
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
                    t[3].update(view[lo - pos : hi - pos])
                if t[2] <= end:
                    tensors[t[0]] = [t[1], t[2], t[3].hexdigest()]
                    current.remove(t)
            pos = end
            if progress:
                progress(len(chunk))
        for t in current + [[n, a, b, hashlib.sha256()] for n, a, b in pending]:  # empty tensors at the end
            tensors[t[0]] = [t[1], t[2], t[3].hexdigest()]
    return pos, whole.hexdigest(), (tensors if spans is not None else None)
