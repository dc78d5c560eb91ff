"""Sources: safety rules, pattern selection, local items, and the ModelScope adapter as far as the SDK allows
without a ModelScope server (its own cache layout, read with ``local_files_only``)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from bundler.pack import pack
from bundler.sources import apply_safety, local_revision, prepare_local, select
from bundler.spec import SourceSpec, load_spec
from ferry.errors import SourceError


def test_apply_safety_rules():
    kept, skipped, py = apply_safety(
        ["config.json", "model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "modeling_x.py"],
        allow_pickle=False,
        label="m",
    )
    assert kept == ["config.json", "model.safetensors", "modeling_x.py"] and py == ["modeling_x.py"]
    assert skipped == ["pytorch_model.bin", "pytorch_model.bin.index.json"]
    # sub/ has no safetensors of its own: its pickle is refused, naming it
    with pytest.raises(SourceError, match=r"sub/adapter_model\.bin"):
        apply_safety(["a.safetensors", "sub/adapter_model.bin"], allow_pickle=False, label="m")
    kept, skipped, _ = apply_safety(["a.safetensors", "sub/adapter_model.bin", "x.ckpt"], allow_pickle=True, label="m")
    assert kept == ["a.safetensors", "sub/adapter_model.bin"] and skipped == ["x.ckpt"]


def test_select_patterns_cross_folders_like_huggingface_hub():
    rels = ["config.json", "original/consolidated.pth", "original/params.json", "model.safetensors"]
    assert select(rels, ["*.json"], None) == ["config.json", "original/params.json"]
    assert select(rels, None, ["original/"]) == ["config.json", "model.safetensors"]
    assert select(rels, None, None) == rels


def test_local_file_and_folder_items(tmp_path, llamafactory_data, stories_model):
    item = prepare_local(SourceSpec(source=str(llamafactory_data / "c4_demo.jsonl")), "dataset", allow_pickle=False)
    assert (item.repo_id, item.path, [f.rel for f in item.files]) == (
        "local/c4_demo",
        "datasets/local/c4_demo",
        ["c4_demo.jsonl"],
    )
    folder = tmp_path / "model"
    shutil.copytree(stories_model, folder)
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\ncard\n")
    item = prepare_local(SourceSpec(source=str(folder)), "model", allow_pickle=False)
    assert ".git/HEAD" not in {f.rel for f in item.files} and item.license == "apache-2.0"
    with pytest.raises(SourceError, match="does not exist"):
        prepare_local(SourceSpec(source=str(tmp_path / "missing")), "model", allow_pickle=False)


def test_local_revision_depends_on_content_only():
    a = local_revision([("b", "2" * 64), ("a", "1" * 64)])
    assert a == local_revision([("a", "1" * 64), ("b", "2" * 64)]) and len(a) == 40
    assert a != local_revision([("a", "1" * 64), ("b", "3" * 64)])


def test_two_local_items_with_one_name_get_distinct_paths(tmp_path, stories_model):
    for sub in ("x", "y"):
        shutil.copytree(stories_model, tmp_path / sub / "stories")
    result = pack(
        load_spec(name="d", models=[str(tmp_path / "x" / "stories"), str(tmp_path / "y" / "stories")], no_wheels=True),
        tmp_path / "out",
        progress=False,
    )
    assert [i["path"] for i in result.manifest["items"]] == ["models/local/stories", "models/local/stories-2"]


def _modelscope_cache(root: Path, repo_id: str, revision: str, source: Path) -> Path:
    """The modelscope SDK's own cache layout: MODELSCOPE_CACHE/models/ORG--NAME/snapshots/REVISION/."""
    snap = root / "models" / repo_id.replace("/", "--") / "snapshots" / revision
    shutil.copytree(source, snap)
    return snap


def test_modelscope_source_from_the_sdk_cache_offline(tmp_path, monkeypatch, stories_model):
    cache = tmp_path / "ms-cache"
    _modelscope_cache(cache, "stories/stories260K", "master", stories_model)
    _modelscope_cache(cache, "stories/stories260K", "v1.0", stories_model)
    monkeypatch.setenv("MODELSCOPE_CACHE", str(cache))
    monkeypatch.setenv("MODELSCOPE_OFFLINE", "1")
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # any network use would fail
    spec = load_spec(name="ms", models=["ms:stories/stories260K", "ms:stories/stories260K@v1.0"], no_wheels=True)
    result = pack(spec, tmp_path / "out", progress=False)
    master, tagged = result.manifest["items"]
    assert (master["source"], master["repo_id"], master["revision"], master["path"]) == (
        "ms",
        "stories/stories260K",
        "master",
        "models/ms/stories/stories260K",
    )
    assert tagged["revision_requested"] == "v1.0" and tagged["path"] == "models/ms/stories/stories260K-2"
    assert {f["path"]: f["sha256"] for f in master["files"]} == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in stories_model.iterdir()
    }

    missing = load_spec(name="ms2", models=["ms:stories/stories260K@v9"], no_wheels=True)
    with pytest.raises(SourceError, match=r"ms:stories/stories260K@v9.*'v9' is not in the ModelScope cache"):
        pack(missing, tmp_path / "out", progress=False)
