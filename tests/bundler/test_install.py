"""``ferry install`` into a prefix: the Hugging Face cache layout, datasets, ferry.env, idempotence, blob
sharing, atomicity and the up-front free-space check. Bundles come from the real ``bundler.pack``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.install import install, prefix_env, read_env_file
from bundler.installer.hashing import size_and_sha256
from bundler.installer.modelscope import ms_model_dir
from bundler.installer.place import place_hf
from bundler.pack import pack
from bundler.spec import load_spec
from ferry.constants import OFFLINE_ENV
from ferry.errors import IntegrityError, NotInstalledError
from tests.support.helpers import ROOT, resign
from tests.support.netns import run_in_mount_namespace, run_offline


def _pack(out: Path, name: str, models: list[Path], datasets: list[Path]) -> Path:
    spec = load_spec(name=name, models=[str(m) for m in models], datasets=[str(d) for d in datasets], no_wheels=True)
    pack(spec, out, progress=False)
    return out / f"{name}.ferry.tar"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> dict:
    """Two bundles sharing the stories260K model: ``a`` (+ alpaca_en_demo.json) and ``b`` (+ the whole
    LLaMA-Factory demo folder with its dataset_info.json); ``c``: a *modified* stories260K (new revision)."""
    out = tmp_path_factory.mktemp("bundles")
    modified = out / "src" / "stories260K"
    shutil.copytree(stories_model, modified)
    os.chmod(modified / "config.json", 0o644)
    (modified / "config.json").write_text(
        (stories_model / "config.json").read_text().replace('"rms_norm_eps"', '"_note": 1, "rms_norm_eps"')
    )
    return {
        "a": _pack(out, "a", [stories_model], [llamafactory_data / "alpaca_en_demo.json"]),
        "b": _pack(out, "b", [stories_model], [llamafactory_data]),
        "c": _pack(out, "c", [modified], []),
        "out": out,
    }


def _tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its type, link target or (size, mtime_ns, inode): a change detector."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        st = path.lstat()
        if path.is_symlink():
            state[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            state[rel] = ("dir",)
        else:
            state[rel] = ("file", st.st_size, st.st_mtime_ns, st.st_ino)
    return state


def test_install_layout(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    report = install(bundles["a"], prefix, create_venv=False)
    manifest = json.loads((bundles["out"] / "a" / "manifest.json").read_text())
    model = next(i for i in manifest["items"] if i["kind"] == "model")
    repo = prefix / "hf-home" / "hub" / "models--local--stories260K"
    assert (repo / "refs" / "main").read_text() == model["revision"]
    snapshot = repo / "snapshots" / model["revision"]
    for entry in model["files"]:
        link = snapshot / entry["path"]
        assert link.is_symlink()
        assert os.readlink(link) == f"../../blobs/{entry['sha256']}"
        assert size_and_sha256(link) == (entry["size"], entry["sha256"])
    assert report.models[0]["blobs_added"] == len(model["files"])
    assert report.files_checked == len(model["files"]) + 5  # + dataset, install.py, manifest, SBOM, SHA256SUMS
    assert not list(prefix.glob(".staging-*"))

    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(prefix / "hf-home" / "hub")
    assert [(r.repo_id, r.repo_type) for r in info.repos] == [("local/stories260K", "model")]
    assert [rev.commit_hash for rev in next(iter(info.repos)).revisions] == [model["revision"]]

    registry = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    assert registry == {"alpaca_en_demo": {"file_name": "alpaca_en_demo/alpaca_en_demo.json"}}
    assert (prefix / "datasets" / "alpaca_en_demo" / "alpaca_en_demo.json").is_file()

    env_text = read_env_file(prefix)
    for key, value in OFFLINE_ENV.items():
        assert f"export {key}={value}" in env_text
    assert f"export HF_HOME={prefix / 'hf-home'}" in env_text
    assert f"export MODELSCOPE_CACHE={prefix / 'modelscope'}" in env_text
    env = prefix_env(prefix)
    assert env["HF_HOME"] == str(prefix / "hf-home") and env["FERRY_HOME"] == str(prefix)
    assert "PATH" not in env  # no venv was created
    sourced = subprocess.run(
        ["sh", "-c", f". {prefix}/ferry.env && env"], capture_output=True, text=True, check=True
    ).stdout
    assert "HF_HUB_OFFLINE=1" in sourced and f"HF_HOME={prefix / 'hf-home'}" in sourced


def test_env_command_prints_ferry_env(bundles: dict, tmp_path: Path) -> None:
    with pytest.raises(NotInstalledError):
        read_env_file(tmp_path / "nothing")
    prefix = tmp_path / "prefix"
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "install", "-q", str(bundles["a"]), "--prefix", str(prefix), "--no-venv"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "local/stories260K" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "env", "--prefix", str(prefix)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout == (prefix / "ferry.env").read_text()


def test_install_twice_changes_nothing(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    first = install(bundles["a"], prefix, create_venv=False)
    before = _tree(prefix)
    second = install(bundles["a"], prefix, create_venv=False)
    assert not first.already_installed and second.already_installed
    assert _tree(prefix) == before


def test_second_bundle_adds_and_shares_blobs(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    blobs = prefix / "hf-home" / "hub" / "models--local--stories260K" / "blobs"
    inodes = {p.name: p.stat().st_ino for p in blobs.iterdir()}
    report = install(bundles["b"], prefix, create_venv=False)
    assert report.models[0]["blobs_added"] == 0
    assert report.models[0]["blobs_shared"] == len(inodes)
    assert {p.name: p.stat().st_ino for p in blobs.iterdir()} == inodes
    registry = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    # b's own dataset_info.json entries, re-rooted (optional keys kept), replace a's entry of the same name
    assert registry["alpaca_en_demo"] == {"file_name": "llamafactory/alpaca_en_demo.json"}
    assert registry["c4_demo"]["file_name"] == "llamafactory/c4_demo.jsonl"
    assert registry["c4_demo"]["columns"] == {"prompt": "text"}
    assert (prefix / "datasets" / "alpaca_en_demo" / "alpaca_en_demo.json").is_file()  # a's data still there
    # a new revision of the model adds a snapshot beside the first one
    install(bundles["c"], prefix, create_venv=False)
    snapshots = prefix / "hf-home" / "hub" / "models--local--stories260K" / "snapshots"
    assert len(list(snapshots.iterdir())) == 2


def test_failed_install_leaves_earlier_install_intact(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    before = _tree(prefix)
    bad = tmp_path / "c.ferry.tar"
    data = bytearray(bundles["c"].read_bytes())
    offset = data.find(b'"_note": 1')
    assert offset > 0
    data[offset + 9] = ord("2")  # the changed config.json of the new revision: a flipped byte
    bad.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="models/local/stories260K/config.json"):
        install(bad, prefix, create_venv=False)
    assert _tree(prefix) == before


def test_stale_staging_from_a_killed_run_is_removed(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    stale = prefix / ".staging-killed"
    (stale / "bundle").mkdir(parents=True)
    (stale / "bundle" / "half.bin").write_bytes(b"x" * 100)
    install(bundles["a"], prefix, create_venv=False)
    assert not stale.exists()


def test_too_little_space_is_refused_up_front(bundles: dict, tmp_path: Path) -> None:
    """A 1 MiB tmpfs (in a private mount namespace) cannot take the ~2 MiB bundle: the error says how much
    is needed and where, and nothing is written."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} -m ferry install -q {bundles['a']} "
        f"--prefix {mnt}/prefix --no-venv; echo rc=$?; ls -A {mnt}"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert "rc=9" in proc.stdout, proc.stdout + proc.stderr
    assert "needs" in proc.stderr and str(mnt) in proc.stderr and "free" in proc.stderr
    assert proc.stdout.split("rc=9")[1].split() == []  # not even the prefix it would have created


BUILD_VENV = """
import sys
from pathlib import Path

from bundler.installer.venv import build_venv
from ferry.errors import FerryError

disk = Path(sys.argv[1])
try:
    build_venv(disk / "prefix" / "venvs" / "b1", disk / "wheels", disk / "wheels" / "requirements.lock", print)
except FerryError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def test_a_disk_that_fills_while_the_venv_is_built_says_so_and_leaves_no_venv(tmp_path: Path) -> None:
    """A 4 MiB tmpfs fills while ensurepip puts pip into the venv (about 22 MiB): the error says the disk ran out,
    not that python3-venv is missing, and neither the venv nor an empty venvs/ is left."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "build_venv.py").write_text(BUILD_VENV)
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {mnt} && mkdir {mnt}/prefix {mnt}/wheels && "
        f"{sys.executable} {tmp_path / 'build_venv.py'} {mnt}; echo listing; ls -A {mnt}/prefix"
    )
    proc = run_in_mount_namespace(script, pythonpath=ROOT)
    said, listing = proc.stdout.split("listing\n")
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"InsufficientSpaceError: ran out of disk space in {mnt}/prefix ("), (
        proc.stdout + proc.stderr
    )
    assert "while installing pip into the venv (ensurepip)" in last and "python3-venv" not in last
    assert listing.split() == []


def _resign_as_modelscope(bundle: Path, repo_id: str) -> None:
    """Mark the bundle's model item as a ModelScope snapshot of ``repo_id`` (re-signing manifest.json), as
    ``ferry pack ms:REPO`` writes it; no ModelScope server exists here to pack from."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for item in manifest["items"]:
        if item["kind"] == "model":
            item.update(
                source="ms", repo_id=repo_id, spec=f"ms:{repo_id}", revision="master", revision_requested="master"
            )
    resign(bundle, manifest)


def test_modelscope_model_is_found_offline_by_the_sdk(bundles: dict, tmp_path: Path) -> None:
    bundle = tmp_path / "a"
    shutil.copytree(bundles["out"] / "a", bundle)
    _resign_as_modelscope(bundle, "karpathy/stories.260K")
    prefix = tmp_path / "prefix"
    report = install(bundle, prefix, create_venv=False)
    assert report.models[0]["outcome"] == "installed"
    code = (
        "from modelscope import snapshot_download; "
        "print(snapshot_download('karpathy/stories.260K', local_files_only=True))"
    )
    env = {**os.environ, **prefix_env(prefix)}
    proc = run_offline([sys.executable, "-c", code], env=env, cwd=tmp_path)
    found = Path(proc.stdout.strip().splitlines()[-1])
    assert found == ms_model_dir(prefix, "karpathy/stories.260K", "master")
    assert (found / "model.safetensors").is_file()


def test_killed_install_leaves_earlier_install_intact(bundles: dict, tmp_path: Path) -> None:
    """SIGKILL half-way through extracting a second bundle: the first install is untouched, nothing of the
    second is visible, and running the install again completes it."""
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    before = _tree(prefix)
    code = (
        "import os, signal, sys; from pathlib import Path; from bundler.installer.install import install_bundle\n"
        "seen = [0]\n"
        "def progress(n):\n"
        "    seen[0] += n\n"
        "    if seen[0] > 600_000: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"install_bundle(Path({str(bundles['c'])!r}), Path({str(prefix)!r}), create_venv=False, "
        "progress=progress, log=lambda m: None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    after = {k: v for k, v in _tree(prefix).items() if not k.startswith(".staging-")}
    assert after == before
    report = install(bundles["c"], prefix, create_venv=False)
    assert not list(prefix.glob(".staging-*"))
    assert len(list((prefix / "hf-home/hub/models--local--stories260K/snapshots").iterdir())) == 2
    assert report.models[0]["blobs_shared"] > 0  # unchanged files of the model are shared with bundle a


def test_datasets_with_the_same_name_do_not_replace_each_other(llamafactory_data: Path, tmp_path: Path) -> None:
    """``a/data`` and ``b/data`` in one bundle, and ``c/data`` in a later one, get folders of their own."""
    out = tmp_path / "out"
    pack(
        load_spec(
            name="same",
            datasets=[str(llamafactory_data / "alpaca_en_demo.json"), str(llamafactory_data / "c4_demo.jsonl")],
            no_wheels=True,
        ),
        out,
        progress=False,
    )
    bundle = out / "same"
    manifest = json.loads((bundle / "manifest.json").read_text())
    for item, repo_id in zip(manifest["items"], ("a/data", "b/data")):
        item.update(source="hf", repo_id=repo_id, spec=f"hf:{repo_id}")
    resign(bundle, manifest)
    prefix = tmp_path / "prefix"
    report = install(bundle, prefix, create_venv=False)
    assert [d["name"] for d in report.datasets] == ["a--data", "b--data"]
    registry = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    assert registry == {
        "alpaca_en_demo": {"file_name": "a--data/alpaca_en_demo.json"},
        "c4_demo": {"file_name": "b--data/c4_demo.jsonl"},
    }
    # a later bundle: c/data takes the plain name "data"; then d/data must not replace it
    for repo_id, expected in (("c/data", "data"), ("d/data", "d--data")):
        later = tmp_path / repo_id.replace("/", "_")
        shutil.copytree(bundle, later)
        manifest = json.loads((later / "manifest.json").read_text())
        manifest["bundle_id"] = hashlib.md5(repo_id.encode()).hexdigest()
        manifest["items"] = manifest["items"][:1]
        manifest["items"][0].update(repo_id=repo_id, spec=f"hf:{repo_id}")
        shutil.rmtree(later / manifest["items"][0]["path"].replace("alpaca_en_demo", "c4_demo"))
        resign(later, manifest, drop="c4_demo.jsonl")
        assert install(later, prefix, create_venv=False).datasets[0]["name"] == expected
    assert sorted(p.name for p in (prefix / "datasets").iterdir()) == [
        "a--data",
        "b--data",
        "d--data",
        "data",
        "dataset_info.json",
    ]


def _stage(root: Path, files: dict[str, bytes]) -> list[dict]:
    entries = []
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        entries.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return entries


def test_refs_for_branch_tag_and_commit_and_nested_paths(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    repo = hub / "models--org--m"
    revisions = {"v1": "a" * 40, "main": "b" * 40, "commit": "c" * 40}
    for requested, revision in (
        ("v1", revisions["v1"]),
        ("main", revisions["main"]),
        (revisions["commit"], revisions["commit"]),
    ):
        staged = tmp_path / f"staged-{revision[0]}"
        files = _stage(staged, {"config.json": b"{}", "sub/dir/weights.bin": revision.encode()})
        item = {
            "repo_id": "org/m",
            "revision": revision,
            "revision_requested": requested,
            "files": files,
            "path": "models/hf/org/m",
        }
        place_hf(item, staged, hub, scratch)
        if requested == "v1":  # refs/main only when main itself was packed: v1 must not answer "main"
            assert not (repo / "refs" / "main").exists()
        nested = repo / "snapshots" / revision / "sub" / "dir" / "weights.bin"
        assert os.readlink(nested) == f"../../../../blobs/{files[1]['sha256']}"
        assert nested.read_bytes() == revision.encode()
    assert (repo / "refs" / "v1").read_text() == revisions["v1"]
    assert (repo / "refs" / "main").read_text() == revisions["main"]
    assert sorted(p.name for p in (repo / "refs").iterdir()) == ["main", "v1"]  # a commit request adds no ref
    assert len(list((repo / "blobs").iterdir())) == 4  # config.json shared by all three snapshots
    assert not list(scratch.iterdir())


def test_concurrent_install_into_the_same_prefix_is_refused(bundles: dict, tmp_path: Path) -> None:
    import fcntl
    import threading

    from bundler.installer.fs import prefix_busy
    from ferry.errors import BundleError

    prefix = tmp_path / "prefix"
    prefix.mkdir()
    held = os.open(prefix, os.O_RDONLY | os.O_DIRECTORY)  # what another install holds: the prefix itself
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(BundleError, match="another ferry install is running"):
            install(bundles["a"], prefix, create_venv=False)
    finally:
        os.close(held)
    # a holder of a moment (`verify --prefix` tests the lock) does not refuse an install starting then: it waits
    held = os.open(prefix, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    release = threading.Timer(0.5, os.close, args=(held,))
    release.start()
    install(bundles["a"], prefix, create_venv=False)
    release.join()
    assert prefix_busy(prefix) is False


def test_the_venv_is_installed_by_the_bundles_uv_only_as_the_lock_pins_it(tmp_path: Path) -> None:
    """The uv that builds the venv is the bundle's own wheel, checked against the lock's sha256 before its executable
    is unpacked; a lock without uv is installed by pip. (tests/e2e/test_main_job.py builds a real venv with it.)"""
    import zipfile

    from bundler.installer.venv import _bundled_uv
    from ferry.errors import BundleError

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    lock = wheels / "requirements.lock"
    lock.write_text(f"six==1.17.0 --hash=sha256:{'0' * 64}\n")
    assert _bundled_uv(wheels, lock, tmp_path / "s0") is None  # pip installs this one
    wheel = wheels / "uv-9.9.9-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("uv/__init__.py", "")
        archive.writestr("uv-9.9.9.data/scripts/uv", '#!/bin/sh\necho uv 9.9.9 "$@"\n')
    lock.write_text(f"six==1.17.0 --hash=sha256:{'0' * 64}\nuv==9.9.9 --hash=sha256:{'1' * 64}\n")
    with pytest.raises(BundleError, match=r"uv==9\.9\.9 is locked, but .* holds no uv wheel with that sha256"):
        _bundled_uv(wheels, lock, tmp_path / "s1")
    assert not (tmp_path / "s1").exists()
    lock.write_text(f"uv==9.9.9 --hash=sha256:{size_and_sha256(wheel)[1]}\n")
    uv = _bundled_uv(wheels, lock, tmp_path / "s2")
    assert uv == tmp_path / "s2" / "uv" and os.access(uv, os.X_OK)
    assert subprocess.run([str(uv), "pip"], capture_output=True, text=True).stdout == "uv 9.9.9 pip\n"
    with zipfile.ZipFile(wheel, "w") as archive:  # a wheel without the executable
        archive.writestr("uv/__init__.py", "")
    lock.write_text(f"uv==9.9.9 --hash=sha256:{size_and_sha256(wheel)[1]}\n")
    with pytest.raises(BundleError, match=r"no uv executable \(uv-9\.9\.9\.data/scripts/uv\) in the wheel"):
        _bundled_uv(wheels, lock, tmp_path / "s3")
