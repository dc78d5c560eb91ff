"""Fixtures shared by every test area. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from tests.support.helpers import LLAMAFACTORY_DATA, STORIES_MODEL

#: The suite's guard rails (durations file, per-test budgets, xdist groups and locks), and the session fixtures of
#: the shared machinery: the models' own chat templates, the pinned llama-cpp-python sdist and the llama.cpp build.
pytest_plugins = [
    "pytester",
    "tests.support.suite",
    "tests.support.chat_templates",
    "tests.support.llama_cpp_sdist",
    "tests.support.llama_cpp_build",
]


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it: library functions called in-process (``export``,
    ``run_eval``) switch the process offline (``ferry.constants.apply_offline_env``), and a later test's online
    subprocess (TRANSFORMERS_OFFLINE=1 also makes huggingface_hub offline) would inherit that."""
    with mock.patch.dict(os.environ):
        yield


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real test asset missing: {path} (expected in ../shared/assets beside the project)")
    return path


@pytest.fixture(scope="session")
def stories_model() -> Path:
    """The real stories260K Llama model folder (read-only; copy before modifying)."""
    return _require(STORIES_MODEL)


@pytest.fixture(scope="session")
def llamafactory_data() -> Path:
    """The real LLaMA-Factory demo data folder (alpaca_en_demo.json, c4_demo.jsonl, dataset_info.json...)."""
    return _require(LLAMAFACTORY_DATA)


@pytest.fixture(scope="session")
def sdist_data() -> Path:
    """LLaMA-Factory 0.9.5's whole ``data/`` folder from its hash-pinned sdist (mllm_demo and its images, the
    preference demos, ...; fetched once per machine)."""
    from tests.support.pinned_sdist import LLAMAFACTORY

    return LLAMAFACTORY.path() / "data"
