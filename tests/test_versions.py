"""ferry.versions: release comparison as GPU hosts label their builds, and the one-line refusal of a feature that
needs a newer library than pyproject.toml's floor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ferry import versions
from ferry.errors import ConfigError, ExportError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml's tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_releases_compare_by_number_whatever_the_build_label():
    assert versions.at_least("2.8.0a0+5228986c39.nv25.05", "2.8")  # NVIDIA's container builds
    assert versions.at_least("2.13.0+cpu", "2.8") and versions.at_least("2.8", "2.8.0")
    assert versions.at_least("5.21.0.dev0", "5.21") and versions.at_least("5.24.0", "5.21")
    assert not versions.at_least("2.7.1+cu126", "2.8") and not versions.at_least("5.17.0", "5.21")
    assert not versions.at_least("not-a-version", "1.0")
    assert versions.installed_version("no-such-distribution-here") is None


def test_a_feature_needing_a_newer_library_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda dist: "5.17.0")
    with pytest.raises(ExportError) as err:
        versions.require_version("transformers", "5.21", "merging into fused experts", ExportError)
    assert str(err.value) == (
        "merging into fused experts needs transformers >= 5.21, and transformers 5.17.0 is installed; install "
        "transformers>=5.21 (ferry pack carries the versions its constraints name)"
    )
    monkeypatch.setattr(versions, "installed_version", lambda dist: None)
    with pytest.raises(ConfigError, match=r"^fsdp needs torch >= 2.8, and torch is not installed; "):
        versions.require_version("torch", "2.8", "fsdp", ConfigError)
    monkeypatch.setattr(versions, "installed_version", lambda dist: "2.8.1")
    versions.require_version("torch", "2.8", "fsdp", ConfigError)


def test_the_floors_are_those_the_code_needs():
    """pyproject.toml's floors (docs/installing.md#version-floors): torch 2.6 (get_total_norm /
    clip_grads_with_norm_ in every step), transformers 5, peft 0.18; the features that need more check it
    themselves (fsdp torch 2.8, fused-expert export transformers 5.21, converted-layout targets peft 0.19)."""
    from exporter.layout import FUSED_TRANSFORMERS
    from trainer.fsdp import FSDP_TORCH
    from trainer.targets import PEFT_CONVERSION

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.6" in deps and "transformers>=5.0,<6" in deps and "peft>=0.18" in deps
    assert (FSDP_TORCH, FUSED_TRANSFORMERS, PEFT_CONVERSION) == ("2.8", "5.21", "0.19")
    docs = (ROOT / "docs" / "installing.md").read_text()
    for needed in ("torch 2.8", "transformers 5.21", "peft 0.19"):
        assert needed in docs
