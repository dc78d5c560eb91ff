"""GGUF, Ollama and vLLM outputs of ``ferry export``, against what ferry did not write: llama.cpp's own
converter from the pinned llama-cpp-python sdist, the ``gguf`` package's reader, transformers reading the GGUF back,
Go's ``text/template`` (Ollama's template engine) rendering the Modelfile's TEMPLATE, and peft's adapters.

Zoo families (tests/support/zoo.py configs) get a SentencePiece tokenizer trained here with ``sentencepiece`` (the
zoo's stories260K tokenizer is a BPE whose pre-tokenizer llama.cpp does not know, which the unknown-tokenizer test
uses). Qwen3-MoE has no dense layer (llama.cpp's qwen3moe has none: the zoo's ``mlp_only_layers=[0]`` is refused,
one line) and renormalises its top-k router weights as every released Qwen3-MoE does (``norm_topk_prob: true``,
which llama.cpp's qwen3moe graph assumes; false is refused, one line).

llama.cpp itself (tests/support/llama_cpp_build.py: llama-cpp-python built once per machine from the same pinned sdist)
runs the real stories260K model's GGUF, quantizes to a K-quant, and shows which tokenizer warnings are real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter import gguf as ferry_gguf
from exporter.export import export
from exporter.ollama import go_template, turn_pieces
from exporter.options import ExportOptions
from ferry.errors import ExportError
from serving.engines import free_port
from serving.vllm_lora import vllm_lora_fit
from tests.support import forks
from tests.support.helpers import LLAMA_TARGETS, fork_ferry, make_adapter, run_ferry
from tests.support.netns import run_offline
from tests.support.zoo import FAMILIES

pytestmark = pytest.mark.budget(90, reason="llama.cpp's converter and reader over the MoE zoo models")

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(autouse=True)
def forked_converter(monkeypatch):
    """llama.cpp's converter as a fork of this process (``forks.forked_converter_run``): an exec'd one spends about
    4.5 CPU-s importing torch and transformers, some 25 times in this file. ``FERRY_TESTS_EXEC=1``: exec'd."""
    monkeypatch.setattr(ferry_gguf, "subprocess", forks.subprocess_with(run=forks.forked_converter_run))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def converter(llama_cpp_sdist) -> Path:
    """llama.cpp's converter extracted from the pinned sdist (once per machine, into ferry's cache)."""
    return ferry_gguf.find_converter(llama_cpp_sdist)


@pytest.fixture(scope="session")
def spm_tokenizer(tmp_path_factory, llamafactory_data) -> Path:
    """A 512-piece SentencePiece BPE (byte fallback) trained on alpaca_en_demo, with transformers' files."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("spm")
    rows = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())
    (root / "corpus.txt").write_text("\n".join(r["instruction"] + " " + r["output"] for r in rows[:300]))
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"),
        model_prefix=str(root / "tokenizer"),
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    src = root / "src"
    src.mkdir()
    shutil.copyfile(root / "tokenizer.model", src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
            }
        )
    )
    out = root / "hf"
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    shutil.copyfile(root / "tokenizer.model", out / "tokenizer.model")
    return out


@pytest.fixture(scope="session")
def gpt2_tokenizer(llama_cpp_sdist) -> Path:
    """GPT-2's byte-level BPE as a transformers tokenizer, for families whose converter takes only a BPE it knows
    (Qwen3-MoE). Built from llama.cpp's own GPT-2 vocabulary file in the pinned sdist (``models/ggml-vocab-gpt-2
    .gguf``: tokens and merges) and proven equal to GPT-2 on that file's test vectors (``.inp`` / ``.out``, the ids
    llama.cpp's tokenizer tests expect), so the converter recognises its pre-tokenizer. Built once per machine (6 s:
    the sdist read and the 50,257 tokens parsed) into the test cache, keyed by the sdist's sha256; the test vectors
    are checked again on every use."""
    from transformers import AutoTokenizer

    from tests.support.chat_templates import SHA256
    from tests.support.suite import machine_lock

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry-tests" / f"gpt2-bpe-{SHA256[:16]}"
    if not root.is_dir():
        with machine_lock(f"gpt2-bpe-{SHA256[:16]}"):
            if not root.is_dir():
                _build_gpt2_tokenizer(llama_cpp_sdist, root)
    tok = AutoTokenizer.from_pretrained(root / "hf")
    texts = (root / "vocab.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    want = [[int(x) for x in line.split()] for line in (root / "vocab.out").read_text().splitlines()]
    assert len(texts) == len(want) > 20 and [tok.encode(t, add_special_tokens=False) for t in texts] == want
    return root / "hf"


def _build_gpt2_tokenizer(sdist: Path, root: Path) -> None:
    """The tokenizer of :func:`gpt2_tokenizer` and the test vectors, into ``root`` (renamed into place whole)."""
    import tarfile
    import tempfile

    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ferry.serving_tools import SDIST

    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gpt2-bpe-", dir=root.parent) as tmp:
        work = Path(tmp) / "built"
        work.mkdir()
        members = {f"{SDIST.llama_cpp}models/ggml-vocab-gpt-2.gguf{ext}": ext for ext in ("", ".inp", ".out")}
        with tarfile.open(sdist, "r:gz") as tar:
            for info in tar:
                if info.name in members:
                    (work / f"vocab{members[info.name]}").write_bytes(tar.extractfile(info).read())
        reader = gguf.GGUFReader(str(work / "vocab"))
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
        bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
        )
        tok.save_pretrained(work / "hf")
        (work / "vocab").unlink()
        work.rename(root)


def _build(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """A zoo family (its config builder), random-init, 1-D parameters moved off their init, the tokenizer of
    ``tokenizer_dir`` (vocabulary size, BOS and EOS set from it) and a ChatML chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = FAMILIES[family][0]()
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    bos, eos = (1, 2) if vocab == 512 else (vocab - 1, vocab - 1)  # our SentencePiece's <s> </s>; <|endoftext|>
    config.vocab_size, config.bos_token_id, config.eos_token_id = vocab, bos, eos
    if family == "qwen3_moe":
        config.mlp_only_layers = []
        config.norm_topk_prob = True
    if family == "gemma3_text":
        config.query_pre_attn_scalar = config.head_dim  # as Gemma-3 1B/4B/12B; llama.cpp assumes it
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    out = root / family
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        shutil.copyfile(file, out / file.name)
    (out / "chat_template.jinja").write_text(CHATML)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    return out


CASES = [
    ("llama", "bf16"),
    ("llama", "q8_0"),
    ("qwen2", "bf16"),
    ("qwen2", "q8_0"),
    ("qwen3", "bf16"),
    ("qwen3", "q8_0"),
    ("mistral", "bf16"),
    ("mistral", "q8_0"),
    ("gemma3_text", "bf16"),
    ("gemma3_text", "q8_0"),
    ("phi3", "bf16"),
    ("phi3", "q8_0"),
    ("qwen3_moe", "bf16"),
    ("qwen3_moe", "q8_0"),
]
ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "llama",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
}


#: Families whose converter takes only a byte-level BPE it knows: they get GPT-2's (vocabulary 50,257, EOS 50,256).
BPE_ONLY = ("qwen3_moe",)


@pytest.fixture(scope="session")
def gguf_zoo(tmp_path_factory, spm_tokenizer, gpt2_tokenizer):
    root = tmp_path_factory.mktemp("gguf-zoo")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _build(family, root, gpt2_tokenizer if family in BPE_ONLY else spm_tokenizer)
        return built[family]

    return get


def test_a_forked_converter_writes_what_an_execd_one_writes(gguf_zoo, converter, tmp_path, monkeypatch):
    # the same conversion both ways: the same file, byte for byte; and a forked converter's failure is the same line
    model = gguf_zoo("llama")
    forked = ferry_gguf.convert(model, tmp_path / "forked.gguf", "q8_0", converter=converter)
    monkeypatch.setenv("FERRY_TESTS_EXEC", "1")
    execd = ferry_gguf.convert(model, tmp_path / "execd.gguf", "q8_0", converter=converter)
    assert forked > 0 and execd > 0
    assert (tmp_path / "forked.gguf").read_bytes() == (tmp_path / "execd.gguf").read_bytes()
    (tmp_path / "broken").mkdir()
    shutil.copyfile(model / "config.json", tmp_path / "broken" / "config.json")  # no weights, no tokenizer
    lines = []
    for how in ("1", "0"):
        monkeypatch.setenv("FERRY_TESTS_EXEC", how)
        with pytest.raises(ExportError) as caught:
            ferry_gguf.convert(tmp_path / "broken", tmp_path / f"broken-{how}.gguf", "bf16", converter=converter)
        lines.append(str(caught.value).replace(f"broken-{how}", "broken-N"))
    assert lines[0] == lines[1] and "converter" in lines[0], lines


@pytest.mark.parametrize("family,gguf_type", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_zoo_family_converts_and_reads_back(gguf_zoo, converter, tmp_path, family, gguf_type, monkeypatch):
    """Static, weight-identity and logit checks of each family's GGUF. 5-15 s a case; the two Qwen3-MoE cases take
    about 25 s each on 2 quiet cores, 35-45 s loaded (GPT-2's 50,257-token vocabulary, quantized and read back)."""
    import gguf

    model = gguf_zoo(family)
    library_reader, opened = gguf.GGUFReader, []
    original_init = library_reader.__init__

    def counted_init(self, path, *args, **kwargs):
        opened.append(str(path))
        original_init(self, path, *args, **kwargs)

    monkeypatch.setattr(library_reader, "__init__", counted_init)
    path, report, times = ferry_gguf.write_gguf(
        model, tmp_path, gguf_type, converter=converter, prompts=["Once upon a time", "Write a short poem."]
    )
    assert report.passed, report.failures
    # the check parsed the file once: its static check and transformers' config and weight loads shared the reader
    assert opened == [str(path)] and gguf.GGUFReader is library_reader
    static = report.static
    assert static["architecture"] == ARCH[family]
    assert static["file_type"] == {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}[gguf_type]
    vocab, eos = (50257, 50256) if family in BPE_ONLY else (512, 2)
    assert static["vocab_size"] == vocab and static["chat_template_equal"] is True and static["eos_token_id"] == eos
    assert {"bf16": "BF16", "q8_0": "Q8_0"}[gguf_type] in report.tensor_types
    # every parameter proven a rounding of the merged one; logits equal the ideal model's in float32
    n_params = len(dict(__import__("transformers").AutoModelForCausalLM.from_pretrained(model).named_parameters()))
    assert report.weights_checked == n_params
    assert report.max_abs_diff <= report.tolerance and report.greedy_equal_ideal
    assert report.noise > 0  # the type rounds: the readback is not the float32 model itself
    assert times["convert_s"] > 0 and path.name.endswith(f"-{gguf_type}.gguf")


def test_qwen3_moe_without_renormalised_router_weights_is_refused(gguf_zoo, converter, tmp_path):
    # llama.cpp's qwen3moe graph renormalises the top-k weights whatever the GGUF says; a model that does not would
    # compute other outputs there, so the static check fails in one line (transformers' reading, given the export's
    # config, would still equal the model: only the static check can see this)
    model = tmp_path / "qwen3_moe-no-norm"
    shutil.copytree(gguf_zoo("qwen3_moe"), model)
    config = json.loads((model / "config.json").read_text())
    config["norm_topk_prob"] = False
    (model / "config.json").write_text(json.dumps(config))
    path, _, _ = ferry_gguf.write_gguf(model, tmp_path, "bf16", converter=converter, check=False)
    facts, failures, _ = ferry_gguf.static_check(path, model, "bf16")
    assert len(failures) == 1 and "norm_topk_prob is false" in failures[0] and "\n" not in failures[0]
    assert facts["hparams"]["expert_count"] == 4 and facts["hparams"]["expert_feed_forward_length"] == 32


def test_gemma3_attention_scale_llama_cpp_does_not_store_is_refused(gguf_zoo, converter, tmp_path):
    # the zoo's Gemma-3 left at transformers' default query_pre_attn_scalar 256 with head_dim 16: llama.cpp scales
    # by 1/sqrt(16) whatever the config says (seen as llama.cpp logits 0.2-0.5 off from position 1 on)
    model = tmp_path / "gemma3-scalar"
    shutil.copytree(gguf_zoo("gemma3_text"), model)
    config = json.loads((model / "config.json").read_text())
    config["query_pre_attn_scalar"] = 256
    (model / "config.json").write_text(json.dumps(config))
    _, report, _ = ferry_gguf.write_gguf(model, tmp_path, "bf16", converter=converter, prompts=["Hi"])
    assert len(report.failures) == 1 and "query_pre_attn_scalar is 256" in report.failures[0]
    assert "1/sqrt(16)" in report.failures[0] and "\n" not in report.failures[0]


def test_a_tokenizer_the_converter_does_not_know_is_one_line(stories_model, converter, tmp_path):
    # the zoo's Qwen3 with the stories260K BPE: llama.cpp's converter hashes the pre-tokenizer's output and knows no
    # such hash
    from tests.support.zoo import build

    model = build("qwen3", tmp_path / "zoo", stories_model)
    with pytest.raises(ExportError, match=r"does not recognise this tokenizer .*chkhsh [0-9a-f]{64}") as info:
        ferry_gguf.write_gguf(model, tmp_path, "bf16", converter=converter)
    assert "\n" not in str(info.value) and not list(tmp_path.glob("*.gguf"))


def test_weights_that_are_not_the_merged_ones_fail_the_check(gguf_zoo, converter, tmp_path):
    model = gguf_zoo("llama")
    path, _, _ = ferry_gguf.write_gguf(model, tmp_path, "bf16", converter=converter, check=False)
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    from safetensors.torch import load_file, save_file

    state = load_file(changed / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    state[key] = state[key] + 1e-3 * torch.randn_like(state[key])  # a layer whose LoRA update is missing
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    report = ferry_gguf.check_gguf(path, changed, "bf16", prompts=["Hi"])
    assert not report.passed and any(key in f for f in report.failures)


def test_k_quant_without_llama_cpp_says_how_before_merging(stories_copy, tmp_path, monkeypatch, llama_cpp_sdist):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not importable
    make_adapter(stories_copy, tmp_path / "adapter", target_modules=["q_proj"])
    with pytest.raises(ExportError, match=r"ollama create NAME --quantize q4_K_M -f Modelfile"):
        export(
            tmp_path / "adapter",
            tmp_path / "out",
            ExportOptions(base=stories_copy, formats="gguf", gguf_type="q4_k_m", llama_cpp_source=llama_cpp_sdist),
        )
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------- end to end
def test_export_hf_and_gguf_offline_through_the_cli(stories_copy, tmp_path, llama_cpp_sdist, converter):
    from transformers import AutoTokenizer

    from trainer.templates import get_template, write_chat_template

    adapter = tmp_path / "adapter"
    make_adapter(stories_copy, adapter, target_modules=LLAMA_TARGETS)
    tok = AutoTokenizer.from_pretrained(stories_copy)
    write_chat_template(get_template("alpaca"), tok)
    tok.save_pretrained(adapter)
    out = tmp_path / "merged"
    env = {**os.environ, "FERRY_CACHE": str(converter.parent.parent)}  # the converter extracted already
    args = ["export", "--adapter", str(adapter), "--base", str(stories_copy), "--output", str(out)]
    args += ["--format", "hf,gguf", "--gguf-type", "q8_0", "--llama-cpp-source", str(llama_cpp_sdist)]
    # forked with no network (its converter forked from it: the autouse fixture's), FERRY_TESTS_EXEC=1: exec'd
    proc = run_ferry(
        [*args, "--max-new-tokens", "4", "--prompt", "Once upon a time"], env=env, cwd=Path.cwd(), offline=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "smoke     passed" in proc.stdout
    gguf_file = next(out.glob("*-q8_0.gguf"))
    report = json.loads((out / "smoke_report.json").read_text())
    assert report["passed"] and report["gguf"]["passed"] and report["gguf"]["static"]["chat_template_equal"]
    assert report["gguf"]["greedy_equal_ideal"] is True and report["gguf"]["weights_checked"] > 0
    sums = (out / "SHA256SUMS").read_text()
    assert gguf_file.name in sums and "Modelfile" in sums and "SERVING.md" in sums
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out, check=True)
    modelfile = (out / "Modelfile").read_text()
    assert f"FROM ./{gguf_file.name}\n" in modelfile and "TEMPLATE" in modelfile
    assert 'SYSTEM """Below is an instruction' in modelfile  # alpaca's default system prompt
    assert 'PARAMETER stop "</s>"' in modelfile
    serving = (out / "SERVING.md").read_text()
    assert (
        f"llama-server -m {gguf_file}" in serving
        and "ollama create" in serving
        and f"vllm.entrypoints.openai.api_server --model {out}" in serving
    )
    import gguf

    stored = gguf.GGUFReader(str(gguf_file)).fields["tokenizer.chat_template"].contents()
    assert stored == (out / "chat_template.jinja").read_text()


# --------------------------------------------------------------------------------------------------- llama.cpp
#: Prompts whose words llama.cpp's tokenizer splits as HF's does even with the stories260K GGUF's equal scores
#: (see test_tokenizer_warnings_predict_what_llama_cpp_does: the third default prompt is split differently).
AGREEING_PROMPTS = ["Once upon a time", "The capital of France is"]


def test_llama_cpp_runs_the_f16_gguf_of_a_real_models_export(
    stories_copy, tmp_path, llama_cpp_sdist, llama_cpp_module, llama_cpp_build
):
    """The real stories260K with a LoRA merged, exported as hf + f16 GGUF in-process: llama.cpp (built from the
    pinned sdist) loads the GGUF, its token ids for the prompts are the HF tokenizer's and its greedy tokens the
    merged model's (with the f16-rounded weights, which are also the unrounded model's here). `ferry serve` on the
    GGUF starts llama-cpp-python's server, whose greedy completions equal the smoke report's texts (--check)."""
    adapter = tmp_path / "adapter"
    make_adapter(stories_copy, adapter, target_modules=LLAMA_TARGETS)
    out = tmp_path / "merged"
    report = export(
        adapter,
        out,
        ExportOptions(
            base=stories_copy,
            formats="hf,gguf",
            gguf_type="f16",
            llama_cpp_source=llama_cpp_sdist,
            prompts=AGREEING_PROMPTS,
            max_new_tokens=8,
        ),
    )
    smoke = json.loads((out / "smoke_report.json").read_text())["gguf"]
    assert smoke["passed"] and smoke["static"]["file_type"] == "MOSTLY_F16"
    ran = smoke["llama_cpp"]
    assert ran["version"] == llama_cpp_module.__version__ == "0.3.36"
    assert ran["tokens_equal"] is True and ran["greedy_equal"] is True
    assert [len(g) for g in ran["greedy"]] == [8, 8] and smoke["greedy_equal_merged"] is True
    # the stories260K tokenizer.json has no tokenizer.model: the converter's scores are all equal, which is flagged
    assert any(w.startswith("GGUF: llama.cpp will not split text") and "same score" in w for w in report.warnings)

    gguf_file = next(out.glob("*.gguf"))
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_build), "TMPDIR": str(tmp_path)}
    done = fork_ferry(["serve", str(gguf_file), "--check", "--port", str(free_port())], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("starting llama.cpp on 127.0.0.1:")
    assert f"check passed: 2 prompts answered as in {out / 'smoke_report.json'}" in done.stdout


def test_k_quant_through_the_built_llama_cpp_offline_cli(
    stories_copy, tmp_path, llama_cpp_sdist, converter, llama_cpp_build
):
    """``ferry export --gguf-type q4_k_m`` offline with llama-cpp-python importable (the test build on PYTHONPATH):
    llama.cpp's quantizer writes a Q4_K_M file the gguf reader accepts, and smoke_report.json carries llama.cpp's
    own run. Exec'd, not forked: llama.cpp's quantizer and its smoke run use GNU OpenMP, whose thread pool does not
    survive a fork (a forked export hung under xdist once an earlier test in the worker had run llama.cpp)."""
    import gguf

    adapter = tmp_path / "adapter"
    make_adapter(stories_copy, adapter, target_modules=LLAMA_TARGETS)
    out = tmp_path / "merged"
    env = {
        **os.environ,
        "FERRY_CACHE": str(converter.parent.parent),
        "PYTHONPATH": os.pathsep.join([str(llama_cpp_build), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    proc = run_offline(
        [
            sys.executable,
            "-m",
            "ferry",
            "export",
            "--adapter",
            adapter,
            "--base",
            stories_copy,
            "--output",
            out,
            "--format",
            "gguf",
            "--gguf-type",
            "q4_k_m",
            "--llama-cpp-source",
            llama_cpp_sdist,
            "--max-new-tokens",
            "4",
            "--prompt",
            AGREEING_PROMPTS[0],
        ],
        env=env,
        cwd=Path.cwd(),
    )
    assert "smoke     passed" in proc.stdout and "llama.cpp will not split text" in proc.stdout
    path = next(out.glob("*-q4_k_m.gguf"))
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    # rows of 64 are not a multiple of a K-quant's 256-value block: llama.cpp falls back to Q5_0 / Q8_0 per tensor
    types = {t.tensor_type.name for t in reader.tensors}
    assert types & {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} and "BF16" not in types
    report = json.loads((out / "smoke_report.json").read_text())["gguf"]
    assert report["passed"] and report["static"]["file_type"] == "MOSTLY_Q4_K_M" and report["times"]["quantize_s"] > 0
    assert report["llama_cpp"]["version"] == "0.3.36" and report["llama_cpp"]["tokens_equal"] is True
    assert len(report["llama_cpp"]["greedy"][0]) == 8 and report["llama_cpp"]["greedy_equal"] is None  # not f16
    assert not list(out.glob("*.safetensors"))  # gguf only


def test_tokenizer_warnings_predict_what_llama_cpp_does(gguf_zoo, converter, stories_model, tmp_path, llama_cpp_module):
    """Each static tokenizer warning names a real difference: llama.cpp splits the prompt otherwise exactly where a
    warning was raised, and nowhere else.

    * llama with a SentencePiece tokenizer.model: no warning, the same ids;
    * gemma3_text with the same tokenizer.model: the converter forces ``add_space_prefix`` false (Gemma's own
      SentencePiece models add no dummy prefix; this one does): warned, and llama.cpp's ids differ;
    * stories260K (tokenizer.json only): every score -1000: warned, and the third default prompt splits otherwise.

    About 20 s (three conversions and checks, f32 so that llama.cpp's greedy tokens are judged).
    """
    from exporter.smoke import DEFAULT_PROMPTS

    seen = {}
    for name, model in (
        ("llama", gguf_zoo("llama")),
        ("gemma3_text", gguf_zoo("gemma3_text")),
        ("stories260K", stories_model),
    ):
        gguf_type = "f32"  # llama.cpp then computes in float32 too: its greedy tokens are judged
        (tmp_path / name).mkdir()
        path, _, _ = ferry_gguf.write_gguf(model, tmp_path / name, gguf_type, converter=converter, check=False)
        report = ferry_gguf.check_gguf(path, model, gguf_type, prompts=DEFAULT_PROMPTS, max_new_tokens=2)
        seen[name] = report
        assert report.llama_cpp is not None
        mismatched = [f for f in report.failures if f.startswith("llama.cpp tokenizes prompt")]
        assert bool(report.warnings) == bool(mismatched) == (not report.llama_cpp["tokens_equal"]), name
        assert [f for f in report.failures if f not in mismatched] == [], name  # weights and logits are right
    assert not seen["llama"].warnings
    assert len(seen["gemma3_text"].warnings) == 1 and "add_space_prefix is false" in seen["gemma3_text"].warnings[0]
    assert seen["gemma3_text"].static["hf_adds_space_prefix"] is True
    assert len(seen["stories260K"].warnings) == 1 and "same score (-1000)" in seen["stories260K"].warnings[0]
    assert [f.split(" as ")[0] for f in seen["stories260K"].failures] == ["llama.cpp tokenizes prompt 2"]


# --------------------------------------------------------------------------------------------------- Ollama
GO_RENDER = r"""package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string
	Content string
}

type Case struct {
	Template string
	System   string
	Messages []Message
}

func main() {
	var cases []Case
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		panic(err)
	}
	out := []string{}
	for _, c := range cases {
		t := template.Must(template.New("t").Parse(c.Template))
		var b strings.Builder
		if err := t.Execute(&b, map[string]any{"System": c.System, "Messages": c.Messages}); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


@pytest.fixture(scope="session")
def go_render(tmp_path_factory):
    """Render Ollama templates with Go's text/template (Ollama's engine), as Ollama passes them: ``.System`` is
    the conversation's system message (else the Modelfile's SYSTEM), ``.Messages`` every message."""
    go = shutil.which("go")
    assert go, "Go is needed to render Ollama templates (make test-deps installs golang-go)"
    root = tmp_path_factory.mktemp("gorender")
    (root / "main.go").write_text(GO_RENDER)
    env = {
        **os.environ,
        # Go's build cache is keyed by content: one per machine, so its standard library is compiled once
        "GOCACHE": str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry-tests" / "go-build"),
        "GOPATH": str(root / "gopath"),
        "GO111MODULE": "off",
        "GOFLAGS": "-mod=mod",
        "CGO_ENABLED": "0",
    }
    subprocess.run([go, "build", "-o", str(root / "render"), str(root / "main.go")], check=True, env=env, cwd=root)

    def render(cases: list[dict]) -> list[str]:
        proc = subprocess.run(
            [str(root / "render")], input=json.dumps(cases), capture_output=True, text=True, check=True
        )
        return json.loads(proc.stdout)

    return render


EXPRESSIBLE = (
    "chatml",
    "qwen",
    "llama3",
    "alpaca",
    "vicuna",
    "default",
    "phi",
    "zephyr",
    "qwen3_nothink",
    "yi",
    "deepseek3",
    "smollm2",
    "cohere",
)
#: templates that fold the system prompt into the first user turn: no TEMPLATE (Ollama reads the GGUF's)
FOLDED = ("llama2", "mistral", "gemma")


def test_modelfile_template_renders_like_the_chat_template(stories_model, go_render):
    sys.path.insert(0, str(GOLDEN))
    from conversations import CONVERSATIONS
    from transformers import AutoTokenizer

    from trainer.templates import TEMPLATES, get_template, write_chat_template

    tok = AutoTokenizer.from_pretrained(stories_model)
    cases, wants, names, refused = [], [], [], []
    for name in TEMPLATES:
        template = get_template(name)
        write_chat_template(template, tok)
        pieces = turn_pieces(tok)
        if pieces is None:
            refused.append(name)
            continue
        names.append(name)
        for conv in CONVERSATIONS.values():
            if conv["tools"] or any(m["role"] not in ("user", "assistant") for m in conv["messages"]):
                continue
            messages = ([{"role": "system", "content": conv["system"]}] if conv["system"] else []) + conv["messages"][
                :-1
            ]
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            system = conv["system"] or pieces.default_system or ""
            cases.append(
                {
                    "Template": go_template(pieces),
                    "System": system,
                    "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages],
                }
            )
            wants.append(want[len(pieces.bos) :])
    got = go_render(cases)
    assert got == wants
    missing = [n for n in EXPRESSIBLE if n in TEMPLATES and n not in names]
    assert not missing, f"turn-by-turn templates not written as Go templates: {missing}"
    assert all(n in refused for n in FOLDED if n in TEMPLATES)
    assert len(names) >= 20, (names, refused)


# --------------------------------------------------------------------------------------------------- vLLM
def test_vllm_fit_flags_modules_to_save_and_passes_plain_lora(stories_copy, tmp_path):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    make_adapter(stories_copy, plain, target_modules=LLAMA_TARGETS, r=24)
    saved = tmp_path / "saved"
    make_adapter(stories_copy, saved, target_modules=["q_proj"], modules_to_save=["lm_head"])
    fit = vllm_lora_fit(plain)
    assert fit.fits and fit.max_lora_rank == 32 and not fit.reasons
    flagged = vllm_lora_fit(saved)
    assert not flagged.fits and "modules_to_save" in flagged.reasons[0]
    assert not vllm_lora_fit({"r": 8, "target_modules": ["q_proj"], "use_dora": True}).fits
    assert not vllm_lora_fit({"r": 1024, "target_modules": ["q_proj"]}).fits

    AutoTokenizer.from_pretrained(stories_copy).save_pretrained(plain)
    report = export(plain, tmp_path / "out-plain", ExportOptions(base=stories_copy, adapter_only=True))
    serving = (tmp_path / "out-plain" / "SERVING.md").read_text()
    assert f"--lora-modules out-plain={tmp_path / 'out-plain'} --max-lora-rank 32" in serving
    assert any("vLLM serves this adapter" in w for w in report.warnings)
    report = export(saved, tmp_path / "out-saved", ExportOptions(base=stories_copy, adapter_only=True))
    line = next(w for w in report.warnings if "vLLM" in w)
    assert "does not take this adapter" in line and "merged model" in line and "\n" not in line
    assert "ferry export --adapter" in (tmp_path / "out-saved" / "SERVING.md").read_text()


# --------------------------------------------------------------------------------------------------- carried
def test_pack_carries_the_converter_and_install_places_it(tmp_path, llama_cpp_sdist, llamafactory_data, monkeypatch):
    from bundler.install import install
    from bundler.installer import prefix as installed_prefix
    from bundler.pack import pack
    from bundler.spec import load_spec
    from ferry.serving_tools import SDIST, TOOL_FILES

    assert installed_prefix.TOOL_FILES is TOOL_FILES  # install.py places ferry's own pins, not a copy
    house = tmp_path / "house"  # a find-links folder holding the sdist (no 77 MB download in the test)
    house.mkdir()
    os.link(llama_cpp_sdist, house / SDIST.filename)
    spec = load_spec(
        name="servekit",
        datasets=[str(llamafactory_data / "dataset_info.json")],
        find_links=[str(house)],
        extras=["gguf"],
    )
    spec.wheels.requirements = ["six==1.17.0"]
    result = pack(spec, tmp_path / "out", progress=False)
    wheels = next(i for i in result.manifest["items"] if i["kind"] == "wheels")
    names = {f["path"]: f["sha256"] for f in wheels["files"]}
    assert names[SDIST.filename] == SDIST.sha256
    for project in ("sentencepiece-", "protobuf-", "numpy-", "pyyaml-", "gguf-", "six-"):
        assert any(n.lower().startswith(project) and n.endswith(".whl") for n in names), project
    assert "llama" not in (result.bundle_dir / "wheels" / "requirements.lock").read_text()  # pip never builds it

    prefix = tmp_path / "prefix"
    install(result.bundle_dir, prefix, create_venv=False)
    placed = prefix / "tools" / SDIST.filename
    assert placed.is_file() and ferry_gguf.sha256_file(placed) == SDIST.sha256
    monkeypatch.setenv("FERRY_HOME", str(prefix))
    assert (ferry_gguf.find_converter() / "convert_hf_to_gguf.py").is_file()  # export finds it there
    assert installed_prefix.verify_prefix(prefix)["problems"] == []
    with open(placed, "r+b") as f:  # drift in the carried tool is named
        f.seek(1000)
        f.write(b"\0")
    assert any(f"tools/{SDIST.filename}" in p for p in installed_prefix.verify_prefix(prefix)["problems"])


def test_a_qwen2_vl_export_writes_its_vision_part_and_llama_cpp_reads_the_text_part(
    converter, gpt2_tokenizer, tmp_path, llama_cpp_module, llama_cpp_sdist
):
    """A tiny random Qwen2-VL (GPT-2's byte-level BPE, which the converter knows, with the Qwen chat and vision
    tokens) and a LoRA on its language model, exported as f32 GGUF: llama.cpp's converter writes the language model
    and, with ``--mmproj``, the vision part; the projector file's facts match the vision config; llama.cpp (built
    from the pinned sdist) tokenizes the prompts as the HF tokenizer does and its greedy tokens are the merged
    model's (transformers cannot read a qwen2vl GGUF back: llama.cpp is the reader); SERVING.md's llama-server
    line loads the projector."""
    from tests.support.helpers import random_adapter
    from tests.support.vlm import build

    base = build(tmp_path / "models", "qwen2_vl", gpt2_tokenizer, base_vocab=50257)
    targets = ["model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.mlp.down_proj"]
    adapter = random_adapter(base, tmp_path / "adapter", 3, targets, auto="AutoModelForImageTextToText")
    out = tmp_path / "merged"
    options = ExportOptions(
        formats="hf,gguf", gguf_type="f32", llama_cpp_source=llama_cpp_sdist, prompts=["Hello world"], max_new_tokens=6
    )
    export(adapter, out, options)
    smoke = json.loads((out / "smoke_report.json").read_text())
    gguf = smoke["gguf"]
    assert gguf["passed"], gguf["failures"]
    assert gguf["static"]["architecture"] == "qwen2vl"
    assert gguf["llama_cpp"]["tokens_equal"] is True and gguf["llama_cpp"]["greedy_equal"] is True
    assert gguf["llama_cpp"]["greedy"] == gguf["llama_cpp"]["merged_greedy"]
    projector = gguf["mmproj"]
    config = json.loads((base / "config.json").read_text())
    assert projector["failures"] == [] and projector["type"] == "mmproj" and projector["has_vision_encoder"]
    assert projector["block_count"] == config["vision_config"]["depth"]
    assert projector["projection_dim"] == config["text_config"]["hidden_size"]
    main_file = out / gguf["file"]
    assert (out / f"mmproj-{main_file.name}").is_file()
    serving = (out / "SERVING.md").read_text()
    assert f"--mmproj {out / ('mmproj-' + main_file.name)}" in serving
