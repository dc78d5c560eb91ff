"""ferry/folder_lock.py: one command at a time per output folder. A second ``ferry train`` on a held output_dir, a
second ``ferry eval`` on a held output_dir and a second ``ferry export`` to a held output name are refused in one
line naming the holder before anything starts; the kernel frees the lock when its holder exits, and a record left by
a holder that is gone is taken over with one line."""

from __future__ import annotations

import json
import os
import socket

import pytest

from ferry.errors import ConfigError
from ferry.folder_lock import RECORD, hold_folder, hold_name
from tests.support.helpers import run_ferry_train, tiny_config, worker_env, write_config


def _held_in_a_child(folder, ready_r, ready_w, release_r, release_w, hold=hold_folder, command="ferry train") -> int:
    """Fork a process that holds ``folder`` (``hold``: :func:`hold_folder` or :func:`hold_name`) until the parent
    writes to ``release_w``; returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            with hold(folder, command):
                os.write(ready_w, b"x")
                os.read(release_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.read(ready_r, 1)
    return pid


def test_a_held_folder_is_refused_naming_its_holder_and_free_again_when_the_holder_exits(tmp_path):
    folder = tmp_path / "out"
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = _held_in_a_child(folder, ready_r, ready_w, release_r, release_w)
    try:
        with pytest.raises(ConfigError) as refused, hold_folder(folder, "ferry train"):
            pass
        message = str(refused.value)
        assert "\n" not in message and f"pid {pid} on {socket.gethostname()}, ferry train since" in message
        assert message.startswith(f"output_dir '{folder}' is in use by another run")
    finally:
        os.write(release_w, b"x")
        os.waitpid(pid, 0)
    assert not folder.exists()  # the holder took its record, and the folder it made, with it
    with hold_folder(folder, "ferry train") as held:
        assert json.loads((held / RECORD).read_text())["pid"] == os.getpid()
        (held / "adapter").mkdir()  # what the run wrote stays; only the record goes
    assert sorted(os.listdir(folder)) == ["adapter"]


def test_a_file_in_the_folders_place_is_one_line(tmp_path):
    (tmp_path / "out").write_text("mine")
    with pytest.raises(ConfigError, match=r"output_dir '.*out' cannot be used as a folder \(File exists\)$"):
        with hold_folder(tmp_path / "out", "ferry train"):
            pass
    assert (tmp_path / "out").read_text() == "mine"


def test_a_record_left_by_a_holder_that_is_gone_is_taken_over_in_one_line(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    record = {"pid": 2**22 + 7, "host": "node-a", "command": "ferry train", "since": "2026-11-28 03:00:00"}
    (folder / RECORD).write_text(json.dumps(record))  # a run killed with SIGKILL: the lock went, the record stayed
    with hold_folder(folder, "ferry train"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"ferry: output_dir {folder} was held by pid {2**22 + 7} on node-a, ferry train since 2026-11-28 03:00:00, "
        "which has stopped; taking it over"
    ]


def test_a_second_ferry_train_on_a_held_output_dir_is_one_line_and_starts_nothing(
    tmp_path, stories_model, llamafactory_data
):
    cfg = tiny_config(stories_model, llamafactory_data, tmp_path, max_steps=2)
    config = write_config(tmp_path / "train.yaml", cfg)
    out = tmp_path / "out"
    with hold_folder(out, "ferry train"):  # the first run, still going
        proc = run_ferry_train(config, "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path, check=False)
        assert sorted(os.listdir(out)) == [RECORD]  # nothing of the second run's
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ferry: error: output_dir '{out}' is in use by another run")
    assert f"pid {os.getpid()}" in lines[0] and lines[0].endswith("wait for it to finish or choose another output_dir")


def test_a_held_export_name_is_refused_and_its_lock_file_goes_with_the_holder(tmp_path, capsys):
    from exporter.export import export
    from exporter.options import ExportOptions

    output = tmp_path / "merged"
    lock = tmp_path / ".merged.ferry-lock"
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = _held_in_a_child(output, ready_r, ready_w, release_r, release_w, hold=hold_name, command="ferry export")
    try:
        assert json.loads(lock.read_text())["pid"] == pid
        with pytest.raises(ConfigError) as refused:  # refused before the adapter is even read
            export(tmp_path / "no-adapter-here", output, ExportOptions(smoke=False))
        message = str(refused.value)
        assert message.startswith(f"--output '{output}' is in use by another run (pid {pid} on ")
        assert "ferry export since" in message and "\n" not in message
    finally:
        os.write(release_w, b"x")
        os.waitpid(pid, 0)
    assert sorted(os.listdir(tmp_path)) == []  # no output, no lock file
    # a lock file left by a holder killed with SIGKILL: taken over with one line, and removed at the end
    record = {"pid": 2**22 + 9, "host": "node-b", "command": "ferry export", "since": "2026-11-28 04:00:00"}
    lock.write_text(json.dumps(record))
    with hold_name(output, "ferry export") as held:
        assert held == output and json.loads(lock.read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err.splitlines() == [
        f"ferry: --output {output} was held by pid {2**22 + 9} on node-b, ferry export since 2026-11-28 04:00:00, "
        "which has stopped; taking it over"
    ]
    assert not lock.exists()


def test_a_second_ferry_eval_on_a_held_output_dir_is_one_line(tmp_path):
    from evaluation.config import EvalConfig
    from evaluation.run import run_eval

    out = tmp_path / "eval-out"
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = _held_in_a_child(out, ready_r, ready_w, release_r, release_w, command="ferry eval")
    try:
        config = EvalConfig(model_name_or_path=str(tmp_path / "no-model"), tasks=["arc_easy"], output_dir=str(out))
        with pytest.raises(ConfigError) as refused:  # before the model is looked for
            run_eval(config)
        assert str(refused.value).startswith(f"output_dir '{out}' is in use by another run (pid {pid} on ")
        assert sorted(os.listdir(out)) == [RECORD]
    finally:
        os.write(release_w, b"x")
        os.waitpid(pid, 0)
    assert not out.exists()
