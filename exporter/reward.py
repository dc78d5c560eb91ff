"""The smoke check of a reward model (stage rm): the merged model and its ``value_head.safetensors`` score a
chosen / rejected pair, and the scores equal base + adapter through peft.

A score is ``weight @ h + bias`` (:data:`ferry.adapter_folder.VALUE_HEAD_KEYS`), ``h`` the backbone's last hidden
state (``model.base_model``, float32) at the sequence's last token, each sequence ending with the tokenizer's EOS
as LLaMA-Factory's templates end a reply. Bounds as the logits check of :mod:`exporter.smoke`: a float32 export
within ``FP32_ATOL + FP32_RTOL * max |reference score|``; a float16 / bfloat16 export (its weights computed in
float32) within that plus ``LOWP_NOISE_FACTOR`` times how far peft's own merge rounded to the dtype moves the scores.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ferry.adapter_folder import read_value_head

#: The pair every reward model scores: a prompt, a good reply, a bad one.
REWARD_PAIR = ("The capital of France is", " Paris.", " a kind of cheese that grows on trees.")


def _pair_ids(tokenizer: Any) -> list[torch.Tensor]:
    """``[1, seq_len]`` token ids of prompt + chosen and prompt + rejected, each ending with EOS when the tokenizer
    has one."""
    prompt, chosen, rejected = REWARD_PAIR
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [torch.tensor([tokenizer(prompt + reply)["input_ids"] + eos]) for reply in (chosen, rejected)]


def pair_scores(
    model: Any, head: dict[str, torch.Tensor], ids: list[torch.Tensor], device: torch.device
) -> list[float]:
    """The value head's score of each sequence in ``ids`` (``[1, seq_len]`` each) under the causal LM ``model``
    (or a peft model over one): its backbone's float32 last hidden state at the last token times
    ``head["weight"]`` plus ``head["bias"]``."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its LoRA'd model
    backbone = hf.base_model
    weight, bias = head["weight"].to(device), head["bias"].to(device)
    scores = []
    with torch.inference_mode():
        for seq in ids:
            hidden = backbone(input_ids=seq.to(device), use_cache=False).last_hidden_state[0, -1].float()
            scores.append(float(weight[0] @ hidden + bias[0]))
    return scores


def reward_check(
    model_dir: Path,
    probe: Any,
    load: Any,
    load_base: Any,
    dtype: torch.dtype,
    adapter: str | os.PathLike | None,
    base_dir: Path | None,
    bounds: tuple[float, float, float],
) -> tuple[dict[str, Any] | None, list[str]]:
    """The reward pair's scores under the merged model (its weights in float32) and, with an adapter, under base +
    adapter through peft: ``(report, failures)``; ``(None, [])`` for a model without a value head.

    Args:
        probe: :class:`exporter.smoke._Probe` (tokenizer, device, trust_remote_code).
        load: :func:`exporter.smoke._load` (the merged model); ``load_base``: the same for the base, its tied
            weights untied (as the logits check loads it).
        dtype: the export's dtype (float16 / bfloat16 widen the bound by the measured rounding noise).
        bounds: ``(FP32_ATOL, FP32_RTOL, LOWP_NOISE_FACTOR)``.

    Raises:
        ConfigError: the value head file does not fit the model.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=probe.trust_remote_code)
    head = read_value_head(model_dir, int(config.get_text_config().hidden_size))
    if head is None:
        return None, []
    ids = _pair_ids(probe.tokenizer)
    merged = load(model_dir, torch.float32, probe.device, probe.trust_remote_code)
    scores = pair_scores(merged, head, ids, probe.device)
    del merged
    report: dict[str, Any] = {"pair": list(REWARD_PAIR), "chosen": scores[0], "rejected": scores[1]}
    failures = [] if all(map(math.isfinite, scores)) else ["the reward model's scores of the smoke pair are NaN/inf"]
    if adapter is None or base_dir is None:
        return report, failures
    from trainer.peft_build import load_peft_adapter

    base = load_base(base_dir, torch.float32, probe.device, probe.trust_remote_code)
    peft_model = load_peft_adapter(base, str(adapter), torch_device=str(probe.device)).eval()
    reference = pair_scores(peft_model, head, ids, probe.device)
    atol, rtol, noise_factor = bounds
    tolerance = atol + rtol * max(abs(r) for r in reference)
    if dtype != torch.float32:
        ideal = peft_model.merge_and_unload()
        with torch.no_grad():
            for param in ideal.parameters():
                if param.dtype.is_floating_point:
                    param.copy_(param.to(dtype).float())
        rounded = pair_scores(ideal, head, ids, probe.device)
        tolerance += noise_factor * max(abs(a - b) for a, b in zip(rounded, reference))
    del base, peft_model
    diff = max(abs(a - b) for a, b in zip(scores, reference))
    report.update(
        reference_chosen=reference[0], reference_rejected=reference[1], max_abs_diff=diff, tolerance=tolerance
    )
    if not diff <= tolerance:
        failures.append(
            f"the merged reward model's scores differ from base + adapter (peft) by {diff:.3g} > tolerance "
            f"{tolerance:.3g}: the merge is wrong"
        )
    return report, failures


__all__ = ["REWARD_PAIR", "pair_scores", "reward_check"]
