"""A real Hugging Face hub for tests: the ``olah`` mirror server serving local git repos on 127.0.0.1.

olah (PyPI ``olah``) answers the hub API (``/api/models/ORG/NAME/revision/REV``, ``/api/.../tree/...``,
``/ORG/NAME/resolve/REV/FILE``) from git repositories under a mirrors folder when its config says::

    [basic]
    host = "127.0.0.1"
    port = PORT
    mirrors-path = ["DIR/mirrors"]
    [accessibility]
    offline = true

Repos live at ``DIR/mirrors/models/ORG/NAME`` and ``DIR/mirrors/datasets/ORG/NAME`` (one git commit per
:meth:`Hub.commit` call). Files matching ``lfs`` patterns are committed as git-lfs pointers with the object
under ``.git/lfs/objects/OID[:2]/OID[2:4]/OID``, as on the real hub, so clients see their sha256.

Usage::

    from tests.support.hub import serve_hub

    with serve_hub(tmp_path) as hub:                          # starts olah, waits until it answers
        sha = hub.add_model("stories/stories260K", STORIES_MODEL)   # -> 40-hex commit
        hub.add_dataset("llamafactory/alpaca_en_demo", {"alpaca_en_demo.json": path})
        env = {**os.environ, **hub.env()}                     # HF_ENDPOINT=http://127.0.0.1:PORT
        ...                                                   # olah is stopped on exit

``hub.endpoint`` is the URL; in-process code must pass it explicitly (``HfApi(endpoint=...)``) or read
``$HF_ENDPOINT`` at call time, because huggingface_hub reads ``HF_ENDPOINT`` once at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

#: Files committed as git-lfs pointers (as the hub's default .gitattributes does).
DEFAULT_LFS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.gguf")
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "ferry tests",
    "GIT_AUTHOR_EMAIL": "tests@ferry.invalid",
    "GIT_COMMITTER_NAME": "ferry tests",
    "GIT_COMMITTER_EMAIL": "tests@ferry.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    proc = subprocess.run(["git", "-C", str(repo), *args], env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout.strip()


@dataclass
class Hub:
    """A running olah server. ``endpoint`` = ``http://127.0.0.1:PORT``; ``mirrors`` = the mirrors folder;
    ``log`` = olah's combined stdout/stderr file."""

    endpoint: str
    mirrors: Path
    log: Path
    process: subprocess.Popen | None = None
    commits: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """Environment for a client process: ``HF_ENDPOINT`` and no Xet, no telemetry."""
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        files: Mapping[str, Path | bytes | str] | Path,
        *,
        message: str = "upload",
        lfs: tuple[str, ...] = DEFAULT_LFS,
        tag: str | None = None,
        replace: bool = True,
    ) -> str:
        """Commit ``files`` (``{repo path: source file, bytes or text}``, or a folder to copy whole) to the
        repo ``repo_type`` (``models`` / ``datasets``) ``repo_id`` on branch ``main``; returns the commit.

        With ``replace`` (default) the commit holds exactly ``files``; otherwise it adds to the last one.
        ``tag`` also tags the commit (a revision name clients may ask for).
        """
        if isinstance(files, Path):
            folder = files
            files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        repo = self.mirrors / repo_type / repo_id
        if not (repo / ".git").is_dir():
            repo.mkdir(parents=True, exist_ok=True)
            _git(repo, "init", "-q", "-b", "main")
        elif replace:
            for child in repo.iterdir():
                if child.name != ".git":
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        for rel, src in files.items():
            data = src.read_bytes() if isinstance(src, Path) else src.encode() if isinstance(src, str) else src
            dest = repo / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if any(fnmatchcase(rel, p) or fnmatchcase(Path(rel).name, p) for p in lfs):
                oid = hashlib.sha256(data).hexdigest()
                obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
                obj.parent.mkdir(parents=True, exist_ok=True)
                obj.write_bytes(data)
                data = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n".encode()
            dest.write_bytes(data)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", message)
        sha = _git(repo, "rev-parse", "HEAD")
        if tag:
            _git(repo, "tag", "-f", tag)
        self.commits[f"{repo_type}/{repo_id}"] = sha
        return sha

    def add_model(self, repo_id: str, files: Mapping[str, Path | bytes | str] | Path, **kw) -> str:
        """:meth:`commit` to ``models/ORG/NAME``."""
        return self.commit("models", repo_id, files, **kw)

    def add_dataset(self, repo_id: str, files: Mapping[str, Path | bytes | str] | Path, **kw) -> str:
        """:meth:`commit` to ``datasets/ORG/NAME``."""
        return self.commit("datasets", repo_id, files, **kw)

    def requests_for(self, text: str) -> int:
        """How many lines of olah's access log mention ``text`` (e.g. ``'/resolve/'`` to count downloads)."""
        with contextlib.suppress(FileNotFoundError):
            return sum(text in line for line in self.log.read_text(errors="replace").splitlines())
        return 0


@contextlib.contextmanager
def serve_hub(tmp_dir: str | os.PathLike, *, timeout: float = 60.0) -> Iterator[Hub]:
    """Start olah on a free 127.0.0.1 port with ``tmp_dir/mirrors`` as its only mirror, offline; yield a
    :class:`Hub`; stop the server on exit. Raises RuntimeError (with olah's log) when it does not come up."""
    root = Path(tmp_dir)
    mirrors = root / "mirrors"
    for sub in ("models", "datasets"):
        (mirrors / sub).mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = root / "olah.toml"
    config.write_text(
        "[basic]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f'repos-path = "{root / "olah-repos"}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        "metadata-cache-ttl = 0\n"
        "[accessibility]\n"
        "offline = true\n"
    )
    log = root / "olah.log"
    hub = Hub(endpoint=f"http://127.0.0.1:{port}", mirrors=mirrors, log=log)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env["PYTHONUNBUFFERED"] = "1"  # the access log must be current for Hub.requests_for
    with open(log, "wb") as log_fh:
        hub.process = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "--config", str(config), "--log-path", str(root / "olah-logs")],
            cwd=root,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if hub.process.poll() is not None:
                raise RuntimeError(f"olah exited with {hub.process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{hub.endpoint}/api/models/none/none", timeout=2):
                    pass
                break
            except urllib.error.HTTPError:
                break  # it answered (404 for a repo that does not exist)
            except (TimeoutError, urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"olah did not answer on {hub.endpoint}:\n{log.read_text()[-4000:]}") from None
                time.sleep(0.2)
        yield hub
    finally:
        hub.process.terminate()
        try:
            hub.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            hub.process.kill()
            hub.process.wait()
