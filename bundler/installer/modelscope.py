"""ModelScope models in a prefix: where they go, and the hook that keeps ModelScope's SDK offline in the venv.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

from pathlib import Path

from ferry.errors import BundleError

#: ModelScope's SDK (modelscope 1.40 over modelscope-hub 0.5) has no offline switch of its own: no environment
#: variable makes ``snapshot_download`` or ``AutoModelForCausalLM.from_pretrained("ORG/NAME")`` skip the network;
#: only the keyword ``local_files_only=True`` does. This module, placed in the venv's site-packages with the
#: ``.pth`` line that imports it (see :func:`ms_offline_hook_files`), adds that keyword to the SDK's download
#: entry points whenever ``MODELSCOPE_OFFLINE`` is true (ferry.env sets it), read at each call.
MS_OFFLINE_HOOK_MODULE = "_ferry_modelscope_offline"


_MS_OFFLINE_HOOK_SOURCE = f'''"""Written by ferry install: ModelScope's SDK honours MODELSCOPE_OFFLINE=1 (stdlib).

modelscope >= 1.38 downloads through modelscope_hub.compat, whose snapshot_download / model_file_download
(and the dataset variants) list the repository on the network unless called with local_files_only=True, and no
environment variable sets that (modelscope 1.40.2, modelscope-hub 0.5.1). While MODELSCOPE_OFFLINE is 1/true/
yes/on at call time, this hook passes local_files_only=True to them, so the SDK answers from $MODELSCOPE_CACHE
at once or raises its CacheNotFound error. A function without that keyword (another SDK version) is left as it
is. Remove this file and {MS_OFFLINE_HOOK_MODULE}.pth to turn the hook off.
"""

import importlib.machinery
import os
import sys

_TARGETS = {{
    "modelscope_hub.compat.snapshot_download": ("snapshot_download", "dataset_snapshot_download"),
    "modelscope_hub.compat.file_download": ("model_file_download", "dataset_file_download"),
}}


def offline():
    return os.environ.get("MODELSCOPE_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _forcing(func):
    import functools
    import inspect

    try:
        if "local_files_only" not in inspect.signature(func).parameters:
            return func
    except (TypeError, ValueError):
        return func

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if offline():
            kwargs["local_files_only"] = True
        return func(*args, **kwargs)

    wrapper.__ferry_offline__ = True
    return wrapper


def _patch(module):
    for attr in _TARGETS.get(module.__name__, ()):
        func = getattr(module, attr, None)
        if callable(func) and not getattr(func, "__ferry_offline__", False):
            setattr(module, attr, _forcing(func))


class _Finder:
    """Finds the targets as the path finder does, then patches them right after they are executed (before
    any ``from ... import`` of their functions elsewhere)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install():
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(type(f).__name__ == "_Finder" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:  # never break interpreter start-up
    pass
'''


def ms_offline_hook_files() -> dict[str, str]:
    """Files to write into a venv's ``site-packages`` (``sysconfig.get_path("purelib", vars={"base": VENV,
    "platbase": VENV})``) so that ModelScope's SDK in that venv stays offline while ``MODELSCOPE_OFFLINE`` is
    true: ``{"_ferry_modelscope_offline.py": <hook source>, "_ferry_modelscope_offline.pth": "import ..."}``
    (file name -> text). Python runs the ``.pth`` line at start-up (the ``site`` module); the hook costs one
    dictionary look-up per import until ``modelscope_hub.compat`` is imported.

    Why a hook: modelscope 1.40.2 / modelscope-hub 0.5.1 read no offline variable at all (modelscope_hub/
    constants.py registers every variable they read; none is an offline switch), and
    ``AutoModelForCausalLM.from_pretrained("ORG/NAME")`` calls ``snapshot_download`` without
    ``local_files_only`` (modelscope/utils/hf_util/patcher.py ``get_model_dir``), which lists the repository on
    modelscope.cn and fails after ~22 s of retries on an isolated host.
    """
    return {
        f"{MS_OFFLINE_HOOK_MODULE}.py": _MS_OFFLINE_HOOK_SOURCE,
        f"{MS_OFFLINE_HOOK_MODULE}.pth": f"import {MS_OFFLINE_HOOK_MODULE}\n",
    }


def ms_model_dir(prefix: Path, repo_id: str, revision: str) -> Path:
    """Where a ModelScope model ``ORG/NAME`` at ``revision`` (the name asked for, ``master`` by default; the
    manifest's ``revision_requested``) goes in a prefix: ``PREFIX/modelscope/models/ORG--NAME/snapshots/REVISION``,
    the layout modelscope-hub (>= 0.1, used by modelscope >= 1.38) writes and reads under ``$MODELSCOPE_CACHE``
    (modelscope_hub/_download.py ``_repo_cache_dir_path``, ``_resolve_cached_snapshot``). The files go there
    as they are (no blobs, links or metadata files: the SDK reads none).

    The SDK looks this folder up by revision: ``from_pretrained("ORG/NAME")`` asks for ``master``
    (patcher.py ``_ms_revision``), ``snapshot_download("ORG/NAME")`` for ``master``, then ``main``, then the
    only snapshot present. A model packed at another revision is found by passing ``revision=`` (else the
    SDK names the revisions it has). The older layout ``models/ORG/NAME___`` (dots as ``___``) is still read,
    before this one and whatever the revision asked: an install must not leave one behind for the same repo.

    Raises:
        BundleError: ``repo_id`` is not ``ORG/NAME`` or ``revision`` is not a safe relative name.
    """
    owner, _, name = repo_id.partition("/")
    bad = {"", ".", ".."}
    if owner in bad or name in bad or "/" in name or "\\" in repo_id:
        raise BundleError(f"ModelScope repo id {repo_id!r} is not ORG/NAME")
    parts = revision.split("/")
    if not revision or revision.startswith("/") or any(p in bad for p in parts) or "\\" in revision:
        raise BundleError(f"ModelScope revision {revision!r} of {repo_id} is not a safe relative name")
    return Path(prefix) / "modelscope" / "models" / f"{owner}--{name}" / "snapshots" / Path(*parts)
