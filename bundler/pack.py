"""``ferry pack``: build a bundle (directory + tar or volumes) from a :class:`bundler.spec.PackSpec`.

Steps, in order:

1. Prepare every source (:mod:`bundler.sources`): resolve hub revisions to commit hashes and download into
   the resumable cache ``OUT/.ferry-cache``; apply the pickle / remote-code rules.
2. Resolve the wheels for the target with uv and download exactly those files (:mod:`bundler.wheels`)
   unless ``no_wheels``; the manifest's ``target`` records Python, platform, torch build and indexes.
3. Check free space up front: the bundle directory and the tar each take the content size.
4. One pass (:class:`bundler.writer.BundleWriter`): each file is read once, hashed, and written to the
   staging directory beside ``OUT/NAME`` and to the tar stream. A hash cache (``OUT/.ferry-cache/hashes.json``,
   :class:`ferry.digests.DigestCache`: absolute path, size, mtime_ns and inode) means a re-run hashes nothing it
   hashed before. LFS files are checked against the sha256 the hub states.
5. ``install.py`` (generated now from the installer's modules, :mod:`bundler.installer.generate`) and
   ``SHA256SUMS`` go last; ``manifest.json``, its signature (``--sign KEY``, :mod:`bundler.signing`) and
   ``sbom.cdx.json`` (:mod:`bundler.sbom`) go FIRST, into a head the writer reserved before the pass from an
   upper bound of their sizes and filled once every digest is known
   (:meth:`bundler.writer.BundleWriter.write_head`).
6. Move an earlier bundle of the same name (directory, archive, sums, signature) aside as one set, rename the
   staging directory to ``OUT/NAME``, the tar (or volumes) into place, write ``OUT/NAME.ferry.sha256`` (and
   ``OUT/NAME.ferry.sig`` when signed), then drop the earlier set. A failure anywhere puts the earlier bundle back
   whole, and so does the next pack of the name after a kill (:func:`_put_back`): the directory and the archive
   in ``OUT`` always come from one pack.

The layout and manifest schema are those of :mod:`bundler.format`.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bundler.format import (
    ARCHIVE_SUFFIX,
    FORMAT_VERSION,
    FULL_FORMAT_VERSION,
    INSTALLER_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    SBOM_NAME,
    SIGNATURE_NAME,
    SIGNATURE_SUFFIX,
    SUMS_NAME,
    VOLUMES_SUMS_SUFFIX,
)
from bundler.installer.fields import check_relpath, check_repo_id
from bundler.installer.manifest import validate_delta, validate_manifest
from bundler.sources import Kind, PreparedItem, SourceFile, local_revision, prepare
from bundler.spec import PackSpec, SourceSpec
from bundler.writer import BundleWriter, FileRecord, head_bound
from ferry import __version__
from ferry.digests import DigestCache
from ferry.errors import InsufficientSpaceError, SourceError, UnsafeArchiveError
from ferry.faults import kill_point
from ferry.folder_lock import hold_name
from ferry.fsutil import atomic_directory, atomic_write_text, ensure_free_space, format_bytes

CACHE_DIRNAME = ".ferry-cache"
HASH_CACHE_NAME = "hashes.json"
#: Head room on top of the content size when checking free space (manifest, tar headers, padding).
SPACE_MARGIN = 16 * 1024 * 1024


@dataclass
class PackResult:
    """What :func:`pack` wrote and how much work it did.

    Sizes are bytes. ``hashed_bytes`` counts content bytes hashed in this run; ``cached_hash_bytes`` counts
    content bytes whose sha256 came from the hash cache (a re-run: ``hashed_bytes == 0``).
    ``downloaded_bytes`` counts bytes fetched from a hub in this run (0 when the download cache was complete).
    """

    name: str
    bundle_dir: Path
    archives: list[Path]
    sums_path: Path | None
    manifest: dict[str, Any]
    content_bytes: int
    hashed_bytes: int
    cached_hash_bytes: int
    downloaded_bytes: int
    elapsed_s: float
    skipped_files: list[str] = field(default_factory=list)
    signature_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    #: with ``base``: how each file travels (bundler/delta.py); ``dry_run``: nothing was written
    delta: Any = None
    dry_run: bool = False

    @property
    def manifest_path(self) -> Path:
        """``OUT/NAME/manifest.json``."""
        return self.bundle_dir / MANIFEST_NAME

    def summary(self) -> str:
        """A plain-text table of the items and the totals, for the CLI."""
        if self.dry_run:
            return self.delta.report()
        rows = [("kind", "source", "repo_id", "revision", "files", "size", "licence")]
        for item in self.manifest["items"]:
            rows.append(
                (
                    item["kind"],
                    item["source"],
                    item.get("repo_id") or "-",
                    (item.get("revision") or "-")[:12],
                    str(len(item["files"])),
                    format_bytes(sum(f["size"] for f in item["files"])),
                    (item.get("license") or "-") + (" (trust_remote_code)" if item.get("trust_remote_code") else ""),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        rate = self.content_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines += [
            "",
            f"bundle    {self.bundle_dir}",
            *(f"archive   {p} ({format_bytes(p.stat().st_size)})" for p in self.archives),
            *([f"checksums {self.sums_path}"] if self.sums_path else []),
            *(
                [f"signature {self.signature_path} ({self.manifest['signature']['key']})"]
                if self.signature_path
                else []
            ),
            f"content   {format_bytes(self.content_bytes)}; hashed {format_bytes(self.hashed_bytes)}, "
            f"from hash cache {format_bytes(self.cached_hash_bytes)}; downloaded {format_bytes(self.downloaded_bytes)}",
            f"time      {self.elapsed_s:.1f} s ({format_bytes(rate)}/s)",
        ]
        target = self.manifest.get("target") or {}
        if any(item["kind"] == "wheels" for item in self.manifest["items"]) and target:
            lines.append(
                f"wheels    for CPython {target.get('python')} on {', '.join(target.get('platforms', []))}"
                f", torch {target.get('torch_version') or '-'} (--torch {target.get('torch')})"
            )
        if self.skipped_files:
            lines.append(
                f"skipped   {len(self.skipped_files)} pickle file(s) with safetensors beside them: "
                + ", ".join(self.skipped_files)
            )
        lines += [f"note      {note}" for note in self.notes]
        if self.delta is not None:
            lines += ["", self.delta.report()]
        return "\n".join(lines)


def host_info() -> dict[str, str]:
    """This host's ``python`` (X.Y), ``platform`` (e.g. ``linux_x86_64``) and ``implementation`` (``cp``)."""
    impl = sys.implementation.name
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": sysconfig.get_platform().replace("-", "_").replace(".", "_"),
        "implementation": {"cpython": "cp", "pypy": "pp"}.get(impl, impl),
    }


def _target_without_wheels(spec: PackSpec) -> dict[str, Any]:
    """The manifest's ``target`` for a bundle without wheels: the spec's target with this host's values
    filled in (nothing resolved, so no indexes and no torch version)."""
    from bundler.wheels import resolve_target, target_record

    return {**target_record(resolve_target(spec.target)), "torch_version": None}


def _sums_line(digest: str, path: str) -> str:
    if "\\" in path or "\n" in path:  # coreutils escaping
        return "\\" + digest + "  " + path.replace("\\", "\\\\").replace("\n", "\\n") + "\n"
    return f"{digest}  {path}\n"


def _check_items(items: list[PreparedItem]) -> None:
    """Refuse, before anything is downloaded into the bundle, what the verifier on the other side would refuse:
    file names with a newline, backslash, control character or bytes that are not UTF-8, repo ids outside
    huggingface_hub's rule; and two datasets that would install under the same name (``hf:org/alpaca_demo``
    and a local ``alpaca_demo.json`` both become ``PREFIX/datasets/alpaca_demo``).

    Raises:
        SourceError: naming the item and the file, or both datasets.
    """
    for item in items:
        try:
            check_repo_id(item.repo_id, f"{item.spec}: repo id")
            for f in item.files:
                check_relpath(f.rel, f"{item.spec}: file")
        except UnsafeArchiveError as exc:
            raise SourceError(
                f"{exc} (the bundle could not be verified on the isolated host; rename or --exclude it)"
            ) from None
    names: dict[str, PreparedItem] = {}
    for item in items:
        if item.kind != "dataset" or item.source == "nltk":  # NLTK data goes to PREFIX/nltk_data
            continue
        name = item.repo_id.split("/")[-1]
        if name in names:
            raise SourceError(
                f"datasets {names[name].spec!r} and {item.spec!r} would both install as "
                f"PREFIX/datasets/{name}: pack one of them, or rename the local one"
            )
        names[name] = item


def _unique_paths(items: list[PreparedItem]) -> None:
    seen: set[str] = set()
    for item in items:
        base, n = item.path, 1
        while item.path in seen:
            n += 1
            item.path = f"{base}-{n}"
            if item.source == "local":
                item.repo_id = f"{item.repo_id}-{n}"
        seen.add(item.path)


def pack(
    spec: PackSpec,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    sign: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    dry_run: bool = False,
) -> PackResult:
    """Build ``OUT/NAME/`` and ``OUT/NAME.ferry.tar``, or volumes and ``OUT/NAME.ferry.sha256`` listing them.

    ``progress`` shows tqdm bars (downloads, archiving) on stderr. ``sign``: a private OpenSSH key; manifest.json
    is signed with it (``ssh-keygen -Y sign -n ferry-bundle``), the signature goes inside the bundle and to
    ``OUT/NAME.ferry.sig``; the key is tried before anything is downloaded. See the module docstring.

    ``base``: a ``ferry state`` document or an earlier manifest.json; the bundle is then a delta bundle
    (format_version 2, bundler/delta.py) carrying only the files (or tensors) the base lacks. ``dry_run`` (with
    ``base``): download into ``OUT/.ferry-cache`` and decide, write no bundle; ``result.delta.report()`` says
    the bytes carried vs the full bundle per item.

    Raises:
        SourceError: a source cannot be fetched, is refused (pickle) or fails its LFS sha256 check.
        InsufficientSpaceError: ``OUT`` has less free space than twice the content size (checked up front).
        ConfigError: invalid wheel options, or ``sign`` is not a usable key (or ssh-keygen lacks ``-Y sign``);
        BundleError: conflicting bundle member paths.
        ConfigError: another ``ferry pack`` is writing a bundle of that name into ``OUT`` (one line naming it).
    """
    started = time.perf_counter()
    signer = _load_signer(sign)
    delta_base = None
    if base is not None:
        from bundler.delta import load_base

        delta_base = load_base(base)
    elif dry_run:
        raise ValueError("pack(dry_run=True) needs a base")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # One pack per bundle name in OUT at a time (a second is refused in one line: `.NAME.ferry-lock` beside it), so
    # the directory and the archive always come from one pack; what a killed pack left half-written beside the name
    # is removed by the next one, and an earlier bundle it had moved aside is put back (ferry.folder_lock).
    with hold_name(out / spec.name, "ferry pack", key="bundle"):
        return _pack_held(spec, out, progress, signer, delta_base, dry_run, started)


def _pack_held(
    spec: PackSpec,
    out: Path,
    progress: bool,
    signer: Any,
    delta_base: Any,
    dry_run: bool,
    started: float,
) -> PackResult:
    """:func:`pack` once the bundle's name in ``out`` is held: plan the lm-eval tasks and the wheels, prepare every
    source, download the wheels, plan the delta (``delta_base``), then write the bundle (:func:`_write_bundle`)."""
    _put_back(out, spec.name)
    cache_dir = out / CACHE_DIRNAME
    cache_dir.mkdir(exist_ok=True)

    def space(needed: int, what: str) -> None:
        ensure_free_space(out, needed + SPACE_MARGIN, what)

    eval_plan, eval_datasets = _plan_eval(spec)
    # The wheels are resolved next (seconds, nothing downloaded): a target the wheels cannot serve fails
    # before any model is fetched.
    resolution = None
    engines: dict[str, Any] = {}
    if not spec.wheels.no_wheels:
        from bundler.wheels import resolve, resolve_engine

        resolution = resolve(spec)
        engines = {e.engine: resolve_engine(spec, e) for e in spec.engines}  # each its own lock
        target = None
    else:
        target = _target_without_wheels(spec)
    items = _prepare_items(spec, cache_dir, progress, space, eval_plan, eval_datasets)

    wheel_files: list[SourceFile] = []
    wheels_meta: dict[str, Any] | None = None
    wheel_tmp: Path | None = None
    try:
        if not spec.wheels.no_wheels:
            wheel_tmp = Path(tempfile.mkdtemp(prefix="wheels-", dir=cache_dir))
            wheels_meta, wheel_files = _fetch_wheels(spec, cache_dir, wheel_tmp, progress, resolution, engines)
            target = wheels_meta["target"]
        plan = None
        if delta_base is not None:  # every file's sha256 (and tensors) compared with the base
            plan = _plan_delta(items, wheel_files, wheels_meta, delta_base, cache_dir)
            if dry_run:
                plan.cleanup()
                return _dry_run_result(spec, out, items, plan, started)
        content = sum(i.size for i in items) + sum(f.size for f in wheel_files)
        if plan is not None:
            content = plan.carried_bytes
        space(2 * content, f"bundle {spec.name!r} (directory + archive, 2 x {format_bytes(content)})")
        try:
            try:
                result = _write_bundle(
                    spec, out, items, wheel_files, wheels_meta, target, cache_dir, content, progress, signer, plan
                )
            finally:
                if plan is not None:
                    plan.cleanup()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientSpaceError(
                    f"disk full while writing bundle {spec.name!r} into {out} (needs about "
                    f"{format_bytes(2 * content + SPACE_MARGIN)}); nothing was left half-written: {exc}"
                ) from None
            raise
    finally:
        if wheel_tmp is not None:
            shutil.rmtree(wheel_tmp, ignore_errors=True)
    result.downloaded_bytes = sum(i.downloaded_bytes for i in items)
    result.notes = [note for i in items for note in i.notes]
    result.elapsed_s = time.perf_counter() - started
    return result


def _plan_eval(spec: PackSpec) -> tuple[list[Any], list[SourceSpec]]:
    """Plan the spec's lm-eval tasks first (their registry, no download): a task that would need the network on
    the isolated host is refused before anything is fetched. Returns the plan and the datasets its tasks read;
    what the tasks' helpers import joins the wheels (:meth:`PackSpec.add_eval_requirements`)."""
    if not spec.eval:
        return [], []
    from bundler.eval_tasks import eval_sources, plan_eval_tasks, task_requirements

    eval_plan = plan_eval_tasks(spec.eval)
    eval_datasets = eval_sources(eval_plan, spec.datasets)
    spec.add_eval_requirements(task_requirements(eval_plan))  # what the tasks' helpers import joins the wheels
    return eval_plan, eval_datasets


def _prepare_items(
    spec: PackSpec,
    cache_dir: Path,
    progress: bool,
    space: Callable[[int, str], None],
    eval_plan: list[Any],
    eval_datasets: list[SourceSpec],
) -> list[PreparedItem]:
    """Prepare every model and dataset of the spec and of its lm-eval tasks (downloaded into ``cache_dir``,
    ``space`` asked before each download), and the NLTK data the tasks need; give each a unique bundle path and
    refuse what the verifier would refuse (:func:`_check_items`).

    Raises:
        SourceError: see :func:`bundler.sources.prepare` and :func:`_check_items`.
    """
    items: list[PreparedItem] = []
    kinds: tuple[tuple[Kind, list[SourceSpec]], ...] = (
        ("model", spec.models),
        ("dataset", [*spec.datasets, *eval_datasets]),
    )
    for kind, sources in kinds:
        for src in sources:
            items.append(
                prepare(
                    src,
                    kind,
                    cache_dir=cache_dir,
                    allow_pickle=spec.allow_pickle,
                    progress=progress,
                    ensure_space=space,
                )
            )
    if eval_plan:  # NLTK data the tasks' helpers would download at run time (bundler/nltk_data.py)
        from bundler.eval_tasks import nltk_needs

        if needs := nltk_needs(eval_plan):
            from bundler.nltk_data import fetch_nltk_packages

            items += fetch_nltk_packages(list(needs), cache_dir, spec.nltk_index_url, users=needs)
    _unique_paths(items)
    _check_items(items)
    if eval_plan:
        from bundler.eval_tasks import attach_eval_tasks

        attach_eval_tasks(items, eval_plan)
    return items


def _fetch_wheels(
    spec: PackSpec,
    cache_dir: Path,
    wheel_tmp: Path,
    progress: bool,
    resolution: Any,
    engines: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[SourceFile]]:
    """Download the resolved wheels into ``wheel_tmp``, each serving engine's (``engines``: name -> its
    :func:`bundler.wheels.resolve_engine`) into ``wheel_tmp/engines/NAME`` (bundle path ``wheels/engines/NAME/``,
    its lock beside them), and fetch the serving tools (``serving: [gguf]``), which ride in wheels/ unlocked.
    Returns the wheels' metadata (:func:`bundler.wheels.download_wheels`; ``engines``: name -> the engine's own,
    ``expected``: every file's locked sha256 by its path under wheels/) and the files."""
    from bundler.wheels import ENGINES_DIRNAME, download_wheels, engine_spec

    wheels_meta = download_wheels(spec, wheel_tmp, progress=progress, resolution=resolution)
    wheel_files = [SourceFile(p.name, p, p.stat().st_size) for p in wheels_meta["wheels"]]
    wheels_meta["engines"] = {}
    for engine in spec.engines:
        folder = f"{ENGINES_DIRNAME}/{engine.engine}"
        meta = download_wheels(
            engine_spec(spec, engine), wheel_tmp / folder, progress=progress, resolution=(engines or {})[engine.engine]
        )
        meta["folder"], meta["requirement"], meta["exclude"] = folder, engine.requirement, list(engine.exclude)
        wheels_meta["engines"][engine.engine] = meta
        wheel_files += [SourceFile(f"{folder}/{p.name}", p, p.stat().st_size) for p in meta["wheels"]]
        wheels_meta["expected"].update({f"{folder}/{name}": sha for name, sha in meta["expected"].items()})
    from bundler.tools import fetch_tools  # serving tools (serving: [gguf]) ride in wheels/, unlocked

    for tool in fetch_tools(spec, cache_dir):
        wheel_files.append(SourceFile(tool.name, tool, tool.stat().st_size))
    return wheels_meta, wheel_files


def _plan_delta(
    items: list[PreparedItem],
    wheel_files: list[SourceFile],
    wheels_meta: dict[str, Any] | None,
    delta_base: Any,
    cache_dir: Path,
) -> Any:
    """How each file travels against ``delta_base`` (:func:`bundler.delta.plan_delta`, its work folder in
    ``cache_dir``, removed when planning fails). The digests go to the hash cache, so the pass that writes the
    bundle reads them instead of hashing the carried files again."""
    from bundler.delta import plan_delta

    hashes = DigestCache(cache_dir / HASH_CACHE_NAME)
    work = Path(tempfile.mkdtemp(prefix="delta-", dir=cache_dir))
    try:
        plan = plan_delta(
            items,
            wheel_files,
            delta_base,
            work_dir=work,
            hash_cache=hashes,
            expected_wheels=(wheels_meta or {}).get("expected"),
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    hashes.save()  # the pass below reads these digests instead of hashing the carried files again
    return plan


def _dry_run_result(spec: PackSpec, out: Path, items: list[PreparedItem], plan: Any, started: float) -> PackResult:
    """What ``pack(dry_run=True)`` returns: the delta ``plan`` (the bytes it would carry) and nothing written."""
    return PackResult(
        name=spec.name,
        bundle_dir=out / spec.name,
        archives=[],
        sums_path=None,
        manifest={},
        content_bytes=plan.carried_bytes,
        hashed_bytes=0,
        cached_hash_bytes=0,
        downloaded_bytes=sum(i.downloaded_bytes for i in items),
        elapsed_s=time.perf_counter() - started,
        delta=plan,
        dry_run=True,
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_bundle(
    spec: PackSpec,
    out: Path,
    items: list[PreparedItem],
    wheel_files: list[SourceFile],
    wheels_meta: dict[str, Any] | None,
    target: dict[str, Any] | None,
    cache_dir: Path,
    content: int,
    progress: bool,
    signer: Any = None,
    plan: Any = None,
) -> PackResult:
    """Write the bundle and put it in place: the directory staged and the archive written in one pass (each file
    hashed once, the metadata head filled last), the earlier bundle of the name set aside, the new one renamed in,
    the earlier one dropped. A failure anywhere puts the earlier bundle back (:func:`_put_back`). ``content``: the
    bytes of the files carried (for the progress bar)."""
    hash_cache = DigestCache(cache_dir / HASH_CACHE_NAME)
    from bundler.installer.generate import render  # (imported here: `python -m` runs that module as __main__)

    installer = render().encode("utf-8")  # generated now: the very code ferry install runs
    bar = _progress_bar(spec.name, content + len(installer), progress)
    writer = None
    try:
        with atomic_directory(out / spec.name, overwrite=True) as stage:  # (the earlier one is aside by then)
            os.chmod(stage, 0o777 & ~_umask())
            writer = BundleWriter(stage, out, spec.name, split_size=spec.split_size, on_bytes=bar.update)
            try:
                head = _MetadataHead(spec, items, wheel_files, wheels_meta, target, signer, plan)
                writer.reserve_head(head.bound())
                manifest_items = _write_items(writer, items, hash_cache, plan)
                if wheels_meta is not None:
                    manifest_items.append(_write_wheels(writer, wheel_files, wheels_meta, plan))
                content_hashed, content_cached = writer.hashed_bytes, writer.cached_bytes
                rec = writer.add_bytes(installer, INSTALLER_NAME)
                bar.update(rec.size)
                manifest = _new_manifest(spec, target, rec, manifest_items, plan)
                _write_head(writer, head, manifest)
                bar.close()
                hash_cache.save()
                kill_point("pack:written")  # the directory staged and the archive written, neither in place yet
                aside = _set_aside(out, spec.name)
            except BaseException:
                bar.close()
                writer.abort()
                raise
        # The directory is in place; now the tar / volumes, the .ferry.sha256 and the signature beside them.
        kill_point("pack:renamed")
        archives, sums_path = writer.commit()
        signature_path = head.write_beside(out)
    except BaseException:
        if writer is not None:
            writer.abort()
        _put_back(out, spec.name, quiet=True)
        raise
    _drop_aside(aside)
    if head.members_last:
        _warn_members_last(spec.name)
    return PackResult(
        name=spec.name,
        bundle_dir=out / spec.name,
        archives=archives,
        sums_path=sums_path,
        manifest=manifest,
        content_bytes=content,
        hashed_bytes=content_hashed,
        cached_hash_bytes=content_cached,
        downloaded_bytes=0,
        elapsed_s=0.0,
        skipped_files=[s for i in items for s in i.skipped_files],
        signature_path=signature_path,
        delta=plan,
    )


def _progress_bar(name: str, total: int, progress: bool) -> Any:
    """The tqdm bar of packing bundle ``name`` (``total`` bytes; disabled unless ``progress``)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"packing {name}",
        disable=not progress,
        dynamic_ncols=True,
    )


def _write_items(writer: BundleWriter, items: list[PreparedItem], hash_cache: DigestCache, plan: Any) -> list[dict]:
    """Write every model and dataset file (a delta bundle: what ``plan`` carries) and return the manifest items;
    a local item's revision is derived from its files' digests (:func:`local_revision`).

    Raises:
        SourceError: a hub file whose sha256 is not the one the hub states (the corrupt download is removed).
    """
    manifest_items: list[dict[str, Any]] = []
    for item in items:
        files: list[dict[str, Any]] = []
        for f in item.files:
            if plan is not None and _delta_reused(plan, writer, f"{item.path}/{f.rel}", f.rel, files):
                continue
            rec = writer.add_file(f.src, f"{item.path}/{f.rel}", known_sha256=hash_cache.get(f.src))
            if f.expected_sha256 and rec.sha256 != f.expected_sha256:
                hash_cache.drop(f.src)
                with contextlib.suppress(OSError):
                    f.src.unlink()  # a corrupt download: fetch it again next time
                hash_cache.save()
                raise SourceError(
                    f"{item.spec}: {f.rel} has sha256 {rec.sha256} but the hub states "
                    f"{f.expected_sha256}; the corrupt download was removed, run ferry pack again"
                )
            hash_cache.put(f.src, rec.sha256)
            files.append({"path": f.rel, "size": rec.size, "sha256": rec.sha256, **_carried(plan)})
        if item.revision is None:
            item.revision = local_revision([(x["path"], x["sha256"]) for x in files])
        manifest_items.append(_item_entry(item, files))
    return manifest_items


def _write_wheels(
    writer: BundleWriter, wheel_files: list[SourceFile], wheels_meta: dict[str, Any], plan: Any
) -> dict[str, Any]:
    """Write the wheels (a delta bundle: what ``plan`` carries), their lock and uv's pylock.toml; return the
    manifest's wheels item.

    Raises:
        SourceError: a wheel whose sha256 is not the one the resolver locked.
    """
    from bundler.wheels import PYLOCK_NAME, lock_text

    files: list[dict[str, Any]] = []
    expected = wheels_meta.get("expected", {})
    for f in wheel_files:
        if plan is not None and _delta_reused(plan, writer, f"wheels/{f.rel}", f.rel, files):
            continue
        rec = writer.add_file(f.src, f"wheels/{f.rel}")
        if f.rel in expected and rec.sha256 != expected[f.rel]:
            raise SourceError(
                f"wheels/{f.rel} has sha256 {rec.sha256} but the resolver locked "
                f"{expected[f.rel]}; run ferry pack again"
            )
        files.append({"path": f.rel, "size": rec.size, "sha256": rec.sha256, **_carried(plan)})
    lock = writer.add_bytes(
        lock_text(wheels_meta, {x["path"]: x["sha256"] for x in files}).encode(), f"wheels/{LOCK_NAME}"
    )
    files.append({"path": LOCK_NAME, "size": lock.size, "sha256": lock.sha256, **_carried(plan)})
    for meta in wheels_meta.get("engines", {}).values():  # each engine's own lock beside its wheels
        folder = meta["folder"]
        hashes = {x["path"].removeprefix(f"{folder}/"): x["sha256"] for x in files if x["path"].startswith(folder)}
        rec = writer.add_bytes(lock_text(meta, hashes).encode(), f"wheels/{folder}/{LOCK_NAME}")
        files.append({"path": f"{folder}/{LOCK_NAME}", "size": rec.size, "sha256": rec.sha256, **_carried(plan)})
    if wheels_meta.get("pylock"):  # uv's PEP 751 lock: where every file came from
        rec = writer.add_bytes(wheels_meta["pylock"].encode(), f"wheels/{PYLOCK_NAME}")
        files.append({"path": PYLOCK_NAME, "size": rec.size, "sha256": rec.sha256, **_carried(plan)})
    return _wheels_entry(wheels_meta["spec"], files, _engine_entries(wheels_meta))


def _new_manifest(
    spec: PackSpec,
    target: dict[str, Any] | None,
    installer: FileRecord,
    items: list[dict[str, Any]],
    plan: Any,
) -> dict[str, Any]:
    """The bundle's manifest (a new bundle_id, created now), validated as its own verifier would: a delta bundle
    gets format_version 2 and its base. :meth:`_MetadataHead.members` completes it."""
    support: list[dict[str, Any]] = [{"path": installer.path, "size": installer.size, "sha256": installer.sha256}]
    host = host_info()
    manifest = {
        "format_version": FULL_FORMAT_VERSION,
        "name": spec.name,
        "bundle_id": uuid.uuid4().hex,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "ferry_version": __version__,
        "host": host,
        "target": target,
        "support_files": support,
        "items": items,
    }
    if plan is not None:  # a delta bundle: readers before format_version 2 must refuse it
        manifest["format_version"] = FORMAT_VERSION
        manifest["base"] = plan.base.sha256
    validate_manifest(manifest)
    validate_delta(manifest)  # pack never writes a manifest its own verifier refuses
    return manifest


def _write_head(writer: BundleWriter, head: _MetadataHead, manifest: dict[str, Any]) -> None:
    """Write SHA256SUMS and fill the reserved head with manifest.json, its signature and the SBOM; when they
    outgrew the head (a bug), they go to the end of the archive instead (still a valid bundle)."""
    members = head.members(manifest)
    if not writer.fits_head(members):  # the bound missed (a bug): still a valid bundle, metadata last
        for path, data in members:
            writer.add_bytes(data, path)
        head.members_last = True
        members = []
    sums = "".join(_sums_line(hashlib.sha256(data).hexdigest(), path) for path, data in members)
    sums += "".join(_sums_line(r.sha256, r.path) for r in writer.records)
    writer.add_bytes(sums.encode(), SUMS_NAME)
    writer.write_head(members)


def _warn_members_last(name: str) -> None:
    """Warn (at :func:`_pack_held`'s call of :func:`_write_bundle`) that bundle ``name``'s metadata is at the end of
    its archive, where ferry inspect does not read it."""
    import warnings

    warnings.warn(
        f"bundle {name}: manifest.json outgrew the head reserved for it, so it is at the end of "
        f"the archive; ferry verify and install work, ferry inspect does not (please report this)",
        RuntimeWarning,
        stacklevel=3,
    )


def _carried(plan: Any) -> dict[str, str]:
    """The delta field of a file carried whole (none in a full bundle)."""
    return {"delta": "carried"} if plan is not None else {}


def _delta_reused(plan: Any, writer: BundleWriter, bundle_path: str, rel: str, files: list[dict[str, Any]]) -> bool:
    """For a delta bundle: when the file at ``bundle_path`` is not carried whole, append its manifest entry to
    ``files`` (writing its carried tensors as ``deltas/...``) and return True."""
    from bundler.delta import patch_member

    decision = plan.decisions[bundle_path]
    if decision.mode == "carried":
        return False
    if decision.mode == "tensors":
        writer.add_file(decision.patch_file, patch_member(bundle_path), known_sha256=decision.patch["sha256"])
    files.append({"path": rel, "size": decision.size, "sha256": decision.sha256, **decision.fields()})
    return True


def _item_entry(item: PreparedItem, files: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest entry of a model or dataset item (bundler/format.py)."""
    return {
        "kind": item.kind,
        "source": item.source,
        "spec": item.spec,
        "repo_id": item.repo_id,
        "revision_requested": item.revision_requested,
        "revision": item.revision,
        "license": item.license,
        "trust_remote_code": item.trust_remote_code,
        "python_files": item.python_files,
        "skipped_files": item.skipped_files,
        "path": item.path,
        "files": files,
        **({"eval_tasks": item.eval_tasks} if item.eval_tasks else {}),
        **({"media": item.media} if item.media is not None else {}),
    }


# ---------------------------------------------------------------------------------------------------------
# Metadata first: manifest.json, its signature and sbom.cdx.json (reserved before the pass, filled after).
# ---------------------------------------------------------------------------------------------------------

#: Slack on the manifest's bound on top of the placeholder estimate (fields added after the estimate).
MANIFEST_SLACK = 64 * 1024


def _load_signer(sign: str | os.PathLike | None) -> Any:
    if sign is None:
        return None
    from bundler.signing import Signer

    return Signer.load(Path(sign))


def provenance(spec: PackSpec) -> dict[str, Any]:
    """Where and with what the bundle was packed: hub endpoints, pip indexes, host name, full Python version
    and platform string. Endpoints are read now (``$HF_ENDPOINT``, ``$MODELSCOPE_DOMAIN``, ``$PIP_INDEX_URL``)."""
    import platform
    import socket

    from ferry.constants import hf_endpoint

    wheels = spec.wheels
    index = wheels.index_url or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    return {
        "hf_endpoint": hf_endpoint(),
        "ms_endpoint": os.environ.get("MODELSCOPE_DOMAIN") or "www.modelscope.cn",
        "pip_index_urls": [] if wheels.no_wheels else [index, *wheels.extra_index_urls],
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


class _MetadataHead:
    """The head members of one pack: :meth:`bound` before the pass, :meth:`members` after it."""

    def __init__(
        self,
        spec: PackSpec,
        items: list[PreparedItem],
        wheel_files: list[SourceFile],
        wheels_meta: dict[str, Any] | None,
        target: dict[str, Any] | None,
        signer: Any,
        plan: Any = None,
    ) -> None:
        from bundler.sbom import wheel_metadata

        self.spec, self.items, self.wheel_files, self.signer = spec, items, wheel_files, signer
        self.wheels_meta, self.target, self.plan = wheels_meta, target, plan
        self.wheel_info = {f.rel: wheel_metadata(f.src) for f in wheel_files if f.rel.endswith(".whl")}
        self.signature: bytes | None = None
        #: True when the members outgrew the reserved head and went to the end (ferry inspect then refuses)
        self.members_last = False

    def _placeholder(self) -> dict[str, Any]:
        """A manifest shaped like the final one, every digest and revision a placeholder of the same length."""
        zero = "0" * 64
        items = []

        def delta(bundle_path: str) -> dict[str, Any]:  # the exact delta fields (decided before the pass)
            return self.plan.decisions[bundle_path].fields() if self.plan is not None else {}

        for item in self.items:
            files = [
                {"path": f.rel, "size": f.size, "sha256": zero, **delta(f"{item.path}/{f.rel}")} for f in item.files
            ]
            entry = _item_entry(item, files)
            entry["revision"] = entry["revision"] or "0" * 40
            items.append(entry)
        if self.wheels_meta is not None:
            files = [
                {"path": f.rel, "size": f.size, "sha256": zero, **delta(f"wheels/{f.rel}")} for f in self.wheel_files
            ]
            files.append({"path": LOCK_NAME, "size": 10**12, "sha256": zero, "delta": "from_base"})
            for meta in self.wheels_meta.get("engines", {}).values():
                files.append(
                    {"path": f"{meta['folder']}/{LOCK_NAME}", "size": 10**12, "sha256": zero, "delta": "from_base"}
                )
            items.append(_wheels_entry(self.wheels_meta.get("spec"), files, _engine_entries(self.wheels_meta)))
        host = host_info()
        return {
            "format_version": FULL_FORMAT_VERSION,
            "name": self.spec.name,
            "bundle_id": uuid.uuid4().hex,
            **({"base": zero} if self.plan is not None else {}),
            "created": "2000-01-01T00:00:00Z",
            "ferry_version": __version__,
            "host": host,
            "target": self.target,  # known before the pass (resolved with the wheels)
            "provenance": provenance(self.spec),
            "signature": self.signer.manifest_entry() if self.signer else None,
            "support_files": [
                {"path": INSTALLER_NAME, "size": 10**12, "sha256": zero},
                {"path": SBOM_NAME, "size": 10**12, "sha256": zero},
            ],
            "items": items,
        }

    def bound(self) -> int:
        """Upper bound in bytes of the reserved tar head (manifest, signature, SBOM and the filler header)."""
        from bundler.sbom import sbom_bound
        from bundler.signing import MAX_SIGNATURE_BYTES

        placeholder = self._placeholder()
        text = _manifest_bytes(placeholder)
        manifest = len(text) + len(text) // 4 + MANIFEST_SLACK
        sizes = [manifest, sbom_bound(placeholder, self.wheel_info)]
        if self.signer is not None:
            sizes.append(MAX_SIGNATURE_BYTES)
        return head_bound(self.spec.name, sizes)

    def members(self, manifest: dict[str, Any]) -> list[tuple[str, bytes]]:
        """Complete ``manifest`` (provenance, signer, the SBOM's entry in ``support_files``) and return the
        head members in order: manifest.json, [manifest.json.sig], sbom.cdx.json."""
        from bundler.sbom import build_sbom

        manifest["provenance"] = provenance(self.spec)
        if self.signer is not None:
            manifest["signature"] = self.signer.manifest_entry()
        sbom = build_sbom(manifest, self.wheel_info)
        manifest["support_files"].append(
            {"path": SBOM_NAME, "size": len(sbom), "sha256": hashlib.sha256(sbom).hexdigest()}
        )
        data = _manifest_bytes(manifest)
        members = [(MANIFEST_NAME, data)]
        if self.signer is not None:
            self.signature = self.signer.sign(data)
            members.append((SIGNATURE_NAME, self.signature))
        members.append((SBOM_NAME, sbom))
        return members

    def write_beside(self, out: Path) -> Path | None:
        """Write ``OUT/NAME.ferry.sig`` (signed packs) or remove a stale one; return its path or None."""
        path = out / f"{self.spec.name}{SIGNATURE_SUFFIX}"
        if self.signature is None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        atomic_write_text(path, self.signature.decode("ascii"))
        os.chmod(path, 0o666 & ~_umask())
        return path


def _engine_entries(wheels_meta: dict[str, Any]) -> dict[str, Any]:
    """The wheels item's ``engines``: engine name -> ``{"requirement", "exclude", "lock"}`` (``lock``: its lock's
    path under wheels/, ``engines/NAME/requirements.lock``, beside its wheels)."""
    return {
        name: {"requirement": m["requirement"], "exclude": m["exclude"], "lock": f"{m['folder']}/{LOCK_NAME}"}
        for name, m in wheels_meta.get("engines", {}).items()
    }


def _wheels_entry(spec: Any, files: list[dict[str, Any]], engines: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest item of the bundle's wheels (resolved by uv from ``spec``): ``files`` as in every item;
    ``engines`` (:func:`_engine_entries`) when the bundle carries serving engines."""
    extra = {"engines": engines} if engines else {}
    return {
        "kind": "wheels",
        "source": "uv",
        "spec": spec,
        "repo_id": None,
        "revision_requested": None,
        "revision": None,
        "license": None,
        "trust_remote_code": False,
        "python_files": [],
        "path": "wheels",
        "files": files,
        **extra,
    }


def _bundle_set(out: Path, name: str) -> list[Path]:
    """What a pack of ``name`` puts in ``out`` and is there now: the directory, the tar or its volumes
    (``NAME.ferry.tar.NNN``), the volumes' ``NAME.ferry.sha256`` and the signature ``NAME.ferry.sig``."""
    base = f"{name}{ARCHIVE_SUFFIX}"
    found = [out / name, out / base, out / f"{name}{VOLUMES_SUMS_SUFFIX}", out / f"{name}{SIGNATURE_SUFFIX}"]
    found += sorted(p for p in out.glob(f"{glob.escape(base)}.*") if p.name[len(base) + 1 :].isdigit())
    return [p for p in found if os.path.lexists(p)]


def _aside_dir(out: Path, name: str) -> Path:
    """Where the earlier bundle of ``name`` waits while a pack renames its own in (``OUT/.NAME.ferry-aside``)."""
    return out / f".{name}.ferry-aside"


#: In the aside folder once the whole earlier set is in it: from then on what is under the bundle's names is new.
_ASIDE_COMPLETE = ".complete"


def _set_aside(out: Path, name: str) -> Path | None:
    """Move the earlier bundle of ``name`` in ``out`` (:func:`_bundle_set`) into :func:`_aside_dir` as one set and
    mark it complete; None when there is none. A kill before the mark leaves part of the set in place and part
    aside, after it new files under the names: :func:`_put_back` undoes either."""
    earlier = _bundle_set(out, name)
    if not earlier:
        return None
    aside = _aside_dir(out, name)
    aside.mkdir()
    for path in earlier:
        os.replace(path, aside / path.name)
    (aside / _ASIDE_COMPLETE).touch()
    kill_point("pack:aside")
    return aside


def _drop_aside(aside: Path | None) -> None:
    """Delete the earlier set once the new bundle is wholly in place: renamed to a ``.tmp`` name first, so that a
    kill while it is deleted leaves what the next holder removes (:func:`ferry.folder_lock.hold_name`), never a
    part of the earlier set to put back."""
    if aside is None:
        return
    gone = aside.with_name(f"{aside.name}-{os.getpid()}.tmp")
    os.replace(aside, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _put_back(out: Path, name: str, quiet: bool = False) -> None:
    """Put back the earlier bundle of ``name`` that a pack set aside and did not finish replacing (it failed, or
    it was killed and this pack holds the name now): what the stopped pack renamed in is removed first when the
    set was complete, then every file of the set goes back under its name, with one line unless ``quiet``."""
    aside = _aside_dir(out, name)
    if not aside.is_dir():
        return
    if (aside / _ASIDE_COMPLETE).exists():
        for path in _bundle_set(out, name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for path in sorted(aside.iterdir()):
        if path.name != _ASIDE_COMPLETE:
            os.replace(path, out / path.name)
    shutil.rmtree(aside)
    if not quiet:
        print(
            f"ferry: put back the earlier bundle {out / name} (directory and archive), which a stopped pack had "
            f"moved aside to {aside.name} to replace it",
            file=sys.stderr,
        )


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()
