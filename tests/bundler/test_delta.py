"""Delta bundles (bundler/delta.py): ``ferry state``, ``ferry pack --base``, the delta install.

One chain, built once on the real olah hub, side by side with full bundles of the same targets:

* ``delta/stories`` v1: the stories260K Llama split into two safetensors shards (an index beside them);
  v2: ``config.json`` changed, weights unchanged; v3: one tensor of shard 2 changed.
* prefix A: full bundle of v1, then delta D2 (v2 + the alpaca dataset, against A's ``ferry state``), then delta
  D3 (v3 + the dataset, against A's next state; installed by the bundle's own install.py with a bare python3).
* prefix B: the same targets as full bundles. A and B must end up indistinguishable: equal state documents,
  ``verify_prefix`` passing, every revision loading offline.

Hostile deltas are refused in one line by ``ferry install`` and a bare ``install.py``, with the prefix and a
sentinel outside it unchanged byte for byte (as tests/bundler/test_hostile.py checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import ferry.cli
from bundler.delta import load_base, prefix_state, write_state
from bundler.inspect import inspect
from bundler.install import install
from bundler.installer.hashing import size_and_sha256
from bundler.installer.safetensors import tensor_digests
from bundler.pack import pack
from bundler.spec import load_spec
from bundler.verify import verify, verify_prefix
from ferry.errors import IntegrityError, UnsafeArchiveError
from tests.bundler.test_hostile import snapshot
from tests.support.helpers import ALPACA_REPO, resign, set_online_env
from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]
REPO = "delta/stories"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _revisions(stories: Path, work: Path) -> dict[str, dict[str, Path | str]]:
    """The three revisions' files (see the module docstring) and which tensor v3 changes."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(stories / "model.safetensors"))
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    common = {p.name: p for p in sorted(stories.iterdir()) if p.is_file() and p.name != "model.safetensors"}
    revs: dict[str, dict] = {}
    for rev in ("v1", "v3"):
        folder = work / rev
        folder.mkdir(parents=True)
        for i, half in enumerate(halves):
            part = {k: tensors[k] for k in half}
            if rev == "v3" and i == 1:
                changed = max(half, key=lambda k: tensors[k].numel())
                part[changed] = part[changed] * 0.5
            save_file(part, str(folder / SHARDS[i]), metadata={"format": "pt"})
        revs[rev] = {**common, **{s: folder / s for s in SHARDS}}
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {k: SHARDS[i] for i, half in enumerate(halves) for k in half},
    }
    config = json.loads((stories / "config.json").read_text())
    for rev in ("v1", "v3"):
        revs[rev]["model.safetensors.index.json"] = json.dumps(index)
    revs["v2"] = {**revs["v1"], "config.json": json.dumps({**config, "ferry_note": "v2"}, indent=2)}
    revs["v3"]["config.json"] = revs["v2"]["config.json"]
    revs["changed"] = changed  # type: ignore[assignment]
    return revs


@pytest.fixture(scope="module")
def chain(hub, stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("delta")
    revs = _revisions(stories_model, root / "src")
    changed = revs.pop("changed")
    for tag in ("v1", "v2", "v3"):
        hub.add_model(REPO, revs[tag], tag=tag)
    found: dict = {"root": root, "revs": revs, "changed": changed, "prefix_a": root / "A", "prefix_b": root / "B"}
    with pytest.MonkeyPatch.context() as mp:
        set_online_env(mp, hub, root / "hf-home")

        def spec(name: str, tag: str, dataset: bool) -> object:
            return load_spec(
                name=name,
                models=[f"hf:{REPO}@{tag}"],
                datasets=[f"hf:{ALPACA_REPO}"] if dataset else [],
                no_wheels=True,
            )

        found["p1"] = pack(spec("p1", "v1", False), root / "out", progress=False)
        for prefix in (found["prefix_a"], found["prefix_b"]):
            install(found["p1"].bundle_dir, prefix, create_venv=False)
        found["s1"] = write_state(found["prefix_a"], root / "s1.json")
        found["d2"] = pack(spec("d2", "v2", True), root / "out", progress=False, base=root / "s1.json")
        found["d2m"] = pack(
            spec("d2m", "v2", True), root / "out", progress=False, base=found["p1"].bundle_dir / "manifest.json"
        )
        found["f2"] = pack(spec("f2", "v2", True), root / "out", progress=False)
        found["install_d2"] = install(found["d2"].archives[0], found["prefix_a"], create_venv=False)
        install(found["f2"].bundle_dir, found["prefix_b"], create_venv=False)
        found["state2"] = (prefix_state(found["prefix_a"]), prefix_state(found["prefix_b"]))
        write_state(found["prefix_a"], root / "s2.json")
        found["d3"] = pack(spec("d3", "v3", True), root / "out", progress=False, base=root / "s2.json")
        found["f3"] = pack(spec("f3", "v3", True), root / "out", progress=False)
    # D3 the way an isolated host without ferry installs it: the bundle's install.py, bare python3, no network
    found["d3_stdout"] = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(found["d3"].bundle_dir / "install.py"),
            "--prefix",
            str(found["prefix_a"]),
            "--no-venv",
        ],
        env={"PATH": os.environ["PATH"]},
        cwd=root,
    ).stdout
    install(found["f3"].bundle_dir, found["prefix_b"], create_venv=False)
    return found


def _prefix_at(chain: dict, stage: int, prefix: Path) -> Path:
    """A new prefix holding what prefix A held at ``stage`` (1: the full v1 bundle; 2: and delta D2)."""
    install(chain["p1"].bundle_dir, prefix, create_venv=False)
    if stage == 2:
        install(chain["d2"].bundle_dir, prefix, create_venv=False)
    return prefix


def _row(result, label: str) -> dict:
    return next(r for r in result.delta.rows() if r["label"] == label)


def _files(result) -> dict[str, dict]:
    return {f["path"]: f for f in result.manifest["items"][0]["files"]}


def test_config_change_carries_only_the_config(chain: dict) -> None:
    """v2 changed config.json alone: the delta's model part is exactly that file; the rest is from the base."""
    d2 = chain["d2"]
    model = _row(d2, f"model {REPO}")
    config = len(str(chain["revs"]["v2"]["config.json"]).encode())
    assert model["carried_bytes"] == config < 1024 * 1024
    assert model["carried_bytes"] / model["full_bytes"] < 0.001  # the goal: < 0.1 %
    modes = {p: f["delta"] for p, f in _files(d2).items()}
    assert modes.pop("config.json") == "carried" and set(modes.values()) == {"from_base"}
    manifest = d2.manifest
    assert (
        manifest["format_version"] == 2
        and manifest["base"] == hashlib.sha256((chain["root"] / "s1.json").read_bytes()).hexdigest()
    )
    assert len(manifest["items"][0]["files"]) == len(chain["revs"]["v2"])  # the full target is listed
    # an earlier bundle's manifest.json serves as the base too (same decisions, base = its sha256)
    assert {p: f["delta"] for p, f in _files(chain["d2m"]).items()} == {p: f["delta"] for p, f in _files(d2).items()}
    assert (
        chain["d2m"].manifest["base"]
        == hashlib.sha256((chain["p1"].bundle_dir / "manifest.json").read_bytes()).hexdigest()
    )


def test_new_dataset_is_carried_whole(chain: dict) -> None:
    """The dataset the base lacks is carried whole: the delta carries the dataset and the config, no more."""
    d2 = chain["d2"]
    dataset = _row(d2, f"dataset {ALPACA_REPO}")
    assert dataset["carried_bytes"] == dataset["full_bytes"] > 0
    report = chain["install_d2"]
    assert report.delta == {
        "from_base": len(chain["revs"]["v2"]) - 1,
        "rebuilt": 0,
        "reused_bytes": _row(d2, f"model {REPO}")["reused_bytes"],
    }
    assert "delta    " in report.summary()
    assert d2.delta.carried_bytes == dataset["full_bytes"] + _row(d2, f"model {REPO}")["carried_bytes"]
    # the tar is the carried content plus metadata (manifest, SBOM, install.py, tar headers)
    tar = d2.archives[0].stat().st_size
    assert tar < d2.delta.carried_bytes + 400 * 1024 < d2.delta.full_bytes + chain["f2"].archives[0].stat().st_size


def test_one_changed_tensor_carries_that_tensor_and_the_header(chain: dict) -> None:
    from safetensors import safe_open

    d3, revs = chain["d3"], chain["revs"]
    shard = Path(revs["v3"][SHARDS[1]])
    with safe_open(str(shard), "pt") as fh:  # the real reader's view of the tensor
        tensor = fh.get_tensor(chain["changed"])
    header = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]
    entry = _files(d3)[SHARDS[1]]
    assert entry["delta"] == "tensors"
    assert entry["patch"]["size"] == header + tensor.numel() * tensor.element_size()
    assert _row(d3, f"model {REPO}")["carried_bytes"] == entry["patch"]["size"]
    assert _files(d3)[SHARDS[0]]["delta"] == "from_base" and _files(d3)["config.json"]["delta"] == "from_base"
    # the rebuilt shard in prefix A is byte-equal to the hub's file
    snap = chain["prefix_a"] / "hf-home/hub/models--delta--stories/snapshots" / d3.manifest["items"][0]["revision"]
    assert (snap / SHARDS[1]).read_bytes() == shard.read_bytes()
    assert "OK:" in chain["d3_stdout"]


def test_tensor_table_matches_the_safetensors_reader(chain: dict) -> None:
    """Per-tensor offsets and digests (what a delta is cut by) equal the bytes the safetensors library reads."""
    from safetensors import safe_open

    shard = Path(chain["revs"]["v3"][SHARDS[1]])
    size, digest, tensors = tensor_digests(shard)
    assert (size, digest) == size_and_sha256(shard)
    with safe_open(str(shard), "np") as fh:
        assert sorted(tensors) == sorted(fh.keys())
        for name in fh.keys():
            data = fh.get_tensor(name).tobytes()
            start, end, sha = tensors[name]
            assert end - start == len(data) and sha == hashlib.sha256(data).hexdigest()
    assert tensor_digests(Path(chain["revs"]["v3"]["tokenizer.json"]))[2] is None  # not safetensors


def test_delta_install_is_indistinguishable_from_a_full_install(chain: dict) -> None:
    a, b = chain["prefix_a"], chain["prefix_b"]
    assert chain["state2"][0] == chain["state2"][1]
    assert prefix_state(a) == prefix_state(b)
    assert prefix_state(a, trust_recorded=True) == prefix_state(b, trust_recorded=True)
    for prefix in (a, b):
        verify_prefix(prefix)
    # the recorded manifests hold the full target
    recorded = json.loads((a / ".ferry/manifests" / f"{chain['d3'].manifest['bundle_id']}.json").read_text())
    assert [f["path"] for f in recorded["items"][0]["files"]] == [
        f["path"] for f in chain["f3"].manifest["items"][0]["files"]
    ]
    # verify without a prefix checks only what the delta carries
    report = verify(chain["d3"].archives[0])
    assert report.bytes_checked < chain["d3"].delta.carried_bytes + 300 * 1024
    assert report.base == chain["d3"].manifest["base"] and "a delta bundle" in report.summary()


PROBE = r"""
import json, sys
from transformers import AutoConfig, AutoModelForCausalLM
out = {}
for tag in ("v1", "v2", "v3"):
    model = AutoModelForCausalLM.from_pretrained("delta/stories", revision=tag)
    config = AutoConfig.from_pretrained("delta/stories", revision=tag)
    out[tag] = [getattr(config, "ferry_note", None), float(model.get_parameter(sys.argv[1]).abs().sum())]
print(json.dumps(out))
"""


def test_every_revision_loads_offline(chain: dict) -> None:
    """With ferry.env sourced and no network, v1 (the base), v2 and v3 (the deltas) all load."""
    prefix = chain["prefix_a"]
    env = {"PATH": os.environ["PATH"], "HOME": str(chain["root"])}
    script = f'. {prefix}/ferry.env && exec {sys.executable} -c "$0" "$@"'
    proc = run_offline(["sh", "-c", script, PROBE, chain["changed"]], env=env, cwd=ROOT, timeout=300)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["v1"][0] is None and found["v2"][0] == "v2" and found["v3"][0] == "v2"
    assert found["v1"][1] == found["v2"][1] == pytest.approx(2 * found["v3"][1])


def test_inspect_shows_base_carried_and_reused(chain: dict, tmp_path: Path, capsys) -> None:
    d3 = chain["d3"]
    ins = inspect(d3.archives[0])
    delta = ins.to_json()["delta"]
    assert delta["base"] == d3.manifest["base"]
    assert delta["carried_bytes"] == d3.delta.carried_bytes
    assert delta["reused_bytes"] == d3.delta.full_bytes - d3.delta.carried_bytes
    assert f"base {d3.manifest['base']}" in ins.text()
    page = ins.html()
    assert "<h2>Delta</h2>" in page and d3.manifest["base"] in page and "rebuilt by tensor" in page
    assert inspect(chain["f3"].archives[0]).delta is None
    assert "<h2>Delta</h2>" not in inspect(chain["f3"].archives[0]).html()
    ferry.cli.main(["state", str(chain["prefix_b"]), "-o", str(tmp_path / "b.json")])
    assert "OK:" in capsys.readouterr().out
    assert load_base(tmp_path / "b.json").kind == "state"


def test_dry_run_reports_bytes_per_item(
    chain: dict, hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    set_online_env(monkeypatch, hub, chain["root"] / "hf-home")
    ferry.cli.main(
        [
            "pack",
            "--dry-run",
            "-q",
            "--name",
            "dry",
            "--model",
            f"hf:{REPO}@v3",
            "--no-wheels",
            "--base",
            str(chain["root"] / "s2.json"),
            "-o",
            str(chain["root"] / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert f"model {REPO}" in out and "delta carries" in out and "total" in out
    assert not (chain["root"] / "out" / "dry").exists()
    # a state taken with --trust-recorded has no tensor tables: packed where the base files are not on disk
    # (a fresh OUT), safetensors files are compared whole
    prefix = _prefix_at(chain, 2, tmp_path / "prefix")
    ferry.cli.main(["state", "--trust-recorded", str(prefix), "-o", str(tmp_path / "trusted.json")])
    assert load_base(tmp_path / "trusted.json").tables == {}
    result = pack(
        load_spec(name="dry", models=[f"hf:{REPO}@v3"], no_wheels=True),
        tmp_path / "fresh",
        progress=False,
        base=tmp_path / "trusted.json",
        dry_run=True,
    )
    modes = {path.rsplit("/", 1)[-1]: d.mode for path, d in result.delta.decisions.items()}
    assert modes[SHARDS[1]] == "carried" and modes[SHARDS[0]] == modes["config.json"] == "from_base"
    assert "delta carries" in result.summary()
    # a manifest as the base: the packer computes the tables from the files it packed before (the same OUT)
    result = pack(
        load_spec(name="dry", models=[f"hf:{REPO}@v3"], no_wheels=True),
        chain["root"] / "out",
        progress=False,
        base=chain["p1"].bundle_dir / "manifest.json",
        dry_run=True,
    )
    shard = next(d for path, d in result.delta.decisions.items() if path.endswith(SHARDS[1]))
    assert shard.mode == "tensors" and shard.carried == _files(chain["d3"])[SHARDS[1]]["patch"]["size"]


def test_signed_delta_in_volumes_installs_under_the_prefix_policy(
    chain: dict, hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A delta signed with --sign and split into volumes: the head holds the larger delta manifest, the
    signature checks against allowed_signers, and the install (which then requires signatures) completes."""
    key = tmp_path / "alice"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice", "-f", str(key)], check=True)
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f'alice namespaces="ferry-bundle" {(tmp_path / "alice.pub").read_text().strip()}\n')
    set_online_env(monkeypatch, hub, chain["root"] / "hf-home")
    spec = load_spec(name="signed", models=[f"hf:{REPO}@v3"], datasets=[f"hf:{ALPACA_REPO}"], no_wheels=True)
    spec.split_size = 256 * 1024
    result = pack(spec, chain["root"] / "out", progress=False, sign=key, base=chain["root"] / "s2.json")
    assert len(result.archives) > 1 and result.manifest["base"]
    assert inspect(result.archives[0], allowed_signers=allowed).signature["status"] == "verified"
    prefix = _prefix_at(chain, 2, tmp_path / "prefix")
    report = install(result.archives[0], prefix, create_venv=False, allowed_signers=allowed, require_signature=True)
    assert report.signature["principal"] == "alice" and report.delta["rebuilt"] == 1
    verify_prefix(prefix)


# ---------------------------------------------------------------------------------------------------------
# Hostile deltas: refused in one line, prefix and outside unchanged.
# ---------------------------------------------------------------------------------------------------------


def _drift(prefix: Path, chain: dict) -> None:
    blob = prefix / "hf-home/hub/models--delta--stories/blobs" / _files(chain["d2"])["tokenizer.json"]["sha256"]
    data = bytearray(blob.read_bytes())
    data[10] ^= 1
    blob.write_bytes(bytes(data))


def _forge_from_base(manifest: dict, bundle: Path) -> None:
    entry = next(f for f in manifest["items"][0]["files"] if f["path"] == "tokenizer.json")
    entry["sha256"] = hashlib.sha256(b"not what the host holds").hexdigest()


def _outside_blob(manifest: dict, bundle: Path) -> None:
    entry = next(f for f in manifest["items"][0]["files"] if f.get("delta") == "tensors")
    segment = next(s for s in entry["patch"]["segments"] if s[0] == "base")
    segment[1] = entry["patch"]["base_size"]


def _outside_patch(manifest: dict, bundle: Path) -> None:
    entry = next(f for f in manifest["items"][0]["files"] if f.get("delta") == "tensors")
    segment = next(s for s in entry["patch"]["segments"] if s[0] == "patch")
    segment[2] += entry["patch"]["size"]


#: (case, bundle, the prefix's stage, prefix mutation, manifest mutation, error class, what the line names)
HOSTILE = [
    ("base-file-drifted", "d2", 1, _drift, None, IntegrityError, "tokenizer.json"),
    ("delta-for-another-base", "d3", 1, None, None, IntegrityError, "config.json"),
    ("forged-from-base-sha256", "d2", 1, None, _forge_from_base, IntegrityError, "tokenizer.json"),
    ("tensor-table-outside-the-blob", "d3", 2, None, _outside_blob, UnsafeArchiveError, "segments["),
    (
        "tensor-table-outside-the-carried-tensors",
        "d3",
        2,
        None,
        _outside_patch,
        UnsafeArchiveError,
        "outside the carried tensors",
    ),
]


@pytest.mark.parametrize(
    "case,bundle,stage,prefix_change,manifest_change,error,names", HOSTILE, ids=[c[0] for c in HOSTILE]
)
def test_hostile_delta_is_refused(
    case: str,
    bundle: str,
    stage: int,
    prefix_change,
    manifest_change,
    error,
    names: str,
    chain: dict,
    tmp_path: Path,
    capsys,
) -> None:
    prefix, sentinel = _prefix_at(chain, stage, tmp_path / "prefix"), tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("do not touch\n")
    if prefix_change:
        prefix_change(prefix, chain)
    source = tmp_path / "bundle"
    shutil.copytree(chain[bundle].bundle_dir, source)
    if manifest_change:
        manifest = json.loads((source / "manifest.json").read_text())
        manifest_change(manifest, source)
        resign(source, manifest)
    before, outside = snapshot(prefix), snapshot(sentinel)
    with pytest.raises(error) as info:
        install(source, prefix, create_venv=False)
    assert names in str(info.value) and "\n" not in str(info.value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        ferry.cli.main(["install", "-q", str(source), "--prefix", str(prefix), "--no-venv"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("ferry: error: ")]  # (after the RISK lines)
    assert exit_info.value.code == error.exit_code and len(errors) == 1 and names in errors[0]
    assert err.strip().splitlines()[-1] == errors[0]
    proc = subprocess.run(
        ["/usr/bin/python3", "-I", str(source / "install.py"), "--prefix", str(prefix), "--no-venv"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == error.exit_code and last.startswith("install.py: error: ") and names in last
    assert "Traceback" not in proc.stderr
    assert snapshot(prefix) == before and snapshot(sentinel) == outside


def test_killed_delta_install_leaves_the_previous_state_and_completes_next_time(chain: dict, tmp_path: Path) -> None:
    """SIGKILL right after the rebuilt shard's blob moved into place: the prefix still verifies and gives the
    state it had; the next install of the same delta completes (the state of a full install)."""
    prefix = _prefix_at(chain, 2, tmp_path / "prefix")
    before = prefix_state(prefix)
    rebuilt = _files(chain["d3"])[SHARDS[1]]["sha256"]
    code = (
        "import os, signal; from pathlib import Path; from bundler.installer import install, place\n"
        "real = os.replace\n"
        "def replace(src, dst):\n"
        "    real(src, dst)\n"
        f"    if str(dst).endswith({rebuilt!r}): os.kill(os.getpid(), signal.SIGKILL)\n"
        "place.os.replace = replace\n"  # place_hf moves each blob into the prefix
        f"install.install_bundle(Path({str(chain['d3'].bundle_dir)!r}), Path({str(prefix)!r}), "
        "create_venv=False, log=lambda m: None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert list(prefix.glob(".staging-*"))  # killed half-way
    verify_prefix(prefix)
    assert prefix_state(prefix) == before
    install(chain["d3"].bundle_dir, prefix, create_venv=False)
    assert not list(prefix.glob(".staging-*"))
    verify_prefix(prefix)
    assert prefix_state(prefix) == prefix_state(chain["prefix_b"])


# ---------------------------------------------------------------------------------------------------------
# Wheels: one pin changed, only that wheel crosses; the venv rebuilt from the delta passes its RECORD check.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.budget(60, reason="downloads two wheel sets from the package index and writes a delta of them")
def test_changed_pin_carries_only_that_wheel(tmp_path: Path) -> None:
    def spec(name: str, six: str) -> object:
        s = load_spec(name=name)
        s.wheels.requirements = [f"six=={six}", "idna==3.10"]
        return s

    full = pack(spec("w1", "1.16.0"), tmp_path / "out", progress=False)
    prefix = tmp_path / "prefix"
    install(full.bundle_dir, prefix, create_venv=False)  # the wheels are kept all the same
    assert sorted(p.name for p in (prefix / "wheels").iterdir()) == sorted(
        f["sha256"] for f in full.manifest["items"][0]["files"]
    )
    write_state(prefix, tmp_path / "state.json")
    delta = pack(spec("w2", "1.17.0"), tmp_path / "out", progress=False, base=tmp_path / "state.json")
    files = {f["path"]: f["delta"] for f in delta.manifest["items"][0]["files"]}
    carried = sorted(p for p, mode in files.items() if mode == "carried" and p.endswith(".whl"))
    assert carried == ["six-1.17.0-py2.py3-none-any.whl"]
    assert [p for p, mode in files.items() if mode == "from_base"] == ["idna-3.10-py3-none-any.whl"]
    wheel_bytes = sum(f["size"] for f in delta.manifest["items"][0]["files"] if f["path"].endswith(".whl"))
    six = next(f["size"] for f in delta.manifest["items"][0]["files"] if f["path"].startswith("six-"))
    assert _row(delta, "wheels")["carried_bytes"] < six + 4096 < wheel_bytes
    # the isolated side: the delta's own install.py, bare python3, no network
    proc = run_offline(
        ["/usr/bin/python3", "-I", str(delta.bundle_dir / "install.py"), "--prefix", str(prefix)],
        env={"PATH": os.environ["PATH"]},
        cwd=tmp_path,
    )
    assert "delta   1 file(s) taken from the prefix" in proc.stdout
    verify_prefix(prefix)  # every venv file against its wheel's RECORD, the kept wheels by sha256
    version = run_offline(
        [str(prefix / "venv" / "bin" / "python"), "-c", "import six; print(six.__version__)"],
        env={"PATH": os.environ["PATH"]},
        cwd=tmp_path,
    ).stdout.strip()
    assert version == "1.17.0"
