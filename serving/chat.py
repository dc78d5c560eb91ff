"""``ferry chat CONFIG.yaml``: an offline terminal chat from LLaMA-Factory's inference YAML.

``examples/inference/*.yaml`` (``llamafactory-cli chat CONFIG``) name the base (``model_name_or_path``), the
adapters (``adapter_name_or_path``, merged into the base in order, as LLaMA-Factory does for inference), the chat
template (``template``, ferry's built-in templates: the prompt is rendered exactly as in training),
``infer_backend`` (``huggingface``: transformers in this process; ``vllm`` / ``sglang`` where installed: the
engine's own OpenAI-compatible server, started for the chat, :mod:`serving.engines`; otherwise, and for
ktransformers, one line that says whether the package is installed), ``default_system`` and the generation
keys of LLaMA-Factory's GeneratingArguments (``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``num_beams``,
``max_new_tokens``, ``repetition_penalty``, ``length_penalty``, ``skip_special_tokens``).

The loop reads one user turn per line; ``clear`` drops the history, ``exit`` ends the chat (as LLaMA-Factory's CLI);
``image PATH`` attaches an image to the next turn (a vision-language model with a Qwen-VL image processor, backend
huggingface: the turn gets an ``<image>`` placeholder in front unless it writes its own, and the image is processed
as in training, :mod:`trainer.vision`); the reply streams token by token (transformers' ``TextIteratorStreamer``)
and stops at the template's stop words.
Through a pipe (stdin not a terminal) stdout carries the replies alone, one newline after each, flushed as they
stream: ``printf 'Hi\\nexit\\n' | ferry chat CONFIG.yaml``.
"""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ferry.errors import ConfigError
from serving.engines import BACKENDS, SERVER_BACKENDS, backend_message

#: LLaMA-Factory's generation keys (GeneratingArguments) and their defaults there.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.95,
    "top_p": 0.7,
    "top_k": 50,
    "num_beams": 1,
    "max_new_tokens": 1024,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
}
CHAT_KEYS = (
    "model_name_or_path",
    "adapter_name_or_path",
    "template",
    "infer_backend",
    "trust_remote_code",
    "default_system",
    "enable_thinking",
    "skip_special_tokens",
    "infer_dtype",
    *GENERATION_DEFAULTS,
)


@dataclass
class ChatSpec:
    """An inference YAML read: base, adapter folders (merge order), template name, system prompt, generation
    keyword arguments for ``model.generate``, dtype name."""

    base: str
    adapters: list[Path]
    template: str | None
    default_system: str | None
    generation: dict[str, Any] = field(default_factory=dict)
    skip_special_tokens: bool = True
    trust_remote_code: bool = False
    dtype: str = "auto"
    backend: str = "huggingface"


def read_chat_config(path: str | os.PathLike) -> ChatSpec:
    """Read LLaMA-Factory's inference YAML.

    Raises:
        ConfigError: missing file, not a mapping, an unknown key (nearest known one named), no
            model_name_or_path, an unknown template, or an ``infer_backend`` other than huggingface, or vllm /
            sglang installed here (:func:`backend_message`).
    """
    from ferry.adapter_folder import adapter_folder
    from ferry.yaml_config import read_yaml_mapping

    file = Path(path)
    data = read_yaml_mapping(file)
    # every other key LLaMA-Factory's chat parser takes (model, data, fine-tuning, generation arguments) is accepted
    # without a word, as LLaMA-Factory does: a YAML that runs there is not refused here for a key it does not need
    from ferry.lf_keys import lf_keys, refuse_model_changes

    taken = lf_keys("infer")
    refuse_model_changes(data, str(file))
    unknown = [k for k in data if k not in CHAT_KEYS and k not in taken]
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), CHAT_KEYS, n=1, cutoff=0.6)
        raise ConfigError(
            f"{file}: unknown key {unknown[0]!r} in an inference YAML"
            + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    backend = str(data.get("infer_backend", "huggingface"))
    if backend != "huggingface":
        import importlib.util

        if backend not in SERVER_BACKENDS or importlib.util.find_spec(SERVER_BACKENDS[backend]) is None:
            raise ConfigError(f"{file}: {backend_message(backend)}")
    if not data.get("model_name_or_path"):
        raise ConfigError(f"{file}: missing required key 'model_name_or_path'")
    template = data.get("template")
    if template is not None:
        from trainer.templates import TEMPLATES, unknown_template_message

        if template not in TEMPLATES:
            raise ConfigError(f"{file}: template: {unknown_template_message(str(template))}")
    raw = data.get("adapter_name_or_path")
    names = [p.strip() for p in raw.split(",") if p.strip()] if isinstance(raw, str) else list(raw or [])
    generation = {k: data.get(k, v) for k, v in GENERATION_DEFAULTS.items()}
    if not generation["do_sample"]:  # greedy: the sampling knobs would only make transformers warn
        for key in ("temperature", "top_p", "top_k"):
            generation.pop(key)
    return ChatSpec(
        base=str(data["model_name_or_path"]),
        adapters=[adapter_folder(n) for n in names],
        template=template,
        default_system=data.get("default_system"),
        generation=generation,
        skip_special_tokens=bool(data.get("skip_special_tokens", True)),
        trust_remote_code=bool(data.get("trust_remote_code")),
        dtype=str(data.get("infer_dtype", "auto")),
        backend=backend,
    )


@dataclass
class ChatModel:
    """A loaded chat model: ``model`` (adapters merged), ``tokenizer`` (the last adapter's tokenizer files when it
    has them: they carry the trained special tokens), ``template`` (None: the tokenizer's own chat template),
    ``stop_ids`` (EOS and the template's stop words), ``images`` (:class:`trainer.vision.ImageProcessing` of a
    vision-language base, else None)."""

    model: Any
    tokenizer: Any
    template: Any
    stop_ids: list[int]
    spec: ChatSpec
    images: Any = None


def model_class(model_dir: Path, trust_remote_code: bool) -> Any:
    """The transformers Auto class to chat with ``model_dir`` (:func:`ferry.architecture.auto_model_class`:
    ``AutoModelForImageTextToText`` for a vision-language model without a causal-LM class, such as Qwen3-VL:
    LLaMA-Factory's inference/qwen3vl.yaml; an adapter trained on that class names its modules)."""
    from transformers import AutoConfig

    from ferry.architecture import auto_model_class

    return auto_model_class(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))


def load_chat_model(spec: ChatSpec) -> ChatModel:
    """Load the base on CUDA when available (else CPU; with the RoPE scaling the last adapter was trained with),
    merge the adapters in order (peft's ``merge_and_unload``).

    Raises:
        ferry.errors.NotInstalledError / SourceError: the base is not installed (``ferry.hub.resolve_model``).
    """
    import torch
    from transformers import AutoTokenizer

    from ferry.adapter_folder import read_rope_record
    from ferry.hub import resolve_model
    from trainer.peft_build import load_peft_adapter

    base_dir = resolve_model(spec.base, None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "auto" if spec.dtype == "auto" else getattr(torch, spec.dtype)
    kwargs: dict[str, Any] = {}
    rope = read_rope_record(spec.adapters[-1]) if spec.adapters else None
    if rope is not None:  # the base as the adapter was trained over it: its RoPE stretched (rope_scaling)
        from ferry.rope import scaled_config

        kwargs["config"] = scaled_config(base_dir, rope, trust_remote_code=spec.trust_remote_code)
    auto = model_class(base_dir, spec.trust_remote_code)
    model = auto.from_pretrained(base_dir, dtype=dtype, trust_remote_code=spec.trust_remote_code, **kwargs)
    for adapter in spec.adapters:
        model = load_peft_adapter(model, str(adapter)).merge_and_unload()
    model.to(device).eval()
    tok_dir = next((a for a in reversed(spec.adapters) if (a / "tokenizer_config.json").is_file()), base_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=spec.trust_remote_code)
    template = None
    if spec.template is not None:
        from trainer.templates import get_template

        template = get_template(spec.template, default_system=spec.default_system)
        template.fix_special_tokens(tokenizer)
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for word in template.stop_words if template is not None else []:
        token = tokenizer.convert_tokens_to_ids(word)
        if isinstance(token, int) and token != tokenizer.unk_token_id and token not in stop_ids:
            stop_ids.append(token)
    images = None
    if auto.__name__ == "AutoModelForImageTextToText" and (base_dir / "preprocessor_config.json").is_file():
        from trainer.vision import ImageProcessing

        try:
            images = ImageProcessing(base_dir)
        except ConfigError:  # not a Qwen-VL processor: the chat stays text only
            images = None
    return ChatModel(model, tokenizer, template, stop_ids, spec, images)


def image_inputs(chat: ChatModel, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``messages`` with each ``<image>`` placeholder expanded into the image's slot tokens, and the model's image
    inputs (``pixel_values``, ``image_grid_thw``), for the images the messages carry (``"images"``: paths, in
    order); ``(messages, {})`` when they carry none.

    Raises:
        ConfigError: images for a model without a Qwen-VL image processor.
        DataError: an image is missing or unreadable; placeholders and images do not match.
    """
    from trainer.vision import ImageSlots, check_placeholders, expand_placeholders

    paths = [str(p) for m in messages for p in m.get("images", ())]
    if not paths:
        return messages, {}
    if chat.images is None:
        raise ConfigError(f"{chat.spec.base} takes no images here (no Qwen-VL image processor in its folder)")
    texts = [m["content"] for m in messages]
    check_placeholders(texts, len(paths), "chat")
    counts = chat.images.token_counts(paths, "chat")
    expanded = expand_placeholders(texts, counts, ImageSlots())
    return [{"role": m["role"], "content": t} for m, t in zip(messages, expanded)], chat.images.inputs(paths, "chat")


def prompt_ids(chat: ChatModel, messages: list[dict[str, str]]) -> list[int]:
    """The generation prompt of ``messages`` (the last one a user turn): the template's rendering as in training,
    or the tokenizer's own chat template when the YAML names none."""
    if chat.template is not None:
        return list(chat.template.encode_prompt(chat.tokenizer, messages, chat.spec.default_system))
    system = [{"role": "system", "content": chat.spec.default_system}] if chat.spec.default_system else []
    return list(
        chat.tokenizer.apply_chat_template(
            system + messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def stream_reply(chat: ChatModel, messages: list[dict[str, str]]) -> Iterator[str]:
    """Generate the reply to ``messages`` and yield its text piece by piece as tokens arrive."""
    import torch
    from transformers import TextIteratorStreamer

    from trainer.vision import ImageSlots, image_token_type_ids

    messages, pixels = image_inputs(chat, messages)
    ids = torch.tensor([prompt_ids(chat, messages)], device=chat.model.device)
    streamer = TextIteratorStreamer(chat.tokenizer, skip_prompt=True, skip_special_tokens=chat.spec.skip_special_tokens)
    if pixels:
        token = chat.tokenizer.convert_tokens_to_ids(ImageSlots.token)
        pixels = {k: v.to(chat.model.device) for k, v in pixels.items()}
        pixels["mm_token_type_ids"] = image_token_type_ids(ids, token)
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **pixels,
        streamer=streamer,
        eos_token_id=chat.stop_ids or None,
        pad_token_id=chat.tokenizer.pad_token_id or chat.stop_ids[0],
        **chat.spec.generation,
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with torch.inference_mode():
                chat.model.generate(**kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
            streamer.end()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if errors:
        raise errors[0]


def chat_loop(
    config: str | os.PathLike,
    stdin: TextIO,
    stdout: TextIO,
    *,
    interactive: bool | None = None,
    server_plan: Any = None,
) -> int:
    """Run the terminal chat: one user turn per input line; ``clear`` forgets the history; ``exit`` (or the end of
    input) stops. Returns the number of replies given.

    ``interactive`` (default: ``stdin.isatty()``): at a terminal, a banner, ``User: `` prompts and an
    ``Assistant: `` label frame the turns, as LLaMA-Factory's CLI. Driven through a pipe, stdout carries only the
    replies, each followed by one newline, and nothing is written for ``clear``. Either way every streamed piece is
    flushed as it arrives, so a program on the other end of the pipe reads a reply before it sends the next turn.

    ``server_plan``: for ``infer_backend: vllm`` / ``sglang``, the function that gives the server's command line
    (default :func:`serving.engines.server_plan`; see :func:`serving.engines.start_served_chat`).

    Raises:
        ConfigError: as :func:`read_chat_config`.
        ServingError: the vLLM / SGLang server did not come up or failed a turn.
    """
    spec = read_chat_config(config)
    if spec.backend == "huggingface":
        chat = load_chat_model(spec)
        return _converse(lambda messages: stream_reply(chat, messages), stdin, stdout, interactive)
    from serving.engines import start_served_chat

    served = start_served_chat(spec, server_plan)
    try:
        return _converse(served.reply, stdin, stdout, interactive)
    finally:
        served.close()


def _converse(reply: Any, stdin: TextIO, stdout: TextIO, interactive: bool | None) -> int:
    """The turns of :func:`chat_loop`, ``reply(messages)`` streaming each answer."""
    if interactive is None:
        interactive = stdin.isatty()

    def say(text: str) -> None:
        if interactive:
            stdout.write(text)
            stdout.flush()

    say(
        "ferry chat: type a message; `image PATH` attaches an image to the next one; `clear` forgets the history, "
        "`exit` ends.\n"
    )
    messages: list[dict[str, Any]] = []
    pending: list[str] = []  # images attached to the next turn
    replies = 0
    while True:
        say("\nUser: ")
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if text == "exit":
            break
        if text == "clear":
            messages, pending = [], []
            say("(history cleared)\n")
            continue
        if text.startswith("image "):
            path = os.path.expanduser(text[len("image ") :].strip())
            if not os.path.isfile(path):
                raise ConfigError(f"image {path}: no such file")
            pending.append(path)
            say(f"(image {path} goes with the next message)\n")
            continue
        message: dict[str, Any] = {"role": "user", "content": text}
        if pending:
            if "<image>" not in text:
                message["content"] = "<image>" * len(pending) + text
            message["images"], pending = pending, []
        messages.append(message)
        say("Assistant: ")
        answer = ""
        for piece in reply(messages):
            stdout.write(piece)
            stdout.flush()
            answer += piece
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": answer})
        replies += 1
    return replies


__all__ = [
    "BACKENDS",
    "CHAT_KEYS",
    "ChatModel",
    "ChatSpec",
    "GENERATION_DEFAULTS",
    "backend_message",
    "chat_loop",
    "load_chat_model",
    "model_class",
    "prompt_ids",
    "read_chat_config",
    "stream_reply",
]
