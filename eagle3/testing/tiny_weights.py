"""Tiny random weights: one named random stream per tensor family (so ``only=`` subsets give the
same bytes), target text/vision stacks and draft layers in the upstream tensor names."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter
from eagle3.formats.codecs import ct_int4_pack
from eagle3.testing.tiny_configs import (
    AUX_LAYER_IDS,
    DRAFT_DIMS,
    DRAFT_VOCAB_SIZE,
    GROUP_SIZE,
    TEXT_DIMS,
    VISION_DIMS,
)
from eagle3.testing.tiny_tokenizer import build_tokenizer, corpus_text
from eagle3.testing.tiny_vocab import SPECIAL_TOKENS, VOCAB_SIZE


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
