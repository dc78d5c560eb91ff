"""Multi-node over a real network: two test hosts (network namespaces joined by a veth pair, each with its own
host name, :class:`tests.support.netns.TwoHosts`), one ``ferry train --nnodes 2 --nproc-per-node 1`` agent on each,
meeting
through a c10d rendezvous on the first host's veth address; gloo then connects the workers over the veth pair.
Each host's launcher validates and tokenises on its own (both share one cache folder here, as they share the
file system: one builds it under the file lock and the other loads it; FSDP checkpoints need that shared
output_dir too).

- DDP: the job must equal 1 node x 2 processes: same global batch, same ranks, same gloo sums, so we allow only
  1e-6 relative on losses and on each adapter tensor's Frobenius norm.
- FSDP (``fsdp: full_shard``): the same job, against the same 1-node DDP run, with test_fsdp's FSDP-vs-DDP
  tolerances (losses 1e-5 relative; adapter 1e-4 relative Frobenius / 1e-4 absolute). Each rank holds half the
  parameters.
- ``fsdp: hybrid_shard``: the 2-D mesh, replicated across the two hosts; the same tolerances.
- FSDP with an output_dir the hosts do not share (a tmpfs on the second host): refused at start.
- A node that never arrives: the one agent fails within ``--rdzv-timeout`` with one line naming the endpoint.

Each host's ``ferry train`` is forked from pytest and moved onto its host (``TwoHosts.enter``), its torchrun and
worker forked too (tests/support/forks.py); the node that never arrives runs an exec'd one (``TwoHosts.popen``,
``ip netns exec``), as ``FERRY_TESTS_EXEC=1`` runs them all.

Namespaces need root; without it these tests skip and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    start_ferry,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)
from tests.support.netns import NamespacesUnavailable, TwoHosts

RDZV_PORT = 29400  # inside the test's own namespace: nothing else listens there


@pytest.fixture(scope="module")
def hosts():
    try:
        with TwoHosts() as made:
            yield made
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot make two test hosts with network namespaces here: {exc}")


#: The reference run is test_ddp.py's A, shared through the session (tests/trainer/conftest.py): one xdist worker.
pytestmark = [
    pytest.mark.two_ranks,
    pytest.mark.budget(90, reason="a 12-step job of two torchrun agents on two network namespaces"),
]


@pytest.fixture(scope="module")
def one_node(equivalence_run, stories_model, llamafactory_data, tmp_path_factory) -> tuple[Path, dict]:
    """The reference: 1 node x 2 processes, DDP (the shared ``ddp_2x2`` run), and its config."""
    out = equivalence_run("ddp_2x2")
    cfg = tiny_config(stories_model, llamafactory_data, tmp_path_factory.mktemp("one-node"), output_dir=str(out))
    return out, cfg


def _communicate(agents: list[Any]) -> list[tuple[str, str]]:
    """Both agents' (stdout, stderr), read at the same time: reading one host's pipes to the end first could
    leave the other blocked on a full pipe, which would then hold the first one in torchrun's exit barrier."""
    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(lambda agent: agent.communicate(timeout=600), agents))


def _start_on(hosts: TwoHosts, host: int, args: list[str], work: Path, setup: str = "") -> Any:
    """``ferry ARGS`` on ``host``: forked from this process and moved onto the host (``TwoHosts.enter``), its
    torchrun and worker forked too (tests/support/helpers.py ``start_ferry``); ``FERRY_TESTS_EXEC=1``: exec'd
    there (``TwoHosts.popen``). Either has ``communicate(timeout)`` and ``returncode``."""
    if os.environ.get("FERRY_TESTS_EXEC") == "1":
        argv = [sys.executable, "-m", "ferry", *args]
        pipes = {"text": True, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return hosts.popen(host, argv, setup=setup, env=worker_env(work), cwd=work, **pipes)
    return start_ferry(args, env=worker_env(work), cwd=work, enter=lambda: hosts.enter(host, setup))


def _train_on_two_hosts(hosts: TwoHosts, cfg: dict, work: Path) -> Path:
    config = write_config(work / "two-nodes.yaml", cfg)
    args = ["train", str(config), "--nnodes", "2", "--nproc-per-node", "1"]
    args += ["--rdzv-endpoint", f"{hosts.addresses[0]}:{RDZV_PORT}", "--rdzv-timeout", "120"]
    received = hosts.rx_bytes(1)
    agents = [_start_on(hosts, h, args, work) for h in (0, 1)]
    results = _communicate(agents)
    for agent, (out, err) in zip(agents, results):
        assert agent.returncode == 0, f"{out[-2000:]}\n{err[-6000:]}"
        assert "world size:          2 (2 node(s) x 1 process(es))" in out
    # the second host's worker got the first one's gradients over the veth pair: LoRA's 46,240 fp32
    # gradients (185 KB) per step for 12 steps, plus the rendezvous, at least 1 MB in all
    assert hosts.rx_bytes(1) - received > 1_000_000
    output_dir = Path(cfg["output_dir"])
    report = json.loads((output_dir / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["global_steps"] == 12
    return output_dir


def test_ddp_on_two_hosts_equals_one_node_with_two_processes(hosts, one_node, tmp_path):
    reference, cfg = one_node
    out = _train_on_two_hosts(hosts, {**cfg, "output_dir": str(tmp_path / "ddp")}, tmp_path)
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-6)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(reference / "adapter"), rel_frobenius=1e-6, max_abs=1e-6
    )


def test_fsdp_on_two_hosts_equals_one_node_with_two_processes(hosts, one_node, tmp_path):
    reference, cfg = one_node
    out = _train_on_two_hosts(hosts, {**cfg, "output_dir": str(tmp_path / "fsdp"), "fsdp": "full_shard"}, tmp_path)
    report = json.loads((out / "train_report.json").read_text())
    assert report["parallelism"] == "full_shard"
    ddp_bytes = json.loads((reference / "train_report.json").read_text())["param_bytes_per_rank"]
    assert sum(report["param_bytes_per_rank"]) == pytest.approx(ddp_bytes[0], rel=0.01)  # sharded, not copied
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-5)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(reference / "adapter"), rel_frobenius=1e-4, max_abs=1e-4
    )


def test_hybrid_shard_on_two_hosts_replicates_across_them(hosts, one_node, tmp_path):
    """hybrid_shard: a 2-D mesh (2 nodes to replicate over x 1 process to shard over): each host holds the whole
    model and the gradients are all-reduced across the hosts, so it trains what DDP trains."""
    reference, cfg = one_node
    out = _train_on_two_hosts(hosts, {**cfg, "output_dir": str(tmp_path / "hsdp"), "fsdp": "hybrid_shard"}, tmp_path)
    report = json.loads((out / "train_report.json").read_text())
    assert report["parallelism"] == "hybrid_shard"
    assert report["param_bytes_per_rank"][0] == report["param_bytes_per_rank"][1] > 1_000_000  # unsharded: 1.2 MB
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-5)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(reference / "adapter"), rel_frobenius=1e-4, max_abs=1e-4
    )


def test_fsdp_refuses_an_output_dir_the_nodes_do_not_share(hosts, one_node, tmp_path):
    """Every FSDP rank writes its checkpoint shard into output_dir: on the second host a tmpfs hides the first
    host's folder, so the run stops at start with one line naming the key, before any step."""
    _, cfg = one_node
    out = tmp_path / "fsdp-local"
    out.mkdir()
    config = write_config(tmp_path / "local.yaml", {**cfg, "output_dir": str(out), "fsdp": "full_shard"})
    args = ["train", str(config), "--nnodes", "2", "--nproc-per-node", "1"]
    args += ["--rdzv-endpoint", f"{hosts.addresses[0]}:{RDZV_PORT}", "--rdzv-timeout", "120"]
    agents = [
        _start_on(hosts, h, args, tmp_path, setup=f"mount -t tmpfs ferry-local {out}" if h == 1 else "") for h in (0, 1)
    ]
    results = _communicate(agents)
    assert all(agent.returncode != 0 for agent in agents)
    # every rank stops with the same line (whichever rank the rendezvous gave each host)
    line = f"] fsdp: output_dir {str(out)!r} is not on a file system every node shares (1 rank(s) cannot see it)"
    for _, err in results:
        assert line in err, err[-3000:]
    assert not (out / "metrics.jsonl").exists() and not (out / "train_report.json").exists()


def test_a_node_that_never_arrives_fails_the_other_within_the_rendezvous_timeout(
    hosts, stories_model, llamafactory_data, tmp_path
):
    cfg = tiny_config(stories_model, llamafactory_data, tmp_path)
    config = write_config(tmp_path / "config.yaml", cfg)
    endpoint = f"{hosts.addresses[0]}:{RDZV_PORT}"
    args = ["train", str(config), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
    started = time.monotonic()
    agent = _start_on(hosts, 0, [*args, "--rdzv-timeout", "3"], tmp_path)
    out, err = agent.communicate(timeout=300)
    elapsed = time.monotonic() - started
    assert agent.returncode == 10, err[-3000:]  # TrainingError
    lines = err.strip().splitlines()
    assert lines == [lines[-1]], f"expected one line, got:\n{err[-3000:]}"
    assert lines[-1] == (
        f"ferry: error: rendezvous at {endpoint} timed out after 3 s: not all 2 nodes joined; start 'ferry train' "
        f"with the same --rdzv-endpoint on every node (or raise --rdzv-timeout)"
    )
    assert elapsed < 3 + 60  # the timeout, plus starting Python and torchrun on a loaded 2-core machine
    assert not (tmp_path / "out" / "train_report.json").exists()
