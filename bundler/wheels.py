"""Wheels for the isolated host: ``pip download`` for the target, then ``requirements.lock`` with hashes.

The lock file has one line per project, ``NAME==VERSION --hash=sha256:HEX [--hash=...]``, so the isolated
host installs with::

    pip install --no-index --find-links wheels --require-hashes -r wheels/requirements.lock

Target options map to pip's: ``--python-version X.Y``, ``--platform TAG`` (repeatable), ``--implementation``,
``--abi``. When the target differs from this host, ``--only-binary=:all:`` is added (pip cannot build an
sdist for another interpreter); for this host, an sdist pip had to download is built into a wheel with
``pip wheel --no-deps``. Every command gets ``-c constraints.txt`` (the project's: it pins ``torch``).

With no requirements, the wheel set is ferry's own runtime requirements (``importlib.metadata.requires
("llm-ferry")`` without extras) plus ferry's own wheel, built from the source checkout with
``pip wheel --no-deps --no-build-isolation``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bundler.spec import PackSpec, TargetSpec
from ferry.errors import ConfigError, SourceError

DISTRIBUTION = "llm-ferry"
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def canonical_name(name: str) -> str:
    """PEP 503 normalised project name: ``Markup_Safe`` -> ``markup-safe``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel_filename(filename: str) -> tuple[str, str]:
    """``(canonical name, version)`` of a wheel file name (PEP 427). Raises SourceError when malformed."""
    match = _WHEEL_NAME.match(filename)
    if not match:
        raise SourceError(f"not a wheel file name: {filename!r}")
    return canonical_name(match["name"]), match["version"]


def project_root() -> Path | None:
    """The source checkout ferry runs from (the folder with ferry's ``pyproject.toml``), or None."""
    import ferry

    root = Path(ferry.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"llm-ferry"', pyproject.read_text(encoding="utf-8")):
        return root
    return None


def default_constraints() -> Path | None:
    """The project's ``constraints.txt`` (next to ``pyproject.toml``), or None outside a source checkout."""
    root = project_root()
    if root is not None and (root / "constraints.txt").is_file():
        return root / "constraints.txt"
    return None


def ferry_requirements() -> list[str]:
    """ferry's runtime requirements from its installed metadata, extras left out (e.g. ``torch>=2.4``).

    Raises:
        SourceError: the ``llm-ferry`` distribution is not installed (no metadata to read).
    """
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(f"the {DISTRIBUTION} distribution is not installed, so its requirements are unknown; "
                          f"install ferry with pip or give --requirements") from None
    return [r for r in requires if not re.search(r"\bextra\s*==", r)]


def target_args(target: TargetSpec) -> list[str]:
    """pip's target options for ``target`` (empty when the target is this host)."""
    host_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    host_impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
    differs = bool(target.platforms) or bool(target.abi) or (
        target.python_version not in (None, host_python)) or (target.implementation not in (None, "", host_impl))
    if not differs:
        return []
    args = ["--only-binary=:all:", "--python-version", target.python_version or host_python,
            "--implementation", target.implementation or host_impl]
    for platform in target.platforms:
        args += ["--platform", platform]
    if target.abi:
        args += ["--abi", target.abi]
    return args


def _run_pip(args: list[str], *, what: str, progress: bool) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"]
    env = {**os.environ, "PIP_NO_COLOR": "1"}
    proc = subprocess.run(cmd, env=env, text=True, stdout=None if progress else subprocess.PIPE,
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-12:])
        raise SourceError(f"{what} failed (pip exit {proc.returncode}): {' '.join(cmd[3:])}\n{tail}")


def build_ferry_wheel(dest: Path, *, progress: bool = False) -> Path:
    """Build ferry's own wheel into ``dest`` from the source checkout; return its path.

    Raises:
        SourceError: ferry does not run from a source checkout, or the build failed.
    """
    root = project_root()
    if root is None:
        raise SourceError("ferry does not run from a source checkout, so it cannot build its own wheel; give "
                          "--requirements FILE (listing e.g. llm-ferry from your index) or --no-wheels")
    before = set(dest.glob("*.whl"))
    _run_pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(root)],
             what="building ferry's wheel", progress=progress)
    built = [p for p in dest.glob("*.whl") if p not in before and parse_wheel_filename(p.name)[0] == DISTRIBUTION]
    if not built:
        built = [p for p in dest.glob("*.whl") if parse_wheel_filename(p.name)[0] == DISTRIBUTION]
    if not built:
        raise SourceError(f"pip wheel did not produce a {DISTRIBUTION} wheel in {dest}")
    return built[0]


def download_wheels(spec: PackSpec, dest: Path, *, progress: bool = True) -> dict[str, Any]:
    """Download every wheel ``spec.wheels`` asks for, for ``spec.target``, into ``dest`` (an empty folder).

    Returns ``{"wheels": [Path, ...], "spec": str, "requirements": [...], "target_args": [...]}``, the
    input of :func:`lock_text` and of the manifest's wheels item.

    Raises:
        SourceError: pip failed (its last lines are in the message) or produced a non-wheel for another
            target; ConfigError: a requirements or constraints file does not exist.
    """
    wheels = spec.wheels
    dest.mkdir(parents=True, exist_ok=True)
    requirements = list(wheels.requirements)
    for req_file in wheels.requirements_files:
        if not Path(req_file).is_file():
            raise ConfigError(f"requirements file {req_file} does not exist")
    include_ferry = wheels.include_ferry
    if include_ferry is None:
        include_ferry = not requirements and not wheels.requirements_files
    if include_ferry and not requirements and not wheels.requirements_files:
        requirements = ferry_requirements()
    constraints = wheels.constraints or default_constraints()
    if constraints is not None and not Path(constraints).is_file():
        raise ConfigError(f"constraints file {constraints} does not exist")

    t_args = target_args(spec.target)
    args = ["download", "--dest", str(dest), "--progress-bar", "on" if progress else "off"]
    if not progress:
        args.append("-q")
    if constraints is not None:
        args += ["-c", str(constraints)]
    if wheels.index_url:
        args += ["--index-url", wheels.index_url]
    for url in wheels.extra_index_urls:
        args += ["--extra-index-url", url]
    for link in wheels.find_links:
        args += ["--find-links", link]
    args += t_args
    for req_file in wheels.requirements_files:
        args += ["-r", str(req_file)]
    args += requirements
    if requirements or wheels.requirements_files:
        _run_pip(args, what="pip download", progress=progress)

    others = [p for p in dest.iterdir() if p.is_file() and not p.name.endswith(".whl")]
    if others and t_args:
        raise SourceError(f"pip download gave non-wheel files for a foreign target: {[p.name for p in others]}")
    for sdist in others:  # this host: build the sdist into a wheel the isolated host can install
        _run_pip(["wheel", "--no-deps", "-q", "-w", str(dest), str(sdist)], what=f"building {sdist.name}",
                 progress=progress)
        sdist.unlink()
    if include_ferry:
        build_ferry_wheel(dest, progress=progress)
    found = sorted(p for p in dest.iterdir() if p.name.endswith(".whl"))
    if not found:
        raise SourceError("no wheels were downloaded (empty requirements?); use --no-wheels to pack none")
    described = [*requirements, *(f"-r {Path(f).name}" for f in wheels.requirements_files)]
    if include_ferry:
        described.append(DISTRIBUTION)
    return {
        "wheels": found,
        "spec": " ".join(described),
        "requirements": described,
        "target_args": t_args,
        "constraints": Path(constraints).read_text(encoding="utf-8") if constraints else None,
    }


def lock_text(meta: dict[str, Any], hashes: dict[str, str]) -> str:
    """The ``requirements.lock`` text: ``NAME==VERSION --hash=sha256:HEX`` per project, sorted by name.

    ``hashes`` maps wheel file names to their sha256 (computed while the wheels were copied into the bundle).
    Two wheels of one project and version (e.g. two platforms) share a line with two ``--hash`` options.

    Raises:
        SourceError: two different versions of one project (the set would not install with --require-hashes).
    """
    projects: dict[str, tuple[str, list[str]]] = {}
    for path in meta["wheels"]:
        name, version = parse_wheel_filename(Path(path).name)
        if name in projects and projects[name][0] != version:
            raise SourceError(f"two versions of {name} in the wheel set: {projects[name][0]} and {version}")
        projects.setdefault(name, (version, []))[1].append(hashes[Path(path).name])
    lines = ["# ferry wheel lock: pip install --no-index --find-links . --require-hashes -r requirements.lock"]
    for name in sorted(projects):
        version, digests = projects[name]
        lines.append(f"{name}=={version} " + " ".join(f"--hash=sha256:{d}" for d in sorted(set(digests))))
    return "\n".join(lines) + "\n"
