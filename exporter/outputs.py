"""The outputs ``ferry export`` writes after the merge, each from the merged Hugging Face folder.

:func:`exporter.export.export` merges (or re-exports the adapter) and runs the HF smoke check; then
:func:`finish` adds, in the export folder:

* ``<name>-<type>.gguf`` (``formats`` has ``gguf``; :mod:`exporter.gguf`) and its proof under ``"gguf"`` in
  ``smoke_report.json``;
* ``Modelfile`` beside the GGUF (:mod:`exporter.ollama`);
* ``SERVING.md`` with the commands for everything in the folder (:mod:`serving.guide`), and for an adapter the
  vLLM LoRA fit as one line in the report's warnings.

``--format gguf`` alone keeps the folder's small files (config, tokenizer, card, lineage) and removes the
safetensors weights once the GGUF is written and proven. :func:`preflight` runs before the merge, so that a missing
converter or quantizer is refused before minutes of merging. Both read :class:`exporter.options.ExportOptions`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferry.adapter_folder import read_adapter_config, read_rope_record
from ferry.errors import ExportError
from ferry.fsutil import atomic_write_text

if TYPE_CHECKING:
    from exporter.options import ExportOptions


def preflight(options: ExportOptions) -> Path | None:
    """Refuse what cannot be done before the merge starts; returns the converter folder when GGUF is asked
    (``options.formats``), else None.

    Raises:
        ExportError: GGUF with ``adapter_only``, an unknown GGUF type, no quantizer for a K-quant.
        NotInstalledError: the converter is not installed.
    """
    formats, gguf_type, llama_cpp_dir = options.formats, options.gguf_type, options.llama_cpp_dir
    if "gguf" not in formats:
        return None
    from exporter import gguf

    if options.adapter_only:
        raise ExportError("--format gguf needs the merged model: drop --adapter-only")
    gguf_type = gguf_type.lower()
    if gguf_type not in gguf.GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type}: use one of {', '.join(gguf.GGUF_TYPES)}")
    if gguf_type in gguf.K_QUANTS:
        gguf.k_quant_route(gguf_type, llama_cpp_dir)
    return gguf.find_converter(options.llama_cpp_source)


def finish(report: Any, options: ExportOptions, converter: Path | None, folder: Path | None = None) -> list[str]:
    """Write the further outputs into ``folder`` (default ``report.output``; :func:`exporter.export.export` passes
    its staged folder, which has the output's name and becomes ``report.output`` once everything is written;
    ``report``: the :class:`exporter.export.ExportReport` of the merge; module docstring) as ``options`` ask
    (``formats``, ``gguf_type``, ``llama_cpp_dir``; ``smoke``: prove the GGUF with ``prompts``), ``converter`` from
    :func:`preflight`; returns notes for the report. SERVING.md and the messages name ``report.output``; a failed
    conversion's log goes beside it (``.NAME-TYPE.gguf.convert.log``), since a failed export leaves no folder.

    Raises:
        ExportError: the converter failed (one line).
        SmokeCheckError: the GGUF's proof failed (smoke_report.json written first).
    """
    from serving import guide, vllm_lora

    shown: Path = report.output
    output: Path = folder if folder is not None else shown
    notes: list[str] = []
    gguf_files: list[Path] = []
    if report.mode == "merged" and "gguf" in options.formats:
        from exporter import gguf, ollama

        path, gguf_report, times = gguf.write_gguf(
            output,
            output,
            options.gguf_type,
            converter=converter,
            llama_cpp_dir=options.llama_cpp_dir,
            check=options.smoke,
            prompts=options.prompts,
            trust_remote_code=options.trust_remote_code,
            log_dir=shown.parent if folder is not None else None,
        )
        gguf_files.append(path)
        _, modelfile_notes = ollama.write_modelfile(output, path, trust_remote_code=options.trust_remote_code)
        notes += modelfile_notes
        if gguf_report is not None:
            smoke_path = output / "smoke_report.json"
            data = json.loads(smoke_path.read_text()) if smoke_path.is_file() else {}
            data["gguf"] = {**gguf_report.to_dict(), "times": times}
            atomic_write_text(smoke_path, json.dumps(data, indent=2) + "\n")
            if report.smoke is not None:
                report.smoke["gguf"] = data["gguf"]
            notes += [f"GGUF: {w}" for w in gguf_report.warnings]
            gguf.raise_if_failed(gguf_report, shown)
        if "hf" not in options.formats:
            for weights in [*output.glob("model*.safetensors"), output / "model.safetensors.index.json"]:
                if weights.is_file():
                    weights.unlink()
    adapter_config, rope = None, None
    if report.mode == "adapter-only":
        adapter_config, rope = read_adapter_config(output) or {}, read_rope_record(output)
        fit = vllm_lora.vllm_lora_fit(adapter_config, rope=rope)
        notes.append(fit.line("the merged model (ferry export without --adapter-only)"))
    guide.write_serving(
        output,
        shown_as=shown,
        mode=report.mode,
        base_repo_id=report.base_repo_id,
        base_path=report.base,
        adapter_config=adapter_config,
        gguf_files=gguf_files,
        has_hf="hf" in options.formats,
        rope=rope,
    )
    return notes


__all__ = ["finish", "preflight"]
