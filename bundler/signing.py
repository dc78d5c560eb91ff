"""Signing bundles with an OpenSSH key (``ferry pack --sign KEY``) and checking them.

Why OpenSSH: ``ssh-keygen`` is on every Linux host, banks already manage SSH keys, and git signs commits in
the same format. ``ferry pack --sign KEY`` runs::

    ssh-keygen -Y sign -n ferry-bundle -f KEY  < manifest.json  > manifest.json.sig

over manifest.json's exact bytes, the ones in the bundle directory and in the archive. The signature is the
archive's second member, ``NAME/manifest.json.sig`` in the directory, and ``OUT/NAME.ferry.sig`` beside the
bundle. Anyone can check it by hand with an OpenSSH allowed_signers file (one line per signer:
``alice@bank namespaces="ferry-bundle" ssh-ed25519 AAAA...``)::

    ssh-keygen -Y verify -f allowed_signers -I alice@bank -n ferry-bundle -s manifest.json.sig < manifest.json

``ferry verify --allowed-signers``, ``ferry install --allowed-signers`` and the bundle's ``install.py`` do that
with the functions of :mod:`bundler.installer.signature` (standard library only and part of the generated
``install.py``, so the isolated host needs no ferry), which this module re-exports for the library side.

Signing needs OpenSSH >= 8.1 on the packing host, checking needs >= 8.2 (``-Y find-principals``). An isolated
host with an older OpenSSH (RHEL 8: 8.0) checks the signature on another host and brings the manifest with
``--manifest``; the manifest then vouches for every byte.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bundler.format import SIGNATURE_NAMESPACE
from bundler.installer.signature import _signature_key, read_head, ssh_keygen, verify_signature
from ferry.errors import ConfigError

__all__ = ["Signer", "read_head", "signature_key", "verify_signature"]

#: Upper bound of an SSHSIG armoured signature in bytes (RSA 16384-bit keys give about 5 kB).
MAX_SIGNATURE_BYTES = 16 * 1024


@dataclass(frozen=True)
class Signer:
    """A private OpenSSH key that signs manifests. ``key`` is its path; ``fingerprint`` is
    ``'ED25519 key SHA256:...'`` and ``comment`` the public key's comment (often ``user@host``), both
    recorded in the manifest as who claims to have signed (the check is against allowed_signers)."""

    key: Path
    fingerprint: str
    comment: str

    @classmethod
    def load(cls, key: str | Path) -> Signer:
        """Check that ``key`` is a usable private key by signing a probe (an encrypted key asks for its
        passphrase here, before the long pass, or uses ssh-agent).

        Raises:
            ConfigError: no such file, not a private key, wrong passphrase, or ssh-keygen lacks ``-Y sign``.
        """
        key = Path(key).expanduser()
        if not key.is_file():
            raise ConfigError(f"--sign {key}: no such key file")
        listed = _run(["-l", "-f", str(key)], None, key)
        match = re.match(r"^\d+ (\S+) ?(.*) \((\S+)\)\s*$", listed.stdout.decode("utf-8", "replace"))
        if listed.returncode != 0 or not match:
            raise ConfigError(f"--sign {key}: not an OpenSSH key ({_err(listed)})")
        signer = cls(key=key, fingerprint=f"{match.group(3)} key {match.group(1)}", comment=match.group(2))
        signer.sign(b"ferry probe\n")
        return signer

    def sign(self, data: bytes) -> bytes:
        """The armoured SSHSIG signature of ``data`` (namespace ``ferry-bundle``).

        Raises:
            ConfigError: ssh-keygen refused (wrong passphrase, not a private key).
        """
        proc = _run(["-Y", "sign", "-n", SIGNATURE_NAMESPACE, "-f", str(self.key)], data, self.key)
        if proc.returncode != 0 or b"-----BEGIN SSH SIGNATURE-----" not in proc.stdout:
            raise ConfigError(f"--sign {self.key}: ssh-keygen -Y sign failed: {_err(proc)}")
        if len(proc.stdout) > MAX_SIGNATURE_BYTES:
            raise ConfigError(
                f"--sign {self.key}: the signature is {len(proc.stdout)} bytes, more than the "
                f"{MAX_SIGNATURE_BYTES} ferry reserves; use an ed25519 or ecdsa key"
            )
        return proc.stdout

    def manifest_entry(self) -> dict[str, str]:
        """What the manifest records about the signer (a claim; ``ferry inspect`` shows it as such)."""
        return {"namespace": SIGNATURE_NAMESPACE, "key": self.fingerprint, "comment": self.comment}


def signature_key(data: bytes, signature: bytes) -> str | None:
    """``'ED25519 key SHA256:...'`` when ``signature`` is a well-formed ferry signature over ``data``
    (self-consistent, not checked against any allowed signer), else None. Needs OpenSSH >= 8.2.

    Raises:
        BundleError: ssh-keygen missing or too old.
    """
    with tempfile.TemporaryDirectory(prefix="ferry-sig-") as tmp:
        sig_file = Path(tmp) / "manifest.json.sig"
        sig_file.write_bytes(signature)
        return _signature_key(data, sig_file)


def _run(args: list[str], data: bytes | None, key: Path) -> subprocess.CompletedProcess:
    try:
        return ssh_keygen(args, data)
    except Exception as exc:  # BundleError from the verifier's wording: say it for the signing side
        if "ssh-keygen" in str(exc):
            raise ConfigError(
                f"--sign {key}: signing needs ssh-keygen -Y sign (OpenSSH >= 8.1) on this host: {exc}"
            ) from None
        raise


def _err(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
    return text[-1] if text else f"exit status {proc.returncode}"
