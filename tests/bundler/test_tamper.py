"""Tampered and malicious bundles: every case fails verify and install with a message naming the culprit,
and nothing lands outside the staging area.

Bundles are built by the real ``bundler.pack`` from the real stories260K model and the alpaca demo file;
malicious archives are the real bundle's tar with one crafted member inserted in front.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from bundler.format import FORMAT_VERSION
from bundler.install import install
from bundler.installer.hashing import size_and_sha256
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify
from ferry.errors import BundleError, IntegrityError, UnsafeArchiveError
from tests.support.helpers import LLAMAFACTORY_DATA, STORIES_MODEL, resign

NAME = "tamper"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, stories_model: Path, llamafactory_data: Path) -> Path:
    """OUT with ``tamper/`` and ``tamper.ferry.tar`` (pristine; copy before use)."""
    out = tmp_path_factory.mktemp("packed")
    spec = load_spec(
        name=NAME,
        models=[str(stories_model)],
        datasets=[str(llamafactory_data / "alpaca_en_demo.json")],
        no_wheels=True,
    )
    pack(spec, out, progress=False)
    return out


@pytest.fixture(scope="module")
def packed_split(tmp_path_factory: pytest.TempPathFactory, stories_model: Path) -> Path:
    """OUT with ``tamper.ferry.tar.000`` .. ``.NNN`` (400 kB volumes) and ``tamper.ferry.sha256``."""
    out = tmp_path_factory.mktemp("packed-split")
    spec = load_spec(name=NAME, models=[str(stories_model)], no_wheels=True, split_size="400kB")
    pack(spec, out, progress=False)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _bundle_files() -> list[str]:
    """Every file of the pristine bundle directory (content, install.py, manifest.json, SHA256SUMS)."""
    files = (
        [f"models/local/stories260K/{p.name}" for p in sorted(STORIES_MODEL.iterdir())]
        if STORIES_MODEL.exists()
        else []
    )
    if LLAMAFACTORY_DATA.exists():
        files.append("datasets/local/alpaca_en_demo/alpaca_en_demo.json")
    return files + ["install.py", "manifest.json", "SHA256SUMS"]


def _assert_nothing_installed(prefix: Path, tmp_path: Path) -> None:
    """Only the lock folder may exist in the prefix; no staging left; nothing escaped into tmp_path."""
    if prefix.exists():
        assert sorted(p.name for p in prefix.iterdir()) in ([], [".ferry"]), list(prefix.iterdir())
        assert not (prefix / ".ferry" / "state.json").exists()
    assert not list(tmp_path.rglob("escaped*"))


@pytest.mark.parametrize("rel", _bundle_files())
def test_flipped_byte_in_any_file_names_it(packed: Path, tmp_path: Path, rel: str) -> None:
    bundle = _copy(packed / NAME, tmp_path / NAME)
    _flip(bundle / rel)
    with pytest.raises((IntegrityError, BundleError)) as info:
        verify(bundle)
    assert rel.rsplit("/", 1)[-1] in str(info.value)
    prefix = tmp_path / "prefix"
    with pytest.raises((IntegrityError, BundleError)) as info:
        install(bundle, prefix, create_venv=False)
    assert rel.rsplit("/", 1)[-1] in str(info.value)
    _assert_nothing_installed(prefix, tmp_path)


def test_flipped_byte_inside_archive_member(packed: Path, tmp_path: Path) -> None:
    archive = tmp_path / f"{NAME}.ferry.tar"
    shutil.copy(packed / f"{NAME}.ferry.tar", archive)
    with tarfile.open(archive) as tar:
        member = tar.getmember(f"{NAME}/models/local/stories260K/model.safetensors")
    _flip(archive, member.offset_data + member.size // 3)
    with pytest.raises(IntegrityError, match="sha256 mismatch: models/local/stories260K/model.safetensors"):
        verify(archive)
    prefix = tmp_path / "prefix"
    with pytest.raises(IntegrityError, match="model.safetensors"):
        install(archive, prefix, create_venv=False)
    _assert_nothing_installed(prefix, tmp_path)


def test_truncated_volume_is_named(packed_split: Path, tmp_path: Path) -> None:
    out = _copy(packed_split, tmp_path / "out")
    volumes = sorted(out.glob(f"{NAME}.ferry.tar.0*"))
    assert len(volumes) >= 3
    victim = volumes[1]
    victim.write_bytes(victim.read_bytes()[:-1000])
    with pytest.raises(IntegrityError) as info:
        verify(volumes[0])
    assert victim.name in str(info.value)
    prefix = tmp_path / "prefix"
    with pytest.raises(IntegrityError, match=victim.name.replace(".", r"\.")):
        install(volumes[0], prefix, create_venv=False)
    _assert_nothing_installed(prefix, tmp_path)


def test_truncated_volume_is_named_without_the_sums_file(packed_split: Path, tmp_path: Path) -> None:
    """NAME.ferry.sha256 did not come across: the split's sizes still name the short volume, and the position
    names the volume being read with an offset inside it."""
    out = _copy(packed_split, tmp_path / "out")
    (out / f"{NAME}.ferry.sha256").unlink()
    volumes = sorted(out.glob(f"{NAME}.ferry.tar.0*"))
    victim = volumes[1]
    victim.write_bytes(victim.read_bytes()[:-1000])
    with pytest.raises(IntegrityError) as info:
        verify(volumes[0])
    message = str(info.value)
    assert f"volume {victim.name} is {victim.stat().st_size} bytes" in message and "truncated" in message
    where = message.split(" at byte ")[1].split(":")[0]  # 'N of NAME.ferry.tar.00K'
    offset, volume = int(where.split(" of ")[0]), out / where.split(" of ")[1]
    assert volume in volumes and 0 <= offset <= volume.stat().st_size


def _volume_lines(message: str) -> list[str]:
    return [line.strip() for line in message.splitlines() if line.strip().startswith("volume ")]


def test_each_broken_volume_is_named_once_first_and_no_sound_one_is_blamed(packed_split: Path, tmp_path: Path) -> None:
    """.000 is the small metadata head, not the split size: a flipped byte in a data volume is one line naming that
    volume (none about the sizes of the sound ones), and a truncated volume is named first, once, in one line
    that gives both its size against the split size and its sha256."""
    out = _copy(packed_split, tmp_path / "flipped")
    volumes = sorted(out.glob(f"{NAME}.ferry.tar.0*"))
    assert len(volumes) >= 4 and volumes[0].stat().st_size < volumes[1].stat().st_size  # the head is small
    _flip(volumes[2])
    with pytest.raises(IntegrityError) as info:
        verify(volumes[0])
    lines = _volume_lines(str(info.value))
    assert lines == [
        f"volume {volumes[2].name} ({volumes[2].stat().st_size} bytes) does not match its sha256 in "
        f"{NAME}.ferry.sha256: truncated or altered"
    ], str(info.value)
    assert str(info.value).split("\n")[1].strip() == lines[0]  # the culprit comes first

    out = _copy(packed_split, tmp_path / "truncated")
    volumes = sorted(out.glob(f"{NAME}.ferry.tar.0*"))
    victim, split = volumes[-2], volumes[1].stat().st_size
    victim.write_bytes(victim.read_bytes()[:-5000])
    with pytest.raises(IntegrityError) as info:
        verify(volumes[0])
    first = str(info.value).split("\n")[1].strip()
    assert first == (
        f"volume {victim.name} is {split - 5000} bytes where the split size is {split} (truncated) and does not "
        f"match its sha256 in {NAME}.ferry.sha256"
    ), str(info.value)
    assert _volume_lines(str(info.value)) == [first]


def test_truncated_last_volume_is_named(packed_split: Path, tmp_path: Path) -> None:
    out = _copy(packed_split, tmp_path / "out")
    last = sorted(out.glob(f"{NAME}.ferry.tar.0*"))[-1]
    last.write_bytes(last.read_bytes()[: len(last.read_bytes()) // 2])
    with pytest.raises(IntegrityError) as info:
        verify(out / f"{NAME}.ferry.tar.000")
    assert last.name in str(info.value)


def test_missing_volume_is_named(packed_split: Path, tmp_path: Path) -> None:
    out = _copy(packed_split, tmp_path / "out")
    (out / f"{NAME}.ferry.tar.001").unlink()
    with pytest.raises(BundleError, match=rf"{NAME}\.ferry\.tar\.001"):
        verify(out / f"{NAME}.ferry.tar.000")
    prefix = tmp_path / "prefix"
    with pytest.raises(BundleError, match=rf"{NAME}\.ferry\.tar\.001"):
        install(out / f"{NAME}.ferry.tar.000", prefix, create_venv=False)
    _assert_nothing_installed(prefix, tmp_path)


def test_extra_file_in_directory_is_named(packed: Path, tmp_path: Path) -> None:
    bundle = _copy(packed / NAME, tmp_path / NAME)
    (bundle / "models" / "local" / "stories260K" / "backdoor.py").write_text("import os\n")
    with pytest.raises(IntegrityError, match=r"extra file: models/local/stories260K/backdoor\.py"):
        verify(bundle)


def _rewrite(
    src: Path,
    dst: Path,
    first: list[tuple[tarfile.TarInfo, bytes | None]],
    last: list[tuple[tarfile.TarInfo, bytes | None]] = (),
) -> Path:
    """Copy the tar ``src`` to ``dst`` with crafted members before and after the real ones."""
    with tarfile.open(src) as old, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as new:
        for info, data in first:
            new.addfile(info, io.BytesIO(data) if data is not None else None)
        for member in old:
            new.addfile(member, old.extractfile(member) if member.isreg() else None)
        for info, data in last:
            new.addfile(info, io.BytesIO(data) if data is not None else None)
    return dst


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    if data is not None:
        info.size = len(data)
    return info, data


def test_extra_member_in_archive_is_named(packed: Path, tmp_path: Path) -> None:
    archive = _rewrite(
        packed / f"{NAME}.ferry.tar",
        tmp_path / f"{NAME}.ferry.tar",
        [],
        [_member(f"{NAME}/datasets/extra.json", data=b"[]")],
    )
    with pytest.raises(IntegrityError, match=r"extra file: datasets/extra\.json"):
        verify(archive)


def _evil_cases(tmp_path: Path) -> dict[str, list[tuple]]:
    outside = tmp_path / "escaped-dir"
    return {
        "dotdot": [_member(f"{NAME}/../../../escaped.txt", data=b"x")],
        "dotdot-top": [_member("../escaped.txt", data=b"x")],
        "absolute": [_member(str(tmp_path / "escaped-abs.txt"), data=b"x")],
        "symlink-etc": [
            _member(f"{NAME}/models/etc", tarfile.SYMTYPE, link="/etc"),
            _member(f"{NAME}/models/etc/escaped", data=b"x"),
        ],
        "symlink-dotdot": [
            _member(f"{NAME}/models/up", tarfile.SYMTYPE, link="../../.."),
            _member(f"{NAME}/models/up/escaped.txt", data=b"x"),
        ],
        "symlink-outside": [_member(f"{NAME}/out", tarfile.SYMTYPE, link=str(outside))],
        "hardlink-outside": [_member(f"{NAME}/passwd", tarfile.LNKTYPE, link="/etc/passwd")],
        "hardlink-dotdot": [_member(f"{NAME}/up", tarfile.LNKTYPE, link="../escaped.txt")],
        "device": [_member(f"{NAME}/null", tarfile.CHRTYPE)],
        "block-device": [_member(f"{NAME}/sda", tarfile.BLKTYPE)],
        "fifo": [_member(f"{NAME}/fifo", tarfile.FIFOTYPE)],
        "duplicate": [_member(f"{NAME}/install.py", data=b"print('evil')\n")],
    }


@pytest.mark.parametrize(
    "case",
    [
        "dotdot",
        "dotdot-top",
        "absolute",
        "symlink-etc",
        "symlink-dotdot",
        "symlink-outside",
        "hardlink-outside",
        "hardlink-dotdot",
        "device",
        "block-device",
        "fifo",
        "duplicate",
    ],
)
def test_malicious_archive_is_refused(packed: Path, tmp_path: Path, case: str) -> None:
    first = _evil_cases(tmp_path)[case]
    evil_name = first[0][0].name
    if case == "duplicate":  # the crafted copy comes after the real install.py
        archive = _rewrite(packed / f"{NAME}.ferry.tar", tmp_path / f"{NAME}.ferry.tar", [], first)
    else:
        archive = _rewrite(packed / f"{NAME}.ferry.tar", tmp_path / f"{NAME}.ferry.tar", first)
    with pytest.raises(UnsafeArchiveError) as info:
        verify(archive)
    assert evil_name in str(info.value)
    prefix = tmp_path / "prefix"
    with pytest.raises(UnsafeArchiveError) as info:
        install(archive, prefix, create_venv=False)
    assert evil_name in str(info.value)
    _assert_nothing_installed(prefix, tmp_path)
    assert not (tmp_path / "escaped-dir").exists()


def test_link_inside_bundle_is_an_extra_file(packed: Path, tmp_path: Path) -> None:
    archive = _rewrite(
        packed / f"{NAME}.ferry.tar",
        tmp_path / f"{NAME}.ferry.tar",
        [_member(f"{NAME}/models/alias", tarfile.SYMTYPE, link="local/stories260K")],
    )
    with pytest.raises(IntegrityError, match=r"extra file: models/alias \(a link"):
        verify(archive)


def test_newer_format_version_says_upgrade(packed: Path, tmp_path: Path) -> None:
    bundle = _copy(packed / NAME, tmp_path / NAME)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    resign(bundle, manifest)
    with pytest.raises(BundleError, match=f"format_version {FORMAT_VERSION + 1} is newer.*upgrade ferry"):
        verify(bundle)
    prefix = tmp_path / "prefix"
    with pytest.raises(BundleError, match="upgrade ferry"):
        install(bundle, prefix, create_venv=False)
    _assert_nothing_installed(prefix, tmp_path)


def test_reference_manifest_detects_a_resigned_bundle(packed: Path, tmp_path: Path) -> None:
    """An attacker who alters a file and re-signs manifest.json + SHA256SUMS is caught by a manifest carried
    over a separate channel."""
    reference = tmp_path / "reference-manifest.json"
    shutil.copy(packed / NAME / "manifest.json", reference)
    bundle = _copy(packed / NAME, tmp_path / NAME)
    config = bundle / "models/local/stories260K/config.json"
    config.write_text(config.read_text().replace("512", "513"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    for item in manifest["items"]:
        for entry in item["files"]:
            if entry["path"] == "config.json":
                entry["size"], entry["sha256"] = size_and_sha256(config)
    resign(bundle, manifest)
    sums = (bundle / "SHA256SUMS").read_text().splitlines()
    size, digest = size_and_sha256(config)
    sums = [
        f"{digest}  models/local/stories260K/config.json" if line.endswith("stories260K/config.json") else line
        for line in sums
    ]
    (bundle / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    verify(bundle)  # self-consistent
    with pytest.raises(IntegrityError) as info:
        verify(bundle, reference)
    message = str(info.value)
    assert "differs from the reference manifest" in message
    assert "sha256 mismatch: models/local/stories260K/config.json" in message


def test_install_py_refuses_tampered_bundle_with_bare_python(packed: Path, tmp_path: Path) -> None:
    """The bundle's own install.py (no ferry importable: its look-alike errors) exits with IntegrityError's
    code and names the file."""
    bundle = _copy(packed / NAME, tmp_path / NAME)
    _flip(bundle / "models/local/stories260K/tokenizer.json")
    proc = subprocess.run(
        ["/usr/bin/python3", "-I", str(bundle / "install.py"), "--prefix", str(tmp_path / "prefix"), "--no-venv"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )
    assert proc.returncode == IntegrityError.exit_code, proc.stderr
    assert "sha256 mismatch: models/local/stories260K/tokenizer.json" in proc.stderr
    _assert_nothing_installed(tmp_path / "prefix", tmp_path)
