"""Merging an adapter that grew the vocabulary (``resize_vocab`` / ``add_special_tokens``, see trainer/vocab.py).

Such an adapter carries either the whole input embeddings and output head as peft ``modules_to_save``, with
more rows than the base stores (``[rows, hidden]`` against the base's ``[vocab_size, hidden]``; a tied base), or
only their new rows as peft ``trainable_token_indices`` (``trainable_tokens_delta`` ``[len(indices), hidden]``
per module, the indices in adapter_config.json; an untied base); plus its tokenizer with the new tokens and
``ferry_vocab.json`` (the added tokens and their ids, the base's and the new number of rows). The export then
writes:

* ``embed_tokens`` and ``lm_head`` at their grown shape: the adapter's copies (a tied base comes out untied: the
  two copies were trained apart, as LLaMA-Factory trains them), or the base's rows with the trained rows put in
  (peft's ``index_copy``);
* ``vocab_size`` = the grown rows in config.json (and in its ``text_config``);
* the adapter's tokenizer files instead of the base's (they hold the new tokens; the chat template training used
  comes with them), checked: every added token is one id below ``vocab_size``;
* ``generation_config.json`` with the tokenizer's EOS among its ``eos_token_id`` when the template made a new
  token the EOS (``<|im_end|>`` for qwen templates), so that generation stops at the end of a turn.

An adapter that grows only one of the embeddings and the head (or two of them to different sizes) is refused:
the merged model could not compute what base + adapter computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exporter.io import TensorInfo, copy_tokenizer_files
from ferry.adapter_folder import VOCAB_RECORD, read_vocab_record
from ferry.errors import ExportError


@dataclass(frozen=True)
class GrownVocab:
    """The base's and the merged model's embedding rows, and the stored keys that grow."""

    base_rows: int
    rows: int
    keys: tuple[str, ...]


def grows_vocab(key: str, tensor: torch.Tensor, info: TensorInfo, embedding_keys: tuple[str | None, ...]) -> bool:
    """Whether adapter tensor ``tensor`` replacing stored ``key`` is a grown embedding or head: same width, more
    rows."""
    return (
        key in embedding_keys
        and tensor.ndim == 2
        and len(info.shape) == 2
        and tensor.shape[1] == info.shape[1]
        and tensor.shape[0] > info.shape[0]
    )


def grown_rows(
    ad: Any,
    copies: dict[str, torch.Tensor],
    infos: dict[str, TensorInfo],
    in_key: str | None,
    out_key: str | None,
    tied: bool,
    stored: dict[str, TensorInfo],
) -> GrownVocab | None:
    """The :class:`GrownVocab` of an adapter whose ``modules_to_save`` tensors (``copies``, by stored key) grow the
    vocabulary, else None.

    Raises:
        ExportError: only one of the input embeddings and the output head grows, or they grow to different sizes.
    """
    grown = {k: int(t.shape[0]) for k, t in copies.items() if k in infos and int(t.shape[0]) != infos[k].shape[0]}
    if not grown:
        return None
    heads = [k for k in (in_key, out_key) if k is not None and (k in stored or tied)]
    missing = [k for k in dict.fromkeys(heads) if k not in grown]
    if missing or len(set(grown.values())) != 1:
        what = ", ".join(f"{k} to {n} rows" for k, n in grown.items())
        raise ExportError(
            f"{ad.weights_file}: the adapter grows {what} but not {', '.join(missing) or 'both alike'}: "
            f"the input embeddings and the output head must grow together (resize_vocab)"
        )
    rows = next(iter(grown.values()))
    return GrownVocab(base_rows=infos[next(iter(grown))].shape[0], rows=rows, keys=tuple(grown))


def token_rows_plan(
    ad: Any, stored: Any, infos: dict[str, TensorInfo], in_key: str | None, out_key: str | None, tied: bool
) -> tuple[dict[str, tuple[list[int], torch.Tensor]], GrownVocab | None]:
    """The rows peft's ``trainable_token_indices`` trained (``ad.token_rows``), by stored key, and the
    :class:`GrownVocab` when their indices reach past the stored rows (the rows from ``ferry_vocab.json``, else the
    largest index + 1).

    Raises:
        ExportError: a module with trained rows has no stored weight or another width; the grown rows are not all
            trained (their values would be unknown); an untied model grows only one of embeddings and head; a tied
            model's head holds rows of its own.
    """
    by_key: dict[str, tuple[list[int], torch.Tensor]] = {}
    for name, (indices, delta) in ad.token_rows.items():
        key = stored(name + ".weight")
        if key is None or key not in infos or len(infos[key].shape) != 2 or infos[key].shape[1] != delta.shape[1]:
            raise ExportError(f"{ad.weights_file}: trainable tokens of {name!r} fit no stored weight of the base")
        if tied and key == out_key and key not in (in_key,) and in_key is not None:
            raise ExportError(
                f"{ad.weights_file}: the tied head {name!r} holds trainable tokens of its own; the "
                f"export cannot keep it tied"
            )
        by_key[key] = (indices, delta)
    if not by_key:
        return {}, None
    base_rows = max(infos[k].shape[0] for k in by_key)
    record = read_vocab_record(ad.folder) or {}
    rows = int(record.get("rows") or max(base_rows, max(max(i) + 1 for i, _ in by_key.values())))
    if rows <= base_rows:
        return by_key, None
    heads = [k for k in (in_key, out_key) if k is not None and k in infos and not (tied and k == out_key)]
    for key in heads:
        if key not in by_key or not set(range(base_rows, rows)) <= set(by_key[key][0]):
            raise ExportError(
                f"{ad.weights_file}: the adapter grows the vocabulary to {rows} rows but does not train "
                f"every new row of {key}: the input embeddings and the output head must grow together "
                f"(resize_vocab)"
            )
    return by_key, GrownVocab(base_rows=base_rows, rows=rows, keys=tuple(by_key))


def apply_token_rows(weight: torch.Tensor, indices: list[int], delta: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ``[stored rows, hidden]`` grown to ``rows`` and with rows ``indices`` replaced by ``delta``
    (peft ``TrainableTokensLayer.merge``: ``index_copy``), float32 ``[rows, hidden]``."""
    out = torch.empty((max(rows, weight.shape[0]), weight.shape[1]), dtype=torch.float32)
    out[: weight.shape[0]] = weight.float()
    return out.index_copy_(0, torch.tensor(indices, dtype=torch.int64), delta.float())


def set_vocab_size(config: dict[str, Any], rows: int) -> None:
    """``vocab_size`` = ``rows`` in a config.json dict, and in its ``text_config`` when that states one."""
    if "vocab_size" in config or not isinstance(config.get("text_config"), dict):
        config["vocab_size"] = rows
    if isinstance(config.get("text_config"), dict) and "vocab_size" in config["text_config"]:
        config["text_config"] = {**config["text_config"], "vocab_size": rows}


def export_grown_tokenizer(adapter_dir: Path, dest: Path, base_dir: Path, grown: GrownVocab | None) -> dict[str, Any]:
    """Write the adapter's tokenizer (with the new tokens) into ``dest``, check it against the vocabulary record and
    the rows, and add its EOS to ``generation_config.json``. Returns what ``ferry_export.json`` records under
    ``vocab``: the added tokens with their ids, the base's and the merged model's rows.

    Raises:
        ExportError: the adapter folder has no tokenizer, or an added token is not one id below the rows.
    """
    from transformers import AutoTokenizer

    if not copy_tokenizer_files([adapter_dir], dest):
        raise ExportError(
            f"{adapter_dir} holds no tokenizer files, but its adapter adds tokens to the vocabulary: "
            f"export the run's final adapter folder (it carries the tokenizer)"
        )
    record = read_vocab_record(adapter_dir) or {}
    tokenizer = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    base_rows = (
        grown.base_rows
        if grown is not None
        else int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    )
    rows = grown.rows if grown is not None else base_rows
    if record.get("rows") not in (None, rows):
        raise ExportError(
            f"{adapter_dir / VOCAB_RECORD} says {record['rows']} embedding rows, the adapter's weights have {rows}"
        )
    added = {str(k): int(v) for k, v in (record.get("added") or {}).items()}
    for token, want in added.items():
        ids = tokenizer.convert_tokens_to_ids([token])
        if ids != [want] or not 0 <= want < rows:
            raise ExportError(
                f"{adapter_dir}: added token {token!r} is id {ids} in the adapter's tokenizer, "
                f"{VOCAB_RECORD} says {want} (rows: {rows})"
            )
    if len(tokenizer) > rows:
        raise ExportError(
            f"{adapter_dir}: the tokenizer has {len(tokenizer)} tokens but the model {rows} embedding rows"
        )
    generation = dest / "generation_config.json"
    eos = tokenizer.eos_token_id
    if generation.is_file() and isinstance(eos, int) and eos in added.values():
        gen = json.loads(generation.read_text(encoding="utf-8"))
        have = gen.get("eos_token_id")
        ids = [have] if isinstance(have, int) else list(have or [])
        if eos not in ids:
            gen["eos_token_id"] = [*ids, eos] if ids else eos
            generation.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    return {"added": added, "base_rows": base_rows, "rows": rows}


__all__ = [
    "GrownVocab",
    "apply_token_rows",
    "export_grown_tokenizer",
    "grown_rows",
    "grows_vocab",
    "set_vocab_size",
    "token_rows_plan",
]
