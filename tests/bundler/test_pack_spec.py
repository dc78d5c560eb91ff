"""PackSpec: YAML + flags, unknown keys named with the nearest valid key, sizes, relative paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from bundler.spec import load_spec
from ferry.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_yaml_and_flags_add_up(tmp_path):
    (tmp_path / "data").mkdir()
    spec_file = write(
        tmp_path,
        (
            "name: kit\n"
            "models:\n  - hf:Qwen/Qwen2.5-0.5B@main\n  - source: ./data\n    include: ['*.json']\n"
            "datasets: hf:org/ds\n"
            "wheels:\n  requirements: [six]\n  extra_index_urls: [https://a.invalid/simple]\n"
            "target: {python_version: '3.10', platforms: [manylinux2014_x86_64]}\n"
            "split_size: 4G\n"
        ),
    )
    spec = load_spec(
        spec_file,
        models=["hf:org/other@v2"],
        platforms=["linux_x86_64"],
        extra_index_urls=["https://b.invalid/simple"],
        split_size=None,
        name="renamed",
    )
    assert spec.name == "renamed"
    assert [m.source for m in spec.models] == ["hf:Qwen/Qwen2.5-0.5B@main", str(tmp_path / "data"), "hf:org/other@v2"]
    assert spec.models[0].repo_id == "Qwen/Qwen2.5-0.5B" and spec.models[0].revision == "main"
    assert spec.models[1].scheme == "local" and spec.models[1].include == ["*.json"]
    assert spec.models[2].revision == "v2" and spec.datasets[0].repo_id == "org/ds"
    assert spec.target.platforms == ["manylinux2014_x86_64", "linux_x86_64"]
    assert spec.wheels.extra_index_urls == ["https://a.invalid/simple", "https://b.invalid/simple"]
    assert spec.split_size == 4 * 10**9
    assert load_spec(spec_file, split_size="500MiB").split_size == 500 * 1024**2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: k\nmodel: [hf:a/b]\n", r"unknown key 'model' \(did you mean 'models'\?\)"),
        ("name: k\nwheels: {index: x}\n", r"unknown key 'wheels.index' \(did you mean 'index_url'\?\)"),
        (
            "name: k\nmodels:\n  - source: hf:a/b\n    includes: ['*']\n",
            r"unknown key 'models.0.includes' \(did you mean 'include'\?\)",
        ),
        ("name: k\ntarget: {python_version: '3'}\n", r"target.python_version: .*3\.11"),
        ("name: k\nmodels: [hf:nope]\n", r"expected hf:ORG/NAME"),
        ("name: 'a b'\n", r"bundle name"),
        ("models: [hf:a/b]\n", r"no bundle name"),
        ("name: k\nmodels: [\n", r"line \d+: invalid YAML"),
        ("- a\n- b\n", r"top level must be a mapping"),
        ("name: k\nwheels: {no_wheels: true}\n", r"nothing to pack"),
        ("name: k\nmodels: [hf:a/b]\nsplit_size: 0\n", r"split_size: .*positive"),
    ],
)
def test_bad_specs_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as exc:
        load_spec(write(tmp_path, text))
    assert str(tmp_path / "spec.yaml") in str(exc.value)


def test_bad_flag_values():
    with pytest.raises(ConfigError, match="not a size"):
        load_spec(name="k", models=["hf:a/b"], split_size="lots")
    with pytest.raises(ConfigError, match="python_version"):
        load_spec(name="k", models=["hf:a/b"], python_version="ten")
    with pytest.raises(ConfigError, match="no bundle name"):
        load_spec(models=["hf:a/b"])
