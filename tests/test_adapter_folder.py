"""ferry.adapter_folder: the one place that names and reads the records of a trained adapter folder, checked on a
folder peft itself wrote, and on broken records (each refused naming its file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry import adapter_folder as af
from ferry.errors import ConfigError
from tests.support.helpers import LLAMA_TARGETS, make_adapter


@pytest.fixture(scope="module")
def peft_folder(stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter saved by peft's own ``save_pretrained`` on the real stories260K model."""
    out = tmp_path_factory.mktemp("adapter") / "out"
    make_adapter(stories_model, out / af.ADAPTER_DIRNAME, target_modules=LLAMA_TARGETS)
    return out


def test_the_names_are_what_peft_writes(peft_folder: Path):
    folder = peft_folder / af.ADAPTER_DIRNAME
    assert {af.ADAPTER_CONFIG, af.ADAPTER_WEIGHTS} <= {p.name for p in folder.iterdir()}
    config = af.read_adapter_config(folder)
    assert config is not None and config["peft_type"] == "LORA" and config["r"] == 4


def test_adapter_folder_takes_an_adapter_folder_or_an_output_dir(peft_folder: Path, tmp_path: Path):
    folder = peft_folder / af.ADAPTER_DIRNAME
    assert af.adapter_folder(folder) == folder
    assert af.adapter_folder(peft_folder) == folder
    with pytest.raises(ConfigError, match=r"holds no adapter_config.json"):
        af.adapter_folder(tmp_path)


def test_absent_records_read_as_nothing(peft_folder: Path):
    folder = peft_folder / af.ADAPTER_DIRNAME
    assert af.read_stack_record(folder) == []
    assert af.read_quant_record(folder) is None
    assert af.read_vocab_record(folder) is None
    assert af.read_export_record(folder) is None
    af.check_stacked(folder, None)  # nothing recorded: any base will do


def test_a_stack_record_round_trips_and_guards_the_base(peft_folder: Path, tmp_path: Path):
    first = peft_folder / af.ADAPTER_DIRNAME
    second = tmp_path / "second"
    second.mkdir()
    (second / af.ADAPTER_WEIGHTS).write_bytes(b"weights")
    af.write_stack_record(second, af.merged_chain([first]))
    chain = af.read_stack_record(second)
    assert [e["path"] for e in chain] == [str(first.resolve())]
    assert len(chain[0]["sha256"]) == 64
    with pytest.raises(ConfigError, match=r"trained on a base with 1 adapter\(s\) merged"):
        af.check_stacked(second, None)
    merged_base = tmp_path / "merged-base"
    merged_base.mkdir()
    af.write_stack_record(merged_base, chain)
    af.check_stacked(second, merged_base)
    assert af.merged_chain([second]) == [*chain, af.stack_entry(second)]


@pytest.mark.parametrize(
    "name,text,reader",
    [
        (af.STACK_RECORD, "{not json", af.read_stack_record),
        (af.STACK_RECORD, json.dumps({"merged": []}), af.read_stack_record),
        (af.STACK_RECORD, json.dumps({"merged_into_base": [{"path": "x"}]}), af.read_stack_record),
        (af.QUANT_RECORD, json.dumps({"quantization_bit": 3}), af.read_quant_record),
        (af.QUANT_RECORD, json.dumps([4]), af.read_quant_record),
        (af.VOCAB_RECORD, json.dumps({"added": {"<x>": "7"}, "base_rows": 4, "rows": 8}), af.read_vocab_record),
        (af.VOCAB_RECORD, json.dumps({"added": {}, "rows": 8}), af.read_vocab_record),
        (af.EXPORT_RECORD, json.dumps(["base"]), af.read_export_record),
        (af.ADAPTER_CONFIG, "[]", af.read_adapter_config),
    ],
)
def test_a_malformed_record_is_refused_naming_its_file(tmp_path: Path, name, text, reader):
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / name}: "):
        reader(tmp_path)


def test_records_written_here_read_back(tmp_path: Path):
    af.write_quant_record(tmp_path, {"quantization_bit": 4, "quantization_type": "nf4"})
    assert af.read_quant_record(tmp_path) == {"quantization_bit": 4, "quantization_type": "nf4"}
    af.write_vocab_record(tmp_path, {"added": {"<|im_end|>": 512}, "base_rows": 512, "rows": 576})
    assert af.read_vocab_record(tmp_path) == {"format": 1, "added": {"<|im_end|>": 512}, "base_rows": 512, "rows": 576}
    assert sorted(p.name for p in tmp_path.iterdir()) == [af.QUANT_RECORD, af.VOCAB_RECORD]  # no temp files left
