"""No `template` set: the tokenizer's own chat_template, rendered once, with the assistant replies located in
the text (or marked by {% generation %}); templates that rewrite earlier turns (Qwen3 drops earlier reasoning)
work; a reply the template drops is refused naming file and row.

The chat templates below are written for these tests to reproduce the behaviours of the model families'
templates (Qwen3's reasoning handling, Llama 3's headers and trimming, Gemma's model role and system folded into
the first user turn, Mistral's [INST] and EOS, GLM-4's turns without an end marker); they are not copies of the
models' files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.errors import DataError
from tests.support.helpers import write_json
from trainer.data import prepare_data
from trainer.loss import IGNORE_INDEX

QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=0) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{%- set c = m.content -%}{%- set r = '' -%}"
    "{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' ~ r ~ '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- c ~ '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA3_LIKE = (
    "{{- bos_token -}}{%- for m in messages -%}"
    "{{- '<|start_header_id|>' ~ m.role ~ '<|end_header_id|>\\n\\n' ~ (m.content | trim) ~ '<|eot_id|>' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)
GEMMA_LIKE = (
    "{{- bos_token -}}{%- set first = '' -%}{%- set loop_messages = messages -%}"
    "{%- if messages[0].role == 'system' -%}{%- set first = messages[0].content ~ '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- for m in loop_messages -%}{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{- '<start_of_turn>' ~ role ~ '\\n' ~ (first if loop.first else '') ~ m.content ~ '<end_of_turn>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
MISTRAL_LIKE = (
    "{{- bos_token -}}{%- for m in messages -%}{%- if m.role == 'user' -%}{{- '[INST] ' ~ m.content ~ '[/INST]' -}}"
    "{%- elif m.role == 'assistant' -%}{{- m.content ~ eos_token -}}{%- endif -%}{%- endfor -%}"
)
GLM4_LIKE = (
    "[gMASK]<sop>{%- for m in messages -%}{{- '<|' ~ m.role ~ '|>\\n' ~ m.content -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
GENERATION_MARKED = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- 'A: ' -}}{% generation %}"
    "{{- m.content ~ eos_token -}}{% endgeneration %}{{- '\\n' -}}{%- else -%}"
    "{{- m.role ~ ': ' ~ m.content ~ '\\n' -}}{%- endif -%}{%- endfor -%}"
)

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>\nThree plus three.\n</think>\n\n6"},
        ]
    }
]


def trained(tokenizer, example) -> list[str]:
    runs, cur = [], []
    for tok, lab in zip(example["input_ids"], example["labels"]):
        if lab != IGNORE_INDEX:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


@pytest.fixture
def with_template(stories_tokenizer):
    saved = stories_tokenizer.chat_template

    def set_template(text: str):
        stories_tokenizer.chat_template = text
        return stories_tokenizer

    yield set_template
    stories_tokenizer.chat_template = saved


@pytest.mark.parametrize(
    ("name", "jinja", "expected"),
    [
        # Qwen3: the earlier turn's reasoning is dropped by the template, the last one kept: both answers trained
        ("qwen3", QWEN3_LIKE, ["4<|im_end|>", "<think>\nThree plus three.\n</think>\n\n6<|im_end|>"]),
        (
            "llama3",
            LLAMA3_LIKE,
            ["<think>\nTwo plus two.\n</think>\n\n4<|eot_id|>", "<think>\nThree plus three.\n</think>\n\n6<|eot_id|>"],
        ),
        (
            "gemma",
            GEMMA_LIKE,
            [
                "<think>\nTwo plus two.\n</think>\n\n4<end_of_turn>",
                "<think>\nThree plus three.\n</think>\n\n6<end_of_turn>",
            ],
        ),
        ("glm4", GLM4_LIKE, ["<think>\nTwo plus two.\n</think>\n\n4", "<think>\nThree plus three.\n</think>\n\n6"]),
    ],
)
def test_chat_template_rendered_once_trains_each_reply(
    make_cfg, with_template, tmp_path: Path, name: str, jinja: str, expected: list[str]
) -> None:
    tokenizer = with_template(jinja)
    path = write_json(tmp_path / "chat.json", ROWS)
    data = prepare_data(make_cfg(dataset=str(path), cutoff_len=2048), tokenizer)
    assert data.stats["template"] == "tokenizer-chat-template"
    example = data.train[0]
    full = tokenizer.apply_chat_template(ROWS[0]["messages"], tokenize=False)
    assert example["input_ids"] == tokenizer(full, add_special_tokens=False)["input_ids"]
    got = [t.strip() for t in trained(tokenizer, example)]
    assert got == [e.strip() for e in expected]


def test_mistral_like_trains_reply_and_eos(make_cfg, with_template, tmp_path: Path) -> None:
    tokenizer = with_template(MISTRAL_LIKE)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye."},
            ]
        }
    ]
    data = prepare_data(make_cfg(cutoff_len=2048, dataset=str(write_json(tmp_path / "m.json", rows))), tokenizer)
    assert [t.strip() for t in trained(tokenizer, data.train[0])] == ["Hello.</s>", "Bye.</s>"]


def test_generation_markers_decide_the_mask(make_cfg, with_template, tmp_path: Path) -> None:
    tokenizer = with_template(GENERATION_MARKED)
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    data = prepare_data(make_cfg(cutoff_len=2048, dataset=str(write_json(tmp_path / "g.json", rows))), tokenizer)
    assert [t.strip() for t in trained(tokenizer, data.train[0])] == ["Hello.</s>"]


def test_a_reply_the_template_drops_is_refused_naming_file_and_row(make_cfg, with_template, tmp_path: Path) -> None:
    tokenizer = with_template(
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{{- 'U: ' ~ m.content ~ '\\n' -}}"
        "{%- else -%}{{- 'A: [redacted]\\n' -}}{%- endif -%}{%- endfor -%}"
    )
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    path = write_json(tmp_path / "d.json", rows)
    with pytest.raises(DataError, match=r"d.json: row 1: message 1 \(assistant\): its text does not appear"):
        prepare_data(make_cfg(dataset=str(path), cutoff_len=2048), tokenizer)
    assert json.loads(path.read_text()) == rows
