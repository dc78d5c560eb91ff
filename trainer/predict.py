"""``do_predict`` with ``predict_with_generate``: replies generated for every row of ``eval_dataset``, scored the
way LLaMA-Factory 0.9.5 scores them, across ranks.

Each rank generates its shard of the rows (rows ``rank, rank + world, ...``; left-padded batches of
``per_device_eval_batch_size``); rank 0 gathers them back in the dataset's order and writes, into ``output_dir``:

- ``generated_predictions.jsonl``: one ``{"prompt", "predict", "label"}`` object per row (LLaMA-Factory's fields:
  the prompt decoded with its special tokens, prediction and label without them);
- ``predict_results.json``: ``predict_bleu-4``, ``predict_rouge-1``, ``predict_rouge-2``, ``predict_rouge-l``
  (percentages, the mean over rows) plus ``predict_runtime`` (s) and ``predict_samples_per_second``.

The scores use the libraries LLaMA-Factory's ``ComputeSimilarity`` uses (the ``predict`` extra): jieba word
segmentation, ``rouge_chinese.Rouge`` F-scores on the space-joined words, and nltk's ``sentence_bleu`` on
characters with ``SmoothingFunction().method3``; each row's score is rounded to 4 decimals before the mean.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ferry.errors import ConfigError, DataError
from ferry.fsutil import atomic_write_text
from trainer.config import TrainConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

logger = logging.getLogger("ferry.trainer.predict")


@dataclass
class PredictRow:
    """One row to predict: ``input_ids`` the generation prompt, ``label_ids`` the reference reply's ids."""

    index: int
    input_ids: list[int]
    label_ids: list[int]


@dataclass
class PredictReport:
    """What :func:`predict` wrote (rank 0; other ranks get the same metrics)."""

    predictions_path: str
    results_path: str
    metrics: dict[str, float]
    num_rows: int


def similarity_scores(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """LLaMA-Factory's BLEU-4 / ROUGE-1/2/L over ``(label, predict)`` text pairs, in percent, averaged over rows.

    Per row: ROUGE F-scores of ``rouge_chinese.Rouge().get_scores`` on the jieba words joined by spaces (0 when
    either side has no word), BLEU-4 of ``nltk.translate.bleu_score.sentence_bleu`` on the characters with
    ``SmoothingFunction().method3``; each rounded to 4 decimals after * 100, then the mean (numpy).
    Source of the formula: LLaMA-Factory 0.9.5 ``train/sft/metric.py`` (``ComputeSimilarity``).

    Returns:
        ``{"bleu-4", "rouge-1", "rouge-2", "rouge-l"}`` -> float; an empty ``pairs`` gives NaN-free zeros.

    Raises:
        ConfigError: the ``predict`` extra (jieba, nltk, rouge-chinese) is not installed.
    """
    try:
        import jieba
        import numpy as np
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
        from rouge_chinese import Rouge
    except ImportError as exc:
        raise ConfigError(f"do_predict scores need the predict extra (pip install 'ferry[predict]'): {exc}") from None
    jieba.setLogLevel(logging.WARNING)
    scores: dict[str, list[float]] = {"rouge-1": [], "rouge-2": [], "rouge-l": [], "bleu-4": []}
    for label, pred in pairs:
        hypothesis, reference = " ".join(jieba.cut(pred)), " ".join(jieba.cut(label))
        if not hypothesis.split() or not reference.split():
            rouge = {"rouge-1": {"f": 0.0}, "rouge-2": {"f": 0.0}, "rouge-l": {"f": 0.0}}
        else:
            rouge = Rouge().get_scores(hypothesis, reference)[0]
        for key, value in rouge.items():
            scores[key].append(round(value["f"] * 100, 4))
        bleu = sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3)
        scores["bleu-4"].append(round(bleu * 100, 4))
    return {key: float(np.mean(values)) if values else 0.0 for key, values in scores.items()}


def build_rows(cfg: TrainConfig, tokenizer: Any) -> list[PredictRow]:
    """The rows of ``cfg.eval_dataset`` (``max_samples`` applies) as generation prompts and reference ids,
    as LLaMA-Factory's unsupervised processor builds them: a built-in template's ``encode_oneturn`` (the prompt
    is exactly what training renders before the reply; ``efficient_eos`` templates add EOS to the label), or the
    tokenizer's chat template with ``add_generation_prompt``; both cut to ``cutoff_len`` by ``infer_seqlen``.

    Raises:
        DataError: a row is plain text (``pt``) or its template cannot render it.
    """
    from trainer.data import _encode, infer_seqlen, resolve_template, sample_messages
    from trainer.formats import load_samples, resolve_datasets, sampling_rng

    renderer = resolve_template(cfg, tokenizer)
    rows: list[PredictRow] = []
    rng = sampling_rng(cfg.seed)
    for spec in resolve_datasets(cfg.eval_dataset or [], cfg.dataset_dir):
        for sample in load_samples(spec, stage="sft", max_samples=cfg.max_samples, rng=rng):
            if sample.text is not None:
                raise DataError(f"{sample.origin}: do_predict needs conversations, not plain text")
            messages = sample_messages(sample)
            try:
                if renderer.template is not None:
                    prompt, label = renderer.template.encode_oneturn(
                        tokenizer, messages, sample.system, sample.tools or None
                    )
                    if renderer.template.efficient_eos:
                        label = [*label, tokenizer.eos_token_id]
                else:
                    chat = [
                        {"role": "tool" if m["role"] == "observation" else m["role"], "content": m["content"]}
                        for m in messages[:-1]
                    ]
                    if sample.system:
                        chat.insert(0, {"role": "system", "content": sample.system})
                    prompt = tokenizer.apply_chat_template(
                        chat, add_generation_prompt=True, tokenize=True, return_dict=False
                    )
                    label = _encode(tokenizer, messages[-1]["content"])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise DataError(f"{sample.origin}: template {renderer.name!r} cannot render this row: {exc}") from None
            source_len, target_len = infer_seqlen(len(prompt), len(label), cfg.cutoff_len)
            rows.append(PredictRow(len(rows), list(prompt)[:source_len], list(label)[:target_len]))
    if not rows:
        raise DataError(f"eval_dataset {','.join(cfg.eval_dataset or [])}: no rows to predict")
    return rows


def stop_token_ids(cfg: TrainConfig, tokenizer: Any) -> list[int]:
    """EOS plus the built-in template's stop words that are single tokens (LLaMA-Factory's
    ``get_stop_token_ids``)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if cfg.template is not None:
        from trainer.data import template_for

        for word in template_for(cfg).stop_words:
            token = tokenizer.convert_tokens_to_ids(word)
            if isinstance(token, int) and token != tokenizer.unk_token_id and token not in ids:
                ids.append(token)
    return ids


@torch.no_grad()
def generate_rows(
    model: Any, tokenizer: Any, rows: list[PredictRow], cfg: TrainConfig, device: torch.device
) -> dict[int, list[int]]:
    """Generate for ``rows`` in left-padded batches of ``per_device_eval_batch_size``; returns row index -> the
    generated ids up to (not including) the first stop token."""
    stops = stop_token_ids(cfg, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    options: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "do_sample": cfg.do_sample,
        "repetition_penalty": cfg.repetition_penalty,
        "eos_token_id": stops,
        "pad_token_id": pad,
    }
    if cfg.do_sample:
        options.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    else:  # greedy: no sampling knobs (transformers warns when they are set without do_sample)
        options.update(temperature=None, top_p=None, top_k=None)
    out: dict[int, list[int]] = {}
    size = cfg.per_device_eval_batch_size
    for start in range(0, len(rows), size):
        batch = rows[start : start + size]
        width = max(len(r.input_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.input_ids)) + r.input_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in batch], device=device)
        generated = model.generate(input_ids=ids, attention_mask=mask, **options)[:, width:].tolist()
        for row, tokens in zip(batch, generated):
            cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
            out[row.index] = tokens[:cut]
    return out


def load_predict_model(cfg: TrainConfig, adapters: list[str], device: torch.device) -> Any:
    """The base (or exported) model of ``cfg`` in eval mode on ``device`` with ``adapters`` applied in order as
    LLaMA-Factory applies ``adapter_name_or_path`` for inference: all but the last merged into the weights, the last
    loaded by peft (each a LLaMA-Factory or ferry output_dir, or an adapter folder); the base's RoPE stretched as
    the last adapter records (``ferry_rope.json``). bf16 / fp16 weights as the config says on CUDA; fp32 on CPU.

    Raises:
        ConfigError: a path holds no adapter_config.json, or the adapter grew the vocabulary (ferry_vocab.json).
    """
    from transformers import AutoConfig

    from ferry.adapter_folder import VOCAB_RECORD, adapter_folder, read_rope_record
    from ferry.architecture import auto_model_class
    from ferry.hub import resolve_model
    from trainer.peft_build import load_peft_adapter

    folders = [adapter_folder(path) for path in adapters]
    for folder in folders:
        if (folder / VOCAB_RECORD).is_file():
            raise ConfigError(
                f"adapter {folder} grew the vocabulary ({VOCAB_RECORD}); do_predict does not rebuild "
                f"grown embeddings yet: 'ferry export' it and predict on the merged model"
            )
    dtype = torch.float32
    if device.type == "cuda":
        dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    base_dir = resolve_model(cfg.model_name_or_path, cfg.model_revision)
    kwargs: dict[str, Any] = {}
    rope = read_rope_record(folders[-1]) if folders else None
    if rope is not None:  # the base as the adapter was trained over it: its RoPE stretched (rope_scaling)
        from ferry.rope import scaled_config

        kwargs["config"] = scaled_config(base_dir, rope, trust_remote_code=cfg.trust_remote_code)
    config = kwargs.get("config") or AutoConfig.from_pretrained(base_dir, trust_remote_code=cfg.trust_remote_code)
    model: PreTrainedModel | PeftModel = auto_model_class(config).from_pretrained(
        base_dir, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **kwargs
    )
    for i, folder in enumerate(folders):
        model = load_peft_adapter(model, str(folder))
        if i < len(folders) - 1:
            model = model.merge_and_unload()
    model.config.use_cache = True
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) reads as unbound


_groups_joined = 0


def _join(env: Any, timeout_s: int) -> None:
    """Join the job's process group for prediction. After training destroyed its group in this process, a new
    default group would reuse the old one's keys in torchrun's agent store (its name restarts at "0") and a rank
    could read a peer's stale address; so under the agent store each group gets its own key prefix."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    global _groups_joined
    _groups_joined += 1
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        env.init_process_group(timeout_s)
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    prefix = f"ferry/predict-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{_groups_joined}"
    kwargs: dict[str, Any] = {
        "backend": env.backend,
        "timeout": timedelta(seconds=timeout_s),
        "store": dist.PrefixStore(prefix, store),
        "rank": env.rank,
        "world_size": env.world_size,
    }
    if env.device.type == "cuda" and env.backend == "nccl":
        kwargs["device_id"] = env.device
    dist.init_process_group(**kwargs)


def predict(cfg: TrainConfig, *, adapters: list[str] | None = None, output_dir: str | None = None) -> PredictReport:
    """Generate and score ``cfg.eval_dataset`` on the model (plus ``adapters``, default
    ``cfg.adapter_name_or_path``, see :func:`load_predict_model`) on every rank of the job (torchrun's environment; a
    plain process is rank 0 of 1), then write the two files into ``output_dir`` (default ``cfg.output_dir``) on
    rank 0, atomically.

    Greedy decoding (``do_sample: false``) gives the same predictions whatever the number of ranks.

    Raises:
        ConfigError / DataError: see :func:`load_predict_model`, :func:`build_rows`, :func:`similarity_scores`.
    """
    import torch.distributed as dist

    from trainer.data import load_tokenizer
    from trainer.distributed import DistEnv

    env = DistEnv.from_environ(cfg.ddp_backend)
    if env.backend is not None and not env.initialized:
        _join(env, cfg.ddp_timeout)
    started = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    if cfg.template is not None:
        from trainer.data import fix_special_tokens, template_for

        fix_special_tokens(tokenizer, template_for(cfg), cfg.model_name_or_path)
    rows = build_rows(cfg, tokenizer)
    if cfg.do_sample:
        torch.manual_seed(cfg.seed + env.rank)
    model = load_predict_model(cfg, list(cfg.adapter_name_or_path or []) if adapters is None else adapters, env.device)
    mine = generate_rows(model, tokenizer, rows[env.rank :: env.world_size], cfg, env.device)
    if env.initialized:
        parts: list[Any] = [None] * env.world_size
        dist.all_gather_object(parts, mine)
        merged = {k: v for part in parts for k, v in part.items()}
    else:
        merged = mine
    seconds = time.perf_counter() - started
    lines, pairs = [], []
    for row in rows:
        prompt = tokenizer.decode(row.input_ids, skip_special_tokens=False)
        # decode gives one str for one sequence of ids (transformers types it str | list[str], for batches too)
        label = cast(str, tokenizer.decode(row.label_ids, skip_special_tokens=True))
        pred = cast(str, tokenizer.decode(merged[row.index], skip_special_tokens=True))
        lines.append(json.dumps({"prompt": prompt, "predict": pred, "label": label}, ensure_ascii=False) + "\n")
        pairs.append((label, pred))
    metrics = {f"predict_{k}": v for k, v in similarity_scores(pairs).items()}
    metrics.update(predict_runtime=round(seconds, 4), predict_samples_per_second=round(len(rows) / seconds, 3))
    out = Path(output_dir or cfg.output_dir)
    predictions, results = out / "generated_predictions.jsonl", out / "predict_results.json"
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(predictions, "".join(lines))
        atomic_write_text(results, json.dumps(metrics, indent=4, sort_keys=True) + "\n")
        logger.info("predictions of %d rows in %s: %s", len(rows), predictions, metrics)
    if env.initialized:
        dist.barrier()
    return PredictReport(str(predictions), str(results), metrics, len(rows))
