"""Benchmark: ``ferry inspect`` of a 1 GB bundle reads under 1 % of its bytes.

A bundle of about 1 GB (``quick``: 200 MB) of random model shards (real bytes, deleted afterwards) is packed
once, signed with an ed25519 key made by ``ssh-keygen`` here, as one ``NAME.ferry.tar`` and again as
256 MB volumes. Then :func:`bundler.inspect.inspect` (signature checked against an allowed_signers file) runs
on the tar and on the first volume alone, and the bytes this process read are counted independently of
ferry's own report: the ``rchar`` field of ``/proc/self/io`` (every byte returned by read(2) and friends,
page cache or not) before and after the call, after a warm-up call so that no module import is counted.
``ferry`` is those bytes, ``peer`` the bundle's size, ``ratio`` the percentage read (target: under 1 %).

Run: ``.venv/bin/python -m benchmarks.bench_inspect [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def _rchar() -> int:
    """Bytes this process has read so far (``/proc/self/io`` rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def run(quick: bool = False) -> list[dict]:
    """Pack, inspect, count; return the rows ``{"metric", "ferry", "peer", "ratio", "target"}``."""
    from benchmarks.bench_verify import _make_model
    from bundler.inspect import inspect
    from bundler.pack import pack
    from bundler.spec import load_spec

    total = 200 * 10**6 if quick else 10**9
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-inspect-"))
    try:
        key = work / "signer"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench@ferry", "-f", str(key)], check=True)
        allowed = work / "allowed_signers"
        allowed.write_text(f'bench@ferry namespaces="ferry-bundle" {(work / "signer.pub").read_text().strip()}\n')
        src = work / "src" / "bench-model"
        _make_model(src, total)
        pack(load_spec(name="bench", models=[str(src)], no_wheels=True), work / "out", progress=False, sign=key)
        shutil.rmtree(work / "out" / "bench")  # only the archive is inspected; keep the disk use down
        pack(
            load_spec(name="vols", models=[str(src)], no_wheels=True, split_size="256MB"),
            work / "out",
            progress=False,
            sign=key,
        )
        shutil.rmtree(work / "out" / "vols")
        shutil.rmtree(work / "src")
        targets = [
            (
                "inspect 1 GB tar: bytes read" if not quick else "inspect 200 MB tar: bytes read",
                work / "out" / "bench.ferry.tar",
            ),
            ("inspect first volume: bytes read", work / "out" / "vols.ferry.tar.000"),
        ]
        inspect(targets[0][1], allowed)  # warm-up: imports, ssh-keygen in the page cache
        rows = []
        for metric, target in targets:
            before = _rchar()
            started = time.perf_counter()
            found = inspect(target, allowed)
            seconds = time.perf_counter() - started
            read = _rchar() - before
            assert found.signature["status"] == "verified", found.signature
            size = (
                found.bundle_bytes
                if target.name.endswith(".tar")
                else sum(p.stat().st_size for p in target.parent.glob("vols.ferry.tar.0*"))
            )
            rows.append(
                {
                    "metric": metric,
                    "ferry": read,
                    "peer": size,
                    "ratio": round(100 * read / size, 4),
                    "target": "< 1 (%)",
                    "seconds": round(seconds, 3),
                    "reported": found.bytes_read,
                }
            )
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 MB instead of 1 GB")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    print(f"{'metric':36} {'read (B)':>10} {'bundle (B)':>12} {'% read':>10} {'s':>6}  target")
    for row in rows:
        print(
            f"{row['metric']:36} {row['ferry']:10d} {row['peer']:12d} {row['ratio']:10.4f} "
            f"{row['seconds']:6.3f}  {row['target']}  (ferry reports {row['reported']} B)"
        )


if __name__ == "__main__":
    main()
