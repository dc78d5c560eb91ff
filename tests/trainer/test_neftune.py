"""``neftune_noise_alpha``: NEFTune's noise on the input embeddings, in training steps only.

The reference is the paper's rule (Jain et al. 2023, arXiv:2310.05914, Algorithm 1, as transformers' Trainer and so
LLaMA-Factory and trl apply it): uniform noise in [-m, m], m = alpha / sqrt(seq_len * hidden_size), added to the
embeddings of a training forward. The test draws that noise itself with the same seed and feeds the noisy
embeddings to the model without the hook: the losses must be equal.
"""

from __future__ import annotations

import json
import math

import torch

from tests.support.helpers import run_plain_worker, tiny_config, worker_env, write_config
from trainer.config import TrainConfig
from trainer.modeling import apply_neftune, build_lora_model


def test_the_noise_is_the_papers_in_training_and_none_in_evaluation(stories_model, llamafactory_data):
    cfg = TrainConfig(
        model_name_or_path=str(stories_model),
        dataset="alpaca_en_demo",
        dataset_dir=str(llamafactory_data),
        output_dir="unused",
        lora_rank=4,
        neftune_noise_alpha=5,
    )
    torch.manual_seed(0)
    model = build_lora_model(cfg, stories_model, device=torch.device("cpu"), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 24))
    embeddings = model.get_base_model().get_input_embeddings()
    with torch.no_grad():
        plain = embeddings(ids)  # [2, 24, hidden]
        model.train()
        no_hook = model(input_ids=ids, labels=ids).loss
        handle = apply_neftune(model, cfg.neftune_noise_alpha)
        torch.manual_seed(3)
        noisy = model(input_ids=ids, labels=ids).loss
        model.eval()
        evaluated = model(input_ids=ids, labels=ids).loss
        handle.remove()
        bound = 5 / math.sqrt(24 * plain.shape[-1])  # alpha / sqrt(seq_len * hidden_size)
        torch.manual_seed(3)
        noise = torch.zeros_like(plain).uniform_(-bound, bound)
        model.train()
        expected = model(inputs_embeds=plain + noise, labels=ids).loss
        model.eval()
        reference_eval = model(input_ids=ids, labels=ids).loss
    assert noisy.item() == expected.item() and noisy.item() != no_hook.item()
    assert evaluated.item() == reference_eval.item()  # evaluation sees the embeddings as they are


def test_a_run_with_neftune_trains_on_noisy_embeddings(stories_model, llamafactory_data, tmp_path):
    """Two 3-step one-process runs from the same seed, one with ``neftune_noise_alpha: 5``: the first step's loss
    differs (the noise is in the forward) and both train."""
    losses = {}
    for name, extra in (("plain", {}), ("neftune", {"neftune_noise_alpha": 5})):
        cfg = tiny_config(stories_model, llamafactory_data, tmp_path, max_steps=3, output_dir=str(tmp_path / name))
        run_plain_worker(
            write_config(tmp_path / f"{name}.yaml", {**cfg, **extra}), env=worker_env(tmp_path), cwd=tmp_path
        )
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [row["loss"] for row in rows if "loss" in row and "step" in row]
    assert len(losses["plain"]) == len(losses["neftune"]) == 3, losses
    assert losses["neftune"][0] != losses["plain"][0], losses
    config = json.loads((tmp_path / "neftune" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8
