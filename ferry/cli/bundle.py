"""CLI commands of the isolated host: ``ferry verify``, ``ferry install``, ``ferry env``.

Each parses its options, calls one library function (bundler.verify.verify, bundler.install.install,
bundler.install.read_env_file) and prints its report. ``ferry install`` first prints the risk flags of
``ferry inspect`` (bundler.inspect.inspect: reads the bundle's metadata head only).
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("verify")
@click.argument("bundle", required=False, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--manifest",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A manifest.json brought over a separate channel: check the bundle against it.",
)
@click.option(
    "--prefix",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Check an installed prefix instead: re-hash every installed file against its manifest.",
)
@click.option(
    "--allowed-signers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="OpenSSH allowed_signers file: require a valid signature by one of its signers.",
)
@click.option("--require-signature", is_flag=True, help="Refuse an unsigned bundle (needs --allowed-signers).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def verify_command(
    bundle: Path | None,
    manifest: Path | None,
    prefix: Path | None,
    allowed_signers: Path | None,
    require_signature: bool,
    quiet: bool,
) -> None:
    """Check every byte of BUNDLE (a directory, NAME.ferry.tar or NAME.ferry.tar.000) against its manifest,
    or with --prefix every file installed into a prefix (offline).

    Names every missing, extra, truncated or mismatched file and exits non-zero when there is one.
    """
    if (bundle is None) == (prefix is None):
        raise click.UsageError("give a BUNDLE or --prefix DIR (one of them)")
    if prefix is not None:
        from bundler.verify import verify_prefix

        click.echo(verify_prefix(prefix).summary())
        return
    from bundler.verify import verify

    assert bundle is not None  # one of BUNDLE and --prefix, checked above
    report = verify(
        bundle, manifest, progress=not quiet, allowed_signers=allowed_signers, require_signature=require_signature
    )
    click.echo(report.summary())


@click.command("install")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--prefix",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Install root (models in PREFIX/hf-home, datasets in PREFIX/datasets, PREFIX/ferry.env).",
)
@click.option("--no-venv", is_flag=True, help="Do not create a venv from the bundle's wheels.")
@click.option(
    "--no-compile",
    is_flag=True,
    help="Do not compile the venv's modules to bytecode while installing (faster; each compiles when first "
    "imported, so keep the venv writable).",
)
@click.option(
    "--manifest",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A manifest.json brought over a separate channel: the bundle must match it.",
)
@click.option(
    "--private", is_flag=True, help="Readable by this account only (0700/0600); default: every account (0755/0644)."
)
@click.option(
    "--replace-datasets",
    is_flag=True,
    help="Replace installed datasets of the same name whose content differs (refused by default).",
)
@click.option(
    "--allowed-signers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="OpenSSH allowed_signers file: require a valid signature by one of its signers, and record it "
    "in PREFIX/.ferry as the prefix's policy (every later install must then be signed by them).",
)
@click.option(
    "--require-signature",
    is_flag=True,
    help="Refuse an unsigned bundle (signers from --allowed-signers or the prefix's policy).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def install_command(
    bundle: Path,
    prefix: Path,
    no_venv: bool,
    no_compile: bool,
    manifest: Path | None,
    private: bool,
    replace_datasets: bool,
    allowed_signers: Path | None,
    require_signature: bool,
    quiet: bool,
) -> None:
    """Verify BUNDLE and install it into PREFIX, straight from the directory, archive or volumes.

    The risk flags of `ferry inspect` (unsigned, remote code, pickle files, unknown licences) are printed first.
    """
    from bundler.install import install

    _print_risk_flags(bundle, allowed_signers or _policy(prefix))
    report = install(
        bundle,
        prefix,
        create_venv=not no_venv,
        manifest=manifest,
        progress=not quiet,
        private=private,
        replace_datasets=replace_datasets,
        allowed_signers=allowed_signers,
        require_signature=require_signature,
        compile_bytecode=not no_compile,
    )
    click.echo(report.summary())


def _policy(prefix: Path) -> Path | None:
    from bundler.format import POLICY_NAME

    path = prefix / ".ferry" / POLICY_NAME
    return path if path.is_file() else None


def _print_risk_flags(bundle: Path, allowed_signers: Path | None) -> None:
    """``ferry inspect``'s risk flags on stderr (a bundle packed before metadata came first has none to show)."""
    from bundler.inspect import inspect
    from ferry.errors import BundleError

    try:
        found = inspect(bundle, allowed_signers)
    except BundleError as exc:
        click.echo(f"ferry: cannot inspect before installing: {exc}", err=True)
        return
    for flag in found.risks:
        click.echo(f"RISK: {flag}", err=True)


@click.command("env")
@click.option(
    "--prefix",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="An install root written by ferry install.",
)
def env_command(prefix: Path) -> None:
    """Print PREFIX/ferry.env (use: eval "$(ferry env --prefix DIR)" or source DIR/ferry.env)."""
    from bundler.install import read_env_file

    click.echo(read_env_file(prefix), nl=False)


COMMANDS: list = [verify_command, install_command, env_command]
