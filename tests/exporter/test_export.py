"""Export end to end on real models: shards, dtypes, files beside the weights, lineage, refusals, atomicity."""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime

import pytest
import torch
from safetensors.torch import load_file, save_file

from exporter.export import export
from exporter.options import ExportOptions
from ferry.errors import ExportError, SourceError
from tests.support.helpers import (
    LLAMA_TARGETS,
    load_export,
    make_adapter,
    merged_reference,
)


def test_sharded_base_round_trips(stories_model, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded-base"
    AutoModelForCausalLM.from_pretrained(stories_model).save_pretrained(sharded, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((stories_model / name).read_bytes())
    base_shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(base_shards) >= 3
    peft_model = make_adapter(sharded, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    reference = merged_reference(peft_model)

    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(smoke=False, max_shard_size="250KB"))
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(report.shards) >= 4 and set(index["weight_map"].values()) == set(report.shards)
    for shard in report.shards:  # every shard within the limit, except a single tensor larger than it
        tensors = load_file(out / shard)
        assert len(tensors) == 1 or (out / shard).stat().st_size <= 250_000 + 8192
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in load_export(out).values())
    merged = load_export(out)
    assert max((merged[k] - reference[k]).abs().max().item() for k in merged) <= 1e-6
    # transformers loads the sharded export and it computes what peft computes
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 403, 407, 261]])
    with torch.no_grad():
        assert (model(input_ids=ids).logits - peft_model(input_ids=ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion(stories_model, tmp_path, dtype):
    peft_model = make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    reference = merged_reference(peft_model)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, dtype=dtype, smoke=False))
    torch_dtype = getattr(torch, dtype)
    merged = load_export(tmp_path / "out")
    assert report.dtype == dtype and all(t.dtype == torch_dtype for t in merged.values())
    # merged in float32, then rounded once: equal to peft's float32 merge rounded to the same dtype
    for key, tensor in merged.items():
        assert torch.equal(tensor, reference[key].to(torch_dtype)), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == dtype and "quantization_config" not in config


def test_output_folder_contents_and_lineage(stories_copy, tmp_path):
    # a chat template in the tokenizer config, a train_config.yaml and train_report.json beside the adapter
    tok_cfg = json.loads((stories_copy / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (stories_copy / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (stories_copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run = tmp_path / "saves" / "run1"
    make_adapter(stories_copy, run / "adapter", target_modules=["q_proj", "v_proj"])
    data = tmp_path / "data"  # a LLaMA-Factory dataset folder: identity's sha256 comes from its file
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"identity": {"file_name": "identity.json"}}))
    (data / "identity.json").write_text('[{"instruction": "who are you?", "output": "ferry"}]')
    (run / "train_config.yaml").write_text(
        f"model_name_or_path: stories\ndataset: alpaca_en_demo,identity\ndataset_dir: {data}\nlora_rank: 4\n"
    )
    (run / "train_report.json").write_text(json.dumps({"datasets": [{"name": "alpaca_en_demo", "sha256": "ab" * 32}]}))

    report = export(run / "adapter", tmp_path / "out", ExportOptions(base=stories_copy, smoke=False))
    out = tmp_path / "out"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
        "ferry_export.json",
        "SHA256SUMS",
        "model.safetensors",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == tok_cfg["chat_template"]
    card = (out / "README.md").read_text()
    adapter_sha = hashlib.sha256((run / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert adapter_sha in card and "alpaca_en_demo" in card and "ab" * 32 in card and "lora_rank: 4" in card
    meta = json.loads((out / "ferry_export.json").read_text())
    assert meta["adapter"]["sha256"] == adapter_sha == report.adapter_sha256
    identity_sha = hashlib.sha256((data / "identity.json").read_bytes()).hexdigest()
    assert meta["datasets"] == [
        {"name": "alpaca_en_demo", "sha256": "ab" * 32},  # from train_report.json
        {"name": "identity", "sha256": identity_sha},
    ]  # hashed from dataset_dir
    assert identity_sha in card
    # SHA256SUMS covers every other file and verifies with coreutils
    listed = {line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()}
    assert listed == {p.name for p in out.iterdir()} - {"SHA256SUMS"}
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=out, check=True)
    # under the suite's umask (022) a service account can read the folder and every file in it
    from ferry.fsutil import process_umask

    assert process_umask() == 0o022 and (out.stat().st_mode & 0o755) == 0o755
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in out.iterdir()), modes


def test_quantized_base_is_refused(stories_copy, tmp_path):
    make_adapter(stories_copy, tmp_path / "adapter", target_modules=["q_proj"])
    config = json.loads((stories_copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (stories_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="quantized \\(bitsandbytes\\)"):
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_copy, smoke=False))
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_is_refused(stories_model, gpt2_model, tmp_path):
    # an adapter trained on stories260K (hidden 64) does not fit a base with another hidden size
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(stories_model)
    config.hidden_size, config.head_dim = 32, 4
    other = tmp_path / "other-llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj"])
    with pytest.raises(ExportError, match="does not fit base weight 'model.layers.0.self_attn.q_proj.weight'"):
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=other, smoke=False))
    with pytest.raises(ExportError, match="another architecture"):  # GPT-2 has no q_proj at all
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=gpt2_model, smoke=False))
    assert not (tmp_path / "out").exists()


def test_pickle_only_base_needs_allow_pickle(stories_copy, tmp_path):
    peft_model = make_adapter(stories_copy, tmp_path / "adapter", target_modules=["q_proj", "down_proj"])
    reference = merged_reference(peft_model)
    state = load_file(stories_copy / "model.safetensors")
    torch.save(state, stories_copy / "pytorch_model.bin")
    (stories_copy / "model.safetensors").unlink()
    with pytest.raises(SourceError, match="--allow-pickle"):
        export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_copy, smoke=False))
    export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_copy, smoke=False, allow_pickle=True))
    merged = load_export(tmp_path / "out")
    assert max((merged[k] - reference[k]).abs().max().item() for k in merged) <= 1e-6


def test_existing_output_and_failed_export_leave_disk_untouched(stories_model, tmp_path):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export(tmp_path / "adapter", out, ExportOptions(base=stories_model, smoke=False))
    # an adapter whose merge overflows float16 fails mid-merge, after some shards were written: the old output
    # survives and no temp folder is left behind
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    state = load_file(weights)
    key = next(k for k in state if "layers.3" in k and "lora_B" in k)
    state[key] = state[key] * 1e6
    save_file(state, weights)
    with pytest.raises(ExportError, match="overflows float16"):
        export(
            tmp_path / "adapter",
            out,
            ExportOptions(base=stories_model, smoke=False, overwrite=True, dtype="float16", max_shard_size="100KB"),
        )
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"]
    # NaN in the adapter is refused before anything is written
    state[key][0, 0] = float("nan")
    save_file(state, weights)
    with pytest.raises(ExportError, match="contains NaN/inf"):
        export(tmp_path / "adapter", out, ExportOptions(base=stories_model, smoke=False, overwrite=True))
    assert (out / "keep.txt").read_text() == "mine"


def test_adapter_only(stories_model, tmp_path):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=LLAMA_TARGETS)
    report = export(tmp_path / "adapter", tmp_path / "out", ExportOptions(base=stories_model, adapter_only=True))
    out = tmp_path / "out"
    assert report.mode == "adapter-only" and report.smoke is None
    original = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (out / "adapter_model.safetensors").read_bytes() == original
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=out, check=True)
    # peft loads the re-exported adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(stories_model), out)
    assert len([n for n, _ in model.named_parameters() if "lora_A" in n]) == 5 * len(LLAMA_TARGETS)


def test_an_export_is_readable_by_every_account_unless_private(stories_model, tmp_path):
    """Under a locked-down umask (077) the export is still 0755 / 0644 (a serving engine's service account reads it);
    ``private`` makes it 0700 / 0600; the caller's umask is left as it was."""
    import os

    from ferry.fsutil import process_umask

    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj"])
    old = os.umask(0o077)
    try:
        for name, private in (("shared", False), ("private", True)):
            options = ExportOptions(base=stories_model, adapter_only=True, private=private)
            export(tmp_path / "adapter", tmp_path / name, options)
        assert process_umask() == 0o077
    finally:
        os.umask(old)
    for name, (folder, file) in (("shared", (0o755, 0o644)), ("private", (0o700, 0o600))):
        out = tmp_path / name
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert out.stat().st_mode & 0o777 == folder and set(modes.values()) == {file}, (name, modes)


def test_bundle_of_the_export_verifies(stories_model, tmp_path):
    from bundler.verify import verify

    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    report = export(
        tmp_path / "adapter", tmp_path / "merged", ExportOptions(base=stories_model, smoke=False, bundle=True)
    )
    assert report.bundle == tmp_path / "merged.bundle" / "merged"
    manifest = json.loads((report.bundle / "manifest.json").read_text())
    (item,) = manifest["items"]
    assert item["kind"] == "model" and item["source"] == "local"
    shipped = {f["path"]: f["sha256"] for f in item["files"]}
    for line in (tmp_path / "merged" / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert shipped[name] == digest
    verify(tmp_path / "merged.bundle" / "merged.ferry.tar")


@pytest.mark.parametrize("where", ["adapter", "inside-adapter", "base", "contains-base"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_output_overlapping_adapter_or_base_is_refused(stories_copy, tmp_path, where, overwrite):
    adapter = tmp_path / "run" / "adapter"
    make_adapter(stories_copy, adapter, target_modules=["q_proj"])
    output = {
        "adapter": adapter,
        "inside-adapter": adapter / "merged",
        "base": stories_copy,
        "contains-base": stories_copy.parent,
    }[where]
    before = {p: p.read_bytes() for p in [*adapter.rglob("*"), *stories_copy.rglob("*")] if p.is_file()}
    with pytest.raises(ExportError, match="overwrite what it reads"):
        export(adapter, output, ExportOptions(base=stories_copy, smoke=False, overwrite=overwrite))
    with pytest.raises(ExportError, match="overwrite what it reads"):
        export(adapter, output, ExportOptions(base=stories_copy, smoke=False, overwrite=overwrite, adapter_only=True))
    assert {p: p.read_bytes() for p in before} == before
    assert not (adapter / "merged").exists()


def test_base_other_than_recorded_is_warned_and_recorded(stories_model, stories_copy, tmp_path):
    make_adapter(stories_model, tmp_path / "adapter", target_modules=["q_proj"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(stories_model)
    report = export(tmp_path / "adapter", tmp_path / "same", ExportOptions(smoke=False))
    assert not any("recorded base" in w for w in report.warnings)
    report = export(tmp_path / "adapter", tmp_path / "other", ExportOptions(base=stories_copy, smoke=False))
    assert any("not the adapter's recorded base" in w and str(stories_model) in w for w in report.warnings)
    meta = json.loads((tmp_path / "other" / "ferry_export.json").read_text())
    assert meta["base"]["path"] == str(stories_copy.resolve())
    assert meta["base"]["recorded_by_adapter"]["repo_id"] == str(stories_model)
    assert "adapter's recorded base" in (tmp_path / "other" / "README.md").read_text()


@pytest.mark.parametrize("template_name", ["qwen3_nothink", "llama3", "alpaca"])
def test_export_keeps_base_tokenizer_and_ships_the_trained_template(stories_copy, tmp_path, template_name, monkeypatch):
    """The merged model's tokenizer files are the base's, byte for byte; its chat_template.jinja is the one
    training wrote (trainer.templates.write_chat_template), and transformers' apply_chat_template on the export
    renders exactly the prompt training rendered."""
    from transformers import AutoTokenizer

    from trainer.templates import (
        get_template,
        training_prompt_text,
        write_chat_template,
    )
    from trainer.templates import tools as template_tools

    # llama3's tool prompt carries the date: training renders "today", the served template the caller's date_string
    monkeypatch.setattr(template_tools, "today", lambda: datetime(2026, 11, 24))

    adapter = tmp_path / "adapter"
    make_adapter(stories_copy, adapter, target_modules=["q_proj", "v_proj"])
    tokenizer = AutoTokenizer.from_pretrained(stories_copy)
    template = get_template(template_name)
    write_chat_template(template, tokenizer)
    tokenizer.save_pretrained(adapter)  # what the training loop writes beside the adapter
    export(adapter, tmp_path / "out", ExportOptions(base=stories_copy, smoke=False))
    out = tmp_path / "out"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (stories_copy / name).read_bytes(), name
    assert (out / "chat_template.jinja").read_text() == (adapter / "chat_template.jinja").read_text()
    exported = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Ahoy!"},
        {"role": "user", "content": "Where to?"},
        {"role": "assistant", "content": "North."},
    ]
    want = training_prompt_text(template, messages, bos_token=exported.bos_token, eos_token=exported.eos_token)
    got = exported.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert got == want
    # a conversation with tools and a tool call, as a serving stack sends it
    tools = [
        {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    trained = [
        {"role": "user", "content": "Oslo?"},
        {"role": "function", "content": json.dumps(call)},
        {"role": "observation", "content": "3C"},
        {"role": "assistant", "content": "Cold."},
    ]
    served = [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "3C"},
    ]
    want = training_prompt_text(
        template, trained, tools=json.dumps(tools), bos_token=exported.bos_token, eos_token=exported.eos_token
    )
    got = exported.apply_chat_template(
        served, tools=tools, tokenize=False, add_generation_prompt=True, date_string="24 Nov 2026"
    )
    assert got == want and "get_weather" in got and "Oslo" in got


def test_export_without_a_template_ships_the_bases_own_template_tools_included(
    stories_copy, tmp_path, real_chat_templates
):
    """Trained with the tokenizer's own chat template (no template: key), the export carries the base's
    template byte for byte, so tools and tool calls render as the base model's vendor wrote them."""
    from transformers import AutoTokenizer

    (stories_copy / "chat_template.jinja").write_text(real_chat_templates["qwen3"], encoding="utf-8")
    base = AutoTokenizer.from_pretrained(stories_copy)
    adapter = tmp_path / "adapter"
    make_adapter(stories_copy, adapter, target_modules=["q_proj", "v_proj"])
    base.save_pretrained(adapter)  # what training writes beside the adapter when no template is set
    export(adapter, tmp_path / "out", ExportOptions(base=stories_copy, smoke=False))
    out = tmp_path / "out"
    assert (out / "chat_template.jinja").read_bytes() == (stories_copy / "chat_template.jinja").read_bytes()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    served = [
        {"role": "user", "content": "Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "3C"},
    ]
    exported = AutoTokenizer.from_pretrained(out)
    got = exported.apply_chat_template(served, tools=tools, tokenize=False, add_generation_prompt=True)
    assert got == base.apply_chat_template(served, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in got and "<tool_call>" in got and "<tool_response>" in got


def test_unchanged_tensors_are_copied_as_bytes_in_chunks(tmp_path):
    # a tensor the adapter does not touch goes from the base file to the output through one small buffer: same
    # bytes, same sha256 as writing the tensor, and a planned dtype/shape it does not have is refused
    import hashlib as _hashlib

    from exporter.io import CheckpointReader, ShardedSafetensorsWriter, TensorInfo

    torch.manual_seed(0)
    state = {"a": torch.randn(37, 11), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(5).to(torch.bfloat16)}
    save_file(state, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    plan = [reader.infos[k] for k in reader.keys_in(reader.files[0])]
    for copy in (True, False):
        out = tmp_path / f"out-{copy}"
        out.mkdir()
        with ShardedSafetensorsWriter(out, plan, 10**9) as writer, reader.open(reader.files[0]) as shard:
            for info in plan:
                if copy:
                    fd, offset, stored = shard.locate(info.name)
                    writer.copy(info.name, fd, offset, stored, chunk=64)  # several chunks per tensor
                else:
                    writer.write(info.name, shard.get(info.name))
            sums = writer.close()
        assert sums["model.safetensors"] == _hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert (tmp_path / "out-True" / "model.safetensors").read_bytes() == (
        tmp_path / "out-False" / "model.safetensors"
    ).read_bytes()
    assert all(torch.equal(v, state[k]) for k, v in load_file(tmp_path / "out-True" / "model.safetensors").items())
    out = tmp_path / "wrong"
    out.mkdir()
    with (
        ShardedSafetensorsWriter(out, [TensorInfo("a", torch.float16, (37, 11))], 10**9) as writer,
        reader.open(reader.files[0]) as shard,
        pytest.raises(ExportError, match="writer expected 'a'"),
    ):
        writer.copy("a", *shard.locate("a"))
