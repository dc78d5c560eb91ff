"""GGUF for llama.cpp and Ollama: the merged Hugging Face folder converted by llama.cpp's own converter, then proven.

The converter is never written here and never fetched or compiled at run time. llama.cpp's
``convert_hf_to_gguf.py`` (with its ``conversion/`` package and its own, newer ``gguf-py``) is vendored in the
llama-cpp-python source distribution on PyPI; ferry pins one release of it (:data:`SDIST`), ``ferry pack`` carries
that file when the spec asks for GGUF, ``ferry install`` places it in the prefix, and this module extracts the three
members the converter needs into ferry's cache, once, after checking the file's sha256::

    PREFIX/tools/llama_cpp_python-0.3.36.tar.gz           carried by the bundle (or --llama-cpp-source FILE|DIR)
    ~/.cache/ferry/llama.cpp/<sha256>/                     extracted once (atomic rename), read-only afterwards
    ├── convert_hf_to_gguf.py
    ├── conversion/ ...
    └── gguf-py/gguf/ ...

The converter runs as a subprocess of ferry's own Python (it needs torch, transformers, numpy, safetensors, PyYAML,
sentencepiece and protobuf: ferry's ``gguf`` extra) with ferry's offline variables set; its log is kept, and a
failure becomes one line naming what it did not know (a tokenizer's pre-tokenizer, an architecture, a tensor).

Types: the converter writes ``f32``, ``f16``, ``bf16`` and ``q8_0`` itself (:data:`CONVERTER_TYPES`). K-quants
(``q4_k_m`` and friends, :data:`K_QUANTS`) need llama.cpp's C++ quantizer: an importable llama-cpp-python
(``llama_cpp.llama_model_quantize``) or ``llama_cpp_dir`` holding a ``llama-quantize`` binary; without either the
export refuses up front with the one command that does it (``ollama create --quantize``, from the bf16 GGUF).

Proof (:func:`check_gguf`, written under ``"gguf"`` in ``smoke_report.json``):

1. **Static**, with the ``gguf`` package's reader: architecture, block count and embedding length against
   config.json, the token embedding's shape, vocabulary size (= the model's embedding rows, >= the tokenizer's
   length), EOS id in generation_config's EOS ids, ``tokenizer.chat_template`` equal to the export's chat template,
   ``general.file_type`` the one asked.
2. **Weights and logits**, with transformers as an independent reader (``from_pretrained(..., gguf_file=...)``,
   which de-quantizes through the ``gguf`` package): every parameter must equal the merged model's parameter rounded
   to one of the tensor types the file holds (F32 exactly; BF16 / F16 by rounding; Q8_0 by the ``gguf`` package's
   quantize + dequantize), to 1e-6 relative. Then the merged model's architecture is given those very weights (the
   *ideal* model); the GGUF model's logits on the smoke prompts must equal the ideal's within the float32 bound of
   :mod:`exporter.smoke` (``1e-4 + 1e-4 · max |logits|``), and its greedy tokens must be the ideal's. The distance
   from the unrounded merged model (the type's rounding noise) and whether its greedy tokens agree are reported.
   A hyper-parameter the converter lost (RoPE base, norm epsilon, tied head) shows there even when the weights
   are right. K-quant files (which the ``gguf`` package cannot write) get the logit distance and greedy agreement
   reported, not the weight identity.
3. **llama.cpp itself**, when llama-cpp-python is importable: its tokenizer's ids for each rendered prompt equal
   the HF tokenizer's, and its greedy tokens (from the HF ids) equal the ideal model's for f32 / f16 (reported for
   bf16, whose matmuls round the activations to bf16 too). Static warnings name the two ways llama.cpp's
   tokenizer is known to split text otherwise (:func:`_tokenizer_warnings`), so an export without llama.cpp
   still says so in one line each.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ferry.adapter_folder import read_export_record
from ferry.constants import apply_offline_env, ferry_cache_dir, ferry_home
from ferry.errors import ConfigError, ExportError, NotInstalledError, SmokeCheckError
from ferry.fsutil import sha256_file
from ferry.serving_tools import CONVERTER_REQUIREMENTS, SDIST, TOOLS_DIR  # noqa: F401 - re-exported

#: What the converter needs from the sdist.
CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
#: Types the converter writes itself (its ``--outtype``).
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
#: Types that need llama.cpp's C++ quantizer (names as llama-quantize spells them, lower case).
K_QUANTS = (
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_0",
    "q4_1",
    "q4_k_s",
    "q4_k_m",
    "q5_0",
    "q5_1",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
)
GGUF_TYPES = CONVERTER_TYPES + K_QUANTS

#: Relative tolerance of the weight identity (float32 re-arithmetic in the readers, e.g. Gemma's norm + 1 - 1).
WEIGHT_RTOL = 1e-6
#: float32 logits bound, as in exporter.smoke: max |Δ| <= ATOL + RTOL · max |reference|.
FP32_ATOL, FP32_RTOL = 1e-4, 1e-4


# --------------------------------------------------------------------------------------------------- converter
def _candidates(source: str | os.PathLike | None) -> list[Path]:
    if source is not None:
        return [Path(source).expanduser()]
    found = []
    home = ferry_home()
    if home is not None:
        found.append(home / TOOLS_DIR / SDIST.filename)
    found.append(Path(sys.prefix) / TOOLS_DIR / SDIST.filename)  # the prefix's venv is PREFIX/venvs/ID
    found.append(Path(sys.prefix).parent.parent / TOOLS_DIR / SDIST.filename)
    return found


def find_converter(source: str | os.PathLike | None = None) -> Path:
    """The folder holding llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``.

    ``source``: a llama.cpp source folder, or the pinned sdist file (or a folder holding it); default: the sdist
    in ``$FERRY_HOME/tools`` (where ``ferry install`` puts it). An sdist is checked against :data:`SDIST`'s sha256
    and its converter extracted once into ``<ferry cache>/llama.cpp/<sha256>/``.

    Raises:
        NotInstalledError: nothing found (the line says how to carry it: ``ferry pack --extra gguf``).
        ExportError: an sdist with another sha256, or a folder without the converter.
    """
    for path in _candidates(source):
        if path.is_dir() and (path / "convert_hf_to_gguf.py").is_file():
            return path
        if path.is_dir() and (path / SDIST.filename).is_file():
            path = path / SDIST.filename
        if path.is_file():
            return _extract(path)
        if source is not None:
            raise ExportError(
                f"--llama-cpp-source {path}: neither a llama.cpp folder with convert_hf_to_gguf.py nor {SDIST.filename}"
            )
    raise NotInstalledError(
        f"llama.cpp's converter is not installed: pack it with `ferry pack SPEC --extra gguf` (or `serving: [gguf]` "
        f"in the spec) and install the bundle, or pass --llama-cpp-source {SDIST.filename}"
    )


def _extract(sdist: Path) -> Path:
    target = ferry_cache_dir() / "llama.cpp" / SDIST.sha256
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    digest = sha256_file(sdist)
    if digest != SDIST.sha256:
        raise ExportError(
            f"{sdist}: sha256 {digest} is not the pinned {SDIST.project} {SDIST.version} "
            f"({SDIST.sha256}); ferry runs only the converter it was tested with"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for info in tar:
                rel = info.name[len(SDIST.llama_cpp) :] if info.name.startswith(SDIST.llama_cpp) else None
                if rel is None or not info.isfile() or not rel.startswith(CONVERTER_MEMBERS) or ".." in rel.split("/"):
                    continue
                dest = staging / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                member = tar.extractfile(info)
                if member is None:
                    continue
                dest.write_bytes(member.read())
        if not (staging / "convert_hf_to_gguf.py").is_file():
            raise ExportError(f"{sdist} holds no {SDIST.llama_cpp}convert_hf_to_gguf.py")
        try:
            staging.rename(target)
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():  # another process's complete copy is fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def converter_env() -> dict[str, str]:
    """The converter's environment: this one with ferry's offline variables, the vendored gguf-py in use."""
    env = dict(os.environ)
    apply_offline_env(env)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def converter_command(
    converter: Path, model_dir: Path, outfile: Path, outtype: str, *, mmproj: bool = False
) -> list[str]:
    """The command line ferry runs (also what SERVING.md and the benchmark show); ``mmproj``: the vision part
    (llama.cpp's multimodal projector file) instead of the language model."""
    return [
        sys.executable,
        str(converter / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outfile",
        str(outfile),
        "--outtype",
        outtype,
        *(["--mmproj"] if mmproj else []),
    ]


def _converter_failure(log: str, model_dir: Path) -> str:
    """One line from the converter's log: what it did not know."""
    if "BPE pre-tokenizer was not recognized" in log:
        chk = re.search(r"chkhsh:\s*([0-9a-f]{64})", log)
        return (
            f"{model_dir}: llama.cpp's converter does not recognise this tokenizer (its BPE pre-tokenizer, "
            f"chkhsh {chk[1] if chk else '?'}, is not in {SDIST.project} {SDIST.version}'s list)"
        )
    m = re.search(r"Model (\S+) is not supported", log)
    if m:
        return (
            f"{model_dir}: llama.cpp's converter ({SDIST.project} {SDIST.version}) does not support architecture {m[1]}"
        )
    m = re.search(r"Can not map tensor '([^']+)'", log)
    if m:
        return f"{model_dir}: llama.cpp's converter cannot map tensor {m[1]!r} of this architecture"
    m = re.search(r"No module named '([^']+)'", log)
    if m:
        return (
            f"llama.cpp's converter needs the Python package {m[1]!r}: install ferry's gguf extra "
            f"(pip install 'llm-ferry[gguf]'; a bundle packed with --extra gguf carries it)"
        )
    m = re.search(r"FileNotFoundError: .*?(tokenizer\.model|File not found: \S+)", log)
    if m:
        return f"{model_dir}: llama.cpp's converter needs a file the tokenizer does not have ({m[1]})"
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return f"{model_dir}: llama.cpp's converter failed: {lines[-1] if lines else 'no output'}"


def convert(
    model_dir: str | os.PathLike,
    outfile: str | os.PathLike,
    outtype: str,
    *,
    converter: Path | None = None,
    log_file: Path | None = None,
    mmproj: bool = False,
) -> float:
    """Run llama.cpp's converter on a Hugging Face folder: ``outfile`` (written under a temp name, renamed when
    complete) in ``outtype`` (one of :data:`CONVERTER_TYPES`); ``mmproj``: the vision part (``--mmproj``). Returns
    the seconds it took.

    Raises:
        ExportError: one line from the converter's log (unknown tokenizer / architecture / tensor, a missing
            Python package); the full log is in ``log_file`` (default: beside ``outfile``, removed on success).
    """
    if outtype not in CONVERTER_TYPES:
        raise ExportError(f"the converter writes {', '.join(CONVERTER_TYPES)}, not {outtype!r}")
    converter = converter or find_converter()
    model_dir, outfile = Path(model_dir).resolve(), Path(outfile).absolute()
    tmp = outfile.with_name(f".{outfile.name}.partial")
    log_file = log_file or outfile.with_name(f"{outfile.name}.convert.log")
    started = time.perf_counter()
    with open(log_file, "w", encoding="utf-8") as log:
        proc = subprocess.run(
            converter_command(converter, model_dir, tmp, outtype, mmproj=mmproj),
            env=converter_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(outfile.parent),
            check=False,
        )
    seconds = time.perf_counter() - started
    if proc.returncode != 0 or not tmp.is_file():
        with contextlib.suppress(OSError):
            tmp.unlink()
        text = log_file.read_text(encoding="utf-8", errors="replace")
        raise ExportError(_converter_failure(text, model_dir) + f" (log: {log_file})")
    os.replace(tmp, outfile)
    with contextlib.suppress(OSError):
        log_file.unlink()
    return seconds


# --------------------------------------------------------------------------------------------------- K-quants
def k_quant_route(gguf_type: str, llama_cpp_dir: str | os.PathLike | None = None) -> tuple[str, Any]:
    """How a K-quant will be made: ``("llama_cpp", module)`` (an importable llama-cpp-python) or
    ``("binary", path to llama-quantize)``.

    Raises:
        ExportError: neither is here; the line gives the command that does it with Ollama from the bf16 GGUF.
    """
    if llama_cpp_dir is not None:
        base = Path(llama_cpp_dir).expanduser()
        for cand in (
            base / "llama-quantize",
            base / "bin" / "llama-quantize",
            base / "build" / "bin" / "llama-quantize",
        ):
            if cand.is_file() and os.access(cand, os.X_OK):
                return "binary", cand
        raise ExportError(f"--llama-cpp-dir {base}: no executable llama-quantize in it, bin/ or build/bin/")
    try:
        import llama_cpp  # noqa: PLC0415 - optional

        return "llama_cpp", llama_cpp
    except Exception:  # noqa: BLE001 - not installed, or its shared library does not load
        pass
    raise ExportError(
        f"--gguf-type {gguf_type} needs llama.cpp's quantizer (an installed llama-cpp-python, or --llama-cpp-dir with "
        f"llama-quantize); or export --gguf-type bf16 and run: ollama create NAME --quantize "
        f"{_ollama_spelling(gguf_type)} -f Modelfile"
    )


def _ollama_spelling(gguf_type: str) -> str:
    """``q4_k_m`` as ``ollama create --quantize`` spells it: ``q4_K_M``."""
    return re.sub(r"_k(_[sml])?$", lambda m: "_K" + (m[1] or "").upper(), gguf_type.lower())


def quantize(src: Path, dst: Path, gguf_type: str, route: tuple[str, Any]) -> float:
    """Quantize the GGUF ``src`` to ``gguf_type`` (a :data:`K_QUANTS` entry) into ``dst`` (temp name, renamed).
    Returns seconds.

    Raises:
        ExportError: the quantizer failed (its return code).
    """
    import gguf

    ftype = gguf.LlamaFileType["MOSTLY_" + gguf_type.upper()].value
    tmp = dst.with_name(f".{dst.name}.partial")
    started = time.perf_counter()
    kind, tool = route
    if kind == "llama_cpp":
        import ctypes

        params = tool.llama_model_quantize_default_params()
        params.ftype = ftype
        rc = tool.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    else:
        proc = subprocess.run(
            [str(tool), str(src), str(tmp), gguf_type.upper()], capture_output=True, text=True, check=False
        )
        rc = proc.returncode
    if rc != 0 or not tmp.is_file():
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ExportError(f"llama.cpp's quantizer failed on {src} -> {gguf_type} (return code {rc})")
    os.replace(tmp, dst)
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------------- the proof
@dataclass
class GgufReport:
    """What :func:`check_gguf` found. ``static``: the reader's facts; ``max_abs_diff``: largest |GGUF − ideal|
    logit; ``noise``: largest |ideal − merged| logit (the type's rounding); ``tolerance``: the bound on
    ``max_abs_diff``; ``weights_checked``: parameters proven equal to a rounding of the merged ones;
    ``greedy_equal_ideal`` / ``greedy_equal_merged``: greedy tokens agree; ``llama_cpp``: llama.cpp's own
    run (None when llama-cpp-python is not importable); ``failures``: one line per failed check; ``warnings``: one
    line per way llama.cpp's tokenizer will split text unlike the HF tokenizer (seen without llama.cpp)."""

    file: str
    gguf_type: str
    size_bytes: int
    static: dict[str, Any] = field(default_factory=dict)
    weights_checked: int = 0
    tensor_types: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    noise: float | None = None
    tolerance: float | None = None
    greedy_equal_ideal: bool | None = None
    greedy_equal_merged: bool | None = None
    llama_cpp: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: bool = False
    seconds: float = 0.0
    #: a vision-language export's projector file (:func:`check_mmproj`'s facts), or why it was not written
    mmproj: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def _chat_template_text(model_dir: Path) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def _eos_ids(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
            if ids:
                return ids
    return ids


@contextlib.contextmanager
def one_reading(path: Path) -> Iterator[Any]:
    """Parse the GGUF at ``path`` once (``gguf.GGUFReader``) and, inside the block, hand that same reader to every
    ``gguf.GGUFReader(path)`` of this file: transformers' GGUF loading builds its own reader for the config and again
    for the weights (``load_gguf_checkpoint``), and the static check a third.

    Why: the reader turns every metadata string into its own array view when it opens a file, so opening one costs
    time in proportion to the vocabulary: about 4 s for GPT-2's 50,257 tokens and 50,000 merges on this 2-core
    machine (gguf-py 0.17), three times per check. Both readers only read (a read-only memmap). Another file, or a
    writable mode, gets a reader of its own as before; ``gguf.GGUFReader`` is the library's class again on exit.
    """
    import gguf

    library_reader: Any = gguf.GGUFReader
    first = library_reader(str(path))
    target = os.path.realpath(path)

    class _SharedReader(library_reader):  # the library's class, typed Any here
        def __new__(cls, file: Any, mode: str = "r") -> Any:
            if mode == "r" and os.path.realpath(file) == target:
                return first  # not an instance of this class: __init__ is not called again
            return library_reader(file, mode)

    setattr(gguf, "GGUFReader", _SharedReader)  # noqa: B010 - the library's own attribute, put back below
    try:
        yield first
    finally:
        setattr(gguf, "GGUFReader", library_reader)  # noqa: B010


def static_check(
    path: Path, model_dir: Path, gguf_type: str, reader: Any = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The reader's facts about ``path``, the failures against the HF folder ``model_dir`` (see the module
    docstring, step 1) and warnings: ways llama.cpp's tokenizer will split text unlike the HF tokenizer's
    (:func:`_tokenizer_warnings`), each one line. ``reader``: a ``gguf.GGUFReader`` of ``path`` already open
    (:func:`one_reading`), else one is opened."""
    import gguf
    from transformers import AutoTokenizer

    reader = reader if reader is not None else gguf.GGUFReader(str(path))
    config = json.loads((model_dir / "config.json").read_text())
    text_cfg = config.get("text_config") or config
    arch = _field(reader, "general.architecture")
    facts: dict[str, Any] = {"architecture": arch, "tensors": len(reader.tensors)}
    failures: list[str] = []
    file_type = _field(reader, "general.file_type")
    want = gguf.LlamaFileType["MOSTLY_" + gguf_type.upper() if gguf_type != "f32" else "ALL_F32"].value
    facts["file_type"] = gguf.LlamaFileType(file_type).name if file_type is not None else None
    if file_type != want:
        failures.append(f"file type {facts['file_type']} is not the {gguf_type} asked for")
    blocks = _field(reader, f"{arch}.block_count")
    facts["block_count"] = blocks
    if blocks != text_cfg.get("num_hidden_layers"):
        failures.append(f"{arch}.block_count {blocks} != config num_hidden_layers {text_cfg.get('num_hidden_layers')}")
    hidden = _field(reader, f"{arch}.embedding_length")
    facts["embedding_length"] = hidden
    if text_cfg.get("hidden_size") is not None and hidden != text_cfg.get("hidden_size"):
        failures.append(f"{arch}.embedding_length {hidden} != config hidden_size {text_cfg.get('hidden_size')}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_tokens = len(tokens) if tokens is not None else 0
    facts["vocab_size"] = n_tokens
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    facts["token_embd_shape"] = [int(x) for x in embd.shape] if embd is not None else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    facts["tokenizer_length"] = len(tokenizer)
    if embd is None:
        failures.append("no token_embd.weight tensor")
    elif [int(x) for x in embd.shape] != [hidden, n_tokens]:
        failures.append(f"token_embd.weight shape {list(embd.shape)} != [embedding_length {hidden}, vocab {n_tokens}]")
    if n_tokens < len(tokenizer):
        failures.append(f"GGUF vocabulary {n_tokens} < the tokenizer's {len(tokenizer)} tokens")
    vocab_cfg = text_cfg.get("vocab_size")
    if vocab_cfg is not None and n_tokens != vocab_cfg:
        failures.append(f"GGUF vocabulary {n_tokens} != config vocab_size {vocab_cfg}")
    eos, eot = _field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")
    want_eos = _eos_ids(model_dir)
    facts.update(eos_token_id=eos, eot_token_id=eot, generation_eos_ids=sorted(want_eos))
    if want_eos and eos not in want_eos:
        failures.append(f"GGUF EOS id {eos} is not among generation_config's EOS ids {sorted(want_eos)}")
    if eot is not None and want_eos and eot not in want_eos:
        failures.append(f"GGUF EOT id {eot} is not among generation_config's EOS ids {sorted(want_eos)}")
    template = _chat_template_text(model_dir)
    stored = _field(reader, "tokenizer.chat_template")
    facts["chat_template_equal"] = stored == template
    if template is not None and stored != template:
        failures.append("tokenizer.chat_template differs from the export's chat template")
    facts["tensor_types"] = sorted({t.tensor_type.name for t in reader.tensors})
    failures += _hyperparameter_failures(reader, arch, text_cfg, facts)
    return facts, failures, _tokenizer_warnings(reader, tokenizer, facts)


#: GGUF key (after ``<arch>.``) -> the config.json key it is written from (llama.cpp's converter, ``conversion/``).
HPARAMS: dict[str, str | tuple[str, ...]] = {
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_count": ("num_experts", "num_local_experts"),
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def _config_value(text_cfg: dict, key: str | tuple[str, ...]) -> Any:
    for name in (key,) if isinstance(key, str) else key:
        if name == "rope_theta" and name not in text_cfg:  # transformers 5 nests it under rope_parameters
            value = (text_cfg.get("rope_parameters") or {}).get("rope_theta")
        else:
            value = text_cfg.get(name)
        if value is not None:
            return value
    return None


def _hyperparameter_failures(reader: Any, arch: str, text_cfg: dict, facts: dict[str, Any]) -> list[str]:
    """The GGUF's hyper-parameters (:data:`HPARAMS`) against config.json's, and what llama.cpp assumes for the
    architecture without storing it. Floats compare at float32 (the GGUF stores float32)."""
    import numpy as np

    failures: list[str] = []
    hparams: dict[str, Any] = {}
    for gguf_key, cfg_key in HPARAMS.items():
        got, want = _field(reader, f"{arch}.{gguf_key}"), _config_value(text_cfg, cfg_key)
        if got is None or want is None or isinstance(want, (list, dict)):
            continue
        hparams[gguf_key] = got
        same = (
            (np.float32(got) == np.float32(want)) if isinstance(got, float) or isinstance(want, float) else got == want
        )
        if not same:
            name = cfg_key if isinstance(cfg_key, str) else "/".join(cfg_key)
            failures.append(f"{arch}.{gguf_key} {got} != config {name} {want}")
    facts["hparams"] = hparams
    failures += _rope_scaling_failures(reader, arch, text_cfg, hparams)
    # llama.cpp's qwen3moe graph always renormalises the top-k router weights (build_moe_ffn(..., norm_w=true));
    # the GGUF has no key for it, so a model trained with norm_topk_prob false would compute other outputs there
    if arch == "qwen3moe" and not text_cfg.get("norm_topk_prob", False):
        failures.append(
            "llama.cpp's qwen3moe always renormalises the top-k expert weights, but config "
            "norm_topk_prob is false: llama.cpp would compute other outputs than this model"
        )
    # llama.cpp's gemma2 / gemma3 scale queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B layer count
    # (src/models/gemma2.cpp, gemma3.cpp); query_pre_attn_scalar is not stored in the GGUF
    scalar = text_cfg.get("query_pre_attn_scalar")
    if arch in GEMMA_27B_LAYERS and scalar is not None:
        heads, hidden = text_cfg.get("num_attention_heads") or 1, text_cfg.get("hidden_size") or 0
        head_dim = text_cfg.get("head_dim") or hidden // heads
        implied = hidden / heads if text_cfg.get("num_hidden_layers") == GEMMA_27B_LAYERS[arch] else head_dim
        if float(scalar) != float(implied):
            failures.append(
                f"llama.cpp's {arch} scales attention by 1/sqrt({implied:g}) and stores no "
                f"query_pre_attn_scalar, but config query_pre_attn_scalar is {scalar}: llama.cpp would "
                f"compute other outputs than this model"
            )
    return failures


#: llama.cpp's 27B layer count per Gemma architecture, the one size whose attention scale is 1/sqrt(hidden/heads).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _rope_scaling_failures(reader: Any, arch: str, text_cfg: dict, hparams: dict[str, Any]) -> list[str]:
    """config.json's RoPE scaling (an adapter's ``rope_scaling``, or the base's own) against the GGUF's
    ``rope.scaling.*`` keys as llama.cpp's converter writes them: linear and yarn as type and factor (yarn with its
    original context), llama3 as the ``rope_freqs`` tensor; llama.cpp has no dynamic NTK scaling for a plain
    decoder, so a dynamic one fails. ``hparams`` gains what the GGUF holds."""
    params = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type in (None, "default") or not isinstance(params.get("factor"), (int, float)):
        return []
    got_type, got_factor = _field(reader, f"{arch}.rope.scaling.type"), _field(reader, f"{arch}.rope.scaling.factor")
    hparams.update({"rope.scaling.type": got_type, "rope.scaling.factor": got_factor})
    factor = float(params["factor"])
    if rope_type == "dynamic":
        return [
            f"config rope_type dynamic (factor {factor:g}): llama.cpp has no dynamic NTK RoPE scaling for {arch}, "
            f"so it would compute other outputs than this model past its first positions"
        ]
    if rope_type == "llama3":
        names = {t.name for t in reader.tensors}
        return [] if "rope_freqs.weight" in names else ["config rope_type llama3 but the GGUF holds no rope_freqs"]
    if rope_type in ("linear", "yarn"):
        failures = []
        if got_type != rope_type or got_factor is None or float(got_factor) != factor:
            failures.append(f"{arch}.rope.scaling {got_type} x{got_factor} != config {rope_type} x{factor:g}")
        original = params.get("original_max_position_embeddings")
        got_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if rope_type == "yarn" and original is not None and got_ctx != original:
            failures.append(f"{arch}.rope.scaling.original_context_length {got_ctx} != config {original}")
        return failures
    return []


def _tokenizer_warnings(reader: Any, tokenizer: Any, facts: dict[str, Any]) -> list[str]:
    """Ways the GGUF's tokenizer will split text other than the HF tokenizer does, seen without llama.cpp.

    Both come from choices in llama.cpp's converter for SentencePiece-style vocabularies (``tokenizer.ggml.model``
    ``"llama"``), whose tokenizer merges the adjacent pair with the highest score first, leftmost on ties:

    * every score equal: the converter's ``LlamaHfVocab`` (a ``tokenizer.json`` BPE with byte fallback and no
      ``tokenizer.model``) writes the placeholder score -1000 for every token, so llama.cpp merges left to
      right instead of in the BPE's merge order;
    * ``tokenizer.ggml.add_space_prefix`` (default true) unlike the HF tokenizer: Gemma / Gemma-3 force it false
      (their own SentencePiece models add no dummy prefix); a SentencePiece model that does add one is split
      differently from the first word on.
    """
    warnings: list[str] = []
    model = _field(reader, "tokenizer.ggml.model")
    facts["tokenizer_model"] = model
    if model != "llama":
        return warnings
    scores = reader.fields.get("tokenizer.ggml.scores")
    if scores is not None:
        values = {float(scores.parts[i][0]) for i in scores.data}
        facts["token_scores_distinct"] = len(values)
        if len(values) == 1 and len(scores.data) > 1:
            warnings.append(
                f"llama.cpp will not split text as the HF tokenizer does: the converter wrote the same "
                f"score ({values.pop():g}) for every token of this BPE tokenizer.json, so llama.cpp merges "
                f"left to right instead of in BPE merge order (a tokenizer.model would carry the scores)"
            )
    add_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    add_prefix = True if add_prefix is None else bool(add_prefix)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
    hf_prefix = bool(pieces) and str(pieces[0]).startswith("\u2581")
    facts.update(add_space_prefix=add_prefix, hf_adds_space_prefix=hf_prefix)
    if add_prefix != hf_prefix:
        warnings.append(
            f"llama.cpp will not split text as the HF tokenizer does: the GGUF's "
            f"tokenizer.ggml.add_space_prefix is {str(add_prefix).lower()} but the HF tokenizer "
            f"{'adds' if hf_prefix else 'does not add'} a leading space (U+2581) to the first word"
        )
    return warnings


def _rounded(weight: Any, type_name: str) -> Any:
    """``weight`` (float32) as the GGUF type ``type_name`` stores it, back in float32; None when not representable."""
    import numpy as np
    import torch

    if type_name == "F32":
        return weight
    if type_name == "BF16":
        return weight.to(torch.bfloat16).float()
    if type_name == "F16":
        return weight.to(torch.float16).float()
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[type_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if weight.shape[-1] % block:
        return None
    try:
        data = quants.dequantize(quants.quantize(weight.numpy().astype(np.float32), qtype), qtype)
    except NotImplementedError:
        return None
    return torch.from_numpy(np.ascontiguousarray(data)).reshape(weight.shape)


#: Config keys never taken from the export for the readback: bookkeeping, and what the reader derives from the
#: tensors themselves (a tied head: no output.weight), and the model type (the reader picks the class to fill).
_CONFIG_BOOKKEEPING = {
    "model_type",
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "id2label",
    "label2id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "_attn_implementation",
    "_experts_implementation",
    "max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
}


def _readback_config(path: Path, merged_config: Any, report: GgufReport) -> Any:
    """transformers' own config for the GGUF, with the hyper-parameters its GGUF reader does not carry taken from the
    export: it maps no ``expert_feed_forward_length`` for Qwen3-MoE (``moe_intermediate_size`` stays 768) and no
    ``attention.key_length`` for Qwen3 (``head_dim`` stays 128), which the static check proves in the GGUF; other
    keys the GGUF has no field for (``norm_topk_prob``, ``query_pre_attn_scalar``) are what llama.cpp implies, checked
    there too; its reader maps no RoPE scaling either, so ``rope_parameters`` is the export's (the static check
    compares the GGUF's ``rope.freq_base`` and ``rope.scaling.*`` with it). Model type, architectures, the tied
    head and bookkeeping are never taken. Each key taken is listed in
    ``report.static["readback_config_from_export"]`` as ``{key: [transformers' value, export's value]}``.

    Raises:
        ValueError / KeyError: transformers cannot read the GGUF's metadata (caught by the caller)."""
    import numpy as np
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    export = merged_config.to_dict()
    taken: dict[str, list[Any]] = {}
    for key, want in export.items():
        if key in _CONFIG_BOOKKEEPING or key.startswith("_") or not hasattr(config, key):
            continue
        got = getattr(config, key)
        if isinstance(got, float) and isinstance(want, float) and np.float32(got) == np.float32(want):
            continue  # the GGUF stores float32
        if got != want and (not isinstance(want, dict) or key == "rope_parameters"):
            taken[key] = [got, want]
            setattr(config, key, want)
    report.static["readback_config_from_export"] = taken
    return config


def _greedy(model: Any, enc: dict, n: int, pad: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_length=enc["input_ids"].shape[1] + n,
            min_length=enc["input_ids"].shape[1] + n,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad,
        )
    return out[0, enc["input_ids"].shape[1] :].tolist()


class _Prompts:
    """The check's prompts, run the same way through any model: logits (float32, ``[1, seq_len, vocab]`` each) and
    ``max_new_tokens`` greedy token ids each."""

    def __init__(self, inputs: list[dict], max_new_tokens: int, pad: int) -> None:
        self.inputs, self.max_new_tokens, self.pad = inputs, max_new_tokens, pad

    def logits(self, model: Any) -> list[Any]:
        import torch

        with torch.inference_mode():
            return [model(**enc).logits.float() for enc in self.inputs]

    def greedy(self, model: Any) -> list[list[int]]:
        return [_greedy(model, enc, self.max_new_tokens, self.pad) for enc in self.inputs]


def _weight_is_rounded(name: str, want: Any, got: Any, report: GgufReport) -> bool:
    """Whether the GGUF's weight ``got`` is the merged weight ``want`` rounded to one of the file's tensor types
    (within :data:`WEIGHT_RTOL`); a failure line is added to ``report`` when not."""
    if got.shape != want.shape:
        report.failures.append(f"{name}: shape {list(got.shape)} in the GGUF, {list(want.shape)} merged")
        return False
    bound = WEIGHT_RTOL * (1.0 + float(want.abs().max()))
    for type_name in report.tensor_types:
        cand = _rounded(want.detach(), type_name)
        if cand is not None and float((got - cand).abs().max()) <= bound:
            return True
    report.failures.append(
        f"{name}: the GGUF's weight is not the merged weight rounded to any of "
        f"{report.tensor_types} (max |Δ| {float((got - want).abs().max()):.3g})"
    )
    return False


def _take_gguf_weights(merged: Any, read: Any, report: GgufReport, exact_type: bool) -> bool:
    """Make ``merged`` the ideal model: the merged architecture holding exactly the GGUF's weights, once each is
    proven to be the merged weight rounded to a type the file holds (``exact_type``: a type the converter writes
    itself; a K-quant is not checked weight by weight). Returns whether it did; failures go to ``report``."""
    import torch

    merged_params = dict(merged.named_parameters())
    read_params = dict(read.named_parameters())
    if set(merged_params) != set(read_params):
        missing = sorted(set(merged_params) ^ set(read_params))[:3]
        report.failures.append(f"the GGUF's parameters differ from the merged model's (e.g. {missing})")
        return False
    if not exact_type:
        return False
    with torch.no_grad():
        for name, want in merged_params.items():
            if not _weight_is_rounded(name, want, read_params[name].detach(), report):
                return False
            report.weights_checked += 1
        for name, param in merged_params.items():
            param.copy_(read_params[name])
    return True


def _compare_logits(
    merged: Any, read: Any, prompts: _Prompts, gguf_type: str, report: GgufReport
) -> list[list[int]] | None:
    """transformers' reading of the GGUF against the merged model: logits and greedy tokens, against the ideal
    model (:func:`_take_gguf_weights`) when there is one, else against the merged weights. Fills ``report``;
    returns the ideal model's greedy tokens (None without an ideal model)."""
    ref_logits, ref_greedy = prompts.logits(merged), prompts.greedy(merged)
    got_logits, got_greedy = prompts.logits(read), prompts.greedy(read)
    report.greedy_equal_merged = got_greedy == ref_greedy
    if not _take_gguf_weights(merged, read, report, gguf_type in CONVERTER_TYPES):
        report.max_abs_diff = max(float((a - b).abs().max()) for a, b in zip(got_logits, ref_logits))
        return None
    ideal_logits, ideal_greedy = prompts.logits(merged), prompts.greedy(merged)
    scale = max(float(x.abs().max()) for x in ideal_logits)
    report.tolerance = FP32_ATOL + FP32_RTOL * scale
    report.max_abs_diff = max(float((a - b).abs().max()) for a, b in zip(got_logits, ideal_logits))
    report.noise = max(float((a - b).abs().max()) for a, b in zip(ideal_logits, ref_logits))
    report.greedy_equal_ideal = got_greedy == ideal_greedy
    if not report.max_abs_diff <= report.tolerance:
        report.failures.append(
            f"transformers' reading of the GGUF computes other logits than the merged model "
            f"with the same weights: max |Δ| {report.max_abs_diff:.3g} > {report.tolerance:.3g} "
            f"(a hyper-parameter lost in conversion?)"
        )
    if not report.greedy_equal_ideal:
        report.failures.append("the GGUF's greedy tokens differ from the merged model's with the same weights")
    return ideal_greedy


def _chat_text(tokenizer: Any, prompt: str) -> str:
    """``prompt`` as one user turn rendered by the tokenizer's chat template (generation prompt added), or as is
    when the tokenizer has none: the text llama.cpp is given."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return str(rendered)


def check_gguf(
    path: str | os.PathLike,
    model_dir: str | os.PathLike,
    gguf_type: str,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 8,
    trust_remote_code: bool = False,
) -> GgufReport:
    """Prove the GGUF ``path`` against the merged HF folder ``model_dir`` (module docstring: static, weights and
    logits through transformers, llama.cpp when importable). Never raises for a failed check: the report's
    ``failures`` name them (the caller raises :class:`SmokeCheckError`). Logits are compared in float32, sizes
    are in bytes, durations in seconds.

    Raises:
        ExportError: a reader cannot open the file at all (named), or the merged folder does not load.
    """
    apply_offline_env()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.smoke import DEFAULT_PROMPTS, _encode, model_loading_errors

    started = time.perf_counter()
    path, model_dir = Path(path), Path(model_dir)
    report = GgufReport(file=path.name, gguf_type=gguf_type, size_bytes=path.stat().st_size)
    with contextlib.ExitStack() as reading:  # the file parsed once: the static check's and transformers' reader
        try:
            reader = reading.enter_context(one_reading(path))
            report.static, failures, report.warnings = static_check(path, model_dir, gguf_type, reader)
        except (ValueError, KeyError, OSError) as exc:
            raise ExportError(f"{path}: the gguf reader cannot read it ({exc})") from None
        report.failures += failures
        report.tensor_types = report.static.get("tensor_types", [])

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        prompts = list(prompts or DEFAULT_PROMPTS)
        inputs = [_encode(tokenizer, p) for p in prompts]
        texts = [_chat_text(tokenizer, p) for p in prompts]
        auto = _merged_class(model_dir, trust_remote_code)
        with model_loading_errors(model_dir, trust_remote_code):
            merged = auto.from_pretrained(
                model_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=trust_remote_code
            ).eval()
        if auto is not AutoModelForCausalLM:  # no causal-LM class: transformers' GGUF reader has no such model
            return _check_by_llama_cpp(
                path, model_dir, merged, tokenizer, (inputs, texts, max_new_tokens), report, started=started
            )
        try:
            read_config = _readback_config(path, merged.config, report)
            read = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, config=read_config, dtype=torch.float32, local_files_only=True
            ).eval()
        except Exception as exc:  # noqa: BLE001 - transformers' GGUF reader knows fewer architectures than llama.cpp
            report.failures.append(
                f"transformers cannot read the GGUF back ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            )
            report.passed, report.seconds = False, time.perf_counter() - started
            return report
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    ideal_greedy = _compare_logits(merged, read, _Prompts(inputs, max_new_tokens, pad), gguf_type, report)
    del read, merged
    report.llama_cpp = _llama_cpp_check(
        path,
        tokenizer,
        inputs,
        texts,
        ideal_greedy,
        max_new_tokens,
        gguf_type,
        report,
        eos_ids=sorted(_eos_ids(model_dir)),
    )
    report.passed = not report.failures
    report.seconds = time.perf_counter() - started
    return report


def _merged_class(model_dir: Path, trust_remote_code: bool) -> Any:
    """The auto class the merged folder loads with (:func:`ferry.architecture.auto_model_class`)."""
    from transformers import AutoConfig

    from ferry.architecture import auto_model_class

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    return auto_model_class(config)


def _check_by_llama_cpp(
    path: Path,
    model_dir: Path,
    merged: Any,
    tokenizer: Any,
    prompts: tuple[list[dict], list[str], int],
    report: GgufReport,
    *,
    started: float,
) -> GgufReport:
    """The rest of :func:`check_gguf` for a vision-language model without a causal-LM class (Qwen2-VL, Qwen3-VL),
    whose language model transformers' GGUF reader cannot build: llama.cpp itself is the reader. Its tokens for
    each prompt must be the HF tokenizer's, and for an f32 file (the merged weights unrounded) its greedy tokens
    the merged model's on the text prompts; other types are reported. Without llama-cpp-python the file is proven
    statically only, said in one warning line. ``prompts``: the token ids, rendered texts and greedy tokens per
    prompt of :func:`check_gguf`."""
    inputs, texts, max_new_tokens = prompts
    gguf_type = report.gguf_type
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    merged_greedy = _Prompts(inputs, max_new_tokens, pad).greedy(merged)
    del merged
    report.llama_cpp = _llama_cpp_check(
        path,
        tokenizer,
        inputs,
        texts,
        merged_greedy if gguf_type == "f32" else None,
        max_new_tokens,
        gguf_type,
        report,
        eos_ids=sorted(_eos_ids(model_dir)),
    )
    if report.llama_cpp is None:
        report.warnings.append(
            f"{path.name} is checked statically only: transformers cannot read a {report.static.get('architecture')} "
            "GGUF back and llama-cpp-python is not importable here"
        )
    else:
        report.llama_cpp["merged_greedy"] = merged_greedy
    report.passed = not report.failures
    report.seconds = time.perf_counter() - started
    return report


def has_vision_part(model_dir: Path) -> bool:
    """Whether the merged folder holds a vision tower llama.cpp keeps in a separate projector file: config.json
    has a ``vision_config``."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return isinstance(config.get("vision_config"), dict)


def check_mmproj(path: Path, model_dir: Path) -> dict[str, Any]:
    """The projector file's facts (``general.type``, projector type, vision block count and projection width, tensor
    count) with ``failures``: not a projector, no vision encoder, a block count other than the vision config's
    depth, a projection width other than the language model's hidden size."""
    import gguf

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    vision, text = config.get("vision_config") or {}, config.get("text_config") or config
    with one_reading(path) as reader:
        facts: dict[str, Any] = {
            "file": path.name,
            "size_bytes": path.stat().st_size,
            "tensors": len(reader.tensors),
            "type": _field(reader, "general.type"),
            "projector_type": _field(reader, gguf.Keys.Clip.PROJECTOR_TYPE),
            "has_vision_encoder": _field(reader, gguf.Keys.Clip.HAS_VISION_ENCODER),
            "block_count": _field(reader, gguf.Keys.ClipVision.BLOCK_COUNT),
            "projection_dim": _field(reader, gguf.Keys.ClipVision.PROJECTION_DIM),
        }
    failures = []
    if facts["type"] != "mmproj" or not facts["has_vision_encoder"]:
        failures.append(f"{path.name} is not a vision projector (general.type {facts['type']!r})")
    depth = vision.get("depth", vision.get("num_hidden_layers"))
    if depth is not None and facts["block_count"] != depth:
        failures.append(f"{path.name}: clip.vision.block_count {facts['block_count']} != vision depth {depth}")
    if text.get("hidden_size") is not None and facts["projection_dim"] != text["hidden_size"]:
        failures.append(
            f"{path.name}: clip.vision.projection_dim {facts['projection_dim']} != hidden size {text['hidden_size']}"
        )
    facts["failures"] = failures
    return facts


def _llama_cpp_check(
    path: Path,
    tokenizer: Any,
    inputs: list[dict],
    texts: list[str],
    ideal_greedy: list[list[int]] | None,
    max_new_tokens: int,
    gguf_type: str,
    report: GgufReport,
    *,
    eos_ids: list[int] | None = None,
) -> dict[str, Any] | None:
    """Run the prompts through llama.cpp when llama-cpp-python is importable (None otherwise). ``eos_ids`` are kept
    from being chosen, as the HF side's ``min_length`` keeps them (:func:`_greedy` generates exactly
    ``max_new_tokens``), so both pick the best other token."""
    try:
        import llama_cpp
        import numpy as np
    except Exception:  # noqa: BLE001 - not installed or its library does not load
        return None
    banned = list(eos_ids or [])

    def no_eos(_ids: Any, scores: Any) -> Any:
        scores[banned] = -np.inf
        return scores

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=512, n_threads=max(1, min(4, os.cpu_count() or 1)), verbose=False, seed=0
    )
    result: dict[str, Any] = {
        "version": getattr(llama_cpp, "__version__", None),
        "tokens_equal": True,
        "greedy_equal": None,
    }
    greedy = []
    chat = bool(getattr(tokenizer, "chat_template", None))
    for i, enc in enumerate(inputs):
        ids = enc["input_ids"][0].tolist()
        # the same text through both tokenizers: the rendered chat prompt (its special tokens parsed), or the raw
        # prompt with BOS added as the HF tokenizer adds it
        text = texts[i]
        theirs = llm.tokenize(
            text.encode("utf-8"), add_bos=not chat and bool(ids) and ids[0] == tokenizer.bos_token_id, special=chat
        )
        if theirs != ids:
            result["tokens_equal"] = False
            report.failures.append(
                f"llama.cpp tokenizes prompt {i} as {theirs[:12]}..., the HF tokenizer as {ids[:12]}..."
            )
        llm.reset()
        out = []
        for tok in llm.generate(
            ids,
            temp=0.0,
            top_k=1,
            top_p=1.0,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
            logits_processor=llama_cpp.LogitsProcessorList([no_eos]) if banned else None,
        ):
            out.append(int(tok))
            if len(out) >= max_new_tokens:
                break
        greedy.append(out)
    result["greedy"] = greedy
    if ideal_greedy is not None and gguf_type in ("f32", "f16", "bf16"):
        cut = [g[: len(o)] for g, o in zip(ideal_greedy, greedy)]
        result["greedy_equal"] = cut == greedy
        # a bf16 file is reported, not judged: ggml's bf16 matmul rounds the activations to bf16 as well, which
        # flips near-tied tokens (seen on a random-init Gemma-3 whose f32 GGUF agrees to 4e-4 in llama.cpp)
        if not result["greedy_equal"] and gguf_type != "bf16":
            report.failures.append(f"llama.cpp's greedy tokens {greedy} differ from the merged model's {cut}")
    del llm
    return result


# --------------------------------------------------------------------------------------------------- the output
def gguf_file_name(model_dir: Path, gguf_type: str) -> str:
    """``<name>-<type>.gguf``, name from the export's lineage (base repo name) or the folder."""
    name = model_dir.name
    with contextlib.suppress(ConfigError, OSError, AttributeError):
        repo = (read_export_record(model_dir) or {}).get("base", {}).get("repo_id")
        if repo:
            name = str(repo).split("/")[-1] + "-ferry"
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-.") or "model"
    return f"{name}-{gguf_type}.gguf"


def write_gguf(
    model_dir: str | os.PathLike,
    dest_dir: str | os.PathLike,
    gguf_type: str,
    *,
    converter: Path | None = None,
    llama_cpp_dir: str | os.PathLike | None = None,
    check: bool = True,
    prompts: list[str] | None = None,
    trust_remote_code: bool = False,
    log_dir: str | os.PathLike | None = None,
) -> tuple[Path, GgufReport | None, dict[str, float]]:
    """Convert the merged folder ``model_dir`` to ``dest_dir/<name>-<type>.gguf`` (K-quants: converted to bf16 in a
    temp file, then quantized) and, with ``check``, prove it (:func:`check_gguf`). The converter's log goes to
    ``dest_dir/<file>.convert.log`` (``log_dir``: ``log_dir/.<file>.convert.log``), removed on success. Returns
    (path, report, {"convert_s", "quantize_s", "check_s"}).

    Raises:
        ExportError: unknown type, converter failure (one line), no quantizer for a K-quant.
        NotInstalledError: the converter is not installed.
    """
    gguf_type = gguf_type.lower()
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type}: use one of {', '.join(GGUF_TYPES)}")
    route = k_quant_route(gguf_type, llama_cpp_dir) if gguf_type in K_QUANTS else None
    converter = converter or find_converter()
    model_dir, dest_dir = Path(model_dir), Path(dest_dir)
    out = dest_dir / gguf_file_name(model_dir, gguf_type)
    log_file = (
        Path(log_dir) / f".{out.name}.convert.log" if log_dir is not None else dest_dir / f"{out.name}.convert.log"
    )
    times: dict[str, float] = {}
    if route is None:
        times["convert_s"] = convert(model_dir, out, gguf_type, converter=converter, log_file=log_file)
    else:
        with tempfile.TemporaryDirectory(prefix=".ferry-gguf-", dir=dest_dir) as tmp:
            mid = Path(tmp) / "model-bf16.gguf"
            times["convert_s"] = convert(model_dir, mid, "bf16", converter=converter, log_file=log_file)
            times["quantize_s"] = quantize(mid, out, gguf_type, route)
    mmproj = (
        _write_mmproj(model_dir, out, gguf_type, converter, log_file, times) if has_vision_part(model_dir) else None
    )
    report = None
    if check:
        report = check_gguf(out, model_dir, gguf_type, prompts=prompts, trust_remote_code=trust_remote_code)
        times["check_s"] = report.seconds
        if mmproj is not None:
            report.mmproj = mmproj
            report.failures += mmproj.get("failures", [])
            if "not_written" in mmproj:
                report.warnings.append(mmproj["not_written"])
            report.passed = not report.failures
    return out, report, times


#: The type of the projector file for a K-quant or q8_0 export (llama.cpp quantizes the language model only).
MMPROJ_FALLBACK_TYPE = "f16"


def mmproj_file_name(gguf_path: Path) -> str:
    """``mmproj-<name>-<type>.gguf`` beside the language model's ``<name>-<type>.gguf`` (llama.cpp's prefix)."""
    return f"mmproj-{gguf_path.name}"


def _write_mmproj(
    model_dir: Path, out: Path, gguf_type: str, converter: Path, log_file: Path, times: dict[str, float]
) -> dict[str, Any]:
    """The vision part of a vision-language export as llama.cpp's projector file beside ``out`` (``--mmproj``; in
    ``gguf_type`` when the converter writes it unquantized, else :data:`MMPROJ_FALLBACK_TYPE`), with
    :func:`check_mmproj`'s facts; where the converter does not take this family's vision part, ``not_written``:
    one line saying the text part was converted and the vision part was not."""
    mm_type = gguf_type if gguf_type in ("f32", "f16", "bf16") else MMPROJ_FALLBACK_TYPE
    mm_path = out.with_name(mmproj_file_name(out))
    mm_log = log_file.with_name(log_file.name.replace(".convert.log", ".mmproj.convert.log"))
    try:
        times["mmproj_s"] = convert(model_dir, mm_path, mm_type, converter=converter, log_file=mm_log, mmproj=True)
    except ExportError as exc:
        return {"not_written": f"the text part was converted to {out.name}; the vision part was not ({exc})"}
    return {"gguf_type": mm_type, **check_mmproj(mm_path, model_dir)}


def raise_if_failed(report: GgufReport | None, where: Path) -> None:
    """Raise :class:`SmokeCheckError` naming every failed GGUF check."""
    if report is not None and report.failures:
        raise SmokeCheckError(
            f"GGUF check of {where / report.file} failed: "
            + "; ".join(report.failures)
            + f" (report: {where / 'smoke_report.json'})"
        )


__all__ = [
    "SDIST",
    "CONVERTER_TYPES",
    "K_QUANTS",
    "GGUF_TYPES",
    "CONVERTER_REQUIREMENTS",
    "find_converter",
    "convert",
    "check_gguf",
    "static_check",
    "write_gguf",
    "GgufReport",
    "k_quant_route",
    "quantize",
    "converter_command",
    "converter_env",
    "raise_if_failed",
    "gguf_file_name",
]
