"""``ferry train`` reports what goes wrong in its workers as one line: the launcher's pre-flight catches a missing
``trust_remote_code``, an unavailable attention implementation, ``lora_target`` names the model does not have and
a read-only HF modules cache before any worker trains; an exception inside a worker arrives as one line naming it,
the full output kept in ``output_dir/logs/``, and the resume hint only when there is a checkpoint to resume from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import run_ferry
from tests.support.netns import run_in_mount_namespace

pytestmark = pytest.mark.budget(90, reason="errors raised inside torchrun workers, read through the CLI")

CONFIG_PY = """from transformers import LlamaConfig


class BoomConfig(LlamaConfig):
    model_type = "boom-llama"
"""
MODELING_PY = """from transformers import LlamaForCausalLM

from .configuration_boom import BoomConfig


class BoomForCausalLM(LlamaForCausalLM):
    config_class = BoomConfig

    def forward(self, *args, **kwargs):
        import importlib

        # a kernel package this host does not have, looked up only at run time (so transformers' check of the
        # code's imports cannot see it)
        importlib.import_module("fancy_kernels_ferry_test")

        return super().forward(*args, **kwargs)
"""


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, stories_model) -> Path:
    """stories260K as a trust_remote_code model (config.json auto_map, its own configuration / modeling code)
    whose forward needs a package that is not installed."""
    folder = tmp_path_factory.mktemp("remote") / "boom"
    shutil.copytree(stories_model, folder)
    folder.chmod(0o755)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="boom-llama",
        architectures=["BoomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_boom.BoomConfig",
            "AutoModelForCausalLM": "modeling_boom.BoomForCausalLM",
        },
    )
    (folder / "config.json").chmod(0o644)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_boom.py").write_text(CONFIG_PY)
    (folder / "modeling_boom.py").write_text(MODELING_PY)
    return folder


def _run(model: Path, data: Path, work: Path, *overrides: str, env_extra: dict | None = None, fork: bool = False):
    """``ferry train`` of one step in ``work``: exec'd (a model with remote code: transformers keeps the modules it
    loaded from its modules cache in ``sys.modules``, which a fork would share with this process), or ``fork``ed
    (:func:`tests.support.helpers.run_ferry`, its torchrun and worker too)."""
    cfg = {
        "model_name_or_path": str(model),
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(data),
        "template": "alpaca",
        "cutoff_len": 32,
        "max_samples": 4,
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "lora_rank": 2,
        "output_dir": str(work / "out"),
        "disable_tqdm": True,
    }
    work.mkdir(parents=True, exist_ok=True)
    (work / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        **os.environ,
        "PYTHONPATH": str(Path.cwd()),
        "OMP_NUM_THREADS": "1",
        "HF_MODULES_CACHE": str(work / "mods"),
        **(env_extra or {}),
    }
    args = ["train", str(work / "c.yaml"), "--nproc-per-node", "1", *overrides]
    if fork:
        return run_ferry(args, env=env, cwd=Path.cwd(), timeout=300)
    return subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True, env=env, timeout=300)


def _one_error_line(proc) -> str:
    errors = [
        line
        for line in proc.stderr.splitlines()
        if "error" in line.lower() or "Traceback" in line or line.startswith("[rank")
    ]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("ferry: error: ")
    return errors[0]


def _cfg(model: Path, data: Path, **keys):
    from trainer.config import TrainConfig

    return TrainConfig(
        model_name_or_path=str(model), dataset="alpaca_en_demo", dataset_dir=str(data), output_dir="unused", **keys
    )


def test_preflight_refusals(remote_code_model, stories_model, llamafactory_data, tmp_path, monkeypatch):
    from ferry.errors import ConfigError
    from trainer.launch import preflight

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "mods"))
    with pytest.raises(ConfigError, match="trust_remote_code: .* ships its own model code.*set trust_remote_code"):
        preflight(_cfg(remote_code_model, llamafactory_data), remote_code_model)
    with pytest.raises(ConfigError, match="lora_target: c_attn matches no linear layer of the model; it has down_proj"):
        preflight(_cfg(stories_model, llamafactory_data, lora_target="c_attn,q_proj"), stories_model)
    with pytest.raises(ConfigError, match="flash_attn: flash_attention_2 needs the flash-attn package"):
        preflight(_cfg(stories_model, llamafactory_data, flash_attn="fa2"), stories_model)
    with pytest.raises(ConfigError, match="additional_target: lm_heads is no module"):
        preflight(_cfg(stories_model, llamafactory_data, additional_target="lm_heads"), stories_model)
    preflight(_cfg(stories_model, llamafactory_data), stories_model)  # a good config passes


def test_preflight_errors_reach_the_user_as_one_line(remote_code_model, llamafactory_data, tmp_path):
    # through the CLI, before any worker trains: the missing trust_remote_code, then (with it) a read-only HF
    # modules cache (a read-only bind mount in a user + mount namespace: root there, yet writes are refused)
    line = _one_error_line(_run(remote_code_model, llamafactory_data, tmp_path / "a"))
    assert "trust_remote_code: " in line and "set trust_remote_code: true" in line
    assert not (tmp_path / "a" / "out").exists()
    mods = tmp_path / "ro-mods"
    mods.mkdir()
    script = (
        f"mount --bind {mods} {mods} && mount -o remount,bind,ro {mods} && HF_MODULES_CACHE={mods} "
        f"{sys.executable} -m ferry train {tmp_path / 'a' / 'c.yaml'} trust_remote_code=true --nproc-per-node 1"
    )
    proc = run_in_mount_namespace(script, pythonpath=Path.cwd())
    line = _one_error_line(proc)
    assert "HF_MODULES_CACHE" in line and "not writable" in line


def test_worker_exception_is_one_line_with_the_log_kept(remote_code_model, llamafactory_data, tmp_path):
    proc = _run(remote_code_model, llamafactory_data, tmp_path, "trust_remote_code=true")
    assert proc.returncode != 0
    line = _one_error_line(proc)
    assert "ModuleNotFoundError: No module named 'fancy_kernels_ferry_test'" in line
    assert "re-running" not in line  # no checkpoint yet: nothing to resume from
    logs = list((tmp_path / "out" / "logs").glob("torchrun-stderr-*.log"))
    assert len(logs) == 1 and "Traceback (most recent call last)" in logs[0].read_text()
    assert str(logs[0]) in line


def test_export_and_smoke_of_a_remote_code_model_need_the_flag(remote_code_model, tmp_path):
    # export refuses before writing anything; smoke says the same in one line; with the flag both work
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from exporter.export import export
    from exporter.options import ExportOptions
    from ferry.errors import ExportError

    model = AutoModelForCausalLM.from_pretrained(remote_code_model, trust_remote_code=True)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ExportError, match="custom code .* pass --trust-remote-code"):
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=remote_code_model))
    assert not (tmp_path / "out").exists()
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=remote_code_model, smoke=False))
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "smoke", str(tmp_path / "out"), "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path.cwd()), "HF_MODULES_CACHE": str(tmp_path / "m")},
    )
    assert proc.returncode == 11 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ferry: error: ") and "--trust-remote-code" in proc.stderr


def test_killed_worker_with_a_checkpoint_gets_the_resume_hint(stories_model, llamafactory_data, tmp_path):
    proc = _run(
        stories_model,
        llamafactory_data,
        tmp_path,
        "max_steps=3",
        "save_steps=1",
        env_extra={"FERRY_TEST_KILL_AT_STEP": "2"},
        fork=True,
    )
    line = _one_error_line(proc)
    assert "a worker was killed (Signal 9 (SIGKILL)" in line
    assert f"re-running the same command continues from the newest checkpoint in {tmp_path / 'out'}" in line
    assert (tmp_path / "out" / "checkpoint-1").is_dir() or (tmp_path / "out" / "checkpoint-2").is_dir()
