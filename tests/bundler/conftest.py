"""Fixtures of the bundler tests: a real olah hub serving the stories260K model and an alpaca dataset.

``hub`` (session scope) is a :class:`tests.hubserver.Hub` with

* ``stories/stories260K`` (model): the files of ``../shared/assets/models/stories260K`` plus a model card
  ``README.md`` whose front matter says ``license: mit``; ``model.safetensors`` is an LFS file; tag ``v1``.
* ``llamafactory/alpaca_en_demo`` (dataset): ``alpaca_en_demo.json`` from the LLaMA-Factory demo data.

``hub_env`` points ``$HF_ENDPOINT`` at it for the test (ferry reads it at call time) and gives the test its
own ``$HF_HOME``. Tests that need more repos add them with ``hub.add_model(...)`` under a unique repo id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubserver import Hub, serve_hub

STORIES_REPO = "stories/stories260K"
ALPACA_REPO = "llamafactory/alpaca_en_demo"
MODEL_CARD = "---\nlicense: mit\nlibrary_name: transformers\n---\n# stories260K\nA tiny TinyStories Llama.\n"


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> Iterator[Hub]:
    """A running olah hub holding the stories260K model and the alpaca_en_demo dataset (see module doc)."""
    root = tmp_path_factory.mktemp("hub")
    with serve_hub(root) as server:
        files: dict[str, Path | str] = {p.name: p for p in sorted(stories_model.iterdir()) if p.is_file()}
        files["README.md"] = MODEL_CARD
        server.add_model(STORIES_REPO, files, tag="v1")
        server.add_dataset(ALPACA_REPO, {"alpaca_en_demo.json": llamafactory_data / "alpaca_en_demo.json"})
        yield server


@pytest.fixture()
def hub_env(hub: Hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Hub:
    """``hub`` with ``$HF_ENDPOINT`` (and a private ``$HF_HOME``, no token) set for this test."""
    for key, value in hub.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


def resign(bundle: Path, manifest: dict, drop: str | None = None) -> None:
    """Write ``manifest`` as the bundle directory's manifest.json and fix its SHA256SUMS line (dropping lines
    that end in ``drop``): what an attacker holding the bundle, or a pack with other sources, would write."""
    data = (json.dumps(manifest, indent=2) + "\n").encode()
    (bundle / "manifest.json").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    lines = [f"{digest}  manifest.json" if line.endswith("  manifest.json") else line
             for line in (bundle / "SHA256SUMS").read_text().splitlines() if not (drop and line.endswith(drop))]
    (bundle / "SHA256SUMS").write_text("\n".join(lines) + "\n")
