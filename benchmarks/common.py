"""What several benchmarks share: the paths of the shared assets, a training subprocess's environment and a
logged subprocess run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT.parent / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K"
ALPACA = ASSETS / "datasets" / "llamafactory" / "alpaca_en_demo.json"


def bench_env(threads: int = 1) -> dict[str, str]:
    """This environment plus: ``threads`` OpenMP threads per process (1 with 2 processes on the 2-core machine),
    this checkout first on the path, no tokenizer threads, the hub offline, unbuffered output."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=str(ROOT),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_to_log(cmd: list[str], log: Path, threads: int = 1) -> None:
    """Run ``cmd`` from the checkout under :func:`bench_env`, its output into ``log``.

    Raises:
        RuntimeError: it exited non-zero (the message holds the log's tail).
    """
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=bench_env(threads), stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")


def random_llama(hidden: int, layers: int, vocab_size: int = 512, **config: object):
    """A random-init float32 ``LlamaForCausalLM`` (seed 0): ``hidden`` wide, ``layers`` deep, heads of 64, two
    queries per key/value head, an MLP four times as wide; ``config``: more LlamaConfig fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 128,
            vocab_size=vocab_size,
            **config,
        )
    )
