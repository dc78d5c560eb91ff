"""Turn a :class:`bundler.spec.SourceSpec` into a :class:`PreparedItem`: local files ready to be packed, with
the revision resolved, the licence read, and the safety rules applied.

* ``hf:ORG/NAME[@REVISION]``: ``huggingface_hub`` (honours ``HF_ENDPOINT`` and ``HF_TOKEN``). The revision is
  resolved to its commit hash with ``HfApi().model_info`` / ``dataset_info`` (``files_metadata=True`` also
  gives each LFS file's sha256, checked after packing), then ``snapshot_download(local_dir=...)`` fetches
  exactly the selected files into ``CACHE/hf/{models,datasets}/ORG/NAME/COMMIT``; a second run finds complete
  files there and downloads nothing (huggingface_hub's own ``.cache/huggingface`` metadata, resumable
  ``.incomplete`` files).
* ``ms:ORG/NAME[@REVISION]``: the modelscope SDK (``modelscope.snapshot_download`` into ``CACHE/ms``).
* a local folder or file.

Safety rules (:func:`apply_safety`): pickle weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``)
are left out when safetensors weights exist in the same folder, refused otherwise unless ``allow_pickle``;
``*.py`` files are listed and the item is marked ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bundler.format import DATASETS_CACHE_DIRNAME, PICKLE_SUFFIXES
from bundler.source_file import SourceFile
from bundler.spec import SourceSpec
from ferry.constants import hf_endpoint, hf_token
from ferry.errors import SourceError
from ferry.hub import modelscope_cache_dir

if TYPE_CHECKING:  # (huggingface_hub is imported when a hub source is prepared)
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

Kind = Literal["model", "dataset"]

#: Folders never carried from a local source: VCS metadata and huggingface_hub's local-dir metadata.
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".cache"}
#: Files never carried (VCS / OS noise).
SKIP_FILES = {".gitattributes", ".DS_Store"}


@dataclass
class PreparedItem:
    """A model or dataset whose files are on local disk, ready for :class:`bundler.writer.BundleWriter`.

    ``revision`` is the resolved commit hash (None for local sources until the files are hashed; see
    :func:`local_revision`). ``path`` is the item's folder inside the bundle (e.g. ``models/hf/ORG/NAME``).
    """

    kind: Kind
    source: Literal["hf", "ms", "local", "nltk"]
    spec: str
    repo_id: str
    revision_requested: str | None
    revision: str | None
    path: str
    files: list[SourceFile]
    license: str | None = None
    python_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    downloaded_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: lm-eval tasks that read this dataset: ``{"task", "config", "version"}`` (bundler/eval_tasks.py)
    eval_tasks: list[dict[str, str | None]] = field(default_factory=list)
    #: the images and videos its rows name, ``{"images", "videos", "bytes"}`` (bundler/media.py); None when no entry
    #: declares either
    media: dict[str, int] | None = None

    @property
    def trust_remote_code(self) -> bool:
        """True when the item holds Python files (custom modelling code)."""
        return bool(self.python_files)

    @property
    def size(self) -> int:
        """Total bytes of the item's files."""
        return sum(f.size for f in self.files)


def _matches(rel: str, patterns: list[str] | None) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(rel, p.rstrip("/") + "/*") for p in patterns or [])


def select(rels: list[str], include: list[str] | None, exclude: list[str] | None) -> list[str]:
    """Keep the paths that match an ``include`` pattern (all when None) and no ``exclude`` pattern.
    Patterns are fnmatch patterns over POSIX relative paths; ``*`` crosses ``/`` as in huggingface_hub."""
    return [r for r in rels if (include is None or _matches(r, include)) and not _matches(r, exclude)]


def apply_safety(rels: list[str], *, allow_pickle: bool, label: str) -> tuple[list[str], list[str], list[str]]:
    """Apply the pickle and remote-code rules to repo-relative paths.

    Returns ``(kept, skipped, python_files)``. A pickle file whose folder also holds ``*.safetensors`` is
    skipped (the same weights exist in a safe format), together with its ``*.bin.index.json``.

    Raises:
        SourceError: pickle files without safetensors beside them and not ``allow_pickle``; names them.
    """
    safetensor_dirs = {posixpath.dirname(r) for r in rels if r.endswith(".safetensors")}
    kept: list[str] = []
    skipped: list[str] = []
    refused: list[str] = []
    for rel in rels:
        folder = posixpath.dirname(rel)
        is_pickle = rel.endswith(PICKLE_SUFFIXES)
        is_pickle_index = any(rel.endswith(f"{s}.index.json") for s in PICKLE_SUFFIXES)
        if (is_pickle or is_pickle_index) and folder in safetensor_dirs:
            skipped.append(rel)
        elif is_pickle and not allow_pickle:
            refused.append(rel)
        else:
            kept.append(rel)
    if refused:
        raise SourceError(
            f"{label}: refusing pickle files that can run arbitrary code when loaded: {', '.join(refused)} "
            f"(no safetensors weights beside them); pass --allow-pickle (allow_pickle: true) to carry them anyway"
        )
    python_files = [r for r in kept if r.endswith(".py")]
    return kept, skipped, python_files


def read_license(folder: Path) -> str | None:
    """The ``license`` in the front matter of ``folder/README.md`` (a model or dataset card), or None."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except Exception:  # a malformed card is not a reason to fail the pack  # noqa: BLE001
        return None
    value = meta.get("license")
    if isinstance(value, list):
        value = ", ".join(map(str, value))
    return str(value) if value else None


def local_revision(records: list[tuple[str, str]]) -> str:
    """sha1 (40 hex, like a git commit) over the sorted ``(path, sha256)`` pairs of a local item."""
    h = hashlib.sha1()
    for rel, digest in sorted(records):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def prepare_local(spec: SourceSpec, kind: Kind, *, allow_pickle: bool) -> PreparedItem:
    """A local folder (walked, hidden VCS folders skipped, symlinked files followed) or a single file.

    Raises:
        SourceError: the path does not exist, or is empty after filtering, or holds refused pickles.
    """
    path = spec.path
    if not path.exists():
        raise SourceError(f"local {kind} {str(path)!r} does not exist")
    if path.is_file():
        found = {path.name: path}
    else:
        found = _walk(path)
    name = spec.local_repo_id.split("/", 1)[1]
    rels = select(sorted(found), spec.include, spec.exclude)
    if not rels:
        raise SourceError(f"local {kind} {str(path)!r} has no files to pack (after include/exclude)")
    kept, skipped, python_files = apply_safety(rels, allow_pickle=allow_pickle, label=f"local {kind} {path}")
    files = [SourceFile(rel, found[rel], found[rel].stat().st_size) for rel in kept]
    media = None
    if kind == "dataset" and path.is_dir():  # every image the rows name must travel with them
        from bundler.media import check_media

        media = check_media(path, set(kept))
    return PreparedItem(
        kind=kind,
        source="local",
        spec=spec.source,
        repo_id=f"local/{name}",
        revision_requested=None,
        revision=None,
        path=f"{kind}s/local/{name}",
        files=files,
        license=read_license(path) if path.is_dir() else None,
        python_files=python_files,
        skipped_files=skipped,
        media=media,
    )


def prepare(
    spec: SourceSpec,
    kind: Kind,
    *,
    cache_dir: Path,
    allow_pickle: bool,
    progress: bool = True,
    ensure_space: Callable[[int, str], None] | None = None,
) -> PreparedItem:
    """Dispatch on the source scheme; see the module docstring. ``cache_dir`` holds hub downloads.
    ``ensure_space(bytes, what)`` is called before a download with the bytes it will write."""
    if spec.scheme == "hf":
        return prepare_hf(
            spec, kind, cache_dir=cache_dir, allow_pickle=allow_pickle, progress=progress, ensure_space=ensure_space
        )
    if spec.scheme == "ms":
        return prepare_ms(
            spec, kind, cache_dir=cache_dir, allow_pickle=allow_pickle, progress=progress, ensure_space=ensure_space
        )
    return prepare_local(spec, kind, allow_pickle=allow_pickle)


def _glob_escape(name: str) -> str:
    """An fnmatch pattern that matches exactly ``name``."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _snapshot_state(folder: Path, rels: list[str]) -> dict[str, tuple[int, int]]:
    state = {}
    for rel in rels:
        with contextlib.suppress(FileNotFoundError):
            st = (folder / rel).stat()
            state[rel] = (st.st_size, st.st_mtime_ns)
    return state


@contextlib.contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled and not was_disabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def prepare_hf(
    spec: SourceSpec,
    kind: Kind,
    *,
    cache_dir: Path,
    allow_pickle: bool,
    progress: bool = True,
    ensure_space: Callable[[int, str], None] | None = None,
) -> PreparedItem:
    """Resolve, select and download a Hugging Face repo (``repo_type`` dataset for datasets).

    The endpoint and token are read now (``$HF_ENDPOINT``, ``$HF_TOKEN``), not at import. Files land in
    ``cache_dir/hf/{models,datasets}/ORG/NAME/COMMIT`` via ``snapshot_download(local_dir=...)``: complete files
    from an earlier run are not fetched again, partial ones resume.

    Raises:
        SourceError: repo or revision not found, gated/private without a token, hub unreachable, refused
            pickles, or nothing left after include/exclude.
    """
    from huggingface_hub import HfApi

    repo_id, requested = spec.repo_id, spec.revision
    assert repo_id is not None
    endpoint, token = hf_endpoint(), hf_token()
    repo_type = "model" if kind == "model" else "dataset"
    label = f"{spec.source} ({endpoint})"
    info, commit, entries = _hf_listing(HfApi(endpoint=endpoint, token=token), repo_id, repo_type, requested, label)

    by_path = {e.path: e for e in entries if posixpath.basename(e.path) not in SKIP_FILES}
    rels = select(sorted(by_path), spec.include, spec.exclude)
    if kind == "dataset" and any(p.split("/")[0] == DATASETS_CACHE_DIRNAME for p in rels):
        raise SourceError(
            f"{label}: the repo holds a folder {DATASETS_CACHE_DIRNAME}/, which ferry reserves for "
            f"the datasets cache it builds; exclude it (exclude: ['{DATASETS_CACHE_DIRNAME}/*'])"
        )
    if not rels:
        raise SourceError(f"{label}: no files to pack at {commit} (after include/exclude)")
    kept, skipped, python_files = apply_safety(rels, allow_pickle=allow_pickle, label=label)

    local_dir = cache_dir / "hf" / f"{kind}s" / repo_id / commit
    before = _before_download(local_dir, kept, {r: by_path[r].size for r in kept}, spec.source, ensure_space)
    _hf_snapshot(repo_id, repo_type, commit, local_dir, kept, endpoint, token, label, progress)
    downloaded, after = _delivered(local_dir, kept, before, f"{label}: the hub")
    files = []
    for rel in kept:
        entry = by_path[rel]
        if after[rel][0] != entry.size:
            raise SourceError(f"{label}: {rel} is {after[rel][0]} bytes on disk but the hub lists {entry.size}")
        files.append(SourceFile(rel, local_dir / rel, entry.size, entry.lfs.sha256 if entry.lfs else None))
    license_ = _card_licence(info)
    if license_ is None:
        license_ = read_license(local_dir)
    notes: list[str] = []
    if kind == "dataset" and spec.datasets_cache:  # what load_dataset("ORG/NAME") reads offline (hub_datasets.py)
        arrow, notes = _hf_datasets_cache(spec, repo_id, commit, local_dir, cache_dir)
        files += arrow
    return PreparedItem(
        kind=kind,
        source="hf",
        spec=spec.source,
        repo_id=repo_id,
        revision_requested=requested,
        revision=commit,
        path=f"{kind}s/hf/{repo_id}",
        files=files,
        license=license_,
        python_files=python_files,
        skipped_files=skipped,
        downloaded_bytes=downloaded,
        notes=notes,
    )


def _hf_listing(
    api: HfApi, repo_id: str, repo_type: str, requested: str | None, label: str
) -> tuple[Any, str, list[RepoFile]]:
    """``(info, commit, files)`` of a hub repo: ``requested`` (``main`` when None) resolved to its commit hash,
    and every file at that commit (directories left out).

    Raises:
        SourceError: gated, not found (or private without a token), no such revision, hub unreachable; no
            commit hash returned.
    """
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=requested or "main")
        commit = info.sha
        if not commit:
            raise SourceError(f"{label}: the hub did not return a commit hash for revision {requested or 'main'!r}")
        entries = [
            e
            for e in api.list_repo_tree(repo_id, repo_type=repo_type, revision=commit, recursive=True)
            if isinstance(e, huggingface_hub.hf_api.RepoFile)
        ]
    except GatedRepoError:
        raise SourceError(f"{label}: the repo is gated; accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{label}: no such {repo_type} repo (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise SourceError(f"{label}: revision {requested!r} not found") from None
    except (HfHubHTTPError, OSError, ConnectionError) as exc:
        raise SourceError(f"{label}: cannot reach the hub: {exc}") from None
    except Exception as exc:  # httpx transport errors are not OSError
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise SourceError(f"{label}: cannot reach the hub: {exc}") from None
        raise
    return info, commit, entries


def _before_download(
    folder: Path,
    kept: list[str],
    sizes: dict[str, int],
    source: str,
    ensure_space: Callable[[int, str], None] | None,
) -> dict[str, tuple[int, int]]:
    """The ``(size, mtime_ns)`` of the ``kept`` files already in ``folder``, after ``ensure_space`` was asked for
    the bytes of those whose size on disk differs from ``sizes`` (what the download will write)."""
    before = _snapshot_state(folder, kept)
    to_fetch = sum(sizes[r] for r in kept if before.get(r, (-1,))[0] != sizes[r])
    if to_fetch and ensure_space is not None:
        ensure_space(to_fetch, f"downloading {source} ({to_fetch} bytes)")
    return before


def _delivered(
    folder: Path, kept: list[str], before: dict[str, tuple[int, int]], who: str
) -> tuple[int, dict[str, tuple[int, int]]]:
    """``(bytes downloaded, state after)`` of the ``kept`` files in ``folder`` once a download returned: the bytes
    of the files that changed since ``before`` (:func:`_before_download`).

    Raises:
        SourceError: a file is missing (``who``, e.g. ``LABEL: the hub``, did not deliver it).
    """
    after = _snapshot_state(folder, kept)
    missing = [r for r in kept if r not in after]
    if missing:
        raise SourceError(f"{who} did not deliver {', '.join(missing)}")
    return sum(after[r][0] for r in kept if before.get(r) != after[r]), after


def _hf_snapshot(
    repo_id: str,
    repo_type: str,
    commit: str,
    local_dir: Path,
    kept: list[str],
    endpoint: str,
    token: str | None,
    label: str,
    progress: bool,
) -> None:
    """``snapshot_download`` of exactly the ``kept`` files at ``commit`` into ``local_dir`` (resumable).

    Raises:
        SourceError: the download failed (run ferry pack again to resume).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        with _hf_progress(progress):
            snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=commit,
                local_dir=local_dir,
                endpoint=endpoint,
                token=token,
                allow_patterns=[_glob_escape(r) for r in kept],
                max_workers=4,
            )
    except (HfHubHTTPError, OSError) as exc:
        raise SourceError(f"{label}: download failed (run ferry pack again to resume): {exc}") from None
    except Exception as exc:
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise SourceError(f"{label}: download failed (run ferry pack again to resume): {exc}") from None
        raise


def _card_licence(info: Any) -> str | None:
    """The ``license`` of a hub repo's card data (``repo_info``), lists joined; None when it states none."""
    card = getattr(info, "card_data", None) or getattr(info, "cardData", None)
    if card is None:
        return None
    value = card.get("license") if hasattr(card, "get") else None
    if isinstance(value, list):
        value = ", ".join(map(str, value))
    return str(value) if value else None


def _hf_datasets_cache(
    spec: SourceSpec, repo_id: str, commit: str, local_dir: Path, cache_dir: Path
) -> tuple[list[SourceFile], list[str]]:
    """The files of the datasets Arrow cache of a hub dataset downloaded to ``local_dir`` (what
    ``datasets.load_dataset("ORG/NAME")`` reads offline, bundler/hub_datasets.py), and a note when the datasets
    library cannot read the repo (then no cache is packed)."""
    from bundler.hub_datasets import build_arrow_cache

    arrow, why = build_arrow_cache(repo_id, commit, local_dir, cache_dir / "hf" / "datasets-arrow" / repo_id / commit)
    notes = []
    if why:
        notes.append(
            f"{spec.source}: no datasets cache packed, so datasets.load_dataset({repo_id!r}) will not "
            f"find it offline (the datasets library cannot read the repo: {why}); dataset_info.json "
            f"entries still name its files"
        )
    return arrow, notes


def _ms_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        import requests

        errors.append(requests.RequestException)
    with contextlib.suppress(ImportError):
        from modelscope_hub import errors as ms_errors

        errors += [v for v in vars(ms_errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    return tuple(errors)


def _walk(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for fname in sorted(files):
            full = Path(root) / fname
            if fname not in SKIP_FILES and full.is_file():
                found[full.relative_to(folder).as_posix()] = full
    return found


def prepare_ms(
    spec: SourceSpec,
    kind: Kind,
    *,
    cache_dir: Path,
    allow_pickle: bool,
    progress: bool = True,
    ensure_space: Callable[[int, str], None] | None = None,
) -> PreparedItem:
    """A ModelScope repo through the modelscope SDK (``modelscope.hub.snapshot_download``).

    Online: the SDK lists the files at the revision (with their sha256, checked after packing) and downloads
    the selected ones into ``cache_dir/ms/{models,datasets}/ORG/NAME/REVISION``. With ``MODELSCOPE_OFFLINE=1``
    the SDK's own cache (``$MODELSCOPE_CACHE``) is used instead (``local_files_only``), without network.
    ``revision`` is the requested name (default ``master``; a 40-hex commit when one was asked for): the SDK
    exposes no commit for a branch or tag. Checked in modelscope-hub 0.5.1 / modelscope 1.40.2:
    ``HubApi.get_repo`` -> ``RepoInfo`` (no commit field), ``HubApi.list_repo_files`` -> ``FileInfo`` (path,
    size, blob_id, sha256, type, last_modified, lfs), ``list_revisions`` / ``get_valid_revision_detail`` ->
    dicts keyed ``Revision`` (the name) and ``CreatedAt``; ``CommitInfo`` and modelscope's
    ``CommitHistoryResponse`` / ``ModelInfo.sha`` exist as types, but no SDK call returns them. The raw
    listing (``HubApi.legacy.list_repo_files``) may carry a per-file ``Revision`` that modelscope's old cache
    called a commit id (modelscope/hub/utils/caching.py), a property of each file, not of the snapshot.

    Raises:
        SourceError: the SDK failed (not found, unreachable, not cached offline), refused pickles, no files.
    """
    from modelscope.hub.snapshot_download import snapshot_download as ms_snapshot_download

    repo_id = spec.repo_id
    assert repo_id is not None
    requested = spec.revision
    revision = requested or "master"
    repo_type = "model" if kind == "model" else "dataset"
    label = f"{spec.source} (ModelScope)"
    offline = os.environ.get("MODELSCOPE_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    downloaded = 0
    folder, sizes, expected = _ms_listing(spec, kind, cache_dir, revision, label, offline)
    rels = select(sorted(sizes), spec.include, spec.exclude)
    if not rels:
        raise SourceError(f"{label}: no files to pack at {revision!r} (after include/exclude)")
    kept, skipped, python_files = apply_safety(rels, allow_pickle=allow_pickle, label=label)
    if not offline:
        before = _before_download(folder, kept, sizes, spec.source, ensure_space)
        try:
            ms_snapshot_download(
                repo_id=repo_id,
                repo_type=repo_type,
                revision=revision,
                local_dir=str(folder),
                allow_patterns=[_glob_escape(r) for r in kept],
            )
        except _ms_errors() as exc:
            raise SourceError(f"{label}: download failed (run ferry pack again to resume): {exc}") from None
        downloaded, _ = _delivered(folder, kept, before, f"{label}: the SDK")
    files = [SourceFile(rel, folder / rel, (folder / rel).stat().st_size, expected.get(rel)) for rel in kept]
    return PreparedItem(
        kind=kind,
        source="ms",
        spec=spec.source,
        repo_id=repo_id,
        revision_requested=requested,
        revision=revision,
        path=f"{kind}s/ms/{repo_id}",
        files=files,
        license=read_license(folder),
        python_files=python_files,
        skipped_files=skipped,
        downloaded_bytes=downloaded,
    )


def _ms_listing(
    spec: SourceSpec, kind: Kind, cache_dir: Path, revision: str, label: str, offline: bool
) -> tuple[Path, dict[str, int], dict[str, str | None]]:
    """``(folder, sizes, sha256s)`` of a ModelScope repo at ``revision``: ``offline``, the SDK's own cached
    snapshot (sizes from disk, no sha256); online, the SDK's listing (sizes and sha256 by path) and the folder
    under ``cache_dir/ms`` to download into.

    Raises:
        SourceError: not in the ModelScope cache (offline), or the listing failed (online).
    """
    from modelscope.hub.snapshot_download import snapshot_download as ms_snapshot_download

    repo_id = spec.repo_id
    assert repo_id is not None
    repo_type = "model" if kind == "model" else "dataset"
    try:
        if offline:
            folder = Path(
                ms_snapshot_download(
                    repo_id=repo_id,
                    repo_type=repo_type,
                    revision=revision,
                    local_files_only=True,
                    cache_dir=str(modelscope_cache_dir()),
                )
            )
            found = _walk(folder)
            sizes = {rel: path.stat().st_size for rel, path in found.items()}
            expected: dict[str, str | None] = {rel: None for rel in found}
        else:
            from modelscope_hub.api import HubApi

            api = HubApi(token=os.environ.get("MODELSCOPE_API_TOKEN") or None)
            infos = [f for f in api.list_repo_files(repo_id, repo_type, revision=revision) if not f.is_dir]
            sizes = {f.path: f.size for f in infos if posixpath.basename(f.path) not in SKIP_FILES}
            expected = {f.path: f.sha256 for f in infos}
            folder = cache_dir / "ms" / f"{kind}s" / repo_id / revision
    except _ms_errors() as exc:
        how = (
            "is not in the ModelScope cache ($MODELSCOPE_CACHE) and MODELSCOPE_OFFLINE=1"
            if offline
            else "could not be listed"
        )
        raise SourceError(f"{label}: revision {revision!r} {how}: {type(exc).__name__}: {exc}") from None
    return folder, sizes, expected
