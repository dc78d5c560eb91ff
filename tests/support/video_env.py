"""A Python that can process video rows: torchvision and PyAV beside the suite's own packages.

The training set pins torch 2.13.0, and the only torchvision wheels for it on x86_64 (PyPI's 0.28.0) are CUDA
builds that fail to load beside the CPU torch; transformers' video processors need torchvision. The environment
kept here holds torch 2.14.1 and torchvision 0.29.1 (the pair that loads together on a CPU host, a CUDA build run
on the CPU) and PyAV, installed by uv from this host's package sources as pip reads them (its find-links and extra
indexes; PyPI where it names none), once per machine in ``~/.cache/ferry-tests/envs/video-KEY`` (KEY: the
requirements and this Python; a machine-wide lock; a half-built one is built again). :func:`video_python` then
makes a small virtual environment in the test's temp folder whose site path is that environment first, then the
running suite's own site-packages (transformers, peft, ferry's dependencies): the interpreter the video tests run
``ferry`` and ``tests/support/video_probe.py`` with.
"""

from __future__ import annotations

import hashlib
import site
import subprocess
import sys
from pathlib import Path

from uv import find_uv_bin

from bundler.wheels import host_pip_config
from tests.support.suite import LOCK_DIR, kept_build

#: What the kept environment holds.
REQUIREMENTS = ["torch==2.14.1", "torchvision==0.29.1", "av==18.1.0"]


def video_stack() -> Path:
    """The kept environment's site-packages (built now when this machine has none)."""
    key = hashlib.sha256(f"{' '.join(REQUIREMENTS)}\n{sys.version}".encode()).hexdigest()[:16]
    env = kept_build(LOCK_DIR.parent / "envs" / f"video-{key}", "\n".join(REQUIREMENTS) + "\n", _install)
    return next((env / "lib").glob("python3.*/site-packages"))


def _install(env: Path) -> None:
    """A virtual environment in ``env`` holding :data:`REQUIREMENTS`, by uv from this host's package sources."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    argv = [find_uv_bin(), "pip", "install", "-q", "--python", str(env / "bin" / "python"), "--compile-bytecode"]
    config = host_pip_config()  # this host's package sources, as pip would read them
    argv += [f"--extra-index-url={url}" for url in config.get("extra-index-url", "").split()]
    argv += [f"--find-links={path}" for path in config.get("find-links", "").split()]
    proc = subprocess.run([*argv, *REQUIREMENTS], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def video_python(folder: Path) -> Path:
    """A python in ``folder`` (a new virtual environment) that imports the kept environment's torch, torchvision
    and PyAV first and everything else from the running suite's site-packages (their ``.pth`` files honoured)."""
    stack = video_stack()
    if not (folder / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    ours = next(p for p in site.getsitepackages() if p.endswith("site-packages"))
    target = next((folder / "lib").glob("python3.*/site-packages"))
    (target / "ferry-tests-video.pth").write_text(
        f"import site; site.addsitedir({str(stack)!r}); site.addsitedir({ours!r})\n"
    )
    return folder / "bin" / "python"
