"""One-pass bundle writer: every source byte is read once, hashed, and written to both the bundle directory
and the tar stream (split into volumes when asked).

Four threads share each 4 MiB chunk, decoupled by queues so that none waits for another chunk by chunk:

* the caller's thread reads a chunk into a free buffer of a small pool (``POOL_BUFFERS`` x ``CHUNK_SIZE``)
  and writes it into the bundle directory;
* a hash thread updates the file's sha256 with it (the manifest's digest);
* a tar thread appends it to the tar stream (or the current volume);
* with ``split_size``, a tar-hash thread updates the running sha256 of the current volume (for
  ``NAME.ferry.sha256``). A single ``NAME.ferry.tar`` gets no archive-level digest: every byte of content in
  it is already covered by the manifest inside it, and a second sha256 over the same bytes would double
  pack's CPU work.

A buffer returns to the pool when every thread is done with it, so the reader runs at most
``POOL_BUFFERS`` chunks ahead. ``hashlib`` and file writes release the GIL on large buffers, so the threads
run in parallel. The caller waits only for a file's own digest at the end of that file. (A per-chunk barrier
instead stalls the whole pipeline every time any thread is descheduled on a busy machine.)

The tar is an uncompressed POSIX (pax) stream built by hand with :meth:`tarfile.TarInfo.tobuf`: a header,
the data padded to 512 bytes, and at the end two zero blocks padded to tar's 10240-byte record, exactly what
``tarfile`` itself writes. Volumes (``NAME.ferry.tar.000``, ``.001``, ...) are a plain byte split of that
stream, so ``cat NAME.ferry.tar.* | tar x`` works. Every output is written under a temp name and renamed
only by :meth:`BundleWriter.commit`; :meth:`BundleWriter.abort` removes the temp files.

Metadata first (:meth:`BundleWriter.reserve_head`, :meth:`BundleWriter.write_head`): manifest.json, its
signature and the SBOM describe every file, so their bytes are known only after the pass, yet a reader
wants them first (``ferry inspect`` of a 100 GB bundle reads about 100 kB). The pass therefore starts with a
reserved region of zeros, sized from an upper bound of those members; at the end they are written into it (``pwrite``
into the temp archive, before the rename) followed by one pax global header whose ``comment`` record fills
the rest of the region exactly (tar and tarfile skip it; nothing is extracted for it). With ``split_size``
the reserved region is a volume of its own (``.000``), hashed after it was filled.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from bundler.format import ARCHIVE_SUFFIX, VOLUME_DIGITS, VOLUMES_SUMS_SUFFIX
from ferry.errors import BundleError, SourceError
from ferry.fsutil import atomic_write_text

#: Read size: large enough for hashlib to release the GIL and for few syscalls, small enough for the cache.
CHUNK_SIZE = 4 * 1024 * 1024
#: Buffers in flight between the reader and the hash / tar threads (memory: POOL_BUFFERS x CHUNK_SIZE).
POOL_BUFFERS = 8
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

    Each volume is written to a temp file ``.NAME.ferry.tar[.NNN].PID.tmp`` beside its final name. ``write``
    returns the ``(volume hasher, piece)`` pairs it wrote so that another thread can hash them (in order);
    digests are read by ``commit`` once that thread has drained. ``finish`` closes the last volume;
    ``commit`` renames every volume into place.
    """

    def __init__(self, out_dir: Path, name: str, split_size: int | None) -> None:
        self.out_dir = out_dir
        #: volumes are hashed for NAME.ferry.sha256; a single tar is not (see the module docstring)
        self.hashed = split_size is not None
        self.base = f"{name}{ARCHIVE_SUFFIX}"
        self.split_size = split_size
        self.volumes: list[tuple[Path, Path, Any]] = []  # (temp, final, sha256 object) of closed volumes
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
        self._fh = open(self._tmp, "wb", buffering=0)
        self._hash = hashlib.sha256() if self.hashed else None
        self._in_volume = 0

    def _close(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self.volumes.append((self._tmp, self._final, self._hash))
        self._fh = None

    def write(self, data: bytes | memoryview) -> list[tuple[Any, memoryview]]:
        """Append ``data`` to the stream (one thread at a time, in order); return what to hash, in order."""
        view = memoryview(data)
        pieces = []
        while len(view):
            if self._fh is None:
                self._open()
            fh = self._fh
            assert fh is not None  # _open() opened the next volume
            room = len(view) if self.split_size is None else min(len(view), self.split_size - self._in_volume)
            piece = view[:room]
            if self._hash is not None:
                pieces.append((self._hash, piece))
            _write_all(fh, piece)
            self._in_volume += room
            self.total += room
            view = view[room:]
            if self.split_size is not None and self._in_volume >= self.split_size:
                self._close()
        return pieces

    def cut(self) -> None:
        """Close the current volume now (the next write opens the next one); no-op without ``split_size``."""
        if self.split_size is not None and self._fh is not None:
            self._close()

    def patch(self, offset: int, data: bytes) -> list[int]:
        """Overwrite the closed stream at ``offset`` with ``data`` (across volumes); return the indices of the
        volumes it touched, whose sha256 the caller must compute again."""
        touched = []
        start = 0
        for index, (tmp, _, _) in enumerate(self.volumes):
            size = os.path.getsize(tmp)
            lo, hi = max(offset, start), min(offset + len(data), start + size)
            if lo < hi:
                with open(tmp, "r+b", buffering=0) as fh:
                    fh.seek(lo - start)
                    _write_all(fh, memoryview(data)[lo - offset : hi - offset])
                touched.append(index)
            start += size
        return touched

    def rehash(self, index: int) -> None:
        """Hash volume ``index`` again from its temp file (after :meth:`patch`)."""
        tmp, final, old = self.volumes[index]
        if old is None:
            return
        hasher = hashlib.sha256()
        with open(tmp, "rb", buffering=0) as fh:
            for block in iter(lambda: fh.read(CHUNK_SIZE), b""):
                hasher.update(block)
        self.volumes[index] = (tmp, final, hasher)

    def finish(self) -> None:
        """Close the last volume (an empty stream still gives one volume)."""
        if self._fh is None and not self.volumes:
            self._open()
        if self._fh is not None:
            self._close()

    def commit(self) -> list[tuple[Path, str | None]]:
        """Rename every volume into place, remove stale volumes of an earlier pack; return (path, sha256)."""
        for tmp, final, _ in self.volumes:
            os.replace(tmp, final)
        keep = {final for _, final, _ in self.volumes}
        single = self.out_dir / self.base
        stale = [single, *(p for p in self.out_dir.glob(f"{self.base}.*") if p.name[len(self.base) + 1 :].isdigit())]
        for path in stale:
            if path not in keep and path.is_file():
                path.unlink()
        return [(final, h.hexdigest() if h is not None else None) for _, final, h in self.volumes]

    def abort(self) -> None:
        """Close and delete every temp volume."""
        if self._fh is not None:
            self._fh.close()
            self.volumes.append((self._tmp, self._final, self._hash))
            self._fh = None
        for tmp, _, _ in self.volumes:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


class _Chunk:
    """A pooled buffer shared by ``users`` consumer threads; back to the pool when the last one releases it."""

    __slots__ = ("buf", "view", "users", "lock", "pool")

    def __init__(self, buf: bytearray, n: int, users: int, pool: queue.Queue) -> None:
        self.buf, self.view, self.users, self.lock, self.pool = buf, memoryview(buf)[:n], users, threading.Lock(), pool

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.pool.put(self.buf)


class _Worker(threading.Thread):
    """Runs ``handle(item)`` for each queued item in order; remembers the first error and keeps draining
    (releasing chunks) so that the reader never blocks forever on the buffer pool."""

    def __init__(self, name: str, handle: Callable[[Any], None]) -> None:
        super().__init__(name=name, daemon=True)
        self.q: queue.Queue = queue.Queue()
        self.handle = handle
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                if self.error is None:
                    self.handle(item)
            except BaseException as exc:  # reported to the caller by check()  # noqa: BLE001
                self.error = exc
            finally:
                chunk = item[1] if isinstance(item, tuple) else item
                if isinstance(chunk, _Chunk):
                    chunk.release()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class BundleWriter:
    """Write files into ``stage_dir`` (the future ``OUT/NAME``) and into ``OUT/NAME.ferry.tar`` in one pass.

    Members of the tar are named ``NAME/<path>``. Call :meth:`add_file` / :meth:`add_bytes` in the order the
    members should appear, then :meth:`finish`, then :meth:`commit` (renames the tar or volumes and writes
    ``NAME.ferry.sha256`` for volumes), or :meth:`abort` on failure. ``on_bytes(n)`` is called after each chunk
    (progress).
    ``hashed_bytes`` / ``cached_bytes`` count file bytes hashed here / whose digest the caller supplied.

    Raises:
        SourceError: a source file cannot be read, or changed size while being read.
        BundleError: a member path is absolute, empty, contains ``..``, or repeats.
        OSError: writing the bundle directory or the tar failed (e.g. disk full).
    """

    def __init__(
        self,
        stage_dir: Path,
        out_dir: Path,
        name: str,
        *,
        split_size: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
        mtime: int | None = None,
    ) -> None:
        self.stage_dir = Path(stage_dir)
        self.out_dir = Path(out_dir)
        self.name = name
        self.sink = _VolumeSink(self.out_dir, name, split_size)
        self.on_bytes = on_bytes or (lambda n: None)
        self.mtime = int(time.time()) if mtime is None else mtime
        self.hashed_bytes = 0
        self.cached_bytes = 0
        self.records: list[FileRecord] = []
        self._seen: set[str] = set()
        self._finished = False
        self._head_size = 0
        self._pool: queue.Queue = queue.Queue()
        for _ in range(POOL_BUFFERS):
            self._pool.put(bytearray(CHUNK_SIZE))
        self._hasher = _Worker("ferry-pack-hash", self._hash_item)
        self._tar = _Worker("ferry-pack-tar", self._tar_item)
        self._tar_hasher = _Worker("ferry-pack-tar-hash", self._tar_hash_item)
        self._workers = (self._hasher, self._tar, self._tar_hasher)
        for worker in self._workers:
            worker.start()

    # -- worker side ------------------------------------------------------------------------------------
    @staticmethod
    def _hash_item(item: tuple) -> None:
        target, chunk = item
        if isinstance(chunk, _Chunk):
            target.update(chunk.view)
        else:  # end of file: target is an Event-like slot to fill with the digest
            target.set_result(chunk.hexdigest())

    def _tar_item(self, item: Any) -> None:
        if item is _CUT:
            self.sink.cut()
            return
        pieces = self.sink.write(item.view if isinstance(item, _Chunk) else item)
        if isinstance(item, _Chunk):
            with item.lock:
                item.users += 1  # the tar-hash thread releases it too
        self._tar_hasher.q.put((pieces, item))

    @staticmethod
    def _tar_hash_item(item: tuple) -> None:
        for hasher, piece in item[0]:
            hasher.update(piece)

    def _check_workers(self) -> None:
        for worker in self._workers:
            worker.check()

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
        self._check_workers()
        path = self._check_path(path)
        dest = self.stage_dir / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            fin = open(src, "rb", buffering=0)
        except OSError as exc:
            raise SourceError(f"cannot read {src}: {exc.strerror or exc}") from None
        hasher = hashlib.sha256() if known_sha256 is None else None
        users = 2 if hasher is not None else 1
        with fin, open(dest, "wb", buffering=0) as fout:
            size = os.fstat(fin.fileno()).st_size
            self._tar.q.put(self._header(path, size))
            done = 0
            while True:
                buf = self._pool.get()
                n = fin.readinto(buf)
                if not n or done + n > size:
                    self._pool.put(buf)
                    done += n
                    break
                done += n
                chunk = _Chunk(buf, n, users, self._pool)
                if hasher is not None:
                    self._hasher.q.put((hasher, chunk))
                self._tar.q.put(chunk)
                _write_all(fout, chunk.view)
                self.on_bytes(n)
                self._check_workers()
            if done != size:
                raise SourceError(
                    f"{src} changed size while being packed ({size} bytes, read at least {done}); run ferry pack again"
                )
            self._pad(size)
        if hasher is not None:
            slot = _Result()
            self._hasher.q.put((slot, hasher))
            digest = slot.wait(self._hasher)
            self.hashed_bytes += size
        else:
            assert known_sha256 is not None  # no hasher only when the digest is known
            digest = known_sha256
            self.cached_bytes += size
        record = FileRecord(path, size, digest, hashed=hasher is not None)
        self.records.append(record)
        return record

    def add_bytes(self, data: bytes, path: str) -> FileRecord:
        """Write small in-memory ``data`` (manifest, lock file, SHA256SUMS) as ``path``."""
        self._check_workers()
        path = self._check_path(path)
        dest = self.stage_dir / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        self._tar.q.put(self._header(path, len(data)))
        self._tar.q.put(bytes(data))
        self._pad(len(data))
        record = FileRecord(path, len(data), hashlib.sha256(data).hexdigest())
        self.records.append(record)
        return record

    # -- metadata first ---------------------------------------------------------------------------------
    def reserve_head(self, size: int) -> int:
        """Reserve the first ``size`` bytes of the tar stream (rounded up to 512) for :meth:`write_head`.

        Call it before any member. With ``split_size`` the region is a volume of its own. ``size`` is an upper
        bound of the metadata members' tar encoding (see :func:`head_bound`) plus 512 bytes for the filler
        header. Returns the reserved size in bytes.

        Raises:
            BundleError: a member was already added.
        """
        if self.records or self.sink.total or self._head_size:
            raise BundleError("reserve_head must come before every other bundle member")
        self._head_size = -(-max(size, BLOCK) // BLOCK) * BLOCK
        remaining = self._head_size
        while remaining:
            n = min(remaining, CHUNK_SIZE)
            self._tar.q.put(bytes(n))
            remaining -= n
        self._tar.q.put(_CUT)
        return self._head_size

    def fits_head(self, members: list[tuple[str, bytes]]) -> bool:
        """Whether ``members`` (``(path, bytes)``) and the filler header fit in the reserved region."""
        size = sum(len(self._header(path, len(data))) + -(-len(data) // BLOCK) * BLOCK for path, data in members)
        return size + BLOCK <= self._head_size

    def write_head(self, members: list[tuple[str, bytes]]) -> list[FileRecord]:
        """Write the metadata ``members`` (``(path, bytes)`` in order) into the reserved region and into the
        bundle directory; call after :meth:`finish` and before :meth:`commit`. Returns their records. With no
        members the whole region becomes the filler (the caller added them at the end instead, see
        :meth:`fits_head`).

        Raises:
            BundleError: no region was reserved, or the members do not fit in it (check :meth:`fits_head`).
        """
        if not self._head_size:
            raise BundleError("write_head without reserve_head")
        self.finish()
        encoded = bytearray()
        records = []
        for path, data in members:
            path = self._check_path(path)
            dest = self.stage_dir / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            encoded += self._header(path, len(data)) + data + b"\0" * ((-len(data)) % BLOCK)
            records.append(FileRecord(path, len(data), hashlib.sha256(data).hexdigest()))
        room = self._head_size - len(encoded)
        if room < BLOCK:
            raise BundleError(
                f"the metadata members take {len(encoded)} bytes but only {self._head_size - BLOCK} "
                f"were reserved before the pass; this is a bug in ferry's size bound"
            )
        encoded += _filler(room)
        for index in self.sink.patch(0, bytes(encoded)):
            self.sink.rehash(index)
        self.records[:0] = records
        return records

    def _pad(self, size: int) -> None:
        rem = size % BLOCK
        if rem:
            self._tar.q.put(b"\0" * (BLOCK - rem))

    # -- finishing ------------------------------------------------------------------------------------------
    def _stop_workers(self) -> None:
        for worker in self._workers:  # in this order: the tar thread feeds the tar-hash thread
            if worker.is_alive():
                worker.q.put(None)
                worker.join()

    def finish(self) -> None:
        """Write the tar end (two zero blocks, padded to a full record), drain the threads, close the last
        volume. Raises the first error a thread met (e.g. OSError: disk full)."""
        if self._finished:
            return
        self._check_workers()
        self._stop_workers()
        self._check_workers()
        tar_bytes = self.sink.total
        end = 2 * BLOCK
        end += (-(tar_bytes + end)) % RECORD
        for hasher, piece in self.sink.write(b"\0" * end):
            hasher.update(piece)
        self.sink.finish()
        self._finished = True

    def commit(self) -> tuple[list[Path], Path | None]:
        """Rename the tar or its volumes into place; for volumes write ``OUT/NAME.ferry.sha256`` (coreutils
        format, names relative to ``OUT``), for a single tar remove a stale one of an earlier split pack.
        Returns (archive paths, sums path or None)."""
        self.finish()
        volumes = self.sink.commit()
        sums = self.out_dir / f"{self.name}{VOLUMES_SUMS_SUFFIX}"
        if not self.sink.hashed:
            with contextlib.suppress(FileNotFoundError):
                sums.unlink()
            return [p for p, _ in volumes], None
        atomic_write_text(sums, "".join(f"{digest}  {path.name}\n" for path, digest in volumes))
        os.chmod(sums, 0o666 & ~_umask())
        return [p for p, _ in volumes], sums

    def abort(self) -> None:
        """Stop the threads and delete temp volumes (the stage directory is the caller's)."""
        self._stop_workers()
        self.sink.abort()


#: Tar-thread marker: close the current volume (the reserved head is a volume of its own).
_CUT = object()


def head_bound(name: str, data_bounds: list[int]) -> int:
    """Upper bound in bytes of the reserved head for members of at most ``data_bounds`` bytes each under the
    top folder ``name``: per member a header (up to three 512-byte blocks with pax long names) and its data
    padded to 512, plus the filler's header."""
    header = 3 * BLOCK + 2 * len(name.encode()) + 2 * BLOCK
    return sum(header + -(-n // BLOCK) * BLOCK for n in data_bounds) + 2 * BLOCK


def _filler(n: int) -> bytes:
    """Exactly ``n`` bytes (a multiple of 512, at least 512) of tar: one pax global header whose ``comment``
    record pads the rest. tar and tarfile read it as a header, extract nothing and go on."""
    if n == BLOCK:
        return tarfile.TarInfo.create_pax_global_header({})
    want = n - BLOCK  # the record's length: "LEN comment=VALUE\n"
    prefix = len(" comment=\n")
    digits = len(str(want))
    value = "-" * (want - prefix - digits)
    out = tarfile.TarInfo.create_pax_global_header({"comment": value})
    assert len(out) == n, (len(out), n)
    return out


class _Result:
    """A one-shot slot the hash thread fills with a file's digest."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.value: str | None = None

    def set_result(self, value: str) -> None:
        self.value = value
        self._event.set()

    def wait(self, worker: _Worker) -> str:
        while not self._event.wait(0.5):
            worker.check()
            if not worker.is_alive():
                raise RuntimeError("the hash thread stopped")
        worker.check()
        assert self.value is not None
        return self.value


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_all(fh: BinaryIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while len(view):
        n = fh.write(view)
        view = view[n:]
