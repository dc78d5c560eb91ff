"""Delta bundles: carry only what the isolated host lacks (``ferry state``, ``ferry pack --base``).

On the isolated side ``ferry state PREFIX -o state.json`` (or ``python3 install.py --state PREFIX -o FILE``)
writes what an installed prefix holds: every installed file's size and sha256, per item and wheel, and each
safetensors file's tensor table (:func:`bundler.installer.prefix.prefix_state`). That document, or an earlier
bundle's ``manifest.json`` (for sites where nothing may leave the isolated side), is the *base*.

On the online side ``ferry pack SPEC --base BASE`` resolves and downloads the full target as always, then
:func:`plan_delta` decides per file (bundler/format.py has the manifest fields)::

    sha256 in the base (same size)          -> "from_base"  not carried
    .safetensors sharing tensors with a      -> "tensors"    the new header + changed tensors carried as
      base file (same name, same bytes)                     deltas/ITEM/FILE; rebuilt on the host
    anything else                            -> "carried"    in the bundle, as in a full bundle

The install side (checks and rebuild) lives in :mod:`bundler.installer.delta`, part of the generated
``install.py``, so that a bare ``python3 install.py`` installs a delta bundle too: it finds every ``from_base``
file in the prefix and re-hashes it before anything is placed, rebuilds ``tensors`` files streaming from the
installed blob and checks their sha256, and then installs the completed staging area exactly as a full
bundle's.

A base taken from a manifest (or a ``--trust-recorded`` state) has no tensor tables; when this packer still has
a base safetensors file on disk (its hash cache knows a file with that sha256, e.g. the earlier revision packed
into the same ``OUT``), the table is computed from that file; otherwise safetensors files are compared whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bundler.format import DELTAS_DIRNAME, STATE_FORMAT
from bundler.installer import prefix as installed_prefix
from bundler.installer.hashing import CHUNK_SIZE, size_and_sha256
from bundler.installer.manifest import parse_manifest
from bundler.installer.safetensors import tensor_digests
from ferry.errors import ConfigError, SourceError
from ferry.fsutil import atomic_write_text, format_bytes

#: A safetensors file is carried whole when its patch would hold at least this share of its bytes.
MAX_PATCH_SHARE = 0.9


@dataclass
class Base:
    """A base document: ``sha256`` of its bytes, ``kind`` (``"state"`` or ``"manifest"``), ``sizes`` (file
    sha256 -> size in bytes) of every file the host holds, ``tables`` (sha256 of a safetensors file ->
    ``{name: [start, end, sha256]}``) and ``names`` (sha256 -> ``(repo_id, path)`` pairs holding it)."""

    path: Path
    sha256: str
    kind: str
    sizes: dict[str, int]
    tables: dict[str, dict[str, list]]
    names: dict[str, set[tuple[str | None, str]]]


def load_base(path: str | os.PathLike) -> Base:
    """Read a ``ferry state`` document or a bundle's ``manifest.json`` (full or delta: both list the full
    target) as a :class:`Base`.

    Raises:
        ConfigError: the file cannot be read, is not JSON, or is neither document (naming the file and key).
        BundleError / UnsafeArchiveError: a manifest that does not parse (see
            :func:`bundler.installer.manifest.parse_manifest`).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--base {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--base {path}: not JSON ({exc})") from None
    sizes: dict[str, int] = {}
    tables: dict[str, dict[str, list]] = {}
    names: dict[str, set] = {}

    def add(repo_id: str | None, entry: Any, where: str) -> None:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("path"), str)
        ):
            raise ConfigError(f"--base {path}: {where} needs 'path', 'size' and 'sha256'")
        sha = entry["sha256"].lower()
        sizes[sha] = entry["size"]
        names.setdefault(sha, set()).add((repo_id, entry["path"]))
        table = entry.get("tensors")
        if isinstance(table, dict) and all(isinstance(v, list) and len(v) == 3 for v in table.values()):
            tables[sha] = table

    if isinstance(doc, dict) and doc.get("format") == STATE_FORMAT:
        if doc.get("version") != 1 or not isinstance(doc.get("items"), list) or not isinstance(doc.get("wheels"), list):
            raise ConfigError(
                f"--base {path}: a {STATE_FORMAT} document of version 1 with 'items' and 'wheels' lists expected"
            )
        for i, item in enumerate(doc["items"]):
            for j, entry in enumerate(item.get("files", []) if isinstance(item, dict) else []):
                add(item.get("repo_id"), entry, f"items[{i}].files[{j}]")
        for j, entry in enumerate(doc["wheels"]):
            add(None, entry, f"wheels[{j}]")
        kind = "state"
    elif isinstance(doc, dict) and "format_version" in doc and "items" in doc:
        manifest = parse_manifest(data, str(path))
        for item in manifest["items"]:
            for entry in item["files"]:
                add(item.get("repo_id"), entry, "file")
        kind = "manifest"
    else:
        raise ConfigError(
            f"--base {path}: neither a `ferry state` document ('format': '{STATE_FORMAT}') nor a bundle's manifest.json"
        )
    return Base(path=path, sha256=hashlib.sha256(data).hexdigest(), kind=kind, sizes=sizes, tables=tables, names=names)


@dataclass
class FileDecision:
    """How one file of the target travels: ``mode`` (``carried``, ``from_base``, ``tensors``), its ``size`` and
    ``sha256``, the bytes ``carried`` for it, and for ``tensors`` the ``patch`` entry and the ``patch_file``
    (a temp file holding the carried bytes)."""

    mode: str
    size: int
    sha256: str
    carried: int
    patch: dict[str, Any] | None = None
    patch_file: Path | None = None

    def fields(self) -> dict[str, Any]:
        """The manifest fields this decision adds to the file's entry."""
        return {"delta": self.mode, **({"patch": self.patch} if self.patch is not None else {})}


@dataclass
class DeltaPlan:
    """Every file's :class:`FileDecision`, keyed by bundle path (``ITEM_PATH/FILE``, ``wheels/NAME``), and one
    report row per item (:meth:`rows`). ``work_dir`` holds the patch files until :meth:`cleanup`."""

    base: Base
    decisions: dict[str, FileDecision]
    items: list[dict[str, Any]] = field(default_factory=list)
    work_dir: Path | None = None

    @property
    def carried_bytes(self) -> int:
        """Bytes of content the delta bundle carries (files and patches)."""
        return sum(d.carried for d in self.decisions.values())

    @property
    def full_bytes(self) -> int:
        """Bytes of content the full bundle of the same target would carry."""
        return sum(d.size for d in self.decisions.values())

    def rows(self) -> list[dict[str, Any]]:
        """Per item: ``label``, ``files``, ``carried_files`` (whole or patched), ``full_bytes``,
        ``carried_bytes``, ``reused_bytes``."""
        out = []
        for item in self.items:
            ds = [self.decisions[p] for p in item["paths"] if p in self.decisions]
            full, carried = sum(d.size for d in ds), sum(d.carried for d in ds)
            out.append(
                {
                    "label": item["label"],
                    "files": len(ds),
                    "carried_files": sum(1 for d in ds if d.mode != "from_base"),
                    "full_bytes": full,
                    "carried_bytes": carried,
                    "reused_bytes": full - carried,
                }
            )
        return out

    def report(self) -> str:
        """A plain-text table: bytes carried vs the full bundle, per item and in total."""
        rows = [("item", "files", "carried", "full bundle", "delta carries", "share")]
        for r in self.rows():
            rows.append(
                (
                    r["label"],
                    str(r["files"]),
                    str(r["carried_files"]),
                    format_bytes(r["full_bytes"]),
                    format_bytes(r["carried_bytes"]),
                    _share(r["carried_bytes"], r["full_bytes"]),
                )
            )
        rows.append(
            (
                "total",
                str(len(self.decisions)),
                str(sum(1 for d in self.decisions.values() if d.mode != "from_base")),
                format_bytes(self.full_bytes),
                format_bytes(self.carried_bytes),
                _share(self.carried_bytes, self.full_bytes),
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(0, f"delta against {self.base.path} ({self.base.kind}, sha256 {self.base.sha256[:12]})")
        return "\n".join(lines)

    def cleanup(self) -> None:
        """Remove the patch files."""
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.3f} %" if whole else "-"


def plan_delta(
    items: list[Any],
    wheel_files: list[Any],
    base: Base,
    *,
    work_dir: Path,
    hash_cache: Any = None,
    expected_wheels: dict[str, str] | None = None,
) -> DeltaPlan:
    """Decide how each file of the target travels against ``base`` (see the module docstring); write the patch
    of every ``tensors`` file into ``work_dir`` (created; removed by :meth:`DeltaPlan.cleanup`).

    ``items``: :class:`bundler.sources.PreparedItem` (their files already downloaded); ``wheel_files``:
    :class:`bundler.sources.SourceFile` of the wheels; ``hash_cache``: :class:`ferry.digests.DigestCache` (digests
    reused and remembered); ``expected_wheels``: wheel name -> the sha256 the resolver locked.

    Raises:
        SourceError: a file does not have the sha256 the hub or the resolver states.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    if hash_cache is not None and any(f.rel.endswith(".safetensors") for item in items for f in item.files):
        _tables_from_local_copies(base, hash_cache)
    plan = DeltaPlan(base=base, decisions={}, work_dir=work_dir)
    expected_wheels = expected_wheels or {}
    for item in items:
        paths = []
        for f in item.files:
            bundle_path = f"{item.path}/{f.rel}"
            plan.decisions[bundle_path] = _decide(
                f.src, f.rel, item.repo_id, bundle_path, base, work_dir, hash_cache, f.expected_sha256, item.spec
            )
            paths.append(bundle_path)
        plan.items.append({"label": f"{item.kind} {item.repo_id}", "paths": paths})
    paths = []
    for f in wheel_files:
        bundle_path = f"wheels/{f.rel}"
        plan.decisions[bundle_path] = _decide(
            f.src, f.rel, None, bundle_path, base, work_dir, None, expected_wheels.get(f.rel), "wheels"
        )
        paths.append(bundle_path)
    if wheel_files:
        plan.items.append({"label": "wheels", "paths": paths})
    return plan


def _tables_from_local_copies(base: Base, hash_cache: Any) -> None:
    """Fill in the tensor tables the base lacks from files on this host that have the base file's sha256 (the
    hash cache knows them, and each is hashed again before its table is used)."""
    wanted = {
        sha
        for sha, names in base.names.items()
        if sha not in base.tables and any(path.endswith(".safetensors") for _, path in names)
    }
    for key, entry in list(hash_cache.entries.items()):
        if not wanted:
            return
        sha = entry[-1] if isinstance(entry, list) and entry else None  # get() below checks the rest
        if sha not in wanted or not os.path.isfile(key) or hash_cache.get(Path(key)) != sha:
            continue
        size, digest, table = tensor_digests(Path(key))
        if digest == sha and table is not None:
            base.tables[sha] = table
            wanted.discard(sha)


def _decide(
    src: Path,
    rel: str,
    repo_id: str | None,
    bundle_path: str,
    base: Base,
    work_dir: Path,
    hash_cache: Any,
    expected: str | None,
    what: str,
) -> FileDecision:
    tensors = None
    known = hash_cache.get(src) if hash_cache is not None else None
    if known is not None and not (rel.endswith(".safetensors") and base.tables and known not in base.sizes):
        size, sha = src.stat().st_size, known
    elif rel.endswith(".safetensors") and base.tables:
        size, sha, tensors = tensor_digests(src)
    else:
        size, sha = size_and_sha256(src)
    if expected and sha != expected:
        raise SourceError(f"{what}: {rel} has sha256 {sha} but {expected} was stated for it; run ferry pack again")
    if hash_cache is not None:
        hash_cache.put(src, sha)
    if base.sizes.get(sha) == size:
        return FileDecision("from_base", size, sha, 0)
    if tensors:
        decision = _tensor_patch(src, rel, repo_id, size, sha, tensors, base, work_dir / bundle_path)
        if decision is not None:
            return decision
    return FileDecision("carried", size, sha, size)


def _tensor_patch(
    src: Path,
    rel: str,
    repo_id: str | None,
    size: int,
    sha: str,
    tensors: dict[str, list],
    base: Base,
    patch_file: Path,
) -> FileDecision | None:
    """The ``tensors`` decision for a changed safetensors file, or None when no base file shares enough."""
    best: tuple[int, int, str] | None = None
    for base_sha, table in base.tables.items():
        shared = sum(
            t[1] - t[0]
            for name, t in tensors.items()
            if name in table and table[name][2] == t[2] and table[name][1] - table[name][0] == t[1] - t[0]
        )
        same_place = int((repo_id, rel) in base.names.get(base_sha, set()))
        if shared and (best is None or (shared, same_place) > best[:2]):
            best = (shared, same_place, base_sha)
    if best is None:
        return None
    base_sha = best[2]
    table = base.tables[base_sha]
    spans: list[list] = []  # [source, offset in that source, length], new-file order; patch offsets are in src

    def push(source: str, offset: int, length: int) -> None:
        if length <= 0:
            return
        if spans and spans[-1][0] == source and spans[-1][1] + spans[-1][2] == offset:
            spans[-1][2] += length
        else:
            spans.append([source, offset, length])

    pos = 0
    for name, (start, end, digest) in sorted(tensors.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        push("patch", pos, start - pos)
        old = table.get(name)
        if old is not None and old[2] == digest and old[1] - old[0] == end - start:
            push("base", old[0], end - start)
        else:
            push("patch", start, end - start)
        pos = end
    push("patch", pos, size - pos)
    carried = sum(s[2] for s in spans if s[0] == "patch")
    if carried >= MAX_PATCH_SHARE * size:
        return None
    patch_file.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    segments = []
    written = 0
    with open(src, "rb") as fin, open(patch_file, "wb") as fout:
        for source, offset, length in spans:
            if source == "base":
                segments.append(["base", offset, length])
                continue
            segments.append(["patch", written, length])
            fin.seek(offset)
            left = length
            while left:
                chunk = fin.read(min(CHUNK_SIZE, left))
                if not chunk:
                    raise SourceError(f"{src} changed while its delta was computed; run ferry pack again")
                hasher.update(chunk)
                fout.write(chunk)
                left -= len(chunk)
            written += length
    patch = {
        "size": written,
        "sha256": hasher.hexdigest(),
        "base_sha256": base_sha,
        "base_size": base.sizes[base_sha],
        "segments": segments,
    }
    return FileDecision("tensors", size, sha, written, patch=patch, patch_file=patch_file)


def patch_member(bundle_path: str) -> str:
    """The bundle path of the carried tensors of the file at ``bundle_path`` (``deltas/ITEM/FILE``)."""
    return f"{DELTAS_DIRNAME}/{bundle_path}"


# ---------------------------------------------------------------------------------------------------------
# ferry state
# ---------------------------------------------------------------------------------------------------------


@dataclass
class StateReport:
    """What :func:`write_state` wrote: ``path``, ``items`` and ``wheels`` counted, ``files`` and ``bytes`` listed,
    ``sha256`` of the document, ``seconds`` wall time."""

    path: Path
    items: int
    wheels: int
    files: int
    bytes: int
    sha256: str
    seconds: float

    def summary(self) -> str:
        """One line for the CLI."""
        return (
            f"OK: {self.path}: {self.items} item(s), {self.wheels} wheel file(s), {self.files} files, "
            f"{format_bytes(self.bytes)} (sha256 {self.sha256[:12]}) in {self.seconds:.1f} s"
        )


def prefix_state(prefix: str | os.PathLike, *, trust_recorded: bool = False) -> dict[str, Any]:
    """The state document of an installed prefix (:func:`bundler.installer.prefix.prefix_state`).

    Raises:
        BundleError: ``prefix`` holds no install record.
    """
    return installed_prefix.prefix_state(Path(prefix), trust_recorded=trust_recorded)


def state_bytes(document: dict[str, Any]) -> bytes:
    """The document as written (sorted keys: equal states give equal bytes, hence equal ``base`` digests)."""
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


def write_state(prefix: str | os.PathLike, output: str | os.PathLike, *, trust_recorded: bool = False) -> StateReport:
    """Write the state document of ``prefix`` to ``output`` (atomically): what ``ferry pack --base`` packs a
    delta against. ``trust_recorded``: take sizes and digests from the install records (every file must
    still exist) instead of re-hashing; such a document has no tensor tables.

    Raises:
        BundleError: ``prefix`` holds no install record.
        PrefixError: an install interrupted in ``prefix`` cannot be rolled back (:func:`recover_interrupted_install`).
    """
    import time

    from bundler.installer.install import recover_interrupted_install

    started = time.perf_counter()
    recover_interrupted_install(Path(prefix))  # the state of what the records say, not of a half install
    document = prefix_state(prefix, trust_recorded=trust_recorded)
    data = state_bytes(document)
    atomic_write_text(Path(output), data.decode())
    files = [f for i in document["items"] for f in i["files"]] + document["wheels"]
    return StateReport(
        path=Path(output),
        items=len(document["items"]),
        wheels=len(document["wheels"]),
        files=len(files),
        bytes=sum(f["size"] for f in files),
        sha256=hashlib.sha256(data).hexdigest(),
        seconds=time.perf_counter() - started,
    )
