"""Building and loading peft models without peft's false alarms.

:func:`get_peft_model_checked` and :func:`load_peft_adapter` are what every part of ferry calls instead of
``peft.get_peft_model`` / ``peft.PeftModel.from_pretrained``: the DDP, FSDP and QLoRA builds, continued adapters,
do_predict, chat and the export smoke check. Kept apart from :mod:`trainer.targets` so that the light modules
(``trainer.lf_compat`` under ``trainer.config``) can use it without an import circle.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.errors import ConfigError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

#: Two warnings peft 0.21.2 (the newest release) raises on every ferry model that it should not, both from peft's
#: own code, so ferry cannot stop them by calling anything differently:
#:
#: * ``peft/peft_model.py`` (``PeftModel.__init__``) reads ``model.is_gradient_checkpointing``, which transformers 5
#:   deprecated for ``is_activation_checkpointing`` (a FutureWarning attributed to transformers.modeling_utils);
#:   ferry itself only uses ``activation_checkpointing_enable`` / ``is_activation_checkpointing``.
#: * ``peft/tuners/tuners_utils.py`` (``BaseTuner.inject_adapter``, the check added by peft PR #3588) tests each
#:   ``rank_pattern`` / ``alpha_pattern`` key against the *module* names it adapted only. The keys ferry passes for
#:   fused MoE experts (``.*\\.gate_up_proj``: gate and up fused, so rank and alpha 2x, peft's own conversion rule)
#:   name a ``target_parameters`` entry; peft applies them there (the expert LoRA gets rank 2r) and then warns
#:   that they matched nothing. :func:`check_patterns_applied` runs the check peft meant, over modules and
#:   parameters, and raises on a key that really matched nothing.
PEFT_FALSE_ALARMS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    (RuntimeWarning, r"The following (rank|alpha)_pattern keys did not match any targeted module"),
)


@contextlib.contextmanager
def peft_false_alarms_off() -> Iterator[None]:
    """Silence exactly the two peft warnings of :data:`PEFT_FALSE_ALARMS` while building or loading a peft model
    (``get_peft_model``, ``PeftModel.from_pretrained``); every other warning passes. Pair it with
    :func:`check_patterns_applied` so that a rank/alpha pattern that matches nothing still fails."""
    with warnings.catch_warnings():
        for category, message in PEFT_FALSE_ALARMS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def check_patterns_applied(peft_model: torch.nn.Module, adapter: str = "default") -> None:
    """Every ``rank_pattern`` / ``alpha_pattern`` key of ``adapter`` matched an adapted module *or parameter*
    (peft's matching rule, ``re.match(rf"(.*\\.)?({key})$", name)``, as ``peft.utils.other.get_pattern_key``).

    Raises:
        ConfigError: a key that matched nothing (the rank or alpha it sets was not applied).
    """
    tuner = getattr(peft_model, "base_model", None)
    config = getattr(peft_model, "peft_config", {}).get(adapter)
    if tuner is None or config is None:
        return
    names = list(getattr(tuner, "targeted_module_names", ())) + list(getattr(tuner, "targeted_parameter_names", ()))
    for attr in ("rank_pattern", "alpha_pattern"):
        unmatched = sorted(
            k for k in (getattr(config, attr, None) or {}) if not any(re.match(rf"(.*\.)?({k})$", n) for n in names)
        )
        if unmatched:
            raise ConfigError(f"LoRA {attr} keys {unmatched} match no adapted module or parameter of the model")


def get_peft_model_checked(model: torch.nn.Module, lora_config: Any) -> PeftModel:
    """``peft.get_peft_model(model, lora_config)`` without peft's two false alarms (:data:`PEFT_FALSE_ALARMS`),
    then :func:`check_patterns_applied`.

    Raises:
        ValueError: from peft, when the targets do not fit the model.
        ConfigError: a rank/alpha pattern key matched nothing.
    """
    from peft import get_peft_model

    with peft_false_alarms_off():
        peft_model = cast("PeftModel", get_peft_model(model, lora_config))  # not mixed: a PeftModel
    check_patterns_applied(peft_model)
    return peft_model


def load_peft_adapter(model: torch.nn.Module, folder: str, **kwargs: Any) -> PeftModel:
    """``peft.PeftModel.from_pretrained(model, folder, **kwargs)`` without peft's two false alarms, then
    :func:`check_patterns_applied` (an adapter whose patterns fit no module of ``model`` raises ConfigError)."""
    from peft import PeftModel

    with peft_false_alarms_off():
        peft_model = PeftModel.from_pretrained(model, folder, **kwargs)
    check_patterns_applied(peft_model)
    return peft_model


def base_model_of(peft_model: PeftModel) -> PreTrainedModel:
    """The transformers model under ``peft_model``'s LoRA layers: ``get_base_model()``, which peft types as a
    bare ``nn.Module``."""
    return cast("PreTrainedModel", peft_model.get_base_model())


__all__ = [
    "PEFT_FALSE_ALARMS",
    "base_model_of",
    "check_patterns_applied",
    "get_peft_model_checked",
    "load_peft_adapter",
    "peft_false_alarms_off",
]
