"""Hashing while reading: a background thread hashes (and writes) each chunk while the caller reads the next.

Standard library only (part of the generated ``install.py``). Sizes are in bytes, digests lowercase hex.
"""

from __future__ import annotations

import hashlib
import os
import queue
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Read and hash size in bytes: big enough that hashlib releases the GIL and syscalls are few.
CHUNK_SIZE = 1024 * 1024


Progress = Callable[[int], None]


class HashWorker:
    """One background thread running submitted callables in order.

    ``hashlib.update`` and file writes release the GIL on buffers over 2 KiB, so the caller's reads (tar
    parsing, ``read``) overlap with hashing and writing. At most ``depth`` chunks wait in the queue (memory
    bound: ``depth * CHUNK_SIZE`` bytes). An exception in the worker is re-raised by the next
    :meth:`submit` or by :meth:`drain`.
    """

    def __init__(self, depth: int = 8) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ferry-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:
                    task()
            except BaseException as exc:  # handed to the caller thread
                self._error = exc
            finally:
                self._queue.task_done()

    def submit(self, task: Callable[[], Any]) -> None:
        """Run ``task()`` in the worker after every earlier task."""
        if self._error is not None:
            raise self._error
        self._queue.put(task)

    def drain(self) -> None:
        """Wait until every submitted task has run; re-raise the first worker exception."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the thread (after the queued tasks)."""
        self._queue.put(None)
        self._thread.join()


def hash_file(path: str | os.PathLike, progress: Progress | None = None) -> tuple[int, Any]:
    """Stream ``path`` once; return ``(size in bytes, the sha256 hash object)``. ``progress(n)`` per chunk."""
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(CHUNK_SIZE)
            if not chunk:
                break
            hasher.update(chunk)
            size += len(chunk)
            if progress:
                progress(len(chunk))
    return size, hasher


def size_and_sha256(path: str | os.PathLike, progress: Progress | None = None) -> tuple[int, str]:
    """Stream ``path`` once; return ``(size in bytes, sha256 hex)``. ``progress(n)`` after each chunk."""
    size, hasher = hash_file(path, progress)
    return size, hasher.hexdigest()


def copy_hashing(src: Path, dest: Path | None, worker: HashWorker, progress: Progress | None) -> tuple[int, str]:
    """Read ``src`` once, hash it (and write it to ``dest``, created exclusively) in ``worker``."""
    hasher = hashlib.sha256()
    size = 0
    out = None
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        out = open(dest, "xb")
    try:
        with open(src, "rb", buffering=0) as fh:
            while True:
                chunk = fh.read(CHUNK_SIZE)
                if not chunk:
                    break
                size += len(chunk)
                worker.submit(hash_task(hasher, out, chunk))
                if progress:
                    progress(len(chunk))
        worker.drain()
    finally:
        if out is not None:
            out.close()
    return size, hasher.hexdigest()


def hash_task(hasher: Any, out: Any, chunk: bytes) -> Callable[[], None]:
    def task() -> None:
        hasher.update(chunk)
        if out is not None:
            out.write(chunk)

    return task


def same_file(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` (followed through links) holds exactly ``size`` bytes with this sha256."""
    try:
        if os.stat(path).st_size != size:
            return False
        return size_and_sha256(path)[1] == sha256
    except OSError:
        return False


def same_inode(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same file (a hard link of it), without following a link at ``a``."""
    try:
        sa, sb = os.lstat(a), os.stat(b)
    except OSError:
        return False
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
