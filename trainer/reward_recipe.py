"""Reward-model training (``stage: rm``): a scalar value head over the LoRA model, trained on ranking pairs.

The pairs, their batches and the step are :class:`~trainer.preference_recipe.PreferenceRecipe`'s (pair ``i``'s
chosen and rejected rows in one forward, the loss summed over pairs and divided by the global pair count); what
differs::

    model      the LoRA model's backbone (``base_model``: the decoder without its LM head, so no logits at all)
               and a value head ``v_head``: dropout, then ``summary`` Linear(hidden_size, 1) in fp32, read at each
               row's last non-padding token (rows are right-padded)
    loss       trainer.preference_loss.reward_pairwise_loss: -log sigmoid(r_chosen - r_rejected) per pair
    metrics    accuracy (r_chosen > r_rejected), margin, rewards/chosen, rewards/rejected (means over pairs)
    saved      value_head.safetensors beside the adapter (and in each checkpoint), keys v_head.summary.weight
               [1, hidden_size] and v_head.summary.bias [1], fp32, as LLaMA-Factory writes it; a run that
               continues an adapter folder holding one starts from that head, as LLaMA-Factory does

The value head's dropout (p = 0.1, or the model config's ``summary_dropout_prob``) and LoRA's stay on while
training, as in LLaMA-Factory's rm stage; evaluation runs in eval mode.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.adapter_folder import VALUE_HEAD_FILE, VALUE_HEAD_KEYS, read_value_head
from ferry.errors import ConfigError, TrainingError
from trainer.modeling import autocast
from trainer.preference_loss import PreferenceLoss, last_kept_positions, reward_pairwise_loss
from trainer.preference_recipe import _NOT_INPUTS, PreferenceRecipe
from trainer.recipe import FinetuneRecipe

if TYPE_CHECKING:
    from trainer.config import TrainConfig


#: The metrics of the reward model (trl's RewardTrainer's names; the rewards split as DPO's are).
REWARD_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")

#: trl's ValueHead dropout when the model config names none (``summary_dropout_prob``).
DEFAULT_SUMMARY_DROPOUT = 0.1


class ValueHead(torch.nn.Module):
    """``dropout`` then ``summary`` (``Linear(hidden_size, 1)``, fp32 weights): the scalar score of a hidden state.

    ``forward(hidden)``: ``hidden`` ``[rows, hidden_size]`` of any float dtype, cast to fp32 outside autocast;
    returns fp32 ``[rows]``.
    """

    def __init__(self, hidden_size: int, dropout: float = DEFAULT_SUMMARY_DROPOUT) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout)
        self.summary = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return self.summary(self.dropout(hidden.float())).squeeze(-1)

    def state_for_file(self) -> dict[str, torch.Tensor]:
        """The head as :data:`VALUE_HEAD_FILE` holds it (fp32 CPU tensors under :data:`VALUE_HEAD_KEYS`)."""
        weight, bias = VALUE_HEAD_KEYS
        return {
            weight: self.summary.weight.detach().float().cpu().contiguous(),
            bias: self.summary.bias.detach().float().cpu().contiguous(),
        }

    @torch.no_grad()
    def load_file(self, folder: Path) -> None:
        """Load ``folder``'s :data:`VALUE_HEAD_FILE` into the head.

        Raises:
            ConfigError: the file is unreadable, lacks a key or has the wrong shapes (names the file).
        """
        tensors = read_value_head(folder, self.summary.in_features)
        if tensors is None:
            raise ConfigError(f"{folder / VALUE_HEAD_FILE} is missing")
        self.summary.weight.copy_(tensors["weight"])
        self.summary.bias.copy_(tensors["bias"])


def last_token_values(hidden: torch.Tensor, attention_mask: torch.Tensor, head: ValueHead) -> torch.Tensor:
    """The head's score of each row's last kept token (:func:`~trainer.preference_loss.last_kept_positions`):
    ``hidden`` ``[rows, seq_len, hidden_size]``, ``attention_mask`` ``[rows, seq_len]``; returns fp32 ``[rows]``.
    Only those ``rows`` hidden states go through the head (never a ``[rows, seq_len]`` fp32 copy).

    Raises:
        TrainingError: a row without tokens.
    """
    last = last_kept_positions(attention_mask)
    picked = hidden[torch.arange(hidden.size(0), device=hidden.device), last]  # [rows, hidden_size]
    return head(picked)


class _ScoreForward(torch.nn.Module):
    """What DDP wraps for stage rm: ``forward(input_ids, attention_mask, position_ids)`` runs the LoRA model's
    backbone and its value head (``peft_model.v_head``) and returns fp32 ``[rows]`` scores. It owns no
    parameter of its own: the peft model (with ``v_head``) is its only child."""

    def __init__(self, peft_model: torch.nn.Module, backbone: torch.nn.Module, amp: Any) -> None:
        super().__init__()
        self.peft_model = peft_model
        self._backbone = [backbone]  # not registered twice: it lives inside peft_model
        self._amp = amp

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        with self._amp:
            hidden = self._backbone[0](**inputs, use_cache=False).last_hidden_state
        head = cast("ValueHead", self.peft_model.v_head)
        return last_token_values(hidden, inputs["attention_mask"], head)


class RewardRecipe(PreferenceRecipe):
    """:class:`PreferenceRecipe` for ``stage: rm`` (see the module docstring for what changes).

    Raises:
        ConfigError: the model has no backbone to score with, or a value head file does not fit it.
        NotInstalledError, DataError, TrainingError: as :class:`FinetuneRecipe`.
    """

    metric_names = REWARD_METRICS

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.value_head_from: Path | None = None

    def setup_model(self) -> None:
        """The SFT recipe's model (dropout stays on, as LLaMA-Factory's rm stage keeps it), with the value head
        attached before the DDP wrapper (:meth:`_wrap_model`)."""
        FinetuneRecipe.setup_model(self)

    def _setup_loss_head(self) -> None:
        """No LM head runs: the scores come from the backbone's last hidden states."""
        self.head = None

    def _wrap_model(self) -> torch.nn.Module:
        """``peft_model.v_head`` (:class:`ValueHead`, on this rank's device): from a resumed checkpoint's
        :data:`VALUE_HEAD_FILE`, else from the continued adapter folder's, else freshly drawn; then DDP over
        :class:`_ScoreForward` (DDP broadcasts rank 0's head to every rank)."""
        env = self.env
        hf: Any = self.peft_model.get_base_model()
        backbone = getattr(hf, "base_model", None)
        if backbone is None or backbone is hf:
            raise ConfigError(
                f"model_name_or_path: {type(hf).__name__} has no backbone (base_model) under its LM head, which "
                f"a reward model scores with"
            )
        dropout = getattr(hf.config, "summary_dropout_prob", None)
        dropout = DEFAULT_SUMMARY_DROPOUT if dropout is None else float(dropout)
        head = ValueHead(int(hf.config.get_text_config().hidden_size), dropout)
        source = self._value_head_source()
        if source is not None:
            head.load_file(source)
        self.value_head_from = source
        self.peft_model.v_head = head.to(env.device)
        self.score_model = _ScoreForward(self.peft_model, backbone, autocast(env.device, self.dtype))
        if env.is_main:
            where = f"from {source / VALUE_HEAD_FILE}" if source is not None else "new (nn.Linear's initialisation)"
            print(f"ferry: value head: {where}", file=sys.stderr)
        return self._ddp(self.score_model) if env.initialized else self.score_model

    def _value_head_source(self) -> Path | None:
        """The folder whose :data:`VALUE_HEAD_FILE` to start from: the resumed checkpoint (which must hold one),
        else the last continued adapter folder when it holds one, else None."""
        if self.loaded is not None:
            if not (self.loaded.path / VALUE_HEAD_FILE).is_file():
                raise TrainingError(
                    f"{self.loaded.path / VALUE_HEAD_FILE} is missing: checkpoint {self.loaded.path} cannot resume "
                    f"a reward model"
                )
            return self.loaded.path
        if self.cfg.adapter_name_or_path:
            from ferry.adapter_folder import adapter_folder

            folder = adapter_folder(self.cfg.adapter_name_or_path[-1])
            if (folder / VALUE_HEAD_FILE).is_file():
                return folder
        return None

    def _adapter_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """The value head, written beside the adapter and into each checkpoint."""
        return {VALUE_HEAD_FILE: self.peft_model.v_head.state_for_file()}

    def _pair_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> PreferenceLoss:
        """The pairwise loss of one micro-batch: ``model`` is the DDP wrapper, or the peft model (evaluation),
        which scores through the unwrapped :class:`_ScoreForward`."""
        env = self.env
        inputs = {k: v.to(env.device, non_blocking=True) for k, v in batch.items() if k not in _NOT_INPUTS}
        scorer = self.score_model if model is self.peft_model else model
        scores = scorer(**inputs)
        n = int(batch["pairs"])
        return reward_pairwise_loss(scores[:n], scores[n:])


__all__ = [
    "REWARD_METRICS",
    "RewardRecipe",
    "ValueHead",
    "last_token_values",
]
