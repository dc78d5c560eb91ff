"""Wheels for another host: resolved on this host (Python 3.11) FOR a 3.10 / 3.12 / 3.13 target with real
PyPI, then installed by the bundle's own install.py, run by that Python under ``unshare -rn`` (no network).

Also: ``--dry-run`` of ferry's full default set for a GPU target (torch + nvidia wheels, nothing downloaded),
targets the wheels cannot serve failing at pack time with the package named, this host's pip/uv settings
never leaking in, an explicit ``--find-links`` folder (this machine's local CPU torch wheel), and
``install.py`` refusing an interpreter or platform that is not the bundle's target.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.utils import parse_wheel_filename as parse_wheel

from bundler.installer.venv import check_target
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.wheels import host_pip_config, resolve, target_tags
from ferry.errors import BundleError, ConfigError, SourceError
from tests.support.netns import run_offline

PYENV = Path("/root/.pyenv/versions")
#: Marker-gated and binary wheels: exceptiongroup only below 3.11, tomli always, PyYAML and MarkupSafe binary.
MARKED = ['exceptiongroup>=1.0.2; python_version < "3.11"', "tomli>=2", "PyYAML>=6", "MarkupSafe>=2.1"]
PLATFORM = "manylinux_2_28_x86_64"


def pyenv_python(version: str) -> Path | None:
    """pyenv's interpreter for ``X.Y`` (the newest patch release installed), or None."""
    found = sorted(PYENV.glob(f"{version}.*/bin/python{version}"))
    return found[-1] if found else None


def lock_names(bundle: Path) -> dict[str, str]:
    lines = (bundle / "wheels" / "requirements.lock").read_text().splitlines()
    return dict(line.split()[0].split("==") for line in lines if line and not line.startswith("#"))


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
@pytest.mark.budget(
    75,
    reason="pip resolves and downloads the set for the target Python from the package index, then it installs offline",
)
def test_marker_gated_set_packed_here_installs_on_the_target_python_offline(version, tmp_path):
    python = pyenv_python(version)
    if python is None:
        pytest.skip(f"no Python {version} interpreter under {PYENV} (checked where one exists)")
    spec = load_spec(name=f"py{version.replace('.', '')}", python_version=version, platforms=[PLATFORM])
    spec.wheels.requirements = list(MARKED)
    result = pack(spec, tmp_path / "out", progress=False)
    bundle = result.bundle_dir
    names = lock_names(bundle)
    # markers evaluated for the target, not for this 3.11 host
    assert ("exceptiongroup" in names) == (version == "3.10")
    assert {"tomli", "pyyaml", "markupsafe"} <= set(names)
    if version == "3.10":
        assert "typing-extensions" in names  # exceptiongroup's own dependency below 3.13
    abi = f"cp{version.replace('.', '')}"
    for wheel in (bundle / "wheels").glob("*.whl"):
        tags = {str(t) for t in parse_wheel(wheel.name)[3]}
        assert any(t.split("-")[2] == "any" or t.split("-")[0] in (abi, "py3", "py2.py3") or abi in t for t in tags), (
            wheel.name
        )
    binary = [w for w in (bundle / "wheels").glob("*.whl") if w.name.startswith(("pyyaml", "markupsafe"))]
    assert len(binary) == 2 and all(f"-{abi}-" in w.name and "manylinux" in w.name for w in binary)
    target = result.manifest["target"]
    assert target["python"] == version and target["platforms"] == [PLATFORM] and target["torch"] == "pypi"

    prefix = tmp_path / "prefix"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = run_offline([str(python), "install.py", "--prefix", str(prefix)], env=bare, cwd=bundle)
    assert "OK:" in proc.stdout
    venv_python = prefix / "venv" / "bin" / "python"
    check = run_offline(
        [
            str(venv_python),
            "-c",
            "import sys, tomli, yaml, markupsafe; "
            "mods = ['tomli', 'yaml', 'markupsafe'] + (['exceptiongroup'] if sys.version_info < (3, 11) "
            "else []); [__import__(m) for m in mods]; "
            "print(sys.version_info[:2], yaml.__with_libyaml__, mods)",
        ],
        env=bare,
        cwd=tmp_path,
    )
    assert check.stdout.startswith(f"({version.replace('.', ', ')})")
    assert "True" in check.stdout  # PyYAML's C extension (the binary wheel for the target) loads

    if version != f"{sys.version_info.major}.{sys.version_info.minor}":
        # this host's python refuses before installing anything, and names the bundle's target
        wrong = run_offline(
            ["/usr/bin/python3", "install.py", "--prefix", str(tmp_path / "p2")], env=bare, cwd=bundle, check=False
        )
        assert wrong.returncode != 0
        assert f"target Python {version}" in wrong.stderr and f"python{version}" in wrong.stderr
        assert not (tmp_path / "p2" / "venv").exists()


def test_dry_run_of_ferrys_default_set_for_a_gpu_target_lists_torch_and_nvidia_wheels():
    spec = load_spec(name="gpu", python_version="3.10", platforms=[PLATFORM], torch="pypi")
    resolution = resolve(spec)
    names = {f.name: f for f in resolution.files}
    assert {"torch", "transformers", "peft", "safetensors", "huggingface-hub", "uv"} <= set(names)
    assert "exceptiongroup" in names or "tomli" in names  # 3.10-only dependencies are in the set
    nvidia = [f for f in resolution.files if f.name.startswith("nvidia-")]
    assert len(nvidia) >= 5
    assert resolution.torch_version is not None and "+" not in resolution.torch_version  # PyPI's build
    tags = {str(t) for t in target_tags(resolution.target)}
    for f in resolution.files:  # every file is a wheel for this target, with a size and a hash
        assert f.filename.endswith(".whl") and not f.sdist
        assert {str(t) for t in parse_wheel(f.filename)[3]} & tags, f.filename
        assert f.size and f.size > 0 and len(f.sha256) == 64 and f.url.startswith("https://")
    assert resolution.total_bytes > 1024**3  # torch + CUDA libraries: gigabytes
    # the torch wheel is really there, with the size the index stated
    request = urllib.request.Request(names["torch"].url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert int(response.headers["Content-Length"]) == names["torch"].size
    summary = resolution.summary()
    assert f"torch {resolution.torch_version} and {len(nvidia)} nvidia wheels" in summary
    assert "plus llm-ferry's own wheel" in summary


def test_cli_dry_run_prints_the_list_and_downloads_nothing(tmp_path, monkeypatch):
    from ferry.cli import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli,
        [
            "pack",
            "--dry-run",
            "--name",
            "d",
            "--python-version",
            "3.12",
            "--platform",
            "x86_64-manylinux_2_28",
            "--torch",
            "pypi",
            "--requirements",
            str(_req(tmp_path, ["PyYAML==6.0.3"])),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "pyyaml-6.0.3-cp312-cp312-manylinux" in result.output
    assert "total     1 files, " in result.output and "KiB" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requirements.txt"]  # nothing downloaded or written


def _req(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _c_extension_sdist(folder: Path) -> Path:
    """A source-only project ``cspeedup`` 0.1 with a C extension, as ``python -m build --sdist`` lays it out."""
    import tarfile

    src = folder / "src" / "cspeedup-0.1"
    src.mkdir(parents=True)
    (src / "setup.py").write_text(
        "from setuptools import Extension, setup\n"
        "setup(name='cspeedup', version='0.1', ext_modules=[Extension('cspeedup', ['cspeedup.c'])])\n"
    )
    (src / "cspeedup.c").write_text(
        '#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "cspeedup", 0, -1, 0};\n'
        "PyMODINIT_FUNC PyInit_cspeedup(void) { return PyModule_Create(&m); }\n"
    )
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: cspeedup\nVersion: 0.1\n")
    links = folder / "links"
    links.mkdir()
    with tarfile.open(links / "cspeedup-0.1.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="cspeedup-0.1")
    return links


@pytest.mark.budget(
    75, reason="pip downloads sdists from the package index and builds them into wheels in isolated environments"
)
def test_a_source_only_project_is_built_here_and_carried_only_when_pure_python(tmp_path):
    spec = load_spec(name="fromsource", python_version="3.10", platforms=[PLATFORM])
    spec.wheels.requirements = ["antlr4-python3-runtime==4.9.3"]  # published as an sdist only, pure Python
    result = pack(spec, tmp_path / "out", progress=False)
    (wheel,) = (result.bundle_dir / "wheels").glob("antlr4*.whl")
    assert wheel.name == "antlr4_python3_runtime-4.9.3-py3-none-any.whl"
    from ferry.fsutil import sha256_file

    lock = (result.bundle_dir / "wheels" / "requirements.lock").read_text()
    assert f"antlr4-python3-runtime==4.9.3 --hash=sha256:{sha256_file(wheel)}" in lock
    # a source-only project that compiles C builds a wheel for this host alone: refused, named, nothing written
    spec = load_spec(
        name="cext", python_version="3.10", platforms=[PLATFORM], find_links=[_c_extension_sdist(tmp_path)]
    )
    spec.wheels.requirements = ["cspeedup==0.1"]
    with pytest.raises(
        SourceError,
        match=r"cspeedup 0\.1 is published as source only \(cspeedup-0\.1\.tar\.gz\) "
        r"and builds a platform wheel here \(cp311-cp311-linux_x86_64\), not one for CPython 3\.10",
    ):
        pack(spec, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2" / "cext").exists()
    spec = load_spec(name="musl", python_version="3.10", platforms=["musllinux_1_2_x86_64"])
    spec.wheels.requirements = ["torch==2.13.0"]  # no musl build of torch exists
    with pytest.raises(SourceError, match=r"torch==2\.13\.0 has no wheels with a matching platform tag"):
        resolve(spec)


def test_host_pip_and_uv_settings_do_not_leak_into_the_resolution(tmp_path, monkeypatch):
    pins = tmp_path / "pins.txt"
    pins.write_text("six==1.16.0\n")
    for key in ("PIP_INDEX_URL", "UV_INDEX_URL", "UV_DEFAULT_INDEX"):
        monkeypatch.setenv(key, "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONSTRAINT", str(pins))
    monkeypatch.setenv("UV_CONSTRAINT", str(pins))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    spec = load_spec(name="leak", python_version="3.12", platforms=[PLATFORM])
    spec.wheels.requirements = ["six"]
    resolution = resolve(spec)
    six = next(f for f in resolution.files if f.name == "six")
    assert six.version != "1.16.0" and six.url.startswith("https://files.pythonhosted.org/")
    assert resolution.indexes["index_url"] == "https://pypi.org/simple" and resolution.indexes["find_links"] == []


def _local_wheel(folder: Path, name: str, version: str) -> Path:
    """Write a minimal pure-Python wheel (PEP 427) that exists on no index."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{name.replace('-', '_')}.py": "VALUE = 42\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ferry-test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{p},,\n" for p in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for p, text in files.items():
            zf.writestr(p, text)
        zf.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def test_explicit_find_links_folder_is_used_and_recorded(tmp_path):
    house = tmp_path / "wheelhouse"
    _local_wheel(house, "ferry-local-only", "1.0")
    spec = load_spec(name="fl", python_version="3.10", platforms=[PLATFORM], find_links=[str(house)])
    spec.wheels.requirements = ["ferry-local-only==1.0", "tomli"]
    result = pack(spec, tmp_path / "out", progress=False)
    assert lock_names(result.bundle_dir) == {"ferry-local-only": "1.0", "tomli": lock_names(result.bundle_dir)["tomli"]}
    assert result.manifest["target"]["indexes"]["find_links"] == [str(house)]
    pylock = (result.bundle_dir / "wheels" / "pylock.toml").read_text()
    assert house.as_uri() in pylock or str(house) in pylock
    # without the folder the same set does not resolve: nothing of it came from elsewhere
    spec.wheels.find_links = []
    with pytest.raises(SourceError, match="ferry-local-only"):
        resolve(spec)


def test_this_machines_local_cpu_torch_wheel_is_taken_only_when_passed_explicitly(monkeypatch):
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    links = [p for p in host_pip_config().get("find-links", "").split() if list(Path(p).glob("torch-*.whl"))]
    if not links:
        pytest.skip("this machine's pip configuration names no folder with a local torch wheel")
    spec = load_spec(name="host", find_links=links)
    resolution = resolve(spec)  # ferry's default set for this host, torch from the folder named above
    assert resolution.torch_version is not None and resolution.torch_version.endswith("+cpu")
    torch = next(f for f in resolution.files if f.name == "torch")
    assert torch.url.startswith("file://") and torch.size == Path(torch.url[7:]).stat().st_size
    assert not [f for f in resolution.files if f.name.startswith("nvidia-")]


def test_torch_build_takes_torch_from_the_pytorch_index(monkeypatch):
    """--torch cpu sends torch to https://download.pytorch.org/whl/cpu (unreachable from this sandbox, so the
    resolution fails, and the message names the index it tried)."""
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    spec = load_spec(name="cpu", python_version="3.12", platforms=[PLATFORM], torch="cpu")
    spec.wheels.requirements = ["torch==2.13.0"]
    try:
        resolution = resolve(spec)
    except SourceError as exc:
        assert "download.pytorch.org/whl/cpu" in str(exc)
    else:  # where the PyTorch index is reachable: the CPU build, no nvidia wheels
        assert resolution.torch_version == "2.13.0+cpu"
        assert resolution.indexes["torch_index"] == "https://download.pytorch.org/whl/cpu"


def test_spec_file_names_the_target_once(tmp_path):
    path = tmp_path / "kit.yaml"
    path.write_text(
        "name: kit\nwheels: {requirements: [six], find_links: [wheelhouse]}\n"
        "target:\n  python_version: '3.10'\n  platform: manylinux_2_28_x86_64\n  torch: cu128\n"
    )
    (tmp_path / "wheelhouse").mkdir()
    spec = load_spec(path)
    assert spec.target.platforms == [PLATFORM] and spec.target.torch == "cu128"
    assert spec.wheels.find_links == [str(tmp_path / "wheelhouse")]
    path.write_text("name: kit\ntarget: {python_version: 3.10}\n")
    with pytest.raises(ConfigError, match=r"target\.python_version: .*string"):
        load_spec(path)
    path.write_text("name: kit\ntarget: {torch: cuda}\n")
    with pytest.raises(ConfigError, match=r"target\.torch: .*pypi, cpu"):
        load_spec(path)


def test_check_target_names_the_bundles_target():
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    import sysconfig

    machine = sysconfig.get_platform().split("-")[-1]
    check_target({"target": {"python": here, "platforms": [f"manylinux2014_{machine}"], "implementation": "cp"}})
    check_target({"target": {"python": here, "platforms": [f"linux_{machine}"]}})  # older manifests
    check_target({})
    cases = [
        ({"python": "3.9", "platforms": [f"manylinux2014_{machine}"], "torch": "cu128"}, "target Python 3.9, torch"),
        ({"python": here, "platforms": [f"manylinux_2_99_{machine}"]}, "platform manylinux_2_99"),
        ({"python": here, "platforms": ["macosx_12_0_arm64"]}, "platform macosx_12_0_arm64"),
        ({"python": here, "platforms": ["win_amd64"]}, "platform win_amd64"),
        ({"python": here, "implementation": "pp"}, "implementation pp"),
    ]
    for target, message in cases:
        with pytest.raises(BundleError, match=message) as info:
            check_target({"target": target})
        assert "--platform manylinux_" in str(info.value) and "\n" not in str(info.value)


def test_manifest_records_the_target_and_indexes(tmp_path):
    spec = load_spec(name="rec", python_version="3.12", platforms=["manylinux2014_x86_64"])
    spec.wheels.requirements = ["six==1.17.0"]
    result = pack(spec, tmp_path / "out", progress=False)
    manifest = json.loads((result.bundle_dir / "manifest.json").read_text())
    assert manifest["target"] == {
        "python": "3.12",
        "platforms": ["manylinux_2_17_x86_64"],
        "implementation": "cp",
        "abi": "cp312",
        "torch": "pypi",
        "resolver_platform": "x86_64-manylinux_2_17",
        "torch_version": None,
        "indexes": {
            "index_url": "https://pypi.org/simple",
            "extra_index_urls": [],
            "find_links": [],
            "torch_index": None,
        },
    }
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=result.bundle_dir, check=True)


def test_project_constraints_pin_only_ferrys_default_set():
    """constraints.txt pins torch for ferry's own set; a set of your own is resolved with your pins only."""
    spec = load_spec(name="own", python_version="3.12", platforms=[PLATFORM])
    spec.wheels.requirements = ["torch==2.12.0"]
    assert resolve(spec).torch_version == "2.12.0"
    default = resolve(load_spec(name="default", python_version="3.12", platforms=[PLATFORM]))
    assert default.torch_version == "2.13.0" and default.constraints is not None
    assert "torch==2.13.0" in default.constraints


def test_an_unservable_target_fails_before_any_model_is_downloaded(tmp_path, hub_env):
    from tests.support.helpers import STORIES_REPO

    spec = load_spec(
        name="early", models=[f"hf:{STORIES_REPO}"], python_version="3.10", platforms=["musllinux_1_2_x86_64"]
    )
    spec.wheels.requirements = ["torch==2.13.0"]  # no musl build of torch exists
    with pytest.raises(SourceError, match=r"torch==2\.13\.0 has no wheels with a matching platform tag"):
        pack(spec, tmp_path / "out", progress=False)
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


def test_extra_liger_adds_liger_kernel_for_a_cuda_target(tmp_path, monkeypatch):
    """`ferry pack --extra liger` puts liger-kernel (and what it needs, Triton) into a CUDA target's wheel set."""
    from ferry.cli import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli,
        [
            "pack",
            "--dry-run",
            "--name",
            "d",
            "--python-version",
            "3.12",
            "--platform",
            "x86_64-manylinux_2_28",
            "--torch",
            "pypi",
            "--extra",
            "liger",
            "--requirements",
            str(_req(tmp_path, ["PyYAML==6.0.3"])),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "liger_kernel-" in result.output and "triton-" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requirements.txt"]
