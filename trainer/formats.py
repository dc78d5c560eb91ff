"""Dataset files and formats, as LLaMA-Factory defines them (``data/README.md`` of hiyouga/LLaMA-Factory).

A dataset is named in the config either by a key of ``dataset_dir/dataset_info.json`` or by the path of a
``.json`` (a list of rows) or ``.jsonl`` (one row per line) file or of a folder of such files.
``dataset_info.json`` entries carry::

    "name": {
      "file_name": "data.json",                 # file or folder under dataset_dir
      "formatting": "alpaca" | "sharegpt",      # default alpaca
      "columns": {"prompt", "query", "response", "system", "history", "messages", "tools"},
      "tags": {"role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag",
               "function_tag", "system_tag"}     # sharegpt only
    }

Every row becomes one :class:`Sample`: a conversation (``system`` + alternating user/assistant turns) or a
plain ``text`` for pre-training. Formats:

- **alpaca**: ``instruction`` (+ ``"\\n" + input`` when non-empty) is the user turn, ``output`` the assistant
  turn; ``history`` is a list of ``[prompt, response]`` pairs before them; ``system`` optional.
- **sharegpt**: a list of ``{"from": "human"|"gpt"|"observation"|"function_call"|"system", "value": ...}``
  under ``conversations``; user/observation turns at odd positions, assistant/function turns at even ones.
- **OpenAI messages**: sharegpt with tags ``role``/``content`` and roles ``system``/``user``/``assistant``/
  ``tool`` under ``messages`` (detected automatically for files not listed in dataset_info.json).
- **plain text**: a dataset whose columns map only ``prompt`` (e.g. ``{"prompt": "text"}``, c4_demo), a file of
  ``{"text": ...}`` rows, or any alpaca dataset's prompt column when ``stage: pt``.

A malformed row (invalid JSON line, not an object, missing column, wrong type, bad role order) is a
:class:`ferry.errors.DataError` naming the file and the 1-based row number (the line number for ``.jsonl``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, DataError, NotInstalledError

#: Roles of a normalised conversation turn.
USER, ASSISTANT, OBSERVATION, FUNCTION = "user", "assistant", "observation", "function"

_SHAREGPT_TAGS = {
    "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system",
}
_OPENAI_TAGS = {
    "role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
    "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system",
}
_ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives and how to read its rows.

    Attributes:
        name: the name as written in the config.
        files: the data files (one, or every .json/.jsonl file of a folder, sorted).
        formatting: ``"alpaca"``, ``"sharegpt"``, ``"text"``, or ``"auto"`` (detected per file from its
            first row: ``messages``/``conversations`` -> sharegpt, ``instruction`` -> alpaca, ``text`` -> text).
        columns: LLaMA-Factory column mapping (only the keys given in dataset_info.json).
        tags: sharegpt tags (only the keys given; the rest default per detected style).
    """

    name: str
    files: tuple[Path, ...]
    formatting: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """Plain-type description (part of the tokenisation cache key)."""
        return {"name": self.name, "formatting": self.formatting, "columns": dict(sorted(self.columns.items())),
                "tags": dict(sorted(self.tags.items())), "files": [str(f) for f in self.files]}


@dataclass
class Sample:
    """One normalised row.

    Either ``text`` is set (plain text, every token trained) or ``turns`` holds ``(role, content)`` pairs in
    order, roles alternating ``user``/``observation`` then ``assistant``/``function``, ending with an
    assistant/function turn. ``system`` is the system prompt ("" when none); ``tools`` a tool description;
    ``origin`` is ``"FILE: row N"`` for error messages.
    """

    turns: list[tuple[str, str]] = field(default_factory=list)
    system: str = ""
    tools: str = ""
    text: str | None = None
    origin: str = ""


# ---------------------------------------------------------------------- resolving names


def resolve_datasets(names: list[str], dataset_dir: str | os.PathLike) -> list[DatasetSpec]:
    """Turn the config's dataset names into :class:`DatasetSpec` objects.

    A name is looked up in ``dataset_dir/dataset_info.json`` first, then as a path (absolute, relative to
    the working directory, or relative to ``dataset_dir``).

    Raises:
        NotInstalledError: the name is neither listed nor an existing file, or its file is missing, or the
            entry points at a hub dataset (``hf_hub_url``/``ms_hub_url``) with no local file.
        ConfigError: dataset_info.json is not valid JSON, or an entry is malformed.
    """
    root = Path(dataset_dir)
    info_path = root / "dataset_info.json"
    info: dict[str, Any] = {}
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{info_path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(info, dict):
            raise ConfigError(f"{info_path}: expected an object mapping dataset names to descriptions")
    specs = []
    for name in names:
        if name in info:
            specs.append(_spec_from_info(name, info[name], root, info_path))
            continue
        for candidate in (Path(name).expanduser(), root / name):
            if candidate.exists():
                specs.append(DatasetSpec(name=name, files=_data_files(candidate, name)))
                break
        else:
            listed = f" (dataset_info.json lists: {', '.join(sorted(info))})" if info else ""
            raise NotInstalledError(
                f"dataset {name!r} is neither in {info_path} nor a file{listed}: add it to the datasets of your "
                f"ferry pack spec and install the bundle, or give the path of a .json/.jsonl file"
            )
    return specs


def _spec_from_info(name: str, entry: Any, root: Path, info_path: Path) -> DatasetSpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{info_path}: entry {name!r} must be an object")
    if entry.get("ranking"):
        raise ConfigError(f"{info_path}: dataset {name!r} is a preference (ranking) dataset; ferry trains SFT/PT")
    file_name = entry.get("file_name")
    if not file_name:
        hub = entry.get("hf_hub_url") or entry.get("ms_hub_url") or entry.get("script_url")
        raise NotInstalledError(
            f"dataset {name!r} ({info_path}) has no local file_name"
            + (f" (it points at {hub!r})" if hub else "")
            + ": add the dataset to your ferry pack spec so that it is installed under dataset_dir"
        )
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"{info_path}: dataset {name!r}: formatting must be alpaca or sharegpt, got {formatting!r}")
    columns = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if not isinstance(columns, dict) or not isinstance(tags, dict):
        raise ConfigError(f"{info_path}: dataset {name!r}: columns and tags must be objects")
    if formatting == "alpaca" and set(columns) == {"prompt"}:
        formatting = "text"
    path = root / file_name
    if not path.exists():
        raise NotInstalledError(
            f"dataset {name!r}: file {path} is missing: add it to your ferry pack spec and install the bundle"
        )
    return DatasetSpec(name=name, files=_data_files(path, name), formatting=formatting,
                       columns={str(k): str(v) for k, v in columns.items()},
                       tags={str(k): str(v) for k, v in tags.items()})


def _data_files(path: Path, name: str) -> tuple[Path, ...]:
    if path.is_dir():
        files = tuple(sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _SUFFIXES))
        if not files:
            raise NotInstalledError(f"dataset {name!r}: folder {path} holds no .json or .jsonl file")
        return tuple(f.resolve() for f in files)
    if path.suffix not in _SUFFIXES:
        raise ConfigError(f"dataset {name!r}: {path} is not a .json or .jsonl file")
    return (path.resolve(),)


# ---------------------------------------------------------------------- reading rows


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, row)`` from a ``.json`` list (row number = 1-based index) or a ``.jsonl`` file
    (row number = 1-based line number; blank lines are skipped).

    Raises:
        DataError: invalid JSON (naming the file and line), or a .json file that is not a list.
    """
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: row {lineno}: invalid JSON line: {exc.msg}") from None
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    yield from enumerate(rows, start=1)


def load_samples(spec: DatasetSpec, *, stage: str, max_samples: int | None = None) -> Iterator[Sample]:
    """Yield the normalised samples of a dataset, at most ``max_samples`` (the first ones in file order).

    Raises:
        DataError: a malformed row (the message names the file and the row number).
        ConfigError: a sharegpt dataset with ``stage: pt`` (LLaMA-Factory: incompatible).
    """
    count = 0
    for path in spec.files:
        formatting = spec.formatting
        for rowno, row in read_rows(path):
            if max_samples is not None and count >= max_samples:
                return
            where = f"{path}: row {rowno}"
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if formatting == "auto":
                formatting = _detect(row, where)
            if stage == "pt" and formatting == "sharegpt":
                raise ConfigError(f"dataset {spec.name!r}: sharegpt data cannot be used with stage: pt")
            if formatting == "text" or stage == "pt":
                sample = _text_sample(row, spec, formatting, where)
            elif formatting == "alpaca":
                sample = _alpaca_sample(row, spec, where)
            else:
                sample = _sharegpt_sample(row, spec, where)
            sample.origin = where
            yield sample
            count += 1


def _detect(row: dict[str, Any], where: str) -> str:
    if "messages" in row or "conversations" in row:
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    raise DataError(
        f"{where}: cannot tell the format from keys {sorted(row)}: expected instruction/output (alpaca), "
        f"conversations or messages (sharegpt/OpenAI) or text; or describe the file in dataset_info.json"
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


def _text_sample(row: dict[str, Any], spec: DatasetSpec, formatting: str, where: str) -> Sample:
    column = spec.columns.get("prompt") or ("text" if formatting == "text" else "instruction")
    return Sample(text=_get_str(row, column, where, required=True))


def _alpaca_sample(row: dict[str, Any], spec: DatasetSpec, where: str) -> Sample:
    cols = {**_ALPACA_COLUMNS, **spec.columns}
    prompt = _get_str(row, cols["prompt"], where, required=True)
    query = _get_str(row, cols["query"], where, required=False)
    response = _get_str(row, cols["response"], where, required=True)
    turns: list[tuple[str, str]] = []
    history_col = cols.get("history", "history")
    history = row.get(history_col)
    if history:
        if not isinstance(history, list):
            raise DataError(f"{where}: column {history_col!r} must be a list of [prompt, response] pairs")
        for i, pair in enumerate(history, start=1):
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                    or not all(isinstance(x, str) for x in pair)):
                raise DataError(f"{where}: {history_col}[{i}] must be a [prompt, response] pair of strings")
            turns += [(USER, pair[0]), (ASSISTANT, pair[1])]
    turns += [(USER, f"{prompt}\n{query}" if query else prompt), (ASSISTANT, response)]
    system = _get_str(row, cols.get("system", "system"), where, required=False)
    tools = _tools(row, cols.get("tools", "tools"), where)
    return Sample(turns=turns, system=system, tools=tools)


def _tools(row: dict[str, Any], column: str, where: str) -> str:
    value = row.get(column)
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    raise DataError(f"{where}: column {column!r} must be a string or JSON, got {type(value).__name__}")


def _sharegpt_sample(row: dict[str, Any], spec: DatasetSpec, where: str) -> Sample:
    column = spec.columns.get("messages") or ("messages" if "messages" in row else "conversations")
    messages = row.get(column)
    if messages is None:
        raise DataError(f"{where}: missing column {column!r}")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: column {column!r} must be a non-empty list of messages")
    first = messages[0]
    style = _OPENAI_TAGS if isinstance(first, dict) and "role" in first and "from" not in first else _SHAREGPT_TAGS
    tags = {**style, **spec.tags}
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    role_map = {tags["user_tag"]: USER, tags["observation_tag"]: OBSERVATION,
                tags["assistant_tag"]: ASSISTANT, tags["function_tag"]: FUNCTION}
    system = _get_str(row, spec.columns.get("system", "system"), where, required=False)
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: {column}[{i}] must be an object, got {type(msg).__name__}")
        if role_tag not in msg or content_tag not in msg:
            raise DataError(f"{where}: {column}[{i}] needs keys {role_tag!r} and {content_tag!r}")
        role, content = msg[role_tag], msg[content_tag]
        if not isinstance(content, str):
            raise DataError(f"{where}: {column}[{i}].{content_tag} must be a string, got {type(content).__name__}")
        if i == 0 and role == tags["system_tag"]:
            system = content
            continue
        if role not in role_map:
            raise DataError(f"{where}: {column}[{i}]: unknown role {role!r} (expected one of {sorted(role_map)})")
        norm = role_map[role]
        expect_user = len(turns) % 2 == 0
        if expect_user != (norm in (USER, OBSERVATION)):
            wanted = "a user/observation" if expect_user else "an assistant/function"
            raise DataError(f"{where}: {column}[{i}]: bad role order: {role!r} where {wanted} turn is expected")
        turns.append((norm, content))
    if not turns:
        raise DataError(f"{where}: conversation has no user/assistant turns")
    if len(turns) % 2:
        raise DataError(f"{where}: conversation must end with an assistant turn (it ends with {turns[-1][0]})")
    tools = _tools(row, spec.columns.get("tools", "tools"), where)
    return Sample(turns=turns, system=system, tools=tools)


__all__ = ["DatasetSpec", "Sample", "resolve_datasets", "read_rows", "load_samples",
           "USER", "ASSISTANT", "OBSERVATION", "FUNCTION"]
