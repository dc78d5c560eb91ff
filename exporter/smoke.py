"""``ferry smoke``: prove that an exported model behaves like base + adapter, offline.

Three checks on a few prompts (:data:`DEFAULT_PROMPTS`, or the user's; a chat template, when the tokenizer has
one, wraps each prompt as a user turn):

1. **Logits equal base + adapter through peft.** The merged model's logits ``[1, seq_len, vocab]`` on every
   prompt are compared with those of ``PeftModel.from_pretrained(base, adapter)`` (unmerged) in float32, the
   exact reference. A float32 export passes when ``max |Δ| <= 1e-4 + 1e-4 · max |reference|``. A float16 /
   bfloat16 export cannot be that close: rounding weights and activations to 11 / 8 mantissa bits moves the
   logits by an amount that depends on the model. So the same unmerged peft model is also run in the export's
   dtype; its distance from the float32 reference is the dtype's *noise*, and the export passes when
   ``max |Δ| <= 2 · noise + atol`` (atol 1e-2 for float16, 5e-2 for bfloat16): a correct merge is about as far
   from the truth as the unmerged model in the same dtype, a wrong one is far beyond it. Skipped (reported as
   ``None``) when no adapter is known: neither given nor recorded in the export's ``ferry_export.json``.
2. **Greedy generation works.** ``max_new_tokens`` greedy tokens per prompt: every step's scores are finite
   (no NaN/inf), at least one token is produced and the text is not empty. Whether EOS came within
   ``max_new_tokens`` is reported per prompt. Not reaching EOS is *not* a failure by default: ``max_new_tokens`` is
   kept small to make the check fast, and a correct model often needs more tokens to finish an answer, so the
   criterion would fail good models. Pass ``require_eos=True`` to fail when no prompt reaches EOS (useful with a
   larger ``max_new_tokens`` on an instruction model).
3. **Speed.** Generated tokens per second over all prompts (greedy, batch 1, the device the model runs on).

It also reports whether the adapter changed the answers: the greedy text of the base (peft with the adapter
disabled) versus the merged model's. An adapter that changes nothing is suspicious but not a failure.

The report is written to ``MODEL_DIR/smoke_report.json``; a failed check raises :class:`SmokeCheckError` after the
report is written. Peak memory: one model at a time (the merged model is freed before the reference is loaded).
"""

from __future__ import annotations

import gc
import json
import os
import time
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
#: float16 / bfloat16 exports: pass when max |Δ| <= LOWP_NOISE_FACTOR · noise + LOWP_ATOL[dtype], where noise is
#: how far peft's own unmerged base + adapter moves when run in that dtype instead of float32.
LOWP_NOISE_FACTOR = 2.0
LOWP_ATOL: dict[torch.dtype, float] = {torch.float16: 1e-2, torch.bfloat16: 5e-2}

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
    logits_match: bool | None
    tokens_per_second: float
    adapter_changed_output: bool | None
    prompts: list[PromptResult] = field(default_factory=list)
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
            lines.append(f"  logits    max |merged - (base + adapter)| = {self.max_abs_diff:.3g} "
                         f"(tolerance {self.tolerance:.3g}{noise})")
        else:
            lines.append("  logits    not compared (no adapter given or recorded)")
        lines.append(f"  speed     {self.tokens_per_second:.1f} tokens/s (greedy, batch 1)")
        if self.adapter_changed_output is not None:
            verb = "changed" if self.adapter_changed_output else "did NOT change"
            lines.append(f"  adapter   {verb} the greedy answers")
        for p in self.prompts:
            eos = "EOS" if p.eos_reached else f"no EOS in {self.max_new_tokens}"
            lines.append(f"  prompt    {p.prompt!r} -> {p.text[:70]!r} ({p.new_tokens} tokens, {eos})")
        for failure in self.failures:
            lines.append(f"  FAILED    {failure}")
        return "\n".join(lines)


def _device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _encode(tokenizer: Any, prompt: str) -> dict[str, torch.Tensor]:
    """Token ids ``[1, seq_len]`` for a prompt, as a user turn when the tokenizer has a chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
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


def _run(model: Any, tokenizer: Any, inputs: list[dict[str, torch.Tensor]], max_new_tokens: int,
         device: torch.device) -> tuple[list[torch.Tensor], list[tuple[str, int, bool, bool]], float, int]:
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
            out = model.generate(**enc, max_length=enc["input_ids"].shape[1] + max_new_tokens, do_sample=False,
                                 num_beams=1, pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            new = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
            finite = all(bool(torch.isfinite(s).all()) for s in out.scores)
            eos_at = next((i for i, t in enumerate(new) if t in eos), None)
            kept = new if eos_at is None else new[:eos_at]
            text = tokenizer.decode(kept, skip_special_tokens=True)
            tokens += len(new)
            gens.append((text, len(new), eos_at is not None, finite))
    return logits, gens, seconds, tokens


def _load(path: str | os.PathLike, dtype: Any, device: torch.device, trust_remote_code: bool) -> Any:
    """A causal LM from a local folder, offline, in ``dtype`` (or ``"auto"``), on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    # straight onto the accelerator (device_map) rather than through host memory first
    device_map = str(device) if device.type != "cpu" else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, device_map=device_map,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def _reference(base_dir: Path, adapter: str | os.PathLike, dtype: torch.dtype, inputs: list[dict[str, torch.Tensor]],
               tokenizer: Any, max_new_tokens: int, device: torch.device,
               trust_remote_code: bool) -> tuple[list[torch.Tensor], list[tuple[str, int, bool, bool]]]:
    """Logits of base + adapter through peft (unmerged) in ``dtype``, and, when ``max_new_tokens`` > 0, the base
    model's greedy generations (adapter disabled). The models are freed before returning."""
    from peft import PeftModel

    base_model = _load(base_dir, dtype, device, trust_remote_code)
    reference = PeftModel.from_pretrained(base_model, str(adapter), torch_device=str(device)).eval()
    with torch.inference_mode():
        logits = [reference(**{k: v.to(device) for k, v in enc.items()}).logits.float().cpu() for enc in inputs]
    gens: list[tuple[str, int, bool, bool]] = []
    if max_new_tokens > 0:
        with reference.disable_adapter():
            _, gens, _, _ = _run(reference, tokenizer, inputs, max_new_tokens, device)
    del reference, base_model
    _release_memory()
    return logits, gens


def _release_memory() -> None:
    """Return freed model memory (callers ``del`` their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
) -> SmokeReport:
    """Check an exported (merged) model offline; see the module docstring for the checks and tolerances.

    Args:
        model_dir: the merged model folder (``ferry export`` output).
        adapter: the LoRA adapter folder it was merged from; default: the one in ``model_dir/ferry_export.json``.
        base: the base model (folder or installed repo id); default: the recorded one, else the adapter's
            ``base_model_name_or_path``.
        prompts: prompts to check (default :data:`DEFAULT_PROMPTS`).
        max_new_tokens: greedy tokens generated per prompt.
        device: ``cuda``, ``cuda:1``, ``cpu``...; default: CUDA when available.
        require_eos: fail when no prompt reaches EOS within ``max_new_tokens``.
        write_report: write ``model_dir/smoke_report.json``.
        trust_remote_code: let transformers run the model's own code.

    Returns:
        The :class:`SmokeReport` (``passed`` True).

    Raises:
        SmokeCheckError: a check failed (the report is written first and names every failure).
        ExportError: ``model_dir`` is not a model folder.
        NotInstalledError: the base model is not installed.
    """
    apply_offline_env()
    from transformers import AutoTokenizer

    started = time.perf_counter()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a model folder (no config.json)")
    recorded: dict[str, Any] = {}
    meta_path = model_dir / "ferry_export.json"
    if meta_path.is_file():
        recorded = json.loads(meta_path.read_text())
    if adapter is None and recorded.get("adapter", {}).get("path"):
        candidate = Path(recorded["adapter"]["path"])
        adapter = candidate if (candidate / "adapter_config.json").is_file() else None
    base_dir = None
    if adapter is not None:
        from exporter.export import load_adapter, _resolve_base

        if base is None and recorded.get("base", {}).get("path") and Path(recorded["base"]["path"]).is_dir():
            base = recorded["base"]["path"]
        base_dir, _, _ = _resolve_base(load_adapter(adapter), base)

    dev = _device(device)
    prompts = list(prompts or DEFAULT_PROMPTS)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{model_dir}: no usable tokenizer to run the smoke check ({exc})") from None
    inputs = [_encode(tokenizer, p) for p in prompts]

    merged = _load(model_dir, "auto", dev, trust_remote_code)
    dtype = next(merged.parameters()).dtype
    logits, gens, gen_seconds, gen_tokens = _run(merged, tokenizer, inputs, max_new_tokens, dev)
    del merged
    _release_memory()

    failures: list[str] = []
    results = [PromptResult(p, text, n, eos, fin) for p, (text, n, eos, fin) in zip(prompts, gens)]
    for p, lg in zip(results, logits):
        if not bool(torch.isfinite(lg).all()):
            failures.append(f"prompt {p.prompt!r}: the merged model's logits contain NaN/inf")
        if not p.finite:
            failures.append(f"prompt {p.prompt!r}: NaN/inf scores during generation")
        if p.new_tokens == 0 or (not p.text.strip() and not p.eos_reached):
            failures.append(f"prompt {p.prompt!r}: generation produced no text")
    if require_eos and not any(p.eos_reached for p in results):
        failures.append(f"no prompt reached EOS within {max_new_tokens} new tokens")

    max_diff = tolerance = noise = None
    logits_match = changed = None
    if adapter is not None:
        # the truth: base + adapter through peft (unmerged) in float32
        ref_logits, base_gens = _reference(base_dir, adapter, torch.float32, inputs, tokenizer,
                                           max_new_tokens if dtype == torch.float32 else 0, dev, trust_remote_code)
        scale = max(float(r.abs().max()) for r in ref_logits)
        if dtype == torch.float32:
            tolerance = FP32_ATOL + FP32_RTOL * scale
        else:  # the same unmerged computation in the export's dtype shows how far rounding alone moves the logits
            low_logits, base_gens = _reference(base_dir, adapter, dtype, inputs, tokenizer, max_new_tokens, dev,
                                               trust_remote_code)
            noise = max(_max_diff(a, b) for a, b in zip(low_logits, ref_logits))
            tolerance = LOWP_NOISE_FACTOR * noise + LOWP_ATOL.get(dtype, LOWP_ATOL[torch.bfloat16])
        diffs = [_max_diff(a, b) for a, b in zip(logits, ref_logits)]
        for p, d in zip(results, diffs):
            p.max_abs_diff = d
        max_diff = max(diffs)
        logits_match = bool(max_diff <= tolerance)  # NaN compares False
        if not logits_match:
            failures.append(f"merged logits differ from base + adapter (peft) by {max_diff:.3g} > tolerance "
                            f"{tolerance:.3g}: the merge is wrong")
        for p, (text, *_rest) in zip(results, base_gens):
            p.base_text = text
        changed = any(p.base_text != p.text for p in results)

    report = SmokeReport(
        model_dir=str(model_dir), adapter=str(adapter) if adapter is not None else None,
        base=str(base_dir) if base_dir is not None else None, dtype=str(dtype).removeprefix("torch."),
        device=str(dev), max_new_tokens=max_new_tokens, max_abs_diff=max_diff, reference_noise=noise,
        tolerance=tolerance,
        logits_match=logits_match, tokens_per_second=gen_tokens / gen_seconds if gen_seconds > 0 else 0.0,
        adapter_changed_output=changed, prompts=results, failures=failures, passed=not failures,
        seconds=time.perf_counter() - started,
    )
    if write_report:
        atomic_write_text(model_dir / REPORT_NAME, json.dumps(report.to_dict(), indent=2) + "\n")
    if failures:
        raise SmokeCheckError(f"smoke check of {model_dir} failed: " + "; ".join(failures)
                              + (f" (report: {model_dir / REPORT_NAME})" if write_report else ""))
    return report


__all__ = ["smoke", "SmokeReport", "PromptResult", "DEFAULT_PROMPTS", "FP32_ATOL", "FP32_RTOL", "LOWP_NOISE_FACTOR",
           "LOWP_ATOL"]
