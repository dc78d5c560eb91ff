"""Reading a PEFT LoRA adapter folder, and finding the base model it names (offline).

``adapter_config.json`` + ``adapter_model.safetensors`` (peft ``save_pretrained``) become an :class:`Adapter`:
LoRA factors per adapted module (run-time module names, peft's ``base_model.model.`` prefix removed),
``modules_to_save`` replacements and saved base layers, each layer's scaling from ``r`` / ``lora_alpha`` /
``rank_pattern`` / ``alpha_pattern`` / ``use_rslora``. No model is built here; :mod:`exporter.export` maps the
names onto the base's stored tensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exporter.io import load_file, sha256_file
from exporter.lora import lora_scaling, pattern_value
from ferry.adapter_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config
from ferry.errors import ConfigError, ExportError

#: The weight files peft writes, safetensors first (``adapter_model.bin``: pickle, read only when allowed).
ADAPTER_WEIGHT_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin")

#: Adapter weight-name suffixes that carry a LoRA factor (peft ``save_pretrained`` names, adapter name removed).
_LORA_SUFFIXES = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_B.bias": "B_bias",
    ".lora_embedding_A": "A",
    ".lora_embedding_B": "B",
    ".lora_magnitude_vector": "magnitude",
    ".lora_magnitude_vector.weight": "magnitude",
}


@dataclass
class LoraModule:
    """One adapted layer: its module name in the model (``model.layers.0.self_attn.q_proj``) and factors."""

    name: str
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    B_bias: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None
    embedding: bool = False
    scaling: float = 1.0
    fan_in_fan_out: bool = False
    #: peft ``target_parameters`` on a fused 3-D expert parameter ``[E, ...]``: A is ``[r·E, in]``, B ``[out, r·E]``
    num_experts: int = 1
    #: the run-time parameter this LoRA changes (``...experts.gate_up_proj``), set by export for target_parameters
    parameter: str | None = None
    #: the 3-D parameter is stored ``[E, out, in]`` (peft's ``_did_swap_in_out_features``)
    out_first: bool = True

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)``: ``[r, in]`` and ``[out, r]`` (``[r·E, in]``, ``[out, r·E]`` for fused experts).

        Raises:
            ExportError: a factor is missing (:func:`load_adapter` refuses such adapters, so only a module built
                by hand gets here).
        """
        if self.A is None or self.B is None:
            raise ExportError(f"adapter layer {self.name!r} lacks lora_{'A' if self.A is None else 'B'}")
        return self.A, self.B

    def bias_update(self) -> torch.Tensor:
        """``lora_B.bias`` ``[out]``.

        Raises:
            ExportError: the layer has no LoRA bias.
        """
        if self.B_bias is None:
            raise ExportError(f"adapter layer {self.name!r} has no lora_B bias")
        return self.B_bias


@dataclass
class Adapter:
    """A PEFT LoRA adapter folder, parsed.

    ``modules``: LoRA layers by module name; ``replacements``: full tensors that replace base tensors (peft's
    ``modules_to_save``); ``base_overrides``: base weights saved with the adapter (``*.base_layer.weight``, peft's
    ``save_embedding_layers``), which the LoRA update is added to. Both keyed by tensor name *as the model names
    it*.
    """

    folder: Path
    config: dict[str, Any]
    weights_file: Path
    sha256: str
    modules: dict[str, LoraModule]
    replacements: dict[str, torch.Tensor]
    base_overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    #: peft ``trainable_token_indices``: module name -> (row indices, their new values ``[len(indices), hidden]``),
    #: rows that replace the weight's rows (peft ``TrainableTokensLayer.merge``: ``index_copy``)
    token_rows: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)


def _strip_prefix(key: str) -> str:
    for prefix in ("base_model.model.", "base_model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _read_config(folder: Path) -> dict[str, Any]:
    """``adapter_config.json`` of a LoRA adapter the exporter can merge (read by
    :func:`ferry.adapter_folder.read_adapter_config`).

    Raises:
        ExportError: missing, invalid JSON or not an object, not LoRA, or layer replication / aLoRA.
    """
    config_path = folder / ADAPTER_CONFIG
    try:
        config = read_adapter_config(folder)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    if config is None:
        raise ExportError(f"{folder} is not a PEFT adapter folder: {ADAPTER_CONFIG} is missing")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ExportError(f"{config_path}: peft_type is {config.get('peft_type')!r}; only LORA adapters can be merged")
    for key in ("layer_replication", "alora_invocation_tokens"):
        if config.get(key):
            raise ExportError(f"{config_path}: {key} is set; merging such adapters is not supported")
    return config


def _sort_tensors(
    state: dict[str, torch.Tensor], config: dict[str, Any], config_path: Path, weights: Path
) -> tuple[
    dict[str, LoraModule], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, tuple[list[int], torch.Tensor]]
]:
    """The adapter's tensors by kind: LoRA factors per module, ``modules_to_save`` replacements, saved base layers
    and trainable-token rows (the fields of :class:`Adapter`), named as the model names them.

    Raises:
        ExportError: a LoRA kind the exporter cannot merge, or token rows that do not match their indices.
    """
    modules: dict[str, LoraModule] = {}
    replacements: dict[str, torch.Tensor] = {}
    base_overrides: dict[str, torch.Tensor] = {}
    token_rows: dict[str, tuple[list[int], torch.Tensor]] = {}
    for raw_key, tensor in state.items():
        key = _strip_prefix(raw_key)
        if key.endswith(_TOKEN_DELTA):
            name = key.removesuffix(_TOKEN_DELTA)
            token_rows[name] = (_token_indices(config, name, config_path), tensor)
            if tensor.ndim != 2 or tensor.shape[0] != len(token_rows[name][0]):
                raise ExportError(
                    f"{weights}: {raw_key!r} has shape {list(tensor.shape)} for "
                    f"{len(token_rows[name][0])} trainable token indices"
                )
            continue
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is not None:
            name = key[: -len(suffix)]
            module = modules.setdefault(name, LoraModule(name))
            setattr(module, _LORA_SUFFIXES[suffix], tensor)
            module.embedding = module.embedding or "lora_embedding" in suffix
        elif ".lora_" in key or "trainable_tokens" in key:
            raise ExportError(f"{weights}: tensor {raw_key!r} is of a LoRA kind the exporter cannot merge")
        elif ".base_layer." in key:
            base_overrides[key.replace(".base_layer.", ".")] = tensor
        else:
            replacements[key.replace(".modules_to_save.default.", ".").replace(".original_module.", ".")] = tensor
    return modules, replacements, base_overrides, token_rows


def _set_scaling(modules: dict[str, LoraModule], config: dict[str, Any], weights: Path) -> None:
    """Each layer's rank check and scaling from ``r`` / ``lora_alpha`` / ``rank_pattern`` / ``alpha_pattern`` /
    ``use_rslora``, and its fan_in_fan_out as peft decides it for embeddings.

    Raises:
        ExportError: a layer with only one of A / B, or a rank that disagrees with the config.
    """
    r_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    for module in modules.values():
        if module.A is None or module.B is None:
            raise ExportError(f"{weights}: layer {module.name!r} has only one of lora_A / lora_B")
        r = int(pattern_value(rank_pattern, module.name, r_default))
        if config.get("target_parameters") and module.A.shape[0] != r:
            module.num_experts = 0  # perhaps LoRA on a fused-expert parameter: export checks it against the model
        elif module.A.shape[0] != r:
            raise ExportError(
                f"{weights}: layer {module.name!r} has rank {module.A.shape[0]} but {ADAPTER_CONFIG} says r={r}"
            )
        alpha = float(pattern_value(alpha_pattern, module.name, alpha_default))
        module.scaling = lora_scaling(alpha, r, use_rslora=bool(config.get("use_rslora")))
        # peft's rule: an embedding is always fan_in_fan_out; a Conv1D always, an nn.Linear never, whatever the
        # config's fan_in_fan_out says (peft overrides it with a warning). Conv1D layers are marked by export.
        module.fan_in_fan_out = module.embedding


def load_adapter(folder: str | os.PathLike, *, allow_pickle: bool = False) -> Adapter:
    """Read a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Scaling per layer is ``lora_alpha / r`` or ``lora_alpha / √r`` (``use_rslora``), with ``rank_pattern`` and
    ``alpha_pattern`` applied per module as peft does. Tensors keep the dtype they are stored in.

    Raises:
        ExportError: not a LoRA adapter, a missing/invalid file, an incomplete A/B pair, a rank that disagrees with
            the config, a tensor with NaN/inf, or LoRA features the exporter cannot merge (e.g. layer replication).
        SourceError: only a pickle ``adapter_model.bin`` and ``allow_pickle`` is False.
    """
    folder = Path(folder)
    config = _read_config(folder)
    weights = next((folder / n for n in ADAPTER_WEIGHT_FILES if (folder / n).is_file()), None)
    if weights is None:
        raise ExportError(f"{folder} has no adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES)})")
    state = load_file(weights, allow_pickle=allow_pickle)
    modules, replacements, base_overrides, token_rows = _sort_tensors(state, config, folder / ADAPTER_CONFIG, weights)
    for raw_key, tensor in state.items():
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"{weights}: tensor {raw_key!r} contains NaN/inf: the adapter is broken")
    _set_scaling(modules, config, weights)
    return Adapter(folder, config, weights, sha256_file(weights), modules, replacements, base_overrides, token_rows)


_TOKEN_DELTA = ".token_adapter.trainable_tokens_delta"


def _token_indices(config: dict[str, Any], module: str, config_path: Path) -> list[int]:
    """The ``trainable_token_indices`` of ``module``: a list applies to the input embeddings (peft's default
    ``embed_tokens``), a dict maps module names (matched at the end of the name, at a dot boundary) to lists.

    Raises:
        ExportError: no indices for the module in the config.
    """
    spec = config.get("trainable_token_indices")
    if isinstance(spec, list):
        spec = {"embed_tokens": spec}
    for name, indices in (spec or {}).items():
        if (module == name or module.endswith("." + name)) and isinstance(indices, list):
            return [int(i) for i in indices]
    raise ExportError(
        f"{config_path}: trainable_token_indices names no indices for {module!r}, whose trained rows the adapter holds"
    )


def _resolve_base(adapter: Adapter, base: str | os.PathLike | None) -> tuple[Path, str | None, str | None]:
    """(local folder, repo_id or path as named, revision) of the base model, resolved offline."""
    from ferry.hub import resolve_model

    revision = None
    if base is None:
        base = adapter.config.get("base_model_name_or_path")
        revision = adapter.config.get("revision") or None
        if not base:
            raise ExportError(f"{adapter.folder / ADAPTER_CONFIG} has no base_model_name_or_path; pass --base MODEL")
        if not Path(str(base)).expanduser().is_dir() and not Path(str(base)).is_absolute():
            relative = adapter.folder / str(base)
            if relative.is_dir():  # a path relative to the adapter folder
                base = relative
    folder = resolve_model(base, revision=revision)
    commit = revision
    if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
        commit = folder.name  # an HF cache snapshot folder is named by its commit
    return folder, str(base), commit


__all__ = ["ADAPTER_WEIGHT_FILES", "Adapter", "LoraModule", "load_adapter"]
