"""An install killed at each of its write phases (``FERRY_TEST_KILL_AT``, :mod:`ferry.faults`) loses nothing.

The install replaces what an earlier one placed: a dataset folder and its ``dataset_info.json`` entry (with
``--replace-datasets``) and a local model's ``refs/main`` (a new revision of the same folder name). After each
kill, ``verify --prefix`` either passes or names the interrupted install first; the next command that reads the
prefix (:func:`bundler.recover_interrupted_install`) leaves either the earlier install whole (a kill before the
install record was written) or the new one (after); ``verify --prefix`` then passes, and installing the bundle
again completes it. The new content comes both as a full bundle and as a delta bundle against the old one (whose
install rebuilds its files from what the old install placed). Bundles come from the real ``bundler.pack``
(stories260K, LLaMA-Factory's demo data).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bundler import recover_interrupted_install
from bundler.install import install
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify_prefix
from ferry.errors import IntegrityError
from ferry.faults import KILL_AT_ENV
from tests.support.helpers import ROOT

#: Every kill point the replacing install reaches, in the order it reaches them; the last two come after the install
#: record is written, so the new install stands.
POINTS = [
    "install:staged",
    "install:placed#1",
    "install:ref",
    "install:swap-aside",
    "install:swap-in",
    "install:dataset-info",
    "install:placed#2",
    "install:state",
    "install:commit",
]
COMPLETE = {"install:state", "install:commit"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> dict:
    """``old``: stories260K and alpaca_en_demo.json; ``new``: the same names with other content (one config key
    more, five rows)."""
    out = tmp_path_factory.mktemp("bundles")
    model = out / "src" / "stories260K"
    shutil.copytree(stories_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "ferry_test_variant": 2}, indent=2))
    rows = out / "src" / "alpaca_en_demo.json"
    rows.write_text(json.dumps(json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())[:5]))
    for name, models, datasets in (
        ("old", [str(stories_model)], [str(llamafactory_data / "alpaca_en_demo.json")]),
        ("new", [str(model)], [str(rows)]),
    ):
        pack(load_spec(name=name, models=models, datasets=datasets, no_wheels=True), out, progress=False)
    # the same new content as a delta bundle against the old one: it carries the changed config and rows only
    spec = load_spec(name="new", models=[str(model)], datasets=[str(rows)], no_wheels=True)
    delta = pack(spec, out / "delta", progress=False, base=out / "old" / "manifest.json").manifest
    carried = {f["path"]: f["delta"] for i in delta["items"] if i["kind"] == "model" for f in i["files"]}
    assert carried["model.safetensors"] == "from_base" and carried["config.json"] != "from_base", carried
    return {"old": out / "old.ferry.tar", "new": out / "new.ferry.tar", "delta": out / "delta" / "new.ferry.tar"}


def _snapshot(prefix: Path) -> dict:
    """What a reader of the prefix sees: the dataset's bytes, dataset_info.json, the model's refs/main."""
    dataset = prefix / "datasets" / "alpaca_en_demo"
    ref = prefix / "hf-home" / "hub" / "models--local--stories260K" / "refs" / "main"
    return {
        "dataset": {p.name: p.read_bytes() for p in sorted(dataset.iterdir())} if dataset.is_dir() else None,
        "info": (prefix / "datasets" / "dataset_info.json").read_text(),
        "ref": ref.read_text(),
    }


@pytest.fixture(scope="module")
def states(bundles: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The prefix as the old install leaves it, and as the new one over it leaves it (uninterrupted)."""
    prefix = tmp_path_factory.mktemp("reference") / "prefix"
    install(bundles["old"], prefix, create_venv=False)
    old = _snapshot(prefix)
    install(bundles["new"], prefix, create_venv=False, replace_datasets=True)
    return {"old": old, "new": _snapshot(prefix)}


@pytest.mark.parametrize("bundle", ["new", "delta"])
@pytest.mark.parametrize("point", POINTS)
def test_an_install_killed_at_each_phase_loses_nothing(
    bundles: dict, states: dict, tmp_path: Path, point: str, bundle: str
) -> None:
    """``bundle``: the new content as a full bundle, or as a delta bundle against the old one (its files rebuilt
    from what the old install placed before anything is replaced)."""
    prefix = tmp_path / "prefix"
    install(bundles["old"], prefix, create_venv=False)
    code = (
        "from pathlib import Path; from bundler.install import install\n"
        f"install(Path({str(bundles[bundle])!r}), Path({str(prefix)!r}), create_venv=False, replace_datasets=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, KILL_AT_ENV: point}, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, f"{point} was not reached: {proc.stderr}"

    journal = prefix / ".ferry" / "journal.json"
    if journal.exists() and point not in COMPLETE:
        with pytest.raises(IntegrityError) as info:
            verify_prefix(prefix)
        assert info.value.problems[0].startswith("interrupted: the install of new (from "), info.value.problems
        assert (
            f"`ferry install {bundles[bundle]} --prefix {prefix} --replace-datasets` completes it"
            in (info.value.problems[0])
        )
    else:  # killed before it changed anything in place, or after its install record was written
        verify_prefix(prefix)

    messages: list[str] = []
    recover_interrupted_install(prefix, log=messages.append)
    assert not journal.exists() and not (prefix / ".ferry" / "replaced").exists()
    assert _snapshot(prefix) == states["new" if point in COMPLETE else "old"], messages
    verify_prefix(prefix)

    install(bundles[bundle], prefix, create_venv=False, replace_datasets=True)  # the command that completes it
    assert _snapshot(prefix) == states["new"]
    verify_prefix(prefix)


@pytest.mark.budget(60, reason="two venvs built with ensurepip and pip (about 8 s each here), three installs exec'd")
def test_an_install_killed_around_its_venv_loses_nothing(tmp_path: Path) -> None:
    """Two bundles with wheels (six from the package index), the first installed with its venv. The second's install
    killed once its venv is built (``install:venv``: nothing in place changed, the prefix verifies, ``venv`` still
    the first's) and once ``venv`` points at its venv (``install:venv-link``: ``verify --prefix`` names the
    interrupted install, the next command puts the link back); installing it again reuses the complete venv and
    switches the link."""
    out = tmp_path / "bundles"
    for name in ("w1", "w2"):
        spec = load_spec(name=name)
        spec.wheels.requirements = ["six==1.17.0"]
        pack(spec, out, progress=False)
    prefix = tmp_path / "prefix"
    first = install(out / "w1.ferry.tar", prefix)
    link = prefix / "venv"
    earlier = os.readlink(link)
    assert first.venv == link and (link / "bin" / "python").exists()
    assert list(link.glob("lib/python*/site-packages/__pycache__/six.*.pyc"))  # compiled while installing

    def killed_at(point: str) -> str:
        code = (
            "from pathlib import Path; from bundler.install import install\n"
            f"install(Path({str(out / 'w2.ferry.tar')!r}), Path({str(prefix)!r}))\n"
        )
        env = {**os.environ, KILL_AT_ENV: point}
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == -signal.SIGKILL, f"{point} was not reached: {proc.stderr}"
        return proc.stderr

    killed_at("install:venv")
    (built,) = [p for p in (prefix / "venvs").iterdir() if os.path.join("venvs", p.name) != earlier]
    assert (built / ".ferry-complete").exists() and os.readlink(link) == earlier
    verify_prefix(prefix)

    killed_at("install:venv-link")
    assert os.readlink(link) == os.path.join("venvs", built.name)
    with pytest.raises(IntegrityError) as info:
        verify_prefix(prefix)
    assert info.value.problems[0].startswith("interrupted: the install of w2 (from "), info.value.problems
    messages: list[str] = []
    recover_interrupted_install(prefix, log=messages.append)
    assert os.readlink(link) == earlier, messages
    verify_prefix(prefix)

    complete = (built / ".ferry-complete").stat().st_ino
    again = install(out / "w2.ferry.tar", prefix)
    assert (built / ".ferry-complete").stat().st_ino == complete  # reused, not built again
    assert os.readlink(link) == os.path.join("venvs", built.name) and again.venv == link
    verify_prefix(prefix)
    six = subprocess.run(
        [str(link / "bin" / "python"), "-c", "import six; print(six.__version__)"], capture_output=True
    )
    assert six.stdout.decode().strip() == "1.17.0", six.stderr
