"""LLaMA-Factory's own packed rows and ``num_samples`` picks on real data: tests/golden/data.json.

Run in the LLaMA-Factory 0.9.5 venv described in make_template_goldens.py::

    /tmp/lf-venv/bin/python tests/golden/make_data_goldens.py [SHARED_ASSETS]

SHARED_ASSETS defaults to ../shared/assets beside the project (the stories260K model and LLaMA-Factory's demo
data). Each case goes through LLaMA-Factory's real entry path for ``stage: sft`` (``run_sft``'s order):
``get_train_args`` (parses the keys, applies ``packing``'s ``cutoff_len -= 1``, calls ``transformers.set_seed``),
``load_tokenizer``, ``get_template_and_fix_tokenizer``, ``get_dataset``.

- ``packing``: the packed rows (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, padding included)
  for ``packing: true`` and for ``neat_packing: true`` (and with ``train_on_prompt``); with ``val_size`` also the
  packed eval rows and the sample indices ``train_test_split`` puts in train and in eval.
- ``num_samples``: the row indices ``_load_single_dataset`` selects (recorded from its ``Dataset.select`` call)
  for a list of two datasets that both set ``num_samples`` (one asks for more rows than it holds), per seed.
Paths are stored relative to the assets folder; ferry's tests run the same keys on the same files.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_STUB = Path(tempfile.mkdtemp(prefix="lf-stub-"))
(_STUB / "torchaudio.py").write_text("")
sys.path.insert(0, str(_STUB))
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lf-datasets-"))

MODEL = "models/stories260K"
DATA = "datasets/llamafactory"

PACKING_KEYS = {
    "dataset": "alpaca_en_demo,identity",
    "template": "default",
    "cutoff_len": 384,
    "max_samples": 20,
    "seed": 42,
}
PACKING_MODES = {
    "packing": {"packing": True},
    "neat_packing": {"neat_packing": True},
    "packing+train_on_prompt": {"packing": True, "train_on_prompt": True},
    "neat_packing+val_size": {"neat_packing": True, "val_size": 0.25},
}
#: dataset_info.json entries (file_name relative to the data folder) and the seeds to run them with
NUM_SAMPLES_INFO = {
    "alpaca_sampled": {"file_name": "alpaca_en_demo.json", "num_samples": 9},
    "identity_sampled": {"file_name": "identity.json", "num_samples": 100},
}
NUM_SAMPLES_SEEDS = [42, 7]


def _run(
    assets: Path,
    keys: dict,
    dataset_dir: Path,
    work: Path,
) -> tuple[dict, list[list[int]], dict | None, list[list[int]]]:
    """LLaMA-Factory's sft data path for ``keys``: (the train dataset's columns, the index lists of
    ``_load_single_dataset``'s select() calls, the eval dataset's columns or None, the index lists of
    ``train_test_split``'s select() calls: train, then test)."""
    import datasets
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    picks: list[list[int]] = []
    splits: list[list[int]] = []
    original_select = datasets.Dataset.select

    def select(self, indices, *args, **kwargs):
        indices = [int(i) for i in indices]
        caller = sys._getframe(1).f_code.co_name
        if caller == "_load_single_dataset" and indices != list(range(len(indices))):
            picks.append(indices)
        elif caller == "train_test_split":
            splits.append(indices)
        return original_select(self, indices, *args, **kwargs)

    datasets.Dataset.select = select
    try:
        args = {
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "lora",
            "model_name_or_path": str(assets / MODEL),
            "dataset_dir": str(dataset_dir),
            "output_dir": str(work / "out"),
            "overwrite_cache": True,
            "report_to": "none",
            **keys,
        }
        model_args, data_args, training_args, _ft, _gen = get_train_args(args)
        tokenizer_module = load_tokenizer(model_args)
        template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
        module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    finally:
        datasets.Dataset.select = original_select

    def columns(ds):
        return {
            k: [list(map(int, r)) for r in ds[k]]
            for k in ("input_ids", "labels", "attention_mask", "position_ids")
            if k in ds.column_names
        }

    evals = module.get("eval_dataset")
    return columns(module["train_dataset"]), picks, (columns(evals) if evals is not None else None), splits


def _rows(columns: dict) -> list[dict]:
    return [dict(zip(columns, vals)) for vals in zip(*columns.values())]


def main(assets: Path, out: Path = HERE / "data.json") -> None:
    from importlib.metadata import version

    work = Path(tempfile.mkdtemp(prefix="lf-data-goldens-"))
    packing = {}
    for mode, extra in PACKING_MODES.items():
        columns, _, evals, splits = _run(assets, {**PACKING_KEYS, **extra}, assets / DATA, work / mode)
        packing[mode] = {"keys": extra, "rows": _rows(columns)}
        if evals is not None:
            packing[mode].update(eval_rows=_rows(evals), split_train=splits[0], split_eval=splits[1])
    info_dir = work / "info"
    info_dir.mkdir()
    info = {
        name: {**entry, "file_name": str(assets / DATA / entry["file_name"])}
        for name, entry in NUM_SAMPLES_INFO.items()
    }
    (info_dir / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    num_samples = {}
    for seed in NUM_SAMPLES_SEEDS:
        keys = {"dataset": ",".join(NUM_SAMPLES_INFO), "template": "default", "cutoff_len": 64, "seed": seed}
        _, picks, _, _ = _run(assets, keys, info_dir, work / f"seed{seed}")
        assert len(picks) == len(NUM_SAMPLES_INFO), picks
        num_samples[str(seed)] = dict(zip(NUM_SAMPLES_INFO, picks))
    golden = {
        "generator": "tests/golden/make_data_goldens.py",
        "llamafactory": version("llamafactory"),
        "transformers": version("transformers"),
        "datasets": version("datasets"),
        "numpy": version("numpy"),
        "model": MODEL,
        "data": DATA,
        "packing_keys": PACKING_KEYS,
        "packing": packing,
        "num_samples_info": NUM_SAMPLES_INFO,
        "num_samples": num_samples,
    }
    out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(
        f"wrote {out}: {sum(len(p['rows']) for p in packing.values())} packed rows, "
        f"{len(num_samples)} num_samples cases"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[2] / "shared" / "assets")
