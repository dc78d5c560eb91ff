"""``ferry train``: the CLI face of :func:`trainer.launch.launch` (see ferry/cli.py for how commands register)."""

from __future__ import annotations

import os

import click


def _print_keys(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--keys``: every config key with its default, limits or choices and meaning (from
    trainer.config.TrainConfig), then exit."""
    if not value or ctx.resilient_parsing:
        return
    import textwrap

    from trainer.config import TrainConfig

    limits = TrainConfig.key_limits()
    for key, default, description in TrainConfig.key_help():
        click.echo(f"{key}  (default: {default})" + (f"  [{limits[key]}]" if key in limits else ""))
        click.echo(textwrap.fill(description, width=96, initial_indent="    ", subsequent_indent="    "))
    ctx.exit(0)


def _print_templates(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--templates``: every built-in chat template (LLaMA-Factory's names) with a one-line summary, then exit."""
    if not value or ctx.resilient_parsing:
        return
    from trainer.templates import describe_templates

    rows = describe_templates()
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        click.echo(f"{name.ljust(width)}  {summary}")
    ctx.exit(0)


@click.command(
    "train",
    context_settings={"max_content_width": 100},
    epilog="Config keys use LLaMA-Factory's names (model_name_or_path, dataset, lora_rank, cutoff_len, "
    "per_device_train_batch_size, gradient_accumulation_steps, learning_rate, output_dir, ...; see --keys); an "
    "unknown key is an error naming the nearest valid one. Users who run torchrun themselves: "
    "'torchrun [OPTIONS] -m trainer CONFIG.yaml [KEY=VALUE ...]'.",
)
@click.argument("config", metavar="CONFIG.yaml")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option(
    "--nproc-per-node",
    default="auto",
    show_default=True,
    help="Worker processes on this node: an integer, or auto (one per GPU; on CPU one per 2 cores).",
)
@click.option("--nnodes", type=int, default=1, show_default=True, help="Number of nodes in the job.")
@click.option(
    "--node-rank",
    type=int,
    default=0,
    show_default=True,
    help="This node's rank (with --master-addr; c10d rendezvous assigns it by itself).",
)
@click.option("--master-addr", default=None, help="Address of the rank-0 node (static rendezvous).")
@click.option("--master-port", type=int, default=None, help="Port on the rank-0 node (static rendezvous).")
@click.option(
    "--rdzv-endpoint",
    default=None,
    metavar="HOST:PORT",
    help="c10d rendezvous endpoint shared by all nodes (recommended for several nodes).",
)
@click.option(
    "--max-restarts",
    type=int,
    default=0,
    show_default=True,
    help="Restart the worker group this many times after a failure; training resumes from the newest checkpoint.",
)
@click.option(
    "--rdzv-timeout",
    type=int,
    default=None,
    metavar="SECONDS",
    help="Seconds the c10d rendezvous waits for every node before failing (torchrun's default 600).",
)
@click.option(
    "--keys",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_print_keys,
    help="List every config key with its default, limits and meaning, then exit.",
)
@click.option(
    "--templates",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_print_templates,
    help="List every built-in chat template (LLaMA-Factory's names), then exit.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Validate, tokenise and print the resolved config, world size, global batch size, steps, "
    "trainable parameters, tokens per step and the memory per rank of DDP and FSDP; start no worker.",
)
@click.option(
    "--accelerate-config",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="An accelerate config file (as `accelerate launch --config_file FILE`, e.g. LLaMA-Factory's "
    "examples/accelerate/fsdp_config.yaml): its FSDP / DeepSpeed / DDP choice and process counts "
    "become ferry's fsdp keys and options, with one line saying so.",
)
@click.option(
    "--verbose",
    is_flag=True,  # quiet output unless asked
    help="Show transformers'/peft's progress bars and warnings (else in OUTPUT_DIR/logs/).",
)
def train_command(
    config: str,
    overrides: tuple[str, ...],
    nproc_per_node: str,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    rdzv_endpoint: str | None,
    max_restarts: int,
    rdzv_timeout: int | None,
    dry_run: bool,
    verbose: bool = False,
    accelerate_config: str | None = None,
) -> None:
    """Fine-tune a LoRA adapter with PyTorch DDP (or FSDP2: fsdp: full_shard) under torchrun, fully offline.

    Validates CONFIG.yaml (plus KEY=VALUE overrides), tokenises the dataset once into a cache keyed by the
    content hashes of data, tokenizer and settings, then starts the workers with torchrun. Output:
    OUTPUT_DIR/adapter/, metrics.jsonl, train_report.json, checkpoint-STEP/ folders.
    """
    from trainer.launch import launch

    if verbose:
        from ferry.output import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"  # this process and the workers
    elif dry_run:  # a dry run routes nothing to output_dir/logs/; bitsandbytes' CPU backend warns at import (peft
        import logging  # imports it to build the meta model), a notice about a kernel QLoRA alone would use

        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    report = launch(
        config,
        overrides,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        rdzv_timeout=rdzv_timeout,
        dry_run=dry_run,
        accelerate_config=accelerate_config,
    )
    click.echo(report.summary())
    if report.config.get("eval_tasks") and report.train_report and node_rank == 0:
        from evaluation import score_training_run

        scored = score_training_run(report.config)
        click.echo(f"\nlm-eval, base vs tuned ({scored.files['report.md']}):")
        click.echo(scored.table())
        scored.raise_for_regressions()


COMMANDS: list[click.Command] = [train_command]
