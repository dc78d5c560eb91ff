"""peft 0.21.2's two false alarms on ferry's models (trainer/peft_build.py, ``PEFT_FALSE_ALARMS``) never leave ferry,
on every path that builds or loads a peft model, and the check that replaces the pattern one does its job: the
fused-expert rank/alpha patterns are applied (rank 2r), a pattern that matches nothing raises ConfigError.
In process, on the zoo's tiny MoE models (a few seconds each)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError
from trainer.config import TrainConfig

ALARMS = ("is_gradient_checkpointing", "_pattern keys did not match")


def _alarms(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if any(a in str(w.message) for a in ALARMS)]


def _cfg(model: Path, tmp_path: Path) -> TrainConfig:
    return TrainConfig(
        model_name_or_path=str(model),
        dataset="unused",
        output_dir=str(tmp_path / "out"),
        lora_target="all",
        lora_rank=4,
        lora_alpha=8,
    )


def _fused_gate_up(peft_model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in peft_model.modules()
        if type(m).__name__ == "ParamWrapper" and getattr(m, "parameter_name", None) == "gate_up_proj"
    ]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_patterns_apply_and_peft_warns_nothing(zoo, family, tmp_path):
    from trainer.fsdp import add_lora_to_meta_model
    from trainer.modeling import build_lora_model
    from trainer.peft_build import load_peft_adapter
    from trainer.targets import lora_config_for

    model_dir = zoo(family)
    cfg = _cfg(model_dir, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = build_lora_model(cfg, model_dir, device=torch.device("cpu"), dtype=torch.float32)
        experts = _fused_gate_up(peft_model)
        # gate and up fused into one parameter: rank and alpha twice LoRA's, as peft's own conversion gives them
        assert experts and all(m.r["default"] == 8 and m.lora_alpha["default"] == 16 for m in experts)

        peft_model.save_pretrained(tmp_path / "adapter")  # predict / chat / smoke / continued training load it
        from transformers import AutoModelForCausalLM

        reloaded = load_peft_adapter(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "adapter"))
        assert all(m.r["default"] == 8 for m in _fused_gate_up(reloaded))

        from transformers import AutoConfig

        with torch.device("meta"):  # the FSDP build (and the launcher's --dry-run count)
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        meta_model, _ = add_lora_to_meta_model(meta, lora_config_for(cfg, meta))
        assert all(m.r["default"] == 8 for m in _fused_gate_up(meta_model))
    assert _alarms(caught) == []


def test_a_pattern_that_matches_nothing_is_an_error(stories_model):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from trainer.peft_build import get_peft_model_checked

    model = AutoModelForCausalLM.from_pretrained(stories_model)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"no_such_proj": 8})
    with pytest.raises(ConfigError, match=r"rank_pattern keys \['no_such_proj'\] match no adapted module"):
        get_peft_model_checked(model, config)


def test_targets_on_a_converted_layout_need_peft_0_19(zoo, tmp_path, monkeypatch):
    """LLaMA-Factory's names on a model transformers 5 converts on load (fused experts) are rewritten by
    ``peft.utils.transformers_weight_conversion``, new in peft 0.19: on an older peft (the version stands in for
    a host's preinstalled 0.18) the pre-flight refuses in one line; a Llama, which nothing converts, resolves."""
    from ferry import versions
    from trainer.launch import preflight

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: "0.18.0" if d == "peft" else real(d))
    model_dir = zoo("qwen3_moe")
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(model_dir, tmp_path), model_dir)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("lora_target on qwen3_moe (a layout transformers 5 converts on load, fused ")
    assert "needs peft >= 0.19, and peft 0.18.0 is installed" in str(err.value)
    preflight(_cfg(zoo("llama"), tmp_path), zoo("llama"))
