"""LLaMA-Factory key semantics in the config: do_train, tokenized_path, flash_attn fallback, mask_history with
train_on_prompt, ignored keys (listed by --keys, warned once), bad YAML files in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ferry.errors import ConfigError
from trainer import config as config_module
from trainer.config import (
    IGNORED_KEYS,
    TrainConfig,
    attention_fallback,
    load_config,
    tokenize_only,
)

MINIMAL = ["model_name_or_path=m", "dataset=d", "output_dir=o"]


def test_do_train_false_alone_is_refused_and_with_tokenized_path_only_tokenises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"do_train: false leaves ferry nothing to do"):
        load_config(None, [*MINIMAL, "do_train=false"])
    cfg = load_config(None, [*MINIMAL, "do_train=false", f"tokenized_path={tmp_path / 'tok'}"])
    assert tokenize_only(cfg)
    (tmp_path / "tok").mkdir()
    assert tokenize_only(cfg)  # do_train: false never trains
    trains = load_config(None, [*MINIMAL, f"tokenized_path={tmp_path / 'tok'}"])
    assert not tokenize_only(trains)  # the folder exists: train from it
    fresh = load_config(None, [*MINIMAL, f"tokenized_path={tmp_path / 'new'}"])
    assert tokenize_only(fresh)  # not there yet: tokenise into it and stop
    assert not tokenize_only(load_config(None, MINIMAL))


def test_fa2_without_flash_attn_falls_back_to_sdpa_once_in_the_launcher(caplog, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with caplog.at_level(logging.WARNING, logger="ferry.trainer.config"):
        cfg = load_config(None, [*MINIMAL, "flash_attn=fa2"])
    assert cfg.flash_attn == "sdpa" and cfg.attn_implementation == "sdpa"
    assert [r.getMessage() for r in caplog.records if "flash_attn" in r.getMessage()] == [
        "flash_attn: fa2 needs the flash_attn package, which is not installed: using sdpa (PyTorch's "
        "scaled-dot-product attention) instead, as LLaMA-Factory does"
    ]
    for kind in ("sdpa", "eager", "auto", "disabled"):
        same, warning = attention_fallback(
            TrainConfig(model_name_or_path="m", dataset="d", output_dir="o", flash_attn=kind)
        )
        assert same.flash_attn == kind and warning is None


def test_mask_history_with_train_on_prompt_is_refused() -> None:
    with pytest.raises(ConfigError, match="mask_history: cannot be combined with train_on_prompt"):
        load_config(None, [*MINIMAL, "mask_history=true", "train_on_prompt=true"])


def test_ignored_keys_are_listed_and_warned_once(caplog, monkeypatch) -> None:
    monkeypatch.setattr(config_module, "_warned_keys", set())
    help_rows = {key: text for key, _, text in TrainConfig.key_help()}
    for key in IGNORED_KEYS:
        assert help_rows[key].startswith("IGNORED by ferry")
    with caplog.at_level(logging.WARNING, logger="ferry.trainer.config"):
        load_config(None, [*MINIMAL, "preprocessing_num_workers=16", "use_reentrant_gc=true"])
        load_config(None, [*MINIMAL, "preprocessing_num_workers=16"])
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("preprocessing_num_workers: 16 is accepted")]) == 1
    assert not any(m.startswith("use_reentrant_gc") for m in messages)  # set to its default: nothing to say


def test_bad_yaml_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is a directory, not a YAML file"):
        load_config(tmp_path)
    raw = b"model_name_or_path: m\ndataset: caf\xe9\noutput_dir: o\n"
    (tmp_path / "c.yaml").write_bytes(raw)
    offset = raw.index(b"\xe9")
    with pytest.raises(ConfigError, match=rf"c.yaml: line 2: byte offset {offset}: not UTF-8 \(byte 0xe9\)"):
        load_config(tmp_path / "c.yaml")
    cases = {  # PyYAML alone keeps the last of two keys silently and prints a multi-line error for bad syntax
        "model_name_or_path: m\nlearning_rate: 1e-4\noutput_dir: o\nlearning_rate: 1e-3\n": (
            "c.yaml: line 4, column 1: key 'learning_rate' is given twice (lines 2 and 4); keep one"
        ),
        "model_name_or_path: m\nfsdp_config:\n  cpu_offload: true\n  cpu_offload: false\n": (
            "c.yaml: line 4, column 3: key 'cpu_offload' is given twice (lines 3 and 4); keep one"
        ),
        "model_name_or_path: m\nlora_target: [q_proj, v_proj\noutput_dir: o\n": (
            "c.yaml: line 3, column 11: not valid YAML (expected ',' or ']', but got ':')"
        ),
        "": "c.yaml: missing required key 'model_name_or_path'",
    }
    for text, message in cases.items():
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_config(tmp_path / "c.yaml")
        assert str(caught.value).startswith(str(tmp_path / message)) and "\n" not in str(caught.value), caught.value


def test_do_train_false_tokenises_but_never_trains(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    from ferry.errors import TrainingError
    from trainer.data import prepare_data

    cfg = make_cfg(do_train=False, tokenized_path=str(tmp_path / "tok"), max_samples=4)
    with pytest.raises(TrainingError, match=r"do_train: false: the data is tokenised into .*tok/.* nothing is trained"):
        prepare_data(cfg, stories_tokenizer)
    data = prepare_data(cfg, stories_tokenizer, for_training=False)  # the tokenise-only launcher path
    assert data.stats["cache_hit"] and len(data.train) == 4
