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

Measured here (2 shared CPU cores at load ~10, 50 steps, 2026-11-25): model+optimizer 64.3 vs 400.3 MiB per rank
(0.161x), peak RSS 1.07x of LoRA's (the full-precision checkpoint is read before it is quantised, and that load is
the peak on CPU), tokens/s 0.78x, final train loss 5.356 vs 5.353 (gap 0.003). ``--backends --max-steps 10``
(torchao 0.18.0): 4-bit weight bytes 1.001x of torchao's, the same relative quantisation error (0.0920) and final
loss; tokens/s 0.98x with ``--rounds 2`` (load ~9) and 1.59x with ``--rounds 3`` (load ~5), peak RSS 1.02x / 0.91x.

Run: ``.venv/bin/python -m benchmarks.bench_qlora [--quick] [--max-steps N]`` (default 50 steps; quick: 5).

``--backends`` compares the two 4-bit weight formats ferry could train over, bitsandbytes' ``Linear4bit`` (NF4,
blocks of 64, double quantisation: what ferry uses) and torchao's ``NF4Tensor`` (``to_nf4``: NF4, blocks of 64,
int8 block scales in groups of 256), on the same model, LoRA, batches and optimizer: one process each (1 thread),
run alternately ``--rounds`` times, each in its own child process. Per side: the bytes of the quantised linear
weights (packed data + scales), peak RSS, RSS after training, tokens/s over steps 2..N, the relative quantisation
error ``||W - dequant(quant(W))||_F / ||W||_F`` over all quantised weights, and the final loss. torchao is not a
ferry dependency: ``pip install torchao==0.18.0`` (checked against torch 2.13's CPU wheel) into the venv, or
``--torchao-path DIR`` for a ``pip install --target DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_fsdp import build_model
from benchmarks.bench_train import ALPACA, _env, _rate

SETTINGS = dict(
    cutoff_len=128, per_device_train_batch_size=2, lora_rank=8, lora_alpha=16, learning_rate=1e-4, seed=42, nproc=2
)


def _config(work: Path, model: Path, quantized: bool, max_steps: int) -> Path:
    name = "qlora" if quantized else "lora"
    config = {
        "model_name_or_path": str(model),
        "dataset": str(ALPACA),
        "template": "default",
        "cutoff_len": SETTINGS["cutoff_len"],
        "lora_rank": SETTINGS["lora_rank"],
        "lora_alpha": SETTINGS["lora_alpha"],
        "lora_target": "all",
        "per_device_train_batch_size": SETTINGS["per_device_train_batch_size"],
        "learning_rate": SETTINGS["learning_rate"],
        "max_steps": max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": str(work / f"out-{name}"),
        "overwrite_output_dir": True,
        "resume_from_checkpoint": False,
        "seed": SETTINGS["seed"],
        "disable_tqdm": True,
        "report_to": "none",
    }
    if quantized:
        config.update(quantization_bit=4, quantization_method="bnb", quantization_type="nf4", double_quantization=True)
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def run_side(work: Path, model: Path, quantized: bool, max_steps: int) -> dict:
    """One ``ferry train`` run; its train_report plus ``tokens_per_s`` and ``model_optimizer_bytes``."""
    config = _config(work, model, quantized, max_steps)
    log = work / f"{config.stem}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "ferry", "train", str(config), "--nproc-per-node", str(SETTINGS["nproc"])],
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
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
    mib = 2**20
    try:
        model = work / "llama-400mb"
        n_params = build_model(model)
        lora = run_side(work, model, False, max_steps)
        qlora = run_side(work, model, True, max_steps)
        for name, rep in (("LoRA", lora), ("QLoRA", qlora)):
            print(
                f"[bench_qlora] {name}: peak RSS per rank {[round(x / mib) for x in rep['peak_rss_bytes_per_rank']]}"
                f" MiB, parameters per rank {[round(x / mib, 1) for x in rep['param_bytes_per_rank']]} MiB, "
                f"model+optimizer {rep['model_optimizer_bytes'] / mib:.1f} MiB, {rep['tokens_per_s']:.0f} "
                f"tokens/s, loss {rep['train_loss_first']:.4f} -> {rep['train_loss_final']:.4f}",
                file=sys.stderr,
            )
        label = f"{n_params / 1e6:.1f}M Llama, LoRA r8, 2 procs CPU, {max_steps} steps"
        rss = (max(qlora["peak_rss_bytes_per_rank"]), max(lora["peak_rss_bytes_per_rank"]))
        share = (qlora["model_optimizer_bytes"], lora["model_optimizer_bytes"])
        return [
            {
                "metric": f"qlora {label}: model+optimizer MiB/rank (QLoRA vs LoRA)",
                "ferry": share[0] / mib,
                "peer": share[1] / mib,
                "ratio": share[0] / share[1],
                "target": "<= 0.45x",
            },
            {
                "metric": f"qlora {label}: peak RSS MiB/rank",
                "ferry": rss[0] / mib,
                "peer": rss[1] / mib,
                "ratio": rss[0] / rss[1],
                "target": "report",
            },
            {
                "metric": f"qlora {label}: tokens/s",
                "ferry": qlora["tokens_per_s"],
                "peer": lora["tokens_per_s"],
                "ratio": qlora["tokens_per_s"] / lora["tokens_per_s"],
                "target": "report (CPU dequantises)",
            },
            {
                "metric": f"qlora {label}: final train loss",
                "ferry": qlora["train_loss_final"],
                "peer": lora["train_loss_final"],
                "ratio": qlora["train_loss_final"] - lora["train_loss_final"],
                "target": "report (ratio column = gap)",
            },
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------- bitsandbytes vs torchao NF4 (--backends)


def _quantized_bytes(weight) -> int:
    """Bytes a 4-bit weight holds: bitsandbytes' packed data + its quant state (absmax, nested absmax and code
    tables), or torchao NF4Tensor's inner tensors (packed data, int8 scalers, their fp32 factors, the NF4 table)."""
    state = getattr(weight, "quant_state", None)
    if state is not None:
        total = weight.data.nbytes + state.absmax.nbytes + state.code.nbytes
        if state.nested:
            total += state.state2.absmax.nbytes + state.state2.code.nbytes
        return total
    names, _ = weight.__tensor_flatten__()
    return sum(getattr(weight, name).nbytes for name in names)


def _dequantized(weight) -> torch.Tensor:  # noqa: F821 - torch is imported in the child
    state = getattr(weight, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as F

        return F.dequantize_4bit(weight.data, state).float()
    return weight.get_original_weight().float()


def backend_side(backend: str, model: Path, steps: int) -> dict:
    """One side of ``--backends`` in this process: load ``model`` with every linear layer but the head in 4-bit
    NF4 (``bnb``: transformers' BitsAndBytesConfig, as ferry loads; ``torchao``: the fp32 model, then each weight
    replaced by ``torchao.quantization.to_nf4`` of it), LoRA r8 on every linear layer, gradient checkpointing,
    AdamW lr 1e-4, ``steps`` steps of 2 x 128 random tokens (seeded). Returns the figures (bytes, tokens/s)."""
    import resource
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.set_num_threads(1)
    torch.manual_seed(SETTINGS["seed"])
    if backend == "bnb":
        from trainer.quant import disable_cpu_inference_repack

        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        base = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, quantization_config=quant, device_map={"": "cpu"}
        )
        disable_cpu_inference_repack(base)
    else:
        from torchao.quantization import to_nf4

        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight = torch.nn.Parameter(to_nf4(module.weight.data), requires_grad=False)
    quantized = {
        name: module.weight
        for name, module in base.named_modules()
        if name != "lm_head"
        and hasattr(module, "weight")
        and (hasattr(module.weight, "quant_state") or hasattr(module.weight, "get_original_weight"))
    }
    weight_bytes = sum(_quantized_bytes(w) for w in quantized.values())
    for param in base.parameters():
        param.requires_grad_(False)
    base.config.use_cache = False
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=SETTINGS["lora_rank"], lora_alpha=SETTINGS["lora_alpha"], target_modules="all-linear", lora_dropout=0.0
        ),
    )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=SETTINGS["learning_rate"])
    gen = torch.Generator().manual_seed(7)
    batches = [
        torch.randint(3, 512, (SETTINGS["per_device_train_batch_size"], SETTINGS["cutoff_len"]), generator=gen)
        for _ in range(steps)
    ]
    peft_model.train()
    times, losses = [], []
    for ids in batches:
        started = time.perf_counter()
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    tokens = SETTINGS["per_device_train_batch_size"] * SETTINGS["cutoff_len"]
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:
        rss_now = int(statm.read().split()[1]) * page
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    original = load_file(str(model / "model.safetensors"))  # after the memory figures: it is 4 bytes a weight
    err = sq = 0.0
    for name, weight in quantized.items():
        w = original[name + ".weight"].float()
        err += float((w - _dequantized(weight)).pow(2).sum())
        sq += float(w.pow(2).sum())
    return {
        "backend": backend,
        "quantized_weights": len(quantized),
        "weight_bytes": weight_bytes,
        "weight_count": sum(original[n + ".weight"].numel() for n in quantized),
        "rel_error": (err / sq) ** 0.5,
        "peak_rss": peak_rss,
        "rss_after": rss_now,
        "tokens_per_s": tokens * (len(times) - 1) / sum(times[1:]),
        "loss_first": losses[0],
        "loss_final": losses[-1],
    }


def run_backends(max_steps: int = 20, rounds: int = 2, torchao_path: str | None = None) -> list[dict]:
    """bitsandbytes vs torchao NF4, alternated ``rounds`` times (bnb, torchao, bnb, ...) on one model; the table
    rows (ferry's choice bitsandbytes = "ferry", torchao = "peer"), medians over the rounds."""
    import statistics

    work = Path(tempfile.mkdtemp(prefix="ferry-bench-qbackends-"))
    env = _env()
    if torchao_path:
        env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + torchao_path
    try:
        model = work / "llama-400mb"
        n_params = build_model(model)
        results: dict[str, list[dict]] = {"bnb": [], "torchao": []}
        for _ in range(rounds):
            for backend in ("bnb", "torchao"):
                out = work / f"{backend}.json"
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.bench_qlora",
                        "--side",
                        backend,
                        "--model",
                        str(model),
                        "--max-steps",
                        str(max_steps),
                        "--out",
                        str(out),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"{backend} side failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                results[backend].append(json.loads(out.read_text()))
                print(f"[bench_qlora --backends] {json.dumps(results[backend][-1])}", file=sys.stderr)
        med = {
            b: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
            for b, rs in results.items()
        }
        mib = 2**20
        label = f"nf4 {n_params / 1e6:.1f}M Llama, LoRA r8, 1 proc CPU, {max_steps} steps x {rounds}"
        b, t = med["bnb"], med["torchao"]
        return [
            {
                "metric": f"{label}: 4-bit weight MiB (bnb vs torchao)",
                "ferry": b["weight_bytes"] / mib,
                "peer": t["weight_bytes"] / mib,
                "ratio": b["weight_bytes"] / t["weight_bytes"],
                "target": "report",
            },
            {
                "metric": f"{label}: peak RSS MiB",
                "ferry": b["peak_rss"] / mib,
                "peer": t["peak_rss"] / mib,
                "ratio": b["peak_rss"] / t["peak_rss"],
                "target": "report",
            },
            {
                "metric": f"{label}: RSS after training MiB",
                "ferry": b["rss_after"] / mib,
                "peer": t["rss_after"] / mib,
                "ratio": b["rss_after"] / t["rss_after"],
                "target": "report",
            },
            {
                "metric": f"{label}: tokens/s",
                "ferry": b["tokens_per_s"],
                "peer": t["tokens_per_s"],
                "ratio": b["tokens_per_s"] / t["tokens_per_s"],
                "target": "report",
            },
            {
                "metric": f"{label}: relative weight error",
                "ferry": b["rel_error"],
                "peer": t["rel_error"],
                "ratio": b["rel_error"] / t["rel_error"],
                "target": "report",
            },
            {
                "metric": f"{label}: final loss",
                "ferry": b["loss_final"],
                "peer": t["loss_final"],
                "ratio": b["loss_final"] - t["loss_final"],
                "target": "report (ratio column = gap)",
            },
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument(
        "--backends", action="store_true", help="bitsandbytes vs torchao NF4 (needs torchao) instead of QLoRA vs LoRA"
    )
    parser.add_argument("--rounds", type=int, default=2, help="--backends: alternations of the two sides")
    parser.add_argument("--torchao-path", default=None, help="--backends: a pip --target folder holding torchao")
    parser.add_argument("--side", choices=("bnb", "torchao"), help=argparse.SUPPRESS)  # the child of --backends
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = backend_side(args.side, Path(args.model), args.max_steps)
        Path(args.out).write_text(json.dumps(result))
        return
    from benchmarks.__main__ import format_table

    if args.backends:
        steps = args.max_steps or (5 if args.quick else 20)
        print(format_table(run_backends(max_steps=steps, rounds=args.rounds, torchao_path=args.torchao_path)))
        return
    print(format_table(run(quick=args.quick, max_steps=args.max_steps)))


if __name__ == "__main__":
    main()
