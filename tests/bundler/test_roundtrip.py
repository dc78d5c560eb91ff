"""Round trip across the air gap: pack on the online side, then verify, install and generate with NO network
(``unshare -rn``, tests/support/netns.py), loading the model by repo_id with ``HF_HUB_OFFLINE=1`` (in a forked
child whose libraries read the installed prefix's environment again)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.install import prefix_env
from bundler.pack import pack
from bundler.spec import load_spec
from tests.support.helpers import ALPACA_REPO, ROOT, SHARED_ASSETS, STORIES_REPO, fork_ferry
from tests.support.netns import run_offline


def _generate(argv: list[str]) -> None:
    """In a child with no network and only the installed prefix's environment: load ``argv[0]`` by repo id, print
    its greedy continuation of "Once upon a time" and the repos of the hub cache."""
    from huggingface_hub import scan_cache_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo_id = argv[0]
    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    model = AutoModelForCausalLM.from_pretrained(repo_id)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    print("TEXT:" + tokenizer.decode(out[0], skip_special_tokens=True))
    print("CACHE:" + ",".join(sorted(r.repo_id for r in scan_cache_dir().repos)))


def _expected_text() -> str:
    """The greedy continuation stated in ../shared/assets/README.md."""
    readme = (SHARED_ASSETS / "README.md").read_text()
    match = re.search(r'`"Once upon a time"` → `"(.+?)"`', readme)
    assert match, "expected text not found in shared/assets/README.md"
    return match.group(1).strip()


def _offline_env(prefix: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE"))}
    return {**env, **prefix_env(prefix)}


def _generate_offline(prefix: Path, repo_id: str, tmp_path: Path) -> tuple[str, str]:
    """:func:`_generate` in a child forked from this process (transformers imported once for the suite; the
    libraries' environment read again from the prefix's, tests/test_fork_ferry.py) in a namespace with no network."""
    proc = fork_ferry([repo_id], env=_offline_env(prefix), cwd=tmp_path, offline=True, entry=_generate)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = next(line[5:] for line in proc.stdout.splitlines() if line.startswith("TEXT:"))
    cache = next(line[6:] for line in proc.stdout.splitlines() if line.startswith("CACHE:"))
    return text, cache


@pytest.mark.slow
@pytest.mark.budget(
    60, reason="packs, verifies and installs a bundle, then loads the model in a Python with no network"
)
def test_local_folder_round_trip_offline(stories_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(load_spec(name="rt", models=[str(stories_model)], no_wheels=True, split_size="300kB"), out, progress=False)
    prefix = tmp_path / "prefix"
    first = out / "rt.ferry.tar.000"
    ferry = [sys.executable, "-m", "ferry"]
    verified = run_offline([*ferry, "verify", "-q", str(first)], cwd=ROOT)
    assert "OK: rt" in verified.stdout
    run_offline([*ferry, "install", "-q", str(first), "--prefix", str(prefix), "--no-venv"], cwd=ROOT)
    text, cache = _generate_offline(prefix, "local/stories260K", tmp_path)
    assert text.strip().startswith(_expected_text())
    assert cache == "local/stories260K"


@pytest.mark.slow
@pytest.mark.budget(
    60, reason="packs from the test hub, verifies and installs, then loads the model in a Python with no network"
)
def test_hub_repo_round_trip_offline(hub_env, tmp_path: Path) -> None:
    """Pack ``hf:stories/stories260K`` and the dataset ``hf:llamafactory/alpaca_en_demo`` from the olah hub by
    repo id, then install and load them offline."""
    out = tmp_path / "out"
    result = pack(
        load_spec(name="hubrt", models=[f"hf:{STORIES_REPO}"], datasets=[f"hf:{ALPACA_REPO}"], no_wheels=True),
        out,
        progress=False,
    )
    item = result.manifest["items"][0]
    assert item["repo_id"] == STORIES_REPO and re.fullmatch(r"[0-9a-f]{40}", item["revision"])
    prefix = tmp_path / "prefix"
    env = {k: v for k, v in os.environ.items() if k != "HF_ENDPOINT"}
    run_offline(
        [
            sys.executable,
            "-m",
            "ferry",
            "install",
            "-q",
            str(out / "hubrt.ferry.tar"),
            "--prefix",
            str(prefix),
            "--no-venv",
        ],
        env=env,
        cwd=ROOT,
    )
    refs = prefix / "hf-home" / "hub" / "models--stories--stories260K" / "refs" / "main"
    assert refs.read_text() == item["revision"]
    text, cache = _generate_offline(prefix, STORIES_REPO, tmp_path)
    assert text.strip().startswith(_expected_text())
    assert cache == f"{ALPACA_REPO},{STORIES_REPO}"  # hub datasets are in the hub cache too
    registry = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    assert registry == {"alpaca_en_demo": {"file_name": "alpaca_en_demo/alpaca_en_demo.json"}}
    rows = json.loads((prefix / "datasets" / "alpaca_en_demo" / "alpaca_en_demo.json").read_text())
    assert len(rows) == 999 and set(rows[0]) == {"instruction", "input", "output"}


@pytest.mark.slow
@pytest.mark.budget(60, reason="install.py builds a venv from the bundle's wheels with no network")
def test_install_py_with_real_venv_offline(stories_model: Path, tmp_path: Path) -> None:
    """The bundle's own install.py, run by a bare python3 with no network, creates a venv from the bundle's
    wheels (pip --no-index --require-hashes) whose activate script sources ferry.env."""
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("six==1.17.0\nidna==3.10\n")
    out = tmp_path / "out"
    pack(load_spec(name="venvrt", models=[str(stories_model)], requirements=[requirements]), out, progress=False)
    lock = (out / "venvrt" / "wheels" / "requirements.lock").read_text()
    assert "six==1.17.0" in lock and "--hash=sha256:" in lock
    # the user's side: a plain tar extraction, then install.py from the extracted folder
    extracted = tmp_path / "usb"
    extracted.mkdir()
    subprocess.run(["tar", "-xf", str(out / "venvrt.ferry.tar"), "-C", str(extracted)], check=True)
    prefix = tmp_path / "prefix"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = run_offline(["/usr/bin/python3", "install.py", "--prefix", str(prefix)], env=bare, cwd=extracted / "venvrt")
    assert "OK:" in proc.stdout
    assert (prefix / "venv").is_symlink()
    check = run_offline(
        [
            "sh",
            "-c",
            f". {prefix}/venv/bin/activate && python -c 'import six, idna, os; "
            f'print(six.__version__, os.environ["HF_HUB_OFFLINE"], os.environ["HF_HOME"])\'',
        ],
        env=bare,
        cwd=tmp_path,
    )
    assert check.stdout.split() == ["1.17.0", "1", str(prefix / "hf-home")]
    # the venv carries the ModelScope offline hook (loaded at start-up by its .pth line)
    hook = run_offline(
        [
            str(prefix / "venv" / "bin" / "python"),
            "-c",
            "import sys; print('_ferry_modelscope_offline' in sys.modules)",
        ],
        env=bare,
        cwd=tmp_path,
    )
    assert hook.stdout.strip() == "True"
    # the installed prefix, venv included (pip's RECORD hashes), matches its manifests; a changed file is named
    ok = run_offline(
        ["/usr/bin/python3", "install.py", "--verify-prefix", str(prefix)], env=bare, cwd=extracted / "venvrt"
    )
    assert ok.stdout.startswith("OK: 1 bundle(s)")
    six_py = next((prefix / "venv").glob("lib/python*/site-packages/six.py"))
    six_py.write_text(six_py.read_text() + "\n# edited\n")
    drift = run_offline(
        ["/usr/bin/python3", "install.py", "--verify-prefix", str(prefix)],
        env=bare,
        cwd=extracted / "venvrt",
        check=False,
    )
    assert drift.returncode == 7 and "changed: venv file lib/" in drift.stderr and "six.py" in drift.stderr
    six_py.write_text(six_py.read_text().replace("\n# edited\n", ""))
    # a second run is a no-op: same venv, nothing rebuilt
    marker = prefix / "venv" / ".ferry-complete"
    mtime = marker.stat().st_mtime_ns
    run_offline(["/usr/bin/python3", "install.py", "--prefix", str(prefix)], env=bare, cwd=extracted / "venvrt")
    assert marker.stat().st_mtime_ns == mtime
