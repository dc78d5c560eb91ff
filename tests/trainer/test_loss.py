"""trainer/loss.py: the chunked causal-LM loss equals the whole-logits loss (value and LoRA gradients) on the real
stories260K model and zoo families, falls back where a family post-processes its logits, and its largest tensor
is one chunk's logits instead of the whole."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.loss import IGNORE_INDEX, ChunkedHead, causal_lm_loss_sum, chunked_loss_sum, setup_head


def _lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    for name, p in peft_model.named_parameters():  # lora_B starts at zero: make every factor carry a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return peft_model


def _zoo_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tests.support.zoo import FAMILIES

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[name][0]())


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :7] = IGNORE_INDEX  # a prompt
    labels[1, 20:] = IGNORE_INDEX  # padding
    return ids, labels


def _loss_and_grads(model, ids, labels, head: ChunkedHead | None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks (GPT-2 trains with dropout) on both paths
    if head is None:
        loss = causal_lm_loss_sum(model(input_ids=ids, use_cache=False).logits, labels)
    else:
        with head.loss_mode(labels):
            out = model(input_ids=ids, use_cache=False)
        loss = head.loss(out.logits)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


CASES = {
    # name: (builder, LoRA targets); lm_head in the targets: LoRA on the head itself
    "stories260K": (None, ["q_proj", "v_proj", "down_proj", "lm_head"]),
    "qwen3": ("qwen3", ["q_proj", "v_proj", "down_proj"]),  # tied embeddings
    "gpt2": ("gpt2", ["c_attn", "c_fc"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_loss_and_lora_grads_equal_whole(case: str, stories_model: Path) -> None:
    zoo_name, targets = CASES[case]
    if zoo_name is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    else:
        model = _zoo_model(zoo_name)
    peft_model = _lora(model, targets)
    vocab = peft_model.get_output_embeddings().weight.shape[0]
    ids, labels = _batch(vocab)
    head = setup_head(peft_model, torch.device("cpu"), contextlib.nullcontext(), False, verbose=False)
    assert head is not None
    head.chunk_tokens = 5  # several chunks, the last one short
    whole, whole_grads = _loss_and_grads(peft_model, ids, labels, None)
    chunked, chunked_grads = _loss_and_grads(peft_model, ids, labels, head)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    assert whole_grads.keys() == chunked_grads.keys() and whole_grads
    if "lm_head" in targets:
        assert any("lm_head" in n for n in whole_grads)
    for name, g in whole_grads.items():
        assert g.abs().sum() > 0, name
        err = (chunked_grads[name] - g).norm() / g.norm()
        assert err <= 1e-5, (name, float(err))
    # outside loss_mode the head is the plain head again: the model's logits are the unchunked ones
    with torch.no_grad():
        assert peft_model(input_ids=ids).logits.shape == (2, 24, vocab)


def test_softcapping_family_falls_back_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    model = _zoo_model("gemma2")  # final_logit_softcapping: tanh after the head
    assert model.config.final_logit_softcapping
    peft_model = _lora(model, ["q_proj", "v_proj"])
    assert setup_head(peft_model, torch.device("cpu"), contextlib.nullcontext(), True, verbose=True) is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # the liger line (no CUDA here) and the fall-back line
    assert lines[0].startswith("ferry: enable_liger_kernel: liger-kernel runs on CUDA only")
    assert lines[1].startswith("ferry: loss: the model post-processes its logits") and "whole logits" in lines[1]


class _LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor any op creates (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_largest_tensor_of_the_loss_step_is_one_chunk() -> None:
    vocab, hidden_size, rows = 4096, 16, 512
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, rows, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))

    def step(chunked: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
        hidden.grad = None
        with _LargestTensor() as mode:
            if chunked:
                loss = chunked_loss_sum(head.forward, hidden, labels, chunk_tokens=64)
            else:
                loss = causal_lm_loss_sum(head(hidden), labels)
            loss.backward()
        return mode.largest, loss.detach(), hidden.grad.clone()

    whole_peak, whole_loss, whole_grad = step(False)
    chunk_peak, chunk_loss, chunk_grad = step(True)
    torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-5, atol=1e-7)
    assert whole_peak >= rows * vocab * 4  # the whole fp32 logits
    assert chunk_peak <= 64 * vocab * 4  # one chunk's
    assert chunk_peak * 4 <= whole_peak


class _ChunkBuffers(TorchDispatchMode):
    """Distinct storages of ``nbytes`` bytes that any op creates or writes (an upper bound on how many such
    buffers are alive at once: a storage freed and its address reused counts once)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.seen = nbytes, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == self.nbytes:
                self.seen.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_holds_one_logits_buffer_and_the_same_gradients(dtype: torch.dtype) -> None:
    """One chunk through a frozen head: the loss and input gradient of F.cross_entropy (fp32 and bf16 logits), and
    at most two fp32 logits buffers over forward and backward (the forward's and the one recomputed in backward,
    where the gradient is formed in place); autograd's cross-entropy adds log_softmax's output and two gradient
    buffers of the same size."""
    vocab, hidden_size, rows = 1000, 16, 64
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype).requires_grad_(False)
    hidden = torch.randn(1, rows, hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))  # the last position has no target: rows - 1 logits rows

    with _ChunkBuffers((rows - 1) * vocab * 4) as mode:
        chunked = chunked_loss_sum(head.forward, hidden, labels, chunk_tokens=rows)
        chunked.backward()
    chunk_grad, hidden.grad = hidden.grad.clone(), None
    whole = causal_lm_loss_sum(head(hidden), labels)
    whole.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(chunked, whole, **tol)
    torch.testing.assert_close(chunk_grad, hidden.grad, **tol)
    assert 1 <= len(mode.seen) <= 2
