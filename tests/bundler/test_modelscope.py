"""ModelScope models after ``ferry install``: the real SDK (modelscope 1.40 over modelscope-hub 0.5) finds and
loads them with no network at all (``unshare -rn``), at once.

The SDK reads no offline variable; what makes ``AutoModelForCausalLM.from_pretrained("ORG/NAME")`` stay off
the network is the hook ``ferry install`` writes into the venv
(``bundler.installer.modelscope.ms_offline_hook_files``), active while ``MODELSCOPE_OFFLINE`` (set by ferry.env)
is true. The venv here is built the way install's is, on top of the shared one (a venv cannot be filled from the
bundle's wheels without packing modelscope and torch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bundler.install import install, prefix_env
from bundler.installer.modelscope import ms_model_dir, ms_offline_hook_files
from bundler.pack import pack
from bundler.spec import load_spec
from ferry import hub
from ferry.errors import BundleError
from tests.bundler.test_install import _resign_as_modelscope
from tests.support.netns import run_offline

REPO = "karpathy/stories.260K"

#: Runs in the venv, offline: times snapshot_download and from_pretrained (import time excluded).
LOAD = r"""
import json, sys, time
from modelscope import AutoModelForCausalLM, AutoTokenizer, snapshot_download
out = {"hook": "_ferry_modelscope_offline" in sys.modules}
t = time.monotonic(); out["snapshot"] = snapshot_download(REPO); out["snapshot_s"] = time.monotonic() - t
t = time.monotonic(); model = AutoModelForCausalLM.from_pretrained(REPO); out["model_s"] = time.monotonic() - t
tok = AutoTokenizer.from_pretrained(REPO)
out.update(model_dir=model.model_dir, model=type(model).__name__, vocab=model.config.vocab_size,
           ids=tok("Once upon a time")["input_ids"], params=sum(p.numel() for p in model.parameters()))
try:
    snapshot_download(REPO, revision="v9")
except Exception as exc:
    out["other_revision"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
""".replace("REPO", repr(REPO))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, stories_model: Path) -> Path:
    """A prefix holding stories260K installed from a bundle marked as ``ms:karpathy/stories.260K``."""
    out = tmp_path_factory.mktemp("ms-bundle")
    pack(load_spec(name="ms", models=[str(stories_model)], no_wheels=True), out, progress=False)
    bundle = out / "ms"
    _resign_as_modelscope(bundle, REPO)
    prefix = out / "prefix"
    report = install(bundle, prefix, create_venv=False)
    assert report.models[0]["outcome"] == "installed"
    return prefix


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv's python with the shared venv's packages and ferry's ModelScope offline hook in site-packages."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    shared = sysconfig.get_path("purelib")
    (purelib / "aaa_shared_venv.pth").write_text(f"import site; site.addsitedir({shared!r})\n")
    for name, text in ms_offline_hook_files().items():
        (purelib / name).write_text(text)
    return venv / "bin" / "python"


@pytest.mark.budget(
    60, reason="installs a bundle, then modelscope and transformers load the model in a Python with no network"
)
def test_from_pretrained_and_snapshot_download_load_the_installed_model_offline(
    installed: Path, hooked_python: Path, stories_model: Path, tmp_path: Path
) -> None:
    env = {**os.environ, **prefix_env(installed)}
    proc = run_offline([str(hooked_python), "-c", LOAD], env=env, cwd=tmp_path, timeout=120)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    where = ms_model_dir(installed, REPO, "master")
    assert where == installed / "modelscope" / "models" / "karpathy--stories.260K" / "snapshots" / "master"
    assert found["hook"] is True
    assert Path(found["snapshot"]) == where
    assert Path(found["model_dir"]) == where
    config = json.loads((stories_model / "config.json").read_text())
    assert (found["model"], found["vocab"]) == ("LlamaForCausalLM", config["vocab_size"])
    assert found["params"] > 200_000 and len(found["ids"]) >= 4
    # Before: 22 s of retries against modelscope.cn, then NetworkError. Now: the local folder at once.
    assert found["snapshot_s"] < 2.0, found
    assert found["model_s"] < 11.0, found
    # A revision that was not installed is refused by name, not answered with the installed one.
    assert found["other_revision"].startswith("CacheNotFound") and "master" in found["other_revision"]


def test_without_modelscope_offline_the_hook_lets_the_sdk_go_to_the_network(
    installed: Path, hooked_python: Path, tmp_path: Path
) -> None:
    """The hook is switched by MODELSCOPE_OFFLINE, read at call time: with 0 the SDK lists the repository
    on its endpoint (here a closed local port, so the refusal is immediate)."""
    code = (
        "from modelscope import snapshot_download\n"
        f"try:\n    print('found', snapshot_download({REPO!r}))\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    env = {
        **os.environ,
        **prefix_env(installed),
        "MODELSCOPE_OFFLINE": "0",
        "MODELSCOPE_ENDPOINT": "http://127.0.0.1:9",
        "MODELSCOPE_API_MAX_RETRIES": "1",
        "MODELSCOPE_REPO_TREE_PAGE_MAX_ATTEMPTS": "1",
    }
    proc = run_offline([str(hooked_python), "-c", code], env=env, cwd=tmp_path, timeout=120)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("NetworkError") and "127.0.0.1" in last, proc.stdout + proc.stderr


def test_ferry_resolves_the_installed_model_without_the_sdk(installed: Path, monkeypatch) -> None:
    monkeypatch.setenv("MODELSCOPE_CACHE", str(installed / "modelscope"))
    monkeypatch.setitem(sys.modules, "modelscope", None)  # the ms: path must not need the SDK
    where = ms_model_dir(installed, REPO, "master").resolve()
    assert hub.resolve_model(f"ms:{REPO}") == where
    assert hub._modelscope_local(REPO, "master") == where
    assert hub._modelscope_local(REPO, "v9") is None


@pytest.mark.parametrize(
    "repo_id, revision",
    [
        ("stories", "master"),
        ("a/b/c", "master"),
        ("../x", "master"),
        ("a/..", "master"),
        ("a/b", ""),
        ("a/b", "../../etc"),
        ("a/b", "/abs"),
        ("a/b", "x/../y"),
    ],
)
def test_ms_model_dir_refuses_unsafe_names(repo_id: str, revision: str, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="ModelScope"):
        ms_model_dir(tmp_path, repo_id, revision)


def test_ms_model_dir_keeps_dots_and_nested_revisions(tmp_path: Path) -> None:
    assert ms_model_dir(tmp_path, "Qwen/Qwen2.5-0.5B", "release/v1") == (
        tmp_path / "modelscope" / "models" / "Qwen--Qwen2.5-0.5B" / "snapshots" / "release" / "v1"
    )


def test_hook_source_runs_on_a_bare_python(tmp_path: Path) -> None:
    """The hook is standard library only and harmless where modelscope is not installed."""
    for name, text in ms_offline_hook_files().items():
        (tmp_path / name).write_text(text)
    code = (
        "import sys, _ferry_modelscope_offline as h; "
        "print(sum(type(f).__name__ == '_Finder' for f in sys.meta_path)); h.install(); "
        "print(sum(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    )
    proc = subprocess.run(
        [shutil.which("python3") or sys.executable, "-E", "-s", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1"]
