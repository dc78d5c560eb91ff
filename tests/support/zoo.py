"""A zoo of random-init tiny models, one per current family, built from transformers' own config classes and saved
in the hub's on-disk layout (hidden 64, 2 layers, the stories260K tokenizer's 512-token vocabulary).

transformers 5 ``save_pretrained`` already writes most families in the hub's layout (it reverses its load-time
conversions: fused experts are saved per expert, Gemma-3's language model under ``language_model.model``). Where
the hub stores names that ``save_pretrained`` does not reproduce, the fixture rewrites the safetensors itself:

* ``gpt2-hub``: GPT-2 checkpoints on the hub store ``h.0.attn.c_attn.weight`` (no ``transformer.`` prefix; the
  ``PreTrainedModel`` base-model prefix rule adds it on load).
* ``gemma3_vlm``: the hub's Gemma-3 vision+text checkpoints store the vision tower as
  ``vision_tower.vision_model.*`` (SigLIP's own layout), which ``save_pretrained`` writes without the
  ``vision_model`` level; transformers loads both.
* ``llama_remote_code``: a trust_remote_code model (config.json ``auto_map`` naming its own configuration and
  modeling code, Llama underneath).
* ``qwen3_moe_fused``, ``mixtral_fused``: the experts stored fused, one 3-D tensor per layer and projection
  (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``), as newer hub checkpoints store them and as
  transformers 5 writes them with ``save_pretrained(save_original_format=False)``; transformers loads them as they
  are (its per-expert converters do not match).
* ``qwen3_5_vl``: Qwen3.5 as the hub ships it, the vision-language class ``Qwen3_5ForConditionalGeneration``
  (``model.language_model.*``, ``model.visual.*`` incl. the merger/projector, ``lm_head``, and tensors of the
  multi-token-prediction head ``mtp.*``, which transformers does not load; its image processor).
  transformers' ``AutoModelForCausalLM`` builds ``Qwen3_5ForCausalLM`` from it (the language model; the vision
  tower is not loaded), which is what ferry trains.
* ``qwen3_5``: the hub's Qwen3.5 checkpoints store the text model under ``model.language_model.`` (transformers'
  ``qwen3_5_text`` mapping removes that prefix on load); the names are derived with transformers' own reverse
  conversion (:func:`transformers.core_model_loading.revert_weight_conversion` of that mapping).

Each entry: ``(name, builder, LLaMA-Factory's usual explicit lora_target)``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

H = 64  # hidden size
COMMON = dict(vocab_size=512, num_hidden_layers=2)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **COMMON)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **COMMON)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        **COMMON,
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        **COMMON,
    )


def _qwen3_moe_fused():
    # experts [E, 2I, H] = [4, 96, 64]: not square, so peft's orientation shows in the LoRA factors' shapes
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        **COMMON,
    )


def _qwen3_5():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        **COMMON,
    )


def _qwen3_5_vl():
    from transformers import Qwen3_5Config, Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=H,
        patch_size=8,
        num_position_embeddings=16,
    )
    return Qwen3_5Config(
        text_config=_qwen3_5().to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=508,
        video_token_id=507,
        vision_start_token_id=505,
        vision_end_token_id=506,
    )


def _qwen3_vl():
    """Qwen3-VL as the hub ships it (``Qwen3VLForConditionalGeneration``: LLaMA-Factory's merge_lora/qwen3vl)."""
    from transformers import Qwen3VLConfig, Qwen3VLTextConfig, Qwen3VLVisionConfig

    text = Qwen3VLTextConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3]},
        **COMMON,
    )
    vision = Qwen3VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=H,
        patch_size=8,
        num_position_embeddings=16,
        deepstack_visual_indexes=[1],
    )
    return Qwen3VLConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=508,
        video_token_id=507,
        vision_start_token_id=505,
        vision_end_token_id=506,
    )


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=H,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **COMMON,
    )


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **COMMON)


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON
    )


def _gemma3_text():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON
    )


def _gemma3_vlm():
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=511,
        boi_token_index=509,
        eoi_token_index=510,
    )


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(
        hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **COMMON
    )


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(n_embd=H, n_layer=2, n_head=4, n_positions=128, vocab_size=512, bos_token_id=1, eos_token_id=2)


def _gpt_neox():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, **COMMON)


def _falcon():
    from transformers import FalconConfig

    return FalconConfig(hidden_size=H, num_attention_heads=4, new_decoder_architecture=False, **COMMON)


def _opt():
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=H, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=H, max_position_embeddings=128, **COMMON
    )


def _starcoder2():
    from transformers import Starcoder2Config

    return Starcoder2Config(
        hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **COMMON
    )


def _glm4():
    from transformers import Glm4Config

    return Glm4Config(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        **COMMON,
    )


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        **COMMON,
    )


LLAMA_LIKE = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
#: name -> (config builder, LLaMA-Factory's usual explicit lora_target for the family)
FAMILIES: dict[str, tuple[Callable, str]] = {
    "llama": (_llama, LLAMA_LIKE),
    "qwen2": (_qwen2, LLAMA_LIKE),
    "qwen3": (_qwen3, LLAMA_LIKE),
    "qwen3_moe": (_qwen3_moe, LLAMA_LIKE),
    "qwen3_moe_fused": (_qwen3_moe_fused, LLAMA_LIKE),
    "qwen3_5": (_qwen3_5, "in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,q_proj,k_proj,v_proj,o_proj"),
    "qwen3_5_vl": (_qwen3_5_vl, "in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,q_proj,k_proj,v_proj,o_proj"),
    "mixtral": (_mixtral, "q_proj,k_proj,v_proj,o_proj,w1,w2,w3"),
    "mixtral_fused": (_mixtral, "q_proj,k_proj,v_proj,o_proj,w1,w2,w3"),
    "mistral": (_mistral, LLAMA_LIKE),
    "gemma2": (_gemma2, LLAMA_LIKE),
    "gemma3_text": (_gemma3_text, LLAMA_LIKE),
    "gemma3_vlm": (_gemma3_vlm, LLAMA_LIKE),
    "phi3": (_phi3, "qkv_proj,o_proj,gate_up_proj,down_proj"),
    "gpt2": (_gpt2, "c_attn,c_proj,c_fc"),
    "gpt2_hub": (_gpt2, "c_attn,c_proj,c_fc"),
    "gpt_neox": (_gpt_neox, "query_key_value,dense,dense_h_to_4h,dense_4h_to_h"),
    "falcon": (_falcon, "query_key_value,dense,dense_h_to_4h,dense_4h_to_h"),
    "opt": (_opt, "q_proj,k_proj,v_proj,out_proj,fc1,fc2"),
    "starcoder2": (_starcoder2, "q_proj,k_proj,v_proj,o_proj,c_fc,c_proj"),
    "glm4": (_glm4, "q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj"),
    "deepseek_v3": (_deepseek_v3, "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj"),
    "llama_remote_code": (_llama, LLAMA_LIKE),
}

#: families saved as their full vision-language class (``AutoModelForImageTextToText``), not as what
#: ``AutoModelForCausalLM`` builds from their config
FULL_VLM = ("qwen3_5_vl", "qwen3_vl")

#: built by :func:`build` but left out of the family-wide tests (FAMILIES): name -> (config builder, lora_target)
MERGE_ONLY: dict[str, tuple[Callable, str]] = {"qwen3_vl": (_qwen3_vl, LLAMA_LIKE)}

#: A trust_remote_code model: Llama weights, its own configuration / modeling code named in config.json auto_map.
REMOTE_CONFIG_PY = """from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "ferry-remote-llama"
"""
REMOTE_MODELING_PY = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


def _make_remote_code(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="ferry-remote-llama",
        architectures=["RemoteLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteLlamaConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG_PY)
    (folder / "modeling_remote.py").write_text(REMOTE_MODELING_PY)


def _rewrite(folder: Path, rename: Callable[[str], str]) -> None:
    """Rewrite ``folder/model.safetensors`` with every tensor name passed through ``rename``."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    save_file({rename(k): v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def _add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors to ``folder/model.safetensors`` (ones the hub's folder stores but transformers does not load)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    save_file({**state, **extra}, str(path), metadata={"format": "pt"})


def _hub_names_qwen3_5(model) -> Callable[[str], str]:
    """The hub's names for a Qwen3.5 text model, from transformers' own (reversed) ``qwen3_5_text`` mapping."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import apply_renamings

    renamings = [t.reverse_transform() for t in get_checkpoint_conversion_mapping("qwen3_5_text")[::-1]]
    return lambda key: apply_renamings(key, renamings)


def build(name: str, root: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Build family ``name`` under ``root/name`` (float32 safetensors, hub layout, stories260K tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    builder, _ = FAMILIES[name] if name in FAMILIES else MERGE_ONLY[name]
    torch.manual_seed(seed)
    config = builder()
    auto = AutoModelForImageTextToText if name in FULL_VLM else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms / biases away from their init, so that a wrong mapping shows in the logits
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    out = root / name
    model.save_pretrained(out, save_original_format=not name.endswith("_fused"))
    if name == "gpt2_hub":
        _rewrite(out, lambda k: k.removeprefix("transformer."))
    elif name == "gemma3_vlm":  # the hub's Gemma-3 checkpoints keep SigLIP's own vision_model level
        _rewrite(
            out,
            lambda k: (
                "vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k
            ),
        )
    elif name == "qwen3_5":
        _rewrite(out, _hub_names_qwen3_5(model))
    elif name == "llama_remote_code":
        _make_remote_code(out)
    elif name == "qwen3_5_vl":  # the hub's Qwen3.5 folders also store the multi-token-prediction head (mtp.*),
        _add_tensors(out, {"mtp.fc.weight": torch.randn(H, 2 * H), "mtp.norm.weight": torch.ones(H)})  # unloaded
    if name == "gemma3_vlm":  # the image processor a VLM's hub folder ships
        from transformers import Gemma3ImageProcessor

        Gemma3ImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    elif name == "qwen3_5_vl":
        from transformers import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(
            patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
        ).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / file, out / file)
    gen = out / "generation_config.json"
    data = json.loads(gen.read_text()) if gen.is_file() else {}
    data.update(bos_token_id=1, eos_token_id=2)
    gen.write_text(json.dumps(data))
    return out
