"""The image slots of the built-in templates that LLaMA-Factory pairs with its Qwen-VL image plugin (standard library
only: the chat templates written into adapters and exports render these slots too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSlots:
    """The tokens that stand for one image in the text: ``bos`` + ``token`` x n + ``eos``; a video's are
    ``bos`` + ``video`` x n + ``eos``, once per temporal patch each behind its time (``<1.5 seconds>``) where
    ``timestamps`` (LLaMA-Factory's qwen3_vl plugin), else once for the whole video (its qwen2_vl plugin)."""

    bos: str = "<|vision_start|>"
    token: str = "<|image_pad|>"
    eos: str = "<|vision_end|>"
    video: str = "<|video_pad|>"
    timestamps: bool = False


#: The built-in templates with image slots (LLaMA-Factory pairs each with its qwen2_vl / qwen3_vl plugin, whose
#: image handling is the same).
IMAGE_TEMPLATES: dict[str, ImageSlots] = {
    **{name: ImageSlots() for name in ("qwen2_vl", "keye_vl", "mimo_vl")},
    **{
        name: ImageSlots(timestamps=True)
        for name in ("qwen3_vl", "qwen3_vl_nothink", "qwen3_5", "qwen3_5_nothink", "qwen3_6")
    },
}

__all__ = ["IMAGE_TEMPLATES", "ImageSlots"]
