"""Multi-node: two torchrun agents (``ferry train --nnodes 2 --nproc-per-node 1``) meet through a c10d rendezvous on
127.0.0.1 and train one job together. Each node's launcher validates and tokenises on its own (here both share
one cache folder, so one builds it under the file lock and the other loads it).

The job must equal 1 node x 2 processes: same global batch, same ranks, same gloo sums, so we allow only
1e-6 relative on losses and on each adapter tensor's Frobenius norm.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.trainer.test_loop import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry_train,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_train_one_job_like_one_node_with_two_processes(stories_model, llamafactory_data, tmp_path):
    one_node = tiny_config(stories_model, llamafactory_data, tmp_path, output_dir=str(tmp_path / "one-node"))
    run_ferry_train(write_config(tmp_path / "one-node.yaml", one_node), "--nproc-per-node", "2",
                    env=worker_env(tmp_path), cwd=tmp_path)

    two_nodes = {**one_node, "output_dir": str(tmp_path / "two-nodes")}
    config = write_config(tmp_path / "two-nodes.yaml", two_nodes)
    endpoint = f"127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "ferry", "train", str(config), "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint]
    agents = [
        subprocess.Popen(argv, env=worker_env(tmp_path), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    results = [agent.communicate(timeout=600) for agent in agents]
    for agent, (out, err) in zip(agents, results):
        assert agent.returncode == 0, f"{out[-2000:]}\n{err[-6000:]}"
        assert "world size:          2 (2 node(s) x 1 process(es))" in out

    report = json.loads((tmp_path / "two-nodes" / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["global_steps"] == 12
    assert train_losses(tmp_path / "two-nodes") == pytest.approx(
        train_losses(tmp_path / "one-node"), rel=1e-6)
    assert_same_adapter(adapter_tensors(tmp_path / "two-nodes" / "adapter"),
                        adapter_tensors(tmp_path / "one-node" / "adapter"), rel_frobenius=1e-6, max_abs=1e-6)
