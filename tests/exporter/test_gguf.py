"""GGUF, Ollama and vLLM outputs of ``ferry export`` (issue 17), against what ferry did not write: llama.cpp's own
converter from the pinned llama-cpp-python sdist, the ``gguf`` package's reader, transformers reading the GGUF back,
Go's ``text/template`` (Ollama's template engine) rendering the Modelfile's TEMPLATE, and peft's adapters.

Zoo families (tests/models/zoo.py configs) get a SentencePiece tokenizer trained here with ``sentencepiece`` (the
zoo's stories260K tokenizer is a BPE whose pre-tokenizer llama.cpp does not know, which the unknown-tokenizer test
uses); Qwen3 keeps its default head_dim (transformers' GGUF reader assumes it) and Qwen3-MoE has no dense layer
(llama.cpp's qwen3moe has none: the zoo's ``mlp_only_layers=[0]`` is refused, one line).
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
from exporter.serving import vllm_lora_fit
from ferry.errors import ExportError
from tests.exporter.conftest import LLAMA_TARGETS, make_adapter
from tests.llama_cpp_sdist import llama_cpp_sdist  # noqa: F401 - session fixture
from tests.models.zoo import FAMILIES
from tests.netns import run_offline

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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
    spm.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "tokenizer"),
                                   vocab_size=512, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   num_threads=1, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    src = root / "src"
    src.mkdir()
    shutil.copyfile(root / "tokenizer.model", src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                           "eos_token": "</s>", "unk_token": "<unk>",
                                                           "pad_token": "<unk>"}))
    out = root / "hf"
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    shutil.copyfile(root / "tokenizer.model", out / "tokenizer.model")
    return out


def _build(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """A zoo family (its config builder), random-init, 1-D parameters moved off their init, our SPM tokenizer and a
    ChatML chat template."""
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family][0]()
    if family == "qwen3":
        config.head_dim = 128  # transformers' GGUF reader takes Qwen3's default head_dim
    if family == "qwen3_moe":
        config.mlp_only_layers = []
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
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


CASES = [("llama", "bf16"), ("qwen2", "bf16"), ("qwen3", "bf16"), ("qwen3", "q8_0"),
         ("mistral", "bf16"), ("gemma3_text", "bf16"), ("phi3", "bf16")]
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma3_text": "gemma3",
        "phi3": "phi3", "qwen3_moe": "qwen3moe"}


@pytest.fixture(scope="session")
def gguf_zoo(tmp_path_factory, spm_tokenizer):
    root = tmp_path_factory.mktemp("gguf-zoo")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _build(family, root, spm_tokenizer)
        return built[family]

    return get


@pytest.mark.parametrize("family,gguf_type", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_zoo_family_converts_and_reads_back(gguf_zoo, converter, tmp_path, family, gguf_type):
    model = gguf_zoo(family)
    path, report, times = ferry_gguf.write_gguf(model, tmp_path, gguf_type, converter=converter,
                                                prompts=["Once upon a time", "Write a short poem."])
    assert report.passed, report.failures
    static = report.static
    assert static["architecture"] == ARCH[family]
    assert static["file_type"] == {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}[gguf_type]
    assert static["vocab_size"] == 512 and static["chat_template_equal"] is True and static["eos_token_id"] == 2
    assert {"bf16": "BF16", "q8_0": "Q8_0"}[gguf_type] in report.tensor_types
    # every parameter proven a rounding of the merged one; logits equal the ideal model's in float32
    n_params = len(dict(__import__("transformers").AutoModelForCausalLM.from_pretrained(model).named_parameters()))
    assert report.weights_checked == n_params
    assert report.max_abs_diff <= report.tolerance and report.greedy_equal_ideal
    assert report.noise > 0  # the type rounds: the readback is not the float32 model itself
    assert times["convert_s"] > 0 and path.name.endswith(f"-{gguf_type}.gguf")


def test_a_tokenizer_the_converter_does_not_know_is_one_line(stories_model, converter, tmp_path):
    # the zoo's Qwen3 with the stories260K BPE: llama.cpp's converter hashes the pre-tokenizer's output and knows no
    # such hash
    from tests.models.zoo import build

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
        export(tmp_path / "adapter", tmp_path / "out", base=stories_copy, formats="gguf", gguf_type="q4_k_m",
               llama_cpp_source=llama_cpp_sdist)
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
    proc = run_offline([sys.executable, "-m", "ferry", "export", "--adapter", adapter, "--base", stories_copy,
                        "--output", out, "--format", "hf,gguf", "--gguf-type", "q8_0", "--llama-cpp-source",
                        llama_cpp_sdist, "--max-new-tokens", "4", "--prompt", "Once upon a time"],
                       env=env, cwd=Path.cwd())
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
    assert f"llama-server -m {gguf_file}" in serving and "ollama create" in serving and f"vllm serve {out}" in serving
    import gguf

    stored = gguf.GGUFReader(str(gguf_file)).fields["tokenizer.chat_template"].contents()
    assert stored == (out / "chat_template.jinja").read_text()


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
    env = {**os.environ, "GOCACHE": str(root / "cache"), "GOPATH": str(root / "gopath"), "GO111MODULE": "off",
           "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    subprocess.run([go, "build", "-o", str(root / "render"), str(root / "main.go")], check=True, env=env, cwd=root)

    def render(cases: list[dict]) -> list[str]:
        proc = subprocess.run([str(root / "render")], input=json.dumps(cases), capture_output=True, text=True,
                              check=True)
        return json.loads(proc.stdout)

    return render


EXPRESSIBLE = ("chatml", "qwen", "llama3", "alpaca", "vicuna", "default", "phi", "zephyr", "qwen3_nothink", "yi",
               "deepseek3", "smollm2", "cohere")
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
            messages = ([{"role": "system", "content": conv["system"]}] if conv["system"] else []) \
                + conv["messages"][:-1]
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            system = conv["system"] or pieces.default_system or ""
            cases.append({"Template": go_template(pieces), "System": system,
                          "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]})
            wants.append(want[len(pieces.bos):])
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
    report = export(plain, tmp_path / "out-plain", base=stories_copy, adapter_only=True)
    serving = (tmp_path / "out-plain" / "SERVING.md").read_text()
    assert f"--lora-modules out-plain={tmp_path / 'out-plain'} --max-lora-rank 32" in serving
    assert any("vLLM serves this adapter" in w for w in report.warnings)
    report = export(saved, tmp_path / "out-saved", base=stories_copy, adapter_only=True)
    line = next(w for w in report.warnings if "vLLM" in w)
    assert "does not take this adapter" in line and "merged model" in line and "\n" not in line
    assert "ferry export --adapter" in (tmp_path / "out-saved" / "SERVING.md").read_text()


# --------------------------------------------------------------------------------------------------- carried
def test_pack_carries_the_converter_and_install_places_it(tmp_path, llama_cpp_sdist, llamafactory_data, monkeypatch):
    from bundler import standalone
    from bundler.install import install
    from bundler.pack import pack
    from bundler.spec import load_spec
    from ferry.serving_tools import SDIST, TOOL_FILES

    assert standalone.TOOL_FILES == TOOL_FILES  # install.py's copy
    house = tmp_path / "house"  # a find-links folder holding the sdist (no 77 MB download in the test)
    house.mkdir()
    os.link(llama_cpp_sdist, house / SDIST.filename)
    spec = load_spec(name="servekit", datasets=[str(llamafactory_data / "dataset_info.json")],
                     find_links=[str(house)], extras=["gguf"])
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
    assert standalone.verify_prefix(prefix)["problems"] == []
    with open(placed, "r+b") as f:  # drift in the carried tool is named
        f.seek(1000)
        f.write(b"\0")
    assert any(f"tools/{SDIST.filename}" in p for p in standalone.verify_prefix(prefix)["problems"])
