"""Training stages and the datasets each can use: LLaMA-Factory's rule, read by the trainer (which refuses a
dataset before it reads a row) and by ``ferry pack`` (which refuses a bundle whose training config names data
its stage cannot use, before anything crosses the gap)."""

from __future__ import annotations

from collections.abc import Collection

#: The preference stages: ``dpo`` and ``rm`` train on ranking pairs, ``kto`` on desirable/undesirable rows.
PREFERENCE_STAGES = ("dpo", "kto", "rm")


def dataset_stage_problem(stage: str, ranking: bool, columns: Collection[str]) -> str | None:
    """Why a dataset cannot train ``stage``, in words that name the key to change, or None when it can.

    ``ranking`` is the dataset's ``dataset_info.json`` flag, ``columns`` the keys its ``columns`` object maps to
    a column (``chosen``, ``rejected``, ``kto_tag``, ...). LLaMA-Factory's rule (``data/loader.py``: "The dataset
    is not applicable in the current training stage"): ``dpo`` and ``rm`` take ranking datasets only, every other
    stage none; ``kto`` needs the ``kto_tag`` column (without it LLaMA-Factory drops every row); ``sft`` and
    ``pt`` take no preference column (a KTO dataset's undesirable replies would become targets).
    """
    if stage in ("dpo", "rm"):
        if not ranking:
            return (
                f'not a ranking dataset, so stage: {stage} cannot use it: set "ranking": true and '
                f"columns.chosen / columns.rejected in dataset_info.json, or stage: sft"
            )
        missing = [k for k in ("chosen", "rejected") if k not in columns]
        if missing:
            return f"columns.{missing[0]}: a ranking dataset must name its {missing[0]} column"
    elif ranking:
        return (
            f"key 'ranking': a ranking (chosen/rejected) dataset cannot train stage: {stage}; set stage: "
            f'dpo (or rm), or "ranking": false'
        )
    elif "chosen" in columns or "rejected" in columns:
        key = "chosen" if "chosen" in columns else "rejected"
        return f'columns.{key}: a preference column without "ranking": true; set "ranking": true'
    if stage == "kto" and "kto_tag" not in columns:
        return (
            "no columns.kto_tag, so stage: kto has no desirable/undesirable label: declare the boolean "
            "column as columns.kto_tag in dataset_info.json"
        )
    if stage in ("sft", "pt") and "kto_tag" in columns:
        return (
            f"columns.kto_tag: a KTO (desirable/undesirable) dataset cannot train stage: {stage} (its "
            f"undesirable replies would become targets); set stage: kto"
        )
    return None


__all__ = ["PREFERENCE_STAGES", "dataset_stage_problem"]
