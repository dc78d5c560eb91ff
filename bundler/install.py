"""``ferry install``: verify a bundle and install it into a prefix, straight from a directory, an archive or
its volumes.

The work is done by :mod:`bundler.installer` (the same code the bundle's generated ``install.py`` runs with a
bare ``python3``; :mod:`bundler.installer.install` draws the installed prefix). This module adds a tqdm bar and a
typed report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bundler.format import POLICY_NAME
from bundler.installer import records
from bundler.installer.install import install_bundle
from bundler.installer.report import say
from bundler.installer.scan import Scan
from bundler.installer.signature import precheck_signature
from bundler.verify import byte_progress
from ferry.errors import NotInstalledError
from ferry.fsutil import format_bytes


@dataclass
class InstallReport:
    """The outcome of :func:`install`.

    ``models``: one dict per model (``repo_id``, ``revision``, ``path`` of the snapshot, ``blobs_added``,
    ``blobs_shared`` or ``outcome``); ``datasets``: one dict per dataset (``name``, ``path``, ``entries``
    added to ``dataset_info.json``); ``venv``: the ``PREFIX/venv`` link or None; ``files_checked`` /
    ``bytes_checked``: what was hashed while staging; ``already_installed``: this bundle_id was installed
    before with the same manifest; ``repaired``: installed files that were missing or corrupt and were put
    back from the bundle; ``seconds``: wall time.
    """

    bundle: Path
    prefix: Path
    name: str
    bundle_id: str
    models: list[dict[str, Any]]
    datasets: list[dict[str, Any]]
    venv: Path | None
    env_file: Path
    files_checked: int
    bytes_checked: int
    already_installed: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    signature: dict | None = None
    #: a delta bundle: ``{"from_base", "rebuilt", "reused_bytes"}`` (files taken from the prefix, files rebuilt
    #: by tensor, bytes not carried); None for a full bundle
    delta: dict | None = None
    #: serving engine name -> its ``PREFIX/engines/NAME`` link (each its own environment)
    engines: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """A few lines for the CLI."""
        lines = []
        for m in self.models:
            lines.append(f"model    {m['repo_id']} @ {str(m['revision'])[:12]} -> {m['path']}")
        for d in self.datasets:
            lines.append(
                f"dataset  {d['name']} -> {d['path']} (dataset_info: {', '.join(d['entries']) or '-'}"
                + (f"; datasets.load_dataset({d['repo_id']!r})" if d.get("arrow_cache") else "")
                + ")"
            )
        if self.venv:
            lines.append(f"venv     {self.venv}")
        for name, link in sorted(self.engines.items()):
            lines.append(f"engine   {name} -> {link} (ferry serve --engine {name})")
        lines += [f"note     {n}" for n in self.notes]
        lines += [f"repaired {r}" for r in self.repaired]
        if self.delta:
            lines.append(
                f"delta    {self.delta['from_base']} file(s) taken from the prefix (re-hashed first), "
                f"{self.delta['rebuilt']} rebuilt by tensor; "
                f"{format_bytes(self.delta['reused_bytes'])} not carried"
            )
        if self.signature:
            lines.append(
                f"signed   by {self.signature['principal']} ({self.signature['key']}), allowed by "
                f"{self.signature['allowed_signers']}"
            )
        if self.already_installed:
            state = (
                f"already installed; {len(self.repaired)} damaged file(s) repaired"
                if self.repaired
                else "already installed; every installed file checked, nothing changed"
            )
        else:
            state = "installed"
        lines.append(
            f"{self.name} ({self.bundle_id}) {state}: {self.files_checked} files, "
            f"{format_bytes(self.bytes_checked)} verified in {self.seconds:.1f} s"
        )
        lines.append(f"now run:  source {self.env_file}")
        return "\n".join(lines)


def install(
    bundle: str | Path,
    prefix: str | Path,
    *,
    create_venv: bool = True,
    manifest: str | Path | None = None,
    progress: bool = False,
    private: bool = False,
    replace_datasets: bool = False,
    allowed_signers: str | Path | None = None,
    require_signature: bool = False,
    compile_bytecode: bool = True,
) -> InstallReport:
    """Verify ``bundle`` (directory, ``NAME.ferry.tar`` or ``NAME.ferry.tar.000``) and install it into
    ``prefix``.

    Steps: free-space check up front; stream-extract (or copy) every file into ``PREFIX/.staging-XXXX`` while
    hashing it; compare with the manifest (or ``manifest``, one brought over a separate channel); create
    ``PREFIX/venvs/<bundle_id>`` from the bundle's wheels with ``pip install --no-index --require-hashes``
    (when it has wheels and ``create_venv``); place models in the Hugging Face cache ``PREFIX/hf-home/hub``
    (ModelScope models in ``PREFIX/modelscope/models``), datasets in ``PREFIX/datasets`` with a merged
    LLaMA-Factory ``dataset_info.json``; switch ``PREFIX/venv``; write ``PREFIX/ferry.env``. A failure at any
    point leaves earlier installs as they were; installing the same bundle again re-hashes what it installed
    and repairs missing or corrupt files, changing nothing else.

    Every manifest field is validated before anything is written and every destination is proven to lie
    inside ``prefix`` (symbolic links already there resolved). Files are 0644 and folders 0755 whatever the
    umask (a shared prefix installed by root is usable by every account); ``private``: 0600 / 0700.
    ``replace_datasets``: an installed dataset of the same name (folder or dataset_info.json entry) with other
    content is replaced (kept until the install completes) instead of refused. ``compile_bytecode`` false skips
    compiling the venv's modules while installing (a faster install; each compiles when first imported).

    Signatures: ``allowed_signers`` (an OpenSSH allowed_signers file) requires a valid signature by one of
    its signers and, the first time, is recorded as the prefix's policy (``PREFIX/.ferry/allowed_signers``):
    every later install into the prefix then requires a valid signature by those signers, with or without
    the option. ``require_signature`` refuses an unsigned bundle (needs signers from the option or the
    policy).

    Raises:
        UnsafeArchiveError: a manifest field that would reach outside the prefix (named), a destination that
            resolves outside it; nothing was written.
        PrefixError: the prefix is read-only or belongs to another account.
        InsufficientSpaceError: up front, naming the bytes needed and the directory.
        IntegrityError, UnsafeArchiveError, BundleError: see :func:`bundler.verify.verify`; nothing installed.
        BundleError: the wheels target another Python version, or venv creation / pip failed; a different
            allowed_signers than the prefix's policy; ssh-keygen missing or older than OpenSSH 8.2.
        IntegrityError (one line): unsigned, forged or wrong signer while a signature is required.
    """
    bundle = Path(bundle)
    started = time.perf_counter()
    policy = Path(prefix) / ".ferry" / POLICY_NAME
    signers = Path(allowed_signers) if allowed_signers else (policy if policy.is_file() else None)
    if signers is not None:  # refuse a bad signature from the metadata head, before reading the payload
        precheck_signature(bundle, signers, Path(manifest) if manifest else None)
    with byte_progress(bundle, "install", progress) as callback:
        found, scan, summary = install_bundle(
            bundle,
            Path(prefix),
            create_venv=create_venv,
            reference=Path(manifest) if manifest else None,
            progress=callback,
            log=(lambda message: None) if not progress else say,
            private=private,
            replace_datasets=replace_datasets,
            allowed_signers=Path(allowed_signers) if allowed_signers else None,
            require_signature=require_signature,
            compile_bytecode=compile_bytecode,
        )
    return _report(bundle, Path(prefix).absolute(), found, scan, summary, started)


def _report(bundle: Path, prefix: Path, found: dict, scan: Scan, summary: dict, started: float) -> InstallReport:
    """The :class:`InstallReport` of an install of ``bundle`` into ``prefix`` (absolute): the verified manifest
    ``found``, the staging pass's ``scan``, :func:`install_bundle`'s ``summary``; ``started``: perf_counter()
    seconds when the install began."""
    return InstallReport(
        bundle=bundle,
        prefix=prefix,
        name=found["name"],
        bundle_id=found["bundle_id"],
        models=summary["models"],
        datasets=summary["datasets"],
        venv=Path(summary["venv"]) if summary["venv"] else None,
        env_file=prefix / "ferry.env",
        files_checked=len(scan.observed),
        bytes_checked=scan.bytes_read,
        already_installed=summary["already_installed"],
        seconds=time.perf_counter() - started,
        notes=summary["notes"],
        repaired=summary["repaired"],
        signature=getattr(scan, "signature", None),
        delta=summary.get("delta"),
        engines=summary.get("engines") or {},
    )


def prefix_env(prefix: str | os.PathLike) -> dict[str, str]:
    """The environment an installed prefix needs (what ``PREFIX/ferry.env`` exports): FERRY_HOME, HF_HOME,
    MODELSCOPE_CACHE, FERRY_DATASET_DIR, every offline switch of ``ferry.constants.OFFLINE_ENV`` and, when
    the prefix has a venv, PATH with its ``bin`` first."""
    return records.prefix_env(prefix)


def read_env_file(prefix: str | os.PathLike) -> str:
    """The text of ``PREFIX/ferry.env``.

    Raises:
        NotInstalledError: no bundle was installed into ``prefix``.
    """
    path = Path(prefix) / "ferry.env"
    if not path.is_file():
        raise NotInstalledError(
            f"{path} does not exist: install a bundle first (ferry install BUNDLE --prefix {prefix})"
        )
    return path.read_text("utf-8")
