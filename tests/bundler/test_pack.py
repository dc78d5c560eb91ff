"""``ferry pack`` end to end: local sources, a real olah hub, resume, safety rules, volumes, atomicity."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bundler.format import INSTALLER_NAME, MANIFEST_NAME, SUMS_NAME
from bundler.pack import pack
from bundler.spec import PackSpec, load_spec
from ferry.cli import main as ferry_main
from ferry.errors import InsufficientSpaceError, SourceError
from tests.support.helpers import ALPACA_REPO, STORIES_REPO


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tar_members(paths: list[Path]) -> list[tarfile.TarInfo]:
    """Members of the tar stream made of ``paths`` concatenated (one file or volumes)."""
    stream = b"".join(p.read_bytes() for p in paths)
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r:") as tar:
        return tar.getmembers()


def extract(paths: list[Path], dest: Path) -> None:
    """Extract with GNU tar from the concatenated stream, as a user would (``cat NAME.ferry.tar.* | tar x``)."""
    dest.mkdir(parents=True, exist_ok=True)
    cat = subprocess.Popen(["cat", *map(str, paths)], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=cat.stdout, check=True)
    assert cat.wait() == 0


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_pack_local_writes_layout_hashes_and_archive(tmp_path, stories_model, llamafactory_data):
    spec = load_spec(
        name="kit",
        models=[str(stories_model)],
        datasets=[str(llamafactory_data / "alpaca_en_demo.json")],
        no_wheels=True,
    )
    result = pack(spec, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    bundle = out / "kit"
    assert result.bundle_dir == bundle and result.archives == [out / "kit.ferry.tar"]

    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1 and manifest["name"] == "kit"
    model, dataset = manifest["items"]
    assert (model["kind"], model["source"], model["repo_id"], model["path"]) == (
        "model",
        "local",
        "local/stories260K",
        "models/local/stories260K",
    )
    assert len(model["revision"]) == 40 and model["trust_remote_code"] is False
    expected = {p.name: sha256(p) for p in stories_model.iterdir() if p.is_file()}
    assert {f["path"]: f["sha256"] for f in model["files"]} == expected
    assert {f["path"]: f["size"] for f in model["files"]} == {p.name: p.stat().st_size for p in stories_model.iterdir()}
    assert dataset["files"] == [
        {
            "path": "alpaca_en_demo.json",
            "size": (llamafactory_data / "alpaca_en_demo.json").stat().st_size,
            "sha256": sha256(llamafactory_data / "alpaca_en_demo.json"),
        }
    ]
    assert (
        result.hashed_bytes
        == result.content_bytes
        == sum(f.stat().st_size for f in stories_model.iterdir())
        + (llamafactory_data / "alpaca_en_demo.json").stat().st_size
    )

    # coreutils can check the bundle without ferry; a single tar has no archive checksum file (the manifest
    # inside it covers every byte of content; volumes get NAME.ferry.sha256, see the split test)
    subprocess.run(["sha256sum", "--quiet", "-c", SUMS_NAME], cwd=bundle, check=True)
    assert result.sums_path is None and not (out / "kit.ferry.sha256").exists()
    sums_listed = {line.split("  ", 1)[1] for line in (bundle / SUMS_NAME).read_text().splitlines()}
    assert sums_listed == set(tree(bundle)) - {SUMS_NAME}

    # the archive holds exactly the directory; manifest and SBOM come first (ferry inspect reads only them),
    # SHA256SUMS last
    names = [m.name for m in tar_members(result.archives)]
    assert names[:2] == ["kit/manifest.json", "kit/sbom.cdx.json"] and names[-1] == f"kit/{SUMS_NAME}"
    if (bundle / INSTALLER_NAME).exists():
        assert names[-2] == f"kit/{INSTALLER_NAME}"
    extract(result.archives, tmp_path / "x")
    assert tree(tmp_path / "x" / "kit") == tree(bundle)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_pack_from_hub_by_repo_id(tmp_path, hub_env, stories_model, llamafactory_data):
    spec = load_spec(name="hubkit", models=[f"hf:{STORIES_REPO}"], datasets=[f"hf:{ALPACA_REPO}@main"], no_wheels=True)
    result = pack(spec, tmp_path / "out", progress=False)
    model, dataset = result.manifest["items"]
    assert model["repo_id"] == STORIES_REPO and model["source"] == "hf"
    assert model["revision"] == hub_env.commits[f"models/{STORIES_REPO}"]  # resolved to the git commit
    assert model["revision_requested"] is None and model["license"] == "mit"
    assert model["path"] == f"models/hf/{STORIES_REPO}"
    files = {f["path"]: f["sha256"] for f in model["files"]}
    assert (
        files.pop("README.md")
        == hashlib.sha256((hub_env.mirrors / "models" / STORIES_REPO / "README.md").read_bytes()).hexdigest()
    )
    assert files == {p.name: sha256(p) for p in stories_model.iterdir()}
    assert dataset["revision"] == hub_env.commits[f"datasets/{ALPACA_REPO}"]
    assert dataset["revision_requested"] == "main"
    repo_files = [f for f in dataset["files"] if not f["path"].startswith(".ferry-datasets-cache/")]
    assert repo_files == [f for f in dataset["files"] if f["path"] == "alpaca_en_demo.json"]
    assert repo_files[0]["sha256"] == sha256(llamafactory_data / "alpaca_en_demo.json")
    # the rest is the datasets Arrow cache built from the downloaded files (tests/bundler/test_hub_datasets.py)
    arrow = sum(f["size"] for f in dataset["files"]) - repo_files[0]["size"]
    assert arrow > 0 and result.downloaded_bytes == result.content_bytes - arrow
    subprocess.run(["sha256sum", "--quiet", "-c", SUMS_NAME], cwd=result.bundle_dir, check=True)


def test_pack_resolves_a_tag_to_its_commit(tmp_path, hub_env):
    spec = load_spec(name="tagged", models=[f"hf:{STORIES_REPO}@v1"], no_wheels=True)
    item = pack(spec, tmp_path / "out", progress=False).manifest["items"][0]
    assert item["revision_requested"] == "v1"
    assert item["revision"] == hub_env.commits[f"models/{STORIES_REPO}"]


def test_second_pack_reuses_downloads_and_hash_cache(tmp_path, hub_env):
    spec = load_spec(name="again", models=[f"hf:{STORIES_REPO}"], no_wheels=True)
    first = pack(spec, tmp_path / "out", progress=False)
    assert first.hashed_bytes == first.content_bytes > 1_000_000
    cached = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / ".ferry-cache" / "hf").rglob("*.safetensors")}
    gets = hub_env.requests_for(f'"GET /{STORIES_REPO}/resolve/')

    second = pack(spec, tmp_path / "out", progress=False)
    assert second.downloaded_bytes == 0 and hub_env.requests_for(f'"GET /{STORIES_REPO}/resolve/') == gets
    assert second.hashed_bytes == 0 and second.cached_hash_bytes == first.content_bytes
    assert {p: p.stat().st_mtime_ns for p in cached} == cached
    assert second.manifest["items"][0]["files"] == first.manifest["items"][0]["files"]
    assert second.manifest["bundle_id"] != first.manifest["bundle_id"]

    # a file lost from the cache (an interrupted download) is fetched and hashed again, alone
    weights = next(iter(cached))
    size = weights.stat().st_size
    weights.unlink()
    third = pack(spec, tmp_path / "out", progress=False)
    assert third.downloaded_bytes == size and third.hashed_bytes == size
    subprocess.run(["sha256sum", "--quiet", "-c", SUMS_NAME], cwd=third.bundle_dir, check=True)


def test_lfs_sha256_mismatch_is_refused_and_previous_bundle_kept(tmp_path, hub_env, stories_model):
    repo = "corrupt/stories260K"
    hub_env.add_model(repo, stories_model)
    out = tmp_path / "out"
    good = pack(load_spec(name="kit", models=[str(stories_model)], no_wheels=True), out, progress=False)
    before = {p.name: sha256(p) for p in out.iterdir() if p.is_file()}
    before_dir = tree(good.bundle_dir)

    # flip one byte of the LFS object the hub serves; the tree still states the original sha256
    oid = sha256(stories_model / "model.safetensors")
    obj = hub_env.mirrors / "models" / repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    data = bytearray(obj.read_bytes())
    data[1000] ^= 0xFF
    obj.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"model\.safetensors has sha256 .* but the hub states " + oid):
        pack(load_spec(name="kit", models=[f"hf:{repo}"], no_wheels=True), out, progress=False)
    # the earlier bundle of that name is untouched and no temp file is left behind
    assert {p.name: sha256(p) for p in out.iterdir() if p.is_file()} == before
    assert tree(good.bundle_dir) == before_dir
    assert sorted(p.name for p in out.iterdir()) == [".ferry-cache", "kit", "kit.ferry.tar"]


def test_pickle_weights_skipped_beside_safetensors(tmp_path, hub_env, stories_model):
    repo = "pickles/with-safetensors"
    files = {p.name: p for p in stories_model.iterdir()}
    files["pytorch_model.bin"] = b"\x80\x04 not really a pickle"
    files["training_args.bin"] = b"\x80\x04 args"
    hub_env.add_model(repo, files)
    result = pack(load_spec(name="p", models=[f"hf:{repo}"], no_wheels=True), tmp_path / "out", progress=False)
    packed = {f["path"] for f in result.manifest["items"][0]["files"]}
    assert "model.safetensors" in packed and not {"pytorch_model.bin", "training_args.bin"} & packed
    assert sorted(result.skipped_files) == ["pytorch_model.bin", "training_args.bin"]
    assert "skipped" in result.summary() and "pytorch_model.bin" in result.summary()
    assert hub_env.requests_for(f"/{repo}/resolve/") > 0 and hub_env.requests_for("pytorch_model.bin") == 0


def test_pickle_only_model_refused_unless_allowed(tmp_path, stories_model):
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_bytes((stories_model / "config.json").read_bytes())
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04 weights")
    (model / "optimizer.pt").write_bytes(b"\x80\x04 state")
    with pytest.raises(SourceError, match=r"optimizer\.pt, pytorch_model\.bin.*--allow-pickle"):
        pack(load_spec(name="p", models=[str(model)], no_wheels=True), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "p").exists()
    result = pack(
        load_spec(name="p", models=[str(model)], no_wheels=True, allow_pickle=True), tmp_path / "out", progress=False
    )
    assert {f["path"] for f in result.manifest["items"][0]["files"]} == {
        "config.json",
        "pytorch_model.bin",
        "optimizer.pt",
    }


def test_python_files_mark_trust_remote_code(tmp_path, hub_env, stories_model):
    repo = "custom/remote-code"
    hub_env.add_model(
        repo,
        {
            "config.json": stories_model / "config.json",
            "model.safetensors": stories_model / "model.safetensors",
            "modeling_tiny.py": "class TinyModel: pass\n",
            "sub/configuration_tiny.py": "X = 1\n",
        },
    )
    result = pack(load_spec(name="rc", models=[f"hf:{repo}"], no_wheels=True), tmp_path / "out", progress=False)
    item = result.manifest["items"][0]
    assert item["trust_remote_code"] is True
    assert item["python_files"] == ["modeling_tiny.py", "sub/configuration_tiny.py"]
    assert "trust_remote_code" in result.summary()


def test_include_exclude_patterns(tmp_path, hub_env):
    (tmp_path / "spec.yaml").write_text(
        f"name: slim\nmodels:\n  - source: hf:{STORIES_REPO}\n    include: ['*.json', '*.safetensors']\n"
        f"    exclude: [generation_config.json]\nwheels: {{no_wheels: true}}\n"
    )
    spec = load_spec(tmp_path / "spec.yaml")
    result = pack(spec, tmp_path / "out", progress=False)
    assert sorted(f["path"] for f in result.manifest["items"][0]["files"]) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_split_volumes_concatenate_to_the_archive(tmp_path, stories_model, llamafactory_data):
    split = 300_000
    spec = load_spec(
        name="vol",
        models=[str(stories_model)],
        datasets=[str(llamafactory_data)],
        no_wheels=True,
        split_size=str(split),
    )
    out = tmp_path / "out"
    result = pack(spec, out, progress=False)
    assert [p.name for p in result.archives] == [f"vol.ferry.tar.{i:03d}" for i in range(len(result.archives))]
    assert len(result.archives) > 5
    # .000 is the metadata head alone (manifest.json, sbom.cdx.json: what ferry inspect reads), then full volumes
    assert result.archives[0].stat().st_size < split
    from bundler.installer.signature import read_head

    assert read_head(result.archives[0])["members"] == ["manifest.json", "sbom.cdx.json"]
    assert all(p.stat().st_size == split for p in result.archives[1:-1])
    assert 0 < result.archives[-1].stat().st_size <= split
    listed = [line.split("  ") for line in (out / "vol.ferry.sha256").read_text().splitlines()]
    assert [(name, digest) for digest, name in listed] == [(p.name, sha256(p)) for p in result.archives]
    subprocess.run(["sha256sum", "--quiet", "-c", "vol.ferry.sha256"], cwd=out, check=True)
    extract(result.archives, tmp_path / "x")
    assert tree(tmp_path / "x" / "vol") == tree(result.bundle_dir)

    # packing again without a split replaces the volumes by one tar (no stale volume is left to `cat`)
    single = pack(
        load_spec(name="vol", models=[str(stories_model)], datasets=[str(llamafactory_data)], no_wheels=True),
        out,
        progress=False,
    )
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("vol.ferry.tar")) == ["vol.ferry.tar"]
    assert single.hashed_bytes == 0  # the hash cache covers local sources too


def test_writer_volumes_are_a_byte_split_of_the_single_tar(tmp_path, stories_model):
    from bundler.writer import BundleWriter

    def write(out: Path, split: int | None) -> bytes:
        stage = out / "stage"
        stage.mkdir(parents=True)
        writer = BundleWriter(stage, out, "w", split_size=split, mtime=1_700_000_000)
        for p in sorted(stories_model.iterdir()):
            writer.add_file(p, f"models/local/s/{p.name}")
        writer.add_bytes(b"{}\n", "manifest.json")
        archives, _ = writer.commit()
        return b"".join(p.read_bytes() for p in archives)

    single = write(tmp_path / "a", None)
    assert single == write(tmp_path / "b", 65_536)
    assert len(single) % tarfile.RECORDSIZE == 0


def test_cli_pack_and_unknown_spec_key(tmp_path, stories_model, capsys):
    ferry_main(
        ["pack", "-o", str(tmp_path / "out"), "--name", "cli", "--model", str(stories_model), "--no-wheels", "-q"]
    )
    assert "local/stories260K" in capsys.readouterr().out
    assert (tmp_path / "out" / "cli.ferry.tar").is_file()

    (tmp_path / "bad.yaml").write_text("name: bad\nmodels: []\nwheels:\n  no_wheel: true\n")
    with pytest.raises(SystemExit) as exc:
        ferry_main(["pack", str(tmp_path / "bad.yaml"), "-o", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'wheels.no_wheel'" in err and "did you mean 'no_wheels'" in err


def test_unknown_hub_repo_is_a_source_error(tmp_path, hub_env):
    with pytest.raises(SourceError, match="nobody/nothing.*no such model repo"):
        pack(load_spec(name="x", models=["hf:nobody/nothing"], no_wheels=True), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "x").exists()


def test_environment_is_left_alone(tmp_path, stories_model):
    before = dict(os.environ)
    pack(load_spec(name="e", models=[str(stories_model)], no_wheels=True), tmp_path / "out", progress=False)
    assert dict(os.environ) == before


_SMALL_DISK = """
import importlib
import sys
from bundler.spec import load_spec
from ferry.errors import InsufficientSpaceError
pack_module = importlib.import_module("bundler.pack")
pack_module.SPACE_MARGIN = int(sys.argv[3])
pack = pack_module.pack
try:
    pack(load_spec(name="s", models=[sys.argv[2]], no_wheels=True), sys.argv[1], progress=False)
except InsufficientSpaceError as exc:
    print("ERROR", exc)
"""


@pytest.mark.parametrize("margin", [16 * 1024 * 1024, 0])
def test_too_little_space_is_an_error_and_leaves_nothing(tmp_path, stories_model, margin):
    """A 2.1 MB tmpfs: with the real margin the up-front check refuses; with none, the check passes and the
    disk fills part-way, which must still end in InsufficientSpaceError with no temp file left behind."""
    disk = tmp_path / "disk"
    disk.mkdir()
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "small.py"
    script.write_text(_SMALL_DISK)
    inner = (
        f"mount -t tmpfs -o size=2100k tmpfs {disk} && cd {root} && "
        f"{sys.executable} {script} {disk}/out {stories_model} {margin} && find {disk}/out -type f"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", inner], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ERROR")
    if margin:
        assert "needs 18.0 MiB in" in lines[0] and "is free" in lines[0]
    else:
        assert "disk full while writing bundle 's'" in lines[0]
    # nothing half-written is visible: no bundle, no archive, no temp files (the hash cache may exist)
    assert [p for p in lines[1:] if "/.ferry-cache/" not in p] == []


def test_one_pack_per_bundle_name_and_a_killed_one_is_undone_by_the_next(tmp_path, stories_model, capfd):
    """A second pack of a name being packed into the same folder is refused in one line. A pack killed at each
    point of its commit (``pack:aside``: the earlier directory and archive moved aside; ``pack:renamed``: the new
    directory in, the archive not; ``pack:written``: both staged, nothing moved) is undone by the next pack of the
    name: the earlier directory and archive are back as one pair, what the killed pack left is removed, and a
    pack that is not stopped replaces the pair with one ``ferry verify`` passes."""
    import signal
    import tarfile

    from bundler.verify import verify
    from ferry.errors import ConfigError
    from ferry.faults import KILL_AT_ENV
    from ferry.folder_lock import hold_name
    from tests.support.helpers import ROOT

    out = tmp_path / "out"

    def spec() -> PackSpec:
        return load_spec(name="n", models=[str(stories_model)], no_wheels=True)

    def bundle_ids() -> tuple[str, str]:
        """The directory's bundle_id and the archive's."""
        with tarfile.open(out / "n.ferry.tar") as tar:
            archived = json.load(tar.extractfile(f"n/{MANIFEST_NAME}"))
        return json.loads((out / "n" / MANIFEST_NAME).read_bytes())["bundle_id"], archived["bundle_id"]

    pack(spec(), out, progress=False)
    earlier = (out / "n" / MANIFEST_NAME).read_bytes()
    first = json.loads(earlier)["bundle_id"]
    with hold_name(out / "n", "ferry pack", key="bundle"), pytest.raises(ConfigError) as refused:
        pack(spec(), out, progress=False)
    assert str(refused.value).startswith(f"bundle {str(out / 'n')!r} is in use by another run (pid {os.getpid()} on ")
    assert bundle_ids() == (first, first)

    code = (
        "import sys; from bundler.pack import pack; from bundler.spec import load_spec\n"
        "pack(load_spec(name='n', models=[sys.argv[1]], no_wheels=True), sys.argv[2], progress=False)\n"
    )
    put_back = f"ferry: put back the earlier bundle {out / 'n'} (directory and archive), which a stopped pack had"
    listed, said = {}, {}
    for point in ("pack:aside", "pack:renamed", "pack:written"):
        # exec'd, not forked: the packs above ran worker threads in this process, and a fork of it can hang on a lock
        # one of them held
        killed = subprocess.run(
            [sys.executable, "-c", code, str(stories_model), str(out)],
            cwd=ROOT,
            env={**os.environ, KILL_AT_ENV: point},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-3000:])
        # (the killed pack's staged directory and archive, ``.n.*.tmp``, are beside these every time)
        listed[point] = sorted(p.name for p in out.iterdir() if not p.name.endswith((".tmp", ".ferry-cache")))
        said[point] = killed.stderr
    # killed with the earlier pair aside: nothing under its names
    assert listed["pack:aside"] == [".n.ferry-aside", ".n.ferry-lock"], listed
    # the next pack put it back, then was killed with its own directory in and the earlier archive still aside
    assert put_back in said["pack:renamed"], said["pack:renamed"][-3000:]
    assert listed["pack:renamed"] == [".n.ferry-aside", ".n.ferry-lock", "n"], listed
    # the next pack removed that directory and put the earlier pair back, then was killed before moving anything
    assert put_back in said["pack:written"], said["pack:written"][-3000:]
    assert listed["pack:written"] == [".n.ferry-lock", "n", "n.ferry.tar"], listed
    assert bundle_ids() == (first, first) and (out / "n" / MANIFEST_NAME).read_bytes() == earlier
    verify(out / "n.ferry.tar")

    capfd.readouterr()
    pack(spec(), out, progress=False)
    err = capfd.readouterr().err
    assert f"ferry: removed what the stopped holder left half-written in {out}: .n." in err
    assert sorted(p.name for p in out.iterdir()) == [".ferry-cache", "n", "n.ferry.tar"]
    new, archived = bundle_ids()
    assert new == archived != first
    verify(out / "n.ferry.tar")


def test_a_pack_failing_once_the_earlier_bundle_is_aside_puts_it_back(tmp_path, stories_model, monkeypatch):
    """A disk that fills up as the archive's volumes are renamed in and their sums written (after the earlier
    bundle was moved aside and the new directory renamed in) is the disk-full line, and the earlier directory and
    volumes are back as they were, with nothing of the failed pack beside them."""
    import errno

    from bundler.writer import BundleWriter

    out = tmp_path / "out"

    def spec() -> PackSpec:
        return load_spec(name="n", models=[str(stories_model)], no_wheels=True, split_size="200KB")

    pack(spec(), out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert len(before) > 2 and "n.ferry.sha256" in before
    manifest = (out / "n" / MANIFEST_NAME).read_bytes()
    real_commit = BundleWriter.commit

    def full_after_renaming(self):
        real_commit(self)  # the new volumes are in place by now
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "n.ferry.sha256"))

    monkeypatch.setattr(BundleWriter, "commit", full_after_renaming)
    with pytest.raises(InsufficientSpaceError, match="disk full while writing bundle 'n'"):
        pack(spec(), out, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (out / "n" / MANIFEST_NAME).read_bytes() == manifest
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [".ferry-cache", "n"]
