"""``ferry demo``, the README's main-job command, runs end to end with no network at all."""

from __future__ import annotations

import json
import os

import pytest

from ferry.cli.demo import DEMO_QUESTIONS, run_demo
from ferry.errors import ConfigError
from tests.support.helpers import run_ferry

pytestmark = pytest.mark.budget(
    300, reason="ferry demo: every stage of the embedded default, with 2 training processes"
)


def test_ferry_demo_runs_offline_and_reports_every_stage(tmp_path):
    """``ferry demo`` with no network, forked from this process, its torchrun and workers too
    (:func:`tests.support.helpers.run_ferry`; tests/e2e/test_main_job.py runs the installed ``ferry`` script)."""
    workdir = tmp_path / "demo"
    proc = run_ferry(["demo", "--workdir", str(workdir)], env=dict(os.environ), cwd=tmp_path, offline=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = proc.stdout
    for stage in ("build", "pack", "verify", "install", "train", "export+smoke", "total"):
        assert any(line.startswith(stage) for line in table.splitlines()), (stage, table)
    assert "smoke passed" in table and "adapter changed the answers" in table
    report = json.loads((workdir / "run" / "train_report.json").read_text())
    assert report["world_size"] == 2
    assert report["train_loss_final"] < report["train_loss_first"] - 1.0, report
    smoke = json.loads((workdir / "merged" / "smoke_report.json").read_text())
    assert smoke["passed"] and smoke["adapter_changed_output"]
    # the questions are rendered by the exported chat template, which is the alpaca layout training used
    assert [p["prompt"] for p in smoke["prompts"]] == list(DEMO_QUESTIONS)
    served = (workdir / "merged" / "chat_template.jinja").read_text()
    assert "### Instruction:" in served and "alpaca" in served
    assert (workdir / "out" / "ferry-demo.ferry.tar").is_file()
    assert (workdir / "prefix" / "hf-home" / "hub" / "models--local--tiny-llama").is_dir()
    # only ferry's lines reach the terminal; the libraries' bars and warnings are in the logs
    shown = proc.stdout + proc.stderr
    for library_line in (
        "Loading weights",
        "FutureWarning",
        "UserWarning",
        "rank_pattern",
        "is_gradient_checkpointing",
    ):
        assert library_line not in shown, (library_line, shown[-3000:])
    assert "\r" not in shown  # not a terminal: progress is whole lines
    losses = [line for line in shown.splitlines() if line.startswith("ferry: train step")]
    assert losses and all(line.split("loss ")[1].split(",")[0].count(".") == 1 for line in losses), losses
    assert all(len(line.split("loss ")[1].split(",")[0].split(".")[1]) == 4 for line in losses), losses
    unexpected = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(("ferry", "== "))]
    assert not unexpected, unexpected


def test_demo_refuses_a_non_empty_workdir(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        run_demo(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"
