"""The install's file-system primitives: permission bits, atomic text and links, temp folders, staying inside
the prefix, and the prefix itself as a place to write (writable, locked, rid of what a killed install left).

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from bundler.format import WHEEL_STORE_DIRNAME
from ferry.errors import BundleError, PrefixError, UnsafeArchiveError
from ferry.fsutil import atomic_write_text, process_umask

# ferry.fsutil's SHARED_UMASK / PRIVATE_UMASK apply for the whole install (bundler/installer/install.py), so the venv
# pip builds gets them too; the helpers here set them explicitly where tempfile creates 0600/0700 entries.


def current_umask() -> int:
    """The process's umask (:func:`ferry.fsutil.process_umask`)."""
    return process_umask()


def atomic_text(path: Path, text: str) -> None:
    """Write ``path`` through a temp file ``.NAME.XXXX.tmp`` beside it and one rename, with the install's permission
    bits (``0o666 & ~umask``; see :func:`ferry.fsutil.atomic_write_bytes`)."""
    atomic_write_text(path, text, mode=0o666 & ~current_umask())


def atomic_symlink(target: str, link: Path) -> None:
    """Point ``link`` at ``target`` (relative), replacing what is there in one rename."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}.lnk")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def make_temp_dir(prefix: str, dir: Path) -> Path:
    """``tempfile.mkdtemp`` with the install's permission bits (mkdtemp itself makes 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    os.chmod(path, 0o777 & ~current_umask())
    return path


def check_inside(root_real: str, path: Path, what: str) -> None:
    """Refuse ``path`` unless it, with every symbolic link already on disk resolved, lies inside ``root_real``
    (the prefix's own real path)."""
    real = os.path.realpath(path)
    if real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep):
        raise UnsafeArchiveError(
            f"{what} would be written at {path}, which resolves to {real}, outside the "
            f"prefix {root_real} (refused; nothing was installed)"
        )


#: Seconds an install waits for the prefix lock before it says another install is running: far longer than a
#: check that only tests the lock (:func:`prefix_busy`, as ``ferry verify --prefix`` does) holds it.
LOCK_WAIT_S = 2.0


class PrefixLock:
    """An exclusive ``flock`` on the prefix directory itself for the whole install (nothing is created in the
    prefix to hold it, so a refused install leaves the prefix exactly as it was). ``wait_s``: how long to try
    before refusing (an install: :data:`LOCK_WAIT_S`; a check: 0).

    Raises:
        BundleError: another process held the lock all that time (another install is running).
    """

    def __init__(self, prefix: Path, wait_s: float = LOCK_WAIT_S) -> None:
        self.prefix, self.wait_s = prefix, wait_s

    def __enter__(self) -> PrefixLock:
        import fcntl
        import time

        self.fd = os.open(self.prefix, os.O_RDONLY | os.O_DIRECTORY)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise BundleError(f"another ferry install is running into {self.prefix}") from None
                time.sleep(0.05)

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def prefix_busy(prefix: Path) -> bool:
    """True while another process holds ``prefix``'s :class:`PrefixLock` (an install is running). Holds the lock
    for an instant: an install that starts then waits for it (:data:`LOCK_WAIT_S`)."""
    try:
        with PrefixLock(prefix, wait_s=0):
            return False
    except BundleError:
        return True


def clean_stray_temps(prefix: Path) -> list[str]:
    """Remove what a killed install leaves: staging folders, ``.NAME.XXXX.tmp`` files of atomic writes and
    ``.NAME.PID.TID.lnk`` links (ferry.env, state.json, dataset_info.json, refs/*, the venv link). Runs under
    the prefix lock, so no other install owns them. Returns the removed paths."""
    removed = []
    for stale in prefix.glob(".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(str(stale))
    candidates = [
        prefix,
        prefix / ".ferry",
        prefix / ".ferry" / "manifests",
        prefix / "datasets",
        prefix / WHEEL_STORE_DIRNAME,
    ]
    hub = prefix / "hf-home" / "hub"
    if hub.is_dir():
        for repo in hub.glob("*--*"):
            refs = repo / "refs"
            if refs.is_dir():
                candidates += [Path(root) for root, _, _ in os.walk(refs)]
    for folder in candidates:
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".") and (path.name.endswith(".tmp") or path.name.endswith(".lnk")):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(str(path))
    return removed


def writable_prefix(prefix: Path) -> None:
    """Create ``prefix`` if needed and check that this account can write into it (one line otherwise)."""
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise PrefixError(
            f"cannot create the prefix {prefix}: permission denied (choose another --prefix, or run as its owner)"
        ) from None
    except OSError as exc:
        raise PrefixError(f"cannot create the prefix {prefix}: {exc.strerror}") from None
    if os.statvfs(prefix).f_flag & os.ST_RDONLY:
        raise PrefixError(f"the prefix {prefix} is on a read-only file system: choose another --prefix")
    if not os.access(prefix, os.W_OK | os.X_OK):
        st = prefix.stat()
        raise PrefixError(
            f"the prefix {prefix} is not writable by this account (uid {os.getuid()}; owner uid "
            f"{st.st_uid}, mode {stat.filemode(st.st_mode)}): choose another --prefix, or run as "
            f"its owner"
        )
    probe = prefix / f".ferry-write-test.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PrefixError(f"the prefix {prefix} cannot be written: {exc.strerror} (a read-only file system?)") from None
