"""Benchmark: FSDP (``fsdp: full_shard``) vs DDP in ``ferry train``: per-rank memory and tokens/s.

Both train the same LoRA (rank 8, alpha 16, every linear layer) on the same random-init Llama of about 400 MB
in fp32 (hidden 1024, 8 layers, intermediate 3072, the stories260K tokenizer, built in a temp dir from a fixed
seed) on LLaMA-Factory's alpaca_en_demo (default template), 2 processes on CPU under torchrun (gloo,
OMP_NUM_THREADS=1 each), AdamW, lr 1e-4, one run each (DDP first, then FSDP), in two workloads (``CASES``):
``checkpointing`` (activation checkpointing, as FSDP is used for a model that does not fit, and LLaMA-Factory's
default; micro-batches of 4 x 256 tokens) and ``small-batch`` (no checkpointing, 2 x 128 tokens).

Measured by the workers themselves (``train_report.json``):

- per-rank peak RSS: ``getrusage`` ru_maxrss of each worker (the frozen weights, the runtime, activations);
- parameter bytes per rank: the storage of every parameter a rank holds (its local shards under FSDP);
- tokens/s: non-padding tokens per second over optimizer steps 2..N from ``metrics.jsonl`` (step 1 excluded).

Beside the measured parameter bytes it prints ``ferry train --dry-run``'s estimate of the weights per rank
(``trainer.fsdp.estimate_memory``) and their ratio. Targets: FSDP's per-rank peak RSS <= 0.65x of DDP's,
tokens/s >= 0.8x of DDP's, the estimate within 20% of the measured parameter bytes.

Measured here (2 CPU cores shared with other jobs, 2026-11-24, 6 steps, ``trainer.fsdp.HostAllocator`` on):

- checkpointing: peak RSS per rank 850 vs 1485 MiB (0.57x), tokens/s 132 vs 140 (0.94x; 0.72x in a run with
  more load from other jobs);
- small-batch: peak RSS 1027 vs 1166 MiB (0.88x), tokens/s 174 vs 339 (0.51x): at 256 tokens a micro-batch the
  two all-gathers of the weights per step outweigh the compute on CPU, and the activations of every layer (about
  23 MiB each) plus ~370 MiB of imported libraries per process leave little for the halved weights to save;
- parameters per rank 195.4 vs 390.8 MiB in both, the dry-run estimate equal to both (ratio 1.000).

Before HostAllocator (glibc's default heap) FSDP's peak RSS was 1.05x of DDP's in the small-batch case and
0.99x in the checkpointing case: the freed gathered layers stayed in the process. DDP's peak is at load
(transformers maps the file and copies it).

Run: ``.venv/bin/python -m benchmarks.bench_fsdp [--quick] [--max-steps N]`` (default 6 steps; quick: 3).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_train import ALPACA, STORIES, _env, _rate

#: The benchmark model: Llama, 100.7M parameters = 403 MB in fp32 (8 x 12.6M per layer + 0.5M tied embeddings).
MODEL_CONFIG = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
SETTINGS = dict(gradient_accumulation_steps=1, learning_rate=1e-4, lora_rank=8, lora_alpha=16, seed=42, nproc=2)
#: The two workloads, each run by DDP and by FSDP. ``checkpointing`` is how FSDP is used (a model that does not
#: fit is trained with activation checkpointing, LLaMA-Factory's default), with micro-batches of 1,024 tokens;
#: ``small-batch`` keeps every activation (no checkpointing) at 256 tokens per micro-batch, where the
#: activations and the per-layer gathers weigh most against the halved weights.
CASES = {
    "checkpointing": dict(cutoff_len=256, per_device_train_batch_size=4, gradient_checkpointing=True),
    "small-batch": dict(cutoff_len=128, per_device_train_batch_size=2, gradient_checkpointing=False),
}


def build_model(folder: Path) -> int:
    """Write the random-init benchmark Llama (seed 0, fp32 safetensors) and the stories260K tokenizer to
    ``folder``; return the parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _config(work: Path, model: Path, mode: str, max_steps: int, case: str) -> Path:
    workload = CASES[case]
    config = {
        "model_name_or_path": str(model),
        "dataset": str(ALPACA),
        "template": "default",
        "cutoff_len": workload["cutoff_len"],
        "lora_rank": SETTINGS["lora_rank"],
        "lora_alpha": SETTINGS["lora_alpha"],
        "lora_target": "all",
        "per_device_train_batch_size": workload["per_device_train_batch_size"],
        "gradient_checkpointing": workload["gradient_checkpointing"],
        "gradient_accumulation_steps": SETTINGS["gradient_accumulation_steps"],
        "learning_rate": SETTINGS["learning_rate"],
        "max_steps": max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": str(work / f"out-{case}-{mode}"),
        "overwrite_output_dir": True,
        "resume_from_checkpoint": False,
        "seed": SETTINGS["seed"],
        "disable_tqdm": True,
        "report_to": "none",
        "fsdp": "full_shard" if mode == "fsdp" else "",
    }
    path = work / f"{case}-{mode}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def run_mode(work: Path, model: Path, mode: str, max_steps: int, case: str) -> dict:
    """One ``ferry train`` run (``mode`` ddp or fsdp); returns its train_report plus ``tokens_per_s``."""
    config = _config(work, model, mode, max_steps, case)
    log = work / f"{case}-{mode}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "ferry", "train", str(config), "--nproc-per-node", str(SETTINGS["nproc"])],
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ferry train ({mode}) failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    out_dir = work / f"out-{case}-{mode}"
    report = json.loads((out_dir / "train_report.json").read_text())
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r and r["step"] >= 2]
    report["tokens_per_s"] = _rate([(r["step"], r["elapsed_s"], r["tokens_seen"]) for r in rows])
    return report


def dry_run_estimate(work: Path, model: Path, case: str) -> dict:
    """``ferry train --dry-run``'s memory table (the launcher's own function, in this process)."""
    from trainer.launch import launch

    report = launch(_config(work, model, "fsdp", 2, case), nproc_per_node=SETTINGS["nproc"], dry_run=True, env=_env())
    assert report.memory is not None
    return report.memory


def run(quick: bool = False, max_steps: int | None = None, cases: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    """For each case, DDP then FSDP, one run each; the table rows."""
    max_steps = max_steps or (3 if quick else 6)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-fsdp-"))
    rows: list[dict] = []
    mib = 2**20
    try:
        model = work / "llama-400mb"
        n_params = build_model(model)
        for case in cases:
            estimate = dry_run_estimate(work, model, case)
            ddp = run_mode(work, model, "ddp", max_steps, case)
            fsdp = run_mode(work, model, "fsdp", max_steps, case)
            for name, rep in (("DDP", ddp), ("FSDP", fsdp)):
                print(
                    f"[bench_fsdp] {case} {name}: peak RSS per rank "
                    f"{[round(x / mib) for x in rep['peak_rss_bytes_per_rank']]} MiB, parameters per rank "
                    f"{[round(x / mib, 1) for x in rep['param_bytes_per_rank']]} MiB (dry-run estimate "
                    f"{estimate[name.lower()]['weights'] / mib:.1f} MiB), {rep['tokens_per_s']:.0f} tokens/s",
                    file=sys.stderr,
                )
            w = CASES[case]
            label = (
                f"{case}: {n_params / 1e6:.1f}M Llama fp32, LoRA r8, 2 procs CPU, "
                f"{w['per_device_train_batch_size']}x{w['cutoff_len']} tokens"
            )
            rss = (max(fsdp["peak_rss_bytes_per_rank"]), max(ddp["peak_rss_bytes_per_rank"]))
            rows += [
                {
                    "metric": f"{label}: peak RSS per rank, MiB",
                    "ferry": rss[0] / mib,
                    "peer": rss[1] / mib,
                    "ratio": rss[0] / rss[1],
                    "target": "<= 0.65 (peer: DDP)",
                },
                {
                    "metric": f"{case}: train tokens/s (steps 2..N)",
                    "ferry": fsdp["tokens_per_s"],
                    "peer": ddp["tokens_per_s"],
                    "ratio": fsdp["tokens_per_s"] / ddp["tokens_per_s"],
                    "target": ">= 0.8 (peer: DDP)",
                },
            ]
            for mode, rep in (("fsdp", fsdp), ("ddp", ddp)):
                measured = max(rep["param_bytes_per_rank"])
                rows.append(
                    {
                        "metric": f"{case}: {mode} parameter MiB per rank, dry-run estimate vs measured",
                        "ferry": estimate[mode]["weights"] / mib,
                        "peer": measured / mib,
                        "ratio": estimate[mode]["weights"] / measured,
                        "target": "0.8 .. 1.2",
                    }
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument(
        "--case", choices=sorted(CASES), action="append", help="workload(s) to run (default: all); see CASES"
    )
    args = parser.parse_args(argv)
    from benchmarks.__main__ import format_table

    print(format_table(run(quick=args.quick, max_steps=args.max_steps, cases=tuple(args.case or CASES))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
