"""The chat template that ships with an adapter and an export: a built-in template written as Jinja.

``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)`` with the written template
gives the text training put before a reply (prefix, system prompt or the default one, the tools text, earlier
turns with their end markers, the reasoning templates' empty blocks where training had them), so transformers,
vLLM and TGI prompt the model as it was trained. The tool format's macros are pasted in from
:mod:`trainer.templates.tools`, the same source training renders, so tools and calls cannot drift apart.

Messages it reads, in the forms serving stacks send:

    {"role": "system", "content": ...}                      first message only
    {"role": "user", "content": ...}
    {"role": "assistant", "content": ... or None or "",     a reply; with tool_calls, the calls after the content
     "tool_calls": [{"type": "function", "function": {"name": ..., "arguments": {...} or "<json>"}}]}
    {"role": "tool" | "observation", "content": ...}        a tool result; consecutive results form one turn,
                                                            joined as ferry's OpenAI-format reader joins them
    {"role": "function", "content": {...} or [{...}]}       LLaMA-Factory's call turn, the calls as objects

Contents are strings or lists of text parts. A ``function`` turn whose content is a JSON *string* is refused
(Jinja cannot parse JSON; send ``tool_calls`` or the object).
"""

from __future__ import annotations

import json
from typing import Any

from trainer.templates.images import IMAGE_TEMPLATES
from trainer.templates.render import Template
from trainer.templates.spec import BOS, CONTENT, EOS, Layout, Tok

#: How consecutive tool results are joined into one observation turn (LLaMA-Factory's OpenAI-format reader,
#: which :mod:`trainer.formats` follows).
TOOL_RESULTS_JOIN = "\n</tool_response>\n<tool_response>\n"


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def layout_expr(layout: Layout, content: str, *, bos: str | None, eos: str | None) -> str:
    """A Jinja expression that writes ``layout`` with ``content`` (a Jinja expression) for ``{content}``."""
    parts: list[str] = []
    for piece in layout:
        if isinstance(piece, str):
            if CONTENT in piece:
                head, tail = piece.split(CONTENT, 1)
                parts += [_q(head)] if head else []
                parts.append(f"({content})")
                parts += [_q(tail)] if tail else []
            elif piece:
                parts.append(_q(piece))
        elif isinstance(piece, Tok):
            parts.append(_q(piece.text))
        elif piece is BOS and bos is not None:
            parts.append(_q(bos))
        elif piece is EOS and eos is not None:
            parts.append(_q(eos))
    return " ~ ".join(parts) if parts else '""'


_HELPERS = r"""
{%- macro ferry_text(c) -%}
{%- if c is none -%}{{- "" -}}
{%- elif c is string -%}{{- c -}}
{%- else -%}{%- for part in c -%}
{%- if part is mapping and part.get("type", "text") == "text" -%}{{- part["text"] -}}
IMAGE_SLOT{%- else -%}{{- raise_exception("this chat template renders text only, not a content part of type "
    ~ (part.get("type") if part is mapping else part)) -}}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
"""


def _helpers(name: str) -> str:
    """ferry's macros for template ``name``: ``ferry_text`` joins a content's text parts and, for a template with
    image slots, writes an ``image`` / ``image_url`` part as one slot (``<|vision_start|><|image_pad|><|vision_end|>``,
    which transformers' and vLLM's Qwen-VL processors expand to the image's tokens, as training expanded its
    ``<image>``) and a ``video`` / ``video_url`` part as ``<|vision_start|><|video_pad|><|vision_end|>`` (the
    processors expand the pad to the video's tokens), for templates with per-frame times as ``<|video_pad|>`` alone
    (transformers' Qwen3-VL processor replaces it with each frame's time and slot, the layout training wrote); any
    other part is refused."""
    slots = IMAGE_TEMPLATES.get(name)
    image = ""
    if slots is not None:
        # per-frame times (Qwen3-VL): transformers' processor writes each frame's slot, behind its time, for the pad
        video = slots.video if slots.timestamps else slots.bos + slots.video + slots.eos
        image = "".join(
            f'{{%- elif part is mapping and part.get("type") in ("{kind}", "{kind}_url") -%}}{{{{- '
            + _q(text)
            + " -}}\n"
            for kind, text in (("image", slots.bos + slots.token + slots.eos), ("video", video))
        )
    return _HELPERS.replace("IMAGE_SLOT", image).strip()


def chat_template_jinja(
    template: Template, *, bos_token: str | None, eos_token: str | None, mask_history: bool = False
) -> str:
    """The Jinja chat template of ``template`` (see the module docstring), as one string ending in a newline.

    ``bos_token`` / ``eos_token``: the tokenizer's texts after :meth:`Template.fix_special_tokens`, written
    literally. ``mask_history``: the run trained only the last reply (``mask_history`` without
    ``preserve_thinking``): earlier replies are written without their reasoning blocks, as training saw them.
    The template has three parts: :func:`_collect_turns_jinja`, :func:`_system_jinja` and :func:`_turns_jinja`.
    """
    ev = {"bos": bos_token, "eos": eos_token}
    drop = bool(mask_history and template.reasoning and not template.preserve_thinking)
    lines = _collect_turns_jinja(template) + _system_jinja(template, ev) + _turns_jinja(template, ev, drop)
    return "\n".join(lines) + "\n"


def _collect_turns_jinja(template: Template) -> list[str]:
    """Part 1: the header, the tool format's and ferry's macros, then the system prompt and the conversation's
    turns into ``ns`` (tool results merged into one observation turn, calls normalised)."""
    open_tag, close_tag = template.spec.think_tags
    return [
        "{#- Written by ferry: the built-in chat template " + _q(template.spec.name) + " as training rendered it. -#}",
        template.tools.source.strip(),
        _helpers(template.spec.name),
        _strip_macro(open_tag, close_tag),
        "{%- set ns = namespace(system=" + _q(template.default_system) + ", turns=[]) -%}",
        "{%- for message in messages -%}",
        "{%- set role = message['role'] -%}",
        "{%- if loop.first and role == 'system' -%}{%- set ns.system = ferry_text(message['content']) or ns.system -%}",
        "{%- elif role == 'tool' or role == 'observation' -%}",
        "{%- set text = ferry_text(message['content']) -%}",
        "{%- if ns.turns and ns.turns[-1]['role'] == 'observation' -%}"
        "{%- set ns.turns = ns.turns[:-1] + [{'role': 'observation', 'content': ns.turns[-1]['content'] ~ "
        + _q(TOOL_RESULTS_JOIN)
        + " ~ text}] -%}"
        "{%- else -%}{%- set ns.turns = ns.turns + [{'role': 'observation', 'content': text}] -%}{%- endif -%}",
        "{%- elif (role == 'assistant' or role == 'function') and message.get('tool_calls') -%}",
        "{%- set calls = namespace(items=[]) -%}",
        "{%- for tc in message['tool_calls'] -%}{%- set f = tc['function'] if tc.get('function') is mapping else tc -%}"
        "{%- set calls.items = calls.items + [{'name': f['name'], 'arguments': f.get('arguments', {}), "
        "'encoded': f.get('arguments') is string}] -%}{%- endfor -%}",
        "{%- set ns.turns = ns.turns + [{'role': 'call', 'content': ferry_text(message.get('content')), "
        "'calls': calls.items}] -%}",
        "{%- elif role == 'function' -%}",
        "{%- set c = message['content'] -%}",
        "{%- if c is string -%}{{- raise_exception('a function turn must carry its calls as tool_calls or as a "
        "JSON object, not as a string (a chat template cannot parse JSON)') -}}{%- endif -%}",
        "{%- set ns.turns = ns.turns + [{'role': 'call', 'content': '', 'calls': [c] if c is mapping else c}] -%}",
        "{%- elif role == 'user' or role == 'assistant' -%}",
        "{%- set ns.turns = ns.turns + [{'role': role, 'content': ferry_text(message['content'])}] -%}",
        "{%- else -%}{{- raise_exception('role ' ~ role ~ ' is not rendered by this chat template') -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
    ]


def _strip_macro(open_tag: str, close_tag: str) -> str:
    """The ``ferry_strip(c)`` macro: ``c`` without its reasoning blocks (``open_tag`` ... ``close_tag``), leading
    newlines dropped."""
    macro = (
        "{%- macro ferry_strip(c) -%}{%- set st = namespace(out='', rest=c) -%}{%- for _ in range(c.count(@OPEN@)) -%}"
        "{%- if @OPEN@ in st.rest and @CLOSE@ in st.rest.split(@OPEN@, 1)[1] -%}"
        "{%- set st.out = st.out ~ st.rest.split(@OPEN@, 1)[0] -%}"
        "{%- set st.rest = st.rest.split(@OPEN@, 1)[1].split(@CLOSE@, 1)[1] -%}"
        "{%- endif -%}{%- endfor -%}{{- (st.out ~ st.rest).lstrip('\\n') -}}{%- endmacro -%}"
    )
    return macro.replace("@OPEN@", _q(open_tag)).replace("@CLOSE@", _q(close_tag))


def _system_jinja(template: Template, ev: dict[str, str | None]) -> list[str]:
    """Part 2: the prefix and the system text with the tools (in the first user turn for templates that put
    the system prompt there: ``lead``)."""
    spec = template.spec
    if template.raw_tools is not None:
        tools_expr = layout_expr(template.raw_tools[:1], "tools | tojson", bos=None, eos=None)
    else:
        tools_expr = "ferry_tools_text(tools)"
    lines = [
        "{%- set tools_text = (" + tools_expr + ") if tools else '' -%}",
        "{{- " + layout_expr(spec.layout("prefix"), "''", **ev) + " -}}",
        "{%- set lead = '' -%}",
        "{%- if ns.system or tools -%}",
    ]
    if spec.system_in_user:
        first = spec.layout("system")[:1]
        lines.append("{%- set lead = " + layout_expr(first, "ns.system ~ tools_text", bos=None, eos=None) + " -%}")
    else:
        lines.append("{{- " + layout_expr(spec.layout("system"), "ns.system ~ tools_text", **ev) + " -}}")
    lines.append("{%- endif -%}")
    return lines


def _turns_jinja(template: Template, ev: dict[str, str | None], drop: bool) -> list[str]:
    """Part 3: the turns, each in its layout; the reasoning templates' empty blocks where training had them and
    earlier replies' reasoning dropped when ``drop`` (``mask_history`` trained the last reply only)."""
    spec = template.spec
    open_tag, close_tag = spec.think_tags
    empty = template.empty_thought
    after_prompt = ""
    if template.reasoning and not template.enable_thinking:
        cond = "loop.last" if drop else "true"
        after_prompt = "{%- if " + cond + " -%}{{- " + _q(empty) + " -}}{%- endif -%}"
    reply_prep = "{%- set c = turn['content'] -%}"
    if template.reasoning:
        if template.enable_thinking is False or drop:
            reply_prep += "{%- set c = ferry_strip(c) -%}"
        if template.enable_thinking and not drop:
            reply_prep += (
                "{%- if not ("
                + _q(open_tag.strip())
                + " in c or "
                + _q(close_tag.strip())
                + " in c) -%}{{- "
                + _q(empty)
                + " -}}{%- endif -%}"
            )
    user_content = "(lead ~ turn['content']) if loop.first else turn['content']"
    return [
        "{%- for turn in ns.turns -%}",
        "{%- if turn['role'] == 'user' -%}{{- "
        + layout_expr(spec.layout("user"), user_content, **ev)
        + " -}}"
        + after_prompt,
        "{%- elif turn['role'] == 'observation' -%}{{- "
        + layout_expr(spec.layout("observation"), "turn['content']", **ev)
        + " -}}"
        + after_prompt,
        "{%- elif turn['role'] == 'assistant' -%}"
        + reply_prep
        + "{{- "
        + layout_expr(spec.layout("assistant"), "c", **ev)
        + " -}}",
        "{%- else -%}"
        + reply_prep
        + "{{- "
        + layout_expr(template.call, "c ~ ferry_calls_text(turn['calls'])", **ev)
        + " -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
    ]


def training_prompt_text(
    template: Template,
    messages: list[dict[str, Any]],
    system: str | None = None,
    tools: str | None = None,
    *,
    bos_token: str | None,
    eos_token: str | None,
    mask_history: bool = False,
) -> str:
    """The text training rendered before the LAST reply of ``messages`` (LLaMA-Factory message form, ending
    with an assistant or function turn): what :func:`chat_template_jinja` must write with
    ``add_generation_prompt=True`` for the conversation without that reply."""
    drop = mask_history and not template.preserve_thinking
    pairs = template.render_text(
        messages, system, tools, bos_token=bos_token, eos_token=eos_token, drop_past_thoughts=drop
    )
    return "".join(p + r for p, r in pairs[:-1]) + pairs[-1][0]


def write_chat_template(template: Template, tokenizer: Any, *, mask_history: bool = False) -> str:
    """Set ``tokenizer.chat_template`` to :func:`chat_template_jinja` of ``template`` (with the tokenizer's BOS
    and EOS texts) and return it, so that ``tokenizer.save_pretrained`` writes ``chat_template.jinja`` into the
    adapter folder: the served prompt is the trained one."""
    jinja = chat_template_jinja(
        template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, mask_history=mask_history
    )
    tokenizer.chat_template = jinja
    tokenizer.ferry_chat_template = (template.name, jinja)  # lets trainer.data tell it from a model's own
    return jinja
