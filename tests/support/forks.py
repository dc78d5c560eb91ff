"""Python processes the suite starts many times, as forks of the pytest worker that has their libraries imported:
torchrun and its workers under a forked ``ferry train`` (:mod:`benchmarks.forked_torchrun`, shared with
``gpu_check --tiny``) and llama.cpp's converter (:func:`forked_converter_run`).

``FERRY_TESTS_EXEC=1`` execs everything (the launcher, torchrun, the workers, the converter);
``FERRY_TESTS_EXEC_TORCHRUN=1`` execs torchrun and its workers from a forked launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from benchmarks import forked_torchrun
from benchmarks.forked_torchrun import ForkedProcess, default_signals, exit_with, flush, fresh_streams, subprocess_with

__all__ = ["forked_converter_run", "install", "run_script", "subprocess_with"]


def install() -> None:
    """In a forked ``ferry train`` launcher: its torchrun and workers forked (:func:`benchmarks.forked_torchrun
    .install`), unless ``FERRY_TESTS_EXEC=1`` or ``FERRY_TESTS_EXEC_TORCHRUN=1``."""
    if "1" not in (os.environ.get("FERRY_TESTS_EXEC"), os.environ.get("FERRY_TESTS_EXEC_TORCHRUN")):
        forked_torchrun.install()


CONVERTER_SCRIPT = "convert_hf_to_gguf.py"


def forked_converter_run(cmd: Any, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for :mod:`exporter.gguf`: llama.cpp's converter (``python convert_hf_to_gguf.py ...``
    with ``env``, ``cwd`` and a log file for stdout and stderr, as ``exporter.gguf.convert`` runs it) forked
    (:func:`run_script`, its own ``gguf-py`` imported fresh), any other command the real ``run``."""
    converter = (
        isinstance(cmd, list)
        and len(cmd) > 1
        and cmd[0] == sys.executable
        and str(cmd[1]).endswith(CONVERTER_SCRIPT)
        and not args
        and kwargs.get("stderr") == subprocess.STDOUT
        and hasattr(kwargs.get("stdout"), "fileno")
        and set(kwargs) <= {"env", "stdout", "stderr", "cwd", "check"}
    )
    if not converter or os.environ.get("FERRY_TESTS_EXEC") == "1":
        return subprocess.run(cmd, *args, **kwargs)
    done = run_script(
        cmd, env=kwargs["env"], cwd=kwargs.get("cwd") or os.getcwd(), stdout=kwargs["stdout"], fresh_modules=("gguf",)
    )
    if kwargs.get("check"):
        done.check_returncode()
    return done


def run_script(
    cmd: list[str],
    *,
    env: dict[str, str],
    cwd: str | os.PathLike,
    stdout: Any,
    fresh_modules: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, SCRIPT, ARGS...], env=env, cwd=cwd, stdout=stdout,
    stderr=subprocess.STDOUT)`` as a fork of this process: ``SCRIPT`` run as ``python SCRIPT`` runs it (``runpy``,
    its folder first on ``sys.path``, ``__main__``), with this process's imports. ``fresh_modules``: packages
    removed from ``sys.modules`` in the child, for a script that puts its own copy of one first on the path
    (llama.cpp's converter and its ``gguf-py``)."""
    script, args = str(cmd[1]), [str(c) for c in cmd[2:]]
    out = stdout.fileno()
    flush()
    pid = os.fork()
    if pid == 0:

        def run() -> None:
            import runpy

            from tests.support.helpers import _as_a_fresh_process

            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # never the xdist worker's channel
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.setpgid(0, 0)
            default_signals()
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            fresh_streams(unbuffered=False)
            _as_a_fresh_process()
            for name in [m for m in sys.modules if m.split(".")[0] in fresh_modules]:
                del sys.modules[name]
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")

        exit_with(run)
    return subprocess.CompletedProcess(cmd, ForkedProcess(pid, cmd).wait())
