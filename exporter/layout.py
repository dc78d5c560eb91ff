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
        converter.add_tensor(renamed, runtime_name, pattern, delta)
        parts = converter.convert(renamed, model=self.model, config=self.model.config)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in parts.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            name = apply_renamings(name, renamings)
            match = name if name in group else next(
                (g for g in group if g.endswith("." + name) or name.endswith("." + g)), None)
            if match is None or match in out:
                raise ExportError(f"reversing transformers' conversion of {runtime_name!r} gave {name!r}, which is "
                                  f"not one of its stored tensors ({', '.join(group[:3])}, ...)")
            out[match] = tensor
        if set(out) != set(group):
            missing = sorted(set(group) - set(out))
            raise ExportError(f"reversing transformers' conversion of {runtime_name!r} left stored tensors without "
                              f"an update: {', '.join(missing[:3])}")
        return out


def meta_model(base_dir: Path, trust_remote_code: bool) -> Any:
    """The architecture ``AutoModelForCausalLM`` builds for ``base_dir`` (the class ferry trains), on the meta
    device: no memory, no weights.

    Raises:
        ExportError: the config needs ``trust_remote_code``, or transformers cannot build it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise ExportError(f"{base_dir} contains custom code (config.json auto_map): pass --trust-remote-code if "
                              f"you trust it") from None
        raise ExportError(f"{base_dir}: transformers cannot build the architecture to learn its layout ({exc})"
                          ) from None
    except PermissionError as exc:
        raise ExportError(f"{base_dir}: {exc.filename or exc} is not writable (the model's code is copied to the HF "
                          f"modules cache; set HF_MODULES_CACHE to a writable folder)") from None
    except Exception as exc:  # noqa: BLE001 - any failure to build the architecture
        raise ExportError(f"{base_dir}: transformers cannot build the architecture to learn its layout ({exc})"
                          ) from None


def key_map(model: Any, stored: list[str]) -> KeyMap:
    """Rename every stored tensor name as ``from_pretrained`` does for ``model`` (a meta-device model).

    Args:
        model: from :func:`meta_model`.
        stored: the checkpoint's tensor names.

    Returns:
        A :class:`KeyMap`. Stored names that map to no run-time parameter (buffers, unused tensors) are left out.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    result = KeyMap(converters=converters, renamings=renamings, model=model,
                    shapes={k: tuple(v.shape) for k, v in meta_state.items()})
    for key in stored:
        runtime, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if runtime not in meta_state and key in meta_state:  # as from_pretrained: keep the name, fix the prefix
            runtime, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        if runtime not in meta_state:
            continue
        if pattern is not None:
            result.groups.setdefault(runtime, []).append(key)
        else:
            result.stored_of[runtime] = key
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
    return {name: (m.parameter_name, int(m.num_experts), bool(m._did_swap_in_out_features))
            for name, m in model.named_modules() if hasattr(m, "parameter_name") and hasattr(m, "num_experts")}


__all__ = ["KeyMap", "key_map", "meta_model", "param_wrappers"]
