"""FSDP2 for the recipe: a LoRA model whose frozen base weights are sharded across ranks, built so that no rank
ever holds the whole model, and the memory arithmetic that tells DDP and FSDP apart.

How :func:`build_sharded_lora_model` builds the model on every rank (the order matters)::

    config.json ──▶ model skeleton, parameters on the meta device (buffers real: rotary tables)
                ──▶ peft adds the LoRA layers (drawn on CPU, kept; base weights stay on meta)
                ──▶ fully_shard(each decoder layer), fully_shard(root)     parameters -> meta DTensors, Shard(0)
                ──▶ to_empty(device): each rank allocates its shard only; buffers put back
                ──▶ frozen weights: each rank reads its rows from the safetensors files (pread, no mmap)
                    LoRA weights: as peft draws them (:func:`add_lora_to_meta_model`: DDP's numbers)

Peak memory per rank at load is therefore its shard plus one tensor's rows, not the model (with
``cpu_offload`` the shards are allocated in host memory). On CUDA the frozen
weights are stored in the compute dtype (bf16/fp16), the LoRA weights in fp32, and a ``MixedPrecisionPolicy``
(params in bf16/fp16, gradients reduced in fp32) applies to every unit. ``hybrid_shard`` shards over the
processes of a node and replicates across nodes through a 2-D ``DeviceMesh`` (replicate, shard).

transformers and peft are imported inside functions (see :mod:`trainer.recipe`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from ferry.errors import ConfigError, TrainingError
from trainer.targets import PEFT_INFIXES, PEFT_PREFIX, VISION_NAMES

if TYPE_CHECKING:
    from peft import PeftModel
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

    from trainer.config import TrainConfig


#: The torch release FSDP2 here needs: ``fully_shard(reshard_after_forward=None)`` (the root keeps its gathered
#: weights for the backward, every other unit reshards), accepted from torch 2.8. Every other run needs 2.6
#: (pyproject.toml: ``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_``, transformers' own floor).
FSDP_TORCH = "2.8"


def require_fsdp_torch() -> None:
    """Refuse ``fsdp`` on a torch older than :data:`FSDP_TORCH` (the launcher's pre-flight and each worker).

    Raises:
        ConfigError: one line naming fsdp, the installed torch and the version needed.
    """
    from ferry.versions import require_version

    require_version("torch", FSDP_TORCH, "fsdp (FSDP2's fully_shard with reshard_after_forward=None)", ConfigError)


# ====================================================================== peft on a meta model


def add_lora_to_meta_model(model: torch.nn.Module, lora_config: Any) -> tuple[PeftModel, dict[str, torch.Tensor]]:
    """``peft.get_peft_model`` on a model whose parameters are on the meta device, keeping the LoRA weights
    peft draws: returns ``(peft_model, {name: initial value})`` with the base weights still on meta.

    peft puts new LoRA layers on the device of the base weight, so on a meta model its draws would be lost.
    For the call, every meta parameter is stood in for by a CPU tensor of the same shape and dtype that owns
    no memory (a zero-stride ``expand`` of one element); peft then draws and keeps the LoRA weights exactly as
    it does on a loaded model (same RNG stream, same order: DDP, FSDP and one process start from the same
    adapter), and the stand-ins are put back on meta afterwards (shared parameters stay shared).
    Trainable parameters that are not LoRA A/B weights (additional_target copies) are left out of the dict.

    Raises:
        ValueError: from peft, when the targets do not fit the model.
    """
    from trainer.peft_build import get_peft_model_checked

    meta_of: dict[int, tuple[torch.Size, torch.dtype]] = {}
    swapped: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in swapped:
                stand_in = torch.nn.Parameter(
                    torch.zeros((), dtype=param.dtype).expand(param.shape), requires_grad=param.requires_grad
                )
                swapped[id(param)] = stand_in
                meta_of[id(stand_in)] = (param.shape, param.dtype)
            module._parameters[key] = swapped[id(param)]
    peft_model = get_peft_model_checked(model, lora_config)
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    values = {
        name: param.detach().clone()
        for name, param in peft_model.named_parameters()
        if param.requires_grad and (".lora_A." in name or ".lora_B." in name)
    }
    back: dict[int, torch.nn.Parameter] = {}
    for module in peft_model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in meta_of:
                if id(param) not in back:
                    shape, dtype = meta_of[id(param)]
                    back[id(param)] = torch.nn.Parameter(
                        torch.empty(shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad
                    )  # peft froze it
                module._parameters[key] = back[id(param)]
    return peft_model, values


# ====================================================================== the mesh and the sharded model


def make_mesh(strategy: str, device: torch.device, world_size: int) -> DeviceMesh:
    """The device mesh of a strategy: 1-D over all ranks (``full_shard``, ``shard_grad_op``), or 2-D
    ``(replicate = nodes, shard = processes per node)`` for ``hybrid_shard*`` (torchrun's ``LOCAL_WORLD_SIZE``).

    Raises:
        ConfigError: hybrid sharding with nodes of unequal size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if strategy.startswith("hybrid_shard"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % local:
            raise ConfigError(
                f"fsdp: {strategy} needs the same number of processes on every node "
                f"(world size {world_size}, {local} on this node)"
            )
        return init_device_mesh(device.type, (world_size // local, local), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def decoder_layer_classes(model: PeftModel, configured: list[str] | None) -> set[str]:
    """Class names sharded as one unit each: ``fsdp_config.transformer_layer_cls_to_wrap`` or the model's
    ``_no_split_modules`` (transformers' name for its decoder layer).

    Raises:
        ConfigError: none of the names is a module of the model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(configured or getattr(base, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    if not names & present:
        raise ConfigError(
            f"fsdp_config.transformer_layer_cls_to_wrap: none of {sorted(names) or 'the model defaults'} is a "
            f"module of {type(base).__name__}; name its decoder layer class"
        )
    return names & present


def shard_model(model: PeftModel, cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, dtype: torch.dtype) -> int:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm and head form the root unit).

    ``reshard_after_forward`` per config for the layers (the root keeps its gathered weights for the backward,
    FSDP2's default); on CUDA a ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` when
    ``dtype`` is bf16/fp16, and ``CPUOffloadPolicy`` with ``cpu_offload``. Returns the number of units.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if (cfg.fsdp_cpu_offload and device.type == "cuda") else OffloadPolicy()
    classes = decoder_layer_classes(model, cfg.fsdp_config.transformer_layer_cls_to_wrap)
    # A vision tower's blocks stay in the root unit: a rank whose micro-batch holds no image skips the tower, and
    # blocks of their own would leave the other ranks waiting in their gathers (the root is gathered every step).
    units = [
        m
        for name, m in model.named_modules()
        if type(m).__name__ in classes and not set(name.split(".")) & set(VISION_NAMES)
    ]
    # Every layer reshards after its forward, the last one too: keeping the last layer gathered for the backward
    # (torchtitan's choice) saves one gather a step, but with activation checkpointing its recomputed forward
    # then trained other values than DDP here (tests/trainer/test_fsdp.py, torch 2.13).
    for unit in units:
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward, mp_policy=mp, offload_policy=offload
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=mp, offload_policy=offload)
    return len(units) + 1


#: safetensors dtype names (the format's header) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _CheckpointReader:
    """Rows of the base model's tensors from its safetensors files (one ``model.safetensors`` or an index).

    Reads with ``pread`` from the byte offsets of the safetensors header (8-byte little-endian length, a JSON
    header of ``dtype``, ``shape``, ``data_offsets`` per tensor, then the row-major data): only a rank's own
    rows are read, and nothing is memory-mapped, so the file's pages never count in the rank's resident set
    (safetensors' ``safe_open`` maps the whole file, and the kernel's fault-around maps neighbouring rows of
    the other ranks too).
    """

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({model_dir / v for v in weight_map.values()})
        elif (model_dir / "model.safetensors").is_file():
            files = [model_dir / "model.safetensors"]
        else:
            raise ConfigError(
                f"fsdp: {model_dir} holds no model.safetensors (or index); FSDP loading reads "
                f"safetensors only (convert .bin weights with transformers' save_pretrained)"
            )
        self.tensors: dict[str, tuple[Path, int, torch.dtype, list[int]]] = {}
        for path in files:
            with open(path, "rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(length))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ConfigError(
                        f"fsdp: {path}: tensor {key} has dtype {info['dtype']}, which FSDP loading does not read"
                    )
                self.tensors[key] = (
                    path,
                    8 + length + info["data_offsets"][0],
                    _SAFETENSORS_DTYPES[info["dtype"]],
                    info["shape"],
                )
        self._fds: dict[Path, int] = {}
        #: run-time name -> stored key where transformers renames on load (:func:`_stored_names`)
        self.stored_of: dict[str, str] = {}

    def key_for(self, name: str, prefix: str) -> str | None:
        """The checkpoint key of runtime parameter ``name`` (peft wrappers removed; renamed back as transformers
        renamed it on load; with or without the model's ``base_model_prefix``), or None."""
        key = name.removeprefix(PEFT_PREFIX)
        for infix in PEFT_INFIXES:
            key = key.replace(infix, "")
        if self.stored_of.get(key) in self.tensors:
            return self.stored_of[key]
        candidates = [key]
        if prefix and key.startswith(prefix + "."):
            candidates.append(key[len(prefix) + 1 :])
        elif prefix:
            candidates.append(f"{prefix}.{key}")
        return next((c for c in candidates if c in self.tensors), None)

    def read_rows(self, key: str, start: int, out: torch.Tensor) -> None:
        """Copy rows ``start .. start + len(out)`` of tensor ``key`` into ``out`` (any dtype: cast on copy).

        Raises:
            ConfigError: the stored shape does not match ``out``'s rows.
        """
        path, offset, dtype, shape = self.tensors[key]
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        if tuple(shape[1:]) != tuple(out.shape[1:]) or start + out.shape[0] > (shape[0] if shape else 1):
            raise ConfigError(
                f"fsdp: {path}: tensor {key} has shape {shape}, the model expects rows of {list(out.shape[1:])}"
            )
        item = torch.empty((), dtype=dtype).element_size()
        target = (
            out
            if (out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu")
            else torch.empty(out.shape, dtype=dtype)
        )
        # ndarray.data: a memoryview of the tensor's bytes (the same view as memoryview(ndarray))
        buffer = target.view(-1).view(torch.uint8).numpy().data if target.numel() else memoryview(b"")
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        want, done = len(buffer), 0
        while done < want:
            got = os.preadv(self._fds[path], [buffer[done:]], offset + start * row_numel * item + done)
            if got <= 0:
                raise ConfigError(f"fsdp: {path}: truncated file (tensor {key})")
            done += got
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def build_sharded_lora_model(
    cfg: TrainConfig,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    lora_config: Any,
    vocab: Any = None,
    images: bool = False,
) -> tuple[PeftModel, int, int]:
    """The peft LoRA model under FSDP2, loaded shard by shard (see the module docstring).

    Args:
        model_dir: local model folder with safetensors weights.
        device, dtype: where the shards live and the dtype of the frozen weights (LoRA stays fp32).
        mesh: from :func:`make_mesh`.
        lora_config: model -> ``peft.LoraConfig`` (:func:`trainer.targets.lora_config_for`).
        vocab: a :class:`trainer.vocab.VocabPlan` when the tokenizer gained tokens: the model is built with the
            grown vocabulary, the embeddings and head (or their new rows) are trained, new rows start at the stored
            rows' mean (:func:`trainer.vocab.read_param_rows`).
        images: the data has image rows (a vision-language family with a causal-LM class is built whole).

    Returns:
        ``(model, trainable_params, total_params)`` (counts of the full, unsharded model).

    Raises:
        ConfigError: the checkpoint lacks a tensor under the model's parameter name (transformers renames the
            keys of some families on load; FSDP loading does not), or LoRA targets do not fit.
    """
    model = _meta_model(cfg, model_dir, dtype=dtype, vocab=vocab, images=images)
    stored_of = _stored_names(model, model_dir)  # before peft wraps the modules
    if vocab is not None:  # resize_vocab / add_special_tokens: the embeddings (or their new rows) trained too
        from trainer.vocab import lora_config_with_embeddings

        lora_config = partial(lora_config_with_embeddings, lora_config, cfg, vocab)
    tied, embedding_names = _tied(model), _embedding_names(model)  # before peft wraps the embeddings
    peft_model, lora = _meta_lora_model(model, lora_config(model), model_dir, vocab=vocab)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    buffers = {name: buf.detach().clone() for name, buf in peft_model.named_buffers(remove_duplicate=False)}
    if any(b.is_meta for b in buffers.values()):
        raise TrainingError(f"fsdp: {type(model).__name__} creates buffers on the meta device; cannot shard it")

    if cfg.activation_checkpointing:
        enable_activation_checkpointing(peft_model)
    shard_model(peft_model, cfg, mesh, device, dtype)
    # With CPU offload the shards live in host memory (FSDP2 copies each unit to the GPU when it runs).
    offload = cfg.fsdp_cpu_offload and device.type == "cuda"
    peft_model.to_empty(device=torch.device("cpu") if offload else device)
    if tied and not _tied(model):
        raise TrainingError(f"fsdp: sharding untied the input and output embeddings of {type(model).__name__}")

    with torch.no_grad():
        for prefix_, module in peft_model.named_modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None:  # the values computed at construction, on the compute device
                    module._buffers[key] = buffers[f"{prefix_}.{key}" if prefix_ else key].to(device)
        _load_shards(
            peft_model,
            model_dir,
            lora=lora,
            prefix=getattr(model, "base_model_prefix", "") or "",
            vocab=vocab,
            embedding_names=embedding_names,
            tied=tied,
            stored_of=stored_of,
        )
    return peft_model, trainable, total


def _stored_names(model: PreTrainedModel, model_dir: Path) -> dict[str, str]:
    """Run-time parameter name -> checkpoint key, for the tensors transformers renames on load (Qwen2-VL's hub
    checkpoints store ``model.layers.*`` and ``visual.*``, loaded as ``model.language_model.layers.*`` and
    ``model.visual.*``): :func:`trainer.targets.renamed_on_load`, transformers' own renaming run forward over the stored
    keys. Fused conversions (MoE experts stored per expert) are not read here: their parameters stay unmapped and
    are refused by name."""
    from trainer.targets import renamed_on_load

    reader = _CheckpointReader(model_dir)
    try:
        stored = list(reader.tensors)
    finally:
        reader.close()
    try:
        return renamed_on_load(model, stored).stored_of
    except Exception:  # noqa: BLE001 - transformers cannot rename for this class: the names are read as stored
        return {}


def _meta_model(
    cfg: TrainConfig, model_dir: Path, *, dtype: torch.dtype, vocab: Any, images: bool = False
) -> PreTrainedModel:
    """The model skeleton from config.json (grown to the new vocabulary's size): parameters on the meta device in
    ``dtype``, buffers (rotary tables) computed, embeddings tied as ``from_pretrained`` ties them; the class of
    :func:`ferry.architecture.auto_model_class` (``images``: the data has image rows)."""
    from accelerate import init_empty_weights

    from ferry.architecture import auto_model_class
    from ferry.rope import base_config

    config = base_config(cfg, model_dir)  # rope_scaling applied
    if vocab is not None:  # resize_vocab / add_special_tokens (trainer/vocab.py)
        from trainer.vocab import grown_config

        grown_config(config, vocab)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary tables) computed
        model = auto_model_class(config, images).from_config(
            config,
            dtype=dtype,
            trust_remote_code=cfg.trust_remote_code,
            attn_implementation=cfg.attn_implementation,
        )
    model.config.use_cache = False
    model.tie_weights()  # from_config on meta leaves tied embeddings apart; from_pretrained ties them
    return model


def _meta_lora_model(
    model: PreTrainedModel, lora_config: Any, model_dir: Path, *, vocab: Any
) -> tuple[PeftModel, dict[str, torch.Tensor]]:
    """:func:`add_lora_to_meta_model`, refusing a LoRA variant whose trainable parameters FSDP loading cannot
    place (anything but LoRA A/B weights, ``additional_target`` copies and the new vocabulary rows).

    Raises:
        ConfigError: the LoRA config does not fit the model, or such a trainable parameter.
    """
    try:
        peft_model, lora = add_lora_to_meta_model(model, lora_config)
    except ValueError as exc:
        raise ConfigError(f"lora_target / additional_target do not fit {model_dir}: {exc}") from None
    unknown = [
        n
        for n, p in peft_model.named_parameters()
        if p.requires_grad
        and n not in lora
        and ".modules_to_save." not in n
        and not (vocab is not None and ".trainable_tokens_delta." in n)
    ]
    if unknown:
        raise ConfigError(
            f"fsdp: trainable parameter {unknown[0]} is neither a LoRA A/B weight nor an "
            f"additional_target copy; this LoRA variant is not supported with fsdp"
        )
    return peft_model, lora


def _load_shards(
    peft_model: torch.nn.Module,
    model_dir: Path,
    *,
    lora: dict[str, torch.Tensor],
    prefix: str,
    vocab: Any,
    embedding_names: tuple[str | None, str | None],
    tied: bool,
    stored_of: dict[str, str] | None = None,
) -> None:
    """Fill this rank's rows of every parameter: LoRA weights from ``lora`` (peft's draws), frozen weights read
    from the safetensors files (only this rank's rows), a grown embedding's new rows from the stored rows' mean.

    Raises:
        ConfigError: the checkpoint stores no tensor under a parameter's name.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    reader = _CheckpointReader(model_dir)
    reader.stored_of = stored_of or {}
    try:
        for name, param in peft_model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            else:
                shape, offset = tuple(param.shape), (0,) * param.ndim
            if local.numel() == 0:
                continue
            start, stop = offset[0], offset[0] + shape[0]
            if name in lora:
                local.copy_(lora[name][start:stop].reshape(local.shape))
                continue
            key = reader.key_for(name, prefix)
            if vocab is not None:  # a grown embedding or head: stored rows, then their mean
                from trainer.vocab import read_param_rows

                if read_param_rows(reader, name, key, prefix, start, local, vocab, embedding_names, tied):
                    continue
            if key is None:
                raise ConfigError(
                    f"fsdp: {model_dir} stores no tensor for parameter {name} (transformers renames the "
                    f"checkpoint keys of some model families on load; FSDP loading reads them as named)"
                )
            reader.read_rows(key, start, local)
    finally:
        reader.close()


def _embedding_names(model: PreTrainedModel) -> tuple[str | None, str | None]:
    """Module names of the input embeddings and the output head (None when absent)."""
    by_id = {id(m): n for n, m in model.named_modules()}
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return (by_id.get(id(emb)) if emb is not None else None), (by_id.get(id(head)) if head is not None else None)


def _tied(model: PreTrainedModel) -> bool:
    """Whether the output head shares its weight with the input embeddings (peft's modules_to_save wrappers: their
    original modules)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    head, emb = getattr(head, "original_module", head), getattr(emb, "original_module", emb)
    return head is not None and emb is not None and head.weight is emb.weight


def enable_activation_checkpointing(peft_model: PeftModel) -> bool:
    """transformers' gradient checkpointing (non-reentrant) on every decoder layer, inputs requiring grad.

    Returns False, changing nothing but printing one line on rank 0, for a model whose class says it does not
    support it (``supports_gradient_checkpointing``): the run trains the same, with more memory (LLaMA-Factory
    warns and goes on likewise)."""
    from trainer.peft_build import base_model_of

    kwargs = {"use_reentrant": False}
    base = base_model_of(peft_model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"ferry: gradient_checkpointing: {type(base).__name__} does not support it; training without "
                f"it (more activation memory, the same result)",
                file=sys.stderr,
            )
        return False
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.enable_input_require_grads()
    return True


def gathered_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, over every rank when they are DTensor shards (FSDP): each rank's
    partial sum of squares is all-reduced by ``full_tensor()``. Returns a plain fp32 scalar tensor."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


# ====================================================================== host memory on CPU

#: glibc ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (malloc.h).
_M_MMAP_THRESHOLD = -3
#: Blocks of at least this many bytes are mapped and unmapped on their own (see :class:`HostAllocator`).
CPU_MMAP_THRESHOLD = 1 << 20


class HostAllocator:
    """glibc's heap tuned for FSDP on CPU, where the unsharded weights are plain host allocations.

    FSDP gathers a decoder layer's weights before its forward and backward and frees them right after, twice
    a step, while the activations of the earlier layers stay allocated. With glibc's defaults (a *dynamic*
    mmap threshold that rises to the largest block freed, up to 32 MiB) the gathered weights land in the
    heap between activations, and the freed holes are kept by the process: the resident set grows by about
    a layer per step until it matches DDP's (measured: ``benchmarks/bench_fsdp.py``). Two calls fix that:

    - ``mallopt(M_MMAP_THRESHOLD, 1 MiB)`` at start: blocks of 1 MiB or more (gathered weights, activations)
      get their own mapping, which ``free`` returns to the kernel at once. Setting it also turns the dynamic
      threshold off (mallopt(3)).
    - ``malloc_trim(0)`` after each optimizer step: returns the free pages of the small-block heap.

    Mapping costs a page fault per page touched; the launcher therefore starts FSDP workers with glibc's
    ``glibc.malloc.hugetlb=1`` tunable (2 MiB pages for these mappings). Measured by ``benchmarks/bench_fsdp.py``
    (checkpointing case, 2 ranks): peak RSS 0.55x of DDP with both, 0.88x with an 8 MiB threshold, 1.0x with
    glibc's defaults; tokens/s 0.80x with the tunable, 0.44x without it.

    Nothing happens off glibc, on CUDA (the caching allocator owns device memory), or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable wins).
    """

    def __init__(self, device: torch.device) -> None:
        self._libc = None
        if device.type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return
        import ctypes
        import platform

        if platform.libc_ver()[0] != "glibc":
            return
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        if libc.mallopt(_M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD) == 1:
            self._libc = libc

    @property
    def active(self) -> bool:
        return self._libc is not None

    def trim(self) -> None:
        """Give the heap's free pages back to the kernel (``malloc_trim(0)``; milliseconds)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)


# ====================================================================== memory arithmetic (--dry-run)


@dataclass
class MemoryEstimate:
    """Bytes one rank holds during training, by kind (see :func:`estimate_memory`)."""

    mode: str
    weights: float
    gradients: float
    optimizer: float
    activations: float
    gathered: float  # FSDP: the unsharded weights of the units in flight (0 for DDP)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.gathered

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


class MemoryInputs(TypedDict):
    """The keyword arguments of :func:`estimate_memory` but ``world_size``, as :func:`model_memory_inputs` reads
    them from a model and a config."""

    frozen_params: int
    trainable_params: int
    frozen_bytes: int
    micro_batch: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    layer_params: int
    act_bytes: int
    checkpointing: bool
    optimizer_bytes_per_param: float
    logits_rows: int | None


def estimate_memory(
    *,
    frozen_params: int,
    trainable_params: int,
    frozen_bytes: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    layer_params: int,
    act_bytes: int,
    checkpointing: bool,
    optimizer_bytes_per_param: float = 8.0,
    logits_rows: int | None = None,
) -> dict[str, MemoryEstimate]:
    """Per-rank memory of DDP and FSDP (``full_shard``) at ``world_size`` ranks, in bytes.

    The model-state part is ZeRO's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
    Training Trillion Parameter Models", section 3.1), restricted to what LoRA trains:

    - weights: frozen ``frozen_params * frozen_bytes`` + trainable ``trainable_params * 4`` (fp32);
    - gradients: ``trainable_params * 4`` (only LoRA weights have gradients);
    - optimizer: ``trainable_params * optimizer_bytes_per_param``: AdamW's two fp32 moments, 8 (the default);
      0 for ``optim: sgd`` (torch.optim.SGD without momentum keeps no state);
    - DDP holds all of it on every rank; FSDP divides each term by ``world_size`` and adds the gathered
      (unsharded) weights of two units in flight (the current decoder layer and the prefetched next one):
      ``2 * layer_params * frozen_bytes``.

    Activations are Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", eq. 1: ``s * b * h * (34 + 5 * a * s / h)`` bytes per layer for 2-byte activations, scaled by
    ``act_bytes / 2``; with checkpointing only each layer's input is kept (``2 * s * b * h``, scaled alike)
    plus one layer recomputed. The logits add ``rows * vocab * 4`` twice (fp32 logits and their gradient), with
    ``rows = logits_rows`` when the loss is chunked (trainer/loss.py: one chunk's logits at a time) and the whole
    micro-batch ``b * s`` otherwise (None, the default). The same activations on both: data parallelism does not
    split a micro-batch.
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_layer = s * b * h * (34 + 5 * a * s / max(h, 1)) * act_bytes / 2
    if checkpointing:
        acts = layers * 2 * s * b * h * act_bytes / 2 + per_layer
    else:
        acts = layers * per_layer
    acts += 2 * min(b * s, b * s if logits_rows is None else logits_rows) * vocab * 4
    weights = frozen_params * frozen_bytes + trainable_params * 4
    grads, optim = trainable_params * 4.0, trainable_params * float(optimizer_bytes_per_param)
    ws = max(1, world_size)
    return {
        "ddp": MemoryEstimate("ddp", weights, grads, optim, acts, 0.0),
        "fsdp": MemoryEstimate(
            "fsdp", weights / ws, grads / ws, optim / ws, acts, 0.0 if ws == 1 else 2.0 * layer_params * frozen_bytes
        ),
    }


def device_budget(nproc_per_node: int) -> tuple[float, str]:
    """Memory one rank may use and what it is: the first visible GPU's total memory (bytes) when this process
    sees a GPU (:func:`trainer.gpus.visible_gpu_count`: torch's count after ``CUDA_VISIBLE_DEVICES``), or else
    the host's RAM (``/proc/meminfo`` MemTotal) divided by the processes on this node."""
    from trainer.gpus import visible_gpu_count

    if visible_gpu_count() > 0:
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name} memory"
    total = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = float(line.split()[1]) * 1024
    except OSError:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return total / max(1, nproc_per_node), f"RAM / {nproc_per_node} process(es)"


def model_memory_inputs(
    meta_model: PeftModel, cfg: TrainConfig, dtype_bytes: int, chunk_budget: int | None = None
) -> MemoryInputs:
    """The model-shape inputs of :func:`estimate_memory` from a meta-device peft model and the config.

    The loss is taken as chunked (one chunk of :func:`trainer.loss.chunk_tokens_for` rows of logits at a time,
    ``chunk_budget`` bytes of them: :func:`trainer.loss.chunk_budget_bytes` of the device; None: the CPU's)
    unless the config names a logit post-processing that makes the recipe fall back to the whole logits
    (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``: what :func:`trainer.loss.chunked_loss_ok`
    finds by probing); ``optim: sgd`` keeps no optimizer state."""
    from trainer.loss import chunk_tokens_for
    from trainer.peft_build import base_model_of

    base = base_model_of(meta_model) if hasattr(meta_model, "get_base_model") else meta_model
    conf = base.config
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    post_processed = any(
        getattr(text, key, None) not in (None, 1, 1.0)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )
    trainable = sum(p.numel() for p in meta_model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in meta_model.parameters() if not p.requires_grad)
    classes = set(getattr(base, "_no_split_modules", None) or [])
    layer_sizes = [sum(p.numel() for p in m.parameters()) for m in meta_model.modules() if type(m).__name__ in classes]
    return MemoryInputs(
        frozen_params=frozen,
        trainable_params=trainable,
        frozen_bytes=dtype_bytes,
        micro_batch=cfg.per_device_train_batch_size,
        seq_len=cfg.cutoff_len,
        hidden=int(getattr(text, "hidden_size", 0) or 0),
        layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        heads=int(getattr(text, "num_attention_heads", 0) or 1),
        vocab=vocab,
        layer_params=max(layer_sizes) if layer_sizes else 0,
        act_bytes=dtype_bytes,
        checkpointing=cfg.activation_checkpointing,
        optimizer_bytes_per_param=0.0 if cfg.optim == "sgd" else 8.0,
        logits_rows=None if post_processed else chunk_tokens_for(vocab, *([chunk_budget] if chunk_budget else [])),
    )


__all__ = [
    "FSDP_TORCH",
    "HostAllocator",
    "MemoryEstimate",
    "MemoryInputs",
    "add_lora_to_meta_model",
    "build_sharded_lora_model",
    "decoder_layer_classes",
    "device_budget",
    "enable_activation_checkpointing",
    "estimate_memory",
    "gathered_norm",
    "make_mesh",
    "model_memory_inputs",
    "require_fsdp_torch",
    "shard_model",
]
