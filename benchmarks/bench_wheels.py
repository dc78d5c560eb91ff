"""Wheels for the host target: ferry's resolve (uv) + download (pip, exact URLs) vs a bare ``pip download -r``.

Both sides get the same inputs: ferry's default requirement set (``bundler.wheels.ferry_requirements``, ferry's
own wheel left out because the peer cannot build it either), the project's ``constraints.txt``, and this
machine's local CPU torch wheel folder passed explicitly as ``--find-links`` (read from this host's pip
configuration; without it both sides would fetch the multi-GB CUDA build from PyPI). Neither side reads a pip
configuration file (``PIP_CONFIG_FILE=/dev/null``). Both use their normal caches (pip's HTTP cache, uv's
metadata cache), warmed by one untimed run of each side first, so what is compared is the work each does on a
re-pack: ferry resolves with ``uv pip compile`` and runs one ``pip download --no-deps`` of the resolved URLs;
the peer lets pip resolve and download. The pairs run alternately ``repeats`` times, each into a fresh folder.
Reported: median seconds of each side and the median of the per-pair ratios. Target: ratio <= 1.0.

    python -m benchmarks bench_wheels            # 3 pairs
    python -m benchmarks --quick bench_wheels    # 1 pair
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bundler.spec import load_spec
from bundler.wheels import default_constraints, download, ferry_requirements, host_pip_config, resolve


def local_torch_links() -> list[str]:
    """Folders named by this host's pip configuration (find-links) that hold a torch wheel."""
    return [p for p in host_pip_config().get("find-links", "").split() if list(Path(p).glob("torch-*.whl"))]


def ferry_once(requirements: list[str], links: list[str], dest: Path) -> tuple[float, int]:
    """(seconds, files) for ferry's resolve + download of ``requirements`` for this host into ``dest``."""
    spec = load_spec(name="bench", find_links=links)
    spec.wheels.requirements = list(requirements)
    spec.wheels.include_ferry = False  # the peer cannot build ferry's wheel either
    spec.wheels.constraints = default_constraints()  # what the default set gets (it pins torch)
    started = time.perf_counter()
    files = download(resolve(spec), dest, progress=False)
    return time.perf_counter() - started, len(files)


def pip_once(requirements: list[str], links: list[str], dest: Path) -> tuple[float, int]:
    """(seconds, files) for ``pip download -r`` of the same set with the same explicit inputs."""
    req = dest.parent / f"{dest.name}.txt"
    req.write_text("".join(f"{r}\n" for r in requirements))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        "-r",
        str(req),
    ]
    constraints = default_constraints()
    if constraints is not None:
        cmd += ["-c", str(constraints)]
    for link in links:
        cmd += ["--find-links", link]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    return time.perf_counter() - started, len(list(dest.glob("*")))


def run(quick: bool = False, repeats: int | None = None) -> list[dict]:
    """Warm both caches, run the pairs alternately, return one row (see the module docstring)."""
    repeats = repeats or (1 if quick else 3)
    requirements = ferry_requirements()
    links = local_torch_links()
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-wheels-"))
    try:
        ferry_once(requirements, links, root / "warm-ferry")
        pip_once(requirements, links, root / "warm-pip")
        ferry_set = {x.name for x in (root / "warm-ferry").iterdir()}
        pip_set = {x.name for x in (root / "warm-pip").iterdir()}
        if ferry_set != pip_set:  # the comparison is only fair for the same files
            print(
                f"  bench_wheels: the sets differ: ferry only {sorted(ferry_set - pip_set)}, pip only "
                f"{sorted(pip_set - ferry_set)}",
                file=sys.stderr,
            )
        ferry_s, pip_s, ratios = [], [], []
        for i in range(repeats):
            f, nf = ferry_once(requirements, links, root / f"ferry-{i}")
            p, np_ = pip_once(requirements, links, root / f"pip-{i}")
            shutil.rmtree(root / f"ferry-{i}")
            shutil.rmtree(root / f"pip-{i}")
            ferry_s.append(f)
            pip_s.append(p)
            ratios.append(f / p)
            print(
                f"  bench_wheels run {i + 1}/{repeats}: ferry {f:.2f} s ({nf} files), pip download {p:.2f} s "
                f"({np_} files), ratio {f / p:.2f}",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    where = "local torch wheel via --find-links" if links else "torch from PyPI"
    return [
        {
            "metric": f"resolve + download ferry's default set for this host ({where}, "
            f"{'same' if ferry_set == pip_set else 'DIFFERENT'} {len(ferry_set)} files), s "
            f"(peer: pip download -r)",
            "ferry": statistics.median(ferry_s),
            "peer": statistics.median(pip_s),
            "ratio": statistics.median(ratios),
            "target": "<= 1.0",
        }
    ]


if __name__ == "__main__":
    from benchmarks.__main__ import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
