"""Chat templates: how a conversation becomes the token ids a model trains on, and the chat template it ships.

The package, by concern:

    spec.py     the schema of a template (role layouts, stop words, EOS policy, reasoning, tool format)
    catalog.py  the built-in templates, one entry each (LLaMA-Factory's 121 names and texts)
    tools.py    the tool-calling formats, each written once as Jinja macros (training and serving share them)
    render.py   a configured template renders a conversation into (prompt ids, reply ids) per exchange
    jinja.py    the chat template written into the adapter and the export

Defining a template: add a :class:`~trainer.templates.spec.Spec` to ``catalog.py``; a new tool format: add a
:class:`~trainer.templates.tools.ToolFormat` to ``tools.py``. ``ferry train --templates`` lists them all.
"""

from __future__ import annotations

import difflib
from typing import Any

from trainer.templates.catalog import CATALOG, FAMILY_TEMPLATES
from trainer.templates.jinja import chat_template_jinja, training_prompt_text, write_chat_template
from trainer.templates.render import ASSISTANT, FUNCTION, OBSERVATION, SYSTEM, USER, Template, TextIds, configure
from trainer.templates.spec import Spec
from trainer.templates.tools import TOOL_FORMATS, tool_format

#: Every built-in template by name, in the order ``ferry train --templates`` lists them.
TEMPLATES: dict[str, Spec] = {spec.name: spec for spec in CATALOG}

#: Templates that LLaMA-Factory pairs with image / video / audio processing (ferry trains their text).
MULTIMODAL_TEMPLATES = frozenset(name for name, spec in TEMPLATES.items() if spec.multimodal)


def template_names() -> list[str]:
    """Every built-in template name, in catalog order."""
    return list(TEMPLATES)


def suggest_templates(name: str, model_type: str | None = None) -> list[str]:
    """Built-in names to suggest for an unknown ``name``: those of the model's family (from its config.json
    ``model_type``) first, then the nearest by spelling that do not contradict the family (a Qwen3 model is
    never offered ``qwen``)."""
    family = list(FAMILY_TEMPLATES.get(model_type or "", ()))
    near = difflib.get_close_matches(name, list(TEMPLATES), n=3, cutoff=0.6)
    if family:
        near = [n for n in near if any(n.startswith(f) or f.startswith(n + "_") for f in family) and n not in family]
    return family + [n for n in near if n not in family]


def unknown_template_message(name: str, model_type: str | None = None) -> str:
    """One line: the template name is unknown, with suggestions (see :func:`suggest_templates`)."""
    hints = suggest_templates(name, model_type)
    hint = f" (did you mean {' or '.join(repr(h) for h in hints)}?)" if hints else ""
    family = f" for a {model_type} model" if model_type and model_type in FAMILY_TEMPLATES else ""
    return f"unknown template {name!r}{hint}{family}; `ferry train --templates` lists the {len(TEMPLATES)} built-ins"


def get_template(
    name: str,
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
    tool_format: str | None = None,
    preserve_thinking: bool = False,
    train_on_prompt: bool = False,
) -> Template:
    """The built-in template ``name`` configured by a run's data keys (LLaMA-Factory's meanings):
    ``tool_format`` replaces the template's tool format (calls are then written in the plain reply layout),
    ``default_system`` the default system prompt; reasoning templates take ``enable_thinking`` and
    ``preserve_thinking``.

    Raises:
        KeyError: no such template (:func:`unknown_template_message` says it in one line).
        ValueError: ``train_on_prompt`` with an ``efficient_eos`` template (its prompts carry the previous
            reply's EOS label), or an unknown ``tool_format``.
    """
    spec = TEMPLATES[name]
    if train_on_prompt and spec.efficient_eos:
        raise ValueError(f"template {name!r} does not support train_on_prompt (it uses efficient_eos)")
    return configure(
        spec,
        default_system=default_system,
        enable_thinking=enable_thinking,
        tool_format_name=tool_format,
        preserve_thinking=preserve_thinking,
    )


def describe_templates() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` per built-in template, for ``ferry train --templates``: the user turn's
    layout, the EOS it trains with, and whether it is efficient_eos / reasoning / has a tool format / a default
    system prompt / is multimodal in LLaMA-Factory."""
    rows = []
    for name, spec in TEMPLATES.items():
        user = "".join(
            p if isinstance(p, str) else getattr(p, "text", None) or f"<{repr(p).lower()}>" for p in spec.layout("user")
        )
        facts = [repr(user.replace("{content}", "…"))]
        if spec.replace_eos and spec.stop:
            facts.append(f"EOS={spec.stop[0]}")
        if spec.efficient_eos:
            facts.append("efficient_eos")
        if spec.thinking:
            facts.append("reasoning")
        if spec.tools != "default":
            facts.append(f"tools={spec.tools}")
        if spec.default_system:
            facts.append("default system")
        if spec.multimodal:
            facts.append("multimodal (text only in ferry)")
        rows.append((name, ", ".join(facts)))
    return rows


def prompt_text(
    name: str,
    messages: list[dict[str, Any]],
    system: str | None = None,
    tools: str | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """The generation prompt of the built-in template ``name`` for ``messages`` (ending with a user turn), as
    text: what training renders before the reply, BOS / EOS written as ``bos_token`` / ``eos_token``."""
    return "".join(get_template(name).encode_prompt(TextIds(bos_token, eos_token), messages, system, tools))


__all__ = [
    "TEMPLATES",
    "MULTIMODAL_TEMPLATES",
    "FAMILY_TEMPLATES",
    "TOOL_FORMATS",
    "Spec",
    "Template",
    "TextIds",
    "USER",
    "ASSISTANT",
    "OBSERVATION",
    "FUNCTION",
    "SYSTEM",
    "template_names",
    "suggest_templates",
    "unknown_template_message",
    "get_template",
    "describe_templates",
    "prompt_text",
    "chat_template_jinja",
    "training_prompt_text",
    "write_chat_template",
    "tool_format",
]
