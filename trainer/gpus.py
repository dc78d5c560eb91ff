"""The GPUs this host lets a process use, and whether one node's ranks fit on them.

Counted through torch (``torch.cuda.device_count()``: NVML-based where NVML is present, so it does not initialise
CUDA and a later fork or torchrun start is unaffected; ROCm's count through the same call), after
``CUDA_VISIBLE_DEVICES``: ``""`` or ``-1`` hides every GPU, and then torch is not even imported. A file such as
``/proc/driver/nvidia/version`` is no sign of a GPU: sandboxed runtimes (gVisor, some container set-ups) hide it
while the GPUs work.

Importing this module imports no torch: ``ferry train`` reaches torchrun without it (:mod:`trainer.launch`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ferry.errors import ConfigError

#: The variable CUDA (and torch's count) reads the visible GPUs from.
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def cuda_hidden(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` hides every GPU: set to ``""`` or ``-1`` (CUDA's own conventions)."""
    value = (os.environ if environ is None else environ).get(VISIBLE_ENV)
    return value is not None and value.strip() in ("", "-1")


def visible_gpu_count() -> int:
    """GPUs this process may use: 0 when ``CUDA_VISIBLE_DEVICES`` hides them all (torch is not imported then),
    else ``torch.cuda.device_count()`` (0 with a CPU-only torch). Imports torch (seconds, once per process)."""
    if cuda_hidden():
        return 0
    import torch

    return int(torch.cuda.device_count())


def check_ranks_fit_gpus(local_ranks: int, gpus: int, visible: str | None) -> None:
    """Refuse more processes on one node than it has visible GPUs: rank -> GPU is ``local_rank % gpus``, so two
    ranks would share a GPU, which NCCL refuses mid-start ("Duplicate GPU detected ... ncclInvalidUsage").

    Args:
        local_ranks: processes on this node (``--nproc-per-node``, torchrun's ``LOCAL_WORLD_SIZE``).
        gpus: visible GPUs on this node (:func:`visible_gpu_count`); 0 means CPU training, which always fits.
        visible: the value of ``CUDA_VISIBLE_DEVICES`` (None when unset), named in the message.

    Raises:
        ConfigError: one line naming both counts, ``CUDA_VISIBLE_DEVICES`` and the fix.
    """
    if gpus <= 0 or local_ranks <= gpus:
        return
    shown = "unset" if visible is None else repr(visible)
    raise ConfigError(
        f"{local_ranks} processes per node but {gpus} visible GPU(s) ({VISIBLE_ENV} {shown}): two ranks would share "
        f"a GPU, which NCCL refuses; start with --nproc-per-node {gpus} (or make {local_ranks} GPUs visible)"
    )


def gpu_memory_text(gpu_memory: dict[str, list[int]]) -> str:
    """``peak GPU memory 12.3 GiB allocated, 14.0 GiB reserved (rank 1)``: the rank with the largest reserved
    peak, from :class:`trainer.recipe.TrainReport`'s ``gpu_memory``."""
    from ferry.fsutil import format_bytes

    reserved, allocated = gpu_memory["peak_reserved_bytes"], gpu_memory["peak_allocated_bytes"]
    rank = max(range(len(reserved)), key=reserved.__getitem__)
    return (
        f"peak GPU memory {format_bytes(allocated[rank])} allocated, {format_bytes(reserved[rank])} reserved "
        f"(rank {rank})"
    )


__all__ = ["VISIBLE_ENV", "check_ranks_fit_gpus", "cuda_hidden", "gpu_memory_text", "visible_gpu_count"]
