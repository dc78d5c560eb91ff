"""SHA-256 digests of files, remembered while each file stays as it was.

``ferry pack`` hashes every file it carries, and ``ferry train`` keys its tokenised cache by the digests of the data
files and of every image the rows name: on a vision dataset that is tens of GB read at each start, by the launcher
and by every worker. :class:`DigestCache` keeps ``{absolute path: [size, mtime_ns, inode, sha256]}`` in one JSON
file and answers from it while the file's size, modification time (nanoseconds) and inode are the recorded ones: a
file rewritten in place gets a new modification time, one replaced (a copy, rsync, an unpacked archive) a new
inode. ``min_age_s`` leaves out files modified less than that many seconds before they were hashed (git's "racy"
rule): a file system stamps modification times with a clock of a few milliseconds, so a file rewritten twice within
one tick at the same size would otherwise keep the first digest. A corrupt or unreadable cache file is ignored;
saving is atomic, so processes that save at once leave one whole cache (entries another process added may be lost:
they are computed again).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from ferry.fsutil import atomic_write_text, sha256_file

#: Where ``ferry train`` keeps the digests of data files and images, under ``ferry_cache_dir()``.
DATA_DIGESTS = "file-digests.json"


class DigestCache:
    """The sha256 of files already hashed (module docstring), stored at ``path``; ``min_age_s``: record only files
    modified at least that many seconds before."""

    def __init__(self, path: Path, *, min_age_s: float = 0.0) -> None:
        self.path, self.min_age_ns = path, int(min_age_s * 1e9)
        self.entries: dict[str, list] = {}
        self.changed = False
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self.entries = loaded

    @staticmethod
    def _stamp(src: Path) -> tuple[str, list[int]]:
        st = os.stat(src)
        return str(Path(src).absolute()), [st.st_size, st.st_mtime_ns, st.st_ino]

    def get(self, src: Path) -> str | None:
        """The recorded sha256 of ``src``, or None when unknown or the file changed."""
        key, stamp = self._stamp(src)
        entry = self.entries.get(key)
        if isinstance(entry, list) and len(entry) == len(stamp) + 1 and entry[:-1] == stamp:
            return str(entry[-1])
        return None

    def put(self, src: Path, sha256: str) -> None:
        """Record ``src``'s digest under its current size, modification time and inode (not when it was modified
        less than ``min_age_s`` ago)."""
        key, stamp = self._stamp(src)
        if time.time_ns() - stamp[1] < self.min_age_ns:
            return
        self.entries[key] = [*stamp, sha256]
        self.changed = True

    def drop(self, src: Path) -> None:
        """Forget ``src``."""
        self.changed |= self.entries.pop(str(Path(src).absolute()), None) is not None

    def digest(self, src: Path) -> str:
        """``src``'s sha256: the recorded one, else read and recorded. Raises OSError as ``open`` does."""
        known = self.get(src)
        if known is None:
            known = sha256_file(src)
            self.put(src, known)
        return known

    def save(self) -> None:
        """Write the cache atomically when something was recorded (entries whose files are gone are dropped).

        Raises:
            OSError: the folder cannot be written.
        """
        if not self.changed:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(live, sort_keys=True))
        self.changed = False


def data_digests() -> DigestCache:
    """The digests of training data files and images (:data:`DATA_DIGESTS`), recorded for files modified over two
    seconds before they were read."""
    from ferry.constants import ferry_cache_dir

    return DigestCache(ferry_cache_dir() / DATA_DIGESTS, min_age_s=2.0)


__all__ = ["DATA_DIGESTS", "DigestCache", "data_digests"]
