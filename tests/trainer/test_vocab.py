"""``resize_vocab`` and ``add_special_tokens`` / ``new_special_tokens`` (LLaMA-Factory's keys), end to end on the real
stories260K Llama (tied embeddings, 512 tokens, no ``<|im_end|>``):

* the tokenizer: without ``resize_vocab`` a qwen template is refused in one line; with it ``<|im_end|>`` becomes a
  special token and the EOS; listed tokens come first (LLaMA-Factory's order) and turn ``resize_vocab`` on;
* the model: 576 rows (a multiple of 64), new rows the mean of the old ones, the global RNG untouched; FSDP's
  loader reads the same rows as DDP's resize;
* a real run (``template: qwen3_nothink``, 2 steps, 2 torchrun ranks over gloo) under DDP and under FSDP trains the
  same adapter, with the grown embeddings and head and the tokenizer in the adapter folder;
* ``ferry export`` of it passes smoke, loads in transformers, equals peft's own ``merge_and_unload`` of the adapter
  on the grown base, and its own chat template renders ``<|im_end|>`` as the new id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError, ExportError
from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry_train,
    tiny_config,
    train_losses,
    worker_env,
    write_config,
)
from trainer.config import TrainConfig

IM_END = "<|im_end|>"


def _cfg(stories_model: Path, **keys) -> TrainConfig:
    return TrainConfig(model_name_or_path=str(stories_model), dataset="unused", output_dir="unused", **keys)


# ---------------------------------------------------------------------- tokenizer and rows


def test_a_template_whose_markers_the_vocabulary_lacks_is_refused_in_one_line_without_resize_vocab(stories_model):
    from trainer.data import load_tokenizer

    with pytest.raises(ConfigError) as err:
        load_tokenizer(_cfg(stories_model, template="qwen3_nothink"))
    message = str(err.value)
    assert "\n" not in message and IM_END in message and "resize_vocab: true" in message


def test_resize_vocab_adds_the_templates_end_of_turn_as_the_eos_and_plans_576_rows(stories_model):
    from trainer.data import load_tokenizer
    from trainer.vocab import plan_vocab

    cfg = _cfg(stories_model, template="qwen3_nothink", resize_vocab=True)
    tokenizer = load_tokenizer(cfg)
    assert tokenizer.eos_token == IM_END and tokenizer.eos_token_id == 512
    assert tokenizer.encode(f"hi{IM_END}", add_special_tokens=False)[-1] == 512  # one token, never split
    plan = plan_vocab(cfg, tokenizer, stories_model)
    assert (plan.added, plan.base_rows, plan.rows) == ({IM_END: 512}, 512, 576)
    # and a run that adds nothing plans nothing
    assert (
        plan_vocab(
            _cfg(stories_model, template="llama2"),
            load_tokenizer(_cfg(stories_model, template="llama2")),
            stories_model,
        )
        is None
    )


@pytest.mark.parametrize("key", ["add_special_tokens", "new_special_tokens"])
def test_listed_tokens_come_before_the_templates_and_turn_resize_vocab_on(stories_model, key, caplog):
    from trainer.data import load_tokenizer

    tokenizer = load_tokenizer(_cfg(stories_model, template="qwen3_nothink", **{key: "<tool>, </tool>"}))
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<tool>", "</tool>", IM_END)] == [512, 513, 514]
    assert tokenizer.encode("a<tool>b", add_special_tokens=False).count(512) == 1
    assert "resize_vocab is turned on" in caplog.text
    with pytest.raises(ValueError, match="set only one of them"):
        _cfg(stories_model, add_special_tokens="<a>", new_special_tokens="<b>")


def test_grown_rows_are_the_mean_of_the_old_ones_and_draw_no_random_number(stories_model):
    from transformers import AutoModelForCausalLM

    from trainer.vocab import VocabPlan, grow_embeddings

    model = AutoModelForCausalLM.from_pretrained(stories_model)
    old = model.get_input_embeddings().weight.detach().clone()
    rng = torch.get_rng_state()
    grow_embeddings(model, VocabPlan({IM_END: 512}, 512, 576))
    assert torch.equal(torch.get_rng_state(), rng)
    weight = model.get_input_embeddings().weight
    assert weight.shape == (576, 64) and model.config.vocab_size == 576
    assert model.get_output_embeddings().weight is weight  # still tied
    assert torch.equal(weight[:512], old)
    assert torch.allclose(weight[512:], old.double().mean(0).float().expand(64, -1), atol=0, rtol=0)


def test_fsdp_loader_reads_the_rows_the_ddp_resize_makes(stories_model):
    from transformers import AutoModelForCausalLM

    from trainer.fsdp import _CheckpointReader
    from trainer.vocab import VocabPlan, grow_embeddings, read_param_rows

    plan = VocabPlan({IM_END: 512}, 512, 576)
    model = AutoModelForCausalLM.from_pretrained(stories_model)
    grow_embeddings(model, plan)
    want = model.get_input_embeddings().weight.detach()
    reader = _CheckpointReader(stories_model)
    try:  # two ranks' shards of the tied head's peft copy (the checkpoint stores no lm_head)
        name = "base_model.model.lm_head.modules_to_save.default.weight"
        shards = [torch.empty(288, 64), torch.empty(288, 64)]
        for rank, out in enumerate(shards):
            assert read_param_rows(
                reader, name, None, "model", rank * 288, out, plan, ("model.embed_tokens", "lm_head"), tied=True
            )
        assert not read_param_rows(
            reader,
            "base_model.model.model.norm.weight",
            "model.norm.weight",
            "model",
            0,
            torch.empty(64),
            plan,
            ("model.embed_tokens", "lm_head"),
            tied=True,
        )
    finally:
        reader.close()
    assert torch.equal(torch.cat(shards), want)


def test_fsdp_loader_reads_the_trainable_token_rows_the_ddp_resize_makes(untied_model):
    from transformers import AutoModelForCausalLM

    from trainer.fsdp import _CheckpointReader
    from trainer.vocab import VocabPlan, grow_embeddings, read_param_rows

    plan = VocabPlan({IM_END: 512}, 512, 576, token_rows=[7, *range(512, 576)])  # a stored row and the grown ones
    model = AutoModelForCausalLM.from_pretrained(untied_model)
    grow_embeddings(model, plan)
    reader = _CheckpointReader(untied_model)
    try:
        for module, weight in (
            ("model.embed_tokens", model.get_input_embeddings().weight),
            ("lm_head", model.get_output_embeddings().weight),
        ):
            name = f"base_model.model.{module}.token_adapter.trainable_tokens_delta.default"
            shards = [torch.empty(33, 64), torch.empty(32, 64)]
            for start, out in zip((0, 33), shards):
                assert read_param_rows(
                    reader, name, None, "model", start, out, plan, ("model.embed_tokens", "lm_head"), tied=False
                )
            assert torch.equal(torch.cat(shards), weight.detach()[plan.token_rows]), module
    finally:
        reader.close()


def test_an_additional_target_that_leaves_the_new_rows_frozen_is_refused(stories_model):
    from transformers import AutoModelForCausalLM

    from trainer.vocab import VocabPlan, with_trained_embeddings

    model = AutoModelForCausalLM.from_pretrained(stories_model)
    plan = VocabPlan({IM_END: 512}, 512, 576)
    cfg = _cfg(stories_model, resize_vocab=True)
    assert with_trained_embeddings(cfg, model, plan).additional_target == ["embed_tokens", "lm_head"]  # tied
    assert plan.token_rows == []
    with pytest.raises(ConfigError, match="leaves lm_head frozen"):
        with_trained_embeddings(_cfg(stories_model, additional_target="embed_tokens"), model, plan)


# ---------------------------------------------------------------------- a real run, DDP and FSDP, then export


@pytest.fixture(scope="module")
def untied_model(stories_model, tmp_path_factory) -> Path:
    """A tiny random-init Llama with untied embeddings and the stories260K tokenizer (tests/support/zoo.py)."""
    from tests.support.zoo import build

    return build("llama", tmp_path_factory.mktemp("untied"), stories_model)


@pytest.fixture(scope="module")
def runs(stories_model, untied_model, llamafactory_data, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("vocab")
    outputs = {}
    for name, extra in {
        "ddp": {},
        "fsdp": {"fsdp": "full_shard auto_wrap"},
        "untied": {"model_name_or_path": str(untied_model)},
    }.items():
        cfg = tiny_config(
            stories_model,
            llamafactory_data,
            work,
            output_dir=str(work / name),
            template="qwen3_nothink",
            resize_vocab=True,
            max_samples=8,
            max_steps=2,
            **extra,
        )
        run_ferry_train(
            write_config(work / f"{name}.yaml", cfg), "--nproc-per-node", "2", env=worker_env(work), cwd=work
        )
        outputs[name] = work / name
    return outputs


def test_ddp_and_fsdp_train_the_grown_embeddings_alike(runs, stories_model):
    from safetensors.torch import load_file

    ddp, fsdp = adapter_tensors(runs["ddp"] / "adapter"), adapter_tensors(runs["fsdp"] / "adapter")
    assert train_losses(runs["fsdp"]) == pytest.approx(train_losses(runs["ddp"]), rel=1e-5)
    assert_same_adapter(fsdp, ddp, rel_frobenius=1e-4, max_abs=1e-4)
    embed, head = ddp["base_model.model.model.embed_tokens.weight"], ddp["base_model.model.lm_head.weight"]
    assert embed.shape == head.shape == (576, 64)
    base = load_file(str(stories_model / "model.safetensors"))["model.embed_tokens.weight"]
    assert (head[512] - base.mean(0)).abs().max() > 1e-4  # <|im_end|> ends every reply: its row was trained
    record = json.loads((runs["ddp"] / "adapter" / "ferry_vocab.json").read_text())
    assert (record["added"], record["base_rows"], record["rows"]) == ({IM_END: 512}, 512, 576)
    config = json.loads((runs["ddp"] / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["embed_tokens", "lm_head"]


def test_the_export_passes_smoke_and_equals_pefts_own_merge(runs, stories_model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.export import export
    from exporter.options import ExportOptions

    report = export(runs["ddp"] / "adapter", tmp_path / "merged", ExportOptions(max_new_tokens=4))
    assert report.smoke["passed"] and report.smoke["new_tokens"] == {IM_END: 512}
    merged = tmp_path / "merged"
    config = json.loads((merged / "config.json").read_text())
    assert config["vocab_size"] == 576 and config["tie_word_embeddings"] is False
    assert 512 in json.loads((merged / "generation_config.json").read_text())["eos_token_id"]

    # peft's own merge of the adapter on the grown base (the adapter replaces every embedding and head row)
    base = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    base.resize_token_embeddings(576)
    reference = PeftModel.from_pretrained(base, str(runs["ddp"] / "adapter")).merge_and_unload().state_dict()
    ours = load_file(str(merged / "model.safetensors"))
    assert set(ours) == set(reference)
    for key, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[key], atol=1e-6, rtol=1e-6, msg=key)

    # the export loads in transformers, and its chat template writes the new marker as the new id
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.get_input_embeddings().weight.shape == (576, 64)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=True, return_dict=False
    )
    assert IM_END in tokenizer.decode(ids) and 512 in list(ids)


def test_an_adapter_growing_the_embeddings_but_not_the_head_is_refused(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    from exporter.export import export
    from exporter.options import ExportOptions

    adapter = tmp_path / "adapter"
    shutil.copytree(runs["ddp"] / "adapter", adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.lm_head.weight"][:512].contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="must grow together") as err:
        export(adapter, tmp_path / "merged", ExportOptions(smoke=False))
    assert "\n" not in str(err.value) and not (tmp_path / "merged").exists()


def test_untied_embeddings_train_only_the_new_rows_and_export_as_peft_merges(runs, untied_model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from exporter.export import export
    from exporter.options import ExportOptions

    adapter = runs["untied"] / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None
    new_rows = list(range(512, 576))
    assert config["trainable_token_indices"] == {"embed_tokens": new_rows, "lm_head": new_rows}
    deltas = {k: v for k, v in adapter_tensors(adapter).items() if "lora" not in k}
    assert {tuple(v.shape) for v in deltas.values()} == {(64, 64)} and len(deltas) == 2

    report = export(adapter, tmp_path / "merged", ExportOptions(max_new_tokens=4))
    assert report.smoke["passed"] and report.smoke["new_tokens"] == {IM_END: 512}
    merged = tmp_path / "merged"
    assert json.loads((merged / "config.json").read_text())["vocab_size"] == 576
    base = AutoModelForCausalLM.from_pretrained(untied_model, dtype=torch.float32)
    stored = base.get_input_embeddings().weight.detach().clone()
    base.resize_token_embeddings(576)
    reference = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()
    ours = load_file(str(merged / "model.safetensors"))
    assert set(ours) == set(reference)
    for key, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[key], atol=1e-6, rtol=1e-6, msg=key)
    assert torch.equal(ours["model.embed_tokens.weight"][:512], stored)  # the old rows stay the base's
