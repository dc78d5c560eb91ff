"""CLI commands ``ferry export`` and ``ferry smoke``: thin click wrappers over :func:`exporter.export.export` and
:func:`exporter.smoke.smoke`. Owned by the export area; see ferry/cli.py."""

from __future__ import annotations

import json

import click

from ferry.constants import apply_offline_env


@click.command("export")
@click.argument("config", required=False, type=click.Path(exists=True, dir_okay=False))  # LLaMA-Factory merge YAML
@click.option("--adapter", "adapter", default=None, type=click.Path(exists=True, file_okay=False),
              help="PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).")
@click.option("--base", default=None, metavar="MODEL",
              help="Base model folder or installed repo id [default: the adapter's base_model_name_or_path].")
@click.option("--output", "-o", default=None, type=click.Path(file_okay=False), help="Folder to create.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Output dtype of floating-point weights (the merge is computed in float32).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest output shard (5GB = 5*10^9 bytes, 500MiB binary).")
@click.option("--smoke/--no-smoke", default=True, show_default=True,
              help="Check the merged model against base + adapter through peft (logits, generation, tokens/s).")
@click.option("--prompt", "prompts", multiple=True, help="Prompt for the smoke check (repeatable).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="Greedy tokens generated per prompt by the smoke check.")
@click.option("--adapter-only", is_flag=True, help="Re-export only the adapter (PEFT format) for vLLM --lora-modules.")
@click.option("--bundle", is_flag=True, help="Also write the export as a ferry bundle to carry back across the gap.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle weights (*.bin), which can run code when loaded.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the base model's own Python code to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
# serving outputs (exporter/outputs.py): GGUF for llama.cpp / Ollama, Modelfile, SERVING.md
@click.option("--format", "formats", default="hf", show_default=True, metavar="hf|gguf|hf,gguf",
              help="What to write: sharded safetensors (hf), a GGUF with an Ollama Modelfile (gguf), or both.")
@click.option("--gguf-type", default="bf16", show_default=True,
              help="GGUF type: bf16, f16, q8_0, f32 (llama.cpp's converter) or a K-quant such as q4_k_m.")
@click.option("--llama-cpp-source", default=None, type=click.Path(exists=True),
              help="llama.cpp's converter: a source folder or llama_cpp_python-0.3.36.tar.gz [default: installed].")
@click.option("--llama-cpp-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="A llama.cpp build with llama-quantize, for K-quants without llama-cpp-python.")
@click.option("--merge-into", default="original", show_default=True, type=click.Choice(["original", "dequantized"]),
              help="QLoRA adapters: merge into the original full-precision weights, or into dequant(quant(W)) as "
                   "training saw them.")
def export_command(config, adapter, base, output, dtype, max_shard_size, smoke, prompts, max_new_tokens, adapter_only,
                   bundle, allow_pickle, overwrite, trust_remote_code, as_json, formats, gguf_type, llama_cpp_source,
                   llama_cpp_dir, merge_into) -> None:
    """Merge a LoRA adapter into its base model (streaming, sharded safetensors), offline.

    CONFIG: LLaMA-Factory's merge YAML (model_name_or_path, adapter_name_or_path, export_dir, export_size, ...);
    flags given as well win over its keys (exporter/lf_merge.py)."""
    apply_offline_env()
    from exporter.export import export

    if config is not None:  # LLaMA-Factory's merge YAML (issue 22)
        from exporter.lf_merge import export_from_config

        ctx = click.get_current_context()
        given = {k for k in ("dtype", "max_shard_size", "trust_remote_code")
                 if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}

        def export(adapter, output, base, **kwargs):  # flags given win over the YAML's keys
            for key in ("dtype", "max_shard_size", "trust_remote_code"):
                if key not in given:
                    kwargs.pop(key)
            return export_from_config(config, adapter=adapter, base=base, output=output, **kwargs)
    elif adapter is None or output is None:
        raise click.UsageError("give --adapter and --output, or a LLaMA-Factory merge YAML")
    report = export(
        adapter, output, base, dtype=dtype, max_shard_size=max_shard_size, smoke=smoke,
        prompts=list(prompts) or None, max_new_tokens=max_new_tokens, adapter_only=adapter_only, bundle=bundle,
        allow_pickle=allow_pickle, overwrite=overwrite, trust_remote_code=trust_remote_code, progress=True,
        formats=formats, gguf_type=gguf_type, llama_cpp_source=llama_cpp_source, llama_cpp_dir=llama_cpp_dir,
        merge_into=merge_into,
    )
    click.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else report.summary())


@click.command("smoke")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--adapter", default=None, type=click.Path(exists=True, file_okay=False),
              help="Adapter the model was merged from [default: the one recorded in ferry_export.json].")
@click.option("--base", default=None, metavar="MODEL", help="Base model folder or installed repo id.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt to check (repeatable).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="Greedy tokens generated per prompt.")
@click.option("--require-eos", is_flag=True, help="Fail when no prompt reaches EOS within --max-new-tokens.")
@click.option("--device", default=None, help="cuda, cuda:1, cpu [default: cuda when available].")
@click.option("--report/--no-report", default=True, show_default=True,
              help="Write MODEL_DIR/smoke_report.json (--no-report for a read-only model folder).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def smoke_command(model_dir, adapter, base, prompts, max_new_tokens, require_eos, device, report, trust_remote_code,
                  as_json) -> None:
    """Check an exported model offline: logits vs base + adapter, greedy generation, tokens/s."""
    apply_offline_env()
    from exporter.smoke import smoke

    result = smoke(model_dir, adapter, base, prompts=list(prompts) or None, max_new_tokens=max_new_tokens,
                   device=device, require_eos=require_eos, write_report=report, trust_remote_code=trust_remote_code)
    click.echo(json.dumps(result.to_dict(), indent=2, default=str) if as_json else result.summary())


COMMANDS: list = [export_command, smoke_command]
