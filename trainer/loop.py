"""The training recipe: LoRA fine-tuning with PyTorch DistributedDataParallel or FSDP2, one process per device.

Run by every torchrun worker (``torchrun --nproc-per-node N -m trainer CONFIG.yaml``, what ``ferry train``
starts), or by one plain process (no torchrun environment: world_size 1, no process group). The whole run is
:class:`FinetuneRecipe`, whose methods follow the life of a run top to bottom; :func:`train` drives it.

transformers, peft and huggingface_hub are imported inside functions, after :func:`train` has set the offline
variables (:data:`ferry.constants.OFFLINE_ENV`): importing this module changes no environment.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from ferry.adapter_folder import TRAIN_CONFIG
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, TrainingError
from ferry.fsutil import atomic_directory, atomic_write_text
from trainer import checkpoint as ckpt
from trainer.targets import lora_config_for, lora_targets

if TYPE_CHECKING:
    from trainer.config import TrainConfig

#: Test-only fault injection, read in exactly one place (:meth:`FinetuneRecipe._maybe_crash_for_test`):
#: ``FERRY_TEST_KILL_AT_STEP=N`` makes the last rank SIGKILL itself right after optimizer step N on the first
#: attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so tests can prove that torchrun's restart resumes exactly.
TEST_KILL_ENV = "FERRY_TEST_KILL_AT_STEP"

IGNORE_INDEX = -100


# ====================================================================== public results


@dataclass
class TrainReport:
    """What a finished run reports (``output_dir/train_report.json``).

    Losses are mean cross-entropy per trainable token (nats); ``tokens_*`` count non-padding input tokens
    summed over all ranks; times are wall-clock seconds. ``parallelism``: ``ddp`` or the FSDP strategy;
    ``param_bytes_per_rank``: bytes of parameter storage each rank holds (its shards under FSDP), measured;
    ``peak_rss_bytes_per_rank``: each rank's peak resident set size (``getrusage`` ru_maxrss);
    ``checkpointed_layers``: how many decoder layers recompute their activations in the backward (gradient
    checkpointing; 0 = off).
    """

    output_dir: str
    adapter_dir: str
    global_steps: int
    epochs: float
    world_size: int
    global_batch_size: int
    num_train_samples: int
    num_eval_samples: int
    num_dropped_samples: int
    trainable_params: int
    total_params: int
    tokens_seen: int
    tokens_per_second: float
    train_loss_first: float | None
    train_loss_final: float | None
    eval_loss_first: float | None
    eval_loss_final: float | None
    eval_perplexity_final: float | None
    wall_time_s: float
    resumed_from: str | None = None
    data_stats: dict[str, Any] = field(default_factory=dict)
    parallelism: str = "ddp"
    param_bytes_per_rank: list[int] = field(default_factory=list)
    peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    checkpointed_layers: int = 0
    network: dict[str, Any] | None = None  # issue 21: trainer.netcheck.NetCheck of the pre-flight (> 1 process)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepPlan:
    """How many steps a run takes.

    ``micro_batches_per_epoch`` = ceil(ceil(num_samples / world_size) / per_device_train_batch_size) (what each
    rank's DistributedSampler + DataLoader yields); ``steps_per_epoch`` = ceil(micro_batches_per_epoch /
    gradient_accumulation_steps) (the last step of an epoch may use fewer micro-batches); ``total_steps`` =
    max_steps when > 0, else ceil(num_train_epochs * steps_per_epoch) (transformers' rule).
    """

    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    num_epochs: int
    global_batch_size: int


def plan_steps(num_samples: int, cfg: TrainConfig, world_size: int) -> StepPlan:
    """The :class:`StepPlan` of ``num_samples`` training examples on ``world_size`` processes.

    Raises:
        TrainingError: there are no training examples.
    """
    if num_samples <= 0:
        raise TrainingError("no training examples left after tokenisation (all dropped or empty dataset)")
    per_rank = math.ceil(num_samples / world_size)
    micro = math.ceil(per_rank / cfg.per_device_train_batch_size)
    steps_per_epoch = math.ceil(micro / cfg.gradient_accumulation_steps)
    if cfg.max_steps > 0:
        total = cfg.max_steps
    else:
        total = max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))
    return StepPlan(
        micro_batches_per_epoch=micro,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        num_epochs=math.ceil(total / steps_per_epoch),
        global_batch_size=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size,
    )


# ====================================================================== model pieces


def find_all_linear_modules(model: torch.nn.Module) -> list[str]:
    """Names (last dotted component, e.g. ``q_proj``) of every ``nn.Linear`` except the output head, sorted, as
    LLaMA-Factory's ``find_all_linear_modules`` (``lora_target: all`` itself is resolved by
    :func:`trainer.targets.resolve_lora_targets`, which also covers Conv1D, fused experts and VLM freezing). The
    head is found both by name (``lm_head``) and as ``get_output_embeddings()`` (tied or named otherwise)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for name, module in model.named_modules():
        if module is head or name.split(".")[-1] in ("lm_head", "output_layer"):
            continue
        if isinstance(module, torch.nn.Linear):
            names.add(name.split(".")[-1])
    return sorted(names)


def resolved_revision(model_dir: Path, configured: str | None) -> str | None:
    """The commit of an HF-cache snapshot (``.../snapshots/<sha>``), else the configured revision."""
    if model_dir.parent.name == "snapshots":
        return model_dir.name
    return configured


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 / fp16 per config on CUDA; fp32 on CPU (autocast on CPU is slower and not what users expect)."""
    if device.type != "cuda":
        return torch.float32
    if cfg.bf16:
        return torch.bfloat16
    if cfg.fp16:
        return torch.float16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on CUDA when it is bf16/fp16 (from :func:`compute_dtype`); else a no-op."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def build_lora_model(
    cfg: TrainConfig, model_dir: Path, *, device: torch.device, dtype: torch.dtype, meta: bool = False,
    vocab: Any = None,
) -> torch.nn.Module:
    """The base model with peft LoRA layers (a ``peft.PeftModel``); only LoRA (and ``additional_target``)
    parameters require grad, and those are kept in fp32 whatever ``dtype`` the frozen weights use.

    Args:
        model_dir: local model folder (``ferry.hub.resolve_model``).
        device: where the weights go.
        dtype: dtype of the frozen base weights.
        meta: build on the meta device from config.json only (no weights read): for counting parameters in
            ``--dry-run``.
        vocab: a :class:`trainer.vocab.VocabPlan` when the tokenizer gained tokens: the embeddings grow (mean
            rows) and are trained fully (``modules_to_save``).

    Raises:
        ConfigError: ``lora_target`` / ``additional_target`` name modules the model does not have.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.peft_build import get_peft_model_checked

    if meta:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
        if vocab is not None:  # the grown vocabulary's parameter count (trainer/vocab.py)
            from trainer.vocab import grown_config

            grown_config(config, vocab)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    elif cfg.quantization_bit is not None:  # QLoRA (issue 19): quantised on load, on this rank's device only
        from trainer.quant import load_quantized_model

        model = load_quantized_model(cfg, model_dir, device=device, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
            attn_implementation=cfg.attn_implementation,
        )
        model.to(device)
    model.config.use_cache = False  # the KV cache is useless in training and clashes with checkpointing
    if vocab is not None:  # resize_vocab / add_special_tokens (trainer/vocab.py)
        from trainer.vocab import grow_embeddings, with_trained_embeddings

        if not meta:
            grow_embeddings(model, vocab)
        cfg = with_trained_embeddings(cfg, model, vocab)

    continued = None
    if cfg.adapter_name_or_path and not meta:  # merge earlier adapters / continue the last (trainer/lf_compat.py)
        from trainer.lf_compat import stack_adapters

        model, continued = stack_adapters(model, cfg.adapter_name_or_path, create_new_adapter=cfg.create_new_adapter)
    targets = lora_targets(cfg, model) if continued is None else None
    if continued is not None:
        peft_model = continued
    else:
        lora_config = lora_config_for(cfg, model, targets)
        if cfg.adapter_name_or_path and meta and not cfg.create_new_adapter:  # --dry-run counts the continued one
            from trainer.lf_compat import continued_lora_config

            lora_config = continued_lora_config(cfg)
        if cfg.pissa_init and not meta:  # peft's PiSSA initialisation (trainer/lf_compat.py)
            from trainer.lf_compat import pissa_init_weights

            lora_config.init_lora_weights = pissa_init_weights(cfg)
        if vocab is not None:  # the new rows alone through peft's trainable_token_indices (untied embeddings)
            from trainer.vocab import with_token_rows

            lora_config = with_token_rows(lora_config, model, vocab)
        try:
            peft_model = get_peft_model_checked(model, lora_config)
        except ValueError as exc:
            raise ConfigError(f"lora_target / additional_target do not fit {model_dir}: {exc}") from None
    peft_model.ferry_lora_targets = targets  # for --dry-run's summary
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return peft_model


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s layers recompute their activations in the backward: transformers'
    ``GradientCheckpointingLayer`` modules (the decoder layers) whose ``gradient_checkpointing`` is on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True
               for m in model.modules())


def samples_stay_apart_in_one_row(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``model`` keeps the samples of one row apart when their position ids restart, which neat_packing
    and padding-free batches rely on (transformers builds a block-diagonal mask from the position ids for the
    models whose masks come from ``masking_utils``, and flash-attention kernels split the row at the
    restarts; a model with its own mask code may let the second sample attend to the first).

    The probe: the logits of a 4-token sample alone ``[1, 4, vocab]`` against the same sample placed after
    another one in a ``[1, 8]`` row; equal within 1e-3 + 1e-2 * max |logit| (bf16/fp16 kernel noise).
    Runs in eval mode under ``no_grad`` and draws its tokens from its own generator (the global RNG streams,
    and so resume equivalence, are untouched).
    """
    vocab = int(getattr(model.config, "vocab_size", 0) or 32)
    tokens = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(1234)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            alone = model(input_ids=tokens[4:][None], position_ids=torch.arange(4, device=device)[None],
                          use_cache=False).logits.float()
            row = model(input_ids=tokens[None], position_ids=torch.arange(4, device=device).repeat(2)[None],
                        use_cache=False).logits.float()[:, 4:]
    finally:
        model.train(was_training)
    return bool((alone - row).abs().max() <= 1e-3 + 1e-2 * alone.abs().max())


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (nats, fp32 scalar) over positions whose label is not -100.

    Args:
        logits: [batch, seq_len, vocab] (any float dtype; computed in fp32).
        labels: [batch, seq_len] int64, unshifted (``labels[:, t]`` is the target of position ``t - 1``).

    The caller divides by the trainable-token count of the whole global batch (``count_trainable_tokens``),
    so the mean does not depend on how tokens fall across micro-batches and ranks.
    """
    # Shift the labels, not the logits (as transformers' ForCausalLMLoss): slicing [batch, seq_len, vocab]
    # would copy the largest tensor of the step; the padded last position is ignored.
    labels = labels.to(logits.device)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


# ====================================================================== data pieces


def attention_pair_cost(config: Any) -> float:
    """Attention cost of one (query, key) pair relative to the linear-layer cost of one token, per decoder
    layer, from a transformers model config (multiply-adds; forward, the backward scales both alike).

    Per token the linear layers do ``h * (q + 2 kv) + q * h`` (the q, k, v and o projections) plus the MLP,
    ``3 h i`` when ``intermediate_size`` is set (gated: gate, up, down) else ``8 h^2``; each pair costs
    ``2 q`` (one row of ``Q K^T`` and of ``P V``). The same accounting as Kaplan et al. 2020, "Scaling Laws for
    Neural Language Models", Table 1 (forward FLOPs ~ 2N + 2 n_layer n_ctx d_attn). For the benchmark's Llama
    (h 512, i 1536, 8 heads, 4 KV heads) it is 1024 / 3,145,728 = 3.3e-4.
    """
    h = int(getattr(config, "hidden_size", 0) or 0)
    if h <= 0:
        return 1.0 / (6 * 4096)  # no hidden_size: a 7B-sized guess (only decides a batch layout)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or h // heads)
    q = heads * head_dim
    kv = int(getattr(config, "num_key_value_heads", 0) or heads) * head_dim
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    linear = h * (q + 2 * kv) + q * h + (3 * h * inter if inter else 8 * h * h)
    return 2.0 * q / linear


def flattening_saves(lengths: list[int], pair_cost: float) -> bool:
    """Whether one row of ``sum(lengths)`` tokens costs less than ``len(lengths)`` rows padded to the longest.

    Cost of a layout with rows of ``n`` tokens: ``n * (1 + pair_cost * n)`` per row (linear layers per token
    plus attention over the whole row: with a block-diagonal or padding mask every pair is computed);
    ``pair_cost`` from :func:`attention_pair_cost` (0: flatten whenever there is padding). A batch without
    padding is never flattened.
    """
    total, longest = sum(lengths), max(lengths)
    padded = len(lengths) * longest * (1.0 + pair_cost * longest)
    return total * (1.0 + pair_cost * total) < padded


class ResumableBatchSampler(Sampler[list[int]]):
    """``BatchSampler(sampler, batch_size)`` whose next iteration can skip its first ``skip`` batches, and whose
    batches within one optimizer step are grouped by length.

    Resuming mid-epoch sets ``skip`` to the micro-batches already consumed in that epoch; since the
    DistributedSampler's order depends only on (seed, epoch), the resumed run sees exactly the samples the
    uninterrupted run would have seen next. Skipping happens on index lists: no sample is loaded or collated.
    ``len()`` is the full epoch's batch count.

    With ``lengths`` (tokens per sample) and ``group`` > 1 (``gradient_accumulation_steps``: the micro-batches of
    one optimizer step), the samples of each run of ``group`` consecutive batches from the epoch's start are
    dealt out again by length: sorted (stable), then cut into batches of the same sizes in the same order. Each
    micro-batch then pads to a length near its own samples' instead of the longest of a random draw. The step
    still sees the same samples, and its loss and gradients (sums over its tokens, divided by the step's token
    count, :meth:`FinetuneRecipe._optimizer_step`) are the same up to float summation order; the data order across
    steps is untouched. This is transformers' ``group_by_length`` idea, but inside a step, so it changes no step's
    result. Steps never cross an epoch's end and a resume starts at a step, so ``skip`` is a whole number of groups.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, *, group: int = 1,
                 lengths: Sequence[int] | None = None) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.group = max(1, int(group))
        self.lengths = lengths
        self.skip = 0

    def _grouped(self, batches: Iterator[list[int]]) -> Iterator[list[int]]:
        lengths = self.lengths
        assert lengths is not None
        while True:
            run = list(itertools.islice(batches, self.group))
            if not run:
                return
            ordered = sorted((i for batch in run for i in batch), key=lambda i: lengths[i])
            start = 0
            for batch in run:
                yield ordered[start:start + len(batch)]
                start += len(batch)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(BatchSampler(self.sampler, self.batch_size, drop_last=False))
        if self.lengths is not None and self.group > 1:
            batches = self._grouped(batches)
        skip, self.skip = self.skip, 0
        return itertools.islice(batches, skip, None)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)  # type: ignore[arg-type]


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of ``range(num_samples)`` for evaluation: ``rank, rank + world_size, ...``.

    Unlike ``DistributedSampler`` it never pads with duplicates, so summed eval losses count every sample
    exactly once (ranks may get one sample less; evaluation has no per-batch collectives, so that is safe).
    """

    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def collate_with_token_count(
    examples: list[dict[str, list[int]]], pad_token_id: int, flatten: bool = False,
    pair_cost: float | None = None, cross_sample_attention: bool = False,
) -> dict[str, torch.Tensor]:
    """``trainer.data.collate`` plus ``num_tokens``: the batch's non-padding tokens (int64 scalar), for
    tokens/s. A module-level function (picklable for ``dataloader_num_workers > 0``).

    Args:
        flatten: always one ``[1, total_tokens]`` row (flash-attention kernels need it for packed samples).
        pair_cost: padding-free batching: one row when :func:`flattening_saves` says it is cheaper under this
            cost ratio (:func:`attention_pair_cost`); None: padded rows (unless ``flatten``).
        cross_sample_attention: LLaMA-Factory's plain ``packing`` (see :func:`trainer.data.collate`): padded
            rows with an attention mask, never flattened.
    """
    from trainer.data import collate

    if cross_sample_attention:
        flatten = False
    elif not flatten and pair_cost is not None:
        flatten = flattening_saves([len(e["input_ids"]) for e in examples], pair_cost)
    batch = collate(examples, pad_token_id, flatten=flatten, cross_sample_attention=cross_sample_attention)
    batch["num_tokens"] = torch.tensor(sum(len(e["input_ids"]) for e in examples), dtype=torch.int64)
    return batch


# ====================================================================== the distributed environment


@dataclass
class DistEnv:
    """This process's place in the job, from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE).

    Without those variables (a plain ``python`` process) it is rank 0 of 1 and no process group exists; the
    collective helpers below then do nothing, so the loop reads the same either way.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @classmethod
    def from_environ(cls, ddp_backend: str) -> DistEnv:
        """Read torchrun's variables and pick device and backend (``auto``: nccl on CUDA, gloo on CPU).

        Raises:
            ConfigError: nccl requested without CUDA.
        """
        distributed = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available()
        if ddp_backend == "nccl" and not cuda:
            raise ConfigError("ddp_backend: nccl needs CUDA GPUs; use auto or gloo on CPU")
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)  # before any CUDA tensor: no stray context on GPU 0
        backend = None
        if distributed:
            backend = ("nccl" if cuda else "gloo") if ddp_backend == "auto" else ddp_backend
        return cls(rank, local_rank, world_size, device, backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_process_group(self, timeout_s: int) -> None:
        """Join the process group (TCP store from MASTER_ADDR/MASTER_PORT, set by torchrun)."""
        if self.backend is None:
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kwargs: dict[str, Any] = {"backend": self.backend, "timeout": timedelta(seconds=timeout_s)}
        if self.device.type == "cuda" and self.backend == "nccl":
            kwargs["device_id"] = self.device  # eager NCCL init, bound to this GPU
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent serves ONE TCPStore for every attempt of the job, and the process group writes
            # the same keys each time (gloo's peer addresses, NCCL's unique id): after a restart a rank could
            # read the dead attempt's values and fail with "Connection refused". A prefix per attempt keeps
            # each attempt's keys apart (torch's env:// path only makes a new client, not a new namespace).
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world_size, is_master=False,
                timeout=timedelta(seconds=timeout_s),
            )
            kwargs.update(store=dist.PrefixStore(f"ferry/attempt-{restart}", store), rank=self.rank,
                          world_size=self.world_size)
        dist.init_process_group(**kwargs)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.initialized:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; CPU tensors inside stay on CPU)."""
        if not self.initialized:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.initialized:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.initialized:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def destroy(self, timeout_s: float = 60.0) -> None:
        """Tear the process group down, waiting at most ``timeout_s`` seconds.

        A torchrun worker (``TORCHELASTIC_RUN_ID`` set) leaves it alone: every output is written and the final
        barrier passed, and ``trainer.__main__`` ends the process with ``os._exit``, which closes its sockets.
        There, gloo's teardown has been seen to block one rank for good once its peer had exited (CPU, torch
        2.13) inside ``ProcessGroupGloo``'s destructor, which holds the GIL, so no thread can bound it; the
        other node's torchrun agent then gave up its exit barrier after 300 s and took the rendezvous store
        with it, and this node's agent failed a finished job with ``RendezvousConnectionError``. Elsewhere
        (a plain process, tests) it runs in a thread joined for ``timeout_s`` seconds."""
        if self.initialized and os.environ.get("TORCHELASTIC_RUN_ID") is None:
            import threading

            worker = threading.Thread(target=dist.destroy_process_group, name="ferry-destroy-pg", daemon=True)
            worker.start()
            worker.join(timeout_s)


# ====================================================================== the recipe


class FinetuneRecipe:
    """LoRA fine-tuning of a causal LM with DistributedDataParallel or FSDP2, fully offline.

    Features:
        - FSDP (``fsdp: full_shard`` etc.): the same recipe with ``setup_model`` building a sharded model
          (:mod:`trainer.fsdp`: every decoder layer and the root ``fully_shard``-ed after peft added the LoRA
          layers, each rank loading only its rows of the frozen weights; ``hybrid_shard`` through a 2-D device
          mesh); accumulation with ``set_requires_gradient_sync`` instead of ``no_sync``; the gradient norm
          over all shards (DTensor); checkpoints hold every rank's shard (``torch.distributed.checkpoint``)
          plus the gathered adapter; evaluation runs the same number of forwards on every rank. Everything
          else below is shared.
        - Data parallelism: one process per device under torchrun; ``DistributedDataParallel`` with
          ``gradient_as_bucket_view`` (gradients are all-reduced in buckets during backward) and
          ``static_graph`` when there is no gradient accumulation (static_graph + ``no_sync`` is broken in
          PyTorch, pytorch/pytorch#143580). gloo on CPU, nccl on CUDA (``ddp_backend: auto``).
        - Data: tokenised once before the process group exists (``prepare_data``'s cache; a slow tokeniser
          cannot time out NCCL). A ``DistributedSampler`` (seed, shuffle) with ``set_epoch`` every epoch.
        - Padding-free batches (``padding_free: auto``): a micro-batch whose padding would cost more compute
          than the longer attention rows of laying its samples end to end runs as one row (position ids
          restart per sample; the same loss and gradients). Packing and padding-free rows are used only after
          a probe shows that the model keeps the samples of a row apart (:func:`samples_stay_apart_in_one_row`).
        - Gradient accumulation with ``no_sync`` on all but the last micro-batch. The total batch size is::

              global batch = per_device_train_batch_size * gradient_accumulation_steps * world_size

          e.g. 4 * 2 * 2 processes = 16 sequences per optimizer step.
        - Loss normalisation: the summed token cross-entropy of each micro-batch is divided by the number of
          trainable tokens in the whole global batch (all-reduced over ranks before the backward passes) and
          multiplied by world_size (DDP averages gradients over ranks). The gradient is then exactly that of
          the mean token loss of the global batch, independent of how tokens fall across micro-batches and
          ranks: 2 processes x batch b, 1 process x batch 2b and accumulation 2 x b train the same model.
        - Precision: fp32 on CPU; on CUDA, frozen weights in bf16/fp16 per config, LoRA weights in fp32,
          ``torch.autocast`` and a ``GradScaler`` for fp16. AdamW (fused on CUDA), transformers' schedulers,
          gradient clipping, gradient checkpointing (non-reentrant, the embedding output requiring grad: it works
          over a frozen or 4-bit base with DDP's ``find_unused_parameters`` off).
        - QLoRA (``quantization_bit``, :mod:`trainer.quant`): a 4-bit or 8-bit bitsandbytes base on each rank's
          own device under DDP, or a 4-bit base with bf16-stored packed weights under FSDP2.
        - Checkpoints: rank 0 writes ``checkpoint-STEP/`` atomically (adapter, optimizer, scheduler, scaler,
          every rank's RNG state, the position within the epoch); resume continues at the exact next sample,
          also after torchrun restarts a killed worker group (``--max-restarts``).
        - Evaluation: each rank evaluates its shard (no duplicates); loss sums and token counts are all-reduced.
        - Logging on rank 0 only: tqdm bar, ``metrics.jsonl``, TensorBoard (``report_to: tensorboard``).

    Not supported: full fine-tuning, DeepSpeed (``deepspeed:`` runs as the matching FSDP2 strategy), pre-quantised
    (GPTQ / AWQ / AQLM) bases, 8-bit bases under FSDP, DoRA under FSDP or over a quantised base, changing world size
    or batch shape on resume.

    Raises:
        ConfigError: contradictory settings, an output_dir holding a finished run, a bad resume path.
        NotInstalledError: the model or a dataset is not installed on this host.
        DataError: a malformed dataset row (from ``trainer.data``).
        TrainingError: no training examples; a corrupt checkpoint; a non-finite loss.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.env = DistEnv.from_environ(cfg.ddp_backend)
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        self.dtype = compute_dtype(cfg, self.env.device)
        # FSDP needs a process group; one plain process has nothing to shard across and trains unwrapped.
        self.fsdp = bool(cfg.fsdp) and self.env.backend is not None
        self.host_allocator: Any = None  # trainer.fsdp.HostAllocator under FSDP
        self.head: Any = None  # trainer.loss.ChunkedHead, or None for the whole logits
        if cfg.fsdp and not self.fsdp and self.env.is_main:
            print("ferry: one process without torchrun: nothing to shard, fsdp ignored", file=sys.stderr)
        if (cfg.bf16 or cfg.fp16) and self.env.device.type != "cuda" and self.env.is_main:
            print("ferry: no CUDA device: bf16/fp16 ignored, training in fp32", file=sys.stderr)
        self.global_step = 0
        self.epoch = 0
        self.micro_in_epoch = 0
        self._tokens_seen_t = torch.zeros((), dtype=torch.float64, device=self.env.device)
        self.elapsed_before = 0.0
        self.train_loss_first: float | None = None
        self.train_loss_last: float | None = None
        self.eval_loss_first: float | None = None
        self.eval_loss_last: float | None = None
        self.eval_ppl_last: float | None = None
        self.resumed_from: Path | None = None
        self._pbar: Any = None
        self._tb: Any = None

    # ------------------------------------------------------------------ 1. data (before the process group)

    def setup_data(self) -> None:
        """Seed, load the tokenizer and the tokenised data. Runs BEFORE ``init_process_group``: tokenising a
        large dataset can outlast the collective timeout; ``prepare_data`` loads the launcher's cache (or, when
        torchrun was started by hand, one rank builds it under a file lock while the others wait)."""
        from transformers import set_seed

        from ferry.hub import resolve_model
        from trainer.data import load_tokenizer, prepare_data

        set_seed(self.cfg.seed)
        self.model_dir = resolve_model(self.cfg.model_name_or_path, self.cfg.model_revision)
        self.tokenizer = load_tokenizer(self.cfg)
        from trainer.vocab import plan_vocab

        self.vocab = plan_vocab(self.cfg, self.tokenizer, self.model_dir)  # None unless tokens were added
        self.data = prepare_data(self.cfg, self.tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise TrainingError(f"tokenizer of {self.model_dir} has no pad token after load_tokenizer")

    # ------------------------------------------------------------------ 2. process group and output_dir

    def setup_distributed(self) -> None:
        """Join the process group, then let rank 0 alone decide where the run starts (resume or not) and
        tell the others, so that every rank agrees even when output_dir is not on a shared file system."""
        self.env.init_process_group(self.cfg.ddp_timeout)
        decision: Any
        if self.env.is_main:
            try:
                plan = ckpt.plan_resume(
                    self.out, self.cfg.resume_from_checkpoint, self.cfg.overwrite_output_dir, restarted=self.restarted
                )
                if plan.start_over:
                    ckpt.clear_previous_run(self.out)
                self.out.mkdir(parents=True, exist_ok=True)
                loaded = ckpt.load_checkpoint(plan.checkpoint) if plan.checkpoint else None
                decision = ("ok", loaded)
            except (ConfigError, TrainingError) as exc:
                decision = ("error", exc)
        else:
            decision = None
        status, payload = self.env.broadcast_object(decision)
        if status == "error":
            raise payload
        self.loaded: ckpt.LoadedCheckpoint | None = payload
        if self.fsdp and self.cfg.save_strategy != "no":
            self._check_shared_output_dir()

    def _check_shared_output_dir(self) -> None:
        """FSDP checkpoints are written by every rank into one folder: with several nodes, output_dir must be
        on a file system they share. Rank 0 writes a marker there; a rank that cannot see it fails the run now,
        not at the first checkpoint (a collective: every rank calls it)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.env.world_size))
        if local >= self.env.world_size:
            return  # one node
        marker = self.out / f".ferry-shared-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{self.global_step}"
        if self.env.is_main:
            atomic_write_text(marker, "shared\n")
        self.env.barrier()
        missing = torch.tensor(0.0 if marker.is_file() else 1.0, device=self.env.device)
        self.env.all_reduce_sum(missing)
        self.env.barrier()
        if self.env.is_main:
            marker.unlink(missing_ok=True)
        if float(missing) > 0:
            raise ConfigError(
                f"fsdp: output_dir {str(self.out)!r} is not on a file system every node shares ({int(missing)} "
                f"rank(s) cannot see it); every rank writes its checkpoint shard there (or set save_strategy: no)"
            )

    # ------------------------------------------------------------------ 3. model, DDP, optimizer, scheduler

    def setup_model(self) -> None:
        """Base model + LoRA, gradient checkpointing, then DDP or FSDP2.

        DDP: every rank loads the whole model, then ``DistributedDataParallel`` wraps it. FSDP
        (``trainer.fsdp.build_sharded_lora_model``): the model is built on the meta device, every decoder layer
        and the root are sharded, and each rank reads only its rows of the weights. Either way peft draws the
        LoRA weights right after the seed is set (loading draws no random number), so every world size and
        both modes start from the same adapter and leave the global RNG (dropout) in the same state."""
        from transformers import set_seed

        cfg, env = self.cfg, self.env
        set_seed(cfg.seed)
        if self.fsdp:
            from trainer import fsdp as fs

            if cfg.fsdp_cpu_offload and env.device.type != "cuda" and env.is_main:
                print("ferry: fsdp offload: on CPU the shards are in host memory already; ignored", file=sys.stderr)
            from trainer.lf_compat import refuse_under_fsdp

            refuse_under_fsdp(cfg)  # adapter_name_or_path / pissa_init need the whole model (issue 22)
            self.host_allocator = fs.HostAllocator(env.device)  # before the first gathered layer is allocated
            self.mesh = fs.make_mesh(cfg.fsdp_strategy or "full_shard", env.device, env.world_size)
            if cfg.quantization_bit is not None:  # QLoRA (issue 19): 4-bit base, bf16-stored packed weights
                from trainer.quant import build_sharded_quantized_lora_model

                self.peft_model, self.trainable_params, self.total_params = build_sharded_quantized_lora_model(
                    cfg, self.model_dir, device=env.device, dtype=self.dtype, mesh=self.mesh,
                    lora_config=partial(lora_config_for, cfg))
            else:
                self.peft_model, self.trainable_params, self.total_params = fs.build_sharded_lora_model(
                    cfg, self.model_dir, device=env.device, dtype=self.dtype, mesh=self.mesh,
                    lora_config=partial(lora_config_for, cfg), vocab=self.vocab,
                )
        else:
            self.peft_model = build_lora_model(cfg, self.model_dir, device=env.device, dtype=self.dtype,
                                               vocab=self.vocab)
            self.trainable_params, self.total_params = count_parameters(self.peft_model)
            if cfg.gradient_checkpointing:
                from trainer.fsdp import enable_activation_checkpointing

                enable_activation_checkpointing(self.peft_model)
        if cfg.pissa_init and env.is_main:  # the reference of pissa_convert (trainer/lf_compat.py)
            from trainer.lf_compat import save_pissa_initial

            save_pissa_initial(self.peft_model, self.out)
        peft_cfg = self.peft_model.peft_config["default"]
        path = Path(cfg.model_name_or_path).expanduser()
        peft_cfg.base_model_name_or_path = str(path.resolve()) if path.is_dir() else cfg.model_name_or_path
        peft_cfg.revision = resolved_revision(self.model_dir, cfg.model_revision)

        if self.loaded is not None:
            ckpt.check_parallelism(self.loaded.state, self.loaded.path, cfg.fsdp_strategy if self.fsdp else None)
        if self.loaded is not None and not self.fsdp:  # under FSDP the adapter comes with the sharded state
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.peft_model, self.loaded.adapter_state)
            if result.unexpected_keys:
                raise TrainingError(
                    f"{self.loaded.path}: adapter does not fit this model/config: unexpected keys "
                    f"{result.unexpected_keys[:5]}"
                )

        # Neatly packed and padding-free rows hold several samples kept apart: make sure this model does so.
        # (LLaMA-Factory's plain packing lets a row's samples attend to each other: no probe, no flattening.)
        self.cross_sample_attention = cfg.packing and not cfg.neat_packing and cfg.stage == "sft"
        isolated_packing = cfg.packing and not self.cross_sample_attention
        self.one_row_ok = False
        if isolated_packing or (cfg.padding_free is not False and not self.cross_sample_attention):
            failed = torch.tensor(
                0.0 if samples_stay_apart_in_one_row(self.peft_model, self.env.device, self.dtype) else 1.0,
                device=self.env.device,
            )
            self.one_row_ok = float(self.env.all_reduce_sum(failed)) == 0.0  # every rank decides alike
            if not self.one_row_ok and (isolated_packing or cfg.padding_free is True):
                key = "neat_packing" if isolated_packing else "padding_free"
                raise ConfigError(
                    f"{key}: {cfg.model_name_or_path} lets a sample attend to the one before it in a row "
                    f"(its attention ignores position-id restarts with attn_implementation "
                    f"{cfg.attn_implementation or 'default'}); set {key}: false"
                )
            if self.fsdp:  # the probe's forward left the root unit (embeddings, norm, head) gathered: registered
                self.peft_model.reshard()  # as its full tensors, which the optimizer would hold instead of its shards

        # Loss without the whole logits (issue 21, trainer/loss.py): None = the model's own logits.
        from trainer.loss import setup_head

        self.head = setup_head(self.peft_model, env.device, autocast(env.device, self.dtype),
                               cfg.enable_liger_kernel, verbose=env.is_main)
        whole = torch.tensor(0.0 if self.head is not None else 1.0, device=env.device)
        if float(env.all_reduce_sum(whole)) > 0:  # every rank decides alike
            self.head = None
        if self.fsdp:
            self.peft_model.reshard()  # the probes' forwards left the root unit gathered (see above)
            self.model: torch.nn.Module = self.peft_model  # fully_shard changed the module in place
        elif self.env.initialized:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(
                self.peft_model,
                device_ids=[self.env.device.index] if self.env.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                # static_graph: graph-level bucketing, once per run; not with no_sync (pytorch#143580) and
                # not needed with find_unused_parameters (which already re-traces every step).
                static_graph=cfg.gradient_accumulation_steps == 1 and not cfg.ddp_find_unused_parameters,
                find_unused_parameters=bool(cfg.ddp_find_unused_parameters),
            )
        else:
            self.model = self.peft_model

    def setup_optimizer(self, total_steps: int) -> None:
        """The optimizer (``optim``: AdamW or SGD) over the trainable parameters (no weight decay on biases and
        norms: 1-d tensors) and the LR schedule. The scheduler can only be built once the number of steps is known (after the data)."""
        from transformers import get_scheduler

        cfg = self.cfg
        params = self.trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if cfg.loraplus_lr_ratio is not None:  # peft's LoRA+ groups (trainer/lf_compat.py)
            from trainer.lf_compat import loraplus_optimizer

            self.optimizer = loraplus_optimizer(self.peft_model, cfg, fused=self.env.device.type == "cuda")
        else:
            from trainer.lf_compat import torch_optimizer

            optimizer_cls, kwargs = torch_optimizer(cfg, fused=self.env.device.type == "cuda")
            self.optimizer = optimizer_cls(groups, lr=cfg.learning_rate, **kwargs)
        warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)
        self.scheduler = get_scheduler(
            cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
        )
        fp16 = self.env.device.type == "cuda" and self.dtype == torch.float16
        if self.fsdp:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler("cuda", enabled=fp16)  # inf checks all-reduced over the shards
        else:
            self.scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        if self.loaded is not None and self.loaded.sharded_dir is not None:
            ckpt.load_sharded_state(self.loaded.sharded_dir, self.model, self.optimizer)
            self.scheduler.load_state_dict(self.loaded.scheduler)
            if self.loaded.scaler is not None and self.scaler.is_enabled():
                self.scaler.load_state_dict(self.loaded.scaler)
        elif self.loaded is not None:
            self.optimizer.load_state_dict(self.loaded.optimizer)
            self.scheduler.load_state_dict(self.loaded.scheduler)
            if self.loaded.scaler is not None and self.scaler.is_enabled():
                self.scaler.load_state_dict(self.loaded.scaler)

    # ------------------------------------------------------------------ 4. data loaders

    def setup_loaders(self) -> None:
        """Train loader: DistributedSampler (seed, shuffle; identical order on every world size, then split
        by rank) batched by :class:`ResumableBatchSampler`. Eval loader: :class:`ShardSampler`."""
        cfg, env = self.cfg, self.env
        pad_id = int(self.tokenizer.pad_token_id)
        flash = (cfg.attn_implementation or "").startswith("flash_attention")
        pair_cost = None  # padded rows: padding_free false, or auto on a model that failed the one-row probe
        if cfg.padding_free == "auto" and self.one_row_ok:
            pair_cost = attention_pair_cost(self.peft_model.get_base_model().config)
        elif cfg.padding_free is True:
            pair_cost = 0.0
        collate = partial(collate_with_token_count, pad_token_id=pad_id, flatten=flash, pair_cost=pair_cost,
                          cross_sample_attention=self.cross_sample_attention)
        self.sampler = DistributedSampler(
            self.data.train, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=cfg.seed,
            drop_last=False,
        )
        self.batch_sampler = ResumableBatchSampler(  # each step's micro-batches grouped by length (exact)
            self.sampler, cfg.per_device_train_batch_size, group=cfg.gradient_accumulation_steps,
            lengths=self.data.train.lengths())
        pin = env.device.type == "cuda"
        self.train_loader = DataLoader(
            self.data.train, batch_sampler=self.batch_sampler, collate_fn=collate,
            num_workers=cfg.dataloader_num_workers, pin_memory=pin,
            # Its own generator: creating an iterator then draws no number from the global RNG (the dropout
            # stream), which a resumed run, creating its iterator mid-epoch, would draw out of step.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        self.eval_loader = None
        if self.data.eval:
            self.eval_loader = DataLoader(
                self.data.eval, sampler=ShardSampler(len(self.data.eval), env.rank, env.world_size),
                batch_size=cfg.per_device_eval_batch_size, collate_fn=collate,
                num_workers=cfg.dataloader_num_workers, pin_memory=pin,
            )
        self.plan = plan_steps(len(self.data.train), cfg, env.world_size)

    # ------------------------------------------------------------------ 5. restore the run's position

    def restore_state(self) -> None:
        """Continue where the checkpoint stopped: step, epoch, micro-batches consumed in the epoch, this
        rank's RNG state. metrics.jsonl keeps only rows up to the starting step: rows a crashed attempt wrote
        after its last checkpoint (or all of them, when starting at step 0) would otherwise appear twice."""
        if self.loaded is None:
            if self.env.is_main:
                self._truncate_metrics(0)
            return
        state, cfg = self.loaded.state, self.cfg
        ckpt.check_batch_shape(state, self.loaded.path, self.env.world_size, cfg.per_device_train_batch_size,
                               cfg.gradient_accumulation_steps)
        self.global_step = state.global_step
        self.epoch = state.epoch
        self.micro_in_epoch = state.micro_batches_in_epoch
        self._tokens_seen_t.fill_(state.tokens_seen)
        self.elapsed_before = state.elapsed_s
        self.train_loss_first = state.train_loss_first
        self.eval_loss_first = state.eval_loss_first
        if self.loaded.rng_states:
            ckpt.restore_rng_state(self.loaded.rng_states[self.env.rank % len(self.loaded.rng_states)])
        self.resumed_from = self.loaded.path
        if self.env.is_main:
            self._truncate_metrics(self.global_step)
        self.loaded = None  # free the CPU copies

    # ------------------------------------------------------------------ 6. train

    def train(self) -> None:
        """The loop: epochs, then optimizer steps of up to ``gradient_accumulation_steps`` micro-batches."""
        cfg, env, plan = self.cfg, self.env, self.plan
        if env.is_main:
            self._open_logs()
        window_loss = torch.zeros((), dtype=torch.float64, device=env.device)
        window_tokens = torch.zeros((), dtype=torch.float64, device=env.device)
        window_steps, window_start = 0, time.perf_counter()
        self.session_start = time.perf_counter()
        self.model.train()

        while self.global_step < plan.total_steps:
            self.sampler.set_epoch(self.epoch)  # a new shuffle each epoch, the same on every rank
            self.batch_sampler.skip = self.micro_in_epoch  # > 0 only when resuming mid-epoch
            batches = iter(self.train_loader)
            while True:
                n_micro = min(cfg.gradient_accumulation_steps, plan.micro_batches_per_epoch - self.micro_in_epoch)
                micro_batches = [next(batches) for _ in range(n_micro)]
                step_loss, step_tokens, grad_norm = self._optimizer_step(micro_batches)
                self.micro_in_epoch += n_micro
                self.global_step += 1
                self._tokens_seen_t += step_tokens
                window_loss += step_loss
                window_tokens += step_tokens
                window_steps += 1
                epoch_done = self.micro_in_epoch >= plan.micro_batches_per_epoch
                last = self.global_step >= plan.total_steps
                if self._pbar is not None:
                    self._pbar.update(1)

                if self.global_step == 1 or self.global_step % cfg.logging_steps == 0 or last:
                    loss = float(env.all_reduce_sum(window_loss)) / window_steps
                    elapsed = time.perf_counter() - window_start
                    self._log_train(loss, float(window_tokens) / max(elapsed, 1e-9), float(grad_norm))
                    window_loss.zero_(), window_tokens.zero_()
                    window_steps, window_start = 0, time.perf_counter()

                if epoch_done:  # the checkpoint then points at the start of the next epoch
                    self.epoch, self.micro_in_epoch = self.epoch + 1, 0
                if self._eval_due(epoch_done) and not last:
                    self.evaluate()
                if self._save_due(epoch_done) and not last:
                    self.save_checkpoint()
                self._maybe_crash_for_test()
                if epoch_done or last:
                    break
        if self._pbar is not None:
            self._pbar.close()
        if self.eval_loader is not None:
            self.evaluate()

    def _optimizer_step(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over ``micro_batches`` (this rank's share of the global batch).

        Returns device tensors (no host sync): this rank's share of the step's mean token loss (the shares sum
        over ranks to the global batch's mean loss), the global batch's non-padding tokens (all ranks), and
        the global gradient norm before clipping.
        """
        from trainer.data import count_trainable_tokens

        env, cfg = self.env, self.cfg
        # One all-reduce before any backward: [trainable tokens, non-padding tokens] of the global batch.
        local = [
            float(sum(count_trainable_tokens(mb["labels"]) for mb in micro_batches)),
            float(sum(int(mb["num_tokens"]) for mb in micro_batches)),
        ]
        counts = env.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=env.device))
        denom = counts[0].clamp(min=1.0)  # a global batch with no trainable token contributes nothing
        scale = (env.world_size / denom).float()
        amp = autocast(env.device, self.dtype)
        loss_share = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, batch in enumerate(micro_batches):
            syncing = i == len(micro_batches) - 1  # gradients are reduced on the last micro-batch only
            no_sync: contextlib.AbstractContextManager = contextlib.nullcontext()
            if self.fsdp:  # FSDP2: keep unsharded gradients locally, reduce-scatter their sum on the last one
                self.model.set_requires_gradient_sync(syncing)
            elif not syncing and env.initialized:
                no_sync = self.model.no_sync()
            labels = batch["labels"].to(env.device, non_blocking=True)
            inputs = {
                k: v.to(env.device, non_blocking=True) for k, v in batch.items() if k not in ("labels", "num_tokens")
            }
            with no_sync:
                loss_sum = self._loss_sum(self.model, inputs, labels, amp)
                self.scaler.scale(loss_sum * scale).backward()
            loss_share += loss_sum.detach().double() / denom

        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        # The norm over all ranks' shards under FSDP (DTensor partial sums all-reduced), the local one under DDP
        # (whose gradients are already the same on every rank); then clip_grad_norm_'s own scaling.
        from trainer.fsdp import gathered_norm

        grads = [p.grad for p in self.trainable if p.grad is not None]
        grad_norm = gathered_norm(grads)
        torch.nn.utils.clip_grads_with_norm_(self.trainable, max_norm, grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.host_allocator is not None:
            self.host_allocator.trim()
        return loss_share, counts[1], grad_norm

    def _loss_sum(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
                  amp: contextlib.AbstractContextManager) -> torch.Tensor:
        """Forward of ``model`` and the summed token loss (fp32 scalar): chunked through ``self.head``
        (trainer/loss.py) or from the model's whole logits."""
        if self.head is None:
            with amp:
                logits = model(**inputs).logits
            return causal_lm_loss_sum(logits, labels)
        with amp, self.head.loss_mode(labels):
            out = model(**inputs)
        try:
            return self.head.loss(out.logits)
        except RuntimeError as exc:
            raise TrainingError(f"chunked loss: {exc}") from None

    def _eval_due(self, epoch_done: bool) -> bool:
        if self.eval_loader is None or self.cfg.eval_strategy == "no":
            return False
        if self.cfg.eval_strategy == "epoch":
            return epoch_done
        every = self.cfg.eval_steps or self.cfg.logging_steps
        return self.global_step % every == 0

    def _save_due(self, epoch_done: bool) -> bool:
        if self.cfg.save_strategy == "no":
            return False
        if self.cfg.save_strategy == "epoch":
            return epoch_done
        return self.global_step % self.cfg.save_steps == 0

    # ------------------------------------------------------------------ 7. evaluate

    def _eval_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
        """``(batch, counted)`` pairs of this rank's eval shard. Under FSDP every forward is a collective, so a
        rank whose shard has fewer batches runs extra forwards on a stand-in batch (not counted) until every
        rank has run as many as the largest shard."""
        assert self.eval_loader is not None
        done = 0
        for batch in self.eval_loader:
            done += 1
            yield batch, True
        if self.fsdp:
            per_rank = math.ceil(len(self.data.eval) / self.env.world_size)
            most = math.ceil(per_rank / self.cfg.per_device_eval_batch_size)
            if done < most:
                stand_in = self.eval_loader.collate_fn([self.data.eval[0]])
                for _ in range(most - done):
                    yield stand_in, False

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean token loss and perplexity on the eval data: each rank sums its shard's token losses and
        trainable tokens (on the unwrapped model: no DDP hooks; under FSDP every rank runs the same number
        of forwards, see :meth:`_eval_batches`), then one all-reduce adds them up.

        Returns (eval_loss, perplexity) and logs them on rank 0.
        """
        from trainer.data import count_trainable_tokens

        env = self.env
        module = self.peft_model
        module.eval()
        amp = autocast(env.device, self.dtype)
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # [loss_sum, trainable_tokens]
        for batch, counted in self._eval_batches():
            batch = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            batch.pop("num_tokens")
            loss_sum = self._loss_sum(module, batch, labels, amp)
            if not counted:
                continue
            sums[0] += loss_sum.double()
            sums[1] += count_trainable_tokens(labels)
        env.all_reduce_sum(sums)
        module.train()
        eval_loss = float(sums[0] / sums[1].clamp(min=1))
        ppl = math.exp(eval_loss) if eval_loss < 700 else float("inf")
        if self.eval_loss_first is None:
            self.eval_loss_first = eval_loss
        self.eval_loss_last, self.eval_ppl_last = eval_loss, ppl
        if env.is_main:
            self._write_metrics({
                "step": self.global_step, "eval_loss": eval_loss, "eval_perplexity": ppl,
                "eval_tokens": int(sums[1].item()),
            })
        return eval_loss, ppl

    # ------------------------------------------------------------------ 8. checkpoints

    def _state(self) -> ckpt.TrainerState:
        return ckpt.TrainerState(
            global_step=self.global_step, epoch=self.epoch, micro_batches_in_epoch=self.micro_in_epoch,
            tokens_seen=self.tokens_seen, world_size=self.env.world_size,
            per_device_train_batch_size=self.cfg.per_device_train_batch_size,
            gradient_accumulation_steps=self.cfg.gradient_accumulation_steps, seed=self.cfg.seed,
            train_loss_first=self.train_loss_first, eval_loss_first=self.eval_loss_first,
            elapsed_s=self._elapsed(), extra={"fsdp": self.cfg.fsdp_strategy} if self.fsdp else {},
        )

    def save_checkpoint(self) -> None:
        """Every rank hands its RNG state to rank 0 (a collective: all ranks call this), rank 0 writes
        ``checkpoint-STEP/`` atomically and prunes old ones; a barrier makes the checkpoint complete on disk
        before any rank moves on (so a crash right after it can always resume from it).

        Under FSDP every rank first writes its shard of the LoRA weights and optimizer state into rank 0's
        temp folder (``torch.distributed.checkpoint``; rank 0 writes its metadata), the LoRA weights are
        gathered to rank 0 for the PEFT-format adapter, and only then does rank 0 rename the folder."""
        rng_states = self.env.all_gather_object(ckpt.capture_rng_state())
        full = not self.cfg.save_only_model
        folder, adapter_state = None, None
        if self.fsdp:
            folder = self.env.broadcast_object(
                ckpt.new_checkpoint_folder(self.out, self.global_step) if self.env.is_main else None)
            if full:
                ckpt.save_sharded_state(folder / ckpt.SHARDED_DIR, self.model, self.optimizer)
            adapter_state = ckpt.gather_adapter_state(self.model)
        if self.env.is_main:
            ckpt.save_checkpoint(
                self.out, peft_model=self.peft_model,
                optimizer=self.optimizer if (full and not self.fsdp) else None, scheduler=self.scheduler,
                scaler=self.scaler, state=self._state(), rng_states=rng_states,
                save_total_limit=self.cfg.save_total_limit, folder=folder, adapter_state=adapter_state,
                resumable=full, tokenizer=self.tokenizer, vocab=self.vocab,
            )
        self.env.barrier()

    def _maybe_crash_for_test(self) -> None:
        """Test-only fault injection (see :data:`TEST_KILL_ENV`)."""
        at = os.environ.get(TEST_KILL_ENV)
        if at and int(at) == self.global_step and not self.restarted and self.env.rank == self.env.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ 9. finish

    def _param_bytes(self) -> int:
        """Bytes of parameter storage on this rank: its local shards under FSDP, every parameter under DDP."""
        from torch.distributed.tensor import DTensor

        total = 0
        for param in self.peft_model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
        return total

    def save_final(self) -> TrainReport:
        """Rank 0 writes ``adapter/`` (PEFT adapter + tokenizer files, atomically), ``train_report.json`` and
        ``loss.png``; every rank returns the same report."""
        import resource

        memory = self.env.all_gather_object(
            (self._param_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))  # Linux: KiB
        report = TrainReport(
            output_dir=str(self.out), adapter_dir=str(self.out / "adapter"), global_steps=self.global_step,
            epochs=round(self.global_step / self.plan.steps_per_epoch, 4), world_size=self.env.world_size,
            global_batch_size=self.plan.global_batch_size, num_train_samples=len(self.data.train),
            num_eval_samples=len(self.data.eval),
            num_dropped_samples=int(self.data.stats.get("num_dropped_no_trainable", 0)),
            trainable_params=self.trainable_params, total_params=self.total_params,
            tokens_seen=self.tokens_seen, tokens_per_second=round(self.tokens_seen / max(self._elapsed(), 1e-9), 2),
            train_loss_first=self.train_loss_first, train_loss_final=self.train_loss_last,
            eval_loss_first=self.eval_loss_first, eval_loss_final=self.eval_loss_last,
            eval_perplexity_final=self.eval_ppl_last, wall_time_s=round(self._elapsed(), 3),
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            data_stats={k: v for k, v in self.data.stats.items() if isinstance(v, (int, float, str, bool))},
            parallelism=self.cfg.fsdp_strategy if self.fsdp else "ddp",
            param_bytes_per_rank=[m[0] for m in memory], peak_rss_bytes_per_rank=[m[1] for m in memory],
            checkpointed_layers=checkpointed_layers(self.peft_model),
            network=self.network.to_dict() if getattr(self, "network", None) is not None else None,
        )
        adapter_state = ckpt.gather_adapter_state(self.model) if self.fsdp else None  # a collective
        if self.env.is_main:
            with atomic_directory(self.out / "adapter", overwrite=True) as tmp:
                from trainer.lf_compat import pissa_save_kwargs

                self.peft_model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False,
                                                state_dict=adapter_state, **pissa_save_kwargs(self.cfg, self.out))
                from trainer.lf_compat import write_base_record

                write_base_record(self.cfg, tmp)  # adapters merged into the base it was trained on
                self.tokenizer.save_pretrained(str(tmp))
                from trainer.vocab import save_plan

                save_plan(self.vocab, tmp)  # ferry_vocab.json when tokens were added (read by ferry export)

                if self.cfg.quantization_bit is not None:  # QLoRA: what the adapter was trained over
                    from ferry.adapter_folder import write_quant_record
                    from trainer.quant import quantization_record

                    write_quant_record(tmp, quantization_record(self.cfg, self.dtype))
            self._plot_loss()
            if self._tb is not None:
                self._tb.close()
            atomic_write_text(self.out / ckpt.REPORT_FILE, json.dumps(report.to_dict(), indent=2) + "\n")
        self.env.barrier()
        return report

    def cleanup(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
        self.env.destroy()

    # ------------------------------------------------------------------ logging helpers (rank 0)

    @property
    def tokens_seen(self) -> int:
        """Non-padding tokens processed so far, all ranks together."""
        return int(self._tokens_seen_t.item())

    def _elapsed(self) -> float:
        start = getattr(self, "session_start", None)
        return self.elapsed_before + (time.perf_counter() - start if start is not None else 0.0)

    def _open_logs(self) -> None:
        import yaml
        from tqdm.auto import tqdm

        atomic_write_text(self.out / TRAIN_CONFIG, yaml.safe_dump(self.cfg.resolved_dict(), sort_keys=False))
        from ferry.output import (  # issue 21: no redraws off a terminal
            ProgressLines,
            progress_is_live,
        )

        live = progress_is_live()
        self._lines = None if live or self.cfg.disable_tqdm else ProgressLines("ferry: train", self.plan.total_steps)
        self._pbar = tqdm(
            total=self.plan.total_steps, initial=self.global_step, desc="train", unit="step", dynamic_ncols=True,
            disable=self.cfg.disable_tqdm or not live, file=sys.stderr,
        )
        if self.cfg.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._pbar.write("ferry: tensorboard is not installed; report_to: tensorboard ignored")
            else:
                self._tb = SummaryWriter(log_dir=str(self.out / "runs" / (self.cfg.run_name or "train")))

    def _log_train(self, loss: float, tokens_per_s: float, grad_norm: float) -> None:
        if not math.isfinite(loss):
            raise TrainingError(f"train loss is {loss} at step {self.global_step}; lower learning_rate or use bf16")
        if self.train_loss_first is None:
            self.train_loss_first = loss
        self.train_loss_last = loss
        if not self.env.is_main:
            return
        lr = self.scheduler.get_last_lr()[0]
        epoch = self.epoch + self.micro_in_epoch / self.plan.micro_batches_per_epoch
        self._write_metrics({
            "step": self.global_step, "epoch": round(epoch, 4), "loss": loss, "lr": lr,
            "grad_norm": grad_norm, "tokens_per_second": round(tokens_per_s, 2), "tokens_seen": self.tokens_seen,
            "elapsed_s": round(self._elapsed(), 3),
        })
        if self._pbar is not None:
            self._pbar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
        if getattr(self, "_lines", None) is not None:
            self._lines.line(self.global_step, loss=f"{loss:.4f}", lr=f"{lr:.2e}", tokens_per_s=f"{tokens_per_s:.0f}")

    def _write_metrics(self, row: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = key.replace("eval_", "eval/") if key.startswith("eval_") else f"train/{key}"
                    self._tb.add_scalar(tag, value, row["step"])

    def _truncate_metrics(self, step: int) -> None:
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        keep = [
            line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        atomic_write_text(path, "".join(line + "\n" for line in keep))

    def _plot_loss(self) -> None:
        """``loss.png``: train (and eval) loss against step, from metrics.jsonl; skipped without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        rows = [json.loads(x) for x in (self.out / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if x]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        fig, ax = plt.subplots(figsize=(6, 4))
        if train:
            ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), marker="o", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        fig.tight_layout()
        tmp = self.out / ".loss.png.tmp"
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, self.out / "loss.png")


def train(cfg: TrainConfig) -> TrainReport:
    """Run one fine-tuning job in this process (a torchrun worker, or a single plain process).

    Returns the :class:`TrainReport` (the same on every rank). See :class:`FinetuneRecipe` for what happens
    and what it raises.
    """
    # Before transformers / huggingface_hub / peft are first imported (they read these at import time); this
    # module imports them lazily for that reason.
    apply_offline_env()
    recipe = FinetuneRecipe(cfg)
    try:
        recipe.setup_data()
        recipe.setup_distributed()
        recipe.setup_model()
        recipe.setup_loaders()
        recipe.setup_optimizer(recipe.plan.total_steps)
        recipe.restore_state()
        from trainer.netcheck import (
            preflight,  # issue 21: one timed all-reduce before step 1
        )

        recipe.network = preflight(recipe.env)
        recipe.train()
        return recipe.save_final()
    finally:
        recipe.cleanup()


__all__ = [
    "DistEnv",
    "FinetuneRecipe",
    "StepPlan",
    "TrainReport",
    "attention_pair_cost",
    "autocast",
    "build_lora_model",
    "causal_lm_loss_sum",
    "checkpointed_layers",
    "count_parameters",
    "find_all_linear_modules",
    "flattening_saves",
    "plan_steps",
    "samples_stay_apart_in_one_row",
    "train",
]
