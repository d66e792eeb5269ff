"""Tensor-name knowledge shared by detection, conversion, quantization and the runtime loader.

Every upstream spelling of a tensor name lives here, so that the rest of eagle3 speaks in roles
("the draft's fc", "the decoder layer prefix", "the text stack") instead of string literals.
The whole-checkpoint layouts these names belong to are in :mod:`eagle3.formats.sizing` and
:mod:`eagle3.formats.schema`.

Facts encoded below (all on-disk names, never engine-internal names):

* EAGLE-3 draft keys carry no ``model.`` prefix. The single decoder layer is ``midlayer.*`` in the
  TorchSpec / SpecForge / SGLang native export and ``layers.0.*`` in the vLLM-style export
  (TorchSpec ``--vllm``, speculators, the lightseek MLA drafts). Everything else has one name.
* The Kimi-K2.5 wrapper (``KimiK25ForConditionalGeneration``) nests the DeepSeek-V3 text stack
  under ``language_model.`` and adds ``vision_tower.*`` and ``mm_projector.*``; a text-only
  checkpoint (Kimi-K2-Thinking) has the text stack at the top (``model.layers.N...``, ``lm_head``).
* Quantized Linear modules keep their module name and change the parameter names:
  compressed-tensors ``weight_packed``/``weight_scale``/``weight_shape``; Quark
  ``weight``/``weight_scale``[/``weight_scale_2``]; DeepSeek FP8 ``weight``/``weight_scale_inv``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# ---------------------------------------------------------------------------------------------
# Target (Kimi-K2.5 wrapper / DeepSeek-V3 text stack)
# ---------------------------------------------------------------------------------------------

LM_PREFIX = "language_model."  # text stack inside the K2.5 wrapper
VISION_PREFIX = "vision_tower."  # MoonViT encoder (bf16, never converted by eagle3)
PROJECTOR_PREFIX = "mm_projector."  # vision -> text PatchMerger projector
MULTIMODAL_PREFIXES = (VISION_PREFIX, PROJECTOR_PREFIX)

TARGET_EMBED = "model.embed_tokens.weight"
TARGET_NORM = "model.norm.weight"
TARGET_LM_HEAD = "lm_head.weight"
_TARGET_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def strip_lm_prefix(name: str) -> str:
    """``language_model.model.layers.0...`` -> ``model.layers.0...`` (text-only naming)."""
    return name[len(LM_PREFIX):] if name.startswith(LM_PREFIX) else name


def add_lm_prefix(name: str) -> str:
    """Text-only naming -> wrapper naming (multimodal names are left alone)."""
    if name.startswith(LM_PREFIX) or is_multimodal(name):
        return name
    return LM_PREFIX + name


def is_multimodal(name: str) -> bool:
    """True for the vision tower and projector tensors of a K2.5 wrapper."""
    return name.startswith(MULTIMODAL_PREFIXES)


def target_layer_index(name: str) -> int | None:
    """Decoder-layer index of a target tensor (either naming), or None outside the layers."""
    m = _TARGET_LAYER.match(strip_lm_prefix(name))
    return int(m.group(1)) if m else None


def expert_index(name: str) -> int | None:
    """Routed-expert index of ``...mlp.experts.E.<proj>...``, or None (shared experts are not routed)."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# EAGLE-3 / 3.1 draft
# ---------------------------------------------------------------------------------------------

MIDLAYER = "midlayer."  # TorchSpec / SpecForge / SGLang native
LAYERS0 = "layers.0."  # vLLM-style, speculators, lightseek MLA
DRAFT_LAYER_PREFIXES = (MIDLAYER, LAYERS0)

DRAFT_EMBED = "embed_tokens.weight"
DRAFT_FC = "fc.weight"  # [H, n_aux * H_t]: fuses the aux hidden states
DRAFT_INPUT_NORM = "input_norm.weight"  # norm_before_fc: one RMSNorm over n_aux * H_t
DRAFT_NORM = "norm.weight"  # final RMSNorm
DRAFT_LM_HEAD = "lm_head.weight"  # [V_d, H]
D2T = "d2t"  # int64 [V_d] offsets: target_id = draft_id + d2t[draft_id]
T2D = "t2d"  # bool [V]: training-only mask, every serving engine skips it
_FC_NORM = re.compile(r"^fc_norm\.(\d+)\.weight$")  # EAGLE-3.1, one RMSNorm(H_t) per aux chunk
# SGLang's legacy spelling of the EAGLE-3.1 per-aux norms (new SGLang renames them on load).
LEGACY_FC_NORM = {"aux_norm_low.weight": 0, "aux_norm_mid.weight": 1, "aux_norm_high.weight": 2}

# Layer-relative names inside the draft decoder layer (after the layer prefix).
DRAFT_LAYER_NORMS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
MHA_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight")
MLA_ATTENTION = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                 "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# One key whose presence alone says "this draft layer is MLA" (q/k/v_proj say MHA).
MLA_MARKER = "self_attn.kv_a_proj_with_mqa"
MHA_MARKER = "self_attn.k_proj"


def fc_norm_key(i: int) -> str:
    return f"fc_norm.{i}.weight"


def fc_norm_index(name: str) -> int | None:
    """Aux slot of an EAGLE-3.1 ``fc_norm.{i}.weight`` (or its legacy SGLang name), else None."""
    m = _FC_NORM.match(name)
    if m:
        return int(m.group(1))
    return LEGACY_FC_NORM.get(name)


def draft_layer_prefix(name: str) -> str | None:
    """The layer prefix a draft tensor name starts with (``midlayer.`` / ``layers.N.``), or None."""
    if name.startswith(MIDLAYER):
        return MIDLAYER
    m = re.match(r"^layers\.(\d+)\.", name)
    return m.group(0) if m else None


def rename_draft_layer(name: str, to_prefix: str) -> str:
    """``midlayer.X`` <-> ``layers.0.X``; names outside layer 0 are returned unchanged.

    Only layer 0 has two spellings: multi-layer drafts (vLLM/speculators only) use ``layers.N.``."""
    if to_prefix not in DRAFT_LAYER_PREFIXES:
        raise ValueError(f"unknown draft layer prefix {to_prefix!r}")
    for p in DRAFT_LAYER_PREFIXES:
        if name.startswith(p):
            return to_prefix + name[len(p):]
    return name


def draft_layer_prefixes(names: Iterable[str]) -> set[str]:
    """Which of ``midlayer.`` / ``layers.0.`` occur among ``names`` (both = an inconsistent file)."""
    found: set[str] = set()
    for n in names:
        for p in DRAFT_LAYER_PREFIXES:
            if n.startswith(p):
                found.add(p)
    return found


# ---------------------------------------------------------------------------------------------
# Quantized-module parameter names
# ---------------------------------------------------------------------------------------------

WEIGHT = "weight"
CT_PACKED = "weight_packed"  # compressed-tensors pack-quantized: int32 [N, ceil(K/8)]
CT_SHAPE = "weight_shape"  # compressed-tensors: int32 [2] = (N, K)
SCALE = "weight_scale"  # compressed-tensors group scale / Quark scale (stage 1 for W4A8)
SCALE_2 = "weight_scale_2"  # Quark progressive W4A8: per-channel INT4 stage scale f32 [N]
SCALE_INV = "weight_scale_inv"  # DeepSeek / Kimi-K2 FP8 128x128 block scale
ZERO_POINT = "weight_zero_point"
ZERO_POINT_2 = "weight_zero_point_2"
G_IDX = "weight_g_idx"
INPUT_SCALE = "input_scale"
OUTPUT_SCALE = "output_scale"  # Quark FP8 KV cache scale on k/v (or kv_b) projections
K_SCALE = "k_scale"  # compressed-tensors kv-cache scheme: static key / value cache scales on
V_SCALE = "v_scale"  # the attention module (``...self_attn.k_scale``), scalar or [1]
QUANT_PARAMS = frozenset({WEIGHT, CT_PACKED, CT_SHAPE, SCALE, SCALE_2, SCALE_INV, ZERO_POINT, ZERO_POINT_2,
                          G_IDX, INPUT_SCALE, OUTPUT_SCALE})


def kv_scale_names(attn: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensors that may hold the static FP8 KV-cache scales of attention module ``attn``
    (``...self_attn``), as (key scales, value scales): a compressed-tensors kv-cache scheme's
    ``attn.k_scale`` / ``attn.v_scale``, or Quark's ``output_scale`` on the projections its
    ``kv_cache_quant_config`` names (``k_proj`` / ``v_proj`` of a Llama layer; on an MLA layer
    ``kv_b_proj``, whose output holds both keys and values, or ``kv_a_proj_with_mqa``, whose output
    is the cached latent). Each is a per-tensor dequantization scale (``value = code * scale``)."""
    both = tuple(f"{attn}.{m}.{OUTPUT_SCALE}" for m in ("kv_b_proj", "kv_a_proj_with_mqa"))
    return ((f"{attn}.{K_SCALE}", f"{attn}.k_proj.{OUTPUT_SCALE}", *both),
            (f"{attn}.{V_SCALE}", f"{attn}.v_proj.{OUTPUT_SCALE}", *both))


def split_param(name: str) -> tuple[str, str]:
    """``a.b.c.weight_scale`` -> (``a.b.c``, ``weight_scale``); ``d2t`` -> (``""``, ``d2t``)."""
    mod, _, param = name.rpartition(".")
    return mod, param
