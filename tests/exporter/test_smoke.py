"""The smoke check passes a correct export, reports what it measured, and catches a broken merge."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from exporter.export import export
from exporter.options import ExportOptions
from exporter.smoke import smoke
from ferry.errors import SmokeCheckError
from tests.support.helpers import LLAMA_TARGETS, make_adapter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smoke_passes_on_correct_export(stories_model, tmp_path, dtype):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS, use_dora=dtype == "bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export(
            tmp_path / "adapter",
            tmp_path / "out",
            ExportOptions(
                base=stories_model, dtype=dtype, max_new_tokens=8, prompts=["Once upon a time", "Lily saw a dog"]
            ),
        )
    # stories260K's embeddings are tied and the adapter leaves them alone: the export stays tied, and the smoke
    # check's own untied copy (its bfloat16 ideal, peft's merge) says nothing to the contrary
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    assert not [w for w in caught if "no longer tied" in str(w.message)]
    result = report.smoke
    assert result["passed"] and result["failures"] == []
    assert result["dtype"] == dtype and result["logits_match"] is True
    assert 0 <= result["max_abs_diff"] <= result["tolerance"]
    if dtype == "float32":
        assert result["max_abs_diff"] < 1e-4
    assert result["tokens_per_second"] > 0
    assert result["adapter_changed_output"] is True  # random non-zero lora_B changes the greedy answers
    for prompt in result["prompts"]:
        assert prompt["new_tokens"] > 0 and prompt["finite"] and prompt["text"].strip()
    on_disk = json.loads((tmp_path / "out" / "smoke_report.json").read_text())
    assert on_disk["passed"] and on_disk["max_abs_diff"] == result["max_abs_diff"]
    assert "smoke_report.json" in (tmp_path / "out" / "SHA256SUMS").read_text()


def test_smoke_reports_eos_and_base_output(stories_model, tmp_path):
    # an adapter with lora_B = 0 leaves the real stories260K model as it is, with its known greedy story
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(stories_model), LoraConfig(r=2, target_modules=["q_proj"])
    )
    model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    export(tmp_path / "adapter", out, ExportOptions(base=stories_model, smoke=False))
    result = smoke(out, prompts=["Once upon a time"], max_new_tokens=16)
    (prompt,) = result.prompts
    assert prompt.text.startswith(", there was a little girl named Lily.")
    assert not prompt.eos_reached and result.passed  # no EOS within 16 tokens is reported, not a failure
    assert result.adapter_changed_output is False and prompt.base_text == prompt.text
    assert result.adapter == str((tmp_path / "adapter").resolve())  # found through ferry_export.json
    with pytest.raises(SmokeCheckError, match="no prompt reached EOS within 16"):
        smoke(out, prompts=["Once upon a time"], max_new_tokens=16, require_eos=True)
    # make "." (id 426) an end-of-sequence token: generation stops after the first sentence
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 426]
    (out / "generation_config.json").write_text(json.dumps(gen))
    result = smoke(out, prompts=["Once upon a time"], max_new_tokens=16, require_eos=True)
    (prompt,) = result.prompts
    assert prompt.eos_reached and prompt.new_tokens < 16 and prompt.text == ", there was a little girl named Lily"


def test_smoke_catches_a_broken_merge(stories_model, tmp_path):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    weights = tmp_path / "out" / "model.safetensors"
    state = load_file(weights)
    key = "model.layers.2.self_attn.v_proj.weight"
    state[key] = state[key] + 0.05 * torch.randn_like(state[key])  # one merged weight corrupted
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(SmokeCheckError, match="merged logits differ from base \\+ adapter"):
        smoke(tmp_path / "out", adapter=tmp_path / "adapter", base=stories_model, max_new_tokens=4)
    report = json.loads((tmp_path / "out" / "smoke_report.json").read_text())
    assert report["passed"] is False and report["logits_match"] is False
    assert report["max_abs_diff"] > report["tolerance"]


def test_smoke_catches_nan_weights(stories_model, tmp_path):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj"])
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    weights = tmp_path / "out" / "model.safetensors"
    state = load_file(weights)
    state["model.norm.weight"][3] = float("nan")
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(SmokeCheckError, match="NaN/inf"):
        smoke(tmp_path / "out", max_new_tokens=4)


def test_smoke_without_adapter_checks_generation_only(stories_model, tmp_path):
    # a model folder with no export record (here: the base itself, copied): no reference, generation still checked
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(stories_model, folder)
    folder.chmod(0o755)
    result = smoke(folder, prompts=["Once upon a time"], max_new_tokens=6)
    assert result.passed and result.max_abs_diff is None and result.logits_match is None
    assert result.adapter is None and result.adapter_changed_output is None
    assert result.prompts[0].text.startswith(", there was")
    assert json.loads((folder / "smoke_report.json").read_text())["passed"] is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_bound_catches_one_missing_layer(stories_model, tmp_path, dtype):
    # a base stored in the export's dtype and a small adapter (as trained ones are): one layer's LoRA left out of
    # the export moves the logits by less than the dtype's rounding noise, which a fixed floor would let through
    import shutil

    name = str(dtype).removeprefix("torch.")
    base = tmp_path / "base"
    shutil.copytree(stories_model, base)
    base.chmod(0o755)
    (base / "model.safetensors").chmod(0o644)
    state = load_file(base / "model.safetensors")
    save_file({k: v.to(dtype) for k, v in state.items()}, base / "model.safetensors", metadata={"format": "pt"})
    make_adapter(base, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    lora = load_file(weights)
    save_file({k: v * 0.002 if "lora_B" in k else v for k, v in lora.items()}, weights, metadata={"format": "pt"})

    out = tmp_path / "out"
    report = export(
        tmp_path / "adapter", out, ExportOptions(base=base, dtype=name, max_new_tokens=2, prompts=["Once upon a time"])
    )
    good = report.smoke
    assert good["passed"] and good["rounded_merge_diff"] == 0.0 and good["reference_noise"] > 0
    merged = load_file(out / "model.safetensors")
    key = "model.layers.2.self_attn.v_proj.weight"
    fault = float((merged[key].float() - state[key].to(dtype).float()).abs().max())
    assert fault > 0  # the layer's update survives the rounding
    merged[key] = state[key].to(dtype)  # that layer's LoRA left out
    save_file(merged, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SmokeCheckError, match="differ from peft's merge rounded to that dtype"):
        smoke(out, max_new_tokens=2, prompts=["Once upon a time"], write_report=False)


def test_generation_is_judged_by_tokens_not_printable_text(stories_model, tmp_path):
    # final norm zeroed: every logit is 0, greedy picks token 0 (<unk>) each step, which decodes to "" with special
    # tokens skipped. Tokens were produced and every score is finite: the generation check passes.
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(stories_model, folder)
    folder.chmod(0o755)
    (folder / "model.safetensors").chmod(0o644)
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"].zero_()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    result = smoke(folder, prompts=["Once upon a time"], max_new_tokens=4, write_report=False)
    assert result.passed and result.prompts[0].text.strip() == "" and result.prompts[0].new_tokens == 4


def test_smoke_runs_on_cpu_when_the_gpu_cannot_hold_the_float32_copies():
    """The decision with numbers: CUDA when the float32 copies plus 10 % and 512 MiB fit its free memory, CPU with
    one line when they do not, the user's ``--device`` as given, CPU without CUDA."""
    from exporter.smoke import smoke_device

    gib = 2**30
    assert smoke_device(None, 10 * gib, 80 * gib) == (torch.device("cuda"), None)
    assert smoke_device(None, 72 * gib, 80 * gib) == (torch.device("cuda"), None)  # 72 x 1.1 + 0.5 = 79.7 GiB
    device, line = smoke_device(None, 73 * gib, 80 * gib)  # 80.8 GiB do not fit
    assert device == torch.device("cpu") and "\n" not in line
    assert line == (
        "ferry: smoke: the float32 copies need about 80.8 GiB and the GPU has 80.0 GiB free: running the check on "
        "CPU (slower; --device cuda to insist)"
    )
    assert smoke_device("cuda:1", 500 * gib, 1 * gib) == (torch.device("cuda", 1), None)  # the user's choice
    assert smoke_device(None, 1, None) == (torch.device("cpu"), None)  # no CUDA


def test_the_float32_bytes_come_from_the_headers(stories_model, tmp_path):
    """fp32_bytes reads only the safetensors headers: the element count of every floating tensor at 4 bytes (the
    real model's, counted from its loaded tensors), also for a bfloat16 copy; smoke_bytes adds the adapter to the
    larger of merged model and base."""
    from exporter.smoke import fp32_bytes, smoke_bytes

    state = load_file(stories_model / "model.safetensors")
    expected = sum(t.numel() * 4 for t in state.values())
    assert fp32_bytes(stories_model) == expected
    half = tmp_path / "half"
    half.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, half / "model.safetensors")
    assert fp32_bytes(half) == expected
    make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    adapter = sum(t.numel() * 4 for t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").values())
    assert smoke_bytes(half, stories_model, tmp_path / "adapter") == expected + adapter
    assert fp32_bytes(tmp_path / "adapter" / "no-such") == 0


def test_a_gpu_too_small_for_the_smoke_check_moves_it_to_cpu(stories_model, tmp_path, monkeypatch, capsys):
    """smoke() on a host whose torch reports CUDA with 1 MiB free (stand-ins; this host has no GPU): the check
    runs on CPU, says so in one line and passes; the report names the device."""
    make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, smoke=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    capsys.readouterr()
    result = smoke(tmp_path / "out", prompts=["Once upon a time"], max_new_tokens=4)
    assert result.passed and result.device == "cpu"
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ferry: smoke:")]
    assert len(lines) == 1 and lines[0].endswith(
        "GPU has 1.0 MiB free: running the check on CPU (slower; --device cuda to insist)"
    )
