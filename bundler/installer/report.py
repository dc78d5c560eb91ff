"""How the installer speaks: one line to stderr, an IntegrityError that lists every problem, progress in percent.

Standard library and ferry's foundation only (this module is part of the generated ``install.py``).
"""

from __future__ import annotations

import sys

from ferry.errors import IntegrityError
from ferry.fsutil import format_bytes


def integrity_error(problems: list[str], what: str) -> IntegrityError:
    """An IntegrityError whose message lists every problem (one per line); ``.problems`` holds the list."""
    shown = problems[:200]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    err = IntegrityError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(shown) + more)
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PercentProgress:
    """Prints ``label: NN% (X of Y)`` to stderr every 10 %: the stdlib stand-in for a progress bar."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.shown = -1

    def __call__(self, n: int) -> None:
        self.done += n
        step = min(100, self.done * 100 // self.total) // 10 * 10
        if step > self.shown:
            self.shown = step
            say(f"{self.label}: {step:3d}% ({format_bytes(self.done)} of {format_bytes(self.total)})")
