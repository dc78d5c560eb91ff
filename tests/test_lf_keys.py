"""ferry/lf_keys.json: LLaMA-Factory 0.9.5's own keys by command, read from its pinned sdist, and what the merge and
inference YAML readers do with them."""

from __future__ import annotations

import pytest
import yaml

from ferry.errors import ConfigError
from ferry.lf_keys import lf_keys, lf_version
from tests.golden.make_lf_keys import lf_keys as read_lf_keys
from tests.golden.make_lf_keys import render
from tests.support.helpers import ROOT
from tests.support.pinned_sdist import LLAMAFACTORY


def test_the_table_is_what_llamafactorys_dataclasses_say():
    """Regenerated from the pinned sdist (tests/golden/make_lf_keys.py), byte for byte."""
    assert (ROOT / "ferry" / "lf_keys.json").read_text(encoding="utf-8") == render(read_lf_keys(LLAMAFACTORY.path()))
    assert lf_version() == "0.9.5"
    infer, train = lf_keys("infer"), lf_keys("train")
    assert infer["dataset_dir"] == {"default": "data", "literal": True, "class": "DataArguments"}
    assert infer["temperature"]["class"] == "GeneratingArguments" and "export_dir" in infer
    assert train["use_galore"]["default"] is False and train["temperature"]["class"] == "GeneratingArguments"
    assert "lora_rank" in train and "task" not in train and lf_keys("eval")["task"]["class"] == "EvaluationArguments"


def _yaml(tmp_path, **keys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(keys), encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["chat", "merge"])
def test_keys_that_change_the_model_are_refused_and_a_typo_is_still_unknown(tmp_path, stories_model, kind):
    """Keys LLaMA-Factory's parser takes are accepted, unless ferry would load or compute another model than
    LLaMA-Factory does by leaving them out (a revision, RoPE scaling): those are refused at any value but
    LLaMA-Factory's default. A key of no LLaMA-Factory parser stays an unknown key with the nearest known one."""
    from exporter.lf_merge import read_merge_config
    from serving.chat import read_chat_config

    read = read_chat_config if kind == "chat" else read_merge_config
    base = {"model_name_or_path": str(stories_model), "template": "alpaca", "adapter_name_or_path": str(tmp_path)}
    if kind == "merge":
        base["export_dir"] = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"model_revision: 'v2': ferry loads the installed snapshot"):
        read(_yaml(tmp_path, **base, model_revision="v2"))
    with pytest.raises(ConfigError, match=r"rope_scaling: 'linear': ferry loads the base with the RoPE scaling"):
        read(_yaml(tmp_path, **base, rope_scaling="linear"))
    with pytest.raises(ConfigError, match=r"unknown key 'templat'.*did you mean 'template'"):
        read(_yaml(tmp_path, **base, templat="alpaca"))
