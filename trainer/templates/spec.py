"""The schema of a built-in chat template: what each role's turn looks like, how replies end, where tools go.

A template is data (:class:`Spec`); :mod:`trainer.templates.catalog` holds one entry per template and
:mod:`trainer.templates.render` turns a conversation into token ids with it. A *layout* is the text of one turn
as a sequence of pieces:

    "text with {content}"   literal text; ``{content}`` is replaced by the message (once). Each text piece is
                            tokenised on its own, so where a layout is cut into pieces changes the ids.
    BOS / EOS               the tokenizer's BOS / EOS id (nothing when the tokenizer has none)
    Tok("<|user|>")         the id of that token, looked up in the vocabulary (never split by the tokenizer)

A layout given as one string is one text piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class _Marker:
    """BOS or EOS in a layout."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


BOS = _Marker("BOS")
EOS = _Marker("EOS")


@dataclass(frozen=True)
class Tok:
    """One vocabulary token, written by its text (``Tok("<|user|>")``)."""

    text: str


Piece = str | _Marker | Tok
Layout = tuple[Piece, ...]

#: The placeholder a layout's text pieces carry for the message.
CONTENT = "{content}"


def as_layout(value: str | Layout | None) -> Layout | None:
    """A layout from a string (one text piece) or a tuple of pieces; None stays None."""
    if value is None or isinstance(value, tuple):
        return value
    return (value,)


def fill(layout: Layout, content: str = "") -> list[Piece]:
    """The layout's pieces with the first ``{content}`` of each text piece replaced by ``content``."""
    return [p.replace(CONTENT, content, 1) if isinstance(p, str) else p for p in layout]


@dataclass(frozen=True)
class Spec:
    """One built-in chat template.

    Roles: ``system`` (the system prompt, with the tools text appended), ``user``, ``assistant`` (a reply),
    ``observation`` (a tool result), ``call`` (an assistant turn that calls tools: the layout around the tool
    format's rendering of the calls). ``prefix`` opens the conversation (e.g. BOS).

    Attributes:
        name: the template name (LLaMA-Factory's, so its users' ``template:`` keys work unchanged).
        user: default ``"{content}"``.
        assistant: default ``("{content}", EOS)``, or ``"{content}"`` with ``efficient_eos``.
        system: default ``"{content}"`` (not the user layout).
        observation: default: the user layout.
        call: default: the assistant layout.
        prefix: default: nothing.
        tools: the tool format (:mod:`trainer.templates.tools`) of the tools list and of the calls.
        raw_tools: a layout that carries the tools list as the raw JSON text instead of the tool format's
            rendering (the calls still use ``tools``).
        default_system: the system prompt when the conversation has none.
        stop: the strings that end a reply; with ``replace_eos`` the first one becomes the EOS token, the
            others are registered as special tokens.
        replace_eos: see ``stop``.
        efficient_eos: replies carry no EOS; one EOS ends the whole sequence, and each later prompt starts with
            the EOS the previous reply was trained to produce.
        thinking: reasoning templates: ``"block"`` adds an empty ``think_tags`` block to a reply without one
            (trained when ``enable_thinking``, else part of the prompt); ``"close"`` writes only the closing tag
            for an empty block (GLM-4.7).
        think_tags: the (open, close) texts of a reasoning block.
        call_tags: the (open, close) texts around calls inside a call turn's content.
        system_in_user: the system text is written at the start of the first user message (Llama-2 style).
        multimodal: LLaMA-Factory registers image/video/audio handling for it; ferry trains its text.
    """

    name: str
    user: str | Layout = CONTENT
    assistant: str | Layout | None = None
    system: str | Layout = CONTENT
    observation: str | Layout | None = None
    call: str | Layout | None = None
    prefix: str | Layout = ()
    tools: str = "default"
    raw_tools: str | Layout | None = None
    default_system: str = ""
    stop: tuple[str, ...] = ()
    replace_eos: bool = False
    efficient_eos: bool = False
    thinking: Literal["block", "close"] | None = None
    think_tags: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>")
    system_in_user: bool = False
    multimodal: bool = False
    _resolved: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def layout(self, role: str) -> Layout:
        """The resolved layout of ``role`` (``prefix``, ``system``, ``user``, ``assistant``, ``observation``,
        ``call``), defaults applied."""
        if role not in self._resolved:
            reply = as_layout(self.assistant) or ((CONTENT,) if self.efficient_eos else (CONTENT, EOS))
            table = {
                "prefix": as_layout(self.prefix),
                "system": as_layout(self.system),
                "user": as_layout(self.user),
                "assistant": reply,
                "observation": as_layout(self.observation) or as_layout(self.user),
                "call": as_layout(self.call) or reply,
            }
            self._resolved.update(table)
        return self._resolved[role]
