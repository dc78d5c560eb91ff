"""The image slots of the built-in templates that LLaMA-Factory pairs with its Qwen-VL image plugin (standard library
only: the chat templates written into adapters and exports render these slots too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSlots:
    """The tokens that stand for one image in the text: ``bos`` + ``token`` x n + ``eos``."""

    bos: str = "<|vision_start|>"
    token: str = "<|image_pad|>"
    eos: str = "<|vision_end|>"


#: The built-in templates with image slots (LLaMA-Factory pairs each with its qwen2_vl / qwen3_vl plugin, whose
#: image handling is the same).
IMAGE_TEMPLATES: dict[str, ImageSlots] = {
    name: ImageSlots()
    for name in (
        "qwen2_vl",
        "qwen3_vl",
        "qwen3_vl_nothink",
        "qwen3_5",
        "qwen3_5_nothink",
        "qwen3_6",
        "keye_vl",
        "mimo_vl",
    )
}

__all__ = ["IMAGE_TEMPLATES", "ImageSlots"]
