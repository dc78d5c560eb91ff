"""``ferry eval`` on several ranks: lm-eval's requests split over ``nproc_per_node`` processes started by torchrun.

lm-eval splits every task's requests by ``lm.rank`` / ``lm.world_size`` and gathers the answers on rank 0, but
its ``hf`` model takes its rank from ``accelerate`` only when it sees more than one GPU (on CPU every process
thinks it is rank 0 of 1 and evaluates everything), and then takes the *local* rank (several nodes would
overlap). :func:`ranked_lm` is lm-eval's ``HFLM`` with the rank and world size of the process group ferry starts
(gloo on CPU, nccl on CUDA, one GPU per rank) and its gathers and barrier done with ``torch.distributed``.

The launching process checks the inputs that cost nothing (model, adapter and include folders, devices) and starts
torchrun (``python -m torch.distributed.run --standalone --nproc-per-node N -m evaluation CONFIG.json``) at once:
every rank builds lm-eval's task index anyway (~15 s on 2 cores), so the ranks check the tasks on theirs rather
than the launcher building one more first. A rank's ferry error (an unknown task, a dataset not installed) is
recorded in a file the launcher names (:data:`ERROR_FILE_ENV`) and raised by the launcher as the same error with
the same message and exit code as one process gives, nothing written. The workers evaluate, rank 0 writes the
results and the report, and the launcher reads the report back. Any other failure of a worker is one line (the
first worker exception) with the full output kept in ``output_dir/logs/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evaluation.config import EvalConfig
from evaluation.report import EvalReport
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, EvaluationError, FerryError

#: Set in each worker's environment: run_eval evaluates there instead of launching again.
WORKER_ENV = "FERRY_EVAL_WORKER"
#: Where a worker records its ferry error (``{"type", "message"}``, the first rank to fail wins).
ERROR_FILE_ENV = "FERRY_EVAL_ERROR_FILE"


def in_worker() -> bool:
    """Whether this process is one of the ranks :func:`launch` started."""
    return os.environ.get(WORKER_ENV) == "1"


def check_devices(nproc: int, device: str) -> None:
    """Refuse more CUDA ranks than GPUs (each rank takes one), before anything starts.

    Raises:
        ConfigError: ``device`` is CUDA and torch sees fewer than ``nproc`` GPUs.
    """
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count()
    if nproc > count:
        raise ConfigError(
            f"nproc_per_node {nproc} on device {device} needs {nproc} GPUs (one per rank); torch sees {count}"
        )


def launch(config: EvalConfig) -> EvalReport:
    """Evaluate ``config`` on ``config.nproc_per_node`` ranks of this node and return rank 0's report.

    Raises:
        EvaluationError: torchrun or a worker failed (the first worker exception, and where the full output is).
    """
    from trainer.launch import WorkerStderr, worker_cause

    out = Path(config.output_dir)
    with tempfile.TemporaryDirectory(prefix="ferry-eval-") as tmp:
        config_path = Path(tmp) / "eval_config.json"
        config_path.write_text(config.model_dump_json(), encoding="utf-8")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={config.nproc_per_node}", "-m", "evaluation", str(config_path)]
        env = _worker_env(config.nproc_per_node)
        env[ERROR_FILE_ENV] = str(Path(tmp) / "worker-error.json")
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        errors = WorkerStderr(proc, Path(tmp) / "workers-stderr.log")
        returncode = proc.wait()
        errors.join()
        if returncode != 0:
            recorded = _recorded_error(Path(env[ERROR_FILE_ENV]))
            if recorded is not None:  # a check the ranks made: the error one process would raise
                raise recorded
            kept = _keep_log(errors.log, out)
            raise EvaluationError(f"evaluation failed: {worker_cause(returncode, errors)} (full output: {kept})")
    return EvalReport.from_json((out / "report.json").read_text(encoding="utf-8"))


def record_worker_error(exc: FerryError) -> None:
    """In a worker: record ``exc`` for the launcher (:data:`ERROR_FILE_ENV`), unless another rank did first."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"type": type(exc).__name__, "message": str(exc)}, fh)


def _recorded_error(path: Path) -> FerryError | None:
    """The ferry error a worker recorded in ``path`` (:func:`record_worker_error`), as its own class; None when
    none was recorded or the record names no class of ``ferry.errors``."""
    import ferry.errors

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cls = getattr(ferry.errors, str(record.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, FerryError)):
        return None
    return cls(str(record.get("message", "")))


def _worker_env(nproc: int) -> dict[str, str]:
    """This environment, offline, marked as a worker's, with the cores shared out (``OMP_NUM_THREADS``)."""
    env = dict(os.environ)
    apply_offline_env(env)
    env[WORKER_ENV] = "1"
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return env


def _keep_log(log: Path, out: Path) -> Path:
    """A copy of the workers' stderr in ``out/logs/`` (the temporary folder goes away), or ``log`` if it fails."""
    import shutil

    try:
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        kept = logs / f"eval-workers-stderr-{time.strftime('%Y%m%d-%H%M%S')}.log"
        shutil.copyfile(log, kept)
        return kept
    except OSError:
        return log


def init_process_group(device: str) -> str:
    """Join torchrun's process group (nccl and this rank's GPU on CUDA, gloo on CPU); return this rank's device."""
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return f"cuda:{local_rank}"
    dist.init_process_group("gloo")
    return "cpu"


def ranked_lm(model_args: dict[str, Any], device: str, batch_size: int | str) -> Any:
    """lm-eval's ``HFLM`` on ``device`` that knows this process's global rank and world size and gathers through
    ``torch.distributed`` (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from lm_eval.models.huggingface import HFLM

    class RankedHFLM(HFLM):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            """Every rank's ``tensor`` concatenated along dim 0 (a 0-d tensor counts as ``[1]``), as accelerate's
            ``gather`` returns it."""
            part = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
            parts = [torch.empty_like(part) for _ in range(self._world_size)]
            dist.all_gather(parts, part)
            return torch.cat(parts)

        def barrier(self) -> None:
            dist.barrier()

    return RankedHFLM(device=device, batch_size=batch_size, **model_args)


def leave_process_group(*, wait: bool) -> None:
    """Leave torchrun's process group when this process joined one; ``wait``: first meet the other ranks (a
    successful rank only: a failed one would wait for ranks that torchrun is about to stop)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        dist.barrier()
    dist.destroy_process_group()


__all__ = [
    "ERROR_FILE_ENV",
    "WORKER_ENV",
    "check_devices",
    "in_worker",
    "init_process_group",
    "launch",
    "leave_process_group",
    "ranked_lm",
    "record_worker_error",
]
