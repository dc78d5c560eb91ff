"""LLaMA-Factory's own example YAMLs, read at test time from the hash-pinned llamafactory 0.9.5 sdist
(tests/support/pinned_sdist.py), never copied: only paths and sizes are changed (and the template, which must fit the
tiny stories260K tokenizer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ferry.errors import ConfigError
from tests.support.helpers import ROOT, run_ferry_train, worker_env, write_config
from tests.support.pinned_sdist import LLAMAFACTORY
from trainer.config import load_config

#: Examples other helpers own (QLoRA, new tokens), and the folders that are not ferry train YAMLs.
OTHERS = ("train_qlora/", "extras/fsdp_qlora/", "extras/multi_tokens/", "extras/qoft/")
NOT_TRAIN = (
    "accelerate/",
    "deepspeed/",
    "megatron/",
    "ascend/",
    "ktransformers/accelerate/",
    "v1/",
    "merge_lora/",
    "inference/",
)
#: The examples ferry runs (nlg_eval: do_predict alone).
RUNS = (
    "train_lora/qwen3_lora_dpo.yaml",  # run by test_dpo.py on 2 ranks
    "train_lora/qwen3_lora_reward.yaml",  # run by test_rm.py on 2 ranks, then exported
    "train_lora/qwen3_lora_kto.yaml",  # run by test_kto.py on 2 ranks, then exported
    "train_lora/qwen3vl_lora_sft.yaml",  # run by test_vision_train.py on 2 ranks, then exported
    "train_lora/qwen3vl_lora_dpo.yaml",  # run by test_vision_train.py on image pairs
    "train_lora/qwen3_lora_sft.yaml",
    "train_lora/qwen3_lora_pretrain.yaml",
    "train_lora/qwen3_preprocess.yaml",
    "train_lora/qwen3_lora_sft_ds3.yaml",
    "extras/loraplus/llama3_lora_sft.yaml",
    "extras/pissa/llama3_lora_sft.yaml",
    "extras/nlg_eval/llama3_lora_predict.yaml",
)

pytestmark = pytest.mark.budget(
    120, reason="LLaMA-Factory's examples trained on 2 ranks, and a continued run beside a whole one"
)


def examples_root() -> Path:
    return LLAMAFACTORY.path() / "examples"


def example(name: str, stories_model: Path, data: Path, work: Path, **changes: Any) -> dict[str, Any]:
    """The example's keys with only paths and sizes changed: 2 steps of 8 samples cut to 64 tokens."""
    cfg = yaml.safe_load((examples_root() / name).read_text(encoding="utf-8"))
    cfg.update(
        model_name_or_path=str(stories_model),
        dataset_dir=str(data),
        output_dir=str(work / "out"),
        max_steps=2,
        max_samples=8,
        cutoff_len=64,
        dataloader_num_workers=0,
        template="alpaca",
        bf16=False,
        disable_tqdm=True,
        logging_steps=1,
    )
    if "deepspeed" in cfg:  # a path relative to LLaMA-Factory's checkout
        cfg["deepspeed"] = str(examples_root().parent / cfg["deepspeed"])
    if cfg.get("tokenized_path"):
        cfg["tokenized_path"] = str(work / "tokenized")
    cfg.update(changes)
    return cfg


def refused_examples() -> list[str]:
    names = sorted(str(p.relative_to(examples_root())) for p in examples_root().rglob("*.yaml"))
    return [n for n in names if not n.startswith(OTHERS + NOT_TRAIN) and n not in RUNS]


def test_every_example_ferry_does_not_train_is_one_line_naming_the_feature(
    stories_model, llamafactory_data, tmp_path, capsys
):
    """Every refused example through ferry's CLI entry point (in-process, `ferry train EXAMPLE --dry-run`): exit
    code 2, exactly one `ferry: error:` line naming the LLaMA-Factory feature, no traceback; one of them in a
    real subprocess too."""
    import os

    from ferry.cli import main

    refused = refused_examples()
    assert len(refused) >= 15, refused
    saved = dict(os.environ)
    try:
        for name in refused:
            path = write_config(tmp_path / name, example(name, stories_model, llamafactory_data, tmp_path))
            with pytest.raises(ConfigError) as err:
                load_config(path)
            message = str(err.value)
            assert "\n" not in message, (name, message)
            assert "LLaMA-Factory" in message or "unknown key" in message, (name, message)
            capsys.readouterr()
            with pytest.raises(SystemExit) as code:
                main(["train", str(path), "--dry-run"])
            captured = capsys.readouterr()
            assert code.value.code == 2, (name, captured.err)
            assert [line for line in captured.err.splitlines() if line.strip()] == [f"ferry: error: {message}"], (
                name,
                captured.err,
            )
            assert captured.out == "", (name, captured.out)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # a real process: exit 2, exactly one `ferry: error:` line, no traceback
    name = "train_full/qwen3_full_sft.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "train", str(tmp_path / name), "--dry-run"],
        env=worker_env(tmp_path),
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ferry: error:")]
    assert len(errors) == 1 and "full-parameter fine-tuning" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_deepspeed_zero_stages_map_to_fsdp(stories_model, llamafactory_data, tmp_path, caplog):
    from trainer.lf_compat import deepspeed_fsdp

    ds = examples_root().parent / "examples" / "deepspeed"
    assert deepspeed_fsdp(ds / "ds_z3_config.json")[0] == ["full_shard"]
    assert deepspeed_fsdp(ds / "ds_z3_offload_config.json")[0] == ["full_shard", "offload"]
    assert deepspeed_fsdp(ds / "ds_z2_config.json")[0] == ["shard_grad_op"]
    assert deepspeed_fsdp(ds / "ds_z0_config.json")[0] == []
    name = "train_lora/qwen3_lora_sft_ds3.yaml"
    cfg = load_config(write_config(tmp_path / "ds3.yaml", example(name, stories_model, llamafactory_data, tmp_path)))
    assert cfg.fsdp_strategy == "full_shard"
    assert any("ZeRO stage 3" in r.getMessage() and "full_shard" in r.getMessage() for r in caplog.records)
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a JSON file"):
        deepspeed_fsdp(broken)


def test_loraplus_gives_b_matrices_the_ratio(stories_model, llamafactory_data, tmp_path):
    """LLaMA-Factory's LoRA+ example builds peft's LoRA+ optimizer: B matrices at lr * 16."""
    from trainer.lf_compat import loraplus_optimizer
    from trainer.modeling import build_lora_model

    name = "extras/loraplus/llama3_lora_sft.yaml"
    cfg = load_config(write_config(tmp_path / "lp.yaml", example(name, stories_model, llamafactory_data, tmp_path)))
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    optimizer = loraplus_optimizer(model, cfg, fused=False)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            expected = cfg.learning_rate * (16.0 if "lora_B" in names[id(param)] else 1.0)
            assert group["lr"] == pytest.approx(expected), names[id(param)]


def test_pissa_example_trains_converts_and_merges_as_peft(stories_model, llamafactory_data, tmp_path):
    """extras/pissa: 2 steps, the adapter is saved as a plain LoRA (rank 2r) of the ORIGINAL base; ferry's
    streaming merge equals peft's merge_and_unload of it, and the trained PiSSA model equals base + adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from exporter.export import export
    from exporter.options import ExportOptions

    name = "extras/pissa/llama3_lora_sft.yaml"
    config = write_config(
        tmp_path / "pissa.yaml",
        example(name, stories_model, llamafactory_data, tmp_path, learning_rate=5e-3, warmup_ratio=0.0),
    )
    proc = run_ferry_train(
        str(config), "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=ROOT, check=False, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    adapter = yaml.safe_load((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["init_lora_weights"] is True  # 2 * lora_rank, a plain LoRA
    assert (out / "pissa_init" / "adapter_config.json").is_file()

    merged_dir = tmp_path / "merged"
    export(out / "adapter", merged_dir, ExportOptions(base=stories_model, smoke=False, dtype="float32"))
    base = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(out / "adapter")).merge_and_unload().state_dict()
    ours = {}
    for shard in merged_dir.glob("*.safetensors"):
        ours.update(load_file(str(shard)))
    changed = 0
    for key, value in ours.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(value, load_file(str(next(stories_model.glob("*.safetensors")))).get(key, value))
    assert changed > 0, "the adapter changed no weight"


def _random_adapter(stories_model: Path, folder: Path, seed: int, r: int) -> dict[str, torch.Tensor]:
    """A peft LoRA adapter on q_proj/v_proj with nonzero B (saved by peft itself); returns its tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32),
        LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(folder))
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_adapter_name_or_path_merges_earlier_adapters_and_continues_the_last(stories_model, make_cfg, tmp_path):
    """LLaMA-Factory's rule: all adapters but the last merged into the base (as peft's merge_and_unload), the last
    loaded trainable with its own rank; create_new_adapter merges all and draws a new LoRA of the YAML's rank."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.modeling import build_lora_model

    _random_adapter(stories_model, tmp_path / "a1", 1, 4)
    second = _random_adapter(stories_model, tmp_path / "a2", 2, 2)
    ours = build_lora_model(
        make_cfg(adapter_name_or_path=f"{tmp_path / 'a1'}, {tmp_path / 'a2'}"),
        stories_model,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    merged = (
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32), str(tmp_path / "a1")
        )
        .merge_and_unload()
        .state_dict()
    )
    state = ours.state_dict()
    for key, value in merged.items():  # the first adapter is in the base weights
        name = (
            key.replace(".weight", ".base_layer.weight")
            if key.replace(".weight", ".base_layer.weight") in {k.removeprefix("base_model.model.") for k in state}
            else key
        )
        torch.testing.assert_close(state["base_model.model." + name], value, msg=key)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert ours.peft_config["default"].r == 2  # the continued adapter's rank, not the YAML's 8
    for key, value in second.items():  # the second adapter continues as it was saved
        runtime = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        torch.testing.assert_close(trained[runtime].detach(), value, msg=key)

    meta = build_lora_model(
        make_cfg(adapter_name_or_path=str(tmp_path / "a2")),
        stories_model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        meta=True,
    )  # --dry-run's count
    assert meta.peft_config["default"].r == 2 and sum(p.numel() for p in meta.parameters() if p.requires_grad) == sum(
        p.numel() for p in trained.values()
    )
    fresh = build_lora_model(
        make_cfg(adapter_name_or_path=str(tmp_path / "a2"), create_new_adapter=True),
        stories_model,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert fresh.peft_config["default"].r == 8
    assert all(torch.count_nonzero(p) == 0 for n, p in fresh.named_parameters() if "lora_B" in n)
    with pytest.raises(ConfigError, match="holds no adapter_config.json"):
        build_lora_model(
            make_cfg(adapter_name_or_path=str(tmp_path)), stories_model, device=torch.device("cpu"), dtype=torch.float32
        )


def test_an_adapter_trained_on_merged_adapters_exports_only_with_them(stories_model, llamafactory_data, tmp_path):
    """extras/loraplus with create_new_adapter over a1: the new (LoRA+) adapter records a1; ferry export refuses it
    on the bare base (a wrong model otherwise) and a merge YAML listing a1 first merges both, equal to peft merging
    them in order."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from exporter.export import export
    from exporter.lf_merge import export_from_config
    from exporter.options import ExportOptions

    _random_adapter(stories_model, tmp_path / "a1", 1, 4)
    cfg = example(
        "extras/loraplus/llama3_lora_sft.yaml",
        stories_model,
        llamafactory_data,
        tmp_path,
        adapter_name_or_path=str(tmp_path / "a1"),
        create_new_adapter=True,
        max_samples=4,
        learning_rate=5e-3,
        warmup_ratio=0.0,
    )
    config = write_config(tmp_path / "stack.yaml", cfg)
    proc = run_ferry_train(
        str(config), "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=ROOT, check=False, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    new = tmp_path / "out" / "adapter"
    with pytest.raises(ConfigError, match="merged into it"):
        export(new, tmp_path / "wrong", ExportOptions(base=stories_model, smoke=False))
    assert not (tmp_path / "wrong").exists()
    merge = tmp_path / "merge.yaml"
    merge.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(stories_model),
                "export_dir": str(tmp_path / "m"),
                "adapter_name_or_path": f"{tmp_path / 'a1'},{tmp_path / 'out'}",
            }
        )
    )
    export_from_config(merge, ExportOptions(smoke=False, dtype="float32"))
    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    for adapter in (tmp_path / "a1", new):
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_ds3_example_trains_as_fsdp_full_shard_on_two_ranks(stories_model, llamafactory_data, tmp_path):
    """train_lora/qwen3_lora_sft_ds3 (ZeRO-3) runs as FSDP2 full_shard under torchrun (2 gloo ranks); the adapter
    loads in peft."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = "train_lora/qwen3_lora_sft_ds3.yaml"
    config = write_config(tmp_path / "ds3.yaml", example(name, stories_model, llamafactory_data, tmp_path))
    proc = run_ferry_train(
        str(config), "--nproc-per-node", "2", env=worker_env(tmp_path), cwd=ROOT, check=False, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ZeRO stage 3" in proc.stderr and "full_shard" in proc.stderr
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert (report["parallelism"], report["world_size"], report["global_steps"]) == ("full_shard", 2, 2)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(stories_model), str(tmp_path / "out" / "adapter")
    )
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if "lora_B" in n)


def _sgd_run(stories_model: Path, llamafactory_data: Path, work: Path, name: str, steps: int, **extra: Any) -> Path:
    """``ferry train`` on 2 gloo ranks, the exact continue-training recipe of the test below: 4 alpaca samples
    (2 ranks x 2), ``optim: sgd`` without momentum at a constant LR of 2.0, no warmup, no dropout. Returns the
    output folder."""
    from tests.support.helpers import run_ferry_train, tiny_config

    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        work / name,
        max_samples=4,
        max_steps=steps,
        optim="sgd",
        learning_rate=2.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        lora_dropout=0.0,
        per_device_train_batch_size=2,
        **extra,
    )
    run_ferry_train(
        write_config(work / f"{name}.yaml", cfg), "--nproc-per-node", "2", env=worker_env(work / name), cwd=ROOT
    )
    return work / name / "out"


@pytest.fixture(scope="module")
def four_steps(stories_model, llamafactory_data, tmp_path_factory) -> Path:
    """:func:`_sgd_run` for 4 steps with a checkpoint every 2: the output folder. Its adapter is also the trained
    adapter the prediction example below predicts with."""
    return _sgd_run(stories_model, llamafactory_data, tmp_path_factory.mktemp("sgd"), "four", 4, save_steps=2)


def test_an_adapter_trained_2_steps_and_continued_2_equals_a_4_step_run(
    four_steps, stories_model, llamafactory_data, tmp_path
):
    """Continue-training (adapter_name_or_path) is exact where it must be: a stateless optimizer (optim: sgd, no
    momentum), a constant LR without warmup, no dropout, and one global batch per epoch (4 samples = 2 ranks x 2),
    so each step of either run sees the same samples and only the weights carry over. The 4-step run's step-2
    checkpoint (the adapter a 2-step run ends with: the constant LR does not depend on max_steps) continued for 2 more
    steps then equals the 4-step run to fp32 rounding (both under torchrun, 2 gloo ranks: :func:`_sgd_run`)."""
    from tests.support.helpers import adapter_tensors

    four = adapter_tensors(four_steps / "adapter")
    at_step_2 = four_steps / "checkpoint-2"
    two = adapter_tensors(at_step_2)
    continued_out = _sgd_run(
        stories_model, llamafactory_data, tmp_path, "continued", 2, adapter_name_or_path=str(at_step_2)
    )
    continued = adapter_tensors(continued_out / "adapter")
    assert two.keys() == four.keys() == continued.keys()
    moved = sum((four[k] - two[k]).norm().item() for k in four)
    off = sum((continued[k] - four[k]).norm().item() for k in four)
    assert moved > 1e-3, "steps 3-4 changed the adapter: the comparison means something"
    for key in four:
        assert continued[key].dtype == torch.float32, key
        torch.testing.assert_close(continued[key], four[key], rtol=1e-5, atol=1e-6, msg=key)
    assert off < 1e-4 * moved, (off, moved)


def test_nlg_eval_example_predicts_with_a_trained_adapter(four_steps, stories_model, llamafactory_data, tmp_path):
    """extras/nlg_eval (do_predict alone: no do_train, no dataset; eval_dataset identity,alpaca_en_demo) on an
    adapter ferry trained: nothing is trained, and output_dir holds LLaMA-Factory's two files,
    generated_predictions.jsonl (prompt/predict/label per row, in the datasets' order) and predict_results.json
    (its four scores, recomputed here with the peer libraries as LLaMA-Factory computes them). About 20 s."""
    import json

    from tests.support.helpers import lf_scores

    name = "extras/nlg_eval/llama3_lora_predict.yaml"
    raw = yaml.safe_load((examples_root() / name).read_text(encoding="utf-8"))
    assert raw["do_predict"] and "do_train" not in raw and "dataset" not in raw  # the example as shipped
    cfg = example(
        name,
        stories_model,
        llamafactory_data,
        tmp_path,
        adapter_name_or_path=str(four_steps / "adapter"),
        max_samples=3,
        cutoff_len=512,
        max_new_tokens=8,
    )
    assert load_config(write_config(tmp_path / "predict.yaml", cfg)).do_train is False
    proc = run_ferry_train(
        str(tmp_path / "predict.yaml"),
        "--nproc-per-node",
        "1",
        env=worker_env(tmp_path),
        cwd=ROOT,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    assert not (out / "adapter").exists() and not (out / "train_report.json").exists(), "nothing is trained"
    assert "rows to predict:     6" in proc.stdout and "predictions:" in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text("utf-8").splitlines()]
    assert len(rows) == 6 and all(set(r) == {"prompt", "predict", "label"} for r in rows)
    identity = json.loads((llamafactory_data / "identity.json").read_text("utf-8"))[:3]
    alpaca = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text("utf-8"))[:3]
    for row, sample in zip(rows, identity + alpaca):
        assert row["prompt"].endswith(
            f"### Instruction:\n{sample['instruction']}"
            + (f"\n{sample['input']}" if sample["input"] else "")
            + "\n\n### Response:\n"
        )
        assert sample["output"].startswith(row["label"][:20])
    results = json.loads((out / "predict_results.json").read_text("utf-8"))
    for key, value in lf_scores([(r["label"], r["predict"]) for r in rows]).items():
        assert results[key] == pytest.approx(value, abs=1e-9), key


def test_do_train_defaults_to_false_only_for_a_prediction_yaml_without_training_data(tmp_path):
    """LLaMA-Factory's do_train defaults to false; ferry's to true, except with do_predict and no dataset (what
    extras/nlg_eval ships). Training without a dataset stays one clear line."""
    base = {
        "model_name_or_path": "m",
        "output_dir": str(tmp_path / "o"),
        "do_predict": True,
        "predict_with_generate": True,
        "eval_dataset": "alpaca_en_demo",
    }
    assert load_config(write_config(tmp_path / "a.yaml", base)).do_train is False
    assert load_config(write_config(tmp_path / "b.yaml", {**base, "dataset": "alpaca_en_demo"})).do_train is True
    with pytest.raises(ConfigError, match="at least one training dataset is required") as err:
        load_config(write_config(tmp_path / "c.yaml", {**base, "do_train": True}))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="at least one training dataset is required"):
        load_config(write_config(tmp_path / "d.yaml", {"model_name_or_path": "m", "output_dir": "o"}))


@pytest.mark.parametrize(
    "name",
    ["train_lora/qwen3_lora_sft.yaml", "train_lora/qwen3_lora_pretrain.yaml", "train_lora/qwen3_preprocess.yaml"],
)
def test_plain_lora_examples_plan_as_shipped(stories_model, llamafactory_data, tmp_path, monkeypatch, name):
    """train_lora/qwen3_lora_sft and qwen3_lora_pretrain (c4_demo, stage pt) plan a 2-rank run (`ferry train
    --dry-run`, in-process: data tokenised, LoRA on every linear layer counted); qwen3_preprocess tokenises into its
    tokenized_path and stops without starting a worker, as LLaMA-Factory. Their training loop is the one
    test_loop.py and the ds3 example run."""
    from trainer.launch import launch

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path / "cache"))
    config = write_config(tmp_path / "example.yaml", example(name, stories_model, llamafactory_data, tmp_path))
    report = launch(config, nproc_per_node=2, dry_run=not name.endswith("preprocess.yaml"))
    if name.endswith("preprocess.yaml"):
        assert report.tokenized_only == str(tmp_path / "tokenized") and any((tmp_path / "tokenized").iterdir())
        assert not (tmp_path / "out").exists()
        return
    assert (report.world_size, report.total_steps) == (2, 2)
    if "pretrain" in name:  # 8 c4 documents concatenated and cut into 64-token blocks (packing unset: on for pt)
        assert report.config["stage"] == "pt" and report.data_stats["num_train_samples"] == 8
        assert report.data_stats["packing"] is True and report.num_train_samples > 8
    else:  # identity + alpaca_en_demo, 8 samples each
        assert report.config["stage"] == "sft" and report.num_train_samples == 16
    assert 0 < report.trainable_params < report.total_params


def test_optim_sgd_is_torch_sgd_without_state_and_other_optimizers_are_one_line(stories_model, make_cfg, tmp_path):
    """optim: sgd (transformers' OptimizerNames.SGD) is torch.optim.SGD without momentum, alone and under LoRA+;
    an optimizer ferry does not run is refused in one line that names the ones it does."""
    from trainer.lf_compat import loraplus_optimizer, torch_optimizer
    from trainer.modeling import build_lora_model

    cfg = make_cfg(optim="sgd", loraplus_lr_ratio=4.0)
    assert torch_optimizer(cfg, fused=False) == (torch.optim.SGD, {})
    assert torch_optimizer(make_cfg(), fused=False)[0] is torch.optim.AdamW
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    optimizer = loraplus_optimizer(model, cfg, fused=False)
    assert isinstance(optimizer, torch.optim.SGD) and {g["momentum"] for g in optimizer.param_groups} == {0}
    lrs = sorted({g["lr"] for g in optimizer.param_groups if g["params"]})  # A at lr, B at lr * ratio
    assert lrs == [cfg.learning_rate, 4.0 * cfg.learning_rate]
    base = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d", "optim": "adafactor"}
    with pytest.raises(ConfigError, match="optim: adafactor .*AdamW .*plain SGD \\(optim: sgd\\)") as err:
        load_config(write_config(tmp_path / "a.yaml", base))
    assert "\n" not in str(err.value)
