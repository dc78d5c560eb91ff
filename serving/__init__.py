"""serving: talking to a trained model, and telling others how to serve an export.

Public API::

    chat_loop(config, stdin, stdout) -> int          serving.chat     ``ferry chat CONFIG.yaml`` (LLaMA-Factory's
    read_chat_config(config) -> ChatSpec             serving.chat     inference YAML), in this process or through
    start_served_chat(spec) -> ServedChat            serving.engines  a vLLM / SGLang server it starts
    vllm_lora_fit(adapter_config) -> VllmFit         serving.vllm_lora whether vLLM serves an adapter, and how
    write_serving(output, ...) -> Path               serving.guide    SERVING.md of an export folder

Layers: serving may import the foundation (``ferry``, not ``ferry.cli``) and the trainer (chat templates, peft
loading); the exporter imports serving (SERVING.md), never the other way round. Every module here imports only the
standard library and ferry at load time; transformers, torch and huggingface_hub are imported when used.
"""

from __future__ import annotations

from serving.chat import ChatSpec, chat_loop, read_chat_config
from serving.engines import ServedChat, start_served_chat
from serving.guide import SERVING_MD, serving_markdown, write_serving
from serving.vllm_lora import VllmFit, vllm_lora_fit

__all__ = [
    "SERVING_MD",
    "ChatSpec",
    "ServedChat",
    "VllmFit",
    "chat_loop",
    "read_chat_config",
    "serving_markdown",
    "start_served_chat",
    "vllm_lora_fit",
    "write_serving",
]
