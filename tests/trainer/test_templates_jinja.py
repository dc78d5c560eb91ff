"""The trained template ships with the model: for every built-in template and golden conversation, the Jinja
chat template ferry writes renders, through transformers' apply_chat_template(add_generation_prompt=True),
exactly the text that training put before the reply; and load_tokenizer leaves it on the tokenizer, so the
adapter folder's chat_template.jinja carries it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))

from conversations import CONVERSATIONS  # noqa: E402
from standin import PROFILES  # noqa: E402

from trainer.templates import TEMPLATES, chat_template_jinja, get_template, training_prompt_text  # noqa: E402

PLAIN = [name for name, conv in CONVERSATIONS.items() if not conv["tools"]]


@pytest.fixture(scope="module")
def hf_tokenizer(stories_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_model))


def hf_messages(conv: dict) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    return msgs + [{"role": "tool" if m["role"] == "observation" else m["role"], "content": m["content"]}
                   for m in conv["messages"][:-1]]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_apply_chat_template_reproduces_the_training_prompt(hf_tokenizer, name: str) -> None:
    for enable_thinking in (True, False):
        template = get_template(name, enable_thinking=enable_thinking)
        for profile in ("llama2", "qwen"):
            bos, eos = PROFILES[profile]
            tok_eos = template.stop_words[0] if template.replace_eos else eos
            hf_tokenizer.chat_template = chat_template_jinja(template, bos_token=bos, eos_token=tok_eos)
            for conv_name in PLAIN:
                conv = CONVERSATIONS[conv_name]
                want = training_prompt_text(template, conv["messages"], conv["system"], bos_token=bos,
                                            eos_token=tok_eos)
                got = hf_tokenizer.apply_chat_template(hf_messages(conv), add_generation_prompt=True, tokenize=False)
                assert got == want, f"{name} / {conv_name} / thinking={enable_thinking} / {profile}"


def test_tools_are_refused_not_guessed(hf_tokenizer) -> None:
    import jinja2

    hf_tokenizer.chat_template = chat_template_jinja(get_template("qwen"), bos_token=None, eos_token="<|im_end|>")
    with pytest.raises(jinja2.TemplateError, match="does not render a tools list"):
        hf_tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {
            "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}], tokenize=False)


def test_load_tokenizer_carries_the_trained_template_into_save_pretrained(make_cfg, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.data import load_tokenizer

    tokenizer = load_tokenizer(make_cfg(template="alpaca"))
    tokenizer.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "chat_template.jinja").is_file()
    served = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    prompt = served.apply_chat_template([{"role": "user", "content": "Q?"}], add_generation_prompt=True,
                                        tokenize=False)
    assert prompt == ("Below is an instruction that describes a task. Write a response that appropriately "
                      "completes the request.\n\n### Instruction:\nQ?\n\n### Response:\n")
