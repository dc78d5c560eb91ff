"""benchmarks/gpu_check.py, the prepared GPU check, in its CPU form (``--tiny``), as the device would run it.

- The whole ``--tiny`` list (about 1.5 minutes on 2 idle cores): every check is in the report, none failed, the
  CUDA-only ones are skipped with a reason naming CUDA, the others passed with their figures, within the bounds
  the checks state, and the report is valid JSON.
- ``--only`` reruns exactly the checks it names (or, ``failed``, the report's failures) and keeps every other
  entry as it was; a check past its timeout is recorded failed with the reason and the report stays valid JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from tests.support.helpers import fork_ferry

pytestmark = pytest.mark.budget(
    600,
    reason="the --tiny run makes every CPU check of gpu_check.py, each in its own subprocesses (training, export)",
)

ROOT = Path(__file__).resolve().parents[1]

#: The figures each check that runs on CPU must report (top-level keys of its ``figures``).
CPU_FIGURES = {
    "environment": ("python", "versions", "imports", "bitsandbytes_library", "bnb_4bit_matmul_rel_error"),
    "chunked_loss": ("fp32", "bf16", "chunk_rows"),
    "varlen": ("lengths", "loss_rel_diff_vs_padded", "worst_lora_grad_rel_frobenius_vs_padded", "seconds"),
    "cpu_reference": ("cpu_resumed_vs_cpu",),
    "bf16_gc_padding_free": ("run",),
    "export": ("plain", "qlora"),
    "fsdp": ("fsdp", "offload_vs_fsdp", "sharded_resume_vs_fsdp"),
    "speed": ("model", "data", "ferry", "trainer", "rounds", "ratios_vs_trainer", "goals"),
    "speed_variants": ("reference", "ferry_torchrun", "ferry_liger", "ferry_compiled"),
    "speed_realistic": ("tiny-wide-vocab",),
    "profile": ("settings", "ferry", "ferry_padded", "trainer", "ratios_vs_trainer", "padded_ratios_vs_trainer"),
    "preference": ("dpo", "rm", "rm_export"),
}
CUDA_ONLY = ("qlora", "fsdp_qlora", "syncs")


def run_gpu_check(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.gpu_check ARGS`` as a child forked from this process (torch, transformers and peft
    imported once for the whole suite, :func:`tests.support.helpers.fork_ferry`), which forks its checks in turn."""
    return fork_ferry(
        [], env=dict(os.environ), cwd=ROOT, timeout=timeout, entry=lambda _: sys.exit(gpu_check.main(list(args)))
    )


def entries(report_path: Path) -> dict[str, dict]:
    report = json.loads(report_path.read_text())  # valid JSON, or this raises
    return {e["name"]: e for e in report["checks"]}


def test_the_list_covers_every_check_once():
    assert set(CPU_FIGURES) | set(CUDA_ONLY) == set(gpu_check.CHECK_NAMES)
    assert len(gpu_check.CHECK_NAMES) == len(set(gpu_check.CHECK_NAMES))
    total = sum(c.gpu_timeout_s for c in gpu_check.CHECKS)
    assert f"the GPU timeouts add up to {total:g} s" in gpu_check.__doc__  # the docstring says what they are
    # any one check, rerun with --only and --timeout-scale 1.5, fits a 590 s device call
    assert max(c.gpu_timeout_s for c in gpu_check.CHECKS) * 1.5 <= 590
    assert {c.name for c in gpu_check.CHECKS if c.needs_cuda} == set(CUDA_ONLY)


@pytest.mark.slow
def test_tiny_run_passes_every_check_that_runs_on_cpu(tmp_path):
    out = tmp_path / "report.json"
    proc = run_gpu_check("--tiny", "--out", str(out), "--work", str(tmp_path / "work"))
    got = entries(out)
    assert list(got) == list(gpu_check.CHECK_NAMES), proc.stdout[-3000:]
    failed = {n: (e.get("reason"), e.get("output_tail", "")[-2000:]) for n, e in got.items() if e["status"] == "failed"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in CUDA_ONLY:
        assert got[name]["status"] == "skipped" and "CUDA" in got[name]["reason"], got[name]
    for name, keys in CPU_FIGURES.items():
        assert got[name]["status"] == "passed", got[name]
        assert set(keys) <= set(got[name]["figures"]), (name, sorted(got[name]["figures"]))
        assert got[name]["asserts"] and got[name]["seconds"] > 0

    chunked = got["chunked_loss"]["figures"]
    for precision, (loss_bound, grad_bound) in gpu_check.CHUNKED_BOUNDS.items():
        assert chunked[precision]["chunked"]["loss_rel_diff_vs_whole"] <= loss_bound
        assert chunked[precision]["chunked"]["worst_lora_grad_rel_frobenius_vs_whole"] <= grad_bound
        # four 16-row chunks run more ops than the whole logits' one pass (the profiler counted both)
        assert chunked[precision]["chunked"]["aten_ops_per_step"] > chunked[precision]["whole"]["aten_ops_per_step"] > 0
    one_row = got["varlen"]["figures"]
    assert one_row["kernel"] == "per-sample sdpa reference" and one_row["lengths"] == [40, 31, 17, 9]
    assert one_row["loss_rel_diff_vs_padded"] <= 1e-5 and one_row["worst_lora_grad_rel_frobenius_vs_padded"] <= 1e-4
    for name, label in (("cpu_reference", "cpu_resumed_vs_cpu"), ("fsdp", "sharded_resume_vs_fsdp")):
        compared = got[name]["figures"][label]
        assert compared["steps"] == [4, 5, 6]
        assert compared["max_loss_rel_diff"] <= gpu_check.LOSS_RTOL
        assert compared["max_adapter_rel_frobenius"] <= gpu_check.ADAPTER_REL_FROBENIUS
    run = got["bf16_gc_padding_free"]["figures"]["run"]
    assert run["attention"] == "sdpa"  # one row on CPU: sdpa's mask (on CUDA the check expects ferry_varlen)
    assert run["checkpointed_layers"] == gpu_check.SHAPES["tiny"]["num_hidden_layers"]
    assert run["losses"][-1] < run["losses"][0]
    assert got["export"]["figures"]["plain"]["passed"] is True
    speed = got["speed"]["figures"]
    for side in ("ferry", "trainer"):
        assert speed[side]["tokens_per_s"] > 0 and speed[side]["launch_to_first_step_s"] > 0
    ferry = speed["ratios_vs_trainer"]["ferry"]
    # three rounds in alternating order; the ratio is their median, within their spread
    assert [r["order"][0] for r in speed["rounds"]] == ["ferry", "trainer", "ferry"]
    assert ferry["tokens_per_s_spread"][0] <= ferry["tokens_per_s"] <= ferry["tokens_per_s_spread"][1]
    assert sorted(ferry["tokens_per_s_rounds"])[1] == ferry["tokens_per_s"]
    assert all(r["tokens_per_step"] == 4 * 128 for r in speed["rounds"])  # batch 4, every row cut at cutoff 128
    realistic = got["speed_realistic"]["figures"]["tiny-wide-vocab"]
    assert realistic["order"] == ["ferry", "trainer"] and realistic["ratios_vs_trainer"]["tokens_per_s"] > 0
    # rows of unequal length, batch 8 at cutoff 128: fewer real tokens a step than batch x cutoff on both sides
    assert 0 < realistic["ferry"]["tokens_per_step"] < 8 * 128 and 0 < realistic["trainer"]["tokens_per_step"] < 8 * 128
    assert realistic["ferry"]["attention"] == "sdpa"  # on CUDA: ferry_varlen
    variants = got["speed_variants"]["figures"]
    assert "skipped" in variants["ferry_liger"] and "skipped" in variants["ferry_compiled"]
    # it compared its torchrun run with the speed check's medians (the same work folder)
    assert variants["reference"]["from"].startswith("the speed check's") and variants["reference"]["ferry_tokens_per_s"]
    assert variants["ferry_torchrun"]["tokens_per_s_vs_ferry"] > 0


def fake_report(path: Path, failed: str) -> dict[str, dict]:
    """A previous ``--tiny`` report with every check present, ``failed`` failed and the rest passed; each entry's
    figures hold a marker naming it."""
    checks = [
        {
            "name": n,
            "status": "failed" if n == failed else "passed",
            "seconds": 1.0,
            "asserts": "-",
            "figures": {"marker": n},
        }
        for n in gpu_check.CHECK_NAMES
    ]
    path.write_text(json.dumps({"format": 1, "mode": "tiny", "checks": checks}))
    return {c["name"]: c for c in checks}


def test_only_reruns_exactly_the_named_checks_and_keeps_the_rest(tmp_path):
    out = tmp_path / "report.json"
    before = fake_report(out, failed="environment")
    proc = run_gpu_check("--tiny", "--only", "failed", "--out", str(out), "--work", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = entries(out)
    assert list(after) == list(gpu_check.CHECK_NAMES)
    assert after["environment"]["status"] == "passed"
    assert "marker" not in after["environment"]["figures"] and "versions" in after["environment"]["figures"]
    for name in gpu_check.CHECK_NAMES[1:]:
        assert after[name] == before[name]

    # an explicitly named check past its (scaled) timeout: failed with the reason, the rest untouched
    proc = run_gpu_check(
        "--tiny",
        "--only",
        "environment",
        "--timeout-scale",
        "0.00001",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
    )
    assert proc.returncode == 1
    after = entries(out)
    assert after["environment"]["status"] == "failed"
    assert after["environment"]["reason"].startswith("timed out after 0.0012 s")
    assert "output_tail" in after["environment"]
    for name in gpu_check.CHECK_NAMES[1:]:
        assert after[name] == before[name]


def test_only_refuses_an_unknown_name_and_a_report_of_the_other_mode(tmp_path):
    proc = run_gpu_check("--tiny", "--only", "speedy", "--out", str(tmp_path / "r.json"), timeout=120)
    assert proc.returncode != 0 and "unknown check 'speedy'" in proc.stderr
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"format": 1, "mode": "gpu", "checks": []}))
    proc = run_gpu_check("--tiny", "--only", "environment", "--out", str(out), timeout=120)
    assert proc.returncode != 0 and "holds a gpu run" in proc.stderr


def test_peak_flops_by_gpu_name():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == ("H100", 989e12)
    assert gpu_check.peak_flops("NVIDIA H200") == ("H200", 989e12)
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == ("H100 PCIe", 756e12)
    assert gpu_check.peak_flops("NVIDIA A10G") is None


def _fake_run(path: Path, losses: list[float], scale: float) -> Path:
    import torch
    from safetensors.torch import save_file

    (path / "adapter").mkdir(parents=True)
    rows = [json.dumps({"step": i + 1, "loss": v}) for i, v in enumerate(losses)]
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    weight = torch.linspace(-1.0, 1.0, 64).reshape(8, 8) * scale
    save_file({"base_model.model.layer.lora_A.weight": weight}, str(path / "adapter" / "adapter_model.safetensors"))
    return path


def test_compare_runs_records_every_difference_and_knows_the_cross_device_bounds(tmp_path):
    ref = _fake_run(tmp_path / "ref", [2.0, 1.5, 1.2], 1.0)
    # adapter off by 5e-4 relative (5e-4 absolute at the largest element): past the same-device bounds only
    near = _fake_run(tmp_path / "near", [2.0, 1.5, 1.2], 1.0 + 5e-4)
    ctx = gpu_check.Ctx(tiny=True, work=tmp_path, name="t")
    gpu_check.compare_runs(ctx, "same", near, ref)
    assert [f.split(":")[0] for f in ctx.failures] == ["same", "same"]  # Frobenius and absolute, both recorded
    assert ctx.figures["same"]["bounds"]["adapter_rel_frobenius"] == gpu_check.ADAPTER_REL_FROBENIUS
    ctx.failures.clear()
    gpu_check.compare_runs(ctx, "cross", near, ref, cross_device=True)
    assert ctx.failures == []
    assert ctx.figures["cross"]["max_adapter_rel_frobenius"] == pytest.approx(5e-4, rel=1e-2)
    # the losses keep the strict bound across devices
    off = _fake_run(tmp_path / "off", [2.0, 1.5, 1.2 * (1 + 1e-4)], 1.0)
    gpu_check.compare_runs(ctx, "loss", off, ref, cross_device=True)
    assert len(ctx.failures) == 1 and ctx.failures[0].startswith("loss: losses differ by")


def test_only_groups_split_the_checks_into_device_calls():
    correctness = gpu_check.resolve_only("correctness", None)
    timing = gpu_check.resolve_only("timing", None)
    assert sorted(correctness + timing) == sorted(gpu_check.CHECK_NAMES)
    assert not set(correctness) & set(timing)
    assert timing == ["speed", "speed_variants", "speed_realistic", "profile", "syncs"]
    assert gpu_check.resolve_only("timing,environment", None) == ["environment", *timing]
    calls = [gpu_check.resolve_only(group, None) for group in ("rates", "realistic", "traces")]
    assert sum(calls, []) == timing  # three device calls cover the timing checks
