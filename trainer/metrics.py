"""What rank 0 writes about a run while it trains: metrics.jsonl, TensorBoard events, progress, loss.png.

::

    output_dir/
    ├── metrics.jsonl     one JSON object a line: {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_second",
    │                     "tokens_seen", "elapsed_s"} per logged step, {"step", "eval_loss", "eval_perplexity",
    │                     "eval_tokens"} per evaluation
    ├── runs/RUN_NAME/    TensorBoard events of the same numbers (report_to: tensorboard): train/KEY, eval/KEY
    └── loss.png          train and eval loss against step, drawn at the end (when matplotlib is installed)

The progress shows as a tqdm bar on a terminal, else as one line per logged step (:class:`ferry.output.ProgressLines`);
``disable_tqdm`` turns both off. Only rank 0 holds a :class:`MetricLogger` that writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ferry.fsutil import atomic_write_text

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


class MetricLogger:
    """Rank 0's metrics of a run in ``output_dir`` (see the module docstring for the layout).

    Use: :meth:`truncate` when the run's position is known (before :meth:`open`), :meth:`open` when training
    starts, :meth:`write` per row, :meth:`advance` and :meth:`show` per step, :meth:`finish` at the end and
    :meth:`close` in any case.
    """

    def __init__(self, output_dir: Path) -> None:
        self.out = Path(output_dir)
        self.path = self.out / METRICS_FILE
        self._pbar: Any = None  # tqdm bar on a terminal
        self._lines: Any = None  # ferry.output.ProgressLines off a terminal
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter with report_to: tensorboard

    def truncate(self, step: int) -> None:
        """Keep only the rows up to ``step``: rows a crashed attempt wrote after its last checkpoint (or all of
        them, when starting at step 0) would otherwise appear twice."""
        if not self.path.is_file():
            return
        keep = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))

    def open(
        self, *, total_steps: int, initial_step: int, disable_tqdm: bool, report_to: str, run_name: str | None
    ) -> None:
        """Start the progress display at ``initial_step`` of ``total_steps`` and, with ``report_to:
        tensorboard``, the event writer (one line and none when tensorboard is not installed)."""
        from tqdm.auto import tqdm

        from ferry.output import ProgressLines, progress_is_live  # no redraws off a terminal

        live = progress_is_live()
        self._lines = None if live or disable_tqdm else ProgressLines("ferry: train", total_steps)
        self._pbar = tqdm(
            total=total_steps,
            initial=initial_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=disable_tqdm or not live,
            file=sys.stderr,
        )
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._pbar.write("ferry: tensorboard is not installed; report_to: tensorboard ignored")
            else:
                self._tb = SummaryWriter(log_dir=str(self.out / "runs" / (run_name or "train")))

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` (a ``step`` key plus numbers) to metrics.jsonl and its finite numbers to TensorBoard
        (``eval_X`` as ``eval/X``, the rest as ``train/KEY``)."""
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = key.replace("eval_", "eval/") if key.startswith("eval_") else f"train/{key}"
                    self._tb.add_scalar(tag, value, row["step"])

    def advance(self) -> None:
        """One optimizer step done (the bar moves)."""
        if self._pbar is not None:
            self._pbar.update(1)

    def show(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        """A logged step on the bar (its postfix) or as a progress line."""
        if self._pbar is not None:
            self._pbar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
        if self._lines is not None:
            self._lines.line(step, loss=f"{loss:.4f}", lr=f"{lr:.2e}", tokens_per_s=f"{tokens_per_s:.0f}")

    def close_progress(self) -> None:
        """Close the bar (training is over; the final evaluation and the save follow)."""
        if self._pbar is not None:
            self._pbar.close()

    def finish(self, plot_loss: bool = False) -> None:
        """Draw loss.png when ``plot_loss`` (LLaMA-Factory's key of that name) and close the TensorBoard writer."""
        if plot_loss:
            self.plot_loss()
        if self._tb is not None:
            self._tb.close()

    def close(self) -> None:
        """Close the bar (also after a failure)."""
        self.close_progress()

    def plot_loss(self) -> None:
        """``loss.png``: train (and eval) loss against step, from metrics.jsonl; without matplotlib, one line on
        stderr instead."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"ferry: plot_loss: matplotlib is not installed, so no {LOSS_PLOT} is drawn", file=sys.stderr)
            return
        rows = [json.loads(x) for x in self.path.read_text(encoding="utf-8").splitlines() if x]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        fig, ax = plt.subplots(figsize=(6, 4))
        if train:
            ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), marker="o", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        fig.tight_layout()
        tmp = self.out / f".{LOSS_PLOT}.tmp"
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, self.out / LOSS_PLOT)


__all__ = ["LOSS_PLOT", "METRICS_FILE", "MetricLogger"]
