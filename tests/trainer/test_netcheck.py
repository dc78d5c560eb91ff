"""trainer/netcheck.py: the network pre-flight on 2 real gloo ranks, and its slow-rank rule."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from trainer.netcheck import bus_bandwidth, preflight, slow_ranks

pytestmark = pytest.mark.budget(60, reason="a 2-rank gloo preflight with one rank slowed down")


def test_bus_bandwidth_and_the_slow_rank_rule():
    assert bus_bandwidth(100, 2, 1.0) == 100.0  # 2 (n - 1) / n = 1 for two ranks
    assert bus_bandwidth(100, 4, 1.0) == 150.0
    assert slow_ranks([10.0, 9.0, 11.0, 1.8]) == [3]  # median 9.5: 1.8 x 5 < 9.5
    assert slow_ranks([10.0, 9.0, 11.0, 1.9]) == []  # exactly 5x below is not more than 5x


def _worker(rank: int, port: int, out: dict, slow_rank: int | None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    import torch.distributed as dist

    from trainer.distributed import DistEnv

    env = DistEnv.from_environ("gloo")
    env.init_process_group(60)
    if slow_rank == rank:  # this rank takes 2 s longer to complete its all-reduce than it should
        real = dist.all_reduce

        def slow(tensor, *a, **k):
            work = real(tensor, *a, **k)
            if tensor.numel() > 1:
                time.sleep(2.0)
            return work

        dist.all_reduce = slow
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = preflight(env, bucket_bytes=1 << 20, hosts=["node-a", "node-b"])
    out[rank] = (result.to_dict(), err.getvalue())
    dist.destroy_process_group()


def _run(slow_rank: int | None) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(port, out, slow_rank), nprocs=2, join=True)
    return dict(out)


def test_preflight_on_two_gloo_ranks_reports_the_slowest_and_names_a_slow_one():
    out = _run(slow_rank=1)  # one run (each costs two fresh interpreters): rank 1 finishes 2 s late
    assert out[0][0] == out[1][0]  # every rank returns the same result
    result = out[0][0]
    assert result["bucket_bytes"] == 1 << 20 and len(result["bandwidth_per_rank"]) == 2
    assert all(bw > 0 for bw in result["bandwidth_per_rank"])
    assert result["slowest_bandwidth"] == min(result["bandwidth_per_rank"])
    assert result["slowest_rank"] == 1 and result["slow_ranks"] == [1], result
    lines = out[0][1].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ferry: warning: network pre-flight: rank 1 (node-b)"), lines
    assert out[1][1] == ""  # rank 0 alone prints


def test_one_process_has_no_preflight():
    from trainer.distributed import DistEnv

    assert preflight(DistEnv(0, 0, 1, torch.device("cpu"), None)) is None


def _recording_worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    import torch.distributed as dist

    from trainer.distributed import DistEnv

    env = DistEnv.from_environ("gloo")
    env.init_process_group(60)
    sizes, real = [], dist.all_reduce

    def recording(tensor, *a, **k):
        sizes.append(tensor.numel())
        return real(tensor, *a, **k)

    dist.all_reduce = recording
    result = preflight(env, bucket_bytes=1 << 20, iterations=3)
    dist.all_reduce = real
    out[rank] = (result.to_dict(), sizes)
    dist.destroy_process_group()


def test_preflight_warms_up_with_the_full_bucket_and_times_the_median_of_several():
    """The warm-up all-reduce is the full bucket (NCCL sets up its buffers lazily, at the first collective of a
    size), then ``iterations`` timed ones; barriers between them are no all-reduce of the bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_recording_worker, args=(port, out), nprocs=2, join=True)
    for rank in (0, 1):
        result, sizes = out[rank]
        bucket = [n for n in sizes if n == (1 << 20) // 4]
        assert sizes[0] == (1 << 20) // 4, sizes  # the warm-up: the whole bucket, not 4 bytes
        assert len(bucket) == 1 + 3 and result["iterations"] == 3, sizes
        assert len(result["bandwidth_per_rank"]) == 2 and min(result["bandwidth_per_rank"]) > 0
