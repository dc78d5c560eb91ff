"""Deterministic kill points for the fault-injection tests (standard library only; part of ``install.py``).

``FERRY_TEST_KILL_AT=NAME`` makes the process SIGKILL itself the first time it reaches :func:`kill_point` with that
name, ``NAME#N`` the N-th time (a point inside a loop). Nothing else reads the variable; unset, a kill point costs
one dictionary look-up. The names are the phases of a command that writes, e.g. ``install:swap-in`` (a replaced
folder's new content just went into place) or ``install:state`` (the install record was just written); the tests
that use them (tests/faults/) list every one and prove the earlier state intact after each.
"""

from __future__ import annotations

import os
import signal

#: The variable that names the kill point (``NAME`` or ``NAME#N``).
KILL_AT_ENV = "FERRY_TEST_KILL_AT"

_reached: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL this process when :data:`KILL_AT_ENV` names this point (see the module docstring)."""
    wanted = os.environ.get(KILL_AT_ENV)
    if not wanted or wanted.split("#")[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if wanted == name or wanted == f"{name}#{_reached[name]}":
        os.kill(os.getpid(), signal.SIGKILL)
