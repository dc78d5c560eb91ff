"""The suite's guard rails (tests/support/suite.py), run on small throwaway test files in a child pytest: a test
over its budget fails and the same test with a budget marker passes, a hung test is stopped, a run over the suite's
budget says so, and every run writes its durations file."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import ROOT

pytestmark = pytest.mark.budget(
    120, reason="child pytest runs, two of them on two xdist workers: 5-45 s each on a loaded 2-core machine"
)

SLOW = """
import time
import pytest

def test_slow_without_a_marker():
    time.sleep(0.6)

@pytest.mark.budget(5, reason="sleeps on purpose")
def test_slow_with_a_marker():
    time.sleep(0.6)

def test_quick():
    pass
"""

SPIN = """
import subprocess, sys, time

def _spin():
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass

def test_spins():
    _spin()

def test_spins_in_a_child():
    code = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)

def test_spins_a_little_over():
    end = time.process_time() + 0.18
    while time.process_time() < end:
        pass
"""


def _run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, addopts: str = "", **ini: str
) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("XDG_CACHE_HOME", str(pytester.path / "cache"))  # not this machine's file-cost history
    monkeypatch.delenv("FERRY_TEST_DURATIONS", raising=False)
    options = "".join(f"{key} = {value}\n" for key, value in ini.items())
    pytester.makeini(f"[pytest]\naddopts = -v -p tests.support.suite -p no:cacheprovider {addopts}\n{options}")
    pytester.makepyfile(test_guarded=source)
    return pytester.runpytest_subprocess()


def test_a_test_over_its_budget_fails_and_the_same_test_with_a_budget_marker_passes(pytester, monkeypatch):
    # the budget is CPU seconds; a test that waits fails at three budgets of wall time
    result = _run(pytester, monkeypatch, SLOW + SPIN, ferry_budget_s="0.15")
    result.assert_outcomes(passed=3, failed=3)
    result.stdout.fnmatch_lines(["*FAILED test_guarded.py::test_slow_without_a_marker*"])
    result.stdout.fnmatch_lines(["*took 0.6 s, over 3 times its budget of 0.15 CPU-s*@pytest.mark.budget(SECONDS, *"])
    # spinning in the test or in a child it waits for: the CPU counts, not the wall time
    result.stdout.fnmatch_lines(["*FAILED test_guarded.py::test_spins - *"])
    result.stdout.fnmatch_lines(["*FAILED test_guarded.py::test_spins_in_a_child*"])
    result.stdout.fnmatch_lines(["*used 0.* CPU-s (its own and its children's), over 1.5 times its budget of 0.15*"])
    # a little over its budget (the noise between runs and machines): it passes, and the summary names it
    result.stdout.fnmatch_lines(["*over their budget (passed; they fail at 1.5 budgets)*", "* 0.* CPU-s of 0.15  *"])
    over = result.stdout.str().split("over their budget", 1)[1].split("\n=", 1)[0]
    assert "test_spins_a_little_over" in over and "test_spins_in_a_child" not in over


def test_every_run_writes_its_durations_file_and_names_the_costly_files(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, SLOW + SPIN, ferry_budget_s="30")
    result.assert_outcomes(passed=6)
    rows = [line.split("\t") for line in (pytester.path / ".test-durations.tsv").read_text().splitlines()]
    assert rows[0] == ["nodeid", "when", "seconds", "outcome", "cpu_seconds"]
    phases = {(nodeid.split("::")[1], when): float(seconds) for nodeid, when, seconds, _, _ in rows[1:]}
    cpu = {(nodeid.split("::")[1], when): float(seconds) for nodeid, when, _, _, seconds in rows[1:]}
    assert len(phases) == 18  # six tests, three phases each
    assert phases[("test_slow_with_a_marker", "call")] >= 0.6 > phases[("test_quick", "call")]
    # sleeping costs no CPU; spinning for 0.6 s costs about as much CPU as wall time, the child it waited for too
    assert cpu[("test_slow_with_a_marker", "call")] < 0.3
    assert cpu[("test_spins", "call")] >= 0.4 and cpu[("test_spins_in_a_child", "call")] >= 0.4
    result.stdout.fnmatch_lines(["*cost by test file*", "* 6 tests  test_guarded.py", "*CPU-s of the tests*"])
    assert "over the suite's budget" not in result.stdout.str()
    # the machine's file costs, which order the next run's files (the most expensive first)
    history = json.loads((pytester.path / "cache" / "ferry-tests" / "file-costs.json").read_text())
    assert history["test_guarded.py"] >= 0.6


def test_a_run_over_the_suites_budget_says_so_in_one_line(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, SLOW, ferry_budget_s="30", ferry_suite_budget_min="0.001")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["the tests took * min, over the suite's budget of 0.001 min on 2 cores*"])


def test_a_hung_test_is_stopped_at_its_timeout_and_a_budget_without_a_reason_is_refused(pytester, monkeypatch):
    hung = "import time\n\ndef test_hangs():\n    time.sleep(120)\n"
    result = _run(pytester, monkeypatch, hung, ferry_timeout_s="2", ferry_budget_s="0.5")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout (>2.0s)*"])
    assert result.duration < 60
    unexplained = "import pytest\n\n@pytest.mark.budget(60)\ndef test_x():\n    pass\n"
    result = _run(pytester, monkeypatch, unexplained)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x: budget needs seconds and reason=*"])


def test_a_test_that_may_build_llama_cpp_gets_the_builds_time_on_its_timeout(pytester, monkeypatch):
    """On a machine without the llama.cpp build (this throwaway run's cache is empty), a test using the
    ``llama_cpp_build`` fixture (here a stand-in of the same name, so nothing is built), directly or through
    another fixture, may take the build's allowance more than its timeout; the others keep theirs."""
    from tests.support.llama_cpp_build import BUILD_TIMEOUT_S

    source = """
import pytest

@pytest.fixture
def llama_cpp_build():
    return None

@pytest.fixture
def through(llama_cpp_build):
    return llama_cpp_build

def _timeout(request):
    return request.node.get_closest_marker("timeout").args[0]

def test_builds(llama_cpp_build, request):
    assert _timeout(request) == 7 + BUILD

def test_builds_through_a_fixture(through, request):
    assert _timeout(request) == 7 + BUILD

def test_plain(request):
    assert _timeout(request) == 7
""".replace("BUILD", repr(BUILD_TIMEOUT_S))
    result = _run(
        pytester, monkeypatch, source, "-p tests.support.llama_cpp_build", ferry_timeout_s="7", ferry_budget_s="1"
    )
    result.assert_outcomes(passed=3)


def test_the_most_expensive_files_run_first_by_the_last_runs_costs(pytester, monkeypatch):
    (pytester.path / "cache" / "ferry-tests").mkdir(parents=True)
    (pytester.path / "cache" / "ferry-tests" / "file-costs.json").write_text('{"test_b.py": 50, "test_c.py": 9}')
    pytester.makepyfile(test_b="def test_b():\n    pass\n", test_c="def test_c():\n    pass\n")
    result = _run(pytester, monkeypatch, "def test_a():\n    pass\n")
    result.assert_outcomes(passed=3)
    order = [line.split()[0] for line in result.stdout.lines if line.endswith("%]") and " PASSED " in line]
    assert order == ["test_b.py::test_b", "test_c.py::test_c", "test_guarded.py::test_a"]


def test_two_ranks_tests_never_overlap_under_two_xdist_workers(pytester, monkeypatch):
    """Two files, each a module fixture and a test marked ``two_ranks`` that record when they ran and on which
    worker: on two xdist workers the files go to both workers, and the marked tests with their fixtures run one
    at a time."""
    source = """
import json, os, time
import pytest

def note(what):
    with open(os.environ["RANKS_LOG"], "a") as f:
        f.write(json.dumps([what, __name__, os.environ["PYTEST_XDIST_WORKER"], time.monotonic()]) + "\\n")

@pytest.fixture(scope="module")
def trained():
    note("start")
    time.sleep(1.0)
    yield
    note("end")

@pytest.mark.two_ranks
def test_ranks(trained):
    time.sleep(0.5)
"""
    monkeypatch.setenv("RANKS_LOG", str(pytester.path / "log.jsonl"))
    pytester.makepyfile(test_one=source, test_two=source)
    result = _run(pytester, monkeypatch, "def test_x():\n    pass\n", addopts="-n 2 --dist loadscope")
    result.assert_outcomes(passed=3)
    rows = [json.loads(line) for line in (pytester.path / "log.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len({worker for _, _, worker, _ in rows}) == 2, rows  # one file on each worker
    spans = sorted([at for _, m, _, at in rows if m == module] for module in ("test_one", "test_two"))
    assert spans[0][1] <= spans[1][0], f"the two_ranks tests overlapped: {rows}"


def test_each_file_runs_whole_on_one_worker_and_the_shared_runs_files_together(pytester, monkeypatch):
    """Under two xdist workers a file's tests all run on one worker (its module fixtures run once), and the files
    that assert on the shared equivalence runs are one unit of work."""
    from tests.support.suite import work_unit

    source = """
import os, pytest

@pytest.mark.parametrize("i", range(4))
def test_x(i):
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""
    monkeypatch.setenv("UNITS_LOG", str(pytester.path / "log.txt"))
    pytester.makepyfile(test_one=source, test_two=source)
    result = _run(pytester, monkeypatch, source, addopts="-n 2 --dist loadscope")
    result.assert_outcomes(passed=12)
    seen: dict[str, set[str]] = {}
    for line in (pytester.path / "log.txt").read_text().splitlines():
        module, worker = line.split()
        seen.setdefault(module, set()).add(worker)
    assert {module: len(workers) for module, workers in seen.items()} == {
        "test_guarded": 1,
        "test_one": 1,
        "test_two": 1,
    }
    assert len(set().union(*seen.values())) == 2  # and both workers had work
    shared = {work_unit(f"tests/trainer/{name}.py::test_x") for name in ("test_ddp", "test_fsdp", "test_multinode")}
    assert (
        shared == {"equivalence-runs"} and work_unit("tests/trainer/test_dpo.py::test_x") == "tests/trainer/test_dpo.py"
    )


def test_procaudit_writes_a_line_per_process_and_sums_them_by_kind_and_test_file(tmp_path):
    """tests/support/procaudit.py's hook (what its .pth runs at each interpreter start) writes one line when a
    process exits, naming the test that started it, with its own and its waited children's CPU; the report sums
    them by kind of process (torchrun's children as the training workers) and by test file."""
    import os
    import subprocess
    import sys

    from tests.support.procaudit import HOOK, kind, report

    spin = "import time; t = time.process_time(); [0 for _ in iter(lambda: time.process_time() - t > 0.3, True)]"
    site_dir, lines = tmp_path / "site", tmp_path / "lines"
    site_dir.mkdir()
    lines.mkdir()
    (site_dir / "zz_ferry_procaudit.pth").write_text(HOOK.format(dir=str(lines)))
    # the .pth read by site itself, as at an interpreter's start (site.addsitedir runs its import lines)
    code = f"import site; site.addsitedir({str(site_dir)!r}); import subprocess, sys; "
    code += f"subprocess.run([sys.executable, '-c', {spin!r}])"
    env = {**os.environ, "PYTEST_CURRENT_TEST": "tests/trainer/test_x.py::test_y (call)"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, capture_output=True, text=True)
    assert proc.stderr == ""  # nothing from the hook at exit
    (line,) = lines.glob("*.json")  # the child ran without the hook: only the parent wrote
    rec = json.loads(line.read_text())
    assert rec["test"] == "tests/trainer/test_x.py::test_y (call)" and rec["children"] >= 0.3 > rec["cpu"] - 0.3
    torchrun = dict(rec, pid=1, argv=[sys.executable, "-m", "torch.distributed.run", "-m", "trainer", "c.yaml"])
    (lines / "torchrun.json").write_text(json.dumps(torchrun))
    text = report(lines)
    assert "2 processes" in text and "torchrun" in text and "training worker" in text
    assert f"{rec['cpu'] * 2 + rec['children']:8.0f} s  tests/trainer/test_x.py" in text
    assert kind([sys.executable, "-m", "ferry", "train", "c.yaml"]) == "ferry train"
    assert kind(["/venv/bin/ferry", "export", "--adapter", "a"]) == "ferry export"
    assert kind([sys.executable, "-m", "lm_eval", "--model", "hf"]) == "lm-eval CLI"
    assert kind([sys.executable, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == "pytest worker"


def test_a_file_this_machine_never_ran_is_ordered_by_the_committed_costs(tmp_path, monkeypatch, capsys):
    from tests.support import suite

    committed = tmp_path / "file-costs.json"
    committed.write_text('{"tests/a.py": 5, "tests/b.py": 7}')
    monkeypatch.setattr(suite, "COMMITTED_COSTS", committed)
    monkeypatch.setattr(suite, "LOCK_DIR", tmp_path / "cache" / "ferry-tests" / "locks")
    (tmp_path / "cache" / "ferry-tests").mkdir(parents=True)
    (tmp_path / "cache" / "ferry-tests" / "file-costs.json").write_text('{"tests/b.py": 1}')
    assert suite._history() == {"tests/a.py": 5.0, "tests/b.py": 1.0}  # this machine's figure wins
    durations = tmp_path / "d.tsv"
    durations.write_text(
        "nodeid\twhen\tseconds\toutcome\ntests/c.py::t\tsetup\t2.5\tpassed\ntests/c.py::t\tcall\t1.0\tpassed\n"
    )
    assert suite.main(["--save-costs", str(durations)]) == 0
    assert json.loads(committed.read_text()) == {"tests/a.py": 5, "tests/b.py": 7, "tests/c.py": 3.5}
    assert capsys.readouterr().out.startswith(f"wrote {committed} (1 files)")
    # the summary by file: wall seconds, share, and the CPU seconds where the file has that column
    durations.write_text(
        "nodeid\twhen\tseconds\toutcome\tcpu_seconds\n"
        "tests/c.py::t\tsetup\t2.5\tpassed\t2.0\ntests/c.py::t\tcall\t1.5\tpassed\t0.5\n"
        "tests/d.py::t\tcall\t1.0\tpassed\t\n"
    )
    assert suite.main([str(durations)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "     4.0 s   80.0 %       2.5 CPU-s     1 tests  tests/c.py",
        "     1.0 s   20.0 %                     1 tests  tests/d.py",
        "     5.0 s, 2.5 CPU-s in all, 2 tests",
    ]
