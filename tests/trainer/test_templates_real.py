"""No `template` set, with the REAL chat templates of Qwen3 / Qwen3.5, Llama 3.1 / 3.2, Gemma 2 / 4, Mistral Nemo /
Small 3.2, GLM-4.6 / 4.7 and DeepSeek-V3.1 (fetched at test time, provenance in :mod:`tests.support.chat_templates`) on
the stories260K tokenizer with each template's special tokens added.

For every template and conversation (with and without a system prompt, Chinese text, Qwen3-style reasoning in an
earlier turn that the template strips) ferry's data pipeline must
(a) train on exactly the text ``apply_chat_template`` renders, token for token;
(b) train exactly the assistant replies as the template writes them: the expected character spans are computed
    here on their own, from the prompt that ``add_generation_prompt=True`` renders for the conversation up to the
    reply (where the full rendering starts with it; else from where the reply's text lies) to the template's
    end-of-turn marker, which is written into the table below by hand; and for one conversation the trained
    pieces are also spelled out literally;
(c) refuse, naming the file and the row, a conversation whose reply the template drops or a template refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.errors import DataError
from tests.support.helpers import run_ferry_train, write_json
from trainer.data import prepare_data
from trainer.loss import IGNORE_INDEX

pytestmark = pytest.mark.budget(60, reason="ferry train with the real Qwen3 template")

#: name -> (special tokens the real vocabulary holds as single tokens, the header the template writes before an
#: assistant reply, the end-of-turn marker written after a reply ("" when the next turn's header follows directly),
#: whether the template accepts a system message). Written by hand from the templates.
SPECS: dict[str, tuple[list[str], str, str, bool]] = {
    "qwen3": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_start|>assistant\n", "<|im_end|>", True),
    "qwen3.5": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_start|>assistant\n", "<|im_end|>", True),
    "llama3.1": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
        True,
    ),
    "llama3.2": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
        True,
    ),
    "gemma2": (["<start_of_turn>", "<end_of_turn>"], "<start_of_turn>model\n", "<end_of_turn>", False),
    "gemma4": (["<|turn>", "<turn|>", "<|channel>", "<channel|>"], "<|turn>model\n", "<turn|>", True),
    "mistral-nemo": (["[INST]", "[/INST]"], "[/INST]", "</s>", True),
    "mistral-small3.2": (["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], "[/INST]", "</s>", True),
    "glm4.6": (
        ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"],
        "<|assistant|>",
        "",
        True,
    ),
    "glm4.7-flash": (
        ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"],
        "<|assistant|>",
        "",
        True,
    ),
    "deepseek-v3.1": (
        ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>"],
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
        True,
    ),
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ENGLISH = [
    {"role": "user", "content": "Tell me a story about a cat."},
    {"role": "assistant", "content": "Once upon a time, a cat found a ball."},
    {"role": "user", "content": "What did the cat do next?"},
    {"role": "assistant", "content": "The cat played with the ball all day."},
]
CHINESE = [
    {"role": "user", "content": "你好，请讲一个故事。"},
    {"role": "assistant", "content": "从前有一只小猫。"},
    {"role": "user", "content": "然后呢？"},
    {"role": "assistant", "content": "小猫找到了一个球。"},
]
REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nThree plus three is six.\n</think>\n\n6"},
]
CONVERSATIONS = {
    "english+system": [SYSTEM, *ENGLISH],
    "english": ENGLISH,
    "chinese+system": [SYSTEM, *CHINESE],
    "chinese": CHINESE,
    "reasoning": REASONING,
}


@pytest.fixture(scope="session")
def real_tokenizers(real_chat_templates, stories_model: Path):
    """name -> a stories260K tokenizer with that real chat_template and its special tokens."""
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer

    out = {}
    for name, (specials, *_rest) in SPECS.items():
        tok = load_tokenizer(TrainConfig(model_name_or_path=str(stories_model), dataset="unused", output_dir="unused"))
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.chat_template = real_chat_templates[name]
        out[name] = tok
    return out


def expected_spans(
    tokenizer,
    messages: list[dict[str, str]],
    header: str,
    end_marker: str,
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character span of each assistant reply as the template writes it: from the
    end of the generation prompt for the messages before it (where the rendering starts with that prompt), else
    from the end of the assistant header before the reply's text, to the end-of-turn marker after it."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for k, msg in enumerate(messages):
        text = msg["content"]
        if msg["role"] != "assistant":
            if full.find(text, cursor) >= 0:
                cursor = full.find(text, cursor) + len(text)
            continue
        at = full.find(text.strip(), cursor)
        end = at + len(text.strip())
        if at < 0:  # the template rewrote the reasoning: the answer after it
            answer = text.split("</think>")[-1].strip()
            at = full.index(answer, cursor)
            end = at + len(answer)
        prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        if full.startswith(prompt) and cursor < len(prompt) <= end:
            start = len(prompt)
        else:
            start = full.rindex(header, cursor, at) + len(header)
        if end_marker:
            marker = full.index(end_marker, end)
            assert full[end:marker].strip() == "", ("only the marker follows the reply", full[end:marker])
            end = marker + len(end_marker)
        spans.append((start, end))
        cursor = end
    return full, spans


def trained_char_spans(tokenizer, example, full: str) -> list[tuple[int, int]]:
    """Character spans of ``full`` covered by runs of trained tokens."""
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == example["input_ids"], "trained on the text apply_chat_template renders"
    spans: list[list[int]] = []
    prev = False
    for (a, b), lab in zip(enc["offset_mapping"], example["labels"]):
        on = lab != IGNORE_INDEX
        if on and prev:
            spans[-1][1] = b
        elif on:
            spans.append([a, b])
        prev = on
    return [tuple(s) for s in spans]


def token_spans(tokenizer, full: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans widened to the tokens that start inside them (a token is trained when its first character is)."""
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for s, e in spans:
        inside = [(a, b) for a, b in enc["offset_mapping"] if s <= a < e]
        out.append((inside[0][0], inside[-1][1]))
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_real_chat_template_trains_the_rendered_replies(real_tokenizers, make_cfg, tmp_path: Path, name: str) -> None:
    tokenizer = real_tokenizers[name]
    _specials, header, end_marker, takes_system = SPECS[name]
    convs = {k: v for k, v in CONVERSATIONS.items() if takes_system or v[0]["role"] != "system"}
    path = write_json(tmp_path / "chat.json", [{"messages": m} for m in convs.values()])
    data = prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), tokenizer)
    assert data.stats["template"] == "tokenizer-chat-template"
    assert len(data.train) == len(convs)
    for example, (label, messages) in zip(data.train, convs.items()):
        full, spans = expected_spans(tokenizer, messages, header, end_marker)
        got = trained_char_spans(tokenizer, example, full)
        assert got == token_spans(tokenizer, full, spans), (
            label,
            [full[a:b] for a, b in got],
            [full[a:b] for a, b in spans],
        )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # Qwen3 drops the earlier turn's reasoning and keeps the last one (with its <think> block) as the reply
        ("qwen3", ["4<|im_end|>", "<think>\nThree plus three is six.\n</think>\n\n6<|im_end|>"]),
        # ... and writes an empty <think> block before a last reply without reasoning: the model's output, trained
        (
            "qwen3/no-reasoning",
            [
                "Once upon a time, a cat found a ball.<|im_end|>",
                "<think>\n\n</think>\n\nThe cat played with the ball all day.<|im_end|>",
            ],
        ),
        # Qwen3.5's generation prompt already holds '<think>\n': the model writes what follows
        ("qwen3.5", ["4<|im_end|>", "Three plus three is six.\n</think>\n\n6<|im_end|>"]),
        (
            "llama3.1",
            [
                "<think>\nTwo plus two is four.\n</think>\n\n4<|eot_id|>",
                "<think>\nThree plus three is six.\n</think>\n\n6<|eot_id|>",
            ],
        ),
        (
            "gemma2",
            [
                "<think>\nTwo plus two is four.\n</think>\n\n4<end_of_turn>",
                "<think>\nThree plus three is six.\n</think>\n\n6<end_of_turn>",
            ],
        ),
        (
            "mistral-nemo",
            [
                "<think>\nTwo plus two is four.\n</think>\n\n4</s>",
                "<think>\nThree plus three is six.\n</think>\n\n6</s>",
            ],
        ),
        # GLM-4.6 writes an empty reasoning block for an earlier turn and keeps the last turn's reasoning
        ("glm4.6", ["\n<think></think>\n4", "\n<think>Three plus three is six.</think>\n6"]),
        # DeepSeek-V3.1 (non-thinking): '<think></think>' ends the generation prompt, every reasoning dropped
        ("deepseek-v3.1", ["\n\n4<｜end▁of▁sentence｜>", "\n\n6<｜end▁of▁sentence｜>"]),
    ],
)
def test_real_chat_template_trained_text_spelled_out(
    real_tokenizers, make_cfg, tmp_path: Path, name: str, expected: list[str]
) -> None:
    messages = ENGLISH if name.endswith("/no-reasoning") else REASONING
    tokenizer = real_tokenizers[name.split("/")[0]]
    path = write_json(tmp_path / "r.json", [{"messages": messages}])
    example = prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), tokenizer).train[0]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert [full[a:b] for a, b in trained_char_spans(tokenizer, example, full)] == expected


@pytest.mark.parametrize(
    ("name", "messages", "why"),
    [
        ("gemma2", [SYSTEM, *ENGLISH], "System role not supported"),
        # Gemma 4 cuts a thought channel out of a reply: what remains is not the reply's text, so no span is found
        (
            "gemma4",
            [ENGLISH[0], {"role": "assistant", "content": "A cat.<|channel>thought\nhm<channel|> The end."}],
            "message 1 (assistant): its text does not appear in what the tokenizer's chat_template renders",
        ),
    ],
)
def test_real_chat_template_refusal_names_file_and_row(
    real_tokenizers, make_cfg, tmp_path: Path, name: str, messages, why: str
) -> None:
    rows = [{"messages": ENGLISH}, {"messages": messages}]
    path = write_json(tmp_path / "bad.json", rows)
    with pytest.raises(DataError) as info:
        prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), real_tokenizers[name])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row 2: ") and why in message, message


def test_ferry_train_with_the_real_qwen3_template(
    real_chat_templates, stories_model: Path, llamafactory_data: Path, tmp_path: Path
) -> None:
    """One real `ferry train` (torchrun, 1 worker, 2 steps) on a model folder whose tokenizer carries Qwen3's own
    chat_template (no `template:` key), on multi-turn rows with earlier-turn reasoning: it trains, and the adapter
    folder serves the same template (so the served prompt is the trained one)."""

    from transformers import AutoTokenizer

    from tests.support.helpers import tiny_config, worker_env, write_config

    model = tmp_path / "model"
    model.mkdir()
    for f in stories_model.iterdir():
        (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(real_chat_templates["qwen3"], encoding="utf-8")
    rows = [{"messages": m} for m in ([SYSTEM, *ENGLISH], CHINESE, REASONING) * 4]
    data = write_json(tmp_path / "qwen3_chat.json", rows)
    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        tmp_path,
        model_name_or_path=str(model),
        dataset=str(data),
        max_steps=2,
        cutoff_len=256,
        max_samples=None,
    )
    del cfg["template"]
    config = write_config(tmp_path / "c.yaml", cfg)
    proc = run_ferry_train(
        str(config), "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["num_train_samples"] == 12 and report["global_steps"] == 2, report
    assert report["data_stats"]["template"] == "tokenizer-chat-template", report["data_stats"]
    served = AutoTokenizer.from_pretrained(tmp_path / "out" / "adapter")
    assert served.chat_template == real_chat_templates["qwen3"]


TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
TOOL_ROW = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": json.dumps({"temp": 20})},
        {"from": "gpt", "value": "It is 20 degrees."},
    ],
    "tools": json.dumps(TOOLS),
}
#: the same conversation in the Hugging Face layout, written by hand
TOOL_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": json.dumps({"temp": 20})},
    {"role": "assistant", "content": "It is 20 degrees."},
]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "qwen3",
            [
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                "<think>\n\n</think>\n\nIt is 20 degrees.<|im_end|>",
            ],
        ),
        (
            "llama3.1",
            ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 20 degrees.<|eot_id|>"],
        ),
        (
            "glm4.6",
            [
                "\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "</tool_call>",
                "\n<think></think>\nIt is 20 degrees.",
            ],
        ),
        (
            "deepseek-v3.1",
            [
                '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                "It is 20 degrees.<｜end▁of▁sentence｜>",
            ],
        ),
    ],
)
def test_real_chat_template_trains_tool_calls_in_its_own_format(
    real_tokenizers, make_cfg, tmp_path: Path, name: str, expected: list[str]
) -> None:
    """LLaMA-Factory's function_call / observation / tools go to the template as tool_calls, tool messages and
    ``tools``: the rendering is the template's own (tool list block, call syntax) and the calls are trained."""
    tokenizer = real_tokenizers[name]
    path = write_json(tmp_path / "tools.json", [TOOL_ROW])
    example = prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), tokenizer).train[0]
    full = tokenizer.apply_chat_template(
        TOOL_MESSAGES, tools=[{"type": "function", "function": t} for t in TOOLS], tokenize=False
    )
    if name != "deepseek-v3.1":  # DeepSeek-V3.1's template ignores `tools` (its users write them into the system)
        assert "Weather of a city" in full  # the tool list as the template writes it
    assert [full[a:b] for a, b in trained_char_spans(tokenizer, example, full)] == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3.1", ["Once upon a time, a cat found a ball.<|eot_id|>", "<|eot_id|>"]),
        ("qwen3", ["Once upon a time, a cat found a ball.<|im_end|>", "<think>\n\n</think>\n\n<|im_end|>"]),
    ],
)
def test_real_chat_template_empty_reply_trains_the_end_of_turn(
    real_tokenizers, make_cfg, tmp_path: Path, name: str, expected: list[str]
) -> None:
    messages = [*ENGLISH[:3], {"role": "assistant", "content": ""}]
    path = write_json(tmp_path / "empty.json", [{"messages": messages}])
    tokenizer = real_tokenizers[name]
    example = prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), tokenizer).train[0]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert [full[a:b] for a, b in trained_char_spans(tokenizer, example, full)] == expected


def test_real_chat_template_refusing_tool_calls_names_file_and_row(real_tokenizers, make_cfg, tmp_path: Path) -> None:
    """Mistral's template wants 9-character tool call ids, which LLaMA-Factory data does not carry: refused."""
    hello = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    path = write_json(tmp_path / "tools.json", [hello, TOOL_ROW])
    with pytest.raises(
        DataError,
        match=r"tools.json: row 2: the tokenizer's chat_template refused this "
        r"conversation: Tool call IDs should be alphanumeric strings with length 9",
    ):
        prepare_data(make_cfg(dataset=str(path), cutoff_len=4096), real_tokenizers["mistral-nemo"])
