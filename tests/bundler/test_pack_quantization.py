"""``ferry pack`` carries bitsandbytes when the bundle is for QLoRA: ``--extra quantization``, or a spec whose
``training_config`` (LLaMA-Factory's own ``qwen3_lora_sft_otfq.yaml`` from the hash-pinned sdist) sets
``quantization_bit``; a plain LoRA config adds nothing."""

from __future__ import annotations

import shutil

import pytest

from bundler.spec import TRAINING_REQUIREMENTS, load_spec
from ferry.errors import ConfigError
from tests.support.pinned_sdist import LLAMAFACTORY


def test_extra_quantization_adds_bitsandbytes_and_no_serving_tool():
    spec = load_spec(None, name="kit", extras=("quantization", "gguf"))
    assert spec.training == ["quantization"] and spec.serving == ["gguf"]
    assert TRAINING_REQUIREMENTS["quantization"] == ["bitsandbytes>=0.45"]
    assert load_spec(None, name="kit").training == []


def test_training_config_with_quantization_bit_adds_bitsandbytes(tmp_path):
    examples = LLAMAFACTORY.path() / "examples"
    shutil.copy(examples / "train_qlora" / "qwen3_lora_sft_otfq.yaml", tmp_path / "qlora.yaml")
    shutil.copy(examples / "train_lora" / "qwen3_lora_sft.yaml", tmp_path / "lora.yaml")
    for name, expected in (("qlora.yaml", ["quantization"]), ("lora.yaml", [])):
        spec_file = tmp_path / f"spec-{name}"
        spec_file.write_text(f"name: kit\ntraining_config: {name}\n")  # relative to the spec file
        spec = load_spec(spec_file)
        assert spec.training_config == tmp_path / name
        assert spec.training == expected, name
    (tmp_path / "broken.yaml").write_text("- a list\n")
    (tmp_path / "spec.yaml").write_text("name: kit\ntraining_config: broken.yaml\n")
    with pytest.raises(ConfigError, match="training_config: .*broken.yaml: expected a mapping"):
        load_spec(tmp_path / "spec.yaml")


def test_pack_extra_quantization_puts_the_targets_bitsandbytes_wheel_in_the_set(tmp_path, monkeypatch):
    """`ferry pack --extra quantization --dry-run` for a Linux x86_64 target resolves bitsandbytes' wheel for that
    platform (the PyPI wheel that carries the CPU and CUDA libraries), and writes nothing but the requirements."""
    from click.testing import CliRunner

    from ferry.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "requirements.txt").write_text("PyYAML==6.0.3\n")
    result = CliRunner().invoke(
        cli,
        [
            "pack",
            "--dry-run",
            "--name",
            "q",
            "--python-version",
            "3.12",
            "--platform",
            "x86_64-manylinux_2_28",
            "--torch",
            "pypi",
            "--extra",
            "quantization",
            "--requirements",
            str(tmp_path / "requirements.txt"),
        ],
    )
    assert result.exit_code == 0, result.output
    wheels = [w for w in result.output.split() if w.startswith("bitsandbytes-") and w.endswith(".whl")]
    assert wheels and all("manylinux" in w and "x86_64" in w for w in wheels), result.output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requirements.txt"]
