"""CLI command ``ferry eval``: a thin click wrapper over :func:`evaluation.run.run_eval`. Its flags are generated
from :class:`evaluation.config.EvalConfig` (:mod:`ferry.cli.flags`); a flag given wins over the YAML's key."""

from __future__ import annotations

import click

from evaluation.config import EvalConfig, load_eval_config
from ferry.cli.flags import given_options, model_options


@click.command("eval")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@model_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table.")
@click.pass_context
def eval_command(ctx: click.Context, config: str | None, as_json: bool, **flags: object) -> None:
    """Evaluate a base model and base + LoRA adapter with lm-evaluation-harness, offline, side by side.

    CONFIG: a YAML of the keys below (model_name_or_path, adapter_name_or_path, tasks, ...). With max_drop, exits
    non-zero naming the task and metric that fell by more than allowed."""
    from evaluation.run import run_eval

    report = run_eval(load_eval_config(config, given_options(ctx, EvalConfig, flags)))
    click.echo(report.to_json() if as_json else report.table())
    report.raise_for_regressions()


COMMANDS: list = [eval_command]
