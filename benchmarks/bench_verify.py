"""Benchmark: ``ferry verify`` vs plain hashlib over the same bytes (target: >= 0.8x hashlib's throughput).

A bundle of about 1 GB (``quick``: 200 MB) of random model shards is packed once with ``bundler.pack``; then,
alternating A B A B, ferry's :func:`bundler.verify.verify` streams the archive (tar parsing, per-member
sha256, manifest check) and the peer reads the same archive file in 1 MiB chunks into one ``hashlib.sha256``
(the floor for any one-pass check in Python). Both read from the page cache (a warm-up read first).
Throughput is bytes of the archive per second; the ratio is ferry / peer, the median over the runs.

Run: ``.venv/bin/python -m benchmarks.bench_verify [--quick]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

CHUNK = 1024 * 1024


def _make_model(folder: Path, total_bytes: int, shards: int = 4) -> None:
    """``shards`` files of random bytes (incompressible, like weights) adding up to ``total_bytes``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    per = total_bytes // shards
    block = os.urandom(16 * CHUNK)
    for i in range(shards):
        with open(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            written = 0
            while written < per:
                piece = block[: min(len(block), per - written)]
                fh.write(hashlib.sha256(piece[:64] + written.to_bytes(8, "little")).digest() + piece[32:])
                written += len(piece)


def _peer(path: Path) -> int:
    """hashlib over every byte of ``path`` (1 MiB reads); returns the bytes hashed."""
    hasher = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            hasher.update(view[:n])
            size += n
    return size


def run(quick: bool = False, runs: int | None = None) -> list[dict]:
    """Pack a bundle and time verify vs hashlib, alternating; return the table rows
    ``{"metric", "ferry", "peer", "ratio", "target"}`` (throughputs in GB/s, ratio ferry/peer)."""
    from bundler.pack import pack
    from bundler.spec import load_spec
    from bundler.verify import verify

    total = 200 * 10**6 if quick else 10**9
    runs = runs or (3 if quick else 5)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-verify-"))
    try:
        _make_model(work / "src" / "bench-model", total)
        pack(
            load_spec(name="bench", models=[str(work / "src" / "bench-model")], no_wheels=True),
            work / "out",
            progress=False,
        )
        shutil.rmtree(work / "src")
        archive = work / "out" / "bench.ferry.tar"
        directory = work / "out" / "bench"
        size = archive.stat().st_size
        _peer(archive)  # warm the page cache
        rows = []
        for metric, target in (("verify archive (GB/s)", archive), ("verify directory (GB/s)", directory)):
            ferry_rates, peer_rates, ratios = [], [], []
            for _ in range(runs):
                started = time.perf_counter()
                verify(target)
                ferry_rate = size / (time.perf_counter() - started) / 1e9
                started = time.perf_counter()
                _peer(archive)
                peer_rate = size / (time.perf_counter() - started) / 1e9
                ferry_rates.append(ferry_rate)
                peer_rates.append(peer_rate)
                ratios.append(ferry_rate / peer_rate)
            rows.append(
                {
                    "metric": metric,
                    "ferry": round(statistics.median(ferry_rates), 3),
                    "peer": round(statistics.median(peer_rates), 3),
                    "ratio": round(statistics.median(ratios), 3),
                    "target": ">= 0.8",
                }
            )
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 MB instead of 1 GB")
    parser.add_argument("--runs", type=int, default=None, help="A/B pairs (default 5, quick 3)")
    args = parser.parse_args()
    rows = run(quick=args.quick, runs=args.runs)
    print(f"{'metric':28} {'ferry':>8} {'hashlib':>8} {'ratio':>7}  target")
    for row in rows:
        print(f"{row['metric']:28} {row['ferry']:8.3f} {row['peer']:8.3f} {row['ratio']:7.3f}  {row['target']}")


if __name__ == "__main__":
    main()
