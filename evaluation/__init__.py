"""evaluation: the base model and the tuned one (base + LoRA adapter) through lm-evaluation-harness, offline.

Public API::

    EvalConfig, load_eval_config(path, given)     evaluation.config (the keys of ``ferry eval``)
    run_eval(config) -> EvalReport                evaluation.run (lm-eval runs, results JSON, report, gate)
    score_training_run(train_config) -> EvalReport   eval_tasks after ferry train (base vs output_dir/adapter)
    EvalReport, Row                               evaluation.report (side-by-side rows, table, markdown)

Layering: above the exporter, below ``ferry.cli``; it imports the foundation only, and lm-eval inside functions.
"""

from __future__ import annotations

from evaluation.config import EvalConfig, load_eval_config
from evaluation.report import EvalReport, Row
from evaluation.run import run_eval, score_training_run

__all__ = ["EvalConfig", "EvalReport", "Row", "load_eval_config", "run_eval", "score_training_run"]
