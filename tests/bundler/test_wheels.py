"""Wheels: a real ``pip download`` for this host and for a foreign target, and the hash lock file."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bundler.pack import pack
from bundler.spec import TargetSpec, load_spec
from bundler.wheels import (
    canonical_name,
    default_constraints,
    ferry_requirements,
    lock_text,
    parse_wheel_filename,
    target_args,
)
from ferry.errors import SourceError


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock_entries(lock: Path) -> dict[str, tuple[str, list[str]]]:
    entries = {}
    for line in lock.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        pin, *hashes = line.split()
        name, version = pin.split("==")
        entries[name] = (version, [h.removeprefix("--hash=sha256:") for h in hashes])
    return entries


def test_pure_python_wheel_for_this_host_installs_from_the_lock(tmp_path, llamafactory_data):
    spec = load_spec(name="six", datasets=[str(llamafactory_data / "dataset_info.json")])
    spec.wheels.requirements = ["six==1.17.0"]
    result = pack(spec, tmp_path / "out", progress=False)
    wheels_dir = result.bundle_dir / "wheels"
    item = result.manifest["items"][-1]
    assert item["kind"] == "wheels" and item["path"] == "wheels"
    wheel = next(wheels_dir.glob("six-*.whl"))
    assert lock_entries(wheels_dir / "requirements.lock") == {"six": ("1.17.0", [sha256(wheel)])}
    assert {f["path"]: f["sha256"] for f in item["files"]}[wheel.name] == sha256(wheel)
    assert result.manifest["target"]["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"

    # exactly the isolated host's command: no index, hashes required
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels_dir),
                    "--require-hashes", "-r", str(wheels_dir / "requirements.lock"), "--target", str(target),
                    "--disable-pip-version-check"], check=True)
    assert (target / "six.py").is_file()


def test_binary_wheels_for_a_foreign_target(tmp_path, llamafactory_data):
    spec = load_spec(name="cross", datasets=[str(llamafactory_data / "dataset_info.json")], python_version="3.10",
                     platforms=["manylinux2014_x86_64"])
    spec.wheels.requirements = ["markupsafe==3.0.2", "pyyaml==6.0.2"]
    result = pack(spec, tmp_path / "out", progress=False)
    wheels_dir = result.bundle_dir / "wheels"
    wheels = sorted(wheels_dir.glob("*.whl"))
    assert [parse_wheel_filename(w.name) for w in wheels] == [("markupsafe", "3.0.2"), ("pyyaml", "6.0.2")]
    for wheel in wheels:  # binary wheels for CPython 3.10 on manylinux x86_64, not for this host
        tags = wheel.name[:-4].split("-")
        assert tags[2] == "cp310" and tags[3] == "cp310" and "manylinux" in tags[4] and "x86_64" in tags[4]
        with zipfile.ZipFile(wheel) as zf:
            assert any(n.endswith(".so") for n in zf.namelist())
    lock = lock_entries(wheels_dir / "requirements.lock")
    assert lock == {"markupsafe": ("3.0.2", [sha256(wheels[0])]), "pyyaml": ("6.0.2", [sha256(wheels[1])])}
    assert result.manifest["target"]["python"] == "3.10"
    assert result.manifest["target"]["platforms"] == ["manylinux2014_x86_64"]
    assert "--only-binary=:all:" in result.manifest["target"]["pip_args"]
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=result.bundle_dir, check=True)


def test_unresolvable_requirement_names_pip_failure(tmp_path):
    spec = load_spec(name="nope", python_version="3.10", platforms=["manylinux2014_x86_64"])
    spec.wheels.requirements = ["six==0.0.0.404"]
    with pytest.raises(SourceError, match=r"pip download failed.*six==0\.0\.0\.404"):
        pack(spec, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "nope").exists()


def test_target_args():
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert target_args(TargetSpec()) == []
    assert target_args(TargetSpec(python_version=host)) == []
    args = target_args(TargetSpec(python_version="3.10", platforms=["manylinux2014_x86_64", "linux_x86_64"]))
    assert args == ["--only-binary=:all:", "--python-version", "3.10", "--implementation", "cp",
                    "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64"]
    assert "--abi" in target_args(TargetSpec(abi="cp310"))


def test_ferry_default_set_is_runtime_requirements_without_extras():
    reqs = ferry_requirements()
    names = {canonical_name(r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip()) for r in reqs}
    assert {"torch", "transformers", "peft", "safetensors", "huggingface-hub", "click", "pydantic"} <= names
    assert not {"pytest", "olah", "matplotlib"} & names
    constraints = default_constraints()
    assert constraints is not None and "torch==2.13.0" in constraints.read_text()


def test_lock_text_merges_platform_twins_and_refuses_two_versions():
    meta = {"wheels": [Path("Foo_Bar-1.0-cp310-cp310-manylinux2014_x86_64.whl"),
                       Path("foo_bar-1.0-cp310-cp310-musllinux_1_2_x86_64.whl")]}
    text = lock_text(meta, {meta["wheels"][0].name: "a" * 64, meta["wheels"][1].name: "b" * 64})
    assert text.splitlines()[1] == f"foo-bar==1.0 --hash=sha256:{'a' * 64} --hash=sha256:{'b' * 64}"
    meta = {"wheels": [Path("foo-1.0-py3-none-any.whl"), Path("foo-2.0-py3-none-any.whl")]}
    with pytest.raises(SourceError, match="two versions of foo"):
        lock_text(meta, {"foo-1.0-py3-none-any.whl": "a" * 64, "foo-2.0-py3-none-any.whl": "b" * 64})


def test_ferry_builds_its_own_wheel(tmp_path):
    from bundler.wheels import build_ferry_wheel

    wheel = build_ferry_wheel(tmp_path)
    import ferry

    assert parse_wheel_filename(wheel.name) == ("llm-ferry", ferry.__version__)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {"ferry/cli.py", "bundler/pack.py", "bundler/format.py"} <= names
    assert any(n.endswith("entry_points.txt") for n in names)
