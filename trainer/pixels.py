"""The numbers LLaMA-Factory's Qwen-VL plugins regularise images and video frames with, before the model's own
processor sees them, how that processor is loaded, and the fixed picture the checks use (:mod:`trainer.vision`
and :mod:`trainer.video` share it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferry.errors import ConfigError

if TYPE_CHECKING:
    from PIL.Image import Image

#: LLaMA-Factory's placeholders in message texts.
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
#: LLaMA-Factory's ``image_max_pixels`` / ``image_min_pixels`` defaults (pixels).
IMAGE_MAX_PIXELS = 768 * 768
IMAGE_MIN_PIXELS = 32 * 32
#: Qwen2-VL's smallest side and its aspect-ratio limit (LLaMA-Factory's ``Qwen2VLPlugin``).
_MIN_SIDE = 28
_MAX_ASPECT, _CUT_ASPECT = 200, 180


def _steps(width: int, height: int, max_pixels: int, min_pixels: int) -> list[tuple[int, int] | None]:
    """The sizes of LLaMA-Factory's five resizes in order (scale down to ``max_pixels``, up to ``min_pixels``, each
    side at least 28, an aspect above 200 cut to 180 either way), None for a step that does not apply."""
    steps: list[tuple[int, int] | None] = []

    def step(size: tuple[int, int] | None) -> None:
        nonlocal width, height
        steps.append(size)
        if size is not None:
            width, height = size

    factor = math.sqrt(max_pixels / (width * height)) if width * height > max_pixels else None
    step((int(width * factor), int(height * factor)) if factor else None)
    factor = math.sqrt(min_pixels / (width * height)) if width * height < min_pixels else None
    step((int(width * factor), int(height * factor)) if factor else None)
    step((max(width, _MIN_SIDE), max(height, _MIN_SIDE)) if min(width, height) < _MIN_SIDE else None)
    step((height * _CUT_ASPECT, height) if width / height > _MAX_ASPECT else None)
    step((width, width * _CUT_ASPECT) if height / width > _MAX_ASPECT else None)
    return steps


def regularize_image(image: Image, max_pixels: int, min_pixels: int) -> Image:
    """``image`` as LLaMA-Factory 0.9.5 hands it to a Qwen-VL processor (``BasePlugin._preprocess_image`` and
    ``Qwen2VLPlugin._preprocess_image``): scaled down (aspect kept, ``int`` sides) to at most ``max_pixels``,
    up to at least ``min_pixels``, converted to RGB, each side at least 28, an aspect ratio above 200 cut to 180;
    each step its own resize, as there, so the same pixels.

    Args:
        image: a PIL image.
        max_pixels, min_pixels: bounds on width * height (pixels).

    Returns:
        An RGB PIL image.
    """
    for number, size in enumerate(_steps(image.width, image.height, max_pixels, min_pixels)):
        if number == 2 and image.mode != "RGB":
            image = image.convert("RGB")
        if size is not None:
            image = image.resize(size)
    return image


def regularized_size(width: int, height: int, max_pixels: int, min_pixels: int) -> tuple[int, int]:
    """``(width, height)`` of a ``width`` x ``height`` image after :func:`regularize_image` (pixels), from the
    numbers alone (LLaMA-Factory's ``_get_qwen_video_size_after_regularization``)."""
    sizes = [size for size in _steps(width, height, max_pixels, min_pixels) if size is not None]
    return sizes[-1] if sizes else (width, height)


def probe_image() -> Image:
    """A fixed 112 x 84 RGB picture (gradients across and down, a flat blue), for checks that need an image and
    have none: the export's smoke check compares the merged model with base + adapter on it."""
    from PIL import Image as PILImage

    across = PILImage.linear_gradient("L").rotate(90).resize((112, 84))
    down = PILImage.linear_gradient("L").resize((112, 84))
    return PILImage.merge("RGB", (across, down, PILImage.new("L", (112, 84), 160)))


def load_processor(loader: Any, model_dir: Path, needs: str) -> Any:
    """``loader.from_pretrained(model_dir)`` with no network (``loader``: transformers' ``AutoImageProcessor`` or
    ``AutoProcessor``).

    Raises:
        ConfigError: the folder has none transformers can load, one line starting with ``needs`` ("image rows need
            the model's image processor").
    """
    try:
        return loader.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(
            f"{needs}, and {model_dir} has none transformers can load ({str(exc).splitlines()[0]})"
        ) from None


__all__ = [
    "AUDIO_PLACEHOLDER",
    "IMAGE_MAX_PIXELS",
    "IMAGE_MIN_PIXELS",
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "load_processor",
    "probe_image",
    "regularize_image",
    "regularized_size",
]
