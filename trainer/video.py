"""Videos in supervised rows, processed as LLaMA-Factory 0.9.5's Qwen-VL plugins process them.

A row names its videos in the dataset's ``videos`` column (paths relative to ``media_dir``, like images) and marks
where each goes with a ``<video>`` placeholder, in order (LLaMA-Factory's ``mllm_video_demo``). For the templates
with image slots (:data:`trainer.templates.images.IMAGE_TEMPLATES`):

1. frames are sampled from the file's first video stream (decoded with PyAV): ``n = min(frames in the stream,
   video_maxlen, max(1, floor(duration in seconds * video_fps)))`` frame indices spread evenly over the stream
   (``numpy.linspace(0, frames - 1, n)`` cast to int32), the last frame repeated once when ``n`` is odd; each frame
   is regularised as an image is (:func:`trainer.pixels.regularize_image`) with ``video_max_pixels`` /
   ``video_min_pixels``;
2. the model's own video processor (the ``video_processor`` of ``AutoProcessor`` from the model folder, which needs
   torchvision) gives ``pixel_values_videos`` ``[sum of t*h*w over the videos, channels * temporal_patch_size *
   patch_size**2]`` float32 and ``video_grid_thw`` ``[n_videos, 3]`` int64; for Qwen2.5-VL (a processor whose
   ``model_input_names`` holds it) also ``second_per_grid_ts`` ``[n_videos]`` float32, ``temporal_patch_size /
   (n / duration)`` seconds;
3. at tokenisation each placeholder becomes ``<|vision_start|>`` + ``<|video_pad|>`` x ``t*h*w / merge_size**2``
   + ``<|vision_end|>`` (the qwen2_vl plugin's templates), or, for the qwen3_vl plugin's (``timestamps``), that
   slot once per temporal patch with ``h*w / merge_size**2`` tokens, each behind its time ``<{seconds:.1f}
   seconds>`` from the processor's own ``_calculate_timestamps`` of the sampled frames' times. The grid comes from
   the stream's size and frame count and the processor's ``get_num_of_video_patches`` (no frame is decoded to
   count tokens), and the collate checks it against the processor's grid.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ferry.errors import ConfigError, DataError
from trainer.pixels import VIDEO_PLACEHOLDER, load_processor, probe_image, regularize_image, regularized_size
from trainer.templates.images import ImageSlots

if TYPE_CHECKING:
    from PIL.Image import Image

#: LLaMA-Factory's video keys' defaults: ``video_max_pixels`` / ``video_min_pixels`` (pixels per frame),
#: ``video_fps`` (frames sampled per second), ``video_maxlen`` (frames sampled at most).
VIDEO_MAX_PIXELS = 256 * 256
VIDEO_MIN_PIXELS = 16 * 16
VIDEO_FPS = 2.0
VIDEO_MAXLEN = 128


def video_problem() -> str | None:
    """Why video rows cannot be processed in this environment (torchvision or PyAV missing or not loading), or
    None when both import."""
    for module, role in (("torchvision", "the video processors of transformers"), ("av", "decoding video files")):
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 - a CUDA torchvision beside a CPU torch raises RuntimeError
            return (
                f"video rows need {module} ({role}), which does not import here ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); a bundle packed with the vision extra carries it"
            )
    return None


def sample_indices(total_frames: int, duration_s: float, fps: float, maxlen: int) -> list[int]:
    """The frame indices LLaMA-Factory samples from a stream of ``total_frames`` frames lasting ``duration_s``
    seconds: ``n = min(total_frames, maxlen, max(1, floor(duration_s * fps)))`` evenly spread indices
    (``numpy.linspace(0, total_frames - 1, n)`` cast to int32); ``maxlen`` evenly spread over ``[0, maxlen - 1]``
    when the stream does not say its frame count (0)."""
    import numpy as np

    if total_frames == 0:
        return np.linspace(0, maxlen - 1, maxlen).astype(np.int32).tolist()
    n = min(total_frames, maxlen, max(1, math.floor(duration_s * fps)))
    return np.linspace(0, total_frames - 1, n).astype(np.int32).tolist()


@dataclass(frozen=True)
class VideoStream:
    """What a video file's first video stream says of itself: ``width``, ``height`` (pixels), ``frames`` (count, 0
    unknown), ``duration`` (seconds), ``average_fps`` (frames per second)."""

    width: int
    height: int
    frames: int
    duration: float
    average_fps: float


def probe_video(path: str, where: str) -> VideoStream:
    """The first video stream's :class:`VideoStream` of the file at ``path`` (its header only).

    Raises:
        DataError: missing, unreadable, not a video, without a video stream, a duration or a frame rate (naming
            ``where`` and the path).
    """
    return read_video(path, where, None)[0]


def read_video(
    path: str, where: str, pick: Callable[[VideoStream], list[int]] | None
) -> tuple[VideoStream, list[int], list[Image]]:
    """``(the first video stream's VideoStream, the indices pick(stream) chose, those frames decoded in order as RGB
    PIL images)`` of the file at ``path``, opened once; no frame is decoded when ``pick`` is None.

    Raises:
        DataError: missing, unreadable, not a video, without a video stream, a duration or a frame rate, or holding
            fewer frames than the indices ask for (naming ``where`` and the path).
    """
    import av

    if not os.path.isfile(path):
        raise DataError(f"{where}: video {path} does not exist")
    frames: list[Image] = []
    try:
        with av.open(path, "r") as container:
            stream = next((s for s in container.streams if s.type == "video"), None)
            if stream is None:
                raise DataError(f"{where}: video {path} holds no video stream")
            if stream.duration is None or stream.time_base is None or not stream.average_rate:
                raise DataError(f"{where}: video {path} is no video with a duration and a frame rate (a still image?)")
            info = VideoStream(
                stream.width,
                stream.height,
                int(stream.frames),
                float(stream.duration * stream.time_base),
                float(stream.average_rate),
            )
            indices = pick(info) if pick is not None else []
            wanted = set(indices)
            if wanted:
                container.seek(0)
                for number, frame in enumerate(container.decode(stream)):
                    if number in wanted:
                        frames.append(frame.to_image())
    except DataError:
        raise  # already one line naming the file (a DataError is a ValueError too)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise DataError(f"{where}: video {path} cannot be read as a video ({exc})") from None
    if len(frames) != len(set(indices)):
        raise DataError(
            f"{where}: video {path} decoded {len(frames)} of the {len(set(indices))} frames its header promises at "
            "the sampled indices (a truncated file?)"
        )
    return info, indices, frames


class VideoProcessing:
    """The model's video processor with LLaMA-Factory's frame sampling and regularisation (module docstring).

    Args:
        model_dir: the model folder (the processor files ``AutoProcessor`` reads).
        max_pixels, min_pixels: ``video_max_pixels`` / ``video_min_pixels`` (pixels per frame).
        fps: ``video_fps`` (frames per second); maxlen: ``video_maxlen`` (frames).

    Raises:
        ConfigError: torchvision or PyAV does not import; the folder has no processor with a Qwen-VL video
            processor.
    """

    def __init__(
        self,
        model_dir: Path,
        max_pixels: int = VIDEO_MAX_PIXELS,
        min_pixels: int = VIDEO_MIN_PIXELS,
        fps: float = VIDEO_FPS,
        maxlen: int = VIDEO_MAXLEN,
    ) -> None:
        problem = video_problem()
        if problem is not None:
            raise ConfigError(problem)
        from transformers import AutoProcessor

        self.processor = load_processor(AutoProcessor, model_dir, "video rows need the model's processor")
        video = getattr(self.processor, "video_processor", None)
        if video is None or not isinstance(getattr(video, "merge_size", None), int):
            raise ConfigError(
                f"video rows: {model_dir}'s processor has no Qwen-VL video processor (video_preprocessor_config.json "
                "with a merge_size); ferry builds the Qwen2-VL / Qwen2.5-VL / Qwen3-VL video path"
            )
        self.video_processor = video
        self.merge_size: int = video.merge_size
        self.temporal_patch_size: int = video.temporal_patch_size
        self.max_pixels, self.min_pixels, self.fps, self.maxlen = max_pixels, min_pixels, float(fps), int(maxlen)
        self.seconds_per_grid = "second_per_grid_ts" in getattr(self.processor, "model_input_names", ())

    def fingerprint(self) -> str:
        """SHA-256 of the video processor's settings and the sampling keys (part of the data cache key)."""
        text = json.dumps(
            {
                "processor": self.video_processor.to_dict(),
                "keys": [self.max_pixels, self.min_pixels, self.fps, self.maxlen, self.seconds_per_grid],
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def indices(self, stream: VideoStream) -> list[int]:
        """The frame indices sampled from ``stream`` (:func:`sample_indices`)."""
        return sample_indices(stream.frames, stream.duration, self.fps, self.maxlen)

    def grid(self, path: str, where: str) -> tuple[int, int, VideoStream]:
        """``(t, tokens per temporal patch, stream)`` of the video at ``path`` from its header alone: the regularised
        frame size, the sampled frame count made even, the processor's ``get_num_of_video_patches``.

        Raises:
            DataError: the file is not a readable video (naming ``where``).
        """
        stream = probe_video(path, where)
        frames = len(self.indices(stream))
        frames += frames % 2
        width, height = regularized_size(stream.width, stream.height, self.max_pixels, self.min_pixels)
        patches = int(self.video_processor.get_num_of_video_patches(frames, height, width, {}))
        t = math.ceil(frames / self.temporal_patch_size)
        return t, patches // t // self.merge_size**2, stream

    def slots(self, path: str, slots: ImageSlots, where: str) -> tuple[str, int]:
        """``(the text one <video> placeholder becomes, how many video tokens it holds)`` (module docstring, 3).

        Raises:
            DataError: the file is not a readable video (naming ``where``).
            ConfigError: ``slots.timestamps`` with a processor that computes no frame times.
        """
        t, per_frame, stream = self.grid(path, where)
        times = [i / stream.average_fps * self.fps for i in self.indices(stream)]
        return self.slot_text(t, per_frame, times, slots), t * per_frame

    def slot_text(self, t: int, per_frame: int, times: list[float], slots: ImageSlots) -> str:
        """The text of one video of ``t`` temporal patches of ``per_frame`` tokens whose sampled frames lie at
        ``times`` (frame indices scaled by ``video_fps``, as LLaMA-Factory hands them to the processor): one slot,
        or with ``slots.timestamps`` one per temporal patch behind its time.

        Raises:
            ConfigError: ``slots.timestamps`` with a processor that computes no frame times.
        """
        one = f"{slots.bos}{slots.video * per_frame}{slots.eos}"
        if not slots.timestamps:
            return f"{slots.bos}{slots.video * (t * per_frame)}{slots.eos}"
        calculate = getattr(self.processor, "_calculate_timestamps", None)
        if calculate is None:
            raise ConfigError(
                f"video rows: the template puts a time before each video frame (Qwen3-VL's layout), and "
                f"{type(self.processor).__name__} computes none: use the template of the model's family"
            )
        stamps = calculate(times, self.fps, self.merge_size)
        return "".join(f"<{stamp:.1f} seconds>{one}" for stamp in stamps[:t])

    def frames(self, path: str, where: str) -> tuple[list[Image], float]:
        """``(the sampled, regularised frames of the video at path (an even count), seconds per temporal patch)``
        (module docstring, 1-2): what the video processor is given.

        Raises:
            DataError: the video is missing, unreadable or truncated (naming ``where``).
        """
        stream, indices, frames = read_video(path, where, self.indices)
        if len(frames) % 2:
            frames.append(frames[-1])
        regular = [regularize_image(f, self.max_pixels, self.min_pixels) for f in frames]
        return regular, self.temporal_patch_size / (len(indices) / stream.duration)

    def inputs(self, paths: list[str], where: str = "video") -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` (float32 ``[patches, patch_dim]``) and ``video_grid_thw`` (int64 ``[n, 3]``) of
        the videos at ``paths``, in order; ``second_per_grid_ts`` (float32 ``[n]``, seconds) for processors that
        take it.

        Raises:
            DataError: a video is missing, unreadable or truncated (naming ``where``).
        """
        videos, seconds = [], []
        for path in paths:
            frames, per_grid = self.frames(path, where)
            videos.append(frames)
            seconds.append(per_grid)
        out = self.video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
        result = {
            "pixel_values_videos": out["pixel_values_videos"],
            "video_grid_thw": out["video_grid_thw"].to(torch.int64),
        }
        if self.seconds_per_grid:
            result["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return result


def probe_frames() -> list[Image]:
    """Four fixed frames (:func:`trainer.pixels.probe_image`, then mirrored, flipped, both): a video for checks that
    need one and have none."""
    from PIL import ImageOps

    first = probe_image()
    return [first, ImageOps.mirror(first), ImageOps.flip(first), ImageOps.flip(ImageOps.mirror(first))]


def video_prompt(
    model_dir: Path, tokenizer: Any, question: str = "Describe this video."
) -> tuple[str, dict[str, torch.Tensor]] | None:
    """A prompt holding :func:`probe_frames` as a video for a vision-language model folder: ``(text with the
    video's slots, {"pixel_values_videos", "video_grid_thw"[, "second_per_grid_ts"]})``, laid out as training
    lays a video out for the family (with per-frame times where the processor computes them, at 2 frames per
    second); None where torchvision or PyAV does not import, the folder has no Qwen-VL video processor, or the
    tokenizer lacks the slot tokens."""
    if video_problem() is not None:
        return None
    vocab = tokenizer.get_vocab()
    slots = ImageSlots()
    if any(token not in vocab for token in (slots.bos, slots.video, slots.eos)):
        return None
    try:
        processing = VideoProcessing(model_dir)
    except ConfigError:
        return None
    slots = ImageSlots(timestamps=hasattr(processing.processor, "_calculate_timestamps"))
    frames = probe_frames()
    out = processing.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    grid = out["video_grid_thw"].to(torch.int64)
    t, per_frame = int(grid[0, 0]), int(grid[0, 1] * grid[0, 2]) // processing.merge_size**2
    times = [float(i) for i in range(len(frames))]  # frame k at k / fps seconds
    inputs = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid}
    if processing.seconds_per_grid:
        inputs["second_per_grid_ts"] = torch.tensor([processing.temporal_patch_size / processing.fps])
    return processing.slot_text(t, per_frame, times, slots) + question, inputs


def check_video_grid(grid: torch.Tensor, held: int, merge_size: int, where: str) -> None:
    """Refuse a batch whose videos' processed grid (``[n, 3]``) does not give the video tokens its rows hold
    (``held``): the model would fail, or worse, on features that do not fit.

    Raises:
        DataError: naming ``where`` and both counts.
    """
    made = sum(int(n) // merge_size**2 for n in grid.prod(dim=-1).tolist())
    if made != held:
        raise DataError(
            f"{where}: the video processor made features for {made} video tokens where the rows hold {held}, counted "
            "from the files' headers at tokenisation (a video whose header misstates its frames or size?)"
        )


def expand_videos(texts: list[str], replacements: list[str]) -> list[str]:
    """``texts`` with the k-th ``<video>`` (over all texts, in order) replaced by ``replacements[k]``."""
    out, k = [], 0
    for text in texts:
        while VIDEO_PLACEHOLDER in text:
            text = text.replace(VIDEO_PLACEHOLDER, replacements[k], 1)
            k += 1
        out.append(text)
    return out


__all__ = [
    "VIDEO_FPS",
    "VIDEO_MAXLEN",
    "VIDEO_MAX_PIXELS",
    "VIDEO_MIN_PIXELS",
    "VideoProcessing",
    "VideoStream",
    "check_video_grid",
    "probe_frames",
    "video_prompt",
    "expand_videos",
    "probe_video",
    "read_video",
    "sample_indices",
    "video_problem",
]
