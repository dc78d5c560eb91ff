"""``ferry pack`` with a spec's ``training_config``: the hub models the run loads are carried (for the preference
stages its ref_model and ref_model_adapters too), and a preference stage whose data the bundle would not install, or
whose data is of the wrong kind, is refused on the online side. The configs are LLaMA-Factory 0.9.5's own
examples (hash-pinned sdist) and its own data folder; the slow test packs from a real hub (olah), installs with no
network and trains stage dpo from the installed bundle alone."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from bundler.spec import load_spec
from ferry.errors import ConfigError
from tests.support.helpers import ROOT, STORIES_REPO, worker_env, write_config
from tests.support.netns import run_offline
from tests.support.pinned_sdist import LLAMAFACTORY

pytestmark = pytest.mark.budget(90, reason="packs from the test hub, installs offline and trains from the prefix")

QWEN = "Qwen/Qwen3-4B-Instruct-2507"  # the model of LLaMA-Factory's examples


def _example(name: str, tmp_path: Path, **changes: Any) -> Path:
    """LLaMA-Factory's ``examples/train_lora/NAME`` written to ``tmp_path`` with ``changes`` (None removes a
    key)."""
    cfg = yaml.safe_load((LLAMAFACTORY.path() / "examples" / "train_lora" / name).read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return write_config(tmp_path / name, cfg)


def _spec(tmp_path: Path, config: Path, **extra: Any) -> Path:
    spec = {"name": "kit", "wheels": {"no_wheels": True}, "training_config": config.name, **extra}
    return write_config(tmp_path / "spec.yaml", spec)


def _models(spec: Any) -> list[str]:
    return [src.source for src in spec.models]


def test_a_preference_config_carries_its_hub_models_once(tmp_path):
    data = str(LLAMAFACTORY.path() / "data")
    (tmp_path / "trained-here").mkdir()  # an adapter folder of this host: a path, not carried
    config = _example(
        "qwen3_lora_dpo.yaml", tmp_path, ref_model="org/ref", ref_model_adapters="hf:org/sft, trained-here"
    )
    spec = load_spec(_spec(tmp_path, config, datasets=[data]))
    assert _models(spec) == [f"hf:{QWEN}", "hf:org/ref", "hf:org/sft"]
    assert spec.notes[0] == f"model_name_or_path: {QWEN} is carried as hf:{QWEN} (named by {config})"
    assert [n.split(":")[0] for n in spec.notes] == ["model_name_or_path", "ref_model", "ref_model_adapters"]
    # a model the spec carries already, from either hub, is not added again
    spec = load_spec(_spec(tmp_path, config, datasets=[data], models=[f"ms:{QWEN}", "hf:org/ref@v1"]))
    assert _models(spec) == [f"ms:{QWEN}", "hf:org/ref@v1", "hf:org/sft"]
    # an SFT config carries its model; its data is not a preference stage's to check
    sft = _example("qwen3_lora_sft.yaml", tmp_path)
    assert _models(load_spec(_spec(tmp_path, sft, models=["hf:org/other"]))) == ["hf:org/other", f"hf:{QWEN}"]


def test_local_repo_ids_must_be_local_models_of_the_spec(tmp_path):
    data = str(LLAMAFACTORY.path() / "data")
    config = _example("qwen3_lora_dpo.yaml", tmp_path, model_name_or_path="local/my-base")
    with pytest.raises(ConfigError, match=r"model_name_or_path: local/my-base is the repo id of a local folder"):
        load_spec(_spec(tmp_path, config, datasets=[data]))
    (tmp_path / "models" / "my-base").mkdir(parents=True)
    spec = load_spec(_spec(tmp_path, config, datasets=[data], models=["models/my-base"]))
    assert _models(spec) == [str(tmp_path / "models" / "my-base")] and spec.notes == []


@pytest.mark.parametrize(
    ("example", "changes", "datasets", "refusal"),
    [
        ("qwen3_lora_dpo.yaml", {}, [], r"dataset: 'dpo_en_demo' is not in the bundle, so stage: dpo"),
        # the file alone registers under its stem (as the installer registers it), without the ranking entry
        ("qwen3_lora_dpo.yaml", {}, ["DATA/dpo_en_demo.json"], r"dataset: dataset 'dpo_en_demo': not a ranking"),
        ("qwen3_lora_dpo.yaml", {"dataset": "alpaca_en_demo"}, ["DATA"], r"'alpaca_en_demo': not a ranking dataset"),
        ("qwen3_lora_kto.yaml", {"dataset": "dpo_en_demo"}, ["DATA"], r"'dpo_en_demo': key 'ranking': .* stage: kto"),
        ("qwen3_lora_kto.yaml", {"dataset": "alpaca_en_demo"}, ["DATA"], r"no columns.kto_tag, so stage: kto"),
        ("qwen3_lora_reward.yaml", {"eval_dataset": "kto_en_demo"}, ["DATA"], r"eval_dataset: dataset 'kto_en_demo'"),
    ],
)
def test_a_preference_stage_without_its_kind_of_data_is_refused_before_anything_is_fetched(
    tmp_path, example, changes, datasets, refusal
):
    data = str(LLAMAFACTORY.path() / "data")
    config = _example(example, tmp_path, **changes)
    spec_file = _spec(tmp_path, config, datasets=[d.replace("DATA", data) for d in datasets])
    with pytest.raises(ConfigError, match=refusal) as err:
        load_spec(spec_file)
    assert str(err.value).startswith(f"training_config {config}: ") and "\n" not in str(err.value)


def test_the_stages_own_data_passes_and_dataset_dir_is_the_isolated_hosts(tmp_path):
    data = str(LLAMAFACTORY.path() / "data")
    for example in ("qwen3_lora_dpo.yaml", "qwen3_lora_kto.yaml", "qwen3_lora_reward.yaml"):
        assert _models(load_spec(_spec(tmp_path, _example(example, tmp_path), datasets=[data]))) == [f"hf:{QWEN}"]
    # with dataset_dir the data is read on the isolated host from a folder this host cannot see: not checked
    config = _example("qwen3_lora_dpo.yaml", tmp_path, dataset_dir="/srv/preference-data")
    assert load_spec(_spec(tmp_path, config)).datasets == []
    # a registry that is not JSON is named
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset_info.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"broken: dataset broken: dataset_info.json is not valid JSON"):
        load_spec(_spec(tmp_path, _example("qwen3_lora_dpo.yaml", tmp_path), datasets=[str(broken)]))
    # an entry whose file_name leaves its folder is not registered, here as at install
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (tmp_path / "dpo_en_demo.json").write_text("[]")
    entry = {"file_name": "../dpo_en_demo.json", "ranking": True, "columns": {"chosen": "c", "rejected": "r"}}
    (hostile / "dataset_info.json").write_text(json.dumps({"dpo_en_demo": entry}))
    with pytest.raises(ConfigError, match=r"dataset: 'dpo_en_demo' is not in the bundle"):
        load_spec(_spec(tmp_path, _example("qwen3_lora_dpo.yaml", tmp_path), datasets=[str(hostile)]))


@pytest.mark.slow
def test_a_dpo_bundle_trains_offline_from_what_pack_carried(hub_env, stories_model: Path, tmp_path: Path):
    """The spec names no model: its training config's model, ref_model and ref_model_adapters (hub repo ids)
    are carried from the hub, installed with no network, and the run trains from the prefix alone."""
    from click.testing import CliRunner

    from ferry.cli import cli
    from tests.support.lora import random_adapter

    adapter = random_adapter(stories_model, tmp_path / "sft-adapter")
    hub_env.add_model("org/stories-sft", {p.name: p for p in adapter.iterdir() if p.is_file()})
    data = tmp_path / "prefs"
    data.mkdir()
    lf_data = LLAMAFACTORY.path() / "data"
    shutil.copy(lf_data / "dpo_en_demo.json", data)
    entry = json.loads((lf_data / "dataset_info.json").read_text())["dpo_en_demo"]
    (data / "dataset_info.json").write_text(json.dumps({"dpo_en_demo": entry}))
    config = _example(
        "qwen3_lora_dpo.yaml",
        tmp_path,
        model_name_or_path=STORIES_REPO,
        ref_model=STORIES_REPO,
        ref_model_adapters="org/stories-sft",
        template="default",
        output_dir=str(tmp_path / "out"),
        cutoff_len=64,
        max_samples=8,
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        preprocessing_num_workers=1,
        bf16=False,
        trust_remote_code=False,
        logging_steps=1,
        disable_tqdm=True,
    )
    spec = _spec(tmp_path, config, datasets=["prefs"])
    packed = CliRunner().invoke(cli, ["pack", str(spec), "-o", str(tmp_path / "bundle"), "-q"])
    assert packed.exit_code == 0, packed.output
    assert "note      ref_model_adapters: org/stories-sft is carried as hf:org/stories-sft" in packed.output
    prefix = tmp_path / "prefix"
    env = {k: v for k, v in os.environ.items() if k != "HF_ENDPOINT"}
    bundle = tmp_path / "bundle" / "kit.ferry.tar"
    install = [sys.executable, "-m", "ferry", "install", "-q", str(bundle), "--prefix", str(prefix), "--no-venv"]
    run_offline(install, env=env, cwd=ROOT)
    from bundler.install import prefix_env

    work = tmp_path / "work"
    work.mkdir()
    train_env = {**worker_env(work), **prefix_env(prefix)}
    proc = run_offline([sys.executable, "-m", "ferry", "train", str(config)], env=train_env, cwd=work)
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert (report["stage"], report["global_steps"]) == ("dpo", 2)
    assert f"reference model: ref_model {STORIES_REPO}" in proc.stderr
    # the reference is the base with the carried SFT adapter merged, so the policy (the bare base at step 1)
    # does not start at ln 2 as it would against itself
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    assert abs(first["loss"] - math.log(2)) > 1e-4, first
