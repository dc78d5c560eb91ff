"""Running ``ferry eval`` offline and lm-eval's own CLI online, for the tests of tasks carried in a bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ferry.constants import OFFLINE_ENV
from tests.support.helpers import share_lm_eval_index
from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]


def online_env() -> dict[str, str]:
    """This environment without any hub setting or offline switch (TRANSFORMERS_OFFLINE=1 alone makes
    huggingface_hub offline), for a subprocess that must reach the test hub."""
    drop = set(OFFLINE_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("HF_", "HUGGINGFACE_"))}


def ferry_eval_offline(
    prefix: Path, home: Path, model: Path, out: Path, tasks: Sequence[str], limit: int, *extra: str
) -> subprocess.CompletedProcess:
    """``ferry eval`` under ``unshare -rn`` with only PREFIX/ferry.env (+ PATH, PYTHONPATH for ferry, HOME)."""
    argv = [sys.executable, "-m", "ferry", "eval", "--model-name-or-path", str(model)]
    argv += ["--tasks", ",".join(tasks), "--limit", str(limit), "--output-dir", str(out), *extra]
    script = f'. {prefix}/ferry.env && exec "$@"'
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(home)}
    share_lm_eval_index(home / ".cache" / "ferry")  # ferry's cache under that HOME, with the machine's task index
    return run_offline(["sh", "-c", script, "sh", *argv], env=env, cwd=ROOT, timeout=600, check=False)


def lm_eval_online(
    hub_env: dict[str, str],
    out: Path,
    model_args: str,
    tasks: Sequence[str],
    limit: int,
    *args: str,
    **env_extra: str,
) -> dict[str, Any]:
    """lm-eval's own CLI (more arguments in ``args``), online against the test hub (a fresh HF_HOME under ``out``,
    ``env_extra`` on top of the environment): its results JSON."""
    argv = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", ",".join(tasks)]
    argv += ["--limit", str(limit), "--batch_size", "1", "--device", "cpu", "--output_path", str(out), *args]
    env = online_env()
    env.update(hub_env, HF_HOME=str(out / "hf-home"), **env_extra)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (found,) = out.rglob("results_*.json")
    return json.loads(found.read_text())
