"""New tokens and a resized vocabulary: LLaMA-Factory's ``resize_vocab`` and ``add_special_tokens``
(``new_special_tokens`` before 0.9.5).

What a run with these keys does, in order::

    tokenizer ──add_special_tokens / new_special_tokens──> the listed tokens, special (ids after the vocabulary)
              ──template.fix_special_tokens──> the template's missing stop words / EOS (only with resize_vocab;
                                               without it the template is refused, as before)
    model     ──grow_embeddings──> rows = len(tokenizer) rounded up to a multiple of 64 (when the base has fewer
                                   rows; a base whose padded rows already hold the new ids keeps its size),
                                   each new row = the mean of the old rows (input embeddings and an untied head)
              ──untied embeddings: peft trainable_token_indices──> only the new rows of the input embeddings and
                                        of the head train (``VocabPlan.token_rows``: the added ids and every grown row)
              ──tied embeddings: peft modules_to_save──> the input embeddings and the output head trained fully,
                                        as LLaMA-Factory's ``resize_vocab`` does when ``additional_target`` is unset
    adapter/  ──+ tokenizer files (with the new tokens) + ferry_vocab.json (what was added, old and new rows)

LLaMA-Factory 0.9.5's semantics, kept: the listed tokens are added with ``add_tokens(..., special_tokens=True)``
before the template's; adding any of them turns ``resize_vocab`` on (with a warning); the embeddings grow only
when the tokenizer outgrows them, to a multiple of 64 (``resize_token_embeddings(pad_to_multiple_of=64)``); with
``additional_target`` unset and tied embeddings, the modules that hold the input embedding and the output head
become ``modules_to_save``. Differences: on an untied model only the new rows train (peft's
``trainable_token_indices``; LLaMA-Factory trains both matrices whole: the same new rows, the old rows frozen);
new rows are the plain mean of the old rows (transformers' ``mean_resizing``, without its tiny covariance-shaped
noise and without LLaMA-Factory's added noise of standard deviation ``1/sqrt(hidden_size)``), the same on every
rank, under DDP and FSDP, so both train the same model; an ``additional_target`` that leaves the new rows of the
embeddings or the head untrained is refused (LLaMA-Factory only warns).

``ferry export`` writes the grown ``embed_tokens`` / ``lm_head`` (trained rows from the adapter), ``vocab_size`` in
config.json and the adapter's tokenizer (with the new tokens); a tied base comes out untied (the two copies were
trained apart, as in LLaMA-Factory). To apply the adapter with peft yourself, grow the base first:
``base.resize_token_embeddings(rows)`` with ``rows`` from ``ferry_vocab.json`` (the adapter sets every new row).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.adapter_folder import write_vocab_record
from ferry.errors import ConfigError
from trainer.targets import PEFT_INFIXES, PEFT_PREFIX, lora_config_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainer.config import TrainConfig

logger = logging.getLogger("ferry.trainer.vocab")

#: LLaMA-Factory resizes with ``pad_to_multiple_of=64``.
PAD_TO_MULTIPLE_OF = 64


def listed_tokens(cfg: TrainConfig) -> list[str]:
    """``add_special_tokens`` (or its older name ``new_special_tokens``), empty names dropped."""
    return [t for t in (cfg.add_special_tokens or cfg.new_special_tokens or []) if t]


def add_listed_tokens(tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig) -> bool:
    """Add the config's listed tokens as special tokens (LLaMA-Factory's ``patch_tokenizer``). Returns whether the
    vocabulary grew, which turns ``resize_vocab`` on (with one warning when the config did not set it)."""
    tokens = listed_tokens(cfg)
    if not tokens:
        return False
    added = tokenizer.add_tokens(tokens, special_tokens=True)
    if added and not cfg.resize_vocab:
        logger.warning(
            "add_special_tokens added %d token(s) to the tokenizer: resize_vocab is turned on, as LLaMA-Factory does",
            added,
        )
    return added > 0


@dataclass
class VocabPlan:
    """How the vocabulary changes: ``added`` maps each token this run added to its id; ``base_rows`` / ``rows``
    are the embedding rows of the base and of the trained model (equal when the base's padded rows already hold
    the new ids); ``trained`` names the modules trained fully (peft ``modules_to_save``, last name components);
    ``token_rows``: the rows trained alone instead (peft ``trainable_token_indices``, untied embeddings)."""

    added: dict[str, int]
    base_rows: int
    rows: int
    trained: list[str] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)

    def new_rows(self) -> list[int]:
        """The added tokens' ids and every grown row (the padding to a multiple of 64 included), sorted."""
        return sorted(set(self.added.values()) | set(range(self.base_rows, self.rows)))

    @property
    def resized(self) -> bool:
        return self.rows != self.base_rows


def added_tokens(tokenizer: PreTrainedTokenizerBase, base_vocab: dict[str, int]) -> dict[str, int]:
    """Tokens ``tokenizer`` has that the base tokenizer's vocabulary ``base_vocab`` lacks, with their ids."""
    return {tok: i for tok, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]) if tok not in base_vocab}


def plan_vocab(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> VocabPlan | None:
    """The :class:`VocabPlan` of a run whose tokenizer (from :func:`trainer.data.load_tokenizer`) may hold new
    tokens; None when it holds none (nothing to resize or train).

    ``rows`` = ``len(tokenizer)`` rounded up to a multiple of 64 when that exceeds the base's ``vocab_size``
    (config.json), else the base's size.

    Raises:
        ConfigError: config.json has no ``vocab_size``.
    """
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=cfg.trust_remote_code, local_files_only=True)
    added = added_tokens(tokenizer, base.get_vocab())
    if not added:
        return None
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    base_rows = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    if not isinstance(base_rows, int):
        raise ConfigError(f"resize_vocab: {model_dir}/config.json states no vocab_size to resize")
    need = len(tokenizer)
    rows = math.ceil(need / PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF if need > base_rows else base_rows
    return VocabPlan(added=added, base_rows=base_rows, rows=rows)


def embedding_modules(model: PreTrainedModel) -> list[str]:
    """Last name components of the modules holding the input embeddings and the output head (LLaMA-Factory's
    rule for ``resize_vocab``'s ``additional_target``), e.g. ``["embed_tokens", "lm_head"]``."""
    wanted = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    names = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(module is w for w in wanted) and name.split(".")[-1] not in names:
            names.append(name.split(".")[-1])
    return names


def _tied(model: PreTrainedModel) -> bool:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and emb is not None and head.weight is emb.weight


def token_rows_trainable(model: PreTrainedModel) -> bool:
    """Whether peft's ``trainable_token_indices`` can train the new rows alone: untied input embeddings
    (``nn.Embedding``) and output head (``nn.Linear``). A tied model trains both fully (``modules_to_save``)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return isinstance(emb, torch.nn.Embedding) and isinstance(head, torch.nn.Linear) and not _tied(model)


def with_trained_embeddings(cfg: TrainConfig, model: PreTrainedModel, plan: VocabPlan) -> TrainConfig:
    """How the new rows train, decided on the model: with ``additional_target`` unset, an untied model trains only
    the new rows of its embeddings and head (``plan.token_rows``: peft ``trainable_token_indices``, see
    :func:`with_token_rows`); a tied one trains both fully, as LLaMA-Factory (``cfg`` returned with
    ``additional_target`` = their modules, ``plan.trained`` set).

    Raises:
        ConfigError: ``additional_target`` is set and leaves the embeddings or the head, whose new rows must be
            trained, out.
    """
    names = embedding_modules(model)
    if cfg.additional_target is None and token_rows_trainable(model):
        plan.trained, plan.token_rows = [], plan.new_rows()
        return cfg
    if cfg.additional_target is None:
        plan.trained = names
        return cfg.model_copy(update={"additional_target": names})
    missing = [n for n in names if n not in cfg.additional_target]
    if missing:
        raise ConfigError(
            f"additional_target: {','.join(cfg.additional_target)} leaves {', '.join(missing)} frozen, so the rows "
            f"of the {len(plan.added)} new token(s) would stay untrained; add {','.join(missing)} or leave "
            f"additional_target unset (resize_vocab then trains {','.join(names)})"
        )
    plan.trained = list(cfg.additional_target)
    return cfg


@torch.no_grad()
def mean_fill_(weight: torch.Tensor, old_rows: int) -> None:
    """Set rows ``old_rows:`` of ``weight`` [rows, hidden] to the mean of rows ``:old_rows`` (computed in float64,
    stored in the weight's dtype): transformers' ``mean_resizing`` without its sampled noise."""
    if weight.shape[0] > old_rows:
        weight[old_rows:] = weight[:old_rows].double().mean(dim=0).to(weight.dtype)


def grow_embeddings(model: PreTrainedModel, plan: VocabPlan) -> None:
    """Grow a loaded model's input embeddings (and untied output head) to ``plan.rows`` with mean rows, and set
    ``config.vocab_size``. transformers' ``resize_token_embeddings`` makes the new tensors; its random init is
    overwritten and the global RNG is left as it was (fork_rng), so the LoRA weights peft draws next are the
    ones of a run without new tokens, on every rank and under FSDP too.

    Raises:
        ConfigError: the model cannot resize its embeddings (transformers raises for such classes).
    """
    if not plan.resized:
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.resize_token_embeddings(plan.rows, mean_resizing=False)
    except (NotImplementedError, AttributeError, ValueError) as exc:
        raise ConfigError(f"resize_vocab: {type(model).__name__} cannot resize its embeddings ({exc})") from None
    embeddings = cast(torch.Tensor, model.get_input_embeddings().weight)  # transformers types the module nn.Module
    mean_fill_(embeddings, plan.base_rows)
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        mean_fill_(head.weight, plan.base_rows)


def grown_config(config: Any, plan: VocabPlan) -> None:
    """Set ``vocab_size`` of a transformers config (and of its text config) to ``plan.rows``, so that a model
    built from it (the FSDP meta-device build) has the grown embeddings."""
    config.vocab_size = plan.rows
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        text.vocab_size = plan.rows


def read_grown_rows(reader: Any, key: str, start: int, out: torch.Tensor, plan: VocabPlan) -> None:
    """FSDP loading of a grown embedding or head: rows ``start .. start + len(out)`` of the runtime tensor, the
    stored rows read from the checkpoint (``reader``: :class:`trainer.fsdp._CheckpointReader`) and the rows past
    ``plan.base_rows`` set to the mean of all stored rows (read in blocks; every rank computes the same mean)."""
    stop = start + out.shape[0]
    if start < plan.base_rows:
        reader.read_rows(key, start, out[: min(stop, plan.base_rows) - start])
    if stop > plan.base_rows:
        total = torch.zeros(out.shape[1:], dtype=torch.float64)
        block = max(1, (16 << 20) // max(1, out[0].numel() * 8))
        for first in range(0, plan.base_rows, block):
            rows = torch.empty((min(block, plan.base_rows - first), *out.shape[1:]), dtype=out.dtype)
            reader.read_rows(key, first, rows)
            total += rows.double().sum(dim=0)
        out[max(0, plan.base_rows - start) :] = (total / plan.base_rows).to(out.dtype)


def with_token_rows(lora_config: Any, model: PreTrainedModel, plan: VocabPlan) -> Any:
    """``lora_config`` (a ``peft.LoraConfig``) with ``trainable_token_indices`` = ``plan.token_rows`` on the input
    embeddings and on the head, when :func:`with_trained_embeddings` chose them."""
    if plan.token_rows:
        lora_config.trainable_token_indices = {name: list(plan.token_rows) for name in embedding_modules(model)}
    return lora_config


def lora_config_with_embeddings(lora_config: Any, cfg: TrainConfig, plan: VocabPlan, model: PreTrainedModel) -> Any:
    """FSDP's ``lora_config`` callable (model -> ``peft.LoraConfig``) for a run with new tokens: the config's LoRA
    with the embeddings and head trained fully (:func:`with_trained_embeddings`). ``lora_config``, the plain
    callable, is replaced (``trainer.targets.lora_config_for`` on the amended config)."""
    return with_token_rows(lora_config_for(with_trained_embeddings(cfg, model, plan), model), model, plan)


_DELTA = ".trainable_tokens_delta.default"


def read_param_rows(
    reader: Any,
    name: str,
    key: str | None,
    prefix: str,
    start: int,
    out: torch.Tensor,
    plan: VocabPlan,
    embedding_names: tuple[str | None, str | None],
    tied: bool,
) -> bool:
    """FSDP loading: fill ``out`` (rows ``start ..`` of runtime parameter ``name``) when it is the weight of the
    input embeddings or the output head (a peft copy included), or peft's ``trainable_tokens_delta`` of one (its
    rows are the weight's rows ``plan.token_rows``). A tied head's copy reads the embeddings' stored tensor; rows
    past the stored ones get their mean (:func:`read_grown_rows`). Returns False for any other parameter (the
    caller reads it as usual). peft's ``trainable_tokens_original`` buffer (used only to unmerge) keeps its
    meta-time values.

    Raises:
        ConfigError: the stored tensor has neither the base's nor the grown number of rows.
    """
    emb, head = embedding_names
    module = name.removeprefix(PEFT_PREFIX)
    for infix in (*PEFT_INFIXES, ".token_adapter"):
        module = module.replace(infix, "")
    delta = module.endswith(_DELTA)  # peft trainable_token_indices: row i of the delta is row token_rows[i]
    module = module.removesuffix(_DELTA).removesuffix(".weight")
    if module not in (emb, head):
        return False
    if key is None and tied and module == head and emb is not None:
        key = reader.key_for(f"{emb}.weight", prefix)
    if key is None or delta:  # peft's token_adapter level is no level of the checkpoint
        key = reader.key_for(f"{module}.weight", prefix) or key
    if key is None:
        return False
    if delta:
        mean = None
        for i, row in enumerate(plan.token_rows[start : start + out.shape[0]]):
            if row < reader.tensors[key][3][0]:
                reader.read_rows(key, row, out[i : i + 1])
            else:
                if mean is None:
                    mean = torch.empty((1, *out.shape[1:]), dtype=out.dtype)
                    read_grown_rows(reader, key, plan.base_rows, mean, plan)
                out[i : i + 1] = mean
        return True
    stored = reader.tensors[key][3][0]
    if stored == plan.rows:
        reader.read_rows(key, start, out)
    elif stored == plan.base_rows:
        read_grown_rows(reader, key, start, out, plan)
    else:
        raise ConfigError(f"resize_vocab: {key} has {stored} rows; expected {plan.base_rows} (the base's vocab_size)")
    return True


def save_plan(plan: VocabPlan | None, folder: Path) -> None:
    """Write the vocabulary record (``folder/ferry_vocab.json``, :mod:`ferry.adapter_folder`); nothing when no
    token was added."""
    if plan is not None:
        write_vocab_record(folder, asdict(plan))


__all__ = [
    "PAD_TO_MULTIPLE_OF",
    "VocabPlan",
    "add_listed_tokens",
    "added_tokens",
    "embedding_modules",
    "grow_embeddings",
    "grown_config",
    "listed_tokens",
    "lora_config_with_embeddings",
    "mean_fill_",
    "plan_vocab",
    "read_grown_rows",
    "read_param_rows",
    "save_plan",
    "token_rows_trainable",
    "with_token_rows",
    "with_trained_embeddings",
]
