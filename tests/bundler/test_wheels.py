"""Wheels: a real uv resolution + pip download for this host and for a foreign target, the hash lock file,
and the mapping of pip / uv platform names (the target-specific installs are in test_wheels_target.py)."""

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
    pip_platforms,
    resolve_target,
    uv_platform,
)
from ferry.errors import ConfigError, SourceError


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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels_dir),
            "--require-hashes",
            "-r",
            str(wheels_dir / "requirements.lock"),
            "--target",
            str(target),
            "--disable-pip-version-check",
        ],
        check=True,
    )
    assert (target / "six.py").is_file()


def test_binary_wheels_for_a_foreign_target(tmp_path, llamafactory_data):
    spec = load_spec(
        name="cross",
        datasets=[str(llamafactory_data / "dataset_info.json")],
        python_version="3.10",
        platforms=["manylinux2014_x86_64"],
    )
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
    target = result.manifest["target"]
    assert target["python"] == "3.10" and target["platforms"] == ["manylinux_2_17_x86_64"]
    assert target["resolver_platform"] == "x86_64-manylinux_2_17" and target["torch"] == "pypi"
    assert target["indexes"] == {
        "index_url": "https://pypi.org/simple",
        "extra_index_urls": [],
        "find_links": [],
        "torch_index": None,
    }
    assert item_paths(result) >= {"requirements.lock", "pylock.toml"}
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=result.bundle_dir, check=True)


def item_paths(result) -> set[str]:
    return {f["path"] for f in result.manifest["items"][-1]["files"]}


def test_unresolvable_requirement_names_the_resolver_explanation(tmp_path):
    spec = load_spec(name="nope", python_version="3.10", platforms=["manylinux2014_x86_64"])
    spec.wheels.requirements = ["six==0.0.0.404"]
    with pytest.raises(
        SourceError,
        match=r"resolving wheels for CPython 3\.10 on manylinux_2_17_x86_64.*"
        r"six==0\.0\.0\.404",
    ) as info:
        pack(spec, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out" / "nope").exists()


@pytest.mark.parametrize(
    ("given", "uv", "tag", "env"),
    [
        (["manylinux_2_28_x86_64"], "x86_64-manylinux_2_28", "manylinux_2_28_x86_64", {}),
        (["manylinux_2_30_x86_64"], "x86_64-manylinux_2_28", "manylinux_2_30_x86_64", {}),  # newest uv knows <= 2.30
        (["manylinux2014_x86_64", "manylinux_2_28_x86_64"], "x86_64-manylinux_2_28", "manylinux_2_28_x86_64", {}),
        (["manylinux2014_aarch64"], "aarch64-manylinux_2_17", "manylinux_2_17_aarch64", {}),
        (["musllinux_1_2_x86_64"], "x86_64-unknown-linux-musl", "musllinux_1_2_x86_64", {}),
        (["macosx_12_0_arm64"], "aarch64-apple-darwin", "macosx_12_0_arm64", {"MACOSX_DEPLOYMENT_TARGET": "12.0"}),
        (["macosx_11_0_x86_64"], "x86_64-apple-darwin", "macosx_11_0_x86_64", {"MACOSX_DEPLOYMENT_TARGET": "11.0"}),
        (["win_amd64"], "x86_64-pc-windows-msvc", "win_amd64", {}),
        (["linux"], "x86_64-manylinux_2_28", "manylinux_2_28_x86_64", {}),  # uv's alias for x86_64-manylinux_2_28
        (["x86_64-manylinux_2_31"], "x86_64-manylinux_2_31", "manylinux_2_31_x86_64", {}),
        (["windows"], "x86_64-pc-windows-msvc", "win_amd64", {}),
        (["macos"], "aarch64-apple-darwin", "macosx_13_0_arm64", {"MACOSX_DEPLOYMENT_TARGET": "13.0"}),
    ],
)
def test_pip_and_uv_platform_names_map_onto_one_uv_target(given, uv, tag, env):
    assert uv_platform(given) == (uv, tag, env)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["linux_x86_64"], "names no glibc version"),
        (["manylinux1_x86_64"], "older than 2.17"),
        (["musllinux_1_1_x86_64"], "musllinux_1_2"),
        (["manylinux_2_28_ppc64le"], "x86_64 and aarch64 only"),
        (["manylinux_2_28_x86_64", "win_amd64"], "one bundle serves one platform"),
        (["solaris"], "not a pip platform tag"),
    ],
)
def test_platforms_uv_cannot_serve_are_refused_by_name(given, message):
    with pytest.raises(ConfigError, match=message):
        uv_platform(given)


def test_target_tags_follow_pip_order():
    assert pip_platforms("manylinux_2_28_x86_64")[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"]
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(
        pip_platforms("manylinux_2_28_x86_64")
    )
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert resolve_target(TargetSpec()).host and resolve_target(TargetSpec()).python == host
    foreign = resolve_target(TargetSpec(python_version="3.10", platforms=["manylinux_2_28_x86_64"], torch="cu128"))
    assert not foreign.host and foreign.abi == "cp310" and foreign.torch == "cu128"
    with pytest.raises(ConfigError, match="CPython"):
        resolve_target(TargetSpec(implementation="pp"))
    with pytest.raises(ConfigError, match="default ABI"):
        resolve_target(TargetSpec(python_version="3.10", abi="cp311"))


def test_ferry_default_set_is_runtime_requirements_without_extras():
    reqs = ferry_requirements()
    names = {canonical_name(r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip()) for r in reqs}
    assert {"torch", "transformers", "peft", "safetensors", "huggingface-hub", "click", "pydantic", "uv"} <= names
    assert not {"pytest", "olah", "matplotlib"} & names
    constraints = default_constraints()
    assert constraints is not None and "torch==2.13.0" in constraints.read_text()


def test_lock_text_merges_platform_twins_and_refuses_two_versions():
    meta = {
        "wheels": [
            Path("Foo_Bar-1.0-cp310-cp310-manylinux2014_x86_64.whl"),
            Path("foo_bar-1.0-cp310-cp310-musllinux_1_2_x86_64.whl"),
        ]
    }
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
    assert {
        "ferry/cli/__init__.py",
        "ferry/cli/demo_data/ferry_demo.json",
        "trainer/templates/catalog.py",
        "bundler/pack.py",
        "bundler/format.py",
    } <= names
    assert any(n.endswith("entry_points.txt") for n in names)


@pytest.mark.slow
def test_an_sdist_only_package_is_built_into_a_wheel_for_this_host(tmp_path):
    spec = load_spec(name="sdist")
    spec.wheels.requirements = ["antlr4-python3-runtime==4.9.3"]  # published as an sdist only
    result = pack(spec, tmp_path / "out", progress=False)
    assert item_paths(result) == {"antlr4_python3_runtime-4.9.3-py3-none-any.whl", "requirements.lock", "pylock.toml"}
    assert result.manifest["target"]["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_index_credentials_are_not_recorded():
    from bundler.wheels import redact_url, target_record

    assert redact_url("https://user:s3cret@mirror.example/simple") == "https://***@mirror.example/simple"
    assert redact_url("https://pypi.org/simple") == "https://pypi.org/simple"
    record = target_record(
        resolve_target(TargetSpec()),
        {
            "index_url": "https://t0ken@m.example/simple",
            "extra_index_urls": ["https://a:b@x.example/s"],
            "find_links": [],
            "torch_index": None,
        },
    )
    assert "t0ken" not in str(record) and "a:b" not in str(record)
