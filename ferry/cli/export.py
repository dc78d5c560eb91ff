"""CLI commands ``ferry export`` and ``ferry smoke``: thin click wrappers over :func:`exporter.export.export` and
:func:`exporter.smoke.smoke`. ``ferry export``'s option flags are generated from
:class:`exporter.options.ExportOptions` (:mod:`ferry.cli.flags`). Owned by the export area; see ferry/cli.py."""

from __future__ import annotations

import json

import click

from exporter.options import ExportOptions
from ferry.cli.flags import given_options, model_options
from ferry.constants import apply_offline_env


@click.command("export")
@click.argument("config", required=False, type=click.Path(exists=True, dir_okay=False))  # LLaMA-Factory merge YAML
@click.option(
    "--adapter",
    "adapter",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).",
)
@click.option("--output", "-o", default=None, type=click.Path(file_okay=False), help="Folder to create.")
@model_options(ExportOptions)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def export_command(
    ctx: click.Context, config: str | None, adapter: str | None, output: str | None, as_json: bool, **flags: object
) -> None:
    """Merge a LoRA adapter into its base model (streaming, sharded safetensors), offline.

    CONFIG: LLaMA-Factory's merge YAML (model_name_or_path, adapter_name_or_path, export_dir, export_size, ...);
    flags given as well win over its keys (exporter/lf_merge.py)."""
    apply_offline_env()
    options = ExportOptions(**given_options(ctx, ExportOptions, flags), progress=True)
    if config is not None:  # LLaMA-Factory's merge YAML: the flags given win over its keys
        from exporter.lf_merge import export_from_config

        report = export_from_config(config, options, adapter=adapter, output=output)
    elif adapter is None or output is None:
        raise click.UsageError("give --adapter and --output, or a LLaMA-Factory merge YAML")
    else:
        from exporter.export import export

        report = export(adapter, output, options)
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.summary())


@click.command("smoke")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--adapter",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Adapter the model was merged from [default: the one recorded in ferry_export.json].",
)
@click.option("--base", default=None, metavar="MODEL", help="Base model folder or installed repo id.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt to check (repeatable).")
@click.option(
    "--max-new-tokens",
    default=32,
    show_default=True,
    type=click.IntRange(1),
    help="Greedy tokens generated per prompt.",
)
@click.option("--require-eos", is_flag=True, help="Fail when no prompt reaches EOS within --max-new-tokens.")
@click.option("--device", default=None, help="cuda, cuda:1, cpu [default: cuda when available].")
@click.option(
    "--report/--no-report",
    default=True,
    show_default=True,
    help="Write MODEL_DIR/smoke_report.json (--no-report for a read-only model folder).",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def smoke_command(
    model_dir, adapter, base, prompts, max_new_tokens, require_eos, device, report, trust_remote_code, as_json
) -> None:
    """Check an exported model offline: logits vs base + adapter, greedy generation, tokens/s."""
    apply_offline_env()
    from exporter.smoke import smoke

    result = smoke(
        model_dir,
        adapter,
        base,
        prompts=list(prompts) or None,
        max_new_tokens=max_new_tokens,
        device=device,
        require_eos=require_eos,
        write_report=report,
        trust_remote_code=trust_remote_code,
    )
    click.echo(json.dumps(result.to_dict(), indent=2, default=str) if as_json else result.summary())


COMMANDS: list = [export_command, smoke_command]
