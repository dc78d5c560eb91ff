"""Tensor I/O for the exporter, apart from the math (after mergekit's ``io/lazy_tensor_loader.py`` and
``io/tensor_writer.py``): a lazy reader over a model folder's weight shards, and a writer that streams tensors
into sharded safetensors files one at a time.

Reading: :class:`CheckpointReader` indexes every shard's header (names, dtypes, shapes, byte offsets; no tensor
data) and reads one tensor at a time with a positioned read into that tensor's own memory. (safetensors'
``safe_open`` memory-maps the whole shard, and every page it touches counts toward resident memory until the shard
is closed: a 5 GB shard would cost 5 GB of RSS. Reading each tensor's bytes directly bounds memory by the tensors
alive, not by the shard size.) A pickle-only checkpoint (``*.bin``) is read only when the caller allows it, with
``torch.load(weights_only=True, mmap=True)``.

Writing: the safetensors header lists every tensor's byte range up front, and the exporter knows every output
tensor's name, dtype and shape before it computes any of them, so :class:`ShardedSafetensorsWriter` plans the
shards first, writes each file's header, then appends each tensor's bytes as it arrives and frees it. Peak memory
is one tensor, never one shard. The sha256 of each file is computed while it is written. Output layout (as
transformers' ``save_pretrained``)::

    OUT/model.safetensors                          everything fits in max_shard_size
    OUT/model-00001-of-00004.safetensors ...       otherwise, plus
    OUT/model.safetensors.index.json               {"metadata": {"total_size": BYTES}, "weight_map": {name: file}}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ferry.errors import ExportError, SourceError
from ferry.fsutil import sha256_file  # noqa: F401 - exporter.io.sha256_file, as before

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

#: torch dtype ↔ safetensors dtype tag (the safetensors format specification).
DTYPE_TAGS: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TAG_DTYPES: dict[str, torch.dtype] = {tag: dtype for dtype, tag in DTYPE_TAGS.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype and shape of one stored tensor; ``nbytes`` is its size in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class CheckpointReader:
    """The weights of a model folder, read lazily shard by shard.

    ``files`` lists the weight files in the order they are read (the index's order, else sorted); ``infos`` maps
    each tensor name to its :class:`TensorInfo`; ``file_of`` maps it to its file.

    Raises:
        ExportError: the folder holds no weights, or an index names a missing file.
        SourceError: the folder holds only pickle weights (``*.bin``) and ``allow_pickle`` is False.
    """

    def __init__(self, folder: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        self.folder = Path(folder)
        self.pickle = False
        files = self._find_files(self.folder, "safetensors", SAFE_INDEX, SAFE_SINGLE)
        if not files:
            files = self._find_files(self.folder, "bin", PICKLE_INDEX, PICKLE_SINGLE)
            if not files:
                raise ExportError(f"{self.folder} holds no model weights (*.safetensors or pytorch_model*.bin)")
            if not allow_pickle:
                raise SourceError(
                    f"{self.folder} holds only pickle weights ({files[0].name}), which can run arbitrary code when "
                    f"loaded; pass --allow-pickle (allow_pickle=True) if you trust them"
                )
            self.pickle = True
        self.files: list[Path] = files
        self._offsets: dict[Path, dict[str, tuple[TensorInfo, int]]] = {}
        self.infos: dict[str, TensorInfo] = {}
        self.file_of: dict[str, Path] = {}
        for file in files:
            for info in self._read_infos(file):
                if info.name in self.infos:
                    raise ExportError(
                        f"tensor {info.name!r} is stored twice ({self.file_of[info.name].name}, {file.name})"
                    )
                self.infos[info.name] = info
                self.file_of[info.name] = file

    @staticmethod
    def _find_files(folder: Path, ext: str, index_name: str, single_name: str) -> list[Path]:
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ExportError(f"{index}: not a valid weight index ({exc})") from None
            names = list(dict.fromkeys(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise ExportError(f"{index} names shards that are missing: {', '.join(missing[:5])}")
            return [folder / n for n in names]
        if (folder / single_name).is_file():
            return [folder / single_name]
        return sorted(p for p in folder.glob(f"*.{ext}") if p.is_file() and not p.name.startswith("adapter_"))

    def _read_infos(self, file: Path) -> list[TensorInfo]:
        if self.pickle:
            state = _torch_load(file)
            return [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
        self._offsets[file] = offsets = read_header(file)
        return [info for info, _ in offsets.values()]

    def keys_in(self, file: Path) -> list[str]:
        """Tensor names stored in ``file``, in storage order."""
        return [k for k, f in self.file_of.items() if f == file]

    @contextlib.contextmanager
    def open(self, file: Path) -> Iterator[_Shard]:
        """Open one shard; its ``get(name)`` returns a new CPU tensor read from the file (safetensors: a plain
        positioned read into the tensor's own memory, so only the tensors alive count toward resident memory,
        not a memory map of the whole shard)."""
        if self.pickle:
            state = _torch_load(file)
            try:
                yield _Shard(lambda name: state[name])
            finally:
                state.clear()
            return
        offsets = self._offsets[file]
        with open(file, "rb", buffering=0) as fh:

            def get(name: str) -> torch.Tensor:
                info, start = offsets[name]
                tensor = torch.empty(info.shape, dtype=info.dtype)
                if info.nbytes:
                    view = tensor.reshape(-1).view(torch.uint8).numpy().data
                    got = 0
                    while got < info.nbytes:
                        n = os.preadv(fh.fileno(), [view[got:]], start + got)
                        if n == 0:
                            raise ExportError(f"{file}: truncated while reading tensor {name!r}")
                        got += n
                return tensor

            def locate(name: str) -> tuple[int, int, TensorInfo]:
                info, start = offsets[name]
                return fh.fileno(), start, info

            yield _Shard(get, locate)


class _Shard:
    """One open shard: ``get(name)`` reads a tensor; ``locate(name)`` gives ``(file descriptor, byte offset,
    TensorInfo)`` of its stored bytes (safetensors only, None for a pickle shard) for a copy that never builds the
    tensor (:meth:`ShardedSafetensorsWriter.copy`)."""

    def __init__(self, getter, locate=None) -> None:
        self.get = getter
        self.locate = locate


def read_header(file: str | os.PathLike) -> dict[str, tuple[TensorInfo, int]]:
    """Parse a safetensors file's header (the format: u64 little-endian header length, JSON header, byte buffer).

    Returns ``{name: (TensorInfo, absolute byte offset of its data)}`` in storage order.

    Raises:
        ExportError: not a safetensors file, an unknown dtype, or byte ranges that do not match shapes / file size.
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ExportError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise ExportError(f"{file}: not a safetensors file (header length {length} does not fit the file)")
        try:
            table = json.loads(fh.read(length))
        except ValueError as exc:
            raise ExportError(f"{file}: unreadable safetensors header ({exc})") from None
    data_start = 8 + length
    entries = []
    for name, meta in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype = TAG_DTYPES[meta["dtype"]]
            begin, end = (int(x) for x in meta["data_offsets"])
            info = TensorInfo(name, dtype, tuple(int(d) for d in meta["shape"]))
        except KeyError as exc:
            raise ExportError(f"{file}: tensor {name!r}: unsupported or missing {exc} in the header") from None
        if end - begin != info.nbytes or data_start + end > size:
            raise ExportError(
                f"{file}: tensor {name!r}: byte range {begin}..{end} does not match its shape "
                f"{list(info.shape)} {info.dtype} or the file size"
            )
        entries.append((begin, info))
    entries.sort(key=lambda e: e[0])
    return {info.name: (info, data_start + begin) for begin, info in entries}


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # old (non-zip) serialisation cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True)


def load_file(path: str | os.PathLike, *, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Load a small weight file entirely (an adapter): safetensors, or a pickle with ``allow_pickle``.

    Raises:
        SourceError: a pickle file without ``allow_pickle``.
        ExportError: unreadable file.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        if not allow_pickle:
            raise SourceError(f"{path} is a pickle file; pass --allow-pickle (allow_pickle=True) if you trust it")
        return _torch_load(path)
    from safetensors.torch import load_file as _load

    try:
        return _load(str(path))
    except Exception as exc:  # SafetensorError
        raise ExportError(f"{path}: unreadable safetensors file ({exc})") from None


def plan_shards(entries: Sequence[TensorInfo], max_shard_size: int) -> list[list[TensorInfo]]:
    """Split ``entries`` (in order) into shards of at most ``max_shard_size`` bytes each, as transformers'
    ``save_pretrained`` does: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    size = 0
    for info in entries:
        if current and size + info.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(info)
        size += info.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """``['model.safetensors']`` or ``['model-00001-of-000NN.safetensors', ...]``."""
    if count == 1:
        return [SAFE_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(infos: Sequence[TensorInfo], metadata: dict[str, str]) -> bytes:
    """The safetensors header (u64 little-endian length + JSON, space-padded to a multiple of 8)."""
    table: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for info in infos:
        table[info.name] = {
            "dtype": DTYPE_TAGS[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardedSafetensorsWriter:
    """Write tensors, one at a time and in the planned order, into sharded safetensors files in ``out_dir``.

    Args:
        out_dir: an existing directory (the exporter's temp directory).
        entries: every tensor to write, in write order, with its *output* dtype and shape.
        max_shard_size: bytes per shard (decimal units as transformers: ``5GB`` = 5·10^9).

    Use :meth:`write` for each entry in order, then :meth:`close`, which writes the index (when sharded) and
    returns ``{file name: sha256 hex}``. Used as a context manager, an exception closes the open file and the
    hashing thread (the caller removes the half-written directory).

    Raises:
        ExportError: a tensor arrives out of order or with another dtype/shape than planned, or :meth:`close` is
            called before every planned tensor was written.
    """

    def __init__(self, out_dir: str | os.PathLike, entries: Sequence[TensorInfo], max_shard_size: int) -> None:
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(entries, max_shard_size)
        self.names = shard_names(len(self.shards))
        self.total_size = sum(info.nbytes for info in entries)
        self.sha256: dict[str, str] = {}
        self._shard = -1
        self._pos = 0
        self._fh: BinaryIO | None = None
        self._hash = hashlib.sha256()  # of the file being written; a fresh one per file
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-sha256")
        self._buffer: bytearray | None = None

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._pool.shutdown()

    def _next_file(self) -> None:
        self._finish_file()
        self._shard += 1
        self._pos = 0
        name = self.names[self._shard]
        self._fh = open(self.out_dir / name, "wb")
        self._hash = hashlib.sha256()
        header = _header(self.shards[self._shard], {"format": "pt"})
        self._fh.write(header)
        self._hash.update(header)

    def _finish_file(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self.sha256[self.names[self._shard]] = self._hash.hexdigest()
            self._fh = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (on CPU, the planned dtype and shape) as ``name``."""
        while self._fh is None or self._pos >= len(self.shards[self._shard]):
            if self._shard + 1 >= len(self.shards):
                raise ExportError(f"writer got tensor {name!r} after every planned tensor was written")
            self._next_file()
        info = self.shards[self._shard][self._pos]
        if info.name != name or tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise ExportError(
                f"writer expected {info.name!r} {info.dtype} {list(info.shape)}, got {name!r} {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        self._emit(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._pos += 1

    def _emit(self, data: memoryview) -> None:
        """Write ``data`` to the current file and add it to the file's hash."""
        fh = self._fh
        if fh is None:
            raise ExportError("writer: no shard file is open")
        if len(data) >= 1 << 20:  # hash on a second thread while this one writes (both release the GIL)
            hashed = self._pool.submit(self._hash.update, data)
            fh.write(data)
            hashed.result()
        else:
            fh.write(data)
            self._hash.update(data)

    def copy(self, name: str, fd: int, offset: int, info: TensorInfo, chunk: int = 8 << 20) -> None:
        """Append the stored bytes of an unchanged tensor (``info``: its name, dtype and shape in the source, which
        must be the planned ones) from file descriptor ``fd`` at byte ``offset``, ``chunk`` bytes at a time through
        one reused buffer: the tensor is never built, so a copied tensor costs ``chunk`` bytes of memory, not its
        size. Same checks and hashing as :meth:`write`.

        Raises:
            ExportError: out of order or another dtype/shape than planned; the source file is shorter than its
                header says.
        """
        while self._fh is None or self._pos >= len(self.shards[self._shard]):
            if self._shard + 1 >= len(self.shards):
                raise ExportError(f"writer got tensor {name!r} after every planned tensor was written")
            self._next_file()
        planned = self.shards[self._shard][self._pos]
        if planned.name != name or planned.dtype != info.dtype or planned.shape != tuple(info.shape):
            raise ExportError(
                f"writer expected {planned.name!r} {planned.dtype} {list(planned.shape)}, got {name!r} "
                f"{info.dtype} {list(info.shape)}"
            )
        if self._buffer is None or len(self._buffer) < min(chunk, info.nbytes):
            self._buffer = bytearray(min(chunk, max(info.nbytes, 1)))
        buffer = memoryview(self._buffer)
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [buffer[: min(len(buffer), info.nbytes - done)]], offset + done)
            if n <= 0:
                raise ExportError(f"source file ended while copying tensor {name!r}")
            self._emit(buffer[:n])
            done += n
        self._pos += 1

    def close(self) -> dict[str, str]:
        """Finish the last file, write ``model.safetensors.index.json`` when there are several shards, and return
        ``{file name: sha256}`` for every file written."""
        written = sum(len(s) for s in self.shards[: self._shard]) + (self._pos if self._shard >= 0 else 0)
        planned = sum(len(s) for s in self.shards)
        if written != planned:
            raise ExportError(f"writer closed after {written} of {planned} planned tensors")
        if self._fh is None and self._shard < 0:  # an empty model: still write a valid empty file
            self._next_file()
        self._finish_file()
        self._pool.shutdown()
        if len(self.shards) > 1:
            weight_map = {info.name: self.names[i] for i, shard in enumerate(self.shards) for info in shard}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            data = (json.dumps(index, indent=2) + "\n").encode()
            (self.out_dir / SAFE_INDEX).write_bytes(data)
            self.sha256[SAFE_INDEX] = hashlib.sha256(data).hexdigest()
        return dict(self.sha256)


#: The files of a tokenizer, its chat templates and its processor, as found in a model folder.
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)


def copy_tokenizer_files(sources: list[Path], dest: Path) -> list[str]:
    """Copy every tokenizer / chat-template file from the first folder in ``sources`` that has a
    ``tokenizer_config.json`` (or ``tokenizer.json``); returns the copied relative paths."""
    for src in sources:
        if not ((src / "tokenizer_config.json").is_file() or (src / "tokenizer.json").is_file()):
            continue
        copied = []
        for pattern in TOKENIZER_PATTERNS:
            for path in sorted(src.glob(pattern)):
                if path.is_file():
                    rel = path.relative_to(src)
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, dest / rel)
                    copied.append(rel.as_posix())
        return sorted(set(copied))
    return []
