"""Vision-language LoRA: tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models (tests/support/vlm.py) trained on
LLaMA-Factory's own mllm_demo rows and JPEGs (the hash-pinned sdist) mixed with its text-only identity rows, as its
qwen3vl_lora_sft.yaml example mixes them.

The first step's loss is transformers' own loss of the whole vision-language model on that batch (so the images
reach the model as LLaMA-Factory's pixels, and the loss is the token loss); two gloo ranks train the adapter one
process trains; the adapter never touches the vision tower; FSDP with image rows is refused before any worker
starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry_train,
    run_plain_worker,
    train_losses,
    worker_env,
    write_config,
)
from tests.support.vlm import build

pytestmark = pytest.mark.budget(120, reason="a 2-rank torchrun run and a plain run of a vision-language model")


@pytest.fixture(scope="module")
def lf_data() -> Path:
    from tests.support.pinned_sdist import LLAMAFACTORY

    return LLAMAFACTORY.path() / "data"


@pytest.fixture(scope="module")
def models(tmp_path_factory, stories_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: build(root, family, stories_model) for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


def _keys(model: Path, data: Path, out: Path, **extra) -> dict:
    keys = {
        "model_name_or_path": str(model),
        "dataset": "mllm_demo,identity",
        "dataset_dir": str(data),
        "template": "qwen3_vl_nothink" if model.name == "qwen3_vl" else "qwen2_vl",
        "cutoff_len": 256,
        "max_samples": 4,
        "image_max_pixels": 128 * 128,
        "lora_rank": 8,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "seed": 7,
        "disable_tqdm": True,
        "output_dir": str(out),
    }
    keys.update(extra)
    return keys


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_first_loss_is_transformers_own_on_the_image_batch(family, models, lf_data, tmp_path) -> None:
    """One step over the four image rows: ferry's logged loss equals the loss transformers' model class computes
    from the same batch with ``labels`` (at step 1 the LoRA update is zero); the same batch with its images
    mirrored has another loss, so the pixels count."""
    from transformers import AutoModelForImageTextToText

    from trainer.batching import collate_with_token_count
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer, prepare_data
    from trainer.recipe import train
    from trainer.vision import ImageProcessing

    keys = _keys(models[family], lf_data, tmp_path / "out", dataset="mllm_demo", per_device_train_batch_size=4)
    cfg = TrainConfig(**keys, max_steps=1, tokenized_path=str(tmp_path / "tok"))
    report = train(cfg)
    assert report.num_train_samples == 4

    data = prepare_data(cfg, load_tokenizer(cfg))
    assert data.stats["num_images"] == 6  # its first and fourth rows hold two each
    processing = ImageProcessing(models[family], cfg.image_max_pixels, cfg.image_min_pixels)
    batch = collate_with_token_count(list(data.train), 0, causal=True, images=processing, image_token_id=516)
    assert batch["image_grid_thw"].shape == (6, 3)
    model = AutoModelForImageTextToText.from_pretrained(models[family], dtype=torch.float32)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        theirs = model(**inputs, labels=batch["labels"]).loss.item()
        mirrored = model(**{**inputs, "pixel_values": inputs["pixel_values"].flip(0)}, labels=batch["labels"]).loss
    assert train_losses(Path(keys["output_dir"])) == [pytest.approx(theirs, rel=1e-5)]
    assert abs(mirrored.item() - theirs) > 1e-4


def test_two_ranks_train_the_adapter_one_process_trains_and_leave_the_vision_tower(
    models, lf_data, tmp_path, stories_model
) -> None:
    """Image rows and text rows in one dataset list: 2 gloo ranks x batch 2 equal one process x batch 4 (same
    losses, same adapter); the adapter holds LoRA on the language model only."""
    runs = {}
    for name, nproc, batch in (("ddp", 2, 2), ("plain", 1, 4)):
        keys = _keys(models["qwen2_vl"], lf_data, tmp_path / name, per_device_train_batch_size=batch, max_steps=2)
        config = write_config(tmp_path / f"{name}.yaml", keys)
        if nproc > 1:
            run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=tmp_path)
        else:
            run_plain_worker(config, env=worker_env(tmp_path), cwd=tmp_path)
        runs[name] = tmp_path / name
    reports = {name: json.loads((out / "train_report.json").read_text()) for name, out in runs.items()}
    assert [reports[n]["world_size"] for n in ("ddp", "plain")] == [2, 1]
    assert reports["ddp"]["num_train_samples"] == 8  # 4 image rows and 4 identity rows
    assert train_losses(runs["ddp"]) == pytest.approx(train_losses(runs["plain"]), rel=1e-5)
    ddp, plain = adapter_tensors(runs["ddp"] / "adapter"), adapter_tensors(runs["plain"] / "adapter")
    assert_same_adapter(ddp, plain, rel_frobenius=1e-4, max_abs=1e-5)
    assert ddp and all(".language_model." in key and "visual" not in key for key in ddp)


def test_fsdp_with_image_rows_is_refused_before_any_worker(models, lf_data, tmp_path) -> None:
    keys = _keys(models["qwen2_vl"], lf_data, tmp_path / "out", fsdp="full_shard auto_wrap")
    config = write_config(tmp_path / "fsdp.yaml", keys)
    proc = run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "fsdp with image rows: ferry trains vision-language models under DDP" in proc.stderr
    assert not (tmp_path / "out" / "adapter").exists()
