"""LLaMA-Factory's own image rows: tests/golden/vlm.json.

Run in the LLaMA-Factory 0.9.5 venv described in make_template_goldens.py (torchvision uninstalled: the image
processor then is transformers' PIL one, as on ferry's CPU hosts)::

    /tmp/lf-venv/bin/python tests/golden/make_vlm_goldens.py LLAMAFACTORY_SDIST_DIR [SHARED_ASSETS]

LLAMAFACTORY_SDIST_DIR is the unpacked llamafactory-0.9.5 sdist (tests/support/pinned_sdist.py's LLAMAFACTORY);
its data/ folder holds mllm_demo.json and the three JPEGs. SHARED_ASSETS defaults to ../shared/assets beside the
project (the stories260K tokenizer). For each case the tokenizer and image processor files of
tests/support/vlm.py are written, and LLaMA-Factory's real sft data path runs: ``get_train_args``,
``load_tokenizer``, ``get_template_and_fix_tokenizer``, ``get_dataset`` with the processor as
``patch_processor`` sets it up (an object holding the image processor, as LLaMA-Factory's own processor would:
without torchvision transformers cannot build the Qwen-VL processor classes), then
``template.mm_plugin.get_mm_inputs`` per row for the pixel values. Recorded per row: ``input_ids``, ``labels``,
and of ``pixel_values`` its shape, sum, and a position-weighted sum (so that patches in another order differ),
and ``image_grid_thw``. Stage dpo (``DPO_CASES``): ranking rows made from mllm_demo's (tests/support/vlm.py's
``dpo_rows``, which ferry's tests build the same way from the sdist: no row of LLaMA-Factory's is recorded here)
through the same path with ``stage: dpo``; recorded per pair: the chosen and rejected ``input_ids`` and ``labels``
and the images. Stage kto (``KTO_CASES``, ``kto_rows``): per row the judged and KL ``input_ids`` and ``labels``,
its tag and its images.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
_STUB = Path(tempfile.mkdtemp(prefix="lf-stub-"))
(_STUB / "torchaudio.py").write_text("")
sys.path.insert(0, str(_STUB))
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lf-datasets-"))

from tests.support.vlm import preference_folder, write_processor_files  # noqa: E402

#: (case name, model family, LLaMA-Factory keys)
CASES = [
    ("qwen2_vl", "qwen2_vl", {"template": "qwen2_vl"}),
    ("qwen3_vl", "qwen3_vl", {"template": "qwen3_vl"}),
    ("qwen3_vl_nothink", "qwen3_vl", {"template": "qwen3_vl_nothink"}),
    ("qwen2_vl+max_pixels", "qwen2_vl", {"template": "qwen2_vl", "image_max_pixels": 128 * 128}),
    ("qwen3_vl+min_pixels", "qwen3_vl", {"template": "qwen3_vl_nothink", "image_min_pixels": 400 * 400}),
]
BASE_KEYS = {"dataset": "mllm_demo", "cutoff_len": 2048}
#: stage dpo: ranking rows made from mllm_demo's (its first exchange: the prompt with its images, the reply chosen,
#: the next row's first reply rejected), in LLaMA-Factory's sharegpt ranking layout (its rlhf_v entry's columns)
DPO_CASES = [
    ("dpo-qwen2_vl", "qwen2_vl", {"template": "qwen2_vl"}),
    ("dpo-qwen3_vl", "qwen3_vl", {"template": "qwen3_vl_nothink"}),
]
#: stage kto: feedback rows made from mllm_demo's (tests/support/vlm.py's kto_rows)
KTO_CASES = [("kto-qwen2_vl", "qwen2_vl", {"template": "qwen2_vl"})]


def weighted_sum(tensor) -> float:
    """``sum(x_i * (i mod 1009))`` over the flattened tensor (float64): differs when patches change order."""
    import torch

    flat = tensor.double().flatten()
    return float((flat * (torch.arange(flat.numel(), dtype=torch.float64) % 1009)).sum())


def lf_args(stage: str, model_dir: Path, data_dir: Path, work: Path, keys: dict) -> dict:
    """LLaMA-Factory's arguments for a LoRA ``stage`` run that tokenises ``data_dir``'s datasets for the processor
    files in ``model_dir`` (:data:`BASE_KEYS`, then ``keys``)."""
    return {
        "stage": stage,
        "do_train": True,
        "finetuning_type": "lora",
        "model_name_or_path": str(model_dir),
        "dataset_dir": str(data_dir),
        "output_dir": str(work / "out"),
        "overwrite_cache": True,
        "report_to": "none",
        **BASE_KEYS,
        **keys,
    }


def run_case(family: str, keys: dict, data_dir: Path, assets: Path, work: Path, stage: str = "sft") -> list[dict]:
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model.patcher import patch_processor
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    model_dir = write_processor_files(work / "model", family, assets / "models" / "stories260K")
    model_args, data_args, training_args, _ft, _gen = get_train_args(lf_args(stage, model_dir, data_dir, work, keys))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    processor = SimpleNamespace(image_processor=image_processor, video_processor=image_processor, model_input_names=[])
    patch_processor(processor, tokenizer, model_args)
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    module = get_dataset(
        template,
        model_args,
        data_args,
        training_args,
        stage="rm" if stage == "dpo" else stage,
        tokenizer=tokenizer,
        processor=processor,
    )
    if stage in ("dpo", "kto"):
        keys_out = (
            ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
            if stage == "dpo"
            else ("input_ids", "labels", "kl_input_ids", "kl_labels")
        )
        return [
            {
                **{k: list(map(int, row[k])) for k in keys_out},
                **({"kto_tags": bool(row["kto_tags"])} if stage == "kto" else {}),
                "images": [Path(p).relative_to(data_dir).as_posix() for p in row["images"] or []],
            }
            for row in module["train_dataset"]
        ]
    rows = []
    for row in module["train_dataset"]:
        images = row["images"] or []
        mm = template.mm_plugin.get_mm_inputs(images, [], [], [len(images)], [0], [0], [row["input_ids"]], processor)
        pv = mm["pixel_values"]
        rows.append(
            {
                "input_ids": list(map(int, row["input_ids"])),
                "labels": list(map(int, row["labels"])),
                "images": [Path(p).relative_to(data_dir).as_posix() for p in images],
                "pixel_values": {
                    "shape": list(pv.shape),
                    "sum": float(pv.double().sum()),
                    "weighted": weighted_sum(pv),
                },
                "image_grid_thw": mm["image_grid_thw"].tolist(),
            }
        )
    return rows


def main(sdist: Path, assets: Path, out: Path = HERE / "vlm.json") -> None:
    from importlib.metadata import version

    work = Path(tempfile.mkdtemp(prefix="lf-vlm-goldens-"))
    cases = {}
    for name, family, keys in CASES:
        rows = run_case(family, keys, sdist / "data", assets, work / name)
        cases[name] = {"family": family, "keys": {**BASE_KEYS, **keys}, "rows": rows}
    dpo_data = preference_folder(work / "dpo-data", sdist / "data")
    dpo = {}
    for name, family, keys in DPO_CASES:
        keys = {**keys, "dataset": "mllm_dpo", "cutoff_len": 2048}
        rows = run_case(family, keys, dpo_data, assets, work / name, stage="dpo")
        dpo[name] = {"family": family, "keys": keys, "rows": rows}
    kto = {}
    for name, family, keys in KTO_CASES:
        keys = {**keys, "dataset": "mllm_kto", "cutoff_len": 2048}
        rows = run_case(family, keys, dpo_data, assets, work / name, stage="kto")
        kto[name] = {"family": family, "keys": keys, "rows": rows}
    doc = {
        "llamafactory": version("llamafactory"),
        "transformers": version("transformers"),
        "cases": cases,
        "dpo": dpo,
        "kto": kto,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    sdist_dir = Path(sys.argv[1])
    shared = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parent.parent.parent / "shared" / "assets"
    main(sdist_dir, shared)
