"""One command at a time per output folder: an exclusive ``flock`` on the folder itself, and who holds it.

``ferry train`` holds its ``output_dir`` for the whole run: a second run on the same folder (another terminal,
another user, a scheduler that started the job twice) is refused in one line naming the holder, instead of both
appending to ``metrics.jsonl`` and writing the adapter twice. The kernel drops the lock when the holder exits,
however it exits, so a killed run never leaves a lock behind; the holder's record (``.ferry-lock.json`` in the
folder: pid, host, command, start time) only names it, and a record left by a process that is gone is replaced
with one line saying so. ``ferry eval`` holds its ``output_dir`` alike. ``ferry export`` creates its output by
renaming a staged folder into place, so it holds the name instead (:func:`hold_name`: the lock file
``.NAME.ferry-lock`` beside it, which carries the record and goes when the export ends); ``ferry pack`` holds its
bundle's name in its output folder the same way.

On a file system without working ``flock`` (an NFS mount without its lock daemon: ``ENOLCK``) the command runs
unlocked and says so in one line.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ferry.errors import ConfigError
from ferry.fsutil import atomic_write_text

#: The holder's record inside the locked folder.
RECORD = ".ferry-lock.json"


def _holder(record: Path) -> str:
    """The holder's record file as words ("pid 12 on host-a, ferry train since 2026-11-28 21:50:01"), or ''."""
    try:
        rec = json.loads(record.read_text(encoding="utf-8"))
        return f"pid {rec['pid']} on {rec['host']}, {rec['command']} since {rec['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _record(command: str) -> str:
    """This process's record as one JSON line."""
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": time.strftime("%F %T")}
    return json.dumps(rec) + "\n"


def _in_use(key: str, path: Path, record: Path) -> ConfigError:
    return ConfigError(
        f"{key} {str(path)!r} is in use by another run ({_holder(record) or 'its holder did not say who'}); "
        f"wait for it to finish or choose another {key}"
    )


def _unlockable(path: Path, exc: OSError) -> None:
    print(
        f"ferry: {path} cannot be locked ({os.strerror(exc.errno or 0)}): a second run on it would not be refused",
        file=sys.stderr,
    )


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
            if exc.errno in _HELD:
                raise _in_use(key, folder, folder / RECORD) from None
            _unlockable(folder, exc)
            locked = False
        if locked:
            stale = _holder(folder / RECORD)
            if stale:
                print(f"ferry: {key} {folder} was held by {stale}, which has stopped; taking it over", file=sys.stderr)
            atomic_write_text(folder / RECORD, _record(command))
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


def _remove_stages(path: Path) -> None:
    """Clean up after a killed holder of the name ``path``, with one line each: the name's lock is held now, so no
    live writer owns what it left. When the holder was killed between moving the earlier ``path`` aside
    (``.NAME.old-PID`` of an overwrite, :func:`ferry.fsutil.atomic_directory`) and renaming its new folder in, the
    earlier folder is renamed back first: what was there before the command is there again. Then what it was
    writing beside the name is removed: folders ``.NAME.XXXX.tmp`` and an ``.old-PID`` copy already replaced, files
    ``.NAME.*.tmp`` (``ferry pack``'s archive ``.NAME.ferry.tar.PID.tmp``)."""
    left = [
        p
        for p in path.parent.glob(f".{glob.escape(path.name)}.*")
        if not p.is_symlink() and (p.name.endswith(".tmp") or (p.is_dir() and ".old-" in p.name))
    ]
    earlier = [p for p in left if ".old-" in p.name]
    if len(earlier) == 1 and not os.path.lexists(path):
        os.replace(earlier[0], path)
        left.remove(earlier[0])
        print(
            f"ferry: put back {path}, which the stopped holder had moved aside to {earlier[0].name} to replace it",
            file=sys.stderr,
        )
    for stage in left:
        if stage.is_dir():
            shutil.rmtree(stage, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                stage.unlink()
    if left:
        names = ", ".join(sorted(p.name for p in left))
        print(f"ferry: removed what the stopped holder left half-written in {path.parent}: {names}", file=sys.stderr)


#: flock's answers when another open file description holds the lock.
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


@contextlib.contextmanager
def hold_name(path: str | os.PathLike, command: str, key: str = "--output") -> Iterator[Path]:
    """Hold the name ``path`` exclusively for the block, for a command that creates ``path`` by renaming a staged
    folder into place (``ferry export``), so that there is no folder to lock yet: an ``flock`` on the lock file
    ``PARENT/.NAME.ferry-lock``, which holds the record and is removed at the end. ``command`` and ``key`` as for
    :func:`hold_folder`.

    Raises:
        ConfigError: another process holds the name (one line naming it and its holder); the parent folder cannot
            be created or written.
    """
    import fcntl

    path = Path(path)
    lock = path.parent / f".{path.name}.ferry-lock"
    fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            opened = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(opened, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(opened)
                if exc.errno in _HELD:
                    raise _in_use(key, path, lock) from None
                _unlockable(path, exc)
                break
            try:  # the file a holder removed as it finished is not the lock any more: open the current one
                if os.fstat(opened).st_ino == os.stat(lock).st_ino:
                    fd = opened
                    break
            except FileNotFoundError:
                pass
            os.close(opened)
    except OSError as exc:  # an unwritable or unusable parent folder
        raise ConfigError(f"{key} {str(path)!r} cannot be locked in {path.parent} ({exc.strerror})") from None
    if fd is None:  # no working flock here: unlocked, as said
        yield path
        return
    try:
        stale = _holder(lock)
        if stale:
            print(f"ferry: {key} {path} was held by {stale}, which has stopped; taking it over", file=sys.stderr)
            _remove_stages(path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _record(command).encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still held: a process that opened it meanwhile sees it gone and opens a new one
        os.close(fd)


__all__ = ["RECORD", "hold_folder", "hold_name"]
