"""Tiny random vision-language models of the Qwen-VL families, built from transformers' config classes, and their
processor files (the stories260K tokenizer with the Qwen chat and vision tokens added, a Qwen2-VL image processor).

:func:`write_processor_files` runs under LLaMA-Factory's transformers as well (tests/golden/make_vlm_goldens.py
writes the goldens from the same files); :func:`build` adds the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: Tokens the Qwen-VL templates and image slots need, added to the 512-token stories260K vocabulary in this order
#: (ids 512..517).
ADDED_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = 520
#: family -> image processor patch size (Qwen2-VL and Qwen2.5-VL 14, Qwen3-VL 16), as the hub's processors.
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}


def write_processor_files(folder: Path, family: str, tokenizer_dir: Path, video: bool = False) -> Path:
    """``folder``'s tokenizer (``tokenizer_dir``'s, stories260K's by default, with :data:`ADDED_TOKENS` as special
    tokens) and ``preprocessor_config.json`` (a Qwen2-VL image processor: ``PATCH[family]``, merge 2, temporal patch
    2, 4,096 to 1,048,576 pixels). ``video``: the family's whole processor instead (:func:`write_video_processor`;
    needs torchvision)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copyfile(file, folder / file.name)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tokenizer.save_pretrained(str(folder))
    if video:
        return write_video_processor(folder, family, tokenizer)
    Qwen2VLImageProcessorPil(
        patch_size=PATCH[family], temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=1024 * 1024
    ).save_pretrained(str(folder))
    return folder


#: family -> (processor class, video processor class) of transformers, by name.
VIDEO_CLASSES = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
}


def write_video_processor(folder: Path, family: str, tokenizer) -> Path:
    """``folder``'s whole ``family`` processor as ``save_pretrained`` writes it (``processor_config.json``, the image
    processor of :func:`write_processor_files`, a video processor with the same patch, merge 2, temporal patch 2,
    4,096 to 16,777,216 pixels): what ``AutoProcessor`` loads where torchvision is installed (the video processors
    need it)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    processor_cls, video_cls = (getattr(transformers, name) for name in VIDEO_CLASSES[family])
    image = Qwen2VLImageProcessor(
        patch_size=PATCH[family], temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=1024 * 1024
    )
    video = video_cls(
        patch_size=PATCH[family],
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 64 * 64, "longest_edge": 4096 * 4096},
    )
    processor_cls(image_processor=image, tokenizer=tokenizer, video_processor=video).save_pretrained(str(folder))
    return folder


def _config(family: str, base_vocab: int = 512):
    """``family``'s tiny config over a tokenizer of ``base_vocab`` tokens plus :data:`ADDED_TOKENS` after them."""
    ids = {tok: base_vocab + i for i, tok in enumerate(ADDED_TOKENS)}
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text = dict(
        vocab_size=VOCAB if base_vocab == 512 else base_vocab + len(ADDED_TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=PATCH[family],
            num_position_embeddings=64,
            deepstack_visual_indexes=[1],
        )
        return Qwen3VLConfig(text_config={**text, "head_dim": 16}, vision_config=vision, **special)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=PATCH[family],
            window_size=56,
            fullatt_block_indexes=[1],
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    from transformers import Qwen2VLConfig

    # depth 3: llama.cpp's converter maps the merger's mlp.2 through its table of per-block names, which holds only
    # as many indexes as the tower has blocks (real Qwen2-VL towers have 32)
    vision = dict(depth=3, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH[family])
    return Qwen2VLConfig(text_config=text, vision_config=vision, **special)


def build(
    root: Path, family: str, tokenizer_dir: Path, seed: int = 0, base_vocab: int = 512, video: bool = False
) -> Path:
    """A tiny random ``family`` model (qwen2_vl, qwen2_5_vl or qwen3_vl) in ``root/family``: float32 safetensors as
    ``save_pretrained`` writes them, its processor files (``tokenizer_dir``'s tokenizer of ``base_vocab`` tokens;
    ``video``: the whole processor, see :func:`write_processor_files`), a generation config with the tokenizer's
    BOS and EOS (stories260K's: 1 and 2)."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(_config(family, base_vocab), dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their init, so that a wrong mapping shows in the logits
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    out = root / family
    model.save_pretrained(out)
    write_processor_files(out, family, tokenizer_dir, video=video)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ends = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(ends))
    return out


#: Preference rows made from LLaMA-Factory's mllm_demo rows (its sdist's data/mllm_demo.json, read at test time):
#: dataset_info.json entries in its sharegpt ranking layout (its rlhf_v entry's columns) and feedback layout.
DPO_INFO = {
    "mllm_dpo": {
        "file_name": "mllm_dpo.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"},
    }
}
KTO_INFO = {
    "mllm_kto": {
        "file_name": "mllm_kto.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    }
}


def dpo_rows(mllm_demo: list[dict]) -> list[dict]:
    """Ranking rows of :data:`DPO_INFO`: each mllm_demo row's first exchange, the prompt with its images, its reply
    chosen and the next row's first reply rejected."""
    rows = []
    for k, row in enumerate(mllm_demo):
        prompt = row["messages"][0]["content"]
        other = mllm_demo[(k + 1) % len(mllm_demo)]["messages"][1]["content"]
        rows.append(
            {
                "conversations": [{"from": "human", "value": prompt}],
                "chosen": {"from": "gpt", "value": row["messages"][1]["content"]},
                "rejected": {"from": "gpt", "value": other},
                "images": row["images"][: prompt.count("<image>")],
            }
        )
    return rows


def kto_rows(mllm_demo: list[dict]) -> list[dict]:
    """Feedback rows of :data:`KTO_INFO`: each mllm_demo row's first exchange with its images, judged desirable on
    even rows."""
    rows = []
    for k, row in enumerate(mllm_demo):
        prompt = row["messages"][0]["content"]
        rows.append(
            {"messages": row["messages"][:2], "label": k % 2 == 0, "images": row["images"][: prompt.count("<image>")]}
        )
    return rows


def preference_folder(folder: Path, sdist_data: Path) -> Path:
    """``folder`` holding :func:`dpo_rows` and :func:`kto_rows` of the sdist's mllm_demo rows, their dataset_info.json
    entries and the sdist's JPEGs."""
    shutil.copytree(sdist_data / "mllm_demo_data", folder / "mllm_demo_data")
    demo = json.loads((sdist_data / "mllm_demo.json").read_text(encoding="utf-8"))
    (folder / "mllm_dpo.json").write_text(json.dumps(dpo_rows(demo)))
    (folder / "mllm_kto.json").write_text(json.dumps(kto_rows(demo)))
    (folder / "dataset_info.json").write_text(json.dumps({**DPO_INFO, **KTO_INFO}))
    return folder
