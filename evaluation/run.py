"""``run_eval``: the base model, then base + LoRA adapter, through lm-evaluation-harness, offline.

The run, in order::

    check the inputs        model resolved offline (ferry.hub), adapter folder, include_path, max_drop's tasks
    offline switches        HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, ... (ferry.constants.apply_offline_env)
    task names              lm-eval's TaskManager (built-in tasks + include_path): an unknown name is refused,
                            so is a task that needs the network or whose dataset was not packed
                            (bundler/eval_tasks.py)
    evaluate                lm_eval.simple_evaluate(model="hf", model_args={pretrained=, peft=}) per model
    write                   output_dir/
                              base/results.json      lm-eval's results dictionary, as its CLI writes it
                              tuned/results.json     (with an adapter)
                              report.json            rows (task, metric, base, tuned, difference, stderr), gate
                              report.md              the same rows as a markdown table

Everything that can be refused is refused before lm-eval loads a model and before anything is written. lm-eval
is imported inside functions: importing it takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bundler.eval_tasks import EvalTask, plan_eval_tasks, task_manager
from bundler.hub_datasets import cache_folder_name
from evaluation.config import EvalConfig
from evaluation.report import EvalReport, compare, regressions
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, NotInstalledError
from ferry.fsutil import atomic_write_text
from ferry.hub import resolve_model


def run_eval(config: EvalConfig) -> EvalReport:
    """Evaluate ``config.model_name_or_path`` (and, with ``adapter_name_or_path``, the base with that adapter) on
    ``config.tasks`` with lm-eval, write the results and the report into ``config.output_dir``, and return the
    report. The gate's verdicts are in ``report.regressions``; :meth:`EvalReport.raise_for_regressions` raises.

    Raises:
        ConfigError: an unknown task (with lm-eval's closest names), a task that needs the network at run time,
            a missing adapter or include_path folder, a max_drop task that is not evaluated.
        NotInstalledError: the model is neither a folder nor installed in the offline hub cache; a task's
            dataset was not packed and installed.
    """
    model = resolve_model(config.model_name_or_path)
    adapter = _adapter_folder(config.adapter_name_or_path)
    include = _include_folder(config.include_path)
    if isinstance(config.max_drop, dict):
        stray = [task for task in config.max_drop if task not in config.tasks]
        if stray:
            raise ConfigError(f"max_drop names {', '.join(map(repr, stray))}, which tasks does not list")
    apply_offline_env()
    manager = _task_manager(config.tasks, include)
    base = _evaluate(config, manager, model, None)
    tuned = _evaluate(config, manager, model, adapter) if adapter is not None else None
    rows = compare(base, tuned)
    report = EvalReport(rows=rows, regressions=regressions(rows, config.drop_for) if tuned else [])
    _write(Path(config.output_dir), report, base, tuned)
    return report


def _adapter_folder(name: str | None) -> Path | None:
    """The adapter folder, checked to hold a PEFT adapter (its ``adapter_config.json``)."""
    if name is None:
        return None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"adapter_name_or_path {name!r}: no such folder")
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_name_or_path {name!r}: no adapter_config.json (not a PEFT adapter folder)")
    return folder.resolve()


def _include_folder(name: str | None) -> Path | None:
    if name is None:
        return None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"include_path {name!r}: no such folder")
    return folder.resolve()


def _task_manager(tasks: list[str], include: Path | None) -> Any:
    """lm-eval's TaskManager over its built-in tasks and ``include``, after checking that every task is known
    and that what each one reads is here: a hub dataset's ``datasets`` cache (``ferry pack --eval``), or local
    files.

    Raises:
        ConfigError: an unknown task (with lm-eval's closest names); a task that would need the network.
        NotInstalledError: a task's dataset was not packed and installed (the task and the dataset named).
    """
    manager = task_manager(tasks, include)
    _check_carried(plan_eval_tasks(tasks, manager=manager))
    return manager


def _check_carried(planned: list[EvalTask]) -> None:
    """Refuse the first task whose hub dataset has no ``datasets`` cache here (``load_dataset`` would fail
    offline after a long retry, or reach for the network)."""
    import datasets

    root = Path(datasets.config.HF_DATASETS_CACHE)
    for task in planned:
        if task.repo_id is None:
            continue
        folder = root / cache_folder_name(task.repo_id) / task.cache_config
        if not folder.is_dir():
            raise NotInstalledError(
                f"task {task.name!r} reads {task.describe()}, which is not installed (no datasets cache "
                f"{folder}): pack it with `ferry pack --eval {task.name}` and install the bundle"
            )


def _evaluate(config: EvalConfig, manager: Any, model: Path, adapter: Path | None) -> dict[str, Any]:
    """lm-eval's results dictionary for ``model`` (with ``adapter`` through peft when given)."""
    import lm_eval

    model_args: dict[str, Any] = {"pretrained": str(model)}
    if adapter is not None:
        model_args["peft"] = str(adapter)
    if config.trust_remote_code:
        model_args["trust_remote_code"] = True
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        batch_size=config.batch_size,
        device=config.device or _default_device(),
        limit=config.lm_eval_limit(),
        bootstrap_iters=config.bootstrap_iters,
        log_samples=False,
        task_manager=manager,
    )
    if results is None:  # lm-eval returns None on every rank but the first of a multi-process run
        return {}
    return dict(results)


def _default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu`` (lm-eval's own default is ``cuda`` even on a CPU-only host)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _write(out: Path, report: EvalReport, base: dict[str, Any], tuned: dict[str, Any] | None) -> None:
    """lm-eval's results of each model, then report.json and report.md, into ``out`` (files named in the report)."""
    from lm_eval.utils import handle_non_serializable

    out.mkdir(parents=True, exist_ok=True)
    for name, results in (("base", base), ("tuned", tuned)):
        if results is None:
            continue
        path = out / name / "results.json"
        path.parent.mkdir(exist_ok=True)
        atomic_write_text(path, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
        report.files[name] = str(path)
    report.files["report.json"] = str(out / "report.json")
    report.files["report.md"] = str(out / "report.md")
    atomic_write_text(out / "report.json", report.to_json())
    atomic_write_text(out / "report.md", report.markdown())


__all__ = ["run_eval"]
