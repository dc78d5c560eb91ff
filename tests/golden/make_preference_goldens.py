"""LLaMA-Factory's own preference examples (``stage: dpo`` and ``stage: kto``): tests/golden/preference.json.

Run in the LLaMA-Factory 0.9.5 venv described in make_template_goldens.py::

    /tmp/lf-venv/bin/python tests/golden/make_preference_goldens.py LF_DATA [SHARED_ASSETS]

LF_DATA is LLaMA-Factory's ``data/`` folder at v0.9.5 (``dpo_en_demo.json``, ``kto_en_demo.json``,
``dataset_info.json``; e.g. ``git archive v0.9.5 data`` of hiyouga/LLaMA-Factory), SHARED_ASSETS defaults to
../shared/assets beside the project (the stories260K model). A few short rows of each demo file (``DEMO_ROWS``)
and small datasets written here (``WRITTEN``: alpaca pairs with system and history, sharegpt pairs with tools and a
tool call, alpaca KTO rows) are saved as files with their dataset_info.json entries (the demo files' entries as
LLaMA-Factory ships them); the golden records those rows, so ferry's test reads the very same files.

Each case goes through LLaMA-Factory's real entry path: ``get_train_args`` with ``stage: dpo`` / ``stage: kto``,
``load_tokenizer``, ``get_template_and_fix_tokenizer``, then ``get_dataset`` with the stage ``run_dpo`` (``rm``)
or ``run_kto`` (``kto``) passes, for the templates of ``TEMPLATES`` and the cutoffs of ``CUTOFFS`` (the small one
truncates), and ``EXTRA_CASES``: an efficient_eos template, and a kto case that sets ``preprocessing_batch_size``
and ``preprocessing_num_workers`` (the KL replies rotate within each worker's batches). The llama3 tool prompt's
date is pinned to ``conversations.PINNED_DATE``. ``BAD_ROWS`` records what LLaMA-Factory makes of rows ferry refuses.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
_STUB = Path(tempfile.mkdtemp(prefix="lf-stub-"))
(_STUB / "torchaudio.py").write_text("")
sys.path.insert(0, str(_STUB))
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lf-datasets-"))

from conversations import PINNED_DATE  # noqa: E402

MODEL = "models/stories260K"
TEMPLATES = ["default", "llama3", "qwen", "qwen3", "llama2"]
CUTOFFS = [1024, 40]
#: rows (0-based) of LLaMA-Factory's demo files: short ones, desirable and undesirable mixed for KTO
DEMO_ROWS = {"dpo_en_demo": [134, 80], "kto_en_demo": [147, 119]}

_TOOLS = json.dumps(
    [
        {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
)
#: name -> (dataset_info.json entry, rows)
WRITTEN: dict[str, tuple[dict, list[dict]]] = {
    "pairs_alpaca": (
        {
            "file_name": "pairs_alpaca.json",
            "ranking": True,
            "columns": {
                "prompt": "instruction",
                "query": "input",
                "chosen": "chosen",
                "rejected": "rejected",
                "system": "system",
                "history": "history",
            },
        },
        [
            {
                "instruction": "Name a color.",
                "input": "Pick a warm one.",
                "chosen": "Red.",
                "rejected": "Blue is a color.",
                "system": "You answer in one word.",
                "history": [["Hello!", "Hi."]],
            },
            {
                "instruction": "Count to three.",
                "input": "",
                "chosen": "One, two, three.",
                "rejected": "One, two.",
                "system": "",
                "history": [],
            },
            {  # reasoning templates: the chosen reply has its thought, the rejected one gets an empty one
                "instruction": "Pick one.",
                "input": "",
                "chosen": "<think>\nRed is warm.\n</think>\n\nRed.",
                "rejected": "Blue.",
                "system": "",
                "history": [],
            },
        ],
    ),
    "pairs_sharegpt": (
        {
            "file_name": "pairs_sharegpt.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "tools": "tools"},
        },
        [
            {
                "conversations": [
                    {"from": "system", "value": "You are a weather bot."},
                    {"from": "human", "value": "Weather in Paris?"},
                    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                    {"from": "observation", "value": '{"temp": 21}'},
                ],
                "chosen": {"from": "gpt", "value": "It is 21 degrees in Paris."},
                "rejected": {"from": "gpt", "value": "I do not know."},
                "tools": _TOOLS,
            },
            {
                "conversations": [{"from": "human", "value": "Weather in Rome?"}],
                "chosen": {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
                "rejected": {"from": "gpt", "value": "Sunny, always."},
                "tools": _TOOLS,
            },
        ],
    ),
    "pairs_openai": (
        {
            "file_name": "pairs_openai.json",
            "ranking": True,
            "formatting": "openai",
            "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "observation_tag": "tool",
                "system_tag": "system",
            },
        },
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"},
                ],
                "chosen": {"role": "assistant", "content": "Goodbye."},
                "rejected": {"role": "assistant", "content": "Why?"},
            }
        ],
    ),
    "kto_alpaca": (
        {"file_name": "kto_alpaca.json", "columns": {"prompt": "prompt", "response": "completion", "kto_tag": "label"}},
        [
            {"prompt": "Say hi.", "completion": "Hi!", "label": True},
            {"prompt": "Add 2 and 2.", "completion": "5", "label": False},
            {"prompt": "Name a fruit.", "completion": "Apple.", "label": True},
        ],
    ),
}
#: stage -> the datasets of its cases (listed together: LLaMA-Factory concatenates them in this order)
DATASETS = {"dpo": "dpo_en_demo,pairs_alpaca,pairs_sharegpt,pairs_openai", "kto": "kto_en_demo,kto_alpaca"}
#: cases beyond TEMPLATES x CUTOFFS: an efficient_eos template (its EOS appended to each reply), and KL replies
#: that rotate within batches of 3 rows of each of 2 workers' shards
EXTRA_CASES = [
    ("dpo", {"template": "falcon", "cutoff_len": 40}),
    ("kto", {"template": "falcon", "cutoff_len": 1024}),
    ("kto", {"template": "default", "cutoff_len": 1024, "preprocessing_batch_size": 3, "preprocessing_num_workers": 2}),
]

_PAIR_COLUMNS = {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}
_GOOD_PAIR = {"instruction": "Say yes.", "chosen": "Yes.", "rejected": "No."}
_SHAREGPT_COLUMNS = {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}
_KTO_COLUMNS = {"prompt": "instruction", "response": "output", "kto_tag": "label"}
_GOOD_KTO = [
    {"instruction": "Say yes.", "output": "Yes.", "label": True},
    {"instruction": "Say no.", "output": "Yes.", "label": False},
]
#: rows ferry refuses, each dataset a good row or two and then the bad one: what LLaMA-Factory makes of them
BAD_ROWS: dict[str, tuple[str, dict, list[dict]]] = {
    "no_rejected_sharegpt": (
        "dpo",
        {"ranking": True, "formatting": "sharegpt", "columns": _SHAREGPT_COLUMNS},
        [
            {
                "conversations": [{"from": "human", "value": "Say yes."}],
                "chosen": {"from": "gpt", "value": "Yes."},
                "rejected": {"from": "gpt", "value": "No."},
            },
            {"conversations": [{"from": "human", "value": "Say no."}], "chosen": {"from": "gpt", "value": "No."}},
        ],
    ),
    "no_rejected_alpaca": (
        "dpo",
        {"ranking": True, "columns": _PAIR_COLUMNS},
        [_GOOD_PAIR, {"instruction": "Hi.", "chosen": "Hi."}],
    ),
    "empty_prompt": (
        "dpo",
        {"ranking": True, "columns": _PAIR_COLUMNS},
        [_GOOD_PAIR, {**_GOOD_PAIR, "instruction": ""}],
    ),
    "same_reply": (
        "dpo",
        {"ranking": True, "columns": _PAIR_COLUMNS},
        [_GOOD_PAIR, {**_GOOD_PAIR, "rejected": "Yes."}],
    ),
    "user_role_reply": (
        "dpo",
        {"ranking": True, "formatting": "sharegpt", "columns": _SHAREGPT_COLUMNS},
        [
            {
                "conversations": [{"from": "human", "value": "Say yes."}],
                "chosen": {"from": "gpt", "value": "Yes."},
                "rejected": {"from": "gpt", "value": "No."},
            },
            {
                "conversations": [{"from": "human", "value": "Say no."}],
                "chosen": {"from": "human", "value": "No."},
                "rejected": {"from": "gpt", "value": "Yes."},
            },
        ],
    ),
    "kto_tag_string": (
        "kto",
        {"columns": _KTO_COLUMNS},
        [*_GOOD_KTO, {"instruction": "Hi.", "output": "Hi.", "label": "true"}],
    ),
    "kto_tag_strings": (
        "kto",
        {"columns": _KTO_COLUMNS},
        [
            {"instruction": "Say yes.", "output": "Yes.", "label": "true"},
            {"instruction": "Hi.", "output": "Hi.", "label": "false"},
        ],
    ),
    "kto_empty_reply": (
        "kto",
        {"columns": _KTO_COLUMNS},
        [*_GOOD_KTO, {"instruction": "Hi.", "output": "", "label": True}],
    ),
}


def _pin_date() -> None:
    import llamafactory.data.tool_utils as lf_tools

    class _PinnedDate(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*PINNED_DATE)

    lf_tools.datetime = _PinnedDate


def _run(assets: Path, data_dir: Path, work: Path, stage: str, keys: dict) -> list[dict]:
    """LLaMA-Factory's data path of ``run_dpo`` / ``run_kto`` for ``keys``: the train dataset's rows."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    args = {
        "stage": stage,
        "do_train": True,
        "finetuning_type": "lora",
        "model_name_or_path": str(assets / MODEL),
        "dataset_dir": str(data_dir),
        "dataset": DATASETS[stage],
        "output_dir": str(work / "out"),
        "overwrite_cache": True,
        "report_to": "none",
        **keys,
    }
    model_args, data_args, training_args, _ft, _gen = get_train_args(args)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    lf_stage = "rm" if stage == "dpo" else "kto"  # what run_dpo and run_kto pass
    module = get_dataset(template, model_args, data_args, training_args, stage=lf_stage, **tokenizer_module)
    train = module["train_dataset"]
    columns = (
        ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
        if stage == "dpo"
        else ["input_ids", "labels", "kl_input_ids", "kl_labels", "kto_tags"]
    )
    return [{c: train[i][c] for c in columns} for i in range(len(train))]


def _write_data(lf_data: Path, data_dir: Path) -> tuple[dict, dict, dict]:
    """The datasets' files and dataset_info.json in ``data_dir``: (info, files: name -> rows, sources)."""
    lf_info = json.loads((lf_data / "dataset_info.json").read_text(encoding="utf-8"))
    info, files, sources = {}, {}, {}
    for name, rows in DEMO_ROWS.items():
        raw = (lf_data / f"{name}.json").read_bytes()
        every = json.loads(raw)
        files[f"{name}.json"] = [every[i] for i in rows]
        info[name] = lf_info[name]
        sources[f"{name}.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "rows": rows}
    for name, (entry, rows) in WRITTEN.items():
        info[name] = entry
        files[entry["file_name"]] = rows
    for file_name, rows in files.items():
        (data_dir / file_name).write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    (data_dir / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return info, files, sources


def main(lf_data: Path, assets: Path, out: Path = HERE / "preference.json") -> None:
    from importlib.metadata import version

    _pin_date()
    work = Path(tempfile.mkdtemp(prefix="lf-pref-goldens-"))
    data_dir = work / "data"
    data_dir.mkdir()
    info, files, sources = _write_data(lf_data, data_dir)
    cases = []
    plain = [(stage, {"template": t, "cutoff_len": c}) for stage in DATASETS for t in TEMPLATES for c in CUTOFFS]
    for k, (stage, keys) in enumerate(plain + EXTRA_CASES):
        rows = _run(assets, data_dir, work / f"case{k}", stage, keys)
        cases.append({"stage": stage, "keys": keys, "examples": rows})
    bad = {}
    for name, (stage, entry, bad_rows) in BAD_ROWS.items():
        folder = work / name
        folder.mkdir()
        (folder / "d.json").write_text(json.dumps(bad_rows), encoding="utf-8")
        (folder / "dataset_info.json").write_text(
            json.dumps({name: {"file_name": "d.json", **entry}}), encoding="utf-8"
        )
        bad[name] = {"stage": stage, "entry": entry, "rows": bad_rows}
        try:
            out_rows = _run(assets, folder, folder, stage, {"dataset": name, "template": "default", "cutoff_len": 1024})
        except Exception as exc:  # what LLaMA-Factory does with them is part of the golden
            bad[name]["llamafactory_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        bad[name]["llamafactory_examples"] = len(out_rows)
        if stage == "kto":
            bad[name]["llamafactory_kto_tags"] = [r["kto_tags"] for r in out_rows]
    golden = {
        "generator": "tests/golden/make_preference_goldens.py",
        "llamafactory": version("llamafactory"),
        "transformers": version("transformers"),
        "datasets": version("datasets"),
        "model": MODEL,
        "pinned_date": list(PINNED_DATE),
        "sources": sources,
        "dataset_info": info,
        # LLaMA-Factory's own demo rows are not committed: the tests read them from its pinned sdist by "sources"
        "files": {name: rows for name, rows in files.items() if name not in sources},
        "stage_datasets": DATASETS,
        "bad_rows": bad,
        "cases": cases,
    }
    head = json.dumps({k: v for k, v in golden.items() if k != "cases"}, ensure_ascii=False)[:-1]
    lines = [json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases]
    out.write_text(head + ',\n"cases":[\n' + ",\n".join(lines) + "\n]}\n", encoding="utf-8")
    print(f"wrote {out}: {len(cases)} cases, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else HERE.parents[2] / "shared" / "assets")
