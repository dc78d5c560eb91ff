"""``ferry verify``: check every byte of a bundle against its manifest without installing anything.

The work is done by :mod:`bundler.installer` (the same code the bundle's generated ``install.py`` runs); this
module adds a tqdm progress bar and a typed report.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bundler.installer import prefix as installed_prefix
from bundler.installer.check import bundle_bytes, check_bundle
from bundler.installer.report import integrity_error
from bundler.installer.signature import precheck_signature
from ferry.fsutil import format_bytes


@contextlib.contextmanager
def byte_progress(bundle: Path, verb: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar over the bundle's bytes (``"verify NAME"``, ``"install NAME"``) while the block runs; yields
    its ``update(n_bytes)`` callback, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    bar = tqdm(
        total=bundle_bytes(bundle),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"{verb} {bundle.name}",
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()


@dataclass
class VerifyReport:
    """The outcome of a successful :func:`verify`.

    ``files_checked``: regular files read and hashed (content, install.py, manifest.json, SHA256SUMS);
    ``bytes_checked``: content bytes hashed; ``seconds``: wall time; ``problems``: always empty on return
    (a bundle with problems raises), kept so callers can print one shape; ``signature``: with
    ``allowed_signers``, ``{"principal", "key", "allowed_signers"}`` of the good signature, else None.
    """

    bundle: Path
    name: str
    bundle_id: str
    format_version: int
    items: int
    files_checked: int
    bytes_checked: int
    seconds: float
    reference: Path | None = None
    problems: list[str] = field(default_factory=list)
    signature: dict | None = None
    #: a delta bundle: the sha256 of its base document and how many files it expects the prefix to hold
    base: str | None = None
    from_base: int = 0

    def summary(self) -> str:
        """One line for the CLI: ``OK: N files, X verified in S s (R/s)``."""
        rate = self.bytes_checked / self.seconds if self.seconds > 0 else 0.0
        against = f" against {self.reference}" if self.reference else ""
        signed = (
            f"; signature good, by {self.signature['principal']} ({self.signature['key']})" if self.signature else ""
        )
        return (
            f"OK: {self.name} ({self.bundle_id}): {self.items} item(s), {self.files_checked} files, "
            f"{format_bytes(self.bytes_checked)} verified{against} in {self.seconds:.1f} s "
            f"({format_bytes(rate)}/s){signed}"
            + (
                f"; a delta bundle (base {self.base[:12]}): {self.from_base} file(s) must already be in the "
                f"prefix, ferry install checks them before writing anything"
                if self.base
                else ""
            )
        )


def verify(
    bundle: str | Path,
    manifest: str | Path | None = None,
    *,
    progress: bool = False,
    allowed_signers: str | Path | None = None,
    require_signature: bool = False,
) -> VerifyReport:
    """Verify a bundle directory, a ``NAME.ferry.tar`` or its first volume ``NAME.ferry.tar.000``.

    Archives are streamed once; each member is hashed as it is read and compared with ``manifest.json`` at
    the end. ``manifest``: a manifest brought over a separate channel; it is the reference and the bundle's
    own ``manifest.json`` must equal it. ``progress`` shows a tqdm bar (bytes) on stderr.
    ``allowed_signers``: an OpenSSH allowed_signers file; the bundle must then carry a valid
    ``ssh-keygen -Y sign -n ferry-bundle`` signature over the exact manifest bytes trusted (``manifest``'s
    when given) by one of its signers. ``require_signature`` without ``allowed_signers`` is refused.

    Raises:
        IntegrityError: every missing, extra, truncated or mismatched file (and SHA256SUMS line) is listed;
            ``exc.problems`` holds the list.
        UnsafeArchiveError: an archive member that would escape the bundle (absolute, ``..``, outside link,
            device, duplicate).
        BundleError: not a bundle, no manifest, a missing volume, a newer ``format_version``; ssh-keygen
            missing or older than OpenSSH 8.2 when a signature must be checked.
        IntegrityError (one line): with ``allowed_signers``, an unsigned bundle, a signature that does not
            match the manifest (forged), or one by a key not in the file (wrong signer).
    """
    bundle = Path(bundle)
    started = time.perf_counter()
    if allowed_signers:  # refuse a bad signature from the metadata head, before reading the payload
        precheck_signature(bundle, Path(allowed_signers), Path(manifest) if manifest else None)
    with byte_progress(bundle, "verify", progress) as callback:
        found, scan = check_bundle(
            bundle,
            Path(manifest) if manifest else None,
            callback,
            allowed_signers=Path(allowed_signers) if allowed_signers else None,
            require_signature=require_signature,
        )
    return VerifyReport(
        bundle=bundle,
        name=found["name"],
        bundle_id=found["bundle_id"],
        format_version=found["format_version"],
        items=len(found["items"]),
        files_checked=len(scan.observed),
        bytes_checked=scan.bytes_read,
        seconds=time.perf_counter() - started,
        reference=Path(manifest) if manifest else None,
        signature=getattr(scan, "signature", None),
        base=found.get("base"),
        from_base=sum(1 for i in found["items"] for f in i["files"] if f.get("delta") == "from_base"),
    )


@dataclass
class PrefixReport:
    """The outcome of a successful :func:`verify_prefix`: ``bundles`` recorded in the prefix, ``files_checked``
    installed files re-hashed (model snapshots, datasets, ModelScope folders, venv files by their RECORD),
    ``bytes_checked`` their bytes, ``seconds`` wall time."""

    prefix: Path
    bundles: int
    files_checked: int
    bytes_checked: int
    seconds: float

    def summary(self) -> str:
        """One line for the CLI."""
        return (
            f"OK: {self.prefix}: {self.bundles} bundle(s), {self.files_checked} installed files, "
            f"{format_bytes(self.bytes_checked)} match their manifests ({self.seconds:.1f} s)"
        )


def verify_prefix(prefix: str | Path) -> PrefixReport:
    """Re-hash every file installed into ``prefix`` against the manifests recorded there, offline (what
    ``hf cache verify`` cannot do without the hub): model snapshots and their blobs, datasets and ModelScope
    folders (missing, changed, extra files), each bundle's venv against its wheels' RECORD hashes, ferry.env.

    Raises:
        IntegrityError: every drifted file is named; ``exc.problems`` holds the list.
        BundleError: ``prefix`` holds no install record.
    """
    prefix = Path(prefix)
    started = time.perf_counter()
    found = installed_prefix.verify_prefix(prefix)
    if found["problems"]:
        raise integrity_error(found["problems"], f"prefix {prefix} drifted from its manifests")
    return PrefixReport(
        prefix=prefix.absolute(),
        bundles=found["bundles"],
        files_checked=found["files"],
        bytes_checked=found["bytes"],
        seconds=time.perf_counter() - started,
    )
