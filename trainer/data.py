"""From dataset files to training examples: tokenise, mask, truncate, pack, cache (batches: :mod:`trainer.batching`).

The pipeline, run once per (data, tokenizer, settings) and cached::

    dataset names ──formats.resolve_datasets──> files ──formats.load_samples──> Sample rows
      ──template──> (source, target) token pairs per turn ──truncate to cutoff_len──> input_ids + labels
      ──drop samples with no trainable token──> split train/eval (seeded) ──pack (optional)──> cache file

Labels are *unshifted*: ``labels[t]`` is the token the model should predict at position ``t - 1``, and is
:data:`trainer.loss.IGNORE_INDEX` (-100) where no loss is taken (prompt, system, padding; packed rows keep each
sample's labels, as LLaMA-Factory). The loss of a batch is ``sum over t >= 1 of CE(logits[t-1], labels[t])`` over
positions with ``labels[t] != -100`` (:func:`trainer.loss.count_trainable_tokens` counts them).

Chat layout: ``template: NAME`` uses a LLaMA-Factory built-in (:mod:`trainer.templates`, a port of LLaMA-Factory
0.9.5's template code, checked token for token against its goldens): each turn is encoded as LLaMA-Factory encodes
it, so the mask is exact by construction. No ``template`` uses the tokenizer's own ``chat_template``: the
conversation is rendered once and each assistant reply is located in the text (or marked by the template's
``{% generation %}`` blocks), from where the template's generation prompt for the turns before it ends to the
end-of-turn marker the template writes after it; tokens starting inside a reply are trained (checked against the
real templates of Qwen3, Llama 3.x, Gemma, Mistral, GLM-4 and DeepSeek in tests/trainer/test_templates_real.py).
Function calls go to the template as ``tool_calls`` and the tools as ``tools`` (the Hugging Face layout), so the
model's own tool-call format is trained. A tokenizer with neither falls back to ``empty`` (LLaMA-Factory's
fallback) with one warning. Every assistant turn is trained (only the last with ``mask_history``).

Truncation is LLaMA-Factory's (``SupervisedDatasetProcessor``): turn by turn (with ``mask_history`` from the last
turn backwards), the remaining budget is shared between prompt and response by ``infer_seqlen``.

The cache (``$FERRY_CACHE/tokenized/<key>.safetensors``, no pickle) is keyed by the SHA-256 of the data
files, of the tokenizer (its serialised ``tokenizer.json`` state, special tokens and chat template) and of
every data setting. Several processes may call :func:`prepare_data` at once: an ``flock`` on
``<key>.lock`` lets one build while the others wait and then load (``ferry train`` tokenises in the launching
process, so torchrun workers only load and no rank sits in ``init_process_group`` while another tokenises).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ferry.constants import ferry_cache_dir
from ferry.digests import DigestCache, data_digests
from ferry.errors import ConfigError, DataError, TrainingError
from ferry.fsutil import atomic_write_bytes, ensure_free_space, sha256_file
from trainer.formats import (
    ASSISTANT,
    FUNCTION,
    OBSERVATION,
    DatasetSpec,
    Sample,
    iter_rows,
    load_samples,
    resolve_datasets,
    sampling_rng,
)
from trainer.loss import IGNORE_INDEX
from trainer.templates import TEMPLATES, Template, get_template, unknown_template_message, write_chat_template
from trainer.templates.render import infer_seqlen
from trainer.vision import IMAGE_TEMPLATES, ImageProcessing, ImageRows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.config import TrainConfig

logger = logging.getLogger("ferry.trainer.data")

#: Bumped whenever the cache layout or the tokenisation rules change (part of the cache key).
CACHE_FORMAT = "ferry-tokenized-v3"

#: One training sequence: ``input_ids``, ``labels`` (same length, unshifted, -100 where no loss) and
#: ``position_ids`` (0..n-1, restarting at 0 at each sample inside a packed sequence), all ``list[int]``.
Example = dict

_warned_fallback = False


# ---------------------------------------------------------------------- tokenizer


def load_tokenizer(cfg: TrainConfig) -> PreTrainedTokenizerBase:
    """Load the base model's tokenizer offline, padding on the right.

    The model is found with :func:`ferry.hub.resolve_model` (a local path or the installed HF / ModelScope
    cache; never the network). A tokenizer without a pad token (stories260K) gets ``pad_token = eos_token``
    (or ``unk_token``): padding never reaches the loss because labels are -100 there. With a built-in
    ``template`` the tokenizer gets the template's special tokens (:func:`fix_special_tokens`, e.g. EOS becomes
    ``<|im_end|>`` for qwen), as LLaMA-Factory's ``get_template_and_fix_tokenizer`` does, and a
    ``chat_template`` that renders the trained prompt (:func:`trainer.templates.write_chat_template`), which the
    adapter folder's ``chat_template.jinja`` then carries.

    Raises:
        NotInstalledError: the model is not installed.
        ConfigError: the tokenizer has neither pad, EOS nor UNK token; it lacks a token the template needs.
    """
    from transformers import AutoTokenizer

    from ferry.hub import resolve_model

    path = resolve_model(cfg.model_name_or_path, cfg.model_revision)
    tokenizer = AutoTokenizer.from_pretrained(
        str(path),
        trust_remote_code=cfg.trust_remote_code,
        local_files_only=True,
        padding_side="right",
    )
    tokenizer.padding_side = "right"
    # Samples are encoded whole and then cut to cutoff_len (LLaMA-Factory's infer_seqlen), so transformers'
    # "sequence length is longer than the specified maximum" warning about model_max_length never applies.
    if isinstance(getattr(tokenizer, "deprecation_warnings", None), dict):
        tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    from trainer.vocab import add_listed_tokens  # resize_vocab / add_special_tokens

    may_add = add_listed_tokens(tokenizer, cfg) or cfg.resize_vocab
    if cfg.template is not None:
        template = template_for(cfg)
        fix_special_tokens(tokenizer, template, repr(cfg.model_name_or_path), may_add=may_add)
        # the adapter's chat_template.jinja renders the trained prompt
        write_chat_template(template, tokenizer, mask_history=cfg.mask_history)
    elif cfg.stage == "sft" and not getattr(tokenizer, "chat_template", None):
        write_chat_template(template_for(cfg.model_copy(update={"template": "empty"})), tokenizer)  # the fallback
    if tokenizer.pad_token_id is None:
        substitute = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if substitute is None:
            raise ConfigError(f"tokenizer of {cfg.model_name_or_path!r} has no pad, eos or unk token to pad with")
        tokenizer.pad_token = substitute
    return tokenizer


# ---------------------------------------------------------------------- templates and encoding


@dataclass(frozen=True)
class _Renderer:
    """How conversations become token pairs: a built-in template, or the tokenizer's chat_template (None)."""

    name: str
    template: Template | None


def template_for(cfg: TrainConfig) -> Template:
    """The built-in template ``cfg.template`` configured by the config's data keys (``default_system``,
    ``enable_thinking``, ``tool_format``, ``train_on_prompt``), as LLaMA-Factory's
    ``get_template_and_fix_tokenizer`` configures it.

    Raises:
        ConfigError: ``train_on_prompt`` with an ``efficient_eos`` template, or an unknown ``tool_format``.
    """
    assert cfg.template is not None  # callers use the tokenizer's own chat template when no template is named
    try:
        return get_template(
            cfg.template,
            default_system=cfg.default_system,
            enable_thinking=cfg.enable_thinking,
            tool_format=cfg.tool_format,
            train_on_prompt=cfg.train_on_prompt,
        )
    except KeyError:
        raise ConfigError(unknown_template_message(str(cfg.template))) from None
    except ValueError as exc:
        raise ConfigError(f"template {cfg.template!r}: {exc}") from None


def fix_special_tokens(
    tokenizer: PreTrainedTokenizerBase, template: Template, model: str = "the model", *, may_add: bool = False
) -> None:
    """Give ``tokenizer`` the special tokens the template trains with, as LLaMA-Factory's ``fix_special_tokens``
    does: with ``replace_eos`` the template's first stop word becomes the EOS token (``<|im_end|>`` for chatml /
    qwen, ...), the other stop words become special tokens, pad falls back to EOS.

    LLaMA-Factory adds a token the vocabulary lacks and relies on ``resize_vocab``; so does ferry with
    ``may_add`` (``resize_vocab``, or tokens added by ``add_special_tokens``: :mod:`trainer.vocab` then grows the
    embeddings); without it a template whose tokens the tokenizer does not know is refused.

    Raises:
        ConfigError: the tokenizer has no single token for one of the template's stop words, and ``may_add`` is
            False.
    """
    new_eos, stop_words = template.special_tokens_needed()
    vocab = tokenizer.get_vocab()
    for token in ([new_eos] if new_eos else []) + stop_words:
        if may_add:
            break
        if token not in vocab:
            raise ConfigError(
                f"template {template.name!r} ends turns with {token!r}, which the tokenizer of {model} does not "
                f"have as a token: choose the template of the model's family, or set resize_vocab: true to add it "
                f"(the embeddings grow and are trained, as in LLaMA-Factory)"
            )
    template.fix_special_tokens(tokenizer)


def resolve_template(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> _Renderer:
    """The chat layout for ``cfg``: ``cfg.template`` when set, else the tokenizer's ``chat_template``, else the
    built-in ``empty`` (LLaMA-Factory's fallback; with one warning per process)."""
    global _warned_fallback
    if cfg.template is not None:
        return _Renderer(cfg.template, template_for(cfg))
    chat_template = getattr(tokenizer, "chat_template", None)
    if isinstance(chat_template, dict):  # several named templates: apply_chat_template uses "default"
        chat_template = chat_template.get("default")
    ours = getattr(tokenizer, "ferry_chat_template", None)  # (name, jinja) set by write_chat_template
    if ours is not None and ours[1] == chat_template:
        chat_template = None  # ferry's rendering of a built-in (the fallback): train with the built-in itself
    if isinstance(chat_template, str) and chat_template and cfg.stage != "pt":
        return _Renderer("tokenizer-chat-template", None)
    if not _warned_fallback and cfg.stage != "pt":
        logger.warning(
            "the tokenizer of %s has no chat_template and the config sets no template: using the built-in "
            "'empty' template (the conversation's texts back to back, as LLaMA-Factory); set template: to choose "
            "another",
            cfg.model_name_or_path,
        )
        _warned_fallback = True
    return _Renderer("empty", template_for(cfg.model_copy(update={"template": "empty"})))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False)) if text else []


def _bos(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def sample_messages(sample: Sample) -> list[dict[str, str]]:
    """A sample's turns as LLaMA-Factory messages (roles user / assistant / observation / function)."""
    return [{"role": role, "content": text} for role, text in sample.turns]


def encode_pairs_builtin(
    sample: Sample, template: Template, tokenizer: PreTrainedTokenizerBase, *, mask_history: bool = False
) -> list[tuple[list[int], list[int]]]:
    """``(source_ids, target_ids)`` per exchange with a built-in template (:meth:`Template.encode_multiturn`;
    ``mask_history`` drops earlier replies' reasoning unless ``preserve_thinking``, as LLaMA-Factory)."""
    discard_cot = mask_history and not template.preserve_thinking
    return template.encode_multiturn(
        tokenizer, sample_messages(sample), sample.system, sample.tools or None, discard_cot
    )


def _chat_messages(sample: Sample) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A sample as Hugging Face chat messages and ``tools`` (the layout chat templates expect): a function
    turn becomes an assistant message with ``tool_calls`` (``{"type": "function", "function": {"name",
    "arguments"}}`` each, arguments decoded when they are a JSON string), an observation a ``tool`` message, the
    sample's tools (LLaMA-Factory's JSON list of function schemas) the ``tools`` argument, each wrapped as
    ``{"type": "function", "function": schema}`` unless it already is.

    Raises:
        DataError: tools or a function call that is not JSON of that shape (the caller adds the file and row).
    """
    tools = None
    if sample.tools:
        try:
            parsed = json.loads(sample.tools)
        except ValueError as exc:
            raise DataError(f"tools: not JSON ({exc})") from None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(t, dict) for t in parsed):
            raise DataError("tools: expected a JSON list of function schemas (objects)")
        tools = [
            t if t.get("type") == "function" and "function" in t else {"type": "function", "function": t}
            for t in parsed
        ]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": sample.system}] if sample.system else []
    for role, text in sample.turns:
        if role == FUNCTION:
            msgs.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(text, len(msgs))})
        else:
            msgs.append({"role": {ASSISTANT: "assistant", OBSERVATION: "tool"}.get(role, "user"), "content": text})
    return msgs, tools


def _tool_calls(text: str, k: int) -> list[dict[str, Any]]:
    try:
        calls = json.loads(text)
    except ValueError as exc:
        raise DataError(f"message {k} (function call): not JSON ({exc})") from None
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise DataError(f'message {k} (function call): expected {{"name": ..., "arguments": ...}} (or a list)')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        out.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    return out


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_USER, _PROBE_REPLY = "\u2063ferry-probe-user\u2063", "\u2063ferry-probe-reply\u2063"


def _rendered(
    tokenizer: Any,
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The text the tokenizer's chat template renders for ``msgs`` (``apply_chat_template(tokenize=False)``)."""
    return str(
        tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
    )


def _turn_end(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the chat_template writes right after an assistant reply (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``, ``</s>``, or nothing), trailing whitespace left out: found by rendering a probe."""
    cache = getattr(tokenizer, "_ferry_turn_end", None)
    if cache is not None and cache[0] == tokenizer.chat_template:
        return cache[1]
    text = _rendered(
        tokenizer, [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}], None
    )
    end = text.split(_PROBE_REPLY, 1)[1].rstrip() if _PROBE_REPLY in text else ""
    tokenizer._ferry_turn_end = (tokenizer.chat_template, end)
    return end


def _find_reply(full: str, content: str, cursor: int) -> tuple[int, int]:
    """Where an assistant reply's text lies in the rendered conversation, searching from ``cursor``:
    ``(start, end)``, or ``(-1, -1)``. A reply with a reasoning block that the template rewrote (Qwen3 drops
    earlier turns' reasoning and re-spaces the last one) is found by its answer, and its reasoning is included
    when the template kept it just before."""
    start = full.find(content, cursor)
    if start >= 0:
        return start, start + len(content)
    if content.strip() != content and content.strip():  # templates that trim (Llama 3: content | trim)
        return _find_reply(full, content.strip(), cursor)
    if "</think>" not in content:
        return -1, -1
    reasoning, answer = content.split("</think>", 1)
    reasoning = reasoning.split("<think>")[-1].strip()
    answer = answer.lstrip("\n")
    start = full.find(answer, cursor)
    if start < 0:
        return -1, -1
    think = full.rfind("<think>", cursor, start)
    if think >= 0 and reasoning in full[think:start]:
        return think, start + len(answer)
    return start, start + len(answer)


def _reply_start(
    tokenizer: PreTrainedTokenizerBase,
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    k: int,
    full: str,
    cursor: int,
    found: int,
) -> int:
    """Where the model's own output for assistant message ``k`` begins in the rendered conversation ``full`` (cut
    at the reply's end): where the prompt that ``add_generation_prompt=True`` writes for ``msgs[:k]`` stops
    agreeing with it (so Qwen3.5's ``<think>\n``, part of its generation prompt, is not trained).

    So what the template writes between that prompt and the reply's text is trained with the reply, as the model
    generates it at inference: Qwen3's ``<think>\n\n</think>\n\n`` before the last answer, GLM-4's
    ``\n<think></think>\n``. ``found`` (where the reply's text was located) is kept when the prompt disagrees
    with ``full`` before ``cursor`` (the end of the previous message's text: the template placed text
    differently, as Mistral Nemo moves the system prompt into the last user turn) or cannot be rendered."""
    try:
        prompt = _rendered(tokenizer, msgs[:k], tools, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses such a prefix: keep the located text
        return found
    agree = len(os.path.commonprefix([prompt, full]))
    if agree < len(prompt):  # they part inside a token (Gemma 4's '<|channel>' vs '<think>'): back to its start
        offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True, verbose=False)[
            "offset_mapping"
        ]
        agree = max((a for a, _ in offsets if a <= agree), default=0)
    return agree if agree > cursor else found


def _span_without_text(
    tokenizer: PreTrainedTokenizerBase,
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    k: int,
    full: str,
    cursor: int,
    end_marker: str,
) -> tuple[int, int]:
    """The span of assistant message ``k`` (tool calls or an empty reply: no text to locate) in ``full``: from
    where the generation prompt for ``msgs[:k]`` ends (:func:`_reply_start`) to where the rendering of
    ``msgs[:k + 1]`` ends when ``full`` starts with it (trailing whitespace left out), else to the template's
    end-of-turn marker after it.

    Raises:
        DataError: neither way finds the turn (the message says which turn and why).
    """
    what = "function call" if msgs[k].get("tool_calls") else "empty assistant reply"
    start = _reply_start(tokenizer, msgs, tools, k, full, cursor, -1)
    if start < 0:
        raise DataError(
            f"message {k} ({what}): the chat_template's generation prompt for the turns before "
            f"it does not match the rendered conversation, so it cannot be marked for the loss: "
            f"set template: to a built-in (`ferry train --templates`)"
        )
    try:
        turn = _rendered(tokenizer, msgs[: k + 1], tools)
    except Exception:  # noqa: BLE001 - a template that refuses to end on a tool call: use the marker
        turn = ""
    if turn and full.startswith(turn) and len(turn.rstrip()) > start:
        return start, len(turn.rstrip())
    at = full.find(end_marker, start) if end_marker else -1
    if at < 0:
        raise DataError(
            f"message {k} ({what}): cannot tell where the chat_template's rendering of it ends "
            f"(no end-of-turn marker), so it cannot be marked for the loss: set template: to a "
            f"built-in (`ferry train --templates`)"
        )
    return start, at + len(end_marker)


def encode_pairs_chat_template(
    sample: Sample,
    tokenizer: PreTrainedTokenizerBase,
) -> list[tuple[list[int], list[int]]]:
    """``(source_ids, target_ids)`` runs from the tokenizer's own ``chat_template`` (no ``template`` set).

    With ``{% generation %}`` markers in the template, transformers' ``return_assistant_tokens_mask`` marks the
    trained tokens. Otherwise the whole conversation is rendered ONCE (so templates that rewrite earlier turns,
    as Qwen3 drops earlier reasoning, work) and each assistant reply is located in the text in order (see
    :func:`_find_reply`), widened back to where the generation prompt for the turns before it ends
    (:func:`_reply_start`: an empty ``<think></think>`` block the template writes is trained, a ``<think>\n``
    that ends the generation prompt is not) and over the end-of-turn marker the template writes after a reply
    (:func:`_turn_end`); a token is trained when its first character lies in such a span.

    Raises:
        DataError: a reply cannot be found in the rendering (the template rewrites it): the message says which
            turn and why; the caller adds the file and row.
    """
    msgs, tools = _chat_messages(sample)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if _GENERATION_TAG.search(template):
        apply: Any = tokenizer.apply_chat_template  # its stub types tools as list[dict | Callable]
        out = apply(
            msgs,
            tools=tools,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=False,
            return_assistant_tokens_mask=True,
        )
        ids = list(out["input_ids"])
        return _runs_to_pairs(ids, [bool(m) for m in out["assistant_masks"]])
    full = _rendered(tokenizer, msgs, tools)
    end_marker = _turn_end(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            found = full.find(msg["content"], cursor) if msg["content"] else -1
            if found >= 0:
                cursor = found + len(msg["content"])
            continue
        if msg.get("tool_calls") or not msg["content"].strip():  # no text to locate: a call, an empty reply
            start, end = _span_without_text(tokenizer, msgs, tools, k, full, cursor, end_marker)
            spans.append((start, end))
            cursor = end
            continue
        start, end = _find_reply(full, msg["content"], cursor)
        if start >= 0:
            start = _reply_start(tokenizer, msgs, tools, k, full[:end], cursor, start)
        if start < 0:
            raise DataError(
                f"message {k} (assistant): its text does not appear in what the tokenizer's chat_template renders "
                f"(the template rewrites or drops it), so its tokens cannot be marked for the loss: set template: "
                f"to a built-in (`ferry train --templates`)"
            )
        for cut in range(len(end_marker), 0, -1):  # the marker, or the part of it the template wrote here
            if full.startswith(end_marker[:cut], end):
                end += cut
                break
        spans.append((start, end))
        cursor = end
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    starts = [s for s, _ in spans]
    trainable = []
    for start, _end in offsets:
        k = bisect.bisect_right(starts, start) - 1
        trainable.append(k >= 0 and start < spans[k][1])
    return _runs_to_pairs(ids, trainable)


def _runs_to_pairs(ids: list[int], trainable: list[bool]) -> list[tuple[list[int], list[int]]]:
    """Split a masked token list into (non-trainable run, following trainable run) pairs."""
    pairs: list[tuple[list[int], list[int]]] = []
    source: list[int] = []
    target: list[int] = []
    for tok, train in zip(ids, trainable):
        if not train and target:
            pairs.append((source, target))
            source, target = [], []
        (target if train else source).append(tok)
    if source or target:
        pairs.append((source, target))
    return pairs


def build_example(
    pairs: list[tuple[list[int], list[int]]],
    cutoff_len: int,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    efficient_eos_id: int | None = None,
) -> tuple[list[int], list[int], bool]:
    """Concatenate turn pairs into ``(input_ids, labels, truncated)`` of at most ``cutoff_len`` tokens.

    LLaMA-Factory's ``SupervisedDatasetProcessor._encode_data_example``: turns are taken in order (with
    ``mask_history`` from the LAST turn backwards, so the trained turn gets the budget first) while budget
    remains, each cut by :func:`infer_seqlen`. Labels copy every target (only the last turn's with
    ``mask_history``) and the sources too with ``train_on_prompt``; -100 elsewhere. With an ``efficient_eos``
    template (``efficient_eos_id`` = the EOS id) one EOS is appended at the end and trained, and each later
    source's first label is EOS (LLaMA-Factory's layout, kept as is).
    """
    ids: list[int] = []
    labels: list[int] = []
    total = 1 if efficient_eos_id is not None else 0
    ordered = pairs[::-1] if mask_history else pairs
    kept = 0
    truncated = False
    for turn, (source, target) in enumerate(ordered):
        if total >= cutoff_len:
            break
        s_len, t_len = infer_seqlen(len(source), len(target), cutoff_len - total)
        truncated = truncated or s_len < len(source) or t_len < len(target)
        source, target = source[:s_len], target[:t_len]
        total += s_len + t_len
        kept += 1
        if train_on_prompt:
            source_label = list(source)
        elif efficient_eos_id is not None and turn != 0:
            source_label = [efficient_eos_id] + [IGNORE_INDEX] * (s_len - 1)
        else:
            source_label = [IGNORE_INDEX] * s_len
        target_label = [IGNORE_INDEX] * t_len if (mask_history and turn != 0) else list(target)
        if mask_history:
            ids = source + target + ids
            labels = source_label + target_label + labels
        else:
            ids += source + target
            labels += source_label + target_label
    truncated = truncated or any(len(s) + len(t) for s, t in ordered[kept:])
    if efficient_eos_id is not None:
        ids.append(efficient_eos_id)
        labels.append(efficient_eos_id)
    return ids, labels, truncated


def _has_trainable(labels: Sequence[int]) -> bool:
    return any(x != IGNORE_INDEX for x in labels[1:])


# ---------------------------------------------------------------------- packing


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group sample indices into bins of total length <= ``capacity``: LLaMA-Factory's ``greedy_knapsack``
    (``data/processor/processor_utils.py``) with the order in which ``PackedSupervisedDatasetProcessor`` takes
    the samples of each bin, unchanged.

    Each bin is filled by taking, again and again, the longest remaining sample that still fits; among samples
    of one length the one listed last goes first. Bins come in creation order, each listing its sample indices
    in the order they are concatenated. O(n^2) in the worst case (LLaMA-Factory runs it per 1000 samples).

    Raises:
        ValueError: a length above ``capacity`` (LLaMA-Factory drops such a sample; ferry's are cut before).
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {capacity}")
    numbers = sorted(lengths)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    bins: list[list[int]] = []
    while numbers:
        remaining, members = capacity, []
        while True:
            k = bisect.bisect(numbers, remaining) - 1  # the longest that fits
            if k < 0:
                break
            remaining -= numbers[k]
            members.append(by_length[numbers.pop(k)].pop())
        bins.append(members)
    return bins


# ---------------------------------------------------------------------- storage


class ExampleStore(Sequence):
    """A read-only sequence of :data:`Example` backed by flat int32 tensors (cheap to load from the cache,
    cheap to send to DataLoader workers). ``store[i]`` is a fresh dict of ``list[int]``.

    Attributes:
        input_ids, labels, position_ids: 1-D int32 tensors holding every example back to back.
        offsets: 1-D int64 tensor of ``len(store) + 1`` boundaries: example ``i`` is ``[offsets[i], offsets[i+1])``.
        kto_tags: stage kto: 1-D int8 ``[len(store)]``, each example's ``kto_tag`` (1 desirable, 0 undesirable,
            -1 a KL row); ``store[i]`` then carries ``"kto_tag"``. None for every other stage.
        images: image rows: each example's image file paths (``[]`` for a text example); ``store[i]`` then carries
            ``"images"``. None when no example has an image.
        videos: likewise, each example's video file paths (``"videos"``); None when no example has a video.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        offsets: torch.Tensor,
        kto_tags: torch.Tensor | None = None,
        images: list[list[str]] | None = None,
        videos: list[list[str]] | None = None,
    ) -> None:
        self.input_ids, self.labels, self.position_ids, self.offsets = input_ids, labels, position_ids, offsets
        self.kto_tags = kto_tags
        self.images, self.videos = images, videos
        self._bounds = offsets.tolist()

    @classmethod
    def from_examples(cls, examples: Sequence[Example]) -> ExampleStore:
        """Pack a list of Example dicts into flat tensors."""
        lengths = [len(e["input_ids"]) for e in examples]
        offsets = torch.zeros(len(examples) + 1, dtype=torch.int64)
        if examples:
            offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)

        def flat(key: str) -> torch.Tensor:
            return torch.tensor([t for e in examples for t in e[key]], dtype=torch.int32)

        tags = None
        if examples and "kto_tag" in examples[0]:
            tags = torch.tensor([int(e["kto_tag"]) for e in examples], dtype=torch.int8)
        images = [list(e.get("images", ())) for e in examples]
        videos = [list(e.get("videos", ())) for e in examples]
        return cls(
            flat("input_ids"),
            flat("labels"),
            flat("position_ids"),
            offsets,
            tags,
            images if any(images) else None,
            videos if any(videos) else None,
        )

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        a, b = self._bounds[index], self._bounds[index + 1]
        example: dict[str, Any] = {
            "input_ids": self.input_ids[a:b].tolist(),
            "labels": self.labels[a:b].tolist(),
            "position_ids": self.position_ids[a:b].tolist(),
        }
        if self.kto_tags is not None:
            example["kto_tag"] = int(self.kto_tags[index])
        if self.images is not None:
            example["images"] = list(self.images[index])
        if self.videos is not None:
            example["videos"] = list(self.videos[index])
        return example

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> list[int]:
        """Token count of each example."""
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def num_tokens(self) -> int:
        """Total tokens (``sum(lengths())``)."""
        return int(self.input_ids.numel())

    def num_trainable_tokens(self) -> int:
        """Positions that contribute to the loss: ``labels[t] != -100`` for ``t >= 1`` within each example."""
        mask = self.labels != IGNORE_INDEX
        firsts = self.offsets[:-1][self.offsets[:-1] < self.offsets[1:]]
        return int(mask.sum()) - int(mask[firsts].sum())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The flat tensors named ``PREFIX.input_ids`` ... ``PREFIX.offsets`` (and ``PREFIX.kto_tags``), the cache
        file layout."""
        tensors = {
            f"{prefix}.input_ids": self.input_ids,
            f"{prefix}.labels": self.labels,
            f"{prefix}.position_ids": self.position_ids,
            f"{prefix}.offsets": self.offsets,
        }
        if self.kto_tags is not None:
            tensors[f"{prefix}.kto_tags"] = self.kto_tags
        return tensors

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        prefix: str,
        images: list[list[str]] | None = None,
        videos: list[list[str]] | None = None,
    ) -> ExampleStore:
        """Inverse of :meth:`tensors` (``images``, ``videos``: the media paths, which the cache keeps in its
        metadata)."""
        return cls(
            tensors[f"{prefix}.input_ids"],
            tensors[f"{prefix}.labels"],
            tensors[f"{prefix}.position_ids"],
            tensors[f"{prefix}.offsets"],
            tensors.get(f"{prefix}.kto_tags"),
            images,
            videos,
        )


@dataclass
class PreparedData:
    """The tokenised training and evaluation data.

    Attributes:
        train: training examples (an :class:`ExampleStore`: ``len``, indexing and iteration like a list).
        eval: evaluation examples (empty without ``val_size`` or ``eval_dataset``); never packed.
        stats: ``num_samples`` (kept samples, train + eval, before packing), ``num_train_samples``,
            ``num_eval_samples``, ``num_train_sequences`` (after packing), ``num_dropped_no_trainable``,
            ``num_truncated``, ``num_split_documents`` (pt texts longer than cutoff_len, cut into blocks),
            ``num_train_tokens`` (all tokens of ``train``), ``num_trainable_tokens`` (loss positions of
            ``train``), ``template``, ``datasets``, ``cache_path``, ``cache_key``, ``cache_hit``, ``build_id``,
            ``build_seconds``.
    """

    train: ExampleStore
    eval: ExampleStore
    stats: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- cache key


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what determines token ids: the serialised tokenizer (vocab, merges, normalizer,
    pre-tokenizer, added tokens) or, for a slow tokenizer, its vocabulary; plus special tokens and the chat
    template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        name = Path(str(getattr(tokenizer, "name_or_path", "")))
        if name.is_dir():
            for f in sorted(name.iterdir()):
                if f.is_file() and ("token" in f.name or f.suffix in (".model", ".txt", ".jinja")):
                    h.update(f.name.encode() + sha256_file(f).encode())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "bos_token", "eos_token")}
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def _specs_fingerprint(specs: list[DatasetSpec], digests: DigestCache) -> list[dict[str, Any]]:
    out = []
    for spec in specs:
        d = spec.describe()
        d["sha256"] = [digests.digest(Path(f)) for f in spec.files]
        del d["files"]  # content, not location, decides
        out.append(d)
    return out


# ---------------------------------------------------------------------- building


def _encode_conversation(
    sample: Sample, cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, renderer: _Renderer
) -> tuple[list[int], list[int], bool]:
    """One conversation sample as ``(input_ids, labels, truncated)`` (:func:`build_example` of its turn pairs).

    Raises:
        DataError: the template or the tokenizer's chat_template cannot render the row (naming it).
    """
    eos_id = None
    if renderer.template is not None:
        try:
            pairs = encode_pairs_builtin(sample, renderer.template, tokenizer, mask_history=cfg.mask_history)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # bad tool JSON, ...
            raise DataError(f"{sample.origin}: template {renderer.name!r} cannot render this row: {exc}") from None
        if renderer.template.efficient_eos:
            eos_id = tokenizer.eos_token_id
    else:
        try:
            pairs = encode_pairs_chat_template(sample, tokenizer)
        except DataError as exc:
            raise DataError(f"{sample.origin}: {exc}") from None
        except ConfigError:
            raise
        except Exception as exc:  # jinja2's TemplateError, or the template's raise_exception()
            raise DataError(
                f"{sample.origin}: the tokenizer's chat_template refused this conversation: {exc} "
                f"(set template: to a built-in, e.g. {', '.join(list(TEMPLATES)[:4])})"
            ) from exc
    return build_example(
        pairs,
        cfg.cutoff_len,
        train_on_prompt=cfg.train_on_prompt,
        mask_history=cfg.mask_history,
        efficient_eos_id=eos_id,
    )


def _tokenize_specs(
    specs: list[DatasetSpec],
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    renderer: _Renderer,
    counts: dict[str, int],
    rng: Any,
    image_rows: ImageRows | None = None,
) -> list[list[Example]]:
    """Tokenise every sample of ``specs``: one list of examples per sample (several for a ``pt`` document cut
    into blocks; none when it has no trainable token, or when the cut would go through one of its images: both
    counted in ``counts``), in dataset order. ``rng``: the ``num_samples`` stream
    (:func:`trainer.formats.sampling_rng`), shared by train and eval specs. ``image_rows``: the datasets have image
    rows (:mod:`trainer.vision`): placeholders are expanded and each example keeps its ``images``."""
    examples: list[list[Example]] = []
    bos, eos = _bos(tokenizer), ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    cutoff = cfg.cutoff_len
    blocks = _pretrain_blocks_wanted(cfg)
    if blocks:
        eos = _pretrain_eos(cfg, tokenizer)
    for spec in specs:
        for sample in load_samples(spec, stage=cfg.stage, max_samples=cfg.max_samples, rng=rng):
            media = None  # the sample's images and videos
            if sample.text is not None and blocks:  # whole, text + EOS: cut into blocks after the split
                doc = _encode(tokenizer, sample.text) + eos
                examples.append([{"input_ids": doc, "labels": list(doc), "position_ids": list(range(len(doc)))}])
                continue
            if sample.text is not None:
                ids = bos + _encode(tokenizer, sample.text) + eos
                chunks = [ids[i : i + cutoff] for i in range(0, len(ids), cutoff)]
                counts["num_split_documents"] += len(chunks) > 1
                pieces = [(chunk, list(chunk), False) for chunk in chunks]
            else:
                if image_rows is not None:
                    turns, media = image_rows.expand_media(sample.turns, sample.images, sample.videos, sample.origin)
                    sample = dataclasses.replace(sample, turns=turns)
                pieces = [_encode_conversation(sample, cfg, tokenizer, renderer)]
            kept = []
            for ids, labels, truncated in pieces:
                if not _has_trainable(labels):
                    counts["num_dropped_no_trainable"] += 1
                    continue
                if media is not None and image_rows is not None and not image_rows.intact_media(ids, media):
                    counts["num_dropped_image_cut"] += 1  # never train on features that do not fit the tokens
                    continue
                counts["num_truncated"] += truncated
                example = {"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))}
                if media is not None and media.images:
                    example["images"] = media.images
                if media is not None and media.videos:
                    example["videos"] = media.videos
                kept.append(example)
            examples.append(kept)
    return examples


#: The stages whose samples are two rows: ranking pairs (the store holds pair ``i`` at rows ``2i``, chosen, and
#: ``2i + 1``) and KTO's feedback rows (row ``2i`` the judged reply, with its ``kto_tag``; ``2i + 1`` its KL row).
PAIR_STAGES = ("dpo", "rm", "kto")


def _tokenize_pairs(
    specs: list[DatasetSpec],
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    renderer: _Renderer,
    counts: dict[str, int],
    rng: Any,
    image_rows: ImageRows | None = None,
) -> list[list[Example]]:
    """:func:`_tokenize_specs` for stage dpo / rm: one ``[chosen, rejected]`` per ranking pair
    (:func:`trainer.preference_data.pair_examples`); a pair keeps its reply tokens even when the cut leaves one
    reply empty, as LLaMA-Factory does. Stage kto: one ``[judged, kl]`` per feedback row
    (:func:`trainer.preference_data.feedback_examples`).

    Raises:
        ConfigError: no built-in template (the pairs are rendered with LLaMA-Factory's template code).
    """
    from trainer.preference_data import feedback_examples, pair_examples

    if renderer.template is None:
        raise ConfigError(
            f"stage {cfg.stage}: needs a built-in template (template: ...); the tokenizer's own chat_template "
            f"is used for sft only"
        )
    if cfg.stage == "kto":
        return feedback_examples(
            specs,
            renderer.template,
            tokenizer,
            cutoff_len=cfg.cutoff_len,
            max_samples=cfg.max_samples,
            rng=rng,
            batch_size=cfg.preprocessing_batch_size,
            num_workers=cfg.preprocessing_num_workers,
            image_rows=image_rows,
            counts=counts,
        )
    return pair_examples(
        specs,
        cfg.stage,  # type: ignore[arg-type]  # one of PAIR_STAGES
        renderer.template,
        tokenizer,
        cutoff_len=cfg.cutoff_len,
        max_samples=cfg.max_samples,
        rng=rng,
        counts=counts,
        image_rows=image_rows,
    )


def _split(samples: list[list[Example]], val_size: float, seed: int) -> tuple[list[Example], list[Example]]:
    """LLaMA-Factory's ``val_size`` split (``split_dataset``: ``datasets.Dataset.train_test_split(test_size,
    seed=seed)``), over the loaded samples before any is dropped: ``np.random.default_rng(seed).permutation(n)``,
    its first ``ceil(n * val_size)`` (fraction) or ``int(val_size)`` (count) samples go to eval, the rest, in that
    permuted order, to train. ``samples`` holds each sample's examples (see :func:`_tokenize_specs`); returns the
    flat train and eval example lists.

    Raises:
        ConfigError: no sample would be left for training.
    """
    import numpy as np

    flat = [e for examples in samples for e in examples]
    if val_size <= 0:
        return flat, []
    n = len(samples)
    n_val = int(val_size) if val_size >= 1 else math.ceil(n * val_size)
    if n_val >= n:
        raise ConfigError(f"val_size={val_size} leaves no training sample out of {n}")
    order = np.random.default_rng(seed).permutation(n).tolist()
    return ([e for i in order[n_val:] for e in samples[i]], [e for i in order[:n_val] for e in samples[i]])


def pack_examples(examples: Sequence[Example], capacity: int, group_size: int = 1000) -> list[Example]:
    """Concatenate examples into rows of at most ``capacity`` tokens, as LLaMA-Factory's
    ``PackedSupervisedDatasetProcessor`` does: the examples are taken in groups of ``group_size`` (its
    ``preprocessing_batch_size``, one ``datasets.map`` batch), each group packed on its own by
    :func:`pack_lengths`; labels are kept as they are; position ids restart at 0 at each sample.

    Whether the samples of a row attend to each other is decided at collation (:func:`trainer.batching.collate`'s
    ``cross_sample_attention``): LLaMA-Factory's ``packing`` lets them, ``neat_packing`` does not. LLaMA-Factory pads
    each row to ``capacity + 1`` tokens (pad id, label -100, position 0); that padding changes no loss and no
    gradient and is left out here (rows are padded per batch).
    """
    packed = []
    for first in range(0, len(examples), group_size):
        group = examples[first : first + group_size]
        for members in pack_lengths([len(e["input_ids"]) for e in group], capacity):
            ids: list[int] = []
            labels: list[int] = []
            pos: list[int] = []
            for i in members:
                ids += group[i]["input_ids"]
                labels += group[i]["labels"]
                pos += list(range(len(group[i]["input_ids"])))
            packed.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return packed


def _pretrain_blocks_wanted(cfg: TrainConfig) -> bool:
    """Stage pt with packing (LLaMA-Factory's default there): documents become :func:`pretrain_blocks`."""
    return cfg.stage == "pt" and bool(cfg.packing)


def _pretrain_eos(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token after each packed pretraining document: LLaMA-Factory's ``<|end_of_text|>`` for the llama3
    template (its EOS is the turn's ``<|eot_id|>``), else the tokenizer's EOS (none when it has none)."""
    if cfg.template == "llama3":
        token = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
        if isinstance(token, int) and token != tokenizer.unk_token_id:
            return [token]
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def pretrain_blocks(
    examples: Sequence[Example], block_size: int, group_size: int = 1000, bos_id: int | None = None
) -> list[Example]:
    """Stage pt's packing, as LLaMA-Factory's ``PretrainDatasetProcessor`` does it: the documents (each its text
    tokens and EOS) are taken in groups of ``group_size`` (its ``preprocessing_batch_size``, one ``datasets.map``
    batch), each group's tokens concatenated and cut into rows of exactly ``block_size`` tokens (``cutoff_len``), the
    group's last partial row dropped; with ``bos_id`` (a tokenizer whose ``add_bos_token`` is set) each row's first
    token becomes BOS. Labels are the tokens, position ids ``0 .. block_size - 1``: a row is one causal sequence
    across its documents.

    Returns:
        The rows, in order (none when no group holds ``block_size`` tokens).
    """
    rows: list[Example] = []
    for first in range(0, len(examples), group_size):
        tokens = [t for e in examples[first : first + group_size] for t in e["input_ids"]]
        for start in range(0, len(tokens) // block_size * block_size, block_size):
            row = tokens[start : start + block_size]
            if bos_id is not None:
                row[0] = bos_id
            rows.append({"input_ids": row, "labels": list(row), "position_ids": list(range(block_size))})
    return rows


def _pack(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, train: list[Example], evals: list[Example]) -> Any:
    """``(train, evals)`` packed as ``cfg`` asks: stage pt's documents into blocks (both sides, as LLaMA-Factory
    processes its eval set with the same processor), supervised samples into rows (training only).

    Raises:
        TrainingError: stage pt's training (or evaluation) documents make no full block of ``cutoff_len`` tokens.
    """
    if _pretrain_blocks_wanted(cfg):
        bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
        for side, docs in (("training", train), ("evaluation", evals)):
            rows = pretrain_blocks(docs, cfg.cutoff_len, cfg.preprocessing_batch_size, bos)
            if docs and not rows:
                raise TrainingError(
                    f"stage pt packs its {side} documents into blocks of cutoff_len={cfg.cutoff_len} tokens "
                    f"(packing, LLaMA-Factory's default for pt), but each group of preprocessing_batch_size="
                    f"{cfg.preprocessing_batch_size} documents holds fewer ({sum(len(e['input_ids']) for e in docs)} "
                    f"tokens in all): lower cutoff_len, or set packing: false for one document per row"
                )
            train, evals = (rows, evals) if side == "training" else (train, rows)
    elif cfg.packing:
        if any(e.get("images") or e.get("videos") for e in train):
            raise ConfigError(
                "packing: true with image or video rows: ferry does not pack samples that carry media (each row's "
                "images and videos must stay with it); set packing: false"
            )
        train = pack_examples(train, cfg.cutoff_len, cfg.preprocessing_batch_size)
    return train, evals


def _build(
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    renderer: _Renderer,
    train_specs: list[DatasetSpec],
    eval_specs: list[DatasetSpec],
    image_rows: ImageRows | None = None,
) -> tuple[ExampleStore, ExampleStore, dict[str, Any]]:
    counts = {"num_dropped_no_trainable": 0, "num_truncated": 0, "num_split_documents": 0, "num_dropped_image_cut": 0}
    if cfg.packing and cfg.stage == "sft":  # LLaMA-Factory: packing makes cutoff_len one shorter
        cfg = cfg.model_copy(update={"cutoff_len": cfg.cutoff_len - 1})
    rng = sampling_rng(cfg.seed)  # one num_samples stream, datasets in order (LLaMA-Factory's global numpy RNG)
    if cfg.stage in PAIR_STAGES:
        samples = _tokenize_pairs(train_specs, cfg, tokenizer, renderer, counts, rng, image_rows)
        eval_samples = (
            _tokenize_pairs(eval_specs, cfg, tokenizer, renderer, counts, rng, image_rows) if eval_specs else []
        )
    else:
        samples = _tokenize_specs(train_specs, cfg, tokenizer, renderer, counts, rng, image_rows)
        eval_samples = _tokenize_specs(eval_specs, cfg, tokenizer, renderer, counts, rng, image_rows)
    if eval_specs:
        train = [e for examples in samples for e in examples]
        evals = [e for examples in eval_samples for e in examples]
    else:
        train, evals = _split(samples, cfg.val_size, cfg.seed)
    if not train:
        raise TrainingError(
            f"no training sample has a trainable token ({counts['num_dropped_no_trainable']} dropped): check the "
            f"dataset, cutoff_len={cfg.cutoff_len} and the template"
        )
    num_train_samples = len(train) // (2 if cfg.stage in PAIR_STAGES else 1)
    num_eval_samples = len(evals) // (2 if cfg.stage in PAIR_STAGES else 1)
    num_images = sum(len(e.get("images", ())) for e in train + evals) // (2 if cfg.stage in PAIR_STAGES else 1)
    num_videos = sum(len(e.get("videos", ())) for e in train + evals)
    train, evals = _pack(cfg, tokenizer, train, evals)
    train_store, eval_store = ExampleStore.from_examples(train), ExampleStore.from_examples(evals)
    stats = {
        "num_samples": num_train_samples + num_eval_samples,
        "num_train_samples": num_train_samples,
        "num_eval_samples": num_eval_samples,
        "num_train_sequences": len(train_store),
        **counts,
        "num_train_tokens": train_store.num_tokens(),
        "num_trainable_tokens": train_store.num_trainable_tokens(),
        "num_images": num_images,
        "num_videos": num_videos,
        "packing": cfg.packing,
        "neat_packing": cfg.neat_packing,
        "template": renderer.name,
        "datasets": [s.name for s in train_specs],
        "eval_datasets": [s.name for s in eval_specs],
    }
    return train_store, eval_store, stats


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created when absent), released on exit or process death."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _load(path: Path) -> PreparedData:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    tensors = load_file(str(path))
    stats = json.loads(meta["stats"])
    images = json.loads(meta.get("images", "{}"))
    videos = json.loads(meta.get("videos", "{}"))
    return PreparedData(
        ExampleStore.from_tensors(tensors, "train", images.get("train"), videos.get("train")),
        ExampleStore.from_tensors(tensors, "eval", images.get("eval"), videos.get("eval")),
        stats,
    )


def _run_id() -> str | None:
    """torchrun's id of the current job (shared by its workers), None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


#: Cache keys built (or rebuilt) by this process or an ancestor: inherited by the torchrun workers that
#: ``ferry train`` starts, so that ``overwrite_cache: true`` rebuilds once per launch, not once per process.
BUILT_KEYS_VAR = "FERRY_TOKENIZED_KEYS"


def _built_here(key: str) -> bool:
    return key in os.environ.get(BUILT_KEYS_VAR, "").split(",")


def _mark_built(key: str) -> None:
    keys = [k for k in os.environ.get(BUILT_KEYS_VAR, "").split(",") if k]
    if key not in keys:
        os.environ[BUILT_KEYS_VAR] = ",".join([*keys, key])


def prepare_data(
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cache_dir: str | os.PathLike | None = None,
    overwrite: bool | None = None,
    for_training: bool = True,
) -> PreparedData:
    """Tokenise the config's datasets, or load them from the cache.

    Args:
        cfg: the training config (datasets, template, cutoff_len, packing, val_size, max_samples, seed, ...).
        tokenizer: from :func:`load_tokenizer`.
        cache_dir: cache folder; default ``cfg.tokenized_path`` or ``ferry_cache_dir() / "tokenized"``.
        for_training: the caller goes on to train: with ``do_train: false`` the data is still tokenised (into
            ``tokenized_path``) and then TrainingError is raised, so that such a config never trains; a
            tokenise-only caller (see :func:`trainer.config.tokenize_only`) passes False.
        overwrite: rebuild even when a matching entry exists (default ``cfg.overwrite_cache``). It is ignored
            for an entry that this process or its launcher already built (``$FERRY_TOKENIZED_KEYS``, set here
            and inherited by torchrun workers), and the workers of one torchrun job (same
            ``TORCHELASTIC_RUN_ID``) rebuild at most once between them.

    Returns:
        :class:`PreparedData`; ``stats["cache_hit"]`` says whether it came from the cache.

    Raises:
        NotInstalledError: a dataset or data file is missing.
        DataError: a malformed row (file and row number in the message).
        ConfigError: bad dataset_info.json entry, unusable chat_template, val_size too large.
        TrainingError: no sample has a trainable token; ``do_train: false`` with ``for_training``.
        InsufficientSpaceError: no room for the cache entry.
    """
    started = time.monotonic()
    overwrite = cfg.overwrite_cache if overwrite is None else overwrite
    renderer = resolve_template(cfg, tokenizer)
    train_specs = resolve_datasets(cfg.dataset, cfg.dataset_dir, cfg.stage)
    eval_specs = resolve_datasets(cfg.eval_dataset, cfg.dataset_dir, cfg.stage) if cfg.eval_dataset else []
    image_rows = _image_rows(cfg, tokenizer, renderer, train_specs + eval_specs)
    key = _cache_key(cfg, tokenizer, renderer.name, train_specs, eval_specs, image_rows)
    root = Path(cache_dir if cache_dir is not None else (cfg.tokenized_path or ferry_cache_dir() / "tokenized"))
    path = root / f"{key}.safetensors"

    def finish(data: PreparedData, hit: bool) -> PreparedData:
        data.stats.update(
            cache_path=str(path), cache_key=key, cache_hit=hit, load_seconds=round(time.monotonic() - started, 3)
        )
        if for_training and not cfg.do_train:  # never train a do_train: false config (LLaMA-Factory semantics)
            raise TrainingError(
                f"do_train: false: the data is tokenised into {path} and nothing is trained (set do_train: true, "
                f"or leave it out, to train from it)"
            )
        return data

    if overwrite and _built_here(key):
        overwrite = False
    if path.is_file() and not overwrite:
        return finish(_load(path), True)
    with _file_lock(root / f"{key}.lock"):
        if path.is_file():
            if not overwrite:
                return finish(_load(path), True)  # another process built it while we waited
            data = _load(path)
            if _run_id() is not None and data.stats.get("run_id") == _run_id():
                return finish(data, True)  # a sibling worker already rebuilt it for this job
        data = _build_into(path, cfg, tokenizer, renderer, train_specs, eval_specs, image_rows, started=started)
        _mark_built(key)
        return finish(data, False)


def _cache_key(
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    template_name: str,
    train_specs: list[DatasetSpec],
    eval_specs: list[DatasetSpec],
    image_rows: ImageRows | None = None,
) -> str:
    """The cache entry's name: 32 hex digits of the SHA-256 of the cache format, the tokenizer, the data files
    and every setting that changes the tokenised examples (with image rows: the image processing, the media folder's
    location and the contents of every image the rows name). The files' digests are remembered while their size,
    modification time and inode stay the same (:func:`ferry.digests.data_digests`), so a start reads no file it read
    before."""
    settings = (
        "stage", "cutoff_len", "packing", "neat_packing", "preprocessing_batch_size", "max_samples", "val_size",
        "seed", "train_on_prompt", "mask_history", "default_system", "enable_thinking", "tool_format",
    )  # fmt: skip
    digests = data_digests()  # the launcher and each worker of every run compute the key: read each file once
    key_material = {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "train": _specs_fingerprint(train_specs, digests),
        "eval": _specs_fingerprint(eval_specs, digests),
        "template": template_name,
        "settings": {k: getattr(cfg, k) for k in settings},
    }
    if image_rows is not None:
        key_material["images"] = {  # the entry stores the images' paths: a moved folder is another entry
            "processing": image_rows.fingerprint(),
            "media_dir": str(image_rows.media_dir.resolve()),
            "files": _image_hashes(train_specs + eval_specs, image_rows.media_dir, digests),
            "videos": _image_hashes(train_specs + eval_specs, image_rows.media_dir, digests, "videos"),
        }
    with contextlib.suppress(OSError):  # a read-only cache folder costs the next start the hashing, nothing else
        digests.save()
    return hashlib.sha256(json.dumps(key_material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _image_rows(
    cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, renderer: _Renderer, specs: list[DatasetSpec]
) -> ImageRows | None:
    """The image (and video) processing for datasets that declare an ``images`` (``videos``) column (None when
    none does).

    Raises:
        ConfigError: image rows with stage pt, video rows with a stage other than sft, either with a template that
            has no image slots or a model folder that has no Qwen-VL image (video) processor; video rows where
            torchvision or PyAV does not import.
    """
    declared = [spec.name for spec in specs if spec.columns.get("images")]
    with_videos = [spec.name for spec in specs if spec.columns.get("videos")]
    if not declared and not with_videos:
        return None
    where = f"dataset {declared[0]!r} has an images column" if declared else ""
    if with_videos:
        where = f"dataset {with_videos[0]!r} has a videos column"
        if cfg.stage != "sft":
            raise ConfigError(f"{where}: video rows train with stage sft, not stage {cfg.stage}")
    if cfg.stage == "pt":
        raise ConfigError(f"{where}: stage pt trains text rows only; image rows train with stage sft, dpo, kto or rm")
    slots = IMAGE_TEMPLATES.get(renderer.name) if renderer.template is not None else None
    if slots is None:
        raise ConfigError(
            f"{where}, but template {renderer.name!r} has no image slots: set template: to the model's, one of "
            f"{', '.join(IMAGE_TEMPLATES)}"
        )
    from ferry.hub import resolve_model

    model_dir = Path(resolve_model(cfg.model_name_or_path, cfg.model_revision))
    processing = ImageProcessing(model_dir, cfg.image_max_pixels, cfg.image_min_pixels) if declared else None
    videos = None
    if with_videos:
        from trainer.video import VideoProcessing

        try:
            videos = VideoProcessing(
                model_dir, cfg.video_max_pixels, cfg.video_min_pixels, cfg.video_fps, cfg.video_maxlen
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return ImageRows(processing, Path(cfg.media_dir or cfg.dataset_dir), slots, tokenizer, videos)


def _image_hashes(
    specs: list[DatasetSpec], media_dir: Path, digests: DigestCache, column: str = "images"
) -> dict[str, str]:
    """SHA-256 of every image (``column``: or video) file the rows of ``specs`` name, through ``digests`` (entries
    that name no file are left to the build, which refuses them naming the row)."""
    out: dict[str, str] = {}
    for spec in specs:
        if not spec.columns.get(column):
            continue
        for entry in _media_entries(spec, spec.columns[column], digests):
            if entry not in out:
                path = Path(entry) if os.path.isabs(entry) else media_dir / entry
                out[entry] = digests.digest(path) if path.is_file() else "missing"
    return out


def _media_entries(spec: DatasetSpec, column: str, digests: DigestCache) -> list[str]:
    """The distinct file paths the rows of ``spec`` name in ``column``, in row order. Remembered per content (the
    spec's description, its files' SHA-256 from ``digests``, the column) in ``$FERRY_CACHE/media-entries``, so a
    start whose data files did not change parses no row (a cache hit reads no data file at all)."""
    described = spec.describe()
    described["files"] = [digests.digest(Path(f)) for f in spec.files]
    key = hashlib.sha256(json.dumps([described, column], sort_keys=True, default=str).encode()).hexdigest()
    memo = ferry_cache_dir() / "media-entries" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError):
        remembered = json.loads(memo.read_text(encoding="utf-8"))
        if isinstance(remembered, list) and all(isinstance(e, str) for e in remembered):
            return remembered
    entries: dict[str, None] = {}
    for _, row, _ in iter_rows(dataclasses.replace(spec, num_samples=None)):
        value = row.get(column)
        for entry in value if isinstance(value, list) else [value]:
            if isinstance(entry, str) and entry:
                entries.setdefault(entry)
    with contextlib.suppress(OSError):  # a read-only cache folder costs the next start the parsing, nothing else
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(memo, json.dumps(list(entries)).encode())
    return list(entries)


def _build_into(
    path: Path,
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    renderer: _Renderer,
    train_specs: list[DatasetSpec],
    eval_specs: list[DatasetSpec],
    image_rows: ImageRows | None = None,
    *,
    started: float,
) -> PreparedData:
    """Tokenise the datasets and write them to the cache entry ``path`` atomically (safetensors, the stats in
    its metadata).

    Raises:
        InsufficientSpaceError: no room for the entry (checked before writing).
    """
    train, evals, stats = _build(cfg, tokenizer, renderer, train_specs, eval_specs, image_rows)
    stats.update(build_id=uuid.uuid4().hex, run_id=_run_id(), build_seconds=round(time.monotonic() - started, 3))
    tensors = {**train.tensors("train"), **evals.tensors("eval")}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    ensure_free_space(path.parent, nbytes + (1 << 20), what=f"the tokenised dataset cache {path}")
    from safetensors.torch import save

    metadata = {"format": CACHE_FORMAT, "stats": json.dumps(stats)}
    images = {side: store.images for side, store in (("train", train), ("eval", evals)) if store.images is not None}
    if images:
        metadata["images"] = json.dumps(images)
    videos = {side: store.videos for side, store in (("train", train), ("eval", evals)) if store.videos is not None}
    if videos:
        metadata["videos"] = json.dumps(videos)
    blob = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    atomic_write_bytes(path, blob)
    logger.info(
        "tokenised %d samples (%d dropped, %d truncated) into %s in %.1f s",
        stats["num_samples"],
        stats["num_dropped_no_trainable"],
        stats["num_truncated"],
        path,
        stats["build_seconds"],
    )
    return PreparedData(train, evals, stats)


__all__ = [
    "Example",
    "ExampleStore",
    "PreparedData",
    "load_tokenizer",
    "prepare_data",
    "pack_examples",
    "pack_lengths",
    "infer_seqlen",
    "build_example",
    "resolve_template",
    "encode_pairs_builtin",
    "encode_pairs_chat_template",
    "tokenizer_fingerprint",
]
