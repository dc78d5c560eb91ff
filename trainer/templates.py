"""Built-in chat templates: how a conversation becomes the text a model is trained on.

A template renders a conversation as a list of *segments*, each marked trainable or not, so that the loss
mask is exact by construction (no searching for the response inside the rendered text)::

    [BOS] system-prefix  user-turn-1  ASSISTANT-1 EOS  separator  user-turn-2  ASSISTANT-2 EOS
          ^^^^^^^^^^^^^  ^^^^^^^^^^^                   ^^^^^^^^^  ^^^^^^^^^^^
          not trained    not trained  trained          not trained             trained

The names and layouts follow LLaMA-Factory's ``src/llamafactory/data/template.py`` (``default``, ``alpaca``,
``chatml``, ``qwen``, ``llama3``, ``llama2``, ``mistral``, ``empty``). When ``template`` is not set in the
config, the tokenizer's own ``chat_template`` (Jinja, rendered by transformers) is used instead; see
:mod:`trainer.data`. This module is pure Python: it knows nothing about tokenizers except the names of the
BOS/EOS slots.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Template:
    """One chat layout.

    Attributes:
        name: the key users write as ``template:`` in the config.
        system: format of the system prompt, with ``{content}``; rendered before the first user turn.
        user: format of a user turn, with ``{content}``; it ends with the assistant's header so that the
            model's reply starts right after it (generation prompt).
        assistant: format of an assistant turn, with ``{content}``; it ends with the end-of-turn marker.
            Every assistant turn is trained on, including its end-of-turn marker and the EOS token.
        separator: text between an assistant turn and the next user turn (not trained).
        default_system: system prompt used when a sample has none ("" for none).
        observation: format of a tool result turn (sharegpt ``observation``), not trained.
        add_eos: append the tokenizer's EOS id after each assistant turn unless the assistant format already
            ends with the tokenizer's EOS token text (e.g. ``<|im_end|>`` for Qwen instruct tokenizers).
        system_in_user: the rendered system prompt goes inside the first user turn (``[INST] <<SYS>>...``,
            as Llama 2 and Mistral expect) instead of before it.
    """

    name: str
    system: str
    user: str
    assistant: str
    separator: str = ""
    default_system: str = ""
    observation: str | None = None
    add_eos: bool = True
    system_in_user: bool = False

    def format_observation(self) -> str:
        """The observation (tool result) format; defaults to the user format."""
        return self.observation if self.observation is not None else self.user


_CHATML = dict(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    assistant="{content}<|im_end|>",
    separator="\n",
    observation="<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n",
)

#: Every built-in template by name. ``default`` is LLaMA-Factory's ``default`` ("Human: ...\nAssistant:").
TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template(
            name="default",
            system="System: {content}\n",
            user="Human: {content}\nAssistant:",
            assistant="{content}",
            separator="\n",
        ),
        Template(
            name="alpaca",
            system="{content}\n\n",
            user="### Instruction:\n{content}\n\n### Response:\n",
            assistant="{content}",
            separator="\n\n",
            default_system=(
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request."
            ),
        ),
        Template(name="chatml", **_CHATML),
        Template(name="qwen", default_system="You are a helpful assistant.", **_CHATML),
        Template(
            name="llama3",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            user=(
                "<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            assistant="{content}<|eot_id|>",
            observation=(
                "<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
        ),
        Template(
            name="llama2",
            system="<<SYS>>\n{content}\n<</SYS>>\n\n",
            user="[INST] {content} [/INST]",
            assistant="{content}",
            system_in_user=True,
        ),
        Template(name="mistral", system="{content}\n\n", user="[INST] {content}[/INST]", assistant="{content}",
                 system_in_user=True),
        Template(name="empty", system="{content}", user="{content}", assistant="{content}"),
    )
}


def get_template(name: str) -> Template:
    """The built-in template called ``name``.

    Raises:
        KeyError: no such template (the config validator turns this into a ConfigError naming the nearest).
    """
    return TEMPLATES[name]


__all__ = ["Template", "TEMPLATES", "get_template"]
