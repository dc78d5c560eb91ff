"""Checkpoints and resume.

End to end (real torchrun, 2 gloo workers, LoRA dropout 0.1 so that the restored RNG states matter): a worker is
SIGKILLed right after optimizer step 7 (``FERRY_TEST_KILL_AT_STEP``; checkpoints every 3 steps, so the newest
is checkpoint-6, mid-epoch: 6 of 8 steps) and

- with ``--max-restarts 1`` torchrun restarts the group, which resumes from checkpoint-6;
- with no restarts ``ferry train`` fails, and running the same command again resumes from checkpoint-6;

both end with the same per-step losses and adapter as an uninterrupted run. Same world size, same kernels,
same summation order: we expect agreement to rounding, and allow 1e-6 relative (losses) / 1e-6 relative
Frobenius norm (adapter tensors).

Unit level: the rules that pick the checkpoint, rotation, clearing, the RNG round trip.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ferry.errors import ConfigError
from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    fork_ferry,
    run_ferry_train,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.budget(150, reason="training runs killed and resumed, each a torchrun job")

KILL_AT = 7


@pytest.fixture(scope="module")
def reference(stories_model, llamafactory_data, tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run and its config."""
    work = tmp_path_factory.mktemp("resume-ref")
    cfg = tiny_config(stories_model, llamafactory_data, work, lora_dropout=0.1, save_steps=3, save_total_limit=2)
    run_ferry_train(write_config(work / "config.yaml", cfg), "--nproc-per-node", "2", env=worker_env(work), cwd=work)
    return Path(cfg["output_dir"]), cfg


def _assert_same_run(out: Path, ref: Path, resumed: str = "checkpoint-6") -> None:
    losses, expected = train_losses(out), train_losses(ref)
    assert len(losses) == len(expected) == 12
    assert losses == pytest.approx(expected, rel=1e-6)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(ref / "adapter"), rel_frobenius=1e-6, max_abs=1e-6
    )
    report = json.loads((out / "train_report.json").read_text())
    assert report["resumed_from"] == str(out / resumed)
    assert report["tokens_seen"] == json.loads((ref / "train_report.json").read_text())["tokens_seen"]
    # save_total_limit 2: the same newest checkpoints as the uninterrupted run
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-9"]
    assert not (out / "loss.png").exists()  # plot_loss is off by default


def test_killed_worker_with_max_restarts_resumes_exactly(reference, tmp_path):
    ref, cfg = reference
    cfg = {**cfg, "output_dir": str(tmp_path / "out")}
    config = write_config(tmp_path / "config.yaml", cfg)
    env = worker_env(tmp_path, FERRY_TEST_KILL_AT_STEP=str(KILL_AT))
    run_ferry_train(config, "--nproc-per-node", "2", "--max-restarts", "1", env=env, cwd=tmp_path)
    # resumed_from (checked below) is set only when the second attempt loaded checkpoint-6 from this fresh folder
    _assert_same_run(tmp_path / "out", ref)


def test_failed_run_continues_when_the_command_is_run_again(reference, tmp_path):
    ref, cfg = reference
    cfg = {**cfg, "output_dir": str(tmp_path / "out")}
    config = write_config(tmp_path / "config.yaml", cfg)
    killed = run_ferry_train(
        config,
        "--nproc-per-node",
        "2",
        cwd=tmp_path,
        check=False,
        env=worker_env(tmp_path, FERRY_TEST_KILL_AT_STEP=str(KILL_AT)),
    )
    assert killed.returncode == 10, killed.stderr[-3000:]  # TrainingError
    assert "ferry: error: training failed" in killed.stderr
    assert not (tmp_path / "out" / "train_report.json").exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "out")] == ["checkpoint-3", "checkpoint-6"]
    # another world size cannot continue at the same sample: refused up front, before any worker starts
    other = run_ferry_train(config, "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path, check=False)
    assert other.returncode == 2
    assert "was (2, 2, 1), now (1, 2, 1)" in other.stderr.strip().splitlines()[-1]
    (tmp_path / "out" / ".checkpoint-9.x1y2.tmp").mkdir()  # a save killed half-way (the kill above came sooner)
    again = run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=tmp_path)
    _assert_same_run(tmp_path / "out", ref)
    said = [line for line in again.stderr.splitlines() if "resuming" in line or "interrupted" in line]
    assert said == [
        f"ferry: removed what an interrupted checkpoint save left in {tmp_path / 'out'}: .checkpoint-9.x1y2.tmp",
        f"ferry: resuming from {tmp_path / 'out' / 'checkpoint-6'} (step 6)",
    ], again.stderr[-3000:]
    assert not (tmp_path / "out" / ".checkpoint-9.x1y2.tmp").exists()


def _train_on_a_filling_disk(disk: Path, config: Path, room: int, kept: Path) -> None:
    """In the mount namespace where ``disk`` is a tmpfs: a filler file leaves ``room`` bytes free, ``ferry train
    CONFIG`` runs (forked, as :func:`tests.support.helpers.run_ferry_train` runs it) until a save finds the disk full;
    the filler is removed (the user makes room) and the same command runs again. Before each run ``== run N`` on
    stderr; after each its exit status and what ``output_dir`` holds, as one JSON line on stdout. ``output_dir`` is
    copied to ``kept`` at the end (the tmpfs goes with the namespace)."""
    from benchmarks.forked_torchrun import exit_with
    from ferry.cli import main
    from tests.support import forks

    forks.install()  # its torchrun and workers forked too
    out = disk / "out"
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * (shutil.disk_usage(disk).free - room))
    for run in (1, 2):
        print(f"== run {run}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            exit_with(functools.partial(main, ["train", str(config), "--nproc-per-node", "2"]))
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps({"rc": status, "out": sorted(os.listdir(out))}), flush=True)
        (disk / "filler").unlink(missing_ok=True)
    shutil.copytree(out, kept, symlinks=True)


def test_a_disk_full_at_a_checkpoint_is_one_line_and_the_run_goes_on_once_there_is_room(reference, tmp_path):
    """``output_dir`` on a small tmpfs with room for one checkpoint and a half: the save of checkpoint-6 runs out of
    space. One line names the file, the free space and the way on; no half-written checkpoint is left and
    checkpoint-3 is whole. Once there is room the same command resumes from checkpoint-3 and ends as the
    uninterrupted run."""
    ref, cfg = reference
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    config = write_config(tmp_path / "config.yaml", {**cfg, "output_dir": str(disk / "out")})
    checkpoint = sum(f.stat().st_size for f in (ref / "checkpoint-6").iterdir())  # each is as big
    room = checkpoint * 3 // 2 + 256 * 1024  # checkpoint-3, metrics and logs fit; checkpoint-6 does not
    proc = fork_ferry(
        [],
        env=worker_env(tmp_path),
        cwd=tmp_path,
        mount_setup=f"mount -t tmpfs -o size=64m tmpfs {disk}",
        entry=lambda _: _train_on_a_filling_disk(disk, config, room, kept),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (first, second) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    full, again = proc.stderr.split("== run 2\n")
    errors = [line for line in full.splitlines() if line.startswith("ferry: error:")]
    assert first["rc"] == 10 and len(errors) == 1, full[-4000:]  # TrainingError
    assert "Traceback" not in full
    out = disk / "out"
    assert errors[0].startswith(
        f"ferry: error: training failed: [rank 0] cannot write checkpoint-6 to {out}: No space left on device "
        f"({out}/.checkpoint-6."
    ), errors[0]
    assert (
        f"free in {out}; nothing half-written is kept; make room (save_total_limit keeps fewer checkpoints)"
        in (errors[0])
    )
    assert errors[0].endswith(f"re-running the same command continues from the newest checkpoint in {out}")
    assert [name for name in first["out"] if "checkpoint" in name] == ["checkpoint-3"]  # no temp folder either
    assert second["rc"] == 0, again[-4000:]
    assert f"ferry: resuming from {out / 'checkpoint-3'} (step 3)" in again
    (kept / ckpt.REPORT_FILE).write_text((kept / ckpt.REPORT_FILE).read_text().replace(str(out), str(kept)))
    _assert_same_run(kept, ref, resumed="checkpoint-3")


# ---------------------------------------------------------------------- unit level


def _fake_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / ckpt.STATE_FILE).write_text("{}")
    return path


def test_auto_resume_picks_the_newest_complete_checkpoint(tmp_path):
    assert ckpt.plan_resume(tmp_path / "missing", "auto", False) == ckpt.ResumePlan(None, start_over=False)
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 40)
    _fake_checkpoint(tmp_path, 45, complete=False)  # a save killed before its rename never looks like this,
    (tmp_path / ".checkpoint-50.abc.tmp").mkdir()  # but a temp dir of one does
    assert ckpt.plan_resume(tmp_path, "auto", False).checkpoint == newest
    assert ckpt.plan_resume(tmp_path, str(tmp_path / "checkpoint-5"), False).checkpoint == tmp_path / "checkpoint-5"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        ckpt.plan_resume(tmp_path, str(tmp_path / "checkpoint-45"), False)
    with pytest.raises(ConfigError, match="resume_from_checkpoint is off"):
        ckpt.plan_resume(tmp_path, None, False)
    assert ckpt.plan_resume(tmp_path, None, True) == ckpt.ResumePlan(None, start_over=True)


def test_finished_run_needs_overwrite_but_a_torchrun_restart_always_resumes(tmp_path):
    newest = _fake_checkpoint(tmp_path, 8)
    (tmp_path / ckpt.REPORT_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="finished run.*overwrite_output_dir"):
        ckpt.plan_resume(tmp_path, "auto", False)
    assert ckpt.plan_resume(tmp_path, "auto", True).start_over
    # the group restarted by torchrun after a crash of this very run, which started over: continue it
    assert ckpt.plan_resume(tmp_path, "auto", True, restarted=True) == ckpt.ResumePlan(newest, start_over=False)


def test_a_restart_before_the_first_checkpoint_starts_where_the_first_attempt_did(tmp_path):
    elsewhere = _fake_checkpoint(tmp_path / "older-run", 30)
    out = tmp_path / "out"
    assert ckpt.plan_resume(out, str(elsewhere), False, restarted=True).checkpoint == elsewhere
    assert ckpt.plan_resume(out, "auto", True, restarted=True) == ckpt.ResumePlan(None, start_over=False)
    newer = _fake_checkpoint(out, 40)
    assert ckpt.plan_resume(out, str(elsewhere), False, restarted=True).checkpoint == newer


def test_clearing_a_previous_run_keeps_the_users_files(tmp_path):
    _fake_checkpoint(tmp_path, 3)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / ckpt.REPORT_FILE).write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    ckpt.clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_rotation_keeps_the_newest(tmp_path):
    for step in (2, 10, 4, 8):
        _fake_checkpoint(tmp_path, step)
    deleted = ckpt.rotate_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-4"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-8", "checkpoint-10"]


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save([ckpt.capture_rng_state()], tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)[0])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2])


def _fake_gpus(monkeypatch, count: int) -> list[tuple[torch.Tensor, int]]:
    """torch reports ``count`` GPUs; returns the (state, device index) pairs ``torch.cuda.set_rng_state`` gets."""
    restored: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state restored"))
    return restored


def test_a_checkpoint_from_an_8_gpu_node_resumes_on_fewer_gpus(tmp_path, monkeypatch, capsys):
    """An older checkpoint's ``cuda`` list of 8 GPU states (a node with 8 GPUs) restores on a host without CUDA
    (ignored) and on one with a single visible GPU (that GPU takes the state of its own index, one line on the
    main rank), never indexing past the visible GPUs."""
    saved = ckpt.capture_rng_state()
    saved["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    torch.save([saved], tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)[0]

    ckpt.restore_rng_state(state, torch.device("cpu"))  # this CPU host: the CUDA states are ignored
    restored = _fake_gpus(monkeypatch, 1)
    ckpt.restore_rng_state(state, torch.device("cuda", 0), verbose=True)
    assert len(restored) == 1 and restored[0][1] == 0 and torch.equal(restored[0][0], state["cuda"][0])
    line = capsys.readouterr().err.strip()
    assert line == (
        "ferry: resume: the checkpoint holds the CUDA RNG states of 8 GPU(s), this node sees 1: each rank's GPU "
        "takes the saved state of its index modulo 8"
    )
    restored.clear()
    ckpt.restore_rng_state(state, torch.device("cuda", 0), verbose=False)  # other ranks: no line
    assert len(restored) == 1 and capsys.readouterr().err == ""


def test_each_rank_saves_and_restores_its_own_gpus_rng_state(monkeypatch):
    """A rank on ``cuda:3`` saves that GPU's generator only (not every visible GPU's) and restores it to the GPU
    it runs on now; the state is mapped by the rank's device, not by the saving node's GPU count."""
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((16,), device, dtype=torch.uint8))
    state = ckpt.capture_rng_state(torch.device("cuda", 3))
    assert state["cuda_index"] == 3 and torch.equal(state["cuda_device"], torch.full((16,), 3, dtype=torch.uint8))
    assert "cuda" not in state
    restored = _fake_gpus(monkeypatch, 4)
    ckpt.restore_rng_state(state, torch.device("cuda", 3))
    assert len(restored) == 1 and restored[0][1] == 3 and torch.equal(restored[0][0], state["cuda_device"])
    assert ckpt.cuda_state_for({"cuda": []}, 0, 1) == (None, None)
    assert "cuda_device" not in ckpt.capture_rng_state(torch.device("cpu"))


_SHARD_WORKER = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from trainer.checkpoint import load_sharded_state, save_sharded_state, write_error_line
rank, port, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("gloo")
torch.manual_seed(0)
model = fully_shard(torch.nn.Sequential(torch.nn.Linear(256, 256)))  # each rank holds half of 256 KiB
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 256)).sum().backward()
optimizer.step()
said = {}
try:
    save_sharded_state(folder, model, optimizer)
except Exception as exc:
    said["error"] = f"{type(exc).__name__}: {exc}"
    said["line"] = write_error_line(exc, "checkpoint-2 to OUT", folder.parent, rank)
try:
    load_sharded_state(folder, model, optimizer)
except Exception as exc:
    said["load"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(said))
"""


def test_a_full_disk_on_one_rank_of_a_sharded_checkpoint_is_the_same_line_on_every_rank(tmp_path):
    """Two FSDP ranks (gloo) save one sharded checkpoint (``torch.distributed.checkpoint``) into the same path, rank 1
    on its own disk (as a node whose output_dir is not shared), a 64 KiB tmpfs too small for its shard (its
    optimizer state goes through torch.save, whose zip writer hides the OSError): both ranks raise rank 1's
    ``OSError`` naming rank 1's file, and make the disk-full line (rank 1 with its free space, rank 0 naming rank 1);
    reading the checkpoint back fails as a ``TrainingError`` on both (DCP's ``CheckpointException`` is a
    ``BaseException``, which ``except Exception`` would let through)."""
    import socket
    import subprocess

    script = tmp_path / "shard_worker.py"
    script.write_text(_SHARD_WORKER)
    disk = tmp_path / "disk"
    disk.mkdir()
    folder = disk / "sharded"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, str(script), "0", port, str(folder)], **_pipes(env)),
        subprocess.Popen(
            [
                "unshare",
                "-rm",
                "sh",
                "-c",
                'mount -t tmpfs -o size=64k tmpfs "$1" && shift && exec "$0" "$@"',
                sys.executable,
            ]
            + [str(disk), str(script), "1", port, str(folder)],
            **_pipes(env),
        ),
    ]
    said = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        said.append(json.loads(out.splitlines()[-1]))
    shard = folder / "__1_0.distcp"  # rank 1's file (torch.distributed.checkpoint's name)
    assert said[0]["error"] == said[1]["error"] == f"OSError: [Errno 28] No space left on device: {str(shard)!r}"
    # rank 1 says how much room its own disk has left; rank 0, on another disk, names rank 1 instead
    assert said[1]["line"].startswith(f"cannot write checkpoint-2 to OUT: No space left on device ({shard}); ")
    assert said[1]["line"].endswith(f" free in {disk}"), said
    assert said[0]["line"] == f"cannot write checkpoint-2 to OUT on rank 1: No space left on device ({shard})"
    for rank in said:
        assert rank["load"].startswith(f"TrainingError: {folder}: sharded checkpoint unreadable (rank 0: "), said


def _pipes(env: dict) -> dict:
    from tests.support.helpers import ROOT

    return {"cwd": ROOT, "env": env, "stdout": -1, "stderr": -1, "text": True}


def _save_steps(out: Path, model, steps: list[int], limit: int | None) -> None:
    """Save checkpoints of ``model`` (a peft model) at ``steps`` into ``out``, each one's LoRA B weights all equal
    to its step: the checkpoint a reader finds says which save wrote it."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for step in steps:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(step)
        state = ckpt.TrainerState(
            global_step=step,
            epoch=0,
            micro_batches_in_epoch=step,
            tokens_seen=0,
            world_size=1,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=1,
            seed=0,
        )
        ckpt.save_checkpoint(
            out,
            peft_model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            state=state,
            rng_states=[ckpt.capture_rng_state()],
            save_total_limit=limit,
        )


def test_a_save_killed_at_each_phase_leaves_a_checkpoint_to_resume_from(stories_model, tmp_path):
    """A process killed at each phase of a checkpoint save (``FERRY_TEST_KILL_AT``): whole under its temp name
    (``checkpoint:staged``), in place before the oldest is rotated out (``checkpoint:renamed``), the oldest half
    rotated out (``checkpoint:rotating``), an earlier checkpoint of the same step moved aside to be replaced
    (``checkpoint:swap-aside``). After each, the next start's clean-up (:func:`ckpt.remove_interrupted_saves`, what
    ``ferry train`` runs first) leaves only whole checkpoints, and the newest is the one resume picks and loads:
    the earlier save's before the new one was in place, the new one after."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ferry.faults import KILL_AT_ENV

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(stories_model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    cases = {  # point: (saves, save_total_limit, what the clean-up says, checkpoints after it)
        "checkpoint:staged#2": ([3, 6], 1, ["removed what"], [3]),
        "checkpoint:renamed#2": ([3, 6], 1, [], [3, 6]),
        "checkpoint:rotating": ([3, 6], 1, ["removed what"], [6]),
        "checkpoint:swap-aside": ([3, 6, 6], None, ["put back", "removed what"], [3, 6]),  # and the new one staged
    }
    for point, (steps, limit, said, kept) in cases.items():
        out = tmp_path / point.replace(":", "-").replace("#", "-")

        def save(_args, out=out, steps=steps, limit=limit, point=point):
            os.environ[KILL_AT_ENV] = point
            _save_steps(out, model, steps, limit)

        proc = fork_ferry([], env=dict(os.environ), cwd=tmp_path, entry=save)
        assert proc.returncode == -9, (point, proc.stderr[-3000:])  # SIGKILL at the point
        done = ckpt.remove_interrupted_saves(out)
        assert [" ".join(line.split(" ")[:2]) for line in done] == said, done
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [], point
        assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)] == kept, point
        assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{step}" for step in sorted(kept)], point
        plan = ckpt.plan_resume(out, "auto", False)
        loaded = ckpt.load_checkpoint(plan.checkpoint)
        assert loaded.state.global_step == kept[-1] and loaded.optimizer is not None, point
        b_weights = [t for name, t in loaded.adapter_state.items() if "lora_B" in name]
        assert b_weights and all(bool((t == kept[-1]).all()) for t in b_weights), point
