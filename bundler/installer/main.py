"""``python3 install.py``: the command line of the stand-alone installer (verify, install, check a prefix, state).

Standard library and ferry's foundation only (part of the generated ``install.py``, which ends by calling
:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bundler.installer.check import bundle_bytes, check_bundle
from bundler.installer.fs import atomic_text
from bundler.installer.install import install_bundle
from bundler.installer.prefix import prefix_state, verify_prefix
from bundler.installer.report import PercentProgress, integrity_error
from bundler.installer.scan import Scan
from ferry.errors import FerryError
from ferry.fsutil import format_bytes


def main(argv: list[str] | None = None) -> int:
    """``python3 install.py --prefix DIR [--no-venv] [--no-compile] [--private] [--replace-datasets] [--bundle DIR]
    [--manifest FILE]``, ``python3 install.py --verify-only`` or ``python3 install.py --verify-prefix DIR``."""
    parser = _argument_parser()
    args = parser.parse_args(argv)
    if not (args.verify_only or args.verify_prefix or args.state) and args.prefix is None:
        parser.error("--prefix is required (or use --verify-only / --verify-prefix / --state)")
    if args.state and args.output is None:
        parser.error("--state needs --output FILE")
    try:
        if args.state:
            return _write_prefix_state(args)
        if args.verify_prefix:
            return _check_installed_prefix(args)
        total = bundle_bytes(args.bundle)
        if args.verify_only:
            return _verify_bundle_only(args, total)
        _, scan, summary = install_bundle(
            args.bundle,
            args.prefix,
            create_venv=not args.no_venv,
            reference=args.manifest,
            progress=PercentProgress(total, "install"),
            private=args.private,
            replace_datasets=args.replace_datasets,
            allowed_signers=args.allowed_signers,
            require_signature=args.require_signature,
            compile_bytecode=not args.no_compile,
        )
    except FerryError as exc:
        print(f"install.py: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    _print_installed(summary, scan, args.prefix)
    return 0


def _argument_parser() -> argparse.ArgumentParser:
    """The options of ``python3 install.py`` (see :func:`main`)."""
    parser = argparse.ArgumentParser(
        prog="install.py", description="Verify and install this ferry bundle (standard library only)."
    )
    parser.add_argument("--prefix", type=Path, help="install root (required unless --verify-only)")
    parser.add_argument("--no-venv", action="store_true", help="do not create a venv from the bundle's wheels")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="do not compile the venv's modules to bytecode while installing (faster; each module compiles when "
        "first imported, so the venv must stay writable to keep it)",
    )
    parser.add_argument("--verify-only", action="store_true", help="check every byte and stop")
    parser.add_argument(
        "--verify-prefix",
        type=Path,
        metavar="DIR",
        help="re-hash an installed prefix against its recorded manifests and stop",
    )
    parser.add_argument(
        "--private",
        action="store_true",
        help="make what is installed readable by this account only (0700/0600; default 0755/0644)",
    )
    parser.add_argument(
        "--replace-datasets",
        action="store_true",
        help="replace installed datasets of the same name whose content differs",
    )
    parser.add_argument(
        "--bundle",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="bundle directory or archive (default: the folder holding install.py)",
    )
    parser.add_argument("--manifest", type=Path, help="a manifest brought over a separate channel")
    parser.add_argument(
        "--allowed-signers",
        type=Path,
        metavar="FILE",
        help="OpenSSH allowed_signers file: require a valid signature by one of its signers "
        "(installing records it in PREFIX/.ferry as the prefix's policy)",
    )
    parser.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse an unsigned bundle (needs --allowed-signers or a prefix policy)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="DIR",
        help="write the state document of an installed prefix (what `ferry pack --base` "
        "packs a delta bundle against) to --output and stop",
    )
    parser.add_argument("--output", "-o", type=Path, metavar="FILE", help="with --state: the file to write")
    parser.add_argument(
        "--trust-recorded",
        action="store_true",
        help="with --state: take digests from the install records instead of re-hashing",
    )
    return parser


def _write_prefix_state(args: argparse.Namespace) -> int:
    """``--state DIR -o FILE``: write the installed prefix's state document; 0.

    Raises:
        FerryError: see :func:`prefix_state`.
    """
    document = prefix_state(args.state, trust_recorded=args.trust_recorded)
    atomic_text(args.output, json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"OK: {args.output}: {len(document['items'])} item(s), {len(document['wheels'])} wheel file(s)")
    return 0


def _check_installed_prefix(args: argparse.Namespace) -> int:
    """``--verify-prefix DIR``: re-hash the installed prefix against its manifests; 0.

    Raises:
        IntegrityError: the prefix drifted (every problem listed); BundleError: no install record.
    """
    found = verify_prefix(args.verify_prefix)
    if found["problems"]:
        raise integrity_error(found["problems"], f"prefix {args.verify_prefix} drifted from its manifests")
    print(
        f"OK: {found['bundles']} bundle(s), {found['files']} installed files, "
        f"{format_bytes(found['bytes'])} match their manifests"
    )
    return 0


def _verify_bundle_only(args: argparse.Namespace, total: int) -> int:
    """``--verify-only``: check every byte of the bundle (``total`` bytes) and its signature; 0.

    Raises:
        FerryError: see :func:`check_bundle`.
    """
    _, scan = check_bundle(
        args.bundle,
        args.manifest,
        PercentProgress(total, "verify"),
        allowed_signers=args.allowed_signers,
        require_signature=args.require_signature,
    )
    signature = getattr(scan, "signature", None)
    if signature:
        print(f"signature: good, by {signature['principal']} ({signature['key']})")
    print(f"OK: {len(scan.observed)} files, {format_bytes(scan.bytes_read)} verified")
    return 0


def _print_installed(summary: dict, scan: Scan, prefix: Path) -> None:
    """Print what an install placed (models, datasets, notes, repairs, venv, delta) and the ``source`` line."""
    for model in summary["models"]:
        print(f"model   {model['repo_id']} @ {model['revision']} -> {model['path']}")
    for dataset in summary["datasets"]:
        via = f"; datasets.load_dataset({dataset['repo_id']!r})" if dataset.get("arrow_cache") else ""
        print(f"dataset {dataset['name']} -> {dataset['path']} ({', '.join(dataset['entries'])}{via})")
    for note in summary["notes"]:
        print(f"note: {note}")
    for fixed in summary["repaired"]:
        print(f"repaired: {fixed}")
    if summary["venv"]:
        print(f"venv    {summary['venv']}")
    if summary.get("delta"):
        print(
            f"delta   {summary['delta']['from_base']} file(s) taken from the prefix, {summary['delta']['rebuilt']} "
            f"rebuilt by tensor, {format_bytes(summary['delta']['reused_bytes'])} reused"
        )
    print(f"OK: {len(scan.observed)} files verified; now run: source {Path(prefix).absolute() / 'ferry.env'}")


if __name__ == "__main__":
    sys.exit(main())
