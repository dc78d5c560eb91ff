"""An Ollama ``Modelfile`` beside the GGUF: the trained chat format as a Go template, its stop markers, its system.

Ollama renders a prompt with Go's ``text/template`` over ``.System`` and ``.Messages`` (``.Role``, ``.Content``);
without a ``TEMPLATE`` it guesses one from the GGUF's ``tokenizer.chat_template`` (by edit distance to its
built-in templates) or falls back to ``{{ .Prompt }}``, and a fine-tune then never stops. So ferry writes it.

The template is learnt from the export's own chat template (``chat_template.jinja``, rendered by transformers), not
from a table of ours: conversations whose contents are unique markers are rendered, and the text around each marker
gives the pieces of one turn::

    [BOS] sys_prefix SYSTEM sys_suffix  user_prefix USER user_suffix  asst_prefix ASSISTANT asst_suffix ...
          user_prefix USER user_suffix  generation_prompt

A template whose turns are not independent pieces (a system prompt folded into the first user turn, a turn
rendered differently by position) cannot be written this way: :func:`turn_pieces` then returns None and the
Modelfile has no ``TEMPLATE`` (Ollama falls back to the GGUF's chat template) and says so. Every template written is
checked by rendering it (as Jinja built from the same pieces, :func:`jinja_equivalent`) against the export's template
on probe conversations before it is used.

``PARAMETER stop``: the assistant turn's closing marker (its suffix without surrounding white space), the EOS token
and every token in generation_config's EOS ids. ``SYSTEM``: the default system prompt the export's template inserts
when no system message is given (found by rendering without one).

Leading BOS: llama.cpp adds BOS itself when ``tokenizer.ggml.add_bos_token`` is set, so a BOS the chat template
renders at the very start is left out of the Go template.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.fsutil import atomic_write_text

MODELFILE = "Modelfile"

_S, _U1, _A1, _U2 = "\x10SYS\x11", "\x10USR1\x11", "\x10AST1\x11", "\x10USR2\x11"


@dataclass
class TurnPieces:
    """The literal text around each part of a conversation (see the module docstring); ``default_system`` is the
    system prompt the template inserts when none is given (None: none)."""

    bos: str
    sys_prefix: str
    sys_suffix: str
    user_prefix: str
    user_suffix: str
    asst_prefix: str
    asst_suffix: str
    generation_prompt: str
    default_system: str | None


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _split(text: str, *markers: str) -> list[str] | None:
    parts, rest = [], text
    for marker in markers:
        if rest.count(marker) != 1:
            return None
        head, rest = rest.split(marker)
        parts.append(head)
    return [*parts, rest]


def _probe_splits(tokenizer: Any) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """The template's renderings of four probe conversations, split at the probe texts: with a system prompt,
    without one, one user turn closed, and one user turn with the generation prompt; None when a rendering fails
    or a probe text does not appear exactly once."""
    system, user, reply, second = (
        {"role": "system", "content": _S},
        {"role": "user", "content": _U1},
        {"role": "assistant", "content": _A1},
        {"role": "user", "content": _U2},
    )
    try:
        full = _split(_render(tokenizer, [system, user, reply, second], True), _S, _U1, _A1, _U2)
        no_sys = _split(_render(tokenizer, [user, reply, second], True), _U1, _A1, _U2)
        closed = _split(_render(tokenizer, [user], False), _U1)
        opened = _split(_render(tokenizer, [user], True), _U1)
    except Exception:  # noqa: BLE001 - a template that refuses these conversations (e.g. no system role)
        return None
    if not (full and no_sys and closed and opened):
        return None
    return full, no_sys, closed, opened


def turn_pieces(tokenizer: Any) -> TurnPieces | None:
    """Learn :class:`TurnPieces` from ``tokenizer.chat_template``; None when the template's turns are not
    independent pieces (checked with :func:`jinja_equivalent` on probe conversations)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    splits = _probe_splits(tokenizer)
    if splits is None:
        return None
    full, no_sys, closed, opened = splits
    bos = tokenizer.bos_token or ""
    head = full[0]
    lead = bos if bos and head.startswith(bos) else ""
    sys_prefix = head[len(lead) :]
    user_suffix = closed[1]
    if not opened[1].startswith(user_suffix) or closed[0] != opened[0]:
        return None
    generation_prompt = opened[1][len(user_suffix) :]
    # between the user's and the assistant's content: user_suffix + asst_prefix
    if not full[2].startswith(user_suffix):
        return None
    asst_prefix = full[2][len(user_suffix) :]
    # no system: [lead] [default system block] user_prefix USER ...
    plain_head = no_sys[0][len(lead) :] if lead and no_sys[0].startswith(lead) else no_sys[0]
    # between the assistant's content and the next user's: asst_suffix + user_prefix; the user prefix is what
    # stands before the first user message when there is no system (and no default system)
    between_sys_user = full[1]
    user_prefix = None
    for cut in range(len(between_sys_user) + 1):  # the longest tail of the sys->user gap that ends the A->U gap
        candidate = between_sys_user[cut:]
        if full[3].endswith(candidate) and plain_head.endswith(candidate):
            user_prefix = candidate
            break
    if user_prefix is None:
        return None
    sys_suffix = between_sys_user[: len(between_sys_user) - len(user_prefix)]
    asst_suffix = full[3][: len(full[3]) - len(user_prefix)]
    default_system = None
    block = plain_head[: len(plain_head) - len(user_prefix)]
    if block:
        if not (block.startswith(sys_prefix) and block.endswith(sys_suffix)) or len(block) < len(sys_prefix) + len(
            sys_suffix
        ):
            return None
        default_system = block[len(sys_prefix) : len(block) - len(sys_suffix)]
    pieces = TurnPieces(
        lead,
        sys_prefix,
        sys_suffix,
        user_prefix,
        user_suffix,
        asst_prefix,
        asst_suffix,
        generation_prompt,
        default_system,
    )
    if not _agrees(tokenizer, pieces):
        return None
    return pieces


#: Conversations every learnt template must render exactly as the export's template does.
PROBES: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ],
    # contents a template might rewrite: reasoning blocks, surrounding white space
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"},
        {"role": "user", "content": " padded \n"},
    ],
]


def _agrees(tokenizer: Any, pieces: TurnPieces) -> bool:
    import jinja2

    env = jinja2.Environment(keep_trailing_newline=True)
    equivalent = env.from_string(jinja_equivalent(pieces))
    for messages in PROBES:
        try:
            want = _render(tokenizer, messages, True)
        except Exception:  # noqa: BLE001
            return False
        if pieces.bos + equivalent.render(messages=messages) != want:
            return False
    return True


def _go_literal(text: str) -> str:
    """``text`` as Go template output: literal text unless it holds template delimiters (then a Go string)."""
    if "{{" in text or "}}" in text:
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"
    return text


def go_template(p: TurnPieces) -> str:
    """Ollama's TEMPLATE (Go ``text/template`` over ``.System`` and ``.Messages``) for the pieces. No white-space
    trimming markers are used, so every piece's own white space is kept exactly."""
    g = _go_literal
    return (
        "{{ if .System }}" + g(p.sys_prefix) + "{{ .System }}" + g(p.sys_suffix) + "{{ end }}"
        "{{ range $i, $m := .Messages }}"
        '{{ if eq $m.Role "user" }}'
        + g(p.user_prefix)
        + "{{ $m.Content }}"
        + g(p.user_suffix)
        + "{{ if eq (len (slice $.Messages $i)) 1 }}"
        + g(p.generation_prompt)
        + "{{ end }}"
        '{{ else if eq $m.Role "assistant" }}'
        + g(p.asst_prefix)
        + "{{ $m.Content }}"
        + g(p.asst_suffix)
        + "{{ end }}{{ end }}"
    )


def jinja_equivalent(p: TurnPieces) -> str:
    """The same template as :func:`go_template` in Jinja (``messages`` with a leading system message, as
    transformers passes them; ``default_system`` when there is none). Used to check the pieces."""

    def lit(text: str) -> str:
        return "{{ " + json.dumps(text) + " }}"

    default = json.dumps(p.default_system) if p.default_system is not None else "none"
    return (
        "{% set ns = namespace(system=" + default + ", msgs=messages) %}"
        "{% if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}"
        "{% set ns.msgs = messages[1:] %}{% endif %}"
        "{% if ns.system %}" + lit(p.sys_prefix) + "{{ ns.system }}" + lit(p.sys_suffix) + "{% endif %}"
        "{% for m in ns.msgs %}"
        "{% if m.role == 'user' %}"
        + lit(p.user_prefix)
        + "{{ m.content }}"
        + lit(p.user_suffix)
        + "{% if loop.last %}"
        + lit(p.generation_prompt)
        + "{% endif %}"
        "{% elif m.role == 'assistant' %}"
        + lit(p.asst_prefix)
        + "{{ m.content }}"
        + lit(p.asst_suffix)
        + "{% endif %}{% endfor %}"
    )


def stop_markers(tokenizer: Any, pieces: TurnPieces | None, model_dir: Path) -> list[str]:
    """Every end-of-turn marker: the assistant suffix (stripped), the EOS token, generation_config's EOS ids."""
    stops: list[str] = []
    if pieces is not None and pieces.asst_suffix.strip():
        stops.append(pieces.asst_suffix.strip())
    if tokenizer.eos_token:
        stops.append(tokenizer.eos_token)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids = [value] if isinstance(value, int) else list(value or [])
        for i in ids:
            token = tokenizer.convert_ids_to_tokens(int(i))
            if token:
                stops.append(token)
    return list(dict.fromkeys(s for s in stops if s))


def _quote(text: str) -> str:
    """A Modelfile argument: triple-quoted when it spans lines or holds quotes."""
    if '"""' in text:
        raise ValueError("text holds a triple quote, which a Modelfile cannot quote")
    return f'"""{text}"""'


def modelfile_text(gguf_name: str, tokenizer: Any, model_dir: Path) -> tuple[str, TurnPieces | None, list[str]]:
    """The Modelfile for ``./gguf_name``; returns (text, the pieces or None, notes)."""
    pieces = turn_pieces(tokenizer)
    notes = []
    lines = [f"# written by ferry export from {model_dir.name}", f"FROM ./{gguf_name}"]
    if pieces is not None:
        lines.append(f"TEMPLATE {_quote(go_template(pieces))}")
        if pieces.default_system:
            lines.append(f"SYSTEM {_quote(pieces.default_system)}")
    elif getattr(tokenizer, "chat_template", None):
        notes.append(
            "the chat template's turns are not independent pieces: the Modelfile has no TEMPLATE and Ollama "
            "uses the GGUF's tokenizer.chat_template"
        )
    else:
        notes.append("the export has no chat template: the Modelfile has no TEMPLATE")
    for stop in stop_markers(tokenizer, pieces, model_dir):
        lines.append(f"PARAMETER stop {json.dumps(stop, ensure_ascii=False)}")
    return "\n".join(lines) + "\n", pieces, notes


def write_modelfile(
    model_dir: str | os.PathLike, gguf_path: str | os.PathLike, trust_remote_code: bool = False
) -> tuple[Path, list[str]]:
    """Write ``Modelfile`` beside ``gguf_path`` for the export ``model_dir`` (atomic). Returns (path, notes)."""
    from transformers import AutoTokenizer

    model_dir, gguf_path = Path(model_dir), Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    text, _, notes = modelfile_text(gguf_path.name, tokenizer, model_dir)
    dest = gguf_path.parent / MODELFILE
    atomic_write_text(dest, text)
    return dest, notes


__all__ = [
    "MODELFILE",
    "TurnPieces",
    "turn_pieces",
    "go_template",
    "jinja_equivalent",
    "stop_markers",
    "modelfile_text",
    "write_modelfile",
    "PROBES",
]
