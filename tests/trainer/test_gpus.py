"""GPUs on CPU: how many a process sees (torch's count after CUDA_VISIBLE_DEVICES, never a /proc file), and more
ranks per node than GPUs refused in one line, in the launcher and in a worker. torch's CUDA functions are replaced
by stand-ins with the counts a GPU host would give (this host has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ferry.errors import ConfigError
from tests.support.helpers import ROOT, fork_ferry, tiny_config, worker_env, write_config
from trainer.gpus import check_ranks_fit_gpus, cuda_hidden, visible_gpu_count


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[torch.device]:
    """Make torch report ``count`` CUDA devices; returns the list ``torch.cuda.set_device`` calls land in."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_more_ranks_than_gpus_is_one_line_naming_the_counts_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_ranks_fit_gpus(4, 2, "0,1")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("4 processes per node but 2 visible GPU(s) (CUDA_VISIBLE_DEVICES '0,1')")
    assert "NCCL refuses" in message and "--nproc-per-node 2" in message
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES unset"):
        check_ranks_fit_gpus(8, 1, None)
    check_ranks_fit_gpus(2, 2, None)  # one rank per GPU
    check_ranks_fit_gpus(1, 8, None)  # fewer ranks than GPUs
    check_ranks_fit_gpus(8, 0, None)  # CPU training: any number of ranks


def test_visible_gpus_come_from_torch_after_cuda_visible_devices(monkeypatch):
    _gpus(monkeypatch, 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not cuda_hidden() and visible_gpu_count() == 4
    for hidden in ("", "-1", " -1 "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("torch asked though no GPU is visible"))
        assert cuda_hidden() and visible_gpu_count() == 0
    assert cuda_hidden({"CUDA_VISIBLE_DEVICES": ""}) and not cuda_hidden({"CUDA_VISIBLE_DEVICES": "0"})


def test_nproc_auto_is_one_per_visible_gpu_and_counts_cores_when_none_is(monkeypatch):
    from trainer.launch import resolve_nproc_per_node

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _gpus(monkeypatch, 3)
    assert resolve_nproc_per_node("auto") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_nproc_per_node("auto") == max(1, len(os.sched_getaffinity(0)) // 2)


def test_memory_budget_is_the_visible_gpus_memory_or_the_hosts_ram(monkeypatch):
    from trainer.fsdp import device_budget

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _gpus(monkeypatch, 2)
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_045_051_392)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert device_budget(2) == (85_045_051_392.0, "NVIDIA H100 80GB HBM3 memory")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    budget, what = device_budget(2)
    assert what == "RAM / 2 process(es)" and budget > 0


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world_size: int) -> None:
    for key, value in dict(
        RANK=local_rank, LOCAL_RANK=local_rank, WORLD_SIZE=local_world_size, LOCAL_WORLD_SIZE=local_world_size
    ).items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")


def test_a_worker_refuses_more_local_ranks_than_gpus_before_touching_one(monkeypatch):
    from trainer.distributed import DistEnv

    chosen = _gpus(monkeypatch, 2)
    _torchrun_env(monkeypatch, local_rank=3, local_world_size=4)
    refused = r"^4 processes per node but 2 visible GPU\(s\) \(CUDA_VISIBLE_DEVICES '0,1'\)"
    with pytest.raises(ConfigError, match=refused):
        DistEnv.from_environ("auto")
    assert chosen == []  # refused before any GPU was selected
    env = DistEnv.from_environ("gloo")  # gloo lets two ranks share a GPU: allowed
    assert env.device == torch.device("cuda", 1) and env.backend == "gloo"
    _torchrun_env(monkeypatch, local_rank=1, local_world_size=2)
    env = DistEnv.from_environ("auto")
    assert env.device == torch.device("cuda", 1) and env.backend == "nccl" and chosen[-1] == env.device


def test_the_launcher_refuses_more_processes_than_gpus(stories_model, llamafactory_data, tmp_path, monkeypatch):
    """``ferry train --nproc-per-node 4`` on a host with 2 visible GPUs: one ConfigError from the launcher's
    pre-flight (here through the dry run, which runs the same checks); ``ddp_backend: gloo`` passes that check."""
    from trainer.config import load_config
    from trainer.launch import check_gpus, launch

    saved = dict(os.environ)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    _gpus(monkeypatch, 2)
    config = write_config(tmp_path / "c.yaml", tiny_config(stories_model, llamafactory_data, tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"^4 processes per node but 2 visible GPU.*--nproc-per-node 2"):
            launch(config, nproc_per_node=4, dry_run=True)
    finally:  # launch() sets the offline variables in its own process
        os.environ.clear()
        os.environ.update(saved)
    check_gpus(load_config(config, ["ddp_backend=gloo"]), 4)
    check_gpus(load_config(config), 2)


def test_a_torchrun_worker_prints_the_refusal_as_one_line(stories_model, llamafactory_data, tmp_path):
    """The worker entry point (``python -m trainer`` under torchrun's variables) on a host whose torch reports 2
    GPUs (stand-ins installed before the entry point runs) with 4 local ranks: one ``ferry: error:`` line, the
    ConfigError's exit code, no traceback."""
    config = write_config(tmp_path / "c.yaml", tiny_config(stories_model, llamafactory_data, tmp_path))

    def worker_on_two_gpus(_args: list[str]) -> None:  # in a child forked from this process
        import sys

        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 2
        torch.cuda.set_device = lambda d: sys.exit("set_device reached")
        from trainer.__main__ import main

        sys.exit(main([str(config)]))

    env = worker_env(
        tmp_path, RANK="2", LOCAL_RANK="2", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", CUDA_VISIBLE_DEVICES="0,1"
    )
    proc = fork_ferry([], env=env, cwd=tmp_path, entry=worker_on_two_gpus, timeout=300)
    assert proc.returncode == ConfigError.exit_code, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == [
        "ferry: error: [rank 2] 4 processes per node but 2 visible GPU(s) (CUDA_VISIBLE_DEVICES '0,1'): two ranks "
        "would share a GPU, which NCCL refuses; start with --nproc-per-node 2 (or make 4 GPUs visible)"
    ], proc.stderr[-3000:]
    assert not Path(tmp_path / "out" / "adapter").exists()


def test_the_launchers_fast_paths_stay_torch_free(tmp_path):
    """An explicit ``--nproc-per-node`` and ``auto`` with every GPU hidden (``CUDA_VISIBLE_DEVICES=""``) resolve
    without importing torch, as do the GPU helpers' module and the workers' environment: only ``auto`` on a host
    that may have GPUs asks torch for the count."""
    code = (
        "import os, sys\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = ''\n"
        "from pathlib import Path\n"
        "from trainer.launch import _worker_env, resolve_nproc_per_node\n"
        "import trainer.gpus\n"
        "assert resolve_nproc_per_node('3') == 3 and resolve_nproc_per_node('auto') >= 1\n"
        "_worker_env(None, 2, Path('gate'))\n"
        "print('torch' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
