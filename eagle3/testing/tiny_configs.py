"""The tiny models' dimensions and their ``config.json`` files, in the exact upstream shapes
(Kimi-K2.5 / K2-Thinking targets, EAGLE-3 / EAGLE-3.1 / speculators drafts)."""

from __future__ import annotations

from typing import Any

from eagle3.testing.tiny_vocab import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    MEDIA_BEGIN_ID,
    MEDIA_END_ID,
    MEDIA_PAD_ID,
    PAD_ID,
    VIDEO_PLACEHOLDER,
    VIDEO_PLACEHOLDER_ID,
    VOCAB_SIZE,
)

# Kimi's real MLA latent (512 + 64 = 576) and head dims: vLLM's MLA backends accept only a latent
# of 320, 512 or 576, so other engines can run the fixtures that use them.
KIMI_MLA_LATENT: dict[str, int] = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                   "v_head_dim": 128}
TEXT_DIMS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 7,  # default aux ids (2, N//2, N-3) = (2, 3, 4) are distinct
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    **KIMI_MLA_LATENT,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
}
GROUP_SIZE = 32  # compressed-tensors INT4 group along the input dim
AUX_LAYER_IDS = (2, 3, 4)  # "input to layer k" convention (vLLM, speculators, ATOM)
AUX_LAYER_IDS_OUTPUT_OF = (1, 2, 3)  # the same tensors in the "output of layer k" convention (SpecForge)
DRAFT_VOCAB_SIZE = 256
DRAFT_DIMS: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
}

# K2.5 / K2.6 YaRN (text_config.rope_scaling); K2-Thinking uses beta_fast = beta_slow = 1.
ROPE_SCALING_K25: dict[str, Any] = {
    "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}
ROPE_SCALING_K2_THINKING: dict[str, Any] = {**ROPE_SCALING_K25, "beta_fast": 1.0, "beta_slow": 1.0}

# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

_INT4_SCHEME: dict[str, Any] = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE, "num_bits": 4,
    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int",
}
IGNORE_K2_THINKING = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                      "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
IGNORE_K25 = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """Moonshot's compressed-tensors ``pack-quantized`` INT4 W4A16 config (routed experts only)."""
    return {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                      "targets": ["Linear"], "weights": dict(_INT4_SCHEME)}},
        "format": "pack-quantized",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _mla_fields() -> dict[str, int]:
    """The MLA attention shape, shared by the target's text stack and the MLA draft."""
    d = TEXT_DIMS
    return {"num_attention_heads": d["num_attention_heads"], "num_key_value_heads": d["num_attention_heads"],
            **{k: d[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim")}}


def text_config(rope_scaling: dict[str, Any], ignore: list[str], eos_token_id: int) -> dict[str, Any]:
    """The DeepseekV3 text stack as Moonshot writes it (``model_type: kimi_k2``)."""
    d = TEXT_DIMS
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "moe_intermediate_size": d["moe_intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "first_k_dense_replace": d["first_k_dense_replace"],
        "moe_layer_freq": 1,
        **_mla_fields(),
        "n_routed_experts": d["n_routed_experts"],
        "num_experts_per_tok": d["num_experts_per_tok"],
        "n_shared_experts": d["n_shared_experts"],
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "seq_aux": True,
        "aux_loss_alpha": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": dict(rope_scaling),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": eos_token_id,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config(ignore),
    }


# MoonViT: transformers' Kimi_K25VisionConfig reads only the plain names, Moonshot's remote code and
# ATOM/vLLM read the vt_* / init_pos_emb_* names; we write both, with equal values.
VISION_DIMS: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                               "num_hidden_layers": 1, "patch_size": 14, "pos_emb": (4, 4, 2),
                               "merge_kernel_size": (2, 2)}


def vision_config() -> dict[str, Any]:
    v = VISION_DIMS
    h, w, t = v["pos_emb"]
    return {
        "model_type": "kimi_k25_vision",
        "patch_size": v["patch_size"],
        "pos_emb_height": h, "pos_emb_width": w, "pos_emb_time": t,
        "num_attention_heads": v["num_attention_heads"],
        "num_hidden_layers": v["num_hidden_layers"],
        "hidden_size": v["hidden_size"],
        "intermediate_size": v["intermediate_size"],
        "hidden_act": "gelu_pytorch_tanh",
        "merge_kernel_size": list(v["merge_kernel_size"]),
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        "init_pos_emb_height": h, "init_pos_emb_width": w, "init_pos_emb_time": t,
        "pos_emb_type": "divided_fixed",
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": v["hidden_size"],
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": TEXT_DIMS["hidden_size"],
        "vt_hidden_size": v["hidden_size"],
        "vt_intermediate_size": v["intermediate_size"],
        "vt_num_attention_heads": v["num_attention_heads"],
        "vt_num_hidden_layers": v["num_hidden_layers"],
    }


def kimi_k25_config() -> dict[str, Any]:
    """Top-level Kimi-K2.5 config.json: the wrapper plus ``text_config`` and ``vision_config``.

    Both spellings of the media token ids are written (Moonshot's ``media_placeholder_token_id``
    and transformers' ``image_token_id``), and ``projection_hidden_size`` and
    ``tie_word_embeddings`` explicitly, because transformers' defaults (1152, True) are wrong here."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PAD_ID,
        "image_token_id": MEDIA_PAD_ID,
        "video_token_id": VIDEO_PLACEHOLDER_ID,
        "vision_start_token_id": MEDIA_BEGIN_ID,
        "vision_end_token_id": MEDIA_END_ID,
        "projection_hidden_size": VISION_DIMS["hidden_size"],
        "projection_layer_norm_eps": 1e-5,
        "use_unified_vision_chunk": True,
        "video_placeholder": VIDEO_PLACEHOLDER,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text_config(ROPE_SCALING_K25, IGNORE_K25, EOS_ID),
        "vision_config": vision_config(),
    }


def kimi_k2_thinking_config() -> dict[str, Any]:
    """Kimi-K2-Thinking: the text stack is the whole config (eos = ``<|im_end|>`` as in the real one)."""
    return text_config(ROPE_SCALING_K2_THINKING, IGNORE_K2_THINKING, IM_END_ID)


def _llama_draft_fields() -> dict[str, Any]:
    d = DRAFT_DIMS
    return {
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "max_position_embeddings": 262144,
        "model_type": "llama",
        "num_attention_heads": d["num_attention_heads"],
        "num_hidden_layers": 1,
        "num_key_value_heads": d["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": dict(ROPE_SCALING_K25),
        "rope_theta": 50000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
    }


def eagle3_config() -> dict[str, Any]:
    """TorchSpec's init config for the lightseek K2.5 draft: no draft_vocab_size, no eagle_config."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_draft_fields()}


def eagle3_d2t_config() -> dict[str, Any]:
    """SpecForge draft config: reduced vocab, aux ids in the "output of layer k" convention."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_draft_fields(),
        "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS_OUTPUT_OF),
                         "use_aux_hidden_state": True},
    }


def eagle31_mla_config() -> dict[str, Any]:
    """lightseek EAGLE-3.1 MLA draft (TorchSpec MLA config + the 3.1 flags), full vocab."""
    d = TEXT_DIMS
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": 1,
        **_mla_fields(),
        "head_dim": d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": dict(ROPE_SCALING_K25),
        "vocab_size": VOCAB_SIZE,
        "draft_vocab_size": VOCAB_SIZE,
        "target_hidden_size": d["hidden_size"],
        "num_aux_hidden_states": len(AUX_LAYER_IDS),
        "fc_norm": True,
        "norm_output": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS), "use_aux_hidden_state": True},
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


def speculators_config() -> dict[str, Any]:
    """vllm speculators ``Eagle3Speculator`` config (``norm_before_residual`` explicit: vLLM
    defaults it to True for speculators configs that omit it)."""
    layer = _llama_draft_fields()
    layer.pop("tie_word_embeddings")
    layer["rope_scaling"] = {**{k: v for k, v in ROPE_SCALING_K25.items() if k != "type"}, "rope_type": "yarn"}
    return {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0.dev14",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": 3, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["KimiK25ForConditionalGeneration"],
                         "name_or_path": "moonshotai/Kimi-K2.5"},
        },
        "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS),
        "transformer_layer_config": layer,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------------
