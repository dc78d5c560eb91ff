"""``ferry smoke``: prove that an exported model behaves like base + adapter, offline.

Three checks on a few prompts (:data:`DEFAULT_PROMPTS`, or the user's; a chat template, when the tokenizer has
one, wraps each prompt as a user turn):

1. **Logits equal base + adapter through peft.** The merged model's logits ``[1, seq_len, vocab]`` on every
   prompt are compared with those of ``PeftModel.from_pretrained(base, adapter)`` (unmerged) in float32, the
   exact reference. A float32 export passes when ``max |Δ| <= 1e-4 + 1e-4 · max |reference|``. A float16 /
   bfloat16 export is judged by its *weights*: they are loaded into float32 and run in float32, so that the
   runtime's activation rounding (not the export's business) adds nothing. Its remaining error is rounding its
   weights to the dtype, which the check measures instead of assuming a floor: peft's own merge of the same
   adapter (tied weights untied first), rounded to that dtype, is the best export possible; its distance from the
   reference is the dtype's *noise*. The export passes when (a) ``max |Δ reference| <= fp32 bound + 1.5 · noise``
   and (b) ``max |Δ rounded peft merge| <= fp32 bound + 0.25 · noise``. A correct export equals the rounded peft
   merge to the last bit but for rare one-unit rounding flips; an export missing one layer's LoRA differs from it
   by that layer's whole update, which (b) catches even when it is smaller than the noise (tests inject it in
   bfloat16 and float16). Skipped (reported as ``None``) when no adapter is known: neither given nor recorded in
   the export's ``ferry_export.json``.
2. **Greedy generation works.** ``max_new_tokens`` greedy tokens per prompt: every step's scores are finite
   (no NaN/inf) and at least one token is produced. Generation is judged by tokens, not by printable text: a
   correct model may well generate spaces or special tokens. Whether EOS came within ``max_new_tokens`` is reported
   per prompt. Not reaching EOS is *not* a failure by default: ``max_new_tokens`` is kept small to make the check
   fast, and a correct model often needs more tokens to finish an answer, so the criterion would fail good models.
   Pass ``require_eos=True`` to fail when no prompt reaches EOS (useful with a larger ``max_new_tokens`` on an
   instruction model).
3. **Speed.** Generated tokens per second over all prompts (greedy, batch 1, the device the model runs on).

QLoRA exports (``ferry_export.json`` records ``quantization``): with ``merge_into: dequantized`` the reference
of check 1 is the base as training saw it (every quantised weight as ``dequant(quant(W))``,
:mod:`exporter.quant`); either way the merged logits are also compared with that quantised base + adapter and held
to twice the measured quantisation noise (how far quantising moves the base's logits) plus the fp32 bound; the
numbers are in the report's ``quantization``.

It also reports whether the adapter changed the answers: the greedy text of the base (peft with the adapter
disabled) versus the merged model's. An adapter that changes nothing is suspicious but not a failure.

The report is written to ``MODEL_DIR/smoke_report.json``; a failed check raises :class:`SmokeCheckError` after the
report is written. Peak memory: one model at a time (the merged model is freed before the reference is loaded).

A reward model (``value_head.safetensors`` beside the weights, from ``stage: rm``) also scores a chosen / rejected
pair with the merged model and with base + adapter through peft (:mod:`exporter.reward`), reported as ``reward``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ferry.constants import apply_offline_env
from ferry.errors import ExportError, SmokeCheckError
from ferry.fsutil import atomic_write_text

DEFAULT_PROMPTS = ["Once upon a time", "The capital of France is", "Write a short poem about the sea."]

#: float32 exports: pass when max |Δ logits| <= FP32_ATOL + FP32_RTOL · max |reference logits|.
FP32_ATOL, FP32_RTOL = 1e-4, 1e-4
#: float16 / bfloat16 exports (their weights computed in float32): ``noise`` is how far rounding peft's own merge to
#: that dtype moves the logits from the float32 reference. Pass when max |Δ reference| <= the float32 bound +
#: LOWP_NOISE_FACTOR · noise and max |Δ rounded peft merge| <= the float32 bound + LOWP_IDEAL_FACTOR · noise.
LOWP_NOISE_FACTOR = 1.5
LOWP_IDEAL_FACTOR = 0.25

REPORT_NAME = "smoke_report.json"


@dataclass
class PromptResult:
    """One prompt's outcome: the generated text (special tokens removed), its token count, whether EOS came,
    whether every step's scores were finite, and the base model's greedy text (None without an adapter)."""

    prompt: str
    text: str
    new_tokens: int
    eos_reached: bool
    finite: bool
    base_text: str | None = None
    max_abs_diff: float | None = None


@dataclass
class SmokeReport:
    """Result of :func:`smoke`. ``max_abs_diff``: largest |merged − reference| logit over all prompts and
    positions (None when no reference); ``tolerance``: the bound it was compared with; ``tokens_per_second``:
    generated tokens / generation seconds; ``failures``: one line per failed check; ``passed``: no failures."""

    model_dir: str
    adapter: str | None
    base: str | None
    dtype: str
    device: str
    max_new_tokens: int
    max_abs_diff: float | None
    reference_noise: float | None
    tolerance: float | None
    rounded_merge_diff: float | None
    logits_match: bool | None
    tokens_per_second: float
    adapter_changed_output: bool | None
    prompts: list[PromptResult] = field(default_factory=list)
    #: resize_vocab exports: the tokens training added, with their ids (checked single ids below vocab_size,
    #: and present in a compared prompt); None for a model whose vocabulary the adapter did not grow
    new_tokens: dict[str, int] | None = None
    #: QLoRA adapters (exporter/quant.py): ``merge_into``, the largest |merged - (quantized base +
    #: adapter)| logit, the quantization noise (largest |quantized base - full-precision base| logit, adapter off)
    #: and the bound 2 x noise + the fp32 bound it is held to; None for an adapter trained in full precision
    quantization: dict[str, Any] | None = None
    #: a reward model (value_head.safetensors beside the weights, stage rm): the scores of
    #: :data:`exporter.reward.REWARD_PAIR` (chosen, rejected), and with an adapter those of base + adapter through
    #: peft, their largest difference and its bound (:mod:`exporter.reward`); None for a language model
    reward: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    passed: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """Human-readable lines for the CLI."""
        lines = [f"smoke check {'PASSED' if self.passed else 'FAILED'}: {self.model_dir} ({self.dtype}, {self.device})"]
        if self.max_abs_diff is not None:
            noise = f", {self.dtype} noise {self.reference_noise:.3g}" if self.reference_noise is not None else ""
            lines.append(
                f"  logits    max |merged - (base + adapter)| = {self.max_abs_diff:.3g} "
                f"(tolerance {self.tolerance:.3g}{noise})"
            )
        else:
            lines.append("  logits    not compared (no adapter given or recorded)")
        lines.append(f"  speed     {self.tokens_per_second:.1f} tokens/s (greedy, batch 1)")
        if self.reward is not None:
            compared = (
                f", max |merged - (base + adapter)| = {self.reward['max_abs_diff']:.3g}"
                if "max_abs_diff" in self.reward
                else ""
            )
            lines.append(
                f"  reward    chosen {self.reward['chosen']:.4g}, rejected {self.reward['rejected']:.4g}{compared}"
            )
        if self.adapter_changed_output is not None:
            verb = "changed" if self.adapter_changed_output else "did NOT change"
            lines.append(f"  adapter   {verb} the greedy answers")
        for p in self.prompts:
            eos = "EOS" if p.eos_reached else f"no EOS in {self.max_new_tokens}"
            lines.append(f"  prompt    {p.prompt!r} -> {p.text[:70]!r} ({p.new_tokens} tokens, {eos})")
        for failure in self.failures:
            lines.append(f"  FAILED    {failure}")
        return "\n".join(lines)


#: What the smoke check needs on a GPU beyond its float32 copies (:func:`smoke_bytes`): 10 % for activations, the
#: prompts' logits, the generation cache and the allocator's rounding, plus 512 MiB of CUDA workspace.
HEADROOM_FRACTION, HEADROOM_BYTES = 0.10, 512 * 2**20


def fp32_bytes(folder: Path) -> int:
    """Bytes of the model in ``folder`` as float32 copies (4 bytes per element of every floating-point tensor; other
    tensors at their stored size), from the safetensors headers alone: no weight is read. A folder of pickle
    weights (``*.bin``) counts twice its files' size (as if 16-bit). 0 without weights."""
    from exporter.io import read_header

    total = 0
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        for info, _ in read_header(file).values():
            total += info.nbytes // info.dtype.itemsize * 4 if info.dtype.is_floating_point else info.nbytes
    if not files:
        total = 2 * sum(f.stat().st_size for f in folder.glob("*.bin"))
    return total


def smoke_bytes(model_dir: Path, base_dir: Path | None, adapter: Path | None) -> int:
    """Peak bytes the smoke check holds on its device: one float32 model at a time (the merged model, then the base
    as the reference) plus the adapter, all from the safetensors headers (:func:`fp32_bytes`)."""
    models = [fp32_bytes(model_dir)] + ([fp32_bytes(base_dir)] if base_dir is not None else [])
    return max(models) + (fp32_bytes(adapter) if adapter is not None and adapter.is_dir() else 0)


def smoke_device(requested: str | None, needed: int, cuda_free: int | None) -> tuple[torch.device, str | None]:
    """Where the smoke check runs, and the line to show when it moves to CPU.

    Args:
        requested: ``--device`` as given (``cuda``, ``cuda:1``, ``cpu``): used as it is; None: decide here.
        needed: bytes the check holds (:func:`smoke_bytes`).
        cuda_free: free bytes on the CUDA device (``torch.cuda.mem_get_info()``), None without CUDA.

    Returns ``(device, line)``: CUDA when ``needed`` plus :data:`HEADROOM_FRACTION` and :data:`HEADROOM_BYTES` fits in
    ``cuda_free``, else CPU, with a one-line reason when a GPU was there but too small (None otherwise).
    """
    if requested:
        return torch.device(requested), None
    if cuda_free is None:
        return torch.device("cpu"), None
    wanted = needed * (1 + HEADROOM_FRACTION) + HEADROOM_BYTES
    if wanted <= cuda_free:
        return torch.device("cuda"), None
    from ferry.fsutil import format_bytes

    return torch.device("cpu"), (
        f"ferry: smoke: the float32 copies need about {format_bytes(wanted)} and the GPU has {format_bytes(cuda_free)} "
        f"free: running the check on CPU (slower; --device cuda to insist)"
    )


def _device(device: str | None, model_dir: Path, base_dir: Path | None, adapter: Any) -> torch.device:
    """:func:`smoke_device` for this check, measuring the GPU's free memory; prints its line."""
    import sys

    if device or not torch.cuda.is_available():
        return smoke_device(device, 0, None)[0]
    needed = smoke_bytes(model_dir, base_dir, Path(adapter) if adapter is not None else None)
    chosen, line = smoke_device(None, needed, torch.cuda.mem_get_info()[0])
    if line:
        print(line, file=sys.stderr)
    return chosen


def _encode(tokenizer: Any, prompt: str) -> dict[str, torch.Tensor]:
    """Token ids ``[1, seq_len]`` for a prompt, as a user turn when the tokenizer has a chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return tokenizer(prompt, return_tensors="pt")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _run(
    model: Any, tokenizer: Any, inputs: list[dict[str, torch.Tensor]], max_new_tokens: int, device: torch.device
) -> tuple[list[torch.Tensor], list[tuple[str, int, bool, bool]], float, int]:
    """Logits (CPU float32, ``[1, seq_len, vocab]``) and greedy generations for every prompt; also generation
    seconds and generated-token count."""
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    logits, gens = [], []
    seconds, tokens = 0.0, 0
    with torch.inference_mode():
        for enc in inputs:
            enc = {k: v.to(device) for k, v in enc.items()}
            logits.append(model(**enc).logits.float().cpu())
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            # max_length (not max_new_tokens) so that a generation_config.json max_length does not conflict
            out = model.generate(
                **enc,
                max_length=enc["input_ids"].shape[1] + max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad,
                output_scores=True,
                return_dict_in_generate=True,
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            new = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
            finite = all(bool(torch.isfinite(s).all()) for s in out.scores)
            eos_at = next((i for i, t in enumerate(new) if t in eos), None)
            kept = new if eos_at is None else new[:eos_at]
            text = tokenizer.decode(kept, skip_special_tokens=True)
            tokens += len(new)
            gens.append((text, len(new), eos_at is not None, finite))
    return logits, gens, seconds, tokens


def _load(path: str | os.PathLike, dtype: Any, device: torch.device, trust_remote_code: bool, rope: Any = None) -> Any:
    """A causal LM from a local folder, offline, in ``dtype`` (or ``"auto"``), on ``device``, in eval mode; with
    ``rope`` (the adapter's :class:`ferry.rope.RopeScaling`) its RoPE stretched as training stretched it."""
    from transformers import AutoConfig

    from ferry.architecture import auto_model_class

    # straight onto the accelerator (device_map) rather than through host memory first
    device_map = str(device) if device.type != "cpu" else None
    with model_loading_errors(path, trust_remote_code):
        kwargs: dict[str, Any] = {}
        if rope is not None:
            from ferry.rope import scaled_config

            kwargs["config"] = scaled_config(path, rope, trust_remote_code=trust_remote_code)
        config = kwargs.get("config") or AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
        model = auto_model_class(config).from_pretrained(
            path,
            dtype=dtype,
            local_files_only=True,
            device_map=device_map,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
    return model.to(device).eval()


@contextlib.contextmanager
def model_loading_errors(path: str | os.PathLike, trust_remote_code: bool) -> Iterator[None]:
    """One-line :class:`ExportError` for the usual reasons transformers cannot load a model folder: its own code
    needs ``--trust-remote-code``, or the HF modules cache (where remote code is copied) is read-only."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise ExportError(
                f"{path} contains custom code (config.json auto_map): pass --trust-remote-code if you trust it"
            ) from None
        raise
    except PermissionError as exc:
        from transformers.utils import HF_MODULES_CACHE

        raise ExportError(
            f"cannot load {path}: {exc.filename or exc} is not writable (the model's code is copied "
            f"to HF_MODULES_CACHE={HF_MODULES_CACHE}; set HF_MODULES_CACHE to a writable folder)"
        ) from None


def _check_new_tokens(tokenizer: Any, new_tokens: dict[str, int], ids: torch.Tensor, model_dir: Path) -> list[str]:
    """The tokens a resize_vocab run added: each encodes to its one recorded id, below config.json's vocab_size,
    and the marker prompt's ids ``[1, seq_len]`` contain them all. Returns failure lines."""
    failures = []
    rows = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    present = set(ids.reshape(-1).tolist())
    for token, want in new_tokens.items():
        got = tokenizer.encode(token, add_special_tokens=False)
        if got != [want]:
            failures.append(f"new token {token!r} encodes to {got}, not its id {want}")
        elif isinstance(rows, int) and want >= rows:
            failures.append(f"new token {token!r} has id {want} but the model has {rows} embedding rows")
        elif want not in present:
            failures.append(f"new token {token!r} (id {want}) is missing from the prompt that should carry it")
    return failures


def _forward(model: Any, inputs: list[dict[str, torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    """The logits of every prompt under ``model`` on ``device``: CPU float32 ``[1, seq_len, vocab]`` each."""
    with torch.inference_mode():
        return [model(**{k: v.to(device) for k, v in enc.items()}).logits.float().cpu() for enc in inputs]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def _load_untied(path: str | os.PathLike, dtype: Any, device: torch.device, trust_remote_code: bool) -> Any:
    """:func:`_load` with tied weights untied (:func:`_untie`): the base that base + adapter is computed on."""
    model = _load(path, dtype, device, trust_remote_code)
    _untie(model)
    return model


def _untie(model: torch.nn.Module) -> None:
    """Give every parameter that two modules share (tied input / output embeddings) its own copy, so that a merge
    changes only the module it belongs to, as base + adapter computes (peft's merge of a tied embedding changes
    both, huggingface/peft#2777)."""
    seen: set[int] = set()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in seen:
                module._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
            else:
                seen.add(id(param))


def _reference(
    base_dir: Path,
    adapter: str | os.PathLike,
    inputs: list[dict[str, torch.Tensor]],
    tokenizer: Any,
    max_new_tokens: int,
    device: torch.device,
    trust_remote_code: bool,
    round_to: torch.dtype | None = None,
    quant_record: dict[str, Any] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[tuple[str, int, bool, bool]]]:
    """Base + adapter through peft, all in float32: ``(logits, ideal, base_generations)``.

    ``logits``: ``[1, seq_len, vocab]`` per prompt of the unmerged peft model, the exact reference.
    ``ideal`` (only with ``round_to``): the logits of the best export possible in ``round_to``: peft's own merge
    (tied weights untied first) with every weight rounded to ``round_to``, computed in float32.
    ``base_generations``: greedy generations with the adapter disabled (when ``max_new_tokens`` > 0).
    The models are freed before returning."""
    from ferry.adapter_folder import read_rope_record, read_vocab_record
    from trainer.peft_build import load_peft_adapter

    base_model = _load(base_dir, torch.float32, device, trust_remote_code, rope=read_rope_record(Path(adapter)))

    record = read_vocab_record(Path(adapter))
    if record is not None and record["rows"] != base_model.get_input_embeddings().weight.shape[0]:
        # resize_vocab: the adapter sets every grown row (modules_to_save or trainable_token_indices)
        with torch.random.fork_rng(devices=[]):
            base_model.resize_token_embeddings(record["rows"], mean_resizing=False)
    _untie(base_model)
    if quant_record is not None:  # QLoRA: the base as training saw it, dequant(quant(W)) (exporter/quant.py)
        from exporter.quant import dequantize_base_

        dequantize_base_(base_model, quant_record)
    reference = load_peft_adapter(base_model, str(adapter), torch_device=str(device)).eval()
    logits = _forward(reference, inputs, device)
    gens: list[tuple[str, int, bool, bool]] = []
    if max_new_tokens > 0:
        with reference.disable_adapter():
            _, gens, _, _ = _run(reference, tokenizer, inputs, max_new_tokens, device)
    ideal = None
    if round_to is not None:
        with warnings.catch_warnings():  # "no longer tied": untied above on purpose, for this model alone; the
            warnings.filterwarnings("ignore", message="Input and output embeddings are no longer tied")
            merged = reference.merge_and_unload()  # (the export's config.json says whether the export is tied)
        with torch.no_grad():
            for param in merged.parameters():
                if param.dtype.is_floating_point:
                    param.copy_(param.to(round_to).float())
        ideal = _forward(merged, inputs, device)
        del merged
    del reference, base_model
    _release_memory()
    return logits, ideal, gens


def _quantization_check(
    base_dir: Path,
    adapter: Any,
    inputs: list[dict[str, torch.Tensor]],
    device: torch.device,
    trust_remote_code: bool,
    quant_meta: dict[str, Any],
    merged: list[torch.Tensor],
    reference: list[torch.Tensor],
    fp32_bound: float,
) -> dict[str, Any]:
    """QLoRA exports: the merged logits against base + adapter evaluated the way it was trained (the base's
    quantized linear weights as dequant(quant(W)), all in float32), and the bound they are held to: twice the
    quantization noise, measured as the largest |logit| change that quantizing moves the base by (adapter off),
    plus ``fp32_bound``. ``reference`` is the smoke check's own reference: with ``merge_into: dequantized`` it is
    already the quantized one."""
    from exporter.quant import dequantize_base_
    from trainer.peft_build import load_peft_adapter

    full = _load(base_dir, torch.float32, device, trust_remote_code)
    base_full = _forward(full, inputs, device)
    del full
    quantized = _load(base_dir, torch.float32, device, trust_remote_code)
    _untie(quantized)
    dequantize_base_(quantized, quant_meta)
    base_quant = _forward(quantized, inputs, device)
    if quant_meta.get("merge_into") == "dequantized":
        quant_ref = reference
    else:
        quant_ref = _forward(
            load_peft_adapter(quantized, str(adapter), torch_device=str(device)).eval(), inputs, device
        )
    del quantized
    _release_memory()
    noise = max(_max_diff(a, b) for a, b in zip(base_quant, base_full))
    diff = max(_max_diff(a, b) for a, b in zip(merged, quant_ref))
    bound = 2 * noise + fp32_bound
    return {
        "merge_into": quant_meta.get("merge_into"),
        "quantized_reference_diff": diff,
        "quantization_noise": noise,
        "bound": bound,
        "within_bound": bool(diff <= bound),
    }


def _release_memory() -> None:
    """Return freed model memory (callers ``del`` their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt_inputs(
    tokenizer: Any, prompts: list[str], new_tokens: dict[str, int] | None, model_dir: Path
) -> tuple[list[str], list[dict[str, torch.Tensor]], list[str]]:
    """The prompts to check, their token ids (``[1, seq_len]`` each) and failure lines. A model whose vocabulary
    training grew (``new_tokens``, from ferry_export.json) gets one more prompt carrying every new token, so that
    the logits check covers their rows; the tokens themselves are checked (:func:`_check_new_tokens`)."""
    if new_tokens:
        prompts = [*prompts, "".join(new_tokens) + " " + prompts[0]]
    inputs = [_encode(tokenizer, p) for p in prompts]
    failures = _check_new_tokens(tokenizer, new_tokens, inputs[-1]["input_ids"], model_dir) if new_tokens else []
    for media in (_image_input(model_dir, tokenizer, "image"), _image_input(model_dir, tokenizer, "video")):
        if media is not None:
            prompts, inputs = [*prompts, media[0]], [*inputs, media[1]]
    return prompts, inputs, failures


def _image_input(model_dir: Path, tokenizer: Any, kind: str) -> tuple[str, dict[str, torch.Tensor]] | None:
    """A vision-language export's image prompt (``kind`` "image": :func:`trainer.vision.image_prompt`, a fixed
    picture and a question, as a user turn), named ``<image>QUESTION`` in the report, or its video prompt ("video":
    :func:`trainer.video.video_prompt`, four fixed frames, where torchvision and PyAV import), ``<video>QUESTION``;
    None for a text model or where the folder has no processor of that kind."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ferry.architecture import auto_model_class
    from trainer.video import video_prompt
    from trainer.vision import ImageSlots, image_prompt, image_token_type_ids

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None
    if auto_model_class(config) is not AutoModelForImageTextToText:
        return None
    found = (image_prompt if kind == "image" else video_prompt)(model_dir, tokenizer)
    if found is None:
        return None
    question = f"Describe this {kind}."
    enc = _encode(tokenizer, found[0])
    enc.update(found[1])
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (("image", ImageSlots.token), ("video", ImageSlots.video))
    }
    enc["mm_token_type_ids"] = image_token_type_ids(enc["input_ids"], ids["image"], ids["video"])
    return f"<{kind}>{question}", enc


@dataclass
class _Probe:
    """One smoke check's prompts and how every model is run on them: the tokenizer, the prompts' token ids
    (``[1, seq_len]`` each), the device, greedy tokens per prompt, and whether models may run their own code."""

    tokenizer: Any
    inputs: list[dict[str, torch.Tensor]]
    device: torch.device
    max_new_tokens: int
    trust_remote_code: bool


def _run_merged(
    model_dir: Path, probe: _Probe, *, float32_logits: bool
) -> tuple[torch.dtype, list[torch.Tensor], list[tuple[str, int, bool, bool]], float]:
    """The merged model in its own dtype: that dtype, the prompts' logits (CPU float32), greedy generations and
    tokens per second. With ``float32_logits`` (a merge to judge) the logits come from the same stored weights
    computed in float32, so that activation rounding (which depends on the runtime, not on the export) does not
    hide a wrong merge."""
    merged = _load(model_dir, "auto", probe.device, probe.trust_remote_code)
    dtype = next(merged.parameters()).dtype
    logits, gens, seconds, tokens = _run(merged, probe.tokenizer, probe.inputs, probe.max_new_tokens, probe.device)
    del merged
    _release_memory()
    if dtype != torch.float32 and float32_logits:
        merged = _load(model_dir, torch.float32, probe.device, probe.trust_remote_code)
        logits = _forward(merged, probe.inputs, probe.device)
        del merged
        _release_memory()
    return dtype, logits, gens, tokens / seconds if seconds > 0 else 0.0


def _refuse_unusable(model_dir: Path, write_report: bool) -> None:
    """Refuse a folder that is not a model, or where the report cannot be written, before anything loads.

    Raises:
        ExportError: no config.json, or ``write_report`` in a read-only folder.
    """
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a model folder (no config.json)")
    if not write_report:
        return
    import tempfile

    try:  # a real write: os.access says yes to root on a read-only file system
        with tempfile.TemporaryDirectory(prefix=".ferry-probe-", dir=model_dir):
            pass
    except OSError as exc:
        raise ExportError(
            f"{model_dir}: smoke cannot write {REPORT_NAME} there ({exc.strerror or exc}); pass --no-report"
        ) from None


def _sources(
    recorded: dict[str, Any], adapter: str | os.PathLike | None, base: str | os.PathLike | None
) -> tuple[str | os.PathLike | None, Path | None]:
    """The adapter the model was merged from (given, else the one ``ferry_export.json`` records when it is still
    there) and its base folder (given, else the recorded one, else the adapter's); (None, None) without one.

    Raises:
        NotInstalledError: the base model is not installed.
    """
    from ferry.adapter_folder import ADAPTER_CONFIG

    if adapter is None and recorded.get("adapter", {}).get("path"):
        candidate = Path(recorded["adapter"]["path"])
        adapter = candidate if (candidate / ADAPTER_CONFIG).is_file() else None
    if adapter is None:
        return None, None
    from exporter.adapter import _resolve_base, load_adapter

    if base is None and recorded.get("base", {}).get("path") and Path(recorded["base"]["path"]).is_dir():
        base = recorded["base"]["path"]
    base_dir, _, _ = _resolve_base(load_adapter(adapter), base)
    return adapter, base_dir


def _output_failures(
    results: list[PromptResult], logits: list[torch.Tensor], require_eos: bool, max_new_tokens: int
) -> list[str]:
    """Failure lines of the merged model's own outputs: NaN/inf logits or scores, empty generations, no EOS."""
    failures = []
    for p, lg in zip(results, logits):
        if not bool(torch.isfinite(lg).all()):
            failures.append(f"prompt {p.prompt!r}: the merged model's logits contain NaN/inf")
        if not p.finite:
            failures.append(f"prompt {p.prompt!r}: NaN/inf scores during generation")
        if p.new_tokens == 0:
            failures.append(f"prompt {p.prompt!r}: generation produced no tokens")
    if require_eos and not any(p.eos_reached for p in results):
        failures.append(f"no prompt reached EOS within {max_new_tokens} new tokens")
    return failures


@dataclass
class _Comparison:
    """The merged logits against base + adapter through peft (the :class:`SmokeReport` fields of the same names)."""

    max_abs_diff: float | None = None
    tolerance: float | None = None
    reference_noise: float | None = None
    rounded_merge_diff: float | None = None
    quantization: dict[str, Any] | None = None
    logits_match: bool | None = None
    adapter_changed_output: bool | None = None
    failures: list[str] = field(default_factory=list)

    def report_fields(self) -> dict[str, Any]:
        """The comparison as :class:`SmokeReport` keyword arguments (its failures go to the report's list)."""
        return {k: v for k, v in asdict(self).items() if k != "failures"}


def _compare_with_peft(
    probe: _Probe,
    base_dir: Path,
    adapter: str | os.PathLike,
    logits: list[torch.Tensor],
    results: list[PromptResult],
    dtype: torch.dtype,
    recorded: dict[str, Any],
) -> _Comparison:
    """The merged model's float32 ``logits`` (export dtype ``dtype``) against the truth, base + adapter through
    peft unmerged in float32, within the bounds of the module docstring; each prompt in ``results`` gets its
    ``max_abs_diff`` and the base's greedy text."""
    low = dtype if dtype != torch.float32 else None
    quant_meta = recorded.get("quantization") or None
    inputs, device, trust_remote_code = probe.inputs, probe.device, probe.trust_remote_code
    ref_logits, ideal, base_gens = _reference(
        base_dir,
        adapter,
        inputs,
        probe.tokenizer,
        probe.max_new_tokens,
        device,
        trust_remote_code,
        round_to=low,
        quant_record=quant_meta if quant_meta and quant_meta.get("merge_into") == "dequantized" else None,
    )
    scale = max(float(r.abs().max()) for r in ref_logits)
    out = _Comparison()
    tolerance = FP32_ATOL + FP32_RTOL * scale
    if ideal is not None:  # how far rounding the (correctly) merged weights to the export's dtype moves the logits
        noise = out.reference_noise = max(_max_diff(a, b) for a, b in zip(ideal, ref_logits))
        tolerance += LOWP_NOISE_FACTOR * noise
        # a correct export differs from that ideal only by rare one-unit rounding flips (fp32 sums in another
        # order), far below the whole rounding noise; a layer whose update is missing differs by that update
        off = out.rounded_merge_diff = max(_max_diff(a, b) for a, b in zip(logits, ideal))
        if not off <= LOWP_IDEAL_FACTOR * noise + FP32_ATOL + FP32_RTOL * scale:
            out.failures.append(
                f"merged {str(dtype).removeprefix('torch.')} weights differ from peft's merge "
                f"rounded to that dtype by {off:.3g} logits (> {LOWP_IDEAL_FACTOR} x the dtype's "
                f"rounding noise {noise:.3g}): the merge is wrong"
            )
    out.tolerance = tolerance
    diffs = [_max_diff(a, b) for a, b in zip(logits, ref_logits)]
    for p, d in zip(results, diffs):
        p.max_abs_diff = d
    for p, (text, *_rest) in zip(results, base_gens):
        p.base_text = text
    out.max_abs_diff = max(diffs)
    out.logits_match = bool(out.max_abs_diff <= tolerance) and not out.failures
    if not out.logits_match:
        out.failures.append(
            f"merged logits differ from base + adapter (peft) by {out.max_abs_diff:.3g} > "
            f"tolerance {out.tolerance:.3g}: the merge is wrong"
        )
    if quant_meta:
        q = out.quantization = _quantization_check(
            base_dir,
            adapter,
            inputs,
            device,
            trust_remote_code,
            quant_meta,
            logits,
            ref_logits,
            FP32_ATOL + FP32_RTOL * scale,
        )
        if not q["within_bound"]:
            out.failures.append(
                f"merged logits differ from the quantized base + adapter by "
                f"{q['quantized_reference_diff']:.3g} > {q['bound']:.3g} (2 x the measured "
                f"quantization noise {q['quantization_noise']:.3g})"
            )
    out.adapter_changed_output = any(p.base_text != p.text for p in results)
    return out


def smoke(
    model_dir: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    device: str | None = None,
    require_eos: bool = False,
    write_report: bool = True,
    trust_remote_code: bool = False,
    report_as: str | os.PathLike | None = None,
) -> SmokeReport:
    """Check an exported (merged) model offline and return its :class:`SmokeReport` (``passed`` True); see the module
    docstring for the checks and tolerances.

    Args:
        model_dir: the merged model folder (``ferry export`` output).
        adapter: the LoRA adapter folder it was merged from; default: the one in ``model_dir/ferry_export.json``.
        base: the base model (folder or installed repo id); default: the recorded one, else the adapter's
            ``base_model_name_or_path``.
        prompts: prompts to check (default :data:`DEFAULT_PROMPTS`).
        max_new_tokens: greedy tokens generated per prompt.
        device: ``cuda``, ``cuda:1``, ``cpu``...; default: CUDA when available and its free memory holds the
            check's float32 copies (:func:`smoke_device`, estimated from the safetensors headers), else CPU with
            one line.
        require_eos: fail when no prompt reaches EOS within ``max_new_tokens``.
        write_report: write ``model_dir/smoke_report.json``.
        trust_remote_code: let transformers run the model's own code.
        report_as: the folder the report and its messages name (default ``model_dir``; an export checks it staged).

    Raises:
        SmokeCheckError: a check failed (the report is written first and names every failure).
        ExportError: ``model_dir`` is not a model folder, has no usable tokenizer, or the report cannot be written.
        NotInstalledError: the base model is not installed.
    """
    apply_offline_env()
    from transformers import AutoTokenizer

    from ferry.adapter_folder import read_export_record

    started = time.perf_counter()
    model_dir = Path(model_dir)
    _refuse_unusable(model_dir, write_report)
    recorded: dict[str, Any] = read_export_record(model_dir) or {}
    adapter, base_dir = _sources(recorded, adapter, base)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{model_dir}: no usable tokenizer to run the smoke check ({exc})") from None
    new_tokens = (recorded.get("vocab") or {}).get("added") or None
    prompts, inputs, failures = _prompt_inputs(tokenizer, list(prompts or DEFAULT_PROMPTS), new_tokens, model_dir)
    probe = _Probe(tokenizer, inputs, _device(device, model_dir, base_dir, adapter), max_new_tokens, trust_remote_code)
    dtype, logits, gens, tokens_per_second = _run_merged(model_dir, probe, float32_logits=adapter is not None)
    results = [PromptResult(p, text, n, eos, fin) for p, (text, n, eos, fin) in zip(prompts, gens)]
    failures += _output_failures(results, logits, require_eos, max_new_tokens)
    compared = _Comparison()
    if adapter is not None and base_dir is not None:  # _sources gives both or neither
        compared = _compare_with_peft(probe, base_dir, adapter, logits, results, dtype, recorded)
        failures += compared.failures
    reward, reward_failures = _reward_check(model_dir, probe, dtype, adapter, base_dir)
    shown = Path(report_as) if report_as is not None else model_dir
    report = SmokeReport(
        model_dir=str(shown),
        adapter=str(adapter) if adapter is not None else None,
        base=str(base_dir) if base_dir is not None else None,
        dtype=str(dtype).removeprefix("torch."),
        device=str(probe.device),
        max_new_tokens=max_new_tokens,
        tokens_per_second=tokens_per_second,
        prompts=results,
        new_tokens=new_tokens,
        reward=reward,
        failures=failures + reward_failures,
        passed=not failures + reward_failures,
        seconds=time.perf_counter() - started,
        **compared.report_fields(),
    )
    return _conclude(report, model_dir, write_report, shown)


def _reward_check(
    model_dir: Path, probe: _Probe, dtype: torch.dtype, adapter: str | os.PathLike | None, base_dir: Path | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """A reward model's pair scores against base + adapter (:func:`exporter.reward.reward_check`, the same
    bounds as the logits); ``(None, [])`` without a value head."""
    from exporter.reward import reward_check

    bounds = (FP32_ATOL, FP32_RTOL, LOWP_NOISE_FACTOR)
    result = reward_check(model_dir, probe, _load, _load_untied, dtype, adapter, base_dir, bounds)
    _release_memory()
    return result


def _conclude(report: SmokeReport, model_dir: Path, write_report: bool, shown: Path) -> SmokeReport:
    """Write ``smoke_report.json`` into ``model_dir`` (``write_report``), then raise when a check failed, else return
    ``report``; the message names the folder as ``shown``.

    Raises:
        SmokeCheckError: one line naming every failure (and the report file).
    """
    if write_report:
        atomic_write_text(model_dir / REPORT_NAME, json.dumps(report.to_dict(), indent=2) + "\n")
    if report.failures:
        raise SmokeCheckError(
            f"smoke check of {shown} failed: "
            + "; ".join(report.failures)
            + (f" (report: {shown / REPORT_NAME})" if write_report else "")
        )
    return report


__all__ = [
    "smoke",
    "smoke_bytes",
    "smoke_device",
    "fp32_bytes",
    "SmokeReport",
    "PromptResult",
    "DEFAULT_PROMPTS",
    "FP32_ATOL",
    "FP32_RTOL",
    "LOWP_NOISE_FACTOR",
    "LOWP_IDEAL_FACTOR",
]
