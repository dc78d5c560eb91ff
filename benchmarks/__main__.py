"""``python -m benchmarks [--quick] [NAME ...]``: run every ``benchmarks/bench_*.py`` (or those named) and print
one table of metric, ferry, peer, ratio, target."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path

COLUMNS = ("metric", "ferry", "peer", "ratio", "target")


def discover() -> list[str]:
    """Names of the benchmark modules (``bench_pack``, ...), sorted."""
    folder = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name.startswith("bench_"))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "-" if value is None else str(value)


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned plain-text table with the columns of :data:`COLUMNS`."""
    cells = [list(COLUMNS)] + [[_cell(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (each benchmark decides)")
    parser.add_argument("names", nargs="*", help="benchmark modules to run (default: all), e.g. bench_pack")
    args = parser.parse_args(argv)
    names = [n if n.startswith("bench_") else f"bench_{n}" for n in args.names] or discover()
    rows: list[dict] = []
    failed = False
    for name in names:
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            got = module.run(quick=args.quick)
        except Exception:  # one broken benchmark must not hide the others  # noqa: BLE001
            traceback.print_exc()
            rows.append({"metric": f"{name}: FAILED (traceback above)"})
            failed = True
            continue
        rows.extend(got)
        print(f"[{name}: {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    print(format_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
