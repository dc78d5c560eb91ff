"""The base model's on-disk layout against its run-time module names, learned from transformers itself.

transformers 5 renames and reshapes checkpoint tensors on load (``transformers.conversion_mapping``: a list of
``WeightRenaming`` / ``WeightConverter`` per model class or ``model_type``) and reverses them on save. A peft adapter
names the *run-time* modules, while the base folder stores the *hub's* names and shapes. Examples (transformers 5.23):

=================  ===========================================  =============================================
family             stored in the checkpoint                      named at run time (and by the adapter)
=================  ===========================================  =============================================
GPT-2 (hub)        ``h.0.attn.c_attn.weight``                    ``transformer.h.0.attn.c_attn.weight``
Gemma-3 VLM        ``language_model.model.layers.0...``          ``model.language_model.layers.0...``
Qwen3.5            ``model.language_model.layers.0...``          ``model.layers.0...``
Qwen3-MoE, Mixtral ``...experts.3.gate_proj.weight`` (2-D each)  ``...experts.gate_up_proj`` ``[E, 2I, H]``
=================  ===========================================  =============================================

:func:`key_map` instantiates the architecture on the meta device (no memory, no weights), asks transformers for
its conversion list (``get_model_conversion_mapping``) and renames every stored key forward exactly as
``from_pretrained`` does (``rename_source_key`` with the base-model prefix rule). The result maps run-time names to
stored names for one-to-one tensors, and run-time fused parameters to the group of stored tensors they are built
from. :meth:`KeyMap.split_delta` goes the other way for a fused parameter's update, through transformers' own
reversed converter (``WeightTransform.reverse_transform``: e.g. ``Concatenate`` becomes ``Chunk``,
``MergeModulelist`` becomes ``SplitModulelist``). Every operation a converter performs on experts is linear
(concatenate, split, stack, transpose), so it applies to an update exactly as to a weight. No table of renames is
kept here.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ferry.errors import ExportError

#: The transformers release whose ``core_model_loading`` has ``apply_converters`` / ``apply_renamings``, which
#: :meth:`KeyMap.split_delta` reverses a fused parameter's conversion with (transformers 5.21).
FUSED_TRANSFORMERS = "5.21"


def require_fused_conversion(runtime_name: str) -> None:
    """Refuse to merge into the fused parameter ``runtime_name`` (MoE experts stored per expert, fused on load) on a
    transformers older than :data:`FUSED_TRANSFORMERS`; checked while planning, before anything is written.

    Raises:
        ExportError: one line naming the feature, the installed transformers and the version needed.
    """
    from ferry.versions import require_version

    feature = f"merging into the fused experts {runtime_name!r} (reversing transformers' conversion)"
    require_version("transformers", FUSED_TRANSFORMERS, feature, ExportError)


@dataclass
class KeyMap:
    """Stored (checkpoint) tensor names against run-time parameter names.

    ``stored_of``: run-time name -> stored name, for tensors loaded one to one (renamed or not).
    ``groups``: run-time name of a fused parameter -> the stored names it is built from (e.g. every expert's
    ``gate_proj`` and ``up_proj``). ``model``: the meta-device model (for the converters' ``config``).
    """

    stored_of: dict[str, str] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    converters: list[Any] = field(default_factory=list)
    renamings: list[Any] = field(default_factory=list)
    model: Any = None
    #: the model's ``PretrainedConfig`` (some converters read it, e.g. a chunk count)
    config: Any = None
    #: fused parameters whose orientation the conversion fixes: built from 2-D ``[out, in]`` weights (``nn.Linear``)
    #: by stacking and concatenating only, which keep each axis in place, so they are ``[E, out, in]``
    out_first: dict[str, bool] = field(default_factory=dict)

    def split_delta(self, runtime_name: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split the update of fused parameter ``runtime_name`` (its run-time shape, float32) into updates of the
        stored tensors it is built from, with transformers' reversed converter. Returns ``{stored name: update}``,
        each of that stored tensor's shape.

        Raises:
            ExportError: the reversed conversion does not give exactly the group's stored tensors.
        """
        from transformers.core_model_loading import WeightConverter, apply_converters, apply_renamings

        group = self.groups[runtime_name]
        reverse = [c.reverse_transform() for c in self.converters[::-1]]
        renamings = [c.reverse_transform() for c in self.renamings[::-1]]
        converters = [c for c in reverse if isinstance(c, WeightConverter)]
        renamed, pattern = apply_converters(runtime_name, converters)
        if pattern is None:
            raise ExportError(f"transformers has no reverse conversion for fused parameter {runtime_name!r}")
        converter = deepcopy(next(c for c in converters if pattern in c.source_patterns))
        # transformers annotates the value as a Future (its lazy loader's); an eager tensor is what convert() reads
        converter.add_tensor(renamed, runtime_name, pattern, delta)  # type: ignore[arg-type]
        parts = converter.convert(renamed, model=self.model, config=self.config)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in parts.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            name = apply_renamings(name, renamings)
            match = (
                name
                if name in group
                else next((g for g in group if g.endswith("." + name) or name.endswith("." + g)), None)
            )
            if match is None or match in out:
                raise ExportError(
                    f"reversing transformers' conversion of {runtime_name!r} gave {name!r}, which is "
                    f"not one of its stored tensors ({', '.join(group[:3])}, ...)"
                )
            out[match] = tensor
        if set(out) != set(group):
            missing = sorted(set(group) - set(out))
            raise ExportError(
                f"reversing transformers' conversion of {runtime_name!r} left stored tensors without "
                f"an update: {', '.join(missing[:3])}"
            )
        return out


def meta_model(base_dir: Path, trust_remote_code: bool) -> Any:
    """The architecture ferry trains for ``base_dir`` (:func:`ferry.architecture.auto_model_class`:
    ``AutoModelForCausalLM``, or the whole vision-language model for a family without a causal-LM class), on the
    meta device: no memory, no weights.

    Raises:
        ExportError: the config needs ``trust_remote_code``, or transformers cannot build it.
    """
    from transformers import AutoConfig

    from ferry.architecture import auto_model_class

    try:
        config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            return auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise ExportError(
                f"{base_dir} contains custom code (config.json auto_map): pass --trust-remote-code if you trust it"
            ) from None
        raise ExportError(
            f"{base_dir}: transformers cannot build the architecture to learn its layout ({exc})"
        ) from None
    except PermissionError as exc:
        raise ExportError(
            f"{base_dir}: {exc.filename or exc} is not writable (the model's code is copied to the HF "
            f"modules cache; set HF_MODULES_CACHE to a writable folder)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any failure to build the architecture
        raise ExportError(
            f"{base_dir}: transformers cannot build the architecture to learn its layout ({exc})"
        ) from None


def key_map(model: Any, stored: list[str]) -> KeyMap:
    """Rename every stored tensor name as ``from_pretrained`` does for ``model`` (a meta-device model).

    Args:
        model: from :func:`meta_model`.
        stored: the checkpoint's tensor names.

    Returns:
        A :class:`KeyMap`. Stored names that map to no run-time parameter (buffers, unused tensors) are left out.
    """
    from trainer.targets import renamed_on_load

    renamed = renamed_on_load(model, stored)
    return KeyMap(
        stored_of=renamed.stored_of,
        groups=renamed.groups,
        converters=renamed.converters,
        renamings=renamed.renamings,
        model=model,
        config=model.config,
        shapes=renamed.shapes,
    )


def config_key_map(base_dir: Path, raw_config: dict[str, Any], stored: dict[str, Any]) -> KeyMap | None:
    """:func:`key_map` without building the model, for a plain causal LM (the common case of MoE bases).

    Importing an architecture's modeling code costs seconds and tens of MB (transformers' activations pull in
    torch.compile's machinery); the conversion list of a plain ``XForCausalLM`` does not need it.
    ``get_model_conversion_mapping`` walks the model's ``PreTrainedModel`` sub-modules and takes, for each, the
    mapping registered for its class name, else for its ``model_type``. A plain causal LM has two such
    sub-modules, ``XForCausalLM`` (config.json ``architectures``, the class ``AutoModelForCausalLM`` builds for a
    config without sub-configs) and its base model ``XModel`` (same config), so the list is the one registered
    for ``XForCausalLM``, else for ``model_type``, plus transformers' ``legacy`` renamings, exactly as
    ``from_pretrained`` builds it (a class mapping registered for ``XModel`` / ``XTextModel`` sends the
    question to the model). Run-time names are the stored names renamed forward by transformers'
    ``rename_source_key``; a fused parameter's shape follows from the stored shapes and the converter's
    operations (:func:`_stack_concat_shape`). No table of renames is kept here.

    Args:
        base_dir: the base model folder (its config is read by ``AutoConfig`` for the converters).
        raw_config: its config.json.
        stored: the checkpoint's ``{name: TensorInfo}``.

    Returns:
        A :class:`KeyMap` with ``model=None``, or None when the model's class tree is needed to know the mapping
        (remote code, a composite config such as a vision-language model, not a ``...ForCausalLM``, a base-model
        class with a mapping of its own) or a converter does more than stack and concatenate: then use
        :func:`meta_model` and :func:`key_map`.
    """
    model_type = raw_config.get("model_type")
    archs = raw_config.get("architectures") or []
    if (
        raw_config.get("auto_map")
        or not isinstance(model_type, str)
        or len(archs) != 1
        or not str(archs[0]).endswith("ForCausalLM")
        or any(isinstance(v, dict) and "model_type" in v for v in raw_config.values())
    ):
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    arch = str(archs[0])
    stem = arch.removesuffix("ForCausalLM")
    if any(get_checkpoint_conversion_mapping(name) is not None for name in (f"{stem}Model", f"{stem}TextModel")):
        return None
    conversions = get_checkpoint_conversion_mapping(arch)
    if conversions is None:
        conversions = get_checkpoint_conversion_mapping(model_type) or []
    conversions += get_checkpoint_conversion_mapping("legacy") or []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    result = KeyMap(converters=converters, renamings=renamings)
    members: dict[str, list[tuple[str, str]]] = {}
    for key, info in stored.items():
        runtime, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            result.stored_of[runtime] = key
            result.shapes[runtime] = tuple(info.shape)
        else:
            members.setdefault(runtime, []).append((key, pattern))
    if any(getattr(op, "num_shards_attribute", None) for c in converters for op in c.operations):
        from transformers import AutoConfig  # a converter reads the config (its reverse splits by a config count)

        try:
            result.config = AutoConfig.from_pretrained(base_dir, local_files_only=True)
        except Exception:  # noqa: BLE001 - a config transformers cannot read: learn the layout from the model
            return None
    if members:
        for runtime, keys in members.items():
            converter = next(c for c in converters if keys[0][1] in c.source_patterns)
            shape = _stack_concat_shape(converter, [(stored[k].shape, p) for k, p in keys])
            if shape is None:
                return None
            result.shapes[runtime] = shape
            result.groups[runtime] = [key for key, _ in keys]
            if all(len(stored[key].shape) == 2 and key.endswith(".weight") for key, _ in keys):
                result.out_first[runtime] = True
    return result


def _stack_concat_shape(converter: Any, members: list[tuple[tuple[int, ...], str]]) -> tuple[int, ...] | None:
    """The shape of the parameter ``converter`` builds from ``members`` (stored shape, matched source pattern), for
    converters made of transformers' ``MergeModulelist`` (stack the tensors of each source pattern along ``dim``)
    and ``Concatenate`` (concatenate the results along ``dim``) only, applied in the converter's order; None for any
    other operation (then the model is built). Computed from shapes, not by running the ops on meta tensors: torch's
    meta kernels for ``stack`` / ``cat`` import torch.compile's machinery (about a second)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    by_pattern: dict[str, list[tuple[int, ...]]] = {}
    for shape, pattern in members:
        by_pattern.setdefault(pattern, []).append(tuple(shape))
    shapes: list[tuple[int, ...]] | None = None
    for op in converter.operations:
        if type(op) is MergeModulelist and shapes is None:
            shapes = []
            for group in by_pattern.values():
                if len(set(group)) != 1:
                    return None
                dim = op.dim % (len(group[0]) + 1)
                shapes.append(group[0][:dim] + (len(group),) + group[0][dim:])
        elif type(op) is Concatenate and shapes:
            dim = op.dim % len(shapes[0])
            if any(
                len(s) != len(shapes[0]) or s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :]
                for s in shapes
            ):
                return None
            shapes = [shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1 :]]
        else:
            return None
    return shapes[0] if shapes and len(shapes) == 1 else None


def wrappers_from_shapes(
    km: KeyMap, adapter_config: dict[str, Any], factors: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
) -> dict[str, tuple[str, int, bool]] | None:
    """What :func:`param_wrappers` learns from peft, decided by shapes alone where they leave one answer.

    peft wraps every parameter of a module that ``target_parameters`` names (``key == t`` or ``key`` ending in
    ``.t``), nesting one ``ParamWrapper`` per parameter (``m.base_layer`` ... ``m``). A wrapper of a 3-D
    ``[E, d1, d2]`` parameter has ``lora_A [r·E, in]`` and ``lora_B [out, r·E]``, with ``(in, out) = (d2, d1)``
    (peft swaps them, the usual ``[E, out, in]`` storage) or ``(d1, d2)`` (experts marked ``is_transposed``); a
    2-D ``[out, in]`` one has ``lora_A [r, in]``, ``lora_B [out, r]``. ``r`` is ``rank_pattern``'s value for the
    parameter. Each wrapper is matched to the one parameter and orientation its factors fit; a square parameter
    fits both orientations unless the conversion fixes it (:attr:`KeyMap.out_first`).

    Args:
        km: from :func:`config_key_map` (run-time parameter names and shapes).
        adapter_config: adapter_config.json.
        factors: adapter module name -> (lora_A shape, lora_B shape), every LoRA layer of the adapter (those whose
            module owns no targeted parameter are layers of ``target_modules`` and are left out of the result).

    Returns:
        ``{module name: (parameter name, number of experts, stored [E, out, in])}`` as :func:`param_wrappers`, or
        None when shapes leave more than one answer (or none): then ask peft with the model.
    """
    from exporter.lora import pattern_value

    targets = list(adapter_config.get("target_parameters") or [])
    r_default = int(adapter_config.get("r", 8))
    rank_pattern = adapter_config.get("rank_pattern") or {}
    by_parent: dict[str, list[str]] = {}
    for name in factors:
        parent = name
        while parent.endswith(".base_layer"):
            parent = parent.removesuffix(".base_layer")
        by_parent.setdefault(parent, []).append(name)
    result: dict[str, tuple[str, int, bool]] = {}
    for parent, names in by_parent.items():
        params = [
            p
            for p in km.shapes
            if p.startswith(parent + ".")
            and "." not in p[len(parent) + 1 :]
            and any(p == t or p.endswith("." + t) for t in targets)
        ]
        if not params and all(n == parent for n in names):
            continue  # no targeted parameter: a LoRA layer of target_modules
        if len(params) != len(names):
            return None
        fits: dict[str, list[tuple[str, int, bool]]] = {}
        for name in names:
            (a_rows, a_in), (b_out, b_cols) = factors[name]
            fits[name] = []
            for param in params:
                shape = km.shapes[param]
                r = int(pattern_value(rank_pattern, param, r_default))
                if len(shape) == 2 and (a_rows, a_in, b_out, b_cols) == (r, shape[1], shape[0], r):
                    fits[name].append((param, 1, False))
                elif len(shape) == 3 and a_rows == b_cols == r * shape[0]:
                    for out_first, (d_in, d_out) in ((True, (shape[2], shape[1])), (False, (shape[1], shape[2]))):
                        if (a_in, b_out) == (d_in, d_out) and km.out_first.get(param, out_first) == out_first:
                            fits[name].append((param, int(shape[0]), out_first))
        if any(len(f) != 1 for f in fits.values()) or len({f[0][0] for f in fits.values()}) != len(names):
            return None
        for name, [(param, experts, out_first)] in fits.items():
            result[name] = (param.rsplit(".", 1)[1], experts, out_first)
    return result


def param_wrappers(model: Any, adapter_dir: Path) -> dict[str, tuple[str, int, bool]]:
    """peft's own view of an adapter with ``target_parameters``: the adapter is injected into ``model`` (meta
    device, changed in place) and every ``ParamWrapper`` is reported as ``{module name: (parameter name, number of
    experts, stored [E, out, in])}``. Wrappers of several parameters of one module are nested
    (``experts.base_layer`` wraps the first target, ``experts`` the next), which is why peft is asked rather than
    the order guessed.

    Raises:
        ExportError: peft cannot apply the adapter's config to the architecture.
    """
    from peft import LoraConfig, inject_adapter_in_model

    try:
        config = LoraConfig.from_pretrained(str(adapter_dir))
        config.inference_mode = True
        model = inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    except Exception as exc:  # noqa: BLE001 - any failure of peft to apply the config
        raise ExportError(f"{adapter_dir}: peft cannot apply its target_parameters to the base ({exc})") from None
    return {
        name: (m.parameter_name, int(m.num_experts), bool(m._did_swap_in_out_features))
        for name, m in model.named_modules()
        if hasattr(m, "parameter_name") and hasattr(m, "num_experts")
    }


__all__ = [
    "FUSED_TRANSFORMERS",
    "KeyMap",
    "config_key_map",
    "key_map",
    "meta_model",
    "param_wrappers",
    "require_fused_conversion",
    "wrappers_from_shapes",
]
