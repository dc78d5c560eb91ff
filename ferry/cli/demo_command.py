"""CLI command ``ferry demo``: the whole journey on the embedded default (see :mod:`ferry.cli.demo`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="Empty directory for everything the demo writes (default: a new temporary directory).",
)
@click.option("--nproc-per-node", type=int, default=2, show_default=True, help="Training processes.")
def demo_command(workdir: Path | None, nproc_per_node: int) -> None:
    """Pack, verify, install, train (LoRA, DDP) and export a seeded tiny Llama, offline.

    Everything ships inside ferry: the model is built from a fixed seed and the instruction dataset is
    ferry's own. Ends with a table of each stage, its time and where the outputs are.
    """
    from ferry.cli.demo import run_demo

    report = run_demo(workdir, nproc_per_node=nproc_per_node, log=lambda m: click.echo(m, err=True))
    click.echo(report.table())


COMMANDS = [demo_command]
