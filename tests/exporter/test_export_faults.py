"""``ferry export`` under faults: a full disk and a kill while the smoke check runs, and a smoke check that fails.

The export is written, checked and summed in a staged folder (``.NAME.XXXX.tmp/NAME`` beside the output) and
renamed to the output name last, so an export whose check did not finish is never found under that name and a
rerun is not refused as "already exists". The disk fills for real: a small tmpfs in a private user and mount
namespace (``unshare -rm``), filled by a file written until the kernel says ENOSPC just as the smoke check starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.export import export
from exporter.options import ExportOptions
from ferry.errors import SmokeCheckError
from tests.support.helpers import make_adapter
from tests.support.netns import run_in_mount_namespace

pytestmark = pytest.mark.budget(60, reason="two ferry export processes in a mount namespace, each with its smoke")

#: Runs in the namespace: ``ferry export`` with the smoke check wrapped so that it first does ``ACTION``.
EXPORT_WITH_FAULT = """
import os, signal, sys
import exporter.smoke as smoke_module
from ferry.cli import main

action, folder = sys.argv[1], sys.argv[2]
real = smoke_module.smoke

def fault_then_smoke(*args, **kwargs):
    if action == "fill":  # every free byte of the tmpfs taken: the smoke report cannot be written
        try:
            with open(os.path.join(folder, "filler"), "wb") as fh:
                while True:
                    fh.write(b"\\0" * 65536)
                    fh.flush()
        except OSError:
            pass
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

smoke_module.smoke = fault_then_smoke
main(sys.argv[3:])
"""


def test_a_full_disk_or_a_kill_during_the_smoke_check_leaves_nothing_under_the_output_name(stories_model, tmp_path):
    adapter = tmp_path / "adapter"
    make_adapter(stories_model, adapter, target_modules=["q_proj"])
    disk = tmp_path / "disk"
    disk.mkdir()
    args = f"export --adapter {adapter} --base {stories_model} -o {disk}/merged --max-new-tokens 2"
    run = f"{sys.executable} -c '{EXPORT_WITH_FAULT}'"
    script = (
        f"mount -t tmpfs -o size=96m tmpfs {disk} && "
        f"{run} fill {disk} {args}; echo rc=$?; ls -A {disk}; "
        f"rm {disk}/filler; {run} kill {disk} {args}; echo rc=$?; ls -A {disk}; "
        f"{run} none {disk} {args} >/dev/null; echo rc=$?; ls -A {disk}; "
        f"cd {disk}/merged && sha256sum -c --quiet SHA256SUMS && echo sums-ok && cat smoke_report.json"
    )
    proc = run_in_mount_namespace(script, pythonpath=Path.cwd())
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
