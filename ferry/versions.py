"""The installed versions of the libraries ferry runs on, and the one-line refusal of a feature that needs a newer
one than pyproject.toml's floor.

pyproject.toml's floors are what every run needs; a feature that alone needs a newer release checks here, before it
starts, and refuses in one line naming the feature, the installed version and the version it needs (a GPU host
often comes with its own torch or transformers preinstalled). Versions are read from the installed distributions'
metadata (``importlib.metadata``): nothing is imported.
"""

from __future__ import annotations

import importlib.metadata

from ferry.errors import FerryError


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``torch``, ``transformers``, ``peft``...), None when absent."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def at_least(installed: str, needed: str) -> bool:
    """Whether release ``installed`` is ``needed`` or newer, comparing release numbers only: a local or
    pre-release build of a release counts as that release (``2.8.0a0+nv25.05`` is 2.8, as NVIDIA's containers
    label their torch)."""
    from packaging.version import InvalidVersion, Version

    try:
        have, want = Version(installed).release, Version(needed).release
    except InvalidVersion:
        return False
    width = max(len(have), len(want))
    return have + (0,) * (width - len(have)) >= want + (0,) * (width - len(want))


def require_version(distribution: str, needed: str, feature: str, error: type[FerryError]) -> None:
    """Refuse ``feature`` unless ``distribution`` >= ``needed`` is installed.

    Raises:
        error: one line naming the feature, the installed version (or its absence) and the version needed.
    """
    installed = installed_version(distribution)
    if installed is not None and at_least(installed, needed):
        return
    have = f"{distribution} {installed} is installed" if installed else f"{distribution} is not installed"
    raise error(
        f"{feature} needs {distribution} >= {needed}, and {have}; install {distribution}>={needed} (ferry pack "
        f"carries the versions its constraints name)"
    )


__all__ = ["at_least", "installed_version", "require_version"]
