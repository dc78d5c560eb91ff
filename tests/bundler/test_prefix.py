"""The installed prefix: drift checks (``ferry verify --prefix``), repair on re-install, permissions for other
accounts, read-only and foreign prefixes, stray temp files, datasets that are never lost silently, and offline
look-ups that agree with huggingface_hub.

Bundles come from the real ``bundler.pack`` (stories260K, the LLaMA-Factory demo data, the olah hub); other
accounts are real (``setpriv --reuid=65534``), isolation is real (``unshare -rn`` / ``-rm``).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bundler.install import install, prefix_env
from bundler.installer.manifest import content_id
from bundler.installer.venv import check_venv
from bundler.pack import pack
from bundler.sources import apply_safety
from bundler.spec import load_spec
from bundler.verify import verify_prefix
from ferry.errors import BundleError, InsufficientSpaceError, IntegrityError, PrefixError, SourceError
from tests.support.helpers import ALPACA_REPO, ROOT, STORIES_REPO, resign
from tests.support.netns import run_offline

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _pack(out: Path, name: str, models: list[str], datasets: list[str]) -> Path:
    pack(load_spec(name=name, models=models, datasets=datasets, no_wheels=True), out, progress=False)
    return out / f"{name}.ferry.tar"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> dict:
    """``a``: stories260K + alpaca_en_demo.json; ``a2``: the same dataset name with other rows; in a folder every
    account can read (``/tmp/ferry-test-*``, mode 0755) so that install.py can run as another user."""
    out = Path(tempfile.mkdtemp(prefix="ferry-test-", dir="/tmp"))
    os.chmod(out, 0o755)
    other = out / "src" / "alpaca_en_demo.json"
    other.parent.mkdir(parents=True)
    rows = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())[:5]
    other.write_text(json.dumps(rows))
    result = {
        "a": _pack(out, "a", [str(stories_model)], [str(llamafactory_data / "alpaca_en_demo.json")]),
        "a2": _pack(out, "a2", [], [str(other)]),
        "out": out,
    }
    yield result
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture()
def shared_tmp() -> Iterator[Path]:
    """A folder in /tmp that every account can traverse (pytest's own tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="ferry-prefix-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- drift, repair


def test_verify_prefix_names_every_drifted_file_and_reinstall_repairs(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    report = verify_prefix(prefix)
    assert report.bundles == 1 and report.files_checked >= 4

    repo = prefix / "hf-home" / "hub" / "models--local--stories260K"
    snapshot = next((repo / "snapshots").iterdir())
    weights = (snapshot / "model.safetensors").resolve()
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))  # a corrupt blob (bit rot, a careless edit)
    (snapshot / "config.json").unlink()  # a missing snapshot file
    dataset = prefix / "datasets" / "alpaca_en_demo"
    (dataset / "alpaca_en_demo.json").write_text("[]")
    (dataset / "notes.txt").write_text("added by hand")
    with open(prefix / "ferry.env", "a") as fh:
        fh.write("export HF_HUB_OFFLINE=0\n")

    with pytest.raises(IntegrityError) as info:
        verify_prefix(prefix)
    problems = info.value.problems  # type: ignore[attr-defined]
    rel = os.path.relpath(snapshot, prefix)
    assert f"changed: {rel}/model.safetensors" in " ".join(problems)
    assert f"missing: {rel}/config.json" in problems
    assert any(p.startswith("changed: datasets/alpaca_en_demo/alpaca_en_demo.json") for p in problems)
    assert "extra file: datasets/alpaca_en_demo/notes.txt" in problems
    assert any("ferry.env" in p for p in problems)

    # the CLI, with no network at all
    proc = run_offline([sys.executable, "-m", "ferry", "verify", "--prefix", str(prefix)], cwd=ROOT, check=False)
    assert proc.returncode == IntegrityError.exit_code
    assert "model.safetensors" in proc.stderr and "config.json" in proc.stderr

    os.unlink(dataset / "notes.txt")
    again = install(bundles["a"], prefix, create_venv=False)
    assert again.already_installed
    assert any("model.safetensors" in r for r in again.repaired)
    assert any("config.json" in r for r in again.repaired)
    assert any("alpaca_en_demo" in r for r in again.repaired)
    assert "repaired" in again.summary()
    verify_prefix(prefix)  # clean again
    assert not (prefix / ".ferry" / "replaced").exists()

    clean = install(bundles["a"], prefix, create_venv=False)
    assert clean.already_installed and not clean.repaired
    assert "nothing changed" in clean.summary()


def test_verify_prefix_checks_a_venv_against_the_wheels_record(tmp_path: Path) -> None:
    """The venv check reads pip's own RECORD (PEP 376) of a real venv: a changed installed file is named."""
    venv = tmp_path / "venvs" / ("0" * 32)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    (venv / ".ferry-complete").write_text("ok\n")
    problems: list[str] = []
    counts = [0, 0]
    check_venv(venv, problems, counts)
    assert problems == [] and counts[0] > 100  # pip's own files
    target = next(venv.glob("lib/python*/site-packages/pip/__init__.py"))
    target.write_text(target.read_text() + "\n# changed\n")
    check_venv(venv, problems, counts)
    dist_info = next(target.parent.parent.glob("pip-*.dist-info")).name
    assert problems == [f"changed: venv file {target.relative_to(venv)} ({dist_info})"]


# ----------------------------------------------------------------------------------------------- permissions


def _site_for_other_users(dest: Path, top: list[str]) -> Path:
    """Copy the installed files of ``top`` distributions and their requirements (recursively, no extras) into
    ``dest``: a site-packages that an account without access to this project's venv can import."""
    seen: set[str] = set()
    todo = list(top)
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in dist.files or []:
            src = Path(dist.locate_file(f))
            if src.is_file() and not str(f).startswith(".."):
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    for root, dirs, files in os.walk(dest):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return dest


def _modes(prefix: Path) -> set[tuple[str, int]]:
    found = set()
    for path in [prefix, *prefix.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        found.add(("dir" if stat.S_ISDIR(st.st_mode) else "file", stat.S_IMODE(st.st_mode)))
    return found


def test_shared_prefix_is_usable_by_another_account(bundles: dict, shared_tmp: Path) -> None:
    """Installed by root under a strict umask (077), the prefix is 0755/0644; another account sources
    ferry.env and huggingface_hub (the real reader, offline) finds and reads the model and the dataset."""
    prefix = shared_tmp / "prefix"
    old = os.umask(0o077)
    try:
        install(bundles["a"], prefix, create_venv=False)
    finally:
        os.umask(old)
    assert _modes(prefix) == {("dir", 0o755), ("file", 0o644)}
    site = _site_for_other_users(shared_tmp / "site", ["huggingface_hub"])
    code = (
        "import sys, os, json; sys.path.insert(0, sys.argv[1]); "
        "from huggingface_hub import snapshot_download; "
        "path = snapshot_download('local/stories260K'); "
        "sizes = {n: len(open(os.path.join(path, n), 'rb').read()) for n in sorted(os.listdir(path))}; "
        "cfg = json.load(open(os.path.join(path, 'config.json'))); "
        "rows = json.load(open(os.path.join(os.environ['FERRY_DATASET_DIR'], 'alpaca_en_demo', "
        "'alpaca_en_demo.json'))); "
        "print(json.dumps({'uid': os.getuid(), 'sizes': sizes, 'model_type': cfg['model_type'], 'rows': len(rows)}))"
    )
    script = f'. {prefix}/ferry.env && exec /usr/bin/python3 -c "$0" {site}'
    # (not under unshare -rn: a new user namespace maps no uid 65534; ferry.env sets HF_HUB_OFFLINE=1)
    proc = subprocess.run(
        [*NOBODY, "sh", "-c", script, code],
        capture_output=True,
        text=True,
        cwd=shared_tmp,
        env={"PATH": os.environ["PATH"]},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["uid"] == 65534
    assert found["model_type"] == "llama" and found["sizes"]["model.safetensors"] > 0
    assert found["rows"] > 0


def test_private_prefix_is_closed_to_other_accounts(bundles: dict, shared_tmp: Path) -> None:
    prefix = shared_tmp / "prefix"
    install(bundles["a"], prefix, create_venv=False, private=True)
    assert _modes(prefix) == {("dir", 0o700), ("file", 0o600)}
    proc = subprocess.run([*NOBODY, "cat", str(prefix / "ferry.env")], capture_output=True, text=True)
    assert proc.returncode != 0 and "Permission denied" in proc.stderr


def test_foreign_and_read_only_prefixes_are_one_line(bundles: dict, shared_tmp: Path) -> None:
    bundle_dir = bundles["out"] / "a"
    root_owned = shared_tmp / "root-owned"
    root_owned.mkdir(mode=0o755)
    proc = subprocess.run(
        [*NOBODY, "/usr/bin/python3", "-I", str(bundle_dir / "install.py"), "--prefix", str(root_owned), "--no-venv"],
        capture_output=True,
        text=True,
        cwd=shared_tmp,
    )
    assert proc.returncode == PrefixError.exit_code, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("install.py: error: the prefix") and "not writable by this account" in last
    assert "Traceback" not in proc.stderr and not any(root_owned.iterdir())

    mnt = shared_tmp / "ro"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs tmpfs {mnt} && mkdir {mnt}/prefix && mount -o remount,ro {mnt} && "
        f"{sys.executable} -m ferry install -q {bundles['a']} --prefix {mnt}/prefix --no-venv; echo rc=$?"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert f"rc={PrefixError.exit_code}" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (  # after the risk flags that ferry install prints first
        f"ferry: error: the prefix {mnt}/prefix is on a read-only file system: choose another --prefix"
    )
    assert "Traceback" not in proc.stderr


def test_stray_temp_files_of_a_killed_install_are_cleaned(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    refs = prefix / "hf-home" / "hub" / "models--local--stories260K" / "refs"
    strays = [
        prefix / ".ferry.env.x1y2.tmp",
        refs / ".main.abc.tmp",
        prefix / ".ferry" / ".state.json.q.tmp",
        prefix / "datasets" / ".dataset_info.json.z.tmp",
    ]
    for stray in strays:
        stray.write_text("half")
    os.symlink("venvs/x", prefix / ".venv.123.456.lnk")
    install(bundles["a"], prefix, create_venv=False)
    assert not [s for s in strays if s.exists()]
    assert not os.path.lexists(prefix / ".venv.123.456.lnk")


# ------------------------------------------------------------------------------------------------ datasets


def test_pack_refuses_two_datasets_with_one_install_name(hub_env, llamafactory_data: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError) as info:
        pack(
            load_spec(
                name="clash",
                datasets=[f"hf:{ALPACA_REPO}", str(llamafactory_data / "alpaca_en_demo.json")],
                no_wheels=True,
            ),
            tmp_path / "out",
            progress=False,
        )
    message = str(info.value)
    assert f"hf:{ALPACA_REPO}" in message and "alpaca_en_demo.json" in message
    assert "PREFIX/datasets/alpaca_en_demo" in message
    assert not (tmp_path / "out" / "clash").exists()


def test_dataset_with_other_content_is_refused_unless_replace(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    dataset = prefix / "datasets" / "alpaca_en_demo" / "alpaca_en_demo.json"
    original = dataset.read_bytes()
    info_before = (prefix / "datasets" / "dataset_info.json").read_text()
    with pytest.raises(BundleError, match="--replace-datasets"):
        install(bundles["a2"], prefix, create_venv=False)
    assert dataset.read_bytes() == original
    assert (prefix / "datasets" / "dataset_info.json").read_text() == info_before
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "install", "-q", str(bundles["a2"]), "--prefix", str(prefix), "--no-venv"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == BundleError.exit_code and "alpaca_en_demo" in proc.stderr
    report = install(bundles["a2"], prefix, create_venv=False, replace_datasets=True)
    assert report.datasets[0]["outcome"] == "replaced"
    assert len(json.loads(dataset.read_text())) == 5
    assert not (prefix / ".ferry" / "replaced").exists()  # kept only until the install completed
    verify_prefix(prefix)


def _killed_over_a(bundles: dict, tmp_path: Path, point: str) -> tuple[Path, Path, dict, str]:
    """Install ``a``, then ``a2`` with --replace-datasets in a child killed at the kill point ``point``
    (:mod:`ferry.faults`). Returns the prefix, the dataset folder, its files and dataset_info.json's text as ``a``
    left them."""
    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    dataset = prefix / "datasets" / "alpaca_en_demo"
    before = {p.name: p.read_bytes() for p in dataset.iterdir()}
    info_before = (prefix / "datasets" / "dataset_info.json").read_text()
    code = (
        "from pathlib import Path; from bundler.install import install\n"
        f"install(Path({str(bundles['a2'])!r}), Path({str(prefix)!r}), create_venv=False, replace_datasets=True)\n"
    )
    env = {**os.environ, "FERRY_TEST_KILL_AT": point}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return prefix, dataset, before, info_before


def test_data_swapped_out_by_a_killed_install_is_restored(bundles: dict, tmp_path: Path) -> None:
    """SIGKILL right after the old dataset folder was moved aside; then the next install fails (a corrupt
    bundle): the old data is back in place and dataset_info.json is as before."""
    prefix, dataset, before, info_before = _killed_over_a(bundles, tmp_path, "install:swap-aside")
    assert not dataset.exists()  # killed between the two renames
    corrupt = tmp_path / "corrupt.ferry.tar"
    data = bytearray(bundles["a2"].read_bytes())
    data[data.rindex(b'"instruction"') + 2] ^= 0x01  # a byte of the dataset's content
    corrupt.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        install(corrupt, prefix, create_venv=False, replace_datasets=True)
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} == before
    assert (prefix / "datasets" / "dataset_info.json").read_text() == info_before
    verify_prefix(prefix)


def test_interrupted_install_is_named_then_rolled_back_by_the_next_command(
    bundles: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGKILL right after the new dataset folder went into place: `verify --prefix` names the interrupted
    install and the command that completes it; the next command that reads the prefix (`ferry train` with
    FERRY_HOME, as ferry.env sets it) puts the earlier install back first; that command then completes it."""
    from ferry.cli import main

    prefix, dataset, before, info_before = _killed_over_a(bundles, tmp_path, "install:swap-in")
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} != before  # the new data is in place
    with pytest.raises(IntegrityError) as info:
        verify_prefix(prefix)
    command = f"ferry install {bundles['a2']} --prefix {prefix} --replace-datasets"
    first = info.value.problems[0]
    assert first.startswith(f"interrupted: the install of a2 (from {bundles['a2']}, started 20"), first
    assert f"`{command}` completes it" in first
    assert any(p.startswith("changed: ") and "alpaca_en_demo.json" in p for p in info.value.problems[1:])

    monkeypatch.setenv("FERRY_HOME", str(prefix))
    main(["train", "--help"])  # help changes nothing, not even an interrupted install
    assert "Usage: ferry train" in capsys.readouterr().out and (prefix / ".ferry" / "journal.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(tmp_path / "missing.yaml")])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.splitlines()
    assert f"ferry: restored {dataset} (the install of a2" in err[0]
    assert (
        err[-2] == f"ferry: {prefix}: the earlier install is back in place; `{command}` completes the interrupted one"
    )
    assert "missing.yaml" in err[-1]  # then the command itself ran
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} == before
    assert (prefix / "datasets" / "dataset_info.json").read_text() == info_before
    assert not (prefix / ".ferry" / "journal.json").exists() and not (prefix / ".ferry" / "replaced").exists()
    verify_prefix(prefix)

    report = install(bundles["a2"], prefix, create_venv=False, replace_datasets=True)  # the command named
    assert report.datasets[0]["outcome"] == "replaced"
    verify_prefix(prefix)


def test_an_install_that_fails_part_way_puts_the_swapped_folders_back_at_once(
    bundles: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up after the new dataset folder went into place: the install fails in one line, and the
    earlier install is whole at once (no journal left for a later command)."""
    from bundler.installer import install as installer

    prefix = tmp_path / "prefix"
    install(bundles["a"], prefix, create_venv=False)
    dataset = prefix / "datasets" / "alpaca_en_demo"
    before = {p.name: p.read_bytes() for p in dataset.iterdir()}

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(prefix / "datasets" / "dataset_info.json"))

    monkeypatch.setattr(installer, "merge_dataset_info", full)
    with pytest.raises(InsufficientSpaceError, match="ran out of disk space"):
        install(bundles["a2"], prefix, create_venv=False, replace_datasets=True)
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} == before
    assert not (prefix / ".ferry" / "journal.json").exists()
    verify_prefix(prefix)


# ------------------------------------------------------------------------------- offline look-ups, pickles


def test_refs_main_only_when_main_was_packed(hub_env, tmp_path: Path) -> None:
    """``hf:REPO@v1`` installs refs/v1 and no refs/main: huggingface_hub offline finds v1 and refuses "main"
    instead of silently loading v1."""
    out = tmp_path / "out"
    _pack(out, "tagged", [f"hf:{STORIES_REPO}@v1"], [])
    prefix = tmp_path / "prefix"
    install(out / "tagged.ferry.tar", prefix, create_venv=False)
    code = (
        "import sys; from huggingface_hub import snapshot_download; from huggingface_hub.errors import "
        "LocalEntryNotFoundError\n"
        f"print(snapshot_download({STORIES_REPO!r}, revision='v1'))\n"
        "try:\n"
        f"    snapshot_download({STORIES_REPO!r}, revision='main'); print('main: found')\n"
        "except LocalEntryNotFoundError:\n"
        "    print('main: not installed')\n"
    )
    proc = run_offline([sys.executable, "-c", code], env={**os.environ, **prefix_env(prefix)}, cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert Path(lines[-2]).is_dir() and lines[-1] == "main: not installed"
    refs = prefix / "hf-home" / "hub" / f"models--{STORIES_REPO.replace('/', '--')}" / "refs"
    assert sorted(p.name for p in refs.iterdir()) == ["v1"]


@pytest.mark.parametrize("name", ["model.pickle", "scaler.joblib", "weights.pkl"])
def test_pickle_and_joblib_follow_the_pickle_policy(name: str) -> None:
    with pytest.raises(SourceError, match=re.escape(name)):
        apply_safety(["config.json", name], allow_pickle=False, label="m")
    kept, _, _ = apply_safety(["config.json", name], allow_pickle=True, label="m")
    assert name in kept


def test_manifest_copy_and_digest_are_recorded(bundles: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    report = install(bundles["a"], prefix, create_venv=False)
    manifest = json.loads((bundles["out"] / "a" / "manifest.json").read_text())
    copy = json.loads((prefix / ".ferry" / "manifests" / f"{report.bundle_id}.json").read_text())
    assert copy == manifest
    state = json.loads((prefix / ".ferry" / "state.json").read_text())
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert state["bundles"][report.bundle_id]["manifest_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()


def test_content_id_equals_the_local_revision_of_the_same_files() -> None:
    from bundler.sources import local_revision

    files = [{"path": "b/c.json", "sha256": "1" * 64, "size": 1}, {"path": "a.txt", "sha256": "2" * 64, "size": 2}]
    assert content_id({"files": files}) == local_revision([(f["path"], f["sha256"]) for f in files])


def test_repacked_revision_name_with_other_content_is_a_replacement(bundles: dict, tmp_path: Path) -> None:
    """A ModelScope ``master`` packed again later names other bytes under the same revision name: the install
    compares content, not the name, so it is refused as other content (and replaced with --replace-datasets),
    never kept as "unchanged"."""
    prefix = tmp_path / "prefix"
    out = bundles["out"]
    install(out / "a.ferry.tar", prefix, create_venv=False)
    later = tmp_path / "a2"
    shutil.copytree(out / "a2", later)
    manifest = json.loads((later / "manifest.json").read_text())
    genuine = json.loads((out / "a" / "manifest.json").read_text())
    earlier_ds = next(i for i in genuine["items"] if i["kind"] == "dataset")
    item = manifest["items"][0]
    item["revision"] = earlier_ds["revision"]  # same revision name, other files
    resign(later, manifest)
    with pytest.raises(BundleError, match="other content"):
        install(later, prefix, create_venv=False)
    report = install(later, prefix, create_venv=False, replace_datasets=True)
    assert report.datasets[0]["outcome"] == "replaced"
    assert len(json.loads((prefix / "datasets" / "alpaca_en_demo" / "alpaca_en_demo.json").read_text())) == 5
