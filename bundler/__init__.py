"""bundler: pack models, datasets and wheels into one checksummed bundle; verify and install it offline.

Public API::

    pack(spec, out_dir) -> PackResult          online host
    load_spec(path, **flags) -> PackSpec
    verify(bundle, manifest=None) -> VerifyReport
    verify_prefix(prefix) -> PrefixReport       an installed prefix against its recorded manifests
    install(bundle, prefix) -> InstallReport   isolated host
    prefix_env(prefix) -> dict[str, str]
"""

from __future__ import annotations

from bundler.spec import PackSpec, load_spec
from bundler.pack import PackResult, pack
from bundler.verify import PrefixReport, VerifyReport, verify, verify_prefix
from bundler.install import InstallReport, install, prefix_env

__all__ = [
    "InstallReport",
    "PackResult",
    "PackSpec",
    "PrefixReport",
    "VerifyReport",
    "install",
    "load_spec",
    "pack",
    "prefix_env",
    "verify",
    "verify_prefix",
]
