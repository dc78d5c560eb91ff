"""The model a run trains: the base with peft LoRA layers, its precision, and what the recipe asks of it.

::

    compute_dtype(cfg, device) ──> dtype of the frozen weights (fp32 on CPU)
    build_lora_model(cfg, model_dir, ...)
        _base_model:  from_pretrained / quantised on load (trainer.quant) / from config on the meta device
        vocabulary:   grown embeddings when the tokenizer gained tokens (trainer.vocab)
        _with_lora:   earlier adapters merged or continued (trainer.lf_compat), else a new LoRA on lora_target
        trainable parameters in fp32
    samples_stay_apart_in_one_row(model, ...)   the probe packing and padding-free rows rely on
    count_parameters / checkpointed_layers      what the run reports

Under FSDP the sharded model is built by :func:`trainer.fsdp.build_sharded_lora_model` instead (from the same
:func:`trainer.targets.lora_config_for`). transformers and peft are imported inside functions, after
:func:`trainer.recipe.train` has set the offline variables.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ferry.errors import ConfigError
from trainer.loss import unit_roundoff
from trainer.targets import lora_config_for, lora_targets

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from trainer.config import TrainConfig


# ====================================================================== precision


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 / fp16 per config on CUDA; fp32 on CPU (autocast on CPU is slower and not what users expect)."""
    if device.type != "cuda":
        return torch.float32
    if cfg.bf16:
        return torch.bfloat16
    if cfg.fp16:
        return torch.float16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on CUDA when it is bf16/fp16 (from :func:`compute_dtype`); else a no-op."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


# ====================================================================== building


def find_all_linear_modules(model: PreTrainedModel) -> list[str]:
    """Names (last dotted component, e.g. ``q_proj``) of every ``nn.Linear`` except the output head, sorted, as
    LLaMA-Factory's ``find_all_linear_modules`` (``lora_target: all`` itself is resolved by
    :func:`trainer.targets.resolve_lora_targets`, which also covers Conv1D, fused experts and VLM freezing). The
    head is found both by name (``lm_head``) and as ``get_output_embeddings()`` (tied or named otherwise)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for name, module in model.named_modules():
        if module is head or name.split(".")[-1] in ("lm_head", "output_layer"):
            continue
        if isinstance(module, torch.nn.Linear):
            names.add(name.split(".")[-1])
    return sorted(names)


def resolved_revision(model_dir: Path, configured: str | None) -> str | None:
    """The commit of an HF-cache snapshot (``.../snapshots/<sha>``), else the configured revision."""
    if model_dir.parent.name == "snapshots":
        return model_dir.name
    return configured


def build_lora_model(
    cfg: TrainConfig,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    meta: bool = False,
    vocab: Any = None,
    images: bool = False,
) -> PeftModel:
    """The base model with peft LoRA layers (a ``peft.PeftModel``); only LoRA (and ``additional_target``)
    parameters require grad, and those are kept in fp32 whatever ``dtype`` the frozen weights use.

    Args:
        model_dir: local model folder (``ferry.hub.resolve_model``).
        device: where the weights go.
        dtype: dtype of the frozen base weights.
        meta: build on the meta device from config.json only (no weights read): for counting parameters in
            ``--dry-run``.
        vocab: a :class:`trainer.vocab.VocabPlan` when the tokenizer gained tokens: the embeddings grow (mean
            rows) and are trained fully (``modules_to_save``).
        images: the data has image rows: the whole vision-language model (:func:`auto_model_class`).

    The result carries ``ferry_lora_targets`` (the :func:`trainer.targets.lora_targets` resolution, None for a
    continued adapter) for ``--dry-run``'s summary.

    Raises:
        ConfigError: ``lora_target`` / ``additional_target`` name modules the model does not have.
    """
    model = _base_model(cfg, model_dir, device=device, dtype=dtype, meta=meta, vocab=vocab, images=images)
    model.config.use_cache = False  # the KV cache is useless in training and clashes with checkpointing
    if vocab is not None:  # resize_vocab / add_special_tokens (trainer/vocab.py)
        from trainer.vocab import grow_embeddings, with_trained_embeddings

        if not meta:
            grow_embeddings(model, vocab)
        cfg = with_trained_embeddings(cfg, model, vocab)
    peft_model, targets = _with_lora(cfg, model, model_dir, meta=meta, vocab=vocab)
    peft_model.ferry_lora_targets = targets  # for --dry-run's summary
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return peft_model


def _base_model(
    cfg: TrainConfig,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    meta: bool,
    vocab: Any,
    images: bool = False,
) -> PreTrainedModel:
    """The frozen base: on the meta device from config.json (with the grown vocabulary's size), quantised on
    load on this rank's device (QLoRA, :mod:`trainer.quant`), or loaded in ``dtype`` and moved to ``device``."""
    from ferry.rope import base_config

    config = base_config(cfg, model_dir)  # rope_scaling applied
    from ferry.architecture import auto_model_class

    auto = auto_model_class(config, images)
    if meta:
        if vocab is not None:  # the grown vocabulary's parameter count (trainer/vocab.py)
            from trainer.vocab import grown_config

            grown_config(config, vocab)
        with torch.device("meta"):
            return auto.from_config(config, trust_remote_code=cfg.trust_remote_code)
    if cfg.quantization_bit is not None:
        from trainer.quant import load_quantized_model

        return load_quantized_model(cfg, model_dir, device=device, dtype=dtype, config=config, auto=auto)
    model = auto.from_pretrained(
        model_dir,
        config=config,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
    )
    return model.to(device)


def _with_lora(
    cfg: TrainConfig, model: PreTrainedModel, model_dir: Path, *, meta: bool, vocab: Any
) -> tuple[PeftModel, Any]:
    """``(peft_model, targets)``: the adapter of ``adapter_name_or_path`` continued over the earlier ones merged
    into ``model`` (targets None), or a new LoRA on the resolved ``lora_target`` (PiSSA-initialised with
    ``pissa_init``; the new vocabulary rows trained through peft's ``trainable_token_indices``).

    Raises:
        ConfigError: the LoRA config does not fit the model (peft's ValueError).
    """
    from trainer.peft_build import get_peft_model_checked

    if cfg.adapter_name_or_path and not meta:  # merge earlier adapters / continue the last (trainer/lf_compat.py)
        from trainer.lf_compat import stack_adapters

        model, continued = stack_adapters(model, cfg.adapter_name_or_path, create_new_adapter=cfg.create_new_adapter)
        if continued is not None:
            return continued, None
    targets = lora_targets(cfg, model)
    lora_config = lora_config_for(cfg, model, targets)
    if cfg.adapter_name_or_path and meta and not cfg.create_new_adapter:  # --dry-run counts the continued one
        from trainer.lf_compat import continued_lora_config

        lora_config = continued_lora_config(cfg)
    if cfg.pissa_init and not meta:  # peft's PiSSA initialisation (trainer/lf_compat.py)
        from trainer.lf_compat import pissa_init_weights

        lora_config.init_lora_weights = pissa_init_weights(cfg)
    if vocab is not None:  # the new rows alone through peft's trainable_token_indices (untied embeddings)
        from trainer.vocab import with_token_rows

        lora_config = with_token_rows(lora_config, model, vocab)
    try:
        return get_peft_model_checked(model, lora_config), targets
    except ValueError as exc:
        raise ConfigError(f"lora_target / additional_target do not fit {model_dir}: {exc}") from None


# ====================================================================== what the recipe asks of the model


@dataclass
class OneRowProbe:
    """What :func:`samples_stay_apart_in_one_row` measured: ``diff``, the largest |logit| change of the second
    sample between alone and after another sample in one row; ``noise``, the same change for the first sample of
    the row, which causal attention keeps apart whatever the mask (so it is the kernels' own noise); ``bound``, what
    ``diff`` was held to; ``apart = diff <= bound``. True as a bool when ``apart``."""

    apart: bool
    diff: float
    noise: float
    bound: float
    dtype: str

    def __bool__(self) -> bool:
        return self.apart

    def reason(self) -> str:
        """One line: why the probe failed (for the run's fallback record and its ConfigError)."""
        return (
            f"the one-row probe moved a sample's logits by {self.diff:.3g} when it followed another sample in "
            f"one row (bound {self.bound:.3g} in {self.dtype}, the kernels' own noise {self.noise:.3g})"
        )


def one_row_rtol(dtype: torch.dtype) -> float:
    """The one-row probe's bound relative to the largest |logit|: 1e-2, or ``16 u`` where the compute dtype's unit
    roundoff ``u`` (:func:`trainer.loss.unit_roundoff`) makes that larger: bfloat16 ``2**-4`` (6.25 %), since its
    8 significand bits leave ``u = 2**-8`` per operation and the two forwards take different attention kernels
    (one with a block-diagonal mask) through every layer; float32 and float16 1e-2."""
    return max(1e-2, 16 * unit_roundoff(dtype))


def samples_stay_apart_in_one_row(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> OneRowProbe:
    """Whether ``model`` keeps the samples of one row apart when their position ids restart, which neat_packing
    and padding-free batches rely on (transformers builds a block-diagonal mask from the position ids for the
    models whose masks come from ``masking_utils``, and flash-attention kernels split the row at the
    restarts; a model with its own mask code may let the second sample attend to the first).

    The probe: the logits of a 4-token sample alone ``[1, 4, vocab]`` against the same sample placed after
    another one in a ``[1, 8]`` row, computed under autocast in ``dtype``; they must agree within
    ``1e-3 + one_row_rtol(dtype) * max |logit| + 2 * noise``, where ``noise`` is the same comparison for the
    row's first sample (which no mask can leak into), measured alike. A sample that attends to its neighbour moves
    its logits by a sizeable fraction of their range, far beyond that. Runs in eval mode under ``no_grad`` and
    draws its tokens from its own generator (the global RNG streams, and so resume equivalence, are untouched).
    Returns an :class:`OneRowProbe` (true when the samples stay apart).
    """
    vocab = int(getattr(model.config, "vocab_size", 0) or 32)
    tokens = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(1234)).to(device)
    four = torch.arange(4, device=device)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            first = model(input_ids=tokens[:4][None], position_ids=four, use_cache=False).logits.float()
            alone = model(input_ids=tokens[4:][None], position_ids=four, use_cache=False).logits.float()
            row = model(input_ids=tokens[None], position_ids=four.repeat(1, 2), use_cache=False).logits.float()
    finally:
        model.train(was_training)
    noise = float((first - row[:, :4]).abs().max())
    diff = float((alone - row[:, 4:]).abs().max())
    bound = 1e-3 + one_row_rtol(dtype) * float(alone.abs().max()) + 2 * noise
    return OneRowProbe(diff <= bound, diff, noise, bound, str(dtype).removeprefix("torch."))


def apply_neftune(peft_model: Any, alpha: float) -> Any:
    """NEFTune (Jain et al. 2023, arXiv:2310.05914) on ``peft_model``'s input embeddings: transformers' own forward
    hook (``transformers.integrations.neftune``, what its Trainer and so LLaMA-Factory and trl attach), which adds
    uniform noise in ``[-m, m]``, ``m = alpha / sqrt(seq_len * hidden_size)`` (``seq_len`` the padded length of the
    batch ``[batch, seq_len, hidden]``) to the embeddings while the embedding module is in training mode; evaluation,
    prediction and generation (``eval()``) see none. Returns the hook's handle."""
    from transformers.integrations.neftune import activate_neftune

    return activate_neftune(peft_model, alpha)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (elements, not bytes)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s layers recompute their activations in the backward: transformers'
    ``GradientCheckpointingLayer`` modules (the decoder layers) whose ``gradient_checkpointing`` is on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True for m in model.modules())


__all__ = [
    "autocast",
    "build_lora_model",
    "checkpointed_layers",
    "compute_dtype",
    "count_parameters",
    "find_all_linear_modules",
    "OneRowProbe",
    "one_row_rtol",
    "resolved_revision",
    "samples_stay_apart_in_one_row",
]
