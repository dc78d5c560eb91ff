"""What ``ferry export`` is asked to do, as one pydantic model (after mergekit's ``MergeOptions``).

:class:`ExportOptions` is the single source of every export option: :func:`exporter.export.export` takes it,
``ferry export`` generates its flags from it (:mod:`ferry.cli.flags`: names, defaults, help, choices and limits
come from the fields below), and LLaMA-Factory's merge YAML is read into it (:mod:`exporter.lf_merge`: the YAML's
keys, then the flags given on the command line on top).

Values are normalised when the model is built, so the export never parses strings again: ``dtype`` aliases
(``bf16``, ``fp16``, a ``torch.dtype``) become one of the four names; ``formats`` ``"gguf,hf"`` becomes
``("hf", "gguf")``; paths are strings. (``gguf_type`` is checked by :func:`exporter.outputs.preflight` when a GGUF
is asked for.) A value the exporter cannot use is refused
with the same one-line :class:`ferry.errors.ExportError` the command line shows (``--max-shard-size 5XB: ...``).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ferry.errors import ExportError
from ferry.flags import Flag
from ferry.fsutil import parse_size

#: The output dtypes of floating-point weights (``auto``: the base's).
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
#: Other spellings of :data:`DTYPE_NAMES` that library callers may pass.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

#: What an export may write: sharded safetensors (``hf``), a GGUF with an Ollama Modelfile (``gguf``).
FORMATS = ("hf", "gguf")

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Format = Literal["hf", "gguf"]


def parse_formats(formats: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"hf,gguf"`` / ``["gguf"]`` -> ``("hf", "gguf")`` (ordered as :data:`FORMATS`, unique); None -> ``("hf",)``.

    Raises:
        ExportError: an unknown format or none.
    """
    if formats is None:
        return ("hf",)
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    names = [f.strip().lower() for f in items if f.strip()]
    bad = [f for f in names if f not in FORMATS]
    if bad or not names:
        raise ExportError(f"--format {','.join(items)}: use hf, gguf or hf,gguf")
    return tuple(f for f in FORMATS if f in names)


class ExportOptions(BaseModel):
    """How to merge an adapter into its base and what to write (every field is a ``ferry export`` flag of the
    same name, ``_`` spelled ``-``; ``prompts`` is ``--prompt``, ``formats`` ``--format``).

    Sizes in bytes (or a size string), token counts in tokens. Immutable: derive a variant with
    ``options.model_copy(update={...})``.

    Raises:
        ExportError: an unknown dtype, an unreadable ``max_shard_size``, an unknown format (the line the command
            line shows).
        pydantic.ValidationError: any other bad value (a wrong type, ``max_new_tokens`` < 1, an unknown
            ``merge_into`` or field name).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- the base and the merged folder
    base: Annotated[str | None, Flag(metavar="MODEL")] = Field(
        default=None,
        description="Base model folder or installed repo id [default: the adapter's base_model_name_or_path].",
    )
    dtype: Dtype = Field(
        default="auto", description="Output dtype of floating-point weights (the merge is computed in float32)."
    )
    max_shard_size: str | int = Field(
        default="5GB", description="Largest output shard (5GB = 5*10^9 bytes, 500MiB binary)."
    )
    # -- the smoke check
    smoke: bool = Field(
        default=True,
        description="Check the merged model against base + adapter through peft (logits, generation, tokens/s).",
    )
    prompts: Annotated[list[str] | None, Flag(name="prompt", repeat=True)] = Field(
        default=None, description="Prompt for the smoke check (repeatable) [default: a few built-in ones]."
    )
    max_new_tokens: int = Field(default=32, ge=1, description="Greedy tokens generated per prompt by the smoke check.")
    # -- what to write, and what to accept
    adapter_only: bool = Field(
        default=False, description="Re-export only the adapter (PEFT format) for vLLM --lora-modules."
    )
    bundle: bool = Field(
        default=False, description="Also write the export as a ferry bundle to carry back across the gap."
    )
    allow_pickle: bool = Field(
        default=False, description="Accept pickle weights (*.bin), which can run code when loaded."
    )
    overwrite: bool = Field(default=False, description="Replace an existing output folder.")
    private: bool = Field(
        default=False,
        description="Readable by this account only (folders 0700, files 0600); default: by every account (0755/0644), "
        "so that a serving engine's service account can read the export.",
    )
    trust_remote_code: bool = Field(default=False, description="Allow the base model's own Python code to run.")
    progress: Annotated[bool, Flag(cli=False)] = Field(
        default=False, description="Show a progress bar (bytes written) on stderr; the command line always does."
    )
    # -- serving outputs (exporter/outputs.py): GGUF for llama.cpp / Ollama, Modelfile, SERVING.md
    formats: Annotated[tuple[Format, ...], Flag(name="format", metavar="hf|gguf|hf,gguf")] = Field(
        default=("hf",),
        description="What to write: sharded safetensors (hf), a GGUF with an Ollama Modelfile (gguf), or both.",
    )
    gguf_type: str = Field(
        default="bf16",
        description="GGUF type: bf16, f16, q8_0, f32 (llama.cpp's converter) or a K-quant such as q4_k_m.",
    )
    llama_cpp_source: Annotated[str | None, Flag(existing="path")] = Field(
        default=None,
        description="llama.cpp's converter: a source folder or llama_cpp_python-0.3.36.tar.gz [default: installed].",
    )
    llama_cpp_dir: Annotated[str | None, Flag(existing="dir")] = Field(
        default=None, description="A llama.cpp build with llama-quantize, for K-quants without llama-cpp-python."
    )
    merge_into: Literal["original", "dequantized"] = Field(
        default="original",
        description="QLoRA adapters: merge into the original full-precision weights, or into "
        "dequant(quant(W)) as training saw them.",
    )

    @field_validator("base", "llama_cpp_source", "llama_cpp_dir", mode="before")
    @classmethod
    def _path_text(cls, value: Any) -> Any:
        """A ``pathlib.Path`` (or any ``os.PathLike``) as its text."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """``bf16`` / ``torch.bfloat16`` -> ``bfloat16``."""
        name = value if isinstance(value, str) else str(value).removeprefix("torch.")
        name = DTYPE_ALIASES.get(name, name)
        if name not in DTYPE_NAMES:
            raise ExportError(f"unknown dtype {value!r}: use auto, bfloat16, float16 or float32")
        return name

    @field_validator("max_shard_size")
    @classmethod
    def _readable_size(cls, value: str | int) -> str | int:
        try:
            parse_size(value)
        except ValueError as exc:
            raise ExportError(f"--max-shard-size: {exc}") from None
        return value

    @field_validator("formats", mode="before")
    @classmethod
    def _format_names(cls, value: Any) -> Any:
        """``"gguf,hf"`` / ``["gguf"]`` -> ``("hf", "gguf")`` / ``("gguf",)`` (:func:`parse_formats`)."""
        return parse_formats(value)

    @property
    def shard_limit(self) -> int:
        """``max_shard_size`` in bytes."""
        return parse_size(self.max_shard_size)


__all__ = ["DTYPE_ALIASES", "DTYPE_NAMES", "FORMATS", "Dtype", "ExportOptions", "Format", "parse_formats"]
