"""CLI command ``ferry serve MODEL [--adapter DIR] [--engine E] [--check] [-- ENGINE FLAGS]``: a thin click wrapper
over :func:`serving.serve.plan_serve` and :func:`serving.serve.serve`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ferry.constants import apply_offline_env


@click.command("serve", context_settings={"ignore_unknown_options": False})
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--adapter", "adapters", multiple=True, type=click.Path(path_type=Path), help="A LoRA adapter on MODEL.")
@click.option(
    "--engine",
    type=click.Choice(["auto", "transformers", "vllm", "llama.cpp"]),
    default="auto",
    show_default=True,
    help="auto: llama.cpp for a GGUF export, else vLLM where it is installed ($FERRY_HOME/engines/vllm or this "
    "environment), else transformers.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address the server listens on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--served-model-name", default=None, help="The name requests use (default: the folder's name; vLLM).")
@click.option("--dtype", default="auto", show_default=True, help="The engine's --dtype.")
@click.option("--check", is_flag=True, help="Answer the smoke check's prompts, compare them with its texts, stop.")
@click.option(
    "--smoke-report",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The smoke report --check compares with (default: MODEL/smoke_report.json).",
)
@click.option("--log-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="The server's output.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    model: Path,
    adapters: tuple[Path, ...],
    engine: str,
    host: str,
    port: int,
    served_model_name: str | None,
    dtype: str,
    check: bool,
    smoke_report: Path | None,
    log_file: Path | None,
    engine_args: tuple[str, ...],
) -> None:
    """Serve MODEL (a merged export, a base with --adapter, or a GGUF export; a folder, a file or an installed
    repo id) through an OpenAI-compatible server, offline, until Ctrl-C. The engine's own flags go after --:
    ferry serve merged -- --max-model-len 4096."""
    apply_offline_env()
    from serving.serve import SMOKE_REPORT, plan_serve, serve

    plan = plan_serve(
        model,
        adapters=list(adapters),
        engine=engine,
        host=host,
        port=port,
        served_model_name=served_model_name,
        dtype=dtype,
        engine_args=list(engine_args),
    )
    report = None
    if check:
        report = smoke_report or (model if model.is_dir() else model.parent) / SMOKE_REPORT
        if not report.is_file():
            from ferry.errors import NotInstalledError

            raise NotInstalledError(
                f"--check: no smoke report at {report}: run ferry smoke on the export, or name one with --smoke-report"
            )
    sys.exit(serve(plan, check_report=report, log_file=log_file))


COMMANDS = [serve_command]
