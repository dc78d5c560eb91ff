"""``python -m evaluation CONFIG.json``: one rank of ``ferry eval --nproc-per-node N`` (evaluation/parallel.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ferry.errors import FerryError


def worker_main(config_path: str) -> int:
    """One rank: join the group (in run_eval), evaluate (rank 0 writes), leave the group. Returns the exit code."""
    import torch.distributed as dist

    from evaluation.config import EvalConfig
    from evaluation.run import run_eval

    config = EvalConfig.model_validate(json.loads(Path(config_path).read_text(encoding="utf-8")))
    run_eval(config)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    """Run one rank; a ferry error is one ``ferry: error:`` line (the launcher shows it) and its exit code."""
    try:
        return worker_main(argv[0])
    except FerryError as exc:
        print(f"ferry: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
