"""Source distributions from the package index that tests read (never committed), fetched once, hash-pinned.

A :class:`PinnedSdist` names one file on the index with its SHA-256. :meth:`PinnedSdist.path` finds it the way
pip does (the simple index, ``$PIP_INDEX_URL`` or PyPI, PEP 691 JSON), downloads it, refuses it unless the hash
matches, and unpacks it whole into ``${XDG_CACHE_HOME:-~/.cache}/ferry-tests/sdists/<sha256>/`` (renamed into
place when complete, so a killed run leaves nothing half-made). Later runs need no network. A failure fails the
test that asked (pytest.fail): nothing is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.suite import machine_lock


@dataclass(frozen=True)
class PinnedSdist:
    """One sdist: ``package`` / ``version`` on the index, its ``filename`` and ``sha256``."""

    package: str
    version: str
    filename: str
    sha256: str

    @property
    def cache(self) -> Path:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return base / "ferry-tests" / "sdists" / self.sha256

    def _url(self) -> str:
        index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/")
        request = urllib.request.Request(
            f"{index}/{self.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            listing = json.load(resp)
        for entry in listing["files"]:
            if entry["filename"] == self.filename:
                listed = entry.get("hashes", {}).get("sha256")
                if listed not in (None, self.sha256):
                    raise RuntimeError(f"the index lists {self.filename} with sha256 {listed}, pinned {self.sha256}")
                return urllib.parse.urljoin(resp.url, entry["url"])
        raise RuntimeError(f"{index}/{self.package}/ does not list {self.filename}")

    def _fetch(self) -> None:
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=self.cache.parent) as tmp:
            archive, digest = Path(tmp) / self.filename, hashlib.sha256()
            with urllib.request.urlopen(self._url(), timeout=300) as resp, open(archive, "wb") as out:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != self.sha256:
                raise RuntimeError(f"{self.filename}: sha256 {digest.hexdigest()}, pinned {self.sha256}")
            unpacked = Path(tmp) / "unpacked"
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(unpacked, filter="data")
            try:
                unpacked.rename(self.cache)
            except OSError:
                if not self.cache.is_dir():  # another run put its complete copy there first
                    raise

    def path(self) -> Path:
        """The unpacked sdist's top folder (``<package>-<version>/``), fetched on first use."""
        if not self.cache.is_dir():
            with machine_lock(f"sdist-{self.sha256[:16]}"):  # one download per machine, also under pytest-xdist
                if not self.cache.is_dir():
                    self._fetch_or_fail()
        tops = [p for p in self.cache.iterdir() if p.is_dir()]
        if len(tops) != 1:
            pytest.fail(f"{self.cache}: expected one top folder in {self.filename}, found {len(tops)}", pytrace=False)
        return tops[0]

    def _fetch_or_fail(self) -> None:
        try:
            self._fetch()
        except Exception as exc:  # noqa: BLE001 - the reason goes into the failure
            shutil.rmtree(self.cache, ignore_errors=True)
            pytest.fail(f"cannot obtain {self.filename} from the package index: {exc}", pytrace=False)


#: LLaMA-Factory 0.9.5, the peer whose keys, templates and examples ferry follows.
LLAMAFACTORY = PinnedSdist(
    "llamafactory",
    "0.9.5",
    "llamafactory-0.9.5.tar.gz",
    "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f",
)
