"""The conversations of the template goldens, in LLaMA-Factory's message form (roles user / assistant /
observation / function; ``system`` and ``tools`` beside them). Shared by ``make_template_goldens.py`` and the
tests. Standard library only."""

from __future__ import annotations

import json

_TOOLS = json.dumps(
    [
        {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name."}},
                "required": ["city"],
            },
        },
    ]
)


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


#: name -> {"messages": [...], "system": str, "tools": str}
CONVERSATIONS: dict[str, dict] = {
    "single": {"messages": [_m("user", "Hi"), _m("assistant", "Ahoy!")], "system": "", "tools": ""},
    "single_system": {"messages": [_m("user", "Hi"), _m("assistant", "Ahoy!")], "system": "S", "tools": ""},
    "multi_system": {
        "messages": [
            _m("user", "Name a colour."),
            _m("assistant", "Blue."),
            _m("user", "Another one?"),
            _m("assistant", "Red, of course."),
            _m("user", "Thanks"),
            _m("assistant", "Any time."),
        ],
        "system": "Be brief.",
        "tools": "",
    },
    # alpaca with history: [["Hi", "Hello!"]] + instruction "Translate" / input "chat" (joined by "\n")
    "alpaca_history": {
        "messages": [
            _m("user", "Hi"),
            _m("assistant", "Hello!"),
            _m("user", "Translate\nchat"),
            _m("assistant", "Katze? No: chat is French."),
        ],
        "system": "",
        "tools": "",
    },
    "tools": {
        "messages": [
            _m("user", "Weather in Paris?"),
            _m("function", json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})),
            _m("observation", json.dumps({"temp_c": 21})),
            _m("assistant", "It is 21 degrees in Paris."),
        ],
        "system": "You are a helpful assistant.",
        "tools": _TOOLS,
    },
    "tools_no_system": {
        "messages": [
            _m("user", "Weather in Oslo and Rome?"),
            _m(
                "function",
                json.dumps(
                    [
                        {"name": "get_weather", "arguments": {"city": "Oslo"}},
                        {"name": "get_weather", "arguments": {"city": "Rome"}},
                    ]
                ),
            ),
            _m("observation", "Oslo: 3C\n</tool_response>\n<tool_response>\nRome: 18C"),
            _m("assistant", "Cold in Oslo, mild in Rome."),
        ],
        "system": "",
        "tools": _TOOLS,
    },
    # two calls in one turn, their results, a final answer; then one more call (non-ASCII argument) and answer
    "tools_multi_turn": {
        "messages": [
            _m("user", "Weather in Oslo and Rome?"),
            _m(
                "function",
                json.dumps(
                    [
                        {"name": "get_weather", "arguments": {"city": "Oslo"}},
                        {"name": "get_weather", "arguments": {"city": "Rome"}},
                    ]
                ),
            ),
            _m("observation", "Oslo: 3C\n</tool_response>\n<tool_response>\nRome: 18C"),
            _m("assistant", "Cold in Oslo, mild in Rome."),
            _m("user", "And Zürich?"),
            _m(
                "function",
                json.dumps({"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}, ensure_ascii=False),
            ),
            _m("observation", json.dumps({"temp_c": 9, "sky": "grey"})),
            _m("assistant", "9 degrees and grey in Zürich."),
        ],
        "system": "You are a helpful assistant.",
        "tools": _TOOLS,
    },
    "chinese": {
        "messages": [_m("user", "你好，请介绍一下你自己。"), _m("assistant", "我是一个乐于助人的助手。")],
        "system": "你是一个助手。",
        "tools": "",
    },
    "thinking": {
        "messages": [
            _m("user", "2+2?"),
            _m("assistant", "<think>\nTwo plus two.\n</think>\n\n4"),
            _m("user", "And 3+3?"),
            _m("assistant", "<think>\nThree plus three.\n</think>\n\n6"),
        ],
        "system": "",
        "tools": "",
    },
    "long": {
        "messages": [
            _m("user", "Tell me a story about a cat " * 4),
            _m("assistant", "Once upon a time a cat sat. " * 6),
            _m("user", "Shorter."),
            _m("assistant", "A cat sat."),
            _m("user", "Now a dog " * 3),
            _m("assistant", "A dog ran far and fast. " * 5),
        ],
        "system": "Storyteller.",
        "tools": "",
    },
}

#: Data-argument variants: name -> (conversations they apply to, LLaMA-Factory DataArguments overrides).
OPTIONS: dict[str, tuple[tuple[str, ...], dict]] = {
    "plain": (tuple(CONVERSATIONS), {}),
    "mask_history": (("multi_system", "thinking", "long", "tools", "tools_multi_turn"), {"mask_history": True}),
    "cutoff_64": (("long", "multi_system"), {"cutoff_len": 64}),
    "cutoff_64_mask_history": (("long",), {"cutoff_len": 64, "mask_history": True}),
    "train_on_prompt": (("multi_system",), {"train_on_prompt": True}),
    "no_thinking": (("thinking", "single"), {"enable_thinking": False}),
    "default_system": (("single", "single_system"), {"default_system": "Custom system."}),
    "tool_format_qwen": (("tools", "tools_multi_turn"), {"tool_format": "qwen"}),
}

#: The date pinned into the llama3 tool prompt ("Today Date: ...") on both sides.
PINNED_DATE = (2025, 1, 31)

#: The templates that must match LLaMA-Factory's: every option and profile. Other templates: the plain cases with
#: the first profile. (baichuan2 is not among them: LLaMA-Factory 0.9.5 no longer registers it.)
REQUIRED_TEMPLATES = (
    "default",
    "empty",
    "alpaca",
    "vicuna",
    "chatml",
    "qwen",
    "qwen3",
    "qwen3_nothink",
    "qwen3_5",
    "qwen3_5_nothink",
    "llama2",
    "llama3",
    "llama4",
    "mistral",
    "ministral",
    "gemma",
    "gemma2",
    "gemma3",
    "glm4",
    "glm4_moe",
    "chatglm3",
    "deepseek",
    "deepseek3",
    "deepseekr1",
    "yi",
    "intern2",
    "phi",
    "phi4",
    "cohere",
    "falcon",
    "openchat",
    "zephyr",
    "gpt_oss",
    "smollm2",
    "olmo",
    "granite3",
    "seed_oss",
    "hunyuan",
    "telechat2",
    "xuanyuan",
)
