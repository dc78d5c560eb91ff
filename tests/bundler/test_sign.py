"""Signed bundles: ``ferry pack --sign KEY`` with keys made by the real ``ssh-keygen`` in the test, checked by
``ferry verify`` / ``ferry install`` / the bundle's ``install.py`` (bare python3, no network: ``unshare -rn``)
against an OpenSSH allowed_signers file, and a prefix policy that makes every later install require one.

The forged bundle is the attack signatures exist for: one weight changed, manifest.json and SHA256SUMS recomputed,
re-tarred. It passes ``ferry verify`` and ``sha256sum -c`` without a pinned signer, and is refused with one
line as soon as one is pinned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bundler.install import install
from bundler.installer.check import check_bundle
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify
from ferry.errors import BundleError, ConfigError, IntegrityError
from tests.support.helpers import ROOT
from tests.support.netns import run_offline

WEIGHTS = "models/local/stories260K/model.safetensors"


def _keygen(folder: Path, name: str, comment: str) -> Path:
    key = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)], check=True)
    return key


def _allowed(path: Path, *entries: tuple[str, Path]) -> Path:
    path.write_text(
        "".join(
            f'{who} namespaces="ferry-bundle" {Path(str(key) + ".pub").read_text().strip()}\n' for who, key in entries
        )
    )
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> dict:
    """Keys of alice (the pinned signer) and mallory; bundles: ``signed`` (alice, tar + directory),
    ``split`` (alice, 400 kB volumes), ``unsigned``, ``mallory`` (signed by mallory)."""
    root = tmp_path_factory.mktemp("sign")
    alice = _keygen(root, "alice", "alice@bank.example")
    mallory = _keygen(root, "mallory", "mallory@evil.example")
    allowed = _allowed(root / "allowed_signers", ("alice@bank.example", alice))
    out = root / "out"

    def make(name: str, key: Path | None, **flags) -> Path:
        spec = load_spec(
            name=name,
            models=[str(stories_model)],
            datasets=[str(llamafactory_data / "alpaca_en_demo.json")],
            no_wheels=True,
            **flags,
        )
        pack(spec, out, progress=False, sign=key)
        return out / name

    return {
        "root": root,
        "alice": alice,
        "mallory": mallory,
        "allowed": allowed,
        "out": out,
        "signed": make("signed", alice),
        "split": make("split", alice, split_size="400kB"),
        "unsigned": make("unsigned", None),
        "mallory_signed": make("evil", mallory),
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _forge(bundle_dir: Path, dest_folder: Path) -> tuple[Path, Path]:
    """The attack: copy the bundle, change one weight byte, recompute manifest.json and SHA256SUMS (as a
    forger would, with sha256sum), re-tar with GNU tar. Returns (forged directory, forged archive)."""
    dest_folder.mkdir(parents=True, exist_ok=True)
    forged = dest_folder / bundle_dir.name
    shutil.copytree(bundle_dir, forged)
    weights = forged / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    manifest = json.loads((forged / "manifest.json").read_text())
    for item in manifest["items"]:
        for entry in item["files"]:
            if f"{item['path']}/{entry['path']}" == WEIGHTS:
                entry["sha256"] = _sha256(bytes(data))
    (forged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    files = sorted(str(p.relative_to(forged)) for p in forged.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    sums = subprocess.run(["sha256sum", *files], cwd=forged, capture_output=True, text=True, check=True).stdout
    (forged / "SHA256SUMS").write_text(sums)
    archive = dest_folder / f"{bundle_dir.name}.ferry.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(dest_folder), bundle_dir.name], check=True)
    return forged, archive


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------------------------


def test_signed_pack_carries_the_signature_inside_and_beside(env: dict) -> None:
    bundle, out = env["signed"], env["out"]
    signature = (bundle / "manifest.json.sig").read_bytes()
    assert signature.startswith(b"-----BEGIN SSH SIGNATURE-----")
    assert (out / "signed.ferry.sig").read_bytes() == signature
    with tarfile.open(out / "signed.ferry.tar") as tar:
        names = tar.getnames()
        assert names[:3] == ["signed/manifest.json", "signed/manifest.json.sig", "signed/sbom.cdx.json"]
        assert tar.extractfile("signed/manifest.json").read() == (bundle / "manifest.json").read_bytes()
        assert tar.extractfile("signed/manifest.json.sig").read() == signature
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["signature"]["comment"] == "alice@bank.example"
    assert manifest["signature"]["key"].startswith("ED25519 key SHA256:")
    # anyone can check it by hand with OpenSSH, and coreutils still checks the directory
    proc = subprocess.run(
        [
            "ssh-keygen",
            "-Y",
            "verify",
            "-f",
            str(env["allowed"]),
            "-I",
            "alice@bank.example",
            "-n",
            "ferry-bundle",
            "-s",
            str(bundle / "manifest.json.sig"),
        ],
        stdin=open(bundle / "manifest.json", "rb"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "Good" in proc.stdout, proc.stderr
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=bundle, check=True)
    # an unsigned pack of the same name leaves no stale signature beside it
    assert not (out / "unsigned.ferry.sig").exists()


@pytest.mark.parametrize("form", ["directory", "tar", "volumes"])
def test_verify_names_the_signer(env: dict, form: str) -> None:
    target = {
        "directory": env["signed"],
        "tar": env["out"] / "signed.ferry.tar",
        "volumes": env["out"] / "split.ferry.tar.000",
    }[form]
    report = verify(target, allowed_signers=env["allowed"])
    assert report.signature["principal"] == "alice@bank.example"
    assert "signature good, by alice@bank.example" in report.summary()
    # without pinned signers a signed bundle verifies as before, and no signature is claimed checked
    assert verify(target).signature is None


def test_forged_bundle_passes_plain_checks_but_is_refused_with_a_pinned_signer(env: dict, tmp_path: Path) -> None:
    forged_dir, forged_tar = _forge(env["signed"], tmp_path / "forged")
    # the forgery works against the checks that do not pin a signer ...
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=forged_dir, check=True)
    verify(forged_dir)
    verify(forged_tar)
    # ... and is refused with one line once alice is pinned (directory, archive, the library and the CLI)
    for target in (forged_dir, forged_tar):
        with pytest.raises(IntegrityError) as exc:
            verify(target, allowed_signers=env["allowed"])
        assert "does not match its bytes" in _one_line(exc)
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "verify", "-q", str(forged_tar), "--allowed-signers", str(env["allowed"])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == IntegrityError.exit_code
    assert proc.stderr.count("\n") == 1 and "ferry: error: signature check failed" in proc.stderr, proc.stderr
    # installing it over a prefix is refused and installs nothing
    prefix = tmp_path / "prefix"
    with pytest.raises(IntegrityError):
        install(forged_tar, prefix, create_venv=False, allowed_signers=env["allowed"])
    assert not (prefix / "hf-home").exists() and not (prefix / ".ferry" / "allowed_signers").exists()


def test_forged_bundle_refused_by_bare_install_py_offline(env: dict, tmp_path: Path) -> None:
    """The isolated side: the forged bundle's own install.py, bare /usr/bin/python3 (no ferry), no network."""
    forged_dir, forged_tar = _forge(env["signed"], tmp_path / "forged")
    proc = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(forged_dir / "install.py"),
            "--bundle",
            str(forged_tar),
            "--prefix",
            str(tmp_path / "prefix"),
            "--no-venv",
            "--allowed-signers",
            str(env["allowed"]),
        ],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == IntegrityError.exit_code, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("install.py: error:")]
    assert len(errors) == 1 and "does not match its bytes" in errors[0], proc.stderr
    assert not (tmp_path / "prefix" / "hf-home").exists()
    # the genuine bundle installs with the same command
    genuine = env["out"] / "signed.ferry.tar"
    proc = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(env["signed"] / "install.py"),
            "--bundle",
            str(genuine),
            "--prefix",
            str(tmp_path / "prefix"),
            "--no-venv",
            "--allowed-signers",
            str(env["allowed"]),
        ],
        cwd=tmp_path,
    )
    assert "OK:" in proc.stdout
    assert (tmp_path / "prefix" / ".ferry" / "allowed_signers").read_bytes() == env["allowed"].read_bytes()


def test_verify_only_install_py_offline_names_the_signer_of_volumes(env: dict, tmp_path: Path) -> None:
    proc = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(env["split"] / "install.py"),
            "--verify-only",
            "--bundle",
            str(env["out"] / "split.ferry.tar.000"),
            "--allowed-signers",
            str(env["allowed"]),
        ],
        cwd=tmp_path,
    )
    assert "signature: good, by alice@bank.example" in proc.stdout


def test_wrong_signer_is_refused(env: dict, tmp_path: Path) -> None:
    target = env["out"] / "evil.ferry.tar"
    with pytest.raises(IntegrityError) as exc:
        verify(target, allowed_signers=env["allowed"])
    message = _one_line(exc)
    assert "not an allowed signer" in message and "wrong signer" in message
    with pytest.raises(IntegrityError, match="wrong signer"):
        install(target, tmp_path / "prefix", create_venv=False, allowed_signers=env["allowed"])
    # mallory's own allowed_signers accepts it: the key, not the file name, decides
    mine = _allowed(tmp_path / "mallory_signers", ("mallory@evil.example", env["mallory"]))
    assert verify(target, allowed_signers=mine).signature["principal"] == "mallory@evil.example"


def test_unsigned_bundle_is_refused_under_the_prefix_policy(env: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    # --require-signature needs signers
    with pytest.raises(BundleError, match="--allowed-signers"):
        install(env["out"] / "signed.ferry.tar", prefix, create_venv=False, require_signature=True)
    with pytest.raises(IntegrityError) as exc:
        install(env["out"] / "unsigned.ferry.tar", prefix, create_venv=False, allowed_signers=env["allowed"])
    assert "is not signed" in _one_line(exc)
    assert not (prefix / ".ferry" / "allowed_signers").exists()
    # the first signed install records the policy ...
    report = install(env["out"] / "signed.ferry.tar", prefix, create_venv=False, allowed_signers=env["allowed"])
    assert report.signature["principal"] == "alice@bank.example"
    assert (prefix / ".ferry" / "allowed_signers").read_bytes() == env["allowed"].read_bytes()
    state = (prefix / ".ferry" / "state.json").read_text()
    # ... and every later install into the prefix needs a signature by alice, without being told
    with pytest.raises(IntegrityError) as exc:
        install(env["out"] / "unsigned.ferry.tar", prefix, create_venv=False)
    assert "is not signed" in _one_line(exc)
    with pytest.raises(IntegrityError, match="wrong signer"):
        install(env["out"] / "evil.ferry.tar", prefix, create_venv=False)
    assert (prefix / ".ferry" / "state.json").read_text() == state
    # a different allowed_signers file does not silently replace the policy
    other = _allowed(tmp_path / "other", ("mallory@evil.example", env["mallory"]))
    with pytest.raises(BundleError, match="already pins its signers"):
        install(env["out"] / "evil.ferry.tar", prefix, create_venv=False, allowed_signers=other)
    # a signed bundle passes the policy on its own (volumes, no option)
    assert (
        install(env["out"] / "split.ferry.tar.000", prefix, create_venv=False).signature["principal"]
        == "alice@bank.example"
    )
    # install.py --require-signature on a prefix without a policy needs signers
    proc = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(env["signed"] / "install.py"),
            "--prefix",
            str(tmp_path / "new"),
            "--no-venv",
            "--require-signature",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == BundleError.exit_code and "--allowed-signers" in proc.stderr, proc.stderr
    # the bare install.py honours the policy too, offline
    proc = run_offline(
        ["/usr/bin/python3", "-I", str(env["unsigned"] / "install.py"), "--prefix", str(prefix), "--no-venv"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == IntegrityError.exit_code and "is not signed" in proc.stderr, proc.stderr


def test_reference_manifest_is_what_the_signature_must_cover(env: dict, tmp_path: Path) -> None:
    reference = tmp_path / "manifest.json"
    shutil.copy(env["signed"] / "manifest.json", reference)
    assert verify(env["out"] / "signed.ferry.tar", reference, allowed_signers=env["allowed"]).signature
    # same JSON, other bytes: the signature covers bytes, not a parse
    reference.write_text(json.dumps(json.loads(reference.read_text()), indent=1) + "\n")
    with pytest.raises(IntegrityError, match="does not match its bytes"):
        verify(env["out"] / "signed.ferry.tar", reference, allowed_signers=env["allowed"])


def test_missing_ssh_keygen_is_one_line_with_the_way_out(env: dict, tmp_path: Path, monkeypatch) -> None:
    """An isolated host without OpenSSH >= 8.2 (RHEL 8 has 8.0): one line that says what to do instead."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(BundleError) as exc:
        verify(env["out"] / "signed.ferry.tar", allowed_signers=env["allowed"])
    message = _one_line(exc)
    assert "OpenSSH >= 8.2" in message and "--manifest" in message and "ssh-keygen -Y verify" in message
    with pytest.raises(ConfigError, match="OpenSSH >= 8.1"):
        pack(
            load_spec(name="x", models=[str(env["signed"] / "models/local/stories260K")], no_wheels=True),
            tmp_path / "out",
            progress=False,
            sign=env["alice"],
        )


def test_a_bad_key_is_refused_before_packing(env: dict, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--sign"):
        pack(
            load_spec(name="x", models=[str(env["signed"] / "models/local/stories260K")], no_wheels=True),
            tmp_path / "out",
            progress=False,
            sign=env["allowed"],
        )
    assert not (tmp_path / "out" / "x").exists()


def test_passphrase_key_signs_through_ssh_agent(env: dict, tmp_path: Path, stories_model: Path) -> None:
    """A passphrase-protected key (as banks keep them) signs through a real ssh-agent, no prompt."""
    key = tmp_path / "release"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "a long passphrase", "-C", "release@bank.example", "-f", str(key)],
        check=True,
    )
    askpass = tmp_path / "askpass.sh"
    askpass.write_text("#!/bin/sh\necho 'a long passphrase'\n")
    askpass.chmod(0o700)
    agent = subprocess.run(
        ["ssh-agent", "-s", "-a", str(tmp_path / "agent.sock")], capture_output=True, text=True, check=True
    ).stdout
    pid = int(re.search(r"SSH_AGENT_PID=(\d+)", agent).group(1))
    try:
        agent_env = {**os.environ, "SSH_AUTH_SOCK": str(tmp_path / "agent.sock")}
        subprocess.run(
            ["ssh-add", str(key)],
            env={**agent_env, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=True,
        )
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
            pack(
                load_spec(name="agent", models=[str(stories_model)], no_wheels=True),
                tmp_path / "out",
                progress=False,
                sign=key,
            )
    finally:
        os.kill(pid, 15)
    allowed = _allowed(tmp_path / "allowed", ("release@bank.example", key))
    assert (
        verify(tmp_path / "out" / "agent.ferry.tar", allowed_signers=allowed).signature["principal"]
        == "release@bank.example"
    )


def test_bad_signature_is_refused_from_the_head_before_the_payload_is_read(env: dict, tmp_path: Path) -> None:
    """verify/install check the signature from the metadata head first: a wrongly signed bundle whose payload
    is also cut in half is refused for its signer (the payload is never read), in one line."""
    cut = tmp_path / "evil.ferry.tar"
    data = (env["out"] / "evil.ferry.tar").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError) as exc:
        verify(cut, allowed_signers=env["allowed"])
    assert "wrong signer" in _one_line(exc)
    with pytest.raises(IntegrityError, match="wrong signer"):
        install(cut, tmp_path / "prefix", create_venv=False, allowed_signers=env["allowed"])
    assert not (tmp_path / "prefix").exists()  # refused before the prefix was even created
    # without a signer to check, the same file fails for what it is: truncated
    with pytest.raises(IntegrityError, match="truncated or corrupt"):
        verify(cut)


@pytest.mark.parametrize("name, reason", [("unsigned", "is not signed"), ("evil", "wrong signer")])
def test_the_check_after_the_scan_refuses_on_its_own(env: dict, name: str, reason: str) -> None:
    """The check that counts runs on the bytes the scan read (what install.py does; no head pre-check)."""
    for target in (env["out"] / f"{name}.ferry.tar", env["out"] / name):
        with pytest.raises(IntegrityError) as exc:
            check_bundle(target, allowed_signers=env["allowed"])
        assert reason in _one_line(exc)


def test_metadata_that_outgrows_the_reserved_head_goes_last_and_the_bundle_stays_valid(
    tmp_path: Path, stories_model: Path, monkeypatch
) -> None:
    """Should the size bound ever be wrong, pack still writes a valid bundle (metadata at the end, a warning)."""
    from bundler.inspect import inspect
    from bundler.pack import _MetadataHead
    from bundler.writer import head_bound

    monkeypatch.setattr(_MetadataHead, "bound", lambda self: head_bound(self.spec.name, [0]))
    with pytest.warns(RuntimeWarning, match="outgrew the head"):
        result = pack(
            load_spec(name="tiny", models=[str(stories_model)], no_wheels=True),
            tmp_path / "out",
            progress=False,
            sign=_keygen(tmp_path, "k", "k@x"),
        )
    with tarfile.open(result.archives[0]) as tar:
        names = tar.getnames()
    assert names[-4:] == ["tiny/manifest.json", "tiny/manifest.json.sig", "tiny/sbom.cdx.json", "tiny/SHA256SUMS"]
    allowed = _allowed(tmp_path / "allowed", ("k@x", tmp_path / "k"))
    assert verify(result.archives[0], allowed_signers=allowed).signature["principal"] == "k@x"
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=result.bundle_dir, check=True)
    with pytest.raises(BundleError, match="not among the first members"):
        inspect(result.archives[0])
