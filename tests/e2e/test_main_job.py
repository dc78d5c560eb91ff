"""The main job on real input, as a user runs it across the gap.

Online side: a real ``olah`` hub on 127.0.0.1 serves the real stories260K model as ``karpathy/stories260K`` and
LLaMA-Factory's ``alpaca_en_demo.json`` as a dataset repo; ``ferry pack`` takes both by repo id and downloads the
runtime wheels for this host with pip (ferry's own wheel included, torch pinned to the local CPU build).

Isolated side, everything under ``unshare -rn`` (no network at all): ``docker/install-bundle.sh`` (what the
Dockerfile runs, with ``--no-compile`` added: ``python3 install.py`` builds a fresh venv from the bundle's wheels alone,
with the bundle's own uv;
``pip check`` finds every requirement met), then, in that venv,
``ferry train`` (2 processes, gloo) on ``karpathy/stories260K`` by repo id, ``ferry export`` with its smoke
check, and a greedy generation from the merged model.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import yaml

from tests.support.hub import serve_hub
from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]
MODEL_REPO = "karpathy/stories260K"
DATASET_REPO = "llamafactory/alpaca_en_demo"

TRAIN_CONFIG = {
    "model_name_or_path": MODEL_REPO,
    "dataset": "alpaca_en_demo",
    "template": "alpaca",
    "cutoff_len": 128,
    "max_samples": 96,
    "val_size": 16,
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_target": "all",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "learning_rate": 3.0e-3,
    "max_steps": 20,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 2,
    "logging_steps": 2,
    "save_steps": 10,
    "eval_steps": 10,
    "seed": 7,
}

GENERATE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = tok("Once upon a time", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=24, do_sample=False)
print("GENERATION:", tok.decode(out[0], skip_special_tokens=True))
"""


pytestmark = pytest.mark.budget(
    450,
    reason="the main job end to end: pack from the hub and the package index, then install, train and export offline",
)


def test_main_job_pack_online_then_install_train_export_offline(
    tmp_path, stories_model, llamafactory_data, monkeypatch
):
    import bundler

    # ---- online host ------------------------------------------------------------------------------------
    with serve_hub(tmp_path / "hub") as hub:
        hub.add_model(MODEL_REPO, {p.name: p for p in sorted(stories_model.iterdir()) if p.is_file()})
        hub.add_dataset(DATASET_REPO, {"alpaca_en_demo.json": llamafactory_data / "alpaca_en_demo.json"})
        for key, value in hub.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "online-hf-home"))
        # this machine's CPU torch wheel lives in a local folder its pip.conf names; ferry uses no host pip
        # configuration by itself, so the folder is passed explicitly (without it: PyPI's CUDA build)
        from bundler.wheels import host_pip_config

        links = [p for p in host_pip_config().get("find-links", "").split() if list(Path(p).glob("torch-*.whl"))]
        spec = bundler.load_spec(
            name="main-job", models=[f"hf:{MODEL_REPO}"], datasets=[f"hf:{DATASET_REPO}"], find_links=links
        )
        packed = bundler.pack(spec, tmp_path / "out", progress=False)
    manifest = packed.manifest
    kinds = {item["kind"]: item for item in manifest["items"]}
    assert kinds["model"]["repo_id"] == MODEL_REPO and len(kinds["model"]["revision"]) == 40
    wheel_names = {f["path"] for f in kinds["wheels"]["files"]}
    for dist in ("torch-2.13.0", "transformers-", "peft-", "safetensors-", "llm_ferry-"):
        assert any(name.startswith(dist) for name in wheel_names), (dist, sorted(wheel_names))

    # ---- isolated host: no network from here on ---------------------------------------------------------
    bundle = packed.bundle_dir
    prefix = tmp_path / "prefix"
    run_dir = tmp_path / "run"
    merged = tmp_path / "merged"
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**TRAIN_CONFIG, "output_dir": str(run_dir)}))
    gen_script = tmp_path / "generate.py"
    gen_script.write_text(GENERATE)
    q = shlex.quote
    script = " && ".join(
        [
            "set -e",
            # --no-compile: modules compile when first imported (about 60 CPU-s less than compiling all ~13,000)
            f"sh {q(str(ROOT / 'docker' / 'install-bundle.sh'))} {q(str(bundle))} {q(str(prefix))} --no-compile",
            f". {q(str(prefix / 'ferry.env'))}",
            # the venv built from the bundle's wheels, not the test's own environment
            f'test "$(command -v ferry)" = {q(str(prefix / "venv" / "bin" / "ferry"))}',
            "python -m pip check",  # pip's own view of what the bundle's uv installed: every requirement met
            f"ferry train {q(str(config))} --nproc-per-node 2",
            f"ferry export --adapter {q(str(run_dir / 'adapter'))} --output {q(str(merged))} "
            "--prompt 'Once upon a time'",
            f"python {q(str(gen_script))} {q(str(merged))}",
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PIP_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if ".venv" not in p)
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as on a user's host: the venv keeps what its first imports compile
    proc = run_offline(["sh", "-c", script], env=env, cwd=tmp_path, timeout=1500)

    assert "No broken requirements found." in proc.stdout
    (installer,) = (prefix / "venv").glob("lib/python*/site-packages/torch-*.dist-info/INSTALLER")
    assert installer.read_text().strip() == "uv"  # the uv wheel the bundle carries installed the venv
    site = installer.parent.parent
    assert not (site / "transformers" / "models" / "bert" / "__pycache__").exists()  # never imported: not compiled
    assert list((site / "transformers" / "models" / "llama" / "__pycache__").glob("*.pyc"))  # compiled when imported
    report = json.loads((run_dir / "train_report.json").read_text())
    assert report["world_size"] == 2
    assert report["train_loss_final"] < report["train_loss_first"], report
    assert report["eval_loss_final"] is not None
    smoke = json.loads((merged / "smoke_report.json").read_text())
    assert smoke["passed"] is True and smoke["failures"] == []
    assert smoke["max_abs_diff"] is not None and smoke["max_abs_diff"] <= smoke["tolerance"]
    lineage = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert lineage["base_model_name_or_path"] == MODEL_REPO
    generation = [line for line in proc.stdout.splitlines() if line.startswith("GENERATION:")]
    assert generation and generation[0].startswith("GENERATION: Once upon a time")
    print(generation[0])
