"""Every environment variable ferry reads or sets, in one place (as huggingface_hub's ``constants.py``).

Standard library only: the bundle's stand-alone ``install.py`` is generated with this module in it
(bundler/installer/generate.py) and writes ``OFFLINE_ENV`` into ``PREFIX/ferry.env``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

#: Variables that make the Hugging Face, ModelScope and experiment-tracking libraries stay off the network.
#: ``ferry install`` writes them into ``PREFIX/ferry.env``; ``ferry train`` / ``ferry export`` set them in
#: their own process and in every worker before any of those libraries is imported.
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "DO_NOT_TRACK": "1",
    "DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "WANDB_DISABLED": "true",
    # Read by ferry, not by ModelScope's SDK (modelscope 1.40 / modelscope-hub 0.5 have no offline variable):
    # ``ferry pack`` (bundler.sources.prepare_ms) and the hook ``ferry install`` puts in the venv
    # (bundler.installer.modelscope.ms_offline_hook_files), which then calls the SDK with ``local_files_only=True``.
    "MODELSCOPE_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: Root of an installed prefix (``ferry install --prefix DIR`` writes ``FERRY_HOME=DIR`` into ferry.env).
FERRY_HOME_VAR = "FERRY_HOME"


#: Where, relative to an installed prefix, an install that is changing it keeps its journal (what to restore if it
#: is interrupted); the CLI looks for it before commands that read the prefix, without importing ``bundler``.
INSTALL_JOURNAL = Path(".ferry") / "journal.json"


def ferry_home() -> Path | None:
    """The installed prefix named by ``$FERRY_HOME``, or None when unset."""
    value = os.environ.get(FERRY_HOME_VAR)
    return Path(value) if value else None


def hf_endpoint() -> str:
    """The Hugging Face endpoint (``$HF_ENDPOINT``, a mirror or the real hub)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hf_token() -> str | None:
    """``$HF_TOKEN`` when set, for gated or private repos during ``ferry pack``."""
    return os.environ.get("HF_TOKEN") or None


def apply_offline_env(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set :data:`OFFLINE_ENV` in ``env`` (default: ``os.environ``) without overriding values already set
    to something else by the user, except the ``*_OFFLINE`` switches which are always forced to ``1``.

    Returns the mapping that was changed.
    """
    target = os.environ if env is None else env
    for key, value in OFFLINE_ENV.items():
        if key.endswith("_OFFLINE") or key not in target:
            target[key] = value
    return target


#: Root of ferry's own caches (tokenised datasets, pack downloads): ``$FERRY_CACHE``, default
#: ``$XDG_CACHE_HOME/ferry`` or ``~/.cache/ferry``.
FERRY_CACHE_VAR = "FERRY_CACHE"


def ferry_cache_dir() -> Path:
    """The directory for ferry's caches (created on demand by the caller)."""
    value = os.environ.get(FERRY_CACHE_VAR)
    if value:
        return Path(value)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ferry"
