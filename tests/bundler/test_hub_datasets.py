"""Hugging Face dataset repos after ``ferry install``: ``datasets.load_dataset("ORG/NAME")`` and ferry's own data
loader (``dataset: NAME``) read the same rows with no network at all (``unshare -rn``), ``ferry.env`` sourced and
nothing else set.

The olah hub (tests/support/hub.py) serves two dataset repos in the hub layout:

* ``acme/ParquetSet``: README.md with ``configs`` (train and test splits) and ``data/*.parquet`` (LFS, as on the
  hub); tag ``v1`` holds rows ``V1_ROWS``, main (one commit later) ``MAIN_ROWS``. A CamelCase name, because
  ``datasets`` names its cache ``acme___parquet_set``.
* ``acme/jsonl_set``: plain ``data/train.jsonl`` and ``data/test.jsonl``, no README (splits from file names).

Bundle ``main`` packs both (main) and the flat ``llamafactory/alpaca_en_demo`` (one .json at the top) and is
installed by ``bundler.install.install``; bundle ``v1`` packs ``hf:acme/ParquetSet@v1`` and is installed by its
own ``install.py`` (bare python3, no network); each into its own prefix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.install import install
from bundler.pack import pack
from bundler.spec import load_spec
from ferry.errors import BundleError, ConfigError
from tests.support.helpers import ALPACA_REPO, parquet_bytes, set_online_env
from tests.support.hub import DEFAULT_LFS, Hub
from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]
PARQUET_REPO, JSONL_REPO = "acme/ParquetSet", "acme/jsonl_set"
V1_ROWS = [{"instruction": f"v1 question {i}", "input": "", "output": f"v1 answer {i}"} for i in range(3)]
MAIN_ROWS = [
    {"instruction": f"main question {i}", "input": "ctx" if i % 2 else "", "output": f"main answer {i}"}
    for i in range(5)
]
TEST_ROWS = [{"instruction": "held out", "input": "", "output": "not trained"}]
JSONL_ROWS = [{"instruction": f"jsonl {i}", "input": "", "output": f"line {i}"} for i in range(4)]
CARD = """---
license: cc-by-4.0
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
---
# ParquetSet
"""

#: Runs offline with ferry.env sourced: both readers, the unpacked repo, and a revision argument.
PROBE = r"""
import json, os, sys, time
import datasets
from trainer.formats import load_samples, resolve_datasets
from ferry.errors import NotInstalledError
datasets.disable_progress_bars()
out = {"env": {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")}}
for repo in sys.argv[1].split(","):
    out[repo] = {"load_dataset": datasets.load_dataset(repo, split="train").to_list()}
    try:
        out[repo]["test_split"] = datasets.load_dataset(repo, split="test").to_list()
    except Exception as exc:
        out[repo]["test_split"] = f"{type(exc).__name__}: {exc}"
    out[repo]["revision_v1"] = datasets.load_dataset(repo, split="train", revision="v1").to_list()
for name in sys.argv[2].split(","):
    spec, = resolve_datasets([name], os.environ["FERRY_DATASET_DIR"])
    samples = load_samples(spec, stage="sft")
    out[name] = {"layout": spec.layout, "path": str(spec.path),
                 "turns": [[list(t) for t in s.turns] for s in samples]}
if len(sys.argv) > 3:  # a LLaMA-Factory dataset_info.json of the user's own, naming hub repos by hf_hub_url
    for name in json.load(open(os.path.join(sys.argv[3], "dataset_info.json"))):
        spec, = resolve_datasets([name], sys.argv[3])
        out[name] = {"turns": [[list(t) for t in s.turns] for s in load_samples(spec, stage="sft")]}
t = time.monotonic()
try:
    datasets.load_dataset("acme/never_packed", split="train")
except Exception as exc:
    out["missing"] = {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - t}
try:
    resolve_datasets(["never_packed"], os.environ["FERRY_DATASET_DIR"])
except NotInstalledError as exc:
    out["missing"]["ferry"] = str(exc)
print(json.dumps(out))
"""


def _turns(rows: list[dict]) -> list[list[list[str]]]:
    """ferry's alpaca reading of ``rows`` (instruction and input joined by a newline)."""
    return [
        [["user", "\n".join(p for p in (r["instruction"], r["input"]) if p)], ["assistant", r["output"]]] for r in rows
    ]


@pytest.fixture(scope="module")
def prefixes(hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both repos on the hub, bundles ``main`` and ``v1`` packed and installed into prefixes ``main`` and ``v1``
    (no venv). Returns ``{"main", "v1"}`` (prefix paths), ``"results"`` (PackResults), ``"installs"``."""
    lfs = (*DEFAULT_LFS, "*.parquet")
    hub.add_dataset(
        PARQUET_REPO,
        {
            "README.md": CARD,
            "data/train-00000-of-00001.parquet": parquet_bytes(V1_ROWS),
            "data/test-00000-of-00001.parquet": parquet_bytes(TEST_ROWS),
        },
        lfs=lfs,
        tag="v1",
    )
    hub.add_dataset(
        PARQUET_REPO,
        {
            "README.md": CARD,
            "data/train-00000-of-00001.parquet": parquet_bytes(MAIN_ROWS),
            "data/test-00000-of-00001.parquet": parquet_bytes(TEST_ROWS),
        },
        lfs=lfs,
    )
    jsonl = "".join(json.dumps(r) + "\n" for r in JSONL_ROWS)
    hub.add_dataset(JSONL_REPO, {"data/train.jsonl": jsonl, "data/test.jsonl": json.dumps(TEST_ROWS[0]) + "\n"})
    root = tmp_path_factory.mktemp("hub-datasets")
    found: dict = {"results": {}, "installs": {}}
    with pytest.MonkeyPatch.context() as mp:
        set_online_env(mp, hub, root / "hf-home-packer")
        for name, sources in (
            ("main", [f"hf:{PARQUET_REPO}", f"hf:{JSONL_REPO}", f"hf:{ALPACA_REPO}"]),
            ("v1", [f"hf:{PARQUET_REPO}@v1"]),
        ):
            found["results"][name] = pack(
                load_spec(name=f"ds-{name}", datasets=sources, no_wheels=True), root / "out", progress=False
            )
            found[name] = root / f"prefix-{name}"
            if name == "main":
                found["installs"][name] = install(root / "out" / f"ds-{name}.ferry.tar", found[name], create_venv=False)
    # v1 the way an isolated host without ferry installs it: the bundle's install.py, bare python3, no network
    found["v1_stdout"] = run_offline(
        [
            "/usr/bin/python3",
            "-I",
            str(root / "out" / "ds-v1" / "install.py"),
            "--prefix",
            str(found["v1"]),
            "--no-venv",
        ],
        env={"PATH": os.environ["PATH"]},
        cwd=root,
    ).stdout
    return found


def _offline_probe(prefix: Path, repos: str, names: str, home: Path, *extra: str) -> dict:
    """PROBE under ``unshare -rn`` with only ferry.env (+ PATH, PYTHONPATH for ferry, HOME) in the environment."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(home)}
    script = f'. {prefix}/ferry.env && exec {sys.executable} -c "$0" "$@"'
    proc = run_offline(["sh", "-c", script, PROBE, repos, names, *extra], env=env, cwd=ROOT, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pack_carries_the_repo_and_its_datasets_cache(prefixes: dict) -> None:
    item = next(i for i in prefixes["results"]["main"].manifest["items"] if i["repo_id"] == PARQUET_REPO)
    paths = sorted(e["path"] for e in item["files"])
    commit = item["revision"]
    cache = f".ferry-datasets-cache/acme___parquet_set/default/0.0.0/{commit}"
    assert paths == [
        cache + "/dataset_info.json",
        cache + "/parquet_set-test.arrow",
        cache + "/parquet_set-train.arrow",
        "README.md",
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00001.parquet",
    ]
    assert item["license"] == "cc-by-4.0"
    assert prefixes["results"]["main"].notes == []


def test_install_places_hub_cache_arrow_cache_and_one_dataset_info_entry(prefixes: dict) -> None:
    prefix = prefixes["main"]
    report = prefixes["installs"]["main"]
    by_repo = {d["repo_id"]: d for d in report.datasets}
    assert by_repo[PARQUET_REPO]["entries"] == ["ParquetSet"] and by_repo[JSONL_REPO]["entries"] == ["jsonl_set"]
    info = json.loads((prefix / "datasets" / "dataset_info.json").read_text())
    assert info == {
        "ParquetSet": {"hf_hub_url": PARQUET_REPO},
        "jsonl_set": {"hf_hub_url": JSONL_REPO},
        "alpaca_en_demo": {"file_name": "alpaca_en_demo/alpaca_en_demo.json"},
    }  # flat: per file
    repo = prefix / "hf-home" / "hub" / "datasets--acme--ParquetSet"
    commit = (repo / "refs" / "main").read_text()
    snap = repo / "snapshots" / commit
    assert sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if not p.is_dir()) == [
        "README.md",
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00001.parquet",
    ]
    placed = prefix / "datasets" / "ParquetSet" / "data" / "train-00000-of-00001.parquet"
    assert os.path.samefile(snap / "data" / "train-00000-of-00001.parquet", placed)  # one copy of the bytes
    assert (
        f"dataset  ParquetSet -> {prefix}/datasets/ParquetSet (dataset_info: ParquetSet; "
        f"datasets.load_dataset('acme/ParquetSet'))"
    ) in report.summary()
    assert (
        f"dataset ParquetSet -> {prefixes['v1']}/datasets/ParquetSet (ParquetSet; "
        f"datasets.load_dataset('acme/ParquetSet'))"
    ) in prefixes["v1_stdout"]
    link = prefix / "hf-home" / "datasets" / "acme___parquet_set"
    assert os.readlink(link) == "../../datasets/ParquetSet/.ferry-datasets-cache/acme___parquet_set"
    # the revision packed by tag has refs/v1 only, as for models
    v1_repo = prefixes["v1"] / "hf-home" / "hub" / "datasets--acme--ParquetSet"
    assert sorted(p.name for p in (v1_repo / "refs").iterdir()) == ["v1"]


def test_load_dataset_and_ferry_read_the_same_rows_offline(
    prefixes: dict, tmp_path: Path, llamafactory_data: Path
) -> None:
    own = tmp_path / "my_data"
    own.mkdir()
    (own / "dataset_info.json").write_text(
        json.dumps(
            {
                "my_jsonl_test": {"hf_hub_url": JSONL_REPO, "ms_hub_url": "acme/jsonl_set", "split": "test"},
                "my_parquet": {
                    "hf_hub_url": PARQUET_REPO,
                    "split": "test",
                    "columns": {"prompt": "output", "query": "input", "response": "instruction"},
                },
            }
        )
    )
    found = _offline_probe(
        prefixes["main"],
        f"{PARQUET_REPO},{JSONL_REPO},{ALPACA_REPO}",
        "ParquetSet,jsonl_set,alpaca_en_demo",
        tmp_path,
        str(own),
    )
    assert found["env"]["HF_HUB_OFFLINE"] == "1" and found["env"]["HF_DATASETS_CACHE"] is None
    assert found[PARQUET_REPO]["load_dataset"] == MAIN_ROWS
    assert found[PARQUET_REPO]["test_split"] == TEST_ROWS
    assert found[JSONL_REPO]["load_dataset"] == JSONL_ROWS
    assert found[JSONL_REPO]["test_split"] == TEST_ROWS
    # offline, datasets does not consult `revision`: it reads the one installed copy (main here)
    assert found[PARQUET_REPO]["revision_v1"] == MAIN_ROWS
    assert found["ParquetSet"]["turns"] == _turns(MAIN_ROWS) and found["ParquetSet"]["layout"] == "repo"
    assert found["jsonl_set"]["turns"] == _turns(JSONL_ROWS)
    # a flat repo (one .json at the top, as LLaMA-Factory's): by repo id, and by its file's dataset_info entry
    alpaca = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())
    assert found[ALPACA_REPO]["load_dataset"] == alpaca and len(alpaca) == 999
    assert found["alpaca_en_demo"]["turns"] == _turns(alpaca) and found["alpaca_en_demo"]["layout"] == "json"
    # the user's own dataset_info.json: hf_hub_url entries resolve to the installed repos, keys honoured
    assert found["my_jsonl_test"]["turns"] == _turns(TEST_ROWS)
    assert found["my_parquet"]["turns"] == [[["user", r["output"]], ["assistant", r["instruction"]]] for r in TEST_ROWS]
    assert "/hf-home/hub/datasets--acme--ParquetSet/snapshots/" in found["ParquetSet"]["path"]
    missing = found["missing"]
    assert missing["error"] == "ConnectionError: Couldn't reach 'acme/never_packed' on the Hub (OfflineModeIsEnabled)"
    assert missing["s"] < 5, missing  # refused at once, no network wait
    assert missing["ferry"].startswith("dataset 'never_packed' is neither in ")


def test_a_revision_packed_by_tag_is_what_both_readers_get(prefixes: dict, tmp_path: Path) -> None:
    found = _offline_probe(prefixes["v1"], PARQUET_REPO, "ParquetSet", tmp_path)
    assert found[PARQUET_REPO]["load_dataset"] == V1_ROWS
    assert found[PARQUET_REPO]["revision_v1"] == V1_ROWS
    assert found["ParquetSet"]["turns"] == _turns(V1_ROWS)


def test_reinstall_is_unchanged_and_verify_prefix_is_clean(prefixes: dict) -> None:
    from bundler.installer.prefix import verify_prefix

    again = install(prefixes["results"]["main"].bundle_dir, prefixes["main"], create_venv=False)
    assert [d["outcome"] for d in again.datasets] == ["unchanged"] * 3 and again.repaired == []
    assert verify_prefix(prefixes["main"])["problems"] == []


def test_a_repo_the_datasets_library_cannot_read_is_packed_with_a_note(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two files of one split with other columns (as LLaMA-Factory's demo_data repo): no online load reads it either
    hub.add_dataset("acme/mixed", {"data/a.jsonl": '{"x": 1}\n', "data/b.jsonl": '{"y": "text"}\n'})
    for key, value in hub.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    result = pack(load_spec(name="mixed", datasets=["hf:acme/mixed"], no_wheels=True), tmp_path / "out", progress=False)
    item = result.manifest["items"][0]
    assert sorted(e["path"] for e in item["files"]) == ["data/a.jsonl", "data/b.jsonl"]
    assert len(result.notes) == 1 and "datasets.load_dataset('acme/mixed') will not find it offline" in result.notes[0]
    assert "note      hf:acme/mixed: no datasets cache packed" in result.summary()
    # installed, its files keep one dataset_info.json entry each (LLaMA-Factory's file_name), as before
    report = install(result.bundle_dir, tmp_path / "prefix", create_venv=False)
    assert report.datasets[0]["entries"] == ["a", "b"]
    assert not (tmp_path / "prefix" / "hf-home" / "datasets").exists()
    assert (tmp_path / "prefix" / "hf-home" / "hub" / "datasets--acme--mixed" / "refs" / "main").is_file()


def test_another_revision_installed_over_it_is_what_both_readers_get(prefixes: dict, tmp_path: Path) -> None:
    """main, then v1 with --replace-datasets: the hub cache keeps both snapshots and refs/main, the dataset folder
    and the datasets cache hold v1; ferry's `dataset: ParquetSet` (hf_hub_url) follows what load_dataset reads."""
    prefix = tmp_path / "prefix"
    out = prefixes["results"]["main"].bundle_dir.parent
    install(out / "ds-main.ferry.tar", prefix, create_venv=False)
    with pytest.raises(BundleError, match="dataset 'ParquetSet' is already installed"):
        install(out / "ds-v1.ferry.tar", prefix, create_venv=False)
    install(out / "ds-v1.ferry.tar", prefix, create_venv=False, replace_datasets=True)
    repo = prefix / "hf-home" / "hub" / "datasets--acme--ParquetSet"
    assert sorted(p.name for p in (repo / "refs").iterdir()) == ["main", "v1"]
    assert len(list((repo / "snapshots").iterdir())) == 2
    found = _offline_probe(prefix, PARQUET_REPO, "ParquetSet", tmp_path)
    assert found[PARQUET_REPO]["load_dataset"] == V1_ROWS
    assert found["ParquetSet"]["turns"] == _turns(V1_ROWS)
    assert found["ParquetSet"]["path"].endswith((repo / "refs" / "v1").read_text())


#: Runs offline on a read-only prefix: load_dataset by repo id as is, ferry's loader, then the documented way out.
READ_ONLY = r"""
import json, os, sys
import datasets
from trainer.formats import load_samples, resolve_datasets
datasets.disable_progress_bars()
out = {}
try:
    out["load_dataset"] = datasets.load_dataset(sys.argv[1], split="train").to_list()
except Exception as exc:
    out["load_dataset"] = f"{type(exc).__name__}: {exc}"
spec, = resolve_datasets([sys.argv[2]], os.environ["FERRY_DATASET_DIR"])
out["ferry"] = [[list(t) for t in s.turns] for s in load_samples(spec, stage="sft")]
print(json.dumps(out))
"""


def test_a_read_only_prefix_needs_a_writable_datasets_cache_for_load_dataset(prefixes: dict, tmp_path: Path) -> None:
    """``datasets`` takes a file lock in HF_DATASETS_CACHE even to read its cache: on a prefix this account cannot
    write (read-only here; a shared install by root alike) load_dataset("ORG/NAME") fails, ferry's loader does not
    (it writes to ferry's own cache); linking the installed cache into a writable HF_DATASETS_CACHE (README) works."""
    prefix = prefixes["main"]
    own = tmp_path / "hf-datasets"
    own.mkdir()
    os.symlink(prefix / "hf-home" / "datasets" / "acme___parquet_set", own / "acme___parquet_set")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    run = f'{sys.executable} -c "$0" {PARQUET_REPO} ParquetSet'
    script = (
        f"ip link set lo up && mount --bind {prefix} {prefix} && mount -o remount,bind,ro {prefix} && "
        f". {prefix}/ferry.env && {run} && HF_DATASETS_CACHE={own} {run}"
    )
    proc = subprocess.run(
        ["unshare", "-rmn", "sh", "-c", script, READ_ONLY],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    as_is, linked = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert as_is["load_dataset"].startswith("OSError: [Errno 30] Read-only file system: ")
    assert as_is["ferry"] == _turns(MAIN_ROWS) == linked["ferry"]
    assert linked["load_dataset"] == MAIN_ROWS


def test_datasets_cache_false_packs_the_repo_alone(
    hub: Hub, prefixes: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in hub.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        f"name: bare\ndatasets:\n  - source: hf:{PARQUET_REPO}\n    datasets_cache: false\nwheels:\n  no_wheels: true\n"
    )
    item = pack(load_spec(spec_file), tmp_path / "out", progress=False).manifest["items"][0]
    assert sorted(e["path"] for e in item["files"]) == [
        "README.md",
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00001.parquet",
    ]
    # installed: in the hub cache (ferry's hf_hub_url entries read it), and one entry per data file, as before
    report = install(tmp_path / "out" / "bare.ferry.tar", tmp_path / "prefix", create_venv=False)
    assert sorted(report.datasets[0]["entries"]) == ["test-00000-of-00001", "train-00000-of-00001"]
    assert report.datasets[0]["arrow_cache"] is None and report.datasets[0]["hub_path"].endswith(item["revision"])
    spec_file.write_text("name: bad\nmodels:\n  - source: hf:a/b\n    datasets_cache: false\n")
    with pytest.raises(ConfigError, match="datasets_cache applies to hf: datasets only"):
        load_spec(spec_file)
