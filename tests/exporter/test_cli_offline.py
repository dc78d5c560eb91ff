"""``ferry export`` and ``ferry smoke`` end to end through the CLI with no network (``unshare -rn``), the base
resolved by repo id from a Hugging Face cache as ``ferry install`` lays it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import LLAMA_TARGETS, make_adapter, run_ferry

pytestmark = pytest.mark.budget(120, reason="ferry export and its smoke check through the CLI under unshare -rn")

FERRY = [sys.executable, "-m", "ferry"]
REPO_ID = "ferry-test/stories260K"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(stories_model: Path, home: Path) -> Path:
    """Install stories260K into ``home/hub`` at commit :data:`COMMIT` (the cache layout huggingface_hub reads)."""
    repo = home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(stories_model, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def _ferry(args: list[str], env: dict[str, str] | None = None):
    """``ferry ARGS...`` with no network (forked: :func:`tests.support.helpers.run_ferry`), in this checkout."""
    return run_ferry(args, env=dict(os.environ) if env is None else env, cwd=Path.cwd(), offline=True)


def test_export_and_smoke_offline_through_cli(stories_model, tmp_path):
    hf_home = tmp_path / "hf"
    snapshot = _hf_cache(stories_model, hf_home)
    adapter = tmp_path / "saves" / "adapter"
    make_adapter(snapshot, adapter, target_modules=LLAMA_TARGETS, use_rslora=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(base_model_name_or_path=REPO_ID, revision=COMMIT)  # what the trainer writes
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0"}  # ferry must force offline by itself
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "merged"

    args = ["export", "--adapter", str(adapter), "--output", str(out), "--dtype", "bfloat16"]
    proc = _ferry([*args, "--prompt", "Once upon a time", "--max-new-tokens", "8"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "smoke     passed" in proc.stdout
    card = (out / "README.md").read_text()
    assert f"base_model: {REPO_ID}" in card and COMMIT in card
    meta = json.loads((out / "ferry_export.json").read_text())
    assert meta["base"] == {
        "repo_id": REPO_ID,
        "revision": COMMIT,
        "path": str(snapshot),
        "recorded_by_adapter": {"repo_id": REPO_ID, "revision": COMMIT},
    }
    smoke_report = json.loads((out / "smoke_report.json").read_text())
    assert smoke_report["passed"] and smoke_report["dtype"] == "bfloat16"

    proc = _ferry(["smoke", str(out), "--max-new-tokens", "4", "--json"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert report["passed"] and report["logits_match"] is True and report["base"] == str(snapshot)


def test_cli_refusals_are_one_line_errors(stories_model, tmp_path):
    base = tmp_path / "quantized"
    shutil.copytree(stories_model, base)
    (base / "config.json").chmod(0o644)
    adapter = tmp_path / "adapter"
    make_adapter(stories_model, adapter, target_modules=["q_proj"])
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (base / "config.json").write_text(json.dumps(config))
    proc = _ferry(["export", "--adapter", str(adapter), "--base", str(base), "-o", str(tmp_path / "out")])
    assert proc.returncode == 11
    assert proc.stderr.strip().splitlines()[-1].startswith("ferry: error: ") and "quantized (gptq)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_read_only_output_and_report_are_one_line_errors(stories_model, tmp_path):
    # a read-only bind mount (in a user + mount namespace: root there, yet the file system refuses writes)

    adapter = tmp_path / "adapter"
    make_adapter(stories_model, adapter, target_modules=["q_proj"])
    from exporter.export import export
    from exporter.options import ExportOptions

    export(adapter, tmp_path / "ro" / "merged", ExportOptions(base=stories_model, smoke=False))
    ro = tmp_path / "ro"
    read_only = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}"

    def ferry(*args: str) -> subprocess.CompletedProcess[str]:
        return run_ferry(list(args), env=dict(os.environ), cwd=Path.cwd(), mount_setup=read_only)

    runs = [
        ferry("export", "--adapter", str(adapter), "--base", str(stories_model), "-o", str(ro / "new")),
        ferry("smoke", str(ro / "merged"), "--max-new-tokens", "2"),
        ferry("smoke", str(ro / "merged"), "--max-new-tokens", "2", "--no-report"),
    ]
    assert [run.returncode for run in runs] == [11, 11, 0], [run.stderr[-2000:] for run in runs]
    errors = [line for run in runs for line in run.stderr.splitlines() if line.startswith("ferry: error:")]
    assert len(errors) == 2 and not any("Traceback" in run.stderr for run in runs)
    assert "cannot write in" in errors[0] and "Read-only file system" in errors[0]
    assert "--no-report" in errors[1]
    assert not (tmp_path / "ro" / "new").exists()
