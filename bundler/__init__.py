"""bundler: pack models, datasets and wheels into one checksummed bundle; verify and install it offline.

Public API (imported lazily so that ``bundler.standalone`` and ``bundler.format`` stay standard-library only)::

    pack(spec, out_dir) -> PackResult          online host
    load_spec(path, **flags) -> PackSpec
    verify(bundle, manifest=None) -> VerifyReport
    install(bundle, prefix) -> InstallReport   isolated host
    prefix_env(prefix) -> dict[str, str]
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PackSpec": "bundler.spec",
    "load_spec": "bundler.spec",
    "pack": "bundler.pack",
    "PackResult": "bundler.pack",
    "verify": "bundler.verify",
    "VerifyReport": "bundler.verify",
    "install": "bundler.install",
    "InstallReport": "bundler.install",
    "prefix_env": "bundler.install",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bundler' has no attribute {name!r}")
