"""Network pre-flight for multi-process runs: timed all-reduces of a gradient-bucket-sized tensor before step 1.

One untimed all-reduce of the full bucket first: NCCL sets up its connections, channels and buffers lazily, at
the first collective of a size and kind (nccl-tests likewise warm up before timing), and a 4-byte warm-up leaves
most of that cost to the timed call, so a healthy rank looked slow. Then :data:`ITERATIONS` all-reduces, each
timed from a common start (a barrier, then a CUDA synchronise); a rank reports the median of its times as bus
bandwidth, NCCL's figure for an all-reduce (nccl-tests' ``busbw``): ``2 (n - 1) / n x bytes / seconds``, where
``n`` is the world size. The median ignores one iteration disturbed by the host. The run summary carries the
slowest rank's bandwidth; a rank more than :data:`SLOW_FACTOR` times below the median is named in one warning
line (a slow or misconfigured link is the usual cause of NCCL timeouts in multi-node runs). In a ring
all-reduce a slow link delays every rank, so the figure mostly tells the network's health as a whole; a rank
that is slow to take part (its own host busy or its NIC stalled) shows as itself.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: Bytes of the timed tensor: DDP's default gradient bucket (25 MiB).
BUCKET_BYTES = 25 * 2**20
#: A rank whose bandwidth is below the median divided by this is named.
SLOW_FACTOR = 5.0
#: Timed all-reduces after the warm-up; each rank reports the median.
ITERATIONS = 5


@dataclass
class NetCheck:
    """The pre-flight's result: ``bucket_bytes`` timed, per-rank bus bandwidth (bytes/s, index = rank; each the
    median over ``iterations`` timed all-reduces), the slowest rank and its bandwidth, and the ranks more than
    :data:`SLOW_FACTOR` x below the median."""

    bucket_bytes: int
    bandwidth_per_rank: list[float]
    slowest_rank: int
    slowest_bandwidth: float
    slow_ranks: list[int]
    iterations: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bus_bandwidth(nbytes: int, world_size: int, seconds: float) -> float:
    """All-reduce bus bandwidth in bytes/s (nccl-tests' ``busbw``): ``2 (n - 1) / n x nbytes / seconds``."""
    return 2.0 * (world_size - 1) / world_size * nbytes / max(seconds, 1e-9)


def slow_ranks(bandwidths: list[float], factor: float = SLOW_FACTOR) -> list[int]:
    """Ranks whose bandwidth is more than ``factor`` times below the median of all ranks."""
    median = statistics.median(bandwidths)
    return [r for r, bw in enumerate(bandwidths) if bw * factor < median]


def preflight(
    env: Any,
    bucket_bytes: int = BUCKET_BYTES,
    hosts: list[str] | None = None,
    verbose: bool = True,
    iterations: int = ITERATIONS,
) -> NetCheck | None:
    """Warm up with one all-reduce of ``bucket_bytes`` (fp32), then time ``iterations`` more on every rank of
    ``env`` (a :class:`trainer.distributed.DistEnv`), each from a barrier; a rank's bandwidth is its median.
    None without a process group or with one process. Rank 0 prints the warning line when a rank is slow
    (``hosts``: host name per rank, for the line). Every rank returns the same result."""
    if not env.initialized or env.world_size < 2:
        return None
    import torch.distributed as dist

    tensor = torch.ones(max(1, bucket_bytes // 4), dtype=torch.float32, device=env.device)
    dist.all_reduce(tensor)  # the warm-up, full size: NCCL's lazy set-up is not part of the timing
    times = []
    for _ in range(max(1, iterations)):
        env.barrier()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        times.append(time.perf_counter() - started)
    mine = bus_bandwidth(tensor.numel() * 4, env.world_size, statistics.median(times))
    per_rank = [float(x) for x in env.all_gather_object(mine)]
    slowest = min(range(len(per_rank)), key=per_rank.__getitem__)
    result = NetCheck(tensor.numel() * 4, per_rank, slowest, per_rank[slowest], slow_ranks(per_rank), len(times))
    if result.slow_ranks and env.is_main and verbose:
        median = statistics.median(per_rank)
        named = ", ".join(
            f"rank {r}" + (f" ({hosts[r]})" if hosts else "") + f" {per_rank[r] / 1e6:.0f} MB/s"
            for r in result.slow_ranks
        )
        print(
            f"ferry: warning: network pre-flight: {named} more than {SLOW_FACTOR:.0f}x below the median "
            f"{median / 1e6:.0f} MB/s all-reduce bandwidth; check that node's network (NCCL timeouts follow)",
            file=sys.stderr,
        )
    return result


__all__ = ["BUCKET_BYTES", "ITERATIONS", "NetCheck", "SLOW_FACTOR", "bus_bandwidth", "preflight", "slow_ranks"]
