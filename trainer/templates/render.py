"""Rendering a conversation with a built-in template: one (prompt ids, reply ids) pair per exchange.

A conversation is a list of messages ``{"role", "content"}`` with roles ``user`` / ``observation`` (a tool
result) at even positions and ``assistant`` / ``function`` (a tool call, its content the JSON of
``{"name", "arguments"}`` or a list of them) at odd positions: LLaMA-Factory's message form, which every dataset
format of :mod:`trainer.formats` becomes. The first message carries the template's prefix and the system prompt
(with the tools text appended)::

    pair 0:  prefix  system(+tools)  user-1        ->  reply-1   (assistant, or function call)
    pair t:  user-t (or observation-t)             ->  reply-t

Text pieces are tokenised one by one with ``tokenizer.encode(text, add_special_tokens=False)``; ``Tok`` pieces
are looked up with ``convert_tokens_to_ids``; BOS / EOS are the tokenizer's ids. :class:`TextIds` stands in for
a tokenizer whose "ids" are the texts, which renders a conversation as text.

Reasoning templates (``Spec.thinking``) give a reply that has no reasoning block an empty one: trained as part of
the reply when ``enable_thinking`` is on, written at the end of the prompt otherwise. With ``enable_thinking``
off, replies lose their reasoning blocks; with ``mask_history`` (only the last reply trained) earlier replies lose
theirs unless ``preserve_thinking``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trainer.templates.spec import BOS, CONTENT, EOS, Layout, Piece, Spec, Tok, fill
from trainer.templates.tools import ToolFormat, tool_format

USER, ASSISTANT, OBSERVATION, FUNCTION, SYSTEM = "user", "assistant", "observation", "function", "system"

Pairs = list[tuple[list[Any], list[Any]]]


class TextIds:
    """A stand-in tokenizer whose ids are texts: rendering with it gives lists of strings whose concatenation is
    the text. BOS / EOS are written as ``bos_token`` / ``eos_token`` (nothing when None)."""

    def __init__(self, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.bos_token_id, self.eos_token_id = bos_token, eos_token

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return [text] if text else []

    def convert_tokens_to_ids(self, token: str) -> str:
        return token


@dataclass(frozen=True)
class Template:
    """A built-in template configured for one run (see :func:`trainer.templates.get_template`).

    Attributes:
        spec: the catalog entry.
        default_system: the system prompt when a conversation has none.
        tools: the tool format of the tools list and the calls.
        call: the layout around a call turn's text.
        raw_tools: a layout that writes the tools list's JSON text as it is (instead of the tool format).
        enable_thinking: reasoning templates: train the (possibly empty) reasoning block with the reply.
        preserve_thinking: keep earlier replies' reasoning under ``mask_history``.
    """

    spec: Spec
    default_system: str
    tools: ToolFormat
    call: Layout
    raw_tools: Layout | None = None
    enable_thinking: bool | None = True
    preserve_thinking: bool = False

    # -- what the data pipeline and the tokenizer set-up read

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stop_words(self) -> list[str]:
        return list(self.spec.stop)

    @property
    def efficient_eos(self) -> bool:
        return self.spec.efficient_eos

    @property
    def reasoning(self) -> bool:
        return self.spec.thinking is not None

    @property
    def empty_thought(self) -> str:
        """The text of an empty reasoning block ("" for templates without reasoning)."""
        if not self.reasoning:
            return ""
        open_tag, close_tag = self.spec.think_tags
        return close_tag if self.spec.thinking == "close" else open_tag + close_tag

    # -- special tokens

    def special_tokens_needed(self) -> tuple[str | None, list[str]]:
        """``(new_eos, other_stop_words)``: with ``replace_eos`` the first stop word becomes the EOS token; the
        remaining stop words are registered as special tokens.

        Raises:
            ValueError: ``replace_eos`` without stop words.
        """
        stop = list(self.spec.stop)
        if not self.spec.replace_eos:
            return None, stop
        if not stop:
            raise ValueError(f"template {self.name!r} replaces EOS but names no stop word")
        return stop[0], stop[1:]

    def fix_special_tokens(self, tokenizer: Any) -> None:
        """Give ``tokenizer`` the template's special tokens, in place: EOS becomes the first stop word
        (``replace_eos``), ``<|endoftext|>`` when the tokenizer has no EOS at all, pad falls back to EOS, and the
        other stop words are added as additional special tokens (keeping the existing ones)."""
        new_eos, others = self.special_tokens_needed()
        if new_eos is not None and tokenizer.eos_token != new_eos:
            tokenizer.add_special_tokens({"eos_token": new_eos})
        if tokenizer.eos_token_id is None:
            tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if others:
            try:
                tokenizer.add_special_tokens(
                    {"additional_special_tokens": others}, replace_additional_special_tokens=False
                )
            except TypeError:  # a tokenizer without that keyword keeps the existing ones anyway
                tokenizer.add_special_tokens({"additional_special_tokens": others})

    # -- reasoning blocks

    def has_thought(self, content: str) -> bool:
        """Whether ``content`` carries either tag of a reasoning block (stripped of its newlines)."""
        open_tag, close_tag = self.spec.think_tags
        return open_tag.strip() in content or close_tag.strip() in content

    def strip_thoughts(self, content: str) -> str:
        """``content`` without its reasoning blocks, leading newlines dropped."""
        open_tag, close_tag = self.spec.think_tags
        return re.sub(re.escape(open_tag) + ".*?" + re.escape(close_tag), "", content, flags=re.DOTALL).lstrip("\n")

    # -- rendering

    def tools_text(self, tools: str) -> str:
        """The text appended to the system prompt for ``tools`` (a JSON list of function schemas); templates with
        ``raw_tools`` write the JSON text as it is.

        Raises:
            ValueError: ``tools`` is not a JSON list, or the tool format cannot read a schema.
        """
        if self.raw_tools is not None:  # the JSON text itself, inside the layout's first piece
            head = fill(self.raw_tools, tools)[0]
            return head if isinstance(head, str) else ""
        try:
            parsed = json.loads(tools)
        except ValueError as exc:
            raise ValueError(f"tools are not JSON ({exc}): {tools[:80]!r}") from None
        if not isinstance(parsed, list):
            raise ValueError(f"tools must be a JSON list of function schemas, got {type(parsed).__name__}")
        try:
            return self.tools.tools_text(parsed)
        except (KeyError, TypeError, AttributeError) as exc:  # a schema the format cannot read
            raise ValueError(f"the {self.tools.name} tool format cannot read these tools ({exc!r})") from None

    def call_text(self, content: str, *, tagged: bool = True) -> str:
        """The reply text of a function turn: ``content`` is the JSON of the calls (``{"name", "arguments"}`` or
        a list), possibly with a reasoning block before it or the calls between ``call_tags``; that other text
        is kept in front of the tool format's rendering of the calls. ``tagged`` False (Llama-2 style
        templates) reads the whole content as JSON.

        Raises:
            ValueError: the calls are not JSON of that shape, or the tool format cannot write them.
        """
        before, body = "", content
        if tagged:
            found = _between(content, self.spec.call_tags)
            if found is not None:
                before, body = content.replace(found[0], ""), found[1]
            else:
                thought = _between(content, self.spec.think_tags)
                if thought is not None:
                    before, body = thought[0], content.replace(thought[0], "")
        try:
            parsed = json.loads(body)
        except ValueError:
            raise ValueError(f"a function call that is not JSON: {content[:80]!r}") from None
        calls = parsed if isinstance(parsed, list) else [parsed]
        try:
            pairs = [(c["name"], c["arguments"]) for c in calls]
        except (KeyError, TypeError):
            raise ValueError(f"a function call needs 'name' and 'arguments': {content[:80]!r}") from None
        return before + self.tools.calls_text(pairs)

    def turn_pieces(
        self, messages: list[dict[str, str]], system: str | None = None, tools: str | None = None
    ) -> list[list[Piece]]:
        """The pieces of each message, in order: the first message opens with the prefix and the system text
        (``system`` or the default, plus the tools text) unless the template writes it into the first user
        message.

        Raises:
            ValueError: an unknown role, or tool JSON that cannot be rendered.
        """
        spec = self.spec
        system = system or self.default_system
        out: list[list[Piece]] = []
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            pieces: list[Piece] = []
            lead = ""
            if i == 0:
                pieces += spec.layout("prefix")
                if system or tools:
                    text = system + (self.tools_text(tools) if tools else "")
                    if spec.system_in_user:
                        first = fill(spec.layout("system"), text)[0]
                        lead = first if isinstance(first, str) else ""
                    else:
                        pieces += fill(spec.layout("system"), text)
            if role == USER:
                pieces += fill(spec.layout("user"), lead + content)
            elif role == ASSISTANT:
                pieces += fill(spec.layout("assistant"), content)
            elif role == OBSERVATION:
                pieces += fill(spec.layout("observation"), content)
            elif role == FUNCTION:
                pieces += fill(self.call, self.call_text(content, tagged=not spec.system_in_user))
            else:
                raise ValueError(f"unknown role {role!r} (expected user, assistant, observation or function)")
            out.append(pieces)
        return out

    def encode_multiturn(
        self,
        tokenizer: Any,
        messages: list[dict[str, str]],
        system: str | None = None,
        tools: str | None = None,
        drop_past_thoughts: bool = False,
    ) -> Pairs:
        """``(prompt_ids, reply_ids)`` per exchange of ``messages`` (even length, user/observation first).

        ``system`` falls back to the template's default; ``tools`` is the JSON list of function schemas.
        ``drop_past_thoughts`` (``mask_history`` without ``preserve_thinking``): earlier replies lose their
        reasoning blocks and only the last reply gets an empty one.

        Raises:
            ValueError: see :meth:`turn_pieces`.
        """
        messages = [dict(m) for m in messages]
        last = len(messages) - 1
        if self.reasoning:
            for i in range(1, len(messages), 2):
                if self.enable_thinking is False or (drop_past_thoughts and i != last):
                    messages[i]["content"] = self.strip_thoughts(messages[i]["content"])
        ids = [self._ids(tokenizer, p) for p in self.turn_pieces(messages, system, tools)]
        if self.reasoning:
            empty = tokenizer.encode(self.empty_thought, add_special_tokens=False)
            for r in [last] if drop_past_thoughts else range(1, len(messages), 2):
                if not self.has_thought(messages[r]["content"]):
                    if self.enable_thinking:
                        ids[r] = list(empty) + ids[r]
                    else:
                        ids[r - 1] = ids[r - 1] + list(empty)
        return [(ids[i], ids[i + 1]) for i in range(0, len(ids) - 1, 2)]

    def encode_oneturn(
        self, tokenizer: Any, messages: list[dict[str, str]], system: str | None = None, tools: str | None = None
    ) -> tuple[list[Any], list[Any]]:
        """``(prompt_ids, reply_ids)`` for the last reply of ``messages``, everything before it as the prompt
        (how generation sees a conversation). Reasoning templates drop earlier replies' reasoning unless
        ``preserve_thinking``."""
        messages = [dict(m) for m in messages]
        last = len(messages) - 1
        if self.reasoning:
            for i in range(1, last - 1, 2):
                if not self.preserve_thinking:
                    messages[i]["content"] = self.strip_thoughts(messages[i]["content"])
            if self.enable_thinking is False:
                messages[last]["content"] = self.strip_thoughts(messages[last]["content"])
        ids = [self._ids(tokenizer, p) for p in self.turn_pieces(messages, system, tools)]
        prompt, reply = [x for turn in ids[:-1] for x in turn], ids[-1]
        if self.reasoning and not self.has_thought(messages[last]["content"]):
            empty = list(tokenizer.encode(self.empty_thought, add_special_tokens=False))
            if self.enable_thinking:
                reply = empty + reply
            else:
                prompt = prompt + empty
        return prompt, reply

    def encode_prompt(
        self, tokenizer: Any, messages: list[dict[str, str]], system: str | None = None, tools: str | None = None
    ) -> list[Any]:
        """The generation prompt's ids for ``messages`` ending with a user/observation turn: what training
        renders before the reply."""
        return self.encode_oneturn(tokenizer, [*messages, {"role": ASSISTANT, "content": ""}], system, tools)[0]

    def render_text(
        self,
        messages: list[dict[str, str]],
        system: str | None = None,
        tools: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        drop_past_thoughts: bool = False,
    ) -> list[tuple[str, str]]:
        """:meth:`encode_multiturn` as text: ``(prompt_text, reply_text)`` per exchange, BOS / EOS written as
        ``bos_token`` / ``eos_token``."""
        pairs = self.encode_multiturn(TextIds(bos_token, eos_token), messages, system, tools, drop_past_thoughts)
        return [("".join(p), "".join(r)) for p, r in pairs]

    @staticmethod
    def _ids(tokenizer: Any, pieces: list[Piece]) -> list[Any]:
        ids: list[Any] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    ids += tokenizer.encode(piece, add_special_tokens=False)
            elif isinstance(piece, Tok):
                ids.append(tokenizer.convert_tokens_to_ids(piece.text))
            elif piece is BOS:
                if tokenizer.bos_token_id is not None:
                    ids.append(tokenizer.bos_token_id)
            elif piece is EOS:
                if tokenizer.eos_token_id is not None:
                    ids.append(tokenizer.eos_token_id)
        return ids


def _layout(value: Any) -> Layout:
    return value if isinstance(value, tuple) else (value,)


def _between(text: str, tags: tuple[str, str]) -> tuple[str, str] | None:
    """``(whole match, inside)`` of the first ``open ... close`` span of ``text`` (shortest), or None."""
    found = re.search(re.escape(tags[0]) + "(.*?)" + re.escape(tags[1]), text, flags=re.DOTALL)
    return (found.group(0), found.group(1)) if found else None


def configure(
    spec: Spec,
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
    tool_format_name: str | None = None,
    preserve_thinking: bool = False,
) -> Template:
    """``spec`` configured by a run's data keys: ``tool_format_name`` replaces the tool format and writes calls
    in the plain reply layout (``{content}`` plus EOS unless ``efficient_eos``), ``default_system`` replaces the
    default system prompt, ``enable_thinking`` / ``preserve_thinking`` apply to reasoning templates.

    Raises:
        ValueError: an unknown tool format.
    """
    fmt = tool_format(spec.tools)
    call = spec.layout("call")
    raw_tools = _layout(spec.raw_tools) if spec.raw_tools is not None else None
    if tool_format_name is not None:
        fmt = tool_format(tool_format_name)
        call = (CONTENT,) if spec.efficient_eos else (CONTENT, EOS)
        raw_tools = None
    reasoning = spec.thinking is not None
    return Template(
        spec=spec,
        default_system=spec.default_system if default_system is None else default_system,
        tools=fmt,
        call=call,
        raw_tools=raw_tools,
        enable_thinking=enable_thinking if reasoning else True,
        preserve_thinking=preserve_thinking if reasoning else False,
    )


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """Share ``budget`` tokens between a prompt of ``source_len`` and a response of ``target_len`` tokens.

    LLaMA-Factory's ``infer_seqlen`` (``src/llamafactory/data/processor/processor_utils.py``), unchanged: a short
    response is kept whole; else a short prompt is kept whole; else both are cut in proportion to their lengths.
    Returns ``(new_source_len, new_target_len)``.
    """
    if target_len * 2 < budget:
        max_target = budget
    elif source_len * 2 < budget:
        max_target = budget - source_len
    else:
        max_target = int(budget * (target_len / (source_len + target_len)))
    new_target = min(max_target, target_len)
    new_source = min(max(budget - new_target, 0), source_len)
    return new_source, new_target
