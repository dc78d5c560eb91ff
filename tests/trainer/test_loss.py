"""The loss without whole logits (trainer.loss): the same loss and gradients as the cross-entropy over the whole
[batch, seq_len, vocab] logits, for the head alone and for real models with LoRA, while what the step keeps for
backward shrinks from the logits to the hidden states; models whose forward changes the head's output (Gemma's
soft-capping) keep the whole-logits path, said in one line."""

from __future__ import annotations

import pytest
import torch

from trainer.loop import causal_lm_loss_sum
from trainer.loss import chunk_rows, head_is_plain, head_loss_sum, head_returns_hidden, output_head


def _labels(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, : seq // 2] = -100  # a masked prompt
    labels[-1, -3:] = -100  # padding
    return labels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 10_000])
def test_chunked_head_loss_equals_whole_logits(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=bias)
    hidden = torch.randn(3, 17, 32, requires_grad=True)
    labels = _labels(3, 17, 300)
    whole = causal_lm_loss_sum(head(hidden), labels)
    whole.backward()
    want = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad, head.weight.grad = None, None
    if bias:
        head.bias.grad = None
    ours = head_loss_sum(hidden, labels, head, rows=rows)
    ours.backward()
    got = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    assert torch.allclose(ours, whole, rtol=1e-6)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


def test_a_micro_batch_without_trained_tokens_gives_zero_and_zero_gradients() -> None:
    head = torch.nn.Linear(8, 20)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    loss = head_loss_sum(hidden, torch.full((2, 5), -100), head)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(hidden.grad.abs().max()) == 0.0


def test_what_backward_keeps_is_hidden_states_not_logits() -> None:
    """The bytes autograd saves for backward between the forward and the backward of the loss (the head's own
    weight aside: it is there anyway): the whole-logits path keeps tensors the size of the logits; the chunked one
    only the trained positions' hidden states and targets."""
    vocab, seq = 20_000, 256
    head = torch.nn.Linear(64, vocab, bias=False)
    head.weight.requires_grad_(False)  # a frozen head, as with LoRA
    hidden = torch.randn(1, seq, 64, requires_grad=True)
    labels = _labels(1, seq, vocab)

    def saved_bytes(fn) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() != head.weight.untyped_storage().data_ptr():
                sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes)

    logits_bytes = seq * vocab * 4
    whole = saved_bytes(lambda: causal_lm_loss_sum(head(hidden), labels))
    chunked = saved_bytes(lambda: head_loss_sum(hidden, labels, head, rows=32))
    assert whole >= logits_bytes  # the logits (and the softmax's output) wait for backward
    assert chunked < logits_bytes / 50  # hidden states, targets: a few hundred KB
    assert chunk_rows(151_936) * 151_936 * 4 <= 256 * 1024 * 1024


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, chunked: bool):
    model.zero_grad(set_to_none=True)
    if chunked:
        head = output_head(model)
        with head_returns_hidden(head):
            hidden = model(input_ids=ids, use_cache=False).logits
        loss = head_loss_sum(hidden, labels, head, rows=7)
    else:
        loss = causal_lm_loss_sum(model(input_ids=ids, use_cache=False).logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_real_model_loss_and_lora_gradients_equal_the_whole_logits_path(stories_model) -> None:
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(str(stories_model), dtype=torch.float32))
    assert head_is_plain(model, torch.device("cpu")) == (True, "")
    ids = torch.randint(1, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :6] = -100
    whole, whole_grads = _loss_and_grads(model, ids, labels, chunked=False)
    ours, our_grads = _loss_and_grads(model, ids, labels, chunked=True)
    assert torch.allclose(ours, whole, rtol=1e-6) and whole_grads.keys() == our_grads.keys() and whole_grads
    for name, want in whole_grads.items():
        assert (our_grads[name] - want).abs().max() <= 1e-5 * want.abs().max(), name


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text", "phi3"])
def test_zoo_families_use_the_chunked_loss_only_where_it_is_exact(family: str) -> None:
    """Tied heads (qwen3) and untied ones give the same loss chunked; Gemma-2's final logit soft-capping is
    found by the check and keeps the whole logits."""
    from transformers import AutoModelForCausalLM

    from tests.models.zoo import FAMILIES

    config = FAMILIES[family][0]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain, why = head_is_plain(model, torch.device("cpu"))
    capped = getattr(config, "final_logit_softcapping", None)
    assert plain == (not capped), (family, why)
    if not plain:
        assert "soft-capping" in why
        return
    ids = torch.randint(1, 500, (2, 12), generator=torch.Generator().manual_seed(4))
    whole, whole_grads = _loss_and_grads(model, ids, ids, chunked=False)
    ours, our_grads = _loss_and_grads(model, ids, ids, chunked=True)
    assert torch.allclose(ours, whole, rtol=1e-6)
    for name, want in whole_grads.items():
        assert (our_grads[name] - want).abs().max() <= 1e-5 * want.abs().max() + 1e-9, name
