"""``ferry chat CONFIG.yaml`` with LLaMA-Factory 0.9.5's own inference YAML (examples/inference/qwen3_lora_sft.yaml
from the hash-pinned sdist; only paths, the template fitting the tiny model and sizes changed), driven through a
pipe: two turns, `clear`, one more, `exit`. Each streamed reply equals peft's greedy generation from the template's
prompt with the history."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from ferry.errors import ConfigError
from tests.exporter.test_lf_merge import random_adapter
from tests.pinned_sdist import LLAMAFACTORY

ROOT = Path(__file__).resolve().parents[2]


def inference_yaml(folder: Path, **changes) -> Path:
    cfg = yaml.safe_load((LLAMAFACTORY.path() / "examples" / "inference" / "qwen3_lora_sft.yaml").read_text("utf-8"))
    cfg.update(changes)
    path = folder / "chat.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def greedy(model, tokenizer, template, messages: list[dict[str, str]], n: int) -> str:
    ids = torch.tensor([template.encode_prompt(tokenizer, messages, None)])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_chat_through_a_pipe_streams_peft_greedy_replies_with_history(stories_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.chat import chat_loop
    from trainer.templates import get_template

    adapter = random_adapter(stories_model, tmp_path / "run", 5, ["q_proj", "v_proj"])
    config = inference_yaml(tmp_path, model_name_or_path=str(stories_model), adapter_name_or_path=str(adapter),
                            template="alpaca", do_sample=False, max_new_tokens=10)
    turns = ["Once upon a time", "What happened next?", "clear", "Tell me a story", "exit", "never read"]
    stdout = io.StringIO()
    assert chat_loop(config, io.StringIO("\n".join(turns) + "\n"), stdout) == 3  # the CLI's path, in-process
    proc = SimpleNamespace(stdout=stdout.getvalue())
    replies = [part.split("\n", 1)[0] for part in proc.stdout.split("Assistant: ")[1:]]
    assert len(replies) == 3 and all(r.strip() for r in replies), proc.stdout

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32),
                                      str(adapter)).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories_model)
    template = get_template("alpaca")
    template.fix_special_tokens(tokenizer)
    first = greedy(model, tokenizer, template, [{"role": "user", "content": turns[0]}], 10)
    assert replies[0] == first
    second = greedy(model, tokenizer, template, [{"role": "user", "content": turns[0]},
                                                 {"role": "assistant", "content": first},
                                                 {"role": "user", "content": turns[1]}], 10)
    assert replies[1] == second
    assert replies[2] == greedy(model, tokenizer, template, [{"role": "user", "content": turns[3]}], 10)  # cleared
    assert "history cleared" in proc.stdout


@pytest.mark.parametrize("changes, match", [
    ({"infer_backend": "vllm"}, "infer_backend: vllm is not ferry chat's backend"),
    ({"infer_backend": "sglang"}, "export the merged model"),
    ({"template": "no_such_template"}, "template"),
    ({"temprature": 0.5}, "did you mean 'temperature'"),
])
def test_chat_yaml_refusals_are_one_line(stories_model, tmp_path, changes, match):
    from exporter.chat import read_chat_config

    config = inference_yaml(tmp_path, model_name_or_path=str(stories_model), adapter_name_or_path=None, **changes)
    with pytest.raises(ConfigError, match=match) as err:
        read_chat_config(config)
    assert "\n" not in str(err.value)
    if "infer_backend" not in changes or changes["infer_backend"] != "vllm":
        return  # the CLI path once: exit 2, one line, no traceback
    proc = subprocess.run([sys.executable, "-m", "ferry", "chat", str(config)], input="exit\n", cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True, capture_output=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("ferry: error:") == 1 and "Traceback" not in proc.stderr
