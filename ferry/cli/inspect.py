"""CLI command ``ferry inspect``: show what a bundle holds, reading its metadata only (bundler.inspect)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("inspect")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Also write a self-contained HTML page for approvers (risk flags first).",
)
@click.option(
    "--allowed-signers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="OpenSSH allowed_signers file: check the signature against it.",
)
def inspect_command(bundle: Path, as_json: bool, html_file: Path | None, allowed_signers: Path | None) -> None:
    """Show BUNDLE's signer, provenance, items, wheels, licences and risk flags without reading its payload.

    BUNDLE is a directory, NAME.ferry.tar or its first volume NAME.ferry.tar.000; only the metadata at its
    start is read (about 100 kB plus 1 kB per file, whatever the bundle's size). It does not check the
    content: that is `ferry verify`.
    """
    from bundler.inspect import inspect, write_html

    found = inspect(bundle, allowed_signers)
    if html_file is not None:
        write_html(found, html_file)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
    else:
        click.echo(found.text())
        if html_file is not None:
            click.echo(f"html       {html_file}")


COMMANDS: list = [inspect_command]
