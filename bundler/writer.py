"""One-pass bundle writer: every source byte is read once, hashed, and written to both the bundle directory
and the tar stream (split into volumes when asked).

Per file, the main thread reads 4 MiB chunks and writes each chunk into the bundle directory, while a
two-thread pool hashes the same chunk (sha256 of the file) and appends it to the tar stream (which keeps
its own running sha256 per volume for ``NAME.ferry.sha256``). ``hashlib`` and file writes release the GIL on
large buffers, so reading, hashing and writing overlap. Reading chunk *i+1* overlaps with the work on
chunk *i*; at most two chunks are alive at a time.

The tar is an uncompressed POSIX (pax) stream built by hand with :meth:`tarfile.TarInfo.tobuf`: a header,
the data padded to 512 bytes, and at the end two zero blocks padded to tar's 10240-byte record, exactly what
``tarfile`` itself writes. Volumes (``NAME.ferry.tar.000``, ``.001``, ...) are a plain byte split of that
stream, so ``cat NAME.ferry.tar.* | tar x`` works. Every output is written under a temp name and renamed
only by :meth:`BundleWriter.commit`; :meth:`BundleWriter.abort` removes the temp files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from bundler.format import ARCHIVE_SUFFIX, VOLUME_DIGITS, VOLUMES_SUMS_SUFFIX
from ferry.errors import BundleError, SourceError
from ferry.fsutil import atomic_write_text

#: Read size: large enough for hashlib to release the GIL and for few syscalls, small enough for the cache.
CHUNK_SIZE = 4 * 1024 * 1024
BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240


@dataclass(frozen=True)
class FileRecord:
    """One file written into the bundle: ``path`` relative to the bundle root (POSIX), ``size`` in bytes,
    ``sha256`` hex digest, and whether the digest was ``hashed`` in this pass (False: taken from the cache)."""

    path: str
    size: int
    sha256: str
    hashed: bool = True


class _VolumeSink:
    """The tar byte stream, split into volumes of at most ``split_size`` bytes (None: one file).

    Each volume is written to a temp file ``.NAME.ferry.tar[.NNN].PID.tmp`` beside its final name, with a
    running sha256. ``finish`` closes the last volume; ``commit`` renames every volume into place.
    """

    def __init__(self, out_dir: Path, name: str, split_size: int | None) -> None:
        self.out_dir = out_dir
        self.base = f"{name}{ARCHIVE_SUFFIX}"
        self.split_size = split_size
        self.volumes: list[tuple[Path, Path, str]] = []  # (temp, final, sha256) of closed volumes
        self._fh: BinaryIO | None = None
        self._hash: Any = None
        self._in_volume = 0
        self.total = 0

    def _final_name(self, index: int) -> Path:
        if self.split_size is None:
            return self.out_dir / self.base
        return self.out_dir / f"{self.base}.{index:0{VOLUME_DIGITS}d}"

    def _open(self) -> None:
        final = self._final_name(len(self.volumes))
        self._tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        self._final = final
        self._fh = open(self._tmp, "wb")
        self._hash = hashlib.sha256()
        self._in_volume = 0

    def _close(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self.volumes.append((self._tmp, self._final, self._hash.hexdigest()))
        self._fh = None

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the stream (called from one thread at a time, in order)."""
        view = memoryview(data)
        while len(view):
            if self._fh is None:
                self._open()
            room = len(view) if self.split_size is None else min(len(view), self.split_size - self._in_volume)
            piece = view[:room]
            self._hash.update(piece)
            self._fh.write(piece)
            self._in_volume += room
            self.total += room
            view = view[room:]
            if self.split_size is not None and self._in_volume >= self.split_size:
                self._close()

    def finish(self) -> None:
        """Close the last volume (an empty stream still gives one volume)."""
        if self._fh is None and not self.volumes:
            self._open()
        if self._fh is not None:
            self._close()

    def commit(self) -> list[tuple[Path, str]]:
        """Rename every volume into place, remove stale volumes of an earlier pack; return (path, sha256)."""
        for tmp, final, _ in self.volumes:
            os.replace(tmp, final)
        keep = {final for _, final, _ in self.volumes}
        single = self.out_dir / self.base
        stale = [single, *(p for p in self.out_dir.glob(f"{self.base}.*") if p.name[len(self.base) + 1:].isdigit())]
        for path in stale:
            if path not in keep and path.is_file():
                path.unlink()
        return [(final, digest) for _, final, digest in self.volumes]

    def abort(self) -> None:
        """Close and delete every temp volume."""
        if self._fh is not None:
            self._fh.close()
            self.volumes.append((self._tmp, self._final, ""))
            self._fh = None
        for tmp, _, _ in self.volumes:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


class BundleWriter:
    """Write files into ``stage_dir`` (the future ``OUT/NAME``) and into ``OUT/NAME.ferry.tar`` in one pass.

    Members of the tar are named ``NAME/<path>``. Call :meth:`add_file` / :meth:`add_bytes` in the order the
    members should appear, then :meth:`finish`, then :meth:`commit` (renames the tar or volumes and writes
    ``NAME.ferry.sha256``), or :meth:`abort` on failure. ``on_bytes(n)`` is called after each chunk (progress).

    Raises:
        SourceError: a source file cannot be read, or changed size while being read.
        BundleError: a member path is absolute or contains ``..``.
    """

    def __init__(
        self, stage_dir: Path, out_dir: Path, name: str, *, split_size: int | None = None,
        on_bytes: Callable[[int], None] | None = None, mtime: int | None = None,
    ) -> None:
        self.stage_dir = Path(stage_dir)
        self.out_dir = Path(out_dir)
        self.name = name
        self.sink = _VolumeSink(self.out_dir, name, split_size)
        self.on_bytes = on_bytes or (lambda n: None)
        self.mtime = int(time.time()) if mtime is None else mtime
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ferry-pack")
        self.hashed_bytes = 0
        self.cached_bytes = 0
        self.records: list[FileRecord] = []
        self._seen: set[str] = set()
        self._finished = False

    # -- tar framing ---------------------------------------------------------------------------------------
    def _header(self, path: str, size: int) -> bytes:
        info = tarfile.TarInfo(f"{self.name}/{path}")
        info.size = size
        info.mode = 0o644
        info.mtime = self.mtime
        info.type = tarfile.REGTYPE
        info.uname = info.gname = ""
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _check_path(self, path: str) -> str:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise BundleError(f"refusing bundle member path {path!r} (absolute, empty or '..' component)")
        if path in self._seen:
            raise BundleError(f"duplicate bundle member {path!r}")
        self._seen.add(path)
        return path

    # -- adding members -------------------------------------------------------------------------------------
    def add_file(self, src: Path, path: str, *, known_sha256: str | None = None) -> FileRecord:
        """Copy ``src`` to ``stage_dir/path`` and into the tar as ``NAME/path``, hashing it on the way.

        ``known_sha256``: a digest already known for exactly these bytes (the hash cache); the file is then
        copied without hashing it again (the tar stream is still hashed). Returns the :class:`FileRecord`.
        """
        path = self._check_path(path)
        dest = self.stage_dir / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            fin = open(src, "rb", buffering=0)
        except OSError as exc:
            raise SourceError(f"cannot read {src}: {exc.strerror or exc}") from None
        with fin, open(dest, "wb", buffering=0) as fout:
            size = os.fstat(fin.fileno()).st_size
            self.sink.write(self._header(path, size))
            hasher = hashlib.sha256() if known_sha256 is None else None
            pending: list[Future] = []
            done = 0
            try:
                while True:
                    chunk = fin.read(CHUNK_SIZE)
                    for fut in pending:
                        fut.result()
                    pending = []
                    if not chunk:
                        break
                    done += len(chunk)
                    if done > size:
                        break
                    if hasher is not None:
                        pending.append(self.pool.submit(hasher.update, chunk))
                    pending.append(self.pool.submit(self.sink.write, chunk))
                    _write_all(fout, chunk)
                    self.on_bytes(len(chunk))
            finally:
                for fut in pending:
                    fut.result()
            if done != size:
                raise SourceError(f"{src} changed size while being packed ({size} bytes, read {done}); "
                                  f"run ferry pack again")
            self._pad(size)
        if hasher is not None:
            digest = hasher.hexdigest()
            self.hashed_bytes += size
        else:
            digest = known_sha256
            self.cached_bytes += size
        record = FileRecord(path, size, digest, hashed=hasher is not None)
        self.records.append(record)
        return record

    def add_bytes(self, data: bytes, path: str) -> FileRecord:
        """Write small in-memory ``data`` (manifest, lock file, SHA256SUMS) as ``path``."""
        path = self._check_path(path)
        dest = self.stage_dir / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        self.sink.write(self._header(path, len(data)))
        self.sink.write(data)
        self._pad(len(data))
        self.on_bytes(len(data))
        record = FileRecord(path, len(data), hashlib.sha256(data).hexdigest())
        self.records.append(record)
        return record

    def _pad(self, size: int) -> None:
        rem = size % BLOCK
        if rem:
            self.sink.write(b"\0" * (BLOCK - rem))

    # -- finishing ------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Write the tar end (two zero blocks, padded to a full record) and close the last volume."""
        if self._finished:
            return
        self.pool.shutdown(wait=True)
        end = 2 * BLOCK
        total = self.sink.total + end
        end += (-total) % RECORD
        self.sink.write(b"\0" * end)
        self.sink.finish()
        self._finished = True

    def commit(self) -> tuple[list[Path], Path]:
        """Rename the tar or its volumes into place and write ``OUT/NAME.ferry.sha256`` (coreutils format,
        names relative to ``OUT``). Returns (archive paths, sums path)."""
        self.finish()
        volumes = self.sink.commit()
        sums = self.out_dir / f"{self.name}{VOLUMES_SUMS_SUFFIX}"
        atomic_write_text(sums, "".join(f"{digest}  {path.name}\n" for path, digest in volumes))
        os.chmod(sums, 0o666 & ~_umask())
        return [p for p, _ in volumes], sums

    def abort(self) -> None:
        """Stop the pool and delete temp volumes (the stage directory is the caller's)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.sink.abort()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_all(fh: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
        n = fh.write(view)
        view = view[n:]
