"""Dataset files and formats, as LLaMA-Factory defines and loads them (``data/README.md`` and
``src/llamafactory/data/{parser,loader,converter}.py`` of hiyouga/LLaMA-Factory 0.9.5).

A dataset is named in the config either by a key of ``dataset_dir/dataset_info.json`` or by a path. Rows are
read through the ``datasets`` library, as LLaMA-Factory reads them, offline:

- plain files by extension (``FILEEXT2TYPE``): ``.json`` (a list, or JSON Lines as ``Dataset.to_json`` writes),
  ``.jsonl``, ``.parquet``, ``.csv``, ``.arrow``, ``.txt`` (one sample per line, ``stage: pt``); a folder of such
  files is searched recursively (one type per dataset);
- a ``save_to_disk`` folder (``datasets.load_from_disk``) and a Hugging Face dataset repository folder (README
  ``configs`` / ``data/`` splits; ``subset``, ``split`` and ``folder`` pick the part); an ``hf_hub_url`` entry
  is read from the local hub cache when it is installed there.

``dataset_info.json`` entries carry::

    "name": {
      "file_name": "data.json",                 # file or folder under dataset_dir (or hf_hub_url, installed)
      "formatting": "alpaca" | "sharegpt" | "openai",   # default alpaca
      "subset": ..., "split": "train", "folder": ..., "num_samples": N,
      "columns": {"prompt", "query", "response", "system", "history", "messages", "tools"},
      "tags": {"role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag",
               "function_tag", "system_tag"}
    }

Only declared columns are read (LLaMA-Factory's defaults: instruction/input/output for alpaca, conversations for
sharegpt; ``system``, ``tools`` and ``history`` only when declared); ``images`` and ``videos`` are read too
(:mod:`trainer.vision`, :mod:`trainer.video`). Refused with one line naming the dataset and the key: ``audios``,
unknown keys. Preference datasets (``"ranking": true`` with ``chosen``/``rejected`` columns, or a ``kto_tag``
column) are read by :mod:`trainer.preference_data`; each stage takes only its own kind (:func:`check_stage`,
LLaMA-Factory's "not applicable in the current training stage").

Every row becomes one :class:`Sample`: a conversation (``system`` + alternating user/assistant turns) or a
plain ``text`` for pre-training. Formats:

- **alpaca**: ``instruction`` and ``input`` joined by a newline (empty ones left out) is the user turn,
  ``output`` the assistant turn; ``history`` is a list of ``[prompt, response]`` pairs before them.
- **sharegpt**: a list of ``{"from": "human"|"gpt"|"observation"|"function_call"|"system", "value": ...}``
  under ``conversations``; user/observation turns at odd positions, assistant/function turns at even ones.
- **openai**: ``{"role", "content"}`` messages; an assistant's ``tool_calls`` become a function turn and
  consecutive ``tool`` messages one observation (LLaMA-Factory's ``OpenAIDatasetConverter``). Files not listed in
  dataset_info.json with such ``messages`` are read this way. Content-part lists: text parts joined; any other
  part (image, audio) refused naming the row.
- **plain text**: a dataset whose columns map only ``prompt`` (c4_demo, wiki_demo), a file of ``{"text": ...}``
  rows, or any alpaca dataset's prompt column when ``stage: pt``.

A malformed row (invalid JSON, not an object, missing column, wrong type, bad role order) is a
:class:`ferry.errors.DataError` naming the file and the 1-based row number; bytes that are not UTF-8 name the file,
line and byte offset; an empty file or ``[]`` names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.digests import data_digests
from ferry.errors import ConfigError, DataError, NotInstalledError
from ferry.stages import dataset_stage_problem
from ferry.yaml_config import decode_utf8

#: Roles of a normalised conversation turn.
USER, ASSISTANT, OBSERVATION, FUNCTION = "user", "assistant", "observation", "function"

_SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
_OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function_call",
    "system_tag": "system",
}
_ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}


def message_tags(spec: DatasetSpec, formatting: str) -> dict[str, str]:
    """The message tags of a sharegpt or openai dataset: the format's defaults under the entry's ``tags``."""
    return {**(_OPENAI_TAGS if formatting == "openai" else _SHAREGPT_TAGS), **spec.tags}


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives and how to read its rows.

    Attributes:
        name: the name as written in the config.
        files: every file of the dataset (a file, or the files of a folder, sorted); their hashes key the cache.
        layout: ``datasets`` builder of plain files (``json``, ``csv``, ``parquet``, ``arrow``, ``text``), or
            ``disk`` (a ``save_to_disk`` folder) or ``repo`` (a Hugging Face dataset repository folder).
        path: the file or folder named by the config / dataset_info.json.
        formatting: ``"alpaca"``, ``"sharegpt"``, ``"openai"``, ``"text"``, or ``"auto"`` (paths not listed in
            dataset_info.json: detected from the first row: ``messages``/``conversations`` -> sharegpt or openai,
            ``instruction`` -> alpaca, ``text`` -> text).
        columns: LLaMA-Factory column mapping (only the keys given in dataset_info.json).
        tags: sharegpt tags (only the keys given; the rest default per style).
        subset, split, folder: LLaMA-Factory's ``subset`` (config name), ``split`` (default train, slicing such as
            ``train[:100]`` allowed) and ``folder`` (data_dir) of a repository layout.
        num_samples: LLaMA-Factory's ``num_samples`` (random subset, seeded by the config's seed).
        declared: listed in dataset_info.json: only the declared columns are read (LLaMA-Factory).
        columns_given: the entry has a ``columns`` object: then a key it leaves out is not read at all, not even
            alpaca's default ``instruction``/``input``/``output`` (LLaMA-Factory's ``DatasetAttr.join`` sets every
            column key it does not find there to None).
        ranking: LLaMA-Factory's ``ranking``: rows hold a prompt and a chosen and a rejected reply (stage dpo/rm).
    """

    name: str
    files: tuple[Path, ...]
    formatting: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    layout: str = "json"
    path: Path | None = None
    subset: str | None = None
    split: str = "train"
    folder: str | None = None
    num_samples: int | None = None
    declared: bool = False
    columns_given: bool = False
    ranking: bool = False

    def describe(self) -> dict[str, Any]:
        """Plain-type description (part of the tokenisation cache key)."""
        return {
            "name": self.name,
            "formatting": self.formatting,
            "columns": dict(sorted(self.columns.items())),
            "columns_given": self.columns_given,
            "tags": dict(sorted(self.tags.items())),
            "files": [str(f) for f in self.files],
            "layout": self.layout,
            "subset": self.subset,
            "split": self.split,
            "folder": self.folder,
            "num_samples": self.num_samples,
            "declared": self.declared,
            "ranking": self.ranking,
        }


@dataclass
class Sample:
    """One normalised row.

    Either ``text`` is set (plain text, every token trained) or ``turns`` holds ``(role, content)`` pairs in
    order, roles alternating ``user``/``observation`` then ``assistant``/``function``, ending with an
    assistant/function turn. ``system`` is the system prompt ("" when none); ``tools`` a tool description;
    ``origin`` is ``"FILE: row N"`` for error messages. ``images``: the entries of the dataset's ``images`` column
    as the row writes them (paths relative to ``media_dir``; see :mod:`trainer.vision`), () for a text row;
    ``videos`` likewise, of the ``videos`` column (:mod:`trainer.video`).
    """

    turns: list[tuple[str, str]] = field(default_factory=list)
    system: str = ""
    tools: str = ""
    text: str | None = None
    origin: str = ""
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()


# ---------------------------------------------------------------------- resolving names

#: LLaMA-Factory's ``FILEEXT2TYPE``: file extension -> ``datasets`` builder.
FILEEXT2TYPE = {"arrow": "arrow", "csv": "csv", "json": "json", "jsonl": "json", "parquet": "parquet", "txt": "text"}
#: dataset_info.json keys ferry reads; any other key of an entry is refused (it would be silently ignored).
_INFO_KEYS = {
    "file_name",
    "hf_hub_url",
    "ms_hub_url",
    "om_hub_url",
    "script_url",
    "cloud_file_name",
    "formatting",
    "ranking",
    "subset",
    "split",
    "folder",
    "num_samples",
    "columns",
    "tags",
}
_COLUMN_KEYS = {
    "prompt",
    "query",
    "response",
    "history",
    "messages",
    "system",
    "tools",
    "images",
    "videos",
    "audios",
    "chosen",
    "rejected",
    "kto_tag",
}


def read_dataset_info(root: Path) -> dict[str, Any]:
    """``root/dataset_info.json`` as a dict ({} when absent).

    Raises:
        DataError: the file is not UTF-8 (naming line and byte offset).
        ConfigError: not valid JSON, or not an object.
    """
    info_path = root / "dataset_info.json"
    if not info_path.is_file():
        return {}
    text = decode_utf8(info_path.read_bytes(), info_path, DataError)
    try:
        info = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{info_path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{info_path}: expected an object mapping dataset names to descriptions")
    return info


def resolve_datasets(names: list[str], dataset_dir: str | os.PathLike, stage: str = "sft") -> list[DatasetSpec]:
    """Turn the config's dataset names into :class:`DatasetSpec` objects.

    A name is looked up in ``dataset_dir/dataset_info.json`` first (LLaMA-Factory's keys: ``file_name``,
    ``hf_hub_url`` / ``ms_hub_url`` for a dataset installed in the local hub cache, ``formatting``, ``subset``,
    ``split``, ``folder``, ``num_samples``, ``columns``, ``tags``), then as a path (absolute, relative to the
    working directory, or relative to ``dataset_dir``): a data file, a folder of data files (searched
    recursively), a ``save_to_disk`` folder or a Hugging Face dataset repository folder. Each dataset must suit
    ``stage`` (:func:`check_stage`).

    Raises:
        NotInstalledError: the name is neither listed nor an existing path ("did you mean" for near names), or its
            file is missing, or a hub entry is not installed.
        ConfigError: dataset_info.json is not valid JSON, an entry is malformed, it asks for what ferry does
            not train (image/video/audio columns, an unknown key), or the dataset does not suit ``stage``: one
            line naming the dataset and the key.
    """
    root = Path(dataset_dir)
    info_path = root / "dataset_info.json"
    info = read_dataset_info(root)
    specs = []
    for name in names:
        if name in info:
            specs.append(_spec_from_info(name, info[name], root, info_path))
            check_stage(specs[-1], stage, f"{info_path}: dataset {name!r}")
            continue
        for candidate in (Path(name).expanduser(), root / name):
            if candidate.exists():
                specs.append(_spec_from_path(name, candidate))
                check_stage(specs[-1], stage, f"dataset {name!r}")
                break
        else:
            import difflib

            near = difflib.get_close_matches(name, list(info), n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
            raise NotInstalledError(
                f"dataset {name!r} is neither in {info_path} nor a file or folder{hint}: add it to the datasets of "
                f"your ferry pack spec and install the bundle, or give the path of a data file or folder"
            )
    return specs


def check_stage(spec: DatasetSpec, stage: str, where: str) -> None:
    """Refuse a dataset that the training stage cannot use, in one line naming the key to change
    (:func:`ferry.stages.dataset_stage_problem`: LLaMA-Factory's rule, which ``ferry pack`` applies too).

    Raises:
        ConfigError: the dataset does not suit ``stage``.
    """
    problem = dataset_stage_problem(stage, spec.ranking, spec.columns)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")


def _spec_from_path(name: str, path: Path) -> DatasetSpec:
    layout, files = _layout(path, name)
    return DatasetSpec(name=name, files=files, layout=layout, path=path.resolve())


def _layout(path: Path, name: str) -> tuple[str, tuple[Path, ...]]:
    """``(layout, files)``: ``layout`` is a ``datasets`` builder (json, csv, parquet, arrow, text) for plain
    files, ``disk`` for a ``save_to_disk`` folder, ``repo`` for a Hugging Face dataset repository folder."""
    if path.is_dir():
        files = tuple(
            sorted(
                p.resolve()
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        )
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return "disk", files
        if (path / "dataset_dict.json").is_file():
            return "disk", files
        if (path / "README.md").is_file() or (path / "data").is_dir():
            return "repo", files
        data = [f for f in files if f.suffix[1:] in FILEEXT2TYPE]
        if not data:
            raise NotInstalledError(
                f"dataset {name!r}: folder {path} holds no data file ({', '.join('.' + e for e in FILEEXT2TYPE)})"
            )
        kinds = {FILEEXT2TYPE[f.suffix[1:]] for f in data}
        if len(kinds) > 1:
            raise ConfigError(
                f"dataset {name!r}: folder {path} mixes file types ({', '.join(sorted(kinds))}); "
                f"LLaMA-Factory needs one type per dataset"
            )
        return kinds.pop(), tuple(data)
    kind = FILEEXT2TYPE.get(path.suffix[1:])
    if kind is None:
        raise ConfigError(
            f"dataset {name!r}: {path} is not a data file (allowed: {', '.join('.' + e for e in FILEEXT2TYPE)})"
        )
    return kind, (path.resolve(),)


def _spec_from_info(name: str, entry: Any, root: Path, info_path: Path) -> DatasetSpec:
    where = f"{info_path}: dataset {name!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{info_path}: entry {name!r} must be an object")
    unknown = sorted(set(entry) - _INFO_KEYS)
    if unknown:
        raise ConfigError(f"{where}: key {unknown[0]!r} is not a LLaMA-Factory dataset_info key that ferry reads")
    if not isinstance(entry.get("ranking", False), bool):
        raise ConfigError(f"{where}: key 'ranking' must be true or false, got {entry['ranking']!r}")
    columns = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise ConfigError(f"{where}: columns and tags must be objects")
    for key in columns:
        if key not in _COLUMN_KEYS:
            raise ConfigError(f"{where}: columns.{key} is not a LLaMA-Factory column")
    if columns.get("audios"):
        raise ConfigError(f"{where}: columns.audios: ferry trains text, image and video rows; audios are not built")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt", "openai"):
        raise ConfigError(f"{where}: formatting must be alpaca, sharegpt or openai, got {formatting!r}")
    num_samples = entry.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples <= 0):
        raise ConfigError(f"{where}: num_samples must be a positive integer, got {num_samples!r}")
    split = entry.get("split", "train")
    if formatting == "alpaca" and set(columns) == {"prompt"}:
        formatting = "text"
    if formatting == "alpaca" and "columns" in entry and not columns.get("response") and not entry.get("ranking"):
        raise ConfigError(
            f"{where}: columns names no 'response': LLaMA-Factory then reads no reply and drops every "
            f"row; name the reply column (columns.response)"
        )
    extra = dict(
        subset=entry.get("subset"),
        split=str(split),
        folder=entry.get("folder"),
        num_samples=num_samples,
        formatting=formatting,
        columns={str(k): str(v) for k, v in columns.items() if v},
        tags={str(k): str(v) for k, v in tags.items()},
        declared=True,
        columns_given="columns" in entry,
        ranking=bool(entry.get("ranking", False)),
    )
    file_name = entry.get("file_name")
    if file_name:
        path = root / file_name
        if not path.exists():
            raise NotInstalledError(
                f"dataset {name!r}: file {path} is missing: add it to your ferry pack spec and install the bundle"
            )
        layout, files = _layout(path, name)
        return DatasetSpec(name=name, files=files, layout=layout, path=path.resolve(), **extra)
    hub = entry.get("hf_hub_url") or entry.get("ms_hub_url") or entry.get("om_hub_url")
    local = _installed_hub_dataset(hub) if entry.get("hf_hub_url") else None
    if local is None:
        other = hub or entry.get("script_url") or entry.get("cloud_file_name")
        raise NotInstalledError(
            f"dataset {name!r} ({info_path}) has no local file_name"
            + (f" and {other!r} is not installed" if other else "")
            + ": add the dataset to your ferry pack spec so that it is installed under dataset_dir"
        )
    layout, files = _layout(local, name)
    return DatasetSpec(name=name, files=files, layout="repo" if layout != "disk" else layout, path=local, **extra)


def _installed_hub_dataset(repo_id: str | None) -> Path | None:
    """The local snapshot folder of an installed Hugging Face dataset repository (never the network): the
    revision that ``datasets.load_dataset(repo_id)`` reads offline, so that both readers see the same rows.

    In order: the snapshot of the commit whose ``datasets`` cache is newest (``HF_DATASETS_CACHE/ORG___name/
    CONFIG/VERSION/COMMIT``, the folder ``datasets`` picks offline, whatever ``revision`` it is asked for;
    ``ferry install`` links the cache of the revision it installed there); ``refs/main``; the single installed
    snapshot (``ferry pack hf:ORG/NAME@v1`` writes ``refs/v1`` only).

    Raises:
        NotInstalledError: several revisions are installed and none of the above tells which one is meant.
    """
    if not repo_id:
        return None
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        return None
    snapshots = Path(constants.HF_HUB_CACHE) / ("datasets--" + repo_id.replace("/", "--")) / "snapshots"
    commit = _datasets_cache_commit(repo_id)
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception:  # not in the cache under main: look for another installed revision
        pass
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) > 1:
        raise NotInstalledError(
            f"dataset {repo_id!r}: revisions {', '.join(p.name[:12] for p in found)} are "
            f"installed in {snapshots.parent} and none is main: give the path of one snapshot"
        )
    return found[0] if found else None


def _datasets_cache_commit(repo_id: str) -> str | None:
    """The commit of the newest ``datasets`` cache folder of ``repo_id`` (as ``datasets.packaged_modules.cache``
    picks it offline), or None."""
    try:
        from datasets import config
        from datasets.naming import camelcase_to_snakecase
    except ImportError:
        return None
    *namespace, name = repo_id.split("/")
    root = Path(config.HF_DATASETS_CACHE) / "___".join([*namespace, camelcase_to_snakecase(name)])
    folders = [p for p in root.glob("*/*/*") if p.is_dir()]
    return max(folders, key=lambda p: p.stat().st_mtime).name if folders else None


# ---------------------------------------------------------------------- reading rows


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, row)`` from a ``.json`` list (row number = 1-based index) or a JSON Lines file
    (row number = 1-based line number; blank lines are skipped). Used to locate a JSON error in a file that
    the ``datasets`` library could not read.

    Raises:
        DataError: invalid JSON (naming the file and line), or not UTF-8.
    """
    text = decode_utf8(path.read_bytes(), path, DataError)
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or (stripped and not stripped.startswith("[")):
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {lineno}: invalid JSON line: {exc.msg}") from None
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    yield from enumerate(rows, start=1)


def _load_table(spec: DatasetSpec, file: Path | None) -> Any:
    """One ``datasets.Dataset``: of ``file`` (a plain data file), or of the whole folder (``disk``/``repo``)."""
    import datasets

    from ferry.constants import ferry_cache_dir
    from ferry.output import drop_library_handlers

    drop_library_handlers()  # its own stderr handler: "Failed to load JSON ... in row 400" beside ferry's line
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    cache = str(ferry_cache_dir() / "datasets")
    if spec.layout == "disk":
        loaded = datasets.load_from_disk(str(spec.path))
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise ConfigError(
                    f"dataset {spec.name!r}: split {spec.split!r} is not in {spec.path} (splits: {', '.join(loaded)})"
                )
            loaded = loaded[spec.split]
        return loaded
    if spec.layout == "repo":
        return datasets.load_dataset(
            str(spec.path), name=spec.subset, data_dir=spec.folder, split=spec.split, cache_dir=cache
        )
    assert file is not None
    # datasets keys its Arrow cache of a local file by path and modification time alone: a file replaced by another
    # with the same time (cp -p, rsync -a) would come back as the old rows. A folder per content keys it by bytes.
    digests = data_digests()
    digest = digests.get(file)
    if spec.layout in ("json", "csv", "text") and file.stat().st_size:
        data = file.read_bytes()
        text = decode_utf8(data, file, DataError)  # one line naming file, line and byte, no traceback
        if spec.layout == "json" and file.suffix == ".json":  # one object in .jsonl is a JSON Lines row
            _refuse_one_object(file, text)
        if digest is None:  # the bytes just read, not a second read
            digest = hashlib.sha256(data).hexdigest()
            digests.put(file, digest)
    if digest is None:
        digest = digests.digest(file)
    cache = str(Path(cache) / "by-content" / digest[:32])
    with contextlib.suppress(OSError):
        digests.save()
    return datasets.load_dataset(spec.layout, data_files=[str(file)], split=spec.split, cache_dir=cache)


def _undecoded_images(table: Any, spec: DatasetSpec) -> Any:
    """``table`` with its declared images column read as stored (``{"bytes", "path"}`` per image) where the
    ``datasets`` library would decode it into PIL images (an ``Image`` feature: hub datasets and parquet files that
    hold their images inline), so that :mod:`trainer.vision` decodes the very bytes and keys the cache by them."""
    import datasets

    column = spec.columns.get("images")
    feature = table.features.get(column) if column and getattr(table, "features", None) else None
    if isinstance(feature, datasets.Image) and feature.decode:
        return table.cast_column(column, datasets.Image(decode=False))
    inner = getattr(feature, "feature", None)  # List(Image()) / Sequence(Image())
    if isinstance(inner, datasets.Image) and inner.decode:
        return table.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return table


def _refuse_one_object(file: Path, text: str) -> None:
    """A ``.json`` file that is one object (not a list of rows, not JSON Lines) is refused: the ``datasets``
    library reads it as a single row (a dict of column lists too: one row of lists) and would train on it.

    Raises:
        DataError: naming the file and how to write its rows.
    """
    if not text.lstrip().startswith("{"):
        return
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:  # JSON Lines (or broken JSON, which the reader reports by row)
        return
    if not isinstance(whole, dict):
        return
    raise DataError(
        f"{file}: the file is one JSON object, which would train as a single row; write a JSON list of rows "
        f"([{{...}}, {{...}}]) or one object per line (JSON Lines)"
    )


def _tables(spec: DatasetSpec) -> Iterator[tuple[str, Any]]:
    """``(origin, dataset)`` per file (plain files) or for the whole folder."""
    if spec.layout in ("disk", "repo"):
        try:
            yield str(spec.path), _undecoded_images(_load_table(spec, None), spec)
        except (ConfigError, DataError):
            raise
        except Exception as exc:
            raise DataError(
                f"{spec.path}: the datasets library cannot read this {spec.layout} folder: {_root_cause(exc)}"
            ) from None
        return
    for file in spec.files:
        if file.stat().st_size == 0:
            raise DataError(f"{file}: the file is empty (dataset {spec.name!r})")
        try:
            table = _undecoded_images(_load_table(spec, file), spec)
        except (ConfigError, DataError):
            raise
        except Exception as exc:
            if spec.layout == "json":
                _diagnose_json(file)  # raises naming the row when it can tell what is wrong
            raise DataError(f"{file}: cannot be read as {spec.layout}: {_root_cause(exc)}") from None
        yield str(file), table


def _diagnose_json(path: Path) -> None:
    """Find why the ``datasets`` library refused a JSON file: invalid JSON, a row that is not an object, or a
    column whose type changes between rows. Raises DataError naming the row; returns when it finds nothing."""
    kinds: dict[str, tuple[str, int]] = {}
    rows = 0
    for rowno, row in read_rows(path):
        rows += 1
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {rowno}: expected a JSON object, got {type(row).__name__}")
        for key, value in row.items():
            if value is None:
                continue
            kind = type(value).__name__
            first = kinds.setdefault(key, (kind, rowno))
            if first[0] != kind:
                raise DataError(
                    f"{path}: row {rowno}: column {key!r} is a {kind} here but a {first[0]} in row "
                    f"{first[1]} (one type per column)"
                )
    if rows == 0:
        raise DataError(f"{path}: the file holds no rows")


def _root_cause(exc: BaseException) -> str:
    parent = exc.__cause__ or exc.__context__
    while parent is not None:
        exc = parent
        parent = exc.__cause__ or exc.__context__
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def sampling_rng(seed: int) -> Any:
    """The random stream of ``num_samples``: LLaMA-Factory draws from numpy's global generator, which
    ``transformers.set_seed(seed)`` seeds (``np.random.seed``) before any dataset loads, and every dataset with
    ``num_samples`` takes its draws from it in the order the datasets are listed (train, then eval). Pass one
    such generator to :func:`load_samples` for each dataset in turn."""
    import numpy as np

    return np.random.RandomState(seed)


def _sampled_indices(n: int, num_samples: int, rng: Any) -> list[int]:
    """LLaMA-Factory's ``num_samples`` (``data/loader.py``, ``_load_single_dataset``): ``permutation(n)[:k]``;
    when more are asked than the dataset holds, every row once and the rest drawn with ``choice(n, rest)``, both
    from ``rng`` (see :func:`sampling_rng`)."""
    import numpy as np

    indices = rng.permutation(n)[:num_samples]
    rest = num_samples - len(indices)
    if rest > 0:
        indices = np.concatenate((indices, rng.choice(n, rest)), axis=0)
    return [int(i) for i in indices]


def iter_rows(
    spec: DatasetSpec, *, max_samples: int | None = None, seed: int = 42, rng: Any = None
) -> Iterator[tuple[str, dict[str, Any], str]]:
    """Yield ``(where, row, formatting)`` for the rows of a dataset, read through the ``datasets`` library as
    LLaMA-Factory reads them: ``num_samples`` first (LLaMA-Factory's rows: drawn from ``rng``, the stream shared
    by the datasets of one config, see :func:`sampling_rng`; a fresh ``sampling_rng(seed)`` when None), then at
    most ``max_samples`` (the first ones). ``where`` is ``"FILE: row N"``; ``formatting`` the dataset's, detected
    from the first row when ``auto``.

    Raises:
        DataError: a row that is not an object (naming the file and the row number), an empty file, a file the
            ``datasets`` library cannot read, bytes that are not UTF-8 (file, line, byte offset).
    """
    tables = list(_tables(spec))
    total = sum(len(t) for _, t in tables)
    if total == 0:
        raise DataError(f"{tables[0][0] if tables else spec.path}: dataset {spec.name!r} holds no rows")
    if spec.num_samples is not None:
        flat = [(origin, table, i) for origin, table in tables for i in range(len(table))]
        picks: Any = (
            (flat[k][0], flat[k][2], flat[k][1][flat[k][2]])
            for k in _sampled_indices(total, spec.num_samples, sampling_rng(seed) if rng is None else rng)
        )
    else:
        picks = ((origin, i, row) for origin, table in tables for i, row in enumerate(table))
    formatting = spec.formatting
    count = 0
    for origin, index, row in picks:
        if max_samples is not None and count >= max_samples:
            return
        where = f"{origin}: row {index + 1}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if formatting == "auto":
            formatting = _detect(row, where)
        yield where, row, formatting
        count += 1


def load_samples(
    spec: DatasetSpec, *, stage: str, max_samples: int | None = None, seed: int = 42, rng: Any = None
) -> Iterator[Sample]:
    """Yield the normalised samples of a dataset (rows as :func:`iter_rows` reads them).

    Raises:
        DataError: a malformed row (the message names the file and the row number), an empty file, a file the
            ``datasets`` library cannot read, bytes that are not UTF-8 (file, line, byte offset).
        ConfigError: a sharegpt dataset with ``stage: pt`` (LLaMA-Factory: incompatible).
    """
    for where, row, formatting in iter_rows(spec, max_samples=max_samples, seed=seed, rng=rng):
        if stage == "pt" and formatting in ("sharegpt", "openai"):
            raise ConfigError(f"dataset {spec.name!r}: {formatting} data cannot be used with stage: pt")
        if formatting == "text" or stage == "pt":
            sample = _text_sample(row, spec, formatting, where)
            sample.origin = where
        else:
            sample = conversation_sample(row, spec, where, formatting)
        yield sample


def conversation_sample(
    row: dict[str, Any], spec: DatasetSpec, where: str, formatting: str, *, complete: bool = True
) -> Sample:
    """One row of a conversation format (alpaca, sharegpt, openai) as a :class:`Sample` (``origin`` set to
    ``where``). ``complete=False`` reads the prompt only, as a ranking row holds it: an alpaca row without its
    ``response`` column, a message list whose role order is checked but that may end with a user turn (the
    caller checks how it ends).

    Raises:
        DataError: a malformed row (the message starts with ``where``).
    """
    if formatting == "alpaca":
        sample = _alpaca_sample(row, spec, where, reply=complete)
    elif formatting == "openai":
        sample = _openai_sample(row, spec, where, complete=complete)
    else:
        sample = _sharegpt_sample(row, spec, where, complete=complete)
    sample.origin = where
    sample.images = _images(row, spec)
    sample.videos = _images(row, spec, "videos")
    return sample


def _images(row: dict[str, Any], spec: DatasetSpec, kind: str = "images") -> tuple[Any, ...]:
    """The row's ``images`` (or ``kind``) column entries (LLaMA-Factory's ``_find_medias``: a single entry counts as
    a list of one; none, null or [] is a text row). Only a column declared in dataset_info.json is read."""
    column = spec.columns.get(kind)
    value = row.get(column) if column else None
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _detect(row: dict[str, Any], where: str) -> str:
    def present(key: str) -> bool:
        return row.get(key) is not None

    if present("messages") or present("conversations"):
        msgs = row.get("messages") if present("messages") else row.get("conversations")
        first = msgs[0] if isinstance(msgs, list) and msgs else None
        return (
            "openai"
            if isinstance(first, dict) and first.get("role") is not None and first.get("from") is None
            else "sharegpt"
        )
    if present("instruction"):
        return "alpaca"
    if present("text"):
        return "text"
    raise DataError(
        f"{where}: cannot tell the format from keys {sorted(k for k in row if row[k] is not None)}: expected "
        f"instruction/output (alpaca), conversations or messages (sharegpt/OpenAI) or text; or describe the file "
        f"in dataset_info.json"
    )


def _get_str(row: dict[str, Any], column: str, where: str, *, required: bool) -> str:
    if column not in row or row[column] is None:
        if required:
            raise DataError(f"{where}: missing column {column!r}")
        return ""
    value = row[column]
    if not isinstance(value, str):
        raise DataError(f"{where}: column {column!r} must be a string, got {type(value).__name__}")
    return value


def _optional_column(spec: DatasetSpec, key: str) -> str | None:
    """The column of an optional key (system, tools, history): only when declared in dataset_info.json
    (LLaMA-Factory reads nothing else); for undeclared path datasets, the conventional name."""
    if key in spec.columns:
        return spec.columns[key]
    return None if spec.declared else key


def _text_sample(row: dict[str, Any], spec: DatasetSpec, formatting: str, where: str) -> Sample:
    column = spec.columns.get("prompt") or ("text" if formatting == "text" else "instruction")
    return Sample(text=_get_str(row, column, where, required=True))


def _alpaca_sample(row: dict[str, Any], spec: DatasetSpec, where: str, *, reply: bool = True) -> Sample:
    """LLaMA-Factory's ``AlpacaDatasetConverter``: history pairs, then ``prompt`` and ``query`` joined by a
    newline (empty ones left out), then ``response`` (not read without ``reply``)."""
    cols = dict(spec.columns) if spec.columns_given else {**_ALPACA_COLUMNS, **spec.columns}
    prompt = _get_str(row, cols["prompt"], where, required=True) if "prompt" in cols else ""
    query = _get_str(row, cols["query"], where, required=False) if "query" in cols else ""
    response = _get_str(row, cols["response"], where, required=True) if reply else ""
    turns: list[tuple[str, str]] = []
    history_col = _optional_column(spec, "history")
    history = row.get(history_col) if history_col else None
    if history:
        if not isinstance(history, list):
            raise DataError(f"{where}: column {history_col!r} must be a list of [prompt, response] pairs")
        for i, pair in enumerate(history, start=1):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
                raise DataError(f"{where}: {history_col}[{i}] must be a [prompt, response] pair of strings")
            turns += [(USER, pair[0]), (ASSISTANT, pair[1])]
    turns += [(USER, "\n".join(x for x in (prompt, query) if x))] + ([(ASSISTANT, response)] if reply else [])
    system_col = _optional_column(spec, "system")
    system = _get_str(row, system_col, where, required=False) if system_col else ""
    tools_col = _optional_column(spec, "tools")
    return Sample(turns=turns, system=system, tools=_tools(row, tools_col, where) if tools_col else "")


def _tools(row: dict[str, Any], column: str, where: str) -> str:
    value = row.get(column)
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    raise DataError(f"{where}: column {column!r} must be a string or JSON, got {type(value).__name__}")


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or an OpenAI content-part list whose text parts are joined (as chat
    templates render them); an image/audio/other part is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DataError(
                    f"{where}: content part {k} is {kind or type(part).__name__!r}, not text: ferry "
                    f"trains text only (image/audio parts are refused)"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise DataError(f"{where}: must be a string, got {type(value).__name__}")


def _messages(row: dict[str, Any], spec: DatasetSpec, where: str) -> tuple[str, list[Any]]:
    column = spec.columns.get("messages") or (
        "conversations" if spec.declared else ("messages" if row.get("messages") is not None else "conversations")
    )
    messages = row.get(column)
    if messages is None:
        raise DataError(f"{where}: missing column {column!r}")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: column {column!r} must be a non-empty list of messages")
    return column, messages


def _conversation(
    row: dict[str, Any], spec: DatasetSpec, where: str, default_tags: dict[str, str]
) -> tuple[str, list[Any], dict[str, str], dict[str, str], str]:
    """What the sharegpt and openai readers start from: the messages column and its list, the tags (the
    format's defaults under the dataset's ``tags``), the role map to ferry's roles, and the system column's text."""
    column, messages = _messages(row, spec, where)
    tags = {**default_tags, **spec.tags}
    role_map = {
        tags["user_tag"]: USER,
        tags["observation_tag"]: OBSERVATION,
        tags["assistant_tag"]: ASSISTANT,
        tags["function_tag"]: FUNCTION,
    }
    system_col = _optional_column(spec, "system")
    system = _get_str(row, system_col, where, required=False) if system_col else ""
    return column, messages, tags, role_map, system


def _finish(
    row: dict[str, Any], spec: DatasetSpec, turns: list[tuple[str, str]], system: str, where: str, complete: bool
) -> Sample:
    """The turns checked (user first, assistant last unless not ``complete``) and the row's tools column, as one
    :class:`Sample`."""
    if complete:
        _check_turns(turns, where)
    tools_col = _optional_column(spec, "tools")
    return Sample(turns=turns, system=system, tools=_tools(row, tools_col, where) if tools_col else "")


def _sharegpt_sample(row: dict[str, Any], spec: DatasetSpec, where: str, *, complete: bool = True) -> Sample:
    """LLaMA-Factory's ``SharegptDatasetConverter`` (roles checked: user/observation at odd positions,
    assistant/function at even ones; a system message first replaces the system column). A row LLaMA-Factory
    would skip with a warning is refused here, naming it."""
    column, messages, tags, role_map, system = _conversation(row, spec, where, _SHAREGPT_TAGS)
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: {column}[{i}] must be an object, got {type(msg).__name__}")
        if msg.get(role_tag) is None or content_tag not in msg:
            raise DataError(f"{where}: {column}[{i}] needs keys {role_tag!r} and {content_tag!r}")
        role = msg[role_tag]
        content = _content(msg[content_tag], f"{where}: {column}[{i}].{content_tag}")
        if i == 0 and role == tags["system_tag"]:
            system = content
            continue
        _append_turn(turns, role_map, role, content, where, f"{column}[{i}]")
    return _finish(row, spec, turns, system, where, complete)


def _append_turn(
    turns: list[tuple[str, str]], role_map: dict[str, str], role: Any, content: str, where: str, at: str
) -> None:
    if role not in role_map:
        raise DataError(f"{where}: {at}: unknown role {role!r} (expected one of {sorted(role_map)})")
    norm = role_map[role]
    expect_user = len(turns) % 2 == 0
    if expect_user != (norm in (USER, OBSERVATION)):
        wanted = "a user/observation" if expect_user else "an assistant/function"
        raise DataError(f"{where}: {at}: bad role order: {role!r} where {wanted} turn is expected")
    turns.append((norm, content))


def _check_turns(turns: list[tuple[str, str]], where: str) -> None:
    if not turns:
        raise DataError(f"{where}: conversation has no user/assistant turns")
    if len(turns) % 2:
        raise DataError(f"{where}: conversation must end with an assistant turn (it ends with {turns[-1][0]})")


def _openai_sample(row: dict[str, Any], spec: DatasetSpec, where: str, *, complete: bool = True) -> Sample:
    """LLaMA-Factory's ``OpenAIDatasetConverter``: an assistant message's ``tool_calls`` become a function turn
    (the JSON list of their ``function`` objects); consecutive tool messages become one observation joined by
    ``\n</tool_response>\n<tool_response>\n``."""
    column, messages, tags, role_map, system = _conversation(row, spec, where, _OPENAI_TAGS)
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    turns: list[tuple[str, str]] = []
    pending: list[str] = []
    for i, msg in enumerate(messages):
        at = f"{column}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(f"{where}: {at} must be an object, got {type(msg).__name__}")
        role = msg.get(role_tag)
        if role is None:
            raise DataError(f"{where}: {at} needs key {role_tag!r}")
        if i == 0 and role == tags["system_tag"]:
            system = _content(msg.get(content_tag), f"{where}: {at}.{content_tag}")
            continue
        if role in (tags["assistant_tag"], tags["function_tag"]) and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and "function" in c for c in calls):
                raise DataError(f"{where}: {at}.tool_calls must be a list of {{'function': ...}} objects")
            content, role = json.dumps([c["function"] for c in calls], ensure_ascii=False), tags["function_tag"]
        else:
            content = _content(msg.get(content_tag), f"{where}: {at}.{content_tag}")
        if role == tags["observation_tag"]:
            pending.append(content)
            continue
        if pending:
            _append_turn(
                turns,
                role_map,
                tags["observation_tag"],
                "\n</tool_response>\n<tool_response>\n".join(pending),
                where,
                at,
            )
            pending = []
        _append_turn(turns, role_map, role, content, where, at)
    return _finish(row, spec, turns, system, where, complete)


__all__ = [
    "DatasetSpec",
    "Sample",
    "resolve_datasets",
    "read_rows",
    "iter_rows",
    "load_samples",
    "conversation_sample",
    "message_tags",
    "sampling_rng",
    "read_dataset_info",
    "check_stage",
    "FILEEXT2TYPE",
    "USER",
    "ASSISTANT",
    "OBSERVATION",
    "FUNCTION",
]
