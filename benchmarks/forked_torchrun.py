"""torchrun and its training workers as forks of a ``ferry train`` launcher that was itself forked from a process
with torch, transformers and peft imported: the suite's launchers (``tests.support.helpers.fork_ferry``) and the CPU
checks of ``python -m benchmarks.gpu_check --tiny``. On a GPU nothing here is used: every process is exec'd.

A forked ``ferry train`` launcher starts torchrun as
``python -m torch.distributed.run ... -m trainer CONFIG`` (a ``ferry eval`` on several ranks: ``-m evaluation
CONFIG.json``). Exec'd, torchrun's agent imports torch (about 4 CPU-s on the 2-core machine) and each worker imports
torch, transformers and peft again (about 7 CPU-s): with some 70 training runs and 120 workers, most of the suite's
work. :func:`install` (called in each forked launcher) makes
that one command start as a fork of the launcher instead, which has those libraries imported already:

- **torchrun's agent** is forked with the environment, stderr pipe and process group an exec'd one would have, and
  runs ``torch.distributed.run`` as ``python -m`` does (``runpy``): its argument parsing, rendezvous, elastic
  agent, restarts, error files and failure report are torch's own code, unchanged.
- **each worker** is forked by that agent where torch's ``SubprocessHandler`` would ``Popen`` it
  (``SubprocessHandler._popen``, the one place torch execs a worker): its own session as ``Popen(...,
  start_new_session=True)`` gives it (torch closes a worker with ``killpg``), torch's per-worker environment, its
  redirected stdout / stderr where torchrun gives files, Python's default signal handlers, and what an exec'd
  ``python -m trainer`` does before ``main`` (:func:`worker_main`). torch forks
  workers from the same agent itself when an entrypoint is a function (``start_method="fork"``).

Only that command is forked; every other subprocess of the launcher starts as before. ``tests/test_fork_ferry.py``
proves a forked and an exec'd torchrun train the same losses and adapter bytes on two ranks, and report a failing
worker in the same line.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
import traceback
import types
from typing import Any

TORCHRUN_MODULE = "torch.distributed.run"
WORKER_MODULE = "trainer"
#: The modules torchrun runs as workers (``-m MODULE``) that are forked: a training worker and a ``ferry eval`` rank.
WORKER_MODULES = (WORKER_MODULE, "evaluation")
#: The modules whose ``subprocess.Popen`` of torchrun :func:`install` forks: ``ferry train``'s and ``ferry eval``'s.
LAUNCHER_MODULES = ("trainer.launch", "evaluation.parallel")


class ForkedProcess:
    """A forked child as ``subprocess.Popen`` shows one to its callers: ``pid``, ``returncode``, ``poll``,
    ``wait(timeout)`` (raises ``subprocess.TimeoutExpired``), ``send_signal`` / ``terminate`` / ``kill`` and, for a
    piped stderr, ``stderr`` (a binary reader)."""

    def __init__(self, pid: int, args: list[str], stderr: Any = None) -> None:
        self.pid, self.args, self.stderr = pid, args, stderr
        self.stdin = self.stdout = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                with contextlib.suppress(InterruptedError):
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _module_after_m(cmd: list[str] | tuple[str, ...]) -> str | None:
    """``MODULE`` of ``python [-u] -m MODULE ...`` run by this interpreter, else None."""
    cmd = [str(c) for c in cmd]
    if not cmd or cmd[0] != sys.executable or "-m" not in cmd[1:3]:
        return None
    at = cmd.index("-m", 1)
    return cmd[at + 1] if at + 1 < len(cmd) else None


def default_signals() -> None:
    """Python's handlers of a fresh interpreter: SIGINT raises KeyboardInterrupt, the others the system's."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start


def exit_with(run: Any) -> None:
    """Run ``run()`` as a process's whole life: its ``SystemExit`` status (an uncaught exception: traceback and 1),
    the standard streams flushed, then ``os._exit`` (no exit handlers of the process it was forked from)."""
    code = 1
    try:
        run()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a Python process: traceback, status 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def flush() -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def fresh_streams(unbuffered: bool) -> None:
    """``sys.stdout`` / ``sys.stderr`` on fds 1 and 2, as a fresh interpreter opens them (``-u``: written
    through), and every logging stream handler that wrote to the old objects bound to the new ones."""
    import logging

    old = {id(sys.stdout): 1, id(sys.stderr): 2}
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=unbuffered
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=True
    )
    new = {1: sys.stdout, 2: sys.stderr}
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in (x for x in loggers if isinstance(x, logging.Logger)):
        for handler in logger.handlers:
            fd = old.get(id(getattr(handler, "stream", None)))
            if isinstance(handler, logging.StreamHandler) and fd and "stream" in vars(handler):  # not lastResort
                handler.setStream(new[fd])


def fresh_process_state() -> None:
    """Logging and warnings as a fresh interpreter has them: no handler on the root logger (a record with no handler
    of its own reaches stderr through logging's last resort), the libraries' output not routed to a file that the
    process forked from chose (:func:`ferry.output.unroute_library_output`), Python's default warning filters and
    functions (where a ``catch_warnings(record=True)`` put a recorder)."""
    import importlib
    import logging
    import warnings

    from ferry.output import unroute_library_output

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    unroute_library_output()  # also ends logging.captureWarnings, before warnings' own functions come back
    importlib.reload(warnings)
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)  # each goes first: Python's default list, built backwards
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def fresh_library_env() -> None:
    """What the libraries read from the environment when they are imported, read again from this process's
    ``os.environ`` (replaced after the fork): huggingface_hub's constants (``HF_HOME``, the hub cache, the offline
    switch), ``datasets.config`` (its cache ``HF_DATASETS_CACHE``, its offline switch), transformers' folder of
    remote code (``HF_MODULES_CACHE``), nltk's data search path (``NLTK_DATA``, ``~/nltk_data``) and torch's intra-op
    thread count (``OMP_NUM_THREADS``, where it is set). Modules that are
    not imported are left alone: they read the environment when they are. The two reloaded modules hold constants
    only, so reloading them leaves no second class behind; nltk's path is computed by a throwaway copy of
    ``nltk.data`` and put into the list nltk searches."""
    import importlib

    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        importlib.reload(hub)
        manager = sys.modules.get("huggingface_hub.utils._cache_manager")
        if manager is not None:
            manager.HF_HUB_CACHE = hub.HF_HUB_CACHE  # type: ignore[attr-defined]
    if "datasets.config" in sys.modules:
        importlib.reload(sys.modules["datasets.config"])
    nltk_data = sys.modules.get("nltk.data")
    if nltk_data is not None:  # its search path, built at import from NLTK_DATA and HOME: nltk's own code, run again
        import importlib.util

        spec = importlib.util.spec_from_file_location("_fresh_nltk_data", nltk_data.__file__)
        if spec is not None and spec.loader is not None:
            fresh = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(fresh)  # a throwaway copy: nltk.data itself and its classes stay
            nltk_data.path[:] = fresh.path
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch's intra-op threads
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if hub is not None:
        modules = os.environ.get("HF_MODULES_CACHE") or os.path.join(hub.HF_HOME, "modules")
        for name in ("transformers.utils.hub", "transformers.utils", "transformers.dynamic_module_utils"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "HF_MODULES_CACHE"):
                module.HF_MODULES_CACHE = modules  # type: ignore[attr-defined]


def worker_main(args: list[str], module: str = WORKER_MODULE) -> None:
    """``python -m MODULE ARGS`` (a training worker, ``trainer``, or a ``ferry eval`` rank, ``evaluation``) in a
    forked child whose environment is already the worker's: what an exec'd interpreter does before the module's
    ``main`` and the process it was forked from may not have done, then the worker itself.

    - ``apply_offline_env()``, as ``trainer/__main__.py`` runs it at import (the module may be imported already);
    - the libraries' import-time reading of the environment (:func:`fresh_library_env`): huggingface_hub's offline
      switch (transformers asks it whether it is offline), torch's threads from ``OMP_NUM_THREADS``, the caches.
    """
    import importlib

    from ferry.constants import apply_offline_env

    apply_offline_env()  # HF_HUB_OFFLINE=1 among them: read by huggingface_hub's reloaded constants below
    fresh_library_env()
    if module == "evaluation":  # evaluation/__main__.py: sys.exit(run_worker(argv))
        from evaluation.run import run_worker

        sys.exit(run_worker(list(args)))
    worker = importlib.import_module("trainer.__main__")
    sys.exit(worker.main(list(args)))


def _worker_popen(handler: Any, args: tuple, env: dict[str, str]) -> Any:
    """``SubprocessHandler._popen`` for ``python -u -m trainer ...`` (or ``-m evaluation``): the worker forked from
    this agent."""
    module = _module_after_m(args)
    if module not in WORKER_MODULES:
        return _ORIGINAL_POPEN(handler, args, env)
    argv = [str(a) for a in args]
    worker_args = argv[argv.index("-m", 1) + 2 :]
    out = handler._stdout.fileno() if handler._stdout else None
    err = handler._stderr.fileno() if handler._stderr else None
    flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()  # Popen(start_new_session=True): torch closes a worker with killpg
        if out is not None:
            os.dup2(out, 1)
        if err is not None:
            os.dup2(err, 2)
        default_signals()
        os.environ.clear()
        os.environ.update(env)
        fresh_streams(unbuffered="-u" in argv[1 : argv.index("-m", 1)])
        fresh_process_state()
        sys.argv = [str(module), *worker_args]
        exit_with(lambda: worker_main(worker_args, str(module)))
    return ForkedProcess(pid, argv)


_ORIGINAL_POPEN: Any = None


def _agent_main(argv: list[str], env: dict[str, str]) -> None:
    """The forked torchrun: ``python -m torch.distributed.run ARGV`` with its workers forked (:func:`_worker_popen`)."""
    import runpy

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    global _ORIGINAL_POPEN
    default_signals()
    os.environ.clear()
    os.environ.update(env)
    fresh_streams(unbuffered=env.get("PYTHONUNBUFFERED", "") not in ("", "0"))
    _ORIGINAL_POPEN = subprocess_handler.SubprocessHandler._popen
    subprocess_handler.SubprocessHandler._popen = _worker_popen  # type: ignore[method-assign]
    sys.argv = [TORCHRUN_MODULE, *argv]
    exit_with(lambda: runpy.run_module(TORCHRUN_MODULE, run_name="__main__", alter_sys=True))


def popen(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
    """``subprocess.Popen`` for the launcher: ``python -m torch.distributed.run ...`` forked (:func:`_agent_main`,
    ``env`` and a piped or inherited stderr as given), any other command the real ``Popen``."""
    if args or _module_after_m(cmd) != TORCHRUN_MODULE or set(kwargs) - {"env", "stderr"}:
        return subprocess.Popen(cmd, *args, **kwargs)
    env = dict(kwargs.get("env") or os.environ)
    piped = kwargs.get("stderr") == subprocess.PIPE
    read, write = os.pipe() if piped else (None, None)
    flush()
    pid = os.fork()
    if pid == 0:
        if piped:
            os.close(read)  # type: ignore[arg-type]
            os.dup2(write, 2)  # type: ignore[arg-type]
            os.close(write)  # type: ignore[arg-type]
        _agent_main([str(c) for c in cmd[3:]], env)
    if piped:
        os.close(write)  # type: ignore[arg-type]
    return ForkedProcess(pid, [str(c) for c in cmd], stderr=os.fdopen(read, "rb") if piped else None)


def install() -> None:
    """In a forked ``ferry train`` or ``ferry eval`` launcher: its torchrun (the one ``subprocess.Popen`` of
    ``trainer.launch`` and of ``evaluation.parallel``) forked, as above."""
    import importlib

    for name in LAUNCHER_MODULES:  # the modules (``trainer.launch`` is also a function's name)
        launcher = importlib.import_module(name)
        launcher.subprocess = subprocess_with(Popen=popen)  # type: ignore[attr-defined]


def subprocess_with(**functions: Any) -> types.ModuleType:
    """A copy of the ``subprocess`` module with ``functions`` in place of its own, to put in one module's
    namespace (``module.subprocess``) so that only that module's calls change."""
    copy = types.ModuleType("subprocess")
    copy.__dict__.update(subprocess.__dict__)
    copy.__dict__.update(functions)
    return copy
