"""What ferry makes of video rows, run inside the test environment that has torchvision and PyAV
(tests/support/video_env.py): ``PYTHON tests/support/video_probe.py REQUEST.json RESULT.json``.

The request names the LLaMA-Factory sdist's data folder (``data``), the stories260K folder (``stories``), a work
folder (``work``) and what to do:

- ``cases``: ``{name: {"family", "keys"}}`` (tests/golden/vlm_video.json's): per case, ferry's tokenised rows of the
  keys' datasets (``prepare_data`` on the family's processor files) and of each row's batch (the recipe's collate)
  the statistics the goldens record;
- ``refusals``: bad video rows (:func:`refusals`), what each raised;
- ``served``: the written chat template's video slot expanded by transformers' processor (:func:`served`);
- ``losses``: ``[family, ...]``: one training step (``trainer.recipe.train``, batch of every mllm_video_demo row)
  on a tiny random model of the family, its logged loss, transformers' own loss of that batch and the losses with
  the videos' pixels mirrored, negated and zeroed.

Everything is written to RESULT.json for the calling test to judge; nothing is asserted here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _stats(tensor) -> dict:
    from tests.golden.make_vlm_goldens import weighted_sum

    return {"shape": list(tensor.shape), "sum": float(tensor.double().sum()), "weighted": weighted_sum(tensor)}


def _config(model: Path, data: Path, work: Path, **keys):
    from trainer.config import TrainConfig

    return TrainConfig(
        model_name_or_path=str(model),
        dataset_dir=str(data),
        output_dir=str(work / "out"),
        tokenized_path=str(work / "tok"),
        **keys,
    )


def _collate(recipe_media: tuple, rows: list[dict]) -> dict:
    from trainer.batching import collate_with_token_count

    images, videos = recipe_media
    return collate_with_token_count(
        rows, 0, causal=True, images=images, image_token_id=516, videos=videos, video_token_id=517
    )


def _media(model: Path, cfg) -> tuple:
    from trainer.video import VideoProcessing
    from trainer.vision import ImageProcessing

    return (
        ImageProcessing(model, cfg.image_max_pixels, cfg.image_min_pixels),
        VideoProcessing(model, cfg.video_max_pixels, cfg.video_min_pixels, cfg.video_fps, cfg.video_maxlen),
    )


def tokenised(cases: dict, data: Path, stories: Path, work: Path) -> dict:
    from tests.support.vlm import write_processor_files
    from trainer.data import load_tokenizer, prepare_data

    out = {}
    folders: dict[str, Path] = {}
    for name, case in cases.items():
        family = case["family"]
        if family not in folders:
            folders[family] = write_processor_files(work / "processors" / family, family, stories, video=True)
        keys = {k: v for k, v in case["keys"].items()}
        keys["dataset"] = keys["dataset"].split(",")
        cfg = _config(folders[family], data, work / name, **keys)
        prepared = prepare_data(cfg, load_tokenizer(cfg))
        media = _media(folders[family], cfg)
        rows = []
        for row in prepared.train:
            batch = _collate(media, [row])
            record = {
                "input_ids": row["input_ids"],
                "labels": row["labels"],
                "images": [Path(p).relative_to(data).as_posix() for p in row.get("images", [])],
                "videos": [Path(p).relative_to(data).as_posix() for p in row.get("videos", [])],
                "mm_token_type_ids": batch["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in batch else None,
            }
            for key in ("pixel_values", "pixel_values_videos"):
                if key in batch:
                    record[key] = _stats(batch[key])
            for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
                if key in batch:
                    record[key] = batch[key].tolist()
            rows.append(record)
        out[name] = {"rows": rows, "stats": prepared.stats}
    return out


def losses(families: list[str], data: Path, stories: Path, work: Path) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.support.vlm import build
    from trainer.data import load_tokenizer, prepare_data
    from trainer.recipe import train

    out = {}
    for family in families:
        model_dir = build(work / "models", family, stories, video=True)
        template = "qwen3_vl_nothink" if family == "qwen3_vl" else "qwen2_vl"
        keys = dict(
            dataset=["mllm_video_demo"],
            template=template,
            cutoff_len=1024,
            video_max_pixels=128 * 128,
            video_maxlen=8,
            per_device_train_batch_size=3,
            max_steps=1,
            logging_steps=1,
            lora_rank=8,
            seed=7,
            disable_tqdm=True,
        )
        cfg = _config(model_dir, data, work / f"train-{family}", **keys)
        report = train(cfg)
        metrics = Path(cfg.output_dir) / "metrics.jsonl"
        logged = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]
        prepared = prepare_data(cfg, load_tokenizer(cfg))
        batch = _collate(_media(model_dir, cfg), list(prepared.train))
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        names = ("input_ids", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids", "second_per_grid_ts")
        inputs = {k: batch[k] for k in names if k in batch}
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        with torch.no_grad():
            theirs = model(**inputs, labels=batch["labels"]).loss.item()
            pixels = inputs["pixel_values_videos"]
            others = [
                model(**{**inputs, "pixel_values_videos": other}, labels=batch["labels"]).loss.item()
                for other in (pixels.flip(0), -pixels, torch.zeros_like(pixels))
            ]
        out[family] = {
            "logged": logged,
            "transformers": theirs,
            "others": others,
            "num_train_samples": report.num_train_samples,
            "num_videos": prepared.stats["num_videos"],
            "inputs": sorted(inputs),
        }
    return out


def refusals(cases: dict, data: Path, stories: Path, work: Path) -> dict:
    """Per case ``{"family", "rows", "keys", "entry"}``: ``prepare_data`` over ``rows`` in mllm_video_demo's layout
    (``entry``, else its dataset_info.json entry; the sdist's videos beside them, and a ``broken.mp4`` of JPEG
    bytes); what it raised (``{"error", "message"}``, or the stats when it raised nothing)."""
    import shutil

    from tests.support.vlm import write_processor_files
    from trainer.data import load_tokenizer, prepare_data

    out = {}
    for name, case in cases.items():
        folder = work / "refusals" / name
        shutil.copytree(data / "mllm_demo_data", folder / "mllm_demo_data")
        shutil.copy(data / "mllm_demo_data" / "1.jpg", folder / "mllm_demo_data" / "broken.mp4")
        info = json.loads((data / "dataset_info.json").read_text())
        entry = {**(case.get("entry") or info["mllm_video_demo"]), "file_name": "rows.json"}
        (folder / "dataset_info.json").write_text(json.dumps({"rows": entry}))
        (folder / "rows.json").write_text(json.dumps(case["rows"]))
        model = write_processor_files(work / "refusals" / f"{name}-model", case["family"], stories, video=True)
        cfg = _config(model, folder, work / "refusals" / f"{name}-work", dataset=["rows"], **case["keys"])
        try:
            stats = prepare_data(cfg, load_tokenizer(cfg)).stats
        except Exception as exc:  # noqa: BLE001 - the test judges the class and the message
            out[name] = {"error": type(exc).__name__, "message": str(exc)}
        else:
            out[name] = {"stats": stats}
    return out


def served(cases: dict, data: Path, stories: Path, work: Path) -> dict:
    """Per case ``{"family", "keys"}``: each mllm_video_demo row's prompt as a client sends it (content parts, the
    ``<video>`` a ``video`` part) rendered by the chat template ferry writes, then expanded by transformers' own
    processor with the frames ferry samples and their metadata (the stream's frame rate, the sampled indices); its
    ``input_ids`` beside the prompt of ferry's training row."""
    from tests.support.vlm import write_processor_files
    from trainer.data import load_tokenizer, prepare_data
    from trainer.video import probe_video

    out = {}
    for name, case in cases.items():
        model = write_processor_files(work / "served" / name, case["family"], stories, video=True)
        keys = {**case["keys"], "dataset": case["keys"]["dataset"].split(",")}
        cfg = _config(model, data, work / "served" / f"{name}-work", **keys)
        tokenizer = load_tokenizer(cfg)
        _, videos = _media(model, cfg)
        rows = json.loads((data / "mllm_video_demo.json").read_text())
        pairs = []
        for row, trained in zip(rows, prepare_data(cfg, tokenizer).train):
            user = row["messages"][0]["content"]
            parts = [{"type": "video"}, {"type": "text", "text": user.replace("<video>", "")}]
            assert user.startswith("<video>")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
            )
            path = str(data / row["videos"][0])
            frames, _ = videos.frames(path, "video")
            stream = probe_video(path, "video")  # what a client knows of its video: the frames' rate and indices
            metadata = {
                "fps": stream.average_fps,
                "frames_indices": videos.indices(stream),
                "total_num_frames": stream.frames,
            }
            ids = videos.processor(
                text=[text],
                videos=[frames],
                video_metadata=[metadata],
                do_sample_frames=False,
                add_special_tokens=False,
                return_tensors="pt",
            )
            prompt = next(k for k, label in enumerate(trained["labels"]) if label != -100)
            pairs.append({"served": ids["input_ids"][0].tolist(), "trained": trained["input_ids"][:prompt]})
        out[name] = pairs
    return out


def main(request_path: Path, result_path: Path) -> None:
    request = json.loads(request_path.read_text())
    data, stories, work = Path(request["data"]), Path(request["stories"]), Path(request["work"])
    result = {}
    if request.get("cases"):
        result["cases"] = tokenised(request["cases"], data, stories, work)
    if request.get("refusals"):
        result["refusals"] = refusals(request["refusals"], data, stories, work)
    if request.get("served"):
        result["served"] = served(request["served"], data, stories, work)
    if request.get("losses"):
        result["losses"] = losses(request["losses"], data, stories, work)
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
