"""The data pipeline on the real stories260K tokenizer and LLaMA-Factory demo data: formats, loss masks,
truncation, dropped samples, malformed rows, templates, the train/eval split and collate."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from ferry.errors import ConfigError, DataError, NotInstalledError, TrainingError
from tests.support.helpers import write_json, write_jsonl
from trainer.batching import collate
from trainer.data import build_example, infer_seqlen, prepare_data
from trainer.loss import IGNORE_INDEX, count_trainable_tokens


def trainable_runs(example: dict) -> list[list[int]]:
    """Contiguous runs of trained token ids (labels != -100), in order."""
    runs: list[list[int]] = []
    prev = False
    for tok, lab in zip(example["input_ids"], example["labels"]):
        if lab != IGNORE_INDEX:
            assert lab == tok, "a label must equal its input token (labels are unshifted)"
            if not prev:
                runs.append([])
            runs[-1].append(tok)
        prev = lab != IGNORE_INDEX
    return runs


def reply(tokenizer, run: list[int]) -> str:
    """A trained run of the ``default`` template (LLaMA-Factory's: ``REPLY</s>\n``) without its end marker."""
    text = tokenizer.decode(run)
    assert text.endswith("</s> \n"), text
    return text.removesuffix("</s> \n")


def untrained_text(tokenizer, example: dict) -> str:
    return tokenizer.decode([t for t, lab in zip(example["input_ids"], example["labels"]) if lab == IGNORE_INDEX])


# ---------------------------------------------------------------------- formats and masks


def test_alpaca_trains_exactly_the_response_and_eos(make_cfg, stories_tokenizer, llamafactory_data: Path) -> None:
    rows = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())[:12]
    data = prepare_data(make_cfg(max_samples=12, cutoff_len=4096, template="default"), stories_tokenizer)
    assert data.stats["num_samples"] == 12 and data.stats["num_truncated"] == 0
    assert data.stats["template"] == "default"
    for row, example in zip(rows, data.train):
        (run,) = trainable_runs(example)
        assert stories_tokenizer.eos_token_id in run
        assert reply(stories_tokenizer, run) == row["output"]
        assert example["input_ids"][0] != stories_tokenizer.bos_token_id  # LLaMA-Factory's default has no BOS
        prompt = untrained_text(stories_tokenizer, example)
        assert prompt.startswith("Human: " + row["instruction"]) and prompt.endswith("</s> \nAssistant:")
        if row["input"]:
            assert f"{row['instruction']}\n{row['input']}" in prompt
        assert example["position_ids"] == list(range(len(example["input_ids"])))


def test_builtin_alpaca_template_layout(make_cfg, stories_tokenizer) -> None:
    data = prepare_data(make_cfg(max_samples=2, template="alpaca"), stories_tokenizer)
    prompt = untrained_text(stories_tokenizer, data.train[0])
    assert "Below is an instruction that describes a task." in prompt
    assert "### Instruction:\nDescribe a process of making crepes." in prompt and "### Response:" in prompt
    assert data.stats["template"] == "alpaca"


def test_identity_and_max_samples_per_dataset(make_cfg, stories_tokenizer) -> None:
    data = prepare_data(
        make_cfg(dataset="identity,alpaca_en_demo", max_samples=5, template="default"), stories_tokenizer
    )
    assert data.stats["num_samples"] == 10
    assert data.stats["datasets"] == ["identity", "alpaca_en_demo"]
    first = trainable_runs(data.train[0])[0]
    assert reply(stories_tokenizer, first).startswith("Hello! I am {{name}}")
    assert len(prepare_data(make_cfg(dataset="identity"), stories_tokenizer).train) == 91


def sharegpt_rows() -> list[dict]:
    return [
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Name a colour."},
                {"from": "gpt", "value": "Blue."},
                {"from": "human", "value": "Another one?"},
                {"from": "gpt", "value": "Red, of course."},
            ]
        },
        {
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."}],
            "system": "You are kind.",
        },
    ]


def test_sharegpt_multi_turn_trains_every_assistant_turn(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    write_json(tmp_path / "chat.json", sharegpt_rows())
    (tmp_path / "dataset_info.json").write_text(
        json.dumps(
            {
                "chat": {
                    "file_name": "chat.json",
                    "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "system": "system"},
                },
            }
        )
    )
    data = prepare_data(make_cfg(dataset="chat", dataset_dir=str(tmp_path), template="default"), stories_tokenizer)
    first, second = data.train[0], data.train[1]
    runs = trainable_runs(first)
    assert [reply(stories_tokenizer, r) for r in runs] == ["Blue.", "Red, of course."]
    prompt = untrained_text(stories_tokenizer, first)
    assert "System: Be brief." in prompt and "Human: Another one?" in prompt
    assert "System: You are kind." in untrained_text(stories_tokenizer, second)


def test_mask_history_trains_only_the_last_turn(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    path = write_json(tmp_path / "chat.json", sharegpt_rows())
    data = prepare_data(make_cfg(dataset=str(path), mask_history=True, template="default"), stories_tokenizer)
    runs = trainable_runs(data.train[0])
    assert [reply(stories_tokenizer, r) for r in runs] == ["Red, of course."]


def test_train_on_prompt_trains_everything(make_cfg, stories_tokenizer) -> None:
    data = prepare_data(make_cfg(max_samples=3, train_on_prompt=True), stories_tokenizer)
    for example in data.train:
        assert example["labels"] == example["input_ids"]


def openai_rows() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Sky colour?"},
                {"role": "assistant", "content": "Blue"},
                {"role": "user", "content": "Grass?"},
                {"role": "assistant", "content": "Green"},
            ]
        }
    ]


def test_openai_messages_file_given_by_path(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "openai.jsonl", openai_rows())
    data = prepare_data(make_cfg(dataset=str(path), template="default"), stories_tokenizer)
    runs = trainable_runs(data.train[0])
    assert [reply(stories_tokenizer, r) for r in runs] == ["Blue", "Green"]
    assert "System: You answer in one word." in untrained_text(stories_tokenizer, data.train[0])


def test_openai_messages_via_dataset_info_tags(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    write_json(tmp_path / "oa.json", openai_rows())
    (tmp_path / "dataset_info.json").write_text(
        json.dumps(
            {
                "oa": {
                    "file_name": "oa.json",
                    "formatting": "sharegpt",
                    "columns": {"messages": "messages"},
                    "tags": {
                        "role_tag": "role",
                        "content_tag": "content",
                        "user_tag": "user",
                        "assistant_tag": "assistant",
                        "system_tag": "system",
                    },
                }
            }
        )
    )
    data = prepare_data(make_cfg(dataset="oa", dataset_dir=str(tmp_path), template="default"), stories_tokenizer)
    assert [reply(stories_tokenizer, r) for r in trainable_runs(data.train[0])] == ["Blue", "Green"]


def test_plain_text_c4_trains_every_token_and_splits_long_documents(
    make_cfg, stories_tokenizer, llamafactory_data: Path
) -> None:
    first_text = json.loads((llamafactory_data / "c4_demo.jsonl").read_text().splitlines()[0])["text"]
    data = prepare_data(make_cfg(dataset="c4_demo", max_samples=10, cutoff_len=128), stories_tokenizer)
    assert data.stats["num_split_documents"] > 0
    assert all(len(e["input_ids"]) <= 128 for e in data.train)
    for example in data.train:
        assert example["labels"] == example["input_ids"]
    # the first document's blocks, in order, are BOS + the text + EOS
    ids = stories_tokenizer.encode(first_text, add_special_tokens=False)
    n_blocks = math.ceil((len(ids) + 2) / 128)
    joined = [t for e in list(data.train)[:n_blocks] for t in e["input_ids"]]
    assert joined == [stories_tokenizer.bos_token_id, *ids, stories_tokenizer.eos_token_id]


def test_stage_pt_reads_the_prompt_column(make_cfg, stories_tokenizer, llamafactory_data: Path) -> None:
    rows = json.loads((llamafactory_data / "alpaca_en_demo.json").read_text())
    data = prepare_data(make_cfg(stage="pt", max_samples=3, packing=False), stories_tokenizer)  # a row each
    example = data.train[0]
    assert example["labels"] == example["input_ids"]
    assert stories_tokenizer.decode(example["input_ids"][1:-1]) == rows[0]["instruction"]


# ---------------------------------------------------------------------- truncation and dropping


def test_infer_seqlen_is_llamafactorys() -> None:
    for budget in (2, 3, 8, 64, 257):
        for source in (0, 1, 5, 40, 300, 5000):
            for target in (0, 1, 7, 33, 300, 5000):
                s, t = infer_seqlen(source, target, budget)
                assert 0 <= s <= source and 0 <= t <= target and s + t <= budget
                if source + target <= budget:
                    assert (s, t) == (source, target)
    # both long: shared in proportion (LLaMA-Factory's processor_utils.infer_seqlen)
    assert infer_seqlen(300, 100, 64) == (48, 16)


def test_long_prompt_is_cut_so_the_response_keeps_tokens(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    response = "The answer is yes, and here is why it works."
    path = write_json(
        tmp_path / "long.json",
        [
            {"instruction": "Please read this. " * 200, "input": "", "output": response},
            {"instruction": "Short question?", "input": "", "output": "word " * 400},
        ],
    )
    data = prepare_data(make_cfg(dataset=str(path), cutoff_len=64, template="default"), stories_tokenizer)
    assert data.stats["num_truncated"] == 2
    long_prompt, long_response = data.train[0], data.train[1]
    assert len(long_prompt["input_ids"]) <= 64 and len(long_response["input_ids"]) <= 64
    (run,) = trainable_runs(long_prompt)
    assert reply(stories_tokenizer, run) == response  # the short response survives whole, with EOS
    (run,) = trainable_runs(long_response)
    assert len(run) >= 32 and stories_tokenizer.decode(run).startswith("word word")
    assert "Human: Short question?" in untrained_text(stories_tokenizer, long_response)


def test_build_example_budget_per_turn() -> None:
    pairs = [([1, 10, 11, 12], [20, 21, 2]), ([13, 14], [22, 23, 24, 2])]
    ids, labels, truncated = build_example(pairs, cutoff_len=100)
    assert ids == [1, 10, 11, 12, 20, 21, 2, 13, 14, 22, 23, 24, 2] and not truncated
    assert labels == [-100] * 4 + [20, 21, 2] + [-100] * 2 + [22, 23, 24, 2]
    ids, labels, truncated = build_example(pairs, cutoff_len=8)
    assert truncated and len(ids) == 8 and ids[:7] == [1, 10, 11, 12, 20, 21, 2]


def test_mask_history_keeps_the_last_turn_within_the_budget(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    long_history = {
        "conversations": [
            {"from": "human", "value": "Tell me a long story. " * 30},
            {"from": "gpt", "value": "Once upon a time. " * 30},
            {"from": "human", "value": "And then?"},
            {"from": "gpt", "value": "The end."},
        ]
    }
    short = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    path = write_json(tmp_path / "mixed.json", [long_history, short, long_history])
    data = prepare_data(
        make_cfg(dataset=str(path), cutoff_len=64, mask_history=True, template="default"), stories_tokenizer
    )
    # mask_history budgets the last turn first (LLaMA-Factory): every sample keeps its last reply
    assert data.stats["num_dropped_no_trainable"] == 0 and data.stats["num_samples"] == 3
    assert reply(stories_tokenizer, trainable_runs(data.train[1])[0]) == "Hello."
    assert reply(stories_tokenizer, trainable_runs(data.train[0])[0]) == "The end."


def test_nothing_trainable_at_all_is_a_training_error(make_cfg, stories_tokenizer) -> None:
    with pytest.raises(TrainingError, match="no training sample has a trainable token"):
        prepare_data(make_cfg(max_samples=4, cutoff_len=1), stories_tokenizer)


# ---------------------------------------------------------------------- malformed data


@pytest.mark.parametrize(
    ("name", "rows", "row_no", "fragment"),
    [
        ("missing.json", [{"instruction": "a", "output": "b"}, {"instruction": "c"}], 2, "missing column 'output'"),
        ("type.json", [{"instruction": 5, "output": "b"}], 1, "'instruction' must be a string"),
        ("history.json", [{"instruction": "a", "output": "b", "history": [["x"]]}], 1, "history[1]"),
        (
            "order.json",
            [{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}],
            1,
            "bad role order",
        ),
        (
            "role.json",
            [{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}],
            1,
            "unknown role 'bot'",
        ),
        (
            "ends_user.json",
            [
                {
                    "conversations": [
                        {"from": "human", "value": "a"},
                        {"from": "gpt", "value": "b"},
                        {"from": "human", "value": "c"},
                    ]
                }
            ],
            1,
            "must end with an assistant",
        ),
        ("not_object.json", [{"instruction": "a", "output": "b"}, ["list"]], 2, "expected a JSON object"),
        (
            "lines.jsonl",
            [{"instruction": "a", "output": "b"}, "", '{"instruction": "c", "output": '],
            3,
            "invalid JSON line",
        ),
        (
            "content.jsonl",
            [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}],
            1,
            "must be a string",
        ),
    ],
)
def test_malformed_row_names_file_and_row(
    make_cfg, stories_tokenizer, tmp_path: Path, name: str, rows: list, row_no: int, fragment: str
) -> None:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, rows)
    else:
        write_json(path, rows)
    with pytest.raises(DataError) as err:
        prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    message = str(err.value)
    assert str(path.resolve()) in message and f"row {row_no}:" in message and fragment in message


def test_unknown_format_and_bad_json_file(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    path = write_json(tmp_path / "odd.json", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match="row 1: cannot tell the format"):
        prepare_data(make_cfg(dataset=str(path)), stories_tokenizer)
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"instruction": "a",\n  "output": }\n]')
    with pytest.raises(DataError, match=r"broken.json: line 3: invalid JSON"):
        prepare_data(make_cfg(dataset=str(broken)), stories_tokenizer)


def test_a_json_file_of_one_object_is_refused_and_json_lines_of_one_row_is_not(
    make_cfg, stories_tokenizer, tmp_path: Path
) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"instruction": "a", "output": "b"}, indent=2))  # the datasets library: one row
    with pytest.raises(DataError, match=r"one.json: the file is one JSON object, which would train as a single row"):
        prepare_data(make_cfg(dataset=str(one)), stories_tokenizer)
    columns = tmp_path / "columns.json"  # the datasets library: one row of lists, not two rows
    columns.write_text(json.dumps({"instruction": ["a", "c"], "output": ["b", "d"]}))
    with pytest.raises(DataError, match=r"columns.json: the file is one JSON object"):
        prepare_data(make_cfg(dataset=str(columns)), stories_tokenizer)
    line = write_jsonl(tmp_path / "line.jsonl", [{"instruction": "a", "output": "b"}])  # JSON Lines of one row
    assert len(prepare_data(make_cfg(dataset=str(line)), stories_tokenizer).train) == 1


def test_missing_dataset_says_what_to_pack(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(NotInstalledError, match="'alpaca_gpt4'.*ferry pack"):
        prepare_data(make_cfg(dataset="alpaca_gpt4"), stories_tokenizer)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"hubby": {"hf_hub_url": "org/hubby"}}))
    with pytest.raises(NotInstalledError, match="'hubby'.*org/hubby.*ferry pack"):
        prepare_data(make_cfg(dataset="hubby", dataset_dir=str(tmp_path)), stories_tokenizer)


# ---------------------------------------------------------------------- templates


CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def chat_tokenizer(stories_tokenizer, tmp_path: Path):
    """stories260K's tokenizer saved with a ChatML chat_template, reloaded the trainer's way."""
    from trainer.config import TrainConfig
    from trainer.data import load_tokenizer

    folder = tmp_path / "chat-model"
    stories_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML_JINJA
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # ferry's fallback rendering, saved with it
    return load_tokenizer(TrainConfig(model_name_or_path=str(folder), dataset="x", output_dir="x"))


def test_tokenizer_chat_template_masks_assistant_spans(make_cfg, chat_tokenizer, tmp_path: Path) -> None:
    assert chat_tokenizer.chat_template == CHATML_JINJA
    path = write_jsonl(tmp_path / "openai.jsonl", openai_rows())
    data = prepare_data(make_cfg(dataset=str(path)), chat_tokenizer)
    assert data.stats["template"] == "tokenizer-chat-template"
    example = data.train[0]
    full = chat_tokenizer.apply_chat_template(openai_rows()[0]["messages"], tokenize=False)
    assert chat_tokenizer.decode(example["input_ids"]) == full
    runs = [chat_tokenizer.decode(r).strip() for r in trainable_runs(example)]
    assert runs == ["Blue<|im_end|>", "Green<|im_end|>"]


def test_chat_template_that_rewrites_earlier_turns_still_trains(make_cfg, chat_tokenizer, tmp_path: Path) -> None:
    chat_tokenizer.chat_template = "{{ messages | length }}:" + CHATML_JINJA  # every prefix renders differently
    path = write_jsonl(tmp_path / "openai.jsonl", openai_rows())
    data = prepare_data(make_cfg(dataset=str(path)), chat_tokenizer)
    runs = [chat_tokenizer.decode(r).strip() for r in trainable_runs(data.train[0])]
    assert runs == ["Blue<|im_end|>", "Green<|im_end|>"]


def test_fallback_to_empty_template_warns(make_cfg, stories_tokenizer, caplog, monkeypatch) -> None:
    import trainer.data as data_module

    monkeypatch.setattr(data_module, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="ferry.trainer.data"):
        prepare_data(make_cfg(max_samples=2), stories_tokenizer)
        prepare_data(make_cfg(max_samples=3), stories_tokenizer)
    warnings = [r for r in caplog.records if "no chat_template" in r.getMessage()]
    assert len(warnings) == 1 and "'empty'" in warnings[0].getMessage()


def test_load_tokenizer_pads_with_eos_on_the_right(stories_tokenizer) -> None:
    assert stories_tokenizer.pad_token_id == stories_tokenizer.eos_token_id == 2
    assert stories_tokenizer.padding_side == "right"


# ---------------------------------------------------------------------- split and collate


def test_validation_split_is_seeded_and_disjoint(make_cfg, stories_tokenizer, tmp_path: Path) -> None:
    a = prepare_data(make_cfg(max_samples=50, val_size=0.1, seed=1), stories_tokenizer)
    b = prepare_data(make_cfg(max_samples=50, val_size=0.1, seed=1), stories_tokenizer, cache_dir=tmp_path / "b")
    assert not b.stats["cache_hit"]  # built again from scratch, elsewhere
    c = prepare_data(make_cfg(max_samples=50, val_size=0.1, seed=2), stories_tokenizer)
    assert (len(a.train), len(a.eval)) == (45, 5)
    assert list(a.eval) == list(b.eval)
    assert list(a.eval) != list(c.eval)
    train_ids = {tuple(e["input_ids"]) for e in a.train}
    assert not any(tuple(e["input_ids"]) in train_ids for e in a.eval)
    counted = prepare_data(make_cfg(max_samples=50, val_size=7), stories_tokenizer)
    assert len(counted.eval) == 7


def test_eval_dataset_overrides_val_size(make_cfg, stories_tokenizer) -> None:
    data = prepare_data(make_cfg(max_samples=8, eval_dataset="identity", val_size=0.5), stories_tokenizer)
    assert (len(data.train), len(data.eval)) == (8, 8)
    assert data.stats["eval_datasets"] == ["identity"]


def test_collate_pads_right_and_counts_trainable_tokens(make_cfg, stories_tokenizer) -> None:
    data = prepare_data(make_cfg(max_samples=4, cutoff_len=128), stories_tokenizer)
    examples = list(data.train)
    batch = collate(examples, stories_tokenizer.pad_token_id)
    lengths = [len(e["input_ids"]) for e in examples]
    assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert all(t.dtype == torch.int64 and t.shape == (4, max(lengths)) for t in batch.values())
    for row, n in enumerate(lengths):
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert (batch["input_ids"][row, n:] == stories_tokenizer.pad_token_id).all()
        assert batch["position_ids"][row, :n].tolist() == list(range(n))
    expected = sum(sum(lab != IGNORE_INDEX for lab in e["labels"][1:]) for e in examples)
    assert count_trainable_tokens(batch["labels"]) == expected == data.train.num_trainable_tokens()
    assert data.stats["num_trainable_tokens"] == expected
    assert data.stats["num_train_tokens"] == sum(lengths)


@pytest.fixture
def chatml_tokens_tokenizer(stories_tokenizer, tmp_path: Path):
    """stories260K's tokenizer with ChatML's turn markers as special tokens, reloaded the trainer's way."""
    folder = tmp_path / "chatml-tokens"
    stories_tokenizer.save_pretrained(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(folder)
    return folder


def test_qwen_template_makes_im_end_the_eos_and_trains_the_newline(
    make_cfg, chatml_tokens_tokenizer, tmp_path: Path
) -> None:
    from trainer.data import load_tokenizer

    cfg = make_cfg(
        model_name_or_path=str(chatml_tokens_tokenizer),
        dataset=str(write_json(tmp_path / "chat.json", sharegpt_rows()[:1])),
        template="qwen",
    )
    tokenizer = load_tokenizer(cfg)
    assert tokenizer.eos_token == "<|im_end|>"  # replace_eos, as LLaMA-Factory
    data = prepare_data(cfg, tokenizer)
    runs = [tokenizer.decode(r) for r in trainable_runs(data.train[0])]
    assert runs == ["Blue.<|im_end|> \n", "Red, of course.<|im_end|> \n"]
    prompt = untrained_text(tokenizer, data.train[0])
    assert prompt.startswith("<|im_start|> system\nBe brief.<|im_end|>")


def test_template_whose_end_token_the_tokenizer_lacks_is_refused(make_cfg, stories_tokenizer) -> None:
    from trainer.data import load_tokenizer

    with pytest.raises(ConfigError, match=r"template 'qwen' ends turns with '<\|im_end\|>'.*does not have"):
        load_tokenizer(make_cfg(template="qwen"))


def test_unknown_template_hints_by_family(make_cfg, tmp_path: Path, stories_model: Path) -> None:
    import shutil

    qwen3 = tmp_path / "qwen3-like"
    shutil.copytree(stories_model, qwen3)
    config = json.loads((qwen3 / "config.json").read_text())
    (qwen3 / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(
        Exception, match=r"unknown template 'qwen3_chat' \(did you mean 'qwen3' or 'qwen3_nothink'"
    ) as err:
        make_cfg(model_name_or_path=str(qwen3), template="qwen3_chat")
    assert "'qwen'" not in str(err.value)


def test_chat_template_that_refuses_a_row_names_file_and_row(make_cfg, chat_tokenizer, tmp_path: Path) -> None:
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% endfor %}" + CHATML_JINJA
    )
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, *openai_rows()]
    path = write_jsonl(tmp_path / "openai.jsonl", rows)
    with pytest.raises(DataError, match=r"openai.jsonl: row 2: the tokenizer's chat_template refused .*System role"):
        prepare_data(make_cfg(dataset=str(path)), chat_tokenizer)
