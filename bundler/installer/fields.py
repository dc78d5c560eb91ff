"""Every manifest field that reaches a path or a command is untrusted input: the checks of one field each.

Bundle-relative paths (:func:`check_relpath`), repo ids (:func:`check_repo_id`, huggingface_hub's rule) and
revisions (:func:`check_ref_name`, git's rule). Standard library and ferry's foundation only (part of the
generated ``install.py``).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from ferry.errors import UnsafeArchiveError

#: A 40-hex git commit (hub revisions, local content revisions).
COMMIT_HEX = re.compile(r"^[0-9a-f]{40}$")
#: A lowercase sha256 in hex.
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_relpath(path: Any, where: str) -> str:
    """A bundle-relative POSIX path, checked: a non-empty string, relative, normalised (no ``.``, ``..`` or empty
    components, no trailing ``/``), no backslash, no control character (NUL, newline, ...), valid UTF-8 (no
    lone surrogates from ``\\udXXX`` escapes). Returns the path.

    Raises:
        UnsafeArchiveError: naming ``where`` and the offending value.
    """
    if not isinstance(path, str):
        raise UnsafeArchiveError(f"{where}: expected a path string, got {type(path).__name__}")
    why = None
    if not path:
        why = "empty"
    elif path.startswith("/"):
        why = "absolute"
    elif "\\" in path:
        why = "a backslash"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        why = "a control character (NUL, newline, ...)"
    elif ".." in path.split("/"):
        why = "a '..' component"
    elif posixpath.normpath(path) != path or path == ".":
        why = "not normalised ('.', '//' or a trailing '/')"
    else:
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            why = "not valid UTF-8"
    if why:
        raise UnsafeArchiveError(f"{where}: unsafe path {path!r} ({why})")
    return path


#: huggingface_hub's ``REPO_ID_REGEX`` (utils/_validators.py), used by its ``validate_repo_id``; mirrored here
#: for a bare python3 (tests/bundler keep it equal to the library's).
REPO_ID_REGEX = re.compile(
    r"""
    (\b[\w\-.]{1,96}\b/)? # optional namespace (username or organization)
    \b               # starts with a word boundary
    [\w\-.]{1,96}    # repo_name: alphanumeric + . _ -
    \b               # ends with a word boundary
    """,
    flags=re.VERBOSE | re.ASCII,
)


def check_repo_id(value: Any, where: str) -> str:
    """``ORG/NAME`` or ``NAME`` by huggingface_hub's ``validate_repo_id`` rules: 1-96 characters of
    ``[A-Za-z0-9._-]`` per part, at most one ``/``, no ``--`` or ``..``, not ending in ``.git``, not starting or
    ending with ``-`` or ``.``.

    Raises:
        UnsafeArchiveError: naming ``where`` and the value.
    """
    ok = (
        isinstance(value, str)
        and value.count("/") <= 1
        and REPO_ID_REGEX.fullmatch(value) is not None
        and "--" not in value
        and ".." not in value
        and not value.endswith(".git")
    )
    if not ok:
        raise UnsafeArchiveError(
            f"{where}: invalid repo id {value!r} (huggingface_hub's rule: 'NAME' or "
            f"'ORG/NAME' of letters, digits, '-', '_', '.'; no '--' or '..')"
        )
    return value


def check_ref_name(value: Any, where: str) -> str:
    """A revision: a 40-hex commit, or a ref name by ``git check-ref-format --allow-onelevel`` rules (no ``..``,
    no component starting with ``.`` or ending in ``.lock``, no leading, trailing or double ``/``, no control
    character, space, ``~ ^ : ? * [ \\``, no ``@{``, not ``@``, not ending in ``.``; at most 255 bytes).

    Raises:
        UnsafeArchiveError: naming ``where`` and the value.
    """
    if isinstance(value, str) and COMMIT_HEX.match(value):
        return value
    why = None
    if not isinstance(value, str) or not value:
        why = "not a non-empty string"
    elif len(value.encode("utf-8", "surrogatepass")) > 255:
        why = "longer than 255 bytes"
    elif any(ord(c) < 0x21 or ord(c) == 0x7F or c in "~^:?*[\\" for c in value):
        why = "a control character, space or one of ~ ^ : ? * [ \\"
    elif ".." in value or "@{" in value or value == "@":
        why = "'..', '@{' or '@'"
    elif value.startswith("/") or value.endswith("/") or "//" in value:
        why = "a leading, trailing or double '/'"
    elif value.endswith("."):
        why = "a trailing '.'"
    elif any(part.startswith(".") or part.endswith(".lock") for part in value.split("/")):
        why = "a component starting with '.' or ending in '.lock'"
    else:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            why = "not valid UTF-8"
    if why:
        raise UnsafeArchiveError(f"{where}: invalid revision {value!r} ({why}; git check-ref-format rules)")
    return value
