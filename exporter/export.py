"""``ferry export``: merge a LoRA adapter into its base model, streaming, into sharded safetensors.

The merge never holds the model in memory: the base is read one shard at a time (``safe_open``), each weight that
has a LoRA pair becomes ``W + scaling · (B @ A)`` in float32 (DoRA: rescaled per output row) and is cast to the
output dtype, and every tensor is appended to its output file as soon as it is computed
(:class:`exporter.io.ShardedSafetensorsWriter`); a tensor the adapter does not change (and whose dtype stays) is
copied as bytes through a small buffer, never built. Peak memory is the adapter plus the largest merged tensor (for
fused experts: one fused parameter's update), on top of torch and transformers' conversion code.

Output folder (written to a temp directory beside it, renamed when complete)::

    OUT/
    ├── model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
    ├── config.json                 the base's, dtype updated, quantization_config removed
    ├── generation_config.json      the adapter folder's, else the base's
    ├── tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, ...
    │                               the base's tokenizer files byte for byte, and the chat template training
    │                               used (the adapter's chat_template.jinja)
    ├── README.md                   model card with lineage (base repo_id@commit, adapter sha256, training config,
    │                               datasets with sha256)
    ├── ferry_export.json           the same lineage, machine-readable (``ferry smoke`` reads it)
    ├── smoke_report.json           when the smoke check ran
    ├── SERVING.md                  vllm / llama-server / ollama commands for this folder (serving/guide.py)
    ├── <name>-<type>.gguf, Modelfile   with --format gguf / hf,gguf (exporter/outputs.py, exporter/gguf.py,
    │                               exporter/ollama.py); --format gguf alone leaves the safetensors out
    └── SHA256SUMS                  coreutils format over every other file: ``sha256sum -c SHA256SUMS``

Names and layouts: the adapter names run-time modules, the base folder stores the hub's tensor names, and
transformers 5 converts between the two on load (GPT-2 without ``transformer.``, Gemma-3 vision+text's
``language_model.model.``, Qwen3.5's ``model.language_model.``, per-expert MoE tensors fused into ``[E, ...]``
parameters). When the names differ, :mod:`exporter.layout` asks transformers itself (its conversion mapping, for a
plain causal LM straight from config.json, else on a meta-device model) which stored tensors each adapted parameter
comes from; the output is written in the base's
own layout (same names, same per-expert tensors), which vLLM and the hub's loaders read. LoRA on fused experts
(peft ``target_parameters``) is merged into each stored expert tensor: the fused update is split back with
transformers' reversed converter, one fused parameter at a time.

Safety: the output may not be, contain or lie inside the adapter or base folder (with or without ``overwrite``);
a ``base`` other than the adapter's recorded ``base_model_name_or_path`` / ``revision`` is warned about and both
are recorded in ``ferry_export.json`` and the card.

Tied input / output embeddings stay tied (the head is not written) unless the adapter changes one of them; then
the export unties them so that the merged model computes what base + adapter computes through peft.

An adapter that grew the vocabulary (``resize_vocab``: grown ``modules_to_save`` embeddings and head, or peft
``trainable_token_indices`` rows) is merged at the grown size with ``vocab_size`` and the adapter's tokenizer
(:mod:`exporter.vocab`).

Modules: :mod:`exporter.adapter` reads the adapter folder and finds the base; :mod:`exporter.layout` learns the
base's stored names against its run-time names from transformers; :mod:`exporter.io` reads and writes shards;
:mod:`exporter.lora` is the LoRA algebra; :mod:`exporter.lineage` writes the card and ``ferry_export.json``; this
module drives the merge. :mod:`exporter.smoke` depends on :mod:`exporter.adapter` only, never on this module
(``ExportOptions(smoke=True)`` runs it once the output is in place).

``ExportOptions(adapter_only=True)`` writes the adapter instead (adapter_config.json, adapter_model.safetensors,
tokenizer files when the adapter folder has them, README.md, ferry_export.json, SHA256SUMS), the form vLLM serves
with ``--lora-modules NAME=OUT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from exporter.adapter import Adapter, LoraModule, _resolve_base, load_adapter
from exporter.io import (
    CheckpointReader,
    ShardedSafetensorsWriter,
    TensorInfo,
    copy_tokenizer_files,
    load_file,
    sha256_file,
)
from exporter.lineage import (
    _base_license,
    _meta,
    _model_card,
    _read_lineage,
    _recorded_base_check,
)
from exporter.options import ExportOptions
from exporter.lora import (
    fused_expert_delta,
    lora_scaling,
    merge_bias,
    merge_weight,
    pattern_value,
)
from exporter.vocab import (
    apply_token_rows,
    export_grown_tokenizer,
    grown_rows,
    grows_vocab,
    set_vocab_size,
    token_rows_plan,
)
from ferry.adapter_folder import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHAT_TEMPLATE,
    EXPORT_RECORD,
    check_stacked,
    read_adapter_config,
    read_quant_record,
    read_vocab_record,
)
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, ExportError, NotInstalledError, SourceError
from ferry.fsutil import (
    atomic_directory,
    atomic_write_text,
    ensure_free_space,
    format_bytes,
)

SUMS_NAME = "SHA256SUMS"
SMOKE_REPORT = "smoke_report.json"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

#: Files that make up a tokenizer and its chat template (transformers' tokenizer and processor file names).

#: A multi-modal model's processor configuration (transformers' processor / image / video processor files).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")

# --------------------------------------------------------------------------------------------------- the base
@dataclass
class _ModelLayout:
    """What the exporter needs to know about the base architecture: the names of fan_in_fan_out (``Conv1D``) layers,
    of the input embedding and the output head, and whether the two are tied. See :func:`_model_layout`."""

    fan_in_fan_out: set[str]
    input_embeddings: str | None
    output_embeddings: str | None
    tied: bool


_INPUT_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")


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


def _model_layout(base_dir: Path, raw_config: dict[str, Any], infos: dict[str, TensorInfo],
                  trust_remote_code: bool) -> _ModelLayout:
    """Learn which layers are GPT-2 style ``Conv1D`` (fan_in_fan_out), which tensors are the input embedding and the
    output head, and whether they are tied.

    Importing transformers costs seconds and ~100 MB of resident memory, so the common case (no ``Conv1D`` in the
    architecture's modeling code) is settled from config.json and the checkpoint's names alone: the input embedding
    is the stored ``*.embed_tokens`` / ``wte`` / ... weight, the head ``lm_head`` / ``embed_out`` / ``output``; the
    head is tied when config.json says ``tie_word_embeddings``, or, when config.json is silent, when the checkpoint
    stores no head. Only a ``Conv1D`` architecture is instantiated, on the meta device (no memory, no weights).
    """
    text_cfg = raw_config.get("text_config") or {}
    inp = next((k.removesuffix(".weight") for k in infos
                if k.endswith(".weight") and k.removesuffix(".weight").split(".")[-1] in _INPUT_EMBEDDINGS), None)
    def is_head(key: str) -> bool:
        module = key.removesuffix(".weight")
        return key in ("output.weight", "model.output.weight") or (
            key.endswith(".weight") and module.split(".")[-1] in ("lm_head", "embed_out"))

    out = next((k.removesuffix(".weight") for k in infos if is_head(k)), None)
    stated = raw_config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings"))
    tied = bool(stated) if stated is not None else (inp is not None and out is None)
    layout = _ModelLayout(set(), inp, out or "lm_head", tied)
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
    return _ModelLayout(
        {n for n, m in model.named_modules() if isinstance(m, Conv1D)},
        by_id.get(id(in_mod), inp) if in_mod is not None else inp,
        by_id.get(id(out_mod), out) if out_mod is not None else out,
        bool(getattr(config.get_text_config(), "tie_word_embeddings", tied)),
    )


def _refuse_quantized(base_dir: Path, raw_config: dict[str, Any], reader: CheckpointReader) -> None:
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


def _base_key(name: str, suffix: str, infos: dict[str, TensorInfo]) -> str | None:
    """The checkpoint's name for ``name + suffix``, allowing for a ``model.`` prefix that one side lacks."""
    key = name + suffix
    candidates = [key, key.removeprefix("model."), "model." + key]
    return next((c for c in candidates if c in infos), None)


def _resolve_dtype(dtype: str | torch.dtype, raw_config: dict[str, Any], reader: CheckpointReader) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
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


# --------------------------------------------------------------------------------------------------- safety
def _refuse_overlap(output: Path, folder: Path, what: str) -> None:
    """Refuse an ``output`` that is, contains or lies inside ``folder`` (the adapter or the base): writing there
    would replace the very files the export reads, with or without ``--overwrite``.

    Raises:
        ExportError: the two paths overlap (compared after resolving links).
    """
    out, other = output.expanduser().resolve(), folder.expanduser().resolve()
    if out == other or other in out.parents or out in other.parents:
        relation = "is" if out == other else ("lies inside" if other in out.parents else "contains")
        raise ExportError(f"--output {output} {relation} the {what} folder {folder}: the export would overwrite what "
                          f"it reads; choose another output folder")


def _refuse_unwritable(output: Path) -> None:
    """Refuse an output whose nearest existing folder is not writable, before anything is computed.

    Raises:
        ExportError: read-only parent (or read-only output when it is to be replaced).
    """
    probe = output.expanduser().absolute()
    if probe.exists():
        probe = probe.parent
    while not probe.exists():
        probe = probe.parent
    import tempfile

    try:  # a real write: os.access says yes to root on a read-only file system
        with tempfile.TemporaryDirectory(prefix=".ferry-probe-", dir=probe):
            pass
    except OSError as exc:
        raise ExportError(f"--output {output}: cannot write in {probe} ({exc.strerror or exc})") from None


def _export_tokenizer(base_dir: Path, adapter_dir: Path, dest: Path) -> list[str]:
    """The merged model's tokenizer: the base's tokenizer files byte for byte (transformers 4.x, vLLM and
    llama.cpp's converter read them; the adapter folder's copies are rewritten by transformers 5's
    ``save_pretrained``), with the chat template training used (the adapter folder's ``chat_template.jinja``,
    written by :func:`trainer.templates.write_chat_template`) on top: transformers reads ``chat_template.jinja``
    before any ``chat_template`` inside ``tokenizer_config.json``. A base without tokenizer files gets the
    adapter's set. Returns the copied relative paths."""
    copied = copy_tokenizer_files([base_dir, adapter_dir], dest)
    template = adapter_dir / CHAT_TEMPLATE
    if template.is_file():
        shutil.copyfile(template, dest / CHAT_TEMPLATE)
        copied = sorted({*copied, CHAT_TEMPLATE})
    return copied


def _write_sums(folder: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """Write ``SHA256SUMS`` (coreutils format) over every file in ``folder`` but itself; ``known`` supplies hashes
    computed while writing so that large shards are not read back. Returns {relative path: sha256}."""
    known = known or {}
    sums = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != SUMS_NAME:
            sums[rel] = known.get(rel) or sha256_file(path)
    atomic_write_text(folder / SUMS_NAME, "".join(f"{h}  {p}\n" for p, h in sums.items()))
    return sums


# --------------------------------------------------------------------------------------------------- the report
@dataclass
class ExportReport:
    """What :func:`export` did. Sizes in bytes, durations in seconds.

    ``mode``: ``"merged"`` or ``"adapter-only"``; ``files``: {relative path: sha256} as in SHA256SUMS;
    ``merged_layers``: layers that got W + ΔW; ``replaced_tensors``: tensors copied from the adapter
    (modules_to_save); ``peak_rss_bytes``: this process's peak resident memory after the merge;
    ``smoke``: the smoke check's report as a dict (None with ``smoke=False``); ``bundle``: the bundle directory
    when ``bundle=True``.
    """

    output: Path
    mode: str
    base: Path | None
    base_repo_id: str | None
    base_revision: str | None
    adapter: Path
    adapter_sha256: str
    dtype: str | None
    merged_layers: int
    replaced_tensors: int
    shards: list[str]
    total_bytes: int
    seconds: float
    peak_rss_bytes: int
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    smoke: dict[str, Any] | None = None
    bundle: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in data.items()}

    def summary(self) -> str:
        """A few human-readable lines for the CLI."""
        lines = [
            f"exported the {'merged model' if self.mode == 'merged' else 'adapter'} to {self.output}",
            f"  base      {self.base_repo_id} @ {self.base_revision or '-'}",
            f"  adapter   {self.adapter} (sha256 {self.adapter_sha256[:12]}…)",
        ]
        if self.mode == "merged":
            lines.append(
                f"  merged    {self.merged_layers} LoRA layers, {self.replaced_tensors} tensors from the adapter, "
                f"dtype {self.dtype}, {len(self.shards)} shard(s), {format_bytes(self.total_bytes)}"
            )
        lines.append(f"  took      {self.seconds:.1f} s, peak RSS {format_bytes(self.peak_rss_bytes)}")
        for warning in self.warnings:
            lines.append(f"  warning   {warning}")
        if self.smoke is not None:
            verdict = "passed" if self.smoke.get("passed") else "FAILED"
            lines.append(f"  smoke     {verdict}: max |Δlogits| {self.smoke.get('max_abs_diff')}, "
                         f"{self.smoke.get('tokens_per_second', 0):.1f} tok/s")
        gguf = (self.smoke or {}).get("gguf")  # exporter.outputs: the GGUF's proof
        if gguf:
            lines.append(f"  gguf      {gguf['file']} ({gguf['gguf_type']}): {'passed' if gguf['passed'] else 'FAILED'}, "
                         f"max |Δlogits| vs the merged weights {gguf['max_abs_diff']}, {gguf['weights_checked']} "
                         f"weights proven")
        if self.bundle is not None:
            lines.append(f"  bundle    {self.bundle}")
        return "\n".join(lines)


@contextlib.contextmanager
def _merge_threads() -> Iterator[None]:
    """Run the merge with one intra-op thread. Per weight it is one small-rank ``addmm`` over a tensor read from
    disk, memory- and I/O-bound: extra threads buy little, and on a shared host OpenMP's spin-waiting threads make
    each small op ~3-20x slower (measured on the 2-core CI host: 1.5 GB export 14.5 s with 2 threads, 10.1 s with
    one). The previous setting is restored afterwards (the smoke check runs with it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _one_line_os_errors(output: Path) -> Iterator[None]:
    """Turn a permission error while writing the export (a folder made read-only meanwhile, a full quota) into
    one :class:`ExportError` line; the temp folder is already removed by ``atomic_directory``."""
    try:
        yield
    except PermissionError as exc:
        raise ExportError(f"cannot write the export to {output}: {exc.strerror or exc} ({exc.filename})") from None


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# --------------------------------------------------------------------------------------------------- export
def export(adapter: str | os.PathLike, output: str | os.PathLike, options: ExportOptions | None = None) -> ExportReport:
    """Merge the LoRA adapter in ``adapter`` into its base model and write it to ``output``.

    Args:
        adapter: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        output: the folder to create (must not exist unless ``options.overwrite``); written to a temp folder, then
            renamed.
        options: what to merge into and what to write (:class:`exporter.options.ExportOptions`; default: its
            defaults: the adapter's recorded base, the base's dtype, 5GB shards, the smoke check, safetensors).

    Returns:
        An :class:`ExportReport`.

    Raises:
        ExportError: quantized base, adapter shapes that do not fit the base, output exists, output overlaps the
            adapter or the base, GGUF refused before the merge (:func:`exporter.outputs.preflight`).
        ConfigError: the adapter was trained on adapters merged into its base, which the base lacks.
        SourceError: pickle weights without ``allow_pickle``.
        NotInstalledError: the base model is not installed on this host.
        InsufficientSpaceError: the output file system is too small.
        SmokeCheckError: the smoke check failed (the export is kept, with smoke_report.json, for inspection).
    """
    options = options or ExportOptions()
    apply_offline_env()
    started = time.perf_counter()
    output = Path(output)
    quant_record = _refuse_before_reading(Path(adapter), output, options)
    # serving outputs (GGUF, Modelfile, SERVING.md): refused up front, written after the merge (exporter.outputs)
    from exporter import outputs as serve_outputs

    converter = serve_outputs.preflight(options)
    check_stacked(adapter, options.base)  # an adapter trained on merged adapters needs them
    with _merge_threads(), _one_line_os_errors(output):
        ad = load_adapter(adapter, allow_pickle=options.allow_pickle)
        if options.adapter_only:
            report = _export_adapter_only(ad, output, options.base, overwrite=options.overwrite, started=started,
                                          trust_remote_code=options.trust_remote_code)
        else:
            report = _export_merged(ad, output, options.base, dtype=options.dtype, shard_limit=options.shard_limit,
                                    allow_pickle=options.allow_pickle, overwrite=options.overwrite,
                                    trust_remote_code=options.trust_remote_code, started=started,
                                    progress=options.progress, will_smoke=options.smoke,
                                    quant=(quant_record, options.merge_into))
    if options.smoke and not options.adapter_only:
        _smoke_check(report, options)
    try:
        report.warnings += serve_outputs.finish(report, options, converter)
    finally:
        # shards keep the hashes computed while writing them; every other file (smoke_report.json gained "gguf")
        # is hashed again
        report.files = _write_sums(output, {k: v for k, v in report.files.items()
                                            if k.endswith(".safetensors") and (output / k).is_file()})
    if options.bundle:
        report.bundle = _write_bundle(output, report)
    return report


def _refuse_before_reading(adapter: Path, output: Path, options: ExportOptions) -> dict[str, Any] | None:
    """Refuse what is wrong with the request before any weight is read; returns the adapter's quantization record
    (QLoRA) or None.

    Raises:
        ExportError: ``output`` overlaps the adapter or a base folder, exists without ``overwrite`` or cannot be
            written; ``merge_into`` does not fit the adapter.
    """
    _refuse_overlap(output, adapter, "adapter")
    from exporter.quant import check_merge_into  # QLoRA

    quant_record = read_quant_record(adapter)
    check_merge_into(options.merge_into, quant_record, adapter)
    named_base = options.base
    if named_base is None:
        with contextlib.suppress(ConfigError, OSError):
            named_base = (read_adapter_config(adapter) or {}).get("base_model_name_or_path")
    if named_base and Path(str(named_base)).expanduser().is_dir():
        _refuse_overlap(output, Path(str(named_base)), "base model")  # before "exists": say what is wrong
    if output.exists() and not options.overwrite:
        raise ExportError(f"output {output} already exists (pass --overwrite to replace it)")
    _refuse_unwritable(output)
    return quant_record


def _smoke_check(report: ExportReport, options: ExportOptions) -> None:
    """Run :func:`exporter.smoke.smoke` on the merged folder into ``report.smoke``; SHA256SUMS then lists
    smoke_report.json, pass or fail.

    Raises:
        SmokeCheckError: the check failed.
    """
    from exporter.smoke import smoke

    try:
        result = smoke(report.output, adapter=report.adapter, base=report.base, prompts=options.prompts,
                       max_new_tokens=options.max_new_tokens, trust_remote_code=options.trust_remote_code)
        report.smoke = result.to_dict()
    finally:
        report.files = _write_sums(report.output, report.files)


def _export_merged(ad: Adapter, output: Path, base: Any, *, dtype: Any, shard_limit: int, allow_pickle: bool,
                   overwrite: bool, trust_remote_code: bool, started: float, progress: bool = False,
                   will_smoke: bool = False, quant: tuple[dict | None, str] = (None, "original")) -> ExportReport:
    base_dir, repo_id, commit = _resolve_base(ad, base)
    _refuse_overlap(output, base_dir, "base model")
    recorded_base, base_warning = _recorded_base_check(ad, base_dir, repo_id, commit)
    config_path = base_dir / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{base_dir} has no config.json; is it a transformers model folder?")
    raw_config = json.loads(config_path.read_text())
    if raw_config.get("auto_map") and not trust_remote_code and will_smoke:
        raise ExportError(f"{base_dir} contains custom code (config.json auto_map), which the smoke check runs: pass "
                          f"--trust-remote-code if you trust it (or --no-smoke)")
    reader = CheckpointReader(base_dir, allow_pickle=allow_pickle)
    _refuse_quantized(base_dir, raw_config, reader)
    out_dtype = _resolve_dtype(dtype, raw_config, reader)
    layout = _model_layout(base_dir, raw_config, reader.infos, trust_remote_code)
    warnings: list[str] = [base_warning] if base_warning else []

    # -- map every adapter tensor onto a base tensor, checking shapes before anything is written. A tied output
    #    head is not stored in the checkpoint; it is the input embedding's tensor under another name.
    infos = dict(reader.infos)
    in_key = _base_key(layout.input_embeddings, ".weight", infos) if layout.input_embeddings else None
    out_key_model = f"{layout.output_embeddings}.weight" if layout.output_embeddings else None
    if layout.tied and in_key and out_key_model and _base_key(layout.output_embeddings, ".weight", infos) is None:
        infos[out_key_model] = TensorInfo(out_key_model, infos[in_key].dtype, infos[in_key].shape)
    lora_by_key: dict[str, LoraModule] = {}
    bias_by_key: dict[str, LoraModule] = {}
    fused_by_key: dict[str, str] = {}  # stored tensor -> the fused run-time parameter whose update it receives
    fused_modules: dict[str, LoraModule] = {}  # fused run-time parameter -> its LoRA
    # transformers 5 loads many checkpoints under other names / shapes than it stores them (conversion mappings):
    # learn the mapping from transformers itself when the adapter's names are not the stored ones
    km, wrappers = None, {}
    fused_cfg = bool(ad.config.get("target_parameters"))
    if fused_cfg or any(_base_key(m.name, ".weight", infos) is None for m in ad.modules.values()) or any(
            _base_key(n, "", infos) is None for n in [*ad.replacements, *ad.base_overrides]):
        km, wrappers = _learn_layout(ad, base_dir, raw_config, reader, infos, trust_remote_code, fused_cfg)

    def stored(runtime: str) -> str | None:
        key = _base_key(runtime, "", infos)
        return key if key is not None or km is None else km.stored_of.get(runtime)

    for module in ad.modules.values():
        runtime = module.name + ".weight"
        if module.name in wrappers:  # peft target_parameters: LoRA on a parameter, maybe a fused [E, ...] one
            param_name, experts, out_first = wrappers[module.name]
            parent = module.name
            while parent.endswith(".base_layer"):
                parent = parent.removesuffix(".base_layer")
            runtime = module.parameter = f"{parent}.{param_name}"
            module.out_first = out_first
            # peft keys rank_pattern / alpha_pattern of a target parameter by the parameter's name
            r = int(pattern_value(ad.config.get("rank_pattern") or {}, runtime, int(ad.config.get("r", 8))))
            alpha = float(pattern_value(ad.config.get("alpha_pattern") or {}, runtime,
                                        float(ad.config.get("lora_alpha", 8))))
            if module.A.shape[0] != r * experts:
                raise ExportError(f"adapter layer {module.name!r} has rank {module.A.shape[0]} but "
                                  f"{ADAPTER_CONFIG} says r={r} for the {experts} expert(s) of {runtime!r}")
            module.num_experts = experts
            module.scaling = lora_scaling(alpha, r, use_rslora=bool(ad.config.get("use_rslora")))
            if experts > 1:
                shape = km.shapes.get(runtime)
                e_in, e_out = module.A.shape[1], module.B.shape[0]
                expected = (experts, e_out, e_in) if out_first else (experts, e_in, e_out)
                if shape != expected:
                    raise ExportError(f"adapter layer {module.name!r} (fused experts {list(expected)}) does not fit "
                                      f"{runtime!r} {list(shape or [])} of {repo_id}")
                if runtime in km.groups:
                    targets = km.groups[runtime]
                else:
                    key = stored(runtime)
                    if key is None or tuple(infos[key].shape) != expected:
                        raise ExportError(f"adapter layer {module.name!r}: the base {base_dir} stores no tensor "
                                          f"for {runtime!r}")
                    targets = [key]
                fused_modules[runtime] = module
                fused_by_key.update({k: runtime for k in targets})
                continue
        elif module.num_experts != 1:
            raise ExportError(f"{ad.weights_file}: layer {module.name!r} has rank {module.A.shape[0]} but "
                              f"{ADAPTER_CONFIG} says r={ad.config.get('r')}")
        key = stored(runtime)
        if key is None:
            raise ExportError(
                f"adapter layer {module.name!r} has no weight {runtime!r} in the base model {base_dir}, neither "
                f"stored under that name nor under the name transformers converts it from: the adapter was "
                f"trained on another architecture"
            )
        info = infos[key]
        if info.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ExportError(f"base weight {key!r} is {info.dtype}: the base is quantized (int / fp8 weights need "
                              f"their scales); export against the unquantized base model")
        module.fan_in_fan_out = module.fan_in_fan_out or module.name in layout.fan_in_fan_out \
            or key.removesuffix(".weight") in layout.fan_in_fan_out
        a_in, b_out = module.A.shape[1], module.B.shape[0]
        expected = (a_in, b_out) if module.fan_in_fan_out else (b_out, a_in)
        if len(info.shape) != 2 or tuple(info.shape) != expected:
            raise ExportError(
                f"adapter layer {module.name!r} (lora_A {list(module.A.shape)}, lora_B {list(module.B.shape)}) "
                f"does not fit base weight {key!r} of shape {list(info.shape)}: the adapter was trained on "
                f"another model than {repo_id}"
            )
        if module.magnitude is not None and module.magnitude.numel() != b_out:
            raise ExportError(f"adapter layer {module.name!r}: DoRA magnitude has {module.magnitude.numel()} "
                              f"entries, expected {b_out}")
        lora_by_key[key] = module
        if module.B_bias is not None:
            bkey = stored(runtime.removesuffix(".weight") + ".bias")
            if bkey is None:
                raise ExportError(f"adapter layer {module.name!r} has a LoRA bias but the base layer has no bias")
            bias_by_key[bkey] = module
    copies: dict[str, torch.Tensor] = {}
    overrides: dict[str, torch.Tensor] = {}
    for target, source in ((copies, ad.replacements), (overrides, ad.base_overrides)):
        for name, tensor in source.items():
            key = stored(name)
            if key is None:
                raise ExportError(f"adapter tensor {name!r} (modules_to_save) has no counterpart in the base model")
            if tuple(tensor.shape) != infos[key].shape and not (target is copies and grows_vocab(
                    key, tensor, infos[key], (in_key, out_key_model, _base_key(layout.output_embeddings or "",
                                                                                ".weight", infos)))):
                raise ExportError(f"adapter tensor {name!r} has shape {list(tensor.shape)} but the base's {key!r} "
                                  f"is {list(infos[key].shape)}")
            target[key] = tensor
    # -- a grown vocabulary (resize_vocab: exporter/vocab.py): the adapter's embeddings / head replace the base's
    grown = grown_rows(ad, copies, infos, in_key, out_key_model, layout.tied, reader.infos)
    token_by_key, token_grown = token_rows_plan(ad, stored, infos, in_key, out_key_model, layout.tied)
    if grown is not None and token_grown is not None:
        raise ExportError(f"{ad.weights_file}: the adapter grows the vocabulary twice (modules_to_save and "
                          f"trainable_token_indices)")
    grown = grown or token_grown

    # -- tied embeddings stay tied unless the adapter changes one of the two (LoRA or modules_to_save). Then the
    #    export unties them and writes the head on its own, from the *base* embedding plus the head's own update
    #    (if any): that is what base + adapter computes through peft, where the head keeps reading the base
    #    weight while the embedding gets its LoRA. (peft's merge_and_unload writes into the shared tensor and so
    #    changes both; peft warns about it, huggingface/peft#2777.)
    untie_from: str | None = None
    untie = False
    drop: set[str] = set()
    if layout.tied and in_key and out_key_model:
        out_key = _base_key(layout.output_embeddings, ".weight", reader.infos) or out_key_model
        out_touched = out_key in lora_by_key or out_key in copies
        in_touched = in_key in lora_by_key or in_key in copies
        if out_touched or in_touched:
            untie, untie_from = True, in_key
            changed = " and ".join(k for k, t in ((in_key, in_touched), (out_key_model, out_touched)) if t)
            warnings.append(f"the adapter changes {changed} of a model with tied embeddings: the export unties "
                            f"them (tie_word_embeddings=false), as base + adapter computes")
        elif out_key in reader.infos and out_key != in_key:
            drop.add(out_key)  # stored although tied: not written, the tie recreates it

    def out_info(info: TensorInfo) -> TensorInfo:
        shape = (grown.rows, info.shape[1]) if grown is not None and info.name in grown.keys else info.shape
        return TensorInfo(info.name, out_dtype if info.dtype.is_floating_point else info.dtype, shape)

    plan: list[TensorInfo] = []
    for file in reader.files:
        plan += [out_info(reader.infos[k]) for k in reader.keys_in(file) if k not in drop]
    if untie_from is not None:
        untie_key = _base_key(layout.output_embeddings, ".weight", reader.infos) or out_key_model
        if untie_key in {p.name for p in plan}:
            untie_from = None  # stored in the checkpoint: merged in place
        else:
            plan.append(out_info(TensorInfo(untie_key, out_dtype, reader.infos[in_key].shape)))
    total = sum(p.nbytes for p in plan)
    ensure_free_space(output.parent if output.parent.exists() else Path.cwd(), total + (64 << 20), "the export")

    # QLoRA (issue 19): --merge-into dequantized merges into dequant(quant(W)) of every weight bitsandbytes quantized
    quant_record, merge_into = quant
    requant: set[str] = set()
    if merge_into == "dequantized":
        from exporter.quant import meta_quantized_names

        requant = {k for k in (stored(n + ".weight") for n in meta_quantized_names(base_dir, trust_remote_code))
                   if k is not None and k not in drop}
    lineage = _read_lineage(ad)
    dtype_name = str(out_dtype).removeprefix("torch.")
    meta = _meta(ad, "merged", base_dir, repo_id, commit, dtype_name, lineage)
    meta["base"]["recorded_by_adapter"] = recorded_base
    if quant_record is not None:  # QLoRA (issue 19): what the adapter was trained over, and where it was merged
        meta["quantization"] = {**quant_record, "merge_into": merge_into, "dequantized_weights": len(requant)}
    from tqdm import tqdm

    with atomic_directory(output, overwrite=overwrite) as tmp, \
            tqdm(total=total, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar:
        with ShardedSafetensorsWriter(tmp, plan, shard_limit) as writer:
            untie_source: torch.Tensor | None = None
            fused_parts: dict[str, dict[str, torch.Tensor]] = {}
            for file in reader.files:
                with reader.open(file) as shard:
                    for key in reader.keys_in(file):
                        if key in drop:
                            continue
                        info = reader.infos[key]
                        if shard.locate is not None and key not in overrides and key not in copies \
                                and key != untie_from and key not in fused_by_key and key not in lora_by_key \
                                and key not in bias_by_key and key not in token_by_key and key not in requant \
                                and (out_dtype == info.dtype
                                                                or not info.dtype.is_floating_point):
                            writer.copy(key, *shard.locate(key))  # unchanged: bytes copied, never a tensor
                            bar.update(info.nbytes)
                            continue
                        tensor = overrides[key] if key in overrides else shard.get(key)
                        if key == untie_from:
                            untie_source = tensor
                        tensor = copies.get(key, tensor)
                        if key in requant:  # --merge-into dequantized (exporter/quant.py)
                            from trainer.quant import quant_dequant

                            tensor = quant_dequant(tensor, quant_record)
                        if key in token_by_key:  # peft trainable_token_indices: trained rows replace the base's
                            tensor = apply_token_rows(tensor, *token_by_key[key], grown.rows if grown else 0)
                        if key in fused_by_key:
                            tensor = _fused_part(key, fused_by_key[key], fused_modules, fused_parts, km) \
                                .add_(tensor.float())
                        elif key in lora_by_key:
                            m = lora_by_key[key]
                            tensor = merge_weight(tensor, m.A, m.B, m.scaling, fan_in_fan_out=m.fan_in_fan_out,
                                                  magnitude=m.magnitude)
                        elif key in bias_by_key:
                            m = bias_by_key[key]
                            tensor = merge_bias(tensor, m.B_bias, m.scaling)
                        if tensor.dtype.is_floating_point:
                            tensor = tensor.to(out_dtype)
                            # the adapter is checked finite on load and float32 / bfloat16 share float32's range, so
                            # only float16 (max 65504) can overflow here
                            if out_dtype == torch.float16 and (key in lora_by_key or key in bias_by_key
                                                               or key in fused_by_key) \
                                    and not bool(torch.isfinite(tensor).all()):
                                raise ExportError(f"merged {key!r} overflows float16 (|w| > 65504): export with "
                                                  f"--dtype bfloat16 or float32")
                        writer.write(key, tensor)
                        bar.update(tensor.numel() * tensor.element_size())
                        del tensor
            if untie_from is not None:
                m = lora_by_key.get(untie_key)
                if untie_key in copies:
                    tensor = copies[untie_key]
                elif m is not None:
                    tensor = merge_weight(overrides.get(untie_key, untie_source), m.A, m.B, m.scaling,
                                          fan_in_fan_out=m.fan_in_fan_out, magnitude=m.magnitude)
                else:
                    tensor = untie_source
                writer.write(untie_key, tensor.to(out_dtype))
                untie_source = None
            known = writer.close()

        # -- config, generation config, tokenizer, remote code, card, lineage
        new_config = dict(raw_config)
        new_config.pop("quantization_config", None)
        new_config["dtype"] = dtype_name
        if "torch_dtype" in new_config:
            new_config["torch_dtype"] = dtype_name
        if grown is not None:
            set_vocab_size(new_config, grown.rows)
        if untie:
            new_config["tie_word_embeddings"] = False
            if isinstance(new_config.get("text_config"), dict):
                new_config["text_config"] = {**new_config["text_config"], "tie_word_embeddings": False}
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        for name in ("generation_config.json",):
            src = next((d / name for d in (ad.folder, base_dir) if (d / name).is_file()), None)
            if src is not None:
                shutil.copyfile(src, tmp / name)
        if grown is not None or read_vocab_record(ad.folder) is not None:
            meta["vocab"] = export_grown_tokenizer(ad.folder, tmp, base_dir, grown)
        else:
            _export_tokenizer(base_dir, ad.folder, tmp)
        for name in _PROCESSOR_FILES:  # a VLM's image / video processor: the base's when the adapter has none
            if (base_dir / name).is_file() and not (tmp / name).exists():
                shutil.copyfile(base_dir / name, tmp / name)
        for py in base_dir.glob("*.py"):
            shutil.copyfile(py, tmp / py.name)
        (tmp / "README.md").write_text(_model_card(meta, lineage, _base_license(base_dir)))
        meta["merged_layers"] = len(lora_by_key) + len(fused_modules)
        meta["replaced_tensors"] = len(copies)
        (tmp / EXPORT_RECORD).write_text(json.dumps(meta, indent=2) + "\n")
        files = _write_sums(tmp, known)

    return ExportReport(
        output=output, mode="merged", base=base_dir, base_repo_id=repo_id, base_revision=commit,
        adapter=ad.folder, adapter_sha256=ad.sha256, dtype=dtype_name,
        merged_layers=len(lora_by_key) + len(fused_modules),
        replaced_tensors=len(copies), shards=list(writer.names), total_bytes=total,
        seconds=time.perf_counter() - started, peak_rss_bytes=_peak_rss(), files=files, warnings=warnings,
    )


def _learn_layout(ad: Adapter, base_dir: Path, raw_config: dict[str, Any], reader: CheckpointReader,
                  infos: dict[str, TensorInfo], trust_remote_code: bool, fused_cfg: bool) -> tuple[Any, dict]:
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
        factors = {m.name: (tuple(m.A.shape), tuple(m.B.shape)) for m in ad.modules.values()}
        wrappers = layout.wrappers_from_shapes(km, ad.config, factors) if fused_cfg else {}

        def found(name: str) -> bool:
            return _base_key(name, "", infos) is not None or name in km.stored_of

        if wrappers is not None and all(m.name in wrappers or found(m.name + ".weight") for m in ad.modules.values()) \
                and all(found(n) for n in [*ad.replacements, *ad.base_overrides]) \
                and all(f"{_unwrapped(n)}.{p}" in km.groups or found(f"{_unwrapped(n)}.{p}")
                        for n, (p, _, _) in wrappers.items()):
            return km, wrappers
    model = layout.meta_model(base_dir, trust_remote_code)
    km = layout.key_map(model, list(reader.infos))
    return km, (layout.param_wrappers(model, ad.folder) if fused_cfg else {})


def _unwrapped(name: str) -> str:
    """A peft wrapper's module name without its ``.base_layer`` levels (the module that owns the parameter)."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def _fused_part(key: str, runtime: str, modules: dict[str, LoraModule], parts: dict[str, dict[str, torch.Tensor]],
                km: Any) -> torch.Tensor:
    """The float32 update of stored tensor ``key`` from the fused-expert LoRA on ``runtime``: the whole fused
    update is computed when the first of its stored tensors is reached, split with transformers' reversed
    converter, and each part is freed once written (peak: one fused parameter's update)."""
    if runtime not in parts:
        m = modules[runtime]
        delta = fused_expert_delta(m.A, m.B, m.scaling, m.num_experts, out_first=m.out_first)
        parts[runtime] = km.split_delta(runtime, delta) if runtime in km.groups else {key: delta}
    part = parts[runtime].pop(key)
    if not parts[runtime]:
        del parts[runtime]
    return part


def _export_adapter_only(ad: Adapter, output: Path, base: Any, *, overwrite: bool, started: float,
                         trust_remote_code: bool = False) -> ExportReport:
    """Re-export the adapter as safetensors + config, checked against the base when the base is installed."""
    warnings: list[str] = []
    try:
        base_dir, repo_id, commit = _resolve_base(ad, base)
    except NotInstalledError as exc:
        base_dir, repo_id, commit = None, ad.config.get("base_model_name_or_path"), ad.config.get("revision")
        warnings.append(f"base model not installed here, adapter shapes not checked against it ({exc})")
    recorded_base = {"repo_id": ad.config.get("base_model_name_or_path"), "revision": ad.config.get("revision")}
    if base_dir is not None:
        _refuse_overlap(output, base_dir, "base model")
        recorded_base, base_warning = _recorded_base_check(ad, base_dir, repo_id, commit)
        if base_warning:
            warnings.append(base_warning)
        try:
            reader = CheckpointReader(base_dir)  # safetensors headers only
        except (SourceError, ExportError) as exc:
            reader = None  # a pickle-only base is not unpickled just to check shapes
            warnings.append(f"adapter shapes not checked against the base ({exc})")
        if reader is not None:
            km = None
            if ad.config.get("target_parameters") or any(
                    _base_key(m.name, ".weight", reader.infos) is None for m in ad.modules.values()):
                from exporter.layout import (  # stored names differ from run-time names
                    key_map,
                    meta_model,
                )

                km = key_map(meta_model(base_dir, trust_remote_code), list(reader.infos))
            for module in ad.modules.values():
                if km is not None and (module.num_experts != 1 or ad.config.get("target_parameters")):
                    continue  # LoRA on parameters: peft checks their shapes when it loads the adapter
                key = _base_key(module.name, ".weight", reader.infos)
                if key is None and km is not None:
                    key = km.stored_of.get(module.name + ".weight")
                if key is None:
                    raise ExportError(f"adapter layer {module.name!r} has no weight in the base model {base_dir}")
                shape = reader.infos[key].shape
                if sorted(shape) != sorted((module.A.shape[1], module.B.shape[0])):
                    raise ExportError(f"adapter layer {module.name!r} does not fit base weight {key!r} {list(shape)}")
    if ad.config.get("use_dora"):
        warnings.append("DoRA adapter: vLLM's --lora-modules does not serve DoRA; export a merged model instead")
    lineage = _read_lineage(ad)
    meta = _meta(ad, "adapter-only", base_dir, repo_id, commit, None, lineage)
    meta["base"]["recorded_by_adapter"] = recorded_base
    from safetensors.torch import save_file

    with atomic_directory(output, overwrite=overwrite) as tmp:
        config = dict(ad.config)
        if repo_id and not config.get("base_model_name_or_path"):
            config["base_model_name_or_path"] = repo_id
        if commit and not config.get("revision"):
            config["revision"] = commit
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if ad.weights_file.suffix == ".safetensors":
            shutil.copyfile(ad.weights_file, tmp / ADAPTER_WEIGHTS)
        else:  # a trusted pickle adapter, converted
            state = load_file(ad.weights_file, allow_pickle=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS),
                      metadata={"format": "pt"})
        copy_tokenizer_files([ad.folder], tmp)
        (tmp / "README.md").write_text(_model_card(meta, lineage, _base_license(base_dir) if base_dir else None))
        (tmp / EXPORT_RECORD).write_text(json.dumps(meta, indent=2) + "\n")
        files = _write_sums(tmp)
    return ExportReport(
        output=output, mode="adapter-only", base=base_dir, base_repo_id=repo_id, base_revision=commit,
        adapter=ad.folder, adapter_sha256=ad.sha256, dtype=None, merged_layers=0, replaced_tensors=0, shards=[],
        total_bytes=sum((output / p).stat().st_size for p in files), seconds=time.perf_counter() - started,
        peak_rss_bytes=_peak_rss(), files=files, warnings=warnings,
    )


def _write_bundle(output: Path, report: ExportReport) -> Path:
    """Pack the export folder as a ferry bundle (a local-folder model, no wheels) into ``<output>.bundle/``:
    ``NAME/`` (the bundle directory) and ``NAME.ferry.tar``, NAME being the output folder's name. Returns the bundle directory."""
    from bundler.pack import pack
    from bundler.spec import load_spec

    name = re.sub(r"[^A-Za-z0-9._-]", "-", output.resolve().name).lstrip("._-") or "export"
    spec = load_spec(name=name, models=[str(output.resolve())], no_wheels=True)
    result = pack(spec, output.parent / f"{output.name}.bundle", progress=False)
    return result.bundle_dir


__all__ = ["Adapter", "ExportOptions", "ExportReport", "LoraModule", "export", "load_adapter"]
