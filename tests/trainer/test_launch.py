"""``ferry train`` as a command: the dry run, the torchrun command line, and bad input as one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError, DataError
from tests.support.helpers import run_ferry_train, tiny_config, worker_env, write_config
from trainer.launch import resolve_nproc_per_node, torchrun_command

pytestmark = pytest.mark.budget(60, reason="launcher runs through torchrun")


@pytest.fixture
def restore_environ():
    """launch() sets the offline variables in its own process (it is the CLI's process); undo that here."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def config(stories_model, llamafactory_data, tmp_path) -> Path:
    return write_config(tmp_path / "config.yaml", tiny_config(stories_model, llamafactory_data, tmp_path))


def test_dry_run_prints_the_plan_and_starts_nothing(config, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "train", str(config), "lora_rank=4", "--nproc-per-node", "2", "--dry-run"],
        env=worker_env(tmp_path),
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no library notice (bitsandbytes' kernel warning) on the plan
    out = proc.stdout
    assert "resolved config:" in out and "lora_rank: 4" in out and "lora_alpha: 8.0" in out
    assert "world size:          2 (1 node(s) x 2 process(es))" in out
    assert "global batch size:   4 sequences" in out
    assert "steps:               12 (8 per epoch)" in out  # 32 samples / 4 per step = 8, x 1.5 epochs
    assert "trainable params:    23,120 of 283,152" in out  # r=4 on 7 linear kinds x 5 layers
    assert "tokens per step:" in out and "--standalone" in out
    assert not (tmp_path / "out").exists()


def test_an_output_dir_too_small_for_a_checkpoint_is_refused_and_one_too_small_for_all_is_a_warning(
    stories_model, llamafactory_data, tmp_path
):
    """``output_dir`` on a 256 KiB tmpfs cannot hold one checkpoint of this run (46,240 LoRA parameters: at least
    2 bytes of adapter and 8 of AdamW state each): refused before any step, in one line. On a 2 MiB one it holds
    the first checkpoints but not the 11 this run keeps (save_steps 1, 12 steps, no save_total_limit): one warning
    line, and the plan goes on. The parameters the line counts are the ones the dry run's peft model trains."""
    from tests.support.helpers import run_ferry

    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = tiny_config(
        stories_model, llamafactory_data, tmp_path, save_steps=1, max_steps=12, output_dir=str(disk / "out")
    )
    config = write_config(tmp_path / "c.yaml", cfg)
    said = {}
    for size in ("256k", "2m"):
        args = ["train", str(config), "--nproc-per-node", "1", "--dry-run"]
        proc = run_ferry(
            args, env=worker_env(tmp_path), cwd=tmp_path, mount_setup=f"mount -t tmpfs -o size={size} tmpfs {disk}"
        )
        said[size] = proc
    small, roomier = said["256k"], said["2m"]
    assert small.returncode == 9, small.stderr[-3000:]  # InsufficientSpaceError
    (line,) = small.stderr.strip().splitlines()
    found = re.fullmatch(
        rf"ferry: error: output_dir {re.escape(str(disk / 'out'))}: 256\.0 KiB free, but this run writes at least "
        r"([0-9.]+) KiB there: a checkpoint \(the adapter and its optimizer state\) and the adapter, ([0-9,]+) trained "
        r"parameters; make room or choose another output_dir",
        line,
    )
    assert found, line
    assert roomier.returncode == 0, roomier.stderr[-3000:]
    (warning,) = roomier.stderr.strip().splitlines()
    assert warning.startswith(f"ferry: warning: output_dir {disk / 'out'} has 2.0 MiB free, and the 11 checkpoints ")
    assert warning.endswith("a save will find the disk full (save_total_limit keeps fewer)"), warning
    trainable = re.search(r"trainable params: +([0-9,]+) of", roomier.stdout)
    assert trainable and trainable.group(1) == found.group(2) == "46,240", roomier.stdout
    assert float(found.group(1)) == pytest.approx(46_240 * 12 / 1024, abs=0.1)
    assert not (disk / "out").exists()


def test_a_dry_run_takes_every_llamafactory_key_at_its_default(stories_model, llamafactory_data, tmp_path):
    """One ``ferry train --dry-run`` of a config holding every LLaMA-Factory 0.9.5 training key that has a literal
    default, at that default (as LlamaBoard saves them), on stories260K: it plans, saying nothing of them."""
    from ferry.lf_keys import lf_keys
    from tests.support.helpers import run_ferry

    everything = {k: v["default"] for k, v in lf_keys("train").items() if v["literal"]}
    cfg = {**everything, **tiny_config(stories_model, llamafactory_data, tmp_path), "template": "alpaca"}
    config = write_config(tmp_path / "c.yaml", cfg)
    proc = run_ferry(
        ["train", str(config), "--nproc-per-node", "1", "--dry-run"], env=worker_env(tmp_path), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "" and "trainable params:" in proc.stdout, proc.stderr[-3000:]


def test_dry_run_report_matches_the_real_model(config, stories_model, restore_environ):
    from trainer.config import load_config
    from trainer.launch import launch
    from trainer.modeling import build_lora_model, count_parameters

    report = launch(
        config,
        ["gradient_accumulation_steps=2"],
        nproc_per_node=2,
        nnodes=2,
        rdzv_endpoint="10.0.0.1:29400",
        dry_run=True,
    )
    assert report.world_size == 4 and report.global_batch_size == 2 * 2 * 4
    assert (report.steps_per_epoch, report.total_steps) == (2, 3)  # 32 / 4 ranks / 2 = 4 micro -> 2 steps
    real = build_lora_model(load_config(config), stories_model, device=torch.device("cpu"), dtype=torch.float32)
    assert (report.trainable_params, report.total_params) == count_parameters(real)
    assert report.num_train_samples == 32
    assert report.tokens_per_step == pytest.approx(report.data_stats["num_train_tokens"] / 32 * 16)
    assert "--rdzv-endpoint=10.0.0.1:29400" in report.command and report.command[-3:] == [
        "-m",
        "trainer",
        report.command[-1],
    ]


def test_torchrun_command_picks_the_rendezvous(tmp_path):
    cfg = tmp_path / "c.yaml"
    common = dict(nproc_per_node=2, node_rank=0, master_addr=None, master_port=None, rdzv_endpoint=None, max_restarts=1)
    single = torchrun_command(cfg, nnodes=1, **common)
    assert single[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in single and "--max-restarts=1" in single and single[-3:] == ["-m", "trainer", str(cfg)]
    c10d = torchrun_command(cfg, nnodes=2, **{**common, "rdzv_endpoint": "head:29400"})
    assert "--rdzv-backend=c10d" in c10d and "--rdzv-endpoint=head:29400" in c10d and "--standalone" not in c10d
    static = torchrun_command(cfg, nnodes=2, **{**common, "master_addr": "head", "node_rank": 1})
    assert {"--node-rank=1", "--master-addr=head", "--master-port=29500", "--nnodes=2"} <= set(static)
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        torchrun_command(cfg, nnodes=2, **common)


def test_nproc_per_node_auto_is_one_per_two_cores_on_cpu():
    if torch.cuda.is_available():
        assert resolve_nproc_per_node("auto") == torch.cuda.device_count()
    else:
        assert resolve_nproc_per_node("auto") == max(1, len(os.sched_getaffinity(0)) // 2)
    assert resolve_nproc_per_node("3") == 3
    for bad in ("0", "two", -1):
        with pytest.raises(ConfigError, match="nproc-per-node"):
            resolve_nproc_per_node(bad)


@pytest.mark.parametrize(
    ("args", "exit_code", "needles"),
    [
        (["lora_rnak=4"], 2, ["unknown key 'lora_rnak'", "did you mean 'lora_rank'"]),
        (["cutoff_len=long"], 2, ["cutoff_len"]),
        (["--nnodes", "2"], 2, ["--rdzv-endpoint"]),
        (["model_name_or_path=acme/not-installed"], 4, ["acme/not-installed", "ferry pack"]),
        (["dataset=no_such_dataset"], 4, ["no_such_dataset"]),
    ],
    ids=["unknown-key", "wrong-type", "nnodes-without-endpoint", "model-not-installed", "dataset-not-installed"],
)
def test_bad_input_is_one_line_and_an_exit_code(
    config, tmp_path, args, exit_code, needles, capsys, restore_environ, monkeypatch
):
    from ferry.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    with pytest.raises(SystemExit) as exc:
        main(["train", str(config), *args, "--dry-run"])
    assert exc.value.code == exit_code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("ferry: error: ")]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in errors[0]


def test_missing_config_file_through_the_real_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "train", str(tmp_path / "nope.yaml")],
        env=worker_env(tmp_path),
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"ferry: error: config file {str(tmp_path / 'nope.yaml')!r} does not exist"


def test_worker_entry_point_without_arguments_prints_usage(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer"],
        env=worker_env(tmp_path),
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python -m trainer CONFIG.yaml")


def test_bad_dataset_found_while_workers_start_is_still_one_line(config, tmp_path):
    """Without --dry-run torchrun is already starting its workers while the launcher checks the data; they
    wait at the start gate and leave quietly when the launcher aborts (or are stopped while still importing).
    The data is read before the checks that build the model: a malformed row is the one line although
    lora_target is wrong too, and the datasets library's own line about it (pyarrow's 0-based row) is not shown.
    A missing dataset is one line alike."""
    rows = [json.dumps({"instruction": f"q{i}", "input": "", "output": f"a{i}"}) for i in range(40)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + '\n{"instruction": "x", broken\n', encoding="utf-8")
    for extra, code, named in (
        ([f"dataset={bad}", "lora_target=nope_proj"], DataError.exit_code, f"{bad}: row 41: invalid JSON line"),
        (["dataset=no_such_dataset"], 4, "no_such_dataset"),
    ):
        proc = run_ferry_train(
            config, *extra, "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=tmp_path, check=False
        )
        assert proc.returncode == code, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ferry: error: ")]
        assert len(errors) == 1 and named in errors[0], proc.stderr
        assert proc.stderr.splitlines() == errors, proc.stderr  # nothing else: no pyarrow, torchrun or worker line
        assert not (tmp_path / "out").exists()


def test_keys_lists_every_config_key_from_the_schema(capsys):
    from ferry.cli import main
    from trainer.config import TrainConfig

    try:
        main(["train", "--keys"])  # needs no CONFIG.yaml
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = capsys.readouterr().out
    listed = [line.split("  (default:")[0] for line in out.splitlines() if "  (default: " in line]
    assert listed == list(TrainConfig.model_fields)
    assert "lora_rank  (default: 8)" in out


def test_tokenized_path_tokenises_and_stops_like_llamafactory(config, tmp_path):
    """A ``tokenized_path`` that does not exist yet: the data is tokenised into it and nothing trains (no worker,
    no output_dir); ``do_train: false`` with it does the same; the data is then there to train from."""
    tokenized = tmp_path / "tokenized"
    for extra in ([f"tokenized_path={tokenized}"], [f"tokenized_path={tokenized}", "do_train=false"]):
        proc = run_ferry_train(config, *extra, env=worker_env(tmp_path), cwd=tmp_path, check=False)
        assert proc.returncode == 0, proc.stderr
        assert f"into {tokenized}; nothing was trained" in proc.stdout
        assert list(tokenized.glob("*.safetensors")), "the tokenised data is in tokenized_path"
        assert not (tmp_path / "out").exists() and "torchrun" not in proc.stderr


def test_the_launcher_reaches_torchrun_without_importing_torch(tmp_path):
    """`ferry train` starts torchrun before anything imports torch, transformers or peft (their imports then
    overlap with the workers' own): loading and validating the config imports none of them."""
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: some/model\ndataset: alpaca_en_demo\noutput_dir: out\n", encoding="utf-8")
    code = (
        "import sys; from trainer.launch import launch, torchrun_command; from trainer.config import load_config; "
        f"load_config({str(config)!r}); print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_preflight_of_a_dense_model_imports_no_peft(tmp_path, stories_model, llamafactory_data):
    """The launcher's pre-flight (run while the workers import beside it on the same cores) resolves lora_target on
    a meta model without importing peft (seconds, bitsandbytes inside) when peft would rewrite nothing: the model
    type has no transformers checkpoint conversion (Llama here; MoE types such as qwen3_moe still go through
    peft's rewrite, tests/models). A bad target is still one line from the same pre-flight."""
    cfg = write_config(tmp_path / "c.yaml", tiny_config(stories_model, llamafactory_data, tmp_path, lora_target="all"))
    bad = write_config(
        tmp_path / "bad.yaml",
        tiny_config(stories_model, llamafactory_data, tmp_path / "b", lora_target="q_proj,nope_proj"),
    )
    code = (
        "import sys; from pathlib import Path; from trainer.config import load_config; "
        "from trainer.launch import preflight; from ferry.errors import ConfigError\n"
        f"preflight(load_config({str(cfg)!r}), Path({str(stories_model)!r}))\n"
        "print('peft' in sys.modules, 'bitsandbytes' in sys.modules)\n"
        f"try:\n    preflight(load_config({str(bad)!r}), Path({str(stories_model)!r}))\n"
        "except ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "False False", out.stdout + out.stderr
    assert lines[1].startswith("lora_target: nope_proj matches no linear layer"), lines


def test_a_worker_without_quantization_bit_never_imports_bitsandbytes(tmp_path, stories_model, llamafactory_data):
    """A worker (``python -m trainer``) of a plain LoRA run keeps bitsandbytes out of its imports (peft would pull it
    in, and with it a second of torch._inductor), and still trains and saves its adapter;
    with ``quantization_bit`` the mark is never set (the QLoRA runs in test_quant train through it)."""
    from trainer.config import load_config
    from trainer.quant_keys import keep_bitsandbytes_out

    cfg = write_config(
        tmp_path / "c.yaml", tiny_config(stories_model, llamafactory_data, tmp_path, max_steps=1, max_samples=4)
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainer", str(cfg)],
        env=worker_env(tmp_path),
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    cumulative_us = {
        line.split("|")[-1].strip(): int(line.split("|")[1])
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.split("|")[1].strip().isdigit()
    }
    assert {"torch", "peft", "transformers.modeling_utils"} <= cumulative_us.keys(), "importtime saw the imports"
    # peft's attempt shows as one failed import of microseconds, with nothing of bitsandbytes' own below it
    assert not [m for m in cumulative_us if m.startswith("bitsandbytes.")]
    assert cumulative_us.get("bitsandbytes", 0) < 1000, cumulative_us.get("bitsandbytes")
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    quantized = load_config(
        write_config(tmp_path / "q.yaml", tiny_config(stories_model, llamafactory_data, tmp_path, quantization_bit=4))
    )
    before = sys.modules.get("bitsandbytes", "absent")
    assert keep_bitsandbytes_out(quantized) is False and sys.modules.get("bitsandbytes", "absent") is before
