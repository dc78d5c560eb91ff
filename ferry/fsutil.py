"""Crash-safe file system helpers: write to a temp path in the same directory, then rename.

Nothing a user already has on disk is lost or half-written when ferry is killed or fails part-way.

Standard library and :mod:`ferry.errors` only: the bundle's stand-alone ``install.py`` is generated with this
module in it (bundler/installer/generate.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ferry.errors import InsufficientSpaceError
from ferry.faults import kill_point

#: Permission bits of what ferry install and ferry export write: readable by every account (a shared prefix
#: installed by root, an export a serving engine's service account reads), or, with ``private``, by the writing
#: account alone. Applied through the process umask while the command writes.
SHARED_UMASK, PRIVATE_UMASK = 0o022, 0o077


def process_umask() -> int:
    """This process's umask: the ``Umask:`` line of ``/proc/self/status`` (Linux 4.7 and later), else read by
    setting it and putting it back (which another thread could see for that moment)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (temp file ``.NAME.XXXX.tmp`` in the same directory, fsync,
    ``os.replace``); returns ``path``. The file gets ``mode``, by default ``0o666 & ~umask`` as ``open()`` would
    give it (the temp file alone would be 0600: a service account could not read what it is told to serve)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a read-only or forbidden folder: named by the file asked for, not the temp name
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    try:
        os.fchmod(fd, 0o666 & ~process_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # a failed write (ENOSPC, EDQUOT) names the file it was for
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8", *, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode(encoding), mode=mode)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, *, overwrite: bool = False, same_name: bool = False, phase: str | None = None
) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``path``; on success rename it to ``path``. It gets the permission bits
    ``mkdir`` would give it (``0o777 & ~umask``).

    On any exception the temp directory is removed and ``path`` is left as it was. With ``overwrite``,
    an existing ``path`` is replaced (moved aside to ``.NAME.old-PID`` first, then deleted once the new one is in
    place); without it an existing ``path`` raises ``FileExistsError``. With ``same_name`` the yielded directory
    already has ``path``'s name (``PARENT/.NAME.XXXX.tmp/NAME``), for writers that name what they write after their
    folder. ``phase``: the command's name for its kill points (:mod:`ferry.faults`), ``PHASE:swap-aside`` between the
    two renames of an overwrite (a process killed there leaves the earlier folder aside and nothing under its name,
    which a holder of the name puts back: :func:`ferry.folder_lock.hold_name`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    holder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp = holder / path.name if same_name else holder
    try:
        tmp.mkdir(exist_ok=True)
        os.chmod(tmp, 0o777 & ~process_umask())  # mkdtemp makes 0700; the folder gets what mkdir would give it
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            if phase is not None:
                kill_point(f"{phase}:swap-aside")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if holder != tmp:
            holder.rmdir()
    except BaseException:
        shutil.rmtree(holder, ignore_errors=True)
        raise


def ensure_free_space(directory: str | os.PathLike, needed_bytes: int, what: str = "this write") -> None:
    """Raise :class:`InsufficientSpaceError` up front when ``directory``'s file system has fewer than
    ``needed_bytes`` bytes free (checked on the nearest existing ancestor)."""
    probe = Path(directory).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise InsufficientSpaceError(
            f"{what} needs {format_bytes(needed_bytes)} in {probe} but only {format_bytes(free)} is free"
        )


#: Write errors the user fixes on the host, not in ferry's input: a full disk or quota, a folder that is read-only
#: or forbidden (mount options, permissions changed meanwhile).
HOST_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def host_write_error(exc: BaseException, what: str, where: str | os.PathLike | None) -> str | None:
    """One line for a write error of the host (:data:`HOST_WRITE_ERRNOS`): ``cannot write WHAT: STRERROR (FILE)``,
    and for a full disk or quota ``; N free in WHERE`` (``where``: the folder whose file system ran out; None when
    it is another host's, which this process cannot measure). Besides
    ``OSError``, an error of a Rust writer that carries the OS error in its message (safetensors' ``SafetensorError:
    Error while serializing: I/O error: No space left on device (os error 28)``) counts, without a file name. None
    for any other exception, which the caller re-raises."""
    if not isinstance(exc, OSError):
        found = re.search(r"\(os error (\d+)\)", str(exc))
        exc = OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else OSError()
    if exc.errno not in HOST_WRITE_ERRNOS:
        return None
    line = f"cannot write {what}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and where is not None:
        with contextlib.suppress(OSError):
            line += f"; {format_bytes(shutil.disk_usage(where).free)} free in {where}"
    return line


def format_bytes(n: float) -> str:
    """Human-readable size with binary units: ``format_bytes(1536) == '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str | int) -> int:
    """Parse ``'5GB'``, ``'4G'``, ``'500MiB'``, ``'1024'`` into bytes. ``G``/``GB`` are decimal (10^9) as in
    transformers' ``max_shard_size``; ``GiB`` is binary. Raises ValueError on garbage."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    # fmt: off
    units = {
        "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
        "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "B": 1,
    }
    # fmt: on
    number, factor = s, 1
    for suffix, scale in units.items():
        if s.endswith(suffix):
            number, factor = s[: -len(suffix)], scale
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 5GB, 4G, 500MiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * factor)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces (bounded memory whatever the file's size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
