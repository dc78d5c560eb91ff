"""Run a command with no network at all: ``unshare -rn sh -c 'ip link set lo up; ...'``.

Intranet-side tests use :func:`run_offline` so that any hidden hub call fails loudly instead of silently
succeeding.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence


def run_offline(
    argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
    timeout: float = 900, check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a new user + network namespace with only loopback up. Returns the completed process
    (stdout and stderr captured as text). Raises ``AssertionError`` with both streams when ``check`` and the
    command failed."""
    inner = "ip link set lo up && exec " + " ".join(shlex.quote(str(a)) for a in argv)
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", inner], env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"offline command failed ({proc.returncode}): {' '.join(map(str, argv))}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc
