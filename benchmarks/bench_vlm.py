"""Benchmark: ``ferry train`` on image rows vs transformers' ``Trainer`` + peft with the same processor and collator.

Both sides train the same LoRA (rank 8, alpha 16, the language model's linear layers: ``lora_target: all`` with the
vision tower frozen) on the same random-init Qwen2-VL, built in a temp dir from a fixed seed: a language model of
hidden 256 x 4 layers with Qwen2-VL's vocabulary of 151,936 rows (so the output head costs what it costs in the real
model) and a vision tower of 6 blocks of width 256 (patch 14, merge 2), so that the vision tower is a real share of
each step; the stories260K tokenizer with the Qwen chat and vision tokens added; transformers' Qwen2-VL
image processor. The data: 48 rows of LLaMA-Factory's layout (``<image>`` then a question, an alpaca answer), each
naming one of 8 synthetic 320 x 240 pictures (about 100 image tokens each), template qwen2_vl, cutoff_len 512,
batch 2, lr 1e-4, gradient checkpointing, one process with 2 threads per side (2 cores).

- ferry: ``python -m ferry train config.yaml`` (one plain process).
- peer: ``python -m benchmarks.bench_vlm --peer ...``: a ``Trainer`` over the examples ferry tokenised (the same
  tokens) and ferry's collate (the same pixels, grids and ``mm_token_type_ids``), so the comparison is the
  training loop: the model's own loss from ``labels`` against ferry's chunked loss, Trainer's step against ferry's.

Measured: samples/s over optimizer steps 2..N (step 1 excluded as warm-up; ferry from ``metrics.jsonl``, the peer
from a step-end callback) and each process's peak RSS (``train_report.json``'s, the peer's ``ru_maxrss``).
Alternating runs (A B A B) because this machine drifts; the printed ratio is the median of the per-pair ratios
ferry / peer. Goals: samples/s >= 1.0x, peak RSS <= 0.8x.

Measured here (2 cores, load ~1.6, 2026-11-30, the default run): 0.686 vs 0.580 samples/s (1.18x; pairs 1.16x,
1.22x), peak RSS 1,313 vs 2,740 MiB (0.48x): the Trainer's model keeps the whole float32 logits for the backward.

Run: ``.venv/bin/python -m benchmarks.bench_vlm [--quick] [--rounds R] [--max-steps N]`` (default 2 pairs of 12
steps; quick: 1 pair of 4 steps).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, STORIES, bench_env

ADDED = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SETTINGS = dict(cutoff_len=512, per_device_train_batch_size=2, lora_rank=8, lora_alpha=16, learning_rate=1e-4, seed=42)
THREADS = 2


def build_model(folder: Path) -> int:
    """The random Qwen2-VL of the module docstring in ``folder``; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(STORIES / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED})
    tokenizer.save_pretrained(str(folder))
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in ADDED}
    text = dict(
        vocab_size=151936,  # Qwen2-VL's: the output head's real cost (the small tokenizer uses the first rows)
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(depth=6, embed_dim=256, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2).save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return sum(p.numel() for p in model.parameters())


def build_data(folder: Path) -> None:
    """48 image rows over 8 synthetic pictures, with a dataset_info.json entry ``vlm``."""
    import random

    from PIL import Image

    alpaca = json.loads((ROOT.parent / "shared/assets/datasets/llamafactory/alpaca_en_demo.json").read_text())
    (folder / "images").mkdir(parents=True)
    rng = random.Random(0)
    for k in range(8):
        picture = Image.effect_noise((320, 240), 40 + 10 * k).convert("RGB")
        picture.save(folder / "images" / f"{k}.png")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image>" + alpaca[i]["instruction"]},
                {"role": "assistant", "content": alpaca[i]["output"]},
            ],
            "images": [f"images/{rng.randrange(8)}.png"],
        }
        for i in range(48)
    ]
    (folder / "vlm.json").write_text(json.dumps(rows))
    columns = {"messages": "messages", "images": "images"}
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    info = {"vlm": {"file_name": "vlm.json", "formatting": "sharegpt", "columns": columns, "tags": tags}}
    (folder / "dataset_info.json").write_text(json.dumps(info))


def _config(work: Path, model: Path, data: Path, max_steps: int, tag: str) -> dict:
    return {
        "model_name_or_path": str(model),
        "dataset": "vlm",
        "dataset_dir": str(data),
        "template": "qwen2_vl",
        "cutoff_len": SETTINGS["cutoff_len"],
        "lora_rank": SETTINGS["lora_rank"],
        "lora_alpha": SETTINGS["lora_alpha"],
        "lora_target": "all",
        "per_device_train_batch_size": SETTINGS["per_device_train_batch_size"],
        "learning_rate": SETTINGS["learning_rate"],
        "max_steps": max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": str(work / f"out-{tag}"),
        "overwrite_output_dir": True,
        "seed": SETTINGS["seed"],
        "disable_tqdm": True,
        "report_to": "none",
    }


def run_ferry(work: Path, model: Path, data: Path, max_steps: int, tag: str) -> tuple[float, float]:
    """One ``ferry train`` run: (samples/s over steps 2..N, peak RSS bytes)."""
    cfg = _config(work, model, data, max_steps, tag)
    path = work / f"ferry-{tag}.yaml"
    path.write_text(json.dumps(cfg))
    _run([sys.executable, "-m", "ferry", "train", str(path)], work / f"ferry-{tag}.log")
    out = Path(cfg["output_dir"])
    report = json.loads((out / "train_report.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = sorted((r["step"], r["elapsed_s"]) for r in rows if "loss" in r and r["step"] >= 2)
    (s0, t0), (s1, t1) = rows[0], rows[-1]
    samples = (s1 - s0) * SETTINGS["per_device_train_batch_size"]
    return samples / (t1 - t0), float(max(report["peak_rss_bytes_per_rank"]))


def run_peer(work: Path, model: Path, data: Path, max_steps: int, tag: str) -> tuple[float, float]:
    """One Trainer run in its own process: (samples/s over steps 2..N, peak RSS bytes)."""
    cfg = _config(work, model, data, max_steps, tag)
    path, result = work / f"peer-{tag}.json", work / f"peer-{tag}.result.json"
    path.write_text(json.dumps(cfg))
    _run(
        [sys.executable, "-m", "benchmarks.bench_vlm", "--peer", str(path), "--out", str(result)],
        work / f"peer-{tag}.log",
    )
    got = json.loads(result.read_text())
    return got["samples_per_s"], got["peak_rss_bytes"]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=bench_env(THREADS), stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")


def peer(config: Path, out: Path) -> None:
    """The peer side (in its own process): Trainer + peft over ferry's tokenised examples and collate."""
    from functools import partial

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, Trainer, TrainerCallback, TrainingArguments

    from trainer.batching import collate_with_token_count
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer, prepare_data
    from trainer.vision import ImageProcessing

    cfg = TrainConfig(**json.loads(config.read_text()))
    tokenizer = load_tokenizer(cfg)
    data = prepare_data(cfg, tokenizer)  # the cache ferry's run built: the same tokens
    images = ImageProcessing(Path(cfg.model_name_or_path), cfg.image_max_pixels, cfg.image_min_pixels)
    token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    collate = partial(
        collate_with_token_count,
        pad_token_id=tokenizer.pad_token_id,
        causal=True,
        images=images,
        image_token_id=token_id,
    )

    def collator(examples: list[dict]) -> dict:
        batch = collate(examples)
        return {k: batch[k] for k in ("input_ids", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")}

    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(cfg.model_name_or_path, dtype=torch.float32)
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets))
    model.enable_input_require_grads()
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, D102
            stamps.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=str(Path(cfg.output_dir) / "peer"),
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        learning_rate=cfg.learning_rate,
        max_steps=cfg.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        remove_unused_columns=False,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=list(data.train), data_collator=collator, callbacks=[Stamp()]
    )
    trainer.train()
    samples = (len(stamps) - 1) * cfg.per_device_train_batch_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"samples_per_s": samples / (stamps[-1] - stamps[0]), "peak_rss_bytes": peak}))


def run(quick: bool = False, rounds: int | None = None, max_steps: int | None = None) -> list[dict]:
    """Alternating ferry / peer runs; the table rows."""
    rounds = rounds or (1 if quick else 2)
    max_steps = max_steps or (4 if quick else 12)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-vlm-"))
    try:
        model, data = work / "qwen2vl", work / "data"
        n_params = build_model(model)
        build_data(data)
        pairs = []
        for k in range(rounds):
            ours = run_ferry(work, model, data, max_steps, f"r{k}")
            theirs = run_peer(work, model, data, max_steps, f"r{k}")
            pairs.append((ours, theirs))
            print(
                f"[bench_vlm] round {k + 1}: ferry {ours[0]:.2f} samples/s, {ours[1] / 2**20:.0f} MiB; Trainer "
                f"{theirs[0]:.2f} samples/s, {theirs[1] / 2**20:.0f} MiB",
                file=sys.stderr,
            )
        label = f"vlm {n_params / 1e6:.1f}M Qwen2-VL, LoRA r8, 1 proc CPU, {max_steps} steps x {rounds}"
        speed = statistics.median(o[0] / t[0] for o, t in pairs)
        memory = statistics.median(o[1] / t[1] for o, t in pairs)
        return [
            {
                "metric": f"{label}: samples/s",
                "ferry": statistics.median(o[0] for o, _ in pairs),
                "peer": statistics.median(t[0] for _, t in pairs),
                "ratio": speed,
                "target": ">= 1.0x",
            },
            {
                "metric": f"{label}: peak RSS MiB",
                "ferry": statistics.median(o[1] for o, _ in pairs) / 2**20,
                "peer": statistics.median(t[1] for _, t in pairs) / 2**20,
                "ratio": memory,
                "target": "<= 0.8x",
            },
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--peer", help=argparse.SUPPRESS)  # the Trainer side's config (a child process)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer(Path(args.peer), Path(args.out))
        return
    from benchmarks.__main__ import format_table

    print(format_table(run(quick=args.quick, rounds=args.rounds, max_steps=args.max_steps)))


if __name__ == "__main__":
    main()
