"""CLI command ``ferry pack``: parse options, call :func:`bundler.pack.pack`, print its summary."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("pack")
@click.argument("spec_file", metavar="[SPEC.yaml]", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder that receives NAME/ and NAME.ferry.tar (or volumes and NAME.ferry.sha256).")
@click.option("--name", help="Bundle name (overrides the spec's).")
@click.option("--model", "models", multiple=True, metavar="SRC",
              help="hf:ORG/NAME[@REVISION], ms:ORG/NAME[@REVISION] or a local folder. Repeatable.")
@click.option("--dataset", "datasets", multiple=True, metavar="SRC",
              help="hf:ORG/NAME[@REVISION] (a dataset repo), ms:..., or a local file or folder. Repeatable.")
@click.option("--requirements", "requirements", multiple=True, metavar="FILE",
              type=click.Path(dir_okay=False, path_type=Path),
              help="pip requirements file for the wheel set (default: ferry's own requirements + ferry).")
@click.option("--no-wheels", is_flag=True, default=None, help="Pack no wheels.")
@click.option("--python-version", metavar="X.Y", help="Target Python version (default: this host's).")
@click.option("--platform", "platforms", multiple=True, metavar="TAG",
              help="Target platform tag, e.g. manylinux2014_x86_64. Repeatable.")
@click.option("--implementation", metavar="IMPL", help="Target implementation tag (default: cp).")
@click.option("--index-url", metavar="URL", help="pip index URL.")
@click.option("--extra-index-url", "extra_index_urls", multiple=True, metavar="URL",
              help="Extra pip index URL (e.g. a CUDA build of torch). Repeatable.")
@click.option("--split-size", metavar="SIZE", help="Write volumes of at most SIZE (e.g. 4G, 500MiB).")
@click.option("--allow-pickle", is_flag=True, default=None,
              help="Carry pickle weights (*.bin, *.pt, ...) that have no safetensors twin.")
@click.option("--sign", "sign", metavar="KEY", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Sign manifest.json with this private OpenSSH key (ssh-keygen -Y sign -n ferry-bundle); the "
                   "signature goes inside the bundle and beside it (NAME.ferry.sig).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def pack_command(spec_file: Path | None, out_dir: Path, quiet: bool, sign: Path | None, **flags) -> None:
    """Build a bundle of models, datasets and wheels for an isolated host.

    \b
    ferry pack spec.yaml -o out
    ferry pack -o out --name kit --model hf:ORG/NAME --dataset ./data.json --python-version 3.10
    """
    from bundler.pack import pack
    from bundler.spec import load_spec

    spec = load_spec(spec_file, **flags)
    result = pack(spec, out_dir, progress=not quiet, sign=sign)
    click.echo(result.summary())


COMMANDS: list = [pack_command]
