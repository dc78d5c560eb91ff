"""Packing: bins, content preservation, and the packed loss equal to the unpacked loss on the real
stories260K model (transformers 5 masks across sample boundaries from the position ids)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from trainer.batching import collate
from trainer.data import pack_examples, pack_lengths, prepare_data
from trainer.loss import IGNORE_INDEX, count_trainable_tokens


def test_pack_lengths_places_every_sample_once_within_capacity() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 256) for _ in range(2000)]
    bins = pack_lengths(lengths, 256)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    lower_bound = math.ceil(sum(lengths) / 256)
    assert len(bins) <= lower_bound * 1.02 + 1  # best-fit decreasing is near-optimal on uniform lengths
    assert pack_lengths(lengths, 256) == bins  # deterministic


@pytest.mark.parametrize("key", ["packing", "neat_packing"])
def test_packed_dataset_holds_the_same_samples(make_cfg, stories_tokenizer, key: str) -> None:
    # LLaMA-Factory: with packing, samples are cut to cutoff_len - 1 (tests/trainer/test_data_golden_lf.py)
    plain = prepare_data(make_cfg(max_samples=60, cutoff_len=255), stories_tokenizer)
    packed = prepare_data(make_cfg(max_samples=60, cutoff_len=256, **{key: True}), stories_tokenizer)
    assert packed.stats["num_train_samples"] == plain.stats["num_train_samples"] == 60
    assert packed.stats["num_train_sequences"] == len(packed.train) < 60
    assert packed.stats["num_trainable_tokens"] == plain.stats["num_trainable_tokens"]
    assert all(len(e["input_ids"]) <= 255 for e in packed.train)
    pieces = []
    for example in packed.train:
        starts = [i for i, p in enumerate(example["position_ids"]) if p == 0] + [len(example["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert example["position_ids"][a:b] == list(range(b - a))
            assert example["labels"][a] == IGNORE_INDEX  # a prompt token: never predicted from the previous sample
            pieces.append((tuple(example["input_ids"][a:b]), tuple(example["labels"][a:b])))
    originals = [(tuple(e["input_ids"]), tuple(e["labels"])) for e in plain.train]
    assert sorted(pieces) == sorted(originals)


def _loss_sum(model, batch: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    """Summed next-token cross-entropy over positions with labels != -100 (what the loop computes)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, **kwargs).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(
    make_cfg, stories_tokenizer, stories_model: Path, attn_implementation: str
) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        stories_model, attn_implementation=attn_implementation, dtype=torch.float32
    )
    data = prepare_data(make_cfg(max_samples=16, cutoff_len=128, template="default"), stories_tokenizer)
    examples = list(data.train)
    packed = pack_examples(examples, 256)
    assert len(packed) < len(examples) and any(e["position_ids"].count(0) > 1 for e in packed)
    pad = stories_tokenizer.pad_token_id

    unpacked_batch = collate(examples, pad)
    packed_batch = collate(packed, pad)
    flat_batch = collate(packed, pad, flatten=True)
    assert "attention_mask" in unpacked_batch and "attention_mask" not in packed_batch
    n = count_trainable_tokens(unpacked_batch["labels"])
    assert n == count_trainable_tokens(packed_batch["labels"]) == count_trainable_tokens(flat_batch["labels"])

    model.zero_grad()
    unpacked = _loss_sum(model, unpacked_batch, use_cache=False)
    unpacked.backward()
    grad_unpacked = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    packed_loss = _loss_sum(model, packed_batch, use_cache=False)
    packed_loss.backward()
    grad_packed = model.model.embed_tokens.weight.grad.clone()
    with torch.no_grad():
        flat = _loss_sum(model, flat_batch, use_cache=False)

        # Controls that show the test can fail: one causal mask over the whole row (positions not restarted),
        # and transformers' default KV cache, which turns the packed-sequence detection off.
        no_restart = dict(packed_batch)
        no_restart["position_ids"] = (
            torch.arange(packed_batch["input_ids"].shape[1]).expand_as(packed_batch["input_ids"]).clone()
        )
        leaky = _loss_sum(model, no_restart, use_cache=False)
        with_cache = _loss_sum(model, packed_batch, use_cache=True)

    assert abs(unpacked.item() - packed_loss.item()) / n < 1e-5
    assert abs(unpacked.item() - flat.item()) / n < 1e-5
    # float32 sums in another order: the tolerance scales with the largest gradient (summed, not mean, loss)
    scale = float(grad_unpacked.abs().max())
    assert torch.allclose(grad_packed, grad_unpacked, rtol=1e-4, atol=1e-6 * max(scale, 1.0))
    assert abs(unpacked.item() - leaky.item()) / n > 1e-3
    assert abs(unpacked.item() - with_cache.item()) / n > 1e-3


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_causal_padded_rows_drop_the_mask_and_train_as_the_masked_batch(
    make_cfg, stories_tokenizer, stories_model: Path, attn_implementation: str, monkeypatch
) -> None:
    # Right-padded rows of one sample each: no attention mask and no position ids (the model's own arange), so
    # sdpa runs is_causal with native GQA (stories260K: 8 query heads over 4 KV heads); the loss and every
    # gradient are those of the masked batch (fp32: the loss bit for bit; the gradients too with eager, within
    # rounding with sdpa).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        stories_model, attn_implementation=attn_implementation, dtype=torch.float32
    )
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    examples = list(prepare_data(make_cfg(max_samples=8, cutoff_len=128), stories_tokenizer).train)
    assert len({len(e["input_ids"]) for e in examples}) > 1  # the rows are padded
    pad = stories_tokenizer.pad_token_id
    masked, causal = collate(examples, pad), collate(examples, pad, causal=True)
    assert set(masked) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert set(causal) == {"input_ids", "labels"}
    assert torch.equal(masked["input_ids"], causal["input_ids"]) and torch.equal(masked["labels"], causal["labels"])

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask is None, kwargs.get("is_causal"), kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    losses, grads = [], []
    for batch in (masked, causal):
        model.zero_grad()
        calls.clear()
        loss = _loss_sum(model, batch, use_cache=False)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if attn_implementation == "sdpa":
            layers = model.config.num_hidden_layers
            no_mask = (True, True, True)
            assert calls == ([(False, False, False)] * layers if batch is masked else [no_mask] * layers), calls
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys()
    if attn_implementation == "eager":  # the same kernels, the causal mask built by transformers instead
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    else:  # sdpa's is_causal kernel sums in another order: measured 8.8e-7 relative at most
        worst = max(float((grads[0][n] - grads[1][n]).norm() / grads[0][n].norm()) for n in grads[0])
        assert worst < 1e-5, worst


def test_causal_collation_keeps_what_packed_rows_and_cross_sample_attention_need(make_cfg, stories_tokenizer) -> None:
    examples = list(prepare_data(make_cfg(max_samples=8, cutoff_len=128), stories_tokenizer).train)
    pad = stories_tokenizer.pad_token_id
    packed = pack_examples(examples, 256)
    assert any(e["position_ids"].count(0) > 1 for e in packed)
    # packed rows: the position ids mark the samples (transformers' block-diagonal mask), no attention mask
    assert set(collate(packed, pad, causal=True)) == {"input_ids", "labels", "position_ids"}
    # LLaMA-Factory's plain packing: samples attend to the earlier ones, through the padding mask
    together = collate(packed, pad, cross_sample_attention=True, causal=True)
    assert set(together) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert set(collate(packed, pad, flatten=True, causal=True)) == {"input_ids", "labels", "position_ids"}


# ---------------------------------------------------------------------- padding-free batches


def test_attention_pair_cost_counts_projections_mlp_and_attention(stories_model: Path) -> None:
    from transformers import AutoConfig, LlamaConfig

    from trainer.batching import attention_pair_cost

    # The benchmark's Llama: q/k/v/o 512*(512+2*256) + 512*512, gated MLP 3*512*1536; a pair costs 2*512.
    bench = LlamaConfig(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4)
    assert attention_pair_cost(bench) == 1024 / 3_145_728
    # stories260K: hidden 64, 8 heads of 8, 4 KV heads, intermediate 172.
    stories = AutoConfig.from_pretrained(stories_model)
    assert attention_pair_cost(stories) == 128 / (64 * (64 + 64) + 64 * 64 + 3 * 64 * 172)


def test_flattening_is_chosen_only_when_it_saves_compute() -> None:
    from trainer.batching import flattening_saves

    assert not flattening_saves([256, 256, 256, 256], 0.0)  # no padding: nothing to save
    assert flattening_saves([256, 40, 40, 40], 3.3e-4)  # 1024 padded tokens for 376 real ones
    assert not flattening_saves([256, 250, 240, 230], 3.3e-4)  # little padding, 4x longer attention rows
    assert flattening_saves([256, 250, 240, 230], 0.0)  # padding_free: true
    assert not flattening_saves([2048, 1500, 1500, 1500], 2.8e-3)  # a tiny model: attention dominates


@pytest.mark.parametrize(
    ("device", "attn", "one_row"),
    [
        ("cpu", None, True),
        ("cpu", "sdpa", True),
        ("cuda", None, False),  # sdpa's masked one row is slower than padded rows on a GPU (measured, H200)
        ("cuda", "sdpa", False),
        ("cuda", "eager", False),
        ("cuda", "flash_attention_2", True),
        ("cuda", "flash_attention_3", True),
    ],
)
def test_padding_free_auto_lays_one_row_on_cpu_and_with_one_row_kernels_only(device, attn, one_row) -> None:
    from types import SimpleNamespace

    from trainer.recipe import FinetuneRecipe

    fake = SimpleNamespace(
        cfg=SimpleNamespace(attn_implementation=attn), env=SimpleNamespace(device=torch.device(device)), varlen=False
    )
    fake._one_row_kernel = lambda: FinetuneRecipe._one_row_kernel(fake)
    assert FinetuneRecipe._one_row_pays(fake) is one_row
    fake.varlen = True  # torch's varlen kernel (trainer.varlen) takes one row under any attn_implementation
    assert FinetuneRecipe._one_row_pays(fake) is True


def test_padding_free_batch_gives_the_padded_loss_and_gradients(
    make_cfg, stories_tokenizer, stories_model: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.batching import collate_with_token_count

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    examples = list(prepare_data(make_cfg(max_samples=8, cutoff_len=128), stories_tokenizer).train)
    pad = stories_tokenizer.pad_token_id
    padded = collate_with_token_count(examples, pad)
    flat = collate_with_token_count(examples, pad, pair_cost=0.0)
    assert padded["input_ids"].shape[0] == 8 and flat["input_ids"].shape[0] == 1
    real_tokens = int(padded["num_tokens"])
    assert flat["input_ids"].shape[1] == real_tokens == int(flat["num_tokens"]) < padded["input_ids"].numel()
    n = count_trainable_tokens(padded["labels"])
    assert n == count_trainable_tokens(flat["labels"])

    losses, grads = [], []
    for batch in (padded, flat):
        model.zero_grad()
        loss = _loss_sum(model, {k: v for k, v in batch.items() if k != "num_tokens"}, use_cache=False)
        loss.backward()
        losses.append(loss.item())
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert abs(losses[0] - losses[1]) / n < 1e-5
    # fp32 sums taken in another order: measured 1.1e-6 relative to the gradient norm.
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()).item() < 1e-5


class _PositionsFromZeroToEnd(torch.nn.Module):
    """A causal LM whose positions always run 0..n-1 along the row (as in a model with its own position and
    mask code): the second sample of a row then attends to the first."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_one_row_probe_passes_transformers_llama_and_catches_a_leaking_model(
    stories_model: Path, attn_implementation: str
) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.modeling import samples_stay_apart_in_one_row

    model = AutoModelForCausalLM.from_pretrained(
        stories_model, attn_implementation=attn_implementation, dtype=torch.float32
    )
    model.train()
    rng_before = torch.get_rng_state()
    assert samples_stay_apart_in_one_row(model, torch.device("cpu"), torch.float32)
    assert model.training and torch.equal(torch.get_rng_state(), rng_before)  # mode and RNG stream untouched
    assert not samples_stay_apart_in_one_row(_PositionsFromZeroToEnd(model), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_one_row_probe_in_bf16_holds_its_dtypes_bound_and_still_catches_a_leak(
    stories_model: Path, attn_implementation: str
) -> None:
    """The probe on stories260K held in bfloat16 (bf16 kernels on this CPU): it passes within
    ``1e-3 + 2**-4 * max |logit| + 2 * noise`` (bf16's 8 significand bits: 16 units of 2**-8), the noise measured on
    the row's first sample, which no mask can leak into; the model that ignores the position restarts moves its
    second sample's logits far beyond that bound."""
    from transformers import AutoModelForCausalLM

    from trainer.modeling import one_row_rtol, samples_stay_apart_in_one_row

    assert one_row_rtol(torch.bfloat16) == 2**-4 and one_row_rtol(torch.float32) == one_row_rtol(torch.float16) == 1e-2
    model = AutoModelForCausalLM.from_pretrained(
        stories_model, attn_implementation=attn_implementation, dtype=torch.bfloat16
    )
    probe = samples_stay_apart_in_one_row(model, torch.device("cpu"), torch.bfloat16)
    assert probe and probe.diff <= probe.bound and probe.dtype == "bfloat16", probe
    leak = samples_stay_apart_in_one_row(_PositionsFromZeroToEnd(model), torch.device("cpu"), torch.bfloat16)
    assert not leak and leak.diff > 2 * leak.bound, leak
    assert leak.reason().startswith("the one-row probe moved a sample's logits by ") and "in bfloat16" in leak.reason()
