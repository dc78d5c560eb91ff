"""``neftune_noise_alpha``: NEFTune's noise on the input embeddings, in training steps only.

The reference is the paper's rule (Jain et al. 2023, arXiv:2310.05914, Algorithm 1, as transformers' Trainer and so
LLaMA-Factory and trl apply it): uniform noise in [-m, m], m = alpha / sqrt(seq_len * hidden_size), added to the
embeddings of a training forward. The test draws that noise itself with the same seed and feeds the noisy
embeddings to the model without the hook: the losses must be equal. And trl's ``SFTTrainer`` is the peer: its first
step's loss on the same batch and noise stream is ferry's.
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


def _reseed_training_forwards(embeddings: torch.nn.Module) -> None:
    """Reseed torch's generator before every training forward of ``embeddings``, so that NEFTune's draw (the forward
    hook after it) is the same in two loops whose earlier random draws differ."""

    def reseed(module: torch.nn.Module, args: tuple) -> None:
        if module.training:
            torch.manual_seed(1234)

    embeddings.register_forward_pre_hook(reseed)


def test_the_first_steps_loss_is_trls(stories_model, llamafactory_data, tmp_path, monkeypatch):
    """One step of ferry's loop and of trl's ``SFTTrainer`` (1.16, which takes NEFTune from transformers' Trainer) on
    the same one-sample batch, ``neftune_noise_alpha: 5``, the same noise stream: the first losses are equal (the
    LoRA B factors start at zero, so the step-1 loss is the base's on the noisy embeddings), and differ from the
    loss without noise."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import trainer.recipe
    from trainer.data import load_tokenizer, prepare_data

    cfg = tiny_config(
        stories_model,
        llamafactory_data,
        tmp_path,
        max_steps=1,
        max_samples=1,
        per_device_train_batch_size=1,
        neftune_noise_alpha=5,
        output_dir=str(tmp_path / "ferry"),
    )
    original = trainer.recipe.apply_neftune

    def reseeded(peft_model, alpha):
        _reseed_training_forwards(peft_model.get_input_embeddings())
        return original(peft_model, alpha)

    monkeypatch.setattr(trainer.recipe, "apply_neftune", reseeded)  # the forked worker inherits it
    run_plain_worker(write_config(tmp_path / "ferry.yaml", cfg), env=worker_env(tmp_path), cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "ferry" / "metrics.jsonl").read_text().splitlines()]
    ferry_loss = next(row["loss"] for row in rows if "loss" in row and row.get("step") == 1)

    train_cfg = TrainConfig(**{**cfg, "tokenized_path": str(tmp_path / "tok")})
    row = prepare_data(train_cfg, load_tokenizer(train_cfg)).train[0]
    model = AutoModelForCausalLM.from_pretrained(stories_model, dtype=torch.float32)
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["labels"]])).loss.item()
    _reseed_training_forwards(model.get_input_embeddings())
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=1,
        per_device_train_batch_size=1,
        neftune_noise_alpha=5,
        logging_steps=1,
        learning_rate=5e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    sft = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"input_ids": row["input_ids"], "labels": row["labels"]}]),
        processing_class=load_tokenizer(train_cfg),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"),
    )
    sft.train()
    trl_loss = next(entry["loss"] for entry in sft.state.log_history if "loss" in entry)
    assert abs(ferry_loss - trl_loss) < 1e-5, (ferry_loss, trl_loss)
    assert abs(trl_loss - plain) > 1e-4, (trl_loss, plain)  # the noise is in that loss
