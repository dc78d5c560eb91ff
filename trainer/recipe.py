"""The training recipe: LoRA fine-tuning with PyTorch DistributedDataParallel or FSDP2, one process per device.

Run by every torchrun worker (``torchrun --nproc-per-node N -m trainer CONFIG.yaml``, what ``ferry train``
starts), or by one plain process (no torchrun environment: world_size 1, no process group). The whole run is
:class:`FinetuneRecipe`, whose methods follow the life of a run top to bottom; :func:`train` drives it. The
helpers live in their own modules: :mod:`trainer.distributed` (the process group), :mod:`trainer.batching`
(samplers, collate, the step plan), :mod:`trainer.modeling` (base model + LoRA), :mod:`trainer.loss`,
:mod:`trainer.checkpoint` and :mod:`trainer.metrics`.

transformers, peft and huggingface_hub are imported inside functions, after :func:`train` has set the offline
variables (:data:`ferry.constants.OFFLINE_ENV`): importing this module changes no environment.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ferry.adapter_folder import TRAIN_CONFIG
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, TrainingError
from ferry.fsutil import atomic_directory, atomic_write_text
from trainer import checkpoint as ckpt
from trainer.batching import (
    ResumableBatchSampler,
    ShardSampler,
    StepPlan,
    attention_pair_cost,
    collate_with_token_count,
    plan_steps,
)
from trainer.distributed import DistEnv
from trainer.loss import causal_lm_loss_sum, count_trainable_tokens
from trainer.metrics import MetricLogger
from trainer.modeling import (
    apply_neftune,
    autocast,
    build_lora_model,
    checkpointed_layers,
    compute_dtype,
    count_parameters,
    resolved_revision,
    samples_stay_apart_in_one_row,
)
from trainer.targets import lora_config_for

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import Dataset

    from trainer.config import TrainConfig
    from trainer.data import Example

#: Test-only fault injection, read in exactly one place (:meth:`FinetuneRecipe._maybe_crash_for_test`):
#: ``FERRY_TEST_KILL_AT_STEP=N`` makes the last rank SIGKILL itself right after optimizer step N on the first
#: attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so tests can prove that torchrun's restart resumes exactly.
TEST_KILL_ENV = "FERRY_TEST_KILL_AT_STEP"

#: ``FERRY_SYNC_DEBUG=error`` (or ``warn``) runs every optimizer step after a session's first, its batches fetched
#: too, under torch's CUDA sync debug mode (:meth:`trainer.distributed.DistEnv.sync_debug`): an operation that makes
#: the host wait for the GPU raises (or warns) where it happens. The logging step's own reads run outside it.
#: benchmarks/gpu_check.py's ``syncs`` check sets it; no effect off CUDA.
SYNC_DEBUG_ENV = "FERRY_SYNC_DEBUG"

#: Batch keys (trainer.batching.collate_with_token_count) that are no model input.
_NOT_INPUTS = ("labels", "num_tokens", "loss_positions", "token_counts")


def to_device(value: Any, device: torch.device) -> Any:
    """A batch value on ``device``: tensors copied asynchronously (pinned on CUDA), host integers
    (``max_length_q``) as they are."""
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


@dataclass
class TrainReport:
    """What a finished run reports (``output_dir/train_report.json``).

    Losses are mean cross-entropy per trainable token (nats); ``tokens_*`` count non-padding input tokens
    summed over all ranks; times are wall-clock seconds. ``parallelism``: ``ddp`` or the FSDP strategy;
    ``param_bytes_per_rank``: bytes of parameter storage each rank holds (its shards under FSDP), measured;
    ``peak_rss_bytes_per_rank``: each rank's peak resident set size (``getrusage`` ru_maxrss);
    ``checkpointed_layers``: how many decoder layers recompute their activations in the backward (gradient
    checkpointing; 0 = off); ``network``: the pre-flight all-reduce (:class:`trainer.netcheck.NetCheck` as a
    dict) of a run with more than one process, else None. ``gpu_memory``: on CUDA, each rank's peak bytes
    allocated by tensors (``torch.cuda.max_memory_allocated``) and reserved by the caching allocator
    (``max_memory_reserved``, what the GPU had to hold) as ``{"peak_allocated_bytes": [per rank],
    "peak_reserved_bytes": [per rank]}``; None on CPU. ``fallbacks``: every feature the run asked for (or would use
    by default) but trains without, each ``{"feature": name, "reason": one line}`` (:data:`FALLBACK_FEATURES`).
    ``torch_compile``: with ``torch_compile``, rank 0's ``{"backend", "mode", "layers": decoder layers compiled,
    "graphs": graphs dynamo compiled in this process}`` (one layer's forward, plus one per recompile: eval mode, a
    new shape dynamo could not generalise), else None. ``attention``: the attention function the model ran
    (transformers' ``_attn_implementation``: ``sdpa``, ``eager``, ``flash_attention_2``, or ``ferry_varlen``, see
    :mod:`trainer.varlen`).
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
    network: dict[str, Any] | None = None
    gpu_memory: dict[str, list[int]] | None = None
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    stage: str = "sft"
    torch_compile: dict[str, Any] | None = None
    attention: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready types (what train_report.json holds)."""
        return asdict(self)

    def summary_line(self) -> str:
        """The worker's one-line summary of a finished run (rank 0 prints it): steps, speed, final loss, the
        adapter, then the slowest all-reduce, the largest rank's peak GPU memory and the fallbacks when any."""
        line = (
            f"ferry: trained {self.global_steps} steps on {self.world_size} process(es), "
            f"{self.tokens_per_second:.0f} tokens/s, final loss {self.train_loss_final:.4f}; "
            f"adapter in {self.adapter_dir}"
        )
        if self.network:
            line += (
                f"; slowest all-reduce {self.network['slowest_bandwidth'] / 1e6:.0f} MB/s (rank "
                f"{self.network['slowest_rank']})"
            )
        if self.gpu_memory:
            from trainer.gpus import gpu_memory_text

            line += f"; {gpu_memory_text(self.gpu_memory)}"
        if self.fallbacks:
            line += "; fallbacks: " + ", ".join(f["feature"] for f in self.fallbacks) + " (see train_report.json)"
        return line


#: The features a run falls back from, named in ``train_report.json``'s ``fallbacks``: ``chunked_loss`` (the loss
#: from the whole logits instead, trainer/loss.py), ``liger_kernel`` (ferry's chunked loss instead of liger's fused
#: one), ``padding_free`` (padded rows instead of one row per micro-batch), ``gradient_checkpointing`` (all
#: activations kept), ``mixed_precision`` (fp32 instead of bf16/fp16 without CUDA), ``fsdp`` (one plain process:
#: nothing to shard), ``fsdp_cpu_offload`` (on CPU the shards are in host memory already) and ``torch_compile`` (no
#: decoder layers found to compile).
FALLBACK_FEATURES = (
    "chunked_loss",
    "liger_kernel",
    "padding_free",
    "gradient_checkpointing",
    "mixed_precision",
    "fsdp",
    "fsdp_cpu_offload",
    "torch_compile",
)


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
        - Padding-free batches (``padding_free: auto``): on CPU, a micro-batch whose padding would cost more
          compute than the longer attention rows of laying its samples end to end runs as one row (position ids
          restart per sample; the same loss and gradients). On CUDA only flash-attention kernels get one row:
          there sdpa and eager need a ``[L, L]`` block-diagonal mask for it, which left the fast kernels and
          ran a step 2.4x slower than padded rows (:meth:`_one_row_pays`). Packing and padding-free rows are
          used only after a probe shows that the model keeps the samples of a row apart
          (:func:`samples_stay_apart_in_one_row`).
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
        self.varlen = False  # the model attends through trainer.varlen (_choose_varlen)
        self.images: Any = None  # trainer.vision.ImageProcessing when the data has image rows (setup_data)
        self.image_token_id: int | None = None
        self.videos: Any = None  # trainer.video.VideoProcessing when the data has video rows (setup_data)
        self.video_token_id: int | None = None
        self.fallbacks: list[dict[str, str]] = []  # TrainReport.fallbacks, the same on every rank
        if cfg.fsdp and not self.fsdp:
            self._fall_back("fsdp", "one process without torchrun: nothing to shard, fsdp ignored")
        if (cfg.bf16 or cfg.fp16) and self.env.device.type != "cuda":
            self._fall_back("mixed_precision", "no CUDA device: bf16/fp16 ignored, training in fp32")
        self.global_step = 0
        self.epoch = 0
        self.micro_in_epoch = 0
        self._tokens_seen_t = torch.zeros((), dtype=torch.float64, device=self.env.device)
        self.elapsed_before = 0.0
        self.session_start: float | None = None
        self.train_loss_first: float | None = None
        self.train_loss_last: float | None = None
        self.eval_loss_first: float | None = None
        self.eval_loss_last: float | None = None
        self.eval_ppl_last: float | None = None
        self.resumed_from: Path | None = None
        self.network: Any = None  # trainer.netcheck.NetCheck after check_network, with more than one process
        self.metrics = MetricLogger(self.out)  # written by rank 0 only

    def _fall_back(self, feature: str, reason: str, show: bool = True) -> None:
        """Record that the run trains without ``feature`` (one of :data:`FALLBACK_FEATURES`) for ``reason`` (one
        line), for train_report.json and the run summary; rank 0 prints ``ferry: FEATURE: REASON`` unless ``show``
        is False (the line was printed where the decision was made)."""
        self.fallbacks.append({"feature": feature, "reason": reason})
        if show and self.env.is_main:
            print(f"ferry: {feature}: {reason}", file=sys.stderr)

    # ------------------------------------------------------------------ 1. data (before the process group)

    def setup_data(self) -> None:
        """Seed, load the tokenizer and the tokenised data. Runs BEFORE ``init_process_group``: tokenising a
        large dataset can outlast the collective timeout; ``prepare_data`` loads the launcher's cache (or, when
        torchrun was started by hand, one rank builds it under a file lock while the others wait)."""
        from transformers import set_seed

        from ferry.hub import resolve_model
        from trainer.data import load_tokenizer, prepare_data
        from trainer.vocab import plan_vocab

        set_seed(self.cfg.seed)
        self.model_dir = resolve_model(self.cfg.model_name_or_path, self.cfg.model_revision)
        self.tokenizer = load_tokenizer(self.cfg)
        self.vocab = plan_vocab(self.cfg, self.tokenizer, self.model_dir)  # None unless tokens were added
        self.data = prepare_data(self.cfg, self.tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise TrainingError(f"tokenizer of {self.model_dir} has no pad token after load_tokenizer")
        stores = (self.data.train, self.data.eval)
        if any(store.images is not None or store.videos is not None for store in stores):
            self._setup_media(any(store.videos is not None for store in stores))

    @property
    def has_media(self) -> bool:
        """Whether the data has image or video rows (the model is then the whole vision-language class)."""
        return self.images is not None or self.videos is not None

    def _setup_media(self, videos: bool) -> None:
        """The image (and, for video rows, video) processing the collate runs (:mod:`trainer.vision`,
        :mod:`trainer.video`) and the slot tokens' ids."""
        from trainer.vision import IMAGE_TEMPLATES, ImageProcessing

        cfg = self.cfg
        slots = IMAGE_TEMPLATES[str(cfg.template)]
        if any(store.images is not None for store in (self.data.train, self.data.eval)):
            self.images = ImageProcessing(self.model_dir, cfg.image_max_pixels, cfg.image_min_pixels)
        token_id = self.tokenizer.convert_tokens_to_ids(slots.token)
        assert isinstance(token_id, int)  # ImageRows checked the token at tokenisation
        self.image_token_id = token_id
        if videos:
            from trainer.video import VideoProcessing

            self.videos = VideoProcessing(
                self.model_dir, cfg.video_max_pixels, cfg.video_min_pixels, cfg.video_fps, cfg.video_maxlen
            )
            video_id = self.tokenizer.convert_tokens_to_ids(slots.video)
            assert isinstance(video_id, int)
            self.video_token_id = video_id

    # ------------------------------------------------------------------ 2. process group and output_dir

    def setup_distributed(self) -> None:
        """Join the process group, then let rank 0 alone decide where the run starts (resume or not) and
        tell the others, so that every rank agrees even when output_dir is not on a shared file system."""
        self.env.init_process_group(self.cfg.ddp_timeout)
        decision: Any = None
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
        status, payload = self.env.broadcast_object(decision)
        if status == "error":
            raise payload
        self.loaded: ckpt.LoadedCheckpoint | None = payload
        if self.fsdp and self.cfg.save_strategy != "no":
            self._check_shared_output_dir()

    def _check_shared_output_dir(self) -> None:
        """FSDP checkpoints are written by every rank into one folder: with several nodes, output_dir must be
        on a file system they share. A rank that cannot see rank 0's marker there fails the run now, not at the
        first checkpoint (a collective: every rank calls it)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.env.world_size))
        if local >= self.env.world_size:
            return  # one node
        marker = self.out / f".ferry-shared-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{self.global_step}"
        missing = self.env.ranks_missing(marker)
        if missing > 0:
            raise ConfigError(
                f"fsdp: output_dir {str(self.out)!r} is not on a file system every node shares ({missing} "
                f"rank(s) cannot see it); every rank writes its checkpoint shard there (or set save_strategy: no)"
            )

    # ------------------------------------------------------------------ 3. model

    def setup_model(self) -> None:
        """Base model + LoRA, gradient checkpointing, then DDP or FSDP2, in this order:

        1. the model, right after the seed is set: peft draws the LoRA weights then (loading draws no random
           number), so every world size and both modes start from the same adapter and leave the global RNG
           (dropout) in the same state. DDP: every rank loads the whole model. FSDP
           (``trainer.fsdp.build_sharded_lora_model``): built on the meta device, every decoder layer and the
           root sharded, each rank reading only its rows of the weights;
        2. the adapter config names the base it was trained on (before anything saves it);
        3. a resumed checkpoint's adapter weights (under FSDP they come with the sharded state, in
           :meth:`setup_optimizer`);
        4. the probes (one-row samples, chunked loss): forwards of the unwrapped model, before DDP's hooks;
        5. NEFTune's hook on the input embeddings (``neftune_noise_alpha``, :func:`trainer.modeling.apply_neftune`);
        6. the DDP wrapper last, over the final parameters."""
        from transformers import set_seed

        set_seed(self.cfg.seed)
        self._build_model()
        base = self.peft_model.get_base_model()
        wants = self.cfg.activation_checkpointing if self.fsdp else self.cfg.gradient_checkpointing
        if wants and not getattr(base, "supports_gradient_checkpointing", False):
            # trainer.fsdp.enable_activation_checkpointing printed its line and trained on without it
            reason = f"{type(base).__name__} does not support it; training without it (more activation memory)"
            self._fall_back("gradient_checkpointing", reason, show=False)
        if self.cfg.pissa_init and self.env.is_main:  # the reference of pissa_convert (trainer/lf_compat.py)
            from trainer.lf_compat import save_pissa_initial

            save_pissa_initial(self.peft_model, self.out)
        self._name_base_model()
        self._load_adapter_state()
        self._probe_one_row()
        self._setup_loss_head()
        if self.cfg.neftune_noise_alpha:  # after the probes, whose forwards must see the embeddings as they are
            apply_neftune(self.peft_model, self.cfg.neftune_noise_alpha)
        self._compile_layers()
        self.model: torch.nn.Module = self._wrap_model()

    def _compile_layers(self) -> None:
        """``torch_compile``: ``Module.compile`` on every decoder layer (transformers' ``GradientCheckpointingLayer``
        modules), after the probes and before DDP wraps the model: regional compilation, as torchtune and
        torchtitan do it. The layers share their code and dynamo treats their parameters as inputs, so one graph
        serves them all; gradient checkpointing recomputes through the compiled layer."""
        cfg = self.cfg
        self.compile_info: dict[str, Any] | None = None
        if not cfg.torch_compile:
            return
        from torch._dynamo.utils import counters
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in self.peft_model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not layers:
            base = type(self.peft_model.get_base_model()).__name__
            self._fall_back("torch_compile", f"{base} has no decoder layers transformers marks; trained uncompiled")
            return
        backend, mode = cfg.torch_compile_backend or "inductor", cfg.torch_compile_mode
        for layer in layers:
            layer.compile(backend=backend, mode=mode)
        self._graphs_before = counters["stats"]["unique_graphs"]
        self.compile_info = {"backend": backend, "mode": mode, "layers": len(layers), "graphs": 0}

    def _compile_report(self) -> dict[str, Any] | None:
        """:attr:`compile_info` with the graphs dynamo compiled since :meth:`_compile_layers` (None without it)."""
        info: dict[str, Any] | None = getattr(self, "compile_info", None)
        if info is None:
            return None
        from torch._dynamo.utils import counters

        return {**info, "graphs": counters["stats"]["unique_graphs"] - self._graphs_before}

    def _build_model(self) -> None:
        """``peft_model``, ``trainable_params``, ``total_params``: sharded under FSDP (a 4-bit base through
        :mod:`trainer.quant`), else the whole model on this rank's device with gradient checkpointing."""
        cfg, env = self.cfg, self.env
        if not self.fsdp:
            self.peft_model = build_lora_model(
                cfg,
                self.model_dir,
                device=env.device,
                dtype=self.dtype,
                vocab=self.vocab,
                images=self.has_media,
            )
            self.trainable_params, self.total_params = count_parameters(self.peft_model)
            if cfg.gradient_checkpointing:
                from trainer.fsdp import enable_activation_checkpointing

                enable_activation_checkpointing(self.peft_model)
            return
        from trainer import fsdp as fs
        from trainer.lf_compat import refuse_under_fsdp

        fs.require_fsdp_torch()

        if cfg.fsdp_cpu_offload and env.device.type != "cuda":
            self._fall_back("fsdp_cpu_offload", "on CPU the shards are in host memory already; ignored")
        refuse_under_fsdp(cfg)  # adapter_name_or_path / pissa_init need the whole model
        self.host_allocator = fs.HostAllocator(env.device)  # before the first gathered layer is allocated
        self.mesh = fs.make_mesh(cfg.fsdp_strategy or "full_shard", env.device, env.world_size)
        common: dict[str, Any] = {
            "device": env.device,
            "dtype": self.dtype,
            "mesh": self.mesh,
            "lora_config": partial(lora_config_for, cfg),
        }
        if cfg.quantization_bit is not None:  # QLoRA: a 4-bit base with bf16-stored packed weights
            from trainer.quant import build_sharded_quantized_lora_model

            built = build_sharded_quantized_lora_model(cfg, self.model_dir, **common)
        else:
            built = fs.build_sharded_lora_model(cfg, self.model_dir, vocab=self.vocab, images=self.has_media, **common)
        self.peft_model, self.trainable_params, self.total_params = built

    def _name_base_model(self) -> None:
        """The adapter config names the base by its absolute folder (or the repo id) and resolved revision."""
        cfg = self.cfg
        peft_cfg = self.peft_model.peft_config["default"]
        path = Path(cfg.model_name_or_path).expanduser()
        peft_cfg.base_model_name_or_path = str(path.resolve()) if path.is_dir() else cfg.model_name_or_path
        peft_cfg.revision = resolved_revision(self.model_dir, cfg.model_revision)

    def _load_adapter_state(self) -> None:
        """A resumed checkpoint's parallelism must match this run's; under DDP its adapter weights load now.

        Raises:
            TrainingError: the checkpoint's adapter has keys this model does not.
        """
        if self.loaded is None:
            return
        ckpt.check_parallelism(self.loaded.state, self.loaded.path, self.cfg.fsdp_strategy if self.fsdp else None)
        if self.fsdp:  # the adapter comes with the sharded state
            return
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft_model, self.loaded.adapter_state)
        unexpected = result.unexpected_keys  # type: ignore[attr-defined]  # peft annotates the result `namedtuple`
        if unexpected:
            raise TrainingError(
                f"{self.loaded.path}: adapter does not fit this model/config: unexpected keys {unexpected[:5]}"
            )

    def _probe_one_row(self) -> None:
        """``one_row_ok``: whether neatly packed and padding-free rows, which hold several samples kept apart,
        are kept apart by this model (every rank decides alike). LLaMA-Factory's plain packing lets a row's
        samples attend to each other: no probe, no flattening (``cross_sample_attention``).

        Raises:
            ConfigError: ``neat_packing`` or ``padding_free: true`` on a model that fails the probe.
        """
        cfg = self.cfg
        self.cross_sample_attention = bool(cfg.packing) and not cfg.neat_packing and cfg.stage == "sft"
        isolated_packing = cfg.packing and not self.cross_sample_attention
        self.one_row_ok = False
        if self.has_media:  # a row's images and videos go with its row: padded rows only
            if cfg.padding_free is True or cfg.flash_attn == "varlen":
                key = "padding_free: true" if cfg.padding_free is True else "flash_attn: varlen"
                name = key.split(":")[0]
                raise ConfigError(f"{key} with image rows: each row keeps its own images; leave {name} out")
            return
        self._choose_varlen()
        padding_free = cfg.padding_free is True or (cfg.padding_free == "auto" and self._one_row_pays())
        if not (isolated_packing or (padding_free and not self.cross_sample_attention)):
            return
        probe = samples_stay_apart_in_one_row(self.peft_model, self.env.device, self.dtype)
        failed = torch.tensor(0.0 if probe.apart else 1.0, device=self.env.device)
        failed_ranks = int(self.env.all_reduce_sum(failed))
        self.one_row_ok = failed_ranks == 0
        reason = probe.reason() if not probe.apart else f"the one-row probe failed on {failed_ranks} other rank(s)"
        if not self.one_row_ok and (isolated_packing or cfg.padding_free is True):
            key = "neat_packing" if isolated_packing else "padding_free"
            raise ConfigError(
                f"{key}: {cfg.model_name_or_path} lets a sample attend to the one before it in a row "
                f"(its attention ignores position-id restarts with attn_implementation "
                f"{cfg.attn_implementation or 'default'}: {reason}); set {key}: false"
            )
        if not self.one_row_ok:  # padding_free: auto
            self._fall_back("padding_free", f"{reason}; padded rows instead")
            if self.varlen:  # padded rows go back to sdpa (the varlen function would lay them out as one row)
                from trainer.varlen import drop_varlen

                self.varlen = drop_varlen(self.peft_model)
        if self.fsdp:  # the probe's forward left the root unit (embeddings, norm, head) gathered: registered
            self.peft_model.reshard()  # as its full tensors, which the optimizer would hold instead of its shards

    def _one_row_pays(self) -> bool:
        """Whether ``padding_free: auto`` may lay a micro-batch out as one row here: on CPU yes (each batch then
        decides by FLOPs, :func:`flattening_saves`; 1.02-1.10x tokens/s in ``bench_train``), on CUDA only with a
        kernel that takes one row natively: flash attention or torch's varlen kernel (:mod:`trainer.varlen`).
        Measured on an H200 (``benchmarks/gpu_check.py`` ``profile``: Qwen2.5-0.5B shape, bf16, batch 4 of
        synthetic alpaca rows, sdpa): one masked row per micro-batch took 1.11 s a step against 0.46 s padded, as
        cuDNN's SDPA with a block-diagonal mask spent 6.5 ms of host time per call and 4x the device time of its
        causal kernel on padded rows."""
        return self.env.device.type != "cuda" or self._one_row_kernel()

    def _one_row_kernel(self) -> bool:
        """Whether the model's attention splits one row at its samples' boundaries itself (flash attention, or
        :mod:`trainer.varlen`): the batches are then always one row, carrying ``cu_seq_lens``."""
        flash = (self.cfg.attn_implementation or "").startswith("flash_attention")
        return flash or self.varlen

    def _choose_varlen(self) -> None:
        """``varlen``: whether the model attends through :mod:`trainer.varlen` (before the one-row probe, which
        then checks it). ``flash_attn: varlen`` asks for it (on CPU the per-sample reference; refused in one line
        where the kernel cannot run); ``padding_free`` auto or true with ``flash_attn: auto`` takes it on CUDA
        where torch has the kernel, and auto says in one line why not where it does not (padded rows instead).

        Raises:
            ConfigError: ``flash_attn: varlen`` on a model or device the kernel cannot serve.
        """
        from trainer.varlen import unsupported_attention, use_varlen, varlen_unavailable

        cfg, env = self.cfg, self.env
        self.varlen = False
        config = self.peft_model.get_base_model().config
        if cfg.flash_attn == "varlen":
            why = varlen_unavailable(env.device, self.dtype, config) if env.device.type == "cuda" else None
            why = why or unsupported_attention(config)
            if why is None and self.cross_sample_attention:
                why = "packing without neat_packing lets a row's samples attend to each other"
        elif cfg.flash_attn == "auto" and cfg.padding_free is not False and env.device.type == "cuda":
            if self.cross_sample_attention:
                return
            why = varlen_unavailable(env.device, self.dtype, config)
            if why is not None:
                if cfg.padding_free == "auto":
                    self._fall_back("padding_free", f"{why}; padded rows instead")
                return
        else:
            return
        if why is None and not use_varlen(self.peft_model):
            why = f"{type(self.peft_model.get_base_model()).__name__} does not take transformers' attention functions"
        if why is not None:
            if cfg.flash_attn == "varlen":
                raise ConfigError(f"flash_attn: varlen: {why}; set flash_attn: auto")
            self._fall_back("padding_free", f"{why}; padded rows instead")
            return
        self.varlen = True

    def _setup_loss_head(self) -> None:
        """``head``: the loss without the whole logits (:mod:`trainer.loss`) where its start-up probe shows it
        exact on every rank; None = the model's own logits."""
        from trainer.loss import setup_head

        env = self.env
        local: list[dict[str, str]] = []
        self.head = setup_head(
            self.peft_model,
            env.device,
            autocast(env.device, self.dtype),
            self.cfg.enable_liger_kernel,
            verbose=env.is_main,
            dtype=self.dtype,
            fallbacks=local,
        )
        for entry in local:  # setup_head printed them
            self._fall_back(entry["feature"], entry["reason"], show=False)
        whole = torch.tensor(0.0 if self.head is not None else 1.0, device=env.device)
        failed_ranks = int(env.all_reduce_sum(whole))
        if failed_ranks > 0 and self.head is not None:  # every rank decides alike
            self.head = None
            self._fall_back("chunked_loss", f"the start-up check failed on {failed_ranks} other rank(s)")

    def _wrap_model(self) -> torch.nn.Module:
        """What the steps run: the sharded model itself under FSDP (``fully_shard`` changed it in place),
        ``DistributedDataParallel`` over it with a process group, else the peft model."""
        env = self.env
        if self.fsdp:
            self.peft_model.reshard()  # the probes' forwards left the root unit gathered (see _probe_one_row)
            return self.peft_model
        if not env.initialized:
            return self.peft_model
        return self._ddp(self.peft_model)

    def _ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        """``DistributedDataParallel`` over ``module`` (this rank's device, buckets as gradient views, buffers
        synced at the start only unless ``ddp_broadcast_buffers``, ``ddp_bucket_cap_mb``)."""
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        cfg, env = self.cfg, self.env
        # torch 2.13 renamed broadcast_buffers (now deprecated, with a FutureWarning) to forward_sync_buffers
        renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
        sync_buffers: dict[str, Any] = {
            "forward_sync_buffers" if renamed else "broadcast_buffers": bool(cfg.ddp_broadcast_buffers)
        }
        return DDP(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            # static_graph: graph-level bucketing, once per run; not with no_sync (pytorch#143580) and
            # not needed with find_unused_parameters (which already re-traces every step).
            static_graph=cfg.gradient_accumulation_steps == 1 and not cfg.ddp_find_unused_parameters,
            find_unused_parameters=bool(cfg.ddp_find_unused_parameters),
            bucket_cap_mb=cfg.ddp_bucket_cap_mb,
            **sync_buffers,
        )

    # ------------------------------------------------------------------ 4. data loaders and the step plan

    def setup_loaders(self) -> None:
        """Train loader: DistributedSampler (seed, shuffle; identical order on every world size, then split
        by rank) batched by :class:`ResumableBatchSampler`. Eval loader: :class:`ShardSampler`. After the model:
        the batch layout (padded or one row) depends on the one-row probe and the model's attention cost."""
        cfg, env = self.cfg, self.env
        collate = self._collate()
        # ExampleStore is a map-style dataset (len and indexing) that does not derive from torch's Dataset
        examples = self._train_set()
        train_set = cast("Dataset[Example]", examples)
        self.eval_set = self._eval_set()
        self.sampler: DistributedSampler[int] = DistributedSampler(  # yields indices into train_set
            train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=cfg.seed, drop_last=False
        )
        self.batch_sampler = ResumableBatchSampler(  # each step's micro-batches grouped by length (exact)
            self.sampler,
            cfg.per_device_train_batch_size,
            group=cfg.gradient_accumulation_steps,
            lengths=examples.lengths(),
        )
        pin = env.device.type == "cuda"
        self.train_loader = DataLoader(
            train_set,
            batch_sampler=self.batch_sampler,
            collate_fn=collate,
            num_workers=cfg.dataloader_num_workers,
            pin_memory=pin,
            # Its own generator: creating an iterator then draws no number from the global RNG (the dropout
            # stream), which a resumed run, creating its iterator mid-epoch, would draw out of step.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        self.eval_loader: DataLoader[Example] | None = None
        if len(self.eval_set):
            self.eval_loader = DataLoader(
                cast("Dataset[Example]", self.eval_set),
                sampler=ShardSampler(len(self.eval_set), env.rank, env.world_size),
                batch_size=cfg.per_device_eval_batch_size,
                collate_fn=collate,
                num_workers=cfg.dataloader_num_workers,
                pin_memory=pin,
            )
        self.plan: StepPlan = plan_steps(len(examples), cfg, env.world_size)

    def _collate(self) -> Any:
        """The loaders' collate: padded rows or one row per micro-batch (padding-free, packed, flash attention),
        decided after the model (the one-row probe and the model's attention cost)."""
        cfg = self.cfg
        one_row = self._one_row_kernel()
        pair_cost = None  # padded rows: padding_free false; auto on CUDA or on a model that failed the probe
        if cfg.padding_free == "auto" and self.one_row_ok and self._one_row_pays():
            pair_cost = attention_pair_cost(self.peft_model.get_base_model().config)
        elif cfg.padding_free is True:
            pair_cost = 0.0
        return partial(
            collate_with_token_count,
            pad_token_id=int(self.tokenizer.pad_token_id),
            flatten=one_row,
            pair_cost=pair_cost,
            cross_sample_attention=self.cross_sample_attention,
            with_positions=True,  # the loss's labelled rows, found on the CPU (no device sync per micro-batch)
            causal=True,  # one-sample rows: no [b, 1, L, L] mask (sdpa's is_causal and native GQA)
            cu_seq_lens=one_row,  # the samples' boundaries for the kernel, found on the host
            images=self.images,
            image_token_id=self.image_token_id,
            videos=self.videos,
            video_token_id=self.video_token_id,
        )

    def _train_set(self) -> Any:
        """What the train sampler indexes (a sequence with ``lengths()``): the tokenised examples."""
        return self.data.train

    def _eval_set(self) -> Any:
        """What the eval loader reads: the tokenised eval examples."""
        return self.data.eval

    # ------------------------------------------------------------------ 5. optimizer, scheduler, scaler

    def setup_optimizer(self, total_steps: int) -> None:
        """The optimizer (``optim``: AdamW or SGD) over the trainable parameters (no weight decay on biases and
        norms: 1-d tensors) and the LR schedule over ``total_steps``. The scheduler can only be built once the
        number of steps is known (after the loaders); a resumed checkpoint's optimizer, scheduler and scaler
        state load last, into the objects built here."""
        from transformers import get_scheduler

        cfg = self.cfg
        fused = self.env.device.type == "cuda"
        self.trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        if cfg.loraplus_lr_ratio is not None:  # peft's LoRA+ groups (trainer/lf_compat.py)
            from trainer.lf_compat import loraplus_optimizer

            self.optimizer = loraplus_optimizer(self.peft_model, cfg, fused=fused)
        else:
            from trainer.lf_compat import torch_optimizer

            groups = [
                {"params": [p for p in self.trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in self.trainable if p.ndim < 2], "weight_decay": 0.0},
            ]
            optimizer_cls, kwargs = torch_optimizer(cfg, fused=fused)
            self.optimizer = optimizer_cls([g for g in groups if g["params"]], lr=cfg.learning_rate, **kwargs)
        warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)
        self.scheduler = get_scheduler(
            cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
        )
        fp16 = self.env.device.type == "cuda" and self.dtype == torch.float16
        self.scaler: torch.amp.GradScaler
        if self.fsdp:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler("cuda", enabled=fp16)  # inf checks all-reduced over the shards
        else:
            self.scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        self._load_optimizer_state()

    def _load_optimizer_state(self) -> None:
        """A resumed checkpoint's optimizer (with the sharded adapter under FSDP), scheduler and scaler."""
        loaded = self.loaded
        if loaded is None:
            return
        if loaded.sharded_dir is not None:
            ckpt.load_sharded_state(loaded.sharded_dir, self.model, self.optimizer)
        else:
            self.optimizer.load_state_dict(loaded.optimizer)
        self.scheduler.load_state_dict(loaded.scheduler)
        if loaded.scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(loaded.scaler)

    # ------------------------------------------------------------------ 6. restore the run's position

    def restore_state(self) -> None:
        """Continue where the checkpoint stopped: step, epoch, micro-batches consumed in the epoch, this
        rank's RNG state. metrics.jsonl keeps only rows up to the starting step (:meth:`MetricLogger.truncate`)."""
        if self.loaded is None:
            if self.env.is_main:
                self.metrics.truncate(0)
            return
        state, cfg = self.loaded.state, self.cfg
        ckpt.check_batch_shape(
            state,
            self.loaded.path,
            self.env.world_size,
            cfg.per_device_train_batch_size,
            cfg.gradient_accumulation_steps,
        )
        self.global_step = state.global_step
        self.epoch = state.epoch
        self.micro_in_epoch = state.micro_batches_in_epoch
        self._tokens_seen_t.fill_(state.tokens_seen)
        self.elapsed_before = state.elapsed_s
        self.train_loss_first = state.train_loss_first
        self.eval_loss_first = state.eval_loss_first
        if self.loaded.rng_states:
            ckpt.restore_rng_state(
                self.loaded.rng_states[self.env.rank % len(self.loaded.rng_states)],
                self.env.device,
                verbose=self.env.is_main,
            )
        self.resumed_from = self.loaded.path
        if self.env.is_main:
            self.metrics.truncate(self.global_step)
        self.loaded = None  # free the CPU copies

    # ------------------------------------------------------------------ 7. the network, then train

    def check_network(self) -> None:
        """One timed all-reduce before step 1 (:func:`trainer.netcheck.preflight`; more than one process)."""
        from trainer.netcheck import preflight

        self.network = preflight(self.env)

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
        sync_mode = sync_debug_mode()
        session_steps = 0  # the first step of a session (a fresh run or a resumed one) builds kernels: not checked

        while self.global_step < plan.total_steps:
            self.sampler.set_epoch(self.epoch)  # a new shuffle each epoch, the same on every rank
            self.batch_sampler.skip = self.micro_in_epoch  # > 0 only when resuming mid-epoch
            batches = iter(self.train_loader)
            while True:
                n_micro = min(cfg.gradient_accumulation_steps, plan.micro_batches_per_epoch - self.micro_in_epoch)
                with env.sync_debug(sync_mode if session_steps else None):
                    micro_batches = [next(batches) for _ in range(n_micro)]
                    step_loss, step_tokens, grad_norm = self._optimizer_step(micro_batches)
                session_steps += 1
                self.micro_in_epoch += n_micro
                self.global_step += 1
                self._tokens_seen_t += step_tokens
                window_loss += step_loss
                window_tokens += step_tokens
                window_steps += 1
                epoch_done = self.micro_in_epoch >= plan.micro_batches_per_epoch
                last = self.global_step >= plan.total_steps
                self.metrics.advance()

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
        self.metrics.close_progress()
        if self.eval_loader is not None:
            self.evaluate()

    def _open_logs(self) -> None:
        """Rank 0: the resolved config into ``train_config.yaml``, then the progress display and TensorBoard."""
        import yaml

        atomic_write_text(self.out / TRAIN_CONFIG, yaml.safe_dump(self.cfg.resolved_dict(), sort_keys=False))
        cfg = self.cfg
        self.metrics.open(
            total_steps=self.plan.total_steps,
            initial_step=self.global_step,
            disable_tqdm=cfg.disable_tqdm,
            report_to=cfg.report_to,
            run_name=cfg.run_name,
        )

    def _optimizer_step(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over ``micro_batches`` (this rank's share of the global batch).

        Returns device tensors (no host sync): this rank's share of the step's mean token loss (the shares sum
        over ranks to the global batch's mean loss), the global batch's non-padding tokens (all ranks), and
        the global gradient norm before clipping.
        """
        env = self.env
        # One all-reduce before any backward: [trainable tokens, non-padding tokens] of the global batch, counted
        # by the collate on the host and copied without a sync (torch.tensor(list, device="cuda") would wait for
        # the GPU to run everything queued).
        local = torch.stack([mb["token_counts"] for mb in micro_batches]).sum(0)
        counts = env.all_reduce_sum(env.from_host(local))
        denom = counts[0].clamp(min=1.0)  # a global batch with no trainable token contributes nothing
        scale = (env.world_size / denom).float()
        amp = autocast(env.device, self.dtype)
        loss_share = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, batch in enumerate(micro_batches):
            no_sync = self._micro_context(i, len(micro_batches))
            labels = batch["labels"].to(env.device, non_blocking=True)  # pinned on CUDA: an asynchronous copy
            positions = batch["loss_positions"].to(env.device, non_blocking=True)
            inputs = {k: to_device(v, env.device) for k, v in batch.items() if k not in _NOT_INPUTS}
            with no_sync:
                loss_sum = self._loss_sum(self.model, inputs, labels, amp, positions)
                self.scaler.scale(loss_sum * scale).backward()
            loss_share += loss_sum.detach().double() / denom
        return loss_share, counts[1], self._apply_update()

    def _micro_context(self, index: int, count: int) -> contextlib.AbstractContextManager:
        """Gradient sync for micro-batch ``index`` of ``count``: only the last one reduces gradients (DDP's
        ``no_sync`` on the others; FSDP2 keeps unsharded gradients locally until the last)."""
        syncing = index == count - 1
        if self.fsdp:  # FSDP2: keep unsharded gradients locally, reduce-scatter their sum on the last one
            cast("FSDPModule", self.model).set_requires_gradient_sync(syncing)
        elif not syncing and self.env.initialized:  # DDP (see _wrap_model)
            return cast("DistributedDataParallel", self.model).no_sync()
        return contextlib.nullcontext()

    def _apply_update(self) -> torch.Tensor:
        """Unscale, clip to ``max_grad_norm``, step the optimizer, scheduler and scaler, zero the gradients;
        returns the global gradient norm before clipping (a device scalar)."""
        cfg = self.cfg
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
        return grad_norm

    def _loss_sum(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        labels: torch.Tensor,
        amp: contextlib.AbstractContextManager,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward of ``model`` and the summed token loss (fp32 scalar): chunked through ``self.head``
        (trainer/loss.py; ``positions``: the batch's ``loss_positions``, so that no device sync finds them) or from
        the model's whole logits."""
        if self.head is None:
            with amp:
                logits = model(**inputs).logits
            return causal_lm_loss_sum(logits, labels)
        with amp, self.head.loss_mode(labels, positions):
            out = model(**inputs)
        try:
            return self.head.loss(out.logits)
        except RuntimeError as exc:
            raise TrainingError(f"chunked loss: {exc}") from None

    def _log_train(self, loss: float, tokens_per_s: float, grad_norm: float) -> None:
        """Record a logged step's mean loss (every rank), and on rank 0 write its row and show it.

        Raises:
            TrainingError: the loss is not finite.
        """
        if not math.isfinite(loss):
            raise TrainingError(f"train loss is {loss} at step {self.global_step}; lower learning_rate or use bf16")
        if self.train_loss_first is None:
            self.train_loss_first = loss
        self.train_loss_last = loss
        extra = self._window_metrics()  # on every rank: a subclass's may all-reduce
        if not self.env.is_main:
            return
        lr = self.scheduler.get_last_lr()[0]
        epoch = self.epoch + self.micro_in_epoch / self.plan.micro_batches_per_epoch
        self.metrics.write(
            {
                "step": self.global_step,
                "epoch": round(epoch, 4),
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_second": round(tokens_per_s, 2),
                "tokens_seen": self.tokens_seen,
                "elapsed_s": round(self._elapsed(), 3),
                **extra,
            }
        )
        self.metrics.show(self.global_step, loss, lr, tokens_per_s)

    def _window_metrics(self) -> dict[str, float]:
        """More keys for a logged step's metrics row, over the steps since the last one (a collective: every rank
        calls it). None here; the preference recipe adds its rewards."""
        return {}

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

    # ------------------------------------------------------------------ 8. evaluate

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean token loss and perplexity on the eval data: each rank sums its shard's token losses and
        trainable tokens (on the unwrapped model: no DDP hooks; under FSDP every rank runs the same number
        of forwards, see :meth:`_eval_batches`), then one all-reduce adds them up.

        Returns (eval_loss, perplexity) and logs them on rank 0.
        """
        env = self.env
        module = self.peft_model
        module.eval()
        amp = autocast(env.device, self.dtype)
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # [loss_sum, trainable_tokens]
        for batch, counted in self._eval_batches():
            tokens = count_trainable_tokens(batch["labels"])  # on the CPU batch: no device sync
            batch = {k: to_device(v, env.device) for k, v in batch.items()}
            labels, positions = batch.pop("labels"), batch.pop("loss_positions")
            batch.pop("num_tokens"), batch.pop("token_counts")
            loss_sum = self._loss_sum(module, batch, labels, amp, positions)
            if not counted:
                continue
            sums[0] += loss_sum.double()
            sums[1] += tokens
        env.all_reduce_sum(sums)
        module.train()
        eval_loss = float(sums[0] / sums[1].clamp(min=1))
        ppl = math.exp(eval_loss) if eval_loss < 700 else float("inf")
        if self.eval_loss_first is None:
            self.eval_loss_first = eval_loss
        self.eval_loss_last, self.eval_ppl_last = eval_loss, ppl
        if env.is_main:
            self.metrics.write(
                {
                    "step": self.global_step,
                    "eval_loss": eval_loss,
                    "eval_perplexity": ppl,
                    "eval_tokens": int(sums[1].item()),
                }
            )
        return eval_loss, ppl

    def _eval_batches(
        self, loader: DataLoader[Any] | None = None, dataset: Any = None
    ) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
        """``(batch, counted)`` pairs of this rank's shard of ``loader`` (over ``dataset``, sharded by
        :class:`~trainer.batching.ShardSampler`; default: the eval loader). Under FSDP every forward is a
        collective, so a rank whose shard has fewer batches runs extra forwards on a stand-in batch (not counted)
        until every rank has run as many as the largest shard."""
        loader = self.eval_loader if loader is None else loader
        dataset = self.eval_set if dataset is None else dataset
        assert loader is not None
        done = 0
        for batch in loader:
            done += 1
            yield batch, True
        if self.fsdp:
            per_rank = math.ceil(len(dataset) / self.env.world_size)
            most = math.ceil(per_rank / (loader.batch_size or 1))
            if done < most:
                stand_in = loader.collate_fn([dataset[0]])
                for _ in range(most - done):
                    yield stand_in, False

    # ------------------------------------------------------------------ 9. checkpoints

    def save_checkpoint(self) -> None:
        """Every rank hands its RNG state to rank 0 (a collective: all ranks call this), rank 0 writes
        ``checkpoint-STEP/`` atomically and prunes old ones; a barrier makes the checkpoint complete on disk
        before any rank moves on (so a crash right after it can always resume from it).

        Under FSDP every rank first writes its shard of the LoRA weights and optimizer state into rank 0's
        temp folder (``torch.distributed.checkpoint``; rank 0 writes its metadata), the LoRA weights are
        gathered to rank 0 for the PEFT-format adapter, and only then does rank 0 rename the folder."""
        rng_states = self.env.all_gather_object(ckpt.capture_rng_state(self.env.device))
        with self._host_write_errors(f"{ckpt.CHECKPOINT_PREFIX}{self.global_step} to {self.out}"):
            self._write_checkpoint(rng_states)
        self.env.barrier()

    def _write_checkpoint(self, rng_states: list[dict[str, Any]]) -> None:
        """The writes of :meth:`save_checkpoint`: FSDP shards on every rank, the checkpoint folder on rank 0."""
        full = not self.cfg.save_only_model
        folder, adapter_state = None, None
        if self.fsdp:
            folder = self.env.broadcast_object(
                ckpt.new_checkpoint_folder(self.out, self.global_step) if self.env.is_main else None
            )
            if full:
                ckpt.save_sharded_state(folder / ckpt.SHARDED_DIR, self.model, self.optimizer)
            adapter_state = ckpt.gather_adapter_state(self.model)
        if self.env.is_main:
            ckpt.save_checkpoint(
                self.out,
                peft_model=self.peft_model,
                optimizer=self.optimizer if (full and not self.fsdp) else None,
                scheduler=self.scheduler,
                scaler=self.scaler,
                state=self._state(),
                rng_states=rng_states,
                save_total_limit=self.cfg.save_total_limit,
                folder=folder,
                adapter_state=adapter_state,
                resumable=full,
                tokenizer=self.tokenizer,
                vocab=self.vocab,
                extra_files=self._adapter_files(),
            )

    @contextlib.contextmanager
    def _host_write_errors(self, what: str) -> Iterator[None]:
        """Turn a write error of the host while writing ``what`` (a full disk or quota, a folder made read-only)
        into one :class:`TrainingError` line (:func:`ferry.fsutil.host_write_error`): the file, the free space in
        ``output_dir`` and what to do (``ferry train``'s line adds that running it again resumes from the newest
        checkpoint). What the failed write staged is already removed (``atomic_directory``; under FSDP another
        rank's half-written shard folder by the next launch).

        Raises:
            TrainingError: the write failed for a reason the user fixes on the host.
        """
        try:
            yield
        except Exception as exc:  # OSError; safetensors' SafetensorError carries the OS error in its message
            line = ckpt.write_error_line(exc, what, self.out, self.env.rank)
            if line is None:
                raise
            raise TrainingError(
                f"{line}; nothing half-written is kept; make room (save_total_limit keeps fewer checkpoints)"
            ) from None

    def _state(self) -> ckpt.TrainerState:
        """The run's position and counters as a checkpoint records them."""
        return ckpt.TrainerState(
            global_step=self.global_step,
            epoch=self.epoch,
            micro_batches_in_epoch=self.micro_in_epoch,
            tokens_seen=self.tokens_seen,
            world_size=self.env.world_size,
            per_device_train_batch_size=self.cfg.per_device_train_batch_size,
            gradient_accumulation_steps=self.cfg.gradient_accumulation_steps,
            seed=self.cfg.seed,
            train_loss_first=self.train_loss_first,
            eval_loss_first=self.eval_loss_first,
            elapsed_s=self._elapsed(),
            extra={"fsdp": self.cfg.fsdp_strategy} if self.fsdp else {},
        )

    def _maybe_crash_for_test(self) -> None:
        """Test-only fault injection (see :data:`TEST_KILL_ENV`)."""
        at = os.environ.get(TEST_KILL_ENV)
        if at and int(at) == self.global_step and not self.restarted and self.env.rank == self.env.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ 10. finish

    def save_final(self) -> TrainReport:
        """Rank 0 writes ``adapter/`` (PEFT adapter + tokenizer files, atomically), ``loss.png`` (``plot_loss``)
        and ``train_report.json``; every rank returns the same report. The report is built first: its memory
        figures are gathered from every rank (a collective), as is the adapter under FSDP."""
        report = self._report()
        adapter_state = ckpt.gather_adapter_state(self.model) if self.fsdp else None  # a collective
        if self.env.is_main:
            with self._host_write_errors(f"the adapter to {self.out / 'adapter'}"):
                self._save_adapter(adapter_state)
            self.metrics.finish(plot_loss=self.cfg.plot_loss)
            with self._host_write_errors(f"{self.out / ckpt.REPORT_FILE}"):
                atomic_write_text(self.out / ckpt.REPORT_FILE, json.dumps(report.to_dict(), indent=2) + "\n")
        self.env.barrier()
        return report

    def _report(self) -> TrainReport:
        """The :class:`TrainReport`, with every rank's parameter bytes, peak RSS and peak GPU memory, and rank 0's
        fallbacks (collectives)."""
        import resource

        device = self.env.device
        gpu = (
            (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            if device.type == "cuda"
            else None
        )
        memory = self.env.all_gather_object(
            (self._param_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, gpu)  # Linux: KiB
        )
        gpu_memory = None
        if all(m[2] is not None for m in memory):
            gpu_memory = {
                "peak_allocated_bytes": [int(m[2][0]) for m in memory],
                "peak_reserved_bytes": [int(m[2][1]) for m in memory],
            }
        data, elapsed = self.data, self._elapsed()
        return TrainReport(
            output_dir=str(self.out),
            adapter_dir=str(self.out / "adapter"),
            global_steps=self.global_step,
            epochs=round(self.global_step / self.plan.steps_per_epoch, 4),
            world_size=self.env.world_size,
            global_batch_size=self.plan.global_batch_size,
            num_train_samples=len(data.train),
            num_eval_samples=len(data.eval),
            num_dropped_samples=int(data.stats.get("num_dropped_no_trainable", 0)),
            trainable_params=self.trainable_params,
            total_params=self.total_params,
            tokens_seen=self.tokens_seen,
            tokens_per_second=round(self.tokens_seen / max(elapsed, 1e-9), 2),
            train_loss_first=self.train_loss_first,
            train_loss_final=self.train_loss_last,
            eval_loss_first=self.eval_loss_first,
            eval_loss_final=self.eval_loss_last,
            eval_perplexity_final=self.eval_ppl_last,
            wall_time_s=round(elapsed, 3),
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            data_stats={k: v for k, v in data.stats.items() if isinstance(v, (int, float, str, bool))},
            parallelism=(self.cfg.fsdp_strategy or "full_shard") if self.fsdp else "ddp",  # make_mesh's default
            param_bytes_per_rank=[m[0] for m in memory],
            peak_rss_bytes_per_rank=[m[1] for m in memory],
            checkpointed_layers=checkpointed_layers(self.peft_model),
            network=self.network.to_dict() if self.network is not None else None,
            gpu_memory=gpu_memory,
            fallbacks=list(self.env.broadcast_object(self.fallbacks)),
            torch_compile=self._compile_report(),
            attention=getattr(self.peft_model.get_base_model().config, "_attn_implementation", None),
        )

    def _param_bytes(self) -> int:
        """Bytes of parameter storage on this rank: its local shards under FSDP, every parameter under DDP."""
        from torch.distributed.tensor import DTensor

        total = 0
        for param in self.peft_model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
        return total

    def _save_adapter(self, adapter_state: dict[str, torch.Tensor] | None) -> None:
        """Rank 0: ``output_dir/adapter/`` atomically: the PEFT adapter (``adapter_state``: the gathered FSDP
        weights), the base record, the tokenizer files, the vocabulary, (QLoRA) quantisation and RoPE records."""
        from ferry.adapter_folder import write_quant_record
        from trainer.lf_compat import pissa_save_kwargs, write_base_record
        from trainer.vocab import save_plan

        with atomic_directory(self.out / "adapter", overwrite=True) as tmp:
            self.peft_model.save_pretrained(
                str(tmp),
                safe_serialization=True,
                save_embedding_layers=False,
                state_dict=adapter_state,
                selected_adapters=[self.peft_model.active_adapter],  # not a dpo run's frozen reference adapter
                **pissa_save_kwargs(self.cfg, self.out),
            )
            write_base_record(self.cfg, tmp)  # adapters merged into the base it was trained on
            self.tokenizer.save_pretrained(str(tmp))
            save_plan(self.vocab, tmp)  # ferry_vocab.json when tokens were added (read by ferry export)
            for name, tensors in self._adapter_files().items():  # stage rm: value_head.safetensors
                from safetensors.torch import save_file

                save_file(tensors, str(tmp / name))
            if self.cfg.quantization_bit is not None:  # QLoRA: what the adapter was trained over
                from trainer.quant import quantization_record

                write_quant_record(tmp, quantization_record(self.cfg, self.dtype, self.env.device))
            if self.cfg.rope_scaling is not None:  # the stretched RoPE the base must be loaded with under it
                self._save_rope_record(tmp)

    def _save_rope_record(self, folder: Path) -> None:
        """``ferry_rope.json`` in ``folder`` when ``rope_scaling`` scaled the base (the decision training made,
        taken again from the base's config: :func:`ferry.rope.rope_scaling_for`)."""
        from transformers import AutoConfig

        from ferry.adapter_folder import write_rope_record
        from ferry.rope import rope_scaling_for

        config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=self.cfg.trust_remote_code)
        scaling, _ = rope_scaling_for(self.cfg, config)
        if scaling is not None:
            write_rope_record(folder, scaling)

    def _adapter_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors saved beside the adapter and in every checkpoint (file name -> safetensors state): none
        here; stage rm's value head (trainer/reward_recipe.py)."""
        return {}

    def cleanup(self) -> None:
        """Close the progress bar and leave the process group (also after a failure)."""
        self.metrics.close()
        self.env.destroy()

    # ------------------------------------------------------------------ clocks and counters

    @property
    def tokens_seen(self) -> int:
        """Non-padding tokens processed so far, all ranks together."""
        return int(self._tokens_seen_t.item())

    def _elapsed(self) -> float:
        """Training seconds so far: earlier attempts' (from the checkpoint) plus this session's."""
        start = self.session_start
        return self.elapsed_before + (time.perf_counter() - start if start is not None else 0.0)


def run(recipe: FinetuneRecipe) -> TrainReport:
    """Run ``recipe`` (a :class:`FinetuneRecipe`, or a subclass for another stage) from data to the saved adapter
    in this process (a torchrun worker, or a single plain process). Returns the :class:`TrainReport` (the same on
    every rank); raises what the recipe raises."""
    # Before transformers / huggingface_hub / peft are first imported (they read these at import time); this
    # module imports them lazily for that reason.
    apply_offline_env()
    try:
        recipe.setup_data()
        recipe.setup_distributed()
        recipe.setup_model()
        recipe.setup_loaders()
        recipe.setup_optimizer(recipe.plan.total_steps)
        recipe.restore_state()
        recipe.check_network()
        recipe.train()
        return recipe.save_final()
    finally:
        recipe.cleanup()


def sync_debug_mode() -> str | None:
    """:data:`SYNC_DEBUG_ENV`'s mode (``"warn"``, ``"error"``), or None when it is unset or ``"default"``.

    Raises:
        ConfigError: another value (naming the variable).
    """
    mode = os.environ.get(SYNC_DEBUG_ENV, "").strip().lower()
    if mode not in ("", "default", "warn", "error"):
        raise ConfigError(f"{SYNC_DEBUG_ENV}={mode!r}: expected warn, error or default")
    return mode if mode in ("warn", "error") else None


def train(cfg: TrainConfig) -> TrainReport:
    """Run one ``stage: sft`` or ``pt`` job in this process (:func:`run` of a :class:`FinetuneRecipe`); every
    stage: :func:`trainer.stages.train`.

    Raises:
        ConfigError: another stage (its recipe is not this one).
        And what :class:`FinetuneRecipe` raises.
    """
    if cfg.stage not in ("sft", "pt"):
        raise ConfigError(f"stage {cfg.stage}: trainer.recipe.train runs sft and pt; use trainer.stages.train")
    return run(FinetuneRecipe(cfg))


__all__ = ["FALLBACK_FEATURES", "TEST_KILL_ENV", "FinetuneRecipe", "TrainReport", "run", "train"]
