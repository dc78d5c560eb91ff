"""Datasets read as LLaMA-Factory reads them (through the `datasets` library): every file layout, the
dataset_info.json keys (formatting, columns, tags, num_samples, split, subset), the refusals (ranking, KTO,
multimodal, unknown keys), declared columns only, and bad input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.errors import ConfigError, DataError, NotInstalledError
from trainer.data import prepare_data
from trainer.loss import IGNORE_INDEX

pytestmark = pytest.mark.budget(60, reason="every data layout trained through ferry train")

ROWS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add", "input": "2 and 3", "output": "5"},
    {"instruction": "Greet.", "input": "", "output": "Hello!"},
]


def replies(tokenizer, data) -> list[str]:
    """The trained text of each example (the `default` template's end marker `</s> \\n` removed)."""
    out = []
    for e in data.train:
        ids = [t for t, lab in zip(e["input_ids"], e["labels"]) if lab != IGNORE_INDEX]
        out.append(tokenizer.decode(ids).removesuffix("</s> \n"))
    return out


def write_info(folder: Path, entries: dict) -> None:
    (folder / "dataset_info.json").write_text(json.dumps(entries), encoding="utf-8")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    """One folder holding ROWS in every layout LLaMA-Factory users bring."""
    import datasets

    root = tmp_path_factory.mktemp("layouts")
    ds = datasets.Dataset.from_list(ROWS)
    (root / "rows.json").write_text(json.dumps(ROWS))
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    ds.to_json(str(root / "lines_as.json"))  # JSON Lines in a .json file
    ds.to_parquet(str(root / "rows.parquet"))
    ds.to_csv(str(root / "rows.csv"), index=False)
    (root / "arrow").mkdir()
    ds.save_to_disk(str(root / "saved"))  # save_to_disk folder
    arrow_file = next((root / "saved").glob("*.arrow"))
    (root / "rows.arrow").write_bytes(arrow_file.read_bytes())
    nested = root / "nested" / "part" / "deeper"
    nested.mkdir(parents=True)
    (root / "nested" / "part" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[:2]) + "\n")
    (nested / "b.jsonl").write_text(json.dumps(ROWS[2]) + "\n")
    repo = root / "hub_repo"  # Hugging Face dataset repo layout
    (repo / "data").mkdir(parents=True)
    ds.to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(ROWS[:1]).to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# a dataset\n")
    configs = root / "configs_repo"
    (configs / "en").mkdir(parents=True)
    (configs / "de").mkdir()
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(configs / "en" / "train.parquet"))
    datasets.Dataset.from_list([{"instruction": "Farbe?", "input": "", "output": "Blau."}]).to_parquet(
        str(configs / "de" / "train.parquet")
    )
    (configs / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/*.parquet\n"
        "- config_name: de\n  data_files:\n  - split: train\n    path: de/*.parquet\n---\n"
    )
    (root / "wiki.txt").write_text("The first document line.\nThe second one.\n\nAfter a blank line.\n")
    write_info(
        root,
        {
            "json": {"file_name": "rows.json"},
            "jsonl": {"file_name": "rows.jsonl"},
            "lines_as_json": {"file_name": "lines_as.json"},
            "parquet": {"file_name": "rows.parquet"},
            "csv": {"file_name": "rows.csv"},
            "arrow": {"file_name": "rows.arrow"},
            "saved": {"file_name": "saved"},
            "nested": {"file_name": "nested"},
            "repo": {"file_name": "hub_repo"},
            "repo_test": {"file_name": "hub_repo", "split": "test"},
            "repo_de": {"file_name": "configs_repo", "subset": "de"},
            "wiki": {"file_name": "wiki.txt", "columns": {"prompt": "text"}},
            "sliced": {"file_name": "rows.json", "split": "train[1:]"},
        },
    )
    return root


@pytest.mark.parametrize(
    "name", ["json", "jsonl", "lines_as_json", "parquet", "csv", "arrow", "saved", "nested", "repo"]
)
def test_every_layout_trains_the_same_rows(make_cfg, stories_tokenizer, layouts: Path, name: str) -> None:
    data = prepare_data(make_cfg(dataset=name, dataset_dir=str(layouts), template="default"), stories_tokenizer)
    assert sorted(replies(stories_tokenizer, data)) == sorted(r["output"] for r in ROWS)


def test_split_subset_and_slicing(make_cfg, stories_tokenizer, layouts: Path) -> None:
    def run(name: str) -> list[str]:
        return replies(
            stories_tokenizer,
            prepare_data(make_cfg(dataset=name, dataset_dir=str(layouts), template="default"), stories_tokenizer),
        )

    assert run("repo_test") == ["Blue."]
    assert run("repo_de") == ["Blau."]
    assert run("sliced") == ["5", "Hello!"]


def test_txt_is_one_sample_per_line_for_pt(make_cfg, stories_tokenizer, layouts: Path) -> None:
    cfg = make_cfg(dataset="wiki", dataset_dir=str(layouts), stage="pt", packing=False)  # one document per row
    data = prepare_data(cfg, stories_tokenizer)
    texts = [stories_tokenizer.decode(e["input_ids"], skip_special_tokens=True) for e in data.train]
    assert texts == ["The first document line.", "The second one.", "", "After a blank line."] or texts == [
        "The first document line.",
        "The second one.",
        "After a blank line.",
    ]


def test_num_samples_is_a_seeded_random_subset(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    rows = [{"instruction": f"q{i}", "input": "", "output": f"answer {i}"} for i in range(20)]
    (tmp_path / "many.json").write_text(json.dumps(rows))
    write_info(
        tmp_path,
        {"few": {"file_name": "many.json", "num_samples": 5}, "more": {"file_name": "many.json", "num_samples": 30}},
    )
    few = replies(
        stories_tokenizer,
        prepare_data(make_cfg(dataset="few", dataset_dir=str(tmp_path), template="default"), stories_tokenizer),
    )
    assert len(few) == len(set(few)) == 5 and few != [f"answer {i}" for i in range(5)]
    more = replies(
        stories_tokenizer,
        prepare_data(make_cfg(dataset="more", dataset_dir=str(tmp_path), template="default"), stories_tokenizer),
    )
    assert len(more) == 30 and set(more) == {f"answer {i}" for i in range(20)}  # every row, then repeats


def test_only_declared_columns_are_used(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    rows = [
        {
            "instruction": "Now?",
            "input": "",
            "output": "Yes.",
            "system": "SECRET SYSTEM",
            "history": [["Earlier?", "HISTORY REPLY"]],
        }
    ]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    write_info(
        tmp_path,
        {
            "plain": {"file_name": "r.json"},
            "full": {
                "file_name": "r.json",
                "columns": {
                    "prompt": "instruction",
                    "query": "input",
                    "response": "output",
                    "system": "system",
                    "history": "history",
                },
            },
        },
    )
    plain = prepare_data(make_cfg(dataset="plain", dataset_dir=str(tmp_path), template="default"), stories_tokenizer)
    text = stories_tokenizer.decode(plain.train[0]["input_ids"])
    assert "SECRET" not in text and "HISTORY" not in text
    full = prepare_data(make_cfg(dataset="full", dataset_dir=str(tmp_path), template="default"), stories_tokenizer)
    text = stories_tokenizer.decode(full.train[0]["input_ids"])
    assert "System: SECRET SYSTEM" in text and "HISTORY REPLY" in text


def test_a_columns_object_drops_the_alpaca_defaults_it_leaves_out(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    """LLaMA-Factory's DatasetAttr.join: once an entry has ``columns``, a key it leaves out is None, even
    alpaca's default ``query`` -> ``input``."""
    rows = [{"instruction": "Translate.", "input": "EXTRA INPUT", "output": "Done."}]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    write_info(
        tmp_path,
        {
            "defaults": {"file_name": "r.json"},
            "two": {"file_name": "r.json", "columns": {"prompt": "instruction", "response": "output"}},
            "no_reply": {"file_name": "r.json", "columns": {"prompt": "instruction", "query": "input"}},
            "reply_only": {"file_name": "r.json", "columns": {"query": "input", "response": "output"}},
        },
    )
    text = stories_tokenizer.decode(
        prepare_data(
            make_cfg(dataset="defaults", dataset_dir=str(tmp_path), template="alpaca"), stories_tokenizer
        ).train[0]["input_ids"]
    )
    assert "Translate.\nEXTRA INPUT" in text
    two = prepare_data(make_cfg(dataset="two", dataset_dir=str(tmp_path), template="alpaca"), stories_tokenizer)
    text = stories_tokenizer.decode(two.train[0]["input_ids"])
    assert "Translate." in text and "EXTRA" not in text and "Done." in text
    only = prepare_data(make_cfg(dataset="reply_only", dataset_dir=str(tmp_path), template="alpaca"), stories_tokenizer)
    text = stories_tokenizer.decode(only.train[0]["input_ids"])
    assert "EXTRA INPUT" in text and "Translate" not in text
    with pytest.raises(ConfigError, match=r"dataset 'no_reply': columns names no 'response'"):
        prepare_data(make_cfg(dataset="no_reply", dataset_dir=str(tmp_path), template="alpaca"), stories_tokenizer)


def test_openai_formatting_tool_calls_and_content_parts(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
                    ],
                },
                {"role": "tool", "content": "3C"},
                {"role": "tool", "content": "windy"},
                {"role": "assistant", "content": "Cold."},
            ]
        }
    ]
    (tmp_path / "oa.json").write_text(json.dumps(rows))
    write_info(
        tmp_path,
        {
            "oa": {
                "file_name": "oa.json",
                "formatting": "openai",
                "columns": {"messages": "messages"},
                "tags": {
                    "role_tag": "role",
                    "content_tag": "content",
                    "user_tag": "user",
                    "assistant_tag": "assistant",
                    "observation_tag": "tool",
                    "system_tag": "system",
                },
            }
        },
    )
    data = prepare_data(
        make_cfg(
            dataset="oa",
            dataset_dir=str(tmp_path),
            template="qwen3_nothink",
            model_name_or_path=str(_chatml_model(stories_tokenizer, tmp_path)),
        ),
        _chatml_tok(tmp_path),
    )
    text = _chatml_tok(tmp_path).decode(data.train[0]["input_ids"])
    assert "system\nBe brief." in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n3C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in text
    rows[0]["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    (tmp_path / "oa.json").write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"oa.json: row 1: messages\[1\].content: content part 0 is 'image_url'"):
        prepare_data(make_cfg(dataset="oa", dataset_dir=str(tmp_path), template="default"), stories_tokenizer)


def _chatml_model(stories_tokenizer, tmp_path: Path) -> Path:
    folder = tmp_path / "chatml-model"
    if not folder.exists():
        from transformers import AutoTokenizer

        stories_tokenizer.save_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.save_pretrained(folder)
    return folder


def _chatml_tok(tmp_path: Path):
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer

    return load_tokenizer(
        TrainConfig(
            model_name_or_path=str(tmp_path / "chatml-model"), dataset="x", output_dir="x", template="qwen3_nothink"
        )
    )


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"file_name": "d.json", "ranking": True}, "key 'ranking'"),
        (
            {"file_name": "d.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"}},
            "columns.kto_tag: a KTO",
        ),
        (
            {"file_name": "d.json", "formatting": "sharegpt", "columns": {"messages": "messages", "audios": "audios"}},
            "columns.audios: ferry trains text, image and video rows; audios are not built",
        ),
        ({"file_name": "d.json", "load_from_cache": True}, "key 'load_from_cache'"),
    ],
)
def test_what_ferry_does_not_train_is_refused_naming_dataset_and_key(
    make_cfg, stories_tokenizer, tmp_path: Path, entry: dict, fragment: str
) -> None:
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    write_info(tmp_path, {"d": entry})
    with pytest.raises(ConfigError, match=r"dataset_info.json: dataset 'd': " + fragment.replace(".", r"\.")) as err:
        prepare_data(make_cfg(dataset="d", dataset_dir=str(tmp_path)), stories_tokenizer)
    assert "\n" not in str(err.value)


def test_bad_bytes_and_empty_files_are_one_line(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    raw = b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n'
    bad.write_bytes(raw)
    offset = raw.index(b"\xe9")
    with pytest.raises(DataError, match=rf"bad.jsonl: line 2: byte offset {offset}: not UTF-8 \(byte 0xe9\)"):
        prepare_data(make_cfg(dataset=str(bad)), stories_tokenizer)
    info = b'{"x": {"file_name": "\xff.json"}}'
    (tmp_path / "dataset_info.json").write_bytes(info)
    offset = info.index(b"\xff")
    with pytest.raises(DataError, match=rf"dataset_info.json: line 1: byte offset {offset}: not UTF-8"):
        prepare_data(make_cfg(dataset="x", dataset_dir=str(tmp_path)), stories_tokenizer)
    (tmp_path / "dataset_info.json").unlink()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: the file is empty"):
        prepare_data(make_cfg(dataset=str(empty)), stories_tokenizer)
    brackets = tmp_path / "brackets.json"
    brackets.write_text("[]")
    with pytest.raises(DataError, match=r"brackets.json.*holds no rows"):
        prepare_data(make_cfg(dataset=str(brackets)), stories_tokenizer)


def test_unknown_dataset_gets_a_did_you_mean_not_the_whole_list(make_cfg, stories_tokenizer) -> None:
    with pytest.raises(NotInstalledError) as err:
        prepare_data(make_cfg(dataset="alpaca_en_dem"), stories_tokenizer)
    assert "did you mean 'alpaca_en_demo'" in str(err.value) and "identity" not in str(err.value)


def test_every_layout_trains_through_ferry_train(
    stories_model: Path, llamafactory_data: Path, layouts: Path, tmp_path: Path
) -> None:
    """One real `ferry train` (torchrun, 1 worker) on all layouts at once, plus the pt text file."""

    from tests.support.helpers import run_ferry_train, tiny_config, worker_env, write_config

    names = "json,jsonl,lines_as_json,parquet,csv,arrow,saved,nested,repo,repo_de,sliced"
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config(
            stories_model,
            llamafactory_data,
            tmp_path,
            dataset=names,
            dataset_dir=str(layouts),
            max_steps=2,
            template="default",
        ),
    )
    proc = run_ferry_train(
        str(config), "--nproc-per-node", "1", env=worker_env(tmp_path), cwd=tmp_path, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["num_train_samples"] == 9 * 3 + 1 + 2  # nine full layouts, one German row, a sliced split
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter folder carries the trained template: served prompt == trained prompt
    from transformers import AutoTokenizer

    from trainer.templates import prompt_text

    served = AutoTokenizer.from_pretrained(tmp_path / "out" / "adapter")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert (
        served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == prompt_text("default", messages[1:], "S", eos_token=served.eos_token)
        == "System: S</s>\nHuman: Hi</s>\nAssistant:"
    )
