"""Preference data: LLaMA-Factory's ranking and KTO datasets, read and tokenised as its 0.9.5 ``stage: dpo|rm``
and ``stage: kto`` read and tokenise them (``data/converter.py``, ``data/processor/pairwise.py`` and
``feedback.py``).

Two kinds of rows, each taken by its own stages (:func:`trainer.formats.check_stage`)::

    ranking (stage dpo, rm)   "ranking": true, columns chosen / rejected
        alpaca     prompt/query/system/history columns; chosen and rejected are strings
        sharegpt   the conversation ends with a user (or observation) turn; chosen and rejected are messages
        openai       ({"from": "gpt", "value": ...} or the dataset's tags), assistant or function_call role
    feedback (stage kto)      columns.kto_tag names a JSON boolean column: true = desirable reply
        alpaca / sharegpt / openai rows as for sft; the last reply is the one judged

Tokenised, with a built-in template (:class:`trainer.templates.Template`, its special tokens already set on the
tokenizer by :func:`trainer.data.load_tokenizer`)::

    pair      prompt ──encode_oneturn──> prompt_ids; chosen_ids, rejected_ids (+ EOS for efficient_eos)
              infer_seqlen(len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), cutoff_len) cuts all three
              chosen_input_ids = prompt + chosen,     chosen_labels   = -100 over the prompt, then chosen
              rejected_input_ids = prompt + rejected, rejected_labels = -100 over the prompt, then rejected
    feedback  input_ids / labels from the row's prompt and reply, each pair cut by infer_seqlen on its own;
              kl_input_ids / kl_labels from the same prompt with the reply of the row before it (the first
              row of each preprocessing batch takes the batch's last reply); kto_tags = the boolean

What LLaMA-Factory drops with a warning or trains silently wrong, ferry refuses with a
:class:`ferry.errors.DataError` naming the file and the 1-based row: a missing or empty chosen / rejected reply, a
reply with a user role, a prompt that does not end with a user turn, an empty prompt, a pair whose chosen equals
its rejected (its DPO gradient is zero: the pair only dilutes the batch), a ``kto_tag`` that is not a JSON
boolean (LLaMA-Factory drops such rows) and an empty KTO reply (LLaMA-Factory tells desirable from undesirable
by whether the reply is empty, so it would flip the label).

One difference is kept on purpose, as in ferry's sft reader: LLaMA-Factory 0.9.5's openai converter appends
``"\ndetailed thinking off"`` to the system prompt of every row without tools (one model family's switch); ferry
reads the system prompt as written.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ferry.errors import DataError
from ferry.stages import PREFERENCE_STAGES
from trainer.formats import (
    ASSISTANT,
    FUNCTION,
    OBSERVATION,
    USER,
    DatasetSpec,
    Sample,
    conversation_sample,
    iter_rows,
    message_tags,
    read_rows,
    resolve_datasets,
    sampling_rng,
)
from trainer.loss import IGNORE_INDEX
from trainer.templates.render import infer_seqlen

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.templates import Template
    from trainer.vision import ImageRows

logger = logging.getLogger("ferry.trainer.preference_data")

#: The preference stages: ``dpo`` and ``rm`` read ranking pairs, ``kto`` feedback rows.
PreferenceStage = Literal["dpo", "kto", "rm"]

#: LLaMA-Factory's ``preprocessing_batch_size`` default: the KL replies of stage kto rotate within such batches.
DEFAULT_BATCH_SIZE = 1000


@dataclass
class PairSample:
    """One ranking row: ``prompt`` (a :class:`~trainer.formats.Sample` whose turns end with a user or
    observation turn; its system, tools and origin) and the two replies as ``(role, text)``, role assistant or
    function."""

    prompt: Sample
    chosen: tuple[str, str]
    rejected: tuple[str, str]


@dataclass
class FeedbackSample:
    """One KTO row: ``sample`` (a complete conversation; its last turn is the judged reply) and ``desirable``."""

    sample: Sample
    desirable: bool


# ---------------------------------------------------------------------- reading


def _check_prompt(turns: list[tuple[str, str]], where: str) -> None:
    if not turns or turns[-1][0] not in (USER, OBSERVATION):
        raise DataError(f"{where}: the conversation before chosen/rejected must end with a user turn")
    if not turns[-1][1].strip():
        raise DataError(f"{where}: empty prompt: the last user turn has no text")


def _reply(row: dict[str, Any], spec: DatasetSpec, key: str, where: str, formatting: str) -> tuple[str, str]:
    """The ``chosen`` or ``rejected`` reply of a ranking row as ``(role, text)``."""
    column = spec.columns[key]
    value = row.get(column)
    if value is None:
        raise DataError(f"{where}: no {key} reply (column {column!r}, columns.{key}): a ranking row needs both")
    if formatting == "alpaca":
        if not isinstance(value, str):
            raise DataError(f"{where}: column {column!r} (columns.{key}) must be a string, got {type(value).__name__}")
        role, text = ASSISTANT, value
    else:
        tags = message_tags(spec, formatting)
        role_tag, content_tag = tags["role_tag"], tags["content_tag"]
        if not isinstance(value, dict) or not isinstance(value.get(content_tag), str):
            raise DataError(
                f"{where}: column {column!r} (columns.{key}) must be a message "
                f"{{{role_tag!r}: ..., {content_tag!r}: <text>}}"
            )
        roles = {tags["assistant_tag"]: ASSISTANT, tags["function_tag"]: FUNCTION}
        if value.get(role_tag) not in roles:
            raise DataError(
                f"{where}: column {column!r} (columns.{key}): role {value.get(role_tag)!r} is not a reply role "
                f"({' or '.join(repr(r) for r in roles)})"
            )
        role, text = roles[value[role_tag]], value[content_tag]
    if not text.strip():
        raise DataError(f"{where}: the {key} reply (column {column!r}) is empty")
    return role, text


def read_pair(row: dict[str, Any], spec: DatasetSpec, where: str, formatting: str) -> PairSample:
    """A ranking row as LLaMA-Factory's converters read it (``formatting`` alpaca, sharegpt or openai).

    Raises:
        DataError: see the module docstring (the message starts with ``where``).
    """
    prompt = conversation_sample(row, spec, where, formatting, complete=False)
    _check_prompt(prompt.turns, where)
    chosen = _reply(row, spec, "chosen", where, formatting)
    rejected = _reply(row, spec, "rejected", where, formatting)
    if chosen == rejected:
        raise DataError(
            f"{where}: chosen and rejected are the same reply (columns {spec.columns['chosen']!r} and "
            f"{spec.columns['rejected']!r}): such a pair teaches nothing; fix or drop the row"
        )
    return PairSample(prompt=prompt, chosen=chosen, rejected=rejected)


def _kto_tag_error(where: str, column: str, tag: Any) -> DataError:
    got = "nothing" if tag is None else f"{type(tag).__name__} {tag!r}"
    return DataError(
        f"{where}: column {column!r} (columns.kto_tag) must be a JSON boolean, true (desirable) or false "
        f"(undesirable), got {got}"
    )


def check_json_kto_tags(spec: DatasetSpec) -> None:
    """Every row of a KTO dataset's JSON files must hold a JSON boolean in the ``kto_tag`` column, as written:
    the ``datasets`` library reads a column of mixed JSON types as JSON values and decodes strings that are JSON
    (``"true"`` among booleans comes back as True), so the decoded rows cannot tell.

    Raises:
        DataError: the first row whose tag is not a boolean, naming file, row and column.
    """
    column = spec.columns.get("kto_tag")
    if spec.layout != "json" or not column:
        return
    for file in spec.files:
        for rowno, row in read_rows(file):
            if isinstance(row, dict) and not isinstance(row.get(column), bool):
                raise _kto_tag_error(f"{file}: row {rowno}", column, row.get(column))


def read_feedback(row: dict[str, Any], spec: DatasetSpec, where: str, formatting: str) -> FeedbackSample:
    """A KTO row: the conversation as for sft and its ``kto_tag`` boolean (JSON files: see
    :func:`check_json_kto_tags`, which :func:`load_preference_samples` runs first).

    Raises:
        DataError: see the module docstring (the message starts with ``where``).
    """
    column = spec.columns["kto_tag"]
    tag = row.get(column)
    if not isinstance(tag, bool):
        raise _kto_tag_error(where, column, tag)
    sample = conversation_sample(row, spec, where, formatting)
    _check_prompt(sample.turns[:-1], where)
    if not sample.turns[-1][1].strip():
        raise DataError(f"{where}: the judged reply (the last turn) is empty")
    return FeedbackSample(sample=sample, desirable=tag)


def load_preference_samples(
    spec: DatasetSpec, stage: PreferenceStage, *, max_samples: int | None = None, seed: int = 42, rng: Any = None
) -> Iterator[PairSample | FeedbackSample]:
    """The rows of a dataset resolved for ``stage`` (:func:`trainer.formats.resolve_datasets` with that stage):
    :class:`PairSample` for dpo and rm, :class:`FeedbackSample` for kto; rows picked as for sft
    (:func:`trainer.formats.iter_rows`: ``num_samples`` from ``rng``, then ``max_samples``).

    Raises:
        DataError: a malformed row (file and row in the message); ConfigError: plain-text data.
    """
    if stage == "kto":
        check_json_kto_tags(spec)
    for where, row, formatting in iter_rows(spec, max_samples=max_samples, seed=seed, rng=rng):
        if formatting == "text":
            raise DataError(f"{where}: stage {stage} needs conversations, not plain text")
        yield read_feedback(row, spec, where, formatting) if stage == "kto" else read_pair(row, spec, where, formatting)


# ---------------------------------------------------------------------- encoding


def _messages(turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


def _oneturn(
    template: Template, tokenizer: PreTrainedTokenizerBase, prompt: Sample, reply: tuple[str, str]
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, reply_ids)`` of ``prompt`` followed by ``reply`` (LLaMA-Factory's ``encode_oneturn``; one EOS
    appended to the reply with an efficient_eos template).

    Raises:
        DataError: the template cannot render the row (bad tool JSON, ...), naming it.
    """
    try:
        prompt_ids, reply_ids = template.encode_oneturn(
            tokenizer, _messages([*prompt.turns, reply]), prompt.system, prompt.tools or None
        )
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{prompt.origin}: template {template.name!r} cannot render this row: {exc}") from None
    if template.efficient_eos:
        reply_ids = [*reply_ids, tokenizer.eos_token_id]
    return list(prompt_ids), list(reply_ids)


def encode_pair(
    pair: PairSample, template: Template, tokenizer: PreTrainedTokenizerBase, cutoff_len: int
) -> dict[str, list[int]]:
    """LLaMA-Factory's ``PairwiseDatasetProcessor`` for one row: ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (the prompt, taken from the chosen rendering, masked with
    -100; prompt and both replies cut to ``cutoff_len`` by :func:`trainer.templates.render.infer_seqlen` with the longer
    reply's length)."""
    return _encode_pair(pair, template, tokenizer, cutoff_len)[0]


def _encode_pair(
    pair: PairSample, template: Template, tokenizer: PreTrainedTokenizerBase, cutoff_len: int
) -> tuple[dict[str, list[int]], bool]:
    """:func:`encode_pair` and whether the cut removed any token (of the prompt or either reply)."""
    prompt_ids, chosen_ids = _oneturn(template, tokenizer, pair.prompt, pair.chosen)
    _, rejected_ids = _oneturn(template, tokenizer, pair.prompt, pair.rejected)
    longer = max(len(chosen_ids), len(rejected_ids))
    source_len, target_len = infer_seqlen(len(prompt_ids), longer, cutoff_len)
    truncated = source_len < len(prompt_ids) or target_len < longer
    prompt_ids, masked = prompt_ids[:source_len], [IGNORE_INDEX] * source_len
    chosen_ids, rejected_ids = chosen_ids[:target_len], rejected_ids[:target_len]
    encoded = {
        "chosen_input_ids": prompt_ids + chosen_ids,
        "chosen_labels": masked + chosen_ids,
        "rejected_input_ids": prompt_ids + rejected_ids,
        "rejected_labels": masked + rejected_ids,
    }
    return encoded, truncated


def _cut(prompt_ids: list[int], reply_ids: list[int], cutoff_len: int) -> tuple[list[int], list[int]]:
    source_len, target_len = infer_seqlen(len(prompt_ids), len(reply_ids), cutoff_len)
    return prompt_ids[:source_len] + reply_ids[:target_len], [IGNORE_INDEX] * source_len + reply_ids[:target_len]


def kl_partners(n: int, batch_size: int = DEFAULT_BATCH_SIZE, num_workers: int | None = None) -> list[int]:
    """For each of ``n`` rows in processing order, the row whose reply makes its KL completion: LLaMA-Factory's
    ``FeedbackDatasetProcessor`` rotates the replies of each ``datasets.map`` batch by one (row ``i`` takes row
    ``i - 1``'s reply, the batch's first row its last). The batches are ``batch_size`` rows
    (``preprocessing_batch_size``) of each worker's shard: with ``preprocessing_num_workers`` > 1, ``datasets``
    first cuts the rows into that many contiguous shards (the first ``n % workers`` one row longer; at most
    ``n`` shards)."""
    workers = min(num_workers or 1, n) if n else 1
    bounds, start = [], 0
    for w in range(workers):
        size = n // workers + (1 if w < n % workers else 0)
        bounds += [(b, min(b + batch_size, start + size)) for b in range(start, start + size, batch_size)]
        start += size
    partners = []
    for first, end in bounds:
        partners += [end - 1] + list(range(first, end - 1))
    return partners


def encode_feedback(
    rows: Sequence[FeedbackSample],
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_workers: int | None = None,
) -> list[dict[str, Any]]:
    """LLaMA-Factory's ``FeedbackDatasetProcessor`` over ``rows`` in processing order: per row ``input_ids``,
    ``labels``, ``kl_input_ids``, ``kl_labels`` (the row's prompt with its :func:`kl_partners` row's reply) and
    ``kto_tags``; each prompt/reply pair cut to ``cutoff_len`` by :func:`trainer.templates.render.infer_seqlen`."""
    out = []
    for row, partner in zip(rows, kl_partners(len(rows), batch_size, num_workers)):
        sample = row.sample
        prompt = Sample(turns=sample.turns[:-1], system=sample.system, tools=sample.tools, origin=sample.origin)
        input_ids, labels = _cut(*_oneturn(template, tokenizer, prompt, sample.turns[-1]), cutoff_len)
        kl_reply = rows[partner].sample.turns[-1]
        kl_input_ids, kl_labels = _cut(*_oneturn(template, tokenizer, prompt, kl_reply), cutoff_len)
        out.append(
            {
                "input_ids": input_ids,
                "labels": labels,
                "kl_input_ids": kl_input_ids,
                "kl_labels": kl_labels,
                "kto_tags": row.desirable,
            }
        )
    if rows and len({r.desirable for r in rows}) == 1:
        logger.warning("the KTO data holds only %s replies", "desirable" if rows[0].desirable else "undesirable")
    return out


def preference_examples(
    names: list[str],
    dataset_dir: str,
    stage: PreferenceStage,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cutoff_len: int,
    max_samples: int | None = None,
    seed: int = 42,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_workers: int | None = None,
) -> list[dict[str, Any]]:
    """The tokenised examples of the datasets ``names`` (in ``dataset_dir``) for ``stage``, in LLaMA-Factory's
    order (the datasets one after the other, as its ``concat`` mix): pairs for dpo/rm (:func:`encode_pair`),
    feedback rows for kto (:func:`encode_feedback`, KL replies paired over the whole list).

    Raises:
        NotInstalledError, ConfigError: as :func:`trainer.formats.resolve_datasets` (a dataset that does not
            suit ``stage`` included); DataError: a malformed row, naming the file and row.
    """
    rng = sampling_rng(seed)
    samples = [
        s
        for spec in resolve_datasets(names, dataset_dir, stage)
        for s in load_preference_samples(spec, stage, max_samples=max_samples, rng=rng)
    ]
    if stage == "kto":
        rows = [s for s in samples if isinstance(s, FeedbackSample)]
        return encode_feedback(rows, template, tokenizer, cutoff_len, batch_size=batch_size, num_workers=num_workers)
    return [encode_pair(s, template, tokenizer, cutoff_len) for s in samples if isinstance(s, PairSample)]


def pair_examples(
    specs: Sequence[DatasetSpec],
    stage: PreferenceStage,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cutoff_len: int,
    max_samples: int | None,
    rng: Any,
    counts: dict[str, int] | None = None,
    image_rows: ImageRows | None = None,
) -> list[list[dict[str, Any]]]:
    """The ranking pairs of ``specs`` (stage dpo or rm) as the trainer stores them: one ``[chosen, rejected]`` list
    per pair, each an example dict (``input_ids``, ``labels``, ``position_ids``; :func:`encode_pair`), so that a
    ``val_size`` split keeps a pair together and the store holds pair ``i`` at rows ``2i`` and ``2i + 1``.
    ``counts["num_truncated"]``, when given, gains one per pair that ``cutoff_len`` cut.

    ``image_rows`` (:mod:`trainer.vision`): the prompt's ``<image>`` placeholders are expanded as LLaMA-Factory's
    Qwen-VL plugin expands them, both rows keep the pair's ``images``, and a pair whose cut goes through an image is
    dropped (``counts["num_dropped_image_cut"]``).

    Raises:
        DataError, ConfigError: as :func:`load_preference_samples`; an image row's placeholders or files
            (:meth:`trainer.vision.ImageRows.expand`).
    """
    out = []
    for spec in specs:
        for sample in load_preference_samples(spec, stage, max_samples=max_samples, rng=rng):
            assert isinstance(sample, PairSample)  # stage dpo / rm
            paths: list[str] = []
            n_image_tokens = 0
            if image_rows is not None:
                prompt = sample.prompt
                turns, paths, n_image_tokens = image_rows.expand(prompt.turns, prompt.images, prompt.origin)
                sample = dataclasses.replace(sample, prompt=dataclasses.replace(prompt, turns=turns))
            ids, truncated = _encode_pair(sample, template, tokenizer, cutoff_len)
            if paths and image_rows is not None:
                if not image_rows.intact(ids["chosen_input_ids"], len(paths), n_image_tokens):
                    if counts is not None:
                        counts["num_dropped_image_cut"] += 1
                    continue
            if counts is not None:
                counts["num_truncated"] += truncated
            pair: list[dict[str, Any]] = [
                {
                    "input_ids": ids[f"{side}_input_ids"],
                    "labels": ids[f"{side}_labels"],
                    "position_ids": list(range(len(ids[f"{side}_input_ids"]))),
                }
                for side in ("chosen", "rejected")
            ]
            if paths:
                for row in pair:
                    row["images"] = paths
            out.append(pair)
    return out


def feedback_examples(
    specs: Sequence[DatasetSpec],
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cutoff_len: int,
    max_samples: int | None,
    rng: Any,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_workers: int | None = None,
    image_rows: ImageRows | None = None,
    counts: dict[str, int] | None = None,
) -> list[list[dict[str, Any]]]:
    """The feedback rows of ``specs`` (stage kto) as the trainer stores them: one ``[judged, kl]`` list per row,
    each an example dict (``input_ids``, ``labels``, ``position_ids``, ``kto_tag``: 1 desirable, 0 undesirable,
    -1 on the KL row), from :func:`encode_feedback` over every dataset's rows in order (the KL partners span the
    datasets, as LLaMA-Factory's concatenated dataset does), so that a ``val_size`` split keeps the two together.

    ``image_rows`` (:mod:`trainer.vision`): a row's ``<image>`` placeholders are expanded as LLaMA-Factory's
    Qwen-VL plugin expands them, the judged row and its KL row (the same prompt) keep the row's ``images``, and a
    row whose cut goes through an image in either is dropped after the KL partners are drawn
    (``counts["num_dropped_image_cut"]``).

    Raises:
        DataError, ConfigError: as :func:`load_preference_samples`; an image row's placeholders or files.
    """
    rows = [
        s
        for spec in specs
        for s in load_preference_samples(spec, "kto", max_samples=max_samples, rng=rng)
        if isinstance(s, FeedbackSample)
    ]
    images: list[tuple[list[str], int]] = []
    if image_rows is not None:
        for k, row in enumerate(rows):
            turns, paths, n_image_tokens = image_rows.expand(row.sample.turns, row.sample.images, row.sample.origin)
            rows[k] = dataclasses.replace(row, sample=dataclasses.replace(row.sample, turns=turns))
            images.append((paths, n_image_tokens))
    encoded = encode_feedback(rows, template, tokenizer, cutoff_len, batch_size=batch_size, num_workers=num_workers)
    out = []
    for k, e in enumerate(encoded):
        judged = {"input_ids": e["input_ids"], "labels": e["labels"], "kto_tag": int(e["kto_tags"])}
        kl = {"input_ids": e["kl_input_ids"], "labels": e["kl_labels"], "kto_tag": -1}
        pair = [{**x, "position_ids": list(range(len(x["input_ids"])))} for x in (judged, kl)]
        if images and images[k][0] and image_rows is not None:
            paths, n_image_tokens = images[k]
            if not all(image_rows.intact(x["input_ids"], len(paths), n_image_tokens) for x in pair):
                if counts is not None:
                    counts["num_dropped_image_cut"] += 1
                continue
            for x in pair:
                x["images"] = paths
        out.append(pair)
    return out


__all__ = [
    "feedback_examples",
    "pair_examples",
    "PREFERENCE_STAGES",
    "PreferenceStage",
    "PairSample",
    "FeedbackSample",
    "read_pair",
    "read_feedback",
    "check_json_kto_tags",
    "load_preference_samples",
    "encode_pair",
    "encode_feedback",
    "kl_partners",
    "preference_examples",
]
