"""The trained template ships with the model. For every built-in template the Jinja chat template ferry writes
renders, through transformers' apply_chat_template(add_generation_prompt=True), exactly the text training put
before the reply: for plain conversations, and for every golden conversation with tools (LLaMA-Factory's own
renderings, tests/golden/templates.json) in each form serving stacks send: HF ``tool_calls`` with object
arguments and one ``tool`` message per result, ``tool_calls`` with JSON-string arguments as OpenAI clients send
them, and LLaMA-Factory's ``function`` / ``observation`` roles. load_tokenizer leaves the template on the
tokenizer, so the adapter folder's chat_template.jinja carries it."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))

from conversations import CONVERSATIONS, OPTIONS, PINNED_DATE  # noqa: E402
from standin import PROFILES  # noqa: E402

from trainer.templates import (  # noqa: E402
    TEMPLATES,
    chat_template_jinja,
    get_template,
    training_prompt_text,
)
from trainer.templates.jinja import TOOL_RESULTS_JOIN  # noqa: E402

pytestmark = pytest.mark.budget(90, reason="renders every tool golden through a trained and exported template")

PLAIN = [name for name, conv in CONVERSATIONS.items() if not conv["tools"]]
GOLDEN_DOC = json.loads((GOLDEN / "templates.json").read_text(encoding="utf-8"))
TOOL_CASES = [c for c in GOLDEN_DOC["cases"] if CONVERSATIONS[c["conversation"]]["tools"]]
DATE_STRING = datetime.datetime(*PINNED_DATE).strftime("%d %b %Y")


@pytest.fixture(scope="module")
def hf_tokenizer(stories_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_model))


@pytest.fixture(autouse=True)
def _pinned_date(monkeypatch):
    import trainer.templates.tools as tools

    monkeypatch.setattr(tools, "today", lambda: datetime.datetime(*PINNED_DATE))


def hf_messages(conv: dict) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    return msgs + [
        {"role": "tool" if m["role"] == "observation" else m["role"], "content": m["content"]}
        for m in conv["messages"][:-1]
    ]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_apply_chat_template_reproduces_the_training_prompt(hf_tokenizer, name: str) -> None:
    for enable_thinking in (True, False):
        template = get_template(name, enable_thinking=enable_thinking)
        for profile in ("llama2", "qwen"):
            bos, eos = PROFILES[profile]
            tok_eos = template.special_tokens_needed()[0] or eos
            hf_tokenizer.chat_template = chat_template_jinja(template, bos_token=bos, eos_token=tok_eos)
            for conv_name in PLAIN:
                conv = CONVERSATIONS[conv_name]
                want = training_prompt_text(
                    template, conv["messages"], conv["system"], bos_token=bos, eos_token=tok_eos
                )
                got = hf_tokenizer.apply_chat_template(hf_messages(conv), add_generation_prompt=True, tokenize=False)
                assert got == want, f"{name} / {conv_name} / thinking={enable_thinking} / {profile}"


def _calls(content: str) -> list[dict]:
    parsed = json.loads(content)
    return parsed if isinstance(parsed, list) else [parsed]


def served_forms(conv: dict) -> dict[str, list[dict]]:
    """The conversation without its last reply, in the message forms serving stacks send."""
    system = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    forms: dict[str, list[dict]] = {
        "tool_calls": list(system),
        "json_arguments": list(system),
        "llamafactory_roles": list(system),
    }
    for m in conv["messages"][:-1]:
        if m["role"] == "function":
            calls = _calls(m["content"])
            forms["tool_calls"].append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls
                    ],
                }
            )
            forms["json_arguments"].append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call_{k}",
                            "type": "function",
                            "function": {
                                "name": c["name"],
                                "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                            },
                        }
                        for k, c in enumerate(calls)
                    ],
                }
            )
            forms["llamafactory_roles"].append({"role": "function", "content": calls if len(calls) > 1 else calls[0]})
        elif m["role"] == "observation":
            results = [{"role": "tool", "content": part} for part in m["content"].split(TOOL_RESULTS_JOIN)]
            forms["tool_calls"] += results
            forms["json_arguments"] += results
            forms["llamafactory_roles"].append(dict(m))
        else:
            for form in forms.values():
                form.append(dict(m))
    return forms


def golden_prompt(case: dict, template) -> str:
    """The golden text before the last reply: LLaMA-Factory's whole rendering less that reply (and the final
    EOS an efficient_eos template appends), checked to end with it."""
    conv = CONVERSATIONS[case["conversation"]]
    opts = {"mask_history": False, **OPTIONS[case["option"]][1]}
    bos, eos = PROFILES[case["profile"]][0], case["eos_token"]
    pairs = template.render_text(
        conv["messages"],
        conv["system"],
        conv["tools"],
        bos_token=bos,
        eos_token=eos,
        drop_past_thoughts=opts["mask_history"] and not template.preserve_thinking,
    )
    reply = pairs[-1][1] + (eos if template.efficient_eos else "")
    full = "".join(text for text, _ in case["runs"])
    assert full.endswith(reply), f"{case['template']} / {case['conversation']}: the golden does not end with the reply"
    return full[: len(full) - len(reply)]


def test_every_tool_golden_renders_through_the_exported_template(hf_tokenizer) -> None:
    import jinja2

    checked = {"tool_calls": 0, "json_arguments": 0, "llamafactory_roles": 0, "refused": 0}
    for case in TOOL_CASES:
        if "runs" not in case:  # LLaMA-Factory refused it (e.g. glm4 with two calls in a turn)
            continue
        opts = {
            "mask_history": False,
            "enable_thinking": True,
            "default_system": None,
            "tool_format": None,
            **OPTIONS[case["option"]][1],
        }
        template = get_template(
            case["template"],
            default_system=opts["default_system"],
            enable_thinking=opts["enable_thinking"],
            tool_format=opts["tool_format"],
        )
        want = golden_prompt(case, template)
        hf_tokenizer.chat_template = chat_template_jinja(
            template,
            bos_token=PROFILES[case["profile"]][0],
            eos_token=case["eos_token"],
            mask_history=opts["mask_history"],
        )
        conv = CONVERSATIONS[case["conversation"]]
        where = f"{case['template']} / {case['conversation']} / {case['option']} / {case['profile']}"
        for form, messages in served_forms(conv).items():

            def render(messages=messages, conv=conv):
                return hf_tokenizer.apply_chat_template(
                    messages,
                    tools=json.loads(conv["tools"]),
                    tokenize=False,
                    add_generation_prompt=True,
                    date_string=DATE_STRING,
                )

            if form == "json_arguments" and not template.tools.encoded_arguments:
                with pytest.raises(jinja2.TemplateError, match="must be a JSON object"):
                    render()
                checked["refused"] += 1
                continue
            assert render() == want, f"{where} / {form}"
            checked[form] += 1
    assert min(checked.values()) > 20, checked
    assert checked["tool_calls"] == len([c for c in TOOL_CASES if "runs" in c])


def test_tools_follow_the_trained_tool_format_and_date() -> None:
    """Read back as text: the qwen template's tools block and calls as the Qwen format writes them, and the
    llama3 prompt's date from date_string (the served side) or the pinned clock (training)."""
    from trainer.templates import prompt_text

    tools = CONVERSATIONS["tools"]["tools"]
    text = prompt_text("qwen", [{"role": "user", "content": "Hi"}], tools=tools)
    assert text.startswith("<|im_start|>system\nYou are") and "# Tools" in text and '"name": "get_weather"' in text
    assert "Today Date: 31 Jan 2025" in prompt_text("llama3", [{"role": "user", "content": "Hi"}], tools=tools)


def test_a_function_turn_as_a_json_string_is_refused_in_one_line(hf_tokenizer) -> None:
    import jinja2

    hf_tokenizer.chat_template = chat_template_jinja(get_template("qwen"), bos_token=None, eos_token="<|im_end|>")
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    with pytest.raises(jinja2.TemplateError, match="cannot parse JSON"):
        hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "function", "content": call}], tokenize=False
        )


def test_load_tokenizer_carries_the_trained_template_into_save_pretrained(make_cfg, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.data import load_tokenizer

    tokenizer = load_tokenizer(make_cfg(template="alpaca"))
    tokenizer.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "chat_template.jinja").is_file()
    served = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    prompt = served.apply_chat_template([{"role": "user", "content": "Q?"}], add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nQ?\n\n### Response:\n"
    )
