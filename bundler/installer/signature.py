"""Bundle signatures, and the metadata head of a bundle that carries them.

``ferry pack --sign KEY`` signs manifest.json's exact bytes with ``ssh-keygen -Y sign -n ferry-bundle``; the
signature is the member ``manifest.json.sig`` (second in the archive) and the file ``NAME.ferry.sig``
beside the bundle. Checking it needs ``ssh-keygen -Y find-principals`` and ``-Y verify`` (OpenSSH >= 8.2)
and an OpenSSH allowed_signers file; the principal it names is the signer shown to the user. A prefix
policy is that file copied to ``PREFIX/.ferry/allowed_signers``: every later install into the prefix must
then carry a valid signature by one of those signers.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

from bundler.format import (
    ARCHIVE_SUFFIX,
    MANIFEST_NAME,
    POLICY_NAME,
    SBOM_NAME,
    SIGNATURE_NAME,
    SIGNATURE_NAMESPACE,
    SIGNATURE_SUFFIX,
)
from bundler.installer.archive import MAX_METADATA_BYTES, TarHeaders, VolumeReader, archive_volumes, member_path
from bundler.installer.fs import atomic_text
from bundler.installer.report import integrity_error
from bundler.installer.scan import Scan
from ferry.errors import BundleError, IntegrityError

#: The metadata members an archive starts with, in this order (the signature only when signed).
HEAD_MEMBERS = (MANIFEST_NAME, SIGNATURE_NAME, SBOM_NAME)


_NO_SSHSIG = (
    "checking bundle signatures needs ssh-keygen -Y (OpenSSH >= 8.2){found}: verify on a host that has "
    "it (ssh-keygen -Y verify -f ALLOWED_SIGNERS -I SIGNER -n ferry-bundle -s manifest.json.sig "
    "< manifest.json), bring that manifest.json here and pass it with --manifest FILE instead"
)


def ssh_keygen(args: list[str], data: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``ssh-keygen ARGS`` with ``data`` on stdin; return the finished process (bytes output).

    Raises:
        BundleError: ssh-keygen is missing or too old for ``-Y`` (one line saying how to verify elsewhere).
    """
    try:
        proc = subprocess.run(["ssh-keygen", *args], input=data, capture_output=True, timeout=120)
    except FileNotFoundError:
        raise BundleError(_NO_SSHSIG.format(found=", and ssh-keygen is not installed here")) from None
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0 and re.search(
        r"(illegal|unknown|invalid) option -- Y|unsupported operation|"
        r"Unsupported operation|Usage: ssh-keygen -Y",
        err,
    ):
        raise BundleError(_NO_SSHSIG.format(found=", which this host's ssh-keygen lacks"))
    return proc


def _signature_key(data: bytes, sig_file: Path) -> str | None:
    """``'ED25519 key SHA256:...'`` when ``sig_file`` is a well-formed signature over ``data`` (not checked
    against any allowed signer: ``ssh-keygen -Y check-novalidate``), else None."""
    proc = ssh_keygen(["-Y", "check-novalidate", "-n", SIGNATURE_NAMESPACE, "-s", str(sig_file)], data)
    match = re.search(r"with (\S+ key \S+)", proc.stdout.decode("utf-8", "replace"))
    return match.group(1) if proc.returncode == 0 and match else None


def verify_signature(data: bytes, signature: bytes, allowed_signers: Path, what: str = MANIFEST_NAME) -> dict:
    """Check ``signature`` (an SSHSIG armoured ``ssh-keygen -Y sign -n ferry-bundle`` signature) over the exact
    bytes ``data`` against the OpenSSH ``allowed_signers`` file.

    Returns ``{"principal": signer identity from allowed_signers, "key": "ED25519 key SHA256:...",
    "allowed_signers": path}``.

    Raises:
        IntegrityError: (one line) the signature does not match ``data`` (altered after signing: forged or
            damaged), or its key is not listed in ``allowed_signers`` (wrong signer).
        BundleError: ``allowed_signers`` cannot be read, ssh-keygen is missing or older than 8.2.
    """
    allowed_signers = Path(allowed_signers)
    if not allowed_signers.is_file():
        raise BundleError(f"{allowed_signers}: no such allowed_signers file")
    with tempfile.TemporaryDirectory(prefix="ferry-sig-") as tmp:
        sig_file = Path(tmp) / SIGNATURE_NAME
        sig_file.write_bytes(signature)
        key = _signature_key(data, sig_file)
        if key is None:
            raise _signature_refused(
                f"the signature of {what} does not match its bytes ({what} was altered "
                f"after signing: a forged or damaged bundle)"
            )
        found = ssh_keygen(["-Y", "find-principals", "-s", str(sig_file), "-f", str(allowed_signers)])
        principals = [p for p in found.stdout.decode("utf-8", "replace").split() if p]
        if found.returncode != 0 or not principals:
            raise _signature_refused(
                f"{what} is signed by {key}, which is not an allowed signer in {allowed_signers} (wrong signer)"
            )
        for principal in principals:
            proc = ssh_keygen(
                [
                    "-Y",
                    "verify",
                    "-f",
                    str(allowed_signers),
                    "-I",
                    principal,
                    "-n",
                    SIGNATURE_NAMESPACE,
                    "-s",
                    str(sig_file),
                ],
                data,
            )
            if proc.returncode == 0:
                return {"principal": principal, "key": key, "allowed_signers": str(allowed_signers)}
    raise _signature_refused(
        f"the signature of {what} by {key} does not verify against {allowed_signers} "
        f"for namespace {SIGNATURE_NAMESPACE!r}"
    )


def _signature_refused(reason: str) -> IntegrityError:
    err = IntegrityError(f"signature check failed: {reason}; refused")
    err.problems = [reason]  # type: ignore[attr-defined]
    return err


def _bundle_base(bundle: Path) -> tuple[Path, str]:
    """(folder holding the bundle, NAME) for a bundle directory, ``NAME.ferry.tar`` or its volume."""
    bundle = Path(bundle)
    if bundle.is_dir():
        return bundle.absolute().parent, bundle.absolute().name
    name = re.sub(re.escape(ARCHIVE_SUFFIX) + r"(\.\d+)?$", "", bundle.name)
    return bundle.absolute().parent, name


def read_head(bundle: Path) -> dict:
    """The metadata of a bundle without reading its content: ``{"manifest", "signature", "sbom"}`` (bytes or
    None), ``"signature_source"`` (where the signature came from), ``"members"`` (head member names read)
    and ``"bytes_read"`` (bytes read from the bundle, for the < 1 % promise of ``ferry inspect``).

    An archive (or its first volume) is read from the start up to the first header of a content member; the
    signature falls back to ``NAME.ferry.sig`` beside the bundle.

    Raises:
        BundleError: no manifest.json among the first members (an archive packed before ferry wrote metadata
            first: use ``ferry verify``), or a missing archive.
        UnsafeArchiveError / IntegrityError: a corrupt or unsafe head.
    """
    bundle = Path(bundle)
    head: dict = {
        "manifest": None,
        "signature": None,
        "sbom": None,
        "signature_source": None,
        "members": [],
        "bytes_read": 0,
    }
    if bundle.is_dir():
        _read_head_folder(bundle, head)
    else:
        _read_head_archive(bundle, head)
    if head["manifest"] is None:
        raise BundleError(
            f"{bundle}: {MANIFEST_NAME} is not among the first members (packed by an older ferry or "
            f"another tool); use ferry verify, which reads the whole bundle"
        )
    if head["signature"] is None:
        folder, name = _bundle_base(bundle)
        beside = folder / f"{name}{SIGNATURE_SUFFIX}"
        if beside.is_file():
            signature = beside.read_bytes()
            head["signature"], head["signature_source"] = signature, str(beside)
            head["bytes_read"] += len(signature)
    return head


def _read_head_folder(bundle: Path, head: dict) -> None:
    """Fill ``head`` (see :func:`read_head`) from a bundle directory's metadata files (symbolic links ignored)."""
    for key, name in (("manifest", MANIFEST_NAME), ("signature", SIGNATURE_NAME), ("sbom", SBOM_NAME)):
        path = bundle / name
        if path.is_file() and not path.is_symlink():
            head[key] = path.read_bytes()
            head["members"].append(name)
            head["bytes_read"] += len(head[key])
    if head["signature"] is not None:
        head["signature_source"] = str(bundle / SIGNATURE_NAME)


def _head_volumes(bundle: Path) -> list[Path]:
    """The volumes to read the head of ``bundle`` from: for a volume ``NAME.ferry.tar.NNN``, it and the consecutive
    ones beside it (the later ones may be absent), else :func:`archive_volumes`.

    Raises:
        BundleError: the volume (or the archive) is missing.
    """
    if re.search(re.escape(ARCHIVE_SUFFIX) + r"\.\d+$", bundle.name):  # a volume: the later ones may be absent
        if not bundle.is_file():
            raise BundleError(f"{bundle}: no such volume")
        stem, _, index = bundle.name.rpartition(".")
        volumes = [bundle]
        while (bundle.parent / f"{stem}.{int(index) + len(volumes):0{len(index)}d}").is_file():
            volumes.append(bundle.parent / f"{stem}.{int(index) + len(volumes):0{len(index)}d}")
        return volumes
    _, volumes, _ = archive_volumes(bundle)
    return volumes


def _read_head_archive(bundle: Path, head: dict) -> None:
    """Fill ``head`` (see :func:`read_head`) from an archive or its first volume: the members from the start up to
    the first header of a content member.

    Raises:
        BundleError: a missing volume, a head member over :data:`MAX_METADATA_BYTES`.
        UnsafeArchiveError / IntegrityError: a corrupt or unsafe head.
    """
    reader = VolumeReader(_head_volumes(bundle))  # forward only: opens .001 only when a tiny head spans volumes
    headers = TarHeaders(reader)
    scan = Scan()
    try:
        while True:
            member = headers.next()
            if member is None:
                break
            rel = member_path(member, scan)
            if rel not in HEAD_MEMBERS or not member.isreg():
                break
            if member.size > MAX_METADATA_BYTES:
                raise BundleError(f"{rel} in {bundle.name} is {member.size} bytes: too large")
            data = reader.read(member.size)
            if len(data) != member.size:
                raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
            head[{MANIFEST_NAME: "manifest", SIGNATURE_NAME: "signature", SBOM_NAME: "sbom"}[rel]] = data
            head["members"].append(rel)
    except (tarfile.TarError, EOFError) as exc:
        if head["manifest"] is None or reader._fh is not None:  # else: the head volume alone is here
            raise integrity_error(
                [f"{bundle.name}: corrupt archive head at {reader.position()}: {exc}"], "archive check failed"
            ) from None
    finally:
        head["bytes_read"] = reader.total
        reader.close()
    if head["signature"] is not None:
        head["signature_source"] = f"{bundle.name}:{SIGNATURE_NAME}"


def _scanned_signature(bundle: Path, scan: Scan, dest: Path | None) -> bytes | None:
    """The signature bytes belonging to a scanned bundle: the ``manifest.json.sig`` member the scan read (kept
    in memory, so exactly the bytes SHA256SUMS was checked against), else ``NAME.ferry.sig`` beside the
    bundle, else None."""
    if scan.signature_bytes is not None:
        return scan.signature_bytes
    folder, name = _bundle_base(bundle)
    beside = folder / f"{name}{SIGNATURE_SUFFIX}"
    return beside.read_bytes() if beside.is_file() else None


def check_signature(
    bundle: Path,
    scan: Scan,
    problems: list[str],
    reference: Path | None = None,
    allowed_signers: Path | None = None,
    require_signature: bool = False,
    dest: Path | None = None,
) -> list[str]:
    """Called by :func:`check_bundle` right after the scan was compared with the manifest (which cannot list its
    own signature; :func:`check_scan` leaves that member out, SHA256SUMS lists it): when ``allowed_signers`` is
    given, check the signature over the exact manifest bytes that are then
    trusted (``reference``'s when given, else the bundle's own). Sets ``scan.signature`` (the dict of
    :func:`verify_signature`, or None) and returns the remaining problems.

    Raises:
        IntegrityError: (one line) unsigned, forged or wrong signer while a signature is required.
        BundleError: ``require_signature`` without ``allowed_signers``; ssh-keygen missing or too old.
    """
    scan.signature = None
    if problems or (allowed_signers is None and not require_signature):
        return problems
    if allowed_signers is None:
        raise BundleError("a signature is required but no allowed_signers file was given (--allowed-signers FILE)")
    signature = _scanned_signature(bundle, scan, dest)
    if signature is None:
        raise _signature_refused(
            f"{bundle} is not signed (no {SIGNATURE_NAME} inside, no "
            f"{_bundle_base(bundle)[1]}{SIGNATURE_SUFFIX} beside it) and a signature "
            f"by {allowed_signers} is required"
        )
    data = Path(reference).read_bytes() if reference is not None else scan.manifest_bytes
    assert data is not None
    scan.signature = verify_signature(
        data,
        signature,
        allowed_signers,
        str(reference) if reference is not None else MANIFEST_NAME,
    )
    return problems


def precheck_signature(bundle: Path, allowed_signers: Path, reference: Path | None = None) -> dict | None:
    """Refuse an unsigned, forged or wrongly signed bundle from its metadata head alone, before its payload
    is read (a 100 GB bundle is then refused in a second, not after the full pass). The check after the
    scan (:func:`check_signature`) stays the one that counts; this one only saves time. Returns the
    :func:`verify_signature` dict, or None when the bundle is not laid out metadata-first (then only the
    later check decides).

    Raises:
        IntegrityError: (one line) unsigned, forged or wrong signer.
        BundleError: ssh-keygen missing or older than 8.2; an unreadable allowed_signers file.
    """
    try:
        head = read_head(bundle)
    except BundleError:
        return None
    if head["signature"] is None:
        raise _signature_refused(
            f"{bundle} is not signed (no {SIGNATURE_NAME} inside, no "
            f"{_bundle_base(bundle)[1]}{SIGNATURE_SUFFIX} beside it) and a signature "
            f"by {allowed_signers} is required"
        )
    data = Path(reference).read_bytes() if reference is not None else head["manifest"]
    return verify_signature(
        data, head["signature"], allowed_signers, str(reference) if reference is not None else MANIFEST_NAME
    )


def check_prefix_policy(
    prefix: Path,
    bundle: Path,
    scan: Scan,
    staged: Path,
    reference: Path | None = None,
    allowed_signers: Path | None = None,
    require_signature: bool = False,
) -> dict | None:
    """Called by :func:`install_bundle` once the staged bundle matched its manifest: apply the prefix's
    signature policy (:func:`record_prefix_policy` records a new one once the install is complete).

    The policy is ``PREFIX/.ferry/allowed_signers``. When it exists, the bundle must carry a valid signature
    by one of its signers (a different ``allowed_signers`` file is refused: replace the policy file by hand
    to change it). Otherwise ``allowed_signers`` (when given) is checked, and copied there after the install,
    so that every later install into the prefix requires a signature. ``require_signature`` alone needs one of
    the two. Returns the signature dict of :func:`verify_signature`, or None when no signature was required.

    Raises:
        IntegrityError: unsigned, forged or wrong signer under a policy (one line); nothing is installed.
        BundleError: a conflicting allowed_signers file, or ``require_signature`` with no signers at all.
    """
    policy = Path(prefix) / ".ferry" / POLICY_NAME
    signers = allowed_signers
    if policy.is_file():
        if allowed_signers is not None and Path(allowed_signers).read_bytes() != policy.read_bytes():
            raise BundleError(
                f"{prefix} already pins its signers in {policy}, which differs from "
                f"{allowed_signers}; edit or replace {policy} to change the policy"
            )
        signers = policy
    elif require_signature and allowed_signers is None:
        raise BundleError(f"--require-signature: {prefix} has no signer policy ({policy}); pass --allowed-signers FILE")
    if signers is None:
        return None
    check_signature(bundle, scan, [], reference, signers, True, dest=staged)
    return scan.signature


def record_prefix_policy(prefix: Path, allowed_signers: Path | None) -> None:
    """After a complete install: copy ``allowed_signers`` to ``PREFIX/.ferry/allowed_signers`` when the prefix
    has no policy yet (a failed install records none)."""
    policy = Path(prefix) / ".ferry" / POLICY_NAME
    if allowed_signers is not None and not policy.is_file():
        atomic_text(policy, Path(allowed_signers).read_text("utf-8"))
