"""``ferry export CONFIG.yaml`` with LLaMA-Factory 0.9.5's own merge YAMLs (examples/merge_lora, read from the
hash-pinned sdist at test time; only paths and sizes changed): the merged model equals peft's merge_and_unload."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ferry.errors import ConfigError
from tests.support.helpers import peft_merged, random_adapter
from tests.support.pinned_sdist import LLAMAFACTORY

ROOT = Path(__file__).resolve().parents[2]


def merge_yaml(name: str, folder: Path, **changes) -> Path:
    cfg = yaml.safe_load((LLAMAFACTORY.path() / "examples" / "merge_lora" / name).read_text(encoding="utf-8"))
    cfg.update(changes)
    path = folder / name
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def assert_loads_as(merged_dir: Path, reference: dict[str, torch.Tensor], auto: str = "AutoModelForCausalLM") -> None:
    import transformers

    ours = getattr(transformers, auto).from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_merge_yaml_with_two_adapters_equals_peft_merging_them_in_order(stories_model, tmp_path):
    first = random_adapter(stories_model, tmp_path / "a1", 1, ["q_proj", "v_proj"])
    ferry_dir = tmp_path / "run"  # a ferry output_dir: the adapter is in run/adapter
    random_adapter(stories_model, ferry_dir / "adapter", 2, ["q_proj", "down_proj"])
    config = merge_yaml(
        "qwen3_lora_sft.yaml",
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=f"{first},{ferry_dir}",
        export_dir=str(tmp_path / "merged"),
        export_size=1,
        dataset_dir="data",  # keys LLaMA-Factory's export parser takes and a merge does not need: accepted
        cutoff_len=2048,
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "export", str(config), "--no-smoke"],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_loads_as(tmp_path / "merged", peft_merged(stories_model, [first, ferry_dir / "adapter"]))
    assert not list(tmp_path.glob(".ferry-merge-*")), "the intermediate merge is removed"


def test_qwen3vl_merge_yaml_on_a_tiny_qwen_vl_model(stories_model, tmp_path):
    from exporter.lf_merge import export_from_config
    from exporter.options import ExportOptions
    from tests.support.zoo import build

    model = build("qwen3_5_vl", tmp_path / "zoo", stories_model)
    adapter = random_adapter(model, tmp_path / "vl-adapter", 3, ["q_proj", "v_proj", "down_proj"])
    config = merge_yaml(
        "qwen3vl_lora_sft.yaml",
        tmp_path,
        model_name_or_path=str(model),
        adapter_name_or_path=str(adapter),
        export_dir=str(tmp_path / "vl-merged"),
        export_size=1,
    )
    export_from_config(config, ExportOptions(smoke=False))
    assert_loads_as(tmp_path / "vl-merged", peft_merged(model, [adapter]))


def test_qwen3vl_merge_yaml_on_a_tiny_qwen3_vl_model(stories_model, tmp_path):
    """merge_lora/qwen3vl_lora_sft on the class LLaMA-Factory trains Qwen3-VL with (Qwen3VLForConditionalGeneration,
    AutoModelForImageTextToText; the hub's model.language_model.* / model.visual.* names): the merged folder loads
    in transformers and equals peft's merge_and_unload, vision tower included, and the adapter changed it."""
    from safetensors.torch import load_file

    from exporter.lf_merge import export_from_config
    from exporter.options import ExportOptions
    from tests.support.zoo import build

    auto = "AutoModelForImageTextToText"
    model = build("qwen3_vl", tmp_path / "zoo", stories_model)
    adapter = random_adapter(model, tmp_path / "vl-adapter", 3, ["q_proj", "v_proj", "down_proj"], auto)
    assert any(".language_model." in k for k in load_file(str(adapter / "adapter_model.safetensors")))
    config = merge_yaml(
        "qwen3vl_lora_sft.yaml",
        tmp_path,
        model_name_or_path=str(model),
        adapter_name_or_path=str(adapter),
        export_dir=str(tmp_path / "vl-merged"),
        export_size=1,
    )
    export_from_config(config, ExportOptions(smoke=False))
    reference = peft_merged(model, [adapter], auto)
    assert_loads_as(tmp_path / "vl-merged", reference, auto)
    base = load_file(str(model / "model.safetensors"))
    merged = load_file(str(next((tmp_path / "vl-merged").glob("*.safetensors"))))
    assert merged.keys() == base.keys()  # the hub's names, vision tower kept
    assert sum(not torch.equal(merged[k], base[k]) for k in base) == 6  # q, v, down on 2 layers


@pytest.mark.parametrize(
    "name, changes, match",
    [
        ("qwen3_gptq.yaml", {}, "GPTQ export; ferry's nearest is a quantized GGUF"),
        ("qwen3_full_sft.yaml", {}, "no adapter_name_or_path"),
        ("qwen3_lora_sft.yaml", {"export_hub_model_id": "me/model"}, "offline host cannot reach"),
        ("qwen3_lora_sft.yaml", {"export_legacy_format": True}, "safetensors only"),
        ("qwen3_lora_sft.yaml", {"export_sise": 2}, "did you mean 'export_size'"),
    ],
)
def test_merge_yaml_refusals_are_one_line(tmp_path, name, changes, match):
    from exporter.lf_merge import read_merge_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}", encoding="utf-8")
    config = (
        merge_yaml(name, tmp_path, adapter_name_or_path=str(adapter), **changes)
        if "full" not in name
        else merge_yaml(name, tmp_path, **changes)
    )
    with pytest.raises(ConfigError, match=match) as err:
        read_merge_config(config)
    assert "\n" not in str(err.value)


def test_merge_yaml_template_other_than_the_trained_one_is_refused(tmp_path):
    """merge_lora/qwen3_lora_sft.yaml names qwen3_nothink; a ferry run trained with alpaca says so in one line."""
    from exporter.lf_merge import read_merge_config

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}", encoding="utf-8")
    (run / "train_config.yaml").write_text("template: alpaca\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="was trained with template 'alpaca'"):
        read_merge_config(merge_yaml("qwen3_lora_sft.yaml", tmp_path, adapter_name_or_path=str(run)))
    spec = read_merge_config(
        merge_yaml("qwen3_lora_sft.yaml", tmp_path, adapter_name_or_path=str(run), template="alpaca", export_size=2)
    )
    assert (spec.adapters, spec.max_shard_size, spec.template) == ([run / "adapter"], "2GB", "alpaca")
