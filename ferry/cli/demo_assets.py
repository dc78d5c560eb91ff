"""The embedded default: a small Llama-architecture model built from a fixed seed, and a small instruction
dataset written for the project (``ferry/cli/demo_data/ferry_demo.json``, alpaca format, 48 rows).

Both are built locally with no network, byte-for-byte the same on every run (same seed, same tokenizer
training input), so ``ferry demo`` and the tests can pack, train and export a real model anywhere.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

DEMO_REPO_ID = "ferry-demo/tiny-llama"
DEMO_DATASET_NAME = "ferry_demo"
DEMO_SEED = 0

#: Shape of the demo model: 4 layers, hidden 128, 4 heads / 2 KV heads, vocabulary 768 (byte-level BPE
#: trained on the demo dataset): 836,736 parameters, 3.3 MB in float32.
DEMO_MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
DEMO_VOCAB_SIZE = 768
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def demo_dataset_path() -> Path:
    """Path of the packaged demo dataset (``ferry_demo.json``: a JSON list of alpaca rows)."""
    return Path(str(resources.files("ferry.cli") / "demo_data" / "ferry_demo.json"))


def write_demo_dataset(dest_dir: Path) -> Path:
    """Copy the demo dataset into ``dest_dir`` (created) and return the file's path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / f"{DEMO_DATASET_NAME}.json"
    shutil.copyfile(demo_dataset_path(), target)
    return target


def build_demo_model(dest: Path, seed: int = DEMO_SEED) -> Path:
    """Build the demo model into ``dest`` (created; must be empty or absent) and return it.

    The tokenizer is a byte-level BPE (vocabulary :data:`DEMO_VOCAB_SIZE`, specials ``<unk> <s> </s> <pad>``
    with ids 0-3) trained on the demo dataset, so every text encodes; the model is ``LlamaForCausalLM`` with
    :data:`DEMO_MODEL_SHAPE`, tied embeddings, weights drawn from ``torch.manual_seed(seed)``, saved as one
    float32 ``model.safetensors``. Deterministic: the same seed gives the same bytes.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = json.loads(demo_dataset_path().read_text(encoding="utf-8"))
    corpus: list[str] = []
    for row in rows:
        corpus += [row["instruction"], row.get("input", ""), row["output"]]
    # The prompt scaffolding of the built-in templates, so it tokenises compactly too.
    corpus += ["Human: ", "\nAssistant:", "### Instruction:\n", "### Input:\n", "### Response:\n"]

    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainer=trainers.BpeTrainer(
            vocab_size=DEMO_VOCAB_SIZE,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(dest)

    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
        **DEMO_MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(dest)
    (dest / "README.md").write_text(
        "---\nlicense: apache-2.0\n---\n# ferry demo tiny-llama\n\n"
        f"Random-init Llama ({sum(p.numel() for p in model.parameters()):,} parameters) built by ferry from seed "
        f"{seed}, with a byte-level BPE tokenizer trained on ferry's demo dataset. For demos and tests only.\n",
        encoding="utf-8",
    )
    return dest
