"""Benchmark: QLoRA (``quantization_bit: 4``, NF4 + double quantisation, bitsandbytes) vs plain LoRA, in one run.

Both sides train the same LoRA (rank 8, alpha 16, every linear layer) with ``ferry train`` under torchrun, 2
processes on CPU (gloo, OMP_NUM_THREADS=1 each), on benchmarks/bench_fsdp.py's random-init Llama of 100.7M
parameters (403 MB in fp32) and LLaMA-Factory's alpaca_en_demo (cutoff_len 128, batch 2 per process, gradient
checkpointing, lr 1e-4, seed 42). Reported per side, from ``train_report.json`` and ``metrics.jsonl``:

- model + optimizer bytes per rank: the parameters a rank holds (``param_bytes_per_rank``: packed 4-bit weights
  with their scales, or fp32 weights, plus the fp32 LoRA weights) + AdamW's two fp32 moments of the trainable
  parameters; goal: QLoRA <= 0.45x of LoRA's;
- peak RSS per rank (the whole process: libraries, activations, the load-time copy);
- tokens/s over steps 2..N (CPU: bitsandbytes dequantises every 4-bit weight per matmul, so QLoRA is slower here;
  on a GPU the dequantisation kernel is what users see);
- the loss gap after N steps: QLoRA's final train loss minus LoRA's (same data order and adapter init).

Measured here (2 shared CPU cores, ``--max-steps 10``, 2026-11-24): model+optimizer 64.3 vs 400.3 MiB per rank
(0.161x), peak RSS 1450 vs 1287 MiB (1.13x: the full-precision checkpoint is read before it is quantised, and that
load is the peak on CPU), 52.6 vs 59.6 tokens/s (0.88x), final train loss 6.437 vs 6.436 (gap 0.001).

Run: ``.venv/bin/python -m benchmarks.bench_qlora [--quick] [--max-steps N]`` (default 50 steps; quick: 5).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_fsdp import build_model
from benchmarks.bench_train import ALPACA, _env, _rate

SETTINGS = dict(cutoff_len=128, per_device_train_batch_size=2, lora_rank=8, lora_alpha=16, learning_rate=1e-4,
                seed=42, nproc=2)


def _config(work: Path, model: Path, quantized: bool, max_steps: int) -> Path:
    name = "qlora" if quantized else "lora"
    config = {
        "model_name_or_path": str(model), "dataset": str(ALPACA), "template": "default",
        "cutoff_len": SETTINGS["cutoff_len"], "lora_rank": SETTINGS["lora_rank"],
        "lora_alpha": SETTINGS["lora_alpha"], "lora_target": "all",
        "per_device_train_batch_size": SETTINGS["per_device_train_batch_size"],
        "learning_rate": SETTINGS["learning_rate"], "max_steps": max_steps, "logging_steps": 1,
        "save_strategy": "no", "output_dir": str(work / f"out-{name}"), "overwrite_output_dir": True,
        "resume_from_checkpoint": False, "seed": SETTINGS["seed"], "disable_tqdm": True, "report_to": "none",
    }
    if quantized:
        config.update(quantization_bit=4, quantization_method="bnb", quantization_type="nf4",
                      double_quantization=True)
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def run_side(work: Path, model: Path, quantized: bool, max_steps: int) -> dict:
    """One ``ferry train`` run; its train_report plus ``tokens_per_s`` and ``model_optimizer_bytes``."""
    config = _config(work, model, quantized, max_steps)
    log = work / f"{config.stem}.log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, "-m", "ferry", "train", str(config), "--nproc-per-node",
                               str(SETTINGS["nproc"])], env=_env(), stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"ferry train ({config.stem}) failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    out_dir = work / f"out-{config.stem}"
    report = json.loads((out_dir / "train_report.json").read_text())
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r and r["step"] >= 2]
    report["tokens_per_s"] = _rate([(r["step"], r["elapsed_s"], r["tokens_seen"]) for r in rows])
    report["model_optimizer_bytes"] = max(report["param_bytes_per_rank"]) + 8 * report["trainable_params"]
    return report


def run(quick: bool = False, max_steps: int | None = None) -> list[dict]:
    """LoRA then QLoRA, one run each; the table rows (ferry = QLoRA, peer = plain LoRA)."""
    max_steps = max_steps or (5 if quick else 50)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-qlora-"))
    mib = 2 ** 20
    try:
        model = work / "llama-400mb"
        n_params = build_model(model)
        lora = run_side(work, model, False, max_steps)
        qlora = run_side(work, model, True, max_steps)
        for name, rep in (("LoRA", lora), ("QLoRA", qlora)):
            print(f"[bench_qlora] {name}: peak RSS per rank {[round(x / mib) for x in rep['peak_rss_bytes_per_rank']]}"
                  f" MiB, parameters per rank {[round(x / mib, 1) for x in rep['param_bytes_per_rank']]} MiB, "
                  f"model+optimizer {rep['model_optimizer_bytes'] / mib:.1f} MiB, {rep['tokens_per_s']:.0f} "
                  f"tokens/s, loss {rep['train_loss_first']:.4f} -> {rep['train_loss_final']:.4f}", file=sys.stderr)
        label = f"{n_params / 1e6:.1f}M Llama, LoRA r8, 2 procs CPU, {max_steps} steps"
        rss = (max(qlora["peak_rss_bytes_per_rank"]), max(lora["peak_rss_bytes_per_rank"]))
        share = (qlora["model_optimizer_bytes"], lora["model_optimizer_bytes"])
        return [
            {"metric": f"qlora {label}: model+optimizer MiB/rank (QLoRA vs LoRA)", "ferry": share[0] / mib,
             "peer": share[1] / mib, "ratio": share[0] / share[1], "target": "<= 0.45x"},
            {"metric": f"qlora {label}: peak RSS MiB/rank", "ferry": rss[0] / mib, "peer": rss[1] / mib,
             "ratio": rss[0] / rss[1], "target": "report"},
            {"metric": f"qlora {label}: tokens/s", "ferry": qlora["tokens_per_s"], "peer": lora["tokens_per_s"],
             "ratio": qlora["tokens_per_s"] / lora["tokens_per_s"], "target": "report (CPU dequantises)"},
            {"metric": f"qlora {label}: final train loss", "ferry": qlora["train_loss_final"],
             "peer": lora["train_loss_final"], "ratio": qlora["train_loss_final"] - lora["train_loss_final"],
             "target": "report (ratio column = gap)"},
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()
    from benchmarks.__main__ import format_table

    print(format_table(run(quick=args.quick, max_steps=args.max_steps)))


if __name__ == "__main__":
    main()
