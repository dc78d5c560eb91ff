"""``ferry train``: validate, tokenise once, then start the workers through torchrun.

::

    launching process (ferry train)                      torchrun agent + workers
    ───────────────────────────────────────────          ──────────────────────────────────────────
    load_config, rendezvous options, output_dir check
    resolved config -> temp YAML, start torchrun   ──▶   python -m torch.distributed.run ... -m trainer
    model + data checks, prepare_data fills the          each worker imports torch/transformers/peft,
      tokenised cache (--dry-run: print, stop)             then waits at the start gate
    gate <- "go" (or "abort" + the error)          ──▶   train(): loads the cache, init_process_group...
    wait for torchrun, read train_report.json

Tokenising in the launching process means the workers only load the cache, so no rank sits in tokenisation
while the others wait in a collective (the NCCL-timeout trap); doing it while the workers import their
libraries hides most of its cost. A bad model or dataset is reported by the launcher as one line and the
waiting workers exit quietly. Every process runs with the offline variables of
:data:`ferry.constants.OFFLINE_ENV` set.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, TrainingError
from ferry.fsutil import atomic_write_text

#: The start gate between ``launch`` and its workers: a file the launcher writes ``go`` (data validated and
#: tokenised) or ``abort`` into; workers wait for it after their imports (:func:`wait_at_launch_gate`).
GATE_ENV = "FERRY_LAUNCH_GATE"
LAUNCHER_PID_ENV = "FERRY_LAUNCHER_PID"
GATE_GO, GATE_ABORT = "go", "abort"
STARTED_SUFFIX = ".started"
#: The CUDA allocator setting the workers get unless the user chose one (:func:`_worker_env`).
ALLOC_CONF_ENV, ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"


@dataclass
class LaunchReport:
    """What ``ferry train`` planned and, unless ``dry_run``, how the run ended.

    Attributes:
        world_size: nproc_per_node * nnodes processes.
        global_batch_size: per_device_train_batch_size * gradient_accumulation_steps * world_size (samples:
            sequences; for dpo and rm pairs, for kto feedback rows, each two tokenised rows).
        num_train_samples / num_eval_samples: samples, counted as global_batch_size counts them.
        tokens_per_step: mean non-padding tokens per training sample (both rows of a pair) * global_batch_size
            (an estimate: the real count varies with the samples drawn).
        trainable_params / total_params: for a dry run counted on a meta-device copy of the model with its LoRA
            layers (no weights read); after a run taken from train_report.json; 0 when unknown (a node that
            did not hold rank 0, without a shared file system).
        command: the torchrun command line (run unless dry_run).
        train_report: the contents of output_dir/train_report.json after a successful run.
        memory: dry run only: bytes per rank by kind for ``ddp`` and ``fsdp`` (``trainer.fsdp.estimate_memory``),
            ``budget`` (bytes one rank may use), ``budget_of`` (what that is) and ``recommend`` (a line).
    """

    config: dict[str, Any]
    world_size: int
    nproc_per_node: int
    nnodes: int
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    num_train_samples: int
    num_eval_samples: int
    num_dropped_samples: int
    tokens_per_step: float
    trainable_params: int
    total_params: int
    command: list[str]
    dry_run: bool
    data_stats: dict[str, Any] = field(default_factory=dict)
    train_report: dict[str, Any] | None = None
    #: do_predict (trainer/predict.py): output_dir/predict_results.json, and base/predict_results.json (the base
    #: model's scores, with do_eval) after a successful run
    predict_results: dict[str, Any] | None = None
    predict_results_base: dict[str, Any] | None = None
    #: dry run: the adapted modules by kind with LoRA parameter counts, and what lora_target leaves out
    lora_summary: str = ""
    memory: dict[str, Any] | None = None
    #: ``tokenized_path`` did not exist (or ``do_train: false``): the data was tokenised there and nothing trained
    tokenized_only: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """Human-readable lines: the resolved config (dry run), the plan, and the outcome."""
        import yaml

        if self.tokenized_only:
            return (
                f"tokenised {self.num_train_samples} train / {self.num_eval_samples} eval samples into "
                f"{self.tokenized_only}; nothing was trained (LLaMA-Factory's tokenized_path): run the same "
                f"command again to train from it"
                + ("" if self.config.get("do_train", True) else ", with do_train: true")
            )
        lines = []
        if self.dry_run:
            lines += ["resolved config:", yaml.safe_dump(self.config, sort_keys=False).rstrip(), ""]
        pct = 100.0 * self.trainable_params / max(1, self.total_params)
        if not self.config.get("dataset"):  # do_predict alone: nothing is trained
            lines += [
                f"world size:          {self.world_size} ({self.nnodes} node(s) x {self.nproc_per_node} process(es))",
                f"rows to predict:     {self.num_eval_samples} (no training: do_train false)",
            ]
            return "\n".join(lines + self._predict_lines())
        unit = SAMPLE_UNIT.get(str(self.config.get("stage")), "sequences")
        lines += [
            f"world size:          {self.world_size} ({self.nnodes} node(s) x {self.nproc_per_node} process(es))",
            f"global batch size:   {self.global_batch_size} {unit} "
            f"(per_device_train_batch_size {self.config['per_device_train_batch_size']} x "
            f"gradient_accumulation_steps {self.config['gradient_accumulation_steps']} x world size {self.world_size})",
            f"steps:               {self.total_steps} ({self.steps_per_epoch} per epoch)",
            f"train samples:       {self.num_train_samples} (dropped, no trainable token: {self.num_dropped_samples})",
            f"eval samples:        {self.num_eval_samples}",
            f"tokens per step:     {self.tokens_per_step:,.0f} (mean, non-padding)",
        ]
        stats = self.data_stats or {}
        if stats.get("num_images") or stats.get("num_dropped_image_cut"):
            lines.insert(
                -2,
                f"images:              {stats['num_images']} (samples dropped, cutoff_len would cut an image: "
                f"{stats.get('num_dropped_image_cut', 0)})",
            )
        if stats.get("num_videos"):
            lines.insert(-2, f"videos:              {stats['num_videos']}")
        if self.total_params:
            lines.insert(-1, f"trainable params:    {self.trainable_params:,} of {self.total_params:,} ({pct:.4f}%)")
        if self.dry_run and self.lora_summary:
            lines += ["LoRA on:", self.lora_summary]
        if self.dry_run and self.memory:
            lines += self._memory_lines()
        if self.dry_run:
            lines.append("command:             " + " ".join(self.command))
        elif self.train_report:
            r = self.train_report
            lines += [
                f"trained:             {r['global_steps']} steps, {r['tokens_seen']:,} tokens, "
                f"{r['tokens_per_second']:.0f} tokens/s, {r['wall_time_s']:.1f} s",
                f"train loss:          {r['train_loss_first']} -> {r['train_loss_final']}",
            ]
            if r.get("eval_loss_final") is not None:
                ppl = r.get("eval_perplexity_final")  # None for a preference loss
                lines.append(
                    f"eval loss:           {r['eval_loss_first']} -> {r['eval_loss_final']}"
                    + (f" (perplexity {ppl:.3f})" if ppl is not None else "")
                )
            if r.get("gpu_memory"):
                from trainer.gpus import gpu_memory_text

                lines.append(f"gpu memory:          {gpu_memory_text(r['gpu_memory'])}")
            for entry in r.get("fallbacks") or []:
                lines.append(f"fallback:            {entry['feature']}: {entry['reason']}")
            lines.append(f"adapter:             {r['adapter_dir']}")
        return "\n".join(lines + self._predict_lines())

    def _predict_lines(self) -> list[str]:
        """do_predict's scores after a run (trainer/predict.py): the tuned model's, and the base's with do_eval."""
        if self.dry_run or not self.predict_results:
            return []
        keys = ("predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l")
        lines = ["predictions:         " + "  ".join(k.removeprefix("predict_") for k in keys)]
        if self.predict_results_base:
            lines.append("  base model         " + "  ".join(f"{self.predict_results_base[k]:.4f}" for k in keys))
        lines.append(
            "  "
            + ("tuned model        " if self.predict_results_base else "                   ")
            + "  ".join(f"{self.predict_results[k]:.4f}" for k in keys)
        )
        return lines

    def _memory_lines(self) -> list[str]:
        from ferry.fsutil import format_bytes

        mem = self.memory or {}
        kinds = ("weights", "gradients", "optimizer", "activations", "gathered", "total")
        lines = [
            f"memory per rank:     estimate at world size {self.world_size}; budget "
            f"{format_bytes(mem['budget'])} ({mem['budget_of']})",
            "                     mode" + "".join(f"{k:>13}" for k in kinds),
        ]
        for mode in ("ddp", "fsdp"):
            row = mem[mode]
            cells = "".join(f"{format_bytes(row[k]):>13}" for k in kinds)
            lines.append(f"                     {mode.upper():<4}{cells}")
        lines.append(f"recommendation:      {mem['recommend']}")
        return lines


def memory_plan(
    meta_model: Any,
    cfg: Any,
    world_size: int,
    nproc_per_node: int,
    budget: tuple[float, str] | None = None,
) -> dict[str, Any]:
    """The dry run's memory table: :func:`trainer.fsdp.estimate_memory` for DDP and FSDP at ``world_size``
    against one rank's budget (:func:`trainer.fsdp.device_budget`), and a recommendation: FSDP when DDP's
    estimate exceeds the budget (and FSDP's does not), else the configured mode. ``budget``: (bytes, what)
    instead of this host's."""
    from trainer.fsdp import device_budget, estimate_memory, model_memory_inputs

    limit, budget_of = budget or device_budget(nproc_per_node)
    cuda = not budget_of.startswith("RAM")  # device_budget names a GPU's memory, or "RAM / N process(es)"
    dtype_bytes = 2 if cuda and (cfg.bf16 or cfg.fp16) else 4  # the frozen weights' dtype (compute_dtype's rule)
    from trainer.loss import CHUNK_ELEMENTS, CUDA_CHUNK_SHARE

    chunk_budget = max(4 * CHUNK_ELEMENTS, int(limit * CUDA_CHUNK_SHARE)) if cuda else None  # chunk_budget_bytes'
    inputs = model_memory_inputs(meta_model, cfg, dtype_bytes, chunk_budget)
    if getattr(cfg, "quantization_bit", None):  # QLoRA: the frozen weights at 4 / 8 bits
        from trainer.quant import quantized_weight_bytes

        inputs["frozen_params"] = -(-quantized_weight_bytes(meta_model, cfg, dtype_bytes) // dtype_bytes)
    est = estimate_memory(world_size=world_size, **inputs)
    ddp, fsdp = est["ddp"].total, est["fsdp"].total
    if ddp <= limit:
        recommend = f"DDP fits ({ddp / limit:.0%} of the budget); " + (
            "fsdp is set: it saves memory at the cost of gathering weights every step"
            if cfg.fsdp
            else "no need for fsdp"
        )
    elif fsdp <= limit:
        recommend = f"DDP would not fit ({ddp / limit:.0%} of the budget); FSDP needs {fsdp / limit:.0%}: " + (
            "fsdp is set" if cfg.fsdp else "set fsdp: full_shard"
        )
    else:
        recommend = (
            f"neither fits: DDP {ddp / limit:.0%}, FSDP {fsdp / limit:.0%} of the budget; use more "
            f"processes, a smaller per_device_train_batch_size / cutoff_len, or gradient_checkpointing"
        )
    return {
        "ddp": est["ddp"].to_dict(),
        "fsdp": est["fsdp"].to_dict(),
        "budget": limit,
        "budget_of": budget_of,
        "recommend": recommend,
    }


def resolve_nproc_per_node(value: int | str) -> int:
    """``auto``: one process per visible GPU (:func:`trainer.gpus.visible_gpu_count`: torch's count after
    ``CUDA_VISIBLE_DEVICES``; this imports torch unless that variable hides every GPU), or without one, one
    process per 2 cores (at least 1); else the integer given (no torch import).

    Raises:
        ConfigError: not a positive integer or ``auto``.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        from trainer.gpus import visible_gpu_count

        gpus = visible_gpu_count()
        if gpus > 0:
            return gpus
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // 2)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--nproc-per-node: expected a positive integer or 'auto', got {value!r}") from None
    if n <= 0:
        raise ConfigError(f"--nproc-per-node: expected a positive integer or 'auto', got {value!r}")
    return n


def torchrun_command(
    config_path: Path,
    *,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    rdzv_endpoint: str | None,
    max_restarts: int,
    rdzv_timeout: int | None = None,
) -> list[str]:
    """The ``torch.distributed.run`` command line that starts this job's workers on this node.

    Rendezvous: ``--rdzv-endpoint`` → c10d (node ranks assigned by the rendezvous); else ``--master-addr`` /
    ``--master-port`` → static (``--node-rank`` matters); else, on one node, ``--standalone`` (a free local
    port, so concurrent jobs on one host do not collide).

    ``rdzv_timeout``: seconds the c10d rendezvous waits for every node (torchrun's ``join_timeout``, 600 by
    default).

    Raises:
        ConfigError: several nodes without an endpoint or master address; ``rdzv_timeout`` without c10d.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--max-restarts={max_restarts}",
    ]
    if rdzv_timeout is not None and (rdzv_timeout <= 0 or not rdzv_endpoint):
        raise ConfigError(f"--rdzv-timeout {rdzv_timeout}: needs a positive number of seconds and --rdzv-endpoint")
    if rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_timeout is not None:
            cmd.append(f"--rdzv-conf=join_timeout={rdzv_timeout}")
    elif master_addr or master_port:
        if nnodes > 1 and not master_addr:
            raise ConfigError("--master-addr is required with --nnodes > 1 (or use --rdzv-endpoint HOST:PORT)")
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr or '127.0.0.1'}"]
        cmd += [f"--master-port={master_port or 29500}"]
    elif nnodes > 1:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (or --master-addr/--master-port)")
    else:
        cmd.append("--standalone")
    return cmd + ["-m", "trainer", str(config_path)]


def launch(
    config: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    nproc_per_node: int | str = "auto",
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int | None = None,
    dry_run: bool = False,
    env: dict[str, str] | None = None,
    accelerate_config: str | os.PathLike | None = None,
) -> LaunchReport:
    """Validate the config, start torchrun (unless ``dry_run``), validate model and data and tokenise once
    while its workers import their libraries, then let them train (the start gate) and wait for torchrun.

    Args:
        config: the YAML config; ``overrides``: ``KEY=VALUE`` strings applied on top.
        nproc_per_node: workers on this node, or ``auto`` (:func:`resolve_nproc_per_node`).
        nnodes, node_rank, master_addr, master_port, rdzv_endpoint, max_restarts: as torchrun's options.
        rdzv_timeout: seconds to wait for every node at the c10d rendezvous (default torchrun's 600).
        dry_run: stop after planning (nothing is written to output_dir).
        env: extra environment variables for the workers (on top of this process's and the offline ones).
        accelerate_config: an accelerate config file (``accelerate launch --config_file``): its FSDP / DeepSpeed /
            DDP choice becomes ferry's ``fsdp`` keys and its process counts fill the options left at their
            defaults (:mod:`trainer.accelerate_config`).

    Returns:
        The :class:`LaunchReport` (with ``train_report`` filled after a successful run on the node holding
        rank 0).

    Raises:
        ConfigError: invalid config or options; output_dir holds a finished run and overwrite_output_dir is off;
            another ``ferry train`` holds output_dir (single-node jobs: :func:`ferry.folder_lock.hold_folder`).
        NotInstalledError: the model or a dataset is not installed (says what to add to the pack spec).
        DataError: a malformed dataset row.
        TrainingError: torchrun exited non-zero (a worker failed and the restarts, if any, were used up); the
            rendezvous timed out before every node joined (one line naming the endpoint and the timeout).
    """
    apply_offline_env()
    from trainer.config import load_config, tokenize_only

    # Nothing that imports torch runs before torchrun is started: the workers' own imports (seconds) overlap
    # with this process's checks and tokenisation instead of following them.
    rendezvous: dict[str, Any] = dict(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        rdzv_timeout=rdzv_timeout,
    )
    accelerate = None
    if accelerate_config is not None:  # LLaMA-Factory's `accelerate launch --config_file FILE` examples
        from trainer.accelerate_config import read_accelerate_config

        accelerate = read_accelerate_config(accelerate_config)
        _fill_from_accelerate(rendezvous, accelerate)
    nnodes, node_rank = rendezvous["nnodes"], rendezvous["node_rank"]
    if nnodes <= 0 or not 0 <= node_rank < nnodes or max_restarts < 0:
        raise ConfigError(f"invalid --nnodes {nnodes} / --node-rank {node_rank} / --max-restarts {max_restarts}")
    cfg = load_config(config, overrides, accelerate=accelerate)
    if tokenize_only(cfg):  # LLaMA-Factory: tokenise into a new tokenized_path and stop; no worker is started
        return _tokenize_only(cfg, nnodes=nnodes, dry_run=dry_run)
    rendezvous["nproc_per_node"] = resolve_nproc_per_node(rendezvous["nproc_per_node"])
    job = _Job(cfg, rendezvous, dry_run=dry_run)
    torchrun_command(Path("CONFIG.yaml"), **rendezvous)  # bad rendezvous options fail before tokenising
    if dry_run:
        return job.plan_only()
    report = job.run(env)
    job.read_results(report)
    return report


def _fill_from_accelerate(rendezvous: dict[str, Any], accelerate: Any) -> None:
    """An accelerate config's process counts and addresses fill the torchrun options left at their defaults
    (``accelerate``: a :class:`trainer.accelerate_config.AccelerateLaunch`)."""
    if rendezvous["nproc_per_node"] == "auto" and accelerate.nproc_per_node:
        rendezvous["nproc_per_node"] = accelerate.nproc_per_node
    if rendezvous["nnodes"] == 1 and accelerate.nnodes:
        rendezvous["nnodes"] = accelerate.nnodes
    if rendezvous["node_rank"] == 0 and accelerate.node_rank is not None:
        rendezvous["node_rank"] = accelerate.node_rank
    rendezvous["master_addr"] = rendezvous["master_addr"] or accelerate.master_addr
    rendezvous["master_port"] = rendezvous["master_port"] or accelerate.master_port


def _route_library_output(cfg: Any, held: bool = False) -> None:
    """The libraries' output (transformers' logging, ~0.5 s to import) to ``output_dir/logs/``: called once the
    workers are starting. ``held``: in memory until the run starts (a refused run leaves no logs/ behind)."""
    from ferry.output import route_library_output

    route_library_output(Path(cfg.output_dir) / "logs" / "libraries-launcher.log", held=held)


def _tokenize_only(cfg: Any, *, nnodes: int, dry_run: bool) -> LaunchReport:
    """LLaMA-Factory's ``tokenized_path`` that does not exist yet (or ``do_train: false``): tokenise into it and
    report, starting no worker."""
    from trainer.data import load_tokenizer, prepare_data

    if not dry_run:  # a dry run writes nothing to output_dir
        _route_library_output(cfg)
    data = prepare_data(cfg, load_tokenizer(cfg), for_training=False)
    return LaunchReport(
        config=cfg.resolved_dict(),
        world_size=0,
        nproc_per_node=0,
        nnodes=nnodes,
        global_batch_size=0,
        steps_per_epoch=0,
        total_steps=0,
        num_train_samples=len(data.train) // rows_per_sample(cfg),
        num_eval_samples=len(data.eval) // rows_per_sample(cfg),
        num_dropped_samples=int(data.stats.get("num_dropped_no_trainable", 0) or 0),
        tokens_per_step=0.0,
        trainable_params=0,
        total_params=0,
        command=[],
        dry_run=dry_run,
        data_stats=dict(data.stats),
        tokenized_only=str(cfg.tokenized_path),
    )


def rows_per_sample(cfg: Any) -> int:
    """Tokenised rows per training sample: 2 for the preference stages (dpo and rm store a pair's chosen and
    rejected replies, kto a judged row and its KL row, one after the other), else 1."""
    from ferry.stages import PREFERENCE_STAGES

    return 2 if cfg.stage in PREFERENCE_STAGES else 1


#: What one training sample is, by stage, in the summary's lines
SAMPLE_UNIT = {"dpo": "pairs", "rm": "pairs", "kto": "feedback rows"}


class _Job:
    """One ``ferry train`` job on this node once its config and torchrun options are settled: the steps of
    :func:`launch` after validation, in the order they run.

    ``rendezvous``: :func:`torchrun_command`'s keyword arguments (``nproc_per_node`` resolved to a number).
    """

    def __init__(self, cfg: Any, rendezvous: dict[str, Any], *, dry_run: bool) -> None:
        self.cfg = cfg
        self.rendezvous = rendezvous
        self.dry_run = dry_run
        self.nproc: int = rendezvous["nproc_per_node"]
        self.nnodes: int = rendezvous["nnodes"]
        self.world_size = self.nproc * self.nnodes

    def check_resume(self) -> None:
        """Refuse a finished run or an incompatible checkpoint before any worker trains; the workers decide
        again (and clear the folder when starting over).

        Raises:
            ConfigError: output_dir holds a finished run; the checkpoint's world size, batch shape or parallelism
                differs from this run's.
        """
        from trainer import checkpoint as ckpt

        cfg = self.cfg
        if self.nnodes == 1:  # output_dir is held (run): no save of another run can be under way in it
            for done in ckpt.remove_interrupted_saves(cfg.output_dir):
                print(f"ferry: {done}", file=sys.stderr)
        start = ckpt.plan_resume(cfg.output_dir, cfg.resume_from_checkpoint, cfg.overwrite_output_dir)
        if start.checkpoint is not None:
            state = ckpt.TrainerState.from_file(start.checkpoint / ckpt.STATE_FILE)
            ckpt.check_batch_shape(
                state,
                start.checkpoint,
                self.world_size,
                cfg.per_device_train_batch_size,
                cfg.gradient_accumulation_steps,
            )
            ckpt.check_parallelism(state, start.checkpoint, cfg.fsdp_strategy)
            print(f"ferry: resuming from {start.checkpoint} (step {state.global_step})", file=sys.stderr)

    def prepare(self) -> tuple[Path, Any, Any]:
        """Validate model and data and fill the tokenised cache: ``(model_dir, PreparedData, StepPlan)``, or for
        do_predict alone (no training data) ``(model_dir, rows to predict, None)``."""
        from ferry.hub import resolve_model
        from trainer.batching import plan_steps
        from trainer.data import load_tokenizer, prepare_data

        cfg = self.cfg
        model_dir = resolve_model(cfg.model_name_or_path, cfg.model_revision)
        config = model_config(cfg, model_dir)
        # The data before the checks that build the model: a malformed row is refused in seconds, and a key the
        # checks below refuse costs no second tokenisation once fixed (the cache is keyed without it).
        tokenizer = load_tokenizer(cfg)
        if not cfg.dataset:  # do_predict alone without training data: check its rows now, no step plan
            from trainer.data import fix_special_tokens, template_for
            from trainer.predict import build_rows

            if cfg.template is not None:
                fix_special_tokens(tokenizer, template_for(cfg), cfg.model_name_or_path)
            rows = len(build_rows(cfg, tokenizer))
            preflight(cfg, model_dir, config)
            check_gpus(cfg, self.nproc)
            return model_dir, rows, None
        data = prepare_data(cfg, tokenizer, for_training=cfg.do_train)  # do_predict alone: no training
        lora_params = preflight(cfg, model_dir, config)
        check_gpus(cfg, self.nproc)
        plan = plan_steps(len(data.train) // rows_per_sample(cfg), cfg, self.world_size)
        if cfg.do_train:
            check_output_space(cfg, lora_params, plan)
        return model_dir, data, plan

    def report(self, data: Any, plan: Any, cmd: list[str], trainable: int = 0, total: int = 0) -> LaunchReport:
        """The :class:`LaunchReport` of what :meth:`prepare` found (``data`` the number of rows to predict when
        ``plan`` is None)."""
        common: dict[str, Any] = dict(
            config=self.cfg.resolved_dict(),
            world_size=self.world_size,
            nproc_per_node=self.nproc,
            nnodes=self.nnodes,
            trainable_params=trainable,
            total_params=total,
            command=cmd,
            dry_run=self.dry_run,
        )
        if plan is None:  # do_predict alone
            return LaunchReport(
                global_batch_size=0,
                steps_per_epoch=0,
                total_steps=0,
                num_train_samples=0,
                num_eval_samples=data,
                num_dropped_samples=0,
                tokens_per_step=0.0,
                **common,
            )
        rows = rows_per_sample(self.cfg)
        return LaunchReport(
            global_batch_size=plan.global_batch_size,
            steps_per_epoch=plan.steps_per_epoch,
            total_steps=plan.total_steps,
            num_train_samples=len(data.train) // rows,
            num_eval_samples=len(data.eval) // rows,
            num_dropped_samples=int(data.stats.get("num_dropped_no_trainable", 0)),
            tokens_per_step=data.train.num_tokens() / len(data.train) * rows * plan.global_batch_size,
            data_stats={k: v for k, v in data.stats.items() if isinstance(v, (int, float, str, bool))},
            **common,
        )

    def plan_only(self) -> LaunchReport:
        """``--dry-run``: the plan, the parameter counts and LoRA summary of a meta-device model (no weights read)
        and the memory table; no worker starts and nothing is written to output_dir."""
        import torch

        from trainer.data import load_tokenizer
        from trainer.modeling import build_lora_model, count_parameters
        from trainer.vocab import plan_vocab

        cfg = self.cfg
        model_dir, data, plan = self.prepare()
        vocab = plan_vocab(cfg, load_tokenizer(cfg), model_dir)  # resize_vocab: count the grown embeddings
        meta_model = build_lora_model(
            cfg, model_dir, device=torch.device("meta"), dtype=torch.float32, meta=True, vocab=vocab
        )
        trainable, total = count_parameters(meta_model)
        cmd = torchrun_command(Path("RESOLVED_CONFIG.yaml"), **self.rendezvous)
        report = self.report(data, plan, cmd, trainable, total)
        report.lora_summary = meta_model.ferry_lora_targets.summary()
        report.memory = memory_plan(meta_model, cfg, self.world_size, self.nproc)
        return report

    def run(self, env: dict[str, str] | None) -> LaunchReport:
        """Start torchrun on the resolved config; while its workers import (and wait at the gate), check the
        resume and tokenise; then open the gate (or abort it on an error) and wait for torchrun.

        Raises:
            TrainingError: torchrun failed (:meth:`_raise_on_failure`).
        """
        import yaml

        from ferry.folder_lock import hold_folder

        cfg = self.cfg
        # one run per output_dir on one node; the nodes of a multi-node job share the folder and may all start as
        # node 0 (a c10d rendezvous gives the ranks), so none of them holds it
        holding = hold_folder(cfg.output_dir, "ferry train") if self.nnodes == 1 else nullcontext()
        with holding, tempfile.TemporaryDirectory(prefix="ferry-train-") as tmp:
            resolved_path = Path(tmp) / "train_config.yaml"
            # The launcher fills the cache: the workers must load it, not rebuild it once more (overwrite_cache).
            worker_cfg = {**cfg.resolved_dict(), "overwrite_cache": False}
            resolved_path.write_text(yaml.safe_dump(worker_cfg, sort_keys=False), encoding="utf-8")
            cmd = torchrun_command(resolved_path, **self.rendezvous)
            gate = Path(tmp) / "gate"
            proc = subprocess.Popen(
                cmd, env=_worker_env(env, self.nproc, gate, fsdp=bool(cfg.fsdp)), stderr=subprocess.PIPE
            )
            errors = WorkerStderr(proc, Path(tmp) / "workers-stderr.log")
            _route_library_output(cfg, held=True)
            # torchrun and its workers start (imports, ~10 s) while this process validates and tokenises; the
            # workers wait at the gate, so they never see half-built data and print nothing when we abort.
            try:
                _, data, plan = self.prepare()
                self.check_resume()
            except BaseException:
                _abort(proc, gate)
                errors.join()
                raise
            atomic_write_text(gate, GATE_GO)
            from ferry.output import release_library_output

            release_library_output()
            report = self.report(data, plan, cmd)
            returncode = _wait(proc)
            errors.join()
            self._raise_on_failure(returncode, errors)
        return report

    def _raise_on_failure(self, returncode: int, errors: WorkerStderr) -> None:
        """Nothing when torchrun succeeded; else one line: a rendezvous that timed out before every node joined,
        or the first worker failure (:func:`_worker_failure`).

        Raises:
            TrainingError: torchrun exited non-zero.
        """
        if returncode == 0:
            return
        r = self.rendezvous
        if self.nnodes > 1 and any("RendezvousTimeoutError" in e for _, e in errors.exceptions):
            raise TrainingError(
                f"rendezvous at {r['rdzv_endpoint'] or r['master_addr']} timed out after "
                f"{r['rdzv_timeout'] or 600} s: not all {self.nnodes} nodes joined; start 'ferry train' with the "
                f"same --rdzv-endpoint on every node (or raise --rdzv-timeout)"
            )
        raise _worker_failure(returncode, errors, Path(self.cfg.output_dir))

    def read_results(self, report: LaunchReport) -> None:
        """Fill ``report`` from output_dir after a successful run: train_report.json (on the node that held rank 0,
        or on a shared file system) and do_predict's predict_results.json files."""
        import json

        from trainer import checkpoint as ckpt

        out = Path(self.cfg.output_dir)
        report_file = out / ckpt.REPORT_FILE
        if report_file.is_file():
            report.train_report = json.loads(report_file.read_text(encoding="utf-8"))
            report.trainable_params = report.train_report["trainable_params"]
            report.total_params = report.train_report["total_params"]
        if not self.cfg.do_predict:
            return
        for name, attr in (
            ("predict_results.json", "predict_results"),
            ("base/predict_results.json", "predict_results_base"),
        ):
            if (out / name).is_file():
                setattr(report, attr, json.loads((out / name).read_text(encoding="utf-8")))


def check_gpus(cfg: Any, nproc_per_node: int) -> None:
    """Under nccl (``ddp_backend`` auto or nccl), refuse more processes on this node than it has visible GPUs
    (:func:`trainer.gpus.check_ranks_fit_gpus`), counted in this process's environment. Called once torchrun is
    started (the count imports torch); the workers check again against torchrun's ``LOCAL_WORLD_SIZE``.

    Raises:
        ConfigError: one line naming both counts, ``CUDA_VISIBLE_DEVICES`` and ``--nproc-per-node``.
    """
    from trainer.gpus import VISIBLE_ENV, check_ranks_fit_gpus, visible_gpu_count

    if cfg.ddp_backend != "gloo":
        check_ranks_fit_gpus(nproc_per_node, visible_gpu_count(), os.environ.get(VISIBLE_ENV))


def model_config(cfg: Any, model_dir: Path) -> Any:
    """The base model's ``transformers`` config, read before anything else touches the model: its need for
    ``trust_remote_code`` and, when it ships code, a writable HF modules cache for it (JSON and a config class
    only: no weights, no torch model), with ``rope_scaling`` applied as training applies it (a warning line when
    ``cutoff_len`` fits and nothing is scaled).

    Raises:
        ConfigError: one line naming the key to change (a model whose RoPE cannot be scaled included).
    """
    import json

    from transformers import AutoConfig

    raw = (
        json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        if (model_dir / "config.json").is_file()
        else {}
    )
    if raw.get("auto_map") and cfg.trust_remote_code:
        from transformers.utils import HF_MODULES_CACHE

        probe = Path(HF_MODULES_CACHE)
        while not probe.exists():
            probe = probe.parent
        try:
            with tempfile.TemporaryDirectory(prefix=".ferry-probe-", dir=probe):
                pass
        except OSError as exc:
            raise ConfigError(
                f"trust_remote_code: {model_dir}'s code is copied to HF_MODULES_CACHE="
                f"{HF_MODULES_CACHE}, which is not writable ({exc.strerror}); set HF_MODULES_CACHE "
                f"to a writable folder"
            ) from None
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not cfg.trust_remote_code:
            raise ConfigError(
                f"trust_remote_code: {cfg.model_name_or_path} ships its own model code (config.json "
                f"auto_map); set trust_remote_code: true if you trust it"
            ) from None
        raise ConfigError(f"model_name_or_path: transformers cannot read {model_dir}/config.json ({exc})") from None
    from ferry.rope import apply_to_config, rope_scaling_for

    scaling, warning = rope_scaling_for(cfg, config)  # refused here, once, when the model's RoPE cannot be scaled
    if warning:
        print(f"ferry: warning: {warning}", file=sys.stderr)
    if scaling is not None:
        apply_to_config(config, scaling)  # the meta model the checks build is the one training builds
    return config


def preflight(cfg: Any, model_dir: Path, config: Any = None) -> int:
    """What would otherwise fail inside every worker, checked once in the launcher while the workers import
    (they wait at the start gate and exit quietly when this fails): the model's config (:func:`model_config`,
    unless ``config`` is that already), the attention implementation's package, ``fsdp``'s torch release,
    ``eval_tasks`` known to lm-eval and their datasets installed (bundler/eval_tasks.py), and ``lora_target`` /
    ``additional_target`` against the real module names (on a meta-device model: no weights are read).

    Returns:
        The parameters the adapter trains (LoRA's ``r · (in + out)`` per adapted module, and the modules of
        ``additional_target`` whole), for :func:`check_output_space`.

    Raises:
        ConfigError: one line naming the key to change.
        NotInstalledError: an ``eval_tasks`` task whose dataset is not installed, or lm-eval is not.
    """
    import torch

    from ferry.architecture import auto_model_class
    from trainer.quant import preflight as quant_preflight

    quant_preflight(cfg, model_dir)  # QLoRA: pre-quantised bases refused; bitsandbytes loads here
    if cfg.eval_tasks:  # scored after training: a typo or a task not carried fails now, not hours later
        from bundler.eval_tasks import check_installed, plan_eval_tasks

        check_installed(plan_eval_tasks(cfg.eval_tasks, cfg.eval_include_path))
    if cfg.fsdp:
        from trainer.fsdp import require_fsdp_torch

        require_fsdp_torch()
    _check_ref_model(cfg, model_dir)  # stage dpo's ref_model, when set
    if config is None:
        config = model_config(cfg, model_dir)
    attn = cfg.attn_implementation
    if attn in ("flash_attention_2", "flash_attention_3"):
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

        available = is_flash_attn_2_available() if attn == "flash_attention_2" else is_flash_attn_3_available()
        if not available:
            package = "flash-attn" if attn == "flash_attention_2" else "flash-attn 3 (flash_attn_interface)"
            raise ConfigError(
                f"flash_attn: {attn} needs the {package} package and a CUDA GPU, not available "
                f"here; set flash_attn: sdpa (or auto)"
            )
    from trainer.targets import lora_targets

    try:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to build the architecture
        raise ConfigError(f"model_name_or_path: transformers cannot build {model_dir} ({exc})") from None
    targets = lora_targets(cfg, model)
    names = {name.split(".")[-1] for name, _ in model.named_modules()}
    missing = sorted(set(cfg.additional_target or ()) - names)
    if missing:
        raise ConfigError(f"additional_target: {', '.join(missing)} is no module of {cfg.model_name_or_path}")
    whole = set(cfg.additional_target or ())
    saved = sum(p.numel() for name, m in model.named_modules() if name.split(".")[-1] in whole for p in m.parameters())
    return sum(a.lora_params for a in targets.adapted) + saved


def check_output_space(cfg: Any, trained_params: int, plan: Any) -> None:
    """Refuse a run whose ``output_dir`` cannot hold what it must write before it ends, so that it does not fail
    at its first checkpoint hours later; warn in one line when it cannot hold every checkpoint it keeps.

    What a run writes, at least (lower bounds: a refusal is never wrong): the adapter, 2 bytes per trained
    parameter (bf16; fp32 writes 4); a checkpoint, the adapter and, unless ``save_only_model``, AdamW's two moments
    (8 bytes per parameter, fp32). ``save_strategy`` and ``save_steps`` over ``plan.total_steps`` give the number of
    checkpoints (none at the last step), ``save_total_limit`` how many are kept (one more while a save rotates the
    oldest out).

    Raises:
        InsufficientSpaceError: less free space than one checkpoint and the adapter (or the adapter alone when the
            run saves no checkpoint).
    """
    import shutil

    from ferry.errors import InsufficientSpaceError
    from ferry.fsutil import format_bytes

    adapter = 2 * trained_params
    checkpoint = adapter + (0 if cfg.save_only_model else 8 * trained_params)
    saves = 0  # the last step writes the adapter, not a checkpoint (trainer.recipe)
    if cfg.save_strategy == "steps":
        saves = (plan.total_steps - 1) // cfg.save_steps
    elif cfg.save_strategy == "epoch":
        saves = plan.num_epochs - 1
    kept = min(saves, cfg.save_total_limit + 1) if cfg.save_total_limit else saves
    out = Path(cfg.output_dir).resolve()
    folder = out
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    first = adapter + (checkpoint if saves else 0)
    what = "a checkpoint (the adapter and its optimizer state) and the adapter" if saves else "the adapter"
    if free < first:
        raise InsufficientSpaceError(
            f"output_dir {out}: {format_bytes(free)} free, but this run writes at least {format_bytes(first)} there: "
            f"{what}, {trained_params:,} trained parameters; make room or choose another output_dir"
        )
    every = adapter + kept * checkpoint
    if free < every:
        print(
            f"ferry: warning: output_dir {out} has {format_bytes(free)} free, and the {kept} checkpoints this run "
            f"keeps at a time and its adapter take at least {format_bytes(every)}: a save will find the disk full "
            "(save_total_limit keeps fewer)",
            file=sys.stderr,
        )


def _check_ref_model(cfg: Any, model_dir: Path) -> None:
    """``ref_model`` (stage dpo) installed, its ``ref_model_adapters`` adapter folders, and its vocabulary size
    (config.json ``vocab_size``) equal to the policy's.

    Raises:
        NotInstalledError: ``ref_model`` is neither a folder nor installed (the message names the key).
        ConfigError: an adapter folder holds no adapter; the vocabularies differ.
    """
    if cfg.ref_model is None:
        return
    import json

    from ferry.adapter_folder import adapter_folder
    from ferry.errors import NotInstalledError
    from ferry.hub import resolve_model

    try:
        ref_dir = resolve_model(cfg.ref_model)
    except NotInstalledError as exc:
        raise NotInstalledError(f"ref_model: {exc}") from None
    for folder in cfg.ref_model_adapters or ():
        try:
            adapter_folder(folder)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("adapter_name_or_path:", "ref_model_adapters:", 1)) from None

    def vocab_size(folder: Path) -> int | None:
        path = folder / "config.json"
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        return raw.get("vocab_size", raw.get("text_config", {}).get("vocab_size"))

    ref, policy = vocab_size(ref_dir), vocab_size(model_dir)
    if ref is not None and policy is not None and ref != policy:
        raise ConfigError(
            f"ref_model: {cfg.ref_model} has a vocabulary of {ref} tokens, {cfg.model_name_or_path} of {policy}: "
            f"the reference must share the policy's vocabulary"
        )


class WorkerStderr:
    """Relay torchrun's stderr line by line, holding back worker tracebacks and torchrun's failure report.

    Every line is kept in a log file; lines that belong to a Python traceback (``Traceback ...`` up to the
    exception line, also with torch's ``[rankN]:`` prefix) and torchrun's own error report (``E1123 ...`` log
    records, ``ChildFailedError`` blocks) are not shown: :func:`_worker_failure` sums them up in one line. The
    workers' own one-line ``ferry: error:`` messages, progress bars and logs pass through.
    """

    _PREFIX = __import__("re").compile(r"^\[(?:default)?rank\d+\]:\s?")
    _EXC = __import__("re").compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)[\w]*)(?::\s*(.*))?$")
    _TORCH_LOG = __import__("re").compile(r"^\[?[EWI]\d{4} \d\d:\d\d:\d\d")  # glog lines, c10d's "[W1123 ..."

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        import threading

        self.log = log
        self.exceptions: list[tuple[str, str]] = []  # (rank prefix, "Type: message") per worker traceback
        self.ferry_errors: list[str] = []
        self.signals: list[str] = []  # "Signal 9 (SIGKILL)" from torchrun's report of a killed worker
        self.signals_from_outside: list[str] = []  # those of workers torchrun itself did not send a closing signal
        self._closed_pids: set[str] = set()  # "Sending process PID closing signal SIGTERM": torchrun's own
        if proc.stderr is None:
            raise TrainingError("torchrun's stderr is not a pipe: start it with stderr=subprocess.PIPE")
        self._stream = proc.stderr
        self._thread = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _pump(self, stderr: IO[bytes]) -> None:
        in_traceback, in_report = {}, False
        with open(self.log, "w", encoding="utf-8", errors="replace") as log:
            for raw in iter(stderr.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                text = line.rstrip("\n")
                match = self._PREFIX.match(text)
                who = match.group(0).strip() if match else ""
                body = text[match.end() :] if match else text
                if body.startswith("ferry: error:"):  # a worker's one line: part of the launcher's one line
                    self.ferry_errors.append(body.removeprefix("ferry: error:").strip())
                    continue
                if body.startswith("Traceback (most recent call last)"):
                    in_traceback[who] = True
                    continue
                if in_traceback.get(who):
                    exc = self._EXC.match(body)
                    if exc and not body.startswith(" "):
                        in_traceback[who] = False
                        if "ChildFailedError" in body:  # torchrun's own: its failure report follows
                            in_report = True
                        else:
                            self.exceptions.append((who, body))
                    continue
                self._note_signals(text)
                if (
                    self._TORCH_LOG.match(text)
                    or "ChildFailedError" in text
                    or text.startswith(("=====", "-----"))
                    or in_report
                ):
                    in_report = in_report or "ChildFailedError" in text
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()

    def _note_signals(self, text: str) -> None:
        """Signals in torchrun's lines: the workers it closes itself (``Sending process PID closing signal``) and
        the signal each failed worker got (``Signal 9 (SIGKILL) received by PID``), told apart by PID."""
        import re

        closing = re.search(r"Sending process (\d+) closing signal", text)
        if closing:
            self._closed_pids.add(closing.group(1))
        seen = re.search(r"Signal \d+ \(SIG\w+\)(?: received by PID (\d+))?", text)
        if seen is None:
            return
        label, pid = seen.group(0).split(" received")[0], seen.group(1)
        if label not in self.signals:
            self.signals.append(label)
        if pid is not None and pid not in self._closed_pids and label not in self.signals_from_outside:
            self.signals_from_outside.append(label)

    def join(self) -> None:
        """Wait (at most 30 s) for the relay to reach the end of torchrun's stderr, then close the pipe."""
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._stream.close()


def worker_cause(returncode: int, errors: WorkerStderr) -> str:
    """What made a torchrun run fail, in one phrase: a worker killed by a signal torchrun did not send (the kernel's
    OOM killer's SIGKILL, a segfault: the other ranks' errors, such as gloo's "Connection reset by peer", follow
    from it), else the workers' own ``ferry: error:`` line (a rank that stopped on a :class:`FerryError`; the
    others then fail in their next collective, "Connection closed by peer"), else the first worker exception (with
    its ``[rankN]:``), else the signal that stopped a worker, else torchrun's exit code."""
    if errors.signals_from_outside:
        return f"a worker was killed ({errors.signals_from_outside[0]}: out of memory, or stopped from outside)"
    if errors.ferry_errors:
        return errors.ferry_errors[0]
    if errors.exceptions:
        who, what = errors.exceptions[0]
        return f"{who + ' ' if who else ''}{what}"
    if errors.signals:
        return f"a worker was killed ({errors.signals[0]}: out of memory, or stopped from outside)"
    return f"torchrun exited with code {returncode}"


def _worker_failure(returncode: int, errors: WorkerStderr, output_dir: Path) -> TrainingError:
    """One line for a failed torchrun: the first worker exception (or the workers' own ``ferry: error:`` line
    already shown), where the full output is kept (``output_dir/logs/``), and the resume hint only when a
    checkpoint exists to resume from."""
    import shutil

    from trainer import checkpoint as ckpt

    kept = errors.log
    try:
        logs = output_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        kept = logs / f"torchrun-stderr-{time.strftime('%Y%m%d-%H%M%S')}.log"
        shutil.copyfile(errors.log, kept)
    except OSError:
        pass
    cause = worker_cause(returncode, errors)
    hint = ""
    if ckpt.latest_checkpoint(output_dir) is not None:
        hint = f"; re-running the same command continues from the newest checkpoint in {output_dir}"
    return TrainingError(f"training failed: {cause} (full output: {kept}){hint}")


def _worker_env(extra: dict[str, str] | None, nproc: int, gate: Path, *, fsdp: bool = False) -> dict[str, str]:
    """This process's environment + ``extra`` + the offline variables + the start gate, and the cores shared
    out between the workers (``OMP_NUM_THREADS``, unless set; torchrun would otherwise set 1).

    CUDA's caching allocator gets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set that
    variable or ``PYTORCH_ALLOC_CONF`` (torch >= 2.9's name, which takes precedence): micro-batches of varying
    length ask for blocks of ever new sizes, which fixed segments leave fragmented (reserved but unusable memory,
    then an out-of-memory error with free memory left); expandable segments grow one mapping instead. Ignored on
    CPU.

    Under FSDP, glibc's ``glibc.malloc.hugetlb=1`` tunable is added to ``GLIBC_TUNABLES`` (unless the user set
    it): the gathered layers that ``trainer.fsdp.HostAllocator`` maps and unmaps on CPU then fault in 2 MiB
    transparent huge pages instead of 4 KiB pages (glibc >= 2.35 reads it at start; older ones ignore it)."""
    env = dict(os.environ)
    env.update(extra or {})
    apply_offline_env(env)
    env[GATE_ENV] = str(gate)
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    from ferry.output import TTY_ENV  # workers draw a live bar only if this terminal is one

    env.setdefault(TTY_ENV, "1" if sys.stderr.isatty() else "0")
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    if ALLOC_CONF_ENV not in env and "PYTORCH_ALLOC_CONF" not in env:
        env[ALLOC_CONF_ENV] = ALLOC_CONF
    tunables = env.get("GLIBC_TUNABLES", "")
    if fsdp and "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(x for x in (tunables, "glibc.malloc.hugetlb=1") if x)
    return env


def wait_at_launch_gate(poll_s: float = 0.05) -> bool:
    """In a worker started by :func:`launch`: block until the launcher has validated and tokenised.

    Returns True to go on (also when not started by ``ferry train``: no gate), False when the launcher
    aborted (it reports the error itself) or died.
    """
    path = os.environ.get(GATE_ENV)
    if not path:
        return True
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    gate = Path(path)
    try:  # marks that this node's rendezvous is over and its workers started
        gate.with_name(gate.name + STARTED_SUFFIX).touch()
    except OSError:
        pass
    while True:
        verdict = gate.read_text(encoding="utf-8") if gate.is_file() else ""
        if verdict in (GATE_GO, GATE_ABORT):
            return verdict == GATE_GO
        if launcher:
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
        time.sleep(poll_s)


#: Seconds an aborted launch waits for torchrun's workers to see the gate before it kills them (:func:`_abort`).
ABORT_GRACE_S = 1.0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), from Linux's ``/proc/PID/task/TID/children``; empty where
    there is no such file."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", encoding="ascii") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _abort(proc: subprocess.Popen, gate: Path) -> None:
    """The launcher refused the run before the gate opened: write ``abort`` into the gate (workers that wait there
    exit quietly), and do not wait for workers still importing torch (seconds on a small machine): after
    :data:`ABORT_GRACE_S` torchrun and every process under it are killed. Nothing of theirs needs a clean exit:
    before the gate a worker has joined no process group and trained nothing."""
    atomic_write_text(gate, GATE_ABORT)
    try:
        proc.wait(timeout=ABORT_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:
        pass
    below = _descendants(proc.pid)
    for pid in [proc.pid, *below]:  # torchrun first, so that it reports no failure of the workers
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _wait(proc: subprocess.Popen) -> int:
    """Wait for torchrun; on Ctrl-C let it stop its workers (it got the SIGINT too) and wait."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


__all__ = [
    "LaunchReport",
    "WorkerStderr",
    "worker_cause",
    "check_gpus",
    "launch",
    "memory_plan",
    "preflight",
    "resolve_nproc_per_node",
    "torchrun_command",
    "wait_at_launch_gate",
]
