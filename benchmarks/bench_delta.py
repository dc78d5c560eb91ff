"""Benchmark: delta bundles (``ferry pack --base``) vs full bundles of the same target, in one run.

Four updates of an installed prefix, each packed both ways against the prefix's ``ferry state``; the metric is
the archive that crosses the gap (``NAME.ferry.tar`` bytes: content, metadata, install.py), ratio delta / full:

* config change: a ~1 GB two-shard safetensors model (``quick``: 200 MB) whose config.json changed
  (goal < 0.1 %);
* one new dataset: the same model plus a new ~100 MB JSONL dataset (quick: 20 MB) (goal <= dataset share + 1 %);
* one changed wheel: numpy, PyYAML and tqdm for this host, then tqdm one release later (real wheels from PyPI)
  (goal < 5 %);
* one tensor: one 64 MB tensor of shard 2 changed (quick: 12.5 MB) (goal <= that tensor's share + 1 %);

and the install time of the one-tensor update into a prefix holding the base, delta vs full (goal <= 1.0x: the
delta rebuilds the shard streaming from the installed blob on local disk).

Run: ``.venv/bin/python -m benchmarks.bench_delta [--quick]`` (or ``python -m benchmarks delta``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

TENSORS_PER_SHARD = 8


def _make_model(folder: Path, total_bytes: int) -> tuple[dict, list[str]]:
    """Two safetensors shards of random float32 tensors adding up to ``total_bytes``; returns the tensors of
    shard 2 (name -> array) and its file name list."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}) + "\n")
    per_tensor = total_bytes // (2 * TENSORS_PER_SHARD) // 4096 * 4096
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    second: dict = {}
    weight_map = {}
    for s, name in enumerate(shards):
        tensors = {}
        for t in range(TENSORS_PER_SHARD):
            key = f"model.layers.{s * TENSORS_PER_SHARD + t}.mlp.weight"
            tensors[key] = np.frombuffer(os.urandom(per_tensor), dtype=np.float32).reshape(-1, 1024)
            weight_map[key] = name
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        if s == 1:
            second = tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return second, shards


def _tar(result) -> int:
    return sum(p.stat().st_size for p in result.archives)


def run(quick: bool = False) -> list[dict]:
    """Pack, install and measure (see the module docstring); return rows ``{"metric", "ferry", "peer",
    "ratio", "target"}``: ferry = the delta, peer = the full bundle (bytes in MB, times in s)."""
    import numpy as np
    from safetensors.numpy import save_file

    from bundler.delta import write_state
    from bundler.install import install
    from bundler.pack import pack
    from bundler.spec import load_spec

    total = 200 * 10**6 if quick else 10**9
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-delta-"))
    rows: list[dict] = []

    def row(metric: str, delta: float, full: float, target: str, unit: float = 1e6) -> None:
        rows.append(
            {
                "metric": metric,
                "ferry": round(delta / unit, 3),
                "peer": round(full / unit, 3),
                "ratio": round(delta / full, 5),
                "target": target,
            }
        )

    def both(name: str, base: Path, **spec) -> tuple:
        full = pack(load_spec(name=f"{name}-full", **spec), work / "out", progress=False)
        delta = pack(load_spec(name=f"{name}-delta", **spec), work / "out", progress=False, base=base)
        return full, delta

    try:
        model = work / "src" / "bench-model"
        second, shards = _make_model(model, total)
        data = work / "src" / "notes.jsonl"
        line = json.dumps({"instruction": "x" * 200, "output": "y" * 400})
        with open(data, "w") as fh:
            n = (total // 10) // (len(line) + 1)
            for i in range(n):
                fh.write(line.replace("x", chr(97 + i % 26), 1 + i % 50) + "\n")
        base = pack(load_spec(name="base", models=[str(model)], no_wheels=True), work / "out", progress=False)
        prefix = work / "prefix"
        install(base.bundle_dir, prefix, create_venv=False)
        state = work / "state.json"
        write_state(prefix, state)

        # 1. config change
        (model / "config.json").write_text(
            json.dumps({"model_type": "llama", "hidden_size": 4096, "rope_theta": 500000.0}) + "\n"
        )
        full, delta = both("config", state, models=[str(model)], no_wheels=True)
        row("config change: archive MB", _tar(delta), _tar(full), "< 0.001")
        # 2. one new dataset
        full, delta = both("dataset", state, models=[str(model)], datasets=[str(data)], no_wheels=True)
        share = data.stat().st_size / (data.stat().st_size + total)
        row("one new dataset: archive MB", _tar(delta), _tar(full), f"<= {share + 0.01:.4f}")
        # 4. one tensor (packed before the wheels, which change the state)
        key = sorted(second)[3]
        second[key] = np.frombuffer(os.urandom(second[key].nbytes), dtype=np.float32).reshape(second[key].shape)
        save_file(second, str(model / shards[1]), metadata={"format": "pt"})
        full4, delta4 = both("tensor", state, models=[str(model)], no_wheels=True)
        share = second[key].nbytes / total
        row("one tensor changed: archive MB", _tar(delta4), _tar(full4), f"<= {share + 0.01:.4f}")
        # install time of the one-tensor update into a prefix holding the base: delta vs full
        times = {}
        for kind, result in (("full", full4), ("delta", delta4)):
            target = work / f"prefix-{kind}"
            install(base.bundle_dir, target, create_venv=False)
            started = time.perf_counter()
            install(result.archives[0], target, create_venv=False)
            times[kind] = time.perf_counter() - started
            shutil.rmtree(target)
        rows.append(
            {
                "metric": f"install one-tensor update of {total / 1e9:.1f} GB (s)",
                "ferry": round(times["delta"], 3),
                "peer": round(times["full"], 3),
                "ratio": round(times["delta"] / times["full"], 3),
                "target": "<= 1.0",
            }
        )
        # 3. one changed wheel (real wheels for this host)
        wheels_base = load_spec(name="wheels-base")
        wheels_base.wheels.requirements = ["numpy==2.2.6", "PyYAML==6.0.2", "tqdm==4.67.0"]
        installed = pack(wheels_base, work / "out", progress=False)
        wprefix = work / "prefix-wheels"
        install(installed.bundle_dir, wprefix, create_venv=False)
        write_state(wprefix, work / "state-wheels.json")
        specs = {}
        for kind in ("full", "delta"):
            specs[kind] = load_spec(name=f"wheels-{kind}")
            specs[kind].wheels.requirements = ["numpy==2.2.6", "PyYAML==6.0.2", "tqdm==4.67.1"]
        full = pack(specs["full"], work / "out", progress=False)
        delta = pack(specs["delta"], work / "out", progress=False, base=work / "state-wheels.json")
        row("one changed wheel: archive MB", _tar(delta), _tar(full), "< 0.05")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 MB instead of 1 GB")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    print(f"{'metric':44} {'delta':>10} {'full':>10} {'ratio':>9}  target")
    for r in rows:
        print(f"{r['metric']:44} {r['ferry']:10.3f} {r['peer']:10.3f} {r['ratio']:9.5f}  {r['target']}")


if __name__ == "__main__":
    main()
