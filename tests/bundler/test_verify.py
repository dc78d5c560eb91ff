"""``ferry verify`` on directories, archives and volumes; the CLI; install.py on every CPython of this host; the
installer's rules for repo ids and revisions against huggingface_hub's and git's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.installer.fields import REPO_ID_REGEX, check_ref_name, check_repo_id
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import VerifyReport, verify
from ferry.errors import BundleError, IntegrityError, UnsafeArchiveError
from tests.support.helpers import ROOT


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> Path:
    """OUT holding bundle ``v`` (directory + tar) and bundle ``s`` (volumes of 256 KiB)."""
    out = tmp_path_factory.mktemp("verify")
    pack(
        load_spec(name="v", models=[str(stories_model)], datasets=[str(llamafactory_data)], no_wheels=True),
        out,
        progress=False,
    )
    pack(load_spec(name="s", models=[str(stories_model)], no_wheels=True, split_size="256KiB"), out, progress=False)
    return out


def test_directory_archive_and_volumes_verify(out: Path) -> None:
    manifest = json.loads((out / "v" / "manifest.json").read_text())
    content = sum(f["size"] for item in manifest["items"] for f in item["files"])
    content += sum(f["size"] for f in manifest["support_files"])
    n_files = sum(len(item["files"]) for item in manifest["items"]) + len(manifest["support_files"]) + 2
    for bundle in (out / "v", out / "v.ferry.tar"):
        report = verify(bundle)
        assert isinstance(report, VerifyReport)
        assert (report.name, report.bundle_id, report.items) == ("v", manifest["bundle_id"], 2)
        assert report.files_checked == n_files
        assert report.bytes_checked == content
        assert report.problems == []
    volumes = sorted(out.glob("s.ferry.tar.*"))
    assert len(volumes) > 3
    report = verify(volumes[0])
    assert report.name == "s" and report.bytes_checked > 1_000_000


def test_reference_manifest(out: Path, tmp_path: Path) -> None:
    reference = tmp_path / "manifest.json"
    shutil.copy(out / "v" / "manifest.json", reference)
    assert verify(out / "v.ferry.tar", reference).reference == reference
    with pytest.raises(IntegrityError) as info:
        verify(out / "s.ferry.tar.000", reference)  # another bundle
    message = str(info.value)
    assert "differs from the reference manifest" in message
    assert "missing: datasets/local/llamafactory/dataset_info.json" in message


def test_every_problem_is_listed_together(out: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "v"
    shutil.copytree(out / "v", bundle)
    model = bundle / "models" / "local" / "stories260K"
    (model / "generation_config.json").unlink()
    with open(model / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    (bundle / "notes.txt").write_text("hello")
    with pytest.raises(IntegrityError) as info:
        verify(bundle)
    problems = info.value.problems
    assert "missing: models/local/stories260K/generation_config.json" in problems
    assert any(p.startswith("truncated: models/local/stories260K/model.safetensors (1000 of ") for p in problems)
    assert "extra file: notes.txt (not in the manifest)" in problems


def test_cli_verify_exit_codes(out: Path, tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "ferry", "verify", "-q", str(out / "v.ferry.tar")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK: v ")
    bundle = tmp_path / "v"
    shutil.copytree(out / "v", bundle)
    (bundle / "datasets" / "local" / "llamafactory" / "c4_demo.jsonl").write_text("{}\n")
    bad = subprocess.run(
        [sys.executable, "-m", "ferry", "verify", "-q", str(bundle)], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == IntegrityError.exit_code
    assert bad.stderr.startswith("ferry: error: bundle")
    assert "datasets/local/llamafactory/c4_demo.jsonl" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "ferry", "verify", str(tmp_path / "nothing.txt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert missing.returncode != 0


def test_not_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "file.zip").write_bytes(b"PK")
    with pytest.raises(BundleError, match="not a bundle"):
        verify(tmp_path / "file.zip")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        verify(tmp_path / "empty")


def test_install_py_verify_only(out: Path) -> None:
    proc = subprocess.run(
        ["/usr/bin/python3", "-I", str(out / "v" / "install.py"), "--verify-only"],
        capture_output=True,
        text=True,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: ")
    assert "verify: 100%" in proc.stderr


def test_repo_id_regex_is_huggingface_hubs() -> None:
    """The installer's stdlib copy of huggingface_hub's REPO_ID_REGEX (a third-party rule it cannot import)."""
    from huggingface_hub.utils import _validators

    assert REPO_ID_REGEX.pattern == _validators.REPO_ID_REGEX.pattern
    assert REPO_ID_REGEX.flags == _validators.REPO_ID_REGEX.flags


def _bare_pythons() -> list[str]:
    """Every CPython >= 3.10 on this host (install.py must run on each with the standard library only)."""
    found = {}
    for name in ("/usr/bin/python3", "python3.10", "python3.11", "python3.12", "python3.13", "python3.14"):
        path = shutil.which(name)
        if not path:
            continue
        proc = subprocess.run(
            [path, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if proc.returncode == 0 and tuple(map(int, proc.stdout.split("."))) >= (3, 10):
            found.setdefault(proc.stdout.strip(), path)
    return sorted(found.values())


def test_install_py_runs_on_every_python(out: Path, tmp_path: Path) -> None:
    pythons = _bare_pythons()
    assert "/usr/bin/python3" in pythons
    for python in pythons:
        ok = subprocess.run(
            [
                python,
                "-I",
                str(out / "v" / "install.py"),
                "--bundle",
                str(out / "s.ferry.tar.000"),
                "--prefix",
                str(tmp_path / python.replace("/", "_")),
                "--no-venv",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert ok.returncode == 0, (python, ok.stderr)
        assert (tmp_path / python.replace("/", "_") / "hf-home" / "hub" / "models--local--stories260K").is_dir()
        bad = subprocess.run(
            [
                python,
                "-I",
                str(out / "v" / "install.py"),
                "--bundle",
                str(out / "v"),
                "--manifest",
                str(out / "s" / "manifest.json"),
                "--verify-only",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert bad.returncode == IntegrityError.exit_code, (python, bad.stderr)
        assert "differs from the reference manifest" in bad.stderr


@pytest.mark.parametrize(
    "repo_id",
    [
        "org/name",
        "name",
        "Org-1/n.a_m-e",
        "a" * 96,
        "org/" + "b" * 96,
        "org/",
        "/name",
        "org//name",
        "org/name/x",
        "org/../x",
        "..",
        "a--b",
        "x.git",
        "-x",
        "x-",
        ".x",
        "café",
        "a" * 97,
        "org/na me",
        "",
    ],
)
def test_repo_id_rule_agrees_with_huggingface_hub(repo_id: str) -> None:
    """install.py's stdlib copy of the rule accepts exactly what huggingface_hub's validate_repo_id accepts."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        hub_ok = True
    except HFValidationError:
        hub_ok = False
    try:
        check_repo_id(repo_id, "repo_id")
        ours = True
    except UnsafeArchiveError:
        ours = False
    assert ours == hub_ok, repo_id


@pytest.mark.parametrize(
    "ref",
    [
        "main",
        "v1.0",
        "refs/pr/1",
        "feature/x-y",
        "a" * 40,
        "release-2024.11",
        "../x",
        "/main",
        "main/",
        "a//b",
        "a..b",
        ".hidden",
        "x.lock",
        "a b",
        "a~1",
        "a^",
        "a:b",
        "a?",
        "a*",
        "a[",
        "a\\\\b",
        "@",
        "a@{1}",
        "main.",
        "a\\nb",
        "",
        "x/.y",
    ],
)
def test_ref_name_rule_agrees_with_git(ref: str, tmp_path: Path) -> None:
    """check_ref_name accepts exactly what ``git check-ref-format --allow-onelevel`` accepts."""
    git = subprocess.run(["git", "check-ref-format", "--allow-onelevel", ref], capture_output=True)
    try:
        check_ref_name(ref, "revision")
        ours = True
    except UnsafeArchiveError:
        ours = False
    assert ours == (git.returncode == 0), ref
