"""This process's place in a torchrun job: rank, device, backend, the process group and its collectives.

:class:`DistEnv` reads torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``); without them (a plain
``python`` process) it is rank 0 of 1, no process group exists and every collective helper returns its input, so
the recipe reads the same in both cases. The life of the group::

    DistEnv.from_environ(ddp_backend)   device and backend chosen, no collective yet
    init_process_group(timeout_s)       after tokenisation (a slow tokeniser cannot time out NCCL)
    all_reduce_sum / broadcast_object / all_gather_object / barrier
    destroy()                           outside torchrun only (see its docstring)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ferry.errors import ConfigError
from ferry.fsutil import atomic_write_text
from trainer.gpus import VISIBLE_ENV, check_ranks_fit_gpus


@dataclass
class DistEnv:
    """This process's place in the job, from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE).

    Without those variables (a plain ``python`` process) it is rank 0 of 1 and no process group exists; the
    collective helpers below then do nothing, so the recipe reads the same either way.

    Attributes:
        rank, local_rank, world_size: torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (0, 0, 1 without it).
        device: ``cuda:LOCAL_RANK`` when CUDA is available (``LOCAL_RANK`` modulo the visible GPUs, which under nccl
            is LOCAL_RANK itself: more ranks than GPUs are refused), else ``cpu``.
        backend: ``nccl`` / ``gloo`` under torchrun, None in a plain process (no process group).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @classmethod
    def from_environ(cls, ddp_backend: str) -> DistEnv:
        """Read torchrun's variables and pick device and backend (``auto``: nccl on CUDA, gloo on CPU).

        Raises:
            ConfigError: nccl requested without CUDA; under nccl, more processes on this node (torchrun's
                ``LOCAL_WORLD_SIZE``) than visible GPUs (:func:`trainer.gpus.check_ranks_fit_gpus`), checked
                before any GPU is touched.
        """
        distributed = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available()
        if ddp_backend == "nccl" and not cuda:
            raise ConfigError("ddp_backend: nccl needs CUDA GPUs; use auto or gloo on CPU")
        gpus = torch.cuda.device_count() if cuda else 0
        if distributed and ddp_backend != "gloo":  # gloo lets ranks share a GPU; NCCL does not
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            check_ranks_fit_gpus(local_ranks, gpus, os.environ.get(VISIBLE_ENV))
        device = torch.device("cuda", local_rank % max(1, gpus)) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)  # before any CUDA tensor: no stray context on GPU 0
        backend = None
        if distributed:
            backend = ("nccl" if cuda else "gloo") if ddp_backend == "auto" else ddp_backend
        return cls(rank, local_rank, world_size, device, backend)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run's files and logs."""
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        """Whether the process group exists (after :meth:`init_process_group` under torchrun)."""
        return dist.is_available() and dist.is_initialized()

    def init_process_group(self, timeout_s: int) -> None:
        """Join the process group (TCP store from MASTER_ADDR/MASTER_PORT, set by torchrun); ``timeout_s``
        seconds for every collective. Does nothing in a plain process."""
        if self.backend is None:
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kwargs: dict[str, Any] = {"backend": self.backend, "timeout": timedelta(seconds=timeout_s)}
        if self.device.type == "cuda" and self.backend == "nccl":
            kwargs["device_id"] = self.device  # eager NCCL init, bound to this GPU
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent serves ONE TCPStore for every attempt of the job, and the process group writes
            # the same keys each time (gloo's peer addresses, NCCL's unique id): after a restart a rank could
            # read the dead attempt's values and fail with "Connection refused". A prefix per attempt keeps
            # each attempt's keys apart (torch's env:// path only makes a new client, not a new namespace).
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                self.world_size,
                is_master=False,
                timeout=timedelta(seconds=timeout_s),
            )
            kwargs.update(
                store=dist.PrefixStore(f"ferry/attempt-{restart}", store), rank=self.rank, world_size=self.world_size
            )
        dist.init_process_group(**kwargs)

    def from_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU ``tensor`` on :attr:`device` without a host sync: on CUDA it is pinned and copied on the current
        stream, asynchronously (a copy from pageable memory, as ``torch.tensor(list, device="cuda")`` makes,
        waits until the GPU has run everything queued before it). Any shape and dtype; CPU: ``tensor`` itself."""
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def sync_debug(self, mode: str | None) -> Iterator[None]:
        """Inside: torch's CUDA sync debug mode ``mode`` (``"warn"``: a warning at every operation that waits for
        the GPU, ``"error"``: a RuntimeError naming it; ``torch.cuda.set_sync_debug_mode``), the previous mode
        again after. No-op for ``mode`` None or ``"default"`` and off CUDA (the mode only sees CUDA syncs)."""
        if not mode or mode == "default" or self.device.type != "cuda":
            yield
            return
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape, on :attr:`device`) over all ranks in place; returns it."""
        if self.initialized:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; CPU tensors inside stay on CPU)."""
        if not self.initialized:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled), indexed by rank."""
        if not self.initialized:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait until every rank has reached this point."""
        if self.initialized:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def ranks_missing(self, marker: Path) -> int:
        """How many ranks cannot see the file ``marker`` that rank 0 writes (and then removes): 0 when the
        folder holding it is on a file system every node shares. A collective: every rank calls it."""
        if self.is_main:
            atomic_write_text(marker, "shared\n")
        self.barrier()
        missing = torch.tensor(0.0 if marker.is_file() else 1.0, device=self.device)
        self.all_reduce_sum(missing)
        self.barrier()
        if self.is_main:
            marker.unlink(missing_ok=True)
        return int(missing)

    def destroy(self, timeout_s: float = 60.0) -> None:
        """Tear the process group down, waiting at most ``timeout_s`` seconds.

        A torchrun worker (``TORCHELASTIC_RUN_ID`` set) leaves it alone: every output is written and the final
        barrier passed, and ``trainer.__main__`` ends the process with ``os._exit``, which closes its sockets.
        There, gloo's teardown has been seen to block one rank for good once its peer had exited (CPU, torch
        2.13) inside ``ProcessGroupGloo``'s destructor, which holds the GIL, so no thread can bound it; the
        other node's torchrun agent then gave up its exit barrier after 300 s and took the rendezvous store
        with it, and this node's agent failed a finished job with ``RendezvousConnectionError``. Elsewhere
        (a plain process, tests) it runs in a thread joined for ``timeout_s`` seconds."""
        if self.initialized and os.environ.get("TORCHELASTIC_RUN_ID") is None:
            import threading

            worker = threading.Thread(target=dist.destroy_process_group, name="ferry-destroy-pg", daemon=True)
            worker.start()
            worker.join(timeout_s)


__all__ = ["DistEnv"]
