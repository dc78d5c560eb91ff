"""QLoRA (trainer/quant.py): 4-bit and 8-bit bases through bitsandbytes, checked against what ferry did not write.

- layer level: a ``Linear4bit`` loaded by transformers computes ``F.linear`` on its dequantised weight (forward and
  input gradient), and :func:`trainer.quant.quant_dequant` (the exporter's ``--merge-into dequantized``) rebuilds
  exactly that dequantised weight from the original full-precision tensor;
- model level: a tiny Llama whose dimensions quantise (multiples of 64) with LoRA (B random, as peft's
  ``init_lora_weights=False``): loss and LoRA gradients equal those of an fp32 model built from the dequantised
  weights, at step 0 and over 3 AdamW steps;
- an evaluation pass does not take the gradient away (bitsandbytes' AVX512-BF16 CPU repack);
- LLaMA-Factory's own QLoRA example (``qwen3_lora_sft_otfq.yaml`` from the hash-pinned llamafactory 0.9.5 sdist)
  trains with 2 DDP ranks and with 2 FSDP2 ranks (real torchrun, gloo; FSDP2 with bfloat16-stored packed weights,
  sharded) and gives the losses and adapter of one process with the whole batch, also with gradient
  checkpointing, accumulation and DDP's find_unused_parameters off; ``extras/fsdp_qlora`` runs on 2 FSDP2 ranks
  through its own accelerate config file (``ferry train --accelerate-config``) and its adapter loads in peft; its
  GPTQ / AWQ / AQLM examples are refused in one line naming the method; refused settings give one line.

Tolerances: fp32 on CPU. bitsandbytes' CPU 4-bit matmul dequantises and calls the same GEMM, measured equal to
1e-6; 2 ranks vs 1 process round differently (~1e-7 relative per step, as tests/trainer/test_ddp.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import bitsandbytes as bnb  # noqa: E402 - the quantization extra, installed by make
import bitsandbytes.functional as bnbF  # noqa: E402
import pytest
import torch
import yaml

from ferry.errors import ConfigError
from tests.support.helpers import (
    adapter_tensors,
    assert_same_adapter,
    run_ferry_train,
    run_plain_worker,
    train_losses,
    worker_env,
    write_config,
)
from tests.support.pinned_sdist import LLAMAFACTORY
from trainer.config import TrainConfig

pytestmark = pytest.mark.budget(90, reason="QLoRA runs on 2 FSDP ranks through the CLI")


@pytest.fixture(scope="session")
def tiny64(stories_model: Path, tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64, MLP 128, 4 heads of 16, vocab 512) with the stories260K tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.05,
    )
    out = tmp_path_factory.mktemp("tiny64")
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_model / name, out / name)
    return out


def _cfg(model: Path, **keys) -> TrainConfig:
    base = dict(
        model_name_or_path=str(model), dataset="unused", output_dir="unused", lora_rank=4, seed=3, quantization_bit=4
    )
    base.update(keys)
    return TrainConfig(**base)


def _quantized(model: Path, **keys):
    from trainer.modeling import build_lora_model

    cfg = _cfg(model, **keys)
    peft_model = build_lora_model(cfg, model, device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # init_lora_weights=False: B random, so the base's gradient path matters
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return cfg, peft_model


def _dequantized_reference(model: Path, cfg: TrainConfig, quantized):
    """An fp32 model whose every quantised linear weight is the dequantised one, with the same LoRA weights."""
    from peft import (
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from transformers import AutoModelForCausalLM

    from trainer.targets import lora_config_for

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    modules = dict(ref.named_modules())
    count = 0
    for name, module in quantized.get_base_model().named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            target = modules[name.removesuffix(".base_layer")]
            with torch.no_grad():
                target.weight.copy_(_dequant(module))
            count += 1
    assert count == 2 * 7  # q k v o gate up down in each of 2 layers; the tied head stays full precision
    ref_peft = get_peft_model(ref, lora_config_for(cfg, ref))
    result = set_peft_model_state_dict(ref_peft, get_peft_model_state_dict(quantized))
    assert not result.unexpected_keys
    return ref_peft


def _dequant(module) -> torch.Tensor:
    if isinstance(module, bnb.nn.Linear4bit):
        return bnbF.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    return bnbF.int8_vectorwise_dequant(module.weight.data, module.weight.SCB).float()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(11))
    return {"input_ids": ids, "labels": ids}


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {
        n.replace(".base_layer", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad and "lora_" in n
    }


# ---------------------------------------------------------------------- layer level


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_4bit_layer_is_linear_on_its_dequantized_weight(tiny64, quant_type, double):
    from safetensors.torch import load_file

    from trainer.quant import quant_dequant, quantization_record

    cfg, model = _quantized(tiny64, quantization_type=quant_type, double_quantization=double)
    name, layer = next(
        (n, m)
        for n, m in model.get_base_model().named_modules()
        if isinstance(m, bnb.nn.Linear4bit) and n.endswith("mlp.down_proj.base_layer")
    )
    assert layer.weight.quant_state.quant_type == quant_type
    assert (layer.weight.quant_state.nested is True) == double
    w = _dequant(layer)
    for mode in ("eval", "train"):
        getattr(layer, mode)()
        x = torch.randn(3, 5, 128, requires_grad=True)
        y = layer(x)
        y.backward(torch.ones_like(y))
        x_ref = x.detach().clone().requires_grad_(True)
        y_ref = torch.nn.functional.linear(x_ref, w)
        y_ref.backward(torch.ones_like(y_ref))
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    # the exporter's dequant(quant(W)) from the original full-precision tensor is the weight training saw
    original = load_file(str(tiny64 / "model.safetensors"))[name.removesuffix(".base_layer") + ".weight"]
    assert torch.equal(quant_dequant(original, quantization_record(cfg, torch.float32)), w)


def test_8bit_base_dequantizes_as_the_exporter_does(tiny64):
    from safetensors.torch import load_file

    from trainer.quant import quant_dequant, quantization_record

    cfg, model = _quantized(tiny64, quantization_bit=8)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear8bitLt)
    original = load_file(str(tiny64 / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(
        quant_dequant(original, quantization_record(cfg, torch.float32)), _dequant(layer), rtol=0, atol=1e-7
    )


# ---------------------------------------------------------------------- model level


def test_4bit_lora_trains_as_fp32_on_the_dequantized_weights(tiny64):
    cfg, quantized = _quantized(tiny64)
    # no blanket fp32 cast of the frozen non-quantised parameters: they stay in the training dtype (fp32 here,
    # so check the bf16 case through the config helper instead) and the packed weights stay packed
    assert {p.dtype for n, p in quantized.named_parameters() if "base_layer" in n} == {torch.uint8}
    reference = _dequantized_reference(tiny64, cfg, quantized)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (quantized, reference)]
    batch = _batch()
    for step in range(4):
        losses = []
        for model, opt in zip((quantized, reference), opts):
            model.train()
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), f"step {step}"
        q, r = _lora_grads(quantized), _lora_grads(reference)
        assert q.keys() == r.keys() and len(q) == 28
        for key in q:
            torch.testing.assert_close(q[key], r[key], rtol=1e-4, atol=1e-6, msg=f"step {step}: {key}")
        for opt in opts:
            opt.step()
    assert losses[0] < 6.3  # and it learned something: ln(512) = 6.24 at random init, lora_B moves the loss


def test_eval_pass_keeps_the_gradient_through_the_4bit_base(tiny64):
    _, model = _quantized(tiny64)
    batch = _batch()
    model.train()
    model(**batch).loss.backward()
    before = _lora_grads(model)
    model.zero_grad()
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    model(**batch).loss.backward()
    after = _lora_grads(model)
    for key in before:
        assert before[key].abs().max() > 0, key
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=key)
    # what ferry guards against: on AVX512-BF16 CPUs bitsandbytes' eval repack drops the base's gradient path
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if " avx512_bf16" in flags:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = True
        model.eval()
        with torch.no_grad():
            model(**batch)
        model.train()
        model.zero_grad()
        model(**batch).loss.backward()
        trapped = _lora_grads(model)
        assert any(not torch.allclose(trapped[k], before[k]) for k in before), "the repack trap is gone upstream"


def test_each_rank_loads_its_quantized_base_on_its_own_device():
    """device_map per rank: the whole model on this rank's device (never "auto", which would spread one model over
    every GPU of the host and leave DDP one model-parallel process)."""
    from trainer.quant import device_map_for

    assert device_map_for(torch.device("cuda", 3)) == {"": 3}
    assert device_map_for(torch.device("cpu")) == {"": "cpu"}
    from ferry.errors import TrainingError

    with pytest.raises(TrainingError, match="cuda:LOCAL_RANK"):
        device_map_for(torch.device("cuda"))


def test_bf16_run_computes_in_bf16_and_casts_nothing_else_to_fp32(tiny64):
    """Compute dtype = the training dtype (bf16); norms and embeddings stay bf16 (no blanket fp32 cast as peft's
    prepare_model_for_kbit_training), LoRA is fp32; ``upcast_layernorm`` alone makes the norms fp32. A step under
    bf16 autocast (what ferry's CUDA runs use; on CPU ferry trains in fp32, so CPU autocast stands in) gives finite
    LoRA gradients."""
    from trainer.modeling import build_lora_model

    for upcast in (False, True):
        cfg = _cfg(tiny64, bf16=True, upcast_layernorm=upcast)
        model = build_lora_model(cfg, tiny64, device=torch.device("cpu"), dtype=torch.bfloat16)
        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(layers) == 14 and {m.compute_dtype for m in layers} == {torch.bfloat16}
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        norms = {d for n, d in dtypes.items() if "norm" in n}
        assert norms == ({torch.float32} if upcast else {torch.bfloat16})
        assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.bfloat16
        assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**_batch()).loss
    loss.backward()
    grads = _lora_grads(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert all(bool(g.abs().max() > 0) for k, g in grads.items() if "lora_B" in k)  # B starts at zero, A moves B


def test_launcher_stops_before_training_when_bitsandbytes_cannot_run(tmp_path, tiny64, llamafactory_data, monkeypatch):
    """Launcher pre-flight: a bitsandbytes whose native library does not load (here a package on the path that
    fails at import as a missing libbitsandbytes_cpu.so does) stops ``ferry train`` with one line and no
    traceback, before any worker trains; a host without bitsandbytes at all gets one line saying how to carry it.
    The launcher is forked from this process with bitsandbytes forgotten and the broken one first on its path (a
    ``PYTHONPATH`` does not reach a fork); its torchrun and 2 workers start and are stopped at the start gate."""
    from tests.support.helpers import fork_ferry
    from trainer.quant import backend_problem

    broken = tmp_path / "site" / "bitsandbytes"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise OSError("libbitsandbytes_cpu.so: cannot open shared object file")\n')
    config = write_config(
        tmp_path / "q.yaml",
        {
            "model_name_or_path": str(tiny64),
            "dataset": "alpaca_en_demo",
            "dataset_dir": str(llamafactory_data),
            "template": "alpaca",
            "cutoff_len": 64,
            "max_samples": 8,
            "max_steps": 1,
            "output_dir": str(tmp_path / "o"),
            "quantization_bit": 4,
        },
    )

    def with_the_broken_bitsandbytes(args: list[str]) -> None:
        import sys

        from ferry.cli import main
        from tests.support import forks

        for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
            del sys.modules[name]
        sys.path.insert(0, str(tmp_path / "site"))
        forks.install()
        main(args)

    args = ["train", str(config), "--nproc-per-node", "2"]
    proc = fork_ferry(args, env=worker_env(tmp_path), cwd=tmp_path, entry=with_the_broken_bitsandbytes, timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith(
        "ferry: error: quantization_bit: bitsandbytes is installed but its native library "
        "does not work here: OSError: libbitsandbytes_cpu.so"
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "o" / "train_report.json").exists() and not list((tmp_path / "o").glob("checkpoint-*"))

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    assert "ferry pack --extra quantization carries it" in backend_problem()


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "keys,needle",
    [
        ({"quantization_method": "hqq"}, "'hqq' is not supported; ferry quantises on the fly with bnb"),
        ({"quantization_method": "gptq"}, "'gptq' is not supported"),
        ({"quantization_bit": None, "quantization_type": "fp4"}, "quantization_type: has no effect without"),
        ({"quantization_bit": 8, "quantization_type": "fp4"}, "applies to quantization_bit: 4 only"),
        ({"fsdp": "full_shard", "bnb_4bit_quant_storage": "uint8"}, "uint8 cannot be sharded by FSDP2"),
        ({"fsdp": "full_shard", "quantization_bit": 8}, "fsdp: over an 8-bit base is not supported"),
        ({"fsdp": "full_shard", "bf16": True, "bnb_4bit_quant_storage": "float32"}, "FSDP2 would cast the packed"),
        ({"use_dora": True}, "use_dora: over a quantization_bit base"),
        ({"quantization_bit": 3}, "quantization_bit"),
    ],
)
def test_refused_settings_give_one_line(tmp_path, tiny64, keys, needle):
    from trainer.config import load_config

    data = {
        "model_name_or_path": str(tiny64),
        "dataset": "x",
        "output_dir": str(tmp_path / "o"),
        "quantization_bit": 4,
        **keys,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _lf_example(name: str) -> dict:
    return yaml.safe_load((LLAMAFACTORY.path() / "examples" / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "name,method",
    [("llama3_lora_sft_gptq.yaml", "GPTQ"), ("llama3_lora_sft_awq.yaml", "AWQ"), ("llama3_lora_sft_aqlm.yaml", "AQLM")],
)
def test_llamafactory_prequantized_examples_are_refused(tmp_path, tiny64, llamafactory_data, name, method):
    """LLaMA-Factory's GPTQ / AWQ / AQLM examples name pre-quantised hub models: a local base whose config.json
    carries that quantization_config stands in for each (the model path is the only key replaced)."""
    from trainer.launch import launch

    base = tmp_path / "prequant"
    shutil.copytree(tiny64, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method.lower(), "bits": 4}
    (base / "config.json").write_text(json.dumps(config))
    example = _lf_example(f"train_qlora/{name}")
    example.update(
        model_name_or_path=str(base),
        dataset="alpaca_en_demo",
        dataset_dir=str(llamafactory_data),
        output_dir=str(tmp_path / "out"),
        template="alpaca",
        max_samples=8,
        cutoff_len=64,
    )
    path = write_config(tmp_path / name, example)
    with pytest.raises(ConfigError) as err:
        launch(path, dry_run=True, nproc_per_node=1)
    assert f"pre-quantized {method} model" in str(err.value) and "\n" not in str(err.value)


def test_fsdp_qlora_example_dry_run_counts_4bit_weights(tmp_path, tiny64, llamafactory_data):
    """LLaMA-Factory's examples/extras/fsdp_qlora/llama3_lora_sft.yaml (its FSDP comes from an accelerate config,
    not the YAML): the dry run's memory plan holds the frozen weights at ~4.5 bits, not 32."""
    from trainer.launch import launch

    example = _lf_example("extras/fsdp_qlora/llama3_lora_sft.yaml")
    example.update(
        model_name_or_path=str(tiny64),
        dataset="alpaca_en_demo",
        dataset_dir=str(llamafactory_data),
        output_dir=str(tmp_path / "out"),
        template="alpaca",
        max_samples=8,
        cutoff_len=64,
        tokenized_path=None,
    )
    example.pop("tokenized_path")
    quant = launch(
        write_config(tmp_path / "q.yaml", example),
        dry_run=True,
        nproc_per_node=1,
        env={"FERRY_CACHE": str(tmp_path / "cache")},
    )
    example.pop("quantization_bit")
    plain = launch(
        write_config(tmp_path / "p.yaml", example),
        dry_run=True,
        nproc_per_node=1,
        env={"FERRY_CACHE": str(tmp_path / "cache")},
    )
    q_weights, p_weights = quant.memory["ddp"]["weights"], plain.memory["ddp"]["weights"]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny64)
    linear = sum(
        mod.weight.numel() for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"
    )
    # 4-bit with double quantisation: 0.5 + (1 + 4/256) / 64 bytes per linear weight instead of 4
    saved = p_weights - q_weights
    assert saved == pytest.approx(linear * (4 - 0.5 - (1 + 4 / 256) / 64), rel=1e-3)


def _lf_launcher_config(script: str) -> Path:
    """The accelerate config file an example's train.sh passes to ``accelerate launch --config_file``."""
    words = (LLAMAFACTORY.path() / "examples" / script).read_text(encoding="utf-8").split()
    return LLAMAFACTORY.path() / words[words.index("--config_file") + 1]


def test_fsdp_qlora_example_runs_on_two_fsdp_ranks_and_its_adapter_loads_in_peft(tmp_path, tiny64, llamafactory_data):
    """LLaMA-Factory's examples/extras/fsdp_qlora: its train.sh starts llama3_lora_sft.yaml with
    ``accelerate launch --config_file examples/accelerate/fsdp_config.yaml``; ``ferry train --accelerate-config``
    with that same file (nothing else on the command line: 2 processes and FULL_SHARD come from it) runs the YAML,
    only paths and sizes changed, for 2 steps on 2 gloo ranks under FSDP2 over the 4-bit base. The adapter loads
    in peft over the full-precision base and over the 4-bit base, with the trained weights. About 22 s (38 s on a
    loaded machine)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    accelerate = _lf_launcher_config("extras/fsdp_qlora/train.sh")
    assert accelerate.name == "fsdp_config.yaml"
    example = _lf_example("extras/fsdp_qlora/llama3_lora_sft.yaml")
    assert example["quantization_bit"] == 4 and "fsdp" not in example
    example.update(
        model_name_or_path=str(tiny64),
        dataset_dir=str(llamafactory_data),
        template="alpaca",
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        max_samples=8,
        cutoff_len=64,
        bf16=False,
        dataloader_num_workers=0,
        preprocessing_num_workers=None,
        logging_steps=1,
        disable_tqdm=True,
    )
    config = write_config(tmp_path / "fsdp_qlora.yaml", example)
    proc = run_ferry_train(config, "--accelerate-config", str(accelerate), env=worker_env(tmp_path), cwd=tmp_path)
    assert (
        "--accelerate-config fsdp_config.yaml (distributed_type FSDP, 2 process(es) per node on 1 node(s)) "
        "runs as fsdp: full_shard" in proc.stderr
    )
    out = tmp_path / "out"
    report = json.loads((out / "train_report.json").read_text())
    assert (report["parallelism"], report["world_size"], report["global_steps"]) == ("full_shard", 2, 2)
    assert report["global_batch_size"] == 2 * example["gradient_accumulation_steps"]
    assert len(train_losses(out)) == 2
    record = json.loads((out / "adapter" / "ferry_quantization.json").read_text())
    assert (record["quantization_bit"], record["bnb_4bit_quant_storage"]) == (4, "bfloat16")
    trained = adapter_tensors(out / "adapter")
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    quantized = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    for base in (
        AutoModelForCausalLM.from_pretrained(tiny64),
        AutoModelForCausalLM.from_pretrained(tiny64, quantization_config=quantized, device_map={"": "cpu"}),
    ):
        model = PeftModel.from_pretrained(base, str(out / "adapter"))
        loaded = get_peft_model_state_dict(model)
        assert loaded.keys() == trained.keys()
        for key, value in trained.items():
            assert torch.equal(loaded[key].float(), value.float()), key
        ids = torch.tensor([[1, 5, 9, 14]])
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_accelerate_configs_of_llamafactory_map_to_ferrys_parallelism(tmp_path, tiny64, caplog):
    """Every accelerate config LLaMA-Factory ships under examples/accelerate maps onto ferry's fsdp options and
    launch options; what ferry cannot run is one line naming the file and key."""
    from trainer.accelerate_config import read_accelerate_config
    from trainer.config import load_config

    root = LLAMAFACTORY.path() / "examples" / "accelerate"
    expected = {
        "fsdp_config.yaml": (["full_shard"], 2, 1),
        "fsdp2_config.yaml": (["full_shard"], 2, 1),
        "fsdp_config_offload.yaml": (["full_shard", "offload"], 2, 1),
        "fsdp_config_multiple_nodes.yaml": (["full_shard"], 8, 2),
    }
    for name, (fsdp, nproc, nnodes) in expected.items():
        launch = read_accelerate_config(root / name)
        assert (launch.keys["fsdp"], launch.nproc_per_node, launch.nnodes) == (fsdp, nproc, nnodes), name
    multi = read_accelerate_config(root / "fsdp_config_multiple_nodes.yaml")
    assert (multi.node_rank, multi.master_addr, multi.master_port) == (0, "192.168.0.1", 29500)
    for name in sorted(p.name for p in root.glob("*.yaml")):  # none of them is refused
        read_accelerate_config(root / name)

    yaml_path = write_config(
        tmp_path / "c.yaml",
        {"model_name_or_path": str(tiny64), "dataset": "x", "output_dir": str(tmp_path / "o"), "quantization_bit": 4},
    )
    with caplog.at_level("WARNING", logger="ferry.trainer.config"):
        cfg = load_config(yaml_path, accelerate=read_accelerate_config(root / "fsdp_config_offload.yaml"))
    assert (cfg.fsdp_strategy, cfg.fsdp_cpu_offload, cfg.quantization_bit) == ("full_shard", True, 4)
    assert any("runs as fsdp: full_shard offload" in r.getMessage() for r in caplog.records)
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")
    assert load_config(yaml_path, accelerate=read_accelerate_config(ddp)).fsdp == []
    old = tmp_path / "old.yaml"  # older accelerate files number the strategy; NO_SHARD = 3 is DDP
    old.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 2\n  fsdp_activation_checkpointing: true\n"
    )
    cfg = load_config(yaml_path, accelerate=read_accelerate_config(old))
    assert (cfg.fsdp_strategy, cfg.activation_checkpointing) == ("shard_grad_op", True)

    refused = {
        "distributed_type: TPU\n": "distributed_type: TPU is not run by ferry",
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF\n": (
            "fsdp_config.fsdp_sharding_strategy: 'HALF' is not one of"
        ),
        "distributed_type: FSDP\nnum_processes: 3\nnum_machines: 2\n": "num_processes: 3 is not a multiple",
        "- a list\n": "expected a mapping",
    }
    for text, needle in refused.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as err:
            read_accelerate_config(bad)
        assert needle in str(err.value) and "\n" not in str(err.value) and str(bad) in str(err.value), text
    both = write_config(
        tmp_path / "both.yaml",
        {"model_name_or_path": str(tiny64), "dataset": "x", "output_dir": str(tmp_path / "o"), "fsdp": "full_shard"},
    )
    with pytest.raises(ConfigError, match="fsdp is set and --accelerate-config .* sets the parallelism too"):
        load_config(both, accelerate=read_accelerate_config(root / "fsdp_config.yaml"))


# ---------------------------------------------------------------------- 2 DDP ranks == one process


@pytest.fixture(scope="module")
def otfq_runs(tiny64, llamafactory_data, tmp_path_factory) -> dict[str, Path]:
    """LLaMA-Factory's examples/train_qlora/qwen3_lora_sft_otfq.yaml with the model, dataset and size keys
    replaced: 2 ranks x batch 2 (torchrun: DDP, FSDP2), 2 DDP ranks x batch 1 x accumulation 2 and 1 process x
    batch 4, 4 steps, an evaluation every 2 steps (so training resumes after eval). About 25 s per run."""
    work = tmp_path_factory.mktemp("otfq")
    example = _lf_example("train_qlora/qwen3_lora_sft_otfq.yaml")
    assert example["quantization_bit"] == 4 and example["quantization_method"] == "bnb"
    example.update(
        model_name_or_path=str(tiny64),
        dataset="alpaca_en_demo",
        dataset_dir=str(llamafactory_data),
        template="alpaca",
        cutoff_len=64,
        max_samples=24,
        max_steps=4,
        logging_steps=1,
        gradient_accumulation_steps=1,
        learning_rate=5e-3,
        warmup_ratio=0.0,
        val_size=4,
        eval_steps=2,
        preprocessing_num_workers=None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=7,
    )
    outputs = {}
    for name, nproc, batch in (("ddp", 2, 2), ("fsdp", 2, 2), ("ddp_accum", 2, 1), ("one", 1, 4)):
        cfg = dict(example, output_dir=str(work / name), per_device_train_batch_size=batch)
        if name == "fsdp":
            cfg["fsdp"] = "full_shard"  # bnb_4bit_quant_storage unset: bfloat16 under fsdp
        if name == "ddp_accum":  # the named trap, spelt out: checkpointing on, DDP without find_unused_parameters,
            # and accumulation 2, so DDP runs without static_graph (no_sync on the first micro-batch)
            cfg.update(gradient_accumulation_steps=2, gradient_checkpointing=True, ddp_find_unused_parameters=False)
        config = write_config(work / f"{name}.yaml", cfg)
        if nproc == 2:
            run_ferry_train(config, "--nproc-per-node", "2", env=worker_env(work), cwd=work)
        else:
            run_plain_worker(config, env=worker_env(work), cwd=work)
        outputs[name] = work / name
    return outputs


def test_checkpointed_4bit_ddp_without_find_unused_parameters_trains_as_one_process(otfq_runs):
    """Gradient checkpointing over a 4-bit base under DDP with ``find_unused_parameters=False``, a trap the
    peers' users meet: with reentrant checkpointing and a frozen base whose embeddings do not require grad, the
    checkpointed layers' LoRA weights get no gradient and DDP stops waiting for them. ferry checkpoints
    non-reentrantly with input grads on: 2 ranks x batch 1 x accumulation 2 (no static_graph, no_sync) give the
    losses and adapter of one process with the whole batch, with every decoder layer checkpointed in both."""
    losses, reference = train_losses(otfq_runs["ddp_accum"]), train_losses(otfq_runs["one"])
    assert len(losses) == len(reference) == 4
    assert losses == pytest.approx(reference, rel=1e-5)
    for name in ("ddp_accum", "one", "ddp"):  # the example leaves checkpointing at LLaMA-Factory's default: on
        assert json.loads((otfq_runs[name] / "train_report.json").read_text())["checkpointed_layers"] == 2, name
    ref = adapter_tensors(otfq_runs["one"] / "adapter")
    assert_same_adapter(adapter_tensors(otfq_runs["ddp_accum"] / "adapter"), ref, rel_frobenius=1e-4, max_abs=1e-4)
    assert all(
        v.abs().max() > 0 for k, v in adapter_tensors(otfq_runs["ddp_accum"] / "adapter").items() if "lora_B" in k
    )  # every LoRA B got a gradient through the checkpointed 4-bit layers


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_train_as_one_process(otfq_runs, mode):
    losses, reference = train_losses(otfq_runs[mode]), train_losses(otfq_runs["one"])
    assert len(losses) == len(reference) == 4
    assert losses == pytest.approx(reference, rel=1e-5)
    evals = [json.loads(x) for x in (otfq_runs[mode] / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert len(evals) >= 2  # evaluated mid-run, then trained on
    ref = adapter_tensors(otfq_runs["one"] / "adapter")
    assert_same_adapter(adapter_tensors(otfq_runs[mode] / "adapter"), ref, rel_frobenius=1e-4, max_abs=1e-4)
    report = json.loads((otfq_runs[mode] / "train_report.json").read_text())
    single = json.loads((otfq_runs["one"] / "train_report.json").read_text())
    assert report["parallelism"] == ("full_shard" if mode == "fsdp" else "ddp")
    if mode == "fsdp":  # the packed 4-bit weights are sharded; the root unit (embeddings, final norm) is still
        # gathered after the closing evaluation (FSDP2 keeps the root's weights after a forward for the backward),
        # so a rank holds 0.78 of one process's bytes here (0.50 measured without evaluation)
        assert max(report["param_bytes_per_rank"]) <= 0.8 * single["param_bytes_per_rank"][0]
    assert any(v.abs().max() > 1e-3 for k, v in ref.items() if "lora_B" in k)  # the adapter moved


def test_adapter_records_its_quantization(otfq_runs):
    from ferry.adapter_folder import QUANT_RECORD

    record = json.loads((otfq_runs["ddp"] / "adapter" / QUANT_RECORD).read_text())
    assert record["quantization_bit"] == 4 and record["quantization_type"] == "nf4"
    assert record["bnb_4bit_quant_storage"] == "uint8"
    assert (
        json.loads((otfq_runs["fsdp"] / "adapter" / QUANT_RECORD).read_text())["bnb_4bit_quant_storage"] == "bfloat16"
    )
    assert record["double_quantization"] is True and record["compute_dtype"] == "float32"
    assert record["bitsandbytes_version"] == bnb.__version__


# ---------------------------------------------------------------------- export (exporter/quant.py)


@pytest.fixture(scope="module")
def exports(otfq_runs, tiny64, tmp_path_factory) -> dict[str, object]:
    from exporter.export import export
    from exporter.options import ExportOptions

    work = tmp_path_factory.mktemp("qexport")
    adapter = otfq_runs["one"] / "adapter"
    return {
        mode: export(adapter, work / mode, ExportOptions(base=tiny64, merge_into=mode, max_new_tokens=4))
        for mode in ("original", "dequantized")
    }


def _expected(tiny64: Path, adapter: Path, dequantize: bool) -> dict[str, torch.Tensor]:
    """W + (alpha / r) B A per LoRA layer from the adapter file, W the original tensor or dequant(quant(W))."""
    from safetensors.torch import load_file

    from ferry.adapter_folder import read_quant_record as read_record
    from trainer.quant import quant_dequant

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = adapter_tensors(adapter)
    base = load_file(str(tiny64 / "model.safetensors"))
    record = read_record(adapter)
    out = {}
    for key, w in base.items():
        if dequantize and key.endswith("proj.weight"):
            w = quant_dequant(w, record)
        a = lora.get("base_model.model." + key.replace(".weight", ".lora_A.weight"))
        if a is not None:
            b = lora["base_model.model." + key.replace(".weight", ".lora_B.weight")]
            w = w.float() + scale * (b.float() @ a.float())
        out[key] = w
    return out


@pytest.mark.parametrize("mode", ["original", "dequantized"])
def test_export_merges_into_the_chosen_weights_and_smoke_passes(exports, otfq_runs, tiny64, mode):
    from safetensors.torch import load_file

    report = exports[mode]
    merged = load_file(str(Path(report.output) / "model.safetensors"))
    expected = _expected(tiny64, otfq_runs["one"] / "adapter", dequantize=mode == "dequantized")
    assert merged.keys() == expected.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], expected[key].to(merged[key].dtype), rtol=1e-6, atol=1e-6, msg=key)
    # the two modes really differ: by the quantization error of every linear weight
    other = _expected(tiny64, otfq_runs["one"] / "adapter", dequantize=mode != "dequantized")
    assert (merged["model.layers.0.mlp.up_proj.weight"] - other["model.layers.0.mlp.up_proj.weight"]).abs().max() > 1e-3
    smoke = report.smoke
    assert smoke["passed"], smoke["failures"]
    q = smoke["quantization"]
    assert q["merge_into"] == mode and q["within_bound"] and q["quantization_noise"] > 0
    if mode == "dequantized":  # equal to base + adapter as trained, to fp32 rounding
        assert q["quantized_reference_diff"] <= 1e-4 * (1 + smoke["tolerance"] * 1e4)
    meta = json.loads((Path(report.output) / "ferry_export.json").read_text())
    assert meta["quantization"]["merge_into"] == mode and meta["quantization"]["quantization_bit"] == 4


def test_merge_into_dequantized_needs_a_qlora_adapter(otfq_runs, tiny64, tmp_path):
    from exporter.export import export
    from exporter.options import ExportOptions
    from ferry.adapter_folder import QUANT_RECORD
    from ferry.errors import ExportError

    plain = tmp_path / "adapter"
    shutil.copytree(otfq_runs["one"] / "adapter", plain)
    (plain / QUANT_RECORD).unlink()
    with pytest.raises(ExportError) as err:
        export(plain, tmp_path / "out", ExportOptions(base=tiny64, merge_into="dequantized", smoke=False))
    assert "was not trained over a quantized base" in str(err.value) and "\n" not in str(err.value)


def test_export_cli_merge_into_dequantized(otfq_runs, tiny64, tmp_path):
    """``ferry export --merge-into dequantized`` on the command line: the merged weights are dequant(quant(W)) +
    scale * BA and the export records the choice."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from ferry.cli import cli

    adapter = otfq_runs["one"] / "adapter"
    result = CliRunner().invoke(
        cli,
        [
            "export",
            "--adapter",
            str(adapter),
            "--base",
            str(tiny64),
            "--output",
            str(tmp_path / "m"),
            "--merge-into",
            "dequantized",
            "--no-smoke",
        ],
    )
    assert result.exit_code == 0, result.output
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    expected = _expected(tiny64, adapter, dequantize=True)
    key = "model.layers.1.self_attn.v_proj.weight"
    torch.testing.assert_close(merged[key], expected[key].to(merged[key].dtype), rtol=1e-6, atol=1e-6)
    meta = json.loads((tmp_path / "m" / "ferry_export.json").read_text())
    assert meta["quantization"]["merge_into"] == "dequantized"


def test_train_keys_documents_the_quantization_keys():
    from click.testing import CliRunner

    from ferry.cli import cli

    out = CliRunner().invoke(cli, ["train", "--keys"]).output
    for key in (
        "quantization_bit",
        "quantization_method",
        "quantization_type",
        "double_quantization",
        "bnb_4bit_quant_storage",
        "upcast_layernorm",
    ):
        assert f"\n{key}  (default:" in out, key


# ---------------------------------------------------------------------- CUDA: the kernel check and LLM.int8


def test_cuda_kernel_check_names_bitsandbytes_own_message(tmp_path):
    """The CUDA check runs bitsandbytes' layer on cuda:0 in a fresh interpreter and hands back its own error as one
    line: here a bitsandbytes whose CUDA library does not load (a stand-in package that fails at import as a missing
    libbitsandbytes_cuda126.so does)."""
    import os

    from trainer.quant import cuda_backend_problem

    broken = tmp_path / "site" / "bitsandbytes"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise RuntimeError("Configured CUDA binary not found at libbitsandbytes_cuda126.so\\n'
        'Detected CUDA version 12.6")\n'
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    assert cuda_backend_problem(4, env=env) == (
        "RuntimeError: Configured CUDA binary not found at libbitsandbytes_cuda126.so Detected CUDA version 12.6"
    )


def test_launcher_checks_the_cuda_kernel_when_the_host_shows_a_gpu(tiny64, monkeypatch):
    """With a visible GPU (torch's count replaced: this host has none) the pre-flight also runs a 4-bit layer on
    cuda:0, which fails here as it would with a bitsandbytes or torch build without working CUDA: one ConfigError
    line carrying the error; without a GPU that check does not run."""
    from types import SimpleNamespace

    from trainer import quant

    cfg = SimpleNamespace(quantization_bit=4, model_name_or_path=str(tiny64))
    monkeypatch.setattr("trainer.gpus.visible_gpu_count", lambda: 0)
    monkeypatch.setattr(quant, "cuda_backend_problem", lambda bits: pytest.fail("CUDA checked without a GPU"))
    quant.preflight(cfg, tiny64)
    monkeypatch.undo()
    monkeypatch.setattr("trainer.gpus.visible_gpu_count", lambda: 1)
    with pytest.raises(ConfigError) as err:
        quant.preflight(cfg, tiny64)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("quantization_bit: bitsandbytes' CUDA kernel does not run on cuda:0 here, so every ")
    assert "CUDA" in message.split("every worker would fail: ", 1)[1], message


def test_the_quantization_record_keeps_device_and_int8_threshold(tiny64):
    from trainer.quant import quantization_record

    eight = TrainConfig(model_name_or_path=str(tiny64), dataset="d", output_dir="o", quantization_bit=8)
    record = quantization_record(eight, torch.float16, torch.device("cuda", 3))
    assert record["device"] == "cuda" and record["llm_int8_threshold"] == 6.0  # transformers' default
    four = TrainConfig(model_name_or_path=str(tiny64), dataset="d", output_dir="o", quantization_bit=4)
    record = quantization_record(four, torch.float32, torch.device("cpu"))
    assert record["device"] == "cpu" and record["llm_int8_threshold"] is None


def test_dequantized_merge_of_an_8bit_adapter_trained_on_cuda_is_refused(otfq_runs, tiny64, tmp_path):
    """LLM.int8 on CUDA computes outlier input columns in 16-bit, which no dequantized weight reproduces: an 8-bit
    adapter trained on CUDA with a threshold above 0 is refused for --merge-into dequantized in one line (also a
    record from before the device was kept, whose bf16 compute dtype says CUDA); on CPU, with threshold 0, or at
    4 bits it is not."""
    from exporter.export import export
    from exporter.options import ExportOptions
    from exporter.quant import check_merge_into
    from ferry.adapter_folder import QUANT_RECORD, read_quant_record
    from ferry.errors import ExportError

    adapter = tmp_path / "adapter"
    shutil.copytree(otfq_runs["one"] / "adapter", adapter)
    assert read_quant_record(adapter)["device"] == "cpu"  # this run's own record
    record = dict(read_quant_record(adapter), quantization_bit=8, device="cuda", llm_int8_threshold=6.0)
    (adapter / QUANT_RECORD).write_text(json.dumps(record))
    with pytest.raises(ExportError) as err:
        export(adapter, tmp_path / "out", ExportOptions(base=tiny64, merge_into="dequantized", smoke=False))
    message = str(err.value)
    assert "\n" not in message and not (tmp_path / "out").exists()
    assert "8-bit base on CUDA" in message and "outlier threshold 6" in message
    assert message.endswith("which no dequantized weight reproduces; use --merge-into original")
    older = {k: v for k, v in record.items() if k not in ("device", "llm_int8_threshold")}
    with pytest.raises(ExportError, match="8-bit base on CUDA"):
        check_merge_into("dequantized", dict(older, compute_dtype="bfloat16"), adapter)
    for allowed in (
        dict(record, device="cpu"),
        dict(record, llm_int8_threshold=0.0),
        dict(record, quantization_bit=4),
        dict(older, compute_dtype="float32"),
    ):
        check_merge_into("dequantized", allowed, adapter)
    check_merge_into("original", record, adapter)
