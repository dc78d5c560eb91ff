"""Find installed models offline: a local path, the Hugging Face cache, or the ModelScope cache.

Used by the trainer (``model_name_or_path``) and the exporter (the adapter's base model). It never opens a
network connection: every lookup is ``local_files_only``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ferry.errors import NotInstalledError

#: A hub repo id as configs and pack specs name one, ``ORG/NAME`` (letters, digits, ``_``, ``.``, ``-``; the
#: organisation starting with a letter or digit): what is not one of these is read as a path.
#: :func:`bundler.installer.fields.check_repo_id` applies huggingface_hub's full rule to what a bundle carries.
REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def resolve_model(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """Return the local directory of a model.

    ``name_or_path`` is an existing directory, or a repo id (``ORG/NAME``) installed in the Hugging Face cache
    (``$HF_HOME/hub``, as ``ferry install`` places it) or in the ModelScope cache (``$MODELSCOPE_CACHE``).
    ``revision`` is a branch, tag or commit hash (default: the cache's ``main`` ref).

    Raises:
        NotInstalledError: nothing matching is installed; the message says which ``ferry pack`` source to add.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    repo_id = str(name_or_path)
    if repo_id.startswith(("hf:", "ms:")):
        repo_id = repo_id[3:]
    if "@" in repo_id and revision is None:
        repo_id, revision = repo_id.split("@", 1)
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/", "~")):
        raise NotInstalledError(f"model path {str(name_or_path)!r} does not exist")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=hf_hub_cache()))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    found = _modelscope_local(repo_id, revision)
    if found is not None:
        return found
    raise NotInstalledError(
        f"model {repo_id!r}{'@' + revision if revision else ''} is not installed on this host: add "
        f"'hf:{repo_id}' (or 'ms:{repo_id}') to the models of your ferry pack spec, carry the bundle over and "
        f"run 'ferry install', then 'source PREFIX/ferry.env' so HF_HOME points at it"
    )


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).

    huggingface_hub freezes its own constant at import; ferry reads it per call so that a process which set
    ``HF_HOME`` after importing huggingface_hub (``ferry demo``, tests) still finds what ``ferry install`` placed.
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def modelscope_cache_dir() -> Path:
    """The ModelScope cache root, read from ``$MODELSCOPE_CACHE`` at each call (default ``~/.cache/modelscope``).

    modelscope-hub reads the variable once, at import, into its config; a process that changes it later (a
    test, a notebook, ``ferry install`` then ``ferry pack`` in one process) must pass this to the SDK as
    ``cache_dir`` so that the SDK looks where the variable says now.
    """
    cache = os.environ.get("MODELSCOPE_CACHE")
    return Path(cache) if cache else Path.home() / ".cache" / "modelscope"


def _modelscope_local(repo_id: str, revision: str | None) -> Path | None:
    """The model's folder in the ModelScope cache (``$MODELSCOPE_CACHE``, default ``~/.cache/modelscope``, the
    default of modelscope-hub, which modelscope >= 1.38 downloads through).

    ``ferry install`` places a model where modelscope-hub keeps it: ``models/ORG--NAME/snapshots/REVISION``
    (REVISION: the name asked for at pack time, ``master`` by default; without ``revision`` here, ``master``
    then ``main``). Older SDKs and ferry before that kept ``models/ORG/NAME`` with every ``.`` of the name
    written ``___`` (``Qwen2.5-0.5B`` -> ``Qwen2___5-0___5B``), under ``hub/`` in the default cache, or
    ``ORG/NAME``; those are still read, the ``___`` ones first as the SDK does
    (modelscope_hub/_download.py ``_find_legacy_repo_dir``). When no folder matches, the SDK itself is asked,
    offline.
    """
    root = modelscope_cache_dir()
    org, _, name = repo_id.partition("/")
    safe = name.replace(".", "___")
    snapshots = root / "models" / f"{org}--{name}" / "snapshots"
    candidates = [root / "models" / org / safe, root / "hub" / "models" / org / safe]
    candidates += [snapshots / r for r in ([revision] if revision else ["master", "main"])]
    candidates += [root / "models" / repo_id, root / repo_id, root / "hub" / repo_id]
    for candidate in candidates:
        if (candidate / "config.json").is_file() or (candidate / "configuration.json").is_file():
            return candidate.resolve()
    try:
        from modelscope import snapshot_download as ms_snapshot_download
    except ImportError:
        return None
    try:
        found = ms_snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=str(root))
    except Exception:  # the SDK raises assorted errors (ValueError, its own) for "not in the cache"
        return None
    return Path(found) if found and Path(found).is_dir() else None
