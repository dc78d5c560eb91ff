"""Which transformers auto class ferry builds a model folder with (training, export, smoke check, chat).

A text model is an ``AutoModelForCausalLM``. A vision-language family is built whole
(``AutoModelForImageTextToText``: vision tower, projector and language model) when it has no causal-LM class
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or when the data has image rows; a family with both classes (Qwen3.5, Gemma 3)
trains its language model alone on text rows, as ``AutoModelForCausalLM`` builds it.
"""

from __future__ import annotations

from typing import Any


def auto_model_class(config: Any, images: bool = False) -> Any:
    """The transformers auto class for ``config`` (a ``PretrainedConfig``) under the rule in the module docstring;
    ``images``: the run trains (or the prompt holds) images."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    vision = kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if vision and (images or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


__all__ = ["auto_model_class"]
