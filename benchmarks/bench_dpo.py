"""Benchmark: ``ferry train`` with ``stage: dpo`` vs trl's ``DPOTrainer`` + peft, side by side in one run.

Both sides train the same LoRA (rank 8, alpha 16, every linear layer, no dropout) with the sigmoid DPO loss (beta
0.1), in fp32 without gradient checkpointing (trl's DPOConfig defaults to bf16 and checkpointing; both are set
off), on the same random-init Llama (hidden 512, 2 layers, untied head, the stories260K tokenizer, built in a temp
dir from a fixed seed) at two vocabulary sizes, 32,000 (Llama 2) and 151,936 (Qwen), in one CPU process each,
fp32, batch 4 pairs, no gradient accumulation, no gradient checkpointing, lr 1e-4. Neither keeps a second copy of
the weights: the reference is the model with its adapter disabled on both sides.

The pairs: alpaca_en_demo rows (``../shared/assets``), the prompt its instruction, chosen its output, rejected the
next row's output, both repeated until the pair is longer than ``--cutoff`` (so most rows are cut to it). ferry
reads them as a LLaMA-Factory ``ranking`` dataset (alpaca columns) with the ``default`` template; trl gets the
same rows as plain ``prompt``/``chosen``/``rejected`` text in that template's words, truncated to ``max_length``.

Measured per side: tokens/s over optimizer steps 2..N (non-padding tokens of the chosen and rejected rows the
policy's forward sees: ferry's ``tokens_seen``; for trl a forward pre-hook on the base model counting the
attention mask under grad, so its reference forward is not counted) and the process's peak RSS (``ru_maxrss``:
ferry's ``train_report.json``, trl's written after ``train()``). Printed: the ratios ferry / trl. Goals (at the
151,936 vocabulary): tokens/s >= 1.1x trl's, peak RSS <= 0.5x.

``--precompute``: both sides compute the reference's log-probabilities of every pair once before training
(ferry's and trl's ``precompute_ref_log_probs``, batches of 4 pairs on both sides), so the steps run the policy
only; the rows then also give each side's tokens/s relative to its own run with the live reference, and ferry's
precompute time (from its log line).

Run: ``.venv/bin/python -m benchmarks.bench_dpo [--quick] [--precompute] [--cutoff N] [--steps N]`` (default cutoff
256, 6 steps; ``--quick``: cutoff 128, 4 steps, the 32,000 vocabulary only).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench_memory
from benchmarks.common import ALPACA, STORIES, run_to_log

#: One process per side on the 2-core machine: two threads each.
THREADS = 2

#: bench_memory's Llama (hidden 512, 2 layers, untied head), its vocabulary set per run.
MODEL_CONFIG = {k: v for k, v in bench_memory.MODEL_CONFIG.items() if k != "vocab_size"}
VOCABS = (32000, 151936)
BATCH, LORA_RANK, LORA_ALPHA, BETA, LR, PAIRS = 4, 8, 16, 0.1, 1e-4, 64
GOALS = {"tokens_per_s": 1.1, "peak_rss": 0.5}


def build_model(folder: Path, vocab: int) -> int:
    """Write the random-init benchmark Llama (seed 0) with ``vocab`` rows and the stories260K tokenizer (its ids
    all fall inside either vocabulary); return the parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG, vocab_size=vocab))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_pairs(folder: Path, cutoff: int) -> Path:
    """``folder/pairs.json`` (alpaca ranking columns) and its ``dataset_info.json`` entry ``bench_pairs``."""
    rows = json.loads(ALPACA.read_text())[: PAIRS + 1]

    def long(text: str) -> str:
        text = text or "Once upon a time."
        return " ".join([text] * (cutoff * 4 // max(len(text), 1) + 2))

    pairs = [
        {"instruction": a["instruction"], "input": "", "chosen": long(a["output"]), "rejected": long(b["output"])}
        for a, b in zip(rows, rows[1:])
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pairs.json").write_text(json.dumps(pairs))
    columns = {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}
    info = {"bench_pairs": {"file_name": "pairs.json", "ranking": True, "columns": columns}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def _rate(points: list[tuple[int, float, float]]) -> float:
    """Tokens/s from the first to the last of ``(step, seconds, cumulative tokens)``, step 1 left out."""
    points = sorted(p for p in points if p[0] >= 1)
    (_, t0, n0), (_, t1, n1) = points[0], points[-1]
    return (n1 - n0) / (t1 - t0)


def run_ferry(work: Path, model: Path, data: Path, cutoff: int, steps: int, precompute: bool) -> dict[str, float]:
    """One ``ferry train`` (stage dpo, one process); tokens/s, peak RSS bytes and (``precompute``) the seconds its
    precompute took."""
    out = work / ("ferry-pre" if precompute else "ferry")
    config = {
        "model_name_or_path": str(model),
        "stage": "dpo",
        "dataset": "bench_pairs",
        "dataset_dir": str(data),
        "template": "default",
        "cutoff_len": cutoff,
        "pref_beta": BETA,
        "pref_loss": "sigmoid",
        "lora_rank": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_target": "all",
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "learning_rate": LR,
        "max_steps": steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "seed": 42,
        "disable_tqdm": True,
        "report_to": "none",
        "disable_gradient_checkpointing": True,
    }
    if precompute:
        config.update(precompute_ref_log_probs=True, precompute_ref_batch_size=BATCH)
    cfg_path = out.with_suffix(".yaml")
    cfg_path.write_text(json.dumps(config))
    log = out.with_suffix(".log")
    run_to_log([sys.executable, "-m", "ferry", "train", str(cfg_path), "--nproc-per-node", "1"], log, THREADS)
    said = re.search(r"precomputed in ([0-9.]+) s", log.read_text(errors="replace"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "tokens_seen" in r and "loss" in r]
    report = json.loads((out / "train_report.json").read_text())
    return {
        "tokens_per_s": _rate([(r["step"], r["elapsed_s"], r["tokens_seen"]) for r in rows]),
        "peak_rss_bytes": max(report["peak_rss_bytes_per_rank"]),
        "first_loss": rows[0]["loss"],
        "precompute_s": float(said.group(1)) if said else float("nan"),
    }


def run_trl(work: Path, model: Path, data: Path, cutoff: int, steps: int, precompute: bool) -> dict[str, float]:
    """One trl ``DPOTrainer`` + peft process (:func:`trl_main`); tokens/s and peak RSS bytes."""
    out = work / ("trl-pre" if precompute else "trl")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer", str(model), str(data), str(out)]
    cmd += ["--cutoff", str(cutoff), "--steps", str(steps), *(["--precompute"] if precompute else [])]
    run_to_log(cmd, out.with_suffix(".log"), THREADS)
    steps_seen = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x.strip()]
    result = json.loads((out / "result.json").read_text())
    return {
        "tokens_per_s": _rate([(r["step"], r["t"], r["tokens"]) for r in steps_seen]),
        "peak_rss_bytes": result["peak_rss_bytes"],
        "first_loss": result["first_loss"],
    }


def trl_main(model_dir: str, data: str, out: str, cutoff: int, steps: int, precompute: bool = False) -> None:
    """trl's ``DPOTrainer`` with a peft ``LoraConfig`` on the pairs of ``data``, as a trl script runs it."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    folder = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    rows = json.loads((Path(data) / "pairs.json").read_text())
    dataset = Dataset.from_list(
        [
            {"prompt": f"Human: {r['instruction']}\nAssistant:", "chosen": r["chosen"], "rejected": r["rejected"]}
            for r in rows
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    seen = {"tokens": 0}

    def count(_module: object, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # the policy's forward; the reference's runs under no_grad
            mask = kwargs.get("attention_mask")
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen["tokens"] += int(mask.sum()) if mask is not None else int(ids.numel())

    model.model.register_forward_pre_hook(count, with_kwargs=True)
    log = (folder / "steps.jsonl").open("a", encoding="utf-8")
    losses: list[float] = []
    start = {"t": 0.0}

    class Steps(TrainerCallback):
        def on_train_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
            start["t"] = time.perf_counter()

        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            step = state.global_step  # type: ignore[attr-defined]
            t = time.perf_counter() - start["t"]
            log.write(json.dumps({"step": step, "t": t, "tokens": seen["tokens"]}) + "\n")
            log.flush()

        def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **kw: object) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=cutoff,
        use_cpu=True,
        bf16=False,  # trl's default is True (and gradient_checkpointing's): the benchmark runs both sides in fp32
        gradient_checkpointing=False,
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        precompute_ref_log_probs=precompute,
        precompute_ref_batch_size=BATCH if precompute else None,
    )
    lora = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=[Steps()]
    )
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (folder / "result.json").write_text(json.dumps({"peak_rss_bytes": peak, "first_loss": losses[0]}))


def _rows(label: str, vocab: int, ferry: dict[str, float], peer: dict[str, float], goal: bool) -> list[dict]:
    """The table rows of one side-by-side pair of runs: tokens/s, peak RSS, step-1 loss."""
    return [
        {
            "metric": f"dpo: tokens/s ({label})",
            "ferry": ferry["tokens_per_s"],
            "peer": peer["tokens_per_s"],
            "ratio": ferry["tokens_per_s"] / peer["tokens_per_s"],
            "target": f">= {GOALS['tokens_per_s']}" if goal else None,
        },
        {
            "metric": f"dpo: peak RSS, GiB ({label})",
            "ferry": ferry["peak_rss_bytes"] / 2**30,
            "peer": peer["peak_rss_bytes"] / 2**30,
            "ratio": ferry["peak_rss_bytes"] / peer["peak_rss_bytes"],
            "target": f"<= {GOALS['peak_rss']}" if goal else None,
        },
        {
            "metric": f"dpo: step-1 loss, ln 2 = 0.6931 (vocab {vocab:,})",
            "ferry": ferry["first_loss"],
            "peer": peer["first_loss"],
            "ratio": None,
            "target": None,
        },
    ]


def run(
    quick: bool = False, cutoff: int | None = None, steps: int | None = None, precompute: bool = False
) -> list[dict]:
    """Both sides at each vocabulary (``quick``: cutoff 128, 4 steps, 32,000 only; else cutoff 256, 6 steps, both),
    and with ``precompute`` both sides again with the reference precomputed; rows for ``python -m benchmarks``'s
    table."""
    cutoff = cutoff or (128 if quick else 256)
    steps = steps or (4 if quick else 6)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ferry-bench-dpo-") as tmp:
        work = Path(tmp)
        data = write_pairs(work / "data", cutoff)
        for vocab in VOCABS[:1] if quick else VOCABS:
            model = work / f"model-{vocab}"
            params = build_model(model, vocab)
            here = work / f"v{vocab}"
            here.mkdir()
            ferry = run_ferry(here, model, data, cutoff, steps, precompute=False)
            peer = run_trl(here, model, data, cutoff, steps, precompute=False)
            print(f"[bench_dpo] vocab {vocab}: ferry {ferry}, trl {peer}", file=sys.stderr)
            label = f"{params / 1e6:.0f}M Llama, vocab {vocab:,}, cutoff {cutoff}, batch {BATCH} pairs, 1 CPU proc"
            rows += _rows(label, vocab, ferry, peer, goal=vocab == VOCABS[-1])
            if not precompute:
                continue
            ferry_pre = run_ferry(here, model, data, cutoff, steps, precompute=True)
            peer_pre = run_trl(here, model, data, cutoff, steps, precompute=True)
            print(f"[bench_dpo] vocab {vocab} precomputed: ferry {ferry_pre}, trl {peer_pre}", file=sys.stderr)
            rows += _rows(f"reference precomputed, {label}", vocab, ferry_pre, peer_pre, goal=False)[:2]
            for side, pre, live in (("ferry", ferry_pre, ferry), ("trl", peer_pre, peer)):
                rows.append(
                    {
                        "metric": f"dpo: {side} tokens/s, precomputed (ferry col.) vs live (vocab {vocab:,})",
                        "ferry": pre["tokens_per_s"],
                        "peer": live["tokens_per_s"],
                        "ratio": pre["tokens_per_s"] / live["tokens_per_s"],
                        "target": None,
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cutoff", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--precompute", action="store_true")
    parser.add_argument("--peer", nargs=3, metavar=("MODEL", "DATA", "OUT"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.peer:
        trl_main(*ns.peer, cutoff=ns.cutoff, steps=ns.steps, precompute=ns.precompute)
        return 0
    from benchmarks.__main__ import format_table

    print(format_table(run(quick=ns.quick, cutoff=ns.cutoff, steps=ns.steps, precompute=ns.precompute)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
