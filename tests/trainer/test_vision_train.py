"""Vision-language LoRA: tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models (tests/support/vlm.py) trained on
LLaMA-Factory's own mllm_demo rows and JPEGs (the hash-pinned sdist) mixed with its text-only identity rows, as its
qwen3vl_lora_sft.yaml example mixes them.

The first step's loss is transformers' own loss of the whole vision-language model on that batch (so the images
reach the model as LLaMA-Factory's pixels, and the loss is the token loss); two gloo ranks train the adapter one
process trains, under DDP and under FSDP2; the adapter never touches the vision tower.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry_train,
    run_plain_worker,
    train_losses,
    worker_env,
    write_config,
)
from tests.support.vlm import build, preference_folder

pytestmark = pytest.mark.budget(120, reason="a 2-rank torchrun run and a plain run of a vision-language model")


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


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_vl+qlora"])
def test_the_first_loss_is_transformers_own_on_the_image_batch(family, models, sdist_data, tmp_path) -> None:
    """One step over the four image rows: ferry's logged loss equals the loss transformers' model class computes
    from the same batch with ``labels`` (at step 1 the LoRA update is zero), to 1e-6; the same batch with other
    pixels (mirrored, negated or zeroed) moves the loss by more than ten times that, so the pixels count.
    ``+qlora``: a 4-bit base (bitsandbytes NF4), the reference loaded with the same quantisation."""
    from transformers import AutoModelForImageTextToText

    from trainer.batching import collate_with_token_count
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer, prepare_data
    from trainer.recipe import train
    from trainer.vision import ImageProcessing

    family, _, variant = family.partition("+")
    quant = {"quantization_bit": 4} if variant == "qlora" else {}
    keys = _keys(
        models[family], sdist_data, tmp_path / "out", dataset="mllm_demo", per_device_train_batch_size=4, **quant
    )
    cfg = TrainConfig(**keys, max_steps=1, tokenized_path=str(tmp_path / "tok"))
    report = train(cfg)
    assert report.num_train_samples == 4

    data = prepare_data(cfg, load_tokenizer(cfg))
    assert data.stats["num_images"] == 6  # its first and fourth rows hold two each
    processing = ImageProcessing(models[family], cfg.image_max_pixels, cfg.image_min_pixels)
    batch = collate_with_token_count(list(data.train), 0, causal=True, images=processing, image_token_id=516)
    assert batch["image_grid_thw"].shape == (6, 3)
    extra = {}
    if quant:
        from trainer.quant import bnb_config

        extra["quantization_config"] = bnb_config(cfg, torch.float32)
    model = AutoModelForImageTextToText.from_pretrained(models[family], dtype=torch.float32, **extra)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        theirs = model(**inputs, labels=batch["labels"]).loss.item()
        pixels = inputs["pixel_values"]
        others = [
            model(**{**inputs, "pixel_values": other}, labels=batch["labels"]).loss.item()
            for other in (pixels.flip(0), -pixels, torch.zeros_like(pixels))
        ]
    assert train_losses(Path(keys["output_dir"])) == [pytest.approx(theirs, rel=1e-6)]
    assert max(abs(other - theirs) for other in others) > 10 * 1e-6 * theirs


def lf_example(name: str, model: Path, data: Path, out: Path, **changes) -> dict:
    """LLaMA-Factory's example ``name`` with only paths and sizes changed: 2 steps of 4 samples per dataset cut to
    256 tokens, a loss logged every step, fp32 on the CPU."""
    from tests.support.pinned_sdist import LLAMAFACTORY

    keys = yaml.safe_load((LLAMAFACTORY.path() / "examples" / name).read_text(encoding="utf-8"))
    keys.update(
        model_name_or_path=str(model),
        dataset_dir=str(data),
        output_dir=str(out),
        max_steps=2,
        max_samples=4,
        cutoff_len=256,
        dataloader_num_workers=0,
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
    )
    keys.update(changes)
    return keys


def test_llamafactorys_qwen3vl_example_trains_offline_on_two_ranks_under_ddp_and_fsdp_as_one_process_and_exports(
    models, sdist_data, tmp_path
) -> None:
    """LLaMA-Factory's train_lora/qwen3vl_lora_sft.yaml (image rows of mllm_demo beside the text rows of identity and
    alpaca_en_demo, template qwen3_vl_nothink, lora_target all): 2 gloo ranks with no network at all x accumulation 8
    equal one process x accumulation 16, and FSDP2 on 2 ranks equals DDP (same losses, same adapter; with batch 1 a
    rank's micro-batch often holds no image while the other's does); the adapter holds LoRA on the language model
    only; ``ferry export`` merges it into the whole vision-language model and its smoke check passes on an image
    prompt."""
    name = "train_lora/qwen3vl_lora_sft.yaml"
    runs = {}
    shapes = (("ddp", 2, 8, {}), ("plain", 1, 16, {}), ("fsdp", 2, 8, {"fsdp": "full_shard auto_wrap"}))
    for run, nproc, accumulation, extra in shapes:
        keys = lf_example(
            name, models["qwen3_vl"], sdist_data, tmp_path / run, gradient_accumulation_steps=accumulation, **extra
        )
        config = write_config(tmp_path / f"{run}.yaml", keys)
        if nproc > 1:
            run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=tmp_path, offline=True)
        else:
            run_plain_worker(config, env=worker_env(tmp_path), cwd=tmp_path)
        runs[run] = tmp_path / run
    reports = {run: json.loads((out / "train_report.json").read_text()) for run, out in runs.items()}
    assert [reports[n]["world_size"] for n in ("ddp", "plain", "fsdp")] == [2, 1, 2]
    assert reports["ddp"]["num_train_samples"] == 12  # 4 image rows, 4 identity rows, 4 alpaca rows
    for other in ("plain", "fsdp"):
        assert train_losses(runs["ddp"]) == pytest.approx(train_losses(runs[other]), rel=1e-5), other
    ddp = adapter_tensors(runs["ddp"] / "adapter")
    for other in ("plain", "fsdp"):
        assert_same_adapter(ddp, adapter_tensors(runs[other] / "adapter"), rel_frobenius=1e-4, max_abs=1e-5)
    assert ddp and all(".language_model." in key and "visual" not in key for key in ddp)

    # the export: the whole model merged, its image processor carried, and the smoke check's image prompt (a fixed
    # picture) through the merged model and through base + adapter (peft) with the same logits
    from exporter.export import export

    merged = tmp_path / "merged"
    report = export(runs["ddp"] / "adapter", merged)
    smoke = json.loads((merged / "smoke_report.json").read_text())
    assert smoke["passed"] and report.smoke is not None, smoke
    image = [p for p in smoke["prompts"] if p["prompt"] == "<image>Describe this image."]
    assert len(image) == 1 and image[0]["max_abs_diff"] <= 1e-4
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    processor = (models["qwen3_vl"] / "preprocessor_config.json").read_bytes()
    assert (merged / "preprocessor_config.json").read_bytes() == processor


def _one_step(keys: dict, config: Path, samples: int) -> tuple[Any, dict]:
    """Train ``keys`` (written to ``config``, read back as ``ferry train`` reads it) for their one step over
    ``samples`` samples; returns the config and the first logged step (the record with a ``loss``)."""
    from trainer.config import load_config
    from trainer.stages import train

    cfg = load_config(write_config(config, keys))
    assert train(cfg).num_train_samples == samples
    logged = [json.loads(line) for line in (Path(keys["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return cfg, next(r for r in logged if "loss" in r)


def _summed_logps(model_dir: Path, batch: dict) -> torch.Tensor:
    """transformers' own vision-language model's summed log-probability of each row's labels ``[rows]``, the
    images of ``batch`` (a collated image batch) given with them."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    names = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in names}).logits.float()
    labels = batch["labels"][:, 1:]
    picked = logits[:, :-1].log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (labels != -100)).sum(-1)


def test_llamafactorys_qwen3vl_dpo_example_trains_on_image_pairs(models, sdist_data, tmp_path) -> None:
    """train_lora/qwen3vl_lora_dpo.yaml on a local copy of its rlhf_v layout (sharegpt ranking rows with an images
    column), one step over every pair: the logged ``logps/chosen`` and ``logps/rejected`` are the mean summed
    log-probabilities transformers' own model gives the pairs' rows with their images (at step 1 the policy is the
    base), and the sigmoid loss is log 2."""
    import math

    from trainer.data import load_tokenizer, prepare_data
    from trainer.preference_recipe import collate_pairs
    from trainer.vision import ImageProcessing

    data = tmp_path / "data"
    shutil.copytree(sdist_data / "mllm_demo_data", data / "mllm_demo_data")
    rows = []
    for k, prompt in enumerate(["<image>Who are they?", "<image>Who is he?", "What is this?<image>"]):
        rows.append(
            {
                "conversations": [{"from": "human", "value": prompt}],
                "chosen": {"from": "gpt", "value": "Football players celebrating."},
                "rejected": {"from": "gpt", "value": "A cat on a sofa."},
                "images": [f"mllm_demo_data/{k + 1}.jpg"],
            }
        )
    (data / "rlhf_v.json").write_text(json.dumps(rows))
    columns = {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"}
    info = {"rlhf_v": {"file_name": "rlhf_v.json", "ranking": True, "formatting": "sharegpt", "columns": columns}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    keys = lf_example(
        "train_lora/qwen3vl_lora_dpo.yaml", models["qwen3_vl"], data, tmp_path / "out", per_device_train_batch_size=3
    )
    keys.update(max_steps=1, gradient_accumulation_steps=1, tokenized_path=str(tmp_path / "tok"))
    cfg, step = _one_step(keys, tmp_path / "dpo.yaml", 3)

    prepared = prepare_data(cfg, load_tokenizer(cfg))
    assert prepared.stats["num_images"] == 3
    pairs = [(prepared.train[2 * k], prepared.train[2 * k + 1]) for k in range(3)]
    images = ImageProcessing(models["qwen3_vl"], cfg.image_max_pixels, cfg.image_min_pixels)
    batch = collate_pairs(pairs, 0, images=images, image_token_id=516)
    assert "position_ids" not in batch and batch["image_grid_thw"].shape == (6, 3)
    logps = _summed_logps(models["qwen3_vl"], batch)
    assert step["logps/chosen"] == pytest.approx(logps[:3].mean().item(), rel=1e-5)
    assert step["logps/rejected"] == pytest.approx(logps[3:].mean().item(), rel=1e-5)
    assert step["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_kto_trains_on_image_rows(models, sdist_data, tmp_path) -> None:
    """stage kto on LLaMA-Factory's feedback layout with an images column (tests/support/vlm.py's rows), one
    step over every row: the logged ``logps/chosen`` and ``logps/rejected`` are the mean summed log-probabilities
    transformers' own model gives the desirable and the undesirable judged rows with their images."""

    from trainer.data import load_tokenizer, prepare_data
    from trainer.kto_recipe import collate_feedback
    from trainer.vision import ImageProcessing

    data = preference_folder(tmp_path / "data", sdist_data)
    keys = _keys(models["qwen2_vl"], data, tmp_path / "out", stage="kto", dataset="mllm_kto", max_samples=6)
    keys.update(per_device_train_batch_size=6, max_steps=1, tokenized_path=str(tmp_path / "tok"))
    cfg, step = _one_step(keys, tmp_path / "kto.yaml", 6)

    prepared = prepare_data(cfg, load_tokenizer(cfg))
    rows = [(prepared.train[2 * k], prepared.train[2 * k + 1]) for k in range(6)]
    images = ImageProcessing(models["qwen2_vl"], cfg.image_max_pixels, cfg.image_min_pixels)
    judged = collate_feedback(rows, 0, images=images, image_token_id=516)["judged"]
    assert "position_ids" not in judged and judged["image_grid_thw"].shape == (6, 3)
    logps = _summed_logps(models["qwen2_vl"], judged)
    desirable = torch.tensor([bool(r[0]["kto_tag"]) for r in rows])
    assert step["logps/chosen"] == pytest.approx(logps[desirable].mean().item(), rel=1e-5)
    assert step["logps/rejected"] == pytest.approx(logps[~desirable].mean().item(), rel=1e-5)


def test_a_reward_model_scores_image_pairs_as_its_backbone_and_value_head_do(models, sdist_data, tmp_path) -> None:
    """stage rm on the ranking rows with images of tests/support/vlm.py, one step (a learning rate of 1e-12, and
    the value head's dropout off through the config's ``summary_dropout_prob``): the logged ``rewards/chosen`` and
    ``rewards/rejected`` are the saved value head applied to transformers' own backbone (the vision-language model's
    ``model``) at each row's last token, the rows with their images."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from trainer.data import load_tokenizer, prepare_data
    from trainer.preference_recipe import collate_pairs
    from trainer.vision import ImageProcessing

    model_dir = shutil.copytree(models["qwen2_vl"], tmp_path / "qwen2_vl")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "summary_dropout_prob": 0.0}))
    data = preference_folder(tmp_path / "data", sdist_data)
    keys = _keys(model_dir, data, tmp_path / "out", stage="rm", dataset="mllm_dpo", max_samples=6)
    keys.update(per_device_train_batch_size=6, max_steps=1, learning_rate=1e-12, tokenized_path=str(tmp_path / "tok"))
    cfg, step = _one_step(keys, tmp_path / "rm.yaml", 6)

    prepared = prepare_data(cfg, load_tokenizer(cfg))
    pairs = [(prepared.train[2 * k], prepared.train[2 * k + 1]) for k in range(6)]
    images = ImageProcessing(model_dir, cfg.image_max_pixels, cfg.image_min_pixels)
    batch = collate_pairs(pairs, 0, images=images, image_token_id=516)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    names = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    with torch.no_grad():
        hidden = model.model(**{k: batch[k] for k in names}).last_hidden_state
    last = batch["attention_mask"].sum(-1) - 1
    head = load_file(str(tmp_path / "out" / "adapter" / "value_head.safetensors"))
    scores = hidden[torch.arange(12), last] @ head["v_head.summary.weight"][0] + head["v_head.summary.bias"][0]
    assert step["rewards/chosen"] == pytest.approx(scores[:6].mean().item(), rel=1e-5, abs=1e-6)
    assert step["rewards/rejected"] == pytest.approx(scores[6:].mean().item(), rel=1e-5, abs=1e-6)


def test_ferry_chat_takes_an_image_for_the_next_turn(models, sdist_data, tmp_path) -> None:
    """``image PATH`` then a question: the reply is transformers' own greedy generation from the prompt written out
    here (LLaMA-Factory's qwen2_vl layout, the image's slot tokens) and the processor's pixels of that JPEG; without
    the image the reply is another."""
    import io

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from serving.chat import chat_loop

    model_dir = models["qwen2_vl"]
    config = write_config(
        tmp_path / "chat.yaml",
        {"model_name_or_path": str(model_dir), "template": "qwen2_vl", "do_sample": False, "max_new_tokens": 8},
    )
    image = sdist_data / "mllm_demo_data" / "1.jpg"
    out = io.StringIO()
    turns = f"image {image}\nWho are they?\nclear\nWho are they?\nexit\n"
    assert chat_loop(config, io.StringIO(turns), out, interactive=False) == 2
    with_image, without = out.getvalue().splitlines()

    pixels = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[Image.open(image)], return_tensors="pt")
    slots = int(pixels["image_grid_thw"].prod()) // 4  # 300 x 168 is under every pixel bound: no resize
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * slots
        + "<|vision_end|>Who are they?<|im_end|>\n<|im_start|>assistant\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == 516).int(),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=[2, 513],
        )
    theirs = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    assert with_image == theirs.strip("\n") and with_image != without


@pytest.mark.parametrize(
    "freeze_vision_tower,freeze_language_model", [(False, False), (False, True), (True, False)], ids=str
)
def test_the_freeze_keys_choose_the_lora_targets_as_llamafactory(
    freeze_vision_tower, freeze_language_model, models, stories_model
) -> None:
    """LLaMA-Factory 0.9.5's own expectations (its tests/model/model_utils/test_visual.py, ``test_visual_lora``, on
    Qwen2-VL with ``lora_target: all``): the vision tower's ``visual.blocks.0.attn.qkv`` gets LoRA exactly when
    ``freeze_vision_tower`` is false, the language model's ``language_model.layers.0.self_attn.q_proj`` exactly when
    ``freeze_language_model`` is false, the projector (``visual.merger``) never at its default; a text model with
    ``freeze_language_model: true`` is refused in one line."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ferry.errors import ConfigError
    from trainer.targets import resolve_lora_targets

    model = AutoModelForImageTextToText.from_pretrained(models["qwen2_vl"])
    targets = resolve_lora_targets(
        model,
        ["all"],
        r=8,
        lora_alpha=16,
        freeze_vision_tower=freeze_vision_tower,
        freeze_language_model=freeze_language_model,
    )
    adapted = {a.name for a in targets.adapted}
    assert ("model.visual.blocks.0.attn.qkv" in adapted) != freeze_vision_tower
    assert ("model.language_model.layers.0.self_attn.q_proj" in adapted) != freeze_language_model
    assert not any(".merger." in name for name in adapted)
    if freeze_language_model:
        assert all(name.startswith("model.visual.blocks.") for name in adapted), sorted(adapted)
        assert "language model (freeze_language_model: true): 14 linear layers" in targets.left_out
    with pytest.raises(ConfigError, match=r"^freeze_language_model: true: this model has no language model apart"):
        resolve_lora_targets(
            AutoModelForCausalLM.from_pretrained(stories_model), ["all"], r=8, lora_alpha=16, freeze_language_model=True
        )


def test_lora_on_the_vision_tower_alone_trains_it_and_leaves_the_language_model_as_it_was(
    models, sdist_data, tmp_path
) -> None:
    """``freeze_vision_tower: false`` with ``freeze_language_model: true``: the adapter holds the vision blocks'
    layers only, and they moved (the image rows' loss reaches them through the pixels)."""
    from trainer.config import TrainConfig
    from trainer.recipe import train

    keys = _keys(models["qwen2_vl"], sdist_data, tmp_path / "out", dataset="mllm_demo", per_device_train_batch_size=2)
    cfg = TrainConfig(**keys, max_steps=2, freeze_vision_tower=False, freeze_language_model=True)
    train(cfg)
    tensors = adapter_tensors(tmp_path / "out" / "adapter")
    assert tensors and all(".visual.blocks." in name for name in tensors), sorted(tensors)[:4]
    moved = [name for name, value in tensors.items() if "lora_B" in name and value.abs().max() > 0]
    assert moved, "the second step updated the vision tower's LoRA B matrices"
