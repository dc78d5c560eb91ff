"""Padding-free rows through trainer.varlen: the per-sample reference equals padded rows (loss and every gradient),
the kernel's call is what torch's varlen_attn takes, the recipe picks it where it can run and says why not
elsewhere, and a step through it makes no host sync (tests/trainer/test_step_overhead.py counts)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ferry.errors import ConfigError, TrainingError
from trainer import varlen
from trainer.batching import collate_with_token_count
from trainer.data import prepare_data
from trainer.loss import IGNORE_INDEX, count_trainable_tokens


def _loss_sum(model, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens")}
    logits = model(**inputs, use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _fake_kernel(calls: list[dict], gqa_native: bool = True):
    """torch's varlen_attn as the CPU cannot run it: checks what it is given and computes the per-sample
    reference with transformers' own sdpa function (not ferry's code) on each sample. ``gqa_native`` False: a
    torch whose kernel has no ``enable_gqa`` (K/V must come with as many heads as Q)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, **gqa):
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and isinstance(max_q, int) and max_q == max_k
        assert window_size == (-1, 0)
        assert list(gqa) == (["enable_gqa"] if gqa_native else []) and (gqa_native or q.size(1) == k.size(1))
        calls.append({"cu": cu_q.clone(), "max": max_q, "gqa": gqa.get("enable_gqa", q.size(1) != k.size(1))})
        bounds = cu_q.tolist()
        module = SimpleNamespace(num_key_value_groups=q.size(1) // k.size(1), is_causal=True)
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            out, _ = sdpa_attention_forward(
                module, *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), None, scaling=scale
            )
            parts.append(out[0])
        return torch.cat(parts)

    return kernel


@pytest.fixture(scope="module")
def batches(stories_model: Path, llamafactory_data: Path, stories_tokenizer, tmp_path_factory):
    """Eight alpaca samples as padded rows and as one row with its boundaries."""
    from trainer.config import TrainConfig

    work = tmp_path_factory.mktemp("varlen")
    cfg = TrainConfig(
        model_name_or_path=str(stories_model),
        dataset="alpaca_en_demo",
        dataset_dir=str(llamafactory_data),
        output_dir=str(work / "out"),
        tokenized_path=str(work / "tokenized"),
        cutoff_len=128,
        max_samples=8,
    )
    examples = list(prepare_data(cfg, stories_tokenizer).train)
    pad = stories_tokenizer.pad_token_id
    padded = collate_with_token_count(examples, pad, causal=True)
    flat = collate_with_token_count(examples, pad, flatten=True, cu_seq_lens=True)
    return padded, flat, [len(e["input_ids"]) for e in examples]


@pytest.mark.parametrize("kernel", ["reference", "kernel call", "kernel call without enable_gqa"])
def test_one_row_through_varlen_trains_as_padded_rows(batches, stories_model: Path, monkeypatch, kernel) -> None:
    from transformers import AutoModelForCausalLM

    padded, flat, lengths = batches
    assert "attention_mask" not in padded and "position_ids" not in padded  # sdpa's is_causal on padded rows
    assert flat["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert flat["max_length_q"] == max(lengths) and flat["cu_seq_lens_q"].dtype == torch.int32
    calls: list[dict] = []
    if kernel != "reference":
        native = kernel == "kernel call"
        keywords = {"window_size": (-1, 0), "enable_gqa" if native else "repeat_kv": True}
        monkeypatch.setattr(varlen, "_device_kernel", lambda query: (_fake_kernel(calls, native), keywords))
    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    results = []
    for batch, attention in ((padded, "sdpa"), (flat, None)):
        if attention is None:
            assert varlen.use_varlen(model) and model.config._attn_implementation == varlen.ATTENTION_NAME
        model.zero_grad()
        loss = _loss_sum(model, {k: v for k, v in batch.items() if k not in ("token_counts", "loss_positions")})
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    n = count_trainable_tokens(padded["labels"])
    assert abs(results[0][0] - results[1][0]) / n < 1e-6
    # fp32 sums in another order (sdpa's causal kernel over a padded row against one per sample): measured
    # 2e-7 relative to each gradient's norm
    worst = max(float((results[0][1][k] - g).norm() / results[0][1][k].norm()) for k, g in results[1][1].items())
    assert worst < 1e-5, worst
    if kernel == "kernel call":  # every layer's forward, each with the collate's boundaries, GQA (8 heads, 4 kv)
        assert len(calls) == model.config.num_hidden_layers
        assert all(torch.equal(c["cu"], flat["cu_seq_lens_q"]) and c["gqa"] and c["max"] == max(lengths) for c in calls)
    elif kernel != "reference":  # K/V heads repeated to the query heads' count before the call
        assert len(calls) == model.config.num_hidden_layers and not any(c["gqa"] for c in calls)


def test_boundaries_come_from_position_ids_when_the_batch_has_none() -> None:
    # a packed example (restarts inside it), then one whose ids run on, then a second row
    ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    cu, longest = varlen.cu_seq_lens_of(ids)
    assert cu.tolist() == [0, 3, 5, 9, 15, 18] and cu.dtype == torch.int32 and longest == 6
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    module = SimpleNamespace(num_key_value_groups=2)
    got, weights = varlen.varlen_attention_forward(module, q, k, v, None, position_ids=ids[:1])
    assert weights is None and got.shape == (1, 9, 4, 8)
    # each sample alone through plain sdpa (K/V heads repeated for the grouped queries)
    for a, b in ((0, 3), (3, 5), (5, 9)):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b].repeat_interleave(2, 1), v[:, :, a:b].repeat_interleave(2, 1), is_causal=True
        )
        torch.testing.assert_close(got[:, a:b], want.transpose(1, 2))


def test_it_refuses_a_mask_a_cache_and_dropout() -> None:
    module = SimpleNamespace(num_key_value_groups=1)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TrainingError, match="whole packed training rows only"):
        varlen.varlen_attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4))
    with pytest.raises(TrainingError, match="no KV cache"):
        varlen.varlen_attention_forward(module, q[:, :, :1], q, q, None)  # one new token against four cached
    with pytest.raises(TrainingError, match="no dropout"):
        varlen.varlen_attention_forward(module, q, q, q, None, dropout=0.1)
    for keyword in ({"sliding_window": 4096}, {"softcap": 50.0}):
        with pytest.raises(TrainingError, match="neither a sliding window nor soft-capping"):
            varlen.varlen_attention_forward(module, q, q, q, None, **keyword)
    varlen.varlen_attention_forward(module, q, q, q, None, sliding_window=None, softcap=None)  # full layers pass None


def test_what_the_kernel_cannot_serve_is_named(monkeypatch) -> None:
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    llama = LlamaConfig(num_hidden_layers=2)
    from torch.nn.attention.varlen import varlen_attn

    assert varlen._kernel() == (varlen_attn, {"window_size": (-1, 0), "enable_gqa": True})  # torch 2.13's keywords
    assert varlen.varlen_unavailable(cuda, torch.bfloat16, llama) is None  # torch 2.13 has the kernel
    assert "CUDA only" in varlen.varlen_unavailable(cpu, torch.bfloat16, llama)
    assert "this run in float32" in varlen.varlen_unavailable(cuda, torch.float32, llama)
    sliding = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert "sliding_attention layers" in varlen.unsupported_attention(sliding)
    assert varlen.unsupported_attention(Qwen2Config(num_hidden_layers=2, sliding_window=4096)) is None  # not used
    from transformers import MistralConfig, Phi3Config

    assert "sliding window of 4096 tokens" in varlen.unsupported_attention(MistralConfig(sliding_window=4096))
    assert varlen.unsupported_attention(MistralConfig(sliding_window=None)) is None
    assert "phi3 uses a sliding window of 2047" in varlen.unsupported_attention(Phi3Config(sliding_window=2047))
    assert "soft-caps" in varlen.unsupported_attention(
        Gemma2Config(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    )
    assert "attention_dropout 0.1" in varlen.unsupported_attention(LlamaConfig(attention_dropout=0.1))
    monkeypatch.setattr(varlen, "_kernel", lambda: None)
    assert f"torch {torch.__version__} has no torch.nn.attention.varlen" in varlen.varlen_unavailable(
        cuda, torch.bfloat16, llama
    )


def _chooser(stories_model: Path, device: str, dtype: torch.dtype, **cfg):
    """The recipe's attention choice on a real model, with the device and config given."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.recipe import FinetuneRecipe

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32),
        LoraConfig(r=2, target_modules=["q_proj"]),
    )
    fake = SimpleNamespace(
        cfg=SimpleNamespace(**{"flash_attn": "auto", "padding_free": "auto", "attn_implementation": None, **cfg}),
        env=SimpleNamespace(device=torch.device(device)),
        dtype=dtype,
        peft_model=model,
        cross_sample_attention=False,
        fallbacks=[],
    )
    fake._fall_back = lambda feature, reason: fake.fallbacks.append((feature, reason))
    fake._one_row_kernel = lambda: FinetuneRecipe._one_row_kernel(fake)
    FinetuneRecipe._choose_varlen(fake)
    return fake, FinetuneRecipe._one_row_kernel(fake), FinetuneRecipe._one_row_pays(fake)


def test_the_recipe_takes_varlen_where_it_runs_and_says_why_not(stories_model: Path, monkeypatch) -> None:
    fake, one_row, pays = _chooser(stories_model, "cuda", torch.bfloat16)  # padding_free auto on a bf16 GPU
    assert fake.varlen and one_row and pays and fake.fallbacks == []
    assert fake.peft_model.get_base_model().config._attn_implementation == "ferry_varlen"
    fake, one_row, pays = _chooser(stories_model, "cuda", torch.float32)
    assert not fake.varlen and not pays
    assert fake.fallbacks == [
        ("padding_free", "the flash kernel computes in bf16 or fp16, this run in float32; padded rows instead")
    ]
    fake, *_ = _chooser(stories_model, "cuda", torch.bfloat16, padding_free=False)
    assert not fake.varlen and fake.fallbacks == []
    fake, *_ = _chooser(stories_model, "cuda", torch.bfloat16, flash_attn="sdpa")
    assert not fake.varlen and fake.peft_model.get_base_model().config._attn_implementation == "sdpa"
    fake, one_row, pays = _chooser(stories_model, "cpu", torch.float32, flash_attn="varlen")  # asked for: the reference
    assert fake.varlen and one_row and pays
    fake, *_ = _chooser(stories_model, "cpu", torch.float32)  # CPU, auto: sdpa's one row as before
    assert not fake.varlen and fake.fallbacks == []
    monkeypatch.setattr(varlen, "_kernel", lambda: None)
    fake, *_ = _chooser(stories_model, "cuda", torch.bfloat16)
    assert (
        not fake.varlen
        and "has no torch.nn.attention.varlen (2.10 or later); padded rows instead" in fake.fallbacks[0][1]
    )
    with pytest.raises(ConfigError, match=r"^flash_attn: varlen: torch .* has no torch.nn.attention.varlen"):
        _chooser(stories_model, "cuda", torch.bfloat16, flash_attn="varlen")


class _LeakyPeft(torch.nn.Module):
    """A peft-like wrapper whose forward drops the position ids (as a model with its own position code): its
    samples leak into each other in one row, whatever the attention function."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_base_model(self) -> torch.nn.Module:
        return self.inner

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)


def test_a_failed_one_row_probe_takes_the_varlen_function_back(stories_model: Path) -> None:
    """``padding_free: auto`` with the varlen function on a model whose samples leak in one row: the probe fails, the
    run says so in one line and pads its rows, through sdpa again (the varlen function would lay them out as one
    row); the collate then pads."""
    from transformers import AutoModelForCausalLM

    from trainer.recipe import FinetuneRecipe

    inner = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    cfg = SimpleNamespace(
        flash_attn="varlen",
        padding_free="auto",
        attn_implementation="sdpa",
        packing=False,
        neat_packing=False,
        stage="sft",
        model_name_or_path="leaky",
    )
    fake = SimpleNamespace(
        cfg=cfg,
        env=SimpleNamespace(device=torch.device("cpu"), all_reduce_sum=lambda t: t, is_main=False),
        dtype=torch.float32,
        peft_model=_LeakyPeft(inner),
        fsdp=False,
        fallbacks=[],
        has_media=False,  # no image or video rows
    )
    fake._fall_back = lambda feature, reason: fake.fallbacks.append((feature, reason))
    for name in ("_one_row_kernel", "_one_row_pays", "_choose_varlen"):
        setattr(fake, name, getattr(FinetuneRecipe, name).__get__(fake))
    FinetuneRecipe._probe_one_row(fake)
    assert not fake.one_row_ok and not fake.varlen and inner.config._attn_implementation == "sdpa"
    assert [f for f, _ in fake.fallbacks] == ["padding_free"] and fake.fallbacks[0][1].endswith("padded rows instead")
    assert not fake._one_row_kernel()
