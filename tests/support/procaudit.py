"""Where the suite's CPU goes, by kind of process: ``python -m tests.support.procaudit on|report|off``.

The suite is bound by CPU, and most of it is spent in the Python processes its tests start (ferry's launcher,
torchrun, training workers, lm-eval), not in pytest's own workers. ``on`` puts a ``.pth`` file into this venv's
site-packages, so every Python process of the venv writes one JSON line when it exits: its arguments, the test that
started it (``PYTEST_CURRENT_TEST``, inherited), its own CPU seconds and its waited children's. Training workers end
with ``os._exit`` and write nothing; their CPU is counted in torchrun's children. ``report`` sums the lines by kind
and by test file; ``off`` removes the ``.pth``. Meant for one measuring run, never left on::

    python -m tests.support.procaudit on && python -m pytest; python -m tests.support.procaudit off
    python -m tests.support.procaudit report
"""

from __future__ import annotations

import collections
import json
import os
import sys
import sysconfig
from pathlib import Path

#: Where each process writes its line (``$FERRY_PROCAUDIT_DIR`` moves it).
AUDIT_DIR = Path(os.environ.get("FERRY_PROCAUDIT_DIR", "/tmp/ferry-procaudit"))
PTH = Path(sysconfig.get_paths()["purelib"]) / "zz_ferry_procaudit.pth"

#: The hook the .pth runs at each interpreter start (one line: .pth files execute lines that start with "import").
#: ``site`` runs the line with ``exec`` inside a function, so its imports are that function's locals: the lambda
#: takes the modules it calls as default values, or it finds none of them when the process exits.
HOOK = (
    "import atexit, json, os, resource, sys, time; "
    "atexit.register(lambda t0=time.time(), d={dir!r}, json=json, os=os, resource=resource, sys=sys, time=time: "
    "os.path.isdir(d) and open(os.path.join(d, "
    "f'{{os.getpid()}}-{{int(t0 * 1e6)}}.json'), 'w').write(json.dumps(dict("
    "argv=(getattr(sys, 'orig_argv', None) or sys.argv)[:8], pid=os.getpid(), ppid=os.getppid(), "
    "test=os.environ.get('PYTEST_CURRENT_TEST'), wall=time.time() - t0, "
    "cpu=sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), "
    "children=sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])))))\n"
)


def kind(argv: list[str]) -> str:
    """A short name for a process from its arguments (``orig_argv``: the interpreter first)."""
    words = " ".join(argv[1:5])
    for needle, name in (
        ("exec(eval(sys.stdin.readline()))", "pytest worker"),  # execnet's bootstrap: how xdist starts a worker
        ("pytest", "pytest"),
        ("torch.distributed.run", "torchrun"),
        ("-m trainer", "training worker (plain)"),
        ("benchmarks.gpu_check", "gpu_check"),
        ("lm_eval", "lm-eval CLI"),
    ):
        if needle in words:
            return name
    if "-m ferry" in words or (argv and argv[0].endswith("/ferry")):
        rest = argv[argv.index("ferry") + 1 :] if "ferry" in argv else argv[1:]
        return "ferry " + (rest[0] if rest else "")
    return "other"


def report(folder: Path = AUDIT_DIR) -> str:
    """CPU seconds by kind of process and by test file, from the lines in ``folder``."""
    recs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    by_pid = {r["pid"]: r for r in recs}

    def test_file(r: dict, depth: int = 0) -> str:
        if r.get("test"):
            return r["test"].split("::")[0]
        parent = by_pid.get(r["ppid"])
        return test_file(parent, depth + 1) if parent and depth < 10 else "?"

    kinds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    for r in recs:
        name = kind(r["argv"])
        kinds[name] += r["cpu"]
        counts[name] += 1
        if name == "torchrun":  # its waited children are the training workers, which exit without a line
            kinds["training workers (torchrun's)"] += r["children"]
            counts["training workers (torchrun's)"] += 1
        if name != "pytest worker":
            files[test_file(r)] += r["cpu"] + (r["children"] if name == "torchrun" else 0)
    lines = [f"{sum(kinds.values()):8.0f} CPU-s in {len(recs)} processes that wrote a line", "", "by kind:"]
    lines += [f"{s:8.0f} s {counts[k]:5d} x  {k}" for k, s in kinds.most_common()]
    lines += ["", "by test file (the processes its tests started):"]
    lines += [f"{s:8.0f} s  {f}" for f, s in files.most_common(30)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "report"
    if command == "on":
        AUDIT_DIR.mkdir(parents=True, exist_ok=True)
        PTH.write_text(HOOK.format(dir=str(AUDIT_DIR)), encoding="utf-8")
        print(f"procaudit: on ({PTH}); lines go to {AUDIT_DIR}")
    elif command == "off":
        PTH.unlink(missing_ok=True)
        print("procaudit: off")
    elif command == "report":
        print(report())
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
