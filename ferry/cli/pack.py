"""CLI command ``ferry pack``: parse options, call :func:`bundler.pack.pack`, print its summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command("pack")
@click.argument("spec_file", metavar="[SPEC.yaml]", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder that receives NAME/ and NAME.ferry.tar (or volumes and NAME.ferry.sha256). Required unless --dry-run.",
)
@click.option("--name", help="Bundle name (overrides the spec's).")
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="SRC",
    help="hf:ORG/NAME[@REVISION], ms:ORG/NAME[@REVISION] or a local folder. Repeatable.",
)
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    metavar="SRC",
    help="hf:ORG/NAME[@REVISION] (a dataset repo), ms:..., or a local file or folder. Repeatable.",
)
@click.option(
    "--requirements",
    "requirements",
    multiple=True,
    metavar="FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="pip requirements file for the wheel set (default: ferry's own requirements + ferry).",
)
@click.option("--no-wheels", is_flag=True, default=None, help="Pack no wheels.")
@click.option("--python-version", metavar="X.Y", help="Target Python version (default: this host's).")
@click.option(
    "--platform",
    "platforms",
    multiple=True,
    metavar="TAG",
    help="Target platform as pip or uv spell it: manylinux_2_28_x86_64, manylinux2014_aarch64, "
    "musllinux_1_2_x86_64, macosx_12_0_arm64, win_amd64, linux, macos, windows "
    "(default: this host's).",
)
@click.option(
    "--torch",
    metavar="BUILD",
    help="Torch build: pypi (default: what PyPI serves for the platform), cpu, cu118, cu121, cu124, "
    "cu126, cu128, cu130, rocm6.4 (torch and its companion wheels from the PyTorch index).",
)
@click.option("--implementation", metavar="IMPL", help="Target implementation tag (only cp).")
@click.option(
    "--index-url",
    metavar="URL",
    help="Package index (default: https://pypi.org/simple). This host's pip.conf and PIP_* settings are never used.",
)
@click.option(
    "--extra-index-url",
    "extra_index_urls",
    multiple=True,
    metavar="URL",
    help="Extra package index (e.g. a company mirror). Repeatable.",
)
@click.option(
    "--find-links",
    "find_links",
    multiple=True,
    metavar="DIR|URL",
    help="A folder of wheels or a page of links to search too. Repeatable.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Resolve the wheels for the target and print them with sizes and the total (and, with --eval, the "
    "tasks, the datasets they read and their sizes on the hub); download nothing.",
)
@click.option("--split-size", metavar="SIZE", help="Write volumes of at most SIZE (e.g. 4G, 500MiB).")
@click.option(
    "--allow-pickle",
    is_flag=True,
    default=None,
    help="Carry pickle weights (*.bin, *.pt, ...) that have no safetensors twin.",
)
@click.option(
    "--sign",
    "sign",
    metavar="KEY",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Sign manifest.json with this private OpenSSH key (ssh-keygen -Y sign -n ferry-bundle); the "
    "signature goes inside the bundle and beside it (NAME.ferry.sig).",
)
@click.option(
    "--base",
    "base",
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Pack a delta bundle: carry only what this base lacks (a `ferry state` document of the isolated "
    "prefix, or the manifest.json of a bundle installed there). With --dry-run: print the bytes "
    "carried vs the full bundle per item (downloads into OUT/.ferry-cache, writes no bundle).",
)
@click.option(
    "--extra",
    "extras",
    multiple=True,
    type=click.Choice(["gguf", "liger", "quantization", "vision"]),
    help="Also carry: gguf = llama.cpp's converter (pinned sdist) and its Python packages; liger = "
    "liger-kernel for enable_liger_kernel (CUDA targets); quantization = bitsandbytes for QLoRA "
    "(quantization_bit); vision = torchvision, the release that matches the set's torch (image rows).",
)
@click.option(
    "--eval",
    "eval_tasks",
    multiple=True,
    metavar="TASK",
    help="An lm-evaluation-harness task, group or tag (mmlu, arc_easy, gsm8k, ...): carry the hub datasets it "
    "reads (with their datasets caches) and lm-eval's wheel, for `ferry eval`. Repeatable.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def pack_command(
    spec_file: Path | None,
    out_dir: Path | None,
    quiet: bool,
    dry_run: bool,
    sign: Path | None,
    base: Path | None,
    **flags,
) -> None:
    """Build a bundle of models, datasets and wheels for an isolated host.

    \b
    ferry pack spec.yaml -o out
    ferry pack -o out --name kit --model hf:ORG/NAME --python-version 3.10 \\
        --platform manylinux_2_28_x86_64 --torch cu128
    ferry pack --dry-run --name kit --python-version 3.10 --platform manylinux_2_28_x86_64 --torch pypi
    """
    from bundler.spec import load_spec

    if dry_run and base is not None:  # delta dry run: everything but the bundle
        import tempfile

        from bundler.pack import pack

        spec = load_spec(spec_file, **flags)
        with tempfile.TemporaryDirectory(prefix="ferry-dry-run-") as scratch:
            result = pack(spec, out_dir or scratch, progress=not quiet, base=base, dry_run=True)
        click.echo(result.summary())
        return
    if dry_run:
        from bundler.wheels import resolve

        if not (spec_file or flags.get("name")):
            flags["name"] = "dry-run"
        spec = load_spec(spec_file, **flags)
        _echo_notes(spec)
        if spec.eval:  # the tasks, the datasets they read and their sizes on the hub
            from bundler.eval_tasks import describe_plan, plan_eval_tasks, task_requirements

            eval_plan = plan_eval_tasks(spec.eval)
            spec.add_eval_requirements(task_requirements(eval_plan))
            for line in describe_plan(eval_plan, nltk_index_url=spec.nltk_index_url):
                click.echo(line)
            if spec.wheels.no_wheels:
                return
        if spec.wheels.no_wheels:
            raise click.UsageError("--dry-run resolves the wheel set, and this spec packs no wheels")
        resolution = resolve(spec)
        click.echo(resolution.summary())
        from bundler.wheels import engines_summary, host_pip_config

        click.echo("".join(f"{text}\n" for text in engines_summary(spec)), nl=False)  # each its own environment

        used = {
            *resolution.indexes["find_links"],
            *resolution.indexes["extra_index_urls"],
            resolution.indexes["index_url"],
        }
        how = {
            "find-links": "--find-links",
            "extra-index-url": "--extra-index-url",
            "index-url": "--index-url",
            "constraint": "wheels.constraints in a spec file",
        }
        for key, value in host_pip_config().items():
            unused = [v for v in value.split() if v not in used]
            if unused and key in how:
                click.echo(
                    f"note      this host's pip configuration sets {key}={' '.join(unused)}; ferry does not "
                    f"use it unless given ({how[key]})"
                )
        return
    if out_dir is None:
        raise click.UsageError("Missing option '-o' / '--output' (required unless --dry-run).")
    from bundler.pack import pack

    spec = load_spec(spec_file, **flags)
    _echo_notes(spec)
    result = pack(spec, out_dir, progress=not quiet, sign=sign, base=base)
    click.echo(result.summary())


def _echo_notes(spec: Any) -> None:
    """The spec's notes (what load_spec added on its own), one ``note`` line each."""
    for line in spec.notes:
        click.echo(f"note      {line}")


COMMANDS: list = [pack_command]
