"""RoPE scaling (``rope_scaling: linear | dynamic | yarn | llama3``): the model's rotary position parameters
stretched so that it trains on rows longer than its pre-training context, decided as LLaMA-Factory decides it and
written the way transformers reads it.

The rule (LLaMA-Factory 0.9.5, ``model/model_utils/rope.py``; its training length ``model_max_length`` is
``cutoff_len``):

- the model's context ``C`` is ``original_max_position_embeddings`` of its current rope parameters when they have
  one, else ``max_position_embeddings``;
- a run whose ``cutoff_len`` is at most ``C`` needs no scaling: none is applied (one warning line);
- else ``factor = ceil(cutoff_len / C)`` (a float), the context becomes ``C * factor``, and the rope parameters
  become ``{"rope_type": TYPE, "factor": factor}``, plus ``original_max_position_embeddings: C`` for dynamic, yarn
  and llama3, plus ``low_freq_factor: 1.0, high_freq_factor: 4.0`` for llama3.

Where ferry differs, on purpose: LLaMA-Factory sets transformers 4's ``config.rope_scaling`` and so, under
transformers 5, drops ``rope_theta`` (and a model's ``partial_rotary_factor`` or M-RoPE sections) from the rope
parameters; ferry keeps every parameter that is not the scaling's own. A model without RoPE, or with rope parameters
per attention-layer type (Gemma 3's sliding and full attention) or only inside a ``text_config``, is refused: the
rule has no single context to stretch there.

The decision is made once, when training starts, from the base's config.json; the adapter folder records it
(``ferry_rope.json``, :data:`ferry.adapter_folder.ROPE_RECORD`) so that whatever loads the base under the adapter
(the export's merged config.json and its smoke check, ``ferry chat``, prediction) loads it stretched the same way.
Standard library only at import (transformers is imported by the functions that load a config).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferry.errors import ConfigError

#: LLaMA-Factory's ``RopeScaling`` values (``extras/constants.py``), which are transformers' rope types of the name.
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")

#: Keys of a rope-parameters dict that belong to a scaling (dropped when another scaling replaces it); every other
#: key (``rope_theta``, ``partial_rotary_factor``, ``mrope_section``, ...) describes the model and is kept.
_SCALING_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "factor",
        "original_max_position_embeddings",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "short_factor",
        "long_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    }
)


@dataclass(frozen=True)
class RopeScaling:
    """One decided scaling: ``rope_type``, ``factor``, the context before (``original_max_position_embeddings``,
    tokens) and after (``max_position_embeddings = original * factor``, tokens), and ``extra``, the type's further
    parameters (``original_max_position_embeddings`` for dynamic, yarn and llama3; llama3's frequency factors)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    max_position_embeddings: int
    extra: dict[str, Any]

    def scaling(self) -> dict[str, Any]:
        """The scaling's own parameters: ``{"rope_type", "factor", **extra}`` (what LLaMA-Factory assigns)."""
        return {"rope_type": self.rope_type, "factor": self.factor, **self.extra}

    def to_record(self) -> dict[str, Any]:
        """The adapter folder's ``ferry_rope.json``: ``{"format": 1, "rope_scaling": TYPE, "factor": float,
        "original_max_position_embeddings": int, "max_position_embeddings": int, "scaling": {...}}``."""
        return {
            "format": 1,
            "rope_scaling": self.rope_type,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "scaling": self.scaling(),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str) -> RopeScaling:
        """The scaling a ``ferry_rope.json`` holds (:meth:`to_record`).

        Raises:
            ConfigError: a field is missing or of the wrong type, naming ``where`` (the file).
        """
        try:
            scaling = dict(record["scaling"])
            rope_type = str(record["rope_scaling"])
            factor = float(record["factor"])
            original = int(record["original_max_position_embeddings"])
            enlarged = int(record["max_position_embeddings"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: not a ferry RoPE record ({exc!r})") from None
        if rope_type not in ROPE_SCALING_TYPES or scaling.get("rope_type") != rope_type:
            raise ConfigError(f"{where}: rope_scaling {rope_type!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
        extra = {k: v for k, v in scaling.items() if k not in ("rope_type", "factor")}
        return cls(rope_type, factor, original, enlarged, extra)


def _rope_dict(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rope parameters of a config.json dict (transformers 5's ``rope_parameters``, else 4's ``rope_scaling``
    with the top-level ``rope_theta``), or None when it names neither."""
    params = config.get("rope_parameters")
    if params is None:
        params = config.get("rope_scaling")
    if params is None and "rope_theta" not in config:
        return None
    return dict(params or {})


def decide_rope_scaling(
    config: Mapping[str, Any], rope_scaling: str, cutoff_len: int, *, where: str = "config.json"
) -> tuple[RopeScaling | None, str | None]:
    """LLaMA-Factory's decision (module docstring) for a model's config.json dict (``config.to_dict()`` of a loaded
    config is one): ``(scaling, None)``, or ``(None, warning)`` when ``cutoff_len`` (tokens) fits the model's
    context and nothing is to be stretched.

    Raises:
        ConfigError: ``rope_scaling`` is not a known type; the model has no RoPE, per-layer-type rope parameters,
            rope only inside ``text_config``, or no ``max_position_embeddings`` (named with ``where``).
    """
    if rope_scaling not in ROPE_SCALING_TYPES:
        raise ConfigError(f"rope_scaling: {rope_scaling!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
    params = _rope_dict(config)
    if params is None:
        inner = "text_config" in config and _rope_dict(config["text_config"] or {}) is not None
        raise ConfigError(
            f"rope_scaling: {where} "
            + (
                "keeps its rope parameters in text_config; ferry scales the RoPE of text-only models"
                if inner
                else "names no rotary position embedding (rope_theta / rope_parameters): nothing to scale"
            )
        )
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(
            f"rope_scaling: {where} holds rope parameters per attention-layer type ({', '.join(params)}); "
            "ferry scales one set of rope parameters only"
        )
    context = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    if not isinstance(context, int) or context <= 0:
        raise ConfigError(f"rope_scaling: {where} has no max_position_embeddings to scale from")
    if cutoff_len <= context:
        return None, (
            f"rope_scaling: {rope_scaling} not applied: cutoff_len {cutoff_len} fits the model's "
            f"{context} positions (as LLaMA-Factory decides)"
        )
    factor = float(math.ceil(cutoff_len / context))
    extra: dict[str, Any] = {}
    if rope_scaling in ("dynamic", "yarn", "llama3"):
        extra["original_max_position_embeddings"] = context
    if rope_scaling == "llama3":
        extra.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return RopeScaling(rope_scaling, factor, context, int(context * factor), extra), None


def _with_scaling(params: Mapping[str, Any] | None, scaling: RopeScaling) -> dict[str, Any]:
    """``params`` (a rope-parameters dict) with its scaling keys replaced by ``scaling``'s, the model's own kept."""
    return {**{k: v for k, v in (params or {}).items() if k not in _SCALING_KEYS}, **scaling.scaling()}


def scaled_config_dict(config: Mapping[str, Any], scaling: RopeScaling) -> dict[str, Any]:
    """A copy of the config.json dict ``config`` with ``scaling`` applied, in the dict's own style: transformers 5's
    ``rope_parameters`` updated (the model's own keys kept), or transformers 4's ``rope_scaling`` set beside the
    top-level ``rope_theta``; ``max_position_embeddings`` enlarged."""
    out = dict(config)
    key = "rope_parameters" if "rope_parameters" in out else "rope_scaling"
    out[key] = _with_scaling(out.get(key), scaling)
    out["max_position_embeddings"] = scaling.max_position_embeddings
    return out


def apply_to_config(config: Any, scaling: RopeScaling) -> None:
    """Apply ``scaling`` to a loaded transformers ``PretrainedConfig`` in place (before the model is built from
    it): its ``rope_parameters`` (the model's own keys, ``rope_theta`` first, kept) and
    ``max_position_embeddings``."""
    config.rope_parameters = _with_scaling(getattr(config, "rope_parameters", None), scaling)
    config.max_position_embeddings = scaling.max_position_embeddings


def scaled_config(model_dir: Any, scaling: RopeScaling, *, trust_remote_code: bool = False) -> Any:
    """The transformers config of the local model folder ``model_dir`` with ``scaling`` applied
    (:func:`apply_to_config`): pass it as ``from_pretrained(model_dir, config=...)`` to load the base as the adapter
    was trained over it (transformers imported here, not at import)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    apply_to_config(config, scaling)
    return config


def rope_scaling_for(cfg: Any, config: Any) -> tuple[RopeScaling | None, str | None]:
    """``(scaling, warning)``: the RoPE scaling a training config ``cfg`` (its ``rope_scaling``, ``cutoff_len``,
    ``model_name_or_path``) asks of the base whose transformers config is ``config``
    (:func:`decide_rope_scaling`), or ``(None, None)`` without ``rope_scaling``; ``(None, warning)`` when
    ``cutoff_len`` fits the model's context.

    Raises:
        ConfigError: the model's rope parameters cannot be scaled (no RoPE, one set per layer type, ...).
    """
    if getattr(cfg, "rope_scaling", None) is None:
        return None, None
    return decide_rope_scaling(
        config.to_dict(), cfg.rope_scaling, cfg.cutoff_len, where=f"{cfg.model_name_or_path}'s config.json"
    )


def base_config(cfg: Any, model_dir: Any) -> Any:
    """The base's transformers config (``model_dir``, a local folder) as training builds the model from it, with the
    training config ``cfg``'s ``rope_scaling`` applied (:func:`rope_scaling_for`; the launcher has already refused
    what cannot be scaled). Every training build reads it: DDP, QLoRA, FSDP's meta skeleton."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    scaling, _ = rope_scaling_for(cfg, config)
    if scaling is not None:
        apply_to_config(config, scaling)
    return config
