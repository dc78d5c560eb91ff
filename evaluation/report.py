"""The side-by-side comparison of two lm-eval results and the regression gate.

:func:`compare` reads the ``results`` / ``higher_is_better`` sections of lm-eval's results dictionaries (as
``lm_eval.simple_evaluate`` returns them) into :class:`Row` s, one per task and metric; :class:`EvalReport` prints
them as a table, writes them as JSON and markdown, and names the metrics the gate refuses. Nothing here imports
lm-eval.

A metric key in lm-eval's results is ``NAME,FILTER`` (``acc,none``, ``exact_match,strict-match``) with its
standard error under ``NAME_stderr,FILTER``; a row shows ``NAME`` alone when the filter is ``none``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ferry.errors import RegressionError


@dataclass(frozen=True)
class Row:
    """One task's metric: the base's value, the tuned model's (None without an adapter), and its direction."""

    task: str
    metric: str
    base: float
    tuned: float | None
    stderr: float | None
    higher_is_better: bool

    @property
    def difference(self) -> float | None:
        """tuned - base (None without a tuned model)."""
        return None if self.tuned is None else self.tuned - self.base

    @property
    def drop(self) -> float | None:
        """How much worse the tuned model is (negative: better), in the metric's own direction."""
        diff = self.difference
        if diff is None:
            return None
        return -diff if self.higher_is_better else diff


@dataclass
class EvalReport:
    """What ``ferry eval`` found: the rows, the files written, and the gate's verdicts."""

    rows: list[Row]
    files: dict[str, str] = field(default_factory=dict)
    #: one sentence per (task, metric) that fell by more than its max_drop, in row order
    regressions: list[str] = field(default_factory=list)
    #: each task's version as lm-eval reports it (its YAML's ``metadata.version``)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def has_tuned(self) -> bool:
        return any(row.tuned is not None for row in self.rows)

    def table(self) -> str:
        """The rows as an aligned text table (task, metric, base, tuned, difference, stderr)."""
        header = _header(self.has_tuned)
        lines = [header] + [_cells(row, self.has_tuned) for row in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)

    def markdown(self) -> str:
        """The rows as a markdown table, then the gate's verdict."""
        header = _header(self.has_tuned)
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(_cells(row, self.has_tuned)) + " |" for row in self.rows]
        out += ["", *(f"- regression: {r}" for r in self.regressions)] if self.regressions else []
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict[str, Any]:
        rows = [asdict(row) | {"difference": row.difference} for row in self.rows]
        return {"rows": rows, "regressions": self.regressions, "versions": self.versions, "files": self.files}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> EvalReport:
        """The report :meth:`to_json` wrote (``report.json``)."""
        data = json.loads(text)
        fields = ("task", "metric", "base", "tuned", "stderr", "higher_is_better")
        rows = [Row(**{k: row[k] for k in fields}) for row in data["rows"]]
        return cls(
            rows=rows,
            files=dict(data.get("files", {})),
            regressions=list(data.get("regressions", [])),
            versions=dict(data.get("versions", {})),
        )

    def raise_for_regressions(self) -> None:
        """Raises:
        RegressionError: one line naming every task and metric the gate refused."""
        if self.regressions:
            raise RegressionError("; ".join(self.regressions))


def task_versions(results: dict[str, Any]) -> dict[str, str]:
    """``{task: version}`` from an lm-eval results dictionary's ``versions`` (as strings: lm-eval writes floats)."""
    return {str(task): str(version) for task, version in (results.get("versions") or {}).items()}


def _number(value: Any) -> float | None:
    """A metric value as a float; None for lm-eval's ``"N/A"`` and other non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _header(with_tuned: bool) -> list[str]:
    return (
        ["task", "metric", "base", "tuned", "diff", "stderr"] if with_tuned else ["task", "metric", "value", "stderr"]
    )


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _cells(row: Row, with_tuned: bool) -> list[str]:
    if not with_tuned:
        return [row.task, row.metric, _fmt(row.base), _fmt(row.stderr)]
    return [row.task, row.metric, _fmt(row.base), _fmt(row.tuned), _fmt(row.difference, True), _fmt(row.stderr)]


def metrics_of(results: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float | None]]:
    """``(task, metric) -> (value, stderr)`` for every numeric metric in an lm-eval results dictionary."""
    found: dict[tuple[str, str], tuple[float, float | None]] = {}
    for task, values in results.get("results", {}).items():
        for key, raw in values.items():
            name, _, filt = key.partition(",")
            value = _number(raw)
            if not filt or name.endswith("_stderr") or value is None:
                continue
            metric = name if filt == "none" else f"{name},{filt}"
            found[(task, metric)] = (value, _number(values.get(f"{name}_stderr,{filt}")))
    return found


def compare(base: dict[str, Any], tuned: dict[str, Any] | None) -> list[Row]:
    """The rows of the base's results beside the tuned model's (stderr: the tuned model's, else the base's)."""
    directions = base.get("higher_is_better", {})
    tuned_metrics = metrics_of(tuned) if tuned is not None else {}
    rows = []
    for (task, metric), (value, stderr) in metrics_of(base).items():
        higher = directions.get(task, {}).get(metric.split(",")[0], True)
        other = tuned_metrics.get((task, metric))
        rows.append(
            Row(
                task=task,
                metric=metric,
                base=value,
                tuned=None if other is None else other[0],
                stderr=stderr if other is None else other[1],
                higher_is_better=bool(higher),
            )
        )
    return rows


def regressions(rows: list[Row], allowed: Any) -> list[str]:
    """One sentence per row whose drop exceeds ``allowed(task)`` (a callable giving a float or None)."""
    found = []
    for row in rows:
        limit = allowed(row.task)
        drop = row.drop
        if limit is None or drop is None or drop <= limit:
            continue
        found.append(
            f"{row.task}: {row.metric} fell by {drop:.4f} (base {row.base:.4f}, tuned {row.tuned:.4f}), "
            f"more than max_drop {limit:g}"
        )
    return found


__all__ = ["EvalReport", "Row", "compare", "metrics_of", "regressions"]
