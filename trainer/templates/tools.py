"""Tool-calling formats: how a tools list becomes prompt text and how tool calls become reply text.

Each format is written once, as two Jinja macros:

    ferry_tools_text(tools)   tools: the list of function schemas (``{"name", "description", "parameters"}``,
                              or wrapped as ``{"type": "function", "function": {...}}``) -> the text the
                              template appends to the system prompt
    ferry_calls_text(calls)   calls: ``[{"name": str, "arguments": ...}, ...]`` -> the text of the reply

Training renders them here (:meth:`ToolFormat.tools_text`, :meth:`ToolFormat.calls_text`) in an environment
built like transformers' chat-template environment, and :mod:`trainer.templates.jinja` puts the same macros into
the chat template that ships with the adapter and the export. So ``apply_chat_template(..., tools=...)`` in
transformers, vLLM or TGI writes the tools and calls exactly as training did: there is one definition.

Arguments: JSON formats (``encoded_arguments=True``: default, qwen, llama3, mistral, glm4, minimax1, ling) print
the arguments as JSON. They take an object (``tojson``) or a string that already holds the JSON text (as OpenAI
clients send it; printed as it is, so it matches training when it was written by ``json.dumps``). Training hands
them ``json.dumps(arguments)``: a string value in the data is trained as a JSON string, as LLaMA-Factory does.
The other formats print each argument on its own (``<parameter=city>``); they need an object, and a JSON string
from a served conversation (marked ``"encoded"`` by the chat template) is refused with one line (transformers
documents tool-call arguments as a dict, and vLLM parses them to one).

The prompt texts below are the formats' own words (the text the models were trained on, as LLaMA-Factory 0.9.5
writes them); ``<<TOOLS>>``, ``<<NAMES>>`` and ``<<DATE>>`` mark where the rendered tools, the tool names and
the date go.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

# ---------------------------------------------------------------------- the formats' prompt texts

DEFAULT = (
    "You have access to the following tools:\n"
    "<<TOOLS>>Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [<<NAMES>>])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs (e.g. "
    '```{"input": "hello world", "num_beams": 5}```)\n'
    "```\n"
)

GLM4 = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n"
    "\n"
    "# 可用工具<<TOOLS>>"
)

GLM4_MOE = (
    "\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools><<TOOLS>>\n"
    "</tools>\n"
    "\n"
    "For each function call, output the function name and arguments within the following "
    "XML format:\n"
    "<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n"
    "<arg_value>{arg-value-2}</arg_value>\n"
    "...\n"
    "</tool_call>\n"
)

LLAMA3 = (
    "Cutting Knowledge Date: December 2023\n"
    "Today Date: <<DATE>>\n"
    "\n"
    "You have access to the following functions. To call a function, please respond with "
    'JSON for a function call. Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}. Do not use variables.\n'
    "\n"
    "<<TOOLS>>"
)

MINIMAX1 = (
    "You are provided with these tools:\n"
    "<tools>\n"
    "<<TOOLS>></tools>\n"
    "\n"
    "If you need to call tools, please respond with <tool_calls></tool_calls> XML tags, "
    "and provide tool-name and json-object of arguments, following the format below:\n"
    "<tool_calls>\n"
    '{"name": <tool-name-1>, "arguments": <args-json-object-1>}\n'
    "...\n"
    "</tool_calls>"
)

MINIMAX2 = (
    "\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n"
    "\n"
    "<tools>\n"
    "<<TOOLS>></tools>\n"
    "\n"
    "When making tool calls, use XML format to invoke tools and pass parameters:\n"
    "\n"
    "<minimax:tool_call>\n"
    '<invoke name="tool-name-1">\n'
    '<parameter name="param-key-1">param-value-1</parameter>\n'
    '<parameter name="param-key-2">param-value-2</parameter>\n'
    "...\n"
    "</invoke>\n"
    "</minimax:tool_call>"
)

QWEN = (
    "\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools><<TOOLS>>\n"
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)

QWEN3_5 = (
    "\n"
    "\n"
    "# Tools\n"
    "\n"
    "You have access to the following functions:\n"
    "\n"
    "<tools><<TOOLS>>\n"
    "</tools>\n"
    "\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
    "\n"
    "<tool_call>\n"
    "<function=example_function_name>\n"
    "<parameter=example_parameter_1>\n"
    "value_1\n"
    "</parameter>\n"
    "<parameter=example_parameter_2>\n"
    "This is the value for the second parameter\n"
    "that can span\n"
    "multiple lines\n"
    "</parameter>\n"
    "</function>\n"
    "</tool_call>\n"
    "\n"
    "<IMPORTANT>\n"
    "Reminder:\n"
    "- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML "
    "tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your "
    "current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)

SEED = (
    "system\n"
    "You are Doubao, a helpful AI assistant. You may call one or more functions to "
    "assist with the user query.Tool List:\n"
    "You are authorized to use the following tools (described in JSON Schema format). "
    "Before performing any task, you must decide how to call them based on the "
    "descriptions and parameters of these tools.<<TOOLS>>\n"
    "工具调用请遵循如下格式:\n"
    "<seed:tool_call>\n"
    "<function=example_function_name>\n"
    "<parameter=example_parameter_1>value_1</parameter>\n"
    "<parameter=example_parameter_2>This is the value for the second parameter\n"
    "that can span\n"
    "multiple lines</parameter>\n"
    "</function>\n"
    "</seed:tool_call>\n"
)

LING = (
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools><<TOOLS>>\n"
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
    "\ndetailed thinking off"
)

LFM2 = "List of tools: <|tool_list_start|><<TOOLS>><|tool_list_end|>"


def today() -> datetime:
    """The date the llama3 prompt carries ("Today Date: 31 Jan 2025"): now. Tests pin it. A served chat template
    takes ``date_string`` when the caller passes one, else transformers' ``strftime_now``."""
    return datetime.now()


def _q(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return json.dumps(text, ensure_ascii=False)


def _prompt(text: str, **slots: str) -> str:
    """A Jinja expression of a prompt text whose ``<<NAME>>`` marks are replaced by the expressions given."""
    parts = [(text, True)]
    for name, expr in slots.items():
        mark = f"<<{name.upper()}>>"
        out = []
        for chunk, literal in parts:
            if literal and mark in chunk:
                head, tail = chunk.split(mark, 1)
                out += [(head, True), (expr, False), (tail, True)]
            else:
                out.append((chunk, literal))
        parts = out
    return " ~ ".join(_q(c) if literal else f"({c})" for c, literal in parts if c or not literal)


# ---------------------------------------------------------------------- Jinja shared by the formats

#: Helpers every format may call. ``ferry_json``: an argument object as JSON, or a string that already is JSON.
#: ``ferry_value``: one argument value as the per-argument formats print it (a string as is, else JSON).
#: ``ferry_object``: refuses arguments that are not an object, for the per-argument formats.
_COMMON = r"""
{%- macro ferry_json(a) -%}{{- a if a is string else a | tojson -}}{%- endmacro -%}
{%- macro ferry_value(v) -%}{{- v if v is string else v | tojson -}}{%- endmacro -%}
{%- macro ferry_object(call, fmt) -%}
{%- if call["arguments"] is not mapping -%}
{{- raise_exception("tool call " ~ call["name"] ~ ": the " ~ fmt ~ " tool format writes each argument, so its "
    ~ "arguments must be a JSON object, not " ~ (call["arguments"] | tojson)) -}}
{%- endif -%}
{%- endmacro -%}
"""

# Unwrapping a schema: {"type": "function", "function": f} -> f (LLaMA-Factory takes .get("function", ""),
# Qwen3.5 / LFM2 / Gemma-4 .get("function", tool)); wrapping: f -> {"type": "function", "function": f}.
_UNWRAP = '{%- set fn = tool.get("function", "") if tool.get("type") == "function" else tool -%}'
_UNWRAP_KEEP = '{%- set fn = tool.get("function", tool) if tool.get("type") == "function" else tool -%}'
_WRAP = '{%- set fn = tool if tool.get("type") == "function" else {"type": "function", "function": tool} -%}'


def _tools_macro(per_tool: str, result: str, *, unwrap: str = _UNWRAP) -> str:
    """``ferry_tools_text``: ``per_tool`` (Jinja expression over ``fn``) concatenated over the tools, then
    ``result`` (expression over ``ns.text``)."""
    return (
        "{%- macro ferry_tools_text(tools) -%}{%- set ns = namespace(text='') -%}{%- for tool in tools -%}"
        + unwrap
        + "{%- set ns.text = ns.text ~ "
        + per_tool
        + " -%}{%- endfor -%}{{- "
        + result
        + " -}}{%- endmacro -%}"
    )


def _calls_macro(per_call: str, *, sep: str, before: str = '""', after: str = '""', checks: str = "") -> str:
    """``ferry_calls_text``: ``before``, then ``per_call`` (expression over ``call``) joined by ``sep``, then
    ``after``; ``checks`` runs first (Jinja statements over ``calls``)."""
    return (
        "{%- macro ferry_calls_text(calls) -%}" + checks + "{%- set ns = namespace(text='') -%}"
        "{%- for call in calls -%}"
        + per_call
        + "{%- set ns.text = ns.text ~ ("
        + _q(sep)
        + " if not loop.first else '') ~ one -%}{%- endfor -%}{{- "
        + before
        + " ~ ns.text ~ "
        + after
        + " -}}{%- endmacro -%}"
    )


def _each_argument(fmt: str, head: str, item: str, tail: str) -> str:
    """A per-call body for the formats that write each argument: ``head`` (over ``call``), ``item`` per
    (``key``, ``value``) and ``tail``, into ``one``."""
    return (
        "{{- ferry_object(call, " + _q(fmt) + ") -}}{%- set arg = namespace(text='') -%}"
        "{%- for key, value in call['arguments'].items() -%}{%- set arg.text = arg.text ~ "
        + item
        + " -%}{%- endfor -%}{%- set one = "
        + head
        + " ~ arg.text ~ "
        + tail
        + " -%}"
    )


_NAME = 'call["name"]'
_JSON_CALL = (
    "{%- set one = '{\"name\": ' ~ (call['name'] | tojson) ~ ', \""
    + "{key}"
    + "\": ' ~ ferry_json(call['arguments']) ~ '}' -%}"
)


def _json_call(key: str) -> str:
    """A per-call body writing ``{"name": ..., "<key>": <arguments>}`` as json.dumps would."""
    return _JSON_CALL.replace("{key}", key)


_DEFAULT_TOOLS = (
    r"""
{%- macro ferry_tools_text(tools) -%}
{%- set ns = namespace(text="", names=[]) -%}
{%- for tool in tools -%}
"""
    + _UNWRAP
    + r"""
{%- set args = namespace(text="") -%}
{%- for pname, param in fn["parameters"]["properties"].items() -%}
{%- set required = ", required" if pname in fn["parameters"].get("required", []) else "" -%}
{%- set enum = (", should be one of [" ~ (param["enum"] | join(", ")) ~ "]") if param.get("enum") else "" -%}
{%- set items = (", where each item should be " ~ param["items"].get("type", "")) if param.get("items") else "" -%}
{%- set args.text = args.text ~ "  - " ~ pname ~ " (" ~ param.get("type", "") ~ required ~ "): "
    ~ param.get("description", "") ~ enum ~ items ~ "\n" -%}
{%- endfor -%}
{%- set ns.text = ns.text ~ "> Tool Name: " ~ fn["name"] ~ "\nTool Description: " ~ fn.get("description", "")
    ~ "\nTool Args:\n" ~ args.text ~ "\n" -%}
{%- set ns.names = ns.names + [fn["name"]] -%}
{%- endfor -%}
{{- """
    + _prompt(DEFAULT, tools="ns.text", names='ns.names | join(", ")')
    + r""" -}}
{%- endmacro -%}
"""
)

_GEMMA4_TOOLS = (
    r"""
{%- macro ferry_gemma_props(properties) -%}
{%- set ns = namespace(parts=[]) -%}
{%- for pname, schema in properties.items() -%}
{%- set item = namespace(parts=[]) -%}
{%- if schema.get("description") -%}{%- set item.parts = item.parts + ['description:<|"|>' ~ schema["description"] ~ '<|"|>'] -%}{%- endif -%}
{%- if schema.get("type") -%}{%- set item.parts = item.parts + ['type:<|"|>' ~ (schema["type"] | string | upper) ~ '<|"|>'] -%}{%- endif -%}
{%- set ns.parts = ns.parts + [pname ~ ":{" ~ (item.parts | join(",")) ~ "}"] -%}
{%- endfor -%}
{{- ns.parts | join(",") -}}
{%- endmacro -%}
{%- macro ferry_tools_text(tools) -%}
{%- set ns = namespace(decls=[]) -%}
{%- for tool in tools -%}
"""
    + _UNWRAP_KEEP
    + r"""
{%- set decl = namespace(text="declaration:" ~ fn["name"] ~ '{description:<|"|>' ~ fn.get("description", "") ~ '<|"|>') -%}
{%- set params = fn.get("parameters") -%}
{%- if params -%}
{%- set p = namespace(parts=[]) -%}
{%- if params.get("properties") -%}{%- set p.parts = p.parts + ["properties:{" ~ ferry_gemma_props(params["properties"]) ~ "}"] -%}{%- endif -%}
{%- if params.get("required") -%}{%- set req = namespace(items=[]) -%}{%- for r in params["required"] -%}{%- set req.items = req.items + ['<|"|>' ~ r ~ '<|"|>'] -%}{%- endfor -%}
{%- set p.parts = p.parts + ["required:[" ~ (req.items | join(",")) ~ "]"] -%}{%- endif -%}
{%- if params.get("type") -%}{%- set p.parts = p.parts + ['type:<|"|>' ~ (params["type"] | string | upper) ~ '<|"|>'] -%}{%- endif -%}
{%- set decl.text = decl.text ~ ",parameters:{" ~ (p.parts | join(",")) ~ "}" -%}
{%- endif -%}
{%- set response = fn.get("response") -%}
{%- if response -%}
{%- set r = namespace(parts=[]) -%}
{%- if response.get("description") -%}{%- set r.parts = r.parts + ['description:<|"|>' ~ response["description"] ~ '<|"|>'] -%}{%- endif -%}
{%- set rtype = response.get("type", "") | string | upper -%}
{%- if rtype == "OBJECT" -%}{%- set r.parts = r.parts + ['type:<|"|>' ~ rtype ~ '<|"|>'] -%}{%- endif -%}
{%- set decl.text = decl.text ~ ",response:{" ~ (r.parts | join(",")) ~ "}" -%}
{%- endif -%}
{%- set ns.decls = ns.decls + [decl.text ~ "}"] -%}
{%- endfor -%}
{{- ns.decls | join("\n") -}}
{%- endmacro -%}
"""
)

# Gemma-4 writes values in its own notation: strings between <|"|> marks, keys bare and sorted, true/false/null.
_GEMMA4_CALLS = r"""
{%- macro ferry_gemma_value(a) -%}
{%- if a is string -%}{{- '<|"|>' ~ a ~ '<|"|>' -}}
{%- elif a is boolean -%}{{- "true" if a else "false" -}}
{%- elif a is mapping -%}{{- "{" -}}{%- for k in a.keys() | sort(case_sensitive=true) -%}{{- ("," if not loop.first else "") ~ k ~ ":" ~ ferry_gemma_value(a[k]) -}}{%- endfor -%}{{- "}" -}}
{%- elif a is none -%}{{- "null" -}}
{%- elif a is sequence -%}{{- "[" -}}{%- for x in a -%}{{- ("," if not loop.first else "") ~ ferry_gemma_value(x) -}}{%- endfor -%}{{- "]" -}}
{%- else -%}{{- a | string -}}
{%- endif -%}
{%- endmacro -%}
{%- macro ferry_calls_text(calls) -%}
{%- for call in calls -%}
{%- set a = call["arguments"] -%}
{{- "<|tool_call>call:" ~ call["name"] ~ "{" -}}
{%- if a is mapping -%}{%- for k in a.keys() | sort(case_sensitive=true) -%}{{- ("," if not loop.first else "") ~ k ~ ":" ~ ferry_gemma_value(a[k]) -}}{%- endfor -%}
{%- elif a is string -%}
{%- if call.get("encoded") -%}{{- ferry_object(call, "gemma4") -}}{%- endif -%}{{- a -}}
{%- else -%}{{- ferry_gemma_value(a) -}}
{%- endif -%}
{{- "}<tool_call|>" -}}
{%- endfor -%}
{%- endmacro -%}
"""


@dataclass(frozen=True)
class ToolFormat:
    """One tool-calling format.

    Attributes:
        name: the ``tool_format`` name (LLaMA-Factory's).
        macros: the Jinja source defining ``ferry_tools_text(tools)`` and ``ferry_calls_text(calls)`` (and
            helpers prefixed ``ferry_``), without the common helpers.
        encoded_arguments: training passes each call's arguments as JSON text (``json.dumps``) rather than as
            the object; see the module docstring.
    """

    name: str
    macros: str
    encoded_arguments: bool

    @property
    def source(self) -> str:
        """The format's macros with the common helpers, ready to paste into a chat template."""
        return _COMMON + self.macros

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt text for ``tools`` (a list of function schemas); "" for an empty list.

        Raises:
            ValueError: a schema the format cannot read (e.g. the default format needs ``parameters.properties``).
        """
        if not tools:
            return ""
        return _call(self, "ferry_tools_text", tools)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """The reply text of ``calls``: ``(name, arguments)`` pairs, arguments as decoded JSON.

        Raises:
            ValueError: the format cannot write them (GLM-4 takes one call per turn; the per-argument formats
                need an object).
        """
        encode = self.encoded_arguments
        items = [
            {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if encode else args}
            for name, args in calls
        ]
        return _call(self, "ferry_calls_text", items)


def _raise(message: str) -> None:
    raise ValueError(message)


@cache
def environment():
    """A Jinja environment built as transformers builds its chat-template environment (sandboxed, immutable,
    ``trim_blocks`` / ``lstrip_blocks``, loop controls, a ``tojson`` that is ``json.dumps`` with
    ``ensure_ascii=False``, ``raise_exception``, ``strftime_now``), so that training renders the macros as
    serving does. ``raise_exception`` raises ValueError here; ``strftime_now`` formats :func:`today`."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: today().strftime(fmt)
    env.globals["namespace"] = jinja2.utils.Namespace
    return env


@cache
def _module(fmt: ToolFormat):
    return environment().from_string(fmt.source).module


def _call(fmt: ToolFormat, macro: str, arg: Any) -> str:
    return str(getattr(_module(fmt), macro)(arg))


_DATE = 'date_string if date_string is defined else strftime_now("%d %b %Y")'

#: Every tool format by name.
TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "default",
            _DEFAULT_TOOLS
            + _calls_macro(
                "{%- set one = 'Action: ' ~ call['name'] ~ '\\nAction Input: ' ~ ferry_json(call['arguments']) -%}",
                sep="\n",
            ),
            encoded_arguments=True,
        ),
        ToolFormat("gemma4", _GEMMA4_TOOLS + _GEMMA4_CALLS, encoded_arguments=False),
        ToolFormat(
            "glm4",
            _tools_macro(
                '"\\n\\n## " ~ fn["name"] ~ "\\n\\n" ~ (fn | tojson(indent=4)) ~ '
                + _q("\n在调用上述函数时，请使用 Json 格式表示调用的参数。"),
                _prompt(GLM4, tools="ns.text"),
            )
            + _calls_macro(
                "{%- set one = call['name'] ~ '\\n' ~ ferry_json(call['arguments']) -%}",
                sep="",
                checks=(
                    "{%- if calls | length > 1 -%}{{- raise_exception('the glm4 tool format writes one tool call per "
                    "turn, this one has ' ~ (calls | length)) -}}{%- endif -%}"
                ),
            ),
            encoded_arguments=True,
        ),
        ToolFormat(
            "llama3",
            _tools_macro(
                "(fn | tojson(indent=4)) ~ '\\n\\n'",
                _prompt(LLAMA3, date=_DATE, tools="ns.text"),
                unwrap=_WRAP.replace("set fn = tool if", "set fn = tool if"),
            )
            + "{%- macro ferry_calls_text(calls) -%}{%- set ns = namespace(items=[]) -%}{%- for call in calls -%}"
            + _json_call("parameters")
            + "{%- set ns.items = ns.items + [one] -%}{%- endfor -%}"
            "{{- ns.items[0] if ns.items | length == 1 else '[' ~ (ns.items | join(', ')) ~ ']' -}}{%- endmacro -%}",
            encoded_arguments=True,
        ),
        ToolFormat(
            "lfm2",
            "{%- macro ferry_tools_text(tools) -%}{%- set ns = namespace(items=[]) -%}"
            "{%- for tool in tools -%}" + _UNWRAP_KEEP + "{%- set ns.items = ns.items + [fn] -%}{%- endfor -%}"
            "{{- "
            + _prompt(LFM2, tools="ns.items | tojson")
            + " -}}{%- endmacro -%}"
            + _calls_macro(
                _each_argument(
                    "lfm2",
                    "call['name'] ~ '('",
                    "(', ' if arg.text else '') ~ key ~ ('=\"' ~ value ~ '\"' if value is string else '=' ~ (value | "
                    "tojson))",
                    "')'",
                ),
                sep=", ",
                before="'<|tool_call_start|>['",
                after="']<|tool_call_end|>'",
            ),
            encoded_arguments=False,
        ),
        ToolFormat(
            "minimax1",
            _tools_macro("(fn | tojson) ~ '\\n'", _prompt(MINIMAX1, tools="ns.text"))
            + _calls_macro(_json_call("arguments"), sep="\n", before="'<tool_calls>\\n'", after="'\\n</tool_calls>'"),
            encoded_arguments=True,
        ),
        ToolFormat(
            "minimax2",
            _tools_macro("'<tool>' ~ (fn | tojson) ~ '</tool>\\n'", _prompt(MINIMAX2, tools="ns.text"))
            + _calls_macro(
                _each_argument(
                    "minimax2",
                    "'<invoke name=\"' ~ call['name'] ~ '\">'",
                    "'\\n<parameter name=\"' ~ key ~ '\">' ~ ferry_value(value) ~ '</parameter>'",
                    "'\\n</invoke>'",
                ),
                sep="\n",
            ),
            encoded_arguments=False,
        ),
        ToolFormat(
            "mistral",
            "{%- macro ferry_tools_text(tools) -%}{%- set ns = namespace(items=[]) -%}"
            "{%- for tool in tools -%}" + _WRAP + "{%- set ns.items = ns.items + [fn] -%}{%- endfor -%}"
            "{{- '[AVAILABLE_TOOLS] ' ~ (ns.items | tojson) ~ '[/AVAILABLE_TOOLS]' -}}{%- endmacro -%}"
            + _calls_macro(_json_call("arguments"), sep=", ", before="'['", after="']'"),
            encoded_arguments=True,
        ),
        ToolFormat(
            "qwen",
            _tools_macro("'\\n' ~ (fn | tojson)", _prompt(QWEN, tools="ns.text"), unwrap=_WRAP)
            + _calls_macro(
                _json_call("arguments") + "{%- set one = '<tool_call>\\n' ~ one ~ '\\n</tool_call>' -%}", sep="\n"
            ),
            encoded_arguments=True,
        ),
        ToolFormat(
            "qwen3_5",
            _tools_macro("'\\n' ~ (fn | tojson)", _prompt(QWEN3_5, tools="ns.text"), unwrap=_UNWRAP_KEEP)
            + _calls_macro(
                _each_argument(
                    "qwen3_5",
                    "'<tool_call>\\n<function=' ~ call['name'] ~ '>'",
                    "'\\n<parameter=' ~ key ~ '>\\n' ~ ferry_value(value) ~ '\\n</parameter>'",
                    "'\\n</function>\\n</tool_call>'",
                ),
                sep="\n",
            ),
            encoded_arguments=False,
        ),
        ToolFormat(
            "glm4_moe",
            _tools_macro("'\\n' ~ (fn | tojson)", _prompt(GLM4_MOE, tools="ns.text"), unwrap=_WRAP)
            + _calls_macro(
                _each_argument(
                    "glm4_moe",
                    "'\\n<tool_call>' ~ call['name']",
                    "'\\n<arg_key>' ~ key ~ '</arg_key>\\n<arg_value>' ~ ferry_value(value) ~ '</arg_value>'",
                    "''",
                ),
                sep="\n",
            ),
            encoded_arguments=False,
        ),
        ToolFormat(
            "seed_oss",
            "{%- macro ferry_tools_text(tools) -%}{{- "
            + _prompt(SEED, tools="'\\n' ~ (tools | tojson)")
            + " -}}{%- endmacro -%}"
            + _calls_macro(
                _each_argument(
                    "seed_oss",
                    "'\\n<seed:tool_call>\\n<function=' ~ call['name']",
                    "'\\n<parameter=' ~ key ~ '>' ~ ferry_value(value) ~ '</parameter>'",
                    "'\\n</function>\\n</seed:tool_call>'",
                ),
                sep="\n",
            ),
            encoded_arguments=False,
        ),
        ToolFormat(
            "ling",
            _tools_macro("'\\n' ~ (fn | tojson)", _prompt(LING, tools="ns.text"), unwrap=_WRAP)
            + _calls_macro(
                _json_call("arguments") + "{%- set one = '<tool_call>\\n' ~ one ~ '\\n</tool_call>' -%}", sep="\n"
            ),
            encoded_arguments=True,
        ),
    )
}


def tool_format(name: str) -> ToolFormat:
    """The tool format ``name``.

    Raises:
        ValueError: no such format (the message lists them).
    """
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool_format {name!r} (known: {', '.join(sorted(TOOL_FORMATS))})") from None
