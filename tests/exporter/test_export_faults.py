"""``ferry export`` under faults: a full disk and a kill while the smoke check runs, a smoke check that fails, and
an overwrite killed at each of its phases (``FERRY_TEST_KILL_AT``, :mod:`ferry.faults`).

The export is written, checked and summed in a staged folder (``.NAME.XXXX.tmp/NAME`` beside the output) and
renamed to the output name last, so an export whose check did not finish is never found under that name and a
rerun is not refused as "already exists". The disk fills for real: a small tmpfs in a private user and mount
namespace (``unshare -rm``), filled by a file written until the kernel says ENOSPC just as the smoke check starts.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.export import export
from exporter.options import ExportOptions
from ferry.errors import SmokeCheckError
from ferry.faults import KILL_AT_ENV
from tests.support.helpers import fork_ferry, make_adapter, run_ferry

pytestmark = pytest.mark.budget(60, reason="up to six ferry exports (forked), each with its smoke check")


def _export_with_fault(action: str, folder: Path, args: list[str]) -> None:
    """``ferry ARGS`` with the smoke check wrapped so that it first does ``action``: ``fill`` takes every free byte
    of the tmpfs (the smoke report cannot be written), ``kill`` SIGKILLs this process, ``none`` nothing."""
    import signal

    import exporter.smoke as smoke_module
    from ferry.cli import main

    real = smoke_module.smoke

    def fault_then_smoke(*a: object, **kw: object) -> object:
        if action == "fill":
            try:
                with open(folder / "filler", "wb") as fh:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
            except OSError:
                pass
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    smoke_module.smoke = fault_then_smoke
    main(args)


def _three_exports(disk: Path, args: list[str]) -> None:
    """In the mount namespace where ``disk`` is a 96 MiB tmpfs: ``ferry ARGS`` three times, each in a child forked
    from here (as a shell runs three commands): with the disk filled, killed, and once more with no fault (its
    output dropped). After each, ``rc=STATUS`` (128 + the signal for a killed one, as ``sh`` reports it) and what
    is on the disk, a name a line; at the end ``sums-ok`` once the rerun's folder matches its SHA256SUMS, then its
    smoke report."""
    from benchmarks.forked_torchrun import exit_with

    for action in ("fill", "kill", "none"):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            if action == "none":
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            exit_with(functools.partial(_export_with_fault, action, disk, args))
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"rc={status if status >= 0 else 128 - status}", *sorted(os.listdir(disk)), sep="\n", flush=True)
        if action == "fill":
            (disk / "filler").unlink()
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=disk / "merged", check=True)
    print("sums-ok", (disk / "merged" / "smoke_report.json").read_text(), sep="\n", flush=True)


def test_a_full_disk_or_a_kill_during_the_smoke_check_leaves_nothing_under_the_output_name(stories_model, tmp_path):
    adapter = tmp_path / "adapter"
    make_adapter(stories_model, adapter, target_modules=["q_proj"])
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["export", "--adapter", str(adapter), "--base", str(stories_model), "-o", f"{disk}/merged"]
    # the three exports forked from this process (torch and transformers imported), in a user + mount namespace
    # of their own where ``disk`` is a small tmpfs
    proc = fork_ferry(
        [],
        env=dict(os.environ),
        cwd=tmp_path,
        mount_setup=f"mount -t tmpfs -o size=96m tmpfs {disk}",
        entry=lambda _: _three_exports(disk, [*args, "--max-new-tokens", "2"]),
    )
    out = proc.stdout
    full, killed, rerun = out.split("rc=")[1:4]
    # disk full: one line naming the file, ENOSPC and the free space; only the filler is left on the disk
    assert full.splitlines()[0] == "11" and full.split()[1:] == ["filler"], (out, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ferry: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"cannot write the export to {disk}/merged: No space left on device" in errors[0]
    assert "smoke_report.json" in errors[0] and f"free in {disk}" in errors[0] and "nothing was left" in errors[0]
    # killed: the staged folder and the lock file are left hidden beside the output, nothing under its name
    assert killed.splitlines()[0] == "137" and "merged" not in killed.split()[1:], out
    lock, stage = sorted(killed.split()[1:], key=lambda name: name != ".merged.ferry-lock")  # (ls's order varies)
    assert lock == ".merged.ferry-lock" and stage.startswith(".merged.") and stage.endswith(".tmp"), out
    # the rerun is not refused as "already exists" (the killed holder's lock is taken over in one line, its staged
    # folder removed in another), and its folder is whole and checked; the lock file goes with it
    assert rerun.splitlines()[0] == "0" and rerun.split()[1:3] == ["merged", "sums-ok"], out
    assert f"ferry: --output {disk}/merged was held by pid " in proc.stderr and "taking it over" in proc.stderr
    assert f"ferry: removed what the stopped holder left half-written in {disk}: {stage}" in proc.stderr
    report = json.loads(out.split("sums-ok\n", 1)[1])
    assert report["passed"] and report["model_dir"] == f"{disk}/merged"


def test_a_failed_smoke_check_publishes_the_export_with_its_report_naming_the_output(
    stories_model, tmp_path, monkeypatch
):
    import exporter.smoke as smoke_module

    adapter = tmp_path / "adapter"
    make_adapter(stories_model, adapter, target_modules=["q_proj"])
    monkeypatch.setattr(smoke_module, "_output_failures", lambda *a, **k: ["a failure the test made"])
    out = tmp_path / "merged"
    with pytest.raises(SmokeCheckError) as failed:
        export(adapter, out, ExportOptions(base=stories_model, max_new_tokens=2))
    message = str(failed.value)
    assert f"smoke check of {out} failed: a failure the test made (report: {out / 'smoke_report.json'})" == message
    assert ".tmp" not in message
    report = json.loads((out / "smoke_report.json").read_text())
    assert report["passed"] is False and report["model_dir"] == str(out)
    sums = (out / "SHA256SUMS").read_text()
    assert "smoke_report.json" in sums
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out, check=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staged folder left


#: The kill points of ``ferry export --overwrite`` (:mod:`ferry.faults`), in the order the test reaches them: the
#: first one comes between moving the earlier export aside and renaming the new one in; each later run finds what
#: the killed one left and puts the earlier export back.
EXPORT_KILL_POINTS = ("export:swap-aside", "export:written", "export:checked", "export:summed")


def test_an_export_killed_at_each_phase_leaves_the_earlier_one_whole_and_the_rerun_replaces_it(stories_model, tmp_path):
    """An earlier export under the output name, then ``ferry export --overwrite`` of another adapter killed at each
    phase (forked, ``FERRY_TEST_KILL_AT``): after each kill the name holds the earlier export, byte for byte and
    matching its SHA256SUMS, or (killed between the two renames) nothing, with the earlier export put back by the
    next command; the last run, not killed, replaces it and leaves nothing beside it."""
    earlier_adapter, adapter = tmp_path / "adapter-a", tmp_path / "adapter-b"
    make_adapter(stories_model, earlier_adapter, target_modules=["q_proj"], seed=1)
    make_adapter(stories_model, adapter, target_modules=["q_proj"], seed=2)
    out = tmp_path / "exports" / "merged"

    def export_of(source: Path, *more: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
        args = ["export", "--adapter", str(source), "--base", str(stories_model), "-o", str(out), *more]
        env = {**os.environ, **({KILL_AT_ENV: kill_at} if kill_at else {})}
        return run_ferry([*args, "--max-new-tokens", "2"], env=env, cwd=tmp_path)

    def whole() -> dict[str, bytes]:
        subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out, check=True)
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    assert export_of(earlier_adapter).returncode == 0
    earlier = whole()
    for point in EXPORT_KILL_POINTS:
        proc = export_of(adapter, "--overwrite", kill_at=point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-3000:])
        if point == "export:swap-aside":
            assert not out.exists()
            (aside,) = [p for p in out.parent.iterdir() if p.name.startswith(".merged.old-")]
            assert {p.name: p.read_bytes() for p in sorted(aside.iterdir())} == earlier
        else:
            assert whole() == earlier, point
            if point == "export:written":  # the first command after the swap-aside kill put the earlier export back
                assert f"ferry: put back {out}, which the stopped holder had moved aside to {aside.name}" in proc.stderr
    last = export_of(adapter, "--overwrite")
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"--output {out} was held by pid " in last.stderr and "taking it over" in last.stderr
    assert "ferry: removed what the stopped holder left half-written" in last.stderr
    replaced = whole()
    assert replaced["model.safetensors"] != earlier["model.safetensors"]
    assert json.loads(replaced["smoke_report.json"])["passed"] is True
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]  # no stage, no lock file, no copy aside
