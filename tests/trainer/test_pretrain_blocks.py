"""Stage pt with packing (LLaMA-Factory's default for pt): documents concatenated and cut into ``cutoff_len`` blocks.

The reference is LLaMA-Factory 0.9.5's own ``PretrainDatasetProcessor.preprocess_dataset``
(``data/processor/pretrain.py`` of the hash-pinned sdist), executed on the same tokenizer and documents, one call per
``preprocessing_batch_size`` documents as its ``datasets.map`` batches them: ferry's training rows must be its rows,
token for token, with and without the tokenizer's ``add_bos_token``.
"""

from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ferry.errors import TrainingError
from tests.support.pinned_sdist import LLAMAFACTORY
from trainer.data import prepare_data


def _lf_processor() -> Any:
    """LLaMA-Factory's ``PretrainDatasetProcessor`` class, its base replaced by a dataclass of the same fields
    (``processor_utils.DatasetProcessor``: template, tokenizer, processor, data_args)."""

    @dataclass
    class DatasetProcessor:
        template: Any
        tokenizer: Any
        processor: Any
        data_args: Any

    path = LLAMAFACTORY.path() / "src" / "llamafactory" / "data" / "processor" / "pretrain.py"
    module = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in module.body if not (isinstance(n, ast.ImportFrom) and n.level > 0)]
    scope: dict[str, Any] = {"DatasetProcessor": DatasetProcessor}
    exec(compile(ast.Module(body, []), str(path), "exec"), scope)
    return scope["PretrainDatasetProcessor"]


def _lf_rows(texts: list[str], tokenizer: Any, cutoff_len: int, batch: int, template: str = "default") -> list:
    """LLaMA-Factory's packed pretraining rows of ``texts``, map batch by map batch."""
    data_args = type("DataArguments", (), {"template": template, "packing": True, "cutoff_len": cutoff_len})()
    processor = _lf_processor()(template=None, tokenizer=tokenizer, processor=None, data_args=data_args)
    rows: list[list[int]] = []
    for first in range(0, len(texts), batch):
        prompts = [[{"role": "user", "content": t}] for t in texts[first : first + batch]]
        rows += processor.preprocess_dataset({"_prompt": prompts})["input_ids"]
    return rows


@pytest.mark.parametrize("add_bos_token", [False, True])
def test_pt_blocks_are_llamafactorys_rows(make_cfg, stories_tokenizer, llamafactory_data: Path, add_bos_token) -> None:
    tokenizer = copy.deepcopy(stories_tokenizer)
    tokenizer.add_bos_token = add_bos_token
    texts = [json.loads(line)["text"] for line in (llamafactory_data / "c4_demo.jsonl").read_text().splitlines()]
    cfg = make_cfg(
        stage="pt", dataset="c4_demo", cutoff_len=96, max_samples=40, preprocessing_batch_size=7, overwrite_cache=True
    )
    assert cfg.packing is True  # packing unset: LLaMA-Factory packs stage pt
    data = prepare_data(cfg, tokenizer)
    theirs = _lf_rows(texts[:40], tokenizer, 96, 7)
    ours = [row["input_ids"] for row in data.train]
    assert len(ours) == len(theirs) > 40 and ours == theirs
    assert all(row["labels"] == row["input_ids"] and row["position_ids"] == list(range(96)) for row in data.train)
    assert (ours[0][0] == tokenizer.bos_token_id) == add_bos_token
    assert data.stats["num_train_samples"] == 40 and data.stats["num_train_sequences"] == len(theirs)


def test_pt_documents_shorter_than_one_block_are_one_line(make_cfg, stories_tokenizer) -> None:
    cfg = make_cfg(stage="pt", dataset="c4_demo", cutoff_len=4096, max_samples=2, overwrite_cache=True)
    with pytest.raises(
        TrainingError, match=r"stage pt packs its training documents into blocks of cutoff_len=4096 tokens"
    ):
        prepare_data(cfg, stories_tokenizer)
    one_per_row = prepare_data(cfg.model_copy(update={"packing": False}), stories_tokenizer)
    assert len(one_per_row.train) == 2  # packing: false keeps ferry's document per row
