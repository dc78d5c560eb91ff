"""Images in supervised rows, processed as LLaMA-Factory's Qwen-VL multimodal plugin processes them.

A row names its images in the dataset's ``images`` column (paths relative to ``media_dir``, which defaults to the
dataset folder) and marks where each goes with an ``<image>`` placeholder in its messages, in order. For the Qwen-VL
family templates (``qwen2_vl``, ``qwen3_vl``, ``qwen3_vl_nothink``, ``qwen3_5`` ...):

1. each image is opened with Pillow and regularised: scaled down (aspect kept, ``int`` sides) to at most
   ``image_max_pixels`` pixels, scaled up to at least ``image_min_pixels``, each side at least 28 pixels, an
   aspect ratio above 200 cut to 180, converted to RGB (LLaMA-Factory 0.9.5's ``BasePlugin._preprocess_image`` and
   ``Qwen2VLPlugin._preprocess_image``: the same numbers, so the same pixels);
2. the model's own image processor (``AutoImageProcessor`` from the model folder: transformers' Qwen2-VL processor,
   which resizes to multiples of ``patch_size * merge_size`` and patches) gives ``pixel_values``
   ``[sum of t*h*w over the images, channels * temporal_patch_size * patch_size**2]`` float32 and
   ``image_grid_thw`` ``[n_images, 3]`` int64;
3. each placeholder becomes ``<|vision_start|>`` + ``<|image_pad|>`` x ``t*h*w / merge_size**2`` +
   ``<|vision_end|>`` before the template renders the turn, so the image tokens sit in the prompt and carry no
   label.

The collate gives the model ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (``[batch, seq_len]``
int32: 1 on image tokens, 0 elsewhere), from which transformers computes the multimodal rotary positions
(M-RoPE). Videos go the same way through :mod:`trainer.video` (``<video>`` placeholders, the ``videos`` column,
``pixel_values_videos``, ``video_grid_thw``, 2 in ``mm_token_type_ids``); audio is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ferry.errors import ConfigError, DataError
from trainer.pixels import (
    AUDIO_PLACEHOLDER,
    IMAGE_MAX_PIXELS,
    IMAGE_MIN_PIXELS,
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    load_processor,
    probe_image,
    regularize_image,
    regularized_size,
)
from trainer.templates.images import IMAGE_TEMPLATES, ImageSlots
from trainer.video import VideoProcessing, check_video_grid, expand_videos, video_problem

if TYPE_CHECKING:
    from PIL.Image import Image


def open_image(path: str, where: str) -> Image:
    """Open and fully decode the image at ``path``.

    Raises:
        DataError: missing, unreadable, or not an image Pillow decodes (naming ``where`` and the path).
    """
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if not os.path.isfile(path):
        raise DataError(f"{where}: image {path} does not exist")
    try:
        image = PILImage.open(path)
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{where}: image {path} cannot be read as an image ({exc})") from None
    return image


def count_placeholders(texts: list[str]) -> dict[str, int]:
    """How many ``<image>``, ``<video>`` and ``<audio>`` placeholders ``texts`` hold, by placeholder."""
    return {p: sum(t.count(p) for t in texts) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER)}


def check_placeholders(texts: list[str], n_images: int, where: str, n_videos: int | None = None) -> None:
    """Refuse a row whose messages hold more or fewer ``<image>`` placeholders than it names images, or ``<video>``
    placeholders than ``n_videos`` (None: video rows cannot be processed here, so any ``<video>`` is refused), or
    any ``<audio>``.

    Raises:
        DataError: naming ``where`` and both counts.
    """
    counts = count_placeholders(texts)
    if counts[AUDIO_PLACEHOLDER]:
        raise DataError(
            f"{where}: an {AUDIO_PLACEHOLDER} placeholder: ferry trains image and video rows; audio is not built"
        )
    if n_videos is None and counts[VIDEO_PLACEHOLDER]:
        why = video_problem() or "the dataset declares no videos column"
        raise DataError(f"{where}: a {VIDEO_PLACEHOLDER} placeholder, and {why}")
    for kind, column, given in ((IMAGE_PLACEHOLDER, "images", n_images), (VIDEO_PLACEHOLDER, "videos", n_videos)):
        if given is not None and counts[kind] != given:
            raise DataError(
                f"{where}: {counts[kind]} {kind} placeholder(s) in the messages but {given} {column[:-1]}(s) in the "
                f"{column} column: each {column[:-1]} needs exactly one placeholder"
            )


def image_store() -> Path:
    """Where inline images are kept as files, named by the SHA-256 of their bytes: ``$FERRY_CACHE/images``."""
    from ferry.constants import ferry_cache_dir

    return ferry_cache_dir() / "images"


def resolve_image(entry: Any, media_dir: Path, where: str, column: str = "images") -> str:
    """The file an ``images`` entry names: a path (relative ones against ``media_dir``, LLaMA-Factory's
    ``media_dir``, default the dataset folder; absolute ones as they are), or an image stored inline (``{"bytes":
    ..., "path": ...}`` as the ``datasets`` library keeps an ``Image`` feature, or raw bytes), written once into
    :func:`image_store` under the SHA-256 of its bytes (the bytes as stored: no re-encoding). A ``videos`` entry
    (``column``) is a path only.

    Raises:
        DataError: the entry is neither (naming ``where``).
    """
    if column != "images" and (not isinstance(entry, str) or not entry):
        raise DataError(
            f"{where}: {column} entry is {type(entry).__name__}, not a file path (a video given as a list of frame "
            "images is not built)"
        )
    if isinstance(entry, dict) and entry.get("bytes") is None and isinstance(entry.get("path"), str):
        entry = entry["path"]  # an Image feature that only names its file
    if isinstance(entry, dict) and isinstance(entry.get("bytes"), bytes):
        entry = entry["bytes"]
    if isinstance(entry, bytes) and entry:
        from ferry.fsutil import atomic_write_bytes

        path = image_store() / hashlib.sha256(entry).hexdigest()
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, entry)
        return str(path)
    if not isinstance(entry, str) or not entry:
        raise DataError(f"{where}: images entry is {type(entry).__name__}, neither a file path nor image bytes")
    return str(media_dir / entry) if not os.path.isabs(entry) else entry


class ImageProcessing:
    """The model's image processor with LLaMA-Factory's regularisation (see the module docstring).

    Args:
        model_dir: the model folder (its ``preprocessor_config.json``).
        max_pixels, min_pixels: ``image_max_pixels`` / ``image_min_pixels`` (pixels).

    Raises:
        ConfigError: the folder has no image processor transformers can load, or one without a ``merge_size``
            (not a Qwen-VL processor).
    """

    def __init__(self, model_dir: Path, max_pixels: int = IMAGE_MAX_PIXELS, min_pixels: int = IMAGE_MIN_PIXELS):
        from transformers import AutoImageProcessor

        self.processor = load_processor(AutoImageProcessor, model_dir, "image rows need the model's image processor")
        merge = getattr(self.processor, "merge_size", None)
        if not isinstance(merge, int):
            raise ConfigError(
                f"image rows: {type(self.processor).__name__} of {model_dir} is not a Qwen-VL image processor "
                "(no merge_size); ferry builds the Qwen2-VL / Qwen2.5-VL / Qwen3-VL image path"
            )
        self.merge_size = merge
        self.max_pixels, self.min_pixels = max_pixels, min_pixels

    def fingerprint(self) -> str:
        """SHA-256 of the processor's settings and the pixel bounds (part of the data cache key)."""
        text = json.dumps(
            {"processor": self.processor.to_dict(), "max": self.max_pixels, "min": self.min_pixels},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def inputs(self, paths: list[str], where: str = "image") -> dict[str, torch.Tensor]:
        """``pixel_values`` (float32 ``[patches, patch_dim]``) and ``image_grid_thw`` (int64 ``[n, 3]``) of the
        images at ``paths``, in order.

        Raises:
            DataError: an image is missing or unreadable (naming ``where``).
        """
        return self.pixels([open_image(p, where) for p in paths])

    def pixels(self, images: list[Image]) -> dict[str, torch.Tensor]:
        """:meth:`inputs` of PIL images (regularised here)."""
        images = [regularize_image(image, self.max_pixels, self.min_pixels) for image in images]
        out = self.processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.int64)}

    def token_counts(self, paths: list[str], where: str) -> list[int]:
        """How many image tokens each image becomes: its patches over ``merge_size**2``. The patches come from the
        processor's own ``get_number_of_image_patches`` on the regularised size (what vLLM counts placeholders
        with: no pixels computed, a tenth of the CPU), else from the grid ``t * h * w`` of :meth:`inputs`.

        Raises:
            DataError: an image is missing or unreadable (naming ``where``).
        """
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is None:
            grid = self.inputs(paths, where)["image_grid_thw"]
            return [int(n) for n in (grid.prod(dim=-1) // self.merge_size**2).tolist()]
        sizes = [regularize_image(open_image(p, where), self.max_pixels, self.min_pixels).size for p in paths]
        return [int(count(height, width)) // self.merge_size**2 for width, height in sizes]


def expand_placeholders(texts: list[str], counts: list[int], slots: ImageSlots) -> list[str]:
    """``texts`` with the k-th ``<image>`` (over all texts, in order) replaced by ``slots.bos`` +
    ``slots.token`` x ``counts[k]`` + ``slots.eos``."""
    out, k = [], 0
    for text in texts:
        while IMAGE_PLACEHOLDER in text:
            text = text.replace(IMAGE_PLACEHOLDER, f"{slots.bos}{slots.token * counts[k]}{slots.eos}", 1)
            k += 1
        out.append(text)
    return out


@dataclass
class Media:
    """One row's media after its placeholders are expanded: the file paths, how many image and video tokens the
    text holds, and how many slots (``<|vision_end|>`` tokens) close them."""

    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    image_tokens: int = 0
    video_tokens: int = 0
    slots: int = 0


class ImageRows:
    """What tokenisation needs for a config's image (and video) rows: the processing, ``media_dir``, the template's
    slots and their token ids.

    Args:
        videos: the video processing where the datasets declare a ``videos`` column (:mod:`trainer.video`).

    Raises:
        ConfigError: the tokenizer has no single token for one of the slots.
    """

    def __init__(
        self,
        processing: ImageProcessing | None,
        media_dir: Path,
        slots: ImageSlots,
        tokenizer: Any,
        videos: VideoProcessing | None = None,
    ) -> None:
        self.processing, self.media_dir, self.slots, self.videos = processing, media_dir, slots, videos
        vocab = tokenizer.get_vocab()
        for token in (slots.bos, slots.token, slots.eos, *((slots.video,) if videos is not None else ())):
            if token not in vocab:
                raise ConfigError(
                    f"image rows: the tokenizer has no token {token!r}, which the template's image slots need "
                    "(a Qwen-VL model's tokenizer has it)"
                )
        self.token_id, self.eos_id = vocab[slots.token], vocab[slots.eos]
        self.video_id = vocab.get(slots.video)

    def fingerprint(self) -> str:
        """The processing's fingerprint with the slots (part of the data cache key)."""
        parts = [
            self.processing.fingerprint() if self.processing is not None else "",
            self.videos.fingerprint() if self.videos is not None else "",
            str(self.slots),
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def expand(self, turns: list[tuple[str, str]], images: tuple[Any, ...], where: str) -> tuple[list, list, int]:
        """``(turns with each placeholder expanded, the image file paths, image tokens in all)`` of one row of
        image rows (a ``<video>`` placeholder is refused).

        Raises:
            DataError: placeholders and images do not match; an image is missing, unreadable or not a path.
        """
        turns, media = self.expand_media(turns, images, (), where, videos_allowed=False)
        return turns, media.images, media.image_tokens

    def expand_media(
        self,
        turns: list[tuple[str, str]],
        images: tuple[Any, ...],
        videos: tuple[Any, ...],
        where: str,
        videos_allowed: bool = True,
    ) -> tuple[list[tuple[str, str]], Media]:
        """``(turns with each placeholder expanded, the row's Media)``.

        Raises:
            DataError: placeholders and media do not match; a file is missing, unreadable or not a path; images
                without image processing.
        """
        texts = [content for _, content in turns]
        allowed = videos_allowed and self.videos is not None
        check_placeholders(texts, len(images), where, len(videos) if allowed else None)
        media = Media(images=[resolve_image(p, self.media_dir, where) for p in images])
        counts: list[int] = []
        if media.images:
            if self.processing is None:  # only a dataset that declares no images column: never read
                raise DataError(f"{where}: a row with images, but its dataset declares no images column")
            counts = self.processing.token_counts(media.images, where)
        texts = expand_placeholders(texts, counts, self.slots)
        media.image_tokens, media.slots = sum(counts), len(counts)
        if videos and self.videos is not None:
            media.videos = [resolve_image(p, self.media_dir, where, "videos") for p in videos]
            replacements = []
            for path in media.videos:
                text, tokens = self.videos.slots(path, self.slots, where)
                replacements.append(text)
                media.video_tokens += tokens
                media.slots += text.count(self.slots.eos)
            texts = expand_videos(texts, replacements)
        return [(role, text) for (role, _), text in zip(turns, texts)], media

    def intact(self, input_ids: list[int], n_images: int, n_tokens: int) -> bool:
        """Whether the cut ``input_ids`` still hold every image whole (its tokens and its closing slot)."""
        return self.intact_media(input_ids, Media(image_tokens=n_tokens, slots=n_images))

    def intact_media(self, input_ids: list[int], media: Media) -> bool:
        """Whether the cut ``input_ids`` still hold every image and video of ``media`` whole (their tokens and
        closing slots)."""
        videos = input_ids.count(self.video_id) if self.video_id is not None else 0
        return (
            input_ids.count(self.token_id) == media.image_tokens
            and videos == media.video_tokens
            and input_ids.count(self.eos_id) == media.slots
        )


def image_prompt(
    model_dir: Path, tokenizer: Any, question: str = "Describe this image."
) -> tuple[str, dict[str, torch.Tensor]] | None:
    """A prompt holding :func:`probe_image` for a vision-language model folder: ``(text with the image's slot
    tokens, {"pixel_values", "image_grid_thw"})``; None where the folder has no Qwen-VL image processor or the
    tokenizer lacks the slot tokens."""
    slots = ImageSlots()
    vocab = tokenizer.get_vocab()
    if any(token not in vocab for token in (slots.bos, slots.token, slots.eos)):
        return None
    try:
        processing = ImageProcessing(model_dir)
    except ConfigError:
        return None
    pixels = processing.pixels([probe_image()])
    count = int(pixels["image_grid_thw"].prod(dim=-1)[0]) // processing.merge_size**2
    return expand_placeholders([IMAGE_PLACEHOLDER + question], [count], slots)[0], pixels


def add_image_inputs(
    batch: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    images: ImageProcessing | None,
    image_token_id: int | None,
    videos: VideoProcessing | None = None,
    video_token_id: int | None = None,
) -> None:
    """Give a padded batch of ``rows`` (``batch["input_ids"]`` ``[len(rows), seq_len]``) the images and videos the
    rows name, in row order: ``pixel_values`` and ``image_grid_thw``; ``pixel_values_videos``, ``video_grid_thw``
    (and ``second_per_grid_ts`` where the processor gives it, :mod:`trainer.video`); ``mm_token_type_ids``
    (:func:`image_token_type_ids`); and take its ``position_ids`` away (the model computes its M-RoPE positions from
    those; 1-D ones would replace them). A batch of text rows is left as it is.

    Raises:
        ValueError: rows with images (videos) but no ``images`` / ``image_token_id`` (``videos`` /
            ``video_token_id``).
        DataError: an image or video cannot be read (it changed on disk after tokenisation), or the video
            processor's grid does not give the video tokens the rows hold.
    """
    paths = [str(p) for row in rows for p in row.get("images", ())]
    clips = [str(p) for row in rows for p in row.get("videos", ())]
    if not paths and not clips:
        return
    if paths:
        if images is None or image_token_id is None:
            raise ValueError("a batch with images needs the image processing and the image token id")
        batch.update(images.inputs(paths, "image of a training batch"))
    if clips:
        if videos is None or video_token_id is None:
            raise ValueError("a batch with videos needs the video processing and the video token id")
        batch.update(videos.inputs(clips, "video of a training batch"))
        held = int((batch["input_ids"] == video_token_id).sum())
        check_video_grid(batch["video_grid_thw"], held, videos.merge_size, f"videos {', '.join(clips)}")
    batch["mm_token_type_ids"] = image_token_type_ids(batch["input_ids"], image_token_id, video_token_id)
    batch.pop("position_ids", None)


def image_token_type_ids(
    input_ids: torch.Tensor, image_token_id: int | None, video_token_id: int | None = None
) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` for ``input_ids`` (``[batch, seq_len]``): int32, 1 on image tokens, 2 on
    video tokens, 0 on text."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    if image_token_id is not None:
        types[input_ids == image_token_id] = 1
    if video_token_id is not None:
        types[input_ids == video_token_id] = 2
    return types


__all__ = [
    "IMAGE_PLACEHOLDER",
    "IMAGE_TEMPLATES",
    "ImageProcessing",
    "ImageRows",
    "Media",
    "add_image_inputs",
    "ImageSlots",
    "check_placeholders",
    "expand_placeholders",
    "image_prompt",
    "image_token_type_ids",
    "probe_image",
    "open_image",
    "regularize_image",
    "regularized_size",
    "resolve_image",
]
