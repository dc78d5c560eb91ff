"""Serving tools ``ferry pack`` carries beside the wheels (``serving: [gguf]``, ``ferry pack --extra gguf``).

``gguf``: the pinned llama-cpp-python sdist that vendors llama.cpp's converter (:data:`ferry.serving_tools.SDIST`).
It travels as one more file of the bundle's ``wheels/`` item (hashed in the manifest like every file; the wheel lock
does not list it, so pip never builds it) and ``ferry install`` places it in ``PREFIX/tools/``, where
``ferry export --format gguf`` finds it. The converter's Python packages join the wheel set
(:func:`bundler.wheels.resolve`).

Where the file comes from, first hit wins: a local ``find_links`` folder of the spec holding that exact file name,
the pack cache (``OUT/.ferry-cache/tools/``, a re-run downloads nothing), else the package index the spec names (its
PEP 691 JSON simple page, as pip reads it). Whatever the source, the sha256 must be the pinned one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from bundler.spec import PackSpec
from ferry.errors import SourceError
from ferry.fsutil import sha256_file
from ferry.serving_tools import SDIST

PYPI_SIMPLE = "https://pypi.org/simple"


def _index_url(index: str) -> str:
    """The sdist's URL on ``index``'s simple page (PEP 691 JSON), checked to state the pinned hash when it states
    one."""
    req = urllib.request.Request(
        f"{index.rstrip('/')}/{SDIST.project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        page = json.load(resp)
    for entry in page.get("files", []):
        if entry.get("filename") == SDIST.filename:
            stated = entry.get("hashes", {}).get("sha256")
            if stated not in (None, SDIST.sha256):
                raise SourceError(f"{index} lists {SDIST.filename} with sha256 {stated}, not the pinned {SDIST.sha256}")
            return urllib.parse.urljoin(resp.url, entry["url"])
    raise SourceError(f"{index}/{SDIST.project}/ lists no {SDIST.filename}")


def fetch_tools(spec: PackSpec, cache_dir: Path) -> list[Path]:
    """The tool files ``spec.serving`` asks for, in ``cache_dir/tools/`` (hash-checked). Empty when none.

    Raises:
        SourceError: the file is nowhere (the index's reason), or its sha256 is not the pinned one.
    """
    if "gguf" not in spec.serving:
        return []
    folder = cache_dir / "tools"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / SDIST.filename
    if target.is_file() and sha256_file(target) == SDIST.sha256:
        return [target]
    for link in spec.wheels.find_links:
        local = Path(link).expanduser() / SDIST.filename if "://" not in link else None
        if local is not None and local.is_file():
            if sha256_file(local) != SDIST.sha256:
                raise SourceError(f"{local}: sha256 is not the pinned {SDIST.sha256}")
            shutil.copyfile(local, target)
            return [target]
    index = spec.wheels.index_url or os.environ.get("PIP_INDEX_URL") or PYPI_SIMPLE
    fd, tmp = tempfile.mkstemp(prefix=".part-", dir=folder)
    try:
        url = _index_url(index)
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != SDIST.sha256:
            raise SourceError(f"{url}: sha256 {h.hexdigest()}, not the pinned {SDIST.sha256}")
        os.replace(tmp, target)
    except OSError as exc:
        raise SourceError(f"cannot download {SDIST.filename} from {index}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return [target]


__all__ = ["fetch_tools"]
