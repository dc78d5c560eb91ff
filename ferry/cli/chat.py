"""CLI command ``ferry chat CONFIG.yaml``: a thin click wrapper over :func:`serving.chat.chat_loop` (LLaMA-Factory's
inference YAML)."""

from __future__ import annotations

import sys

import click

from ferry.constants import apply_offline_env


@click.command("chat")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
def chat_command(config) -> None:
    """Chat with a model and its adapters in the terminal, offline (LLaMA-Factory's inference YAML: model,
    adapter_name_or_path, template, infer_backend, default_system, generation keys). infer_backend: huggingface
    runs transformers here; vllm / sglang, where installed, start the engine's OpenAI-compatible server on
    127.0.0.1 for the chat. `clear` forgets the history, `exit` ends."""
    apply_offline_env()
    import logging

    from transformers.utils import logging as hf_logging

    from serving.chat import chat_loop

    hf_logging.set_verbosity_error()  # load reports and generation notices would interleave with the chat
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU backend warns at import (peft imports it)

    chat_loop(config, sys.stdin, sys.stdout)


COMMANDS = [chat_command]
