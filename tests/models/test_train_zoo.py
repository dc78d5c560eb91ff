"""Every family of the zoo trains, exports and passes the smoke check: ``ferry train`` (the library, in process:
2 steps on LLaMA-Factory's alpaca demo data), ``ferry export`` (float32) and ``ferry smoke`` (the merged logits
equal base + adapter through peft, unmerged, within the float32 tolerance). One MoE family runs through the real
CLI with torchrun and 2 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from exporter.export import export
from exporter.io import CheckpointReader
from exporter.options import ExportOptions
from tests.support.helpers import run_ferry_train
from tests.support.zoo import FAMILIES

pytestmark = pytest.mark.budget(120, reason="a MoE model trained by the CLI on 2 processes")


def _config(base: Path, data: Path, work: Path, lora_target: str, **extra) -> dict:
    return {
        "model_name_or_path": str(base),
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(data),
        "template": "alpaca",
        "cutoff_len": 32,
        "max_samples": 8,
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "lora_rank": 4,
        "learning_rate": 1e-2,
        "lora_target": lora_target,
        "output_dir": str(work / "out"),
        "disable_tqdm": True,
        "save_steps": 1000,
        "logging_steps": 1,
        **extra,
    }


def _train(base: Path, data: Path, work: Path, lora_target: str, **extra):
    from trainer.config import TrainConfig
    from trainer.recipe import train

    return train(TrainConfig(**_config(base, data, work, lora_target, **extra)))


def _adapter_modules(adapter_dir: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "pt") as f:
        return {k.split(".lora_")[0] for k in f.keys()}


#: families whose explicit LLaMA-Factory targets mean more than a name match (fused experts, hub key renames, a
#: vision tower with the same names, Conv1D): trained with those too; every family's explicit targets are also
#: exported against peft in test_export_zoo.py
EXPLICIT_TOO = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5", "gemma3_vlm", "gpt2_hub")
CASES = [(f, "all") for f in FAMILIES] + [(f, "explicit") for f in EXPLICIT_TOO]


@pytest.mark.parametrize(("family", "target"), CASES)
def test_train_export_smoke(zoo, llamafactory_data, tmp_path, family, target):
    base = zoo(family)
    lora_target = "all" if target == "all" else FAMILIES[family][1]
    remote = family == "llama_remote_code"
    report = _train(base, llamafactory_data, tmp_path, lora_target, trust_remote_code=remote)
    assert report.global_steps == 2
    exported = export(
        report.adapter_dir,
        tmp_path / "merged",
        ExportOptions(dtype="float32", max_new_tokens=4, prompts=["Once upon a time"], trust_remote_code=remote),
    )
    if remote:  # the model's code travels with the export
        assert (tmp_path / "merged" / "modeling_remote.py").is_file()
    smoke = exported.smoke
    assert smoke["passed"] and smoke["logits_match"] and smoke["max_abs_diff"] <= smoke["tolerance"]
    assert list(CheckpointReader(tmp_path / "merged").infos) == list(CheckpointReader(base).infos)
    modules = _adapter_modules(report.adapter_dir)
    config = json.loads((Path(report.adapter_dir) / "adapter_config.json").read_text())
    if family in ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3_moe_fused"):
        _check_layout_without_model(base, Path(report.adapter_dir))
    family = family.removesuffix("_fused")  # experts stored fused on disk: same model, same targets
    if family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        # the fused experts get LoRA (peft target_parameters), and so do dense MLPs that share their names
        assert any(p.endswith("experts.gate_up_proj") for p in config["target_parameters"])
        assert any(m.endswith("mlp.experts") for m in modules)
        if family != "mixtral":
            assert any(".layers.0.mlp.gate_proj" in m for m in config["target_parameters"])
        if family == "deepseek_v3":
            assert any("shared_experts.down_proj" in m for m in config["target_parameters"])
    if family == "gemma3_vlm":  # the vision tower stays frozen (freeze_vision_tower), and is exported unchanged
        assert modules and not any("vision" in m for m in modules)
        merged, original = CheckpointReader(tmp_path / "merged"), CheckpointReader(base)
        vision = [k for k in original.infos if k.startswith("vision_tower.vision_model.")]
        with merged.open(merged.files[0]) as a, original.open(original.files[0]) as b:
            assert vision and all(torch.equal(a.get(k), b.get(k)) for k in vision)
        assert (tmp_path / "merged" / "preprocessor_config.json").read_text() == (
            base / "preprocessor_config.json"
        ).read_text()
    if family == "qwen3_5_vl":
        _check_qwen3_5_vl(base, tmp_path / "merged", modules)
    if family.startswith("gpt2"):  # Conv1D layers are linear layers for `all`
        assert {m.split(".")[-1] for m in modules} == {"c_attn", "c_proj", "c_fc"}


def _check_layout_without_model(base: Path, adapter_dir: Path) -> None:
    """The exporter reads ferry's MoE adapter without building the model (no modeling code imported), and what it
    reads equals what transformers and peft say on the meta-device model."""
    from exporter import layout
    from exporter.adapter import load_adapter

    ad = load_adapter(adapter_dir)
    km = layout.config_key_map(base, json.loads((base / "config.json").read_text()), CheckpointReader(base).infos)
    assert km is not None
    factors = {m.name: (tuple(m.A.shape), tuple(m.B.shape)) for m in ad.modules.values()}
    wrappers = layout.wrappers_from_shapes(km, ad.config, factors)
    assert wrappers and wrappers == layout.param_wrappers(layout.meta_model(base, False), adapter_dir)


def _check_qwen3_5_vl(base: Path, merged: Path, modules: set[str]) -> None:
    """Qwen3.5 vision-language: ferry trains the language model (transformers' AutoModelForCausalLM builds
    Qwen3_5ForCausalLM from the VL checkpoint), the export keeps the vision tower and merger (and the MTP head's
    tensors) byte for byte and the image processor, and the full VL class loads the export completely and computes
    what the merged language model computes on text."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    assert modules and not any("visual" in m or "merger" in m for m in modules)
    exported, original = CheckpointReader(merged), CheckpointReader(base)
    vision = [k for k in original.infos if k.startswith(("model.visual.", "mtp."))]  # and the unloaded MTP head
    with exported.open(exported.files[0]) as a, original.open(original.files[0]) as b:
        assert (
            any(".merger." in k for k in vision)
            and "mtp.fc.weight" in vision
            and all(torch.equal(a.get(k), b.get(k)) for k in vision)
        )
        changed = [
            k for k in original.infos if k.startswith("model.language_model.") and not torch.equal(a.get(k), b.get(k))
        ]
    assert changed  # the LoRA landed in the language model's stored tensors
    assert (merged / "preprocessor_config.json").read_text() == (base / "preprocessor_config.json").read_text()
    vl, info = Qwen3_5ForConditionalGeneration.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        text_only = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
        assert (vl.eval()(input_ids=ids).logits - text_only).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "gemma3_vlm", "gpt2_hub"])
def test_lora_target_all_resolution(zoo, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.targets import resolve_lora_targets

    config = AutoConfig.from_pretrained(zoo(family))  # built outside the meta context (a first build saves weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = resolve_lora_targets(model, ["all"], r=4, lora_alpha=8)
    groups = targets.grouped()
    assert groups["attention"][0] > 0
    if family in ("qwen3_moe", "deepseek_v3", "mixtral"):
        assert groups["experts"][0] == (1 if family != "mixtral" else 2) * 2  # gate_up_proj + down_proj per layer
        assert any("routers" in note for note in targets.left_out)
    if family in ("qwen3_moe", "deepseek_v3"):
        assert groups["mlp"][0] == (3 if family == "qwen3_moe" else 6)  # dense layer 0 (+ shared experts)
    if family == "gemma3_vlm":
        assert any("vision tower" in note for note in targets.left_out)
        assert "experts" not in groups
        full = resolve_lora_targets(model, ["all"], r=4, lora_alpha=8, freeze_vision_tower=False)
        assert len(full.adapted) > len(targets.adapted)
    summary = targets.summary()
    assert "attention" in summary and "LoRA params" in summary


def test_unknown_lora_target_is_one_line(zoo):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ferry.errors import ConfigError
    from trainer.targets import resolve_lora_targets

    config = AutoConfig.from_pretrained(zoo("qwen3_moe"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match="lora_target: c_attn matches no linear layer.*q_proj"):
        resolve_lora_targets(model, ["q_proj", "c_attn"], r=4, lora_alpha=8)


def test_moe_two_processes_through_the_cli(zoo, llamafactory_data, tmp_path):
    base = zoo("qwen3_moe")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(base, llamafactory_data, tmp_path, "all", per_device_train_batch_size=1)))
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd())}
    dry = run_ferry_train(config, "--nproc-per-node", "2", "--dry-run", env=env, cwd=Path.cwd(), check=False)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "LoRA on:" in dry.stdout and "experts" in dry.stdout and "mlp" in dry.stdout
    proc = run_ferry_train(config, "--nproc-per-node", "2", env=env, cwd=Path.cwd(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["global_steps"] == 2
    exported = export(report["adapter_dir"], tmp_path / "merged", ExportOptions(dtype="float32", max_new_tokens=2))
    assert exported.smoke["passed"] and exported.merged_layers > 0
