"""QLoRA: LoRA over a 4-bit or 8-bit base, with LLaMA-Factory's keys, through bitsandbytes.

The base is loaded by transformers with a ``BitsAndBytesConfig`` built from the config
(:func:`bnb_config`): every ``nn.Linear`` except the output head becomes a ``bnb.nn.Linear4bit`` (NF4 / FP4 in
blocks of 64, optionally with double quantisation of the block scales) or a ``bnb.nn.Linear8bitLt`` (int8 rows
with one absmax scale per row), computing in the training dtype. Each rank loads its own full copy on its own
device (``device_map={"": device}``): ``device_map="auto"`` would make transformers spread the layers over all
GPUs of the host, and DDP would then run one model-parallel process in silence.

Unlike peft's ``prepare_model_for_kbit_training``, ferry does not cast every other frozen parameter to fp32
(norms and embeddings stay in the training dtype) unless ``upcast_layernorm`` asks for the norms; the LoRA
weights are fp32 as in every ferry run.

The trap this module covers (measured on this host, bitsandbytes 0.50.2): on a CPU with AVX512-BF16,
``Linear4bit.forward`` in eval mode repacks its weight for an inference kernel without autograd, so a model that
went through an evaluation pass would train on with no gradient flowing through its base layers.
:func:`disable_cpu_inference_repack` turns that path off on every 4-bit layer.

FSDP2 (:func:`build_sharded_quantized_lora_model`): 4-bit bases only, with the packed bytes stored as bfloat16
(the default under fsdp); uint8 storage under fsdp and 8-bit bases under fsdp are refused.

Refused in one line (:func:`check_config`): a quantisation method other than bnb, a pre-quantised base (GPTQ,
AWQ, AQLM, ... in config.json's ``quantization_config``), DoRA over a quantised base, and keys that need
``quantization_bit``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ferry.errors import ConfigError, TrainingError
from trainer.quant_keys import SUPPORTED_METHODS, check_config, quant_storage  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from peft import PeftModel

#: Bytes per weight of a quantised linear layer (packed data plus block scales): NF4/FP4 in blocks of 64 with an
#: fp32 absmax each (double quantisation: an 8-bit absmax plus an fp32 per 256 blocks), int8 with one fp32 per row
#: (the row term is left out: it is below 1 % for rows of 512 or more).
BYTES_PER_WEIGHT = {(4, False): 0.5 + 4 / 64, (4, True): 0.5 + (1 + 4 / 256) / 64, (8, False): 1.0, (8, True): 1.0}


def check_base(cfg: Any, model_dir: Path) -> None:
    """Refuse a base model that is already quantised (config.json ``quantization_config``: GPTQ, AWQ, AQLM, ...)
    whether or not ``quantization_bit`` is set: ferry trains and exports full-precision bases only.

    Raises:
        ConfigError: one line naming the method.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return
    try:
        quant = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError):
        return
    if isinstance(quant, dict) and quant:
        method = str(quant.get("quant_method") or quant.get("quantization_method") or "unknown")
        raise ConfigError(
            f"model_name_or_path: {cfg.model_name_or_path} is a pre-quantized {method.upper()} "
            f"model; ferry trains over full-precision bases only (quantization_bit: 4 or 8 "
            f"quantizes one with bitsandbytes on the fly)"
        )


def backend_problem() -> str | None:
    """Why bitsandbytes cannot run here (not installed, or its native library does not load), else None.
    Imports bitsandbytes (in the launcher: so that workers never start without it)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return (
            "quantization_bit needs the bitsandbytes package, which is not installed here (ferry pack "
            "--extra quantization carries it; or pip install 'llm-ferry[quantization]')"
        )
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        data, state = F.quantize_4bit(torch.ones(64, 64), quant_type="nf4")
        F.dequantize_4bit(data, state)
    except Exception as exc:  # noqa: BLE001 - a missing native library surfaces as any kind of error
        return f"bitsandbytes is installed but its native library does not work here: {type(exc).__name__}: {exc}"
    del bnb
    return None


#: The CUDA kernel check (:func:`cuda_backend_problem`), run by a fresh interpreter: bitsandbytes' layer of the
#: run's kind on ``cuda:0``, one forward of a tiny input. ``{bits}`` is 4 or 8.
_CUDA_PROBE = """
import sys
try:
    import torch
    import bitsandbytes as bnb

    if {bits} == 4:
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float16, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
    layer = layer.to("cuda:0")
    out = layer(torch.randn(2, 64, dtype=torch.float16, device="cuda:0"))
    torch.cuda.synchronize()
    assert out.shape == (2, 64) and bool(torch.isfinite(out).all()), "non-finite output"
except Exception as exc:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    print(f"{{type(exc).__name__}}: {{text}}"[:400], file=sys.stderr)
    sys.exit(1)
"""


def cuda_backend_problem(bits: int, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> str | None:
    """Why bitsandbytes' CUDA kernel of a ``bits``-bit layer (4: NF4 ``Linear4bit``, 8: LLM.int8 ``Linear8bitLt``)
    does not run on ``cuda:0``, as bitsandbytes (or torch) says it in one line, else None.

    Run in a fresh interpreter (``env``: its environment, default this one's), so that the launcher never creates
    a CUDA context of its own, which would hold memory on GPU 0 for the whole run; the CPU kernel passing
    (:func:`backend_problem`) says nothing of the CUDA library, which a wrong CUDA build or a missing
    ``libbitsandbytes_cuda*.so`` breaks alone.
    """
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CUDA_PROBE.format(bits=int(bits))],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return f"a {bits}-bit layer did not run on cuda:0 within {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"the check exited with code {proc.returncode}"


def preflight(cfg: Any, model_dir: Path) -> None:
    """The launcher's checks before workers start: a pre-quantised base is refused and, with
    ``quantization_bit`` (or stage dpo's ``ref_model_quantization_bit``), the bitsandbytes backend must import
    and run: its CPU kernel here, and, when this host shows a GPU (:func:`trainer.gpus.visible_gpu_count`; the
    workers then train on CUDA), its CUDA kernel too (:func:`cuda_backend_problem`).

    Raises:
        ConfigError: one line.
    """
    check_base(cfg, model_dir)
    for key in ("quantization_bit", "ref_model_quantization_bit"):  # the policy's base, stage dpo's ref_model
        bits = getattr(cfg, key, None)
        if bits is None:
            continue
        problem = backend_problem()
        if problem:
            raise ConfigError(f"{key}: {problem}")
        from trainer.gpus import visible_gpu_count

        if visible_gpu_count() > 0:
            problem = cuda_backend_problem(bits)
            if problem:
                raise ConfigError(
                    f"{key}: bitsandbytes' CUDA kernel does not run on cuda:0 here, so every worker would "
                    f"fail: {problem} (install the bitsandbytes build for this CUDA version)"
                )
            break  # one kernel check per launch


def bnb_config(cfg: Any, dtype: torch.dtype) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``cfg`` with compute dtype ``dtype`` (the training dtype)."""
    from transformers import BitsAndBytesConfig

    if cfg.quantization_bit == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_type=cfg.quantization_type,
        bnb_4bit_use_double_quant=cfg.double_quantization,
        bnb_4bit_quant_storage=getattr(torch, quant_storage(cfg)),
    )


def disable_cpu_inference_repack(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU inference repack on every ``Linear4bit`` (see the module docstring); returns
    how many layers were changed."""
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def device_map_for(device: torch.device) -> dict[str, int | str]:
    """transformers' ``device_map`` that puts the whole model on this rank's ``device`` alone: ``{"": index}`` for
    ``cuda:index`` (each DDP / FSDP rank its own GPU), ``{"": "cpu"}`` on CPU. Never ``"auto"``, which spreads the
    layers over every GPU of the host and turns DDP into one model-parallel process without a word.

    Raises:
        TrainingError: a CUDA device without an index (the rank's ``LOCAL_RANK`` was not applied).
    """
    if device.type == "cuda":
        if device.index is None:
            raise TrainingError("a quantized base needs the rank's own device (cuda:LOCAL_RANK), not plain cuda")
        return {"": device.index}
    return {"": device.type}


def load_quantized_model(
    cfg: Any, model_dir: Path, *, device: torch.device, dtype: torch.dtype, config: Any = None, auto: Any = None
) -> Any:
    """The base model of ``model_dir`` (built from ``config``, by default :func:`ferry.rope.base_config`)
    with its linear layers quantised per ``cfg``, on ``device`` alone.

    Non-quantised parameters stay in ``dtype``; with ``upcast_layernorm`` the norm weights become fp32. Gradient
    checkpointing needs the embedding output to require grad (the base is frozen): the input-embedding hook of
    transformers is enabled here. ``auto``: the transformers auto class (default
    :func:`ferry.architecture.auto_model_class` of the config).
    """
    from ferry.architecture import auto_model_class
    from ferry.rope import base_config

    config = config if config is not None else base_config(cfg, model_dir)  # rope_scaling applied
    model = (auto or auto_model_class(config)).from_pretrained(
        model_dir,
        config=config,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
        quantization_config=bnb_config(cfg, dtype),
        device_map=device_map_for(device),
    )
    disable_cpu_inference_repack(model)
    for param in model.parameters():
        param.requires_grad_(False)
    if cfg.upcast_layernorm:
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name and param.dtype != torch.float32:
                param.data = param.data.float()
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def quantized_weight_bytes(meta_model: PeftModel, cfg: Any, dtype_bytes: int) -> int:
    """Bytes of the frozen base weights once loaded per ``cfg``: every ``nn.Linear`` except the output head
    (what transformers quantises) at :data:`BYTES_PER_WEIGHT`, the rest at ``dtype_bytes``. For ``--dry-run``."""
    from trainer.peft_build import base_model_of

    base = base_model_of(meta_model) if hasattr(meta_model, "get_base_model") else meta_model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    quantized: set[int] = set()
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head and not name.endswith("lm_head"):
            if getattr(module, "weight", None) is not None and not module.weight.requires_grad:
                quantized.add(id(module.weight))
    per = BYTES_PER_WEIGHT[(cfg.quantization_bit, bool(cfg.double_quantization))]
    total = 0.0
    for param in meta_model.parameters():
        if param.requires_grad:
            continue
        total += param.numel() * (per if id(param) in quantized else dtype_bytes)
    return int(total)


def quantization_record(cfg: Any, dtype: torch.dtype, device: torch.device | None = None) -> dict[str, Any]:
    """What ``adapter/ferry_quantization.json`` holds: bits, method, type, double quantisation, storage and the
    compute dtype the adapter was trained over, bitsandbytes' version, the device type it trained on (``cuda`` /
    ``cpu``; None when not given) and, for 8-bit, LLM.int8's outlier threshold (``llm_int8_threshold``: on CUDA,
    input columns with a value above it are multiplied in 16-bit and the rest in int8, which no dequantised
    weight reproduces; :func:`exporter.quant.check_merge_into` reads it)."""
    import bitsandbytes

    threshold = float(bnb_config(cfg, dtype).llm_int8_threshold) if cfg.quantization_bit == 8 else None
    return {
        "quantization_bit": cfg.quantization_bit,
        "quantization_method": cfg.quantization_method,
        "quantization_type": cfg.quantization_type if cfg.quantization_bit == 4 else "int8",
        "double_quantization": bool(cfg.double_quantization) if cfg.quantization_bit == 4 else False,
        "bnb_4bit_quant_storage": quant_storage(cfg),
        "compute_dtype": str(dtype).removeprefix("torch."),
        "blocksize": 64 if cfg.quantization_bit == 4 else None,
        "bitsandbytes_version": bitsandbytes.__version__,
        "device": device.type if device is not None else None,
        "llm_int8_threshold": threshold,
    }


def quant_dequant(weight: torch.Tensor, record: dict[str, Any]) -> torch.Tensor:
    """``dequant(quant(W))`` of a 2-D weight ``[out, in]`` as bitsandbytes computes it when transformers loads
    the base per ``record``: NF4/FP4 in blocks of 64 along the flattened weight (double quantisation of the
    absmax values when recorded), or int8 per row with absmax scaling. Quantised from the weight cast to the
    recorded compute dtype, as transformers does on load; returned in fp32."""
    import bitsandbytes.functional as F

    compute = getattr(torch, record.get("compute_dtype") or "float32")
    w = weight.to(compute).contiguous()
    if record["quantization_bit"] == 4:
        storage = getattr(torch, record.get("bnb_4bit_quant_storage") or "uint8")
        data, state = F.quantize_4bit(
            w,
            blocksize=record.get("blocksize") or 64,
            compress_statistics=bool(record.get("double_quantization")),
            quant_type=record["quantization_type"],
            quant_storage=storage,
        )
        return F.dequantize_4bit(data, state).float()
    cb, scb, _ = F.int8_vectorwise_quant(w.half())
    return F.int8_vectorwise_dequant(cb, scb).float()


__all__ = [
    "BYTES_PER_WEIGHT",
    "SUPPORTED_METHODS",
    "backend_problem",
    "bnb_config",
    "check_base",
    "check_config",
    "cuda_backend_problem",
    "device_map_for",
    "disable_cpu_inference_repack",
    "load_quantized_model",
    "preflight",
    "quant_dequant",
    "quantization_record",
    "quantized_weight_bytes",
]


def build_sharded_quantized_lora_model(
    cfg: Any,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mesh: Any,
    lora_config: Any,
) -> tuple[PeftModel, int, int]:
    """FSDP2 over a 4-bit base: every rank loads the 4-bit model (1/8 of the fp32 bytes) with its packed weights
    stored as ``bnb_4bit_quant_storage`` (bfloat16: FSDP2 shards and all-gathers floating-point storage only;
    the NF4 bytes travel bit for bit, their quant state stays on each module), adds LoRA as the DDP path does (the
    same draws, so the same initial adapter), then shards each decoder layer and the root
    (:func:`trainer.fsdp.shard_model`). Returns ``(model, trainable_params, total_params)`` before sharding.
    """
    from trainer.fsdp import enable_activation_checkpointing, shard_model
    from trainer.peft_build import get_peft_model_checked

    model = load_quantized_model(cfg, model_dir, device=device, dtype=dtype)
    model.config.use_cache = False
    peft_model = get_peft_model_checked(model, lora_config(model))
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(peft_model)
    shard_model(peft_model, cfg, mesh, device, dtype)
    return peft_model, trainable, total
