"""What a training step does not do: a host sync in ferry's own code (except on a logging step), a broadcast of
the model's buffers before every forward under DDP.

A plain-process run (no torchrun) of the SFT recipe on stories260K under a ``TorchFunctionMode`` that sees every
torch call. The ones that make the host wait for the device on CUDA (``.item()``, ``.tolist()``, ``float()``,
``int()``, ``bool()`` of a tensor, ``torch.equal``, ``nonzero``, ``.cpu()``) and tensor creation from Python data
(``torch.tensor``, ``torch.as_tensor``: a copy from pageable memory on CUDA) are counted when ferry's code makes
them (the caller is a file of ferry's), per optimizer step. The collate (trainer/batching.py, trainer/data.py and what
they call) is left out: it builds the CPU batches from Python lists by design, in the loader. Calls that torch,
transformers or peft make are theirs. On CUDA, ``benchmarks/gpu_check.py`` runs steps under
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
FERRY_TREES = tuple(str(ROOT / name) + "/" for name in ("trainer", "ferry", "exporter", "bundler"))
COLLATE = tuple(str(ROOT / "trainer" / name) for name in ("batching.py", "data.py"))
TORCH_TREE = str(Path(torch.__file__).parent) + "/"
STDLIB = str(Path(sys.modules["contextlib"].__file__).parent) + "/"

#: What makes the host wait on CUDA (or copies from pageable memory), by the name the mode sees.
SYNCING = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "equal", "nonzero", "cpu", "numpy"}
FROM_PYTHON = {"tensor", "as_tensor"}


class _Counting(TorchFunctionMode):
    """Counts syncing calls made by ferry's code, keyed by the optimizer step in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0  # 0: before the first step (setup, probes); set by the wrapped _optimizer_step
        self.calls: dict[int, Counter] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.step and (name in SYNCING or name in FROM_PYTHON):
            where = _ferry_caller()
            if where is not None:
                self.calls.setdefault(self.step, Counter())[f"{name} at {where}"] += 1
        return func(*args, **(kwargs or {}))


def _ferry_caller() -> str | None:
    """``file:line`` of the code that made the call when it is ferry's own (not the collate, nor anything the
    collate calls), else None: a call torch's optimizer or transformers makes is theirs (AdamW's CPU
    implementation reads its step count with ``.item()``; on CUDA the recipe picks the fused one)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith((TORCH_TREE, STDLIB)):
        if frame.f_code.co_filename.startswith(TORCH_TREE) and frame.f_code.co_name != "__torch_function__":
            return None  # torch's own code made the call
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(FERRY_TREES):
        return None
    where = f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"
    outer = frame
    while outer is not None:
        if outer.f_code.co_filename.startswith(COLLATE):
            return None
        outer = outer.f_back
    return where


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_a_non_logging_step_makes_no_host_sync(stories_model, llamafactory_data, tmp_path, monkeypatch, layout):
    from trainer.config import TrainConfig
    from trainer.recipe import FinetuneRecipe, train

    overrides: dict = {"padding_free": False}
    kernel_calls: list[dict] = []
    if layout == "varlen":  # one row a micro-batch through trainer.varlen's kernel path, the kernel a CPU stand-in
        from tests.trainer.test_varlen import _fake_kernel
        from trainer import varlen

        overrides = {"padding_free": True, "flash_attn": "varlen"}
        fake = _fake_kernel(kernel_calls)
        monkeypatch.setattr(
            varlen, "_device_kernel", lambda query: (fake, {"window_size": (-1, 0), "enable_gqa": True})
        )

    counting = _Counting()
    step = FinetuneRecipe._optimizer_step

    def counted_step(self, micro_batches):
        if not counting.step:  # from the first step on: the set-up and its probes are not steps
            counting.__enter__()
        counting.step = self.global_step + 1
        return step(self, micro_batches)

    monkeypatch.setattr(FinetuneRecipe, "_optimizer_step", counted_step)
    # FERRY_SYNC_DEBUG: every step after the first runs inside DistEnv.sync_debug("error") (on CUDA: torch's sync
    # debug mode; off CUDA a no-op, so this run trains as without it)
    from trainer.distributed import DistEnv

    modes, sync_debug = [], DistEnv.sync_debug

    def recorded(self, mode):
        modes.append(mode)
        return sync_debug(self, mode)

    monkeypatch.setattr(DistEnv, "sync_debug", recorded)
    monkeypatch.setenv("FERRY_SYNC_DEBUG", "error")
    # logging at steps 1, 3 and 6 (the first, every 3rd, the last); 2 micro-batches a step; padded rows
    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        tmp_path,
        max_samples=24,
        max_steps=6,
        logging_steps=3,
        gradient_accumulation_steps=2,
        save_strategy="no",
        **overrides,
    )
    try:
        report = train(TrainConfig(**cfg))
    finally:
        if counting.step:
            counting.__exit__(None, None, None)
    assert report.global_steps == 6
    assert report.attention == ("ferry_varlen" if layout == "varlen" else "sdpa")
    if layout == "varlen":  # every layer of every micro-batch (2 a step) ran the kernel on a row of two samples
        assert sum(len(c["cu"]) == 3 for c in kernel_calls) >= 5 * 2 * 6, kernel_calls
    assert modes == [None, "error", "error", "error", "error", "error"]
    quiet = {s: dict(counting.calls.get(s, {})) for s in (2, 4, 5)}
    assert quiet == {2: {}, 4: {}, 5: {}}, quiet
    # the control: a logging step reads the loss, the tokens and the gradient norm on the host, and the counter
    # sees ferry's own calls
    logged = counting.calls.get(3, Counter())
    assert sum(n for call, n in logged.items() if call.startswith("__float__ at trainer/recipe.py")) >= 3, logged


def test_the_sync_debug_mode_is_set_inside_and_restored_after_on_cuda_only(monkeypatch):
    from ferry.errors import ConfigError
    from trainer.distributed import DistEnv
    from trainer.recipe import sync_debug_mode

    state, seen = [0], []  # torch's mode: 0 default, 1 warn, 2 error ("error" is set by name)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: (seen.append(mode), state.__setitem__(0, mode)))
    cuda = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0), backend="nccl")
    with cuda.sync_debug("error"):
        assert state[0] == "error"
    assert seen == ["error", 0] and state[0] == 0
    with pytest.raises(RuntimeError, match="synchronizing"), cuda.sync_debug("warn"):
        raise RuntimeError("called a synchronizing CUDA operation")
    assert state[0] == 0  # restored when the step raised too
    seen.clear()
    with cuda.sync_debug(None), DistEnv(0, 0, 1, torch.device("cpu"), "gloo").sync_debug("error"):
        pass
    assert seen == []  # no mode asked, or not CUDA: torch's mode untouched
    for value, mode in (("", None), ("default", None), ("warn", "warn"), (" ERROR", "error")):
        monkeypatch.setenv("FERRY_SYNC_DEBUG", value)
        assert sync_debug_mode() == mode
    monkeypatch.setenv("FERRY_SYNC_DEBUG", "loud")
    with pytest.raises(ConfigError, match="FERRY_SYNC_DEBUG='loud': expected warn, error or default"):
        sync_debug_mode()


def test_ddp_syncs_buffers_once_unless_asked_and_takes_the_bucket_size():
    # torch 2.13's DistributedDataParallel: forward_sync_buffers (broadcast_buffers is deprecated, with a
    # FutureWarning); one gloo rank in this process
    import types
    import warnings

    import torch.distributed as dist

    from trainer.config import TrainConfig
    from trainer.recipe import FinetuneRecipe

    module = torch.nn.Linear(4, 4)
    module.register_buffer("inv_freq", torch.ones(2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        built = {}
        for name, keys in (("default", {}), ("asked", {"ddp_broadcast_buffers": True, "ddp_bucket_cap_mb": 5})):
            cfg = TrainConfig(model_name_or_path="m", dataset="d", output_dir="o", **keys)
            fake = types.SimpleNamespace(cfg=cfg, env=types.SimpleNamespace(device=torch.device("cpu")))
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                built[name] = FinetuneRecipe._ddp(fake, module)
    finally:
        dist.destroy_process_group()
    assert built["default"].forward_sync_buffers is False and built["asked"].forward_sync_buffers is True
    assert built["default"].bucket_bytes_cap == 25 * 1024 * 1024 and built["asked"].bucket_bytes_cap == 5 * 1024 * 1024
