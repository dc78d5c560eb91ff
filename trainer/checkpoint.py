"""Training checkpoints: what rank 0 writes every ``save_steps``, and how a run finds one to resume from.

Layout of ``output_dir`` during and after a run::

    output_dir/
    ├── checkpoint-20/                 written atomically: a temp dir beside it, then one rename
    │   ├── adapter_config.json        PEFT format: the folder loads with peft.PeftModel.from_pretrained
    │   ├── adapter_model.safetensors
    │   ├── optimizer.pt               torch.optim.AdamW.state_dict() (DDP)
    │   ├── sharded/                   FSDP instead of optimizer.pt: torch.distributed.checkpoint of the LoRA
    │   │   ├── __0_0.distcp             weights and AdamW state, one file per rank (each writes its shard),
    │   │   ├── __1_0.distcp ...         and the .metadata rank 0 writes; the frozen base weights are not
    │   │   └── .metadata                saved (they are the base model's files)
    │   ├── scheduler.pt               LR scheduler state_dict()
    │   ├── scaler.pt                  torch.amp.GradScaler state_dict() (fp16 only)
    │   ├── rng_state.pt               list, one entry per rank: python, numpy, torch CPU and its GPU's RNG states
    │   └── trainer_state.json         TrainerState: step, epoch, position within the epoch, tokens seen...
    ├── checkpoint-40/
    ├── adapter/                       the final adapter + tokenizer files (the run is finished when
    ├── train_report.json              train_report.json exists)
    ├── train_config.yaml, metrics.jsonl, loss.png, runs/ (TensorBoard)

A checkpoint folder exists only when it is complete (the rename is the commit point), so "the newest
``checkpoint-N`` folder holding ``trainer_state.json``" is always safe to resume from. Under FSDP every rank
writes its shard into rank 0's temp folder (which must therefore be on a file system all nodes share, as
for any sharded checkpoint) before rank 0 adds the rest and renames it.

The functions here are plain file operations run by one process (rank 0), except the ones marked
"collective" (FSDP: every rank calls them); the loop gathers and broadcasts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch

from ferry.adapter_folder import ADAPTER_WEIGHTS, TRAIN_CONFIG, TRAIN_REPORT
from ferry.errors import ConfigError, TrainingError
from ferry.faults import kill_point
from ferry.fsutil import atomic_directory, host_write_error

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
SHARDED_DIR = "sharded"
REPORT_FILE = TRAIN_REPORT
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")

#: Files and folders a run writes into output_dir; "start over" (overwrite_output_dir) removes exactly these.
RUN_ARTIFACTS = ("adapter", REPORT_FILE, "metrics.jsonl", "loss.png", "runs", TRAIN_CONFIG)


@dataclass
class TrainerState:
    """Where a run stands after an optimizer step: enough to continue at the exact next sample.

    Attributes:
        global_step: optimizer steps done.
        epoch: index of the epoch the next micro-batch comes from (0-based).
        micro_batches_in_epoch: micro-batches of ``epoch`` already consumed on each rank (the resumed run
            skips that many batches of the same epoch's sampler order).
        tokens_seen: non-padding tokens processed, summed over all ranks.
        world_size, per_device_train_batch_size, gradient_accumulation_steps: the shape of the global batch;
            a resume must use the same values (the position within the epoch depends on them).
        train_loss_first: the first logged train loss (for the final report).
        elapsed_s: wall seconds of training before this checkpoint (for tokens/s across restarts).
    """

    global_step: int
    epoch: int
    micro_batches_in_epoch: int
    tokens_seen: int
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    seed: int
    train_loss_first: float | None = None
    eval_loss_first: float | None = None
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: Path) -> TrainerState:
        """Read ``trainer_state.json``. Raises TrainingError naming the file when it is unreadable."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise TrainingError(f"{path}: not a readable trainer state ({exc})") from None


# ---------------------------------------------------------------------- RNG


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states: python ``random``, numpy's global generator, torch CPU, and the CUDA generator
    of this rank's own GPU (``device``, default the current CUDA device) when CUDA is in use.

    The CUDA state is that one device's (``cuda_device``, a uint8 tensor, and ``cuda_index``, its index on the
    saving node): a rank draws from its own GPU alone, and a list of every visible GPU's state could not be
    restored on a node that sees fewer of them.

    Returns a dict of plain Python values and tensors (loadable with ``torch.load(weights_only=True)``).
    """
    import numpy as np

    # the legacy tuple (name, keys, pos, has_gauss, cached_gaussian); numpy's stub types the default call as a dict
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
    else:
        return state
    state["cuda_device"], state["cuda_index"] = torch.cuda.get_rng_state(index), index
    return state


def cuda_state_for(state: dict[str, Any], index: int, visible: int) -> tuple[torch.Tensor | None, str | None]:
    """The saved CUDA RNG state that GPU ``index`` (of ``visible`` GPUs here) takes on resume, and a line to show
    when the saved states had to be mapped onto this node's GPUs (else None).

    ``state`` is one rank's :func:`capture_rng_state` dict: its own device's state (``cuda_device``), or, in a
    checkpoint written before that, ``cuda``: a list of every GPU's state on the saving node, of which a rank
    used the one at its own device index. When that list's length differs from ``visible``, GPU ``index`` takes
    entry ``index % len(list)``: nothing past the list or past this node's GPUs is ever indexed.
    """
    if state.get("cuda_device") is not None:
        return state["cuda_device"], None
    saved = list(state.get("cuda") or [])
    if not saved:
        return None, None
    line = None
    if len(saved) != visible:
        line = (
            f"ferry: resume: the checkpoint holds the CUDA RNG states of {len(saved)} GPU(s), this node sees "
            f"{visible}: each rank's GPU takes the saved state of its index modulo {len(saved)}"
        )
    return saved[index % len(saved)], line


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None, verbose: bool = False) -> None:
    """Inverse of :func:`capture_rng_state`, on this rank's ``device``: the CUDA state goes to that GPU alone
    (default the current CUDA device; :func:`cuda_state_for` maps an older checkpoint's list of every GPU's
    state, printing its one line when ``verbose``). Without CUDA here, a saved CUDA state is ignored."""
    import numpy as np

    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return
    visible = torch.cuda.device_count()
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    own, line = cuda_state_for(state, index, visible)
    if own is None or not 0 <= index < visible:
        return
    if line and verbose:
        print(line, file=sys.stderr)
    torch.cuda.set_rng_state(own, index)


# ---------------------------------------------------------------------- finding checkpoints


def checkpoint_step(path: Path) -> int | None:
    """``checkpoint-40`` -> 40; None for any other name."""
    match = _CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir`` (folders ``checkpoint-N`` holding ``trainer_state.json``),
    oldest (smallest N) first. Leftover temp folders of a killed save are not listed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def is_finished_run(output_dir: str | Path) -> bool:
    """True when ``output_dir`` holds a finished run (its ``train_report.json``)."""
    return (Path(output_dir) / REPORT_FILE).is_file()


@dataclass
class ResumePlan:
    """What a run does with its output_dir. ``checkpoint`` None = start from step 0; ``start_over`` = remove
    the previous run's artifacts and checkpoints first."""

    checkpoint: Path | None
    start_over: bool


def plan_resume(
    output_dir: str | Path, resume_from_checkpoint: str | None, overwrite_output_dir: bool, *, restarted: bool = False
) -> ResumePlan:
    """Decide where a run starts. Pure: reads ``output_dir``, changes nothing.

    Rules (LLaMA-Factory's, plus torchrun restarts):

    - ``restarted`` (torchrun restarted the worker group, ``TORCHELASTIC_RESTART_COUNT > 0``): continue from
      the newest checkpoint of this very run, whatever ``overwrite_output_dir`` says; before this run's first
      checkpoint, start where the first attempt started (the configured checkpoint path, or step 0);
    - ``resume_from_checkpoint`` is a path: that checkpoint (it must exist and be complete);
    - ``overwrite_output_dir``: start over;
    - a finished run in ``output_dir``: ConfigError (set overwrite_output_dir or use another folder);
    - ``"auto"``: the newest checkpoint when there is one, else step 0;
    - None (resume disabled) while checkpoints exist: ConfigError (they would be mixed with the new run's).

    Raises:
        ConfigError: as above, naming output_dir and the key to change.
    """
    out = Path(output_dir)
    latest = latest_checkpoint(out)
    if restarted:
        if latest is None and resume_from_checkpoint not in (None, "auto"):
            latest = Path(resume_from_checkpoint)
        return ResumePlan(latest, start_over=False)
    if resume_from_checkpoint not in (None, "auto"):
        path = Path(resume_from_checkpoint)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                f"resume_from_checkpoint: {str(path)!r} is not a complete checkpoint (no {STATE_FILE}); "
                f"use 'auto' or one of: {', '.join(p.name for p in list_checkpoints(out)) or 'none found'}"
            )
        return ResumePlan(path, start_over=False)
    if overwrite_output_dir:
        return ResumePlan(None, start_over=True)
    if is_finished_run(out):
        raise ConfigError(
            f"output_dir {str(out)!r} already holds a finished run ({REPORT_FILE}); set overwrite_output_dir: "
            f"true to start over, or choose another output_dir"
        )
    if resume_from_checkpoint == "auto":
        return ResumePlan(latest, start_over=False)
    if latest is not None:
        raise ConfigError(
            f"output_dir {str(out)!r} holds checkpoints of an unfinished run but resume_from_checkpoint is off; "
            f"set resume_from_checkpoint: auto to continue it, or overwrite_output_dir: true to start over"
        )
    return ResumePlan(None, start_over=False)


def check_batch_shape(
    state: TrainerState,
    where: Path,
    world_size: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
) -> None:
    """Refuse to resume with another global-batch shape: the position within the epoch (micro-batches per
    rank) and the sampler's split by rank would not mean the same samples any more.

    Raises:
        ConfigError: naming the checkpoint, the values then and now.
    """
    now = (world_size, per_device_train_batch_size, gradient_accumulation_steps)
    then = (state.world_size, state.per_device_train_batch_size, state.gradient_accumulation_steps)
    if now != then:
        raise ConfigError(
            f"resume_from_checkpoint {where}: (world_size, per_device_train_batch_size, "
            f"gradient_accumulation_steps) was {then}, now {now}; resume with the same values or set "
            f"overwrite_output_dir: true to start over"
        )


def check_parallelism(state: TrainerState, where: Path, fsdp: str | None) -> None:
    """Refuse to resume a DDP checkpoint under FSDP or the other way round (their optimizer states are
    stored differently: ``optimizer.pt`` vs ``sharded/``). ``fsdp`` is the run's strategy or None (DDP).

    Raises:
        ConfigError: naming the checkpoint and both settings.
    """
    then = state.extra.get("fsdp")
    if bool(then) != bool(fsdp):
        raise ConfigError(
            f"resume_from_checkpoint {where}: written with fsdp {then or 'off (DDP)'}, this run has fsdp "
            f"{fsdp or 'off (DDP)'}; resume with the same fsdp setting or set overwrite_output_dir: true"
        )


def clear_previous_run(output_dir: str | Path) -> None:
    """Remove a previous run's checkpoints and artifacts (:data:`RUN_ARTIFACTS`) from ``output_dir``; other
    files the user put there stay."""
    out = Path(output_dir)
    if not out.is_dir():
        return
    for child in out.iterdir():
        if checkpoint_step(child) is not None or child.name in RUN_ARTIFACTS:
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()


# ---------------------------------------------------------------------- save / load


def new_checkpoint_folder(output_dir: str | Path, step: int) -> Path:
    """A fresh temp folder beside ``checkpoint-STEP`` (FSDP: rank 0 makes it, every rank writes its shard into
    it, :func:`save_checkpoint` commits it). A leftover of a killed save is never listed as a checkpoint."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_PREFIX}{step}.", suffix=".tmp", dir=out))


def _commit_folder(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, replacing an existing ``target`` (as :func:`ferry.fsutil.atomic_directory`): the
    earlier one is moved aside to ``.checkpoint-N.old-PID`` first (a kill there leaves it for
    :func:`remove_interrupted_saves` to put back) and deleted once the new one is in."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        kill_point("checkpoint:swap-aside")
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_interrupted_saves(output_dir: str | Path) -> list[str]:
    """What a killed save or rotation left in ``output_dir``, cleaned up; call only while no save can be under way
    (the run holds ``output_dir``). A checkpoint moved aside to be replaced (``.checkpoint-N.old-PID``) goes back
    under its name when that name is empty; the rest (``.checkpoint-N.XXXX.tmp`` folders being written or being
    deleted by a rotation, an ``.old-PID`` already replaced) is removed. Returns what was done, one sentence each,
    for the caller to print."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    said, removed = [], []
    for left in sorted(out.glob(f".{CHECKPOINT_PREFIX}*")):
        if not left.is_dir() or left.is_symlink():
            continue
        name = left.name[1:].split(".")[0]
        if ".old-" in left.name and checkpoint_step(out / name) is not None and not (out / name).exists():
            os.replace(left, out / name)
            said.append(
                f"put back {out / name}, which an interrupted checkpoint save had moved aside to {left.name} to "
                "replace it"
            )
        elif left.name.endswith(".tmp") or ".old-" in left.name:
            shutil.rmtree(left, ignore_errors=True)
            removed.append(left.name)
    if removed:
        said.append(f"removed what an interrupted checkpoint save left in {out}: {', '.join(removed)}")
    return said


@contextlib.contextmanager
def _folder(target: Path, folder: Path | None):
    """``atomic_directory(target)``, or, for a temp ``folder`` made by :func:`new_checkpoint_folder`, the same
    commit (rename on success, removal on failure)."""
    if folder is None:
        with atomic_directory(target, overwrite=True, phase="checkpoint") as tmp:
            yield tmp
        return
    try:
        yield folder
        _commit_folder(folder, target)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


class _RecordingWriter(io.RawIOBase):
    """A binary file for ``torch.save`` that remembers the ``OSError`` a write or flush raised (torch's zip writer
    turns it into a ``RuntimeError`` without it)."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self.file, self.error = file, cast("OSError | None", None)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return cast(int, self.file.write(data))
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise


class _RecordingStream(_RecordingWriter):
    """A file of ``torch.distributed.checkpoint``'s writer (:func:`_named_errors_writer`): a
    :class:`_RecordingWriter` that also tells, seeks and closes the file and gives its descriptor (for fsync)."""

    def tell(self) -> int:
        return cast(int, self.file.tell())

    def seekable(self) -> bool:
        return cast(bool, self.file.seekable())

    def seek(self, offset: int, whence: int = 0) -> int:
        return cast(int, self.file.seek(offset, whence))

    def fileno(self) -> int:
        return cast(int, self.file.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes the file through self.flush
            self.file.close()
        except OSError as exc:
            self.error = self.error or exc
            raise


def _named_errors_writer(folder: Path) -> Any:
    """``torch.distributed.checkpoint``'s ``FileSystemWriter`` for ``folder``, whose failed writes raise the
    ``OSError`` they were, naming the file (``FOLDER/__RANK_N.distcp``): DCP's own writes the optimizer state with
    ``torch.save``, whose zip writer turns a full disk into "unexpected pos ..." (as :func:`save_torch` says), and
    its plain writes raise an ``OSError`` without a file name."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class NamedErrors(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            stream = None
            try:
                with super().create_stream(path, mode) as raw:
                    stream = _RecordingStream(raw)
                    yield stream
            except (OSError, RuntimeError) as exc:
                error = (stream.error if stream is not None else None) or (exc if isinstance(exc, OSError) else None)
                if error is None or error.filename:
                    raise
                raise OSError(error.errno, error.strerror, str(path)) from exc

    writer = FileSystemWriter(folder)
    writer.fs = NamedErrors()
    return writer


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``, where a failed write (a full disk or quota, an I/O error) raises the ``OSError`` it
    was, naming ``path``: torch's zip writer reports one as a ``RuntimeError`` that says neither ("unexpected pos
    ...", "iostream error").

    Raises:
        OSError: the file could not be written (``filename`` is ``path``).
    """
    fh = open(path, "wb")  # noqa: SIM115 - closed below, where a failed close (the last buffered bytes) is caught too
    writer = _RecordingWriter(fh)
    try:
        torch.save(obj, cast("IO[bytes]", writer))
        fh.close()
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):
            fh.close()
        error = writer.error or (exc if isinstance(exc, OSError) else None)
        if error is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from exc


def save_checkpoint(
    output_dir: str | Path,
    *,
    peft_model: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    state: TrainerState,
    rng_states: list[dict[str, Any]] | None,
    save_total_limit: int | None = None,
    folder: Path | None = None,
    adapter_state: dict[str, torch.Tensor] | None = None,
    resumable: bool | None = None,
    tokenizer: Any = None,
    vocab: Any = None,
    extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{state.global_step}/`` atomically, then delete the oldest checkpoints
    beyond ``save_total_limit``. Call on rank 0 only.

    Args:
        peft_model: the unwrapped ``peft.PeftModel`` (``ddp_model.module``); its adapter is saved with
            ``save_pretrained`` (safetensors).
        optimizer, scheduler, scaler: saved with ``state_dict()``; optimizer None (``save_only_model``, or
            FSDP whose optimizer state is already in ``folder/sharded``) skips optimizer.pt.
        state: where the run stands.
        rng_states: one :func:`capture_rng_state` dict per rank (index = rank), or None.
        save_total_limit: keep at most this many checkpoints, the newest; None keeps all.
        folder: FSDP: the temp folder from :func:`new_checkpoint_folder` that already holds ``sharded/``.
        adapter_state: FSDP: the gathered LoRA weights (:func:`gather_adapter_state`), saved in PEFT format.
        resumable: write scheduler, scaler, RNG and trainer state (the resume marker); default: whether an
            optimizer was given.
        tokenizer, vocab: a run that added tokens (``resize_vocab``): its tokenizer and
            :class:`trainer.vocab.VocabPlan` go into the checkpoint too, so that ``ferry export`` can merge it.
        extra_files: more safetensors files beside the adapter (file name -> tensors), e.g. stage rm's
            ``value_head.safetensors``.

    Returns:
        The checkpoint folder.
    """
    out = Path(output_dir)
    target = out / f"{CHECKPOINT_PREFIX}{state.global_step}"
    resumable = optimizer is not None if resumable is None else resumable
    with _folder(target, folder) as tmp:
        peft_model.save_pretrained(  # the trained adapter only (a dpo run may hold a frozen reference one)
            str(tmp),
            safe_serialization=True,
            save_embedding_layers=False,
            state_dict=adapter_state,
            selected_adapters=[peft_model.active_adapter],
        )
        if vocab is not None:  # resize_vocab (trainer/vocab.py): the grown adapter needs its tokenizer to export
            from trainer.vocab import save_plan

            tokenizer.save_pretrained(str(tmp))
            save_plan(vocab, tmp)
        if extra_files:
            from safetensors.torch import save_file

            for name, tensors in extra_files.items():
                save_file(tensors, str(tmp / name))
        if resumable:
            if optimizer is not None:
                save_torch(optimizer.state_dict(), tmp / "optimizer.pt")
            save_torch(scheduler.state_dict(), tmp / "scheduler.pt")
            if scaler is not None and scaler.is_enabled():
                save_torch(scaler.state_dict(), tmp / "scaler.pt")
            if rng_states is not None:
                save_torch(rng_states, tmp / "rng_state.pt")
            # Written last: its presence marks a resumable checkpoint (the rename commits the whole folder).
            (tmp / STATE_FILE).write_text(state.to_json(), encoding="utf-8")
        kill_point("checkpoint:staged")  # whole under its temp name, not renamed into place yet
    kill_point("checkpoint:renamed")  # in place, the oldest not rotated out yet
    if save_total_limit is not None:
        rotate_checkpoints(out, save_total_limit)
    return target


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int) -> list[Path]:
    """Delete all but the newest ``save_total_limit`` checkpoints; returns the deleted folders. Each is renamed to
    ``.checkpoint-N.rotated-PID.tmp`` before it is deleted: a kill part-way never leaves a ``checkpoint-N`` with
    some of its files gone (:func:`remove_interrupted_saves` removes the rest)."""
    root = Path(output_dir)
    every = sorted(
        (p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None),
        key=lambda p: checkpoint_step(p) or 0,
    )
    doomed = every[: max(0, len(every) - save_total_limit)]
    for path in doomed:
        gone = path.with_name(f".{path.name}.rotated-{os.getpid()}.tmp")
        os.replace(path, gone)
        kill_point("checkpoint:rotating")
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory (CPU tensors), ready to broadcast to every rank."""

    path: Path
    state: TrainerState
    adapter_state: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng_states: list[dict[str, Any]] | None
    sharded_dir: Path | None = None  # FSDP: LoRA weights + optimizer state, read by every rank


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors on CPU, ``weights_only`` unpickling).

    Raises:
        TrainingError: a file is missing or unreadable (the message names it), e.g. a ``save_only_model``
            checkpoint that holds no optimizer state.
    """
    from safetensors.torch import load_file

    root = Path(path)
    state = TrainerState.from_file(root / STATE_FILE)

    def _load(name: str, required: bool = True) -> Any:
        file = root / name
        if not file.is_file():
            if required:
                raise TrainingError(f"{file} is missing: checkpoint {root} cannot be resumed from")
            return None
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
            raise TrainingError(f"{file}: unreadable ({type(exc).__name__}: {exc})") from None

    adapter_file = root / ADAPTER_WEIGHTS
    if not adapter_file.is_file():
        raise TrainingError(f"{adapter_file} is missing: checkpoint {root} cannot be resumed from")
    sharded = root / SHARDED_DIR
    if state.extra.get("fsdp") and not (sharded / ".metadata").is_file():
        raise TrainingError(f"{sharded}/.metadata is missing: FSDP checkpoint {root} cannot be resumed from")
    return LoadedCheckpoint(
        path=root,
        state=state,
        adapter_state=load_file(str(adapter_file)),
        sharded_dir=sharded if state.extra.get("fsdp") else None,
        optimizer=None if state.extra.get("fsdp") else _load("optimizer.pt"),
        scheduler=_load("scheduler.pt"),
        scaler=_load("scaler.pt", required=False),
        rng_states=_load("rng_state.pt", required=False),
    )


# ---------------------------------------------------------------------- FSDP: sharded state (collectives)


def save_sharded_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shard of the trainable weights and the optimizer state into
    ``folder`` with ``torch.distributed.checkpoint`` (rank 0 also writes ``.metadata``). Frozen weights are
    left out (``ignore_frozen_params``): they are the base model's files.

    Raises:
        OSError: a rank's write failed (a full disk on any rank: every rank raises the lowest failed rank's
            error, which names that rank's file, :func:`rank_failure`).
        TrainingError: a rank failed otherwise (its rank and error in one line).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    try:
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.save(state, checkpoint_id=str(folder), storage_writer=_named_errors_writer(folder))
    except CheckpointException as exc:  # a BaseException: `except Exception` would not see it
        raise rank_failure(exc, folder) from None


def rank_failure(exc: BaseException, folder: Path) -> Exception:
    """The error to raise for ``torch.distributed.checkpoint``'s ``CheckpointException``, which every rank raises
    when any failed, with ``failures`` (rank -> (exception, traceback)): the lowest failed rank's ``OSError`` (given
    ``FOLDER`` as its file when it names none), with that rank in its ``failed_rank`` attribute, so that a full disk
    on rank 1 reads the same on every rank; any other failure as a :class:`TrainingError` naming the rank."""
    failures = sorted(getattr(exc, "failures", {}).items())
    for rank, (error, _trace) in failures:
        if isinstance(error, OSError):
            named = OSError(error.errno, error.strerror or str(error), error.filename or str(folder))
            named.failed_rank = rank  # type: ignore[attr-defined]
            return named
    rank, (error, _trace) = failures[0] if failures else (None, (exc, None))
    first = str(error).splitlines()[0] if str(error) else ""
    where = f" on rank {rank}" if rank is not None else ""
    return TrainingError(f"{folder}: sharded checkpoint failed{where} ({type(error).__name__}: {first})")


def write_error_line(exc: BaseException, what: str, output_dir: Path, rank: int) -> str | None:
    """One line for a write error of the host met by ``rank`` while writing ``what`` into ``output_dir``
    (:func:`ferry.fsutil.host_write_error`: the file, and the free space in ``output_dir`` for a full disk), or None
    for any other exception. An error another rank met (:func:`rank_failure`'s ``failed_rank``) says ``on rank N``
    instead of this rank's free space, which is not the disk that filled up when the ranks are on different hosts."""
    failed = getattr(exc, "failed_rank", rank)
    if failed == rank:
        return host_write_error(exc, what, output_dir)
    return host_write_error(exc, f"{what} on rank {failed}", None)


def load_sharded_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: the inverse of :func:`save_sharded_state`, each rank reading what its shards need.

    Raises:
        TrainingError: the folder is unreadable or does not fit the model (message names it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = sorted(getattr(exc, "failures", {}).items())
        rank, (error, _trace) = failures[0] if failures else (None, (exc, None))
        where = f"rank {rank}: " if rank is not None else ""
        first = str(error).splitlines()[0] if str(error) else ""
        raise TrainingError(
            f"{folder}: sharded checkpoint unreadable ({where}{type(error).__name__}: {first})"
        ) from None
    # strict=False: the frozen base weights are not in the checkpoint (they were loaded from the base model);
    # every trainable key is, since the template above came from this very model.
    result = set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=False, ignore_frozen_params=True),
    )
    if result.unexpected_keys:
        raise TrainingError(
            f"{folder}: sharded checkpoint does not fit this model: unexpected keys {list(result.unexpected_keys)[:5]}"
        )


def gather_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full trainable weights (LoRA and additional_target copies, small) on rank 0's CPU, by
    runtime name (``peft.PeftModel.save_pretrained(state_dict=...)`` picks the adapter's); {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    return cast("dict[str, torch.Tensor]", state)  # full_state_dict: plain tensors, no DTensor shards


__all__ = [
    "CHECKPOINT_PREFIX",
    "SHARDED_DIR",
    "check_parallelism",
    "gather_adapter_state",
    "load_sharded_state",
    "new_checkpoint_folder",
    "save_sharded_state",
    "check_batch_shape",
    "LoadedCheckpoint",
    "ResumePlan",
    "TrainerState",
    "capture_rng_state",
    "cuda_state_for",
    "checkpoint_step",
    "clear_previous_run",
    "is_finished_run",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "plan_resume",
    "restore_rng_state",
    "rotate_checkpoints",
    "save_checkpoint",
]
