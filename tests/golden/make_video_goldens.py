"""LLaMA-Factory's own video rows: tests/golden/vlm_video.json.

Run where LLaMA-Factory 0.9.5 imports beside a torchvision that loads (its video processors need it), for example a
venv whose site-packages hold torch 2.14.1 + torchvision 0.29.1 + av (``pip install torch==2.14.1
torchvision==0.29.1 av``) ahead of the venv of make_template_goldens.py (a ``.pth`` file naming both folders, in
that order)::

    PYTHON tests/golden/make_video_goldens.py LLAMAFACTORY_SDIST_DIR [SHARED_ASSETS]

LLAMAFACTORY_SDIST_DIR is the unpacked llamafactory-0.9.5 sdist; its data/ folder holds mllm_video_demo.json,
mllm_demo.json and their media. For each case tests/support/vlm.py writes the family's whole processor (tokenizer,
image and video processors) and LLaMA-Factory's real sft data path runs: ``get_train_args``, ``load_tokenizer``
(which loads that processor and sets its ``video_*`` keys), ``get_template_and_fix_tokenizer``, ``get_dataset``,
then ``template.mm_plugin.get_mm_inputs`` per row. Recorded per row: ``input_ids``, ``labels``, the media paths,
and of each tensor LLaMA-Factory hands the model (``pixel_values``, ``pixel_values_videos``: shape, sum and a
position-weighted sum; ``image_grid_thw``, ``video_grid_thw`` and ``second_per_grid_ts``: their values).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

# importing it sets LLaMA-Factory's import up as for the image goldens (an empty torchaudio, its env keys)
from tests.golden.make_vlm_goldens import lf_args, weighted_sum  # noqa: E402
from tests.support.vlm import write_processor_files  # noqa: E402

#: (case name, model family, LLaMA-Factory keys)
CASES = [
    ("qwen2_vl", "qwen2_vl", {"template": "qwen2_vl"}),
    ("qwen2_5_vl", "qwen2_5_vl", {"template": "qwen2_vl"}),
    ("qwen3_vl", "qwen3_vl", {"template": "qwen3_vl_nothink"}),
    (
        "qwen2_vl+video_keys",
        "qwen2_vl",
        {"template": "qwen2_vl", "video_max_pixels": 16384, "video_fps": 1.0, "video_maxlen": 6},
    ),
    ("qwen3_vl+video_keys", "qwen3_vl", {"template": "qwen3_vl", "video_max_pixels": 16384, "video_maxlen": 7}),
    ("qwen2_vl+mixed", "qwen2_vl", {"template": "qwen2_vl", "dataset": "mllm_demo,mllm_video_demo"}),
]
BASE_KEYS = {"dataset": "mllm_video_demo", "cutoff_len": 4096}


def _stats(value) -> object:
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim > 1:
        return {"shape": list(value.shape), "sum": float(value.double().sum()), "weighted": weighted_sum(value)}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return [float(v) for v in value]


def run_case(family: str, keys: dict, data_dir: Path, assets: Path, work: Path) -> list[dict]:
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    model_dir = write_processor_files(work / "model", family, assets / "models" / "stories260K", video=True)
    # the image goldens' arguments with this file's dataset and cutoff (keys override BASE_KEYS there too)
    args = lf_args("sft", model_dir, data_dir, work, {**BASE_KEYS, **keys})
    model_args, data_args, training_args, _ft, _gen = get_train_args(args)
    loaded = load_tokenizer(model_args)
    tokenizer, processor = loaded["tokenizer"], loaded["processor"]
    assert processor is not None and getattr(processor, "video_processor", None) is not None, processor
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    module = get_dataset(
        template, model_args, data_args, training_args, stage="sft", tokenizer=tokenizer, processor=processor
    )
    rows = []
    for row in module["train_dataset"]:
        images, videos = row["images"] or [], row["videos"] or []
        mm = template.mm_plugin.get_mm_inputs(
            images, videos, [], [len(images)], [len(videos)], [0], [row["input_ids"]], processor
        )
        record = {
            "input_ids": list(map(int, row["input_ids"])),
            "labels": list(map(int, row["labels"])),
            "images": [Path(p).relative_to(data_dir).as_posix() for p in images],
            "videos": [Path(p).relative_to(data_dir).as_posix() for p in videos],
        }
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            if mm.get(key) is not None:
                record[key] = _stats(mm[key])
        rows.append(record)
    return rows


def main(sdist: Path, assets: Path, out: Path = HERE / "vlm_video.json") -> None:
    from importlib.metadata import version

    work = Path(tempfile.mkdtemp(prefix="lf-video-goldens-"))
    cases = {}
    for name, family, keys in CASES:
        rows = run_case(family, keys, sdist / "data", assets, work / name)
        cases[name] = {"family": family, "keys": {**BASE_KEYS, **keys}, "rows": rows}
        print(name, [len(r["input_ids"]) for r in rows])
    doc = {
        "llamafactory": version("llamafactory"),
        "transformers": version("transformers"),
        "torchvision": version("torchvision"),
        "av": version("av"),
        "cases": cases,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    sdist_dir = Path(sys.argv[1])
    shared = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parent.parent.parent / "shared" / "assets"
    main(sdist_dir, shared)
