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
from ferry.fsutil import atomic_write_text
from tests.support.helpers import LM_EVAL_INDEX, run_ferry_eval, share_lm_eval_index

ROOT = Path(__file__).resolve().parents[2]


def online_env() -> dict[str, str]:
    """This environment without any hub setting or offline switch (TRANSFORMERS_OFFLINE=1 alone makes
    huggingface_hub offline), for a subprocess that must reach the test hub."""
    drop = set(OFFLINE_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("HF_", "HUGGINGFACE_"))}


def ferry_eval_offline(
    prefix: Path, home: Path, model: Path, out: Path, tasks: Sequence[str], limit: int, *extra: str
) -> subprocess.CompletedProcess:
    """``ferry eval`` with no network and only what sourcing PREFIX/ferry.env gives (+ PATH, PYTHONPATH for ferry,
    HOME): :func:`tests.support.helpers.run_ferry_eval` (forked into a new network namespace; exec'd under
    ``unshare -rn`` with ``FERRY_TESTS_EXEC=1``) in the environment that ``sh`` has once it sourced ferry.env."""
    args = ["--model-name-or-path", str(model), "--tasks", ",".join(tasks), "--limit", str(limit)]
    args += ["--output-dir", str(out), *extra]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(home)}
    share_lm_eval_index(home / ".cache" / "ferry")  # ferry's cache under that HOME, with the machine's task index
    return run_ferry_eval(*args, env=sourced(prefix / "ferry.env", env), cwd=ROOT, offline=True)


def sourced(script: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment ``sh`` has after ``. SCRIPT`` from ``env`` (what a user's shell exports once it sourced
    ferry.env), read back from ``env -0``.

    Raises:
        subprocess.CalledProcessError: sourcing failed.
    """
    proc = subprocess.run(
        ["sh", "-c", '. "$1" && exec env -0', "sh", str(script)], env=env, capture_output=True, check=True
    )
    pairs = (item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)
    return {key: value for key, value in pairs if key not in ("PWD", "SHLVL", "_")}


def lm_eval_online(
    hub: Any,
    out: Path,
    model_args: str,
    tasks: Sequence[str],
    limit: int,
    *args: str,
    inputs: dict[str, Path] | None = None,
    **env_extra: str,
) -> dict[str, Any]:
    """lm-eval's own CLI (more arguments in ``args``), online against the test hub ``hub`` (a fresh HF_HOME under
    ``out``, ``env_extra`` on top of the environment): its results JSON, through :func:`lm_eval_cli_cached` with
    the local ``inputs`` (model, adapter, data folders an ``env_extra`` value names) and what the hub serves
    (:func:`content_digest` of its repos' work trees: git-lfs pointers carry their objects' sha256; not the git
    commits, whose hashes change with the time they were made) in the key."""
    argv = ["--model", "hf", "--model_args", model_args, "--tasks", ",".join(tasks)]
    argv += ["--limit", str(limit), "--batch_size", "1", "--device", "cpu", *args]
    env = online_env()
    env.update(hub.env(), HF_HOME=str(out / "hf-home"), **env_extra)
    served = {"hub": content_digest(hub.mirrors, {}), "env": sorted(env_extra)}
    return lm_eval_cli_cached(argv, out, env, inputs or {}, extra_key=served)


LM_EVAL_GOLDENS = LM_EVAL_INDEX.parent / "lm-eval-goldens"

#: The distributions whose versions an lm-eval result depends on, in every cache key.
GOLDEN_VERSIONS = ("lm_eval", "torch", "transformers", "peft", "tokenizers", "datasets")


def content_digest(path: Path, placeholders: dict[str, Path]) -> str:
    """sha256 of a file, or of a folder's files (each one's relative name and bytes, sorted by name), with the path
    of every ``placeholders`` value in those bytes replaced by its key (task YAMLs name their data files by an
    absolute path inside a test's temp folder). A JSON file counts by its parsed content, its lists of strings
    sorted (:func:`_canonical`). Files inside ``.git`` folders are left out (a test hub's repos: their commits
    change with the time they were made, what they serve does not)."""
    import hashlib

    digest = hashlib.sha256()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and ".git" not in p.relative_to(path).parts)
    )
    for file in files:
        data = file.read_bytes()
        if file.suffix == ".json":  # peft writes target_modules, a set, in a per-process order
            data = json.dumps(_canonical(json.loads(data)), sort_keys=True).encode()
        for name, where in sorted(placeholders.items(), key=lambda kv: -len(str(kv[1]))):
            data = data.replace(str(where).encode(), name.encode())
        digest.update(str(file.relative_to(path) if file != path else file.name).encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` (parsed JSON) with every list of strings sorted: peft saves sets (``target_modules``) as lists in
    an order that changes from process to process."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value


def lm_eval_cli_cached(
    args: Sequence[str],
    out: Path,
    env: dict[str, str],
    inputs: dict[str, Path],
    timeout: float = 600,
    extra_key: dict[str, Any] | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """``python -m lm_eval ARGS --output_path OUT`` in ``env`` (and ``cwd``: name it in ``inputs`` where the
    arguments name files relative to it), its results JSON; read from
    :data:`LM_EVAL_GOLDENS` when the same arguments ran on the same bytes before on this machine. The key is the
    arguments with each ``inputs`` path (model, adapter, task and data folders) named by its key instead, the
    content of those inputs (:func:`content_digest`, the paths replaced by their names), ``extra_key`` (what else
    the run reads: the test hub's content) and the versions of :data:`GOLDEN_VERSIONS`: another model, adapter,
    task file, data row, served file or library release runs lm-eval again.
    lm-eval's CLI is the peer these tests compare ``ferry eval`` with, not what they test, and it spends ~16
    CPU-seconds a run (its index of ~14,000 task YAMLs, its imports)."""
    import hashlib
    import importlib.metadata

    ordered = sorted(inputs.items(), key=lambda kv: -len(str(kv[1])))

    def named(text: str) -> str:
        for name, where in ordered:
            text = text.replace(str(where), f"<{name}>")
        return text

    key = {
        "args": [named(a) for a in args],
        "inputs": {
            name: content_digest(where, {f"<{n}>": w for n, w in inputs.items()}) for name, where in inputs.items()
        },
        "versions": {d: importlib.metadata.version(d.replace("_", "-")) for d in GOLDEN_VERSIONS},
        # torch's thread count changes how fp32 sums round: log-likelihood sums differ in their last digits
        "threads": env.get("OMP_NUM_THREADS"),
        **({"extra": extra_key} if extra_key else {}),
    }
    cached = LM_EVAL_GOLDENS / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    argv = [sys.executable, "-m", "lm_eval", *args, "--output_path", str(out)]
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (found,) = out.rglob("results_*.json")
    results = json.loads(found.read_text())
    LM_EVAL_GOLDENS.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cached, json.dumps(results, indent=1))
    return results
