"""Session fixtures for the model zoo: each family is built once, on first use, and shared by every test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.zoo import build


@pytest.fixture(scope="session")
def zoo(tmp_path_factory, stories_model):
    """``zoo(name) -> Path``: the tiny model of family ``name`` in the hub's layout (built once per session)."""
    root = tmp_path_factory.mktemp("zoo")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(name, root, stories_model)
        return built[name]

    return get
