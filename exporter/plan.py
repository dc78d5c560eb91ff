"""Planning the streaming merge: what happens to each stored tensor of the base, decided and checked before a byte
is written.

:func:`plan_merge` reads no weight. From the adapter (:class:`exporter.adapter.Adapter`), the base's config.json and
its shard headers (:class:`exporter.io.CheckpointReader`) it builds a :class:`MergePlan`:

* every LoRA layer mapped onto the stored weight it changes (``lora``), its LoRA bias onto the stored bias
  (``bias``), LoRA on fused expert parameters onto the stored tensors they are fused from (``fused``); shapes
  checked against the adapter's factors;
* ``modules_to_save`` tensors that replace stored ones (``copies``), base weights saved with the adapter that the
  update is added to (``overrides``), trainable-token rows (``token_rows``), a grown vocabulary (``grown``);
* tied embeddings: kept tied (a stored head is dropped) or untied when the adapter changes one of the two;
* ``merge_into="dequantized"``: the weights bitsandbytes quantised (``requant``);
* ``tensors``: every output tensor's name, dtype and shape in write order, which the writer needs up front.

Names: the adapter names run-time modules, the checkpoint stores the hub's names, and transformers 5 converts
between the two on load. :class:`StoredNames` finds a run-time name's stored tensor (the same name, allowing for a
``model.`` prefix one side lacks, else through :mod:`exporter.layout`'s conversion map).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exporter.adapter import Adapter, LoraModule
from exporter.io import CheckpointReader, TensorInfo
from exporter.lora import lora_scaling, pattern_value
from exporter.vocab import GrownVocab, grown_rows, grows_vocab, token_rows_plan
from ferry.adapter_folder import ADAPTER_CONFIG
from ferry.errors import ExportError

#: Output dtype names (``ExportOptions.dtype`` and config.json's ``dtype`` / ``torch_dtype``) -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: Stored weight dtypes a LoRA update can be added to (anything else is a quantized weight).
_MERGEABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INPUT_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")


# --------------------------------------------------------------------------------------------------- the base
@dataclass
class ModelLayout:
    """What the exporter needs to know about the base architecture: the names of fan_in_fan_out (``Conv1D``) layers,
    of the input embedding and the output head, and whether the two are tied. See :func:`model_layout`."""

    fan_in_fan_out: set[str]
    input_embeddings: str | None
    output_embeddings: str | None
    tied: bool


def _mentions_conv1d(base_dir: Path, raw_config: dict[str, Any]) -> bool:
    """Whether the architecture's modeling code uses GPT-2's ``Conv1D`` (read as text: nothing is imported)."""
    import importlib.util

    sources = list(base_dir.glob("*.py"))
    spec = importlib.util.find_spec("transformers")
    model_type = str(raw_config.get("model_type", "")).replace("-", "_")
    if spec is not None and spec.origin and model_type:
        folder = Path(spec.origin).parent / "models" / model_type
        sources += list(folder.glob("modeling_*.py"))
    return any("Conv1D" in path.read_text(errors="replace") for path in sources)


def _is_head(key: str) -> bool:
    """Whether stored tensor ``key`` is an output head's weight (``lm_head``, ``embed_out``, ``output``)."""
    return key in ("output.weight", "model.output.weight") or (
        key.endswith(".weight") and key.removesuffix(".weight").split(".")[-1] in ("lm_head", "embed_out")
    )


def model_layout(
    base_dir: Path, raw_config: dict[str, Any], infos: dict[str, TensorInfo], trust_remote_code: bool
) -> ModelLayout:
    """Learn which layers are GPT-2 style ``Conv1D`` (fan_in_fan_out), which tensors are the input embedding and the
    output head, and whether they are tied.

    Importing transformers costs seconds and ~100 MB of resident memory, so the common case (no ``Conv1D`` in the
    architecture's modeling code) is settled from config.json and the checkpoint's names alone: the input embedding
    is the stored ``*.embed_tokens`` / ``wte`` / ... weight, the head ``lm_head`` / ``embed_out`` / ``output``; the
    head is tied when config.json says ``tie_word_embeddings``, or, when config.json is silent, when the checkpoint
    stores no head. Only a ``Conv1D`` architecture is instantiated, on the meta device (no memory, no weights).

    Raises:
        ExportError: the architecture uses ``Conv1D`` but transformers cannot build it.
    """
    text_cfg = raw_config.get("text_config") or {}
    inp = next(
        (
            k.removesuffix(".weight")
            for k in infos
            if k.endswith(".weight") and k.removesuffix(".weight").split(".")[-1] in _INPUT_EMBEDDINGS
        ),
        None,
    )
    out = next((k.removesuffix(".weight") for k in infos if _is_head(k)), None)
    stated = raw_config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings"))
    tied = bool(stated) if stated is not None else (inp is not None and out is None)
    layout = ModelLayout(set(), inp, out or "lm_head", tied)
    if not _mentions_conv1d(base_dir, raw_config):
        return layout
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D

        config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to build the architecture
        raise ExportError(
            f"{base_dir}: the architecture uses Conv1D layers but transformers cannot build it to find them ({exc})"
        ) from None
    by_id = {id(m): n for n, m in model.named_modules()}
    in_mod, out_mod = model.get_input_embeddings(), model.get_output_embeddings()
    return ModelLayout(
        {n for n, m in model.named_modules() if isinstance(m, Conv1D)},
        by_id.get(id(in_mod), inp) if in_mod is not None else inp,
        by_id.get(id(out_mod), out) if out_mod is not None else out,
        bool(getattr(config.get_text_config(), "tie_word_embeddings", tied)),
    )


def refuse_quantized(base_dir: Path, raw_config: dict[str, Any], reader: CheckpointReader) -> None:
    """Refuse a quantized base: merging into quantized weights loses the adapter's precision.

    Raises:
        ExportError: config.json has a ``quantization_config``, or a stored tensor is a quantized weight's part.
    """
    quant = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ExportError(
            f"{base_dir / 'config.json'}: the base model is quantized ({method}); merging into quantized weights "
            f"loses the adapter's precision. Export against the unquantized base model (--base ORG/NAME)"
        )
    for name in reader.infos:
        if name.endswith((".qweight", ".qzeros", ".scales", ".weight_format", ".SCB", ".absmax", ".quant_map")):
            raise ExportError(f"{base_dir}: tensor {name!r} is a quantized weight; export needs an unquantized base")


def base_key(name: str, suffix: str, infos: dict[str, TensorInfo]) -> str | None:
    """The checkpoint's name for ``name + suffix``, allowing for a ``model.`` prefix that one side lacks."""
    key = name + suffix
    candidates = [key, key.removeprefix("model."), "model." + key]
    return next((c for c in candidates if c in infos), None)


def resolve_dtype(dtype: str, raw_config: dict[str, Any], reader: CheckpointReader) -> torch.dtype:
    """The output dtype of floating-point tensors: ``dtype`` (a :data:`DTYPES` name), or for ``auto`` the base's
    (config.json's ``dtype`` / ``torch_dtype``, else the dtype of its largest stored float tensor).

    Raises:
        ExportError: an unknown dtype name.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ExportError(f"unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32")
        return DTYPES[dtype]
    for key in ("dtype", "torch_dtype"):
        value = raw_config.get(key) or (raw_config.get("text_config") or {}).get(key)
        if isinstance(value, str) and value in DTYPES:
            return DTYPES[value]
    floats = [i for i in reader.infos.values() if i.dtype.is_floating_point]
    if floats:
        return max(floats, key=lambda i: i.nbytes).dtype
    return torch.float32


def _unwrapped(name: str) -> str:
    """A peft wrapper's module name without its ``.base_layer`` levels (the module that owns the parameter)."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def _learn_layout(
    ad: Adapter,
    base_dir: Path,
    raw_config: dict[str, Any],
    reader: CheckpointReader,
    infos: dict[str, TensorInfo],
    trust_remote_code: bool,
    fused_cfg: bool,
) -> tuple[Any, dict]:
    """The base's stored names against its run-time names, and peft's wrappers of ``target_parameters``.

    First without building the model (:func:`exporter.layout.config_key_map`, :func:`wrappers_from_shapes`:
    transformers' conversion list for a plain causal LM, no modeling code imported, seconds and tens of MB less);
    that answer is taken only when every adapter tensor finds its stored tensor(s) through it and shapes leave one
    reading of each wrapper. Otherwise the architecture is built on the meta device and transformers and peft are
    asked on it (:func:`exporter.layout.key_map`, :func:`param_wrappers`), which also gives the precise errors.
    """
    from exporter import layout

    km = layout.config_key_map(base_dir, raw_config, reader.infos)
    if km is not None:
        factors = {m.name: (tuple(m.pair()[0].shape), tuple(m.pair()[1].shape)) for m in ad.modules.values()}
        wrappers = layout.wrappers_from_shapes(km, ad.config, factors) if fused_cfg else {}

        stored_of = km.stored_of

        def found(name: str) -> bool:
            return base_key(name, "", infos) is not None or name in stored_of

        if (
            wrappers is not None
            and all(m.name in wrappers or found(m.name + ".weight") for m in ad.modules.values())
            and all(found(n) for n in [*ad.replacements, *ad.base_overrides])
            and all(
                f"{_unwrapped(n)}.{p}" in km.groups or found(f"{_unwrapped(n)}.{p}")
                for n, (p, _, _) in wrappers.items()
            )
        ):
            return km, wrappers
    model = layout.meta_model(base_dir, trust_remote_code)
    km = layout.key_map(model, list(reader.infos))
    return km, (layout.param_wrappers(model, ad.folder) if fused_cfg else {})


class StoredNames:
    """The checkpoint's name of a run-time tensor name: the name itself (allowing for a ``model.`` prefix one side
    lacks), else the stored tensor transformers converts it from (``key_map``, an :class:`exporter.layout.KeyMap`,
    when the names differ). Called as ``stored(runtime_name) -> stored name or None``."""

    def __init__(self, infos: dict[str, TensorInfo], key_map: Any = None) -> None:
        self.infos, self.key_map = infos, key_map

    def __call__(self, runtime: str) -> str | None:
        key = base_key(runtime, "", self.infos)
        return key if key is not None or self.key_map is None else self.key_map.stored_of.get(runtime)


# --------------------------------------------------------------------------------------------------- the plan
@dataclass
class MergePlan:
    """What the streaming merge does with each stored tensor of the base, keyed by stored name.

    Attributes:
        out_dtype: the output dtype of floating-point tensors (integer tensors keep theirs).
        lora: stored weight -> its LoRA layer (``W + scaling · B A``, DoRA rescaled).
        bias: stored bias -> the LoRA layer whose ``lora_B`` bias is added.
        fused: stored tensor -> the fused run-time expert parameter whose update it receives.
        fused_modules: fused run-time parameter -> its LoRA (``target_parameters``).
        key_map: the stored/run-time name map (:class:`exporter.layout.KeyMap`) when the names differ, else None.
        copies: stored tensor -> the adapter's tensor that replaces it (``modules_to_save``).
        overrides: stored weight -> the base weight saved with the adapter, which the update is added to.
        token_rows: stored weight -> (row indices, their trained values) (``trainable_token_indices``).
        grown: the grown vocabulary, or None.
        drop: stored tensors not written (a stored head of tied embeddings: the tie recreates it).
        untie: the export unties the embeddings (config.json ``tie_word_embeddings=false``).
        untie_head: the head's name when it is not stored and is written last from the input embedding, else None.
        untie_source: the input embedding's stored name the untied head starts from.
        requant: stored weights merged into ``dequant(quant(W))`` (``merge_into="dequantized"``).
        tensors: every output tensor in write order (name, output dtype, output shape).
        warnings: one line each, for the report.
    """

    out_dtype: torch.dtype
    lora: dict[str, LoraModule] = field(default_factory=dict)
    bias: dict[str, LoraModule] = field(default_factory=dict)
    fused: dict[str, str] = field(default_factory=dict)
    fused_modules: dict[str, LoraModule] = field(default_factory=dict)
    key_map: Any = None
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    token_rows: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    grown: GrownVocab | None = None
    drop: set[str] = field(default_factory=set)
    untie: bool = False
    untie_head: str | None = None
    untie_source: str | None = None
    requant: set[str] = field(default_factory=set)
    tensors: list[TensorInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """The size of every output tensor together, in bytes."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def merged_layers(self) -> int:
        """LoRA layers merged: one per adapted weight and one per fused expert parameter."""
        return len(self.lora) + len(self.fused_modules)

    def updates(self, key: str) -> bool:
        """Whether stored tensor ``key`` gets an update from the adapter (LoRA, LoRA bias, fused experts)."""
        return key in self.lora or key in self.bias or key in self.fused

    def changes(self, key: str) -> bool:
        """Whether stored tensor ``key`` is computed (read, changed or replaced) rather than copied as bytes,
        before any dtype conversion."""
        return (
            self.updates(key)
            or key in self.overrides
            or key in self.copies
            or key in self.token_rows
            or key in self.requant
            or key == self.untie_source
        )


class _Planner:
    """Builds a :class:`MergePlan` step by step (:func:`plan_merge`): each ``place_*`` method checks one kind of
    adapter tensor against the base and records where it goes."""

    def __init__(
        self,
        ad: Adapter,
        base_dir: Path,
        raw_config: dict[str, Any],
        reader: CheckpointReader,
        out_dtype: torch.dtype,
        *,
        trust_remote_code: bool,
        repo_id: str | None,
    ) -> None:
        self.ad, self.base_dir, self.reader, self.repo_id = ad, base_dir, reader, repo_id
        self.layout = model_layout(base_dir, raw_config, reader.infos, trust_remote_code)
        # a tied output head is not stored in the checkpoint: it is the input embedding's tensor under another name
        self.infos = dict(reader.infos)
        layout = self.layout
        self.in_key = base_key(layout.input_embeddings, ".weight", self.infos) if layout.input_embeddings else None
        self.head_key = f"{layout.output_embeddings}.weight" if layout.output_embeddings else None
        self.stored_head = base_key(layout.output_embeddings or "", ".weight", reader.infos)
        if layout.tied and self.in_key and self.head_key and self.stored_head is None:
            self.infos[self.head_key] = TensorInfo(
                self.head_key, self.infos[self.in_key].dtype, self.infos[self.in_key].shape
            )
        # transformers 5 loads many checkpoints under other names / shapes than it stores them (conversion
        # mappings): learn the mapping from transformers itself when the adapter's names are not the stored ones
        self.wrappers: dict[str, tuple[str, int, bool]] = {}
        key_map = None
        fused_cfg = bool(ad.config.get("target_parameters"))
        if (
            fused_cfg
            or any(base_key(m.name, ".weight", self.infos) is None for m in ad.modules.values())
            or any(base_key(n, "", self.infos) is None for n in [*ad.replacements, *ad.base_overrides])
        ):
            key_map, self.wrappers = _learn_layout(
                ad, base_dir, raw_config, reader, self.infos, trust_remote_code, fused_cfg
            )
        self.stored = StoredNames(self.infos, key_map)
        self.plan = MergePlan(out_dtype, key_map=key_map)

    def place_module(self, module: LoraModule) -> None:
        """Map one LoRA layer onto its stored weight (and bias), or onto fused expert tensors.

        Raises:
            ExportError: no stored weight for the layer, a quantized or misshapen weight, a rank that disagrees with
                the config, a DoRA magnitude of the wrong size, a LoRA bias on a layer without bias.
        """
        if module.name in self.wrappers:  # peft target_parameters: LoRA on a parameter, maybe a fused [E, ...] one
            if self._place_parameter(module):
                return
        elif module.num_experts != 1:
            raise ExportError(
                f"{self.ad.weights_file}: layer {module.name!r} has rank {module.pair()[0].shape[0]} but "
                f"{ADAPTER_CONFIG} says r={self.ad.config.get('r')}"
            )
        runtime = module.parameter or module.name + ".weight"
        key = self.stored(runtime)
        if key is None:
            raise ExportError(
                f"adapter layer {module.name!r} has no weight {runtime!r} in the base model {self.base_dir}, neither "
                f"stored under that name nor under the name transformers converts it from: the adapter was "
                f"trained on another architecture"
            )
        info = self.infos[key]
        if info.dtype not in _MERGEABLE:
            raise ExportError(
                f"base weight {key!r} is {info.dtype}: the base is quantized (int / fp8 weights need "
                f"their scales); export against the unquantized base model"
            )
        module.fan_in_fan_out = (
            module.fan_in_fan_out
            or module.name in self.layout.fan_in_fan_out
            or key.removesuffix(".weight") in self.layout.fan_in_fan_out
        )
        lora_a, lora_b = module.pair()
        a_in, b_out = lora_a.shape[1], lora_b.shape[0]
        expected = (a_in, b_out) if module.fan_in_fan_out else (b_out, a_in)
        if len(info.shape) != 2 or tuple(info.shape) != expected:
            raise ExportError(
                f"adapter layer {module.name!r} (lora_A {list(lora_a.shape)}, lora_B {list(lora_b.shape)}) "
                f"does not fit base weight {key!r} of shape {list(info.shape)}: the adapter was trained on "
                f"another model than {self.repo_id}"
            )
        if module.magnitude is not None and module.magnitude.numel() != b_out:
            raise ExportError(
                f"adapter layer {module.name!r}: DoRA magnitude has {module.magnitude.numel()} "
                f"entries, expected {b_out}"
            )
        self.plan.lora[key] = module
        if module.B_bias is not None:
            bias_key = self.stored(runtime.removesuffix(".weight") + ".bias")
            if bias_key is None:
                raise ExportError(f"adapter layer {module.name!r} has a LoRA bias but the base layer has no bias")
            self.plan.bias[bias_key] = module

    def _place_parameter(self, module: LoraModule) -> bool:
        """peft ``target_parameters``: set the layer's parameter, experts, rank and scaling; map a fused expert
        parameter (E > 1) onto its stored tensors and return True; return False for a single parameter, which is
        then merged as a plain weight.

        Raises:
            ExportError: a rank that disagrees with ``rank_pattern`` / ``r``, fused shapes that do not fit.
        """
        config = self.ad.config
        param_name, experts, out_first = self.wrappers[module.name]
        runtime = module.parameter = f"{_unwrapped(module.name)}.{param_name}"
        module.out_first = out_first
        # peft keys rank_pattern / alpha_pattern of a target parameter by the parameter's name
        r = int(pattern_value(config.get("rank_pattern") or {}, runtime, int(config.get("r", 8))))
        alpha = float(pattern_value(config.get("alpha_pattern") or {}, runtime, float(config.get("lora_alpha", 8))))
        lora_a, lora_b = module.pair()
        if lora_a.shape[0] != r * experts:
            raise ExportError(
                f"adapter layer {module.name!r} has rank {lora_a.shape[0]} but "
                f"{ADAPTER_CONFIG} says r={r} for the {experts} expert(s) of {runtime!r}"
            )
        module.num_experts = experts
        module.scaling = lora_scaling(alpha, r, use_rslora=bool(config.get("use_rslora")))
        if experts == 1:
            return False
        key_map = self.plan.key_map
        shape = key_map.shapes.get(runtime)
        e_in, e_out = lora_a.shape[1], lora_b.shape[0]
        expected = (experts, e_out, e_in) if out_first else (experts, e_in, e_out)
        if shape != expected:
            raise ExportError(
                f"adapter layer {module.name!r} (fused experts {list(expected)}) does not fit "
                f"{runtime!r} {list(shape or [])} of {self.repo_id}"
            )
        if runtime in key_map.groups:
            from exporter.layout import require_fused_conversion

            require_fused_conversion(runtime)  # KeyMap.split_delta needs transformers >= 5.21
            targets = key_map.groups[runtime]
        else:
            key = self.stored(runtime)
            if key is None or tuple(self.infos[key].shape) != expected:
                raise ExportError(
                    f"adapter layer {module.name!r}: the base {self.base_dir} stores no tensor for {runtime!r}"
                )
            targets = [key]
        self.plan.fused_modules[runtime] = module
        self.plan.fused.update({k: runtime for k in targets})
        return True

    def place_replacements(self) -> None:
        """Map ``modules_to_save`` tensors and saved base weights onto stored tensors; a replaced embedding or head
        may have more rows (a grown vocabulary).

        Raises:
            ExportError: a tensor without a stored counterpart, or of another shape.
        """
        embedding_keys = (self.in_key, self.head_key, self.stored_head)
        for target, source in ((self.plan.copies, self.ad.replacements), (self.plan.overrides, self.ad.base_overrides)):
            for name, tensor in source.items():
                key = self.stored(name)
                if key is None:
                    raise ExportError(f"adapter tensor {name!r} (modules_to_save) has no counterpart in the base model")
                info = self.infos[key]
                if tuple(tensor.shape) != info.shape and not (
                    target is self.plan.copies and grows_vocab(key, tensor, info, embedding_keys)
                ):
                    raise ExportError(
                        f"adapter tensor {name!r} has shape {list(tensor.shape)} but the base's "
                        f"{key!r} is {list(info.shape)}"
                    )
                target[key] = tensor

    def place_vocabulary(self) -> None:
        """A grown vocabulary (``resize_vocab``, :mod:`exporter.vocab`): the adapter's embeddings / head replace
        the base's, or its trained token rows go into them.

        Raises:
            ExportError: as :func:`exporter.vocab.grown_rows` / :func:`~exporter.vocab.token_rows_plan`, or the
                adapter grows the vocabulary both ways.
        """
        tied = self.layout.tied
        grown = grown_rows(self.ad, self.plan.copies, self.infos, self.in_key, self.head_key, tied, self.reader.infos)
        self.plan.token_rows, token_grown = token_rows_plan(
            self.ad, self.stored, self.infos, self.in_key, self.head_key, tied
        )
        if grown is not None and token_grown is not None:
            raise ExportError(
                f"{self.ad.weights_file}: the adapter grows the vocabulary twice (modules_to_save and "
                f"trainable_token_indices)"
            )
        self.plan.grown = grown or token_grown

    def place_ties(self) -> None:
        """Tied embeddings stay tied unless the adapter changes one of the two (LoRA or modules_to_save). Then the
        export unties them and writes the head on its own, from the *base* embedding plus the head's own update (if
        any): that is what base + adapter computes through peft, where the head keeps reading the base weight while
        the embedding gets its LoRA. (peft's merge_and_unload writes into the shared tensor and so changes both;
        peft warns about it, huggingface/peft#2777.)"""
        plan, in_key, head_key = self.plan, self.in_key, self.head_key
        if not (self.layout.tied and in_key and head_key):
            return
        out_key = self.stored_head or head_key
        out_touched = out_key in plan.lora or out_key in plan.copies
        in_touched = in_key in plan.lora or in_key in plan.copies
        if out_touched or in_touched:
            plan.untie, plan.untie_source = True, in_key
            changed = " and ".join(k for k, t in ((in_key, in_touched), (head_key, out_touched)) if t)
            plan.warnings.append(
                f"the adapter changes {changed} of a model with tied embeddings: the export unties "
                f"them (tie_word_embeddings=false), as base + adapter computes"
            )
        elif out_key in self.reader.infos and out_key != in_key:
            plan.drop.add(out_key)  # stored although tied: not written, the tie recreates it

    def _out_info(self, info: TensorInfo) -> TensorInfo:
        """``info`` as written: the output dtype for floats, the grown rows for a grown embedding or head."""
        grown = self.plan.grown
        shape = (grown.rows, info.shape[1]) if grown is not None and info.name in grown.keys else info.shape
        return TensorInfo(info.name, self.plan.out_dtype if info.dtype.is_floating_point else info.dtype, shape)

    def place_tensors(self) -> None:
        """The output tensors in write order: the stored ones shard by shard (less the dropped), then an untied
        head that the checkpoint does not store."""
        plan, reader = self.plan, self.reader
        for file in reader.files:
            plan.tensors += [self._out_info(reader.infos[k]) for k in reader.keys_in(file) if k not in plan.drop]
        if plan.untie_source is None:
            return
        head = self.stored_head or self.head_key
        if head in {t.name for t in plan.tensors}:
            plan.untie_source = None  # stored in the checkpoint: merged in place
        else:
            # an untie source is only planned for a tied head with a stored input embedding
            assert head is not None and self.in_key is not None
            plan.untie_head = head
            plan.tensors.append(self._out_info(TensorInfo(head, plan.out_dtype, reader.infos[self.in_key].shape)))

    def place_requantized(self, trust_remote_code: bool) -> None:
        """``merge_into="dequantized"`` (QLoRA, :mod:`exporter.quant`): the stored weights bitsandbytes quantizes."""
        from exporter.quant import meta_quantized_names

        names = meta_quantized_names(self.base_dir, trust_remote_code)
        self.plan.requant = {
            k for k in (self.stored(n + ".weight") for n in names) if k is not None and k not in self.plan.drop
        }


def plan_merge(
    ad: Adapter,
    base_dir: Path,
    raw_config: dict[str, Any],
    reader: CheckpointReader,
    out_dtype: torch.dtype,
    *,
    trust_remote_code: bool,
    repo_id: str | None,
    merge_into: str = "original",
) -> MergePlan:
    """Decide and check, from names and shapes alone, what the merge writes (module docstring).

    Args:
        ad: the adapter; its layers get ``fan_in_fan_out``, ``parameter``, ``num_experts`` and ``scaling`` set here
            where the base decides them.
        base_dir, raw_config, reader: the base's folder, its config.json and its shard headers.
        out_dtype: the output dtype of floating-point tensors.
        trust_remote_code: let transformers build the base's own model code (to learn names and layer types).
        repo_id: the base's name, for errors.
        merge_into: ``original`` or ``dequantized`` (QLoRA).

    Raises:
        ExportError: an adapter tensor that fits no stored tensor (name or shape), a quantized weight, a vocabulary
            grown unevenly, an architecture transformers cannot build when it must.
    """
    planner = _Planner(
        ad, base_dir, raw_config, reader, out_dtype, trust_remote_code=trust_remote_code, repo_id=repo_id
    )
    for module in ad.modules.values():
        planner.place_module(module)
    planner.place_replacements()
    planner.place_vocabulary()
    planner.place_ties()
    planner.place_tensors()
    if merge_into == "dequantized":
        planner.place_requantized(trust_remote_code)
    return planner.plan


__all__ = [
    "DTYPES",
    "MergePlan",
    "ModelLayout",
    "StoredNames",
    "base_key",
    "model_layout",
    "plan_merge",
    "refuse_quantized",
    "resolve_dtype",
]
