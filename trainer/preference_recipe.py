"""Preference training (``stage: dpo``): :class:`FinetuneRecipe`'s run with ranking pairs and a preference loss.

Everything that is not about pairs is the SFT recipe's, unchanged: the process group, DDP / FSDP2 / QLoRA, the
optimizer and schedule, gradient accumulation, checkpoints and exact resume, logging. What differs::

    data       trainer.data (stage dpo): pair i at rows 2i (chosen) and 2i + 1 (rejected) of the store;
               PairStore indexes pairs, so the sampler, the val_size split and resume count pairs
    batch      collate_pairs: [chosen_1 .. chosen_B, rejected_1 .. rejected_B] padded rows, one forward
    policy     per-sequence log-probabilities through the chunked head (trainer.preference_loss.sequence_logps;
               never the whole [2B, seq_len, vocab] logits), or from the whole logits where the chunked loss is off
    reference  under no_grad: ref_model (a second model, frozen, ref_model_adapters merged, 4/8-bit), else
               the model as training starts, without a second copy of the weights: the LoRA adapter disabled,
               or, continuing an SFT adapter (adapter_name_or_path), that adapter loaded a second time, frozen,
               as peft adapter "reference" (pref_reference: no_adapter: disabled, as LLaMA-Factory); none for
               orpo and simpo
    loss       trainer.preference_loss.pairwise_preference_loss, summed over the micro-batch's pairs and divided
               by the global batch's pair count (all-reduced before any backward), times world_size (DDP averages)
    metrics    rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
               logps/rejected: means over the pairs of the logged steps, all ranks; eval_ prefixed on eval

Dropout is switched off in the whole model (LoRA's included), as LLaMA-Factory (trl's ``disable_dropout``) does:
the policy's and the reference's log-probabilities must come from the same function of the weights.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.errors import TrainingError
from trainer.batching import collate
from trainer.loss import IGNORE_INDEX, ChunkedHead, loss_positions
from trainer.modeling import autocast
from trainer.preference_loss import (
    PreferenceLoss,
    PreferenceLossConfig,
    length_desensitized_weights,
    pairwise_preference_loss,
    sequence_logps,
)
from trainer.recipe import FinetuneRecipe, TrainReport
from trainer.vision import add_image_inputs

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.data import Example, ExampleStore
    from trainer.vision import ImageProcessing

#: The metrics a pair loss reports (trl's and LLaMA-Factory's names), logged as window means over pairs.
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

#: The peft adapter name of the frozen copy of a continued SFT adapter, the reference (``pref_reference: start``).
REFERENCE_ADAPTER = "reference"

#: Batch keys of :func:`collate_pairs` that are no model input.
_NOT_INPUTS = ("labels", "num_tokens", "loss_positions", "label_counts", "pairs", "pair_index")


class PairStore(Sequence):
    """The ranking pairs of an :class:`~trainer.data.ExampleStore` that holds pair ``i`` at rows ``2i`` (chosen)
    and ``2i + 1`` (rejected): ``store[i]`` is ``(chosen, rejected)``, two example dicts; the chosen one also
    holds ``pair_index``, ``offset + i`` (where the pair's precomputed reference log-probabilities are: the eval
    pairs follow the train pairs)."""

    def __init__(self, rows: ExampleStore, offset: int = 0) -> None:
        if len(rows) % 2:
            raise TrainingError(f"a pair store needs an even number of rows, got {len(rows)}")
        self.rows = rows
        self.offset = offset

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return {**self.rows[2 * index], "pair_index": self.offset + index}, self.rows[2 * index + 1]

    def lengths(self) -> list[int]:
        """Each pair's longer row (tokens): what its padded rows in a micro-batch cost."""
        rows = self.rows.lengths()
        return [max(rows[2 * i], rows[2 * i + 1]) for i in range(len(self))]


def collate_pairs(
    pairs: list[tuple[Example, Example]],
    pad_token_id: int,
    images: ImageProcessing | None = None,
    image_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """One micro-batch of ``B`` pairs as ``2B`` padded rows, the chosen first: ``input_ids``, ``labels``,
    ``position_ids``, ``attention_mask`` (``[2B, seq_len]``, :func:`trainer.batching.collate`), ``num_tokens``
    (non-padding tokens, int64 scalar), ``loss_positions`` (:func:`trainer.loss.loss_positions`), ``label_counts``
    (``[2B]`` int64: labelled tokens of each row, the shift included), ``pairs`` (``B``, int64 scalar) and, when
    the chosen examples hold it (:class:`PairStore`), ``pair_index`` (``[B]`` int64). Image rows (``images``,
    ``image_token_id``): also ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` of every row's images
    in row order (a pair's images twice: its chosen and its rejected row each see them), as
    :func:`trainer.batching.collate_with_token_count`. A module-level function (picklable for
    ``dataloader_num_workers > 0``).

    Raises:
        ValueError: no pairs; images without ``images`` / ``image_token_id``.
        DataError: an image of the batch cannot be read.
    """
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    rows = [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]
    batch = collate(rows, pad_token_id)
    labels = batch["labels"]
    batch["num_tokens"] = torch.tensor(sum(len(r["input_ids"]) for r in rows), dtype=torch.int64)
    batch["loss_positions"] = loss_positions(labels)
    batch["label_counts"] = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
    batch["pairs"] = torch.tensor(len(pairs), dtype=torch.int64)
    if all("pair_index" in chosen for chosen, _ in pairs):
        batch["pair_index"] = torch.tensor([chosen["pair_index"] for chosen, _ in pairs], dtype=torch.int64)
    add_image_inputs(batch, rows, images, image_token_id)
    return batch


def whole_logits_logps(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-row summed log-probability (fp32 ``[rows]``, nats) of the labelled tokens from the whole logits
    ``[rows, seq_len, vocab]`` (labels unshifted: position ``t - 1`` predicts ``labels[:, t]``); ``weights``:
    optional ``[rows, seq_len]`` token weights aligned with ``labels``. The fallback of models whose logits the
    chunked head cannot produce."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logps.gather(2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    if weights is not None:
        picked = picked * weights[:, 1:]
    return picked.sum(dim=1)


class PreferenceRecipe(FinetuneRecipe):
    """:class:`FinetuneRecipe` for ``stage: dpo`` (see the module docstring for what changes).

    Raises:
        ConfigError, NotInstalledError, DataError, TrainingError: as :class:`FinetuneRecipe`.
    """

    #: The metrics this stage logs (window means over pairs); stage rm's recipe logs its own.
    metric_names: tuple[str, ...] = PAIR_METRICS

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.pref = PreferenceLossConfig(
            pref_loss=cfg.pref_loss,
            pref_beta=cfg.pref_beta,
            pref_ftx=cfg.pref_ftx,
            dpo_label_smoothing=cfg.dpo_label_smoothing,
            simpo_gamma=cfg.simpo_gamma,
            ld_alpha=cfg.ld_alpha,
        )
        self._window: torch.Tensor | None = None  # [pairs, *PAIR_METRICS sums] since the last logged step
        self.ref_table: torch.Tensor | None = None  # precompute_ref_log_probs: [pairs, 2], see _precompute_reference

    # ------------------------------------------------------------------ model: no dropout, no one-row batches

    def setup_model(self) -> None:
        """The SFT recipe's model (with the reference adapter, :meth:`_wrap_model`), then every dropout off
        (LLaMA-Factory's ``disable_dropout``)."""
        super().setup_model()
        for module in self.peft_model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0

    def _wrap_model(self) -> torch.nn.Module:
        """The reference (:meth:`_load_ref_model`, else :meth:`_load_reference_adapter`) is set up before the DDP
        wrapper."""
        self.ref_model, self.ref_head = self._load_ref_model()
        self.reference_adapter = self._load_reference_adapter()
        return super()._wrap_model()

    def _load_ref_model(self) -> tuple[Any, ChunkedHead | None]:
        """``ref_model``: the explicit reference on this rank's device, frozen, in eval mode, with
        ``ref_model_adapters`` merged into it (peft's ``merge_and_unload``) and in 4/8 bits with
        ``ref_model_quantization_bit`` (bitsandbytes, as QLoRA loads a base); with its own chunked head (the
        same start-up probe as the policy's) where the policy's is chunked. ``(None, None)`` without the key.

        Raises:
            NotInstalledError: ``ref_model`` is neither a folder nor an installed repo id.
            ConfigError: its vocabulary differs from the policy's, or an adapter folder holds no adapter.
        """
        cfg, env = self.cfg, self.env
        if cfg.ref_model is None or not self.pref.uses_reference:
            return None, None
        from ferry.errors import ConfigError
        from ferry.hub import resolve_model
        from trainer.loss import setup_head
        from trainer.modeling import _base_model

        folder = resolve_model(cfg.ref_model)
        # the policy's own loader: dtype, attention kernel, remote code, and 4/8 bits as QLoRA loads a base
        as_ref = cfg.model_copy(update={"quantization_bit": cfg.ref_model_quantization_bit})
        model: Any = _base_model(as_ref, folder, device=env.device, dtype=self.dtype, meta=False, vocab=None)
        if cfg.ref_model_adapters:
            from trainer.lf_compat import stack_adapters

            model, _ = stack_adapters(model, cfg.ref_model_adapters, create_new_adapter=True, trainable=False)
        model.config.use_cache = False
        model.eval()
        model.requires_grad_(False)
        policy_rows = self.peft_model.get_input_embeddings().weight.shape[0]
        ref_rows = model.get_input_embeddings().weight.shape[0]
        if ref_rows != policy_rows:
            raise ConfigError(
                f"ref_model: {cfg.ref_model} has {ref_rows} token embeddings, the policy "
                f"{cfg.model_name_or_path} {policy_rows}: the reference must share the policy's vocabulary"
            )
        head = None
        if self.head is not None:
            amp = autocast(env.device, self.dtype)
            head = setup_head(model, env.device, amp, False, env.is_main, dtype=self.dtype, fallbacks=self.fallbacks)
        if env.is_main:
            where = "" if str(folder) == cfg.ref_model else f" ({folder})"  # a repo id, a relative path, a link
            print(f"ferry: reference model: ref_model {cfg.ref_model}{where}", file=sys.stderr)
        return model, head

    def _load_reference_adapter(self) -> str | None:
        """When the run continues an SFT adapter (``adapter_name_or_path`` without ``create_new_adapter``) and
        the loss has a reference: that adapter again, frozen, as peft adapter :data:`REFERENCE_ADAPTER`, so
        that the reference is the SFT model the run starts from, not the base without it (with
        ``pref_reference: no_adapter`` it is the base, as in LLaMA-Factory). Rank 0 says which in one line.
        Returns the adapter's name, or None where disabling the trained adapter gives the reference."""
        cfg = self.cfg
        if not (cfg.adapter_name_or_path and self.pref.uses_reference) or cfg.create_new_adapter or cfg.ref_model:
            return None
        from ferry.adapter_folder import adapter_folder

        sft = adapter_folder(cfg.adapter_name_or_path[-1])
        if cfg.pref_reference == "no_adapter":
            if self.env.is_main:
                print(
                    f"ferry: reference model: the base without the adapter {sft} that this run continues "
                    f"(pref_reference: no_adapter)",
                    file=sys.stderr,
                )
            return None
        trainable = {n for n, p in self.peft_model.named_parameters() if p.requires_grad}
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            self.peft_model.load_adapter(str(sft), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        self.peft_model.to(self.env.device)
        now = {n for n, p in self.peft_model.named_parameters() if p.requires_grad}
        if now != trainable or self.peft_model.active_adapter == REFERENCE_ADAPTER:
            raise TrainingError(f"{sft}: loading it as the frozen reference adapter changed what trains")
        if self.env.is_main:
            print(
                f"ferry: reference model: the model this run starts from, the adapter {sft} included "
                f"(pref_reference: no_adapter takes the base without it)",
                file=sys.stderr,
            )
        return REFERENCE_ADAPTER

    def _probe_one_row(self) -> None:
        """Pairs run as padded rows: no packed or padding-free rows, so no probe."""
        self.cross_sample_attention = False
        self.one_row_ok = False

    # ------------------------------------------------------------------ data

    def _collate(self) -> Any:
        from functools import partial

        return partial(
            collate_pairs,
            pad_token_id=int(self.tokenizer.pad_token_id),
            images=self.images,
            image_token_id=self.image_token_id,
        )

    def _train_set(self) -> PairStore:
        return PairStore(self.data.train)

    def _eval_set(self) -> PairStore:
        return PairStore(self.data.eval, offset=len(self.data.train) // 2)

    def setup_loaders(self) -> None:
        """The SFT recipe's loaders, then, with ``precompute_ref_log_probs``, the reference's log-probabilities
        of every pair (:meth:`_precompute_reference`)."""
        super().setup_loaders()
        if self.cfg.precompute_ref_log_probs and self.pref.uses_reference:
            self._precompute_reference()

    @torch.no_grad()
    def _precompute_reference(self) -> None:
        """trl's ``precompute_ref_log_probs``: the reference's log-probabilities of every train and eval pair,
        once, into :attr:`ref_table` (fp32 ``[train pairs + eval pairs, 2]`` on every rank: column 0 the chosen
        (kto: judged) row, column 1 the rejected (kto: KL) row, indexed by ``pair_index``). Each rank computes
        ``rank, rank + world_size, ...`` of each set in batches of ``precompute_ref_batch_size`` (default
        ``per_device_eval_batch_size``; under FSDP every rank runs as many forwards, :meth:`_eval_batches`), one
        all-reduce joins them. ``ref_model`` is freed afterwards: the steps never run the reference again."""
        from torch.utils.data import DataLoader

        from trainer.batching import ShardSampler

        cfg, env = self.cfg, self.env
        started = time.perf_counter()
        sets = [self._train_set(), self.eval_set]
        table = torch.zeros(sum(len(p) for p in sets), 2, dtype=torch.float32, device=env.device)
        was_training = self.peft_model.training
        self.peft_model.eval()
        for pairs in sets:
            if not len(pairs):
                continue
            loader = DataLoader(
                cast("Any", pairs),
                sampler=ShardSampler(len(pairs), env.rank, env.world_size),
                batch_size=cfg.precompute_ref_batch_size or cfg.per_device_eval_batch_size,
                collate_fn=self._collate(),
            )
            for batch, counted in self._eval_batches(loader, pairs):
                rows = self._reference_pairs(batch)
                if counted:
                    table[batch["pair_index"].to(env.device)] = rows
        self.peft_model.train(was_training)
        self.ref_table = env.all_reduce_sum(table)
        freed = self.ref_model is not None
        if freed:
            self.ref_model, self.ref_head = None, None
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
        if env.is_main:
            print(
                f"ferry: reference log-probabilities of {len(table)} pairs precomputed in "
                f"{time.perf_counter() - started:.1f} s (precompute_ref_log_probs"
                f"{'; ref_model freed' if freed else ''})",
                file=sys.stderr,
            )

    def _reference_pairs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The reference's fp32 ``[B, 2]`` log-probabilities of a collated batch's pairs (chosen, rejected)."""
        labels, positions, inputs = self._moved(batch)
        reference = self._reference_logps(inputs, labels, positions)
        assert reference is not None  # only losses with a reference precompute
        n = int(batch["pairs"])
        return torch.stack([reference[:n], reference[n:]], dim=1)

    def _precomputed(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The ``[B, 2]`` rows of :attr:`ref_table` for the batch's pairs, or None without a table."""
        if self.ref_table is None:
            return None
        return self.ref_table[batch["pair_index"].to(self.env.device)]

    # ------------------------------------------------------------------ log-probabilities

    def _sequence_logps(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        labels: torch.Tensor,
        positions: torch.Tensor,
        weights: torch.Tensor | None = None,
        head: ChunkedHead | None | str = "policy",
    ) -> torch.Tensor:
        """fp32 ``[2B]`` summed log-probabilities of each row's labelled tokens under ``model``: the chunked head
        (``head``; "policy": the policy's) computes them inside the model's forward (so DDP sees them as its
        output), else (None) the whole logits."""
        amp = autocast(self.env.device, self.dtype)
        chunked = self.head if head == "policy" else head
        if not isinstance(chunked, ChunkedHead):
            with amp:
                logits = model(**inputs).logits
            return whole_logits_logps(logits, labels, weights)
        module = chunked.module
        original = type(module).forward.__get__(module)
        chunk_tokens = chunked.chunk_tokens

        def head_forward(hidden: torch.Tensor) -> torch.Tensor:
            logps, _ = sequence_logps(
                original, hidden, labels, chunk_tokens=chunk_tokens, token_weights=weights, positions=positions
            )
            return logps.reshape(-1, 1, 1)

        module.forward = head_forward
        try:
            with amp:
                out = model(**inputs)
        finally:
            del module.forward
        if out.logits.shape != (labels.size(0), 1, 1):
            raise TrainingError(
                f"the model changed its head's output (got logits {tuple(out.logits.shape)}): the chunked "
                f"log-probabilities do not apply to it"
            )
        return out.logits.reshape(-1).float()

    @torch.no_grad()
    def _reference_logps(
        self, inputs: dict[str, torch.Tensor], labels: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The reference's ``[2B]`` log-probabilities: ``ref_model``'s, the policy's with its adapter disabled, or
        through the frozen :data:`REFERENCE_ADAPTER` (peft's ``adapter_names`` forward, which needs eval mode;
        dropout is off anyway); None for orpo / simpo. On the unwrapped model: no gradient, so no DDP hook is
        involved."""
        if not self.pref.uses_reference:
            return None
        if self.ref_model is not None:
            return self._sequence_logps(self.ref_model, inputs, labels, positions, head=self.ref_head)
        if self.reference_adapter is None:
            with self.peft_model.disable_adapter():
                return self._sequence_logps(self.peft_model, inputs, labels, positions)
        rows = labels.size(0)
        was_training = self.peft_model.training
        self.peft_model.eval()
        try:
            routed: dict[str, Any] = {**inputs, "adapter_names": [self.reference_adapter] * rows}
            return self._sequence_logps(self.peft_model, routed, labels, positions)
        finally:
            self.peft_model.train(was_training)

    def _moved(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(labels, loss_positions, model inputs)`` of a :func:`collate_pairs` batch, on the device."""
        device = self.env.device
        labels = batch["labels"].to(device, non_blocking=True)
        positions = batch["loss_positions"].to(device, non_blocking=True)
        inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k not in _NOT_INPUTS}
        return labels, positions, inputs

    def _pair_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> PreferenceLoss:
        """The preference loss of one micro-batch (its ``losses`` per pair)."""
        labels, positions, inputs = self._moved(batch)
        counts = batch["label_counts"].to(self.env.device, non_blocking=True)
        n = int(batch["pairs"])
        table = self._precomputed(batch)
        if table is not None:
            reference: torch.Tensor | None = torch.cat([table[:, 0], table[:, 1]])
        else:
            reference = self._reference_logps(inputs, labels, positions)
        weights = None
        if self.pref.ld_alpha is not None:
            weights = length_desensitized_weights(labels, self.pref.ld_alpha)
        policy = self._sequence_logps(model, inputs, labels, positions, weights)
        return pairwise_preference_loss(
            self.pref,
            policy[:n],
            policy[n:],
            counts[:n],
            counts[n:],
            reference[:n] if reference is not None else None,
            reference[n:] if reference is not None else None,
        )

    @property
    def metric_width(self) -> int:
        """The length of :meth:`_metric_sums`' vector."""
        return 1 + len(self.metric_names)

    def _pair_loss_sum(self, result: PreferenceLoss, pairs: int) -> torch.Tensor:
        """The micro-batch's loss summed over its ``pairs`` (fp32 scalar, with grad): the per-pair losses'."""
        return result.losses.sum()

    def _metric_means(self, totals: list[float]) -> dict[str, float]:
        """:attr:`metric_names` means from summed :meth:`_metric_sums` (``totals[0]`` the pair count)."""
        pairs = max(totals[0], 1.0)
        return {name: value / pairs for name, value in zip(self.metric_names, totals[1:])}

    def _metric_sums(self, result: PreferenceLoss, pairs: int) -> torch.Tensor:
        """``[pairs, *metric_names]`` as sums over the micro-batch's pairs (float64, on the device)."""
        values = [result.metrics[name].double() * pairs for name in self.metric_names]
        return torch.stack([torch.tensor(float(pairs), dtype=torch.float64, device=values[0].device), *values])

    # ------------------------------------------------------------------ the step

    def _optimizer_step(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's ``micro_batches`` of pairs: the gradient of the mean pair loss of
        the whole global batch (each micro-batch's summed pair losses divided by the global pair count,
        all-reduced first, times world_size). Returns as :meth:`FinetuneRecipe._optimizer_step`: this rank's
        share of the step's mean pair loss, the global batch's non-padding tokens, the gradient norm."""
        env = self.env
        local = [
            float(sum(int(mb["pairs"]) for mb in micro_batches)),
            float(sum(int(mb["num_tokens"]) for mb in micro_batches)),
        ]
        counts = env.all_reduce_sum(env.from_host(torch.tensor(local, dtype=torch.float64)))
        denom = counts[0].clamp(min=1.0)
        scale = (env.world_size / denom).float()
        loss_share = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, batch in enumerate(micro_batches):
            with self._micro_context(i, len(micro_batches)):
                result = self._pair_loss(self.model, batch)
                loss_sum = self._pair_loss_sum(result, int(batch["pairs"]))
                self.scaler.scale(loss_sum * scale).backward()
            loss_share += loss_sum.detach().double() / denom
            sums = self._metric_sums(result, int(batch["pairs"]))
            self._window = sums if self._window is None else self._window + sums
        return loss_share, counts[1], self._apply_update()

    def _window_metrics(self) -> dict[str, float]:
        """The :attr:`metric_names` means over the pairs of every rank since the last logged step."""
        if self._window is None:
            return {}
        totals = self.env.all_reduce_sum(self._window).tolist()
        self._window = None
        return self._metric_means(totals)

    # ------------------------------------------------------------------ evaluate

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """The mean pair loss and the :attr:`metric_names` over the eval pairs of every rank (on the unwrapped
        model), logged as ``eval_loss`` and ``eval_rewards/...``. Returns ``(eval_loss, nan)``: there is no
        perplexity of a preference loss."""
        env = self.env
        module = self.peft_model
        module.eval()
        sums = torch.zeros(1 + self.metric_width, dtype=torch.float64, device=env.device)
        for batch, counted in self._eval_batches():
            result = self._pair_loss(module, batch)
            if counted:
                pairs = int(batch["pairs"])
                sums[0] += self._pair_loss_sum(result, pairs).detach().double()
                sums[1:] += self._metric_sums(result, pairs)
        env.all_reduce_sum(sums)
        module.train()
        totals = sums.tolist()
        pairs = max(totals[1], 1.0)
        eval_loss = totals[0] / pairs
        if self.eval_loss_first is None:
            self.eval_loss_first = eval_loss
        self.eval_loss_last, self.eval_ppl_last = eval_loss, None
        if env.is_main:
            row: dict[str, Any] = {"step": self.global_step, "eval_loss": eval_loss, "eval_pairs": int(totals[1])}
            row.update({f"eval_{name}": value for name, value in self._metric_means(totals[1:]).items()})
            self.metrics.write(row)
        return eval_loss, math.nan

    # ------------------------------------------------------------------ finish

    def _report(self) -> TrainReport:
        """The SFT recipe's report with pairs counted as samples and the stage named."""
        report = super()._report()
        report.num_train_samples = len(self.data.train) // 2
        report.num_eval_samples = len(self.data.eval) // 2
        report.stage = self.cfg.stage
        return report


__all__ = ["PAIR_METRICS", "PairStore", "PreferenceRecipe", "collate_pairs", "whole_logits_logps"]
