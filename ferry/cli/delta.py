"""CLI command ``ferry state``: what an installed prefix holds, the base of a delta bundle (bundler/delta.py)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("state")
@click.argument("prefix", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The state document to write (JSON): carry it to the online host for ferry pack --base.",
)
@click.option(
    "--trust-recorded",
    is_flag=True,
    help="Take sizes and sha256 from the install records (files must exist) instead of re-hashing "
    "every file; the document then has no tensor tables (ferry pack computes them from the base's "
    "files when it still has them, else compares safetensors files whole).",
)
def state_command(prefix: Path, output: Path, trust_recorded: bool) -> None:
    """Write what PREFIX holds (every installed file's size and sha256) for a delta bundle.

    \b
    isolated host:  ferry state /opt/ferry -o state.json
    online host:    ferry pack spec.yaml --base state.json -o out
    """
    from bundler.delta import write_state

    click.echo(write_state(prefix, output, trust_recorded=trust_recorded).summary())


COMMANDS: list = [state_command]
