"""Hand-edited, hostile manifests: every field that reaches a path is refused by ``ferry verify``,
``ferry install`` and a bare ``python3 install.py`` alike, with the field named, and neither the prefix nor
anything outside it changes (byte-for-byte snapshots before and after).

The bundle is the real ``bundler.pack`` output of the real stories260K model and alpaca demo file; each case
edits manifest.json as an attacker would and recomputes its SHA256SUMS line, so only the validation can
catch it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import ferry.cli
from bundler.install import install
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify
from ferry.errors import BundleError, UnsafeArchiveError
from tests.support.helpers import resign

NAME = "hostile"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> Path:
    """``OUT/hostile/``: a genuine bundle (items[0] the local stories260K model, items[1] alpaca_en_demo)."""
    out = tmp_path_factory.mktemp("genuine")
    pack(
        load_spec(
            name=NAME,
            models=[str(stories_model)],
            datasets=[str(llamafactory_data / "alpaca_en_demo.json")],
            no_wheels=True,
        ),
        out,
        progress=False,
    )
    return out / NAME


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: type, mode, link target or sha256 of the bytes."""
    state: dict[str, tuple] = {}
    if not root.exists():
        return state
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        st = path.lstat()
        if path.is_symlink():
            state[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            state[rel] = ("dir", st.st_mode)
        else:
            state[rel] = ("file", st.st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return state


@pytest.fixture()
def arena(tmp_path: Path, genuine: Path) -> dict[str, Path]:
    """A sentinel folder outside the prefix (files, a sub-folder, a copy of the models and datasets layout an
    attacker would aim at) and a prefix holding a genuine install of the bundle."""
    sentinel = tmp_path / "sentinel"
    (sentinel / "sub" / "deeper").mkdir(parents=True)
    (sentinel / "keep.txt").write_text("do not touch\n")
    (sentinel / "sub" / "deeper" / "data.bin").write_bytes(os.urandom(256))
    (sentinel / "snapshots").mkdir()
    prefix = tmp_path / "prefix"
    install(genuine, prefix, create_venv=False)
    return {"sentinel": sentinel, "prefix": prefix, "tmp": tmp_path}


Mutation = Callable[[dict, Path], None]


def _set(path: str, value: object) -> Mutation:
    """A mutation setting ``manifest[path...]`` (dotted, list indices as numbers); ``{S}`` in a string value is
    replaced by the sentinel's absolute path."""

    def mutate(manifest: dict, sentinel: Path) -> None:
        keys = path.split(".")
        target: object = manifest
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]  # type: ignore[index]
        v = value.replace("{S}", str(sentinel)) if isinstance(value, str) else value
        last = keys[-1]
        if isinstance(target, list):
            target[int(last)] = v
        else:
            target[last] = v  # type: ignore[index]

    return mutate


def _as_hf(field: str, value: str) -> Mutation:
    """Make items[0] a hub model (source hf) and set one of its fields."""

    def mutate(manifest: dict, sentinel: Path) -> None:
        item = manifest["items"][0]
        item.update(source="hf", repo_id="org/model", spec="hf:org/model")
        item[field] = value.replace("{S}", str(sentinel))

    return mutate


def _duplicate_file(manifest: dict, sentinel: Path) -> None:
    files = manifest["items"][0]["files"]
    files.append({**files[0], "sha256": "0" * 64})


def _file_and_folder(manifest: dict, sentinel: Path) -> None:
    files = manifest["items"][0]["files"]
    files.append({"path": f"{files[0]['path']}/inner", "size": 1, "sha256": "0" * 64})


def _nested_items(manifest: dict, sentinel: Path) -> None:
    manifest["items"][1]["path"] = manifest["items"][0]["path"] + "/data"
    manifest["items"][1]["kind"] = "model"


#: (case id, mutation, the field the refusal must name)
CASES: list[tuple[str, Mutation, str]] = [
    # the reported attacks
    ("repo_id-absolute-via-double-slash", _set("items.0.repo_id", "evil/{S}"), "items[0].repo_id"),
    ("repo_id-evil//abs", _set("items.0.repo_id", "evil//{S}"), "items[0].repo_id"),
    ("hf-revision-outside-dir", _as_hf("revision", "../../../../../../../..{S}"), "items[0].revision"),
    ("hf-revision-absolute", _as_hf("revision", "{S}"), "items[0].revision"),
    ("bundle_id-outside-dir", _set("bundle_id", "../../{S}"), "bundle_id"),
    ("bundle_id-absolute", _set("bundle_id", "{S}"), "bundle_id"),
    ("dataset-repo_id-org/", _set("items.1.repo_id", "org/"), "items[1].repo_id"),
    # variants of every path-bearing field
    ("repo_id-dotdot", _set("items.0.repo_id", "local/../../x"), "items[0].repo_id"),
    ("repo_id-dotdot-name", _set("items.0.repo_id", "local/.."), "items[0].repo_id"),
    ("repo_id-three-parts", _set("items.0.repo_id", "local/a/b"), "items[0].repo_id"),
    ("repo_id-newline", _set("items.0.repo_id", "local/a\nb"), "items[0].repo_id"),
    ("repo_id-nul", _set("items.0.repo_id", "local/a\x00b"), "items[0].repo_id"),
    ("repo_id-double-dash", _set("items.0.repo_id", "local/a--b"), "items[0].repo_id"),
    ("dataset-repo_id-dotdot", _set("items.1.repo_id", "../datasets"), "items[1].repo_id"),
    ("revision-dotdot", _as_hf("revision", "refs/../../x"), "items[0].revision"),
    ("revision-double-slash", _as_hf("revision", "a//b"), "items[0].revision"),
    ("revision-newline", _as_hf("revision", "main\n"), "items[0].revision"),
    ("revision-nul", _as_hf("revision", "ma\x00in"), "items[0].revision"),
    ("revision-not-a-commit", _as_hf("revision", "main"), "items[0].revision"),
    ("revision_requested-dotdot", _as_hf("revision_requested", "../../../x"), "items[0].revision_requested"),
    ("revision_requested-absolute", _as_hf("revision_requested", "{S}/x"), "items[0].revision_requested"),
    ("revision_requested-newline", _as_hf("revision_requested", "v1\nx"), "items[0].revision_requested"),
    ("local-revision-path", _set("items.0.revision", "../../x"), "items[0].revision"),
    ("name-dotdot", _set("name", "../x"), "name"),
    ("name-absolute", _set("name", "{S}"), "name"),
    ("name-newline", _set("name", "a\nb"), "name"),
    ("item-path-dotdot", _set("items.0.path", "models/../../x"), "items[0].path"),
    ("item-path-absolute", _set("items.0.path", "{S}"), "items[0].path"),
    ("item-path-double-slash", _set("items.0.path", "models//local/x"), "items[0].path"),
    ("item-path-newline", _set("items.0.path", "models/local/x\n"), "items[0].path"),
    ("item-path-nul", _set("items.0.path", "models/local/\x00"), "items[0].path"),
    ("item-path-wrong-kind", _set("items.0.path", "wheels/x"), "items[0].path"),
    ("file-dotdot", _set("items.0.files.0.path", "../../../x"), "items[0].files[0].path"),
    ("file-absolute", _set("items.0.files.0.path", "{S}/keep.txt"), "items[0].files[0].path"),
    ("file-double-slash", _set("items.0.files.0.path", "a//b"), "items[0].files[0].path"),
    ("file-newline", _set("items.0.files.0.path", "a\nb"), "items[0].files[0].path"),
    ("file-nul", _set("items.0.files.0.path", "a\x00b"), "items[0].files[0].path"),
    ("file-backslash", _set("items.0.files.0.path", "a\\..\\b"), "items[0].files[0].path"),
    ("file-not-utf8", _set("items.0.files.0.path", "a\udc80b"), "items[0].files[0].path"),
    ("dataset-file-dotdot", _set("items.1.files.0.path", "../../../../x.json"), "items[1].files[0].path"),
    ("support-file-dotdot", _set("support_files.0.path", "../install.py"), "support_files[0].path"),
    ("kind-unknown", _set("items.0.kind", "script"), "items[0]"),
    ("source-unknown", _set("items.0.source", "http"), "items[0]"),
    ("file-listed-twice", _duplicate_file, "listed twice"),
    ("file-is-also-a-folder", _file_and_folder, "also a folder"),
    ("item-inside-another", _nested_items, "overlap"),
]


@pytest.mark.parametrize("case,mutate,field", CASES, ids=[c[0] for c in CASES])
def test_hostile_manifest_is_refused_everywhere(
    case: str, mutate: Mutation, field: str, genuine: Path, arena: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    bundle = arena["tmp"] / NAME
    shutil.copytree(genuine, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    mutate(manifest, arena["sentinel"])
    resign(bundle, manifest)
    sentinel_before, prefix_before = snapshot(arena["sentinel"]), snapshot(arena["prefix"])

    # ferry verify, the library and the CLI
    with pytest.raises(UnsafeArchiveError) as info:
        verify(bundle)
    assert field in str(info.value), info.value
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        ferry.cli.main(["verify", "-q", str(bundle)])
    err = capsys.readouterr().err
    assert exit_info.value.code == UnsafeArchiveError.exit_code
    assert err.startswith("ferry: error: ") and field in err and "Traceback" not in err

    # ferry install
    with pytest.raises(UnsafeArchiveError) as info:
        install(bundle, arena["prefix"], create_venv=False)
    assert field in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        ferry.cli.main(["install", "-q", str(bundle), "--prefix", str(arena["prefix"]), "--no-venv"])
    assert exit_info.value.code == UnsafeArchiveError.exit_code
    assert field in capsys.readouterr().err

    # the bundle's own install.py with a bare python3 (standard library only)
    for extra in (["--verify-only"], ["--prefix", str(arena["prefix"]), "--no-venv"]):
        proc = subprocess.run(
            ["/usr/bin/python3", "-I", str(bundle / "install.py"), *extra],
            capture_output=True,
            text=True,
            cwd=arena["tmp"],
        )
        assert proc.returncode == UnsafeArchiveError.exit_code, (extra, proc.stdout, proc.stderr)
        last = proc.stderr.strip().splitlines()[-1]  # after the progress lines
        assert last.startswith("install.py: error: ") and field in last
        assert "Traceback" not in proc.stderr

    assert snapshot(arena["sentinel"]) == sentinel_before
    assert snapshot(arena["prefix"]) == prefix_before


@pytest.mark.parametrize("link", ["datasets", "hf-home", "hf-home/hub/models--local--stories260K/snapshots"])
def test_symlink_in_the_prefix_pointing_outside_is_refused(link: str, genuine: Path, tmp_path: Path) -> None:
    """A folder of the prefix that is a symbolic link to somewhere else (planted, or a stale mount) is resolved
    before anything is written: the install is refused and the link's target is not written to."""
    sentinel = tmp_path / "sentinel"
    prefix = tmp_path / "prefix"
    if "/" in link:  # a genuine install first, then the snapshot folder is swapped for a link
        install(genuine, prefix, create_venv=False)
        shutil.rmtree(prefix / link)
        shutil.copytree(genuine / "models", sentinel)
    else:
        sentinel.mkdir()
        (sentinel / "keep.txt").write_text("x")
        prefix.mkdir()
    os.symlink(sentinel, prefix / link)
    before_sentinel, before_prefix = snapshot(sentinel), snapshot(prefix)
    with pytest.raises(UnsafeArchiveError, match="outside the prefix"):
        install(genuine, prefix, create_venv=False)
    assert snapshot(sentinel) == before_sentinel
    assert snapshot(prefix) == before_prefix


def test_forged_bundle_reusing_a_genuine_id_is_refused(genuine: Path, tmp_path: Path) -> None:
    """One weight changed, manifest.json and SHA256SUMS recomputed: it verifies (no signature asked for), but
    installing it over the genuine bundle is refused, never "already installed; nothing changed"."""
    prefix = tmp_path / "prefix"
    install(genuine, prefix, create_venv=False)
    forged = tmp_path / NAME
    shutil.copytree(genuine, forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    item = manifest["items"][0]
    entry = next(e for e in item["files"] if e["path"].endswith(".safetensors") or e["path"].endswith(".bin"))
    weights = forged / item["path"] / entry["path"]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    sums = (
        (forged / "SHA256SUMS")
        .read_text()
        .replace(hashlib.sha256((genuine / item["path"] / entry["path"]).read_bytes()).hexdigest(), entry["sha256"])
    )
    (forged / "SHA256SUMS").write_text(sums)
    resign(forged, manifest)
    verify(forged)  # integrity alone cannot tell: that is what signatures are for
    before = snapshot(prefix)
    with pytest.raises(BundleError, match="already installed with different content"):
        install(forged, prefix, create_venv=False)
    assert snapshot(prefix) == before
