"""tests/support/helpers.py's ``fork_ferry``, which runs the suite's ``ferry train`` launchers as children forked
from pytest: a forked command answers exactly as an exec'd one, and its offline namespace has only loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from ferry.output import route_library_output, unroute_library_output
from tests.support.helpers import ROOT, fork_ferry
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
