"""The suite's guard rails, as a pytest plugin (loaded by tests/conftest.py).

* **Durations file.** Every run writes one row per test phase to ``$FERRY_TEST_DURATIONS`` (default
  ``.test-durations.tsv`` in the checkout): ``nodeid``, ``when`` (setup, call, teardown), ``seconds``, ``outcome``,
  ``cpu_seconds`` (user + system CPU of the test's process and of the children it waited for: on a loaded machine
  the wall seconds of a phase include the other worker's load, its CPU seconds do not), and prints the files that
  cost most. ``python -m tests.support.suite FILE`` sums such a file by test file.
* **A budget per test.** A test's call phase may use :data:`DEFAULT_BUDGET_S` CPU seconds (its own and its waited
  children's: what it costs a suite that keeps both cores busy, and nearly the same on a loaded machine as on an
  idle one), or more when it carries ``@pytest.mark.budget(SECONDS, reason="...")``: the reason says why it may
  cost that much. Past its budget the summary names it; past :data:`FAIL_FACTOR` budgets it fails (the same call's
  CPU seconds differ by some percent between runs and machines). A call longer than :data:`WALL_FACTOR` budgets of
  wall time fails too (it waits: a sleep, a timeout, a child it never reaps). The budget also sets the hung-test
  timeout (pytest-timeout): :data:`DEFAULT_TIMEOUT_S`, or three budgets when that is more.
* **The whole run.** When the run took longer than :data:`SUITE_BUDGET_MIN` minutes, the summary says so in one line.
* **Three workers, two cores.** Under pytest-xdist (``-n 3``: a worker that waits on the network, a sleep or a
  timeout leaves its core to the other two), each test file is one unit of work (its module
  fixtures run once), or several files are one when :data:`SHARED_WORKER` says so; the costliest units start
  first (this machine's last runs, else :data:`COMMITTED_COSTS`); a test marked ``two_ranks`` (a 2-process
  torchrun job, or anything else that keeps both cores busy) holds a machine-wide lock, so no two of them run at
  once; torch gets one thread in each worker (and in a run without workers: the tests fork from it).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ferry.fsutil import atomic_write_text

#: CPU seconds a test's call phase may use without a ``budget`` marker (ini ``ferry_budget_s``).
DEFAULT_BUDGET_S = 20.0
#: A call phase fails at this many budgets of CPU seconds; between one budget and this many it passes and the summary
#: names it. The same call's CPU seconds differ between runs and machines: a test that stayed under 20 CPU-s in five
#: runs on this machine used 20.6 on CI's, and CI's runs took 15-20 % longer than this machine's.
FAIL_FACTOR = 1.5
#: A call phase may take this many budgets of wall time. A loaded machine stretches wall time, not CPU time: one
#: test used 12 CPU-s in 19.6 s on an idle run of this machine and took 37.2 s on CI's.
WALL_FACTOR = 3.0
#: Seconds after which pytest-timeout fails a test that carries no longer budget, setup, call and teardown together
#: (ini ``ferry_timeout_s``).
DEFAULT_TIMEOUT_S = 600.0
#: Minutes the whole pytest run should stay under on the 2-core machine (ini ``ferry_suite_budget_min``).
SUITE_BUDGET_MIN = 20.0
#: Folder of the machine-wide locks (one-time builds, the two-ranks lock).
LOCK_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry-tests" / "locks"


@contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Hold the machine-wide exclusive lock ``name`` (``fcntl.flock`` on ``LOCK_DIR/NAME.lock``) for the block:
    one holder at a time across every pytest process on this machine, released when the holder dies."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / f"{name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kept_build(folder: Path, stamp: str, build: Callable[[Path], None]) -> Path:
    """``folder`` (under :data:`LOCK_DIR`'s parent: kept per machine) as ``build(folder)`` made it: built now unless
    a finished build left its marker there, under the machine-wide lock named after the folder (two pytest runs
    never build it at once); a half-built folder is removed and built again. ``stamp``: the marker's text."""
    done = folder / ".ferry-tests-complete"
    with machine_lock(folder.name):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.write_text(stamp)
    return folder


def _ini(config: pytest.Config, name: str) -> float:
    return float(config.getini(name))


def budget_of(item: pytest.Item) -> float:
    """The CPU seconds ``item``'s call phase may use: its ``budget`` marker's, else the default budget."""
    mark = item.get_closest_marker("budget")
    return float(mark.args[0]) if mark else _ini(item.config, "ferry_budget_s")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "ferry_budget_s", "CPU seconds a test's call may use without a budget marker", default=str(DEFAULT_BUDGET_S)
    )
    parser.addini(
        "ferry_timeout_s", "seconds before a test without a long budget is stopped", default=str(DEFAULT_TIMEOUT_S)
    )
    parser.addini("ferry_suite_budget_min", "minutes the whole run should take at most", default=str(SUITE_BUDGET_MIN))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"budget(seconds, reason): the call phase may use SECONDS of CPU and {WALL_FACTOR:g} times that of wall time",
    )
    config.addinivalue_line(
        "markers", "two_ranks: keeps both cores busy (a 2-process torchrun job); never beside another such test"
    )
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) records and reports
        config.pluginmanager.register(Recorder(config), "ferry-suite-recorder")
    if "PYTEST_XDIST_WORKER" in os.environ or not hasattr(config, "workerinput"):  # a worker, or a run without one
        # One thread for torch in every process that runs tests, also under -n0: the tests fork commands from it,
        # and a child forked after GNU OpenMP's pool started hangs in its first parallel operator
        # (tests/support/helpers.py fork_ferry). Under -n 3 that is also each worker's share of the two cores.
        os.environ["OMP_NUM_THREADS"] = "1"  # what torch reads when it is imported later, and the children
        torch = sys.modules.get("torch")
        if torch is not None:  # imported already (by the suite's conftest): told directly
            torch.set_num_threads(1)


#: Test files that must run on one xdist worker because they assert on the same session fixture's runs, and the
#: name of their shared unit of work. (xdist's own ``xdist_group`` marker cannot group under pytest 9.2, whose node
#: ids it can no longer suffix, so the grouping is this table and :func:`pytest_xdist_make_scheduler`.)
SHARED_WORKER: dict[str, str] = {
    "tests/trainer/test_ddp.py": "equivalence-runs",  # the equivalence runs of tests/trainer/conftest.py
    "tests/trainer/test_fsdp.py": "equivalence-runs",
    "tests/trainer/test_multinode.py": "equivalence-runs",
    "tests/trainer/test_compile.py": "equivalence-runs",
}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: its file, or the shared unit :data:`SHARED_WORKER` names."""
    path = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(path, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """xdist's scope scheduling with :func:`work_unit` as the scope: a file (or a shared unit) goes whole to one
    worker, in the order of the collection (costliest first, see below), so its module fixtures run once."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("budget"):
            if not mark.args or not mark.kwargs.get("reason"):
                raise pytest.UsageError(f"{item.nodeid}: budget needs seconds and reason=")
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(max(_ini(config, "ferry_timeout_s"), 3 * budget_of(item))))
    # the most expensive groups first (what the last run on this machine measured), so that under xdist the long
    # ones do not start last and leave one worker idle; every worker reads the same history, so all collect the
    # same order. Within a group, the collection order stays.
    costs = _history()
    unit_cost: dict[str, float] = defaultdict(float)
    for path in {item.nodeid.split("::", 1)[0] for item in items}:
        unit_cost[work_unit(path)] += costs.get(path, 0.0)
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(work_unit(item.nodeid), index)
    items.sort(key=lambda item: (-unit_cost[work_unit(item.nodeid)], first[work_unit(item.nodeid)]))


#: Seconds per test file measured in a fresh clone on a fresh 2-core machine (caches cold, as CI's machine has them):
#: the order of a run on a machine with no history of its own. ``python -m tests.support.suite --save-costs FILE``
#: writes it from a durations file.
COMMITTED_COSTS = Path(__file__).with_name("file-costs.json")


def history_path() -> Path:
    """Seconds per test file from the runs on this machine (a JSON object), which orders the next run."""
    return LOCK_DIR.parent / "file-costs.json"


def _read_costs(path: Path) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _history() -> dict[str, float]:
    """This machine's costs over the committed ones (:data:`COMMITTED_COSTS`)."""
    return {**_read_costs(COMMITTED_COSTS), **_read_costs(history_path())}


def _costs_text(rows: list[tuple[str, str, float, str]], costs: dict[str, float]) -> str:
    costs = {**costs, **{name: round(seconds, 1) for name, seconds, _count in by_file(rows)}}
    return json.dumps(costs, indent=1, sort_keys=True) + "\n"


def _update_history(rows: list[tuple[str, str, float, str]]) -> None:
    text = _costs_text(rows, _read_costs(history_path()))
    history_path().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(history_path(), text)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """A ``two_ranks`` test holds the machine-wide lock through setup, call and teardown: the module fixtures that
    train (set up before the test, torn down after it) are covered too."""
    if item.get_closest_marker("two_ranks") is None:
        yield
        return
    with machine_lock("two-ranks"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if _PHASE_CPU in item.stash:  # the phase's CPU seconds travel with the report (xdist sends user_properties)
        report.user_properties.append(("cpu_seconds", round(cpu_seconds() - item.stash[_PHASE_CPU], 3)))
    if report.when != "call" or not report.passed:
        return
    budget = budget_of(item)
    report.user_properties.append(("budget", budget))
    used = dict(report.user_properties).get("cpu_seconds")
    if used is not None and used > FAIL_FACTOR * budget:
        what = f"used {used:.1f} CPU-s (its own and its children's), over {FAIL_FACTOR:g} times its budget of "
        what += f"{budget:g}"
    elif report.duration > WALL_FACTOR * budget:
        what = f"took {report.duration:.1f} s, over {WALL_FACTOR:g} times its budget of {budget:g} CPU-s"
    else:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"the test passed but {what}: make it cheaper, "
        f'or mark it @pytest.mark.budget(SECONDS, reason="why it needs that much") (docs/development.md)'
    )


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every child it has waited for (their own waited-for
    children included, as ``getrusage(RUSAGE_CHILDREN)`` counts them)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # type: ignore[no-untyped-def]
    item.stash[_PHASE_CPU] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    item.stash[_PHASE_CPU] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):  # type: ignore[no-untyped-def]
    item.stash[_PHASE_CPU] = cpu_seconds()
    yield


_PHASE_CPU = pytest.StashKey[float]()


def durations_path(config: pytest.Config) -> Path:
    """Where the run writes its durations file."""
    return Path(os.environ.get("FERRY_TEST_DURATIONS") or config.rootpath / ".test-durations.tsv")


def by_file(rows: list[tuple[str, str, float, str]]) -> list[tuple[str, float, int]]:
    """``(file, seconds, tests)`` per test file, most expensive first (every phase counted)."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    for nodeid, _when, duration, _outcome in rows:
        name = nodeid.split("::", 1)[0]
        seconds[name] += duration
        tests[name].add(nodeid)
    return sorted(((f, s, len(tests[f])) for f, s in seconds.items()), key=lambda r: -r[1])


class Recorder:
    """Collects every test phase's duration (under xdist, in the controller, which sees every worker's reports)
    and writes the durations file and the summary lines at the end of the run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.rows: list[tuple[str, str, float, str]] = []
        self.cpu: list[float | None] = []
        self.over: list[tuple[str, float, float]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.rows.append((report.nodeid, report.when, report.duration, report.outcome))
        properties = dict(report.user_properties)
        self.cpu.append(properties.get("cpu_seconds"))
        used, budget = properties.get("cpu_seconds"), properties.get("budget")
        if report.passed and used is not None and budget is not None and used > budget:
            self.over.append((report.nodeid, used, budget))

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        path = durations_path(self.config)
        header = "nodeid\twhen\tseconds\toutcome\tcpu_seconds\n"
        lines = (
            f"{n}\t{w}\t{d:.3f}\t{o}\t{'' if cpu is None else f'{cpu:.3f}'}\n"
            for (n, w, d, o), cpu in zip(self.rows, self.cpu)
        )
        atomic_write_text(path, header + "".join(lines))
        _update_history(self.rows)
        write = terminalreporter.write_line
        terminalreporter.section("cost by test file (seconds of setup, call and teardown)")
        for name, seconds, count in by_file(self.rows)[:15]:
            write(f"{seconds:8.1f} s  {count:4d} tests  {name}")
        cpu = sum(c for c in self.cpu if c is not None)
        write(f"durations of every test phase: {path} ({cpu:.0f} CPU-s of the tests and the children they waited for)")
        if self.over:
            terminalreporter.section(f"over their budget (passed; they fail at {FAIL_FACTOR:g} budgets)")
            for nodeid, used, budget in sorted(self.over, key=lambda row: row[2] - row[1]):
                write(f"{used:6.1f} CPU-s of {budget:g}  {nodeid}", yellow=True)
        minutes, limit = (time.monotonic() - self.started) / 60, _ini(self.config, "ferry_suite_budget_min")
        if minutes > limit:
            write(
                f"the tests took {minutes:.1f} min, over the suite's budget of {limit:g} min on 2 cores: "
                "read the costs above (docs/development.md)",
                red=True,
                bold=True,
            )


def main(argv: list[str]) -> int:
    """``python -m tests.support.suite [--save-costs] [FILE]``: a durations file summed by test file (wall seconds,
    share, CPU seconds where the file has them, tests); with ``--save-costs``, its costs per file written to
    :data:`COMMITTED_COSTS` instead (files the run did not reach keep their committed figure)."""
    save = "--save-costs" in argv
    argv = [a for a in argv if a != "--save-costs"]
    path = Path(argv[0]) if argv else Path(".test-durations.tsv")
    fields = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:]]
    rows = [(f[0], f[1], float(f[2]), f[3]) for f in fields]
    if save:
        atomic_write_text(COMMITTED_COSTS, _costs_text(rows, _read_costs(COMMITTED_COSTS)))
        print(f"wrote {COMMITTED_COSTS} ({len(by_file(rows))} files)")
        return 0
    cpu: dict[str, float] = defaultdict(float)
    for f in fields:
        if len(f) > 4 and f[4]:
            cpu[f[0].split("::", 1)[0]] += float(f[4])
    total = sum(r[2] for r in rows)
    for name, seconds, count in by_file(rows):
        cpu_text = f"{cpu[name]:8.1f} CPU-s" if name in cpu else " " * 14
        print(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {cpu_text}  {count:4d} tests  {name}")
    cpu_total = f", {sum(cpu.values()):.1f} CPU-s" if cpu else ""
    print(f"{total:8.1f} s{cpu_total} in all, {len({r[0] for r in rows})} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
