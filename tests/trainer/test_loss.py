"""trainer/loss.py: the chunked causal-LM loss equals the whole-logits loss (value and LoRA gradients) on the real
stories260K model and zoo families, falls back where a family post-processes its logits, and its largest tensor
is one chunk's logits instead of the whole."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.helpers import LargestTensor
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


def test_largest_tensor_of_the_loss_step_is_one_chunk() -> None:
    vocab, hidden_size, rows = 4096, 16, 512
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, rows, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))

    def step(chunked: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
        hidden.grad = None
        with LargestTensor() as mode:
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


class _Ops(TorchDispatchMode):
    """Names of every aten op run inside (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


#: The ops that make the host wait for the device: a data-dependent shape (nonzero) or a value read (.item()).
_SYNCING = ("aten.nonzero", "aten._local_scalar_dense", "aten.item")


def test_the_loss_with_the_batchs_positions_makes_no_host_sync() -> None:
    """With the labelled positions from the collate (computed on the CPU), the chunked loss and its backward run
    no op that makes the host wait for the device (``nonzero``, ``.item()``); its value and gradients are those
    of the loss that finds the positions itself, which does run ``nonzero`` (the control)."""
    from trainer.loss import count_trainable_tokens, loss_positions

    vocab, hidden_size = 512, 16
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(2, 24, hidden_size, requires_grad=True)
    ids, labels = _batch(vocab)
    positions = loss_positions(labels)
    assert positions.dtype == torch.int64 and positions.numel() == count_trainable_tokens(labels)

    results = []
    for given in (positions, None):
        hidden.grad = None
        with _Ops() as ops:
            loss = chunked_loss_sum(head.forward, hidden, labels, chunk_tokens=5, positions=given)
            loss.backward()
        results.append((ops.names, loss.detach(), hidden.grad.clone()))
    (shipped, loss, grad), (found, loss_found, grad_found) = results
    assert not [name for name in shipped if name in _SYNCING], shipped
    assert "aten.nonzero" in found  # the control: without the batch's positions the loss syncs
    torch.testing.assert_close(loss, loss_found, rtol=0, atol=0)
    torch.testing.assert_close(grad, grad_found, rtol=0, atol=0)
    torch.testing.assert_close(loss, causal_lm_loss_sum(head(hidden), labels).detach(), rtol=1e-5, atol=0)


def test_the_collate_ships_the_labelled_positions_of_padded_and_flattened_batches(
    make_cfg, stories_tokenizer, stories_model: Path
) -> None:
    """``collate_with_token_count(with_positions=True)``: ``loss_positions`` of the padded and of the one-row batch
    pick the rows whose next token is labelled; through the model's head the loss equals the whole logits'."""
    from transformers import AutoModelForCausalLM

    from trainer.batching import collate_with_token_count
    from trainer.data import prepare_data
    from trainer.loss import count_trainable_tokens, loss_positions

    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    examples = list(prepare_data(make_cfg(max_samples=6, cutoff_len=64), stories_tokenizer).train)
    pad = stories_tokenizer.pad_token_id
    head = setup_head(model, torch.device("cpu"), contextlib.nullcontext(), False, verbose=False)
    for batch in (
        collate_with_token_count(examples, pad, with_positions=True),
        collate_with_token_count(examples, pad, pair_cost=0.0, with_positions=True),
    ):
        positions = batch.pop("loss_positions")
        labels = batch.pop("labels")
        batch.pop("num_tokens")
        assert torch.equal(positions, loss_positions(labels)) and positions.numel() == count_trainable_tokens(labels)
        with torch.no_grad():
            whole = causal_lm_loss_sum(model(**batch, use_cache=False).logits, labels)
            with head.loss_mode(labels, positions):
                out = model(**batch, use_cache=False)
            torch.testing.assert_close(head.loss(out.logits), whole, rtol=1e-5, atol=0)
    assert "loss_positions" not in collate_with_token_count(examples, pad)  # only where asked for


def test_the_bf16_bound_accepts_bf16_rounding_that_the_fp32_bound_rejects() -> None:
    """The same logits computed in bfloat16 on this CPU (inputs exact in bf16, so only the bf16 rounding of the
    logits differs; a common offset of 40 as an untrained head may carry, where one bf16 unit is 0.25) against the
    fp32 computation: the summed loss moves by more than float32's bound and well within bfloat16's."""
    from trainer.loss import loss_rtol, probe_bound, unit_roundoff

    assert unit_roundoff(torch.bfloat16) == 2**-8 and loss_rtol(torch.bfloat16) == 2**-6
    assert loss_rtol(torch.float16) == 2**-9 and loss_rtol(torch.float32) == 1e-4
    g = torch.Generator().manual_seed(0)
    vocab, hidden_size = 4096, 64
    hidden = torch.randn(1, 8, hidden_size, generator=g).bfloat16().float()
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=g)).bfloat16().float()
    bias = torch.full((vocab,), 40.0)
    labels = torch.randint(0, vocab, (1, 8), generator=g)
    labels[0, :2] = IGNORE_INDEX
    fp32 = float(causal_lm_loss_sum(F.linear(hidden, weight, bias), labels))
    bf16 = float(causal_lm_loss_sum(F.linear(hidden.bfloat16(), weight.bfloat16(), bias.bfloat16()), labels))
    assert probe_bound(fp32, torch.float32) < abs(bf16 - fp32) <= probe_bound(fp32, torch.bfloat16) / 4, (fp32, bf16)


def test_the_probe_of_a_bf16_model_on_cpu_passes_within_its_dtypes_bound(stories_model: Path, monkeypatch) -> None:
    """The start-up probe on stories260K held in bfloat16 (a bf16 computation on this CPU) passes with the bf16
    bound, and a failing probe names both values and the bound of the dtype."""
    from transformers import AutoModelForCausalLM

    from trainer.loss import chunked_loss_ok

    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.bfloat16)
    head = ChunkedHead(model, chunk_tokens=4)
    assert chunked_loss_ok(model, head, torch.device("cpu"), contextlib.nullcontext(), torch.bfloat16) is None
    head.chunk_tokens = 2
    real = chunked_loss_sum

    def one_row_short(head_forward, hidden, labels, chunk_tokens, liger=False, module=None, positions=None):
        labels = labels.clone()
        labels[0, -1] = IGNORE_INDEX  # one position fewer: a wrong row choice, about a sixth of the loss
        return real(head_forward, hidden, labels, chunk_tokens, liger, module, positions)

    monkeypatch.setattr("trainer.loss.chunked_loss_sum", one_row_short)
    why = chunked_loss_ok(model, head, torch.device("cpu"), contextlib.nullcontext(), torch.bfloat16)
    assert why is not None and why.startswith("chunked loss ") and why.endswith("the bound for bfloat16)"), why


def test_a_failing_probe_is_recorded_as_a_fallback(capsys: pytest.CaptureFixture[str]) -> None:
    """setup_head appends every fallback to the caller's list (the run's train_report.json ``fallbacks``), the
    liger one and the chunked-loss one, with the reason it printed."""
    model = _zoo_model("gemma2")
    peft_model = _lora(model, ["q_proj", "v_proj"])
    fallbacks: list[dict[str, str]] = []
    cpu, amp = torch.device("cpu"), contextlib.nullcontext()
    assert setup_head(peft_model, cpu, amp, True, False, fallbacks=fallbacks) is None
    assert [f["feature"] for f in fallbacks] == ["liger_kernel", "chunked_loss"]
    assert fallbacks[0]["reason"].startswith("liger-kernel runs on CUDA only")
    assert fallbacks[1]["reason"].startswith("the model post-processes its logits")
    assert fallbacks[1]["reason"].endswith("; computing the whole logits")
    assert capsys.readouterr().err == ""  # verbose off: recorded, not printed


def test_chunks_are_sized_by_the_devices_memory_and_fewer_chunks_run_fewer_ops(monkeypatch) -> None:
    """Rows per chunk come from a byte budget: 64 MiB of fp32 logits off CUDA, 1/128 of a GPU's memory on CUDA;
    each chunk runs the same train of ops (forward and the recomputing backward), so the ops of a step fall with
    the chunk count while the loss and gradients stay those of the whole logits."""
    from types import SimpleNamespace

    from trainer.loss import chunk_budget_bytes, chunk_tokens_for

    qwen_vocab, gib = 151_936, 1024**3
    assert chunk_budget_bytes(torch.device("cpu")) == 64 * 1024**2
    assert chunk_tokens_for(qwen_vocab) == 128  # 110 rows fit 64 MiB: the floor of 128
    for total, rows in ((141 * 10**9, 1_812), (80 * gib, 1_104), (24 * gib, 331), (4 * gib, 128)):
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda device, t=total: SimpleNamespace(total_memory=t)
        )
        assert chunk_tokens_for(qwen_vocab, chunk_budget_bytes(torch.device("cuda", 0))) == rows, total
    # a step's labelled rows (8 x 2,048 tokens) in chunks: 128 chunks of 128 rows against 10 on an H200
    assert -(-8 * 2048 // 128) == 128 and -(-8 * 2048 // 1_812) == 10

    vocab, hidden_size, rows = 2048, 16, 1025
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, rows, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))
    whole = causal_lm_loss_sum(head(hidden), labels)
    (whole_grad,) = torch.autograd.grad(whole, hidden)
    counted = {}
    for chunk in (128, 1024):  # 8 chunks, 1 chunk
        with _Ops() as ops:
            loss = chunked_loss_sum(head.forward, hidden, labels, chunk_tokens=chunk)
            (grad,) = torch.autograd.grad(loss, hidden)
        counted[chunk] = len(ops.names)
        torch.testing.assert_close(loss, whole, rtol=1e-5, atol=0)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
    per_chunk = (counted[128] - counted[1024]) / 7
    assert per_chunk >= 10 and counted[128] >= 8 * per_chunk, counted
