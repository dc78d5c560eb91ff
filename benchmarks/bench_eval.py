"""Benchmark: ``ferry eval`` vs lm-evaluation-harness's own CLI on the same model, tasks and limit
(target: wall time <= 1.05x lm-eval's; what ferry adds is bookkeeping).

Setup (not timed): three task YAMLs in lm-eval's format over local JSONL files written here (multiple choice,
generation with ``max_gen_toks`` 16, rolling perplexity), ``DOCS`` documents each (``quick``: fewer), and the
stories260K Llama from ``../shared/assets``. Then, alternating A B A B, ``python -m ferry eval`` (offline
switches on, the tasks planned and their data checked, the report written) and ``python -m lm_eval`` (the
same tasks through ``--include_path``, batch size 1, CPU) each run as a fresh process, the base model alone;
the wall time of each process is measured, and the ratio is ferry / lm-eval, the median over the pairs. Both
processes load the model and get lm-eval's task index: lm-eval's CLI builds it (~10 s on 2 cores), ferry reads
lm-eval's own index from its cache (bundler/eval_index.py; built by the first run on a host). On a tiny model
those dominate, so a larger ``--docs`` shows the per-document cost too. The scores of the first pair are
compared: they must be equal.
Last, ``ferry eval --nproc-per-node 2`` runs ``runs`` times: its throughput against one rank's is the ratio of the
one-rank wall time to the two-rank one (torchrun starts at once; each rank reads lm-eval's task index, from
ferry's cache when warm; on 2 cores each rank has one). ``--docs 400`` makes the documents outweigh start-up.

Run: ``.venv/bin/python -m benchmarks.bench_eval [--quick] [--runs N] [--docs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "assets" / "models" / "stories260K"
TASKS = ("bench_mc", "bench_gen", "bench_ppl")
WORDS = "Lily Tom Ben the a dog cat park ball sun moon tree box red big happy ran saw went played".split()

_YAML = {
    "bench_mc": 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
    'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
    "bench_gen": 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
    'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
    "metric_list:\n  - metric: exact_match\n",
    "bench_ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)) + "."


def _write_tasks(folder: Path, docs: int) -> Path:
    """Three task YAMLs and their JSONL files (``docs`` rows each) in ``folder``; returns the task folder."""
    data = {
        "bench_mc": [
            {"question": _sentence(i, 8), "choices": [_sentence(i + j, 3) for j in range(4)], "answer": i % 4}
            for i in range(docs)
        ],
        "bench_gen": [{"prompt": _sentence(i, 10), "answer": " " + WORDS[i % len(WORDS)]} for i in range(docs)],
        "bench_ppl": [{"text": " ".join(_sentence(i + j, 12) for j in range(4))} for i in range(docs)],
    }
    tasks = folder / "tasks"
    tasks.mkdir(parents=True)
    for name in TASKS:
        rows = folder / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in data[name]))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {rows}\ntest_split: test\n"
        (tasks / f"{name}.yaml").write_text(head + _YAML[name])
    return tasks


def _env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(work / "hf-home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed:\n{proc.stderr[-3000:]}")
    return elapsed


def _ferry(tasks: Path, out: Path, limit: int) -> list[str]:
    return [
        sys.executable, "-m", "ferry", "eval", "--model-name-or-path", str(STORIES), "--tasks", ",".join(TASKS),
        "--include-path", str(tasks), "--limit", str(limit), "--device", "cpu", "--output-dir", str(out),
    ]  # fmt: skip


def _lm_eval(tasks: Path, out: Path, limit: int) -> list[str]:
    return [
        sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={STORIES}",
        "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--limit", str(limit), "--batch_size", "1",
        "--device", "cpu", "--output_path", str(out),
    ]  # fmt: skip


def run(quick: bool = False, runs: int | None = None, docs: int | None = None) -> list[dict]:
    """Time ferry eval vs lm-eval's CLI, alternating; return the table rows ``{"metric", "ferry", "peer",
    "ratio", "target"}`` (seconds of wall time per process, ratio ferry / lm-eval, the median over the pairs).

    Raises:
        RuntimeError: a run failed (its stderr), or the two gave different scores.
    """
    runs = runs or (1 if quick else 3)
    docs = docs or (8 if quick else 40)
    if not STORIES.is_dir():
        raise RuntimeError(f"missing asset {STORIES} (../shared/assets beside the project)")
    ours, peers = [], []
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        work = Path(scratch)
        tasks = _write_tasks(work, docs)
        env = _env(work)
        for i in range(runs):
            ours.append(_timed(_ferry(tasks, work / f"ferry-{i}", docs), env))
            peers.append(_timed(_lm_eval(tasks, work / f"peer-{i}", docs), env))
        mine = json.loads((work / "ferry-0" / "base" / "results.json").read_text())["results"]
        (theirs_file,) = (work / "peer-0").rglob("results_*.json")
        theirs = json.loads(theirs_file.read_text())["results"]
        if any(mine[t] != theirs[t] for t in TASKS):
            raise RuntimeError(f"ferry eval and lm-eval disagree: {mine} vs {theirs}")
        two = [_timed([*_ferry(tasks, work / f"two-{i}", docs), "--nproc-per-node", "2"], env) for i in range(runs)]
    ratios = [a / b for a, b in zip(ours, peers)]
    speedups = [a / b for a, b in zip(ours, two)]
    return [
        {
            "metric": f"eval wall time, s ({len(TASKS)} tasks x {docs} docs, {runs} pair(s))",
            "ferry": statistics.median(ours),
            "peer": statistics.median(peers),
            "ratio": statistics.median(ratios),
            "target": "<= 1.05",
        },
        {
            "metric": "ferry eval throughput, 2 ranks / 1 rank (peer: 1 rank)",
            "ferry": statistics.median(two),
            "peer": statistics.median(ours),
            "ratio": statistics.median(speedups),
            "target": ">= 1.6",
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 documents per task, one pair")
    parser.add_argument("--runs", type=int, default=None, help="A/B pairs (default 3, quick 1)")
    parser.add_argument("--docs", type=int, default=None, help="documents per task (default 40, quick 8)")
    args = parser.parse_args(argv)
    from benchmarks.__main__ import format_table

    print(format_table(run(quick=args.quick, runs=args.runs, docs=args.docs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
