"""``manifest.json``: parsing, validation, the files it vouches for, and the identities derived from it.

The schema is bundler/format.py's (full bundles ``format_version`` 1, delta bundles 2). Every field that reaches
a path or a command is checked before anything is written (:func:`validate_manifest`, :func:`validate_delta`).

A delta manifest (``format_version`` 2) lists the full target, as a full bundle's, plus ``base``: the sha256 of
the base document it was packed against (a ``ferry state`` document or an earlier manifest.json). Every file of
every item says how it travels, in ``delta``:

  "carried"    in the bundle at ITEM/FILE, as in a full bundle;
  "from_base"  not in the bundle: the prefix holds a file with this sha256 (a model blob, a dataset file, a
               wheel kept in PREFIX/wheels/<sha256>); install links (or copies) it into the staging area;
  "tensors"    a .safetensors file rebuilt byte for byte from the installed file ``patch.base_sha256`` and the
               carried member deltas/ITEM/FILE (the new header and the changed tensors): ``patch.segments``
               lists [source, offset, length] in file order, source "patch" (bytes of the carried member)
               or "base" (bytes of the installed file). The rebuilt file's sha256 is checked before it is
               placed (bundler/installer/delta.py).

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from bundler.format import DELTAS_DIRNAME, FORMAT_VERSION, LOCK_NAME, MANIFEST_NAME, SIGNATURE_NAME, SUMS_NAME
from bundler.installer.fields import COMMIT_HEX, SHA256_HEX, check_ref_name, check_relpath, check_repo_id
from ferry.errors import BundleError, UnsafeArchiveError

DELTA_MODES = ("carried", "from_base", "tensors")


_BUNDLE_ID = re.compile(r"^[0-9a-f]{32}$")


_BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


#: The item kinds and the sources each may come from.
ITEM_SOURCES = {"model": ("hf", "ms", "local"), "dataset": ("hf", "ms", "local", "nltk"), "wheels": ("uv", "pip")}


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> dict:
    """Parse and check a manifest's bytes (format of bundler/format.py).

    Raises:
        BundleError: not JSON, a required key is missing or has the wrong type (the key is named), or the
            ``format_version`` is newer than this reader (upgrade ferry).
        UnsafeArchiveError: a listed path is absolute or contains ``..``.
    """
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: expected a JSON object at the top level")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"{where}: 'format_version' must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{where}: bundle format_version {version} is newer than this ferry reads ({FORMAT_VERSION}); "
            f"upgrade ferry (or run the install.py shipped inside the bundle)"
        )
    for key, kind in (("name", str), ("bundle_id", str), ("items", list)):
        if not isinstance(manifest.get(key), kind):
            raise BundleError(f"{where}: '{key}' must be a {kind.__name__}")
    for i, item in enumerate(manifest["items"]):
        here = f"{where}: items[{i}]"
        if not isinstance(item, dict):
            raise BundleError(f"{here} must be an object")
        for key in ("kind", "source", "path"):
            if not isinstance(item.get(key), str):
                raise BundleError(f"{here}.{key} must be a string")
        check_relpath(item["path"], f"{here}.path")
        _check_files(item.get("files"), f"{here}.files")
    _check_files(manifest.get("support_files", []), f"{where}: support_files")
    validate_manifest(manifest, where)
    validate_delta(manifest, where)
    return manifest


def _check_files(files: Any, here: str) -> None:
    if not isinstance(files, list):
        raise BundleError(f"{here} must be a list")
    for j, entry in enumerate(files):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and SHA256_HEX.match(entry["sha256"])
        ):
            raise BundleError(f"{here}[{j}] needs 'path' (string), 'size' (int) and 'sha256' (64 hex digits)")
        check_relpath(entry["path"], f"{here}[{j}].path")


def validate_manifest(manifest: dict, where: str = MANIFEST_NAME) -> None:
    """Check every manifest field that reaches a path or a command (see bundler/format.py for the schema).

    The bundle ``name`` (``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128), ``bundle_id`` (32 lowercase hex, a uuid4),
    each item's ``kind``/``source`` pair, ``repo_id`` (:func:`check_repo_id`; ``local/NAME`` for local sources,
    none for wheels), ``revision`` and ``revision_requested`` (:func:`check_ref_name`; hub and local revisions
    are 40-hex commits), ``path`` (``KINDs/...`` or ``wheels``, never inside another item's), and every
    file path (:func:`check_relpath`), with no two files at the same bundle path or one file where another
    needs a folder.

    Raises:
        UnsafeArchiveError: the first offending field, named as ``items[3].repo_id`` with its value.
        BundleError: a field of the wrong type.
    """
    name = manifest.get("name")
    if not (isinstance(name, str) and _BUNDLE_NAME.match(name) and ".." not in name):
        raise UnsafeArchiveError(
            f"{where}: invalid bundle name {name!r} (letters, digits, '.', '_', '-'; "
            f"at most 128, starting with a letter or digit)"
        )
    if not (isinstance(manifest.get("bundle_id"), str) and _BUNDLE_ID.match(manifest["bundle_id"])):
        raise UnsafeArchiveError(
            f"{where}: invalid bundle_id {manifest.get('bundle_id')!r} (32 lowercase hex digits expected)"
        )
    item_paths: list[str] = []
    for i, item in enumerate(manifest["items"]):
        here = f"{where}: items[{i}]"
        kind, source = item["kind"], item["source"]
        if source not in ITEM_SOURCES.get(kind, ()):
            raise UnsafeArchiveError(
                f"{here}: unknown kind/source {kind!r}/{source!r} (expected one of "
                + ", ".join(f"{k}/{s}" for k, v in ITEM_SOURCES.items() for s in v)
                + ")"
            )
        path = item["path"]
        if kind == "wheels":
            if path != "wheels":
                raise UnsafeArchiveError(f"{here}.path: {path!r} (wheels live in 'wheels')")
            _check_engines(item, here)
        else:
            repo_id = check_repo_id(item.get("repo_id"), f"{here}.repo_id")
            if source == "local" and not repo_id.startswith("local/"):
                raise UnsafeArchiveError(f"{here}.repo_id: {repo_id!r} (local items are named 'local/NAME')")
            if source == "ms" and "/" not in repo_id:
                raise UnsafeArchiveError(f"{here}.repo_id: {repo_id!r} (ModelScope ids are 'ORG/NAME')")
            revision = check_ref_name(item.get("revision"), f"{here}.revision")
            if source in ("hf", "local") and not COMMIT_HEX.match(revision):
                raise UnsafeArchiveError(f"{here}.revision: {revision!r} (a 40-hex commit expected for {source} items)")
            if source == "nltk" and not SHA256_HEX.match(revision):
                raise UnsafeArchiveError(f"{here}.revision: {revision!r} (the package zip's sha256 expected)")
            if item.get("revision_requested") is not None:
                check_ref_name(item["revision_requested"], f"{here}.revision_requested")
            if not path.startswith(f"{kind}s/"):
                raise UnsafeArchiveError(f"{here}.path: {path!r} (expected under '{kind}s/')")
        item_paths.append(path)
    ordered = sorted(item_paths)
    for a, b in zip(ordered, ordered[1:]):
        if a == b or b.startswith(a + "/"):
            raise UnsafeArchiveError(f"{where}: item paths {a!r} and {b!r} overlap")
    every = sorted(expected_files(manifest, target=True))  # raises on duplicates
    for a, b in zip(every, every[1:]):
        if b.startswith(a + "/"):
            raise UnsafeArchiveError(f"{where}: {a!r} is a file and also a folder of {b!r}")
    for path in every:
        if path in (MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME):
            raise UnsafeArchiveError(f"{where}: a listed file is named {path!r}, which the bundle itself uses")


#: A serving engine's name (the wheels item's ``engines`` keys): it becomes a folder and a link name.
_ENGINE_NAME = re.compile(r"^[a-z][a-z0-9]*([._-][a-z0-9]+)*$")


def _check_engines(item: dict, here: str) -> None:
    """The wheels item's ``engines`` (serving engines, each in its own environment): plain names of at most 64
    characters, each with its lock at ``engines/NAME/requirements.lock`` among the item's files.

    Raises:
        UnsafeArchiveError: naming the engine and the field.
    """
    engines = item.get("engines") or {}
    if not isinstance(engines, dict):
        raise UnsafeArchiveError(f"{here}.engines: a mapping of engine names expected, got {type(engines).__name__}")
    listed = {f.get("path") for f in item["files"]}
    for name, entry in engines.items():
        if not (isinstance(name, str) and _ENGINE_NAME.match(name) and len(name) <= 64):
            raise UnsafeArchiveError(f"{here}.engines: {name!r} is no plain engine name")
        lock = entry.get("lock") if isinstance(entry, dict) else None
        if lock != f"engines/{name}/{LOCK_NAME}" or lock not in listed:
            raise UnsafeArchiveError(
                f"{here}.engines.{name}.lock: {lock!r} (expected engines/{name}/{LOCK_NAME} among the files)"
            )


def expected_files(manifest: dict, target: bool = False) -> dict[str, tuple[int, str]]:
    """Every file the bundle holds and the manifest vouches for: bundle-relative POSIX path -> (size in bytes,
    sha256 hex).

    Covers every item file (``item.path/file.path``) and the support files (install.py, the wheel lock);
    not ``manifest.json`` and ``SHA256SUMS`` themselves. In a delta bundle (:func:`is_delta`) a ``from_base``
    file is not in the bundle, and a ``tensors`` file is carried as its patch ``deltas/ITEM/FILE``; with
    ``target`` the full target's paths are listed instead (what an install of the bundle holds).
    """
    out: dict[str, tuple[int, str]] = {}
    listed = [(e["path"], e) for e in manifest.get("support_files", [])]
    for item in manifest["items"]:
        for e in item["files"]:
            mode = "carried" if target else e.get("delta", "carried")
            if mode == "carried":
                listed.append((posixpath.join(item["path"], e["path"]), e))
            elif mode == "tensors" and isinstance(e.get("patch"), dict):
                listed.append((patch_path(item, e), e["patch"]))
    for path, entry in listed:
        if path in out:
            raise UnsafeArchiveError(f"{MANIFEST_NAME}: {path!r} is listed twice")
        out[path] = (entry["size"], entry["sha256"].lower())
    return out


def is_delta(manifest: dict) -> bool:
    """Whether ``manifest`` describes a delta bundle (it names a ``base``)."""
    return manifest.get("base") is not None


def patch_path(item: dict, entry: dict) -> str:
    """Bundle path of the carried tensors of a ``tensors`` file: ``deltas/ITEM_PATH/FILE_PATH``."""
    return posixpath.join(DELTAS_DIRNAME, item["path"], entry["path"])


def validate_delta(manifest: dict, where: str = MANIFEST_NAME) -> None:
    """Check the delta fields of a manifest (see the section comment): ``base`` a sha256, ``delta`` one of
    :data:`DELTA_MODES` on every file of a delta manifest and on none of a full one, each ``tensors`` file's
    ``patch`` (``size``, ``sha256``, ``base_sha256``, ``base_size``, ``segments``) consistent: every segment
    lies inside the carried member or the base file and together they make exactly the file's size.

    Raises:
        UnsafeArchiveError: the first offending field, named (``items[0].files[3].patch.segments[2]``).
        BundleError: a delta manifest whose ``format_version`` is below 2.
    """
    base = manifest.get("base")
    if base is None:
        for i, item in enumerate(manifest["items"]):
            for j, entry in enumerate(item["files"]):
                if "delta" in entry or "patch" in entry:
                    raise UnsafeArchiveError(
                        f"{where}: items[{i}].files[{j}] has delta fields but the manifest names no base"
                    )
        return
    if not (isinstance(base, str) and SHA256_HEX.match(base)):
        raise UnsafeArchiveError(f"{where}: base {base!r} (the sha256 of the base document, 64 hex digits)")
    if manifest["format_version"] < 2:
        raise BundleError(
            f"{where}: a delta bundle (base {base[:12]}) needs format_version 2, not {manifest['format_version']}"
        )
    for i, item in enumerate(manifest["items"]):
        for j, entry in enumerate(item["files"]):
            here = f"{where}: items[{i}].files[{j}]"
            mode = entry.get("delta")
            if mode not in DELTA_MODES:
                raise UnsafeArchiveError(f"{here}.delta: {mode!r} (one of {', '.join(DELTA_MODES)})")
            if mode != "tensors":
                if "patch" in entry:
                    raise UnsafeArchiveError(f"{here}.patch: only 'tensors' files carry a patch")
                continue
            _check_patch(entry, f"{here}.patch")


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_patch(entry: dict, here: str) -> None:
    patch = entry.get("patch")
    if not isinstance(patch, dict):
        raise UnsafeArchiveError(f"{here}: missing (a 'tensors' file needs its patch)")
    for key in ("sha256", "base_sha256"):
        if not (isinstance(patch.get(key), str) and SHA256_HEX.match(patch[key])):
            raise UnsafeArchiveError(f"{here}.{key}: {patch.get(key)!r} (64 hex digits)")
    for key in ("size", "base_size"):
        if not is_count(patch.get(key)):
            raise UnsafeArchiveError(f"{here}.{key}: {patch.get(key)!r} (a byte count)")
    segments = patch.get("segments")
    if not isinstance(segments, list):
        raise UnsafeArchiveError(f"{here}.segments: expected a list of [source, offset, length]")
    total = 0
    for k, seg in enumerate(segments):
        if not (
            isinstance(seg, list)
            and len(seg) == 3
            and seg[0] in ("patch", "base")
            and is_count(seg[1])
            and is_count(seg[2])
            and seg[2] > 0
        ):
            raise UnsafeArchiveError(
                f'{here}.segments[{k}]: {seg!r} (expected ["patch" or "base", offset, length > 0])'
            )
        limit = patch["size"] if seg[0] == "patch" else patch["base_size"]
        if seg[1] + seg[2] > limit:
            what = "the carried tensors" if seg[0] == "patch" else f"the base file {patch['base_sha256'][:12]}"
            raise UnsafeArchiveError(
                f"{here}.segments[{k}]: bytes {seg[1]}..{seg[1] + seg[2]} lie outside {what} ({limit} bytes)"
            )
        total += seg[2]
    if total != entry["size"]:
        raise UnsafeArchiveError(f"{here}.segments: they make {total} bytes, the file has {entry['size']}")


def content_id(item: dict) -> str:
    """sha1 (40 hex) over an item's sorted ``(path, sha256)`` pairs: what its files are, whatever its revision
    name says (a ModelScope ``master`` re-packed later names other bytes). Equal to
    ``bundler.sources.local_revision`` of the same files (a test keeps them equal)."""
    h = hashlib.sha1()
    for rel, digest in sorted((e["path"], e["sha256"]) for e in item["files"]):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces): what an install record remembers,
    so the same ``bundle_id`` with other content is recognised whatever the formatting."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
