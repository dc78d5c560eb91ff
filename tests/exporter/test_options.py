"""ExportOptions is the one source of ``ferry export``'s options: the command's flags are generated from it with
the spellings, defaults and limits they always had, values are normalised once, and LLaMA-Factory's merge YAML
yields to the options given explicitly."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError

from exporter.options import ExportOptions
from ferry.cli import cli
from ferry.cli.export import export_command
from ferry.errors import ExportError

#: ``ferry export``'s option flags as they were written by hand before ExportOptions: (flag declarations, default).
FLAGS = {
    "base": (["--base"], None),
    "dtype": (["--dtype"], "auto"),
    "max_shard_size": (["--max-shard-size"], "5GB"),
    "smoke": (["--smoke", "--no-smoke"], True),
    "prompts": (["--prompt"], ()),
    "max_new_tokens": (["--max-new-tokens"], 32),
    "adapter_only": (["--adapter-only"], False),
    "bundle": (["--bundle"], False),
    "allow_pickle": (["--allow-pickle"], False),
    "overwrite": (["--overwrite"], False),
    "trust_remote_code": (["--trust-remote-code"], False),
    "formats": (["--format"], "hf"),
    "gguf_type": (["--gguf-type"], "bf16"),
    "llama_cpp_source": (["--llama-cpp-source"], None),
    "llama_cpp_dir": (["--llama-cpp-dir"], None),
    "merge_into": (["--merge-into"], "original"),
}


def test_every_option_is_a_flag_with_its_old_spelling_default_and_help():
    params = {p.name: p for p in export_command.params if isinstance(p, click.Option)}
    generated = {name: p for name, p in params.items() if name in ExportOptions.model_fields}
    assert set(generated) == set(ExportOptions.model_fields) - {"progress"}  # the command always shows progress
    for name, (spelled, default) in FLAGS.items():
        option = generated[name]
        assert [*option.opts, *option.secondary_opts] == spelled, name
        assert option.default == default, name
        assert option.help == ExportOptions.model_fields[name].description, name
    assert list(generated["dtype"].type.choices) == ["auto", "bfloat16", "float16", "float32"]
    assert list(generated["merge_into"].type.choices) == ["original", "dequantized"]
    assert generated["max_new_tokens"].type.min == 1 and generated["prompts"].multiple
    assert generated["llama_cpp_dir"].type.exists and not generated["llama_cpp_dir"].type.file_okay
    assert set(params) - set(generated) == {"adapter", "output", "as_json"}


def test_help_lists_the_generated_flags():
    result = CliRunner().invoke(cli, ["export", "--help"])
    assert result.exit_code == 0, result.output
    for spelled, _ in FLAGS.values():
        assert spelled[0] in result.output
    assert "--smoke / --no-smoke" in result.output and "[default: 5GB]" in result.output


def test_values_are_normalised_once():
    options = ExportOptions(base=Path("/models/base"), dtype=torch.bfloat16, formats="GGUF, hf", prompts=("a", "b"))
    assert options.base == "/models/base" and options.dtype == "bfloat16"
    assert options.formats == ("hf", "gguf") and options.prompts == ["a", "b"]
    assert ExportOptions(dtype="fp16").dtype == "float16" and ExportOptions(max_shard_size="1KiB").shard_limit == 1024
    assert ExportOptions().model_fields_set == set()


@pytest.mark.parametrize(
    "values, match",
    [
        ({"dtype": "int8"}, "unknown dtype 'int8': use auto, bfloat16, float16 or float32"),
        ({"max_shard_size": "5XB"}, "--max-shard-size: "),
        ({"formats": "gguf,onnx"}, "--format gguf,onnx: use hf, gguf or hf,gguf"),
    ],
)
def test_a_value_the_export_cannot_use_is_the_line_the_command_shows(values, match):
    with pytest.raises(ExportError, match=match):
        ExportOptions(**values)


def test_other_bad_values_are_validation_errors_naming_the_field():
    with pytest.raises(ValidationError, match="max_new_tokens"):
        ExportOptions(max_new_tokens=0)
    with pytest.raises(ValidationError, match="merge_into"):
        ExportOptions(merge_into="requantized")
    with pytest.raises(ValidationError, match="smoek"):
        ExportOptions(smoek=False)


def test_the_merge_yaml_yields_to_the_options_given(tmp_path):
    from exporter.lf_merge import read_merge_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}", encoding="utf-8")
    config = tmp_path / "merge.yaml"
    config.write_text(
        f"model_name_or_path: base-from-yaml\nadapter_name_or_path: {adapter}\nexport_size: 2\n"
        f"infer_dtype: float16\ntrust_remote_code: true\n",
        encoding="utf-8",
    )
    spec = read_merge_config(config)
    assert spec.options() == ExportOptions(
        base="base-from-yaml", max_shard_size="2GB", dtype="float16", trust_remote_code=True
    )
    given = spec.options(ExportOptions(dtype="float32", smoke=False, base="other-base"))
    assert (given.dtype, given.smoke, given.base, given.max_shard_size) == ("float32", False, "other-base", "2GB")
    defaults_only = spec.options(ExportOptions())  # nothing given explicitly: the YAML's keys stand
    assert (defaults_only.dtype, defaults_only.base) == ("float16", "base-from-yaml")
