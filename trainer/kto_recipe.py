"""KTO (``stage: kto``): :class:`~trainer.preference_recipe.PreferenceRecipe`'s run on feedback rows.

Each sample is one judged reply (desirable or undesirable: LLaMA-Factory's ``kto_tag``) and its KL row (the same
prompt with another row's reply, :func:`trainer.preference_data.kl_partners`); the store holds them at rows ``2i``
and ``2i + 1``, so the sampler, the ``val_size`` split and resume count samples as they count pairs. What differs
from stage dpo::

    batch      collate_feedback: the B judged rows and the B KL rows as two padded sub-batches, kto_tags [B]
    forwards   the policy on the judged rows (with grad, through DDP); under no_grad the policy on the KL rows and
               the reference (the same choices as dpo: ref_model, the disabled adapter or the frozen SFT adapter)
               on both
    KL         trainer.preference_loss.kto_kl of the KL rows, averaged over the ranks (one all-reduce per
               micro-batch, as trl's KTOTrainer gathers it), detached; evaluation uses each eval batch's own
    loss       trainer.preference_loss.kto_loss (Ethayarajh et al. 2024, eq. 7; kto_chosen_weight,
               kto_rejected_weight, pref_ftx), its batch mean times the batch's sample count summed over the
               global batch and divided by its sample count
    metrics    kl, rewards/chosen, rewards/rejected, logps/chosen, logps/rejected (means over the samples of each
               kind), rewards/margins (chosen minus rejected)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from trainer.batching import collate
from trainer.loss import IGNORE_INDEX, loss_positions
from trainer.preference_loss import PreferenceLoss, kto_kl, kto_loss
from trainer.preference_recipe import PreferenceRecipe
from trainer.vision import add_image_inputs

#: The metrics of stage kto (trl's KTOTrainer's names).
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins")


def _rows(
    examples: list[dict[str, Any]], pad_token_id: int, images: Any = None, image_token_id: int | None = None
) -> dict[str, torch.Tensor]:
    batch = collate([{k: e[k] for k in ("input_ids", "labels", "position_ids")} for e in examples], pad_token_id)
    batch["loss_positions"] = loss_positions(batch["labels"])
    batch["label_counts"] = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    add_image_inputs(batch, examples, images, image_token_id)
    return batch


def collate_feedback(
    samples: list[tuple[dict[str, Any], dict[str, Any]]],
    pad_token_id: int,
    images: Any = None,
    image_token_id: int | None = None,
) -> dict[str, Any]:
    """One micro-batch of ``B`` feedback samples: ``judged`` and ``kl``, each a padded sub-batch (``input_ids``,
    ``labels``, ``position_ids``, ``attention_mask`` ``[B, seq_len]``, ``loss_positions``, ``label_counts``
    ``[B]``); ``kto_tags`` bool ``[B]`` (True: desirable); ``pairs`` (``B``) and ``num_tokens`` (the judged and KL
    rows' tokens), int64 scalars; ``pair_index`` (``[B]`` int64) when the judged rows hold it
    (:class:`~trainer.preference_recipe.PairStore`). Image rows (``images``: :class:`trainer.vision.ImageProcessing`,
    ``image_token_id``): each sub-batch also carries ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``
    (a row's KL partner sees the row's images) and no ``position_ids``. A module-level function (picklable for
    DataLoader workers).

    Raises:
        ValueError: no samples, a judged row without a 0/1 ``kto_tag``, images without ``images`` /
            ``image_token_id``.
        DataError: an image of the batch cannot be read.
    """
    if not samples:
        raise ValueError("collate_feedback needs at least one sample")
    judged, kl = [j for j, _ in samples], [k for _, k in samples]
    if any(j.get("kto_tag") not in (0, 1) for j in judged):
        raise ValueError("collate_feedback: every judged row needs a kto_tag of 0 or 1")
    batch = {
        "judged": _rows(judged, pad_token_id, images, image_token_id),
        "kl": _rows(kl, pad_token_id, images, image_token_id),
        "kto_tags": torch.tensor([bool(j["kto_tag"]) for j in judged]),
        "pairs": torch.tensor(len(samples), dtype=torch.int64),
        "num_tokens": torch.tensor(sum(len(e["input_ids"]) for e in judged + kl), dtype=torch.int64),
    }
    if all("pair_index" in j for j in judged):
        batch["pair_index"] = torch.tensor([j["pair_index"] for j in judged], dtype=torch.int64)
    return batch


class KTORecipe(PreferenceRecipe):
    """:class:`PreferenceRecipe` for ``stage: kto`` (see the module docstring for what changes).

    Raises:
        ConfigError, NotInstalledError, DataError, TrainingError: as :class:`PreferenceRecipe`.
    """

    metric_names = KTO_METRICS

    @property
    def metric_width(self) -> int:
        """:meth:`_metric_sums`: samples, kl, then per kind its count and summed rewards and logps."""
        return 8

    def _collate(self) -> Any:
        return partial(
            collate_feedback,
            pad_token_id=int(self.tokenizer.pad_token_id),
            images=self.images,
            image_token_id=self.image_token_id,
        )

    def _part(self, part: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(model inputs, labels, loss_positions)`` of the judged or the KL sub-batch, on the device."""
        inputs = {k: v.to(self.env.device, non_blocking=True) for k, v in part.items()}
        labels, positions = inputs.pop("labels"), inputs.pop("loss_positions")
        inputs.pop("label_counts")
        return inputs, labels, positions

    @torch.no_grad()
    def _reference_pairs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The reference's fp32 ``[B, 2]`` log-probabilities of a batch's judged and KL rows."""
        reference = self._reference_logps(*self._part(batch["judged"]))
        reference_kl = self._reference_logps(*self._part(batch["kl"]))
        assert reference is not None and reference_kl is not None  # kto always has a reference
        return torch.stack([reference, reference_kl], dim=1)

    def _pair_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> PreferenceLoss:
        """KTO's loss of one micro-batch; ``model`` is the DDP wrapper while training (the KL is then averaged
        over the ranks), the peft model while evaluating (each rank's batch its own KL)."""
        env = self.env
        judged, kl_rows = self._part(batch["judged"]), self._part(batch["kl"])
        with torch.no_grad():
            policy_kl = self._sequence_logps(self.peft_model, *kl_rows)
            table = self._precomputed(batch)
            reference: torch.Tensor | None = table[:, 0] if table is not None else self._reference_logps(*judged)
            reference_kl = table[:, 1] if table is not None else self._reference_logps(*kl_rows)
        assert reference is not None and reference_kl is not None  # kto always has a reference
        kl = kto_kl(policy_kl, reference_kl)
        if model is not self.peft_model and env.world_size > 1:
            kl = env.all_reduce_sum(kl.reshape(1).clone())[0] / env.world_size
        policy = self._sequence_logps(model, *judged)
        tags = batch["kto_tags"].to(env.device, non_blocking=True)
        counts = batch["judged"]["label_counts"].to(env.device, non_blocking=True)
        return kto_loss(self.pref, policy, reference, tags, kl, counts)

    def _pair_loss_sum(self, result: PreferenceLoss, pairs: int) -> torch.Tensor:
        """The batch mean (with ``pref_ftx``'s term) times the batch's sample count."""
        return result.loss * pairs

    def _metric_sums(self, result: PreferenceLoss, pairs: int) -> torch.Tensor:
        """``[samples, kl x samples, n_chosen, rewards/chosen sum, logps/chosen sum, n_rejected, rewards/rejected
        sum, logps/rejected sum]`` (float64, on the device)."""
        m = result.metrics
        device = m["kl"].device
        n_c, n_r = result.chosen_rewards.numel(), result.rejected_rewards.numel()
        zero = torch.zeros((), dtype=torch.float64, device=device)
        parts = [
            torch.tensor(float(pairs), dtype=torch.float64, device=device),
            m["kl"].double() * pairs,
            torch.tensor(float(n_c), dtype=torch.float64, device=device),
            result.chosen_rewards.double().sum(),
            m["logps/chosen"].double() * n_c if n_c else zero,
            torch.tensor(float(n_r), dtype=torch.float64, device=device),
            result.rejected_rewards.double().sum(),
            m["logps/rejected"].double() * n_r if n_r else zero,
        ]
        return torch.stack(parts)

    def _metric_means(self, totals: list[float]) -> dict[str, float]:
        """:data:`KTO_METRICS` from summed :meth:`_metric_sums`; a kind absent from every sample is left out."""
        samples, kl_sum, n_c, rc, lc, n_r, rr, lr = totals
        out = {"kl": kl_sum / max(samples, 1.0)}
        if n_c:
            out.update({"rewards/chosen": rc / n_c, "logps/chosen": lc / n_c})
        if n_r:
            out.update({"rewards/rejected": rr / n_r, "logps/rejected": lr / n_r})
        if n_c and n_r:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


__all__ = ["KTO_METRICS", "KTORecipe", "collate_feedback"]
