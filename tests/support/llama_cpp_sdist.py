"""The pinned llama-cpp-python sdist (llama.cpp's converter inside), fetched once per machine for the GGUF tests.

Same file and sha256 as :mod:`tests.support.chat_templates` (and :data:`exporter.gguf.SDIST`): found through the simple
index (``$PIP_INDEX_URL``), hash-checked, kept whole in ``${XDG_CACHE_HOME:-~/.cache}/ferry-tests/sdists/<sha256>/``.
A failed download or a wrong hash FAILS the session, it never skips.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from pathlib import Path

import pytest

from tests.support.chat_templates import FILENAME, SHA256, _sdist_url
from tests.support.suite import machine_lock


def sdist_path() -> Path:
    """The sdist, downloading it once (atomic rename into the cache)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = base / "ferry-tests" / "sdists" / SHA256 / FILENAME
    if target.is_file():
        return target
    with machine_lock(f"sdist-{SHA256[:16]}"):  # one download per machine, also under pytest-xdist
        if not target.is_file():
            _download(target)
    return target


def _download(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        url = _sdist_url()
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=target.parent)
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != SHA256:
            os.unlink(tmp)
            raise RuntimeError(f"{url}: sha256 {h.hexdigest()}, expected {SHA256}")
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001 - the reason goes into the failure
        pytest.fail(f"cannot obtain {FILENAME}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def llama_cpp_sdist() -> Path:
    """The hash-checked llama-cpp-python 0.3.36 sdist file."""
    return sdist_path()
