"""bundler: pack models, datasets and wheels into one checksummed bundle; verify and install it offline.

Public API::

    pack(spec, out_dir, sign=None, base=None) -> PackResult             online host (base: a delta bundle)
    write_state(prefix, output) -> StateReport                          what a prefix holds: a delta's base
    load_spec(path, **flags) -> PackSpec
    inspect_bundle(bundle, allowed_signers=None) -> Inspection          metadata head only
    verify(bundle, manifest=None, allowed_signers=None) -> VerifyReport
    verify_prefix(prefix) -> PrefixReport                               an installed prefix vs its manifests
    install(bundle, prefix, allowed_signers=None) -> InstallReport       isolated host
    recover_interrupted_install(prefix) -> bool                          roll back an install killed part-way
    prefix_env(prefix) -> dict[str, str]
"""

from __future__ import annotations

from bundler.delta import StateReport, write_state
from bundler.inspect import Inspection
from bundler.inspect import inspect as inspect_bundle
from bundler.install import InstallReport, install, prefix_env
from bundler.installer.install import recover_interrupted_install
from bundler.pack import PackResult, pack
from bundler.spec import PackSpec, load_spec
from bundler.verify import PrefixReport, VerifyReport, verify, verify_prefix

__all__ = [
    "InstallReport",
    "Inspection",
    "PackResult",
    "PackSpec",
    "PrefixReport",
    "StateReport",
    "VerifyReport",
    "inspect_bundle",
    "install",
    "load_spec",
    "pack",
    "prefix_env",
    "recover_interrupted_install",
    "verify",
    "verify_prefix",
    "write_state",
]
