"""``run_eval``: the base model, then base + LoRA adapter, through lm-evaluation-harness, offline.

The run, in order::

    check the inputs        model resolved offline (ferry.hub), adapter folder, include_path, max_drop's tasks
    offline switches        HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, ... (ferry.constants.apply_offline_env)
    several ranks           torchrun starts them here (evaluation/parallel.py); each goes through what follows
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

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bundler.eval_tasks import check_installed, plan_eval_tasks, task_manager
from evaluation.config import EvalConfig
from evaluation.parallel import (
    check_devices,
    in_worker,
    init_process_group,
    launch,
    leave_process_group,
    ranked_lm,
    record_worker_error,
)
from evaluation.report import EvalReport, compare, regressions, task_versions
from evaluation.task_folder import localized
from ferry.adapter_folder import CHAT_TEMPLATE
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, FerryError
from ferry.fsutil import atomic_write_text
from ferry.hub import resolve_model
from ferry.output import libraries_to


def run_eval(config: EvalConfig) -> EvalReport:
    """Evaluate ``config.model_name_or_path`` (and, with ``adapter_name_or_path``, the base with that adapter) on
    ``config.tasks`` with lm-eval, write the results and the report into ``config.output_dir``, and return the
    report. The gate's verdicts are in ``report.regressions``; :meth:`EvalReport.raise_for_regressions` raises.

    Raises:
        ConfigError: an unknown task (with lm-eval's closest names), a task that needs the network at run time,
            a missing adapter or include_path folder, a max_drop task that is not evaluated; another ``ferry eval``
            holds ``output_dir`` (:func:`ferry.folder_lock.hold_folder`).
        NotInstalledError: the model is neither a folder nor installed in the offline hub cache; a task's
            dataset was not packed and installed.
    """
    if not in_worker():  # one evaluation per output_dir at a time; a second is refused in one line
        from ferry.folder_lock import hold_folder

        with hold_folder(config.output_dir, "ferry eval"):
            return _run_eval(config)
    return _run_eval(config)


def _run_eval(config: EvalConfig) -> EvalReport:
    """:func:`run_eval` once ``output_dir`` is held (or in a worker of a multi-process evaluation)."""
    model = resolve_model(config.model_name_or_path)
    adapter = _adapter_folder(config.adapter_name_or_path)
    include = _include_folder(config.include_path)
    if isinstance(config.max_drop, dict):
        stray = [task for task in config.max_drop if task not in config.tasks]
        if stray:
            raise ConfigError(f"max_drop names {', '.join(map(repr, stray))}, which tasks does not list")
    apply_offline_env()
    device = config.device or _default_device()
    if config.nproc_per_node > 1 and not in_worker():
        # the ranks check the tasks while they build lm-eval's task index (each needs its own, and building it here
        # first would cost as long again); a refusal there is raised here as the same one-line error
        check_devices(config.nproc_per_node, device)
        return launch(config)
    with tempfile.TemporaryDirectory(prefix="ferry-eval-tasks-") as scratch:
        # data_files relative to their task YAML (a task folder carried in a bundle): evaluation/task_folder.py
        manager = _task_manager(config.tasks, localized(include, Path(scratch)) if include else None)
        if in_worker():
            device = init_process_group(device)
        base = _evaluate(config, manager, model, None, device)
        tuned = _evaluate(config, manager, model, adapter, device) if adapter is not None else None
    if not base:  # a rank other than the first: rank 0 writes
        return EvalReport(rows=[])
    rows = compare(base, tuned)
    report = EvalReport(
        rows=rows, regressions=regressions(rows, config.drop_for) if tuned else [], versions=task_versions(base)
    )
    _write(Path(config.output_dir), report, base, tuned)
    return report


def score_training_run(config: Mapping[str, Any]) -> EvalReport:
    """``eval_tasks`` of a finished ``ferry train`` run (its resolved config): the base and the trained adapter
    (``output_dir/adapter``) through :func:`run_eval` into ``output_dir/eval/``; the report is also kept in
    ``output_dir/train_report.json`` under ``eval``. The gate (``eval_max_drop``) is in ``report.regressions``.

    Raises:
        ConfigError, NotInstalledError: as :func:`run_eval`.
    """
    out = Path(config["output_dir"])
    given = {
        "model_name_or_path": config["model_name_or_path"],
        "adapter_name_or_path": str(out / "adapter"),
        "tasks": config["eval_tasks"],
        "include_path": config.get("eval_include_path"),
        "limit": config.get("eval_limit"),
        "max_drop": config.get("eval_max_drop"),
        "output_dir": str(out / "eval"),
        "trust_remote_code": bool(config.get("trust_remote_code")),
    }
    report = run_eval(EvalConfig.model_validate(given))
    train_report = out / "train_report.json"
    data = json.loads(train_report.read_text(encoding="utf-8"))
    data["eval"] = report.to_dict()
    atomic_write_text(train_report, json.dumps(data, indent=2) + "\n")
    return report


def run_worker(argv: list[str]) -> int:
    """One rank of ``ferry eval --nproc-per-node N`` (``python -m evaluation CONFIG.json``, started by
    :func:`evaluation.parallel.launch`): evaluate its share, rank 0 writing. Returns the exit code; a ferry error is
    printed as one ``ferry: error:`` line, which the launcher turns into its own one line."""
    try:
        run_eval(EvalConfig.model_validate(json.loads(Path(argv[0]).read_text(encoding="utf-8"))))
    except FerryError as exc:
        leave_process_group(wait=False)
        record_worker_error(exc)
        print(f"ferry: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    leave_process_group(wait=True)
    return 0


def _adapter_folder(name: str | None) -> Path | None:
    """The adapter folder, checked to hold a PEFT adapter (its ``adapter_config.json``) that lm-eval loads as
    trained (no RoPE scaling record).

    Raises:
        ConfigError: no such folder, no adapter_config.json, or the adapter records a RoPE scaling.
    """
    if name is None:
        return None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"adapter_name_or_path {name!r}: no such folder")
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_name_or_path {name!r}: no adapter_config.json (not a PEFT adapter folder)")
    from ferry.adapter_folder import ROPE_RECORD, read_rope_record

    rope = read_rope_record(folder)
    if rope is not None:  # lm-eval would load the base under it unstretched: a silently wrong score
        raise ConfigError(
            f"adapter_name_or_path {name!r} was trained with rope_scaling {rope.rope_type} ({ROPE_RECORD}), which "
            f"lm-eval does not apply to the base: evaluate its merged export (`ferry export`, whose config.json "
            f"carries the scaling)"
        )
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
    check_installed(plan_eval_tasks(tasks, manager=manager))
    return manager


def _evaluate(config: EvalConfig, manager: Any, model: Path, adapter: Path | None, device: str) -> dict[str, Any]:
    """lm-eval's results dictionary for ``model`` (with ``adapter`` through peft when given); empty on a rank other
    than the first of a multi-rank run (evaluation/parallel.py). What the libraries write to stderr meanwhile (the
    weights' loading bars, lm-eval's bars and warnings, the ``git`` it runs) goes to
    ``output_dir/logs/libraries.log`` (``libraries-rankN.log`` on the ranks), not to the terminal."""
    rank = os.environ.get("RANK", "0") if in_worker() else None
    log = Path(config.output_dir) / "logs" / ("libraries.log" if rank is None else f"libraries-rank{rank}.log")
    with libraries_to(log):
        return _evaluate_here(config, manager, model, adapter, device)


def _evaluate_here(config: EvalConfig, manager: Any, model: Path, adapter: Path | None, device: str) -> dict[str, Any]:
    """:func:`_evaluate` once stderr goes to the log."""
    import lm_eval

    model_args: dict[str, Any] = {"pretrained": str(model)}
    if adapter is not None:
        model_args["peft"] = str(adapter)
    if config.trust_remote_code:
        model_args["trust_remote_code"] = True
    lm: Any = "hf"
    if in_worker():  # the requests split over the ranks of torchrun's process group
        lm, model_args = ranked_lm(model_args, device, config.batch_size), {}
    template = _trained_template(config)
    if template is not None:  # both models see the prompt the adapter was trained on
        if isinstance(lm, str):
            from lm_eval.models.huggingface import HFLM

            lm, model_args = HFLM(device=device, batch_size=config.batch_size, **model_args), {}
        lm.tokenizer.chat_template = template
    results = lm_eval.simple_evaluate(
        model=lm,
        model_args=model_args or None,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        batch_size=config.batch_size,
        device=device,
        limit=config.lm_eval_limit(),
        gen_kwargs=config.gen_kwargs,
        bootstrap_iters=config.bootstrap_iters,
        log_samples=False,
        task_manager=manager,
        apply_chat_template=config.apply_chat_template,
        system_instruction=config.system_instruction,
    )
    if results is None:  # lm-eval returns None on every rank but the first of a multi-process run
        return {}
    results = dict(results)
    if template is not None:  # as lm-eval's CLI records the template it applied
        results["chat_template"] = template
        results["chat_template_sha"] = hashlib.sha256(template.encode("utf-8")).hexdigest()
    return results


def _trained_template(config: EvalConfig) -> str | None:
    """The adapter's ``chat_template.jinja`` (the prompt ``ferry train`` rendered) when ``apply_chat_template`` is
    asked and the adapter folder has one; else None (lm-eval uses the model tokenizer's own template)."""
    if not config.apply_chat_template or config.adapter_name_or_path is None:
        return None
    path = Path(config.adapter_name_or_path).expanduser() / CHAT_TEMPLATE
    return path.read_text(encoding="utf-8") if path.is_file() else None


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


__all__ = ["run_eval", "run_worker", "score_training_run"]
