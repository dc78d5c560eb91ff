"""One command at a time per output folder: an exclusive ``flock`` on the folder itself, and who holds it.

``ferry train`` holds its ``output_dir`` for the whole run: a second run on the same folder (another terminal,
another user, a scheduler that started the job twice) is refused in one line naming the holder, instead of both
appending to ``metrics.jsonl`` and writing the adapter twice. The kernel drops the lock when the holder exits,
however it exits, so a killed run never leaves a lock behind; the holder's record (``.ferry-lock.json`` in the
folder: pid, host, command, start time) only names it, and a record left by a process that is gone is replaced
with one line saying so.

On a file system without working ``flock`` (an NFS mount without its lock daemon: ``ENOLCK``) the command runs
unlocked and says so in one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ferry.errors import ConfigError
from ferry.fsutil import atomic_write_text

#: The holder's record inside the locked folder.
RECORD = ".ferry-lock.json"


def _holder(folder: Path) -> str:
    """The holder's record as words ("pid 12 on host-a, ferry train since 2026-11-28 21:50:01"), or ''."""
    try:
        rec = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        return f"pid {rec['pid']} on {rec['host']}, {rec['command']} since {rec['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextlib.contextmanager
def hold_folder(folder: str | os.PathLike, command: str, key: str = "output_dir") -> Iterator[Path]:
    """Hold ``folder`` (created when absent, and removed again when the block leaves it empty) exclusively for the
    block; ``command`` names this holder in the record (``"ferry train"``), ``key`` the setting that chose the
    folder, for the messages.

    Raises:
        ConfigError: another process holds the folder (one line naming it and its holder); ``folder`` is a file or
            cannot be created.
    """
    import fcntl

    folder = Path(folder)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:  # a file of that name, a read-only parent
        raise ConfigError(f"{key} {str(folder)!r} cannot be used as a folder ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _holder(folder)
                raise ConfigError(
                    f"{key} {str(folder)!r} is in use by another run ({holder or 'its holder did not say who'}); "
                    f"wait for it to finish or choose another {key}"
                ) from None
            print(
                f"ferry: {folder} cannot be locked ({os.strerror(exc.errno or 0)}): a second run on it would not "
                "be refused",
                file=sys.stderr,
            )
            locked = False
        if locked:
            stale = _holder(folder)
            if stale:
                print(f"ferry: {key} {folder} was held by {stale}, which has stopped; taking it over", file=sys.stderr)
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": command,
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            atomic_write_text(folder / RECORD, json.dumps(record) + "\n")
        try:
            yield folder
        finally:
            if locked:
                with contextlib.suppress(OSError):
                    (folder / RECORD).unlink()
                if created:  # a command refused before it wrote anything leaves no empty folder behind
                    with contextlib.suppress(OSError):
                        folder.rmdir()
    finally:
        os.close(fd)  # releases the lock


__all__ = ["RECORD", "hold_folder"]
