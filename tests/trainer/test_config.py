"""TrainConfig and load_config: LLaMA-Factory YAML, overrides, typed errors naming key, file:line and the
nearest valid key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ferry.errors import ConfigError
from trainer.config import TrainConfig, load_config

# LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml (hiyouga/LLaMA-Factory, commit 13d252fa), verbatim.
LLAMAFACTORY_LLAMA3_LORA_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

MINIMAL = ["model_name_or_path=m", "dataset=d", "output_dir=o"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_llamafactory_example_loads_with_its_values(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, LLAMAFACTORY_LLAMA3_LORA_SFT))
    assert cfg.model_name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert cfg.trust_remote_code is True
    assert cfg.dataset == ["identity", "alpaca_en_demo"]
    assert cfg.template == "llama3"
    assert cfg.learning_rate == pytest.approx(1e-4)
    assert cfg.lr_scheduler_type == "cosine"
    assert cfg.gradient_accumulation_steps == 8
    assert cfg.bf16 is True and cfg.fp16 is False
    assert cfg.ddp_timeout == 180000000
    assert cfg.lora_target == ["all"] and cfg.lora_target_modules == "all-linear"
    assert cfg.lora_alpha == 16.0  # None -> 2 * lora_rank, as LLaMA-Factory
    assert cfg.max_samples == 1000 and cfg.overwrite_cache is True


def test_defaults_follow_llamafactory() -> None:
    cfg = load_config(None, MINIMAL)
    assert (cfg.stage, cfg.finetuning_type, cfg.cutoff_len) == ("sft", "lora", 2048)
    assert (cfg.lora_rank, cfg.lora_dropout) == (8, 0.0)
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.learning_rate) == (1, 1, 5e-5)
    assert (cfg.num_train_epochs, cfg.max_steps, cfg.lr_scheduler_type, cfg.seed) == (3.0, -1, "linear", 42)
    assert cfg.resume_from_checkpoint == "auto" and cfg.report_to == "none" and cfg.template is None
    assert cfg.trust_remote_code is False and cfg.ddp_backend == "auto" and cfg.ddp_timeout == 10800
    # LLaMA-Factory checkpoints activations unless disable_gradient_checkpointing (model_args.py, 0.9.5)
    assert cfg.gradient_checkpointing is True and cfg.resolved_dict()["gradient_checkpointing"] is True


def test_gradient_checkpointing_keys_of_llamafactory_and_hf() -> None:
    assert load_config(None, [*MINIMAL, "disable_gradient_checkpointing=true"]).gradient_checkpointing is False
    assert load_config(None, [*MINIMAL, "gradient_checkpointing=false"]).gradient_checkpointing is False
    assert load_config(None, [*MINIMAL, "use_reentrant_gc=false"]).gradient_checkpointing is True  # accepted
    with pytest.raises(ConfigError, match="gradient_checkpointing: true contradicts disable_gradient_checkpointing"):
        load_config(None, [*MINIMAL, "gradient_checkpointing=true", "disable_gradient_checkpointing=true"])


def test_every_key_is_documented() -> None:
    rows = TrainConfig.key_help()
    assert len(rows) == len(TrainConfig.model_fields) > 60
    undocumented = [key for key, _default, desc in rows if len(desc) < 10]
    assert undocumented == []
    assert dict((k, d) for k, d, _ in rows)["output_dir"] == "required"


def test_unknown_key_names_file_line_and_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name_or_path: m\ndataset: d\noutput_dir: o\nlora_rnak: 16\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f"{path}:4" in message and "'lora_rnak'" in message and "did you mean 'lora_rank'" in message


def test_unknown_override_names_the_override_and_nearest() -> None:
    with pytest.raises(
        ConfigError,
        match=r"override learning_rat=1e-4: unknown key 'learning_rat' "
        r"\(did you mean 'learning_rate'\?\)",
    ):
        load_config(None, [*MINIMAL, "learning_rat=1e-4"])


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name_or_path: m\ndataset: d\noutput_dir: o\n\ncutoff_len: long\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:5" in str(err.value) and "'cutoff_len'" in str(err.value) and "'long'" in str(err.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("bf16=true", "fp16"),
        ("lora_rank=0", "lora_rank"),
        ("lora_dropout=1.5", "lora_dropout"),
        ("val_size=2.5", "val_size"),
        ("template=llama", "template"),
        ("report_to=wandb", "report_to"),
        ("lr_scheduler_type=cosine_annealing", "lr_scheduler_type"),
        ("stage=ppo", "stage"),
        ("lora_target=all,q_proj", "lora_target"),
        ("ddp_backend=mpi", "ddp_backend"),
    ],
)
def test_invalid_values_name_the_key(override: str, key: str) -> None:
    extra = ["fp16=true"] if override.startswith("bf16") else []
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*MINIMAL, *extra, override])


def test_unknown_template_suggests_nearest() -> None:
    with pytest.raises(ConfigError, match="did you mean .*'llama3'"):
        load_config(None, [*MINIMAL, "template=llama"])


def test_missing_required_keys_are_named() -> None:
    with pytest.raises(ConfigError, match="missing required key 'model_name_or_path'.*'output_dir'"):
        load_config(None, ["dataset=d"])


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, [*MINIMAL, "lora_rank"])


def test_overrides_win_and_are_parsed_as_yaml_scalars(tmp_path: Path) -> None:
    path = write(tmp_path, LLAMAFACTORY_LLAMA3_LORA_SFT)
    cfg = load_config(
        path,
        [
            "lora_rank=4",
            "learning_rate=2e-4",
            "bf16=false",
            "packing=true",
            "dataset=a.jsonl, b",
            "resume_from_checkpoint=false",
            "lora_target=q_proj,v_proj",
        ],
    )
    assert cfg.lora_rank == 4 and cfg.lora_alpha == 8.0
    assert cfg.learning_rate == pytest.approx(2e-4) and cfg.bf16 is False and cfg.packing is True
    assert cfg.dataset == ["a.jsonl", "b"] and cfg.resume_from_checkpoint is None
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.template == "llama3"  # untouched keys keep the file's value


def test_llamafactory_neat_packing_turns_packing_on() -> None:
    cfg = load_config(None, [*MINIMAL, "neat_packing=true"])
    assert cfg.packing is True and cfg.neat_packing is True
    with pytest.raises(ConfigError, match="mix_strategy"):
        load_config(None, [*MINIMAL, "mix_strategy=interleave_under"])


def test_explicit_lora_alpha_and_resume_forms() -> None:
    assert load_config(None, [*MINIMAL, "lora_alpha=32"]).lora_alpha == 32.0
    assert load_config(None, [*MINIMAL, "resume_from_checkpoint=true"]).resume_from_checkpoint == "auto"
    assert load_config(None, [*MINIMAL, "resume_from_checkpoint=out/checkpoint-5"]).resume_from_checkpoint == (
        "out/checkpoint-5"
    )
    assert load_config(None, [*MINIMAL, "report_to=[tensorboard]"]).report_to == "tensorboard"
    assert load_config(None, [*MINIMAL, "report_to=none"]).report_to == "none"


def test_dataset_dir_defaults_to_ferry_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FERRY_HOME", raising=False)
    assert load_config(None, MINIMAL).dataset_dir == "data"
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    assert load_config(None, MINIMAL).dataset_dir == str(tmp_path / "datasets")


def test_resolved_dict_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, LLAMAFACTORY_LLAMA3_LORA_SFT), ["val_size=0.1"])
    resolved = cfg.resolved_dict()
    text = yaml.safe_dump(resolved, sort_keys=False)
    assert list(resolved) == list(TrainConfig.model_fields)
    again = load_config(write(tmp_path, text))
    assert again == cfg


def test_ddp_timeout_default_outlasts_a_slow_load_and_says_why() -> None:
    """3 hours by default (a slow model load on one rank or uneven do_predict generation outlasts transformers'
    1800 s; a hung rank still ends the job), the reason in ``ferry train --keys``, and the user's value kept."""
    from click.testing import CliRunner

    from ferry.cli import cli

    assert load_config(None, MINIMAL).ddp_timeout == 3 * 3600
    assert load_config(None, [*MINIMAL, "ddp_timeout=600"]).ddp_timeout == 600
    keys = CliRunner().invoke(cli, ["train", "--keys"]).output
    entry = keys.split("\nddp_timeout  (default: 10800)  [> 0]\n", 1)[1].split("\nddp_backend", 1)[0]
    assert "3 hours" in entry and "slow" in entry and "hangs" in entry


def test_llamafactory_features_at_their_off_value_are_accepted_and_named_when_on() -> None:
    """A YAML LlamaBoard saved carries LLaMA-Factory's features at their defaults: accepted without a word. The same
    keys switched on are refused by name, with what ferry offers instead, not as unknown keys."""
    off = ["use_galore=false", "shift_attn=false", "use_unsloth=false", "streaming=false", "use_ray=false"]
    cfg = load_config(None, [*MINIMAL, *off, "neftune_noise_alpha=null"])
    assert cfg.neftune_noise_alpha is None
    for key, words in (
        ("use_galore", "GaLore"),
        ("shift_attn", "LongLoRA"),
        ("use_unsloth", "Unsloth"),
        ("streaming", "streaming datasets"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [*MINIMAL, f"{key}=true"])
        assert f"{key}: " in str(err.value) and words in str(err.value) and "unknown key" not in str(err.value)
    for stage in ("ppo", "grpo"):
        with pytest.raises(ConfigError, match=rf"stage: {stage}: .*ferry runs stage sft, pt, dpo, kto and rm"):
            load_config(None, [*MINIMAL, f"stage={stage}"])


def test_every_llamafactory_key_at_its_default_is_accepted_and_any_other_value_is_named(tmp_path: Path) -> None:
    """LLaMA-Factory 0.9.5's own training keys (ferry/lf_keys.json, read from its dataclasses): a config holding
    every one with a literal default, at that default, loads; one of them ferry does not run, at another value, is
    refused by name with its LLaMA-Factory part and default (never "unknown key"); a cosmetic one is ignored with a
    warning line. (tests/trainer/test_launch.py runs the same config through `ferry train --dry-run`.)"""
    from ferry.lf_keys import lf_keys

    keys = lf_keys("train")
    assert len(keys) > 200
    everything = {k: v["default"] for k, v in keys.items() if v["literal"]}
    load_config(write(tmp_path, yaml.safe_dump({**everything, "model_name_or_path": "m", "dataset": "d",
                                                "output_dir": "o"})))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config(None, [*MINIMAL, "galore_rank=32"])
    assert str(err.value) == (
        "override galore_rank=32: galore_rank: 32: a LLaMA-Factory feature (FinetuningArguments) ferry does not run; "
        "its default, 16, is accepted"
    )
    load_config(None, [*MINIMAL, "num_beams=1.0"])  # LLaMA-Factory's default 1, as a float
    with pytest.raises(ConfigError, match=r"num_beams: True: .*its default, 1, is accepted"):
        load_config(None, [*MINIMAL, "num_beams=true"])  # a bool is no default of 1, though ``True == 1``
    with pytest.raises(ConfigError, match="badam_verbose: False: a LLaMA-Factory feature"):
        load_config(None, [*MINIMAL, "badam_verbose=false"])  # nor false of 0
    with pytest.raises(ConfigError, match="infer_backend: LLaMA-Factory's inference YAML"):
        load_config(None, [*MINIMAL, "infer_backend=vllm"])
    load_config(None, [*MINIMAL, "infer_backend=huggingface"])  # LLaMA-Factory's default of a refused key
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ferry.trainer.config").addHandler(handler)
    try:
        load_config(None, [*MINIMAL, "print_param_status=true"])
    finally:
        logging.getLogger("ferry.trainer.config").removeHandler(handler)
    assert records == [
        "override print_param_status=true: print_param_status: LLaMA-Factory's ModelArguments key changes "
        "nothing ferry trains or writes; ignored"
    ], records


def test_packing_null_is_llamafactorys_default_on_for_pt_only() -> None:
    for stage, packs in (("pt", True), ("sft", False), ("dpo", False)):
        assert load_config(None, [*MINIMAL, f"stage={stage}"]).packing is packs
        assert load_config(None, [*MINIMAL, f"stage={stage}", "packing=null"]).packing is packs
    assert load_config(None, [*MINIMAL, "stage=pt", "packing=false"]).packing is False
    assert load_config(None, [*MINIMAL, "packing=null", "neat_packing=true"]).packing is True


def _another_value(default):
    """A value of the type of ``default`` that is not it (an LLaMA-Factory key switched on or changed)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "x"
    return "x" if default is None else ["x"]


def test_every_llamafactory_key_does_what_its_class_in_the_keys_page_says(caplog) -> None:
    """docs/llamafactory-keys.md is what `python -m tests.golden.make_lf_keys --page` writes, and for every
    LLaMA-Factory key with a literal default that is no ferry key, another value than the default does what the
    page's class says: named -> refused with its own line, cosmetic -> a warning, default-only -> refused naming its
    LF part."""
    import logging

    from ferry.lf_keys import lf_keys
    from trainer import lf_compat

    root = Path(__file__).resolve().parents[2]
    page = lf_compat.lf_keys_page(TrainConfig.model_fields)
    assert (root / "docs" / "llamafactory-keys.md").read_text(encoding="utf-8") == page
    classes = lf_compat.lf_key_classes(TrainConfig.model_fields)
    assert set(classes.values()) == set(lf_compat.LF_KEY_CLASSES)
    for key, spec in lf_keys("train").items():
        if not spec["literal"] or classes[key] == "ferry":
            continue
        override = f"{key}={yaml.safe_dump(_another_value(spec['default']), default_flow_style=True).strip()}"
        caplog.clear()
        if classes[key] == "cosmetic":
            with caplog.at_level(logging.WARNING, logger="ferry.trainer.config"):
                load_config(None, [*MINIMAL, override])
            assert "changes nothing ferry trains or writes; ignored" in caplog.text, key
            continue
        with pytest.raises(ConfigError) as err:
            load_config(None, [*MINIMAL, override])
        said = str(err.value)
        assert "unknown key" not in said and f": {key}: " in said, (key, said)
        if classes[key] == "default-only":
            assert f"a LLaMA-Factory feature ({spec['class']}) ferry does not run" in said, (key, said)
