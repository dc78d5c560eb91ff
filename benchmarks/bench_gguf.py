"""Benchmark: ferry's GGUF step vs llama.cpp's converter run by hand on the same export, and the readback check.

Setup (not timed): a random-init fp32 Llama of about 1 GB (``--quick``: about 100 MB) with a SentencePiece
tokenizer trained here (512 pieces, on ferry's demo data), saved as the merged folder ``ferry export`` writes;
llama.cpp's converter extracted from the pinned llama-cpp-python sdist (``--sdist FILE``, default: the test cache's
copy, ``~/.cache/ferry-tests/sdists/<sha256>/``).

Then, alternating A B, each in a fresh Python process, for ``--runs`` pairs:

* ferry: ``exporter.gguf.convert`` (the wrapper: temp name, offline environment, log, rename) driving the converter,
  timed from the wrapper's call (``ferry export`` has torch imported already for the merge);
* peer: ``python convert_hf_to_gguf.py MODEL --outfile F --outtype bf16`` typed by hand (what LLaMA-Factory's docs
  and users do after merging).

Wall time per run; the ratio ferry / peer is the median over the pairs (target <= 1.05x). The readback check
(:func:`exporter.gguf.check_gguf`: static reader, transformers' readback, weight identity, logits) is timed once and
reported. Run: ``.venv/bin/python -m benchmarks.bench_gguf [--quick] [--runs N] [--type bf16|q8_0]``.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _model(root: Path, quick: bool) -> Path:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from benchmarks.common import random_llama

    data = json.loads((ROOT / "ferry" / "cli" / "demo_data" / "ferry_demo.json").read_text())
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(json.dumps(row) for row in data))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "tokenizer"),
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    src = root / "tok"
    src.mkdir()
    shutil.copyfile(root / "tokenizer.model", src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    hidden, layers = (512, 8) if quick else (1536, 9)
    out = root / "merged"
    random_llama(hidden, layers).save_pretrained(out, max_shard_size="400MB")
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    shutil.copyfile(root / "tokenizer.model", out / "tokenizer.model")
    return out


#: ferry's side, timed from the call of the wrapper (in ``ferry export`` torch and transformers are imported already,
#: for the merge, so their import time is not the wrapper's)
FERRY_CHILD = """import sys, time
from pathlib import Path
import exporter.gguf
started = time.perf_counter()
exporter.gguf.convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], converter=Path(sys.argv[4]))
print(time.perf_counter() - started)
"""


def _timed(cmd: list[str], env: dict[str, str], reported: bool = False) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    return float(proc.stdout.strip().splitlines()[-1]) if reported else time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--type", default="bf16", choices=["bf16", "f16", "q8_0"])
    parser.add_argument("--sdist", default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from exporter import gguf
    from ferry.constants import apply_offline_env

    sdist = (
        Path(args.sdist)
        if args.sdist
        else (
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "ferry-tests"
            / "sdists"
            / gguf.SDIST.sha256
            / gguf.SDIST.filename
        )
    )
    converter = gguf.find_converter(sdist)
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        root = Path(tmp)
        model = _model(root, args.quick)
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        print(f"model     {model} ({size / 1e9:.2f} GB fp32), type {args.type}, converter {converter}")
        env = apply_offline_env(dict(os.environ))
        env.pop("NO_LOCAL_GGUF", None)
        for path in model.glob("*.safetensors"):
            path.read_bytes()  # warm page cache for both sides
        ours, peer = [], []
        for i in range(args.runs):
            ours.append(
                _timed(
                    [
                        sys.executable,
                        "-c",
                        FERRY_CHILD,
                        str(model),
                        str(root / f"ferry-{i}.gguf"),
                        args.type,
                        str(converter),
                    ],
                    env,
                    reported=True,
                )
            )
            peer.append(
                _timed(
                    [
                        sys.executable,
                        str(converter / "convert_hf_to_gguf.py"),
                        str(model),
                        "--outfile",
                        str(root / f"peer-{i}.gguf"),
                        "--outtype",
                        args.type,
                    ],
                    env,
                )
            )
            print(f"pair {i}   ferry {ours[-1]:.2f} s   by hand {peer[-1]:.2f} s")
        same = (root / "ferry-0.gguf").read_bytes() == (root / "peer-0.gguf").read_bytes()
        ratio = statistics.median(a / b for a, b in zip(ours, peer))
        print(
            f"convert   ferry / by hand = {ratio:.3f}x (median of {args.runs}; target <= 1.05x); "
            f"identical files: {same}"
        )
        started = time.perf_counter()
        report = gguf.check_gguf(
            root / "ferry-0.gguf", model, args.type, prompts=["Once upon a time"], max_new_tokens=4
        )
        print(
            f"readback  {time.perf_counter() - started:.2f} s (passed {report.passed}, max |Δ| "
            f"{report.max_abs_diff:.3g}, {report.weights_checked} weights proven)"
        )


if __name__ == "__main__":
    main()
