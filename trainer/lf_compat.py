"""LLaMA-Factory's own example YAMLs in ferry.

What an example under LLaMA-Factory's ``examples/`` carries that is not a plain LoRA key lives here:

- :func:`translate_lf_keys` runs before validation: ``deepspeed: FILE`` becomes the equivalent FSDP2 strategy
  (ZeRO stage 3 -> ``full_shard``, 2 -> ``shard_grad_op``, an ``offload_*`` device ``cpu`` -> ``offload``, 0/1 ->
  DDP) with one logged line that says so; every LLaMA-Factory feature ferry does not run (full/freeze/OFT
  tuning, the PPO stage (and GRPO), Ray, other optimisers, multimodal media, LLaMA Pro, mixture-of-depths, fp8, ...)
  is refused in ONE :class:`ferry.errors.ConfigError` line naming the feature and ferry's nearest equivalent.
- :func:`stack_adapters`: ``adapter_name_or_path`` as LLaMA-Factory defines it (``llamafactory.model.adapter``):
  when training without ``create_new_adapter``, every adapter but the last is merged into the base and the last
  one is trained further; with ``create_new_adapter`` all are merged and a new LoRA is drawn.
- :func:`torch_optimizer`: transformers' ``optim`` names (AdamW, SGD) as torch optimizer classes.
- :func:`loraplus_optimizer`: peft's LoRA+ optimizer (``peft.optimizers.create_loraplus_optimizer``; Hayou et
  al. 2024, "LoRA+: Efficient Low Rank Adaptation of Large Models": the B matrices learn ``loraplus_lr_ratio``
  times faster than the A matrices).
- :func:`pissa_init_weights`, :func:`save_pissa_initial`, :func:`pissa_save_kwargs`: peft's PiSSA
  initialisation (Meng et al. 2024: A and B from the top singular vectors of W, the base keeps the residual) and
  its conversion to a plain LoRA adapter (rank 2r) that applies to the ORIGINAL base, so that ``ferry export``'s
  streaming merge and every serving stack read it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError
from ferry.lf_keys import lf_keys

_log = logging.getLogger("ferry.trainer.config")

#: Folder under output_dir holding the PiSSA adapter as initialised (the reference of the conversion).
PISSA_INIT_DIR = "pissa_init"

_ADAPTER_HINT = "ferry trains LoRA adapters (finetuning_type: lora, lora_target: all is the closest to it)"
_OPTIM_HINT = (
    "ferry's optimizers are AdamW (optim: adamw_torch; LoRA+ through loraplus_lr_ratio) and plain SGD (optim: sgd)"
)

#: transformers' ``optim`` names ferry runs (:func:`torch_optimizer`).
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")

#: key -> the one-line message: it names LLaMA-Factory's feature and ferry's nearest equivalent. A key whose value
#: is the feature's "off" value (false, None, 0) is accepted and dropped.
_REFUSED: dict[str, str] = {
    "use_ray": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N` (torchrun's rendezvous)",
    "ray_run_name": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N` (torchrun's rendezvous)",
    "ray_storage_path": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N`",
    "ray_num_workers": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N` (torchrun's rendezvous)",
    "resources_per_worker": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N`",
    "placement_strategy": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N`",
    "ray_init_kwargs": "LLaMA-Factory's Ray launcher; span hosts with `ferry train --nnodes N`",
    "use_galore": f"GaLore (LLaMA-Factory's low-rank gradient optimizer); {_OPTIM_HINT}",
    "use_apollo": f"APOLLO (LLaMA-Factory's optimizer); {_OPTIM_HINT}",
    "use_badam": f"BAdam (LLaMA-Factory's block-coordinate optimizer); {_OPTIM_HINT}",
    "use_adam_mini": f"Adam-mini (LLaMA-Factory's optimizer); {_OPTIM_HINT}",
    "use_muon": f"Muon (LLaMA-Factory's optimizer); {_OPTIM_HINT}",
    "use_llama_pro": f"LLaMA Pro (block expansion, LLaMA-Factory's freeze tuning); {_ADAPTER_HINT}",
    "freeze_trainable_layers": f"freeze tuning (LLaMA-Factory's finetuning_type: freeze); {_ADAPTER_HINT}",
    "mixture_of_depths": f"mixture-of-depths (LLaMA-Factory's MoD conversion); {_ADAPTER_HINT}",
    "fp8": "fp8 training (LLaMA-Factory through accelerate/torchao); ferry trains in bf16 (bf16: true) or fp16",
    "use_dft_loss": "DFT loss (LLaMA-Factory's dynamic fine-tuning); ferry trains with token cross-entropy "
    "(stage: sft)",
    "use_asft_loss": "ASFT loss (LLaMA-Factory's anchored SFT); ferry trains with token cross-entropy (stage: sft)",
    "use_eaft_loss": "EAFT loss (LLaMA-Factory's entropy-adaptive SFT); ferry trains with token cross-entropy "
    "(stage: sft)",
    "oft_rank": f"OFT (LLaMA-Factory's orthogonal fine-tuning); {_ADAPTER_HINT}",
    "oft_block_size": f"OFT (LLaMA-Factory's orthogonal fine-tuning); {_ADAPTER_HINT}",
    "oft_target": f"OFT (LLaMA-Factory's orthogonal fine-tuning); {_ADAPTER_HINT}",
    "use_kt": "KTransformers (LLaMA-Factory's CPU/GPU hybrid MoE kernels); ferry trains MoE LoRA with peft "
    "(target_parameters) under DDP or FSDP",
    "kt_optimize_rule": "KTransformers (LLaMA-Factory's CPU/GPU hybrid MoE kernels); ferry trains MoE LoRA with "
    "peft (target_parameters) under DDP or FSDP",
    "shift_attn": "LongLoRA's shifted sparse attention (LLaMA-Factory's shift_attn); ferry trains with the model's "
    "own attention (flash_attn: sdpa, or fa2 on a GPU)",
    "use_unsloth": "Unsloth's patched kernels (LLaMA-Factory's use_unsloth); ferry trains with transformers' kernels "
    "(enable_liger_kernel: true for Liger's fused ones)",
    "use_unsloth_gc": "Unsloth's gradient checkpointing (LLaMA-Factory's use_unsloth_gc); ferry's is torch's "
    "non-reentrant form (on unless disable_gradient_checkpointing: true)",
    "streaming": "streaming datasets (LLaMA-Factory's streaming: an IterableDataset read as it trains); ferry "
    "tokenises the dataset once into its cache before the first step (max_samples reads fewer rows)",
    "export_dir": "LLaMA-Factory's merge YAML is for `ferry export`, not `ferry train`: run `ferry export "
    "--adapter OUTPUT_DIR --out DIR`",
    "moe_aux_loss_coef": "the MoE router's load-balancing loss (LLaMA-Factory sets router_aux_loss_coef and "
    "output_router_logits); ferry trains MoE models on the token loss alone",
    "model_max_length": "LLaMA-Factory derives it from cutoff_len and takes no such key (its parser refuses it): "
    "set cutoff_len, with rope_scaling to train past the model's context",
    "infer_backend": "LLaMA-Factory's inference YAML (llamafactory-cli chat); ferry trains with this command: "
    "serve the exported model (see SERVING.md)",
}

_VALUE_REFUSED: dict[str, dict[str, str]] = {
    "finetuning_type": {
        "full": f"full-parameter fine-tuning (LLaMA-Factory's finetuning_type: full); {_ADAPTER_HINT}",
        "freeze": f"freeze tuning (LLaMA-Factory's finetuning_type: freeze); {_ADAPTER_HINT}",
        "oft": f"OFT (LLaMA-Factory's finetuning_type: oft); {_ADAPTER_HINT}",
    },
    "stage": {
        "ppo": "PPO (LLaMA-Factory's stage: ppo) samples from the policy and scores with a reward model at every "
        "step; ferry runs stage sft, pt, dpo, kto and rm",
        "grpo": "GRPO (trl's online RL, not a LLaMA-Factory stage) samples from the policy and scores at every "
        "step; ferry runs stage sft, pt, dpo, kto and rm (dpo or kto for preference data)",
    },
    "optim": {},  # filled by _optim_message: any optimizer but AdamW
}

#: DeepSpeed ZeRO stage -> the FSDP2 strategy that shards the same state (stage 0/1: DDP).
ZERO_TO_FSDP = {3: "full_shard", 2: "shard_grad_op", 1: None, 0: None}


def _where(origin: Mapping[str, str], key: str) -> str:
    return origin.get(key, "config")


def zero_fsdp_options(stage: Any, devices: set[str], where: str) -> list[str]:
    """ferry's ``fsdp`` options for a ZeRO ``stage`` (0-3) whose parameter / optimizer offload devices are
    ``devices`` (lower-case DeepSpeed device names, ``"none"`` for no offload): :data:`ZERO_TO_FSDP`, plus
    ``offload`` for a ``cpu`` device when something is sharded. Shared by ``deepspeed: FILE`` and
    ``--accelerate-config`` files of ``distributed_type: DEEPSPEED``.

    Raises:
        ConfigError: ``where``, then a stage outside 0-3, or offload to NVMe (ZeRO-Infinity).
    """
    if stage not in ZERO_TO_FSDP:
        raise ConfigError(f"{where}: stage {stage!r} is not 0, 1, 2 or 3")
    if "nvme" in devices:
        raise ConfigError(
            f"{where}: ZeRO-Infinity NVMe offload has no FSDP equivalent; offload to cpu instead (FSDP CPU offload)"
        )
    strategy = ZERO_TO_FSDP[stage]
    options = [strategy] if strategy else []
    if options and "cpu" in devices:
        options.append("offload")
    return options


def deepspeed_fsdp(path: str | Path) -> tuple[list[str], str]:
    """The ``fsdp`` options equivalent to a DeepSpeed JSON config, and the one line that says so.

    Reads ``zero_optimization.stage`` (0-3) and the ``offload_param`` / ``offload_optimizer`` devices. Stage 3 ->
    ``["full_shard"]`` (weights, gradients and optimizer state sharded), 2 -> ``["shard_grad_op"]`` (weights kept
    gathered from forward to backward), 0/1 -> ``[]`` (DDP: ZeRO-1's optimizer-state sharding saves little for a
    LoRA adapter); a ``cpu`` offload device adds ``offload``.

    Raises:
        ConfigError: the file is missing, not JSON, or has a stage outside 0-3 or offload to NVMe.
    """
    file = Path(path)
    try:
        ds = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {str(file)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"DeepSpeed config {str(file)!r} is not a JSON file: {exc}") from None
    zero = ds.get("zero_optimization") or {} if isinstance(ds, dict) else {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    devices = {str((zero.get(k) or {}).get("device", "none")).lower() for k in ("offload_param", "offload_optimizer")}
    options = zero_fsdp_options(stage, devices, f"DeepSpeed config {str(file)!r}: zero_optimization")
    what = f"fsdp: {' '.join(options)}" if options else "DDP (no fsdp)"
    return options, (
        f"deepspeed: {file.name} (ZeRO stage {stage}{', CPU offload' if 'cpu' in devices else ''}) "
        f"runs as {what}, ferry's FSDP2 equivalent"
    )


def _is_lf_default(value: Any, spec: Mapping[str, Any] | None) -> bool:
    """Whether ``value`` is LLaMA-Factory's literal default of the key ``spec`` describes (:mod:`ferry.lf_keys`)."""
    if spec is None or not spec.get("literal"):
        return False
    default = spec.get("default")
    # a bool is an int to ``==``: ``true`` is no default of 1, nor ``0`` of false
    return value == default and isinstance(value, bool) == isinstance(default, bool)


#: LLaMA-Factory defaults the table cannot hold as literals (an enum member): the value a YAML spells them with.
_NON_LITERAL_DEFAULTS = {"infer_backend": "huggingface"}

#: LLaMA-Factory keys that change nothing ferry trains or writes (logging, loading speed, hub tokens; the audio
#: processing keys, as ferry refuses audio rows): any value is accepted with one warning line.
COSMETIC = frozenset(
    {"print_param_status", "include_effective_tokens_per_second", "low_cpu_mem_usage", "hf_hub_token",
     "ms_hub_token", "om_hub_token", "use_audio_in_video", "audio_sampling_rate"}
)  # fmt: skip


def answer_lf_keys(data: MutableMapping[str, Any], origin: Mapping[str, str], known: Any) -> list[str]:
    """LLaMA-Factory's own training keys (:func:`ferry.lf_keys.lf_keys`) that are no ferry key (``known``): at
    LLaMA-Factory's default they are dropped without a word (LlamaBoard's saved arguments carry every key); the
    keys of :data:`COSMETIC` at any value are dropped with one warning line each (returned); at any other value
    they are refused by name.

    Raises:
        ConfigError: one line for the first such key set to something but LLaMA-Factory's default, naming where,
            the key, its value, the part of LLaMA-Factory it belongs to and its default.
    """
    defaults = lf_keys("train")
    warnings: list[str] = []
    problems: list[str] = []
    for key in [k for k in data if k not in known and k in defaults]:
        spec, value = defaults[key], data[key]
        if _is_lf_default(value, spec) or (not spec["literal"] and value is None):
            del data[key]
        elif key in COSMETIC:
            del data[key]
            warnings.append(f"{_where(origin, key)}: {key}: LLaMA-Factory's {spec['class']} key changes nothing ferry "
                            "trains or writes; ignored")  # fmt: skip
        else:
            default = f"its default, {spec['default']!r}, is accepted" if spec["literal"] else "leave it out"
            problems.append(
                f"{_where(origin, key)}: {key}: {value!r}: a LLaMA-Factory feature ({spec['class']}) ferry does not "
                f"run; {default}"
            )
    if problems:
        raise ConfigError(problems[0] + (f" (and {len(problems) - 1} more such key(s))" if len(problems) > 1 else ""))
    for warning in warnings:
        _log.warning("%s", warning)
    return warnings


#: What ferry does with a LLaMA-Factory training key (:func:`lf_key_classes`).
LF_KEY_CLASSES = {
    "ferry": "a ferry key: used",
    "named": "refused at another value than its default, naming ferry's nearest equivalent",
    "cosmetic": "ignored at any value, with one warning line",
    "default-only": "accepted at its default; refused at another value",
}


def lf_key_classes(known: Any) -> dict[str, str]:
    """``{key: class}`` (:data:`LF_KEY_CLASSES`) for every key of LLaMA-Factory's training parser
    (:func:`ferry.lf_keys.lf_keys`), ``known`` being ferry's own keys: what :func:`translate_lf_keys` and
    :func:`answer_lf_keys` do with it."""
    classes = {}
    for key in lf_keys("train"):
        if key in known:
            classes[key] = "ferry"
        elif key in _REFUSED:
            classes[key] = "named"
        elif key in COSMETIC:
            classes[key] = "cosmetic"
        else:
            classes[key] = "default-only"
    return classes


def lf_keys_page(known: Any) -> str:
    """docs/llamafactory-keys.md: every LLaMA-Factory 0.9.5 training key, its part, its default and its class
    (:func:`lf_key_classes`), as a Markdown table."""
    from ferry.lf_keys import lf_version

    lines = [
        "# LLaMA-Factory's keys in ferry",
        "",
        f"Every key of LLaMA-Factory {lf_version()}'s training parser of its own (transformers' training arguments",
        "are not listed: ferry takes the ones it runs under the same names), read from its source into",
        "`ferry/lf_keys.json`, and what `ferry train` does with it. Made by `python -m tests.golden.make_lf_keys",
        "--page > docs/llamafactory-keys.md`; a test keeps it so. See [llamafactory.md](llamafactory.md) for what",
        "carries over.",
        "",
        *(f"- **{name}**: {meaning}" for name, meaning in LF_KEY_CLASSES.items()),
        "",
        "| key | LLaMA-Factory part | its default | ferry |",
        "|---|---|---|---|",
    ]
    classes = lf_key_classes(known)
    for key, spec in lf_keys("train").items():
        default = f"`{json.dumps(spec['default'])}`" if spec["literal"] else "(computed)"
        lines.append(f"| `{key}` | {spec['class']} | {default} | {classes[key]} |")
    return "\n".join(lines) + "\n"


def translate_lf_keys(data: MutableMapping[str, Any], origin: Mapping[str, str]) -> list[str]:
    """Rewrite LLaMA-Factory keys ferry runs differently, before validation; refuse the features it does not run.

    ``deepspeed`` is replaced by the equivalent ``fsdp`` options (:func:`deepspeed_fsdp`); the note is logged and
    returned. ``do_predict: true`` without ``do_train`` and without ``dataset`` sets ``do_train: false``, as
    LLaMA-Factory (whose ``do_train`` defaults to false) runs such a YAML. A refused feature's key at its "off"
    value (false, null, 0, empty: LLaMA-Factory's default, as LlamaBoard's saved arguments carry it) is accepted and
    dropped without a word.

    Raises:
        ConfigError: ONE line for the first LLaMA-Factory feature ferry does not run, naming where it was set,
            the feature and ferry's nearest equivalent.
    """
    notes: list[str] = []
    problems: list[str] = []
    for key, table in _VALUE_REFUSED.items():
        value = data.get(key)
        if not isinstance(value, str):
            continue
        if key == "optim" and value not in OPTIMIZERS:
            problems.append(
                f"{_where(origin, key)}: optim: {value} ({'LLaMA-Factory/transformers optimizer'}); {_OPTIM_HINT}"
            )
        elif value in table:
            problems.append(f"{_where(origin, key)}: {key}: {value}: {table[value]}")
    defaults = lf_keys("train")
    for key, message in _REFUSED.items():
        if key not in data:
            continue
        off = data[key] in (None, False, 0, "", [], {}) or data[key] == _NON_LITERAL_DEFAULTS.get(key)
        if off or _is_lf_default(data[key], defaults.get(key)):
            del data[key]  # the feature's "off" value or LLaMA-Factory's default, as LlamaBoard writes it: accepted
        else:
            problems.append(f"{_where(origin, key)}: {key}: {message}")
    if data.get("do_predict") is True and "do_train" not in data and not data.get("dataset"):
        # LLaMA-Factory's do_train defaults to false (transformers' TrainingArguments): a prediction YAML with no
        # training data (examples/extras/nlg_eval) only predicts. ferry's default stays true otherwise.
        data["do_train"] = False
    if "deepspeed" in data:
        value = data.pop("deepspeed")
        if value not in (None, False, ""):
            if data.get("fsdp"):
                problems.append(f"{_where(origin, 'deepspeed')}: deepspeed and fsdp are both set; keep one")
            else:
                options, note = deepspeed_fsdp(str(value))
                data["fsdp"] = options
                notes.append(note)
    if problems:
        raise ConfigError(problems[0] + (f" (and {len(problems) - 1} more such key(s))" if len(problems) > 1 else ""))
    for note in notes:
        _log.warning("%s", note)
    return notes


# ---------------------------------------------------------------------- adapters


def stack_adapters(
    model: Any, adapters: list[str], *, create_new_adapter: bool, trainable: bool = True
) -> tuple[Any, Any]:
    """Apply ``adapter_name_or_path`` to a loaded base model as LLaMA-Factory does.

    Training without ``create_new_adapter``: every adapter but the last is merged into the base weights (peft's
    ``merge_and_unload``), the last is loaded trainable and training continues it (its rank, targets and alpha
    come from its adapter_config.json, not from the YAML). With ``create_new_adapter`` (or ``trainable=False``)
    every adapter is merged and ``None`` is returned for the adapter to continue.

    Returns:
        ``(model, peft_model or None)``: the (merged) base, and the ``peft.PeftModel`` to train when one was
        continued.

    Raises:
        ConfigError: a path holds no adapter.
    """
    from ferry.adapter_folder import adapter_folder
    from trainer.peft_build import load_peft_adapter

    dirs = [adapter_folder(p) for p in adapters]
    to_merge, resume = (dirs[:-1], dirs[-1]) if trainable and not create_new_adapter else (dirs, None)
    for folder in to_merge:
        model = load_peft_adapter(model, str(folder)).merge_and_unload()
    if resume is None:
        return model, None
    return model, load_peft_adapter(model, str(resume), is_trainable=True)


def continued_lora_config(cfg: Any) -> Any:
    """The ``peft.LoraConfig`` of the adapter ``adapter_name_or_path`` continues (its last entry): its own rank,
    alpha and targets, which win over the YAML's (for ``--dry-run``'s parameter count on the meta device)."""
    from peft import PeftConfig

    from ferry.adapter_folder import adapter_folder

    config = PeftConfig.from_pretrained(str(adapter_folder(cfg.adapter_name_or_path[-1])))
    config.inference_mode = False  # saved adapters record inference mode; this one is trained
    return config


def write_base_record(cfg: Any, folder: Path) -> None:
    """Record in the saved adapter ``folder`` the adapters merged into its base (``ferry.adapter_folder.STACK_RECORD``)
    so that ``ferry export`` refuses to apply it to the bare base: every adapter with ``create_new_adapter``, all
    but the last otherwise, plus what the continued adapter itself was trained on."""
    from ferry.adapter_folder import adapter_folder, merged_chain, read_stack_record, write_stack_record

    if not cfg.adapter_name_or_path:
        return
    dirs = [adapter_folder(p) for p in cfg.adapter_name_or_path]
    chain = merged_chain(dirs) if cfg.create_new_adapter else merged_chain(dirs[:-1]) + read_stack_record(dirs[-1])
    write_stack_record(folder, chain)


def refuse_under_fsdp(cfg: Any) -> None:
    """FSDP builds the model on the meta device and reads only each rank's rows: adapters to merge or continue
    and PiSSA's SVD of the full weights need the whole model on each rank.

    Raises:
        ConfigError: ``adapter_name_or_path`` or ``pissa_init`` with fsdp (also from a DeepSpeed config).
    """
    for key in ("adapter_name_or_path", "pissa_init"):
        if getattr(cfg, key):
            raise ConfigError(
                f"{key} is not supported with fsdp (ZeRO/FSDP sharding): it needs the whole model on "
                f"every rank; train under DDP (no fsdp / deepspeed key)"
            )


# ---------------------------------------------------------------------- LoRA+ and PiSSA


def torch_optimizer(cfg: Any, *, fused: bool) -> tuple[type, dict[str, Any]]:
    """The torch optimizer class and its keyword arguments (besides ``params``, ``lr`` and ``weight_decay``) for
    ``cfg.optim``, as transformers' Trainer maps its OptimizerNames: ``adamw_torch`` / ``adamw_torch_fused`` ->
    ``torch.optim.AdamW(betas=(adam_beta1, adam_beta2), eps=adam_epsilon)``; ``sgd`` -> ``torch.optim.SGD`` with
    its defaults (momentum 0: the optimizer keeps no state). ``fused``: torch's fused kernel (CUDA only)."""
    import torch

    if cfg.optim == "sgd":
        return torch.optim.SGD, {"fused": fused} if fused else {}
    return torch.optim.AdamW, {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon, "fused": fused}


def loraplus_optimizer(peft_model: Any, cfg: Any, *, fused: bool) -> Any:
    """peft's LoRA+ optimizer (``cfg.optim``'s class, :func:`torch_optimizer`): B matrices at
    ``learning_rate * loraplus_lr_ratio``, embedding LoRA at ``loraplus_lr_embedding``, the rest at
    ``learning_rate`` (``peft.optimizers.create_loraplus_optimizer``)."""
    from peft.optimizers import create_loraplus_optimizer

    optimizer_cls, kwargs = torch_optimizer(cfg, fused=fused)
    return create_loraplus_optimizer(
        model=peft_model,
        optimizer_cls=optimizer_cls,
        lr=cfg.learning_rate,
        loraplus_lr_ratio=cfg.loraplus_lr_ratio,
        loraplus_lr_embedding=cfg.loraplus_lr_embedding,
        weight_decay=cfg.weight_decay,
        **kwargs,
    )


def pissa_init_weights(cfg: Any) -> str:
    """peft's ``init_lora_weights`` for ``pissa_init``: ``"pissa"`` (full SVD) when ``pissa_iter`` is -1, else
    ``"pissa_niter_{pissa_iter}"`` (fast randomized SVD with that many subspace iterations), as LLaMA-Factory."""
    return "pissa" if cfg.pissa_iter == -1 else f"pissa_niter_{cfg.pissa_iter}"


def save_pissa_initial(peft_model: Any, output_dir: Path) -> Path:
    """Write the PiSSA adapter as initialised to ``output_dir/pissa_init`` (atomically; rank 0), with
    ``init_lora_weights: true`` so that loading it back does not run the SVD again (as LLaMA-Factory does)."""
    from ferry.fsutil import atomic_directory

    config = peft_model.peft_config["default"]
    init, config.init_lora_weights = config.init_lora_weights, True
    try:
        with atomic_directory(output_dir / PISSA_INIT_DIR, overwrite=True) as tmp:
            peft_model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False)
    finally:
        config.init_lora_weights = init
    return output_dir / PISSA_INIT_DIR


def pissa_save_kwargs(cfg: Any, output_dir: Path) -> dict[str, Any]:
    """Extra ``save_pretrained`` arguments of the final adapter: with ``pissa_convert`` peft writes the trained
    PiSSA adapter as a plain LoRA of rank 2r against the original base
    (``path_initial_model_for_weight_conversion``)."""
    if cfg.pissa_init and cfg.pissa_convert:
        return {"path_initial_model_for_weight_conversion": str(output_dir / PISSA_INIT_DIR)}
    return {}


__all__ = [
    "COSMETIC",
    "LF_KEY_CLASSES",
    "OPTIMIZERS",
    "PISSA_INIT_DIR",
    "ZERO_TO_FSDP",
    "answer_lf_keys",
    "continued_lora_config",
    "deepspeed_fsdp",
    "lf_key_classes",
    "lf_keys_page",
    "loraplus_optimizer",
    "pissa_init_weights",
    "pissa_save_kwargs",
    "refuse_under_fsdp",
    "save_pissa_initial",
    "stack_adapters",
    "torch_optimizer",
    "translate_lf_keys",
    "write_base_record",
    "zero_fsdp_options",
]
