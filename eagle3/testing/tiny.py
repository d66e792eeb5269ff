"""Tiny synthetic checkpoints in the exact upstream on-disk formats (tests and the demo use them).

``make_tiny(out)`` writes one directory per model under ``out``:

==========================  =======================================================================
``kimi-k2.5``               Moonshot Kimi-K2.5 wrapper (``KimiK25ForConditionalGeneration``), text
                            stack ``language_model.*`` with compressed-tensors INT4 routed experts,
                            a small MoonViT ``vision_tower.*`` and ``mm_projector.*``, 3 shards.
``kimi-k2-thinking``        Moonshot Kimi-K2-Thinking text-only form (``model.*``), same text weights.
``kimi-k2.5-eagle3``        lightseek / TorchSpec EAGLE-3 Llama draft (``midlayer.*``, full vocab).
``kimi-k2.5-eagle3-d2t``    SpecForge ``to_sglang`` draft: reduced vocab with ``d2t``/``t2d``, no embed.
``kimi-k2.6-eagle3.1-mla``  lightseek EAGLE-3.1 MLA draft (``layers.0.*``, ``fc_norm``, ``norm_output``).
``speculators-eagle3``      vllm speculators ``Eagle3Speculator`` format (reduced vocab).
==========================  =======================================================================

Every file is a pure function of ``seed``: the same seed gives byte-identical files. Each tensor
family draws from its own named random stream (``_generator(seed, stream)``), so writing a subset
with ``only=`` gives the same bytes as the full run, and the Kimi-K2.5 and K2-Thinking text weights
are identical (their logits can be compared).

The dimensions are the real models' structure scaled down (see :data:`TEXT_DIMS`: hidden 128, 4
heads, 7 layers), except the MLA latent and head dims, which are Kimi's real ones (kv_lora_rank 512,
qk_rope 64, qk_nope 128, v 128) so that other engines' MLA kernels run the fixtures; every Linear
in/out dimension is a multiple of 32 (the quantizer's group size), except the MoE router's 8 rows.
Weights are written by hand with :class:`eagle3.checkpoint.CheckpointWriter` rather than with
``save_pretrained``: transformers writes wrong Moonshot names for ``kimi_k25`` (it renames
``layers`` to ``blocks``), and other loaders need the exact upstream names.

Token ids: the tiny vocabulary has 1024 ids; 0..767 are a byte-level BPE trained (deterministically,
with the ``tokenizers`` library) on a small embedded English + arithmetic corpus, and 768..1023 are
Kimi's 256 reserved special tokens at Kimi's offsets (``tiny id = kimi id - 163584 + 768``). The
video placeholder has no Kimi token id (Kimi uses id 163840 = vocab size); we put it in the free
reserved slot 792 so that every id in the configs is inside the vocabulary.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter, atomic_output, check_output, write_json, writing
from eagle3.errors import UsageError
from eagle3.formats.codecs import ct_int4_pack

MODEL_NAMES: tuple[str, ...] = (
    "kimi-k2.5",
    "kimi-k2-thinking",
    "kimi-k2.5-eagle3",
    "kimi-k2.5-eagle3-d2t",
    "kimi-k2.6-eagle3.1-mla",
    "speculators-eagle3",
)
TARGETS = ("kimi-k2.5", "kimi-k2-thinking")
# Written only when named with ``only=`` / ``--only``: package data, not a function of the seed
# (see :mod:`eagle3.testing.trained`); kept out of MODEL_NAMES, which tests iterate as the random set.
EXTRA_MODEL_NAMES: tuple[str, ...] = ("kimi-k2.5-trained", "kimi-k2.5-trained-eagle3",
                                       "kimi-k2.5-trained-eagle3.1-mla")
DRAFTS = tuple(n for n in MODEL_NAMES if n not in TARGETS)

# ---------------------------------------------------------------------------------------------
# Vocabulary and special tokens
# ---------------------------------------------------------------------------------------------

VOCAB_SIZE = 1024
BPE_VOCAB_SIZE = 768  # ids below this are byte-level BPE tokens
NUM_RESERVED_SPECIAL = VOCAB_SIZE - BPE_VOCAB_SIZE  # 256, like Kimi
KIMI_FIRST_SPECIAL = 163584


def kimi_to_tiny_id(kimi_id: int) -> int:
    """Kimi special-token id -> the tiny vocabulary's id (same offset inside the reserved block)."""
    tiny = kimi_id - KIMI_FIRST_SPECIAL + BPE_VOCAB_SIZE
    if not BPE_VOCAB_SIZE <= tiny < VOCAB_SIZE:
        raise ValueError(f"Kimi id {kimi_id} is not a reserved special token")
    return tiny


# Kimi-K2 / K2.5 named special tokens (tokenizer_config.json of the Kimi repos).
_KIMI_SPECIALS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
VIDEO_PLACEHOLDER_ID = 792  # our choice: Kimi has no such token id (see the module docstring)

SPECIAL_TOKENS: dict[int, str] = {kimi_to_tiny_id(k): v for k, v in _KIMI_SPECIALS.items()}
SPECIAL_TOKENS[VIDEO_PLACEHOLDER_ID] = VIDEO_PLACEHOLDER
TOKEN_IDS: dict[str, int] = {v: k for k, v in SPECIAL_TOKENS.items()}

BOS_ID = TOKEN_IDS["[BOS]"]  # 768
EOS_ID = TOKEN_IDS["[EOS]"]  # 769
IM_END_ID = TOKEN_IDS["<|im_end|>"]  # 770
EOT_ID = TOKEN_IDS["[EOT]"]  # 777
PAD_ID = TOKEN_IDS["[PAD]"]  # 1023
UNK_ID = TOKEN_IDS["[UNK]"]  # 1022
MEDIA_PAD_ID = TOKEN_IDS["<|media_pad|>"]  # 789
MEDIA_BEGIN_ID = TOKEN_IDS["<|media_begin|>"]  # 786
MEDIA_END_ID = TOKEN_IDS["<|media_end|>"]  # 788
STOP_IDS = (EOS_ID, IM_END_ID, EOT_ID)  # what runtimes stop on for Kimi: {[EOS], <|im_end|>, [EOT]}


def special_token_name(tiny_id: int) -> str:
    """Name of reserved id ``tiny_id``: Kimi's name, else ``<|reserved_token_{id}|>`` as Kimi does."""
    return SPECIAL_TOKENS.get(tiny_id, f"<|reserved_token_{tiny_id}|>")


# ---------------------------------------------------------------------------------------------
# Dimensions
# ---------------------------------------------------------------------------------------------

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
# Random streams and weight helpers
# ---------------------------------------------------------------------------------------------


def _generator(seed: int, stream: str) -> torch.Generator:
    """A torch generator for one named stream: independent of which other models are written."""
    digest = hashlib.sha256(f"eagle3-tiny/{seed}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _linear(g: torch.Generator, out_f: int, in_f: int) -> torch.Tensor:
    # std 1/sqrt(in): activations keep unit scale through the Linear, so 7 bf16 layers stay sane.
    return (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(torch.bfloat16)


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)


def _bias(g: torch.Generator, n: int) -> torch.Tensor:
    return (0.02 * torch.randn(n, generator=g)).to(torch.bfloat16)


def int4_expert(g: torch.Generator, out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    """One routed-expert Linear in compressed-tensors ``pack-quantized`` form.

    Codes are uniform in [-8, 7] and the group scales are random positive numbers (QAT checkpoints
    do not have ``amax / 7.5`` scales), sized so that W = q * scale has std ~ 1/sqrt(in)."""
    q = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int64).to(torch.int8)
    base = in_f**-0.5 / 4.6  # std of the uniform codes is ~4.6
    scale = (base * torch.exp(0.25 * torch.randn(out_f, in_f // GROUP_SIZE, generator=g))).to(torch.bfloat16)
    return {
        "weight_packed": ct_int4_pack(q),
        "weight_scale": scale,
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int32),
    }


def target_embedding(seed: int) -> torch.Tensor:
    """The target's token embedding (its own stream: drafts copy it, as trainers initialise the
    draft embedding from the target's)."""
    g = _generator(seed, "text/embed_tokens")
    return torch.randn(VOCAB_SIZE, TEXT_DIMS["hidden_size"], generator=g).to(torch.bfloat16)


def text_layer_tensors(seed: int, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of decoder layer ``layer`` (names relative to ``model.layers.{layer}.``)."""
    d = TEXT_DIMS
    g = _generator(seed, f"text/layers.{layer}")
    H, nh = d["hidden_size"], d["num_attention_heads"]
    dn, dr, dv = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    rq, rkv = d["q_lora_rank"], d["kv_lora_rank"]
    yield "input_layernorm.weight", _norm(g, H)
    yield "self_attn.q_a_proj.weight", _linear(g, rq, H)
    yield "self_attn.q_a_layernorm.weight", _norm(g, rq)
    yield "self_attn.q_b_proj.weight", _linear(g, nh * (dn + dr), rq)
    yield "self_attn.kv_a_proj_with_mqa.weight", _linear(g, rkv + dr, H)
    yield "self_attn.kv_a_layernorm.weight", _norm(g, rkv)
    yield "self_attn.kv_b_proj.weight", _linear(g, nh * (dn + dv), rkv)
    yield "self_attn.o_proj.weight", _linear(g, H, nh * dv)
    yield "post_attention_layernorm.weight", _norm(g, H)
    if layer < d["first_k_dense_replace"]:
        inter = d["intermediate_size"]
        yield "mlp.gate_proj.weight", _linear(g, inter, H)
        yield "mlp.up_proj.weight", _linear(g, inter, H)
        yield "mlp.down_proj.weight", _linear(g, H, inter)
        return
    E, inter = d["n_routed_experts"], d["moe_intermediate_size"]
    shared = d["n_shared_experts"] * inter
    yield "mlp.gate.weight", _linear(g, E, H)
    yield "mlp.gate.e_score_correction_bias", (0.05 * torch.randn(E, generator=g)).float()  # fp32 as in Kimi
    yield "mlp.shared_experts.gate_proj.weight", _linear(g, shared, H)
    yield "mlp.shared_experts.up_proj.weight", _linear(g, shared, H)
    yield "mlp.shared_experts.down_proj.weight", _linear(g, H, shared)
    for e in range(E):
        for proj, (o, i) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            for suffix, t in int4_expert(g, o, i).items():
                yield f"mlp.experts.{e}.{proj}.{suffix}", t


def _write_text_stack(w: CheckpointWriter, seed: int, prefix: str) -> None:
    """``prefix`` is ``""`` (K2-Thinking: ``model.*``, ``lm_head``) or ``"language_model."`` (K2.5).
    Two shards for the layers (split at the middle layer) like Moonshot's multi-shard layout."""
    n = TEXT_DIMS["num_hidden_layers"]
    w.add(f"{prefix}model.embed_tokens.weight", target_embedding(seed))
    for layer in range(n):
        if layer == (n + 1) // 2:
            w.start_shard()
        for name, t in text_layer_tensors(seed, layer):
            w.add(f"{prefix}model.layers.{layer}.{name}", t)
    g = _generator(seed, "text/head")
    w.add(f"{prefix}model.norm.weight", _norm(g, TEXT_DIMS["hidden_size"]))
    w.add(f"{prefix}lm_head.weight", _linear(g, VOCAB_SIZE, TEXT_DIMS["hidden_size"]))


def _vision_tensors(seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """MoonViT + PatchMerger projector with Moonshot's names (bf16)."""
    v = VISION_DIMS
    g = _generator(seed, "vision")
    D, F, P = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    h, w, _ = v["pos_emb"]
    yield "vision_tower.patch_embed.proj.weight", (torch.randn(D, 3, P, P, generator=g) * (3 * P * P) ** -0.5).to(
        torch.bfloat16)
    yield "vision_tower.patch_embed.proj.bias", _bias(g, D)
    yield "vision_tower.patch_embed.pos_emb.weight", (0.02 * torch.randn(h, w, D, generator=g)).to(torch.bfloat16)
    for b in range(v["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        yield p + "norm0.weight", _norm(g, D)
        yield p + "norm0.bias", _bias(g, D)
        yield p + "norm1.weight", _norm(g, D)
        yield p + "norm1.bias", _bias(g, D)
        yield p + "wqkv.weight", _linear(g, 3 * D, D)
        yield p + "wqkv.bias", _bias(g, 3 * D)
        yield p + "wo.weight", _linear(g, D, D)
        yield p + "wo.bias", _bias(g, D)
        yield p + "mlp.fc0.weight", _linear(g, F, D)
        yield p + "mlp.fc0.bias", _bias(g, F)
        yield p + "mlp.fc1.weight", _linear(g, D, F)
        yield p + "mlp.fc1.bias", _bias(g, D)
    yield "vision_tower.encoder.final_layernorm.weight", _norm(g, D)
    yield "vision_tower.encoder.final_layernorm.bias", _bias(g, D)
    kh, kw = v["merge_kernel_size"]
    M = D * kh * kw
    yield "mm_projector.pre_norm.weight", _norm(g, D)
    yield "mm_projector.pre_norm.bias", _bias(g, D)
    yield "mm_projector.proj.0.weight", _linear(g, M, M)
    yield "mm_projector.proj.0.bias", _bias(g, M)
    yield "mm_projector.proj.2.weight", _linear(g, TEXT_DIMS["hidden_size"], M)
    yield "mm_projector.proj.2.bias", _bias(g, TEXT_DIMS["hidden_size"])


# ---------------------------------------------------------------------------------------------
# Draft weights
# ---------------------------------------------------------------------------------------------


def _llama_midlayer(g: torch.Generator, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The single EAGLE-3 decoder layer: q/k/v read cat(embed_norm, hidden_norm), i.e. 2H inputs."""
    d = DRAFT_DIMS
    H, inter, hd = d["hidden_size"], d["intermediate_size"], d["head_dim"]
    nq, nkv = d["num_attention_heads"], d["num_key_value_heads"]
    yield prefix + "input_layernorm.weight", _norm(g, H)
    yield prefix + "hidden_norm.weight", _norm(g, H)
    yield prefix + "self_attn.q_proj.weight", _linear(g, nq * hd, 2 * H)
    yield prefix + "self_attn.k_proj.weight", _linear(g, nkv * hd, 2 * H)
    yield prefix + "self_attn.v_proj.weight", _linear(g, nkv * hd, 2 * H)
    yield prefix + "self_attn.o_proj.weight", _linear(g, H, nq * hd)
    yield prefix + "post_attention_layernorm.weight", _norm(g, H)
    yield prefix + "mlp.gate_proj.weight", _linear(g, inter, H)
    yield prefix + "mlp.up_proj.weight", _linear(g, inter, H)
    yield prefix + "mlp.down_proj.weight", _linear(g, H, inter)


def _mla_midlayer(g: torch.Generator, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """EAGLE-3.1 MLA layer: separate q_a / kv_a down projections reading 2H inputs."""
    d = TEXT_DIMS
    H, inter, nh = d["hidden_size"], d["intermediate_size"], d["num_attention_heads"]
    dn, dr, dv = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    rq, rkv = d["q_lora_rank"], d["kv_lora_rank"]
    yield prefix + "input_layernorm.weight", _norm(g, H)
    yield prefix + "hidden_norm.weight", _norm(g, H)
    yield prefix + "self_attn.q_a_proj.weight", _linear(g, rq, 2 * H)
    yield prefix + "self_attn.q_a_layernorm.weight", _norm(g, rq)
    yield prefix + "self_attn.q_b_proj.weight", _linear(g, nh * (dn + dr), rq)
    yield prefix + "self_attn.kv_a_proj_with_mqa.weight", _linear(g, rkv + dr, 2 * H)
    yield prefix + "self_attn.kv_a_layernorm.weight", _norm(g, rkv)
    yield prefix + "self_attn.kv_b_proj.weight", _linear(g, nh * (dn + dv), rkv)
    yield prefix + "self_attn.o_proj.weight", _linear(g, H, nh * dv)
    yield prefix + "post_attention_layernorm.weight", _norm(g, H)
    yield prefix + "mlp.gate_proj.weight", _linear(g, inter, H)
    yield prefix + "mlp.up_proj.weight", _linear(g, inter, H)
    yield prefix + "mlp.down_proj.weight", _linear(g, H, inter)


def draft_vocab_ids(tokenizer: Any | None = None) -> list[int]:
    """Sorted target ids kept by the reduced-vocab drafts: every named special token plus the most
    frequent BPE tokens of the embedded corpus (what SpecForge's frequency count picks), filled
    up with the lowest unused ids if the corpus is too small."""
    keep = set(SPECIAL_TOKENS)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    counts = Counter(tokenizer.encode(corpus_text()).ids)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= DRAFT_VOCAB_SIZE:
            break
        keep.add(tok)
    i = 0
    while len(keep) < DRAFT_VOCAB_SIZE:
        keep.add(i)
        i += 1
    return sorted(keep)


def d2t_t2d(used: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge/SafeAILab mapping: ``d2t`` OFFSETS (target = draft + d2t[draft]), ``t2d`` mask."""
    d2t = torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.int64)
    t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    t2d[torch.tensor(used)] = True
    return d2t, t2d


def _draft_common(g: torch.Generator, head_rows: int) -> dict[str, torch.Tensor]:
    H = DRAFT_DIMS["hidden_size"]
    return {
        "fc.weight": _linear(g, H, len(AUX_LAYER_IDS) * TEXT_DIMS["hidden_size"]),
        "norm.weight": _norm(g, H),
        "lm_head.weight": _linear(g, head_rows, H),
    }


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# Our own prose (no third-party text), plus generated GSM8K-style problems below.
_ENGLISH = """\
The morning was cold, so Anna put on her warm coat before she walked to the market.
She wanted to buy fresh bread, a few apples and some cheese for the picnic on Sunday.
At the market there were many people, and every seller was calling out the price of the day.
A farmer sold eggs in boxes of twelve, and a baker had just taken hot loaves out of the oven.
Anna asked how much the bread cost, and the baker said that one loaf was three dollars.
She paid with a ten dollar bill and got her change back in coins.
On the way home she met her friend Ben, who was carrying a heavy bag of books from the library.
They talked about the weather, about school, and about the new park near the river.
Ben said that the park would open next week, and that there would be music and games for children.
Learning is easier when you ask good questions and check every answer twice.
A good teacher explains each step, and a good student writes the steps down in order.
If a train leaves the station at nine and travels for two hours, it arrives at eleven.
The library has more than four hundred shelves, and each shelf holds about thirty books.
Water boils at one hundred degrees, and it freezes at zero degrees on the same scale.
The company hired five new workers this year, and each of them works eight hours a day.
When the students finished their homework, the teacher gave them time to read quietly.
Please think step by step, show your work, and then write the final answer on its own line.
The user asked the assistant a question, and the assistant answered politely and clearly.
You are a helpful assistant. Answer the question and explain your reasoning in simple words.
Numbers can be added, subtracted, multiplied and divided, and the result is called the answer.
In April the shop sold twice as many bikes as it did in March, and in May it sold half as many.
She spent a quarter of her money on lunch and saved the rest for the weekend trip with her family.
He reads twenty pages every night, so he finishes a long novel in less than a month.
The farmer has cows, chickens and sheep; every cow has four legs and every chicken has two legs.
A pizza is cut into eight slices, and the children ate all of the slices except three.
They drove sixty miles per hour for three hours and then stopped at a small town for dinner.
The price of a ticket went up by ten percent, so the family paid more than they did last year.
Altogether the class collected two hundred cans of food for the school during the winter.
If the recipe needs three cups of flour for one cake, how many cups are needed for four cakes?
Her brother is five years older than she is, and their father is three times as old as her brother.
Every week the gardener waters the plants on Monday, Wednesday and Friday in the early morning.
The store sells pencils for a quarter each and notebooks for two dollars and fifty cents.
After the game the team had fewer points than before, because the other team scored again.
We need to find how many minutes it takes to walk around the lake at a steady pace.
Because it rained in June and July, the river was higher than usual in the first week of August.
What is the remaining amount after you pay for the shoes, the shirt and the jacket?
The bakery makes cookies, muffins and cupcakes, and it puts them in boxes of a dozen.
Each student in the class brought two friends, so the room was full of people and noise.
The answer is the number of hours, so the final answer should not include the word hours.
"""

_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "James",
          "Kemal", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "books", "pencils", "cookies", "marbles", "stickers", "eggs", "flowers",
          "cards", "shirts", "tickets", "boxes", "candies", "toys", "coins", "cupcakes"]


def _gsm8k_like(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 50), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(5)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?"
        r = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now."
        ans = a + b
    elif kind == 1:
        a += b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} are left?"
        r = f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."
        ans = a - b
    elif kind == 2:
        q = f"Each box holds {c} {item}. {name} fills {a} boxes. How many {item} are there in total?"
        r = f"There are {a} * {c} = <<{a}*{c}={a * c}>>{a * c} {item} in total."
        ans = a * c
    elif kind == 3:
        q = (f"{name} earns ${a} per hour and works {c} hours a day for {b} days. "
             f"How much money does {name} earn?")
        r = (f"Per day {name} earns {a} * {c} = <<{a}*{c}={a * c}>>{a * c} dollars. "
             f"In {b} days that is {a * c} * {b} = <<{a * c}*{b}={a * c * b}>>{a * c * b} dollars.")
        ans = a * c * b
    else:
        total = a * c
        q = f"{name} shares {total} {item} equally among {c} friends. How many {item} does each friend get?"
        r = f"Each friend gets {total} / {c} = <<{total}/{c}={a}>>{a} {item}."
        ans = a
    return f"Question: {q}\nAnswer: {r}\n#### {ans}\n\n"


def corpus_text() -> str:
    """The embedded tokenizer-training corpus (deterministic, seed-independent)."""
    rng = random.Random(20240601)
    # The prose is repeated so that BPE merges favour common English words over rare numbers.
    return 4 * _ENGLISH + "".join(_gsm8k_like(rng) for _ in range(400))


# Kimi's pre-tokenizer splits like cl100k (words with a leading space, digits in groups of at most
# three, punctuation runs, newlines); this is that pattern without Kimi's Han branch.
_SPLIT_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE with 768 ids trained on :func:`corpus_text`,
    then the 256 reserved special tokens at ids 768..1023.

    The tokenizers BPE trainer is deterministic for a fixed corpus (ties are broken by pair id),
    which the tests check byte for byte."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    text = corpus_text()
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"tiny BPE has {tok.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(special_token_name(i), special=True, normalized=False)
                            for i in range(BPE_VOCAB_SIZE, VOCAB_SIZE)])
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id("[PAD]") != PAD_ID:
        raise RuntimeError("tiny tokenizer: special tokens did not land at ids 768..1023")
    return tok


def chat_template() -> str:
    return resources.files("eagle3.testing").joinpath("kimi_chat_template.jinja").read_text(encoding="utf-8")


def _write_tokenizer(d: Path, tokenizer: Any, eos: str, gen_eos: list[int]) -> None:
    with writing(d / "tokenizer.json"):
        (d / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    with writing(d / "chat_template.jinja"):
        (d / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": eos,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
    })
    write_json(d / "generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": gen_eos,
        "pad_token_id": PAD_ID,
    })


# ---------------------------------------------------------------------------------------------
# Writers, one per model
# ---------------------------------------------------------------------------------------------


def _write_kimi_k25(d: Path, seed: int, tokenizer: Any) -> None:
    with CheckpointWriter(d) as w:
        _write_text_stack(w, seed, "language_model.")
        w.start_shard()
        for name, t in _vision_tensors(seed):
            w.add(name, t)
    write_json(d / "config.json", kimi_k25_config())
    _write_tokenizer(d, tokenizer, "[EOS]", [EOS_ID, IM_END_ID, EOT_ID])


def _write_kimi_k2_thinking(d: Path, seed: int, tokenizer: Any) -> None:
    with CheckpointWriter(d) as w:
        _write_text_stack(w, seed, "")
    write_json(d / "config.json", kimi_k2_thinking_config())
    _write_tokenizer(d, tokenizer, "<|im_end|>", [IM_END_ID, EOS_ID, EOT_ID])


def _write_draft(d: Path, config: dict[str, Any], common: dict[str, torch.Tensor],
                 layer: Iterable[tuple[str, torch.Tensor]], *, embed: torch.Tensor | None = None,
                 fc_norms: Sequence[torch.Tensor] = (), lm_head_shard: bool = False,
                 vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The draft layout every format shares: [embed_tokens], fc, [fc_norm.i], the decoder layer,
    norm, lm_head (in its own shard with ``lm_head_shard``, as lightseek ships it), [d2t, t2d]."""
    with CheckpointWriter(d) as w:
        if embed is not None:
            w.add("embed_tokens.weight", embed)
        w.add("fc.weight", common["fc.weight"])
        for i, t in enumerate(fc_norms):
            w.add(f"fc_norm.{i}.weight", t)
        for name, t in layer:
            w.add(name, t)
        w.add("norm.weight", common["norm.weight"])
        if lm_head_shard:
            w.start_shard()
        w.add("lm_head.weight", common["lm_head.weight"])
        if vocab_map is not None:
            w.add("d2t", vocab_map[0])
            w.add("t2d", vocab_map[1])
    write_json(d / "config.json", config)


def _write_eagle3(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.5-eagle3")
    common = _draft_common(g, VOCAB_SIZE)
    _write_draft(d, eagle3_config(), common, _llama_midlayer(g, "midlayer."), embed=target_embedding(seed),
                 lm_head_shard=True)


def _write_eagle3_d2t(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.5-eagle3-d2t")
    common = _draft_common(g, DRAFT_VOCAB_SIZE)
    # SpecForge to_sglang drops embed_tokens (the target's is used).
    _write_draft(d, eagle3_d2t_config(), common, _llama_midlayer(g, "midlayer."),
                 vocab_map=d2t_t2d(draft_vocab_ids(tokenizer)))


def _write_eagle31_mla(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.6-eagle3.1-mla")
    common = _draft_common(g, VOCAB_SIZE)
    fc_norms = [_norm(g, TEXT_DIMS["hidden_size"]) for _ in AUX_LAYER_IDS]  # drawn before the layer
    _write_draft(d, eagle31_mla_config(), common, _mla_midlayer(g, "layers.0."), embed=target_embedding(seed),
                 fc_norms=fc_norms, lm_head_shard=True)


def _write_speculators(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/speculators-eagle3")
    common = _draft_common(g, DRAFT_VOCAB_SIZE)
    _write_draft(d, speculators_config(), common, _llama_midlayer(g, "layers.0."), embed=target_embedding(seed),
                 vocab_map=d2t_t2d(draft_vocab_ids(tokenizer)))


def _write_kimi_k25_trained(d: Path, seed: int, tokenizer: Any) -> None:
    from eagle3.testing import trained

    trained.write_kimi_k25_trained(d, seed, tokenizer)


def _write_trained_draft(d: Path, seed: int, tokenizer: Any) -> None:
    from eagle3.testing import trained

    trained.write_trained_draft(d.name, d)


_WRITERS: dict[str, Callable[[Path, int, Any], None]] = {
    "kimi-k2.5": _write_kimi_k25,
    "kimi-k2-thinking": _write_kimi_k2_thinking,
    "kimi-k2.5-eagle3": _write_eagle3,
    "kimi-k2.5-eagle3-d2t": _write_eagle3_d2t,
    "kimi-k2.6-eagle3.1-mla": _write_eagle31_mla,
    "speculators-eagle3": _write_speculators,
    "kimi-k2.5-trained": _write_kimi_k25_trained,
    "kimi-k2.5-trained-eagle3": _write_trained_draft,
    "kimi-k2.5-trained-eagle3.1-mla": _write_trained_draft,
}


def _select(only: Iterable[str] | None) -> list[str]:
    if only is None:
        return list(MODEL_NAMES)
    wanted = list(only)
    unknown = [n for n in wanted if n not in _WRITERS]
    if unknown:
        raise UsageError(f"--only: unknown model {unknown[0]!r} "
                         f"(choose from {', '.join(MODEL_NAMES + EXTRA_MODEL_NAMES)})")
    if not wanted:
        raise UsageError("--only: no model named")
    return [n for n in MODEL_NAMES + EXTRA_MODEL_NAMES if n in wanted]


def make_tiny(out: str | Path, seed: int = 0, only: Iterable[str] | None = None,
              overwrite: bool = False) -> dict[str, Path]:
    """Write the tiny checkpoints into ``out/<name>`` (atomically, with ``out/manifest.json``).

    Returns ``{name: path}`` in :data:`MODEL_NAMES` order (then :data:`EXTRA_MODEL_NAMES`, written
    only when named in ``only``). Refuses an existing ``out`` unless
    ``overwrite`` (:class:`eagle3.errors.OutputExistsError`)."""
    names = _select(only)
    out = check_output(out, overwrite)  # refuse before any work
    tokenizer = build_tokenizer()
    with atomic_output(out, overwrite=overwrite) as tmp:
        for name in names:
            d = tmp / name
            d.mkdir()
            _WRITERS[name](d, seed, tokenizer)
    return {name: out / name for name in names}


__all__ = [
    "MODEL_NAMES", "EXTRA_MODEL_NAMES", "TARGETS", "DRAFTS", "VOCAB_SIZE", "BPE_VOCAB_SIZE", "SPECIAL_TOKENS", "TOKEN_IDS",
    "BOS_ID", "EOS_ID", "IM_END_ID", "EOT_ID", "PAD_ID", "UNK_ID", "MEDIA_PAD_ID", "STOP_IDS",
    "TEXT_DIMS", "DRAFT_DIMS", "VISION_DIMS", "AUX_LAYER_IDS", "AUX_LAYER_IDS_OUTPUT_OF", "DRAFT_VOCAB_SIZE",
    "GROUP_SIZE", "kimi_to_tiny_id", "make_tiny", "build_tokenizer", "draft_vocab_ids", "d2t_t2d",
    "int4_expert", "target_embedding", "corpus_text", "chat_template",
]
