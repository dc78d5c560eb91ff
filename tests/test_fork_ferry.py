"""tests/support/helpers.py's ``fork_ferry``, which runs the suite's ``ferry train`` launchers and plain training
workers as children forked from pytest, and tests/support/forks.py, which forks their torchrun and its
workers: a forked command answers exactly as an exec'd one, a forked worker or torchrun trains exactly what an exec'd
one trains and fails in the same line, and the offline namespace has only loopback."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from ferry.output import route_library_output, unroute_library_output
from tests.support.helpers import (
    ROOT,
    adapter_tensors,
    fork_ferry,
    run_plain_worker,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)
from tests.support.netns import enter_offline_namespace


def test_a_forked_ferry_answers_as_an_execd_one(tmp_path):
    # as after an earlier in-process test: the libraries' output routed to a file, Python warnings captured
    route_library_output(tmp_path / "earlier" / "logs" / "ferry.log")
    try:
        _answers_as_an_execd_one(tmp_path)
    finally:
        unroute_library_output()


def _answers_as_an_execd_one(tmp_path):
    (tmp_path / "typo.yaml").write_text("model_name_or_path: some/model\nlora_rnk: 8\n")
    (tmp_path / "ddp.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FERRY_TESTS_EXEC", None)
    # relative paths: read from cwd; --accelerate-config logs a warning (no handler: logging's last resort prints it)
    cases = (["missing.yaml"], ["typo.yaml"], ["typo.yaml", "--accelerate-config", "ddp.yaml"])
    for args in (["train", *case] for case in cases):
        forked = fork_ferry(args, env=env, cwd=tmp_path)
        execd = subprocess.run(
            [sys.executable, "-m", "ferry", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert forked.returncode == execd.returncode != 0, (forked, execd)
        assert (forked.stdout, forked.stderr) == (execd.stdout, execd.stderr)
        assert forked.stderr.splitlines()[-1].startswith("ferry: error: ")
    assert "runs as DDP" in forked.stderr.splitlines()[0] and len(forked.stderr.splitlines()) == 2
    assert "missing.yaml" in fork_ferry(["train", "missing.yaml"], env=env, cwd=tmp_path).stderr
    assert "lora_rnk" in fork_ferry(["train", "typo.yaml"], env=env, cwd=tmp_path, offline=True).stderr


def _warn_and_log(args: list[str]) -> None:
    import logging
    import warnings

    warnings.warn("a python warning", UserWarning, stacklevel=1)
    logging.getLogger("transformers.modeling_utils").warning("a transformers record")
    logging.getLogger("ferry.somewhere").warning("a record with no handler")


def test_the_child_prints_what_a_fresh_process_prints_after_an_earlier_test_routed_the_libraries(tmp_path):
    earlier = tmp_path / "earlier" / "logs" / "ferry.log"
    route_library_output(earlier)  # an earlier in-process test left the libraries' output in its file
    try:
        child = fork_ferry([], env=dict(os.environ), cwd=tmp_path, entry=_warn_and_log)
    finally:
        unroute_library_output()
    assert child.returncode == 0, child.stderr
    lines = child.stderr.splitlines()
    assert any(line.endswith("UserWarning: a python warning") for line in lines), lines
    # transformers' own stderr handler prints it ("[transformers] ..." in 5.x), logging's last resort the other
    assert any(line.endswith("a transformers record") for line in lines) and "a record with no handler" in lines
    assert not earlier.exists() or "a python warning" not in earlier.read_text()


#: What huggingface_hub, datasets, transformers and nltk read from the environment when they are imported, printed
#: as JSON: by a forked child (:func:`_print_library_env` as its entry) and by an exec'd interpreter.
LIBRARY_ENV = """
import json
import datasets.config, huggingface_hub.constants as hub, nltk.data, torch, transformers.dynamic_module_utils as dyn
print(json.dumps({
    "hub": [hub.HF_HOME, hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE, hub.HF_TOKEN_PATH],
    "datasets": [datasets.config.HF_DATASETS_CACHE, datasets.config.HF_DATASETS_OFFLINE],
    "modules": dyn.HF_MODULES_CACHE,
    "nltk": nltk.data.path,
    "threads": torch.get_num_threads(),
}, default=str))
"""


def _print_library_env(args: list[str]) -> None:
    exec(LIBRARY_ENV, {})  # noqa: S102 - the same code an exec'd interpreter runs


def test_a_forked_child_reads_the_libraries_environment_as_an_execd_one(tmp_path):
    import datasets.config
    import huggingface_hub.constants
    import nltk.data
    import transformers.dynamic_module_utils  # noqa: F401 - imported here with this process's environment

    assert huggingface_hub.constants.HF_HOME != str(tmp_path / "hf") and nltk.data.path
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), NLTK_DATA=str(tmp_path / "nltk"))
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"))
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    forked = fork_ferry([], env=env, cwd=tmp_path, entry=_print_library_env)
    execd = subprocess.run([sys.executable, "-c", LIBRARY_ENV], env=env, capture_output=True, text=True, timeout=120)
    assert forked.returncode == execd.returncode == 0, (forked.stderr[-2000:], execd.stderr[-2000:])
    assert forked.stdout == execd.stdout
    assert str(tmp_path / "hf") in forked.stdout and str(tmp_path / "nltk") in forked.stdout
    assert datasets.config.HF_DATASETS_CACHE != tmp_path / "hf" / "datasets"  # this process's are its own


def test_a_forked_command_in_a_mount_namespace_sees_its_mounts_and_nothing_else_does(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "tmpfs").mkdir()
    setup = f"mount --bind {tmp_path}/ro {tmp_path}/ro && mount -o remount,bind,ro {tmp_path}/ro"
    setup += f" && mount -t tmpfs -o size=1m tmpfs {tmp_path}/tmpfs"
    code = f"""
import os, shutil
try:
    open("{tmp_path}/ro/x", "w")
except OSError as exc:
    print(exc.strerror)
print(shutil.disk_usage("{tmp_path}/tmpfs").total, os.getuid())
"""
    child = fork_ferry([], env=dict(os.environ), cwd=tmp_path, mount_setup=setup, entry=lambda args: exec(code, {}))
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["Read-only file system", f"{1024 * 1024} 0"]
    (tmp_path / "ro" / "x").write_text("writable out here")  # the mounts were the child's namespace's only
    assert shutil.disk_usage(tmp_path / "tmpfs").total > 1024 * 1024


def test_a_forked_command_does_not_outlive_a_test_stopped_while_it_waits(tmp_path):
    # pytest-timeout stops a test by raising in it from a SIGALRM handler: the command it waits for is killed too
    import signal
    import time

    from tests.support.helpers import start_ferry

    class Stopped(Exception):
        pass

    def stop(_signum: int, _frame: object) -> None:
        raise Stopped

    child = start_ferry([], env=dict(os.environ), cwd=tmp_path, entry=lambda _: time.sleep(600))
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Stopped):
            child.communicate(timeout=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert child.returncode == -signal.SIGKILL  # killed and reaped: no process is left behind
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)


def test_the_offline_namespace_has_only_loopback_up():
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            enter_offline_namespace()
            interfaces = sorted(name for _, name in socket.if_nameindex())
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=2).close()
                reached = True
            except OSError:
                reached = False
            with socket.create_server(("127.0.0.1", 0)) as server:  # loopback is up
                socket.create_connection(server.getsockname(), timeout=2).close()
            code = 0 if interfaces == ["lo"] and not reached else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.budget(60, reason="two one-process runs of one config, one of them exec'd (about 20 s on 2 loaded cores)")
def test_a_forked_plain_worker_trains_what_an_execd_one_trains(tmp_path, stories_model, llamafactory_data, monkeypatch):
    # `python -m trainer CONFIG` both ways on one config: same per-step losses and adapter bytes, the same one
    # summary line but for its timings, and the offline switches set in the child only
    import huggingface_hub.constants

    before = (huggingface_hub.constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"), torch.get_num_threads())
    runs, forked_runs, forks = {}, {}, []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    for how in ("forked", "execd"):
        work = tmp_path / how
        config = write_config(work / "c.yaml", tiny_config(stories_model, llamafactory_data, work, max_steps=3))
        monkeypatch.setenv("FERRY_TESTS_EXEC", "1" if how == "execd" else "0")  # run_plain_worker reads it here
        env = worker_env(work)
        forks_before = len(forks)
        stderr = run_plain_worker(config, env=env, cwd=work)
        forked_runs[how] = len(forks) - forks_before
        stderr = stderr.replace(str(work), "WORK")
        runs[how] = (train_losses(work / "out"), adapter_tensors(work / "out" / "adapter"), stderr)
    (f_losses, f_adapter, f_err), (e_losses, e_adapter, e_err) = runs["forked"], runs["execd"]
    assert len(f_losses) == 3 and f_losses == e_losses
    assert f_adapter.keys() == e_adapter.keys() and all(torch.equal(f_adapter[k], e_adapter[k]) for k in f_adapter)

    def without_figures(text):
        return [re.sub(r"[0-9.]+", "N", line) for line in text.splitlines()]

    assert without_figures(f_err) == without_figures(e_err) and f_err.startswith("ferry: trained 3 steps")
    assert forked_runs == {"forked": 1, "execd": 0}  # FERRY_TESTS_EXEC=1: an interpreter of its own (subprocess)
    after = (huggingface_hub.constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"), torch.get_num_threads())
    assert after == before


#: An interpreter that starts writes its command line here (``sitecustomize`` on the exec'd processes' PYTHONPATH);
#: a forked process starts none.
_RECORD_STARTS = (
    "import os, sys\n"
    "with open(os.environ['FERRY_TESTS_STARTS'], 'a') as f:\n"
    "    f.write(' '.join(sys.orig_argv) + '\\n')\n"
)


@pytest.mark.two_ranks
@pytest.mark.budget(120, reason="four 2-rank ferry train runs, two of them with an exec'd torchrun and workers")
def test_a_forked_torchrun_trains_and_fails_as_an_execd_one(tmp_path, stories_model, llamafactory_data):
    # a 2-rank `ferry train` from a forked launcher, its torchrun and workers forked (tests/support/forks.py)
    # and exec'd (FERRY_TESTS_EXEC_TORCHRUN=1): the same losses, adapter bytes and summary line; a worker SIGKILLed at
    # step 2 gives the same one line; the forked runs start no interpreter, the exec'd ones torchrun and two workers
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_RECORD_STARTS)
    runs = {}
    for how in ("forked", "execd"):
        for case in ("good", "killed"):
            work = tmp_path / how / case
            config = write_config(work / "c.yaml", tiny_config(stories_model, llamafactory_data, work, max_steps=3))
            starts = work / "starts.txt"
            env = worker_env(work, FERRY_TESTS_STARTS=str(starts), FERRY_TESTS_EXEC_TORCHRUN=str(int(how == "execd")))
            env["PYTHONPATH"] = str(tmp_path / "site") + os.pathsep + env["PYTHONPATH"]
            if case == "killed":
                env["FERRY_TEST_KILL_AT_STEP"] = "2"
            proc = fork_ferry(["train", str(config), "--nproc-per-node", "2"], env=env, cwd=work)
            started = starts.read_text().splitlines() if starts.exists() else []
            stderr = proc.stderr.replace(str(work), "WORK")
            runs[how, case] = (proc.returncode, stderr, started, work / "out")
    for case in ("good", "killed"):
        (f_code, f_err, f_started, f_out), (e_code, e_err, e_started, e_out) = runs["forked", case], runs["execd", case]
        assert f_started == [] and len(e_started) == 3, (f_started, e_started)
        assert sum("torch.distributed.run" in line for line in e_started) == 1
        assert f_code == e_code and (f_code == 0) == (case == "good"), (f_err, e_err)
        assert [re.sub(r"[0-9.]+", "N", line) for line in f_err.splitlines()] == [
            re.sub(r"[0-9.]+", "N", line) for line in e_err.splitlines()
        ]
    (_, good, _, f_out), (_, _, _, e_out) = runs["forked", "good"], runs["execd", "good"]
    assert good.startswith("ferry: trained 3 steps on 2 process(es)")
    assert len(train_losses(f_out)) == 3 and train_losses(f_out) == train_losses(e_out)
    f_adapter, e_adapter = adapter_tensors(f_out / "adapter"), adapter_tensors(e_out / "adapter")
    assert f_adapter.keys() == e_adapter.keys() and all(torch.equal(f_adapter[k], e_adapter[k]) for k in f_adapter)
    killed = runs["forked", "killed"][1]
    assert "a worker was killed (Signal 9 (SIGKILL)" in killed and killed.startswith("ferry: error:"), killed
