"""Benchmark: ``ferry export --no-smoke`` vs transformers + peft merging the same LoRA adapter.

Setup (not timed): a random-init fp32 Llama of about 1.5 GB (``quick``: about 300 MB) saved as 4+ safetensors
shards, and an r=16 adapter on every linear layer (q/k/v/o/gate/up/down_proj, non-zero lora_B) built with peft.

Then, alternating A B A B, each in a fresh Python process:

* ferry: ``python -m ferry export --adapter A --base B --output O --no-smoke`` (streaming merge);
* peer: ``AutoModelForCausalLM.from_pretrained(B)``, ``PeftModel.from_pretrained(model, A)``,
  ``merge_and_unload()``, ``save_pretrained(O)`` (what peft's docs, LLaMA-Factory and axolotl do).

Each child's wall time and peak resident memory (``os.wait4`` rusage ``ru_maxrss`` of that child alone, taken by
a small launcher process: see :data:`LAUNCHER`) are measured; the base files are read once beforehand so both
start from a warm page cache. The ratios are ferry / peer, the median over the pairs. Targets: peak RSS <= 0.5x
peft's, wall time <= 1.0x. Each child's CPU time (user + system, same rusage) is reported too, for information:
on a shared host, wall time also measures the neighbours. The first pair's outputs are also compared tensor by
tensor (max |ferry - peft|, reported in the printout).

MoE case (always about 300 MB): a random-init Qwen3-MoE-style model (16 experts per layer, stored per expert as
the hub stores them) with LLaMA-Factory's targets (q/k/v/o/gate/up/down_proj, r=16), which peft 0.21 puts on the
fused expert parameters (``target_parameters``); ferry merges that LoRA back into the stored per-expert tensors.
Same measurement and targets.

Run: ``.venv/bin/python -m benchmarks.bench_export [--quick] [--runs N] [--case dense|moe|both]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

PEER = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", local_files_only=True)
model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
model.save_pretrained(out)
"""


def _build(work: Path, quick: bool) -> tuple[Path, Path]:
    """Save the random-init Llama (4+ shards) and its r=16 all-linear adapter; return (base, adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if quick:  # ~71M parameters, ~285 MB
        dims = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8)
        shard = "80MB"
    else:  # ~374M parameters, ~1.5 GB
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16)
        shard = "400MB"
    config = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, dtype="float32", **dims)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    base = work / "base"
    model.save_pretrained(base, max_shard_size=shard)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False))
    adapter = work / "adapter"
    peft_model.save_pretrained(adapter)
    del model, peft_model
    return base, adapter


def _build_moe(work: Path, layers: int = 6) -> tuple[Path, Path]:
    """Save a ~300 MB (6 layers; each more adds ~30 MB) Qwen3-MoE-style model (per-expert tensors, several
    shards) and an r=16 adapter on LLaMA-Factory's targets, which peft maps onto the fused experts; return
    (base, adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        moe_intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config)
    base = work / "moe-base"
    model.save_pretrained(base, max_shard_size="100MB")
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False))
    adapter = work / "moe-adapter"
    peft_model.save_pretrained(adapter)
    del model, peft_model
    return base, adapter


#: Runs one command and prints its wall time and peak RSS. It exists because Linux starts a child's peak-RSS count
#: at its parent's size (the forked memory image is counted at exec): measured straight from this process, whose
#: memory holds torch and the setup model, every child would look as big as this process. The launcher is a
#: fresh, small interpreter that imports nothing heavy, so its children are measured from ~10 MB.
LAUNCHER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read()
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"wall": time.perf_counter() - started, "maxrss": usage.ru_maxrss * 1024,
                  "cpu": usage.ru_utime + usage.ru_stime,
                  "rc": os.waitstatus_to_exitcode(status), "stderr": err.decode(errors="replace")[-3000:]}))
"""


def _child(argv: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """Run ``argv`` through :data:`LAUNCHER`; return (wall seconds, peak RSS bytes, CPU seconds user + system) of
    that command alone."""
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *argv], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed ({result['rc']}): {result['stderr']}")
    return result["wall"], result["maxrss"], result["cpu"]


def _max_diff(a: Path, b: Path) -> float:
    """max |a - b| over every tensor of two exported folders (read one tensor at a time)."""
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(folder / "model.safetensors", "pt") as fh:
            return {k: folder / "model.safetensors" for k in fh.keys()}

    fa, fb = files(a), files(b)
    assert set(fa) == set(fb), sorted(set(fa) ^ set(fb))[:5]
    worst = 0.0
    for key in fa:
        with safe_open(fa[key], "pt") as ha, safe_open(fb[key], "pt") as hb:
            worst = max(worst, float((ha.get_tensor(key) - hb.get_tensor(key)).abs().max()))
    return worst


def _measure(work: Path, base: Path, adapter: Path, runs: int, label: str, env: dict[str, str]) -> list[dict]:
    """Time ferry vs peft on one base + adapter, alternating; return the two table rows."""
    shards = sorted(base.glob("*.safetensors"))
    model_bytes = sum(p.stat().st_size for p in shards)
    for path in shards:  # warm the page cache for both sides
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass
    walls: dict[str, list[float]] = {"ferry": [], "peer": []}
    rss: dict[str, list[int]] = {"ferry": [], "peer": []}
    cpu: dict[str, list[float]] = {"ferry": [], "peer": []}
    diff = None
    for i in range(runs):
        for side in ("ferry", "peer"):
            out = work / f"out-{side}"
            shutil.rmtree(out, ignore_errors=True)
            if side == "ferry":
                argv = [
                    sys.executable,
                    "-m",
                    "ferry",
                    "export",
                    "--adapter",
                    str(adapter),
                    "--base",
                    str(base),
                    "--output",
                    str(out),
                    "--no-smoke",
                ]
            else:
                argv = [sys.executable, "-c", PEER, str(base), str(adapter), str(out)]
            wall, peak, used = _child(argv, env)
            walls[side].append(wall)
            rss[side].append(peak)
            cpu[side].append(used)
        if i == 0:
            diff = _max_diff(work / "out-ferry", work / "out-peer")
    wall_ratio = statistics.median(f / p for f, p in zip(walls["ferry"], walls["peer"]))
    rss_ratio = statistics.median(f / p for f, p in zip(rss["ferry"], rss["peer"]))
    cpu_ratio = statistics.median(f / p for f, p in zip(cpu["ferry"], cpu["peer"]))
    label = f"{label}, {model_bytes / 1e9:.2f} GB fp32, {len(shards)} shards, r=16"
    print(f"export benchmark: {label}; max |ferry - peft| over all tensors = {diff:.3g}")
    return [
        {
            "metric": f"export wall time (s) [{label}]",
            "ferry": round(statistics.median(walls["ferry"]), 2),
            "peer": round(statistics.median(walls["peer"]), 2),
            "ratio": round(wall_ratio, 3),
            "target": "<= 1.0",
        },
        {
            "metric": f"export peak RSS (GB) [{label.split(',')[0]}]",
            "ferry": round(statistics.median(rss["ferry"]) / 1e9, 3),
            "peer": round(statistics.median(rss["peer"]) / 1e9, 3),
            "ratio": round(rss_ratio, 3),
            "target": "<= 0.5",
        },
        {
            "metric": f"export CPU time, user+sys (s) [{label.split(',')[0]}]",
            "ferry": round(statistics.median(cpu["ferry"]), 2),
            "peer": round(statistics.median(cpu["peer"]), 2),
            "ratio": round(cpu_ratio, 3),
            "target": "info",
        },
    ]


def run(quick: bool = False, runs: int | None = None, case: str = "both", moe_layers: int = 6) -> list[dict]:
    """Build the models and adapters, time ferry vs peft alternating; return the table rows (dense, then MoE)."""
    runs = runs or (2 if quick else 3)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-export-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows: list[dict] = []
    try:
        if case in ("dense", "both"):
            base, adapter = _build(work, quick)
            rows += _measure(work, base, adapter, runs, "Llama", env)
            shutil.rmtree(base)
        if case in ("moe", "both"):
            base, adapter = _build_moe(work, moe_layers)
            rows += _measure(work, base, adapter, runs, "Qwen3-MoE 16 experts, expert LoRA", env)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~300 MB model instead of ~1.5 GB")
    parser.add_argument("--runs", type=int, default=None, help="A/B pairs (default 3, quick 2)")
    parser.add_argument("--case", choices=["dense", "moe", "both"], default="both", help="which models")
    parser.add_argument("--moe-layers", type=int, default=6, help="MoE layers (6: ~300 MB; each adds ~30 MB)")
    args = parser.parse_args()
    for row in run(quick=args.quick, runs=args.runs, case=args.case, moe_layers=args.moe_layers):
        print(
            f"{row['metric']:72} ferry {row['ferry']:8.3f}  peft {row['peer']:8.3f}  ratio {row['ratio']:6.3f}  "
            f"target {row['target']}"
        )


if __name__ == "__main__":
    main()
