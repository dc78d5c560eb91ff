"""LoRA target resolution: what ``lora_target`` (``all`` or LLaMA-Factory's module names) adapts in a real model.

peft 0.21 and transformers 5 make this less simple than matching names:

* **Fused MoE experts.** transformers 5 stores the experts of Qwen3-MoE, Mixtral, DeepSeek-V3 ... as 3-D
  parameters (``mlp.experts.gate_up_proj [E, 2I, H]``), not ``nn.Linear`` modules. peft adapts them through
  ``target_parameters``, and when it is given LLaMA-Factory's names (``gate_proj``/``up_proj``/``down_proj``,
  ``w1``/``w2``/``w3``) it rewrites them into those parameters (``peft.utils.transformers_weight_conversion``),
  *removing the names from target_modules*: the dense MLPs that carry the same names (DeepSeek-V3's first layers,
  its shared experts, Qwen3-MoE's ``mlp_only_layers``) then get no LoRA at all. Here the experts are named by their
  full parameter names and the same-named dense layers by their ``weight`` parameters, so peft's rewrite finds
  nothing to change, at training time and when the adapter is loaded again (by peft or by ``ferry export``).
* **Conv1D.** GPT-2 style ``Conv1D`` layers count as linear layers for ``all``, as peft's ``all-linear``.
* **Vision-language models.** ``all`` leaves the vision tower and the multi-modal projector frozen by default
  (``freeze_vision_tower`` / ``freeze_multi_modal_projector``, LLaMA-Factory's defaults); ``freeze_language_model``
  leaves the language model frozen (with ``freeze_vision_tower: false``: LoRA on the vision tower alone).

:func:`resolve_lora_targets` returns the peft arguments and the list of adapted modules, grouped by kind for
``--dry-run``, plus what ``all`` leaves out, in words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainer.config import TrainConfig

#: Module-name components of a vision tower / multi-modal projector (transformers' VLM classes).
VISION_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder", "vision")
PROJECTOR_NAMES = ("multi_modal_projector", "mm_projector", "merger", "connector", "aligner")
#: Module-name components of a VLM's language model (transformers 5's composite classes: ``model.language_model``).
LANGUAGE_NAMES = ("language_model",)
HEAD_NAMES = ("lm_head", "output_layer", "embed_out")
#: peft's wrappers in parameter names: the prefix of a PeftModel, and the infixes its layers add to a base
#: module's name (what the checkpoint of the base model calls the tensor is the name without them).
#: The peft release with ``peft.utils.transformers_weight_conversion`` (peft 0.19), which rewrites LoRA targets for
#: the layouts transformers 5 converts on load (fused MoE experts, renamed VLM and hub checkpoints). Other models
#: train on pyproject.toml's floor.
PEFT_CONVERSION = "0.19"
PEFT_PREFIX = "base_model.model."
PEFT_INFIXES = (".base_layer", ".original_module", ".modules_to_save.default")

_KINDS = (
    ("embeddings", re.compile(r"(^|\.)(embed\w*|wte|wpe|word_embeddings)(\.|$)")),
    (
        "attention",
        re.compile(
            r"(^|\.)(\w*attn\w*|\w*attention\w*|query_key_value|[qkvo]_proj|q_a_proj|q_b_proj|"
            r"kv_a_proj_with_mqa|kv_b_proj|qkv_proj|c_attn|in_proj_\w+|out_proj)(\.|$)"
        ),
    ),
)


@dataclass
class RenamedOnLoad:
    """Stored (checkpoint) tensor names against run-time parameter names, as ``from_pretrained`` renames them
    (:func:`renamed_on_load`). ``stored_of``: run-time name -> stored name of a tensor loaded one to one;
    ``groups``: run-time name of a fused parameter -> the stored names it is built from; ``shapes``: the run-time
    shapes; ``converters`` / ``renamings``: transformers' conversion list for the model, split by kind."""

    stored_of: dict[str, str] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    converters: list[Any] = field(default_factory=list)
    renamings: list[Any] = field(default_factory=list)


def renamed_on_load(model: Any, stored: list[str]) -> RenamedOnLoad:
    """Rename every stored tensor name as ``from_pretrained`` does for ``model`` (a meta-device model): transformers'
    conversion list for it (``get_model_conversion_mapping``) run forward with ``rename_source_key`` and the
    base-model prefix rule. Stored names that map to no run-time parameter (buffers, unused tensors) are left out.
    FSDP loading reads renamed checkpoints with it (Qwen2-VL's hub keys), the export reverses merges through it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    result = RenamedOnLoad(
        converters=converters, renamings=renamings, shapes={k: tuple(v.shape) for k, v in meta_state.items()}
    )
    for key in stored:
        runtime, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if runtime not in meta_state and key in meta_state:  # as from_pretrained: keep the name, fix the prefix
            runtime, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        if runtime not in meta_state:
            continue
        if pattern is not None:
            result.groups.setdefault(runtime, []).append(key)
        else:
            result.stored_of[runtime] = key
    return result


@dataclass
class Adapted:
    """One adapted module or parameter: its full name, kind (attention / mlp / experts / embeddings / other) and
    the LoRA parameters it adds (``r · (in + out)``, times the experts for a fused parameter)."""

    name: str
    kind: str
    lora_params: int


@dataclass
class LoraTargets:
    """peft arguments and what they adapt.

    ``target_modules``: module names for ``LoraConfig.target_modules`` (last components where that is exact,
    else full names); ``target_parameters``: full parameter names for ``LoraConfig.target_parameters``;
    ``rank_pattern`` / ``alpha_pattern``: peft's for fused parameters (LLaMA-Factory's gate+up pair fused into one
    ``gate_up_proj`` gets rank 2r, as peft's own conversion gives it); ``adapted``: every adapted module;
    ``left_out``: what ``all`` does not adapt, in words.
    """

    target_modules: list[str]
    target_parameters: list[str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    adapted: list[Adapted] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def grouped(self) -> dict[str, tuple[int, int]]:
        """``{kind: (modules, LoRA parameters)}`` in a fixed order."""
        out: dict[str, tuple[int, int]] = {}
        for kind in ("attention", "mlp", "experts", "embeddings", "other"):
            items = [a for a in self.adapted if a.kind == kind]
            if items:
                out[kind] = (len(items), sum(a.lora_params for a in items))
        return out

    def summary(self) -> str:
        """Lines for ``--dry-run``: adapted modules by kind with LoRA parameter counts, then what is left out."""
        lines = [f"  {kind:<11} {n:>5} modules  {p:>14,} LoRA params" for kind, (n, p) in self.grouped().items()]
        lines += [f"  left out:   {note}" for note in self.left_out]
        return "\n".join(lines)


def _is_linear(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def _in_out(module: torch.nn.Module) -> tuple[int, int]:
    weight = cast(torch.Tensor, module.weight)  # an nn.Linear's or a Conv1D's
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):  # weight [in, out]
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def _kind(name: str, fused: bool = False) -> str:
    if fused:
        return "experts"
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "mlp" if re.search(r"(mlp|ffn|feed_forward|fc\d|c_fc|c_proj|dense|_proj|w\d|expert)", name) else "other"


def _frozen_prefixes(
    model: torch.nn.Module,
    freeze_vision_tower: bool,
    freeze_multi_modal_projector: bool,
    freeze_language_model: bool = False,
) -> dict[str, str]:
    """``{module name: why}`` for the top-most vision-tower / projector / language-model modules that stay frozen.

    Raises:
        ConfigError: ``freeze_language_model`` on a model without a separate language model (a text model).
    """
    frozen: dict[str, str] = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        if any(name.startswith(p + ".") for p in frozen):
            continue
        if freeze_vision_tower and parts[-1] in VISION_NAMES:
            frozen[name] = "vision tower (freeze_vision_tower: true)"
        elif freeze_multi_modal_projector and parts[-1] in PROJECTOR_NAMES:
            frozen[name] = "multi-modal projector (freeze_multi_modal_projector: true)"
        elif freeze_language_model and parts[-1] in LANGUAGE_NAMES:
            frozen[name] = "language model (freeze_language_model: true)"
    if freeze_language_model and not any(why.startswith("language model") for why in frozen.values()):
        raise ConfigError(
            "freeze_language_model: true: this model has no language model apart from the rest (a text model, or "
            "a vision-language family loaded without its vision part): leave it false"
        )
    return frozen


def _peft_rewrite(model: torch.nn.Module, names: set[str], r: int, alpha: float) -> tuple[set[str], set[str], Any]:
    """What peft's transformers-5 MoE rewrite makes of ``target_modules=names`` for this model:
    ``(names it removes, parameter names it adds, the rewritten LoraConfig)``; ``(set(), set(), None)`` for a model
    type transformers keeps no checkpoint conversion for, where peft rewrites nothing (its own test,
    ``peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers``). That skips importing
    peft (seconds, bitsandbytes inside) in the launcher's pre-flight while the workers import beside it."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None or get_checkpoint_conversion_mapping(model_type) is None:
        return set(), set(), None
    from ferry.versions import require_version

    feature = f"lora_target on {model_type} (a layout transformers 5 converts on load, fused experts among them)"
    require_version("peft", PEFT_CONVERSION, feature, ConfigError)
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    trial = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; it takes a float (scaling = alpha / r)
        target_modules=sorted(names),  # a list, which LoraConfig turns into a set
    )
    try:
        convert_peft_config_for_transformers(trial, model=model, conversions=None)
    except ValueError as exc:  # e.g. gate_proj without up_proj: fused into one parameter
        raise ConfigError(f"lora_target: {exc}") from None
    kept = set(trial.target_modules or ())
    return set(names) - kept, set(trial.target_parameters or ()), trial


def resolve_lora_targets(
    model: PreTrainedModel,
    lora_target: list[str],
    *,
    r: int,
    lora_alpha: float,
    freeze_vision_tower: bool = True,
    freeze_multi_modal_projector: bool = True,
    freeze_language_model: bool = False,
) -> LoraTargets:
    """Resolve ``lora_target`` against ``model``'s real modules and parameters (a meta-device model is enough).

    Args:
        model: the transformers model, before peft wraps it.
        lora_target: ``["all"]`` or module names (last components, as LLaMA-Factory's ``lora_target``).
        r, lora_alpha: the LoRA rank and alpha (for parameter counts and fused rank patterns).
        freeze_vision_tower, freeze_multi_modal_projector, freeze_language_model: leave these parts of a VLM
            frozen, for ``all`` and for named targets alike (LLaMA-Factory's ``patch_target_modules``).

    Returns:
        :class:`LoraTargets`.

    Raises:
        ConfigError: a named target matches nothing in the model (the message lists the names it has), or
            nothing at all is adapted.
    """
    every = lora_target == ["all"]
    # as LLaMA-Factory: the frozen parts stay frozen for explicit names too (a vision tower has q_proj as well)
    frozen = _frozen_prefixes(model, freeze_vision_tower, freeze_multi_modal_projector, freeze_language_model)
    linear, frozen_count = _linear_layers(model, frozen)
    short_names = {n.split(".")[-1] for n in linear}
    wanted = short_names if every else set(lora_target)
    removed, fused_names, trial = _peft_rewrite(model, wanted, r, lora_alpha)
    fused = _fused_experts(model, frozen, fused_names, every)
    modules = {n: m for n, m in linear.items() if n.split(".")[-1] in wanted}
    if not every:
        _check_named(wanted, short_names, removed, fused)
    as_params = sorted(n for n in modules if n.split(".")[-1] in removed)  # peft would rewrite these names
    by_module = sorted(n for n in modules if n.split(".")[-1] not in removed)
    target_parameters = sorted([f"{n}.weight" for n in as_params] + list(fused))
    rank_pattern, alpha_pattern = _fused_patterns(model, trial, wanted, fused, every, r, lora_alpha)
    adapted = _adapted(modules, fused, rank_pattern, r)
    if not adapted:
        raise ConfigError(f"lora_target: {','.join(lora_target)} adapts nothing in this model")
    return LoraTargets(
        _target_modules(model, by_module),
        target_parameters,
        rank_pattern,
        alpha_pattern,
        adapted,
        _left_out(model, frozen_count, every),
    )


def _frozen_by(frozen: dict[str, str], name: str) -> str | None:
    """Why the module ``name`` stays frozen (it is, or lies under, a :func:`_frozen_prefixes` module), or None."""
    return next((why for p, why in frozen.items() if name == p or name.startswith(p + ".")), None)


def _linear_layers(model: PreTrainedModel, frozen: dict[str, str]) -> tuple[dict[str, torch.nn.Module], dict[str, int]]:
    """``(linear layers by full name, frozen linear layers counted by why)``: every ``nn.Linear`` / ``Conv1D``
    except the output head, split into those LoRA may adapt and those a frozen part holds."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear: dict[str, torch.nn.Module] = {}
    frozen_count: dict[str, int] = {}
    for name, module in model.named_modules():
        if not _is_linear(module) or module is head or name.split(".")[-1] in HEAD_NAMES:
            continue
        why = _frozen_by(frozen, name)
        if why:
            frozen_count[why] = frozen_count.get(why, 0) + 1
            continue
        linear[name] = module
    return linear, frozen_count


def _fused_experts(
    model: torch.nn.Module, frozen: dict[str, str], fused_names: set[str], every: bool
) -> dict[str, torch.nn.Parameter]:
    """Fused 3-D expert parameters by full name: with ``all`` (``every``) every one outside frozen parts; with
    names, those peft's rewrite maps them to (``fused_names``)."""
    fused: dict[str, torch.nn.Parameter] = {}
    for mname, module in model.named_modules():
        if _frozen_by(frozen, mname):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.ndim != 3 or "expert" not in (mname + type(module).__name__).lower():
                continue
            full = f"{mname}.{pname}"
            if every or pname in fused_names or any(full.endswith("." + f) for f in fused_names):
                fused[full] = param
    return fused


def _check_named(wanted: set[str], short_names: set[str], removed: set[str], fused: dict[str, Any]) -> None:
    """Every name of an explicit ``lora_target`` matches a linear layer (or a name peft rewrites).

    Raises:
        ConfigError: naming the unmatched names and the ones the model has.
    """
    known = short_names | {n.split(".")[-1] for n in fused}
    unknown = sorted(t for t in wanted if t not in short_names and t not in removed)
    if unknown:
        raise ConfigError(
            f"lora_target: {', '.join(unknown)} matches no linear layer of the model; it has "
            f"{', '.join(sorted(known)) or 'none'} (or use lora_target: all)"
        )


def _target_modules(model: torch.nn.Module, by_module: list[str]) -> list[str]:
    """``target_modules``: a last component alone where it selects exactly the chosen modules, else full names."""
    every: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        every.setdefault(name.split(".")[-1], []).append(name)
    chosen = set(by_module)
    target_modules: list[str] = []
    for short in sorted({n.split(".")[-1] for n in by_module}):
        names = every[short]
        target_modules += [short] if all(n in chosen for n in names) else sorted(n for n in names if n in chosen)
    return target_modules


def _fused_patterns(
    model: torch.nn.Module,
    trial: Any,
    wanted: set[str],
    fused: dict[str, Any],
    every: bool,
    r: int,
    lora_alpha: float,
) -> tuple[dict[str, int], dict[str, float]]:
    """peft's ``(rank_pattern, alpha_pattern)`` from its rewrite (``trial``); with ``all`` over fused experts,
    the same fused rank peft gives LLaMA-Factory's names (gate+up fused into one parameter: rank 2r)."""
    rank_pattern = {k: int(v) for k, v in ((trial and trial.rank_pattern) or {}).items()}
    alpha_pattern = {k: float(v) for k, v in ((trial and trial.alpha_pattern) or {}).items()}
    if every and fused:
        _, _, full = _peft_rewrite(model, wanted | {"gate_proj", "up_proj", "w1", "w3"}, r, lora_alpha)
        rank_pattern.update({k: int(v) for k, v in ((full and full.rank_pattern) or {}).items()})
        alpha_pattern.update({k: float(v) for k, v in ((full and full.alpha_pattern) or {}).items()})
    return rank_pattern, alpha_pattern


def _adapted(
    modules: dict[str, torch.nn.Module], fused: dict[str, torch.nn.Parameter], rank_pattern: dict[str, int], r: int
) -> list[Adapted]:
    """Every adapted module and fused parameter with its LoRA parameter count: ``r * (in + out)`` for a layer,
    ``rank * experts * (a + b)`` for a fused ``[experts, a, b]`` parameter at its pattern's rank."""

    def rank_of(name: str) -> int:  # peft's rule: a key matches the name's end at a dot boundary, first wins
        key = next((k for k in rank_pattern if re.match(rf"(.*\.)?({k})$", name)), None)
        return int(rank_pattern[key]) if key is not None else r

    adapted = [Adapted(n, _kind(n), r * sum(_in_out(modules[n]))) for n in sorted(modules)]
    for name, param in fused.items():
        experts, a, b = param.shape
        adapted.append(Adapted(name, "experts", rank_of(name) * experts * (a + b)))
    return adapted


def _left_out(model: torch.nn.Module, frozen_count: dict[str, int], every: bool) -> list[str]:
    """What LoRA does not adapt, in words: the frozen parts' linear layers and, with ``all``, MoE routers."""
    left_out = [f"{why}: {n} linear layers" for why, n in frozen_count.items()]
    routers = sorted(
        {
            n.split(".")[-1]
            for n, m in model.named_modules()
            if "router" in type(m).__name__.lower() or n.endswith(".gate") and not _is_linear(m)
        }
    )
    if routers and every:
        left_out.append(f"MoE routers ({', '.join(routers)}): not linear layers")
    return left_out


# ---------------------------------------------------------------------- from a run's config


def _lora_alpha(cfg: TrainConfig) -> float:
    """``cfg.lora_alpha``, which config validation sets (None becomes ``2 * lora_rank``).

    Raises:
        ConfigError: the config skipped validation and still holds None.
    """
    if cfg.lora_alpha is None:
        raise ConfigError("lora_alpha: unset in a config that skipped validation (load it with load_config)")
    return cfg.lora_alpha


def lora_targets(cfg: TrainConfig, model: PreTrainedModel) -> Any:
    """``lora_target`` resolved against ``model`` (:func:`trainer.targets.resolve_lora_targets`): peft's
    target_modules / target_parameters / rank patterns and the adapted modules by kind.

    Raises:
        ConfigError: a target that matches nothing, or LoRA on parameters (fused experts) with dropout or DoRA,
            which peft cannot do.
    """
    targets = resolve_lora_targets(
        model,
        list(cfg.lora_target),
        r=cfg.lora_rank,
        lora_alpha=_lora_alpha(cfg),
        freeze_vision_tower=cfg.freeze_vision_tower,
        freeze_multi_modal_projector=cfg.freeze_multi_modal_projector,
        freeze_language_model=cfg.freeze_language_model,
    )
    if targets.target_parameters and (cfg.lora_dropout or cfg.use_dora):
        key = "lora_dropout" if cfg.lora_dropout else "use_dora"
        raise ConfigError(
            f"{key}: peft cannot apply it to LoRA on parameters ({len(targets.target_parameters)} here, e.g. "
            f"{targets.target_parameters[0]}: fused MoE experts or MLPs that share their names); set {key} off"
        )
    return targets


def lora_config_for(cfg: TrainConfig, model: PreTrainedModel, targets: Any = None) -> Any:
    """The ``peft.LoraConfig`` of ``cfg`` for ``model``: ``lora_target`` resolved against the model's real modules
    and parameters (:func:`lora_targets`: Conv1D, fused MoE experts as ``target_parameters``, the vision tower
    left out; ``targets`` when already resolved), shared by the DDP build and the FSDP meta-device build."""
    from peft import LoraConfig

    targets = targets if targets is not None else lora_targets(cfg, model)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.lora_rank,
        lora_alpha=_lora_alpha(cfg),  # type: ignore[arg-type]  # peft annotates int; it takes a float
        lora_dropout=cfg.lora_dropout,
        target_modules=targets.target_modules or None,
        target_parameters=targets.target_parameters or None,
        rank_pattern=targets.rank_pattern,
        alpha_pattern=targets.alpha_pattern,
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        modules_to_save=cfg.additional_target,
    )


__all__ = [
    "Adapted",
    "LoraTargets",
    "resolve_lora_targets",
    "lora_targets",
    "lora_config_for",
    "VISION_NAMES",
    "PROJECTOR_NAMES",
    "PEFT_CONVERSION",
]
