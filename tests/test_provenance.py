"""Every line in ferry's tree is written here: no project file shares more than 10% of its substantial lines
with LLaMA-Factory 0.9.5's source distribution (the project ferry follows most closely, and whose template code
an earlier ferry carried). Lines are compared stripped of surrounding white space; "substantial" means at least
25 characters, so that blank lines, brackets and one-word lines do not count. Import statements do not count
either: naming the same library (``from __future__ import annotations``) is not copying.

LICENSE is the one file that must be another text word for word: it is the Apache License 2.0's terms, which
both projects carry. It is left out of the share check and checked instead to be exactly those terms."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.pinned_sdist import LLAMAFACTORY

ROOT = Path(__file__).resolve().parents[1]
MIN_CHARS = 25
MAX_SHARE = 0.10
# Files whose text is a published document that must be carried verbatim (checked on their own below).
VERBATIM = {"LICENSE"}
IMPORT = re.compile(r"(import [\w.]+|from [\w.]+ import )")


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= MIN_CHARS and not IMPORT.match(s)]


def _project_files() -> list[Path]:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def shared_share(path: Path, peer: set[str]) -> tuple[int, int]:
    """``(lines of path also in peer, substantial lines of path)``."""
    lines = _lines(path)
    return sum(line in peer for line in lines), len(lines)


def test_no_project_file_is_another_projects_code() -> None:
    peer: set[str] = set()
    for path in LLAMAFACTORY.path().rglob("*"):
        if path.is_file():
            peer.update(_lines(path))
    assert len(peer) > 10_000, "the LLaMA-Factory sdist did not unpack as expected"
    files = _project_files()
    assert len(files) > 100
    offenders = []
    for path in files:
        if str(path.relative_to(ROOT)) in VERBATIM:
            continue
        shared, total = shared_share(path, peer)
        if total and shared / total > MAX_SHARE:
            offenders.append(f"{path.relative_to(ROOT)}: {shared} of {total} lines")
    assert not offenders, "files that share more than 10% of their lines with llamafactory 0.9.5: " + "; ".join(
        offenders
    )


def test_the_check_catches_a_copy(tmp_path: Path) -> None:
    """The comparison itself works: a file made of the peer's template code is caught."""
    source = LLAMAFACTORY.path() / "src" / "llamafactory" / "data" / "template.py"
    copy = tmp_path / "copied.py"
    copy.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    shared, total = shared_share(copy, set(_lines(source)))
    assert total > 500 and shared == total


def test_license_is_the_apache_2_terms_word_for_word() -> None:
    """pyproject declares Apache-2.0; LICENSE holds that licence's terms, line for line as the peer's copy has them
    (the peer's file adds the appendix on how to apply the licence, which a project's own LICENSE leaves out)."""
    ours = [line.strip() for line in (ROOT / "LICENSE").read_text(encoding="utf-8").splitlines()]
    theirs = [line.strip() for line in (LLAMAFACTORY.path() / "LICENSE").read_text(encoding="utf-8").splitlines()]
    end = theirs.index("END OF TERMS AND CONDITIONS") + 1
    assert ours[0] == "Apache License" and "END OF TERMS AND CONDITIONS" in ours
    assert [line for line in ours if line] == [line for line in theirs[:end] if line]
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
