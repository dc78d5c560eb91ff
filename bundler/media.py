"""The images and videos a local dataset's rows name, checked on the online side before anything is packed.

LLaMA-Factory's multimodal layouts (its ``mllm_demo``): a ``dataset_info.json`` entry declares an image column
(``"columns": {"images": "images"}``), and each row lists image paths relative to the media folder, which is the
dataset folder (LLaMA-Factory's ``media_dir`` defaults to ``dataset_dir``)::

    {"messages": [{"role": "user", "content": "<image>Who are they?"}, ...], "images": ["mllm_demo_data/1.jpg"]}

A ``videos`` column (its ``mllm_video_demo``) names video files the same way.

A folder packed as a dataset carries its images and videos with it, hashed like every other file.
:func:`check_media` reads the rows of every entry that declares images or videos (JSON arrays or JSON Lines) and
refuses, in one line naming the data file, the row and the path, a file that the isolated host would not have:
missing, outside the dataset folder (absolute paths and ``..`` included), left out by the source's ``include`` /
``exclude``, unreadable, or not an image (PNG, JPEG, GIF, WebP, BMP, TIFF by their first bytes) or video (MP4/MOV,
AVI, Matroska/WebM, FLV, MPEG by theirs). It returns ``{"images", "videos", "bytes"}`` (distinct files), which the
manifest's dataset item records as ``media`` and ``ferry inspect`` shows.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from ferry.errors import SourceError

#: File signatures of the image formats transformers' image processors open (through PIL).
IMAGE_MAGIC = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",  # JPEG
    b"GIF87a",
    b"GIF89a",
    b"BM",  # BMP
    b"II*\x00",  # TIFF, little-endian
    b"MM\x00*",  # TIFF, big-endian
)


def _is_image(head: bytes) -> bool:
    return head.startswith(IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _is_video(head: bytes) -> bool:
    """Whether ``head`` (a file's first 16 bytes) starts an ISO media file (MP4, MOV: ``ftyp``, ``moov``, ``mdat``
    or ``wide`` at byte 4), an AVI, Matroska/WebM, FLV or MPEG program/transport stream."""
    return (
        head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free")
        or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
        or head.startswith((b"\x1a\x45\xdf\xa3", b"FLV", b"\x00\x00\x01\xba"))
    )


def _rows(path: Path) -> list[Any]:
    """The rows of a JSON array or JSON Lines file (what LLaMA-Factory's local loader reads).

    Raises:
        SourceError: the file is neither (naming the file and the line).
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise SourceError(f"{path}: line {number} is not JSON ({exc})") from None
        return rows
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"{path}: not JSON ({exc})") from None
    return data if isinstance(data, list) else [data]


def _media_columns(info: dict[str, Any]) -> dict[tuple[str, str], str]:
    """``(file_name, "images" or "videos")`` -> column, for the dataset_info.json entries that declare one."""
    out = {}
    for entry in info.values():
        if isinstance(entry, dict) and isinstance(entry.get("file_name"), str):
            for kind in ("images", "videos"):
                column = (entry.get("columns") or {}).get(kind)
                if isinstance(column, str):
                    out[entry["file_name"], kind] = column
    return out


def check_media(folder: Path, carried: set[str]) -> dict[str, int] | None:
    """Check every image and video that the rows of ``folder``'s dataset_info.json entries name (see the module
    docstring); ``carried``: the folder-relative POSIX paths the item packs. Returns ``{"images": N, "videos": V,
    "bytes": B}`` over distinct files, or None when no entry declares images or videos.

    Raises:
        SourceError: one line naming the data file, the row (0-based, as LLaMA-Factory's ``datasets`` rows) and the
            image or video path that the isolated host would not have, and why.
    """
    info_path = folder / "dataset_info.json"
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except ValueError:
        return None  # training_needs refuses an unreadable registry with its own line
    columns = _media_columns(info) if isinstance(info, dict) else {}
    seen: dict[str, str] = {}  # path -> kind
    for (file_name, kind), column in sorted(columns.items()):
        data = folder / file_name
        if file_name not in carried or not data.is_file():
            continue  # an entry whose data is not packed: training_needs names it
        for index, row in enumerate(_rows(data)):
            value = row.get(column) if isinstance(row, dict) else None
            paths = [value] if isinstance(value, str) else value if isinstance(value, list) else []
            for media in paths:
                where = f"{folder.name}/{file_name} row {index}: {kind[:-1]} {media!r}"
                seen.setdefault(_check_one(folder, media, carried, where, kind), kind)
    if not columns:
        return None
    total = sum((folder / rel).stat().st_size for rel in seen)
    kinds = list(seen.values())
    return {"images": kinds.count("images"), "videos": kinds.count("videos"), "bytes": total}


def _check_one(folder: Path, image: Any, carried: set[str], where: str, kind: str = "images") -> str:
    """The folder-relative path of one image (``kind``: or video) reference, after checking it (see
    :func:`check_media`)."""
    if not isinstance(image, str) or not image:
        raise SourceError(f"{where} is not a path")
    rel = posixpath.normpath(image.replace("\\", "/"))
    if image.startswith("/") or rel == ".." or rel.startswith("../"):
        raise SourceError(
            f"{where} lies outside the dataset folder {folder}: the isolated host would not have it (move it into "
            "the folder and name it relative to it)"
        )
    path = folder / rel
    if not path.is_file():
        raise SourceError(f"{where} does not exist ({path})")
    if rel not in carried:
        raise SourceError(f"{where} is left out by the source's include/exclude patterns")
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise SourceError(f"{where} cannot be read ({exc.strerror})") from None
    if kind == "videos" and not _is_video(head):
        raise SourceError(f"{where} is not a video (MP4/MOV, AVI, Matroska/WebM, FLV or MPEG by its first bytes)")
    if kind == "images" and not _is_image(head):
        raise SourceError(f"{where} is not an image (PNG, JPEG, GIF, WebP, BMP or TIFF by its first bytes)")
    return rel


__all__ = ["IMAGE_MAGIC", "check_media"]
