"""Archives and volumes: ``NAME.ferry.tar``, or ``NAME.ferry.tar.000``, ``.001``, ... read as one stream.

Volumes are listed in ``NAME.ferry.sha256`` (or found on disk). An archive is read once, forward only, as
``tarfile.open(mode='r|')`` would (tarfile's own header parser, no seeks, so volumes and pipes work), but member
data goes straight from the stream to a background thread that hashes it (and writes it, when installing) while
the next chunk is read. Every member is compared with ``manifest.json`` at the end (bundler/installer/scan.py).
The archive starts with its metadata (manifest.json, manifest.json.sig when signed, sbom.cdx.json), so
``ferry inspect`` and the signature pre-check read a few hundred kB (bundler/installer/signature.py); the
verdict still comes from the full pass.

Standard library and ferry's foundation only (part of the generated ``install.py``).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
import tarfile
from pathlib import Path

from bundler.format import ARCHIVE_SUFFIX, MANIFEST_NAME, SIGNATURE_NAME, SUMS_NAME, VOLUME_DIGITS, VOLUMES_SUMS_SUFFIX
from bundler.installer.fields import check_relpath
from bundler.installer.hashing import CHUNK_SIZE, HashWorker, Progress, hash_task
from bundler.installer.report import integrity_error
from bundler.installer.scan import SUMS_LINE, Scan, keep_metadata
from ferry.errors import BundleError, UnsafeArchiveError

#: Small members kept in memory while streaming (manifest.json, SHA256SUMS); larger ones are refused.
MAX_METADATA_BYTES = 64 * 1024 * 1024


def archive_volumes(path: Path) -> tuple[str, list[Path], dict[str, str]]:
    """Resolve ``NAME.ferry.tar`` or ``NAME.ferry.tar.000`` into ``(NAME, volume paths, expected sha256 by
    file name)``. Volumes come from ``NAME.ferry.sha256`` when it exists beside them, else from the
    consecutive ``.NNN`` files on disk.

    Raises:
        BundleError: not an archive name, no such file, or a volume is missing (named).
    """
    path = Path(path)
    name = path.name
    split = False
    if re.search(re.escape(ARCHIVE_SUFFIX) + r"\.\d+$", name):
        base = name.rsplit(".", 1)[0]
        split = True
    elif name.endswith(ARCHIVE_SUFFIX):
        base = name
    else:
        raise BundleError(
            f"{path}: not a bundle (expected a directory, NAME{ARCHIVE_SUFFIX} or NAME{ARCHIVE_SUFFIX}.000)"
        )
    bundle_name = base[: -len(ARCHIVE_SUFFIX)]
    folder = path.parent
    sums_path = folder / f"{bundle_name}{VOLUMES_SUMS_SUFFIX}"
    expected: dict[str, str] = {}
    if sums_path.is_file():
        for line in sums_path.read_text("utf-8", errors="replace").splitlines():
            match = SUMS_LINE.match(line.strip())
            if match:
                expected[posixpath.basename(match.group(2))] = match.group(1).lower()
    if split:
        listed = sorted(n for n in expected if n.startswith(base + ".") and n[len(base) + 1 :].isdigit())
        if listed:
            names = listed
        else:
            names = []
            index = 0
            while (folder / f"{base}.{index:0{VOLUME_DIGITS}d}").exists():
                names.append(f"{base}.{index:0{VOLUME_DIGITS}d}")
                index += 1
            if not names:
                raise BundleError(f"{path}: no such volume")
        volumes = [folder / n for n in names]
        missing = [str(v) for v in volumes if not v.is_file()]
        if missing:
            raise BundleError(f"missing volume(s) of {base}: {', '.join(missing)}")
        if listed:
            suffixes = [int(n[len(base) + 1 :]) for n in names]
            gaps = sorted(set(range(len(suffixes))) - set(suffixes))
            if gaps:
                raise BundleError(
                    f"missing volume(s) of {base}: " + ", ".join(f"{base}.{g:0{VOLUME_DIGITS}d}" for g in gaps)
                )
    else:
        if not path.is_file():
            raise BundleError(f"{path}: no such archive")
        volumes = [path]
    return bundle_name, volumes, expected


class VolumeReader:
    """The volumes of a split archive (or one archive) read as one forward-only byte stream.

    ``read(n)`` returns exactly ``n`` bytes unless the stream ends (it crosses volume boundaries), ``tell()``
    is the position in the whole stream, ``position()`` names the volume and offset for error messages, and
    ``progress(n)`` is called for every read.
    """

    def __init__(self, volumes: list[Path], progress: Progress | None = None) -> None:
        self.volumes = list(volumes)
        self.progress = progress
        self.index = 0
        self.offset = 0
        self.total = 0
        self._fh = open(self.volumes[0], "rb", buffering=0) if self.volumes else None

    def read(self, n: int) -> bytes:
        if self._fh is None:
            return b""
        data = self._fh.read(n)
        self.offset += len(data)
        if len(data) < n:  # a short read: the end of this volume (or a pipe); keep filling
            parts = [data]
            got = len(data)
            while got < n and self._fh is not None:
                more = self._fh.read(n - got)
                if not more:
                    self._next_volume()
                    continue
                self.offset += len(more)
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self.total += len(data)
        if self.progress and data:
            self.progress(len(data))
        return data

    def _next_volume(self) -> None:
        assert self._fh is not None
        self._fh.close()
        if self.index + 1 >= len(self.volumes):  # the end: keep pointing at the last byte of the last volume
            self._fh = None
            return
        self.index += 1
        self.offset = 0
        self._fh = open(self.volumes[self.index], "rb", buffering=0)

    def tell(self) -> int:
        return self.total

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (tar padding); raises tarfile.ReadError when the stream ends first."""
        while n > 0:
            got = len(self.read(min(n, CHUNK_SIZE)))
            if not got:
                raise tarfile.ReadError("unexpected end of data")
            n -= got

    def position(self) -> str:
        """Where the stream is: ``'byte N of VOLUME'`` (the volume being read and the bytes read from it)."""
        return f"byte {self.offset} of {self.volumes[self.index].name}"

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class TarHeaders:
    """What :meth:`tarfile.TarInfo.fromtarfile` needs of a TarFile to parse the next header (ustar, pax and
    GNU long names, as ``TarFile`` in ``'r|'`` mode does) from a forward-only stream. Member data is then read
    straight from the stream, without tarfile's buffer copies."""

    def __init__(self, fileobj: VolumeReader) -> None:
        self.fileobj = fileobj
        self.offset = 0  # where the next header starts (set by tarfile after each member)
        self.pax_headers: dict[str, str] = {}  # global pax headers
        self.encoding = "utf-8"
        self.errors = "surrogateescape"

    def next(self) -> tarfile.TarInfo | None:
        """The next member, or None at the end-of-archive marker.

        Raises:
            tarfile.ReadError: the stream ends without an end marker, or a header is corrupt.
        """
        if self.fileobj.tell() < self.offset:
            self.fileobj.skip(self.offset - self.fileobj.tell())
        try:
            return tarfile.TarInfo.fromtarfile(self)  # type: ignore[arg-type]
        except tarfile.EOFHeaderError:  # type: ignore[attr-defined]  # tarfile's own, not in its stubs
            return None
        except tarfile.EmptyHeaderError:  # type: ignore[attr-defined]
            raise tarfile.ReadError("unexpected end of data (no end-of-archive marker)") from None
        except tarfile.HeaderError as exc:
            raise tarfile.ReadError(f"corrupt tar header: {exc}") from None


def member_path(member: tarfile.TarInfo, scan: Scan) -> str:
    """The member's path inside the bundle (top folder stripped), after the safety checks.

    Raises:
        UnsafeArchiveError: absolute, ``..``, not normalised, or outside the bundle's single top folder.
    """
    name = member.name
    stripped = name.rstrip("/") if member.isdir() else name
    try:
        check_relpath(stripped, f"archive member {name!r}")
    except UnsafeArchiveError:
        raise UnsafeArchiveError(f"unsafe archive member {name!r}: absolute path or '..' (refused)") from None
    top, _, rest = stripped.partition("/")
    if scan.top is None:
        scan.top = top
    elif top != scan.top:
        raise UnsafeArchiveError(f"archive member {name!r} is outside the bundle folder {scan.top + '/'!r}")
    return rest


def scan_archive(
    archive: Path,
    dest: Path | None = None,
    progress: Progress | None = None,
) -> Scan:
    """Stream ``archive`` (``NAME.ferry.tar`` or its first volume, all volumes as one stream) once, forward only.

    Headers are parsed by tarfile's own :meth:`tarfile.TarInfo.fromtarfile` (ustar, pax, GNU long names) as
    in ``tarfile.open(mode='r|')``; member data is read straight from the stream in 1 MiB chunks (tarfile's
    stream buffer copies every byte three times, which halves throughput).

    Every regular member is hashed while read; with ``dest`` it is also written to ``dest/<path>`` (the top
    folder ``NAME/`` stripped), created exclusively, never through a link. Directory members are created
    under ``dest``. Nothing is written outside ``dest``.

    Raises:
        UnsafeArchiveError: an absolute or ``..`` member, a symbolic or hard link pointing outside the bundle,
            a device file or FIFO, a duplicate member (each named).
        IntegrityError: the stream is truncated or corrupt; the volume that does not match
            ``NAME.ferry.sha256`` is named when that file is present.
        BundleError: a volume is missing.
    """
    _, volumes, expected = archive_volumes(Path(archive))
    scan = Scan()
    scan.volumes, scan.volume_sums = volumes, expected
    seen: set[str] = set()
    reader = VolumeReader(volumes, progress)
    headers = TarHeaders(reader)
    worker = HashWorker()
    try:
        try:
            while True:
                member = headers.next()
                if member is None:
                    break
                rel = member_path(member, scan)
                if member.name.rstrip("/") in seen:
                    raise UnsafeArchiveError(f"duplicate archive member {member.name!r} (refused)")
                seen.add(member.name.rstrip("/"))
                _scan_member(member, rel, reader, worker, scan, dest)
            _check_end_padding(reader, scan, archive)
        except (tarfile.TarError, EOFError) as exc:
            where = reader.position()
            problems = scan.volume_problems()
            detail = f"archive {Path(archive).name} is truncated or corrupt at {where}: {exc}"
            raise integrity_error([*problems, detail], "archive check failed") from None  # the culprit first
    finally:
        worker.close()
        reader.close()
    if scan.top is None:
        raise BundleError(f"archive {archive} is empty")
    return scan


def _scan_member(
    member: tarfile.TarInfo, rel: str, reader: VolumeReader, worker: HashWorker, scan: Scan, dest: Path | None
) -> None:
    """Take one member whose header was just read (``rel``: its path inside the bundle): a directory is created
    under ``dest``, a link is checked and noted as an extra file, a metadata file is kept in memory, any other
    regular file is hashed (and written under ``dest``) as its data streams by.

    Raises:
        UnsafeArchiveError: a link pointing outside the bundle, a special, top-level or sparse file.
        BundleError: a metadata member over :data:`MAX_METADATA_BYTES`.
        tarfile.ReadError: the data does not follow the header or ends early.
    """
    if member.isdir():
        if dest is not None and rel:
            _safe_mkdir(dest, rel)
        return
    if member.issym() or member.islnk():
        _check_link(member, rel, scan.top or "")
        scan.problems.append(f"extra file: {rel} (a link; bundles hold regular files only)")
        return
    if not member.isreg():
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is a device file, FIFO or other special file (refused)"
        )
    if not rel:
        raise UnsafeArchiveError(f"archive member {member.name!r} is a file at the top level")
    if member.sparse is not None:
        raise UnsafeArchiveError(f"archive member {member.name!r} is a sparse file (refused)")
    if reader.tell() != member.offset_data:
        raise tarfile.ReadError(f"member {member.name!r}: data does not follow its header")
    if rel in (MANIFEST_NAME, SUMS_NAME, SIGNATURE_NAME):
        if member.size > MAX_METADATA_BYTES:
            raise BundleError(f"{rel} in the archive is {member.size} bytes: too large")
        data = reader.read(member.size)
        if len(data) != member.size:
            raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
        keep_metadata(scan, rel, data)
        scan.observed[rel] = (len(data), hashlib.sha256(data).hexdigest())
        return
    _stream_member(member, rel, reader, worker, scan, dest)


def _stream_member(
    member: tarfile.TarInfo, rel: str, reader: VolumeReader, worker: HashWorker, scan: Scan, dest: Path | None
) -> None:
    """Hash a regular member's data in :data:`CHUNK_SIZE` chunks on the worker thread, writing it to
    ``dest/<rel>`` (created exclusively, never through a link) when ``dest`` is given; record it in ``scan``.

    Raises:
        tarfile.ReadError: the stream ends inside the member.
    """
    out = None
    if dest is not None:
        parent = _safe_mkdir(dest, posixpath.dirname(rel)) if "/" in rel else dest
        out = open(parent / posixpath.basename(rel), "xb")
    hasher = hashlib.sha256()
    size = 0
    try:
        while size < member.size:
            chunk = reader.read(min(CHUNK_SIZE, member.size - size))
            if not chunk:
                break
            size += len(chunk)
            worker.submit(hash_task(hasher, out, chunk))
        worker.drain()
    finally:
        if out is not None:
            out.close()
    if size != member.size:
        raise tarfile.ReadError(f"unexpected end of data in member {member.name!r}")
    scan.observed[rel] = (size, hasher.hexdigest())
    scan.bytes_read += size


def _check_end_padding(reader: VolumeReader, scan: Scan, archive: Path) -> None:
    """A zero block in the middle (a shifted or truncated volume) looks like the end marker: note a problem in
    ``scan`` when anything but zero padding follows it."""
    where = reader.position()
    while True:
        rest = reader.read(CHUNK_SIZE)
        if not rest:
            break
        if rest.count(0) != len(rest):
            scan.problems.append(
                f"archive {Path(archive).name} holds data after its end marker "
                f"(near {where}): a volume is truncated, shifted or corrupt"
            )
            break


def _check_link(member: tarfile.TarInfo, rel: str, top: str) -> None:
    """Refuse a symbolic or hard link whose target leaves the bundle folder ``top``."""
    target = member.linkname
    if member.issym():  # relative to the link's own folder
        resolved = posixpath.normpath(posixpath.join(top, posixpath.dirname(rel), target))
    else:  # hard links name another member, relative to the archive root
        resolved = posixpath.normpath(target)
    if (
        target.startswith("/")
        or resolved == ".."
        or resolved.startswith("../")
        or resolved.split("/")[0] != top
        or resolved == top
    ):
        kind = "symbolic" if member.issym() else "hard"
        raise UnsafeArchiveError(
            f"archive member {member.name!r} is a {kind} link to {target!r}, outside the bundle (refused)"
        )


def _safe_mkdir(root: Path, rel: str) -> Path:
    """Create ``root/rel`` component by component, refusing any existing component that is not a real
    directory (so nothing can be written through a link)."""
    current = root
    for part in rel.split("/"):
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeArchiveError(f"{current} exists and is not a directory (refused)")
    return current
