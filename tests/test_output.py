"""ferry/output.py: the libraries' warnings and records go to the log file, not the terminal; progress off a
terminal is plain lines. Run in a fresh interpreter each (the routing changes process-wide logging)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys, warnings
from pathlib import Path
from ferry.output import route_library_output, ProgressLines
log = route_library_output(Path(sys.argv[1]))
import transformers
from transformers.utils import logging as tlog
tlog.get_logger("transformers.modeling_utils").warning("Loading weights: a library line")
warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
import logging
logging.getLogger("peft.tuners").warning("rank_pattern keys did not match")
lines = ProgressLines("ferry: train", 4)
for step in (1, 2, 4):
    lines.line(step, loss=f"{1.23456789:.4f}")
print("ferry: done", log)
"""


def _run(tmp_path: Path, verbose: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FERRY_VERBOSE", None)
    if verbose:
        env["FERRY_VERBOSE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs" / "lib.log")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_library_output_goes_to_the_log_and_progress_is_lines(tmp_path: Path) -> None:
    proc = _run(tmp_path, verbose=False)
    shown = proc.stdout + proc.stderr
    for library_line in ("Loading weights", "FutureWarning", "is_gradient_checkpointing", "rank_pattern"):
        assert library_line not in shown, shown
    assert "\r" not in shown
    assert proc.stderr.splitlines() == [
        "ferry: train step 1/4 (25%), loss 1.2346",
        "ferry: train step 2/4 (50%), loss 1.2346",
        "ferry: train step 4/4 (100%), loss 1.2346",
    ]
    kept = (tmp_path / "logs" / "lib.log").read_text()
    for library_line in ("Loading weights", "FutureWarning", "rank_pattern"):
        assert library_line in kept, kept


def test_verbose_leaves_the_library_output_on_the_terminal(tmp_path: Path) -> None:
    proc = _run(tmp_path, verbose=True)
    assert "Loading weights" in proc.stderr and "FutureWarning" in proc.stderr
    assert not (tmp_path / "logs").exists()


UNROUTE = r"""
import sys, warnings, logging
from pathlib import Path
from ferry.output import route_library_output, unroute_library_output
route_library_output(Path(sys.argv[1]))
import transformers
from transformers.utils import logging as tlog
tlog.get_logger("transformers.modeling_utils").warning("routed: a library line")
unroute_library_output()
tlog.get_logger("transformers.modeling_utils").warning("unrouted: a library line")
warnings.warn("unrouted: a python warning", FutureWarning)
logging.getLogger("peft.tuners").warning("unrouted: a peft line")
"""


def test_unrouting_gives_the_library_output_back_to_the_terminal(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FERRY_VERBOSE", None)
    log = tmp_path / "logs" / "lib.log"
    proc = subprocess.run(
        [sys.executable, "-c", UNROUTE, str(log)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert "routed: a library line" in log.read_text() and "unrouted" not in log.read_text()
    assert "routed: a library line" not in proc.stderr.replace("unrouted: a library line", "")
    for line in ("unrouted: a library line", "FutureWarning: unrouted: a python warning", "unrouted: a peft line"):
        assert line in proc.stderr, proc.stderr


HELD = r"""
import sys
from pathlib import Path
from ferry.output import drop_library_handlers, release_library_output, route_library_output
route_library_output(Path(sys.argv[1]), held=True)
import datasets  # gives its logger a stderr handler of its own on import
drop_library_handlers()
from datasets.utils import logging as dlog
dlog.get_logger("datasets.packaged_modules.json").error("held: a datasets line")
print(Path(sys.argv[1]).exists(), flush=True)
release_library_output()
dlog.get_logger("datasets.packaged_modules.json").error("released: a datasets line")
"""


def test_held_records_wait_for_the_release_and_datasets_own_handler_is_dropped(tmp_path: Path) -> None:
    """What `ferry train`'s launcher does: records held in memory while the run may still be refused (nothing in
    output_dir), written in order once it starts; `datasets`' stderr handler never shows them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FERRY_VERBOSE", None)
    log = tmp_path / "logs" / "lib.log"
    proc = subprocess.run(
        [sys.executable, "-c", HELD, str(log)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "False" and proc.stderr == ""
    kept = log.read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in kept] == ["held: a datasets line", "released: a datasets line"]
