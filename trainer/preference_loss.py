"""The losses of preference training: DPO and its family, KTO, and the reward model's pairwise loss.

Everything here is a function of tensors; wiring into the training loop is the recipe's job. The pipeline of a
step, with LLaMA-Factory 0.9.5's batch layout (the chosen sequences first, then the rejected ones)::

    hidden [2b, seq_len, hidden] + labels [2b, seq_len]
      -> sequence_logps                  logps [2b] (sum over labelled tokens, fp32), counts [2b]
         (ld_alpha: token_weights from length_desensitized_weights, the policy only)
      -> split into chosen [b] / rejected [b]; the reference's likewise, without grad
      -> pairwise_preference_loss        stage dpo: sigmoid, hinge, ipo, kto_pair, orpo, simpo (+ pref_ftx)
         kto_loss                        stage kto: one response per prompt, a desirable/undesirable tag
         reward_pairwise_loss            stage rm: one score per sequence (last_token_scores)

Semantics follow LLaMA-Factory 0.9.5 (``train/dpo/trainer.py``, ``train/kto/trainer.py``, ``train/rm/trainer.py``)
and, where it delegates, trl's DPO and KTO trainers of the versions it pins (0.18 to 0.24), with one deliberate
difference: with trl 0.20 to 0.24 LLaMA-Factory does not pass ``loss_type`` to trl, so its hinge, ipo and kto_pair
silently compute sigmoid. ferry computes the loss named. Where the two libraries name a metric, trl's name is
used (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``; KTO ``kl``; ORPO also LLaMA-Factory's ``sft_loss`` and ``odds_ratio_loss``).

Units: log-probabilities are natural-log nats, summed over a sequence's labelled tokens unless a loss averages
them (ipo, orpo, simpo divide by the labelled-token count, as LLaMA-Factory does, the reference's too). Rewards
are ``pref_beta`` times a log-ratio (or times the policy's log-probability where there is no reference).

Errors: a bad key is a :class:`~ferry.errors.ConfigError` naming the key; tensors of the wrong shape, or a
missing reference where the loss needs one, are a :class:`~ferry.errors.TrainingError` naming the tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ferry.errors import ConfigError, TrainingError
from trainer.loss import IGNORE_INDEX, chunked_token_logps, labelled_rows

#: ``pref_loss`` values (LLaMA-Factory's ``pref_loss`` choices for ``stage: dpo``).
PREF_LOSSES = ("sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo")

#: Losses computed from length-averaged log-probabilities (LLaMA-Factory divides by the labelled-token count).
AVERAGED_LOSSES = frozenset({"ipo", "orpo", "simpo"})

#: Losses without a reference model.
REFERENCE_FREE_LOSSES = frozenset({"orpo", "simpo"})


@dataclass(frozen=True)
class PreferenceLossConfig:
    """The keys of the preference losses, with LLaMA-Factory 0.9.5's names and defaults.

    Attributes:
        pref_loss: one of :data:`PREF_LOSSES` (stage dpo).
        pref_beta: the temperature beta of every loss here (> 0); ORPO's weight lambda of the odds-ratio term.
        pref_ftx: weight of the SFT loss of the chosen response added to the preference loss (>= 0).
        dpo_label_smoothing: conservative-DPO label noise epsilon in ``[0, 0.5)``, sigmoid only.
        simpo_gamma: SimPO's target reward margin gamma, in reward units (beta x nats per token).
        ld_alpha: LD-DPO's weight of the tokens past the shorter response of a pair (None: off); see
            :func:`length_desensitized_weights`.
        kto_chosen_weight: KTO's weight of desirable examples (lambda_D, >= 0).
        kto_rejected_weight: KTO's weight of undesirable examples (lambda_U, >= 0).

    Raises:
        ConfigError: an unknown ``pref_loss`` or a value out of range, one line naming the key.
    """

    pref_loss: str = "sigmoid"
    pref_beta: float = 0.1
    pref_ftx: float = 0.0
    dpo_label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    ld_alpha: float | None = None
    kto_chosen_weight: float = 1.0
    kto_rejected_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.pref_loss not in PREF_LOSSES:
            raise ConfigError(f"pref_loss: unknown loss {self.pref_loss!r} (one of {', '.join(PREF_LOSSES)})")
        if not self.pref_beta > 0:
            raise ConfigError(f"pref_beta: must be > 0 (got {self.pref_beta})")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(f"dpo_label_smoothing: must be in [0, 0.5) (got {self.dpo_label_smoothing})")
        for key in ("pref_ftx", "kto_chosen_weight", "kto_rejected_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{key}: must be >= 0 (got {getattr(self, key)})")
        if self.ld_alpha is not None and not 0 <= self.ld_alpha <= 1:
            raise ConfigError(f"ld_alpha: must be in [0, 1] or unset (got {self.ld_alpha})")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares against a reference model (every ``pref_loss`` but orpo and simpo)."""
        return self.pref_loss not in REFERENCE_FREE_LOSSES

    @property
    def averages_logps(self) -> bool:
        """Whether the loss takes length-averaged log-probabilities (ipo, orpo, simpo)."""
        return self.pref_loss in AVERAGED_LOSSES


@dataclass(frozen=True)
class PreferenceLoss:
    """What a preference loss returns.

    Attributes:
        loss: fp32 scalar, the batch mean of ``losses`` (KTO: plus its SFT term), the one to backpropagate.
        losses: fp32 ``[batch]``, the loss of each pair (KTO: of each example).
        chosen_rewards: fp32 ``[n_chosen]``, detached: ``pref_beta`` times the chosen log-ratio.
        rejected_rewards: fp32 ``[n_rejected]``, detached.
        metrics: detached fp32 0-dim tensors under trl's / LLaMA-Factory's names (call ``.item()`` to log: that
            waits for the device).
    """

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise TrainingError(message)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(n) for n in t.shape) + "]"


def _same_1d(**tensors: torch.Tensor | None) -> None:
    """All given tensors are 1-D of one length, else one TrainingError naming each shape."""
    given = {name: t for name, t in tensors.items() if t is not None}
    shapes = {tuple(t.shape) for t in given.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        listed = ", ".join(f"{name} {_shape(t)}" for name, t in given.items())
        raise TrainingError(f"preference loss: expected 1-D tensors of one length [batch], got {listed}")


def sequence_logps(
    head_forward: Any,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    token_weights: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence log-probability of the labelled tokens, without holding the whole logits.

    ``logps[i] = sum_t w[i, t] * log softmax(head(hidden[i, t - 1]))[labels[i, t]]`` over the positions ``t`` whose
    label is not :data:`~trainer.loss.IGNORE_INDEX` (the causal-LM shift: position ``t - 1`` predicts label ``t``),
    ``w`` = 1 unless ``token_weights`` is given. The head runs on the labelled rows only, ``chunk_tokens`` rows at a
    time, each chunk checkpointed (:func:`trainer.loss.chunked_token_logps`): peak memory holds one chunk's fp32
    logits, ``chunk_tokens x vocab``. Gradients flow to ``hidden`` and to the head's parameters. This is the
    ``get_batch_logps`` of LLaMA-Factory's ``train/trainer_utils.py`` and trl's, computed by chunks.

    Args:
        head_forward: the output head's forward, ``[n, hidden] -> [n, vocab]`` (``lm_head.forward``; a LoRA or
            tied head is called as the model calls it). Nothing may scale or cap its logits afterwards.
        hidden: ``[batch, seq_len, hidden]`` final hidden states, any float dtype (the log-softmax is fp32).
        labels: ``[batch, seq_len]`` int64, unshifted (``labels[:, t]`` is the target of position ``t - 1``).
        chunk_tokens: rows of logits per chunk (>= 1; :func:`trainer.loss.chunk_tokens_for` sizes it by vocab).
        token_weights: optional ``[batch, seq_len]`` float weight of each label position (aligned with
            ``labels``), e.g. :func:`length_desensitized_weights`.
        positions: :func:`trainer.loss.loss_positions` of ``labels`` if the collate computed it (no device sync).

    Returns:
        ``(logps, counts)``: ``logps`` fp32 ``[batch]`` (nats, <= 0 when unweighted), ``counts`` int64 ``[batch]``,
        the number of labelled tokens of each sequence (what ipo, orpo and simpo divide by).

    Raises:
        TrainingError: ``hidden`` is not 3-D, or ``labels`` / ``token_weights`` are not ``[batch, seq_len]``.
    """
    _require(
        hidden.dim() == 3 and labels.shape == hidden.shape[:2],
        f"sequence_logps: hidden must be [batch, seq_len, hidden] and labels [batch, seq_len], got hidden "
        f"{_shape(hidden)} and labels {_shape(labels)}",
    )
    _require(
        token_weights is None or token_weights.shape == labels.shape,
        f"sequence_logps: token_weights must be shaped as labels {_shape(labels)}, got "
        f"{_shape(token_weights) if token_weights is not None else ''}",
    )
    _require(chunk_tokens >= 1, f"sequence_logps: chunk_tokens must be >= 1 (got {chunk_tokens})")
    batch, seq_len = labels.shape
    rows, targets, keep = labelled_rows(hidden, labels, positions)
    token_logps = chunked_token_logps(head_forward, rows, targets, chunk_tokens)
    if token_weights is not None:
        shifted = F.pad(token_weights[:, 1:].to(hidden.device, torch.float32), (0, 1)).reshape(-1)
        token_logps = token_logps * shifted.index_select(0, keep)
    logps = token_logps.new_zeros(batch).index_add(0, keep // seq_len, token_logps)
    if rows.size(0) == 0 and torch.is_grad_enabled():
        # Keep the head's parameters in the graph (DDP / FSDP expect their gradients every step).
        logps = logps + 0.0 * head_forward(hidden.reshape(-1, hidden.size(-1))[:1]).float().sum()
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(-1).to(hidden.device)
    return logps, counts


def length_desensitized_weights(labels: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's token weights (Liu et al. 2024, "LD-DPO: Length Desensitization in Direct Preference
    Optimization"), as LLaMA-Factory 0.9.5 applies ``ld_alpha`` to the policy's log-probabilities.

    Within a pair, the first ``min(len_chosen, len_rejected)`` labelled tokens of each response weigh 1 and the
    rest ``ld_alpha``, so the longer response's tail counts less. Tokens are counted in order of position, which
    equals LLaMA-Factory's "position before the first label plus the shorter length" for a contiguous response.

    Args:
        labels: ``[2b, seq_len]`` int64, unshifted, chosen rows first then rejected.
        ld_alpha: weight of the tail tokens, in ``[0, 1]``.

    Returns:
        fp32 ``[2b, seq_len]`` aligned with ``labels`` (1 where there is no label), for ``sequence_logps``'s
        ``token_weights``.

    Raises:
        TrainingError: ``labels`` is not 2-D with an even number of rows.
    """
    _require(
        labels.dim() == 2 and labels.size(0) % 2 == 0,
        f"length_desensitized_weights: labels must be [2 * pairs, seq_len], got {_shape(labels)}",
    )
    labelled = labels != IGNORE_INDEX
    labelled[:, 0] = False  # the first position is never a target
    order = labelled.cumsum(dim=1)  # k-th labelled token of its row
    chosen_len, rejected_len = labelled.sum(dim=1).chunk(2)
    shared = torch.minimum(chosen_len, rejected_len).repeat(2)
    tail = labelled & (order > shared[:, None])
    return torch.where(tail, float(ld_alpha), 1.0).to(torch.float32)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (a log-probability), accurate at both ends: ``log(-expm1(x))`` for
    ``x > -ln 2``, ``log1p(-exp(x))`` below (Maechler 2012, "Accurately Computing log(1 - exp(-|a|))").
    ``x = 0`` gives ``-inf``."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# long: 50 of its lines are the docstring, one formula and its paper per pref_loss
def pairwise_preference_loss(
    config: PreferenceLossConfig,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_counts: torch.Tensor,
    rejected_counts: torch.Tensor,
    reference_chosen_logps: torch.Tensor | None = None,
    reference_rejected_logps: torch.Tensor | None = None,
) -> PreferenceLoss:
    """The ``stage: dpo`` loss named by ``config.pref_loss``, with LLaMA-Factory 0.9.5's semantics.

    Inputs are per-sequence *summed* log-probabilities (:func:`sequence_logps`); for ipo, orpo and simpo this
    function divides the policy's and the reference's by the labelled-token counts, as LLaMA-Factory's
    ``concatenated_forward`` does. With ``d = (pi_c - pi_r) - (ref_c - ref_r)``, ``beta = pref_beta``:

    - sigmoid (DPO, Rafailov et al. 2023, eq. 7; conservative DPO with ``dpo_label_smoothing`` eps, Mitchell 2023):
      ``-(1 - eps) log s(beta d) - eps log s(-beta d)``.
    - hinge (SLiC, Zhao et al. 2023): ``relu(1 - beta d)``.
    - ipo (Azar et al. 2023, eq. 17, on averaged log-probabilities): ``(d - 1 / (2 beta))^2``.
    - kto_pair (Ethayarajh et al. 2024, the paired form trl <= 0.8 shipped): with log-ratios ``l_c``, ``l_r`` and
      batch-mean reference points ``z_c = max(0, mean l_c)``, ``z_r = max(0, mean l_r)``, the pair's loss is the
      mean of ``1 - s(beta (l_c - z_r))`` and ``1 - s(beta (z_c - l_r))`` (trl concatenated both halves; the mean
      over the batch is the same).
    - orpo (Hong et al. 2024, eq. 6-7, on averaged log-probabilities, no reference): ``-pi_c + beta * -log s(log
      odds)``, ``log odds = (pi_c - pi_r) - (log(1 - e^pi_c) - log(1 - e^pi_r))``.
    - simpo (Meng et al. 2024, eq. 6, on averaged log-probabilities, no reference):
      ``-log s(beta (pi_c - pi_r - simpo_gamma / beta))``.

    ``pref_ftx > 0`` adds ``pref_ftx * sft_loss`` to each pair's loss, ``sft_loss = -`` the chosen response's
    average log-probability per token (the ld_alpha-weighted sum over the count where ld_alpha is set).

    Rewards: ``beta * (pi - ref)`` (detached), or ``beta * pi`` for orpo and simpo. Metrics: ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies`` (share of pairs with chosen reward > rejected), ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected`` (the policy's, averaged where the loss averages), all batch means; orpo
    adds ``sft_loss`` and ``odds_ratio_loss`` (the mean of ``-log s(log odds)``; LLaMA-Factory derives it from the
    total loss, which equals this when ``pref_ftx`` is 0).

    Args:
        config: the keys.
        policy_chosen_logps, policy_rejected_logps: fp32 ``[batch]`` summed log-probabilities (nats), with grad.
        chosen_counts, rejected_counts: int ``[batch]`` labelled-token counts (a count of 0 is taken as 1).
        reference_chosen_logps, reference_rejected_logps: fp32 ``[batch]`` summed log-probabilities of the
            reference (no grad needed); required unless pref_loss is orpo or simpo, ignored there.

    Raises:
        TrainingError: shapes differ or are not 1-D, or the loss needs a reference and none was given.
    """
    _same_1d(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        chosen_counts=chosen_counts,
        rejected_counts=rejected_counts,
        reference_chosen_logps=reference_chosen_logps if config.uses_reference else None,
        reference_rejected_logps=reference_rejected_logps if config.uses_reference else None,
    )
    beta, kind = config.pref_beta, config.pref_loss
    c_len = chosen_counts.clamp(min=1).to(policy_chosen_logps.device, torch.float32)
    r_len = rejected_counts.clamp(min=1).to(policy_rejected_logps.device, torch.float32)
    pi_c, pi_r = policy_chosen_logps.float(), policy_rejected_logps.float()
    if config.averages_logps:
        pi_c, pi_r = pi_c / c_len, pi_r / r_len
    metrics: dict[str, torch.Tensor] = {}
    sft_loss = -pi_c if config.averages_logps else -pi_c / c_len

    if config.uses_reference:
        if reference_chosen_logps is None or reference_rejected_logps is None:
            raise TrainingError(f"pref_loss {kind} needs the reference model's log-probabilities; none were given")
        ref_c = reference_chosen_logps.to(pi_c.device, torch.float32)
        ref_r = reference_rejected_logps.to(pi_r.device, torch.float32)
        if config.averages_logps:
            ref_c, ref_r = ref_c / c_len, ref_r / r_len
        l_c, l_r = pi_c - ref_c, pi_r - ref_r
        losses = _reference_losses(config, l_c, l_r)
        chosen_rewards, rejected_rewards = beta * l_c.detach(), beta * l_r.detach()
    else:
        if kind == "orpo":
            log_odds = (pi_c - pi_r) - (log1mexp(pi_c) - log1mexp(pi_r))
            odds_ratio_loss = -F.logsigmoid(log_odds)
            losses = sft_loss + beta * odds_ratio_loss
            metrics["sft_loss"] = sft_loss.detach().mean()
            metrics["odds_ratio_loss"] = odds_ratio_loss.detach().mean()
        else:  # simpo
            losses = -F.logsigmoid(beta * (pi_c - pi_r - config.simpo_gamma / beta))
        chosen_rewards, rejected_rewards = beta * pi_c.detach(), beta * pi_r.detach()

    if config.pref_ftx > 0:
        losses = losses + config.pref_ftx * sft_loss
    metrics = {**_reward_metrics(chosen_rewards, rejected_rewards, pi_c, pi_r), **metrics}
    return PreferenceLoss(losses.mean(), losses, chosen_rewards, rejected_rewards, metrics)


def _reference_losses(config: PreferenceLossConfig, l_c: torch.Tensor, l_r: torch.Tensor) -> torch.Tensor:
    """Per-pair losses ``[batch]`` of the pref_loss kinds with a reference (sigmoid, hinge, ipo, kto_pair) from the
    log-ratios ``l_c = pi_c - ref_c`` and ``l_r = pi_r - ref_r`` (formulas: :func:`pairwise_preference_loss`)."""
    beta, kind = config.pref_beta, config.pref_loss
    d = l_c - l_r
    if kind == "sigmoid":
        eps = config.dpo_label_smoothing
        return -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    # kto_pair
    z_c, z_r = l_c.mean().clamp(min=0), l_r.mean().clamp(min=0)
    return ((1 - torch.sigmoid(beta * (l_c - z_r))) + (1 - torch.sigmoid(beta * (z_c - l_r)))) / 2


def _reward_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, pi_c: torch.Tensor, pi_r: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": pi_c.detach().mean(),
        "logps/rejected": pi_r.detach().mean(),
    }


def kto_kl(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point before clamping: the batch mean of ``policy - reference`` summed log-probabilities
    of *mismatched* pairs (each prompt with another example's response), detached (fp32 0-dim, nats).

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 7's ``z_0``, estimated
    as trl's KTOTrainer does. Across ranks the estimate is the mean of every rank's value (all-reduce it before
    :func:`kto_loss`, which clamps it at 0).

    Raises:
        TrainingError: the two tensors are not 1-D of one length.
    """
    _same_1d(policy_kl_logps=policy_kl_logps, reference_kl_logps=reference_kl_logps)
    return (policy_kl_logps.float() - reference_kl_logps.float()).mean().detach()


def kto_loss(
    config: PreferenceLossConfig,
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    kto_tags: torch.Tensor,
    kl: torch.Tensor,
    counts: torch.Tensor,
) -> PreferenceLoss:
    """The ``stage: kto`` loss (Ethayarajh et al. 2024, eq. 7), with trl's KTOTrainer's and LLaMA-Factory 0.9.5's
    semantics.

    With the log-ratio ``l = pi - ref`` of each example and ``z = max(0, kl)``: a desirable example costs
    ``kto_chosen_weight * (1 - s(beta (l - z)))``, an undesirable one ``kto_rejected_weight * (1 - s(beta (z -
    l)))``; the loss is their mean over the batch. ``pref_ftx > 0`` adds, as LLaMA-Factory does, ``pref_ftx *
    mean over desirable examples of (-average log-probability per token) * batch / n_desirable``.

    Metrics (trl's names; means over the examples of each kind, present only where the batch has that kind):
    ``rewards/chosen``, ``logps/chosen``, ``rewards/rejected``, ``logps/rejected``, ``rewards/margins`` (both kinds
    present), and ``kl`` (the clamped reference point). Reading which kinds are present waits for ``kto_tags``
    once when it lives on the device.

    Args:
        config: the keys (``pref_beta``, ``kto_chosen_weight``, ``kto_rejected_weight``, ``pref_ftx``).
        policy_logps: fp32 ``[batch]`` summed log-probabilities (nats), with grad.
        reference_logps: fp32 ``[batch]`` the reference's.
        kto_tags: bool ``[batch]``, True for a desirable example (LLaMA-Factory's ``kto_tag``).
        kl: 0-dim, :func:`kto_kl` of the batch's mismatched pairs (all-reduced across ranks if it should be).
        counts: int ``[batch]`` labelled-token counts (for ``pref_ftx``; 0 is taken as 1).

    Raises:
        TrainingError: the per-example tensors are not 1-D of one length, or ``kl`` is not a scalar.
    """
    _same_1d(policy_logps=policy_logps, reference_logps=reference_logps, kto_tags=kto_tags, counts=counts)
    _require(kl.numel() == 1, f"kto_loss: kl must be a scalar, got {_shape(kl)}")
    beta = config.pref_beta
    pi = policy_logps.float()
    tags = kto_tags.to(pi.device, torch.bool)
    log_ratio = pi - reference_logps.to(pi.device, torch.float32)
    z = kl.to(pi.device, torch.float32).reshape(()).clamp(min=0)
    losses = torch.where(
        tags,
        config.kto_chosen_weight * (1 - torch.sigmoid(beta * (log_ratio - z))),
        config.kto_rejected_weight * (1 - torch.sigmoid(beta * (z - log_ratio))),
    )
    loss = losses.mean()
    rewards = beta * log_ratio.detach()
    chosen_rewards, rejected_rewards = rewards[tags], rewards[~tags]
    n_chosen, n_rejected = int(tags.sum()), int((~tags).sum())
    if config.pref_ftx > 0 and n_chosen > 0:
        avg = pi[tags] / counts.to(pi.device)[tags].clamp(min=1)
        loss = loss + config.pref_ftx * (-avg).mean() / n_chosen * tags.numel()
    metrics: dict[str, torch.Tensor] = {"kl": z.detach()}
    if n_chosen:
        metrics["rewards/chosen"] = chosen_rewards.mean()
        metrics["logps/chosen"] = pi.detach()[tags].mean()
    if n_rejected:
        metrics["rewards/rejected"] = rejected_rewards.mean()
        metrics["logps/rejected"] = pi.detach()[~tags].mean()
    if n_chosen and n_rejected:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceLoss(loss, losses, chosen_rewards, rejected_rewards, metrics)


def last_kept_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The last position the attention mask keeps in each row (``[batch, seq_len]`` 0/1 or bool): int64
    ``[batch]``. For right padding that is ``attention_mask.sum(-1) - 1``, where LLaMA-Factory's pairwise trainer
    reads a score; left padding works too (the last kept position is the last one).

    Raises:
        TrainingError: the mask is not 2-D, or a row keeps no position.
    """
    _require(attention_mask.dim() == 2, f"attention_mask must be [batch, seq_len], got {_shape(attention_mask)}")
    kept = attention_mask.bool()
    index = torch.arange(kept.size(1), device=kept.device).expand_as(kept)
    last = torch.where(kept, index, -1).amax(dim=1)
    _require(bool((last >= 0).all()), "a row of the batch keeps no position (an empty sequence)")
    return last


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score of each sequence: its value-head output at its last kept position (:func:`last_kept_positions`).

    Args:
        values: ``[batch, seq_len]`` float, one scalar per position (the value head's output).
        attention_mask: ``[batch, seq_len]`` 0/1 (or bool); every row keeps at least one position.

    Returns:
        ``[batch]`` in ``values``' dtype.

    Raises:
        TrainingError: the shapes differ or are not 2-D, or a row keeps nothing.
    """
    _require(
        values.dim() == 2 and values.shape == attention_mask.shape,
        f"last_token_scores: values and attention_mask must both be [batch, seq_len], got {_shape(values)} and "
        f"{_shape(attention_mask)}",
    )
    last = last_kept_positions(attention_mask.to(values.device))
    return values.gather(1, last[:, None]).squeeze(1)


def reward_pairwise_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> PreferenceLoss:
    """The reward model's pairwise loss (Bradley-Terry, as in Ouyang et al. 2022, eq. 1):
    ``-log s(r_chosen - r_rejected)`` per pair, computed in fp32, as LLaMA-Factory's ``stage: rm`` and trl's
    RewardTrainer (without margin or centring) compute it.

    Args:
        chosen_scores, rejected_scores: ``[batch]`` scores (:func:`last_token_scores`), with grad.

    Returns:
        :class:`PreferenceLoss`: ``loss`` the batch mean, ``losses`` per pair, the scores as the rewards, and
        ``metrics`` ``accuracy`` (share of pairs with ``r_chosen > r_rejected``, trl's and LLaMA-Factory's name),
        ``margin`` (mean ``r_chosen - r_rejected``, trl's), ``rewards/chosen`` and ``rewards/rejected`` (mean
        scores), detached 0-dim.

    Raises:
        TrainingError: the scores are not 1-D of one length.
    """
    _same_1d(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = chosen_scores.float() - rejected_scores.float()
    losses = -F.logsigmoid(diff)
    chosen, rejected = chosen_scores.detach().float(), rejected_scores.detach().float()
    metrics = {
        "accuracy": (diff.detach() > 0).float().mean(),
        "margin": diff.detach().mean(),
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
    }
    return PreferenceLoss(losses.mean(), losses, chosen, rejected, metrics)


__all__ = [
    "AVERAGED_LOSSES",
    "PREF_LOSSES",
    "REFERENCE_FREE_LOSSES",
    "PreferenceLoss",
    "PreferenceLossConfig",
    "kto_kl",
    "kto_loss",
    "last_kept_positions",
    "last_token_scores",
    "length_desensitized_weights",
    "log1mexp",
    "pairwise_preference_loss",
    "reward_pairwise_loss",
    "sequence_logps",
]
