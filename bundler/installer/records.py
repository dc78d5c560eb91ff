"""What a prefix records about itself: ``PREFIX/.ferry/state.json`` (the install record) and ``PREFIX/ferry.env``.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from bundler.format import NLTK_DATA_DIRNAME
from bundler.installer.manifest import content_id
from ferry.constants import OFFLINE_ENV


def load_state(prefix: Path) -> dict:
    path = prefix / ".ferry" / "state.json"
    if path.is_file():
        try:
            state = json.loads(path.read_text("utf-8"))
            return state if isinstance(state, dict) else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}
    return {}


def same_content(record: dict | None, item: dict) -> bool:
    """Whether an install record describes ``item``'s files (records of older installs hold a revision only)."""
    if not record:
        return False
    if "content" in record:
        return record["content"] == content_id(item)
    return record.get("revision") == item["revision"]


def prefix_env(prefix: str | os.PathLike) -> dict[str, str]:
    """The variables ``PREFIX/ferry.env`` sets: FERRY_HOME, HF_HOME, MODELSCOPE_CACHE, FERRY_DATASET_DIR,
    every :data:`OFFLINE_ENV` switch, ``NLTK_DATA`` when ``PREFIX/nltk_data`` exists and, when ``PREFIX/venv``
    exists, ``PATH`` with its ``bin`` first
    (followed by the current ``$PATH``)."""
    prefix = Path(prefix).absolute()
    env = {
        "FERRY_HOME": str(prefix),
        "HF_HOME": str(prefix / "hf-home"),
        "MODELSCOPE_CACHE": str(prefix / "modelscope"),
        "FERRY_DATASET_DIR": str(prefix / "datasets"),
        **OFFLINE_ENV,
    }
    if (prefix / NLTK_DATA_DIRNAME).is_dir():  # NLTK data packages (bundler/nltk_data.py)
        env["NLTK_DATA"] = str(prefix / NLTK_DATA_DIRNAME)
    if (prefix / "venv").exists():
        env["PATH"] = f"{prefix / 'venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


def render_env_file(prefix: Path) -> str:
    """The text of ``PREFIX/ferry.env`` (POSIX shell; ``source`` it)."""
    env = prefix_env(prefix)
    lines = ["# Written by ferry install. Use: source " + shell_quote(str(Path(prefix).absolute() / "ferry.env"))]
    for key, value in env.items():
        if key == "PATH":
            lines.append(f'export PATH={shell_quote(str(Path(prefix).absolute() / "venv" / "bin"))}:"$PATH"')
        else:
            lines.append(f"export {key}={shell_quote(value)}")
    return "\n".join(lines) + "\n"


def shell_quote(value: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:@%+=,-]+", value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"
