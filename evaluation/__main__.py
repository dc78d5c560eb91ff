"""``python -m evaluation CONFIG.json``: one rank of ``ferry eval --nproc-per-node N`` (evaluation/parallel.py)."""

from __future__ import annotations

import sys

from evaluation.run import run_worker

sys.exit(run_worker(sys.argv[1:]))
