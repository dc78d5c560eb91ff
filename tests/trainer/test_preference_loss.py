"""trainer/preference_loss.py against trl 1.16's own code: the DPO losses trl implements (sigmoid, hinge, ipo), SimPO
and ORPO's odds ratio (trl.experimental's CPO and ORPO trainers), KTO and the reward model's pairwise loss, values,
rewards, metrics and gradients within fp32 rounding; the chunked log-probabilities against trl's fused LM head on
a tiny random Llama and against the whole logits. What trl no longer ships (kto_pair, label-smoothed sigmoid) or
defines otherwise than LLaMA-Factory 0.9.5 is checked against the paper's formula written out here.

trl is imported inside the fixtures (about 14 s on this machine), so collecting the test suite does not pay it.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ferry.errors import ConfigError, TrainingError
from tests.support.helpers import LargestTensor
from trainer.loss import IGNORE_INDEX
from trainer.preference_loss import (
    PreferenceLossConfig,
    kto_kl,
    kto_loss,
    last_token_scores,
    length_desensitized_weights,
    pairwise_preference_loss,
    reward_pairwise_loss,
    sequence_logps,
)

RTOL = 1e-6  # fp32: the same formula in another order of operations
ATOL = 1e-7  # for entries that are (close to) zero, where a relative bound means nothing

PAIRS, SEQ = 3, 8


def close(got: torch.Tensor | float, want: torch.Tensor | float) -> None:
    torch.testing.assert_close(torch.as_tensor(got).float(), torch.as_tensor(want).float(), rtol=RTOL, atol=ATOL)


class _OneProcess:
    """trl's trainers gather metrics through an accelerate Accelerator; in one process a gather is the identity."""

    device = torch.device("cpu")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


class _FusedHead:
    """Stands in for a model patched with trl's ``add_fused_lm_head``: ``model(..., labels, fused_lm_head=True)``
    returns per-token log-probabilities ``[batch, seq_len - 1]``, zero where the shifted label is -100 (as trl's
    fused head returns them). The log-probabilities are leaf tensors the test owns, one per ``input_ids``."""

    training = True

    def __init__(self, per_input: dict[int, torch.Tensor]) -> None:
        self.per_input = per_input

    def __call__(self, *, input_ids: torch.Tensor, labels: torch.Tensor, fused_lm_head: bool, **_: Any) -> Any:
        assert fused_lm_head
        kept = labels[:, 1:] != IGNORE_INDEX
        log_probs = self.per_input[input_ids.data_ptr()].masked_fill(~kept, 0.0)
        zeros = torch.zeros_like(log_probs.detach())
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=torch.zeros_like(kept))


def _metrics_store() -> dict[str, defaultdict[str, list[float]]]:
    return {"train": defaultdict(list), "eval": defaultdict(list)}


def _completion_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, completion_mask)`` ``[rows, SEQ]``: a prompt of 1-3 tokens, a completion of
    1 to the rest, right padding; every row a different length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (rows, SEQ), generator=g)
    attention = torch.zeros(rows, SEQ, dtype=torch.long)
    completion = torch.zeros(rows, SEQ, dtype=torch.long)
    for i in range(rows):
        prompt = 1 + i % 3
        length = prompt + 1 + (i * 5 + seed) % (SEQ - prompt)
        attention[i, :length] = 1
        completion[i, prompt:length] = 1
    return ids, attention, completion


def _per_token(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (-3 * torch.rand(rows, SEQ - 1, generator=g)).requires_grad_()


def _sums(per_token: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ferry's sequence_logps returns, from given per-token log-probabilities: sums and labelled counts."""
    kept = labels[:, 1:] != IGNORE_INDEX
    return (per_token * kept).sum(-1), kept.sum(-1)


@pytest.fixture(scope="module")
def trl() -> Any:
    import trl
    import trl.trainer.utils

    with warnings.catch_warnings():  # "trl.experimental ... may change": the pin in pyproject.toml holds it still
        warnings.simplefilter("ignore")
        import trl.experimental.cpo
        import trl.experimental.orpo

    return trl


def _trl_dpo(trl: Any, model: _FusedHead, loss_types: list[str], beta: float, weights: list[float] | None = None):
    # DPOTrainer.__init__ needs a model repo, a dataset and a tokenizer; _compute_loss reads only these attributes.
    t = object.__new__(trl.DPOTrainer)
    t.model, t.accelerator, t.beta = model, _OneProcess(), beta
    t.loss_types, t.loss_weights = loss_types, weights or [1.0] * len(loss_types)
    t.f_divergence_type, t.label_smoothing, t.use_weighting, t.aux_loss_enabled, t.ld_alpha = (
        "reverse_kl",
        0.0,
        False,
        False,
        None,
    )
    t.precompute_ref_logps = True  # the reference's log-probabilities come with the batch, as ferry takes them
    t._metrics, t._total_train_tokens, t._tp_size = _metrics_store(), 0, 1
    return t


def _dpo_case(seed: int = 0):
    """A batch of PAIRS chosen rows then PAIRS rejected ones, their per-token log-probabilities (a leaf) and the
    reference's summed log-probabilities."""
    ids, attention, completion = _completion_batch(2 * PAIRS, seed)
    labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
    per_token = _per_token(2 * PAIRS, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    ref_chosen, ref_rejected = (-10 * torch.rand(2, PAIRS, generator=g)).unbind(0)
    inputs = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return inputs, labels, per_token


def _ferry_pairwise(cfg: PreferenceLossConfig, labels: torch.Tensor, per_token: torch.Tensor, inputs: dict):
    sums, counts = _sums(per_token, labels)
    (pc, pr), (cc, rc) = sums.chunk(2), counts.chunk(2)
    return pairwise_preference_loss(cfg, pc, pr, cc, rc, inputs["ref_chosen_logps"], inputs["ref_rejected_logps"])


@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_dpo_losses_and_gradients_equal_trls_dpo_trainer(trl: Any, loss: str) -> None:
    inputs, labels, per_token = _dpo_case()
    beta = 2.5 if loss == "hinge" else 0.1  # hinge: beta * d is 2.4 (past the margin), -0.7 and -14
    t = _trl_dpo(trl, _FusedHead({inputs["input_ids"].data_ptr(): per_token}), [loss], beta)
    want = t._compute_loss(t.model, inputs, return_outputs=False)
    (want_grad,) = torch.autograd.grad(want, per_token)

    got = _ferry_pairwise(PreferenceLossConfig(pref_loss=loss, pref_beta=beta), labels, per_token, inputs)
    (got_grad,) = torch.autograd.grad(got.loss, per_token)
    close(got.loss, want)
    close(got_grad, want_grad)
    assert got_grad.abs().sum() > 0
    if loss != "ipo":  # trl's rewards and logps are sums; LLaMA-Factory's ipo reports averages (next test)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
            close(got.metrics[name], t._metrics["train"][name][0])
        for name in ("logps/chosen", "logps/rejected"):
            close(got.metrics[name], t._metrics["train"][name][0])


def test_ipo_rewards_and_logps_are_per_token_averages_as_llamafactory_reports_them() -> None:
    # LLaMA-Factory divides the policy's and the reference's log-probabilities by the labelled-token count before
    # the loss, so its rewards and logps metrics are averages (trl's DPOTrainer averages inside the loss only).
    inputs, labels, per_token = _dpo_case()
    got = _ferry_pairwise(PreferenceLossConfig(pref_loss="ipo", pref_beta=0.1), labels, per_token, inputs)
    sums, counts = _sums(per_token.detach(), labels)
    avg = sums / counts
    ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]) / counts
    close(got.chosen_rewards, 0.1 * (avg - ref)[:PAIRS])
    close(got.rejected_rewards, 0.1 * (avg - ref)[PAIRS:])
    close(got.metrics["logps/chosen"], avg[:PAIRS].mean())


def test_pref_ftx_adds_the_chosen_sft_loss_as_trls_sft_term_when_chosen_lengths_agree(trl: Any) -> None:
    # trl's "sft" term is the mean over all chosen tokens, LLaMA-Factory's the mean of per-sequence averages: they
    # agree when every chosen response has the same length, which this batch has.
    inputs, labels, per_token = _dpo_case()
    completion = inputs["completion_mask"]
    completion[:PAIRS] = 0
    completion[:PAIRS, 2:6] = 1
    labels = inputs["input_ids"].masked_fill(completion == 0, IGNORE_INDEX)
    t = _trl_dpo(trl, _FusedHead({inputs["input_ids"].data_ptr(): per_token}), ["sigmoid", "sft"], 0.1, [1.0, 0.7])
    want = t._compute_loss(t.model, inputs, return_outputs=False)
    (want_grad,) = torch.autograd.grad(want, per_token)
    got = _ferry_pairwise(PreferenceLossConfig(pref_ftx=0.7), labels, per_token, inputs)
    (got_grad,) = torch.autograd.grad(got.loss, per_token)
    close(got.loss, want)
    close(got_grad, want_grad)


def test_label_smoothed_sigmoid_is_conservative_dpo() -> None:
    # trl 1.16's sigmoid ignores label_smoothing; LLaMA-Factory 0.9.5 (with trl <= 0.24) applies cDPO's form:
    # -(1 - eps) log s(beta d) - eps log s(-beta d) (Mitchell 2023, "A note on DPO with noisy preferences").
    inputs, labels, per_token = _dpo_case()
    got = _ferry_pairwise(PreferenceLossConfig(dpo_label_smoothing=0.2, pref_beta=0.3), labels, per_token, inputs)
    sums, _ = _sums(per_token, labels)
    d = (sums[:PAIRS] - inputs["ref_chosen_logps"]) - (sums[PAIRS:] - inputs["ref_rejected_logps"])
    want = (-0.8 * torch.log(torch.sigmoid(0.3 * d)) - 0.2 * torch.log(torch.sigmoid(-0.3 * d))).mean()
    close(got.loss, want)
    close(torch.autograd.grad(got.loss, per_token)[0], torch.autograd.grad(want, per_token)[0])


def test_kto_pair_is_the_paired_kto_of_the_halos_paper() -> None:
    # trl dropped kto_pair (0.9); with trl 0.20-0.24 LLaMA-Factory computed sigmoid under that name. The formula
    # (Ethayarajh et al. 2024, eq. 7, the KL reference point of each half estimated from the other half):
    inputs, labels, per_token = _dpo_case()
    beta = 0.4
    got = _ferry_pairwise(PreferenceLossConfig(pref_loss="kto_pair", pref_beta=beta), labels, per_token, inputs)
    sums, _ = _sums(per_token, labels)
    lc, lr = sums[:PAIRS] - inputs["ref_chosen_logps"], sums[PAIRS:] - inputs["ref_rejected_logps"]
    zc, zr = torch.clamp(lc.mean(), min=0), torch.clamp(lr.mean(), min=0)
    halves = torch.cat([1 - torch.sigmoid(beta * (lc - zr)), 1 - torch.sigmoid(beta * (zc - lr))])
    want = halves.mean()
    close(got.loss, want)
    close(torch.autograd.grad(got.loss, per_token)[0], torch.autograd.grad(want, per_token)[0])
    close(got.chosen_rewards, beta * lc.detach())


def _averaged(labels: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sums, counts = _sums(per_token, labels)
    avg = sums / counts
    return avg[:PAIRS], avg[PAIRS:]


def test_simpo_equals_trls_cpo_trainer_simpo_loss_on_averaged_logps(trl: Any) -> None:
    inputs, labels, per_token = _dpo_case()
    # CPOTrainer.__init__ needs a model and a dataset; cpo_loss reads only these attributes.
    t = object.__new__(trl.experimental.cpo.CPOTrainer)
    t.beta, t.simpo_gamma, t.label_smoothing, t.loss_type, t.alpha = 2.0, 0.5, 0.0, "simpo", 0.0
    t.accelerator = _OneProcess()
    avg_c, avg_r = _averaged(labels, per_token)
    losses, want_c, want_r = t.cpo_loss(avg_c, avg_r)
    want = losses.mean()
    got = _ferry_pairwise(PreferenceLossConfig(pref_loss="simpo", pref_beta=2.0), labels, per_token, inputs)
    close(got.loss, want)
    close(torch.autograd.grad(got.loss, per_token)[0], torch.autograd.grad(want, per_token)[0])
    close(got.chosen_rewards, want_c)
    close(got.rejected_rewards, want_r)


def test_orpo_is_the_chosen_nll_plus_beta_times_trls_odds_ratio_term(trl: Any) -> None:
    # LLaMA-Factory's ORPO (Hong et al. 2024, eq. 6): per pair -avg_logp(chosen) + beta * -log s(log odds), on
    # averaged log-probabilities. trl's ORPOTrainer.odds_ratio_loss returns beta * log s(log odds) per pair; its
    # NLL term is a token mean over the batch, so the NLL half is written out here.
    inputs, labels, per_token = _dpo_case()
    beta = 0.25
    t = object.__new__(trl.experimental.orpo.ORPOTrainer)  # odds_ratio_loss reads beta and accelerator only
    t.beta, t.accelerator = beta, _OneProcess()
    avg_c, avg_r = _averaged(labels, per_token)
    ratio_losses, want_c, want_r, mean_ratio, _ = t.odds_ratio_loss(avg_c, avg_r)
    want = (-avg_c - ratio_losses).mean()
    got = _ferry_pairwise(PreferenceLossConfig(pref_loss="orpo", pref_beta=beta), labels, per_token, inputs)
    close(got.loss, want)
    close(torch.autograd.grad(got.loss, per_token)[0], torch.autograd.grad(want, per_token)[0])
    close(got.chosen_rewards, want_c)
    close(got.rejected_rewards, want_r)
    close(got.metrics["odds_ratio_loss"], -mean_ratio)
    close(got.metrics["sft_loss"], -avg_c.mean())


def test_kto_equals_trls_kto_trainer(trl: Any) -> None:
    rows = 5
    ids, attention, completion = _completion_batch(rows, 3)
    kl_ids, kl_attention, kl_completion = _completion_batch(rows, 4)  # the mismatched pairs of the KL term
    tags = torch.tensor([True, False, True, True, False])
    per_token, kl_per_token = _per_token(rows, 5), _per_token(rows, 6).detach()
    g = torch.Generator().manual_seed(7)
    ref, ref_kl = (-8 * torch.rand(2, rows, generator=g)).unbind(0)
    inputs = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "label": tags,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_attention,
        "KL_completion_mask": kl_completion,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    # KTOTrainer.__init__ needs a model, a dataset and a tokenizer; _compute_loss reads only these attributes.
    t = object.__new__(trl.KTOTrainer)
    t.model = _FusedHead({ids.data_ptr(): per_token, kl_ids.data_ptr(): kl_per_token})
    t.accelerator, t.beta, t.loss_type, t.desirable_weight, t.undesirable_weight = _OneProcess(), 0.2, "kto", 1.3, 0.6
    t.calculate_KL, t.precompute_ref_logps, t.aux_loss_enabled = True, True, False
    t._metrics, t._total_train_tokens, t._tp_size = _metrics_store(), 0, 1
    want = t._compute_loss(t.model, inputs, return_outputs=False)
    (want_grad,) = torch.autograd.grad(want, per_token)

    cfg = PreferenceLossConfig(pref_beta=0.2, kto_chosen_weight=1.3, kto_rejected_weight=0.6)
    labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
    sums, counts = _sums(per_token, labels)
    kl_sums, _ = _sums(kl_per_token, kl_ids.masked_fill(kl_completion == 0, IGNORE_INDEX))
    got = kto_loss(cfg, sums, ref, tags, kto_kl(kl_sums, ref_kl), counts)
    (got_grad,) = torch.autograd.grad(got.loss, per_token)
    close(got.loss, want)
    close(got_grad, want_grad)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        close(got.metrics[name], t._metrics["train"][name][0])


def test_reward_loss_and_accuracy_equal_trls_reward_trainer(trl: Any) -> None:
    g = torch.Generator().manual_seed(8)
    values = torch.randn(2 * PAIRS, SEQ, generator=g, requires_grad=True)
    _, attention, _ = _completion_batch(2 * PAIRS, 9)
    # LLaMA-Factory's rule, written out: the value at position attention_mask.sum() - 1 (right padding)
    at_last = values.gather(1, (attention.sum(-1, keepdim=True) - 1)).squeeze(1)

    def scored(**_: Any) -> Any:
        return SimpleNamespace(logits=at_last[:, None])

    scored.training = True  # type: ignore[attr-defined]
    # RewardTrainer.__init__ needs a model and a dataset; compute_loss reads only these attributes.
    t = object.__new__(trl.RewardTrainer)
    t.model, t.accelerator, t.args = scored, _OneProcess(), SimpleNamespace(center_rewards_coefficient=None)
    t._metrics, t._total_train_tokens, t._tp_size = _metrics_store(), 0, 1
    want = t.compute_loss(scored, {"attention_mask": attention})
    (want_grad,) = torch.autograd.grad(want, values)

    scores = last_token_scores(values, attention)
    result = reward_pairwise_loss(*scores.chunk(2))
    loss, metrics = result.loss, result.metrics
    (got_grad,) = torch.autograd.grad(loss, values)
    close(loss, want)
    close(got_grad, want_grad)
    close(metrics["accuracy"], t._metrics["train"]["accuracy"][0])
    close(metrics["margin"], t._metrics["train"]["margin"][0])


def test_last_token_scores_reads_left_padded_rows_at_their_end() -> None:
    values = torch.arange(12.0).reshape(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    assert last_token_scores(values, mask).tolist() == [5.0, 8.0]


def _tiny_llama(trl: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).float()
    trl.trainer.utils.add_fused_lm_head(model)
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_chunked_sequence_logps_equal_trls_fused_head_on_a_tiny_llama(trl: Any, lora: bool) -> None:
    model = _tiny_llama(trl)
    if lora:  # LoRA on the attention (trl's fused head reads lm_head.weight itself, so not on the head)
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in peft_model.named_parameters():  # lora_B starts at zero: give every factor a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        model = peft_model.base_model.model  # the patched LlamaForCausalLM, LoRA layers inside
    ids, attention, completion = _completion_batch(4, 10)
    labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == (4 if lora else 12)

    want = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs.sum(-1)
    want_grads = torch.autograd.grad((want * torch.arange(1.0, 5.0)).sum(), params)

    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    got, counts = sequence_logps(model.lm_head.forward, hidden, labels, chunk_tokens=3)  # 3 < 4 rows
    got_grads = torch.autograd.grad((got * torch.arange(1.0, 5.0)).sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # trl's head sums its tiles in another order
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert counts.tolist() == (completion[:, 1:] == 1).sum(-1).tolist()


def _full_logits_logps(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, weights=None):
    """The plain computation: every logit, log_softmax, gather the shifted labels, mask, sum."""
    logp = torch.log_softmax(head(hidden).float(), -1)[:, :-1]
    target = labels[:, 1:]
    kept = target != IGNORE_INDEX
    picked = logp.gather(2, target.clamp(min=0)[..., None]).squeeze(-1) * kept
    if weights is not None:
        picked = picked * weights[:, 1:]
    return picked.sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1000])
def test_chunked_sequence_logps_equal_the_whole_logits(chunk_tokens: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(4, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (4, 9))
    labels[:, :3] = IGNORE_INDEX
    labels[1, 6:] = IGNORE_INDEX
    labels[3, 1::2] = IGNORE_INDEX  # not contiguous
    weights = length_desensitized_weights(labels, 0.3)
    for w in (None, weights):
        want = _full_logits_logps(head, hidden, labels, w)
        want_grads = torch.autograd.grad((want * torch.arange(1.0, 5.0)).sum(), [hidden, *head.parameters()])
        got, counts = sequence_logps(head.forward, hidden, labels, chunk_tokens=chunk_tokens, token_weights=w)
        got_grads = torch.autograd.grad((got * torch.arange(1.0, 5.0)).sum(), [hidden, *head.parameters()])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
        for g, wg in zip(got_grads, want_grads):  # sums over rows in another order: 1e-6 of their O(1) scale
            torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == [6, 3, 6, 3]
    with torch.no_grad():  # the path without checkpoints
        plain, _ = sequence_logps(head.forward, hidden, labels, chunk_tokens=2)
        torch.testing.assert_close(plain, _full_logits_logps(head, hidden, labels), rtol=RTOL, atol=1e-6)


def test_the_largest_tensor_of_sequence_logps_is_one_chunks_logits() -> None:
    vocab, hidden_size, rows = 4096, 16, 256
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(2, rows, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (2, rows))
    with LargestTensor() as mode:
        logps, _ = sequence_logps(head.forward, hidden, labels, chunk_tokens=64)
        logps.sum().backward()
    assert mode.largest <= 64 * vocab * 4  # one chunk's fp32 logits, not the 2 x 256 x 4096 of the whole
    assert mode.largest >= 64 * vocab * 4 // 2  # (and the probe sees the chunk at all)


def test_length_desensitized_weights_discount_the_longer_responses_tail() -> None:
    labels = torch.full((2, 6), IGNORE_INDEX)
    labels[0, 1:6] = 7  # chosen: 5 labelled tokens
    labels[1, 2:4] = 7  # rejected: 2
    w = length_desensitized_weights(labels, 0.25)
    assert w.tolist() == [[1, 1, 1, 0.25, 0.25, 0.25], [1, 1, 1, 1, 1, 1]]


def test_an_unknown_pref_loss_is_one_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        PreferenceLossConfig(pref_loss="dpop")
    assert str(err.value).startswith("pref_loss: unknown loss 'dpop'") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^pref_beta: "):
        PreferenceLossConfig(pref_beta=0)


def test_mismatched_shapes_are_one_training_error_naming_the_tensors() -> None:
    cfg = PreferenceLossConfig()
    a, b, n = torch.zeros(3), torch.zeros(2), torch.ones(3, dtype=torch.long)
    with pytest.raises(TrainingError, match=r"policy_rejected_logps \[2\]"):
        pairwise_preference_loss(cfg, a, b, n, n, a, a)
    with pytest.raises(TrainingError, match="needs the reference"):
        pairwise_preference_loss(cfg, a, a, n, n)
    with pytest.raises(TrainingError, match=r"labels \[2, 5\]"):
        sequence_logps(
            torch.nn.Linear(4, 8).forward, torch.zeros(2, 6, 4), torch.zeros(2, 5, dtype=torch.long), chunk_tokens=2
        )
    with pytest.raises(TrainingError, match="kto_tags"):
        kto_loss(cfg, a, a, torch.ones(2, dtype=torch.bool), torch.tensor(0.0), n)


def test_kto_pref_ftx_adds_llamafactorys_rescaled_sft_term() -> None:
    # trl's KTOTrainer has no SFT term; LLaMA-Factory 0.9.5 adds pref_ftx * mean(-avg logp of the desirable
    # examples) / n_desirable * batch, written out here.
    sums = torch.tensor([-4.0, -9.0, -2.0, -6.0], requires_grad=True)
    ref, counts = torch.tensor([-5.0, -8.0, -2.5, -6.5]), torch.tensor([2, 3, 1, 4])
    tags = torch.tensor([True, False, True, False])
    kl = torch.tensor(0.3)
    base = kto_loss(PreferenceLossConfig(), sums, ref, tags, kl, counts)
    with_ftx = kto_loss(PreferenceLossConfig(pref_ftx=0.5), sums, ref, tags, kl, counts)
    sft = -(sums[tags] / counts[tags]).mean()
    close(with_ftx.loss, base.loss + 0.5 * sft / 2 * 4)
    desirable_only = kto_loss(PreferenceLossConfig(), sums[tags], ref[tags], tags[tags], kl, counts[tags])
    assert set(desirable_only.metrics) == {"kl", "rewards/chosen", "logps/chosen"}


def test_a_batch_without_labels_still_reaches_the_heads_parameters() -> None:
    head = torch.nn.Linear(4, 8)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    labels = torch.full((2, 5), IGNORE_INDEX)
    logps, counts = sequence_logps(head.forward, hidden, labels, chunk_tokens=2)
    logps.sum().backward()
    assert logps.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]
    assert head.weight.grad is not None and not head.weight.grad.any()
