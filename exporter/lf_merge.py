"""``ferry export CONFIG.yaml``: LLaMA-Factory's merge YAML (``examples/merge_lora/*.yaml``).

LLaMA-Factory merges with ``llamafactory-cli export CONFIG.yaml``; its keys map onto :func:`exporter.export.export`
and the fields of :class:`exporter.options.ExportOptions`:

=========================  ============================================================================
``model_name_or_path``     the base (``base``, ``--base``)
``adapter_name_or_path``   one adapter or several, comma-separated (merged in order, as LLaMA-Factory); a
                           LLaMA-Factory output_dir (adapter_config.json at its top) or ferry's
                           (``output_dir/adapter``)
``export_dir``             the output folder (``--output``)
``export_size``            largest shard in GB (``max_shard_size``, ``--max-shard-size NGB``; LLaMA-Factory's
                           default 5)
``export_device``          ``cpu`` or ``auto``: ferry's streaming merge runs on the CPU either way
``export_legacy_format``   false (safetensors); true (pickle ``.bin``) is refused
``trust_remote_code``      ``trust_remote_code``
``infer_dtype``            ``dtype``
``template``               checked against the template the adapter was trained with (the adapter's
                           tokenizer files carry that one)
=========================  ============================================================================

``export_hub_model_id`` (an upload) and the GPTQ keys (``export_quantization_*``) are refused in one line each,
naming ferry's nearest equivalent. Options given explicitly (the flags given on the command line; the fields
set in the :class:`~exporter.options.ExportOptions` a library caller passes) win over the YAML's keys.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from exporter.options import ExportOptions
from ferry.adapter_folder import (
    TRAIN_CONFIG,
    adapter_folder,
    merged_chain,
    write_stack_record,
)
from ferry.errors import ConfigError
from ferry.lf_keys import lf_keys, refuse_model_changes
from ferry.yaml_config import read_yaml_mapping

if TYPE_CHECKING:
    from exporter.export import ExportReport

#: Keys of LLaMA-Factory's merge YAML that ferry reads.
MERGE_KEYS = (
    "model_name_or_path",
    "adapter_name_or_path",
    "template",
    "trust_remote_code",
    "export_dir",
    "export_size",
    "export_device",
    "export_legacy_format",
    "infer_dtype",
)

#: Keys refused with the reason and ferry's nearest equivalent.
REFUSED_KEYS = {
    "export_hub_model_id": "uploads the merged model to the Hugging Face Hub, which an offline host cannot reach: "
    "carry the export back with `ferry export --bundle` and upload it from the online side",
    "export_quantization_bit": "LLaMA-Factory's GPTQ export; ferry's nearest is a quantized GGUF "
    "(`--format gguf --gguf-type q4_k_m`)",
    "export_quantization_dataset": "LLaMA-Factory's GPTQ export; ferry's nearest is a quantized GGUF "
    "(`--format gguf --gguf-type q4_k_m`)",
    "quantization_bit": "merging into a quantized base loses precision (LLaMA-Factory refuses it too): merge into "
    "the unquantized base",
}


@dataclass
class MergeSpec:
    """A merge YAML read: the adapters to merge, the output, and the keys that are export options.

    Attributes:
        base: the base model (folder or repo id); adapters: adapter folders in merge order; output: export_dir;
        max_shard_size: ``"{export_size}GB"``; trust_remote_code, template, dtype: as named.
    """

    base: str | None
    adapters: list[Path]
    output: str | None
    max_shard_size: str
    trust_remote_code: bool
    template: str | None
    dtype: str

    def options(self, given: ExportOptions | None = None) -> ExportOptions:
        """The YAML's keys as :class:`ExportOptions`, with the fields set explicitly in ``given`` on top (its
        ``model_fields_set``: the flags given on the command line).

        Raises:
            pydantic.ValidationError: a value ExportOptions refuses.
        """
        values: dict[str, Any] = {
            "max_shard_size": self.max_shard_size,
            "trust_remote_code": self.trust_remote_code,
            "dtype": self.dtype,
        }
        if self.base is not None:
            values["base"] = self.base
        if given is not None:
            values.update({name: getattr(given, name) for name in given.model_fields_set})
        return ExportOptions(**values)


def _trained_template(adapter: Path) -> str | None:
    """The ``template`` of the ferry run that wrote ``adapter`` (``train_config.yaml`` beside it), else None."""
    file = adapter.parent / TRAIN_CONFIG
    try:
        value = (yaml.safe_load(file.read_text(encoding="utf-8")) or {}).get("template")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return str(value) if value else None


def read_merge_config(path: str | os.PathLike) -> MergeSpec:
    """Read LLaMA-Factory's merge YAML.

    Raises:
        ConfigError: missing file, not a mapping, an unknown key (with the nearest known one), a refused key (one
            line naming ferry's nearest equivalent), no adapter (LLaMA-Factory's full-model re-save), a bad value.
    """
    file = Path(path)
    data = read_yaml_mapping(file)
    for key, value in data.items():
        if key in REFUSED_KEYS and value not in (None, False, ""):
            raise ConfigError(f"{file}: {key}: {REFUSED_KEYS[key]}")
    # every other key LLaMA-Factory's export parser takes (its model, data, fine-tuning and generation arguments)
    # has nothing to do in a merge: accepted without a word, as LLaMA-Factory does
    taken = lf_keys("infer")
    refuse_model_changes(data, str(file), used=tuple(REFUSED_KEYS))
    unknown = [k for k in data if k not in MERGE_KEYS and k not in REFUSED_KEYS and k not in taken]
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), MERGE_KEYS, n=1, cutoff=0.6)
        raise ConfigError(
            f"{file}: unknown key {unknown[0]!r} in a merge YAML" + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    raw = data.get("adapter_name_or_path")
    names = [p.strip() for p in raw.split(",") if p.strip()] if isinstance(raw, str) else list(raw or [])
    if not names:
        raise ConfigError(
            f"{file}: no adapter_name_or_path: LLaMA-Factory's re-save of a fully fine-tuned model; "
            f"ferry exports LoRA merges (a full model folder already loads in transformers)"
        )
    if data.get("export_legacy_format"):
        raise ConfigError(
            f"{file}: export_legacy_format: true writes pickle .bin weights, which can run code when "
            f"loaded; ferry writes safetensors only (set it to false)"
        )
    if str(data.get("export_device", "cpu")) not in ("cpu", "auto"):
        raise ConfigError(f"{file}: export_device: {data['export_device']!r} is not cpu or auto")
    size = data.get("export_size", 5)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
        raise ConfigError(f"{file}: export_size: {size!r} is not a positive number of GB")
    dtype = str(data.get("infer_dtype", "auto"))
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise ConfigError(f"{file}: infer_dtype: {dtype!r} is not auto, bfloat16, float16 or float32")
    template = data.get("template")
    trained = _trained_template(adapter_folder(names[-1]))
    if template is not None and trained is not None and template != trained:
        raise ConfigError(
            f"{file}: template: {template!r} but {names[-1]} was trained with template {trained!r}: the "
            f"export carries the trained one (set template: {trained} or remove the key)"
        )
    return MergeSpec(
        base=data.get("model_name_or_path"),
        adapters=[adapter_folder(n) for n in names],
        output=data.get("export_dir"),
        max_shard_size=f"{size}GB",
        trust_remote_code=bool(data.get("trust_remote_code")),
        template=data.get("template"),
        dtype=dtype,
    )


def export_from_config(
    config: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    adapter: str | os.PathLike | None = None,
    output: str | os.PathLike | None = None,
) -> ExportReport:
    """Run :func:`exporter.export.export` from a merge YAML: the YAML's keys as options, those set explicitly in
    ``options`` (``ExportOptions(smoke=False)``: ``smoke``) on top (:meth:`MergeSpec.options`); ``adapter`` /
    ``output`` given replace the YAML's ``adapter_name_or_path`` / ``export_dir``.

    Several adapters merge in order, as LLaMA-Factory: each earlier one is merged into a temporary copy of the
    base beside the output (removed afterwards), the last one into ``export_dir``.

    Returns:
        The :class:`exporter.export.ExportReport` of the last merge.

    Raises:
        ConfigError: as :func:`read_merge_config`, or no export_dir and no ``output``.
        ExportError, SmokeCheckError, ...: as :func:`exporter.export.export`.
    """
    from exporter.export import export

    spec = read_merge_config(config)
    adapters = [adapter_folder(adapter)] if adapter else spec.adapters
    output = output or spec.output
    if not output:
        raise ConfigError(f"{config}: no export_dir (or --output): where should the merged model go?")
    options = spec.options(options)
    parent = Path(output).expanduser().resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ferry-merge-", dir=parent) as tmp:
        for i, earlier in enumerate(adapters[:-1]):
            step = Path(tmp) / f"step{i}"
            export(
                earlier,
                step,
                ExportOptions(
                    base=options.base, dtype="auto", smoke=False, trust_remote_code=options.trust_remote_code
                ),
            )
            write_stack_record(step, merged_chain(adapters[: i + 1]))
            options = options.model_copy(update={"base": str(step)})
        return export(adapters[-1], output, options)


__all__ = ["MERGE_KEYS", "MergeSpec", "REFUSED_KEYS", "export_from_config", "read_merge_config"]
