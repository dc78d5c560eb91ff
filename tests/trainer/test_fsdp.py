"""FSDP2 (``fsdp: full_shard``) in the same recipe as DDP, on the real stories260K model, 2 gloo processes on CPU.

Equivalence: the global batch of 4 sequences split three ways must train the same model

    F  torchrun, 2 processes x batch 1 x accumulation 2, fsdp: full_shard auto_wrap  (set_requires_gradient_sync,
       fsdp_config.activation_checkpointing: recomputation must not change the numbers)
    D  torchrun, 2 processes x batch 1 x accumulation 2, DDP                          (no_sync)
    P  one plain process x batch 4

over 12 steps (1.5 epochs: the epoch boundary's reshuffle included). Tolerances as test_ddp (fp32 on CPU, sums
over differently shaped batches and ranks round differently): losses within 1e-5 relative (measured ~2e-7),
adapter tensors within 1e-4 relative Frobenius norm and 1e-4 absolute (measured 1.4e-5 / 2.4e-5 F vs P,
2.4e-6 F vs D).

Packing, LoRA dropout 0.1 and eval data whose shards differ in batch count (every FSDP forward is a
collective, so the short rank runs a stand-in forward): FSDP and DDP, 2 processes each, log the same losses,
eval losses and eval token counts (the same per-rank RNG streams draw the same dropout masks).

Resume: in that packed FSDP run, a worker SIGKILLed after step 7 (checkpoint-6 holds every rank's shard) with
``--max-restarts 1`` must end with the adapter of the uninterrupted run. Measured: bit-identical; allowed 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError
from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry,
    run_ferry_train,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)
from trainer import checkpoint as ckpt
from trainer.config import TrainConfig

LOSS_RTOL = 1e-5
ADAPTER_REL_FROBENIUS, ADAPTER_MAX_ABS = 1e-4, 1e-4
KILL_AT = 7


#: F, D and P are the session's shared equivalence runs (tests/trainer/conftest.py): D and P are test_ddp.py's C
#: and B, so the files share one xdist worker (tests/support/suite.py).
pytestmark = [
    pytest.mark.two_ranks,
    pytest.mark.budget(150, reason="a 2-process FSDP run killed after step 7 and resumed by torchrun"),
]
SHAPES = {"F": "fsdp_2x1x2", "D": "ddp_2x1x2", "P": "plain_4"}


@pytest.fixture(scope="module")
def runs(equivalence_run) -> dict[str, Path]:
    return {name: equivalence_run(shape) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("name", ["F", "D"])
def test_fsdp_and_ddp_train_what_one_process_trains(runs, name):
    reference = train_losses(runs["P"])
    losses = train_losses(runs[name])
    assert len(losses) == len(reference) == 12
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    assert_same_adapter(
        adapter_tensors(runs[name] / "adapter"),
        adapter_tensors(runs["P"] / "adapter"),
        rel_frobenius=ADAPTER_REL_FROBENIUS,
        max_abs=ADAPTER_MAX_ABS,
    )


def test_fsdp_equals_ddp_and_writes_a_peft_adapter(runs, stories_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert train_losses(runs["F"]) == pytest.approx(train_losses(runs["D"]), rel=LOSS_RTOL)
    fsdp_adapter = adapter_tensors(runs["F"] / "adapter")
    assert_same_adapter(
        fsdp_adapter,
        adapter_tensors(runs["D"] / "adapter"),
        rel_frobenius=ADAPTER_REL_FROBENIUS,
        max_abs=ADAPTER_MAX_ABS,
    )
    assert any(v.abs().max() > 1e-3 for k, v in fsdp_adapter.items() if "lora_B" in k)  # it trained
    # full tensors (gathered), not shards: the shapes of the DDP adapter
    assert {k: v.shape for k, v in fsdp_adapter.items()} == {
        k: v.shape for k, v in adapter_tensors(runs["D"] / "adapter").items()
    }
    base = AutoModelForCausalLM.from_pretrained(stories_model)
    tuned = PeftModel.from_pretrained(base, runs["F"] / "adapter")  # what `ferry export` reads
    ids = torch.tensor([[1, 403, 261, 280, 370, 261, 407, 31, 2]])
    with torch.no_grad():
        assert torch.isfinite(tuned(ids).logits).all()
    report = json.loads((runs["F"] / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["global_batch_size"] == 4
    assert report["trainable_params"] == json.loads((runs["D"] / "train_report.json").read_text())["trainable_params"]


def test_no_peft_false_alarm_reaches_the_run_logs(runs):
    """peft 0.21.2 reads transformers' deprecated ``is_gradient_checkpointing`` on every model it wraps and flags
    fused-expert rank patterns it did apply (trainer/peft_build.py ``PEFT_FALSE_ALARMS``): neither reaches the library
    logs of an FSDP, a DDP or a one-process run (output_dir/logs/libraries-*.log, written when a library logs)."""
    for name, out in runs.items():
        text = "".join(p.read_text() for p in (out / "logs").glob("libraries-*.log"))
        assert "is_gradient_checkpointing" not in text and "_pattern keys did not match" not in text, name


# ---------------------------------------------------------------------- packing, eval, resume


@pytest.fixture(scope="module")
def packed(stories_model, llamafactory_data, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """FSDP and DDP, 2 processes each, with packing (LLaMA-Factory's short identity rows, 2+ per row), LoRA
    dropout 0.1, 5 eval samples (eval batch 2: rank 0
    runs 2 batches, rank 1 one, so FSDP's rank 1 runs a stand-in forward), checkpoints every 3 steps, 9 steps."""
    work = tmp_path_factory.mktemp("fsdp-packed")
    runs = {}
    for name, extra in (("fsdp", {"fsdp": "full_shard"}), ("ddp", {})):
        cfg = tiny_config(
            stories_model,
            llamafactory_data,
            work,
            output_dir=str(work / name),
            packing=True,
            dataset="identity",
            cutoff_len=512,
            max_samples=40,
            per_device_train_batch_size=1,
            lora_dropout=0.1,
            val_size=5,
            per_device_eval_batch_size=2,
            eval_steps=3,
            max_steps=9,
            save_steps=3,
            save_total_limit=2,
            **extra,
        )
        run_ferry_train(
            write_config(work / f"{name}.yaml", cfg), "--nproc-per-node", "2", env=worker_env(work), cwd=work
        )
        runs[name] = (work / name, cfg)
    return runs


def _evals(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]


def test_packing_dropout_and_uneven_eval_shards_under_fsdp_as_under_ddp(packed):
    (fsdp, _), (ddp, _) = packed["fsdp"], packed["ddp"]
    assert train_losses(fsdp) == pytest.approx(train_losses(ddp), rel=LOSS_RTOL)
    assert_same_adapter(
        adapter_tensors(fsdp / "adapter"),
        adapter_tensors(ddp / "adapter"),
        rel_frobenius=ADAPTER_REL_FROBENIUS,
        max_abs=ADAPTER_MAX_ABS,
    )
    evals, expected = _evals(fsdp), _evals(ddp)
    assert [r["step"] for r in evals] == [3, 6, 9]
    assert [r["eval_tokens"] for r in evals] == [r["eval_tokens"] for r in expected]  # the stand-in is not counted
    assert [r["eval_loss"] for r in evals] == pytest.approx([r["eval_loss"] for r in expected], rel=LOSS_RTOL)
    stats = json.loads((fsdp / "train_report.json").read_text())["data_stats"]
    assert stats["packing"] and stats["num_train_sequences"] < 0.6 * stats["num_train_samples"]  # rows of 2-3 samples


def test_killed_fsdp_worker_resumes_from_its_sharded_checkpoint_exactly(packed, tmp_path):
    ref, cfg = packed["fsdp"]
    cfg = {**cfg, "output_dir": str(tmp_path / "out")}
    config = write_config(tmp_path / "config.yaml", cfg)
    env = worker_env(tmp_path, FERRY_TEST_KILL_AT_STEP=str(KILL_AT))
    run_ferry_train(config, "--nproc-per-node", "2", "--max-restarts", "1", env=env, cwd=tmp_path)
    out = tmp_path / "out"
    report = json.loads((out / "train_report.json").read_text())
    assert report["resumed_from"] == str(out / "checkpoint-6")
    assert train_losses(out) == pytest.approx(train_losses(ref), rel=1e-6)
    assert_same_adapter(
        adapter_tensors(out / "adapter"), adapter_tensors(ref / "adapter"), rel_frobenius=1e-6, max_abs=1e-6
    )

    # the layout: one shard file per rank + rank 0's metadata, no optimizer.pt, a PEFT adapter beside them
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]  # none at the end
    newest = out / "checkpoint-6"
    sharded = sorted(p.name for p in (newest / ckpt.SHARDED_DIR).iterdir())
    assert sharded == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (newest / "optimizer.pt").exists()
    assert json.loads((newest / ckpt.STATE_FILE).read_text())["extra"] == {"fsdp": "full_shard"}
    assert (newest / "adapter_model.safetensors").is_file() and (newest / "adapter_config.json").is_file()
    assert not list(out.glob(".checkpoint-*")), "no temp folder left behind"

    # a DDP run cannot continue an FSDP checkpoint: refused by the launcher before any worker trains, one line
    ddp = run_ferry_train(
        config,
        "--nproc-per-node",
        "2",
        "fsdp=false",
        f"resume_from_checkpoint={newest}",
        env=worker_env(tmp_path),
        cwd=tmp_path,
        check=False,
    )
    assert ddp.returncode == 2, ddp.stderr[-2000:]
    last = ddp.stderr.strip().splitlines()[-1]
    assert last.startswith("ferry: error: ") and "written with fsdp full_shard, this run has fsdp off (DDP)" in last


# ---------------------------------------------------------------------- config and dry run


def _cfg(**keys) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", dataset="d", output_dir="o", **keys)


def test_fsdp_keys_follow_hf_training_arguments():
    cfg = _cfg(fsdp="full_shard auto_wrap")
    assert cfg.fsdp == ["full_shard", "auto_wrap"] and cfg.fsdp_strategy == "full_shard"
    assert cfg.fsdp_reshard_after_forward and not cfg.fsdp_cpu_offload
    # checkpointing is on unless turned off, as in LLaMA-Factory (disable_gradient_checkpointing: false)
    assert cfg.activation_checkpointing and cfg.gradient_checkpointing
    assert not _cfg(fsdp="full_shard", disable_gradient_checkpointing=True).activation_checkpointing
    assert not _cfg(fsdp="full_shard", fsdp_config={"activation_checkpointing": False}).activation_checkpointing
    cfg = _cfg(fsdp=["shard_grad_op", "offload"], fsdp_config={"fsdp_activation_checkpointing": True})
    assert not cfg.fsdp_reshard_after_forward and cfg.fsdp_cpu_offload and cfg.activation_checkpointing
    assert _cfg(fsdp="hybrid_shard", fsdp_config={"reshard_after_forward": False}).fsdp_reshard_after_forward is False
    assert _cfg(fsdp=True).fsdp == ["full_shard"] and _cfg(fsdp=False).fsdp == [] and _cfg().fsdp_strategy is None


def test_bad_fsdp_keys_name_the_key(tmp_path):
    from trainer.config import load_config

    base = ["model_name_or_path=m", "dataset=d", "output_dir=o"]
    for override, expected in (
        ("fsdp=full_shrad", "unknown fsdp option 'full_shrad' (did you mean 'full_shard'?)"),
        ("fsdp=offload", "offload needs a sharding strategy"),
        ("fsdp=full_shard hybrid_shard", "choose one sharding strategy"),
        ("fsdp_config={cpu_offlod: true}", "key 'fsdp_config': cpu_offlod: Extra inputs are not permitted"),
        ("fsdp_config={version: 1}", "key 'fsdp_config': version"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(None, [*base, override])
        assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="use_dora is not supported with fsdp"):
        load_config(None, [*base, "fsdp=full_shard", "use_dora=true"])


def test_resuming_across_ddp_and_fsdp_is_refused():
    state = ckpt.TrainerState(
        global_step=3,
        epoch=0,
        micro_batches_in_epoch=3,
        tokens_seen=1,
        world_size=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        seed=1,
    )
    ckpt.check_parallelism(state, Path("c"), None)
    with pytest.raises(ConfigError, match="written with fsdp off \\(DDP\\), this run has fsdp full_shard"):
        ckpt.check_parallelism(state, Path("c"), "full_shard")
    state.extra = {"fsdp": "full_shard"}
    ckpt.check_parallelism(state, Path("c"), "hybrid_shard")  # the same sharded layout: DCP reshards


def test_memory_estimate_halves_model_state_and_recommends_fsdp_when_ddp_does_not_fit(stories_model, make_cfg):
    import torch

    from trainer.fsdp import estimate_memory, model_memory_inputs
    from trainer.launch import memory_plan
    from trainer.modeling import build_lora_model

    cfg = make_cfg(cutoff_len=64, per_device_train_batch_size=2)
    meta = build_lora_model(cfg, stories_model, device=torch.device("meta"), dtype=torch.float32, meta=True)
    inputs = model_memory_inputs(meta, cfg, 4)
    assert inputs["frozen_params"] + inputs["trainable_params"] == sum(p.numel() for p in meta.parameters())
    assert (inputs["hidden"], inputs["layers"], inputs["vocab"]) == (64, 5, 512)
    est = estimate_memory(world_size=2, **inputs)
    ddp, fsdp = est["ddp"], est["fsdp"]
    assert ddp.weights == inputs["frozen_params"] * 4 + inputs["trainable_params"] * 4
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (ddp.weights / 2, ddp.gradients / 2, ddp.optimizer / 2)
    assert fsdp.activations == ddp.activations and ddp.gathered == 0 < fsdp.gathered

    # a budget between FSDP's and DDP's totals: FSDP is recommended; a large one: DDP fits
    between = (ddp.total + fsdp.total) / 2
    plan = memory_plan(meta, cfg, 2, 2, budget=(between, "test budget"))
    assert "DDP would not fit" in plan["recommend"] and "set fsdp: full_shard" in plan["recommend"]
    assert "DDP fits" in memory_plan(meta, cfg, 2, 2, budget=(1e12, "test budget"))["recommend"]
    assert "neither fits" in memory_plan(meta, cfg, 2, 2, budget=(1.0, "test budget"))["recommend"]


def test_memory_estimate_holds_one_chunk_of_logits_and_no_sgd_state(make_cfg, tmp_path):
    """The dry run's plan follows what the loop does: a large vocabulary's logits are one chunk of
    trainer.loss.chunk_tokens_for rows (not the whole micro-batch), a family whose logits are post-processed
    (gemma2's final_logit_softcapping: the loop falls back, tests/trainer/test_loss.py) counts them whole, and
    optim: sgd keeps no optimizer state."""
    import torch

    from tests.support.zoo import FAMILIES
    from trainer.fsdp import estimate_memory, model_memory_inputs
    from trainer.loss import chunk_tokens_for
    from trainer.modeling import build_lora_model

    def inputs_of(name: str, config: object, **keys: object) -> dict:
        folder = tmp_path / name
        config.save_pretrained(folder)  # config.json alone: the meta model reads no weights
        cfg = make_cfg(model_name_or_path=str(folder), cutoff_len=1024, per_device_train_batch_size=4, **keys)
        meta = build_lora_model(cfg, folder, device=torch.device("meta"), dtype=torch.float32, meta=True)
        return model_memory_inputs(meta, cfg, 4)

    from transformers import LlamaConfig

    qwen_vocab = LlamaConfig(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    chunked = inputs_of("llama", qwen_vocab)
    rows = chunk_tokens_for(151_936)
    assert chunked["logits_rows"] == rows < 4 * 1024 and chunked["optimizer_bytes_per_param"] == 8.0
    whole = estimate_memory(world_size=1, **{**chunked, "logits_rows": None})["ddp"]
    ours = estimate_memory(world_size=1, **chunked)["ddp"]
    assert whole.activations - ours.activations == 2 * (4 * 1024 - rows) * 151_936 * 4  # bytes of fp32 logits
    assert ours.optimizer == chunked["trainable_params"] * 8

    sgd = inputs_of("llama-sgd", qwen_vocab, optim="sgd")
    assert estimate_memory(world_size=1, **sgd)["ddp"].optimizer == 0

    gemma2 = FAMILIES["gemma2"][0]()
    assert gemma2.final_logit_softcapping
    assert inputs_of("gemma2", gemma2)["logits_rows"] is None


def test_dry_run_prints_memory_per_rank_for_ddp_and_fsdp(stories_model, llamafactory_data, tmp_path):
    cfg = tiny_config(stories_model, llamafactory_data, tmp_path, fsdp="full_shard")
    config = write_config(tmp_path / "c.yaml", cfg)
    # forked (tests/trainer/test_launch.py runs a dry run as an exec'd process)
    proc = run_ferry(
        ["train", str(config), "--nproc-per-node", "2", "--dry-run"], env=worker_env(tmp_path), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("memory per rank:"))
    assert "estimate at world size 2; budget" in lines[head] and "RAM / 2 process(es)" in lines[head]
    assert lines[head + 1].split() == ["mode", "weights", "gradients", "optimizer", "activations", "gathered", "total"]
    assert lines[head + 2].split()[0] == "DDP" and lines[head + 3].split()[0] == "FSDP"
    assert lines[head + 4].startswith("recommendation:      DDP fits")  # 1 MB of weights: RAM is plenty
    assert not (tmp_path / "out").exists()


def test_rdzv_timeout_goes_to_the_c10d_rendezvous():
    from trainer.launch import torchrun_command

    common = dict(nproc_per_node=1, nnodes=2, node_rank=0, master_addr=None, master_port=None, max_restarts=0)
    cmd = torchrun_command(Path("c.yaml"), rdzv_endpoint="10.213.0.1:29400", rdzv_timeout=30, **common)
    assert "--rdzv-conf=join_timeout=30" in cmd and "--rdzv-backend=c10d" in cmd
    with pytest.raises(ConfigError, match="--rdzv-timeout 30: needs a positive number of seconds and --rdzv-endpoint"):
        torchrun_command(Path("c.yaml"), rdzv_endpoint=None, rdzv_timeout=30, **{**common, "master_addr": "10.213.0.1"})


HOST_ALLOCATOR_PROBE = r"""
import json, sys, torch
from trainer.fsdp import HostAllocator

def big_mappings():  # MiB in unnamed anonymous mappings (malloc's own maps; not [heap], not files)
    n = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            n += (hi - lo) if len(line.split()) == 5 else 0
    return round(n / (1 << 20))

tuned = HostAllocator(torch.device("cpu")) if sys.argv[1] == "tuned" else None
warm = torch.ones(1 << 20)  # 4 MiB: glibc maps it; freeing it raises glibc's dynamic threshold past 4 MiB
del warm
before = big_mappings()
weights = torch.ones(1 << 20)  # a gathered layer
held = big_mappings() - before
del weights
after = big_mappings() - before
print(json.dumps({"active": bool(tuned and tuned.active), "held": held, "after": after}))
"""


@pytest.mark.parametrize("mode", ["tuned", "default"])
def test_host_allocator_maps_gathered_layers_and_returns_them(mode):
    """HostAllocator's mallopt: a 4 MiB block (a gathered layer) gets a mapping of its own, gone when freed. With
    glibc's dynamic threshold (mallopt(3)) the same block comes from the heap once a 4 MiB block was freed, and
    the heap keeps what is freed between live blocks. The probe runs in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", HOST_ALLOCATOR_PROBE, mode], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if mode == "tuned":
        assert result == {"active": True, "held": 4, "after": 0}
    else:
        assert result == {"active": False, "held": 0, "after": 0}


def test_fsdp_workers_start_with_huge_pages_for_mapped_blocks(tmp_path, monkeypatch):
    from trainer.launch import _worker_env

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert _worker_env(None, 2, tmp_path / "g", fsdp=True)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in _worker_env(None, 2, tmp_path / "g", fsdp=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert (
        _worker_env(None, 2, tmp_path / "g", fsdp=True)["GLIBC_TUNABLES"]
        == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert _worker_env(None, 2, tmp_path / "g", fsdp=True)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_checkpointing_on_a_model_that_cannot_is_skipped_with_one_line(stories_model, make_cfg, monkeypatch, capsys):
    """Checkpointing is on by default (LLaMA-Factory's default); a model class that says it does not support it
    trains without it and rank 0 says so in one line (LLaMA-Factory warns likewise), instead of failing."""
    from trainer.fsdp import enable_activation_checkpointing
    from trainer.modeling import build_lora_model

    cfg = make_cfg()
    assert cfg.gradient_checkpointing
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    base = model.get_base_model()
    assert enable_activation_checkpointing(model) and base.is_gradient_checkpointing
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    base = model.get_base_model()
    monkeypatch.setattr(type(base), "supports_gradient_checkpointing", False)
    capsys.readouterr()
    assert enable_activation_checkpointing(model) is False
    assert not base.is_gradient_checkpointing
    assert capsys.readouterr().err == (
        "ferry: gradient_checkpointing: LlamaForCausalLM does not support it; training "
        "without it (more activation memory, the same result)\n"
    )


def test_fsdp_on_a_torch_older_than_2_8_is_refused_in_one_line(stories_model, llamafactory_data, tmp_path, monkeypatch):
    """FSDP2's ``fully_shard(reshard_after_forward=None)`` needs torch 2.8 (pyproject.toml's floor, 2.6, is what
    DDP needs): on an older torch (the version stands in for a GPU host's preinstalled 2.7) ``ferry train`` with
    fsdp stops in its pre-flight (here the dry run's) with one line; DDP on the same torch is not refused."""
    from ferry import versions
    from trainer.fsdp import require_fsdp_torch
    from trainer.launch import launch

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda dist: "2.7.1+cu126" if dist == "torch" else real(dist))
    with pytest.raises(ConfigError) as err:
        require_fsdp_torch()
    assert str(err.value).startswith(
        "fsdp (FSDP2's fully_shard with reshard_after_forward=None) needs torch >= 2.8, and torch 2.7.1+cu126 is "
        "installed"
    )
    config = write_config(tmp_path / "c.yaml", tiny_config(stories_model, llamafactory_data, tmp_path))
    saved = dict(os.environ)
    try:
        with pytest.raises(ConfigError, match=r"^fsdp \(FSDP2's .* needs torch >= 2.8"):
            launch(config, ["fsdp=full_shard"], nproc_per_node=2, dry_run=True)
        assert launch(config, nproc_per_node=2, dry_run=True).world_size == 2
    finally:  # launch() sets the offline variables in its own process
        os.environ.clear()
        os.environ.update(saved)
