"""Which recipe trains which ``stage``: :func:`train`, what every worker runs (``python -m trainer``).

sft, pt   trainer.recipe.FinetuneRecipe
dpo       trainer.preference_recipe.PreferenceRecipe (the same run, on ranking pairs)
rm        trainer.reward_recipe.RewardRecipe (ranking pairs, a value head)
kto       trainer.kto_recipe.KTORecipe (feedback rows and their KL rows)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.recipe import TrainReport


def train(cfg: TrainConfig) -> TrainReport:
    """Run one fine-tuning job of ``cfg.stage`` in this process (a torchrun worker, or one plain process) and
    return its report (the same on every rank). Raises what the stage's recipe raises
    (:class:`trainer.recipe.FinetuneRecipe` lists it)."""
    from trainer.recipe import FinetuneRecipe, run

    if cfg.stage == "dpo":
        from trainer.preference_recipe import PreferenceRecipe

        return run(PreferenceRecipe(cfg))
    if cfg.stage == "kto":
        from trainer.kto_recipe import KTORecipe

        return run(KTORecipe(cfg))
    if cfg.stage == "rm":
        from trainer.reward_recipe import RewardRecipe

        return run(RewardRecipe(cfg))
    return run(FinetuneRecipe(cfg))


__all__ = ["train"]
