"""Every family of the zoo exports: an adapter on the run-time modules (peft's names, which transformers 5 renames
and fuses on load) merges into the base's on-disk layout, and the merged model computes what base + adapter
computes through peft, unmerged, within the float32 tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter.export import export
from exporter.io import CheckpointReader
from exporter.options import ExportOptions
from tests.support.zoo import FAMILIES

FP32_TOL = 1e-4


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_explicit_targets_merge_equals_peft(zoo, tmp_path, family):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = zoo(family)
    remote = {"trust_remote_code": family == "llama_remote_code"}
    torch.manual_seed(0)
    targets = FAMILIES[family][1].split(",")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, **remote),
        LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    report = export(
        tmp_path / "adapter", tmp_path / "out", ExportOptions(base=base, smoke=False, dtype="float32", **remote)
    )
    assert report.merged_layers > 0
    # the output keeps the base's on-disk layout (names and per-expert tensors), which vLLM and the hub read
    assert list(CheckpointReader(tmp_path / "out").infos) == list(CheckpointReader(base).infos)

    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, **remote), tmp_path / "adapter"
    ).eval()
    expected = _logits(reference, ids)
    with reference.disable_adapter():
        assert (_logits(reference, ids) - expected).abs().max() > 1e-2  # the adapter changes the output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", **remote).eval()
    assert (_logits(merged, ids) - expected).abs().max() <= FP32_TOL


@pytest.mark.parametrize("family", ["gpt2_hub", "qwen3_5", "qwen3_moe"])
def test_adapter_only_export_checks_hub_layouts(zoo, tmp_path, family):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = zoo(family)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=FAMILIES[family][1].split(","))
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=base, adapter_only=True))
    assert report.mode == "adapter-only" and (tmp_path / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_tied_embedding_lora_exports_and_smokes(zoo, tmp_path, dtype):
    # Qwen3 with tied embeddings and LoRA on embed_tokens (small, as trained adapters are): the export unties the
    # head, and the smoke check's reference (peft's own merge, untied first) agrees with it to the last bit
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = zoo("qwen3")
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.mul_(0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=base, dtype=dtype, max_new_tokens=4))
    assert report.smoke["passed"] and any("unties them" in w for w in report.warnings)
    if dtype != "float32":
        assert report.smoke["rounded_merge_diff"] == 0.0


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "mixtral",
        "deepseek_v3",
        "llama",
        "gemma3_vlm",
        "qwen3_5",
        "llama_remote_code",
        "qwen3_moe_fused",
        "mixtral_fused",
        "qwen3_5_vl",
    ],
)
def test_layout_without_the_model_equals_the_models(zoo, tmp_path, family):
    # the exporter learns the layout of a plain causal LM from transformers' conversion list without importing the
    # modeling code; where it does, it must say exactly what the meta-device model and peft say
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from exporter import layout
    from exporter.adapter import load_adapter

    base = zoo(family)
    stored = CheckpointReader(base).infos
    raw = json.loads((base / "config.json").read_text())
    light = layout.config_key_map(base, raw, stored)
    if family in ("gemma3_vlm", "llama_remote_code", "qwen3_5_vl"):  # composite config / remote code
        assert light is None
        return
    assert light is not None
    remote = {"trust_remote_code": False}
    model = layout.meta_model(base, **remote)
    full = layout.key_map(model, list(stored))
    assert {k: v for k, v in light.stored_of.items() if k in full.stored_of} == full.stored_of
    assert light.groups == full.groups and all(light.shapes[k] == full.shapes[k] for k in full.groups)
    targets = FAMILIES[family][1].split(",")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    ad = load_adapter(tmp_path / "adapter")
    if ad.config.get("target_parameters"):
        factors = {m.name: (tuple(m.A.shape), tuple(m.B.shape)) for m in ad.modules.values()}
        wrappers = layout.wrappers_from_shapes(light, ad.config, factors)
        if family == "mixtral_fused":  # stored [E, 64, 64]: both orientations fit, so peft is asked (None here)
            assert wrappers is None
            return
        assert wrappers and wrappers == layout.param_wrappers(layout.meta_model(base, False), ad.folder)


@pytest.mark.parametrize("family", ["qwen3_moe_fused", "mixtral_fused"])
def test_fused_expert_checkpoints_stay_fused(zoo, tmp_path, family):
    # a base that stores its experts as 3-D tensors (transformers 5's save_pretrained(save_original_format=False),
    # newer hub checkpoints): the expert LoRA is merged into those tensors, and the export stores them the same way
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = zoo(family)
    stored = CheckpointReader(base).infos
    fused = [k for k in stored if k.endswith("mlp.experts.gate_up_proj")]
    assert (
        fused and stored[fused[0]].shape in ((4, 96, 64), (4, 64, 64)) and not any(".experts.0." in k for k in stored)
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=2, target_modules=[], target_parameters=["gate_up_proj", "down_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=base, dtype="float32", max_new_tokens=2))
    assert report.smoke["passed"] and report.merged_layers == 2 * len(fused)  # gate_up_proj and down_proj
    merged = CheckpointReader(tmp_path / "out")
    assert merged.infos == stored
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    expected = _logits(reference, ids)
    with reference.disable_adapter():
        assert (_logits(reference, ids) - expected).abs().max() > 1e-3
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (_logits(out, ids) - expected).abs().max() <= FP32_TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_fused"])
def test_moe_export_imports_no_modeling_code(zoo, tmp_path, family):
    # the MoE export benchmark's time and memory rest on this: a plain causal LM's expert LoRA is mapped without
    # importing the architecture's modeling code or peft (seconds and tens of MB), in a fresh process as the CLI runs
    import json
    import os
    import subprocess
    import sys

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = zoo(family)
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=2, target_modules=FAMILIES[family][1].split(","), init_lora_weights=False),
    ).save_pretrained(tmp_path / "adapter")
    code = (
        "import json, sys; from exporter.export import export; from exporter.options import ExportOptions; "
        f"r = export({str(tmp_path / 'adapter')!r}, {str(tmp_path / 'out')!r}, "
        f"ExportOptions(base={str(base)!r}, smoke=False)); "
        "print(json.dumps([r.merged_layers, sorted(m for m in sys.modules if m.startswith("
        "('peft', 'transformers.models.qwen3_moe.modeling', 'torch._dynamo')))]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged_layers, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert merged_layers > 0 and imported == []


def test_fused_expert_export_on_an_older_transformers_is_refused_before_writing(zoo, tmp_path, monkeypatch):
    """Merging into experts stored per expert and fused on load needs transformers 5.21 (``apply_converters``):
    on an older one (the version stands in for a GPU host's preinstalled 5.17) the export stops while planning, in
    one line naming the versions, with nothing written; a dense model exports on that version."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ferry import versions
    from ferry.errors import ExportError

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: "5.17.0" if d == "transformers" else real(d))
    base = zoo("qwen3_moe")
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=2, target_modules=FAMILIES["qwen3_moe"][1].split(","), init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ExportError) as err:
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=base, smoke=False))
    message = str(err.value)
    assert "\n" not in message and message.startswith("merging into the fused experts ")
    assert "needs transformers >= 5.21, and transformers 5.17.0 is installed" in message
    assert not (tmp_path / "out").exists()
    dense = zoo("qwen3")
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(dense), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    ).save_pretrained(tmp_path / "dense")
    assert export(tmp_path / "dense", tmp_path / "dense-out", ExportOptions(base=dense, smoke=False)).merged_layers > 0
