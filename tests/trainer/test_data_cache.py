"""The tokenisation cache: reuse, invalidation by content and settings, and one build under concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests.support.helpers import write_json
from trainer.data import prepare_data


def alpaca_file(tmp_path: Path, n: int) -> Path:
    rows = [
        {"instruction": f"Count to {i}.", "input": "", "output": " ".join(str(k) for k in range(i + 1))}
        for i in range(n)
    ]
    return write_json(tmp_path / "count.json", rows)


def test_second_call_loads_the_cache_entry(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    cfg = make_cfg(dataset=str(alpaca_file(tmp_path, 20)), val_size=0.2)
    first = prepare_data(cfg, stories_tokenizer)
    assert first.stats["cache_hit"] is False
    entry = Path(first.stats["cache_path"])
    assert entry.parent == tmp_path / "tokenized" and entry.suffix == ".safetensors"
    mtime = entry.stat().st_mtime_ns
    second = prepare_data(cfg, stories_tokenizer)
    # Proof of reuse: the build id written at build time comes back, and the file was not rewritten.
    assert second.stats["cache_hit"] is True
    assert second.stats["build_id"] == first.stats["build_id"]
    assert entry.stat().st_mtime_ns == mtime
    assert list(second.train) == list(first.train) and list(second.eval) == list(first.eval)
    assert {k: v for k, v in second.stats.items() if k not in ("cache_hit", "load_seconds")} == {
        k: v for k, v in first.stats.items() if k not in ("cache_hit", "load_seconds")
    }


def test_changed_data_or_settings_rebuild(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    path = alpaca_file(tmp_path, 10)
    first = prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    rows = json.loads(path.read_text())
    rows[3]["output"] = "changed"
    write_json(path, rows)  # same size class, same name: only the content differs
    changed = prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    assert changed.stats["cache_hit"] is False
    assert changed.stats["cache_key"] != first.stats["cache_key"]
    assert list(changed.train)[3] != list(first.train)[3]
    other_cutoff = prepare_data(make_cfg(dataset=str(path), cutoff_len=32), stories_tokenizer)
    assert other_cutoff.stats["cache_hit"] is False
    assert len({first.stats["cache_key"], changed.stats["cache_key"], other_cutoff.stats["cache_key"]}) == 3
    packed = prepare_data(make_cfg(dataset=str(path), packing=True), stories_tokenizer)
    assert packed.stats["cache_hit"] is False and len(packed.train) < len(changed.train)


def test_a_start_reads_no_data_file_it_read_before_and_a_replaced_one_again(
    make_cfg, stories_tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """The cache key's digests are remembered (ferry.digests.DigestCache) for files modified over two seconds
    before: the next start reads none of them. A file replaced by another of the same size and modification time
    (a copy that keeps times, as rsync -a and cp -p make) has another inode: it is read again and its content
    decides, in the key and in the rows (the datasets library keys its own Arrow cache of the file by path and
    modification time: without ferry's folder per content it returned the old rows here)."""
    import ferry.digests

    path = alpaca_file(tmp_path, 10)
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    first = prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    reads: list[Path] = []
    real = ferry.digests.sha256_file
    monkeypatch.setattr(ferry.digests, "sha256_file", lambda p, *a: reads.append(Path(p)) or real(p, *a))
    again = prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    assert again.stats["cache_hit"] and again.stats["cache_key"] == first.stats["cache_key"]
    assert path not in reads

    rows = json.loads(path.read_text())
    rows[3]["output"] = rows[3]["output"][::-1]  # "3 2 1 0": the same length
    copy = write_json(tmp_path / "copy.json", rows)
    assert copy.stat().st_size == path.stat().st_size
    os.utime(copy, (hour_ago, hour_ago))
    os.replace(copy, path)
    changed = prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    assert path in reads and not changed.stats["cache_hit"]
    assert changed.stats["cache_key"] != first.stats["cache_key"] and list(changed.train) != list(first.train)


def test_overwrite_cache_rebuilds(make_cfg, stories_tokenizer, tmp_path: Path, monkeypatch) -> None:
    cfg = make_cfg(dataset=str(alpaca_file(tmp_path, 5)))
    first = prepare_data(cfg, stories_tokenizer)
    # A fresh launch (no FERRY_TOKENIZED_KEYS inherited from a launcher that just built it) rebuilds.
    monkeypatch.delenv("FERRY_TOKENIZED_KEYS", raising=False)
    again = prepare_data(cfg, stories_tokenizer, overwrite=True)
    assert again.stats["cache_hit"] is False and again.stats["build_id"] != first.stats["build_id"]
    # ...but the same process tree (torchrun workers of `ferry train`) does not rebuild it once more.
    third = prepare_data(cfg, stories_tokenizer, overwrite=True)
    assert third.stats["cache_hit"] is True and third.stats["build_id"] == again.stats["build_id"]


def _worker(model: str, data: str, cache: str, barrier, queue) -> None:
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer

    cfg = TrainConfig(model_name_or_path=model, dataset=data, output_dir=cache, tokenized_path=cache, cutoff_len=128)
    tokenizer = load_tokenizer(cfg)
    barrier.wait()  # both processes reach prepare_data together
    stats = prepare_data(cfg, tokenizer).stats
    queue.put((stats["cache_hit"], stats["build_id"], stats["num_samples"]))


@pytest.mark.budget(60, reason="two processes tokenise one dataset at once, one of them waiting on the other's lock")
def test_two_processes_build_once(stories_model: Path, llamafactory_data: Path, tmp_path: Path) -> None:
    # spawn, not fork: earlier tests in the same pytest process leave threads (tokenizers, hashing pools)
    # whose locks a forked child can inherit held, and then it deadlocks.
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    args = (str(stories_model), str(llamafactory_data / "alpaca_en_demo.json"), str(tmp_path / "cache"), barrier, queue)
    procs = [ctx.Process(target=_worker, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    hits = sorted(hit for hit, _, _ in results)
    assert hits == [False, True]  # one built, the other waited on the lock and loaded
    assert len({build_id for _, build_id, _ in results}) == 1
    assert {n for _, _, n in results} == {999}
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
