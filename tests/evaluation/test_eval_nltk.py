"""lm-eval's ifeval across the gap: the NLTK data its helpers download, carried in the bundle.

lm-eval's ifeval imports a helper that calls ``nltk.download("punkt_tab")`` unless ``nltk.data.find`` finds the
package, and counts sentences with NLTK's Punkt tokenizer. The NLTK index here is NLTK's own format, built by
NLTK's own ``build_index`` over a ``punkt_tab`` package that NLTK's own ``PunktTrainer`` learnt and
``save_punkt_params`` wrote (nltk_data on GitHub is out of this machine's reach; NLTK's downloader refuses
loopback servers, so the index is a ``file://`` one, as a mounted mirror would be). The olah hub serves
``google/IFEval`` (its real name and columns) with a few rows written here. The golden is lm-eval's own CLI,
online against the hub, with ``NLTK_DATA`` holding what NLTK's own downloader fetched from the same index.
"""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("langdetect")

from bundler.eval_tasks import plan_eval_tasks, task_requirements  # noqa: E402
from bundler.install import install  # noqa: E402
from bundler.nltk_data import fetch_nltk_packages  # noqa: E402
from bundler.pack import pack  # noqa: E402
from bundler.spec import load_spec  # noqa: E402
from ferry.errors import NotInstalledError, SourceError  # noqa: E402
from tests.support.evalrun import ferry_eval_offline, lm_eval_online  # noqa: E402
from tests.support.helpers import parquet_bytes, set_online_env  # noqa: E402
from tests.support.hub import DEFAULT_LFS, serve_hub  # noqa: E402

pytestmark = pytest.mark.budget(120, reason="ferry eval offline beside lm-eval's CLI online, on ifeval")

LIMIT = 4
IFEVAL_CARD = (
    "---\nlicense: apache-2.0\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
    "    path: ifeval_input_data.parquet\n---\n"
)
#: (prompt, [(instruction id, kwargs)]): instructions whose checks count sentences (Punkt) and words.
IFEVAL_ROWS = [
    (
        "Write a story about a cat. Use fewer than 3 sentences.",
        [("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"})],
    ),
    (
        "Tell me about the park in at least 4 sentences. Do not use any commas.",
        [
            ("length_constraints:number_sentences", {"num_sentences": 4, "relation": "at least"}),
            ("punctuation:no_comma", {}),
        ],
    ),
    (
        "Describe a dog in at least 20 words.",
        [("length_constraints:number_words", {"num_words": 20, "relation": "at least"})],
    ),
    ("Say hello in all lowercase letters.", [("change_case:english_lowercase", {})]),
    (
        "Write two sentences about the sun.",
        [("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"})],
    ),
]
KWARG_KEYS = ("num_sentences", "relation", "num_words")
PUNKT_TEXT = " ".join(
    f"Mr. Smith went to the park on day {i}. He saw a dog near the lake. Dr. Brown said hello. The dog ran fast."
    for i in range(40)
)


def _ifeval_rows() -> bytes:
    rows = []
    for key, (prompt, instructions) in enumerate(IFEVAL_ROWS):
        rows.append(
            {
                "key": 1000 + key,
                "prompt": prompt,
                "instruction_id_list": [name for name, _ in instructions],
                "kwargs": [{k: kwargs.get(k) for k in KWARG_KEYS} for _, kwargs in instructions],
            }
        )
    return parquet_bytes(rows)


def make_nltk_index(root: Path) -> str:
    """An NLTK data index at ``root`` serving one package, punkt_tab (english), trained and written by NLTK;
    returns its ``file://`` URL."""
    import nltk
    from nltk import downloader
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    stage = root / "stage"
    (root / "packages" / "tokenizers").mkdir(parents=True)
    (stage / "punkt_tab").mkdir(parents=True)
    nltk.data.path.append(str(stage))  # NLTK writes only inside its data path
    trainer = PunktTrainer()
    trainer.train(PUNKT_TEXT, finalize=True)
    save_punkt_params(trainer.get_params(), str(stage / "punkt_tab" / "english"))
    for table in (stage / "punkt_tab" / "english").iterdir():  # sets, written in this process's hash order
        text = table.read_text()
        table.write_text("\n".join(sorted(text.splitlines())) + ("\n" if text.endswith("\n") else ""))
    # the same bytes every run (fixed entry times): the lm-eval golden that reads the unpacked package is keyed by them
    with zipfile.ZipFile(root / "packages" / "tokenizers" / "punkt_tab.zip", "w") as zf:
        for path in sorted(stage.rglob("*")):
            name = path.relative_to(stage).as_posix() + ("/" if path.is_dir() else "")
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o40755 if path.is_dir() else 0o100644) << 16
            zf.writestr(info, b"" if path.is_dir() else path.read_bytes())
    (root / "packages" / "tokenizers" / "punkt_tab.xml").write_text(
        '<package id="punkt_tab" name="Punkt Tokenizer Models (tab)" unzip="1" license="Apache License, Version 2.0" />'
    )
    nltk.data.path.append(str(root))
    index = downloader.build_index(str(root), f"file://{root}/packages")
    (root / "index.xml").write_bytes(ET.tostring(index))
    return f"file://{root}/index.xml"


@pytest.fixture(scope="module")
def nltk_index(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("nltk-index")
    os.chmod(root, 0o700)
    return {"root": root, "url": make_nltk_index(root)}


@pytest.fixture(scope="module")
def carried(tmp_path_factory, stories_model, nltk_index):
    """``ifeval`` packed from the hub by its name (NLTK data from the test index), installed into ``prefix``."""
    root = tmp_path_factory.mktemp("ifeval-pack")
    os.chmod(root, 0o700)
    with serve_hub(root / "hub") as hub:
        hub.add_dataset(
            "google/IFEval",
            {"README.md": IFEVAL_CARD, "ifeval_input_data.parquet": _ifeval_rows()},
            lfs=(*DEFAULT_LFS, "*.parquet"),
        )
        spec = load_spec(name="ifevalkit", eval_tasks=["ifeval"], no_wheels=True)
        spec.nltk_index_url = nltk_index["url"]
        with pytest.MonkeyPatch.context() as mp:
            set_online_env(mp, hub, root / "hf-home-packer")
            result = pack(spec, root / "out", progress=False)
        prefix = root / "prefix"
        install(root / "out" / "ifevalkit.ferry.tar", prefix, create_venv=False)
        yield {"root": root, "hub": hub, "result": result, "prefix": prefix, "model": stories_model, "spec": spec}


def test_the_plan_names_the_nltk_package_and_the_imports_lm_eval_lists():
    (task,) = plan_eval_tasks(["ifeval"])
    assert task.repo_id == "google/IFEval" and task.nltk == ("punkt_tab",)
    from importlib.metadata import requires

    extra = {r.split(";")[0].strip() for r in requires("lm-eval") or [] if 'extra == "ifeval"' in r}
    assert set(task_requirements([task])) == extra == {"langdetect", "immutabledict", "nltk>=3.9.1"}


def test_the_bundle_carries_the_package_nltk_downloaded_and_the_spec_adds_the_imports(carried, nltk_index, tmp_path):
    items = {i["repo_id"]: i for i in carried["result"].manifest["items"]}
    nltk_item = items["tokenizers/punkt_tab"]
    assert (nltk_item["kind"], nltk_item["source"], nltk_item["path"]) == (
        "dataset",
        "nltk",
        "datasets/nltk/tokenizers/punkt_tab",
    )
    index = ET.parse(nltk_index["root"] / "index.xml").getroot()
    (package,) = index.iter("package")
    assert nltk_item["revision"] == package.get("sha256_checksum")
    assert nltk_item["eval_tasks"] == [{"task": "ifeval", "config": None, "version": None}]
    assert nltk_item["license"] == "Apache License, Version 2.0"
    # NLTK's own downloader, from the same index, into a folder of its own: the installed package is the same
    from nltk.downloader import Downloader

    own = tmp_path / "nltk-own"
    own.mkdir(mode=0o700)
    assert Downloader(server_index_url=nltk_index["url"]).download("punkt_tab", download_dir=str(own), quiet=True)
    theirs = own / "tokenizers" / "punkt_tab"
    ours = carried["prefix"] / "nltk_data" / "tokenizers" / "punkt_tab"
    names = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file())
    assert names == sorted(e["path"] for e in nltk_item["files"]) and "english/collocations.tab" in names
    assert all((ours / n).read_bytes() == (theirs / n).read_bytes() for n in names)
    env_text = (carried["prefix"] / "ferry.env").read_text()
    assert f"export NLTK_DATA={carried['prefix'] / 'nltk_data'}" in env_text
    assert carried["spec"].eval_requirements == ["immutabledict", "langdetect", "nltk>=3.9.1"]


def test_dry_run_names_the_nltk_package_beside_the_dataset(carried, nltk_index, tmp_path):
    from ferry.fsutil import format_bytes
    from tests.support.evalrun import ROOT, online_env
    from tests.support.helpers import EVAL_IMPORTS, run_ferry

    env = online_env()
    env.update(carried["hub"].env(), HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(ROOT))
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: dry\neval: [ifeval]\nnltk_index_url: {nltk_index['url']}\n")
    proc = run_ferry(["pack", str(spec), "--dry-run", "--no-wheels"], env=env, cwd=tmp_path, preload=EVAL_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval")]
    assert lines[0].split()[1].startswith("google/IFEval@") and lines[0].endswith("tasks: ifeval")
    index = ET.parse(nltk_index["root"] / "index.xml").getroot()
    (package,) = index.iter("package")
    size = format_bytes(int(package.get("size")))
    assert (
        lines[1] == f"eval      nltk:tokenizers/punkt_tab@{package.get('sha256_checksum')[:12]}  {size}  tasks: ifeval"
    )


def test_the_installed_package_is_verified_and_listed_and_a_changed_file_is_named(carried):
    from bundler.installer.prefix import installed_items
    from bundler.verify import verify_prefix
    from ferry.errors import IntegrityError

    prefix = carried["prefix"]
    assert verify_prefix(prefix).files_checked >= 4
    (item,) = [i for i in installed_items(prefix) if i["source"] == "nltk"]
    assert item["repo_id"] == "tokenizers/punkt_tab"
    package = prefix / "nltk_data" / "tokenizers" / "punkt_tab"
    assert {Path(f["at"]) for f in item["files"]} == {p for p in package.rglob("*") if p.is_file()}
    tab = package / "english" / "sent_starters.txt"
    kept = tab.read_bytes()
    try:
        tab.write_bytes(kept + b"planted\n")
        with pytest.raises(IntegrityError, match=r"nltk_data/tokenizers/punkt_tab/english/sent_starters\.txt"):
            verify_prefix(prefix)
    finally:
        tab.write_bytes(kept)


def test_a_manifest_whose_nltk_item_has_no_sha256_revision_is_refused(carried):
    import copy

    from bundler.installer.manifest import validate_manifest
    from ferry.errors import UnsafeArchiveError

    manifest = copy.deepcopy(carried["result"].manifest)
    validate_manifest(manifest)
    (item,) = [i for i in manifest["items"] if i["source"] == "nltk"]
    item["revision"] = "main"
    with pytest.raises(UnsafeArchiveError, match=r"revision: 'main' \(the package zip's sha256 expected\)"):
        validate_manifest(manifest)


@pytest.mark.slow
def test_ifeval_offline_equals_lm_evals_cli_online_with_nltks_own_download(carried, nltk_index):
    out = carried["root"] / "ferry-ifeval"
    gen = "max_gen_toks=48"  # ifeval asks for 1280 new tokens; stories260K's context is 512
    proc = ferry_eval_offline(
        carried["prefix"], carried["root"], carried["model"], out, ["ifeval"], LIMIT, "--gen-kwargs", gen
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Downloaded punkt_tab" not in proc.stdout + proc.stderr
    nltk_home = carried["root"] / "nltk-golden"
    nltk_home.mkdir(mode=0o700)
    from nltk.downloader import Downloader

    assert Downloader(server_index_url=nltk_index["url"]).download("punkt_tab", download_dir=str(nltk_home), quiet=True)
    golden = lm_eval_online(
        carried["hub"],
        carried["root"] / "golden-ifeval",
        f"pretrained={carried['model']}",
        ["ifeval"],
        LIMIT,
        "--gen_kwargs",
        gen,
        inputs={"model": carried["model"], "nltk_data": nltk_home},
        NLTK_DATA=str(nltk_home),
    )
    ours = json.loads((out / "base" / "results.json").read_text())
    assert ours["results"]["ifeval"] == golden["results"]["ifeval"]
    assert ours["versions"]["ifeval"] == golden["versions"]["ifeval"] == 4.0
    assert ours["n-samples"]["ifeval"] == {"original": len(IFEVAL_ROWS), "effective": LIMIT}
    assert {"prompt_level_strict_acc,none", "inst_level_loose_acc,none"} <= set(ours["results"]["ifeval"])


@pytest.mark.slow
def test_without_the_nltk_data_ifeval_is_refused_in_one_line_before_a_model_loads(carried, tmp_path):
    prefix = tmp_path / "prefix"
    shutil.copytree(carried["prefix"], prefix, symlinks=True)
    shutil.rmtree(prefix / "nltk_data" / "tokenizers" / "punkt_tab")
    env_file = prefix / "ferry.env"  # the copy's own paths
    env_file.write_text(env_file.read_text().replace(str(carried["prefix"]), str(prefix)))
    out = tmp_path / "out"
    proc = ferry_eval_offline(prefix, tmp_path, carried["model"], out, ["ifeval"], LIMIT)
    assert proc.returncode == NotInstalledError.exit_code, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ferry: error:")]
    assert len(errors) == 1 and "task 'ifeval' needs NLTK data 'punkt_tab', which is not installed" in errors[0]
    assert not out.exists()


def test_a_package_the_index_lacks_or_whose_zip_is_not_the_indexed_one_is_refused(nltk_index, tmp_path):
    with pytest.raises(SourceError, match=r"NLTK package 'punkt' \(needed by ifeval\): index file://.*not found"):
        fetch_nltk_packages(["punkt"], tmp_path / "cache", nltk_index["url"], users={"punkt": ["ifeval"]})
    bad = tmp_path / "bad-index"
    shutil.copytree(nltk_index["root"], bad)
    os.chmod(bad, 0o700)
    zip_path = bad / "packages" / "tokenizers" / "punkt_tab.zip"
    with zipfile.ZipFile(zip_path, "a") as zf:
        zf.writestr("punkt_tab/english/extra.txt", "planted\n")
    text = (bad / "index.xml").read_text().replace(str(nltk_index["root"]), str(bad))
    (bad / "index.xml").write_text(text)
    with pytest.raises(SourceError, match=r"NLTK package 'punkt_tab' from file://.*(sha256|md5|ntegrity)"):
        fetch_nltk_packages(["punkt_tab"], tmp_path / "cache2", f"file://{bad}/index.xml")
