"""What a checkpoint's tensors are (name, dtype, shape), from the safetensors headers when the files
are there and from ``config.json`` alone when they are not.

The config-only path is what makes a paper projection possible: the real Kimi-K2.5 ``config.json``
(a few KB) says everything needed to size its 595 GB of weights. Every tensor is derived from the
architecture (DeepSeek-V3 / Kimi text stack, the K2.5 wrapper's MoonViT tower and projector,
EAGLE-3 drafts) and, for each Linear, from the storage layout its quantization scheme writes:

=====================  ==========================================================================
scheme                 tensors of one Linear [N, K]
=====================  ==========================================================================
dense                  ``weight`` [N, K] in the model dtype
ct-int4 (Moonshot)     ``weight_packed`` I32 [N, K/8], ``weight_scale`` [N, K/g] model dtype
                       ([N, 1] for the channel strategy), ``weight_shape`` I32 [2]
ct-fp8                 ``weight`` F8 [N, K], ``weight_scale`` F32 ([N, 1] channel, [1] tensor)
fp8-block (DeepSeek)   ``weight`` F8 [N, K], ``weight_scale_inv`` F32 [N/128, K/128] (ceil)
quark-w4a8             ``weight`` I32 [N, K/8], ``weight_scale`` F32 [], ``weight_scale_2`` F32 [N]
quark-int4 channel     ``weight`` I32 [N, K/8], ``weight_scale`` F32 [N], ``weight_zero_point`` I32 [N/8]
quark-int4 group g     ``weight`` I32 [K, N/8] (transposed), ``weight_scale`` F32 [K/g, N],
                       ``weight_zero_point`` I32 [K/g, N/8]
quark-mxfp4            ``weight`` U8 [N, K/2] (E2M1 pairs), ``weight_scale`` U8 [N, K/32] (E8M0)
quark-fp8              ``weight`` F8 [N, K], ``weight_scale`` F32 ([] tensor, [N] channel)
=====================  ==========================================================================

Which Linears a scheme covers comes from the config's ``ignore`` (compressed-tensors) or
``exclude`` / ``layer_quant_config`` (Quark) lists, matched against checkpoint names the way the
engines match them: ``re:`` entries with ``re.match``, globs with ``fnmatch``, plain entries as the
exact module name or a dotted suffix/prefix of it. Single-stage Quark INT4 is sized with its zero
points (Quark's export writes them; the config does not say), a few bytes per row.

This module is independent of the runtime: the memory plan (:mod:`eagle3.plan`), the
runtime memory benchmark and the full-width slice writer (:mod:`eagle3.testing.slice`) read it.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.checkpoint.header import DTYPE_BYTES  # bytes per element of a safetensors dtype tag
from eagle3.errors import FormatError

# safetensors dtype tag -> bytes per element (no torch needed: planning is config arithmetic)
_TORCH_DTYPE_TAGS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16", "float": "F32"}

# Scheme names (the same strings as eagle3.formats.detect uses for QuantInfo.scheme)
DENSE = "dense"
CT_INT4 = "ct-int4"
CT_FP8 = "ct-fp8"
FP8_BLOCK = "fp8-block"
QUARK_W4A8 = "quark-w4a8"
QUARK_INT4 = "quark-int4"
QUARK_MXFP4 = "quark-mxfp4"
QUARK_FP8 = "quark-fp8"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its name, safetensors dtype tag and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LinearFormat:
    """How one Linear is stored. ``qscheme``: per_channel | per_group | per_tensor | block (where it
    matters); ``scale_dtype``: the dtype of compressed-tensors INT4 group scales (the model dtype)."""

    scheme: str
    dtype: str = "BF16"  # dense weight dtype
    group_size: int | None = None
    qscheme: str | None = None
    block: tuple[int, int] | None = None
    scale_dtype: str = "BF16"
    zero_point: bool = False

    @functools.cache  # noqa: B019 (formats are few and live as long as the process anyway)
    def describe(self) -> str:
        if self.scheme == DENSE:
            return self.dtype.lower()
        extra = f" g{self.group_size}" if self.group_size and self.scheme != QUARK_MXFP4 else ""
        q = f" {self.qscheme}" if self.qscheme and (self.scheme in (QUARK_INT4, QUARK_FP8, CT_FP8)
                                                     or (self.scheme == CT_INT4 and self.qscheme == "channel")) else ""
        return f"{self.scheme}{q}{extra}"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def linear_tensors(module: str, n: int, k: int, fmt: LinearFormat) -> list[TensorSpec]:
    """The tensors a Linear ``module`` of logical shape [N=out, K=in] has on disk in ``fmt``."""
    return [TensorSpec(f"{module}.{param}", dtype, shape) for param, dtype, shape in _linear_layout(n, k, fmt)]


Layout = list[tuple[str, str, tuple[int, ...]]]  # (parameter, dtype tag, shape) of one Linear's tensors


# Kimi-K2.5's 69,779 Linears come in a handful of (shape, format) kinds: each kind's layout is
# derived once (eagle3 plan's inventory of the real config: 1.9 -> 0.8 CPU-s).
@functools.lru_cache(maxsize=4096)
def _linear_layout(n: int, k: int, fmt: LinearFormat) -> Layout:
    def t(param: str, dtype: str, *shape: int) -> tuple[str, str, tuple[int, ...]]:
        return param, dtype, shape

    s = fmt.scheme
    if s == DENSE:
        return [t("weight", fmt.dtype, n, k)]
    if s == CT_INT4:
        # channel strategy: one scale per row (a single group spanning K), stored [N, 1]
        g = k if fmt.qscheme == "channel" else fmt.group_size or 32
        return [t("weight_packed", "I32", n, _ceil(k, 8)), t("weight_scale", fmt.scale_dtype, n, _ceil(k, g)),
                t("weight_shape", "I32", 2)]
    if s == CT_FP8:
        if fmt.qscheme == "block" and fmt.block:
            scale = t("weight_scale", "F32", _ceil(n, fmt.block[0]), _ceil(k, fmt.block[1]))
        elif fmt.qscheme == "channel":
            scale = t("weight_scale", "F32", n, 1)
        else:
            scale = t("weight_scale", "F32", 1)
        return [t("weight", "F8_E4M3", n, k), scale]
    if s == FP8_BLOCK:
        b0, b1 = fmt.block or (128, 128)
        return [t("weight", "F8_E4M3", n, k), t("weight_scale_inv", "F32", _ceil(n, b0), _ceil(k, b1))]
    if s == QUARK_W4A8:
        out = [t("weight", "I32", n, _ceil(k, 8)), t("weight_scale", "F32"), t("weight_scale_2", "F32", n)]
        if fmt.zero_point:  # the INT4 stage's zero points (all 0, symmetric) when the export writes them
            out.append(t("weight_zero_point_2", "I32", _ceil(n, 8)))
        return out
    if s == QUARK_INT4:
        if fmt.qscheme == "per_group":
            g = fmt.group_size or 32
            out = [t("weight", "I32", k, _ceil(n, 8)), t("weight_scale", "F32", _ceil(k, g), n)]
            if fmt.zero_point:
                out.append(t("weight_zero_point", "I32", _ceil(k, g), _ceil(n, 8)))
            return out
        out = [t("weight", "I32", n, _ceil(k, 8)), t("weight_scale", "F32", n)]
        if fmt.zero_point:
            out.append(t("weight_zero_point", "I32", _ceil(n, 8)))
        return out
    if s == QUARK_MXFP4:
        return [t("weight", "U8", n, _ceil(k, 2)), t("weight_scale", "U8", n, _ceil(k, 32))]
    if s == QUARK_FP8:
        scale = t("weight_scale", "F32", n) if fmt.qscheme == "per_channel" else t("weight_scale", "F32")
        return [t("weight", "F8_E4M3", n, k), scale]
    raise ValueError(f"unknown scheme {s!r}")


@functools.cache  # a handful of formats per model, asked once per Linear
def linear_params(fmt: LinearFormat) -> dict[str, str]:
    """{parameter name (``weight_packed``, ``weight_scale``...): safetensors dtype tag} of a Linear
    in ``fmt``; neither depends on its shape. Cached: callers must not modify it."""
    return {t.name.rpartition(".")[2]: t.dtype for t in linear_tensors("m", 8, 8, fmt)}


# ---------------------------------------------------------------------------------------------
# Logical weights of the architectures (dense shapes; kind says what a quantizer may touch)
# ---------------------------------------------------------------------------------------------

# kind: "linear" (nn.Linear: what compressed-tensors and Quark quantize), "router" (the MoE gate: a
# 2-D weight that Quark's name heuristic treats as a Linear but compressed-tensors does not),
# "embed", "norm", "bias", "conv", "param" (other parameters stored as they are).


@dataclass(frozen=True)
class Weight:
    name: str  # full tensor name for non-Linears; module name for kind "linear"/"router"
    kind: str
    shape: tuple[int, ...]
    dtype: str | None = None  # fixed dtype (e.g. F32 e_score_correction_bias); None = model dtype


def _cfg_int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{where}: field '{key}' is {v!r}, expected an integer")
    return v


def text_stack_weights(tc: dict[str, Any], prefix: str, where: str) -> Iterator[Weight]:
    """The DeepSeek-V3 / Kimi text stack, layer by layer."""
    H = _cfg_int(tc, "hidden_size", where)
    V = _cfg_int(tc, "vocab_size", where)
    L = _cfg_int(tc, "num_hidden_layers", where)
    nh = _cfg_int(tc, "num_attention_heads", where)
    dn = _cfg_int(tc, "qk_nope_head_dim", where)
    dr = _cfg_int(tc, "qk_rope_head_dim", where)
    dv = _cfg_int(tc, "v_head_dim", where)
    rq = tc.get("q_lora_rank")
    rkv = _cfg_int(tc, "kv_lora_rank", where)
    inter = _cfg_int(tc, "intermediate_size", where)
    E = _cfg_int(tc, "n_routed_experts", where, 0)
    I_moe = _cfg_int(tc, "moe_intermediate_size", where, 0)
    n_shared = _cfg_int(tc, "n_shared_experts", where, 0)
    dense_k = _cfg_int(tc, "first_k_dense_replace", where, 0)
    freq = _cfg_int(tc, "moe_layer_freq", where, 1) or 1
    mtp = _cfg_int(tc, "num_nextn_predict_layers", where, 0)
    p = prefix
    yield Weight(f"{p}model.embed_tokens.weight", "embed", (V, H))
    for i in range(L + mtp):
        lp = f"{p}model.layers.{i}."
        yield Weight(lp + "input_layernorm.weight", "norm", (H,))
        if rq:
            yield Weight(lp + "self_attn.q_a_proj", "linear", (rq, H))
            yield Weight(lp + "self_attn.q_a_layernorm.weight", "norm", (rq,))
            yield Weight(lp + "self_attn.q_b_proj", "linear", (nh * (dn + dr), rq))
        else:
            yield Weight(lp + "self_attn.q_proj", "linear", (nh * (dn + dr), H))
        yield Weight(lp + "self_attn.kv_a_proj_with_mqa", "linear", (rkv + dr, H))
        yield Weight(lp + "self_attn.kv_a_layernorm.weight", "norm", (rkv,))
        yield Weight(lp + "self_attn.kv_b_proj", "linear", (nh * (dn + dv), rkv))
        yield Weight(lp + "self_attn.o_proj", "linear", (H, nh * dv))
        yield Weight(lp + "post_attention_layernorm.weight", "norm", (H,))
        if E > 0 and i >= dense_k and i % freq == 0:
            yield Weight(lp + "mlp.gate", "router", (E, H))
            if tc.get("topk_method", "noaux_tc") == "noaux_tc":
                yield Weight(lp + "mlp.gate.e_score_correction_bias", "param", (E,), "F32")
            if n_shared:
                S = n_shared * I_moe
                yield Weight(lp + "mlp.shared_experts.gate_proj", "linear", (S, H))
                yield Weight(lp + "mlp.shared_experts.up_proj", "linear", (S, H))
                yield Weight(lp + "mlp.shared_experts.down_proj", "linear", (H, S))
            for e in range(E):
                ep = f"{lp}mlp.experts.{e}."
                yield Weight(ep + "gate_proj", "linear", (I_moe, H))
                yield Weight(ep + "up_proj", "linear", (I_moe, H))
                yield Weight(ep + "down_proj", "linear", (H, I_moe))
        else:
            yield Weight(lp + "mlp.gate_proj", "linear", (inter, H))
            yield Weight(lp + "mlp.up_proj", "linear", (inter, H))
            yield Weight(lp + "mlp.down_proj", "linear", (H, inter))
    yield Weight(f"{p}model.norm.weight", "norm", (H,))
    if not tc.get("tie_word_embeddings", False):
        yield Weight(f"{p}lm_head", "linear", (V, H))


def _vget(vc: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if vc.get(n) is not None:
            return vc[n]
    return default


def vision_weights(vc: dict[str, Any], text_hidden: int) -> Iterator[Weight]:
    """MoonViT + PatchMerger projector of the K2.5 wrapper.
    Both spellings of the fields are read (Moonshot's ``vt_*`` and transformers' plain names); the
    defaults are transformers' (= the real K2.5 numbers)."""
    D = int(_vget(vc, "vt_hidden_size", "hidden_size", default=1152))
    F = int(_vget(vc, "vt_intermediate_size", "intermediate_size", default=4304))
    B = int(_vget(vc, "vt_num_hidden_layers", "num_hidden_layers", default=27))
    P = int(vc.get("patch_size", 14))
    h = int(_vget(vc, "init_pos_emb_height", "pos_emb_height", default=64))
    w = int(_vget(vc, "init_pos_emb_width", "pos_emb_width", default=64))
    kh, kw = (int(x) for x in vc.get("merge_kernel_size", (2, 2)))
    yield Weight("vision_tower.patch_embed.proj.weight", "conv", (D, 3, P, P))
    yield Weight("vision_tower.patch_embed.proj.bias", "bias", (D,))
    yield Weight("vision_tower.patch_embed.pos_emb.weight", "param", (h, w, D))
    for b in range(B):
        p = f"vision_tower.encoder.blocks.{b}."
        for n in ("norm0", "norm1"):
            yield Weight(p + n + ".weight", "norm", (D,))
            yield Weight(p + n + ".bias", "bias", (D,))
        for mod, (o, i) in (("wqkv", (3 * D, D)), ("wo", (D, D)), ("mlp.fc0", (F, D)), ("mlp.fc1", (D, F))):
            yield Weight(p + mod, "linear", (o, i))
            yield Weight(p + mod + ".bias", "bias", (o,))
    yield Weight("vision_tower.encoder.final_layernorm.weight", "norm", (D,))
    yield Weight("vision_tower.encoder.final_layernorm.bias", "bias", (D,))
    M = D * kh * kw
    yield Weight("mm_projector.pre_norm.weight", "norm", (D,))
    yield Weight("mm_projector.pre_norm.bias", "bias", (D,))
    yield Weight("mm_projector.proj.0", "linear", (M, M))
    yield Weight("mm_projector.proj.0.bias", "bias", (M,))
    yield Weight("mm_projector.proj.2", "linear", (text_hidden, M))
    yield Weight("mm_projector.proj.2.bias", "bias", (text_hidden,))


def draft_weights(cfg: dict[str, Any], where: str) -> Iterator[Weight]:
    """An EAGLE-3 / 3.1 draft from its config (Llama/MHA ``midlayer.*``, MLA ``layers.0.*``).

    The config cannot say for sure whether the draft ships its own embedding: SpecForge's reduced-
    vocabulary export drops it (the target's is used), the others keep it; that is what is assumed.
    Plan a draft from its headers when they are there (drafts are small)."""
    lc = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else cfg
    H = _cfg_int(lc, "hidden_size", where)
    V = _cfg_int(lc, "vocab_size", where) if lc.get("vocab_size") is not None else _cfg_int(cfg, "vocab_size", where)
    Vd = int(cfg.get("draft_vocab_size") or V)
    inter = _cfg_int(lc, "intermediate_size", where)
    Ht = int(cfg.get("target_hidden_size") or H)
    n_aux = int(cfg.get("num_aux_hidden_states") or 3)
    speculators = "speculators_model_type" in cfg
    if Vd == V or speculators:
        yield Weight("embed_tokens.weight", "embed", (V, H))
    yield Weight("fc", "linear", (H, n_aux * Ht))
    if cfg.get("fc_norm"):
        for i in range(n_aux):
            yield Weight(f"fc_norm.{i}.weight", "norm", (Ht,))
    archs = cfg.get("architectures") or []
    mla = any("Deepseek" in a for a in archs) or lc.get("kv_lora_rank") is not None
    lp = "layers.0." if mla or speculators else "midlayer."
    yield Weight(lp + "input_layernorm.weight", "norm", (H,))
    yield Weight(lp + "hidden_norm.weight", "norm", (H,))
    if mla:
        nh = _cfg_int(lc, "num_attention_heads", where)
        dn, dr, dv = (_cfg_int(lc, k, where) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        rq, rkv = _cfg_int(lc, "q_lora_rank", where), _cfg_int(lc, "kv_lora_rank", where)
        yield Weight(lp + "self_attn.q_a_proj", "linear", (rq, 2 * H))
        yield Weight(lp + "self_attn.q_a_layernorm.weight", "norm", (rq,))
        yield Weight(lp + "self_attn.q_b_proj", "linear", (nh * (dn + dr), rq))
        yield Weight(lp + "self_attn.kv_a_proj_with_mqa", "linear", (rkv + dr, 2 * H))
        yield Weight(lp + "self_attn.kv_a_layernorm.weight", "norm", (rkv,))
        yield Weight(lp + "self_attn.kv_b_proj", "linear", (nh * (dn + dv), rkv))
        yield Weight(lp + "self_attn.o_proj", "linear", (H, nh * dv))
    else:
        nq = _cfg_int(lc, "num_attention_heads", where)
        nkv = int(lc.get("num_key_value_heads") or nq)
        hd = int(lc.get("head_dim") or H // nq)
        yield Weight(lp + "self_attn.q_proj", "linear", (nq * hd, 2 * H))
        yield Weight(lp + "self_attn.k_proj", "linear", (nkv * hd, 2 * H))
        yield Weight(lp + "self_attn.v_proj", "linear", (nkv * hd, 2 * H))
        yield Weight(lp + "self_attn.o_proj", "linear", (H, nq * hd))
    yield Weight(lp + "post_attention_layernorm.weight", "norm", (H,))
    yield Weight(lp + "mlp.gate_proj", "linear", (inter, H))
    yield Weight(lp + "mlp.up_proj", "linear", (inter, H))
    yield Weight(lp + "mlp.down_proj", "linear", (H, inter))
    yield Weight("norm.weight", "norm", (H,))
    yield Weight("lm_head", "linear", (Vd, H))
    if Vd != V:
        yield Weight("d2t", "param", (Vd,), "I64")
        yield Weight("t2d", "param", (V,), "BOOL")


def kv_values_per_layer(tc: dict[str, Any], where: str) -> int:
    """Values one token takes in one layer's KV cache, from a transformer stack's config (``text_config``
    / ``transformer_layer_config`` / the top level): the MLA latent, ``kv_lora_rank +
    qk_rope_head_dim`` (576 for Kimi), or K and V heads, ``2 x num_key_value_heads x head_dim`` (a
    Llama draft). The runtime's models cache the same per-token shapes (``kv_cache_spec``)."""
    if tc.get("kv_lora_rank") is not None:
        return int(tc["kv_lora_rank"]) + int(tc.get("qk_rope_head_dim") or 0)
    heads = tc.get("num_attention_heads")
    if not heads:
        raise FormatError(f"{where}: field 'num_attention_heads' is missing (needed for the KV cache size)")
    kv = int(tc.get("num_key_value_heads") or heads)
    hd = int(tc.get("head_dim") or int(tc["hidden_size"]) // int(heads))
    return 2 * kv * hd


# ---------------------------------------------------------------------------------------------
# Quantization configs -> which Linear gets which layout
# ---------------------------------------------------------------------------------------------


def find_quantization_config(cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(quantization_config, where): the one lookup of that field (here, so that sizing stays
    torch-free). The top-level one wins, as every engine reads it after Moonshot's and ATOM's config
    classes copy ``text_config.quantization_config`` up."""
    top = cfg.get("quantization_config")
    if isinstance(top, dict):
        return top, "top-level"
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        return tc["quantization_config"], "text_config"
    return None, None


def quantization_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The config's quantization_config (:func:`find_quantization_config`)."""
    return find_quantization_config(cfg)[0]


def _model_dtype(cfg: dict[str, Any]) -> str:
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        v = c.get("torch_dtype") or c.get("dtype")
        if isinstance(v, str) and v in _TORCH_DTYPE_TAGS:
            return _TORCH_DTYPE_TAGS[v]
    return "BF16"


def _is_plain(entry: str) -> bool:
    return not entry.startswith("re:") and not any(c in entry for c in "*?[")


def _entry_regex(entry: str) -> str:
    """A ``re:`` or glob ignore/exclude entry as a regex for ``re.match``: ``re:`` entries as written
    (vLLM/SGLang/compressed-tensors semantics), globs as fnmatch over the name or ``name.*``."""
    if entry.startswith("re:"):
        return entry[3:]
    return f"(?:{fnmatch.translate(entry)})|(?:{fnmatch.translate(entry + '.*')})"


def _matcher(entries: list[str]) -> Callable[[str], bool]:
    """A predicate true for the module names (checkpoint naming) that any entry matches. Plain
    entries match the exact name or a dotted prefix or suffix of it (``lm_head`` matches
    ``language_model.lm_head``); the patterns are one compiled alternation, since the real configs
    are matched against ~70k module names and Quark's lists hold hundreds of explicit names."""
    plain = {e for e in entries if _is_plain(e)}
    pats = [_entry_regex(e) for e in entries if not _is_plain(e)]
    rx = re.compile("|".join(f"(?:{p})" for p in pats)) if pats else None

    def match(module: str) -> bool:
        if plain:
            if module in plain:
                return True
            dot = module.find(".")
            while dot != -1:  # the dotted prefixes and suffixes, cut at each dot
                if module[:dot] in plain or module[dot + 1:] in plain:
                    return True
                dot = module.find(".", dot + 1)
        return rx is not None and rx.match(module) is not None
    return match


Resolver = Callable[[str, str], "LinearFormat"]


def _quark_weight_format(w: Any, where: str, dense: str) -> LinearFormat:
    if isinstance(w, list):
        dts = [str(s.get("dtype")) if isinstance(s, dict) else None for s in w]
        if len(dts) == 2 and dts[0] and dts[0].startswith("fp8_e4m3") and dts[1] == "int4":
            return LinearFormat(QUARK_W4A8, qscheme="per_channel")
        raise FormatError(f"{where}: a {len(w)}-stage weight spec {dts}; eagle3 sizes the [fp8_e4m3, int4] W4A8 one")
    if not isinstance(w, dict):
        raise FormatError(f"{where}: {w!r} is not a Quark QTensorConfig object")
    dt, qs = str(w.get("dtype")), w.get("qscheme")
    if dt in ("int4", "uint4"):
        return LinearFormat(QUARK_INT4, qscheme=qs, group_size=w.get("group_size"), zero_point=True)
    if dt == "fp4":
        return LinearFormat(QUARK_MXFP4, group_size=32, qscheme="per_group")
    if dt.startswith("fp8_e4m3"):
        return LinearFormat(QUARK_FP8, qscheme=qs)
    raise FormatError(f"{where}.dtype is {dt!r}; eagle3 sizes Quark int4, fp4 (MXFP4), fp8_e4m3 and W4A8 weights")


def resolver(cfg: dict[str, Any], where: str = "config.json") -> Resolver:
    """``fmt(module, kind)`` for the config's quantization scheme (dense when there is none)."""
    dense_fmt = LinearFormat(DENSE, dtype=_model_dtype(cfg))
    qc = quantization_config(cfg)
    if qc is None:
        return lambda module, kind: dense_fmt
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        ignored = _matcher([str(e) for e in qc.get("ignore") or []])
        fmts: list[tuple[Callable[[str], bool] | None, LinearFormat]] = []
        for gname, g in groups.items():
            w = (g or {}).get("weights") or {}
            tl = [str(t) for t in g.get("targets") or ["Linear"]]
            targets = None if "Linear" in tl else _matcher(tl)
            if w.get("num_bits") == 4 and w.get("type") == "int":
                channel = w.get("strategy") == "channel"  # no groups: one scale per output row
                fmts.append((targets, LinearFormat(CT_INT4, group_size=None if channel else w.get("group_size") or 32,
                                                   qscheme=w.get("strategy"), scale_dtype=dense_fmt.dtype)))
            elif w.get("num_bits") == 8 and w.get("type") == "float":
                bs = w.get("block_structure")
                fmts.append((targets, LinearFormat(CT_FP8, qscheme=w.get("strategy"),
                                                   block=tuple(bs) if isinstance(bs, list) and len(bs) == 2 else None)))
            else:
                raise FormatError(f"{where}: field 'quantization_config.config_groups.{gname}.weights' is "
                                  f"{w.get('num_bits')}-bit {w.get('type')}; eagle3 sizes int4 and fp8")

        def ct(module: str, kind: str) -> LinearFormat:
            # Moonshot ships the K2.5 vision tower and projector bf16 whatever the ignore list says
            #.
            if kind != "linear" or module.startswith(("vision_tower.", "mm_projector.")) or ignored(module):
                return dense_fmt
            for targets, f in fmts:
                if targets is None or targets(module):
                    return f
            return dense_fmt
        return ct
    if method == "fp8":
        block = qc.get("weight_block_size") or [128, 128]
        skip = [str(e) for e in qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []]
        fp8 = LinearFormat(FP8_BLOCK, block=(int(block[0]), int(block[1])))

        def fp8_block(module: str, kind: str) -> LinearFormat:
            if kind != "linear" or module.endswith("lm_head") or any(e in module for e in skip):
                return dense_fmt
            return fp8
        return fp8_block
    if method == "quark":
        g = qc.get("global_quant_config") or {}
        glob = _quark_weight_format(g["weight"], f"{where}: quantization_config.global_quant_config.weight",
                                    dense_fmt.dtype) if g.get("weight") is not None else None
        layers = [(str(pat), _quark_weight_format(lc["weight"], f"{where}: layer_quant_config.{pat}.weight",
                                                  dense_fmt.dtype))
                  for pat, lc in (qc.get("layer_quant_config") or {}).items()
                  if isinstance(lc, dict) and lc.get("weight") is not None]
        excluded = _matcher([str(e) for e in qc.get("exclude") or []])

        def quark(module: str, kind: str) -> LinearFormat:
            if kind not in ("linear", "router"):
                return dense_fmt
            if excluded(module):
                return dense_fmt
            for pat, f in layers:
                if (fnmatch.fnmatchcase(module, pat) if "*" in pat else pat in module):
                    return f
            return glob or dense_fmt
        return quark
    raise FormatError(f"{where}: field 'quantization_config.quant_method' is {method!r}; eagle3 sizes "
                      f"compressed-tensors, fp8 and quark checkpoints")


# ---------------------------------------------------------------------------------------------
# Whole checkpoints
# ---------------------------------------------------------------------------------------------


def logical_weights(cfg: dict[str, Any], where: str = "config.json") -> Iterator[Weight]:
    """Every weight of a target (K2.5 wrapper or DeepSeek-V3 text stack) or EAGLE-3 draft config."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    if "speculators_model_type" in cfg or any("Eagle" in a for a in archs):
        yield from draft_weights(cfg, where)
        return
    tc = cfg.get("text_config")
    if isinstance(tc, dict):
        yield from text_stack_weights(tc, "language_model.", where)
        vc = cfg.get("vision_config")
        if isinstance(vc, dict):
            yield from vision_weights(vc, _cfg_int(tc, "hidden_size", where))
        return
    if any(a in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM") for a in archs) or cfg.get("kv_lora_rank"):
        yield from text_stack_weights(cfg, "", where)
        return
    raise FormatError(f"{where}: field 'architectures' is {archs}; eagle3 sizes Kimi-K2.5 / DeepSeek-V3 targets "
                      f"and EAGLE-3 drafts from their config")


def config_inventory(cfg: dict[str, Any], where: str = "config.json") -> tuple[list[TensorSpec], dict[str, int]]:
    """The checkpoint's tensors as its config describes them (no file is read), and
    {Linear layout: number of Linears} for the report."""
    fmt = resolver(cfg, where)
    dense = _model_dtype(cfg)
    out: list[TensorSpec] = []
    counts: dict[str, int] = {}
    for w in logical_weights(cfg, where):
        if w.kind in ("linear", "router"):
            n, k = w.shape
            f = fmt(w.name, w.kind)
            out += linear_tensors(w.name, n, k, f)
            d = f.describe()
            counts[d] = counts.get(d, 0) + 1
        else:
            out.append(TensorSpec(w.name, w.dtype or dense, w.shape))
    return out, counts


def config_tensors(cfg: dict[str, Any], where: str = "config.json") -> list[TensorSpec]:
    """The checkpoint's tensors as its config describes them (no file is read)."""
    return config_inventory(cfg, where)[0]


def linear_formats(cfg: dict[str, Any], where: str = "config.json") -> dict[str, int]:
    """{layout description: number of Linears} (what the config quantizes, for the report)."""
    return config_inventory(cfg, where)[1]


def header_tensors(path: str | Path) -> list[TensorSpec] | None:
    """The tensors named by the safetensors headers in ``path``; None when it holds no shards."""
    p = Path(path)
    if not p.is_dir() or not any(p.glob("*.safetensors")):
        return None
    from eagle3.checkpoint import CheckpointReader  # torch: only when there are shards to read

    return [TensorSpec(i.name, i.dtype, tuple(i.shape)) for i in CheckpointReader(p).infos()]


__all__ = ["TensorSpec", "LinearFormat", "Weight", "linear_tensors", "logical_weights", "config_tensors",
           "header_tensors", "config_inventory", "resolver", "linear_formats", "quantization_config", "kv_values_per_layer", "DTYPE_BYTES",
           "text_stack_weights", "vision_weights", "draft_weights"]
