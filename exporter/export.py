"""``ferry export``: merge a LoRA adapter into its base model, streaming, into sharded safetensors.

The merge never holds the model in memory: the base is read one tensor at a time, each weight that has a LoRA pair
becomes ``W + scaling · (B @ A)`` in float32 (DoRA: rescaled per output row) and is cast to the output dtype, and
every tensor is appended to its output file as soon as it is computed (:class:`exporter.io.ShardedSafetensorsWriter`,
:class:`exporter.merge.ShardMerge`); a tensor the adapter does not change (and whose dtype stays) is
copied as bytes through a small buffer, never built. Peak memory is the adapter plus the largest merged tensor (for
fused experts: one fused parameter's update), on top of torch and transformers' conversion code.

Output folder (written to a temp directory beside it, renamed when complete)::

    OUT/
    ├── model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
    ├── config.json                 the base's, dtype updated, quantization_config removed, RoPE scaled as trained
    ├── generation_config.json      the adapter folder's, else the base's
    ├── tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, ...
    │                               the base's tokenizer files byte for byte, and the chat template training
    │                               used (the adapter's chat_template.jinja)
    ├── README.md                   model card with lineage (base repo_id@commit, adapter sha256, training config,
    │                               datasets with sha256)
    ├── ferry_export.json           the same lineage, machine-readable (``ferry smoke`` reads it)
    ├── smoke_report.json           when the smoke check ran
    ├── SERVING.md                  vllm / llama-server / ollama commands for this folder (serving/guide.py)
    ├── value_head.safetensors      a reward model's (stage rm) value head, the adapter folder's, byte for byte
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

Modules: :mod:`exporter.options` holds what the export is asked to do (:class:`ExportOptions`);
:mod:`exporter.adapter` reads the adapter folder and finds the base; :mod:`exporter.layout` learns the base's stored
names against its run-time names from transformers; :mod:`exporter.plan` decides what happens to each stored tensor
(names and shapes only); :mod:`exporter.merge` streams the shards through that plan; :mod:`exporter.io` reads and
writes shards; :mod:`exporter.lora` is the LoRA algebra; :mod:`exporter.lineage` writes the card and
``ferry_export.json``; this module runs the steps in order. :mod:`exporter.smoke` depends on :mod:`exporter.adapter`
only, never on this module (``ExportOptions(smoke=True)`` runs it once the output is in place).

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
from exporter.io import CheckpointReader, ShardedSafetensorsWriter, copy_tokenizer_files, load_file, sha256_file
from exporter.lineage import _base_license, _meta, _model_card, _read_lineage, _recorded_base_check
from exporter.merge import ShardMerge
from exporter.options import ExportOptions
from exporter.plan import MergePlan, base_key, plan_merge, refuse_quantized, resolve_dtype
from exporter.vocab import export_grown_tokenizer, set_vocab_size
from ferry.adapter_folder import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHAT_TEMPLATE,
    EXPORT_RECORD,
    ROPE_RECORD,
    VALUE_HEAD_FILE,
    check_stacked,
    read_adapter_config,
    read_quant_record,
    read_rope_record,
    read_vocab_record,
)
from ferry.constants import apply_offline_env
from ferry.errors import ConfigError, ExportError, NotInstalledError, SmokeCheckError, SourceError
from ferry.faults import kill_point
from ferry.folder_lock import hold_name
from ferry.fsutil import (
    PRIVATE_UMASK,
    SHARED_UMASK,
    atomic_directory,
    atomic_write_text,
    ensure_free_space,
    format_bytes,
    host_write_error,
)

SUMS_NAME = "SHA256SUMS"
SMOKE_REPORT = "smoke_report.json"

#: A multi-modal model's processor configuration (transformers' processor / image / video processor files).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


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
        raise ExportError(
            f"--output {output} {relation} the {what} folder {folder}: the export would overwrite what "
            f"it reads; choose another output folder"
        )


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
            lines.append(
                f"  smoke     {verdict}: max |Δlogits| {self.smoke.get('max_abs_diff')}, "
                f"{self.smoke.get('tokens_per_second', 0):.1f} tok/s"
            )
        gguf = (self.smoke or {}).get("gguf")  # exporter.outputs: the GGUF's proof
        if gguf:
            verdict = "passed" if gguf["passed"] else "FAILED"
            lines.append(
                f"  gguf      {gguf['file']} ({gguf['gguf_type']}): {verdict}, "
                f"max |Δlogits| vs the merged weights {gguf['max_abs_diff']}, {gguf['weights_checked']} "
                f"weights proven"
            )
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
    """Turn a write error of the host (a full disk or quota, a folder made read-only or forbidden meanwhile) into
    one :class:`ExportError` line naming the file, and the free space where space ran out
    (:func:`ferry.fsutil.host_write_error`); the staged folder is already removed by ``atomic_directory``, so
    nothing half-written is left under ``output``'s name."""
    try:
        yield
    except OSError as exc:
        line = host_write_error(exc, f"the export to {output}", output.parent)
        if line is None:
            raise
        raise ExportError(f"{line}; nothing was left under that name") from None


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
            adapter or the base, GGUF refused before the merge (:func:`exporter.outputs.preflight`) or its
            converter failed; a write refused for space, quota or permission (one line naming the file, and the free
            space). Nothing is then left under ``output``'s name: the export is written, checked and summed in a
            staged folder that is renamed to ``output`` last.
        ConfigError: the adapter was trained on adapters merged into its base, which the base lacks.
        SourceError: pickle weights without ``allow_pickle``.
        NotInstalledError: the base model is not installed on this host.
        InsufficientSpaceError: the output file system is too small.
        SmokeCheckError: the smoke check ran and failed (the export is put in place all the same, with
            smoke_report.json, for inspection).
    """
    options = options or ExportOptions()
    # what the export writes is readable by every account (a serving engine's service account) unless asked private;
    # the process umask is set for the export alone, as ferry install sets it
    old_mask = os.umask(PRIVATE_UMASK if options.private else SHARED_UMASK)
    try:
        return _export(adapter, output, options)
    finally:
        os.umask(old_mask)


def _export(adapter: str | os.PathLike, output: str | os.PathLike, options: ExportOptions) -> ExportReport:
    """:func:`export` under the umask it chose."""
    apply_offline_env()
    started = time.perf_counter()
    output = Path(output)
    quant_record = _refuse_before_reading(Path(adapter), output, options)
    # serving outputs (GGUF, Modelfile, SERVING.md): refused up front, written after the merge (exporter.outputs)
    from exporter import outputs as serve_outputs

    converter = serve_outputs.preflight(options)
    check_stacked(adapter, options.base)  # an adapter trained on merged adapters needs them
    failed: SmokeCheckError | None = None
    # One export per output name at a time (a second one is refused in one line); everything is written, checked and
    # summed in a staged folder of the same name, renamed to ``output`` only then: an export whose smoke check or
    # GGUF did not finish (a full disk, a kill) is never in place.
    with (
        hold_name(output, "ferry export"),
        _refuse_existing(output, options.overwrite),
        _one_line_os_errors(output),
        atomic_directory(output, overwrite=options.overwrite, same_name=True, phase="export") as stage,
    ):
        with _merge_threads():
            ad = load_adapter(adapter, allow_pickle=options.allow_pickle)
            if options.adapter_only:
                report = _export_adapter_only(ad, output, stage, options, started)
            else:
                report = _export_merged(ad, output, stage, options, started, quant_record)
        kill_point("export:written")  # the weights and configs staged, not checked yet
        try:
            if options.smoke and not options.adapter_only:
                _smoke_check(report, options, stage)
            report.warnings += serve_outputs.finish(report, options, converter, folder=stage)
        except SmokeCheckError as exc:  # the check ran and failed: published with its report, for inspection
            failed = exc
        kill_point("export:checked")
        # shards keep the hashes computed while writing them; every other file (smoke_report.json gained "gguf")
        # is hashed again
        report.files = _write_sums(
            stage, {k: v for k, v in report.files.items() if k.endswith(".safetensors") and (stage / k).is_file()}
        )
        kill_point("export:summed")  # whole and checked, not renamed into place yet
    if failed is not None:
        raise failed
    if options.bundle:
        report.bundle = _write_bundle(output, report)
    return report


@contextlib.contextmanager
def _refuse_existing(output: Path, overwrite: bool) -> Iterator[None]:
    """Refuse an ``output`` that appeared since the first check (another export finished meanwhile)."""
    if output.exists() and not overwrite:
        raise ExportError(f"output {output} already exists (pass --overwrite to replace it)")
    yield


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


def _smoke_check(report: ExportReport, options: ExportOptions, stage: Path) -> None:
    """Run :func:`exporter.smoke.smoke` on the staged merged folder ``stage`` into ``report.smoke``; its report
    and messages name ``report.output``, where the folder is renamed once everything is written.

    Raises:
        SmokeCheckError: the check failed (smoke_report.json is written first).
    """
    from exporter.smoke import smoke

    result = smoke(
        stage,
        adapter=report.adapter,
        base=report.base,
        prompts=options.prompts,
        max_new_tokens=options.max_new_tokens,
        trust_remote_code=options.trust_remote_code,
        report_as=report.output,
    )
    report.smoke = result.to_dict()


def _read_base_config(base_dir: Path, options: ExportOptions) -> dict[str, Any]:
    """The base's config.json.

    Raises:
        ExportError: no config.json; custom code (``auto_map``) that the smoke check would run without
            ``trust_remote_code``.
    """
    config_path = base_dir / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{base_dir} has no config.json; is it a transformers model folder?")
    raw_config = json.loads(config_path.read_text())
    if raw_config.get("auto_map") and not options.trust_remote_code and options.smoke:
        raise ExportError(
            f"{base_dir} contains custom code (config.json auto_map), which the smoke check runs: pass "
            f"--trust-remote-code if you trust it (or --no-smoke)"
        )
    return raw_config


def _export_merged(
    ad: Adapter,
    output: Path,
    stage: Path,
    options: ExportOptions,
    started: float,
    quant_record: dict[str, Any] | None,
) -> ExportReport:
    """Plan the merge from names and shapes (:func:`exporter.plan.plan_merge`), stream the shards through it into
    the staged folder ``stage`` (:class:`exporter.merge.ShardMerge`), add the small files
    (:func:`_write_model_files`); :func:`export` checks, sums and renames it to ``output``."""
    base_dir, repo_id, commit = _resolve_base(ad, options.base)
    _refuse_overlap(output, base_dir, "base model")
    recorded_base, base_warning = _recorded_base_check(ad, base_dir, repo_id, commit)
    raw_config = _read_base_config(base_dir, options)
    reader = CheckpointReader(base_dir, allow_pickle=options.allow_pickle)
    refuse_quantized(base_dir, raw_config, reader)
    out_dtype = resolve_dtype(options.dtype, raw_config, reader)
    plan = plan_merge(
        ad,
        base_dir,
        raw_config,
        reader,
        out_dtype,
        trust_remote_code=options.trust_remote_code,
        repo_id=repo_id,
        merge_into=options.merge_into,
    )
    total = plan.total_bytes
    ensure_free_space(output.parent if output.parent.exists() else Path.cwd(), total + (64 << 20), "the export")

    lineage = _read_lineage(ad)
    dtype_name = str(out_dtype).removeprefix("torch.")
    meta = _meta(ad, "merged", base_dir, repo_id, commit, dtype_name, lineage)
    meta["base"]["recorded_by_adapter"] = recorded_base
    if quant_record is not None:  # QLoRA: what the adapter was trained over, and where it was merged
        meta["quantization"] = {
            **quant_record,
            "merge_into": options.merge_into,
            "dequantized_weights": len(plan.requant),
        }
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="merging", disable=not options.progress) as bar:
        with ShardedSafetensorsWriter(stage, plan.tensors, options.shard_limit) as writer:
            ShardMerge(plan, reader, writer, bar, quant_record).run()
            known = writer.close()
        _write_model_files(stage, ad, base_dir, raw_config, plan, meta, lineage)

    return ExportReport(
        output=output,
        mode="merged",
        base=base_dir,
        base_repo_id=repo_id,
        base_revision=commit,
        adapter=ad.folder,
        adapter_sha256=ad.sha256,
        dtype=dtype_name,
        merged_layers=plan.merged_layers,
        replaced_tensors=len(plan.copies),
        shards=list(writer.names),
        total_bytes=total,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=_peak_rss(),
        files=known,
        warnings=[*([base_warning] if base_warning else []), *plan.warnings],
    )


def _merged_config(raw_config: dict[str, Any], plan: MergePlan) -> dict[str, Any]:
    """The base's config.json as the merged model's: the output dtype, no quantization_config, the grown
    ``vocab_size``, ``tie_word_embeddings=false`` when the export unties the embeddings."""
    dtype_name = str(plan.out_dtype).removeprefix("torch.")
    config = dict(raw_config)
    config.pop("quantization_config", None)
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    if plan.grown is not None:
        set_vocab_size(config, plan.grown.rows)
    if plan.untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return config


def _write_model_files(
    tmp: Path,
    ad: Adapter,
    base_dir: Path,
    raw_config: dict[str, Any],
    plan: MergePlan,
    meta: dict[str, Any],
    lineage: dict[str, Any],
) -> None:
    """Everything of the merged folder beside the weights: config.json, generation_config.json (the adapter
    folder's, else the base's), the tokenizer (the grown one of an adapter that added tokens), a VLM's processor
    files, the base's remote code, the model card and ``ferry_export.json`` (``meta`` gains the counts)."""
    config = _merged_config(raw_config, plan)
    rope = read_rope_record(ad.folder)
    if rope is not None:  # rope_scaling: the merged model carries the RoPE its adapter was trained with
        from ferry.rope import scaled_config_dict

        config = scaled_config_dict(config, rope)
        meta["rope_scaling"] = rope.to_record()
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json",):
        src = next((d / name for d in (ad.folder, base_dir) if (d / name).is_file()), None)
        if src is not None:
            shutil.copyfile(src, tmp / name)
    if plan.grown is not None or read_vocab_record(ad.folder) is not None:
        meta["vocab"] = export_grown_tokenizer(ad.folder, tmp, base_dir, plan.grown)
    else:
        _export_tokenizer(base_dir, ad.folder, tmp)
    for name in _PROCESSOR_FILES:  # a VLM's image / video processor: the base's when the adapter has none
        if (base_dir / name).is_file() and not (tmp / name).exists():
            shutil.copyfile(base_dir / name, tmp / name)
    for py in base_dir.glob("*.py"):
        shutil.copyfile(py, tmp / py.name)
    _copy_value_head(ad, tmp, meta)
    (tmp / "README.md").write_text(_model_card(meta, lineage, _base_license(base_dir)))
    meta["merged_layers"] = plan.merged_layers
    meta["replaced_tensors"] = len(plan.copies)
    (tmp / EXPORT_RECORD).write_text(json.dumps(meta, indent=2) + "\n")


def _export_adapter_only(
    ad: Adapter, output: Path, stage: Path, options: ExportOptions, started: float
) -> ExportReport:
    """Re-export the adapter as safetensors + config into the staged folder ``stage`` (renamed to ``output`` by
    :func:`export`), checked against the base when the base is installed."""
    warnings: list[str] = []
    try:
        base_dir, repo_id, commit = _resolve_base(ad, options.base)
    except NotInstalledError as exc:
        base_dir, repo_id, commit = None, ad.config.get("base_model_name_or_path"), ad.config.get("revision")
        warnings.append(f"base model not installed here, adapter shapes not checked against it ({exc})")
    recorded_base = {"repo_id": ad.config.get("base_model_name_or_path"), "revision": ad.config.get("revision")}
    if base_dir is not None:
        _refuse_overlap(output, base_dir, "base model")
        recorded_base, base_warning = _recorded_base_check(ad, base_dir, repo_id, commit)
        warnings += [base_warning] if base_warning else []
        warnings += _check_adapter_shapes(ad, base_dir, options.trust_remote_code)
    if ad.config.get("use_dora"):
        warnings.append("DoRA adapter: vLLM's --lora-modules does not serve DoRA; export a merged model instead")
    lineage = _read_lineage(ad)
    meta = _meta(ad, "adapter-only", base_dir, repo_id, commit, None, lineage)
    meta["base"]["recorded_by_adapter"] = recorded_base
    config = dict(ad.config)
    if repo_id and not config.get("base_model_name_or_path"):
        config["base_model_name_or_path"] = repo_id
    if commit and not config.get("revision"):
        config["revision"] = commit
    (stage / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_adapter_weights(ad, stage / ADAPTER_WEIGHTS)
    _copy_value_head(ad, stage, meta)
    rope = read_rope_record(ad.folder)
    if rope is not None:  # the base must be loaded stretched under this adapter: the record goes with it
        shutil.copyfile(ad.folder / ROPE_RECORD, stage / ROPE_RECORD)
        meta["rope_scaling"] = rope.to_record()
        warnings.append(
            f"the adapter was trained with rope_scaling {rope.rope_type} (factor {rope.factor:g}, "
            f"max_position_embeddings {rope.max_position_embeddings}): whatever serves it must load the base with "
            f"those rope parameters ({ROPE_RECORD}); a merged export carries them in its config.json"
        )
    copy_tokenizer_files([ad.folder], stage)
    (stage / "README.md").write_text(_model_card(meta, lineage, _base_license(base_dir) if base_dir else None))
    (stage / EXPORT_RECORD).write_text(json.dumps(meta, indent=2) + "\n")
    files = _write_sums(stage)
    return ExportReport(
        output=output,
        mode="adapter-only",
        base=base_dir,
        base_repo_id=repo_id,
        base_revision=commit,
        adapter=ad.folder,
        adapter_sha256=ad.sha256,
        dtype=None,
        merged_layers=0,
        replaced_tensors=0,
        shards=[],
        total_bytes=sum((stage / p).stat().st_size for p in files),
        seconds=time.perf_counter() - started,
        peak_rss_bytes=_peak_rss(),
        files=files,
        warnings=warnings,
    )


def _check_adapter_shapes(ad: Adapter, base_dir: Path, trust_remote_code: bool) -> list[str]:
    """Check each LoRA layer's factors against its base weight (from the safetensors headers); returns a warning
    when the base's weights cannot be read that way (a pickle-only base is not unpickled just to check shapes).

    Raises:
        ExportError: a layer without a base weight, or whose factors do not fit it.
    """
    try:
        reader = CheckpointReader(base_dir)  # safetensors headers only
    except (SourceError, ExportError) as exc:
        return [f"adapter shapes not checked against the base ({exc})"]
    km = None
    if ad.config.get("target_parameters") or any(
        base_key(m.name, ".weight", reader.infos) is None for m in ad.modules.values()
    ):
        from exporter.layout import key_map, meta_model  # stored names differ from run-time names

        km = key_map(meta_model(base_dir, trust_remote_code), list(reader.infos))
    for module in ad.modules.values():
        if km is not None and (module.num_experts != 1 or ad.config.get("target_parameters")):
            continue  # LoRA on parameters: peft checks their shapes when it loads the adapter
        key = base_key(module.name, ".weight", reader.infos)
        if key is None and km is not None:
            key = km.stored_of.get(module.name + ".weight")
        if key is None:
            raise ExportError(f"adapter layer {module.name!r} has no weight in the base model {base_dir}")
        shape = reader.infos[key].shape
        lora_a, lora_b = module.pair()
        if sorted(shape) != sorted((lora_a.shape[1], lora_b.shape[0])):
            raise ExportError(f"adapter layer {module.name!r} does not fit base weight {key!r} {list(shape)}")
    return []


def _copy_value_head(ad: Adapter, dest: Path, meta: dict[str, Any]) -> None:
    """A reward model (stage rm): the adapter folder's value_head.safetensors goes beside the export's weights
    byte for byte (as LLaMA-Factory's export copies it), its sha256 into ``meta["value_head"]``."""
    source = ad.folder / VALUE_HEAD_FILE
    if source.is_file():
        shutil.copyfile(source, dest / VALUE_HEAD_FILE)
        meta["value_head"] = {"file": VALUE_HEAD_FILE, "sha256": sha256_file(dest / VALUE_HEAD_FILE)}


def _write_adapter_weights(ad: Adapter, dest: Path) -> None:
    """The adapter's weights as ``adapter_model.safetensors``: copied, or converted from a trusted pickle."""
    if ad.weights_file.suffix == ".safetensors":
        shutil.copyfile(ad.weights_file, dest)
        return
    from safetensors.torch import save_file

    state = load_file(ad.weights_file, allow_pickle=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest), metadata={"format": "pt"})


def _write_bundle(output: Path, report: ExportReport) -> Path:
    """Pack the export folder as a ferry bundle (a local-folder model, no wheels) into ``<output>.bundle/``:
    ``NAME/`` (the bundle directory) and ``NAME.ferry.tar``, NAME being the output folder's name. Returns the bundle
    directory."""
    from bundler.pack import pack
    from bundler.spec import load_spec

    name = re.sub(r"[^A-Za-z0-9._-]", "-", output.resolve().name).lstrip("._-") or "export"
    spec = load_spec(name=name, models=[str(output.resolve())], no_wheels=True)
    result = pack(spec, output.parent / f"{output.name}.bundle", progress=False)
    return result.bundle_dir


__all__ = ["Adapter", "ExportOptions", "ExportReport", "LoraModule", "export", "load_adapter"]
