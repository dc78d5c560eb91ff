"""Packing: bins, content preservation, and the packed loss equal to the unpacked loss on the real
stories260K model (transformers 5 masks across sample boundaries from the position ids)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from trainer.data import IGNORE_INDEX, collate, count_trainable_tokens, pack_examples, pack_lengths, prepare_data


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


def test_packed_dataset_holds_the_same_samples(make_cfg, stories_tokenizer) -> None:
    plain = prepare_data(make_cfg(max_samples=60, cutoff_len=256), stories_tokenizer)
    packed = prepare_data(make_cfg(max_samples=60, cutoff_len=256, packing=True), stories_tokenizer)
    assert packed.stats["num_train_samples"] == plain.stats["num_train_samples"] == 60
    assert packed.stats["num_train_sequences"] == len(packed.train) < 60
    assert packed.stats["num_trainable_tokens"] == plain.stats["num_trainable_tokens"]
    assert all(len(e["input_ids"]) <= 256 for e in packed.train)
    pieces = []
    for example in packed.train:
        starts = [i for i, p in enumerate(example["position_ids"]) if p == 0] + [len(example["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert example["position_ids"][a:b] == list(range(b - a))
            assert example["labels"][a] == IGNORE_INDEX  # never predicted from the previous sample
            pieces.append((tuple(example["input_ids"][a:b]), tuple(example["labels"][a + 1:b])))
    originals = [(tuple(e["input_ids"]), tuple(e["labels"][1:])) for e in plain.train]
    assert sorted(pieces) == sorted(originals)


def _loss_sum(model, batch: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    """Summed next-token cross-entropy over positions with labels != -100 (what the loop computes)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, **kwargs).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(make_cfg, stories_tokenizer, stories_model: Path,
                                          attn_implementation: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(stories_model, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    data = prepare_data(make_cfg(max_samples=16, cutoff_len=128), stories_tokenizer)
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
        no_restart["position_ids"] = torch.arange(packed_batch["input_ids"].shape[1]).expand_as(
            packed_batch["input_ids"]).clone()
        leaky = _loss_sum(model, no_restart, use_cache=False)
        with_cache = _loss_sum(model, packed_batch, use_cache=True)

    assert abs(unpacked.item() - packed_loss.item()) / n < 1e-5
    assert abs(unpacked.item() - flat.item()) / n < 1e-5
    assert torch.allclose(grad_packed, grad_unpacked, rtol=1e-4, atol=1e-6)
    assert abs(unpacked.item() - leaky.item()) / n > 1e-3
    assert abs(unpacked.item() - with_cache.item()) / n > 1e-3
