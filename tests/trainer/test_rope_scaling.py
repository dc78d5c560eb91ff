"""``rope_scaling``: the model's RoPE stretched to train past its context, decided as LLaMA-Factory decides it.

The reference for the decision is LLaMA-Factory 0.9.5's own ``configure_rope`` (``model/model_utils/rope.py`` of
the hash-pinned sdist, executed here with its ``RopeScaling`` enum read from its ``extras/constants.py``; its
logger replaced by a list): for every type and context the factor, the rope parameters and the enlarged context
must be LLaMA-Factory's, with ``rope_theta`` kept (LLaMA-Factory's transformers-4 assignment drops it under
transformers 5). The rest runs a real 2-step run on stories260K (512 positions) at ``cutoff_len`` 600 and checks
every reader of what it wrote: transformers' rotary tables in training (DDP and FSDP model builds), the adapter's
``ferry_rope.json``, the merged export's config.json read by transformers (and its smoke check, whose peft
reference loads the base stretched), ``ferry chat``, prediction, and the refusals (lm-eval, a chat or merge YAML
asking another scaling, a model without RoPE).
"""

from __future__ import annotations

import ast
import json
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ferry.errors import ConfigError
from ferry.rope import ROPE_SCALING_TYPES, RopeScaling, decide_rope_scaling, scaled_config_dict
from tests.support.helpers import run_plain_worker, tiny_config, worker_env, write_config
from tests.support.pinned_sdist import LLAMAFACTORY

pytestmark = pytest.mark.budget(90, reason="a 2-step one-process run, its export with the smoke check, chat loads")


def _lf_configure_rope() -> tuple[Any, Any, list[str]]:
    """LLaMA-Factory's ``configure_rope`` and ``RopeScaling`` from the pinned sdist, and the list its logger's
    warnings land in."""
    src = LLAMAFACTORY.path() / "src" / "llamafactory"
    constants = ast.parse((src / "extras" / "constants.py").read_text(encoding="utf-8"))
    enum_class = next(n for n in constants.body if isinstance(n, ast.ClassDef) and n.name == "RopeScaling")
    namespace: dict[str, Any] = {}
    exec(
        compile(ast.Module([ast.parse("from enum import StrEnum").body[0], enum_class], []), "constants", "exec"),
        namespace,
    )
    rope_enum = namespace["RopeScaling"]
    warned: list[str] = []
    logger = types.SimpleNamespace(warning_rank0=warned.append, info_rank0=lambda msg: None)
    module = ast.parse((src / "model" / "model_utils" / "rope.py").read_text(encoding="utf-8"))
    body = [n for n in module.body if not isinstance(n, ast.ImportFrom) or n.level == 0]
    body = [n for n in body if not (isinstance(n, ast.Assign) and ast.unparse(n.value).startswith("logging."))]
    scope: dict[str, Any] = {"RopeScaling": rope_enum, "logger": logger, "math": math}
    exec(compile(ast.Module(body, []), "rope.py", "exec"), scope)
    return scope["configure_rope"], rope_enum, warned


CONTEXTS = [
    {"max_position_embeddings": 512, "rope_theta": 10000.0},  # a transformers-4 config.json (stories260K's)
    {"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},  # t5
    {  # Llama 3.1: an earlier llama3 scaling whose original context is the one to stretch
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    },
]


@pytest.mark.parametrize("rope_type", ROPE_SCALING_TYPES)
@pytest.mark.parametrize("context", range(len(CONTEXTS)))
def test_the_decision_is_llamafactorys(rope_type: str, context: int) -> None:
    configure_rope, rope_enum, warned = _lf_configure_rope()
    raw = CONTEXTS[context]
    old = (raw.get("rope_scaling") or {}).get("original_max_position_embeddings") or raw["max_position_embeddings"]
    for cutoff_len in (old // 2, old, old + 1, 3 * old - 5, 4 * old):
        lf_config = types.SimpleNamespace(
            rope_scaling=dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {}) or None,
            max_position_embeddings=raw["max_position_embeddings"],
        )
        del warned[:]
        configure_rope(lf_config, types.SimpleNamespace(rope_scaling=rope_enum(rope_type), model_max_length=cutoff_len))
        ours, warning = decide_rope_scaling(raw, rope_type, cutoff_len)
        if cutoff_len <= old:  # LLaMA-Factory leaves the config alone and warns
            assert ours is None and warning and "not applied" in warning
            assert any("smaller than max length" in w for w in warned)
            assert lf_config.max_position_embeddings == raw["max_position_embeddings"]
            continue
        assert ours is not None and warning is None
        assert ours.scaling() == lf_config.rope_scaling, (cutoff_len, lf_config.rope_scaling)
        assert ours.max_position_embeddings == lf_config.max_position_embeddings
        written = scaled_config_dict(raw, ours)
        theta = raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"]
        kept = written.get("rope_parameters", {}).get("rope_theta", written.get("rope_theta"))
        assert kept == theta  # LLaMA-Factory's assignment loses it under transformers 5; ferry keeps it


def test_models_whose_rope_cannot_be_stretched_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="names no rotary position embedding"):
        decide_rope_scaling({"max_position_embeddings": 1024, "n_positions": 1024}, "linear", 4096, where="gpt2")
    with pytest.raises(ConfigError, match="per attention-layer type"):
        decide_rope_scaling(
            {
                "max_position_embeddings": 8192,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            },
            "yarn",
            20000,
        )
    with pytest.raises(ConfigError, match="text_config"):
        decide_rope_scaling({"text_config": {"max_position_embeddings": 4096, "rope_theta": 1e6}}, "linear", 9000)
    with pytest.raises(ConfigError, match="not one of"):
        decide_rope_scaling({"max_position_embeddings": 512, "rope_theta": 1e4}, "ntk", 2048)
    with pytest.raises(ConfigError, match="ferry_rope.json: not a ferry RoPE record"):
        RopeScaling.from_record({"rope_scaling": "linear"}, "ferry_rope.json")


@pytest.fixture(scope="module")
def stretched_run(stories_model: Path, llamafactory_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step one-process run on stories260K (512 positions) with ``cutoff_len: 600, rope_scaling: linear``
    (LLaMA-Factory's ``empty`` template)."""
    work = tmp_path_factory.mktemp("rope")
    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        work,
        max_steps=2,
        cutoff_len=600,
        rope_scaling="linear",
        template="empty",  # prompts rendered as they are: llama.cpp splits them as the HF tokenizer does
    )
    run_plain_worker(write_config(work / "train.yaml", cfg), env=worker_env(work), cwd=work)
    return work / "out"


def test_training_builds_the_stretched_model_ddp_and_fsdp_alike(
    stories_model: Path, llamafactory_data: Path, tmp_path: Path, capsys: Any
) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainConfig
    from trainer.fsdp import _meta_model
    from trainer.launch import model_config
    from trainer.modeling import build_lora_model

    base = AutoModelForCausalLM.from_pretrained(stories_model)
    cfg = TrainConfig(**tiny_config(stories_model, llamafactory_data, tmp_path, cutoff_len=1500, rope_scaling="linear"))
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    rotary = model.get_base_model().model.rotary_emb
    assert torch.equal(rotary.inv_freq, base.model.rotary_emb.inv_freq / 3)  # ceil(1500 / 512) = 3
    assert model.config.max_position_embeddings == 1536 and model.config.rope_parameters["rope_theta"] == 10000.0
    meta = _meta_model(cfg, stories_model, dtype=torch.float32, vocab=None)  # FSDP's skeleton, the same config
    assert meta.config.rope_parameters == model.config.rope_parameters
    assert model_config(cfg, stories_model).rope_parameters == model.config.rope_parameters  # the launcher's
    fits = cfg.model_copy(update={"cutoff_len": 512})
    assert model_config(fits, stories_model).rope_parameters["rope_type"] == "default"
    assert "rope_scaling: linear not applied: cutoff_len 512 fits the model's 512 positions" in capsys.readouterr().err


def test_the_adapter_records_it_and_the_export_carries_it(
    stretched_run: Path, tmp_path: Path, llama_cpp_sdist: Path, llama_cpp_module: Any
) -> None:
    """The record; the merged export's config.json (read by transformers), its smoke check; its f32 GGUF, which
    carries the scaling as llama.cpp's converter writes it and which llama.cpp itself runs to the merged model's
    greedy tokens; a dynamic scaling, which llama.cpp has not, refused in the GGUF's proof."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from exporter import gguf as ferry_gguf
    from exporter.export import export

    record = json.loads((stretched_run / "adapter" / "ferry_rope.json").read_text())
    assert record == {
        "format": 1,
        "rope_scaling": "linear",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
        "max_position_embeddings": 1024,
        "scaling": {"rope_type": "linear", "factor": 2.0},
    }
    options = _options(
        formats="hf,gguf",
        gguf_type="f32",
        llama_cpp_source=llama_cpp_sdist,
        prompts=["Once upon a time", "The capital of France is"],  # split alike by llama.cpp (tests/exporter)
        max_new_tokens=8,
    )
    report = export(stretched_run / "adapter", tmp_path / "merged", options=options)
    assert report.smoke is not None and report.smoke["passed"], report.smoke
    gguf = json.loads((tmp_path / "merged" / "smoke_report.json").read_text())["gguf"]
    assert gguf["passed"] and gguf["llama_cpp"]["greedy_equal"] is True, gguf
    assert gguf["static"]["hparams"]["rope.scaling.type"] == "linear"
    assert gguf["static"]["hparams"]["rope.scaling.factor"] == 2.0
    dynamic = tmp_path / "dynamic"
    shutil.copytree(tmp_path / "merged", dynamic, ignore=shutil.ignore_patterns("*.gguf"))
    config_dict = json.loads((dynamic / "config.json").read_text())
    config_dict["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 512}
    (dynamic / "config.json").write_text(json.dumps(config_dict))
    converter = ferry_gguf.find_converter(llama_cpp_sdist)
    path, _, _ = ferry_gguf.write_gguf(dynamic, dynamic, "f32", converter=converter, check=False)
    _, failures, _ = ferry_gguf.static_check(path, dynamic, "f32")
    assert failures == [
        "config rope_type dynamic (factor 2): llama.cpp has no dynamic NTK RoPE scaling for llama, so it would "
        "compute other outputs than this model past its first positions"
    ]
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and written["rope_theta"] == 10000.0
    assert written["max_position_embeddings"] == 1024
    assert json.loads((tmp_path / "merged" / "ferry_export.json").read_text())["rope_scaling"] == record
    config = AutoConfig.from_pretrained(tmp_path / "merged")  # transformers' own reading of the file
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    # the scaling matters to what the export computes: the same weights with the base's RoPE answer otherwise
    ids = torch.tensor([[1, 403, 261, 1460, 59, 278, 1460, 300, 407]]) % 512
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    unscaled = AutoConfig.from_pretrained(tmp_path / "merged")
    unscaled.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", config=unscaled).eval()
    with torch.no_grad():
        assert (merged(ids).logits - plain(ids).logits).abs().max() > 1e-3

    adapter_only = export(stretched_run / "adapter", tmp_path / "adapter-only", options=_options(adapter_only=True))
    assert (tmp_path / "adapter-only" / "ferry_rope.json").read_text() == json.dumps(record, indent=2) + "\n"
    assert any("rope_scaling linear (factor 2" in w for w in adapter_only.warnings)
    # vLLM would serve the adapter on the base as its config.json says, unstretched: SERVING.md and the summary send
    # the user to the merged export instead, and the served chat refuses it (serving.vllm_lora.vllm_lora_fit)
    from serving.vllm_lora import vllm_lora_fit

    serving = (tmp_path / "adapter-only" / "SERVING.md").read_text()
    assert "--enable-lora" not in serving and "rope_scaling linear (factor 2)" in serving, serving
    assert "ferry export --adapter ADAPTER_DIR" in serving
    assert any(w.startswith("vLLM's LoRA serving does not take this adapter") for w in adapter_only.warnings)
    fit = vllm_lora_fit(tmp_path / "adapter-only")
    assert not fit.fits and fit.reasons == [
        "trained with rope_scaling linear (factor 2), which vLLM would not apply to the base"
    ]
    shutil.copytree(tmp_path / "adapter-only", tmp_path / "no-record")
    (tmp_path / "no-record" / "ferry_rope.json").unlink()
    assert vllm_lora_fit(tmp_path / "no-record").fits  # the same adapter without the record would be served


def _options(**kwargs: Any) -> Any:
    from exporter.options import ExportOptions

    return ExportOptions(**kwargs)


def test_chat_and_prediction_load_the_base_stretched_and_lm_eval_is_refused(
    stretched_run: Path, stories_model: Path, llamafactory_data: Path, tmp_path: Path
) -> None:
    from evaluation.run import _adapter_folder
    from exporter.lf_merge import read_merge_config
    from serving.chat import ChatSpec, load_chat_model, read_chat_config
    from trainer.config import TrainConfig
    from trainer.predict import load_predict_model

    adapter = stretched_run / "adapter"
    chat = load_chat_model(ChatSpec(base=str(stories_model), adapters=[adapter], template=None, default_system=None))
    assert chat.model.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    cfg = TrainConfig(**tiny_config(stories_model, llamafactory_data, tmp_path))
    predict = load_predict_model(cfg, [str(stretched_run)], torch.device("cpu"))
    assert predict.config.rope_parameters["factor"] == 2.0
    with pytest.raises(ConfigError, match="trained with rope_scaling linear .*evaluate its merged export"):
        _adapter_folder(str(adapter))

    def yaml_file(name: str, **keys: Any) -> Path:
        path = tmp_path / name
        path.write_text(
            yaml.safe_dump(
                {
                    "model_name_or_path": str(stories_model),
                    "adapter_name_or_path": str(stretched_run),
                    "template": "empty",
                    **keys,
                }
            )
        )
        return path

    read_chat_config(yaml_file("chat.yaml", rope_scaling="linear"))  # what ferry applies anyway: accepted
    read_merge_config(yaml_file("merge.yaml", rope_scaling="linear", export_dir=str(tmp_path / "m")))
    with pytest.raises(ConfigError, match=r"chat-yarn.yaml: rope_scaling: 'yarn': ferry loads the base with the"):
        read_chat_config(yaml_file("chat-yarn.yaml", rope_scaling="yarn"))
    with pytest.raises(ValueError, match="eval_tasks: cannot be combined with rope_scaling"):
        TrainConfig(
            **tiny_config(stories_model, llamafactory_data, tmp_path, rope_scaling="yarn", eval_tasks=["arc_easy"])
        )


def test_model_max_length_is_no_key_as_in_llamafactory(
    stories_model: Path, llamafactory_data: Path, tmp_path: Path
) -> None:
    from trainer.config import load_config

    path = write_config(
        tmp_path / "t.yaml", tiny_config(stories_model, llamafactory_data, tmp_path, model_max_length=4096)
    )
    with pytest.raises(ConfigError, match="model_max_length: LLaMA-Factory derives it from cutoff_len"):
        load_config(path)
