"""The real chat templates of Qwen3, Llama 3.x, Gemma, Mistral and GLM-4, fetched at test time (never committed).

The texts are the model vendors' own ``chat_template`` strings (each under its vendor's licence, so ferry does not
carry them). llama.cpp keeps verbatim copies in ``models/templates/`` and the llama-cpp-python source
distribution on PyPI vendors llama.cpp, so one pinned, hash-checked download gives all of them:

    package   llama-cpp-python 0.3.36, file llama_cpp_python-0.3.36.tar.gz (76.6 MB)
    sha256    832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
    members   llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/<file>.jinja

:data:`TEMPLATES` maps a short name to (member file, the Hugging Face model repository whose
``tokenizer_config.json`` / ``chat_template.jinja`` the file copies). There is no Gemma-3 file in that release:
Gemma-2 (the same turn layout as Gemma-3: ``<start_of_turn>model``, system refused) and Gemma-4 stand in.

The sdist's URL is found the way pip finds it, through the simple index (``$PIP_INDEX_URL``, default
https://pypi.org/simple/, JSON form of PEP 691); the download is checked against the pinned SHA-256, only the
needed members are extracted, into ``${XDG_CACHE_HOME:-~/.cache}/ferry-tests/chat-templates/<sha256>/``, so later
runs need no network. A failed download or a wrong hash FAILS the test session (pytest.fail), it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
FILENAME = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"

#: name -> (member file under MEMBER_DIR, original model repository on the Hugging Face hub)
TEMPLATES: dict[str, tuple[str, str]] = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "Qwen/Qwen3-0.6B"),
    "qwen3.5": ("Qwen3.5-4B.jinja", "Qwen/Qwen3.5-4B"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama/Llama-3.1-8B-Instruct"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "meta-llama/Llama-3.2-3B-Instruct"),
    "gemma2": ("google-gemma-2-2b-it.jinja", "google/gemma-2-2b-it"),
    "gemma4": ("google-gemma-4-31B-it.jinja", "google/gemma-4-31B-it"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistralai/Mistral-Nemo-Instruct-2407"),
    "mistral-small3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistralai/Mistral-Small-3.2-24B-Instruct-2506"),
    "glm4.6": ("GLM-4.6.jinja", "zai-org/GLM-4.6"),
    "glm4.7-flash": ("GLM-4.7-Flash.jinja", "zai-org/GLM-4.7-Flash"),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai/DeepSeek-V3.1"),
}


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/ferry-tests/chat-templates/<sha256>``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ferry-tests" / "chat-templates" / SHA256


def _sdist_url() -> str:
    """The sdist's URL from the simple index (PEP 691 JSON), checked to carry the pinned hash."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/")
    req = urllib.request.Request(f"{index}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        page = json.load(resp)
    for entry in page["files"]:
        if entry["filename"] == FILENAME:
            if entry.get("hashes", {}).get("sha256") not in (None, SHA256):
                raise RuntimeError(f"{index} lists {FILENAME} with sha256 {entry['hashes']['sha256']}, not {SHA256}")
            return urllib.parse.urljoin(resp.url, entry["url"])
    raise RuntimeError(f"{index}/{PACKAGE}/ lists no {FILENAME}")


def _extract(target: Path) -> None:
    from tests.support.llama_cpp_sdist import sdist_path  # imports this module: imported late

    archive = sdist_path()  # the llama.cpp tests' download, hash-checked, one per machine
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        wanted = {MEMBER_DIR + member for member, _ in TEMPLATES.values()}
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:
                if info.name in wanted and info.isfile():
                    (staging / Path(info.name).name).write_bytes(tar.extractfile(info).read())
                    wanted.discard(info.name)
        if wanted:
            raise RuntimeError(f"{FILENAME} lacks {sorted(wanted)}")
        try:
            staging.rename(target)  # atomic: a complete folder or none
        except OSError:
            if not target.is_dir():  # another session renamed its own complete copy first: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def chat_template_texts() -> dict[str, str]:
    """name -> the template text, downloading once per cache (see the module docstring)."""
    target = cache_dir()
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            _extract(target)
        except Exception as exc:  # noqa: BLE001 - the reason goes into the failure
            pytest.fail(f"cannot obtain the real chat templates ({PACKAGE} {VERSION} sdist): {exc}", pytrace=False)
    return {name: (target / member).read_text(encoding="utf-8") for name, (member, _) in TEMPLATES.items()}


@pytest.fixture(scope="session")
def real_chat_templates() -> dict[str, str]:
    """name -> real chat template text (see :data:`TEMPLATES` for each one's provenance)."""
    return chat_template_texts()
