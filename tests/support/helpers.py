"""Helpers shared by the test areas: where the real assets are, a tiny training config and the subprocess that
runs it, adapter comparisons, peft-built adapters, data and bundle writers.

Fixtures stay in the conftest.py of their area; what a test module imports lives here (never from another test
module or a conftest).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.netns import run_offline

ROOT = Path(__file__).resolve().parents[2]
SHARED_ASSETS = ROOT.parent / "shared" / "assets"
STORIES_MODEL = SHARED_ASSETS / "models" / "stories260K"
LLAMAFACTORY_DATA = SHARED_ASSETS / "datasets" / "llamafactory"

LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


class LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor any op creates (forward and backward) while the mode is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def tiny_config(stories_model: Path, llamafactory_data: Path, work: Path, **overrides: Any) -> dict[str, Any]:
    """A run small enough for 2 CPU cores: 32 alpaca samples cut to 64 tokens, LoRA r=8 on every linear."""
    cfg: dict[str, Any] = {
        "model_name_or_path": str(stories_model),
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(llamafactory_data),
        "template": "alpaca",
        "cutoff_len": 64,
        "max_samples": 32,
        "lora_rank": 8,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 5e-3,
        "num_train_epochs": 1.5,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 2,
        "weight_decay": 0.01,
        "logging_steps": 1,
        "save_steps": 1000,
        "seed": 7,
        "disable_tqdm": True,
        "output_dir": str(work / "out"),
    }
    cfg.update(overrides)
    return cfg


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


#: The machine's one copy of ferry's lm-eval task index cache (bundler.eval_index): its file names are a hash of
#: lm-eval's version and every task YAML's path, size and mtime, so every test may share it.
LM_EVAL_INDEX = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry-tests" / "lm-eval-index"


def share_lm_eval_index(ferry_cache: Path) -> Path:
    """Make ``FERRY_CACHE/lm-eval-index`` (``ferry_cache``, a test's own cache folder) a link to the machine's
    :data:`LM_EVAL_INDEX`, so a ``ferry eval`` in a fresh cache reads the index instead of parsing lm-eval's
    ~14,000 task YAMLs again (~10 s). The test that proves the cache equals lm-eval's own index does not use it.
    Returns ``ferry_cache``."""
    from bundler.eval_index import CACHE_SUBDIR

    LM_EVAL_INDEX.mkdir(parents=True, exist_ok=True)
    link = ferry_cache / CACHE_SUBDIR
    if not link.exists():
        ferry_cache.mkdir(parents=True, exist_ok=True)
        link.symlink_to(LM_EVAL_INDEX, target_is_directory=True)
    return ferry_cache


def worker_env(work: Path, **extra: str) -> dict[str, str]:
    """The environment of a ferry subprocess: this checkout first on the path, caches inside the test's folder
    (lm-eval's task index shared: :func:`share_lm_eval_index`), one thread per process (2 cores, 2 workers)."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        FERRY_CACHE=str(share_lm_eval_index(work / "ferry-cache")),
        HF_HOME=str(work / "hf-home"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_ferry(
    args: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    offline: bool = False,
    timeout: float = 600,
    preload: tuple[str, ...] = (),
    mount_setup: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``ferry ARGS...`` with ``env`` in ``cwd`` (with no network when ``offline``; in a user + mount namespace of
    its own after the ``sh`` script ``mount_setup`` mounted what it mounts there, a read-only bind mount or a small
    tmpfs), as a process forked from this one (:func:`fork_ferry`, ``preload``: the modules the command imports, so
    that the child starts with them); ``FERRY_TESTS_EXEC=1``: ``python -m ferry`` exec'd, under ``unshare -rn`` /
    ``unshare -rm``. A ``ferry train``'s or ``ferry eval``'s torchrun and workers are forked too
    (:mod:`tests.support.forks`; ``FERRY_TESTS_EXEC_TORCHRUN=1``: exec'd). Its exit status is the result's; nothing
    is raised for it."""
    assert not (offline and mount_setup), "one namespace at a time"
    if os.environ.get("FERRY_TESTS_EXEC") == "1":
        argv = [sys.executable, "-m", "ferry", *args]
        if offline:
            return run_offline(argv, env=env, cwd=cwd, timeout=timeout, check=False)
        if mount_setup:
            argv = ["unshare", "-rm", "sh", "-c", f'{mount_setup} && exec "$@"', "sh", *argv]
        return subprocess.run(argv, env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout)
    return fork_ferry(
        args, env=env, cwd=cwd, offline=offline, mount_setup=mount_setup, timeout=timeout, preload=preload
    )


def run_ferry_train(
    config: Path,
    *args: str,
    env: dict[str, str],
    cwd: Path,
    offline: bool = False,
    check: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``ferry train CONFIG ARGS...`` through :func:`run_ferry`; ``check``: an exit status other than 0 fails the
    test with the command's output."""
    proc = run_ferry(["train", str(config), *args], env=env, cwd=cwd, offline=offline, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"ferry train failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


#: What ``ferry eval`` imports beyond the CLI (lm-eval's evaluator and its ``hf`` model, peft): imported once per
#: pytest process, so that each forked ``ferry eval`` starts with them (an exec'd one spends about 7 CPU-s on them).
EVAL_IMPORTS = ("evaluation.run", "lm_eval.evaluator", "lm_eval.models.huggingface", "peft")


def run_ferry_eval(
    *args: str, env: dict[str, str], cwd: Path, offline: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``ferry eval ARGS...`` through :func:`run_ferry` (forked, with lm-eval imported first)."""
    return run_ferry(["eval", *args], env=env, cwd=cwd, offline=offline, timeout=timeout, preload=EVAL_IMPORTS)


#: What the ``ferry train`` launcher imports (torch, transformers' Llama modeling for the preflight's meta model,
#: tokenizers, datasets): imported once per pytest process, so that each forked launcher starts with them.
_LAUNCHER_IMPORTS = (
    "ferry.cli",
    "trainer.launch",
    "trainer.config",
    "trainer.checkpoint",
    "trainer.batching",
    "trainer.data",
    "trainer.targets",
    "datasets",
    "transformers.models.llama.modeling_llama",
)


def fork_ferry(
    args: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    offline: bool = False,
    mount_setup: str | None = None,
    timeout: float = 600,
    entry: Any = None,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``ferry ARGS...`` (``entry(ARGS)`` when given, in place of ``ferry.cli.main``) in a child forked from this
    pytest process: ``os.environ`` replaced by ``env``, ``cwd`` its folder, stdin ``/dev/null``, stdout and stderr
    captured, its own process group (killed whole on ``timeout``), logging and warnings as in a fresh process
    (:func:`_as_a_fresh_process`), and with ``offline`` a new user + network namespace with only loopback up, as
    ``unshare -rn`` makes (:func:`tests.support.netns.enter_offline_namespace`), with ``mount_setup`` a new user +
    mount namespace where that ``sh`` script mounted what it mounts (:func:`tests.support.netns.enter_mount_namespace`).
    :func:`start_ferry` starts one without waiting.

    Why: an exec'd ``ferry train`` spends about 5 CPU-s importing torch, transformers and datasets before its
    first line of work; ~70 training runs of the suite paid that on 2 cores. A fork starts with them imported.
    What libraries read from the environment at import time (huggingface_hub's constants, ``datasets.config``,
    transformers' ``HF_MODULES_CACHE``) is read again from ``env``
    (:func:`benchmarks.forked_torchrun.fresh_library_env`); ferry reads its own (``HF_HOME``, ``FERRY_CACHE``,
    offline variables) at call time. The torchrun that a forked ``ferry train``
    starts, and its workers, are forked from it as well (:mod:`tests.support.forks`), with the same
    limits; a run trains exactly as an exec'd one (tests/test_fork_ferry.py).

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout`` seconds (its process group was killed).
    """
    enter = None
    if offline:
        from tests.support.netns import enter_offline_namespace as enter
    elif mount_setup:
        from tests.support.netns import enter_mount_namespace

        def enter() -> None:
            enter_mount_namespace(mount_setup)

    child = start_ferry(args, env=env, cwd=cwd, entry=entry, preload=preload, enter=enter)
    stdout, stderr = child.communicate(timeout=timeout)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


class ForkedFerry:
    """A ``ferry`` command started by :func:`start_ferry`: ``pid``, ``args``, ``returncode`` (None while it runs)
    and ``communicate(timeout)``, as ``subprocess.Popen`` with text pipes has them."""

    def __init__(self, args: list[str], pid: int, out: Any, err: Any) -> None:
        from benchmarks.forked_torchrun import ForkedProcess

        self.args, self.pid, self._out, self._err = args, pid, out, err
        self._proc = ForkedProcess(pid, args)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def communicate(self, timeout: float = 600) -> tuple[str, str]:
        """Wait for the command; return its (stdout, stderr) as text.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` seconds (its process group was killed).
        """
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            raise subprocess.TimeoutExpired(self.args, timeout, *self._output()) from None
        except BaseException:  # pytest-timeout's failure, an interrupt: the command must not outlive the test
            self._kill()
            raise
        return self._output()

    def _kill(self) -> None:
        """SIGKILL the command's process group (and the command itself, should it not have made its group yet)."""
        import contextlib
        import signal

        for kill, target in ((os.killpg, self.pid), (os.kill, self.pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(target, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            self._proc.wait()

    def _output(self) -> tuple[str, str]:
        output = _read(self._out), _read(self._err)
        self._out.close()
        self._err.close()
        return output


def start_ferry(
    args: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    entry: Any = None,
    preload: tuple[str, ...] = (),
    enter: Any = None,
) -> ForkedFerry:
    """:func:`fork_ferry` without waiting: the forked child, running. ``enter``: a function the child calls once
    its environment is ``env`` and before the command, to move itself elsewhere (a network namespace: the offline
    one, or a test host of :class:`tests.support.netns.TwoHosts`)."""
    import importlib
    import tempfile

    for name in (*_LAUNCHER_IMPORTS, *preload):  # ``preload``: more modules the child should find imported
        importlib.import_module(name)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed by communicate
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        _forked_main(args, env=env, cwd=cwd, enter=enter, out=out.fileno(), err=err.fileno(), entry=entry)
    return ForkedFerry(["ferry", *args], pid, out, err)


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 180) -> str:
    """What ``proc`` (a ``subprocess.Popen`` with a binary stdout pipe) printed, up to and including ``marker``;
    an ``AssertionError`` with its output when ``marker`` does not come within ``timeout`` seconds or it ends first."""
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        assert ready and left > 0, f"no {marker!r} within {timeout} s; got {seen!r}"
        chunk = os.read(proc.stdout.fileno(), 4096).decode()
        assert chunk, f"ferry serve ended early ({proc.wait()}): {seen}{proc.stderr.read().decode()[-3000:]}"
        seen += chunk
    return seen


def stop_served(proc: subprocess.Popen, port: int, engine: str, timeout: float = 120) -> None:
    """SIGTERM to a foreground ``ferry serve`` (``proc``, a ``subprocess.Popen`` with a binary stdout pipe): it says
    ``stopping ENGINE``, exits 0, and no process with ``--port PORT`` in its command line is left (the server's
    whole process group went with it)."""
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=timeout)[0].decode()
    assert proc.returncode == 0 and f"stopping {engine}" in rest, rest[-2000:]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--port {port}" not in ps, "the server is gone with ferry"


def _read(file: Any) -> str:
    file.seek(0)
    return file.read().decode("utf-8", errors="replace")


def _forked_main(
    args: list[str], *, env: dict[str, str], cwd: Path, enter: Any, out: int, err: int, entry: Any = None
) -> None:
    """The forked child of :func:`start_ferry`: redirect, move into ``env`` / ``cwd`` (and ``enter()`` where
    given), run ``ferry.cli.main`` and leave with its exit status through ``os._exit`` (no pytest exit handlers)."""
    import io

    from benchmarks.forked_torchrun import exit_with, fresh_library_env

    def run() -> None:
        # fds 0 and 1 of an xdist worker are its channel to the controller: nothing may touch them
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        _FORKED_KEEP.extend((sys.stdin, sys.stdout, sys.stderr))  # pytest's objects: never flushed or closed here
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
        _as_a_fresh_process()
        os.setpgid(0, 0)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        fresh_library_env()  # and torch's threads from OMP_NUM_THREADS
        if enter is not None:
            enter()
        sys.argv = ["ferry", *args]
        main = entry
        if main is None:
            from ferry.cli import main
            from tests.support import forks

            forks.install()  # its torchrun and workers forked too (FERRY_TESTS_EXEC_TORCHRUN=1: exec'd)
        main(list(args))

    exit_with(run)  # the exit status as an interpreter's (SystemExit's, or 1 with the traceback), then os._exit


_FORKED_KEEP: list[Any] = []


def _as_a_fresh_process() -> None:
    """Undo what pytest and earlier in-process tests set up in this process that a fresh Python has not: logging and
    warnings as a fresh interpreter has them (:func:`benchmarks.forked_torchrun.fresh_process_state`), and stream
    handlers bound to pytest's capture objects bound to the new stderr / stdout instead. Call after
    ``sys.stdout`` and ``sys.stderr`` are replaced."""
    import logging

    from benchmarks.forked_torchrun import fresh_process_state

    fresh_process_state()
    old_streams = {id(stream): new for stream, new in zip(_FORKED_KEEP[-2:], (sys.stdout, sys.stderr))}
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in (x for x in loggers if isinstance(x, logging.Logger)):
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in old_streams:
                handler.setStream(old_streams[id(stream)])


#: What a training worker imports beyond the launcher (peft, transformers' modeling utilities, torchrun's error
#: recorder that trainer/__main__.py decorates ``main`` with): imported once per pytest process, so that each forked
#: plain worker starts with them.
_WORKER_IMPORTS = ("peft", "transformers.modeling_utils", "torch.distributed.elastic.multiprocessing.errors")


def _plain_worker_main(args: list[str]) -> None:
    """``python -m trainer ARGS`` in a child of :func:`fork_ferry` (its environment already the test's):
    :func:`benchmarks.forked_torchrun.worker_main`."""
    from benchmarks.forked_torchrun import worker_main

    worker_main(args)


def run_plain_worker(config: Path, *, env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    """``python -m trainer CONFIG``: one process, no torchrun (world size 1, no process group); returns its
    stderr. Forked from this process (:func:`fork_ferry`, :func:`_plain_worker_main`): an exec'd worker spends
    about 4.5 CPU-s importing torch, transformers and peft; ``FERRY_TESTS_EXEC=1`` execs it as before."""
    if os.environ.get("FERRY_TESTS_EXEC") == "1":
        proc = subprocess.run(
            [sys.executable, "-m", "trainer", str(config)],
            env=env,
            cwd=cwd,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
    else:
        proc = fork_ferry(
            [str(config)], env=env, cwd=cwd, timeout=timeout, entry=_plain_worker_main, preload=_WORKER_IMPORTS
        )
    if proc.returncode != 0:
        raise AssertionError(f"python -m trainer failed ({proc.returncode})\n{proc.stderr[-6000:]}")
    return proc.stderr


def train_losses(output_dir: Path) -> list[float]:
    """The per-step train losses from metrics.jsonl (logging_steps 1), in step order."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "each step logged exactly once"
    return [r["loss"] for r in steps]


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def assert_same_adapter(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, rel_frobenius: float, max_abs: float
) -> None:
    """Same keys, and per tensor ``||a - b||_F <= rel_frobenius * ||b||_F`` and ``max|a - b| <= max_abs``.

    Element-wise relative checks are the wrong tool after AdamW: an element whose gradient is ~0 gets an update
    of about +-lr from rounding noise alone, so single elements may differ by a fraction of lr while the
    tensor as a whole agrees to ~1e-5."""
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] - b[key]).float()
        rel = (diff.norm() / b[key].float().norm().clamp(min=1e-12)).item()
        assert rel <= rel_frobenius, f"{key}: relative Frobenius difference {rel:.3g} > {rel_frobenius}"
        assert diff.abs().max().item() <= max_abs, f"{key}: max abs difference {diff.abs().max().item():.3g}"


def parquet_bytes(rows: list[dict]) -> bytes:
    """``rows`` as one parquet file's bytes (pyarrow infers the schema), as a hub dataset repo holds them."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def write_json(path: Path, rows: list[Any]) -> Path:
    """Write rows as a .json list (indent 1, so row N is not line N: tests prove row numbering)."""
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows as .jsonl (one JSON value per line); a str row is written verbatim (for broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def lf_scores(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """LLaMA-Factory 0.9.5's ComputeSimilarity on (label, predict) text pairs, called here on the peer libraries."""
    import jieba
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_chinese import Rouge

    score = {"rouge-1": [], "rouge-2": [], "rouge-l": [], "bleu-4": []}
    for label, pred in pairs:
        hyp, ref = list(jieba.cut(pred)), list(jieba.cut(label))
        if len(" ".join(hyp).split()) == 0 or len(" ".join(ref).split()) == 0:
            result = {"rouge-1": {"f": 0.0}, "rouge-2": {"f": 0.0}, "rouge-l": {"f": 0.0}}
        else:
            result = Rouge().get_scores(" ".join(hyp), " ".join(ref))[0]
        for k, v in result.items():
            score[k].append(round(v["f"] * 100, 4))
        score["bleu-4"].append(
            round(sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3) * 100, 4)
        )
    return {f"predict_{k}": float(np.mean(v)) for k, v in score.items()}


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]  # attention (c_attn, attn.c_proj) and MLP (c_fc, mlp.c_proj)


def make_adapter(base_dir: Path, out_dir: Path, *, seed: int = 0, **lora_kwargs):
    """Build a LoRA adapter on ``base_dir`` with peft, save it to ``out_dir`` and return the in-memory
    PeftModel (float32, CPU) for reference computations."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.1 * torch.randn_like(param))
    peft_model.save_pretrained(out_dir)
    return peft_model


def merged_reference(peft_model) -> dict[str, torch.Tensor]:
    """peft's own merge of ``peft_model`` (a deep copy is merged; the argument stays usable)."""
    import copy

    return {k: v.detach().clone() for k, v in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}


def load_export(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder (one file or an index of shards)."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def random_adapter(
    model_dir: Path, folder: Path, seed: int, targets: list[str], auto: str = "AutoModelForCausalLM"
) -> Path:
    """A peft LoRA adapter (r 4) with nonzero B saved by peft itself, on ``auto`` (a transformers Auto class name)
    of ``model_dir``."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        getattr(transformers, auto).from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(folder))
    return folder


def peft_merged(model_dir: Path, adapters: list[Path], auto: str = "AutoModelForCausalLM") -> dict[str, torch.Tensor]:
    import transformers
    from peft import PeftModel

    model = getattr(transformers, auto).from_pretrained(model_dir, dtype=torch.float32)
    for adapter in adapters:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.state_dict()


#: The repos the bundler tests' olah hub serves (tests/bundler/conftest.py), and the model card it gives stories.
STORIES_REPO = "stories/stories260K"
ALPACA_REPO = "llamafactory/alpaca_en_demo"
MODEL_CARD = "---\nlicense: mit\nlibrary_name: transformers\n---\n# stories260K\nA tiny TinyStories Llama.\n"


def resign(bundle: Path, manifest: dict, drop: str | None = None) -> None:
    """Write ``manifest`` as the bundle directory's manifest.json and fix its SHA256SUMS line (dropping lines
    that end in ``drop``): what an attacker holding the bundle, or a pack with other sources, would write."""
    data = (json.dumps(manifest, indent=2) + "\n").encode()
    (bundle / "manifest.json").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    lines = [
        f"{digest}  manifest.json" if line.endswith("  manifest.json") else line
        for line in (bundle / "SHA256SUMS").read_text().splitlines()
        if not (drop and line.endswith(drop))
    ]
    (bundle / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def set_online_env(mp: Any, hub: Any, hf_home: Path) -> None:
    """The packer's environment on the online host: ``hub``'s ``$HF_ENDPOINT``, a private ``$HF_HOME``, no token,
    not offline."""
    for key, value in hub.env().items():
        mp.setenv(key, value)
    mp.setenv("HF_HOME", str(hf_home))
    mp.delenv("HF_TOKEN", raising=False)
    mp.delenv("HF_HUB_OFFLINE", raising=False)
