"""Small checkpoints in the upstream on-disk formats, written with CheckpointWriter and the codecs.

Used by the detection tests for what the tiny fixtures of eagle3.testing.tiny do not cover
(quantized variants, broken configs). Configs follow the upstream ones (Kimi text stack,
compressed-tensors INT4, the drafts of eagle3.testing.tiny); the Quark configs are real Quark 0.13
exports and the Quark tensor layouts are those of eagle3.formats.sizing (int32 reorder-packed INT4, uint8 FP4 + E8M0, float8 + scale).
Dimensions are tiny (hidden 64, 4 layers, 4 experts) so that a checkpoint is a few hundred KB.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter, write_json
from eagle3.formats import codecs

H, LAYERS, VOCAB, EXPERTS, MOE_I, DENSE_I = 64, 4, 256, 4, 32, 128
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 2, 32, 16, 16, 8, 16

TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I,
    "num_hidden_layers": LAYERS, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
    "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V,
    "n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

CT_INT4_CONFIG: dict[str, Any] = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}

FP8_BLOCK_CONFIG: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}


# The quantization_config AMD Quark 0.13 really exports for each scheme (tests/formats/data/
# make_quark_configs.py wrote them from tiny DeepseekV3 exports), with ``exclude`` emptied.
QUARK_CONFIGS: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "quark013_configs.json").read_text())


def quark_config(scheme: str, exclude: list[str]) -> dict[str, Any]:
    cfg = copy.deepcopy(QUARK_CONFIGS[scheme])
    cfg["exclude"] = list(exclude)
    return cfg


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)


def encode_linear(name: str, w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """The tensors a module ``name`` with weight ``w`` [N, K] has on disk under ``scheme``."""
    n, k = w.shape
    if scheme == "bf16":
        return {f"{name}.weight": w}
    if scheme == "ct-int4":
        packed, scale = codecs.ct_int4_quantize(w, 32)
        return {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale,
                f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if scheme == "quark-w4a8":
        s1 = w.float().abs().amax() / codecs.FP8_E4M3_MAX
        x8 = codecs.fp8_quantize(w, s1).float()
        s2 = x8.abs().amax(1) / 7.5
        q = torch.clamp(torch.round(x8 / s2[:, None]), -8, 7).to(torch.int8)
        return {f"{name}.weight": codecs.quark_int4_pack(q), f"{name}.weight_scale": s1.reshape(()),
                f"{name}.weight_scale_2": s2, f"{name}.weight_zero_point_2": torch.zeros(n // 8, dtype=torch.int32)}
    if scheme == "quark-int4":
        s = (w.float().abs().amax(1) / 7.5)
        q = torch.clamp(torch.round(w.float() / s[:, None]), -8, 7).to(torch.int8)
        return {f"{name}.weight": codecs.quark_int4_pack(q), f"{name}.weight_scale": s.to(torch.bfloat16),
                f"{name}.weight_zero_point": torch.zeros(n // 8, dtype=torch.int32)}
    if scheme == "quark-mxfp4":
        packed, scale = codecs.mxfp4_quantize(w.float())
        return {f"{name}.weight": packed, f"{name}.weight_scale": scale}
    if scheme == "quark-fp8":
        s = w.float().abs().amax(1, keepdim=True) / codecs.FP8_E4M3_MAX
        return {f"{name}.weight": codecs.fp8_quantize(w, s), f"{name}.weight_scale": s.reshape(n).to(w.dtype)}
    if scheme == "fp8-block":
        q, s = codecs.fp8_block_quantize(w)
        return {f"{name}.weight": q, f"{name}.weight_scale_inv": s}
    raise ValueError(scheme)


def write(d: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / "config.json", config)
    kw = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    with CheckpointWriter(d, **kw) as w:
        for name, t in tensors.items():
            w.add(name, t)
    return d


def target_tensors(expert_scheme: str = "bf16", prefix: str = "", vision: bool = False,
                   dense_scheme: str = "bf16", seed: int = 0) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3/Kimi text stack; routed experts in ``expert_scheme``; shared experts and the
    layer-0 dense MLP in ``dense_scheme`` (the AMD MXFP4 revision quantizes them too)."""
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    m = prefix + "model."
    t[m + "embed_tokens.weight"] = _rand(g, VOCAB, H)
    for L in range(LAYERS):
        p = f"{m}layers.{L}."
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        a = p + "self_attn."
        t[a + "q_a_proj.weight"] = _rand(g, Q_LORA, H)
        t[a + "q_a_layernorm.weight"] = torch.ones(Q_LORA, dtype=torch.bfloat16)
        t[a + "q_b_proj.weight"] = _rand(g, HEADS * (NOPE + ROPE), Q_LORA)
        t[a + "kv_a_proj_with_mqa.weight"] = _rand(g, KV_LORA + ROPE, H)
        t[a + "kv_a_layernorm.weight"] = torch.ones(KV_LORA, dtype=torch.bfloat16)
        t[a + "kv_b_proj.weight"] = _rand(g, HEADS * (NOPE + V), KV_LORA)
        t[a + "o_proj.weight"] = _rand(g, H, HEADS * V)
        if L == 0:
            for proj, shape in (("gate_proj", (DENSE_I, H)), ("up_proj", (DENSE_I, H)), ("down_proj", (H, DENSE_I))):
                t.update(encode_linear(f"{p}mlp.{proj}", _rand(g, *shape), dense_scheme))
            continue
        t[p + "mlp.gate.weight"] = _rand(g, EXPERTS, H)
        t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(EXPERTS, dtype=torch.float32)
        for proj, shape in (("gate_proj", (MOE_I, H)), ("up_proj", (MOE_I, H)), ("down_proj", (H, MOE_I))):
            t.update(encode_linear(f"{p}mlp.shared_experts.{proj}", _rand(g, *shape), dense_scheme))
            for e in range(EXPERTS):
                t.update(encode_linear(f"{p}mlp.experts.{e}.{proj}", _rand(g, *shape), expert_scheme))
    t[m + "norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t[prefix + "lm_head.weight"] = _rand(g, VOCAB, H)
    if vision:
        t["vision_tower.patch_embed.proj.weight"] = _rand(g, 16, 3, 2, 2)
        t["vision_tower.encoder.blocks.0.wqkv.weight"] = _rand(g, 48, 16)
        t["vision_tower.encoder.blocks.0.norm0.weight"] = torch.ones(16, dtype=torch.bfloat16)
        t["mm_projector.proj.0.weight"] = _rand(g, 64, 64)
        t["mm_projector.proj.2.weight"] = _rand(g, H, 64)
    return t


def k25_config(quant: dict[str, Any] | None = None, nested_quant: dict[str, Any] | None = None) -> dict[str, Any]:
    """KimiK25ForConditionalGeneration wrapper; ``nested_quant`` goes into text_config as Moonshot ships it."""
    tc = copy.deepcopy(TEXT_CONFIG)
    tc["rope_scaling"]["beta_fast"] = 32.0
    if nested_quant is not None:
        tc["quantization_config"] = copy.deepcopy(nested_quant)
    cfg: dict[str, Any] = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "text_config": tc,
                           "vision_config": {"patch_size": 2, "vt_hidden_size": 16}}
    if quant is not None:
        cfg["quantization_config"] = copy.deepcopy(quant)
    return cfg


def text_config(quant: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = copy.deepcopy(TEXT_CONFIG)
    if quant is not None:
        cfg["quantization_config"] = copy.deepcopy(quant)
    return cfg


# -- drafts -------------------------------------------------------------------------------------

DH, DI, DHEADS, DHEAD_DIM = 64, 96, 2, 32  # draft hidden, MLP, heads, head dim (target hidden = H)


def draft_tensors(prefix: str = "midlayer.", mla: bool = False, n_aux: int = 3, draft_vocab: int = VOCAB,
                  fc_norm: bool = False, embed: bool = True, d2t: torch.Tensor | None = None,
                  t2d: torch.Tensor | None = None, input_norm: bool = False, seed: int = 1,
                  layer_scheme: str = "bf16") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    if embed:
        t["embed_tokens.weight"] = _rand(g, VOCAB, DH)
    t["fc.weight"] = _rand(g, DH, n_aux * H)
    if fc_norm:
        for i in range(n_aux):
            t[f"fc_norm.{i}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    if input_norm:
        t["input_norm.weight"] = torch.ones(n_aux * H, dtype=torch.bfloat16)
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"{prefix}{n}.weight"] = torch.ones(DH, dtype=torch.bfloat16)
    a = prefix + "self_attn."
    if mla:
        lin = {"q_a_proj": (Q_LORA, 2 * DH), "q_b_proj": (DHEADS * (NOPE + ROPE), Q_LORA),
               "kv_a_proj_with_mqa": (KV_LORA + ROPE, 2 * DH), "kv_b_proj": (DHEADS * (NOPE + V), KV_LORA),
               "o_proj": (DH, DHEADS * V)}
        t[a + "q_a_layernorm.weight"] = torch.ones(Q_LORA, dtype=torch.bfloat16)
        t[a + "kv_a_layernorm.weight"] = torch.ones(KV_LORA, dtype=torch.bfloat16)
    else:
        lin = {"q_proj": (DHEADS * DHEAD_DIM, 2 * DH), "k_proj": (DHEADS * DHEAD_DIM, 2 * DH),
               "v_proj": (DHEADS * DHEAD_DIM, 2 * DH), "o_proj": (DH, DHEADS * DHEAD_DIM)}
    for proj, shape in lin.items():
        t.update(encode_linear(a + proj, _rand(g, *shape), layer_scheme))
    for proj, shape in (("gate_proj", (DI, DH)), ("up_proj", (DI, DH)), ("down_proj", (DH, DI))):
        t.update(encode_linear(f"{prefix}mlp.{proj}", _rand(g, *shape), layer_scheme))
    t["norm.weight"] = torch.ones(DH, dtype=torch.bfloat16)
    t["lm_head.weight"] = _rand(g, draft_vocab, DH)
    if d2t is not None:
        t["d2t"] = d2t
    if t2d is not None:
        t["t2d"] = t2d
    return t


def vocab_map(draft_vocab: int, vocab: int = VOCAB, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets, t2d mask) for a random sorted used-token list, as SpecForge/TorchSpec build them."""
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    d2t = used - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t.to(torch.int64), t2d


def llama_draft_config(**extra: Any) -> dict[str, Any]:
    """TorchSpec-style Kimi-K2.5 EAGLE-3 Llama draft config, tiny dims."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
        "head_dim": DHEAD_DIM, "hidden_act": "silu", "hidden_size": DH, "intermediate_size": DI,
        "max_position_embeddings": 262144, "num_attention_heads": DHEADS, "num_hidden_layers": 1,
        "num_key_value_heads": DHEADS, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": VOCAB,
    }
    cfg.update(extra)
    return cfg


def mla_draft_config(**extra: Any) -> dict[str, Any]:
    """lightseek Kimi-K2.6 EAGLE-3.1 MLA draft config, tiny dims."""
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": DH,
        "intermediate_size": DI, "num_hidden_layers": 1, "num_attention_heads": DHEADS,
        "num_key_value_heads": DHEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": V, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB, "target_hidden_size": H, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "fc_norm": True, "norm_output": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
    }
    cfg.update(extra)
    return cfg


def speculators_config(**extra: Any) -> dict[str, Any]:
    """speculators Eagle3Speculator config, tiny dims."""
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": 128, "norm_before_residual": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["KimiK25ForConditionalGeneration"], "name_or_path": "moonshotai/Kimi-K2.5"}},
        "speculators_model_type": "eagle3", "speculators_version": "0.1.0.dev14", "target_hidden_size": None,
        "transformer_layer_config": {"head_dim": DHEAD_DIM, "hidden_size": DH, "model_type": "llama",
                                     "num_attention_heads": DHEADS, "num_hidden_layers": 1,
                                     "num_key_value_heads": DHEADS, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
                                     "vocab_size": VOCAB, "intermediate_size": DI},
    }
    cfg.update(extra)
    return cfg
