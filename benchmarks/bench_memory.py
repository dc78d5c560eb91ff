"""Benchmark: peak memory of a step with a large vocabulary, ``ferry train`` vs transformers' ``Trainer`` + peft.

The largest tensor of a step is the logits, ``[batch, seq_len, vocab]``. Both sides train the same LoRA (rank 8,
every linear layer) on a random-init Llama with Qwen's 151,936-token vocabulary (hidden 512, 2 layers, the
stories260K tokenizer's ids; built from a fixed seed in a temp dir), on LLaMA-Factory's alpaca_en_demo packed
into full rows of ``cutoff_len`` tokens, 2 processes on CPU under torchrun (gloo), no gradient checkpointing on
either side (Trainer's default). ferry computes the loss from the last hidden states a chunk of positions at a
time (trainer/loss.py); the peer's model computes the whole logits and transformers' loss.

Measured: peak RSS per rank (the larger of the two ranks): ferry's ``train_report.json``
(``peak_rss_bytes_per_rank``), the peer's ``resource.getrusage`` maximum written by each rank at the end; and
tokens/s of each side (report). The goal in the issue: ferry <= 0.25x of the peer at cutoff 1024, batch 4.

Run: ``.venv/bin/python -m benchmarks.bench_memory [--cutoff 1024] [--batch 4] [--steps 3]``. The full size
needs about 2 x 11 GB for the peer: on a smaller machine pass a smaller --cutoff / --batch.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_train import ALPACA, STORIES, _env

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936
MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def build_model(folder: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(folder)


def run_ferry(work: Path, model: Path, cutoff: int, batch: int, steps: int) -> tuple[int, float]:
    """(peak RSS bytes of the larger rank, tokens/s)."""
    out = work / "ferry"
    config = {"model_name_or_path": str(model), "dataset": str(ALPACA), "template": "default", "cutoff_len": cutoff,
              "packing": True, "lora_rank": 8, "lora_alpha": 16, "lora_target": "all",
              "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1, "max_steps": steps,
              "logging_steps": 1, "save_strategy": "no", "output_dir": str(out), "overwrite_output_dir": True,
              "seed": 42, "disable_tqdm": True, "report_to": "none", "disable_gradient_checkpointing": True}
    cfg = work / "ferry.yaml"
    cfg.write_text(json.dumps(config))
    subprocess.run([sys.executable, "-m", "ferry", "train", str(cfg), "--nproc-per-node", "2"], cwd=ROOT, env=_env(),
                   check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "train_report.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"tokens_seen"' in x]
    rate = (rows[-1]["tokens_seen"] - rows[0]["tokens_seen"]) / max(rows[-1]["elapsed_s"] - rows[0]["elapsed_s"], 1e-9)
    return int(max(report["peak_rss_bytes_per_rank"])), rate


def run_peer(work: Path, model: Path, cutoff: int, batch: int, steps: int) -> tuple[int, float]:
    out = work / "peer"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(Path(__file__).resolve()), "--peer", "--model", str(model), "--out", str(out),
                    "--cutoff", str(cutoff), "--batch", str(batch), "--steps", str(steps)],
                   cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return max(r["peak_rss_bytes"] for r in ranks), sum(r["tokens_per_s"] for r in ranks)


def _peer_worker(model_dir: str, out: str, cutoff: int, batch: int, steps: int) -> None:
    import os
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for row in json.loads(ALPACA.read_text()):  # packed into full rows, every token trained
        ids += tokenizer.encode(row["instruction"] + row["input"] + row["output"]) + [tokenizer.eos_token_id]
    dataset = [{"input_ids": ids[i:i + cutoff], "labels": ids[i:i + cutoff]}
               for i in range(0, len(ids) - cutoff, cutoff)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    clock = {}

    class Rate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.setdefault("first", (state.global_step, time.perf_counter()))
            clock["last"] = (state.global_step, time.perf_counter())

    def collate(rows: list[dict]) -> dict:
        return {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "labels")}

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, save_strategy="no",
                             report_to="none", ddp_backend="gloo", use_cpu=True, disable_tqdm=True, seed=42,
                             remove_unused_columns=False, ddp_find_unused_parameters=False, logging_steps=1)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[Rate()]).train()
    (s0, t0), (s1, t1) = clock["first"], clock["last"]
    rate = (s1 - s0) * batch * cutoff / max(t1 - t0, 1e-9)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_rss_bytes": peak, "tokens_per_s": rate}))


def run(cutoff: int = 1024, batch: int = 4, steps: int = 3) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        build_model(work / "model")
        ferry_rss, ferry_rate = run_ferry(work, work / "model", cutoff, batch, steps)
        peer_rss, peer_rate = run_peer(work, work / "model", cutoff, batch, steps)
    gib = 1024 ** 3
    logits = batch * cutoff * VOCAB * 4 / gib
    return [
        {"metric": f"peak RSS per rank, GiB (vocab {VOCAB}, cutoff {cutoff}, batch {batch}; fp32 logits "
                   f"{logits:.2f} GiB)", "ferry": round(ferry_rss / gib, 2), "peer": round(peer_rss / gib, 2),
         "ratio": round(ferry_rss / peer_rss, 3), "target": "<= 0.25 at cutoff 1024, batch 4"},
        {"metric": "tokens/s (2 ranks)", "ferry": round(ferry_rate), "peer": round(peer_rate),
         "ratio": round(ferry_rate / peer_rate, 3), "target": "report"},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--cutoff", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.peer:
        _peer_worker(args.model, args.out, args.cutoff, args.batch, args.steps)
        return 0
    from benchmarks.__main__ import format_table

    print(format_table(run(args.cutoff, args.batch, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
