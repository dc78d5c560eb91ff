"""The training config: LLaMA-Factory's key names, validated with pydantic.

:class:`TrainConfig` is the single source of truth for every key ``ferry train`` understands: its name,
type, default, limits and meaning (the field descriptions and limits feed ``ferry train --keys`` and the docs).
It is one flat model made of concern-sized parts, each a pydantic model with its keys and their checks::

    ModelArgs         model_name_or_path, model_revision, trust_remote_code
    StageArgs         stage, do_train, do_eval
    PreferenceArgs    pref_beta, pref_loss, ... ref_model: stage dpo, kto, rm
    PredictArgs       do_predict and generation (max_new_tokens, temperature, ...)
    EvalTaskArgs      eval_tasks, eval_include_path, eval_limit, eval_max_drop: lm-eval after training
    LoraArgs          lora_rank, lora_alpha, lora_dropout, lora_target, ...
    VocabArgs         resize_vocab, add_special_tokens, new_special_tokens
    QuantizationArgs  quantization_bit and friends (QLoRA)
    DataArgs          dataset, template, cutoff_len, packing, val_size, the tokenised cache, ...
    OptimizerArgs     batch sizes, learning rate, schedule, optimizer, clipping
    ComputeArgs       bf16 / fp16, gradient checkpointing, attention and loss kernels
    OutputArgs        output_dir, checkpoints, evaluation, logging
    DistributedArgs   resume, seed, DDP and FSDP
    LlamaFactoryArgs  adapter_name_or_path, LoRA+, PiSSA

A LLaMA-Factory YAML such as ``examples/train_lora/llama3_lora_sft.yaml`` loads as it is; keys that only tune
LLaMA-Factory's own machinery (``preprocessing_num_workers``, ``overwrite_cache``, ...) are accepted and documented
as such.

:func:`load_config` reads a YAML file plus ``KEY=VALUE`` overrides. Every mistake is a
:class:`ferry.errors.ConfigError` that names the key, where it came from (``file:line`` or the override),
and for an unknown key the nearest valid one::

    ferry: error: config.yaml:7: unknown key 'lora_rnak' (did you mean 'lora_rank'?)
    ferry: error: config.yaml:9: key 'cutoff_len': Input should be a valid integer (got 'long')
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from typing_extensions import Self

from ferry.constants import ferry_home
from ferry.errors import ConfigError
from ferry.stages import PREFERENCE_STAGES
from ferry.yaml_config import parse_yaml_mapping, read_config_text, split_names
from trainer.templates import TEMPLATES, unknown_template_message

#: The origins of ``X | Y`` and ``Optional[X]`` annotations.
_UNION_TYPES = (typing.Union, types.UnionType)


def _default_dataset_dir() -> str:
    """``$FERRY_HOME/datasets`` on an installed prefix, else ``data`` (LLaMA-Factory's default)."""
    home = ferry_home()
    return str(home / "datasets") if home is not None else "data"


def _model_type(model: Any) -> str | None:
    """``model_type`` from the base model's config.json when it is installed (for template hints), else None."""
    if not isinstance(model, str):
        return None
    try:
        import json

        from ferry.hub import resolve_model

        return json.loads((Path(resolve_model(model, None)) / "config.json").read_text(encoding="utf-8")).get(
            "model_type"
        )
    except Exception:  # not installed, no config.json: the hint goes by name only
        return None


#: ``ddp_timeout``'s default in seconds (3 hours): above the time one rank may need to load a large model from slow
#: shared storage (a 400 GB checkpoint at 100 MB/s takes about 70 minutes) or to finish do_predict's longer
#: generations while the others wait, and still an end to a job whose rank truly hangs.
DEFAULT_DDP_TIMEOUT_S = 3 * 3600
#: ``fsdp`` options ferry understands (HF TrainingArguments' FSDPOption names, as LLaMA-Factory passes them).
FSDP_OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")
#: The sharding strategies among :data:`FSDP_OPTIONS` (exactly one per run).
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2")


class FsdpConfig(BaseModel):
    """``fsdp_config:``, HF TrainingArguments' key (keys may carry its ``fsdp_`` prefix, which is dropped).

    Every key left unset (None) follows the ``fsdp`` options: ``reshard_after_forward`` is false for
    ``shard_grad_op`` / ``hybrid_shard_zero2`` (ZeRO-2: the gathered weights stay until the backward) and true
    otherwise; ``cpu_offload`` is true with the ``offload`` option; ``activation_checkpointing`` follows
    ``gradient_checkpointing``.
    """

    model_config = ConfigDict(extra="forbid")

    version: Literal[2] = Field(default=2, description="FSDP version: only 2 (torch.distributed.fsdp.fully_shard).")
    reshard_after_forward: bool | None = Field(
        default=None, description="Free the gathered weights of a layer after its forward (gather again in backward)."
    )
    cpu_offload: bool | None = Field(
        default=None, description="Keep sharded parameters, gradients and optimizer state in CPU RAM (CUDA only)."
    )
    activation_checkpointing: bool | None = Field(
        default=None,
        description="Recompute each decoder layer's activations in the backward (= gradient_checkpointing).",
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        default=None,
        description="Class names sharded one unit each (default: the model's _no_split_modules, its decoder layer).",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_prefix(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {(k[5:] if isinstance(k, str) and k.startswith("fsdp_") else k): v for k, v in data.items()}
        return data

    @field_validator("transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return split_names(value)


# ---------------------------------------------------------------------- the keys, by concern


class _Keys(BaseModel):
    """What every part of the config shares: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelArgs(_Keys):
    """The base model (LLaMA-Factory's ModelArguments)."""

    model_name_or_path: str = Field(
        description="Base model: a local directory, or a repo id (ORG/NAME) installed offline in the Hugging "
        "Face cache ($HF_HOME/hub) or the ModelScope cache. Required."
    )
    model_revision: str | None = Field(
        None, description="Branch, tag or commit hash of the base model in the cache (None = main)."
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code (auto_map) to run. Off by default."
    )
    rope_scaling: Literal["linear", "dynamic", "yarn", "llama3"] | None = Field(
        None,
        description="Stretch the model's RoPE to train rows longer than its context, as LLaMA-Factory does: when "
        "cutoff_len exceeds the model's max_position_embeddings C, factor ceil(cutoff_len / C) of this type "
        "(otherwise nothing, with a warning). The adapter records it (ferry_rope.json) and the export's "
        "config.json carries it (ferry/rope.py).",
    )


class StageArgs(_Keys):
    """What the run does: the training stage and LLaMA-Factory's do_* switches."""

    stage: Literal["sft", "pt", "dpo", "kto", "rm"] = Field(
        "sft",
        description="sft: supervised fine-tuning on conversations (loss on assistant tokens only); "
        "pt: pre-training on plain text (loss on every token); dpo: preference optimisation on ranked pairs "
        "(pref_loss picks DPO, IPO, hinge, kto_pair, ORPO or SimPO); rm: a reward model (a value head on ranked "
        "pairs, saved as value_head.safetensors beside the adapter); kto: KTO on replies tagged desirable or not "
        "(kto_tag). ppo is refused.",
    )
    do_train: bool = Field(
        True,
        description="Train. false (LLaMA-Factory: no training) is accepted with tokenized_path, to "
        "tokenise and stop, or with do_predict, to only predict; ferry runs no evaluation-only jobs.",
    )
    do_eval: bool = Field(
        False,
        description="Accepted for LLaMA-Factory compatibility: ferry evaluates whenever there is eval data "
        "(val_size > 0 or eval_dataset). With do_predict after training, the base model predicts too (base vs "
        "tuned in the run summary).",
    )


class PreferenceArgs(_Keys):
    """Preference training (``stage: dpo | kto | rm``): LLaMA-Factory 0.9.5's RLHF keys and defaults, read by
    :class:`trainer.preference_loss.PreferenceLossConfig` (whose docstring gives each formula and its paper)."""

    pref_beta: float = Field(0.1, gt=0, description="beta of the preference losses (ORPO: the odds-ratio weight).")
    pref_ftx: float = Field(
        0.0, ge=0, description="Weight of the SFT loss of the chosen reply added to the preference loss."
    )
    pref_loss: Literal["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"] = Field(
        "sigmoid",
        description="stage dpo's loss: sigmoid (DPO), hinge (SLiC), ipo, kto_pair, orpo and simpo (these two "
        "need no reference model).",
    )
    pref_bco_weight: float = Field(
        0.0, description="BCO's weight in stage dpo (LLaMA-Factory): not supported, only 0 (the default) is accepted."
    )
    dpo_label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Conservative DPO: the share of pairs assumed mislabelled (sigmoid only)."
    )
    simpo_gamma: float = Field(0.5, description="SimPO's target reward margin (reward units).")
    ld_alpha: float | None = Field(
        None,
        ge=0,
        le=1,
        description="LD-DPO: weight of the reply tokens past the shorter reply of a pair (None: off).",
    )
    kto_chosen_weight: float = Field(1.0, ge=0, description="KTO: weight of desirable replies.")
    kto_rejected_weight: float = Field(1.0, ge=0, description="KTO: weight of undesirable replies.")
    ref_model: str | None = Field(
        None,
        description="The reference model of dpo (a local folder or an installed repo id), loaded once per rank, "
        "frozen; it must share the policy's vocabulary. None: the policy as training starts (pref_reference), "
        "with no second copy of the weights.",
    )
    ref_model_adapters: list[str] | None = Field(
        None, description="Adapters merged into ref_model (comma-separated folders)."
    )
    pref_reference: Literal["start", "no_adapter"] = Field(
        "start",
        description="ferry's key: without ref_model, the reference of dpo is the model as training starts "
        "(start: with adapter_name_or_path, your SFT adapter included, held as a frozen second adapter) or the "
        "policy with its trained adapter disabled (no_adapter: LLaMA-Factory's reference, which with "
        "adapter_name_or_path is the base without that adapter). Without adapter_name_or_path both are the base.",
    )
    ref_model_quantization_bit: Literal[4, 8] | None = Field(
        None, description="Load ref_model in 4 or 8 bits (bitsandbytes)."
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="trl's key: compute the reference's log-probabilities of every train and eval pair (kto: "
        "sample) once before training, then free ref_model; each step then runs the policy only.",
    )
    precompute_ref_batch_size: int | None = Field(
        None,
        gt=0,
        description="trl's key: pairs per forward while precomputing (None: per_device_eval_batch_size).",
    )

    @field_validator("pref_bco_weight")
    @classmethod
    def _no_bco(cls, value: float) -> float:
        if value != 0:
            raise ValueError("BCO (pref_bco_weight > 0) is not supported; remove the key or set it to 0")
        return value

    @field_validator("ref_model_adapters", mode="before")
    @classmethod
    def _ref_adapter_list(cls, value: Any) -> Any:
        return split_names(value) or None


class PredictArgs(_Keys):
    """Predictions (:mod:`trainer.predict`): LLaMA-Factory's keys and generation defaults."""

    do_predict: bool = Field(
        False,
        description="Generate a reply for every row of eval_dataset (after training, or alone with "
        "do_train: false) and write generated_predictions.jsonl and predict_results.json (BLEU-4, ROUGE-1/2/L).",
    )
    predict_with_generate: bool = Field(
        False, description="Required with do_predict: predictions are generated (ferry scores nothing else)."
    )
    max_new_tokens: int = Field(1024, description="Most tokens generated per prediction.")
    do_sample: bool = Field(True, description="Sample (temperature, top_p, top_k) instead of greedy decoding.")
    temperature: float = Field(0.95, description="Sampling temperature (with do_sample).")
    top_p: float = Field(0.7, description="Nucleus sampling mass (with do_sample).")
    top_k: int = Field(50, description="Top-k sampling (with do_sample).")
    repetition_penalty: float = Field(1.0, description="Generation's repetition penalty (1.0: none).")


class EvalTaskArgs(_Keys):
    """lm-evaluation-harness tasks run after training, the base against the trained adapter (``ferry eval``)."""

    eval_tasks: list[str] | None = Field(
        None,
        description="lm-eval tasks (comma list; carried with ferry pack --eval) scored on the base and the trained "
        "adapter after training, side by side in the run summary and OUTPUT_DIR/eval/.",
    )
    eval_include_path: str | None = Field(
        None, description="With eval_tasks: a folder of your own lm-eval task YAMLs (ferry eval's include_path)."
    )
    eval_limit: float | None = Field(
        None, gt=0, description="With eval_tasks: documents per task (a whole number, or a fraction < 1)."
    )
    eval_max_drop: float | None = Field(
        None,
        ge=0,
        description="With eval_tasks: fail (exit code 15) when any tuned metric is worse than the base's by more.",
    )

    @field_validator("eval_tasks", mode="before")
    @classmethod
    def _task_list(cls, value: Any) -> Any:
        return split_names(value)


class LoraArgs(_Keys):
    """The adapter: LoRA's rank, scaling, dropout and the modules it adapts (:mod:`trainer.targets`)."""

    finetuning_type: Literal["lora"] = Field("lora", description="Fine-tuning method; only LoRA is supported.")
    lora_rank: int = Field(8, gt=0, description="LoRA rank r (inner dimension of the A and B matrices).")
    lora_alpha: float | None = Field(
        None,
        description="LoRA scaling numerator: the update is (lora_alpha / r) * B A (or lora_alpha / sqrt(r) "
        "with use_rslora). None = 2 * lora_rank, as LLaMA-Factory.",
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on the LoRA input, in [0, 1).")
    lora_target: list[str] = Field(
        default_factory=lambda: ["all"],
        description="Modules that get LoRA layers: 'all' (every linear layer except the output head) or "
        "comma-separated module names such as q_proj,v_proj.",
        json_schema_extra={"limits": "all, or module names"},
    )
    additional_target: list[str] | None = Field(
        None,
        description="Comma-separated module names trained fully and saved with the adapter "
        "(peft modules_to_save), e.g. embed_tokens,lm_head.",
    )
    freeze_vision_tower: bool = Field(
        True, description="Vision-language models: leave the vision tower without LoRA (as LLaMA-Factory)."
    )
    freeze_multi_modal_projector: bool = Field(
        True, description="Vision-language models: leave the multi-modal projector without LoRA (as LLaMA-Factory)."
    )
    freeze_language_model: bool = Field(
        False,
        description="Vision-language models: leave the language model without LoRA (as LLaMA-Factory); with "
        "freeze_vision_tower: false, LoRA goes on the vision tower alone.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by lora_alpha / sqrt(r).")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")

    @field_validator("lora_target", "additional_target", mode="before")
    @classmethod
    def _module_lists(cls, value: Any) -> Any:
        return split_names(value)

    @field_validator("lora_target")
    @classmethod
    def _all_or_names(cls, value: list[str]) -> list[str]:
        if "all" in value and len(value) > 1:
            raise ValueError("'all' cannot be combined with module names")
        if not value:
            raise ValueError("must name at least one module or 'all'")
        return value

    @model_validator(mode="after")
    def _default_alpha(self) -> Self:
        if self.lora_alpha is None:  # LLaMA-Factory's rule; set without re-validation (validate_assignment)
            object.__setattr__(self, "lora_alpha", float(2 * self.lora_rank))
        return self


class VocabArgs(_Keys):
    """New tokens and a resized vocabulary (:mod:`trainer.vocab`), LLaMA-Factory's keys."""

    resize_vocab: bool = Field(
        False,
        description="Add the tokens the template needs and the tokenizer lacks (e.g. <|im_end|> for qwen "
        "templates on a Llama base) as special tokens, grow the embeddings to len(tokenizer) rounded up to a "
        "multiple of 64 with new rows set to the mean of the old ones, and train the new rows: alone on untied "
        "embeddings (peft trainable_token_indices), the embeddings and head fully on tied ones (modules_to_save), "
        "unless additional_target says otherwise.",
    )
    add_special_tokens: list[str] | None = Field(
        None,
        description="Special tokens to add to the tokenizer, comma-separated (LLaMA-Factory 0.9.5's key); "
        "adding any turns resize_vocab on.",
    )
    new_special_tokens: list[str] | None = Field(
        None, description="The same as add_special_tokens (LLaMA-Factory's name for it before 0.9.5)."
    )

    @field_validator("add_special_tokens", "new_special_tokens", mode="before")
    @classmethod
    def _token_lists(cls, value: Any) -> Any:
        return split_names(value)


class QuantizationArgs(_Keys):
    """QLoRA: a base quantised on the fly (:mod:`trainer.quant`)."""

    quantization_bit: Literal[4, 8] | None = Field(
        None,
        description="QLoRA: quantise the base on the fly to 4 or 8 bits (bitsandbytes) and train LoRA over "
        "it; None = full precision. Pre-quantised bases (GPTQ, AWQ, AQLM) are refused.",
    )
    quantization_method: str = Field(
        "bnb", description="On-the-fly quantisation backend: only bnb (bitsandbytes); the others are refused."
    )
    quantization_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type: nf4 (NormalFloat4, QLoRA's) or fp4."
    )
    double_quantization: bool = Field(
        True, description="4-bit: quantise the per-block scales too (about 0.4 bit per weight less)."
    )
    bnb_4bit_quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] | None = Field(
        None,
        description="4-bit: dtype the packed weights are stored in (bitsandbytes' bnb_4bit_quant_storage). "
        "None: bfloat16 under fsdp (FSDP2 shards floating-point storage only), else uint8.",
    )
    upcast_layernorm: bool = Field(
        False,
        description="Cast the norm weights to fp32 (LLaMA-Factory's key); otherwise a quantised run "
        "keeps every non-quantised frozen parameter in the training dtype.",
    )


class DataArgs(_Keys):
    """The data: datasets, chat template, truncation, packing, the eval split and the tokenised cache."""

    dataset: list[str] = Field(
        default_factory=list,
        description="Training datasets, comma-separated: names from dataset_dir/dataset_info.json, or paths "
        "to .json / .jsonl files. Required, except for do_predict alone (do_train: false), which reads "
        "eval_dataset only.",
    )
    dataset_dir: str = Field(
        default_factory=_default_dataset_dir,
        description="Folder holding dataset_info.json and the data files ($FERRY_HOME/datasets when "
        "FERRY_HOME is set, else 'data').",
    )
    eval_dataset: list[str] | None = Field(
        None, description="Evaluation datasets, comma-separated, like dataset. Overrides val_size."
    )
    media_dir: str | None = Field(
        None,
        description="Folder that the images columns' relative paths start from; None = dataset_dir "
        "(LLaMA-Factory's default).",
    )
    image_max_pixels: int = Field(
        768 * 768,
        gt=0,
        description="Image rows: images larger than this many pixels (width * height) are scaled down, aspect "
        "kept, before the model's image processor (as LLaMA-Factory).",
    )
    image_min_pixels: int = Field(
        32 * 32,
        gt=0,
        description="Image rows: images smaller than this many pixels are scaled up before the image processor.",
    )
    video_max_pixels: int = Field(
        256 * 256,
        gt=0,
        description="Video rows: frames larger than this many pixels are scaled down, aspect kept, before the "
        "model's video processor (as LLaMA-Factory).",
    )
    video_min_pixels: int = Field(
        16 * 16,
        gt=0,
        description="Video rows: frames smaller than this many pixels are scaled up before the video processor.",
    )
    video_fps: float = Field(
        2.0,
        gt=0,
        description="Video rows: frames sampled per second of video (at most video_maxlen, at least one).",
    )
    video_maxlen: int = Field(
        128,
        gt=0,
        description="Video rows: the most frames sampled from one video.",
    )
    template: str | None = Field(
        None,
        description="Chat template: None uses the tokenizer's chat_template (falling back to 'empty', "
        f"the texts back to back, with a warning, when it has none); built-ins: {', '.join(TEMPLATES)}.",
        json_schema_extra={"limits": "a built-in name (ferry train --templates)"},
    )
    cutoff_len: int = Field(
        2048,
        gt=0,
        description="Maximum tokens per training sequence; longer samples are truncated so that the "
        "response keeps tokens; with packing, the length of each packed block.",
    )
    packing: bool | None = Field(
        None,
        description="Concatenate samples into rows; None (LLaMA-Factory's default) = on for stage pt, off "
        "otherwise. Stage pt: every document's tokens and EOS concatenated and cut into blocks of exactly "
        "cutoff_len tokens (LLaMA-Factory's pretraining packing). Other stages: LLaMA-Factory's supervised "
        "packing: samples are cut to cutoff_len - 1 and grouped by its greedy knapsack, position ids restart per "
        "sample, and attention crosses sample boundaries within a row; neat_packing keeps them apart.",
    )
    neat_packing: bool = Field(
        False,
        description="Packing without attention across samples (LLaMA-Factory's neat_packing: a "
        "block-diagonal mask per row); turns packing on.",
    )
    padding_free: bool | Literal["auto"] = Field(
        "auto",
        description="Run a micro-batch as one row of its samples laid end to end (position ids restart "
        "per sample, attention stays within each sample: the same loss and gradients) instead of padding every "
        "sample to the longest, so no compute is spent on padding. auto: on CPU when the linear-layer FLOPs "
        "saved outweigh the attention FLOPs of the longer row; on CUDA only with flash-attention kernels (there "
        "sdpa's masked row is slower than padded rows); true: whenever the batch has padding; false: never "
        "(flash-attention kernels still get one row).",
    )
    mix_strategy: Literal["concat"] = Field(
        "concat",
        description="How several datasets are combined: concatenated in the order given (the only "
        "strategy; the DistributedSampler shuffles).",
    )
    train_on_prompt: bool = Field(False, description="Also compute the loss on prompt (user/system) tokens.")
    mask_history: bool = Field(
        False,
        description="Train only on the last assistant turn of each conversation (default: every turn); "
        "truncation budgets the last turn first (LLaMA-Factory).",
    )
    default_system: str | None = Field(
        None, description="Replace the template's default system prompt (used when a sample has none)."
    )
    enable_thinking: bool | None = Field(
        True,
        description="Reasoning templates (qwen3, deepseekr1, ...): true trains an empty <think> block "
        "before replies that have none; false strips every reasoning block and puts the empty block in the prompt.",
    )
    tool_format: str | None = Field(
        None,
        description="Tool-call format replacing the template's own (default, qwen, llama3, glm4, mistral, "
        "qwen3_5, glm4_moe, seed_oss, ...).",
    )
    val_size: float = Field(
        0.0,
        ge=0,
        json_schema_extra={"limits": ">= 0: a fraction < 1, or a whole number"},
        description="Held-out share of the training data for evaluation: a fraction in [0, 1) or an "
        "integer number of samples (>= 1). The split is LLaMA-Factory's (datasets' train_test_split under seed).",
    )
    max_samples: int | None = Field(
        None, gt=0, description="Use at most this many samples from each dataset (the first ones in file order)."
    )
    tokenized_path: str | None = Field(
        None,
        description="LLaMA-Factory's tokenised-dataset folder: when it does not exist yet, `ferry train` "
        "tokenises into it and stops; when it exists, training loads from it (entries keyed by content hashes). "
        "Unset: $FERRY_CACHE/tokenized (~/.cache/ferry/tokenized) and training goes on.",
    )
    overwrite_cache: bool = Field(False, description="Re-tokenise even when a matching cache entry exists.")
    preprocessing_num_workers: int | None = Field(
        None, description="Accepted for LLaMA-Factory compatibility; ferry tokenises in the launching process."
    )
    preprocessing_batch_size: int = Field(
        1000,
        description="With packing: samples are packed in groups of this many, in dataset order "
        "(LLaMA-Factory packs each datasets.map batch on its own).",
    )

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _dataset_lists(cls, value: Any) -> Any:
        return split_names(value)

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or value in TEMPLATES:
            return value
        raise ValueError(unknown_template_message(value, _model_type(info.data.get("model_name_or_path"))))

    @field_validator("tool_format")
    @classmethod
    def _known_tool_format(cls, value: str | None) -> str | None:
        from trainer.templates import TOOL_FORMATS

        if value is None or value in TOOL_FORMATS:
            return value
        raise ValueError(f"unknown tool_format {value!r}; known: {', '.join(TOOL_FORMATS)}")

    @field_validator("val_size")
    @classmethod
    def _fraction_or_count(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError("must be a fraction in [0, 1) or a whole number")
        return value

    @model_validator(mode="after")
    def _neat_packing_packs(self) -> Self:
        # set without re-validation (validate_assignment); None, LLaMA-Factory's default: on for stage pt only
        if self.packing is None:
            object.__setattr__(self, "packing", self.neat_packing or getattr(self, "stage", None) == "pt")
        if self.neat_packing and not self.packing:
            object.__setattr__(self, "packing", True)
        return self


class OptimizerArgs(_Keys):
    """Batch, optimizer and learning-rate schedule."""

    per_device_train_batch_size: int = Field(1, gt=0, description="Sequences per micro-batch on each process.")
    per_device_eval_batch_size: int = Field(1, gt=0, description="Sequences per evaluation batch on each process.")
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        description="Micro-batches per optimizer step. Global batch = per_device_train_batch_size * "
        "gradient_accumulation_steps * world_size sequences.",
    )
    learning_rate: float = Field(5e-5, ge=0, description="Peak learning rate (of AdamW, or SGD with optim: sgd).")
    num_train_epochs: float = Field(3.0, description="Passes over the training data (fractions allowed).")
    max_steps: int = Field(-1, description="Total optimizer steps; > 0 overrides num_train_epochs.")
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup", "constant"] = Field(
        "linear", description="Learning-rate schedule after warmup (transformers' get_scheduler names)."
    )
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Warmup as a fraction of the total steps, in [0, 1].")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps; > 0 overrides warmup_ratio.")
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="Weight decay: AdamW's decoupled decay (SGD's L2 term with optim: sgd), on matrices only.",
    )
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field(
        "adamw_torch",
        description="Optimizer (transformers' OptimizerNames): adamw_torch / adamw_torch_fused = "
        "torch.optim.AdamW (fused on CUDA either way); sgd = torch.optim.SGD without momentum (no optimizer state: "
        "each step depends only on the weights and the batch).",
    )
    adam_beta1: float = Field(0.9, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient L2 norm to this value (0 = off).")
    neftune_noise_alpha: float | None = Field(
        None,
        ge=0,
        description="NEFTune (Jain et al. 2023, arXiv:2310.05914): uniform noise in [-m, m], m = alpha / "
        "sqrt(seq_len * hidden_size), added to the input embeddings in training steps only (transformers' own "
        "hook, as LLaMA-Factory and trl apply it; the paper uses alpha 5 to 15). None or 0 = off.",
    )


class ComputeArgs(_Keys):
    """How each step computes: precision, activation checkpointing, attention and loss kernels."""

    bf16: bool = Field(False, description="bfloat16 autocast (CUDA with bf16 support).")
    fp16: bool = Field(False, description="float16 autocast with a gradient scaler (CUDA).")
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute activations in the backward pass: less memory, about 30% more compute "
        "(transformers' non-reentrant checkpointing of each decoder layer). Unset: on, unless "
        "disable_gradient_checkpointing (LLaMA-Factory's default).",
    )
    disable_gradient_checkpointing: bool = Field(
        False, description="LLaMA-Factory's key: true turns gradient checkpointing off (it is on by default)."
    )
    use_reentrant_gc: bool = Field(
        True,
        description=(
            "Accepted for LLaMA-Factory YAML; ferry's checkpointing is always non-reentrant (the same gradients)."
        ),
    )
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2", "fa3", "eager", "varlen"] = Field(
        "auto",
        description="Attention kernel: auto (transformers' default, sdpa; padding-free rows on CUDA through "
        "torch's varlen flash kernel where torch has it), sdpa, eager, fa2 (flash_attention_2), fa3, disabled "
        "(= eager), or varlen (ferry's: padding-free rows through torch.nn.attention.varlen on CUDA, the "
        "per-sample sdpa reference on CPU).",
    )
    enable_liger_kernel: bool = Field(
        False,
        description=(
            "LLaMA-Factory's key: the loss through liger-kernel's fused linear cross-entropy on CUDA (when installed; "
            "`ferry pack --extra liger` carries it). Elsewhere ferry's own chunked loss (trainer/loss.py, always on "
            "where a start-up check shows it exact): one chunk of logits instead of [batch, seq_len, vocab]."
        ),
    )

    @model_validator(mode="after")
    def _default_checkpointing(self) -> Self:
        if self.gradient_checkpointing is None:  # LLaMA-Factory checkpoints unless told not to
            object.__setattr__(self, "gradient_checkpointing", not self.disable_gradient_checkpointing)
        return self


class OutputArgs(_Keys):
    """What the run writes: output_dir, checkpoints, evaluation and logging."""

    output_dir: str = Field(description="Where the adapter, checkpoints, metrics and report go. Required.")
    overwrite_output_dir: bool = Field(
        False, description="Allow a fresh run into an output_dir that already holds a finished run."
    )
    logging_steps: int = Field(10, gt=0, description="Log train loss, lr and tokens/s every this many steps.")
    save_steps: int = Field(500, gt=0, description="Write checkpoint-STEP/ every this many optimizer steps.")
    save_total_limit: int | None = Field(
        None, gt=0, description="Keep at most this many checkpoints (the newest); None keeps all."
    )
    save_strategy: Literal["steps", "epoch", "no"] = Field(
        "steps", description="When to write checkpoints: every save_steps, at each epoch end, or never."
    )
    save_only_model: bool = Field(
        False, description="Checkpoints hold only the adapter (no optimizer/scheduler/RNG state: cannot resume)."
    )
    eval_steps: int | None = Field(
        None,
        gt=0,
        description="Evaluate every this many steps (None = logging_steps when eval_strategy is steps, "
        "as transformers).",
    )
    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "steps",
        description="When to evaluate when eval data exists: every eval_steps, each epoch end, or "
        "only at the end ('no').",
    )
    report_to: Literal["none", "tensorboard"] = Field(
        "none", description="Experiment tracking: tensorboard (event files under output_dir/runs) or none."
    )
    run_name: str | None = Field(None, description="Name of the run in logs and TensorBoard.")
    plot_loss: bool = Field(
        False,
        description="Draw output_dir/loss.png (train and eval loss per step) at the end, with matplotlib.",
    )
    disable_tqdm: bool = Field(False, description="No progress bar (rank 0 still writes metrics.jsonl).")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, value: Any) -> Any:
        if value is None:
            return "none"
        names = split_names(value) if isinstance(value, (str, list, tuple)) else value
        if not isinstance(names, list):
            return value
        names = [n.lower() for n in names if n.lower() != "none"]
        if not names:
            return "none"
        if all(n in ("tensorboard", "all") for n in names):
            return "tensorboard"
        bad = next(n for n in names if n not in ("tensorboard", "all"))
        raise ValueError(f"{bad!r} is not available offline; use 'tensorboard' or 'none'")


class DistributedArgs(_Keys):
    """Where the run starts and how its processes work together: resume, seed, DDP and FSDP."""

    resume_from_checkpoint: str | None = Field(
        "auto",
        description="'auto': continue from the newest checkpoint in output_dir when there is one; a "
        "path: that checkpoint; false/None: start fresh.",
    )
    seed: int = Field(42, description="Seed of model init, data shuffling, the train/eval split and dropout.")
    ddp_timeout: int = Field(
        DEFAULT_DDP_TIMEOUT_S,
        gt=0,
        description="Seconds one collective may wait for every rank before the job is ended (NCCL's watchdog). "
        "The default, 3 hours, lets one rank load a large model from slow shared storage, or finish do_predict's "
        "longer generations, while the others wait; a rank that truly hangs still ends the job within it. "
        "transformers' 1800 s kills such runs; LLaMA-Factory's examples set 180000000 (5.7 years: a hung job "
        "holds its GPUs until someone notices). Your value is kept.",
    )
    ddp_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA, gloo on CPU."
    )
    fsdp: list[str] = Field(
        default_factory=list,
        description="Fully sharded data parallel (FSDP2) instead of DDP, HF "
        "TrainingArguments' options space-separated: full_shard (weights, gradients and optimizer state "
        "sharded over all ranks), shard_grad_op (weights kept gathered from forward to backward), hybrid_shard "
        "(shard within a node, replicate across nodes), hybrid_shard_zero2, plus offload (CPU offload) and "
        "auto_wrap (accepted: every decoder layer is always its own unit). Empty = DDP.",
        json_schema_extra={"limits": "one strategy of " + ", ".join(FSDP_STRATEGIES) + "; plus offload, auto_wrap"},
    )
    fsdp_config: FsdpConfig = Field(
        default_factory=FsdpConfig,
        description="FSDP settings: reshard_after_forward, cpu_offload, "
        "activation_checkpointing, transformer_layer_cls_to_wrap (keys may carry HF's fsdp_ prefix).",
    )
    ddp_find_unused_parameters: bool | None = Field(
        None, description="DDP find_unused_parameters (None = False, as transformers for LoRA)."
    )
    ddp_broadcast_buffers: bool | None = Field(
        None,
        description="DDP: copy rank 0's buffers to every rank before each forward. None = false: a decoder's "
        "buffers (rotary frequencies, embedding scales) are constants every rank computes alike, and the copy is one "
        "collective per micro-batch (transformers' Trainer keeps torch's true). torch 2.13 still copies them once "
        "when DDP wraps the model; older torch does not, and every rank has computed them alike.",
    )
    ddp_bucket_cap_mb: int | None = Field(
        None,
        gt=0,
        description="DDP gradient bucket size in MiB (None = torch's 25). A LoRA adapter's gradients are small: "
        "r8 on every linear layer of a 0.5B model is 17 MiB in fp32, one bucket.",
    )
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    torch_compile: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile (regional compilation: one layer's code is "
        "compiled once and serves every layer) after LoRA is added and before DDP wraps the model; the graphs "
        "compiled are counted in train_report.json. Not with fsdp.",
    )
    torch_compile_backend: str | None = Field(
        None, description="torch.compile's backend (None = inductor; aot_eager traces without generating kernels)."
    )
    torch_compile_mode: str | None = Field(
        None, description="torch.compile's mode (None = default; reduce-overhead, max-autotune, ...)."
    )

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume(cls, value: Any) -> Any:
        if value is True:
            return "auto"
        if value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "none", "no")):
            return None
        return value

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_options(cls, value: Any) -> Any:
        """``"full_shard auto_wrap"`` / ``[full_shard, offload]`` / ``true`` (= full_shard) / ``false`` / None."""
        if value is None or value is False or value == "":
            return []
        if value is True:
            return ["full_shard"]
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, (list, tuple)):
            return value
        names = [str(v).strip().lower() for v in value if str(v).strip()]
        bad = [n for n in names if n not in FSDP_OPTIONS]
        if bad:
            near = difflib.get_close_matches(bad[0], FSDP_OPTIONS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown fsdp option {bad[0]!r}{hint}; options: {' '.join(FSDP_OPTIONS)}")
        strategies = [n for n in names if n in FSDP_STRATEGIES]
        if len(set(strategies)) > 1:
            raise ValueError(f"choose one sharding strategy, got {' and '.join(strategies)}")
        if names and not strategies:
            raise ValueError(f"{' '.join(names)} needs a sharding strategy such as full_shard")
        return list(dict.fromkeys(names))

    @model_validator(mode="after")
    def _compile_without_fsdp(self) -> Self:
        if self.torch_compile and self.fsdp:
            raise ValueError(
                "torch_compile is not supported with fsdp: ferry compiles the decoder layers where DDP or one "
                "process runs them; train without fsdp, or without torch_compile"
            )
        return self


class LlamaFactoryArgs(_Keys):
    """LLaMA-Factory's example features (:mod:`trainer.lf_compat`): stacked adapters, LoRA+, PiSSA."""

    adapter_name_or_path: list[str] | None = Field(
        None,
        description="Adapters to start from (comma-separated; a LLaMA-Factory or ferry output_dir, or an "
        "adapter folder). As LLaMA-Factory: all but the last are merged into the base and the last is trained "
        "further (its rank and targets win over the YAML's); with create_new_adapter all are merged and a new LoRA "
        "is trained.",
    )
    create_new_adapter: bool = Field(
        False, description="Merge every adapter_name_or_path into the base and train a new LoRA on top."
    )
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        description="LoRA+ (peft's create_loraplus_optimizer): the B matrices learn this many times faster "
        "than learning_rate (LLaMA-Factory's example: 16).",
    )
    loraplus_lr_embedding: float = Field(1e-6, description="LoRA+: learning rate of LoRA on embedding layers.")
    pissa_init: bool = Field(
        False,
        description="PiSSA initialisation (peft): A and B from the top singular vectors of each weight, the "
        "frozen base keeps the residual. Needs pissa_convert (ferry's merge reads the original base).",
    )
    pissa_iter: int = Field(
        16,
        ge=-1,
        json_schema_extra={"limits": "-1, or > 0"},
        description="PiSSA: subspace iterations of the fast randomized SVD; -1 = full SVD.",
    )
    pissa_convert: bool = Field(
        False,
        description="Save the trained PiSSA adapter converted to a plain LoRA (rank 2r) of the original base "
        "(output_dir/adapter); the initial one stays in output_dir/pissa_init.",
    )

    @field_validator("adapter_name_or_path", mode="before")
    @classmethod
    def _adapter_list(cls, value: Any) -> Any:
        return split_names(value) or None

    @field_validator("pissa_iter")
    @classmethod
    def _full_or_iterations(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (full SVD) or > 0")
        return value


# ---------------------------------------------------------------------- the whole config


class TrainConfig(  # pydantic takes the fields of the last base first: the parts are listed last to first
    LlamaFactoryArgs,
    DistributedArgs,
    OutputArgs,
    ComputeArgs,
    OptimizerArgs,
    DataArgs,
    QuantizationArgs,
    VocabArgs,
    LoraArgs,
    EvalTaskArgs,
    PredictArgs,
    PreferenceArgs,
    StageArgs,
    ModelArgs,
):
    """Everything ``ferry train`` needs, with LLaMA-Factory's key names and defaults: one flat model
    (``cfg.lora_rank``) made of the parts above, whose keys come in their order (model, stage, predict, LoRA,
    vocabulary, quantization, data, optimizer, compute, output, distributed, LLaMA-Factory features).

    Each part checks its own keys: types, limits (``Field(gt=...)``: ``--keys`` shows them) and choices
    (``Literal``). Normalised on validation (so the recipe never re-parses strings):

    - ``dataset``, ``eval_dataset``, ``lora_target``, ``additional_target`` become lists of names
      (LLaMA-Factory writes them comma-separated);
    - ``lora_alpha`` None becomes ``2 * lora_rank`` (LLaMA-Factory's rule);
    - ``resume_from_checkpoint`` ``true`` becomes ``"auto"``, ``false`` becomes None;
    - ``report_to`` becomes ``"none"`` or ``"tensorboard"`` (``all`` means tensorboard; online trackers
      such as wandb are refused: the trainer never opens a network connection).

    The rules between keys (``bf16`` with ``fp16``, ``do_predict`` with ``eval_dataset``, ...) are :meth:`_check`'s,
    within a part or across parts, so that every broken one is named in the same line.

    Raises:
        pydantic.ValidationError: on a bad value when constructed directly; :func:`load_config` turns it into
            a :class:`ferry.errors.ConfigError` naming the key.
    """

    def _preference_problems(self) -> list[tuple[str, str]]:
        """The rules of the preference stages (trainer/preference_recipe.py), as :meth:`_check` collects them."""
        problems: list[tuple[str, str]] = []
        if self.stage == "kto" and self.pref_loss != "sigmoid":
            problems.append(("pref_loss", "applies to stage dpo; stage kto has its own loss: remove the key"))
        if self.stage == "rm":
            if self.ref_model is not None:
                problems.append(("ref_model", "stage rm trains a reward model, which has no reference; remove the key"))
            if self.fsdp:
                problems.append(("fsdp", "stage rm runs under DDP (its value head is not sharded); remove fsdp"))
        if self.stage in PREFERENCE_STAGES:
            if self.packing or self.neat_packing:
                problems.append(("packing", f"stage {self.stage} trains on pairs, which are never packed"))
            if self.padding_free is True:
                problems.append(("padding_free", f"stage {self.stage} trains on padded pairs; remove the key"))
            if self.do_predict:
                problems.append(("do_predict", f"is for stage sft; stage {self.stage} does not predict"))
            for key in ("ref_model_adapters", "ref_model_quantization_bit"):
                if getattr(self, key) is not None and self.ref_model is None:
                    problems.append((key, "applies to ref_model, which is not set; set ref_model or remove the key"))
            if self.ref_model is not None and self.pref_loss in ("orpo", "simpo"):
                problems.append(("ref_model", f"pref_loss {self.pref_loss} uses no reference model; remove the key"))
            if self.precompute_ref_batch_size is not None and not self.precompute_ref_log_probs:
                problems.append(
                    ("precompute_ref_batch_size", "applies to precompute_ref_log_probs, which is off; remove the key")
                )
            if self.precompute_ref_log_probs and (self.stage == "rm" or self.pref_loss in ("orpo", "simpo")):
                what = "stage rm" if self.stage == "rm" else f"pref_loss {self.pref_loss}"
                problems.append(("precompute_ref_log_probs", f"{what} uses no reference model; remove the key"))
            if self.ref_model is not None and self.fsdp:
                problems.append(
                    (
                        "ref_model",
                        "is not sharded under fsdp (each rank would hold the whole reference model); remove "
                        "ref_model (the reference is then the policy as training starts) or fsdp",
                    )
                )
            if self.adapter_name_or_path and self.create_new_adapter and self.pref_reference == "no_adapter":
                problems.append(
                    (
                        "pref_reference",
                        "no_adapter cannot take the adapters out: create_new_adapter merged them into the base, "
                        "which is then the reference; remove one of the two keys",
                    )
                )
        return problems

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        """Every rule between keys, checked together: one ValueError naming each broken rule's key."""
        problems: list[tuple[str, str]] = []
        # -- precision and memory
        if self.gradient_checkpointing and self.disable_gradient_checkpointing:
            problems.append(
                (
                    "gradient_checkpointing",
                    "true contradicts disable_gradient_checkpointing: true; keep one of the two keys",
                )
            )
        if self.bf16 and self.fp16:
            problems.append(("fp16", "bf16 and fp16 cannot both be true"))
        # -- how long
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            problems.append(("num_train_epochs", "must be > 0 when max_steps is not set"))
        # -- LLaMA-Factory key semantics
        if self.mask_history and self.train_on_prompt:
            problems.append(("mask_history", "cannot be combined with train_on_prompt (LLaMA-Factory refuses it)"))
        if not self.do_train and self.tokenized_path is None and not self.do_predict:
            problems.append(
                (
                    "do_train",
                    "false leaves ferry nothing to do (it runs no evaluation-only jobs); set "
                    "tokenized_path to only tokenise, do_predict to only predict, or remove "
                    "the key",
                )
            )
        if self.fsdp and self.use_dora:
            problems.append(
                (
                    "fsdp",
                    "use_dora is not supported with fsdp (DoRA's magnitude needs the full "
                    "weights at init); use DDP or plain LoRA",
                )
            )
        if self.add_special_tokens is not None and self.new_special_tokens is not None:  # trainer/vocab.py
            problems.append(("new_special_tokens", "is the older name of add_special_tokens; set only one of them"))
        problems += self._preference_problems()
        # -- predictions (trainer/predict.py)
        if self.do_predict and not self.predict_with_generate:
            problems.append(("predict_with_generate", "must be true with do_predict (ferry scores generated text)"))
        if not self.dataset and (self.do_train or not self.do_predict):
            problems.append(
                (
                    "dataset",
                    "at least one training dataset is required (only do_predict with do_train: false runs without one)",
                )
            )
        if self.do_predict and not self.eval_dataset:
            problems.append(("eval_dataset", "do_predict needs eval_dataset: the rows to generate replies for"))
        if self.eval_tasks and self.rope_scaling is not None:
            problems.append(
                (
                    "eval_tasks",
                    "cannot be combined with rope_scaling: lm-eval would load the base under the adapter with its "
                    "RoPE unscaled; evaluate the merged export (ferry export, then ferry eval on it)",
                )
            )
        # -- LLaMA-Factory features (trainer/lf_compat.py)
        if self.pissa_init and not self.pissa_convert:
            problems.append(
                (
                    "pissa_init",
                    "needs pissa_convert: true (a PiSSA adapter applies to the residual base, "
                    "which ferry export and serving stacks do not have)",
                )
            )
        # -- QLoRA (trainer/quant_keys.py)
        from trainer.quant_keys import check_config

        problems.extend(check_config(self))
        if problems:
            raise ValueError("; ".join(f"{key}: {msg}" for key, msg in problems))
        return self

    # ------------------------------------------------------------------ helpers
    @property
    def lora_target_modules(self) -> str | list[str]:
        """``target_modules`` for ``peft.LoraConfig``: ``"all-linear"`` for ``all``, else the module names."""
        return "all-linear" if self.lora_target == ["all"] else list(self.lora_target)

    @property
    def fsdp_strategy(self) -> str | None:
        """The sharding strategy of ``fsdp`` (``full_shard``, ``shard_grad_op``, ``hybrid_shard``,
        ``hybrid_shard_zero2``), or None for DDP."""
        return next((o for o in self.fsdp if o in FSDP_STRATEGIES), None)

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """``fsdp_config.reshard_after_forward``, else false for the ZeRO-2 strategies and true otherwise."""
        if self.fsdp_config.reshard_after_forward is not None:
            return self.fsdp_config.reshard_after_forward
        return self.fsdp_strategy not in ("shard_grad_op", "hybrid_shard_zero2")

    @property
    def fsdp_cpu_offload(self) -> bool:
        """``fsdp_config.cpu_offload``, else whether ``fsdp`` names ``offload``."""
        if self.fsdp_config.cpu_offload is not None:
            return self.fsdp_config.cpu_offload
        return "offload" in self.fsdp

    @property
    def activation_checkpointing(self) -> bool:
        """Recompute activations in the backward: under FSDP ``fsdp_config.activation_checkpointing`` when set,
        else ``gradient_checkpointing`` (on unless ``disable_gradient_checkpointing``, as in LLaMA-Factory)."""
        if self.fsdp and self.fsdp_config.activation_checkpointing is not None:
            return self.fsdp_config.activation_checkpointing
        return bool(self.gradient_checkpointing)

    @property
    def attn_implementation(self) -> str | None:
        """``attn_implementation`` for ``from_pretrained`` (None = transformers' default) from ``flash_attn``."""
        return {
            "auto": None,
            "disabled": "eager",
            "eager": "eager",
            "sdpa": "sdpa",
            "fa2": "flash_attention_2",
            "fa3": "flash_attention_3",
            "varlen": "sdpa",  # loaded so; the recipe then switches to trainer.varlen's function
        }[self.flash_attn]

    def resolved_dict(self) -> dict[str, Any]:
        """Every key with its resolved value as plain YAML-safe types (lists, str, int, float, bool, None), in
        declaration order: what ``output_dir/train_config.yaml`` holds and ``--dry-run`` prints."""
        return self.model_dump(mode="json")

    @classmethod
    def key_help(cls) -> list[tuple[str, str, str]]:
        """``(key, default, description)`` for every key in declaration order ("required" when no default)."""
        rows = []
        for name, field in cls.model_fields.items():
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                value = field.get_default(call_default_factory=True)
                default = repr(value.model_dump() if isinstance(value, BaseModel) else value)
            else:
                default = repr(field.default)
            description = field.description or ""
            if name in IGNORED_KEYS:
                description = f"IGNORED by ferry ({IGNORED_KEYS[name]}). {description}"
            rows.append((name, default, description))
        return rows

    @classmethod
    def key_limits(cls) -> dict[str, str]:
        """``{key: its limits or choices}`` for the keys that have any, as ``ferry train --keys`` shows them:
        ``> 0``, ``>= 0, < 1``, ``one of: sft, pt``, ``-1, or > 0``; a key that may be left unset says
        ``or null``. Keys that take any value of their type (free text, flags) are left out."""
        return {name: text for name, field in cls.model_fields.items() if (text := _limits_text(field))}


def _limits_text(field: FieldInfo) -> str:
    """A key's limits in words, from its ``Field(gt=, ge=, lt=, le=)`` bounds, its ``Literal`` choices, or the
    ``limits`` text of a key whose validator checks more than those can say."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("limits"):
        return str(extra["limits"])
    signs = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata for attr, sign in signs if hasattr(m, attr)]
    members = typing.get_args(field.annotation) if typing.get_origin(field.annotation) in _UNION_TYPES else ()
    choices: list[str] = []
    for member in members or (field.annotation,):
        if typing.get_origin(member) is Literal:
            choices += [str(c) for c in typing.get_args(member)]
        elif member is bool and any(typing.get_origin(m) is Literal for m in members):  # padding_free
            choices += ["true", "false"]
    text = ", ".join(bounds) if bounds else (f"one of: {', '.join(choices)}" if choices else "")
    if text and type(None) in members:
        text += ", or null"
    return text


# ---------------------------------------------------------------------- LLaMA-Factory semantics

#: Keys ferry accepts (LLaMA-Factory YAMLs carry them) but does not act on, with the reason. ``ferry train --keys``
#: marks them; :func:`load_config` warns once per process when one is set to a non-default value.
IGNORED_KEYS: dict[str, str] = {
    "do_eval": "ferry evaluates whenever there is eval data (val_size or eval_dataset); only do_predict reads it",
    "preprocessing_num_workers": "ferry tokenises once, in the launching process",
    "use_reentrant_gc": "ferry's gradient checkpointing is always non-reentrant (the same gradients; PyTorch's "
    "recommended form)",
}

_warned_keys: set[str] = set()


def warn_ignored_keys(cfg: TrainConfig, set_keys: Sequence[str]) -> list[str]:
    """Log one warning per process for each key of :data:`IGNORED_KEYS` that the user set to a non-default
    value; returns the keys warned about now."""
    import logging

    warned = []
    for key in set_keys:
        if key in IGNORED_KEYS and key not in _warned_keys:
            field = TrainConfig.model_fields[key]
            default = (
                field.get_default(call_default_factory=True) if field.default_factory is not None else field.default
            )
            if getattr(cfg, key) != default:
                logging.getLogger("ferry.trainer.config").warning(
                    "%s: %r is accepted for LLaMA-Factory YAML but ignored: %s",
                    key,
                    getattr(cfg, key),
                    IGNORED_KEYS[key],
                )
                _warned_keys.add(key)
                warned.append(key)
    return warned


def attention_fallback(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """LLaMA-Factory's flash-attention fallback, decided once in the launcher: ``flash_attn: fa2`` (``fa3``)
    without the ``flash_attn`` (``flash_attn_interface``) package becomes ``sdpa`` with a warning (LLaMA-Factory
    warns and falls back too) instead of failing in every worker. Returns ``(config, warning or None)``."""
    import importlib.util

    module = {"fa2": "flash_attn", "fa3": "flash_attn_interface"}.get(cfg.flash_attn)
    if module is None or importlib.util.find_spec(module) is not None:
        return cfg, None
    message = (
        f"flash_attn: {cfg.flash_attn} needs the {module} package, which is not installed: using sdpa "
        f"(PyTorch's scaled-dot-product attention) instead, as LLaMA-Factory does"
    )
    return cfg.model_copy(update={"flash_attn": "sdpa"}), message


def tokenize_only(cfg: TrainConfig) -> bool:
    """LLaMA-Factory's ``tokenized_path``: True when the folder does not exist yet, so that the launcher
    tokenises into it and stops (the next run, finding it, trains from it); also with ``do_train: false``."""
    return cfg.tokenized_path is not None and (
        (not cfg.do_train and not cfg.do_predict) or not Path(cfg.tokenized_path).exists()
    )


# ---------------------------------------------------------------------- loading


def _key_lines(text: str) -> dict[str, int]:
    """1-based line of each top-level key of a YAML mapping (empty when the text is not a mapping)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def _parse_override(item: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> ``(key, value)`` with VALUE parsed as a YAML scalar (``8`` int, ``true`` bool,
    ``1e-4`` float, ``a,b`` string)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    # PyYAML (YAML 1.1) reads 1e-4 as the string "1e-4"; pydantic's lax mode turns it into a float.
    return key, value


def load_config(
    path: str | os.PathLike | None, overrides: Sequence[str] = (), *, accelerate: Any = None
) -> TrainConfig:
    """Read a YAML config and apply ``KEY=VALUE`` overrides (later ones win).

    Args:
        path: a YAML file holding one mapping, or None to build the config from overrides alone.
        overrides: ``KEY=VALUE`` strings; each VALUE is parsed as a YAML scalar.
        accelerate: a :class:`trainer.accelerate_config.AccelerateLaunch` (``ferry train --accelerate-config``):
            its keys (``fsdp``, ``fsdp_config``) go on top of the YAML, below the overrides.

    Returns:
        The validated :class:`TrainConfig`.

    Raises:
        ConfigError: the file is missing or not a YAML mapping; a key is unknown (the message names the nearest
            valid key); a value has the wrong type or is out of range (the message names the key and where it
            was set: ``FILE:LINE`` or ``override KEY=VALUE``).
    """
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        file = Path(path)
        text = read_config_text(file)
        loaded = parse_yaml_mapping(text, file)
        lines = _key_lines(text)
        for key, value in loaded.items():
            data[str(key)] = value
            origin[str(key)] = f"{file}:{lines[key]}" if key in lines else str(file)
    if accelerate is not None:
        from trainer.accelerate_config import apply_accelerate_keys

        apply_accelerate_keys(data, origin, accelerate)
    for item in overrides:
        key, value = _parse_override(item)
        data[key] = value
        origin[key] = f"override {item}"
    cfg = _validate(data, origin, source=str(path) if path is not None else None)
    warn_ignored_keys(cfg, list(data))
    cfg, warning = attention_fallback(cfg)
    if warning:
        import logging

        logging.getLogger("ferry.trainer.config").warning("%s", warning)
    return cfg


def _validate(data: dict[str, Any], origin: Mapping[str, str], source: str | None = None) -> TrainConfig:
    """Build a TrainConfig, translating pydantic's errors into one ConfigError naming key and origin (a missing
    key: the config file ``source``, when there is one)."""
    from trainer.lf_compat import answer_lf_keys, translate_lf_keys

    translate_lf_keys(data, origin)  # deepspeed -> fsdp; LLaMA-Factory features ferry does not run
    answer_lf_keys(data, origin, TrainConfig.model_fields)  # LLaMA-Factory's other keys: at its default, or refused
    fields = list(TrainConfig.model_fields)
    unknown = [k for k in data if k not in TrainConfig.model_fields]
    if unknown:
        msgs = []
        for key in unknown:
            near = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            msgs.append(f"{origin.get(key, 'config')}: unknown key {key!r}{hint}")
        raise ConfigError("; ".join(msgs))
    try:
        return TrainConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, data, origin, source)) from None


def _describe(
    exc: ValidationError, data: Mapping[str, Any], origin: Mapping[str, str], source: str | None = None
) -> str:
    msgs = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        key = str(loc[0]) if loc else ""
        if err["type"] == "missing":
            msgs.append(f"{source + ': ' if source else ''}missing required key {key!r}")
            continue
        if key and key in TrainConfig.model_fields:
            where = origin.get(key, "config")
            text = str(err["msg"]).removeprefix("Value error, ")
            if len(loc) > 1:  # a nested key such as fsdp_config.cpu_offload
                text = f"{'.'.join(str(part) for part in loc[1:])}: {text}"
            msgs.append(f"{where}: key {key!r}: {text} (got {data.get(key)!r})")
            continue
        # model-level validator: its message already starts with "key: ..."
        text = str(err.get("msg", "")).removeprefix("Value error, ")
        first = text.split(":", 1)[0]
        named = origin.get(first)
        msgs.append(f"{named}: {text}" if named else text)
    return "; ".join(msgs)


__all__ = [
    "FSDP_OPTIONS",
    "IGNORED_KEYS",
    "ComputeArgs",
    "DataArgs",
    "DistributedArgs",
    "FsdpConfig",
    "LlamaFactoryArgs",
    "LoraArgs",
    "ModelArgs",
    "OptimizerArgs",
    "OutputArgs",
    "PredictArgs",
    "QuantizationArgs",
    "StageArgs",
    "TrainConfig",
    "VocabArgs",
    "attention_fallback",
    "load_config",
    "tokenize_only",
    "warn_ignored_keys",
]
