"""The streaming merge equals peft's ``merge_and_unload`` (float32, within 1e-6) on a real Llama (stories260K) and
a GPT-2 (Conv1D, fan_in_fan_out), for plain LoRA, rsLoRA and DoRA with lora_target over attention and MLP."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from exporter.export import export
from exporter.options import ExportOptions
from tests.support.helpers import (
    GPT2_TARGETS,
    LLAMA_TARGETS,
    load_export,
    make_adapter,
    merged_reference,
)

VARIANTS = {
    "lora": {},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
}


def _assert_matches_peft(out_dir, reference: dict[str, torch.Tensor], tied: bool) -> None:
    merged = load_export(out_dir)
    expected = {k: v for k, v in reference.items() if not (tied and k == "lm_head.weight")}
    assert set(merged) == set(expected)
    worst = max((merged[k].float() - expected[k].float()).abs().max().item() for k in expected)
    assert worst <= 1e-6, f"merged weights differ from peft merge_and_unload by {worst}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_matches_peft(stories_model, tmp_path, variant):
    peft_model = make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS, **VARIANTS[variant])
    reference = merged_reference(peft_model)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    assert report.merged_layers == 5 * len(LLAMA_TARGETS)
    _assert_matches_peft(tmp_path / "out", reference, tied=True)
    # the adapter really changed something: otherwise this test proves nothing
    base = load_file(stories_model / "model.safetensors")
    merged = load_export(tmp_path / "out")
    key = "model.layers.0.mlp.down_proj.weight"
    assert (merged[key] - base[key]).abs().max() > 1e-3
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in merged


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpt2_conv1d_matches_peft(gpt2_model, tmp_path, variant):
    # peft switches fan_in_fan_out on for Conv1D by itself (with a warning) and saves fan_in_fan_out=False; the
    # exporter must find the layout from the architecture, not from the config.
    peft_model = make_adapter(gpt2_model, tmp_path / "adapter", target_modules=GPT2_TARGETS, **VARIANTS[variant])
    reference = merged_reference(peft_model)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=gpt2_model, smoke=False))
    assert report.merged_layers == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    _assert_matches_peft(tmp_path / "out", reference, tied=True)


def test_rank_and_alpha_patterns(stories_model, tmp_path):
    peft_model = make_adapter(
        stories_model,
        tmp_path / "adapter",
        target_modules=LLAMA_TARGETS,
        r=4,
        lora_alpha=8,
        rank_pattern={"down_proj": 2, r"layers\.0\.self_attn\.q_proj": 6},
        alpha_pattern={"v_proj": 3},
    )
    reference = merged_reference(peft_model)
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    _assert_matches_peft(tmp_path / "out", reference, tied=True)


def test_lora_bias_and_modules_to_save(gpt2_model, tmp_path):
    peft_model = make_adapter(
        gpt2_model, tmp_path / "adapter", target_modules=["c_attn", "c_fc"], lora_bias=True, modules_to_save=["ln_f"]
    )
    with torch.no_grad():  # make the saved copies differ from the base
        for name, param in peft_model.named_parameters():
            if "modules_to_save" in name or "lora_B" in name and name.endswith("bias"):
                param.add_(0.5 + torch.randn_like(param))
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = merged_reference(peft_model)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=gpt2_model, smoke=False))
    assert report.replaced_tensors == 2  # ln_f.weight and ln_f.bias
    _assert_matches_peft(tmp_path / "out", reference, tied=True)


def test_lm_head_of_tied_model_is_untied(stories_model, tmp_path):
    # LoRA on the output head of a tied model: the head must get its own weight, the embedding stays the base's.
    peft_model = make_adapter(stories_model, tmp_path / "adapter", target_modules=["lm_head", "q_proj"])
    with torch.no_grad():
        ids = torch.tensor([[1, 403, 407, 261, 378]])
        expected_logits = peft_model(input_ids=ids).logits
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    assert any("unties" in w for w in report.warnings)
    merged = load_export(tmp_path / "out")
    base = load_file(stories_model / "model.safetensors")
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(merged["lm_head.weight"], base["model.embed_tokens.weight"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.tie_word_embeddings is False
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert (got - expected_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_embedding_lora_of_tied_model(stories_model, tmp_path, variant):
    # LoRA on the tied input embedding: through peft the head keeps reading the base weight, so the export unties
    # the head (base weight) from the merged embedding; every other tensor equals peft's merge_and_unload
    peft_model = make_adapter(
        stories_model, tmp_path / "adapter", target_modules=["embed_tokens", "q_proj"], **VARIANTS[variant]
    )
    ids = torch.tensor([[1, 403, 407, 261, 378]])
    with torch.no_grad():
        expected_logits = peft_model(input_ids=ids).logits
    reference = merged_reference(peft_model)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    assert report.merged_layers == 1 + 5 and any("unties" in w for w in report.warnings)
    merged = load_export(tmp_path / "out")
    base = load_file(stories_model / "model.safetensors")
    assert torch.equal(merged.pop("lm_head.weight"), base["model.embed_tokens.weight"])
    assert max((merged[k] - reference[k]).abs().max().item() for k in merged) <= 1e-6
    assert not torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.tie_word_embeddings is False
    with torch.no_grad():
        assert (model(input_ids=ids).logits - expected_logits).abs().max().item() < 1e-4
