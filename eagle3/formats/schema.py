"""One schema per architecture family: the exact tensors (name, dtype, shape) a checkpoint must hold,
derived from its typed config (:mod:`eagle3.formats.model_config`).

The layouts themselves live in :mod:`eagle3.formats.sizing` (the architectures' logical weights and,
per quantization scheme, what each Linear stores: packed weights, scales, zero points); ``eagle3 plan``,
``quantize``'s expected output (:func:`eagle3.quantize.native.expected_shapes`) and this schema all
derive from those functions, so there is one description of every format. What the schema adds is
what a checkpoint may legitimately vary in:

* drafts: the decoder layer's prefix (``midlayer.`` in SpecForge / EAGLE checkpoints, ``layers.0.`` in
  MLA and speculators ones; every engine loads both), the draft's own ``embed_tokens`` (SpecForge's
  reduced-vocabulary export drops it and uses the target's), ``t2d`` (vLLM and SGLang read ``d2t``
  only), and a full-vocabulary draft's identity ``d2t`` / ``t2d`` (SpecForge saves them anyway);
* targets: the MTP layers after ``num_hidden_layers`` (DeepSeek-V3 ships one; engines skip it) and a
  K2.5 vision tower and projector left in a text-only checkpoint: named here as allowed extras;
* quantized Linears: the optional tensors real exports add and engines load or ignore
  (:func:`module_extras`: a static ``input_scale``; compressed-tensors INT4 ``weight_zero_point`` and
  ``weight_g_idx``; a Quark W4A8 export's all-zero ``weight_zero_point_2``), a kv-cache scheme's
  ``k_scale`` / ``v_scale`` on attention modules or, for Quark, an ``output_scale`` on each Linear
  its ``kv_cache_quant_config`` names (dense or not), and
  ``weight_shape`` in any integer width. Whether the runtime can use one (a non-zero zero point, a
  permuting group index) is the loader's call (:mod:`eagle3.runtime.weights`), not the schema's.

Families: ``kimi-k2.5`` (the wrapper: ``language_model.`` text stack + MoonViT tower + projector),
``deepseek-v3`` (a bare text stack, as ``convert --text-only`` writes it), ``eagle3-llama``,
``eagle3-mla`` and ``speculators``; the source format (compressed-tensors INT4, FP8 block, bf16/fp32,
Quark W4A8 / MXFP4 / INT4 / FP8) is read from ``quantization_config`` (:func:`sizing.resolver`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3.formats import keys, sizing
from eagle3.formats.model_config import DraftConfig, TextStackConfig
from eagle3.formats.sizing import LinearFormat, TensorSpec

FLOAT_TAGS = frozenset({"BF16", "F16", "F32"})  # a dense tensor may be stored in any of these
INT_TAGS = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})
# compressed-tensors' compressor saves weight_shape as a torch tensor of the weight's shape (int64);
# Moonshot's export wrote int32. Engines read its two values, whatever their integer width.
_ANY_INT_WIDTH = (keys.CT_SHAPE,)
# Quantization methods whose checkpoints may carry a kv-cache scheme's k_scale / v_scale.
_KV_SCALE_METHODS = ("compressed-tensors", "quark", "fp8")
_LAYER = re.compile(r"^(?P<p>(?:language_model\.)?model\.layers\.)(?P<i>\d+)\.")
_VISION = re.compile(r"^(?:vision_tower|mm_projector|multi_modal_projector)\.")
_BUFFERS = re.compile(r"(?:^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Extra:
    """An optional tensor a module may carry beside its layout: any of ``dtypes``, any of ``shapes``."""

    dtypes: frozenset[str]
    shapes: tuple[tuple[int, ...], ...]

    def accepts(self, dtype: str, shape: tuple[int, ...]) -> bool:
        return dtype in self.dtypes and shape in self.shapes

    def describe(self) -> str:
        tags = "/".join(sorted(self.dtypes)) if len(self.dtypes) <= 3 else \
            ("float" if self.dtypes <= FLOAT_TAGS else "integer")
        return " or ".join(f"{tags}{list(s)}" for s in self.shapes)


_SCALAR = ((), (1,))  # a per-tensor scale: 0-d (Quark) or [1] (compressed-tensors)


def module_extras(module: str, n: int, k: int, fmt: LinearFormat) -> dict[str, Extra]:
    """The optional tensors a quantized Linear [N, K] in ``fmt`` may carry (engines load or ignore
    them): a static activation scale, and for compressed-tensors INT4 the zero points of an
    asymmetric scheme and the group index of an activation-ordered one."""
    out: dict[str, Extra] = {}
    if fmt.scheme == sizing.QUARK_W4A8 and not fmt.zero_point:
        # the INT4 stage's zero points, all 0 (symmetric): Quark's importer wants them and
        # ``quantize --quark-zero-points`` writes them; vLLM / SGLang / ATOM ignore them
        out[keys.ZERO_POINT_2] = Extra(frozenset({"I32"}), ((-(-n // 8),),))
    if fmt.scheme in (sizing.DENSE, sizing.FP8_BLOCK):  # DeepSeek block FP8 quantizes activations per group
        return out
    out[keys.INPUT_SCALE] = Extra(FLOAT_TAGS, _SCALAR)
    if fmt.scheme == sizing.CT_INT4:
        scale = next(t for t in sizing.linear_tensors(module, n, k, fmt) if t.name.endswith("." + keys.SCALE))
        groups = scale.shape[1]
        # pack-quantized packs zero points 8 to an int32 along the rows; other formats keep the
        # scale's shape
        out[keys.ZERO_POINT] = Extra(INT_TAGS, ((n, groups), (-(-n // 8), groups)))
        out[keys.G_IDX] = Extra(INT_TAGS, ((k,),))
    return out


def stored_format(module: str, fmt: LinearFormat, dtype_of: Callable[[str], str | None]) -> LinearFormat:
    """The layout ``module`` is stored in: ``fmt`` (what its config says), or dense when a quantizer
    left it in the model dtype (mixed-precision exports; every engine loads either): a float
    ``weight`` and none of ``fmt``'s other tensors. ``dtype_of(name)``: a tensor's safetensors dtype
    tag, None when the checkpoint lacks it. The checker (:mod:`eagle3.formats.check`) and the
    runtime's loader (:mod:`eagle3.runtime.weights`) both decide by this."""
    if fmt.scheme == sizing.DENSE:
        return fmt
    w = dtype_of(f"{module}.{keys.WEIGHT}")
    others = [n for n in sizing.linear_params(fmt) if n != keys.WEIGHT]
    if w in FLOAT_TAGS and not any(dtype_of(f"{module}.{n}") is not None for n in others):
        return LinearFormat(sizing.DENSE, dtype=w)
    return fmt


@dataclass(frozen=True)
class Schema:
    """The tensors of one checkpoint: ``tensors`` must all be there (bar ``optional``), with these
    shapes and dtypes; a tensor not in ``tensors`` is unexpected unless :meth:`allowed_extra` says
    engines ignore it."""

    family: str
    tensors: dict[str, TensorSpec]
    optional: frozenset[str] = frozenset()
    num_layers: int | None = None  # the decoder layers the config declares (targets)
    layer_prefix: str = ""  # where a target's decoder layers live ("language_model.model.layers.")
    mtp_layers: int = 0
    vocab_map: tuple[int, int] | None = None  # (vocab, draft_vocab) of a reduced-vocabulary draft
    # module -> (its quantized tensor names, the dense weight that may stand in for them): a Linear a
    # quantizer left in the model dtype (mixed-precision exports; the engines load either).
    dense_alternatives: dict[str, tuple[tuple[str, ...], TensorSpec]] = field(default_factory=dict)
    # module -> (N, K, format) of every quantized Linear: what :meth:`extra` derives optional tensors from
    quantized: dict[str, tuple[int, int, LinearFormat]] = field(default_factory=dict)
    attention: frozenset[str] = frozenset()  # attention modules that may carry k_scale / v_scale
    # Linears a Quark kv-cache scheme (``kv_cache_quant_config``) names: each may carry a static FP8
    # ``output_scale`` (0-d), whatever its weight format (Kimi's k/v live in a dense kv_b_proj)
    kv_outputs: frozenset[str] = frozenset()

    def allowed_extra(self, name: str) -> bool:
        """Tensors engines skip: the MTP layers' extras, a vision tower and projector, rotary buffers."""
        if _BUFFERS.search(name):
            return True
        if self.family in ("kimi-k2.5", "deepseek-v3"):
            if _VISION.match(name.removeprefix("model.")):
                return True
            m = _LAYER.match(name)
            # an MTP layer's own tensors (enorm, hnorm, eh_proj, shared_head.*) beside its decoder layer
            if m and self.num_layers is not None and self.num_layers <= int(m.group("i")) < self.num_layers + self.mtp_layers:
                return True
        return False

    def kv_extra(self, name: str) -> Extra | None:
        """The kv-cache scale ``name`` is (on an attention module or a Linear whose output is cached),
        or None. These do not depend on the module's weight format."""
        module, _, param = name.rpartition(".")
        if (param in (keys.K_SCALE, keys.V_SCALE) and module in self.attention) or \
                (param == keys.OUTPUT_SCALE and module in self.kv_outputs):
            return Extra(FLOAT_TAGS, _SCALAR)
        return None

    def extra(self, name: str) -> Extra | None:
        """The optional tensor ``name`` is (a kv-cache scale, or a per-module extra of its format), or None."""
        kv = self.kv_extra(name)
        if kv is not None:
            return kv
        module, _, param = name.rpartition(".")
        q = self.quantized.get(module)
        return module_extras(module, *q).get(param) if q is not None else None

    def dtype_ok(self, expected: str, got: str, name: str = "") -> bool:
        return dtype_ok(expected, got, name)


def dtype_ok(expected: str, got: str, name: str = "") -> bool:
    """Whether a tensor stored as ``got`` is the ``expected`` dtype tag of its layout: a dense
    tensor in any float width, ``weight_shape`` in any integer width, everything else exactly."""
    if got == expected or (expected in FLOAT_TAGS and got in FLOAT_TAGS):
        return True
    return expected in INT_TAGS and got in INT_TAGS and name.rpartition(".")[2] in _ANY_INT_WIDTH


def _draft_family(dc: DraftConfig) -> str:
    return "speculators" if dc.speculators else "eagle3-mla" if dc.mla else "eagle3-llama"


def schema_for(cfg: dict[str, Any], typed: TextStackConfig | DraftConfig, where: str = "config.json",
               names: set[str] | None = None) -> Schema:
    """The schema of the checkpoint ``cfg`` describes. ``names`` (the tensors in its files) picks
    between the spellings a family allows (a draft's ``midlayer.`` or ``layers.0.``)."""
    specs = {t.name: t for t in sizing.config_tensors(cfg, where)}
    quantized = _quantized_linears(cfg, where)
    kv_outputs = _kv_output_modules(cfg, where)
    if isinstance(typed, DraftConfig):
        return _draft_schema(specs, typed, names or set(), quantized, _kv_scales(cfg), kv_outputs)
    alts = _dense_alternatives(quantized)
    mtp = typed.num_nextn_predict_layers
    prefix = "language_model.model.layers." if isinstance(cfg.get("text_config"), dict) else "model.layers."
    optional = {n for n in specs if (m := _LAYER.match(n)) and int(m.group("i")) >= typed.num_hidden_layers}
    family = "kimi-k2.5" if isinstance(cfg.get("text_config"), dict) else "deepseek-v3"
    return Schema(family, specs, frozenset(optional), typed.num_hidden_layers, prefix, mtp, dense_alternatives=alts,
                  quantized=quantized, attention=_attention_modules(specs) if _kv_scales(cfg) else frozenset(),
                  kv_outputs=kv_outputs)


def _kv_output_modules(cfg: dict[str, Any], where: str) -> frozenset[str]:
    """The Linears whose output a Quark kv-cache scheme quantizes: ``kv_cache_quant_config``'s keys
    (``*k_proj``, ``*v_proj``, ``*kv_b_proj``...) matched as Quark and vLLM match layer patterns
    (fnmatch with ``*``, else a substring)."""
    qc = sizing.quantization_config(cfg)
    pats = list((qc or {}).get("kv_cache_quant_config") or {}) if qc and qc.get("quant_method") == "quark" else []
    if not pats:
        return frozenset()
    return frozenset(w.name for w in sizing.logical_weights(cfg, where) if w.kind == "linear"
                     and any(fnmatch.fnmatchcase(w.name, p) if "*" in p else p in w.name for p in map(str, pats)))


def _kv_scales(cfg: dict[str, Any]) -> bool:
    qc = sizing.quantization_config(cfg)
    return qc is not None and qc.get("quant_method") in _KV_SCALE_METHODS


def _attention_modules(specs: dict[str, TensorSpec]) -> frozenset[str]:
    """``...self_attn`` of every layer with attention weights: where a kv-cache scheme puts its scales."""
    tag = ".self_attn."
    return frozenset(n[: n.index(tag) + len(tag) - 1] for n in specs if tag in n)


def _quantized_linears(cfg: dict[str, Any], where: str) -> dict[str, tuple[int, int, LinearFormat]]:
    fmt = sizing.resolver(cfg, where)
    out = {}
    for w in sizing.logical_weights(cfg, where):
        if w.kind in ("linear", "router"):
            f = fmt(w.name, w.kind)
            if f.scheme != sizing.DENSE:
                out[w.name] = (w.shape[0], w.shape[1], f)
    return out


def _dense_alternatives(quantized: dict[str, tuple[int, int, LinearFormat]]
                        ) -> dict[str, tuple[tuple[str, ...], TensorSpec]]:
    out = {}
    for module, (n, k, f) in quantized.items():
        q = tuple(t.name for t in sizing.linear_tensors(module, n, k, f))
        out[module] = (q, TensorSpec(f"{module}.weight", "BF16", (n, k)))
    return out


def _draft_schema(specs: dict[str, TensorSpec], dc: DraftConfig, names: set[str],
                  quantized: dict[str, tuple[int, int, LinearFormat]], kv_scales: bool,
                  kv_outputs: frozenset[str]) -> Schema:
    # sizing names the decoder layer as the engines' canonical spelling; a checkpoint in the other one
    # (both load everywhere) is the same draft.
    here = "layers.0." if any(n.startswith("layers.0.") for n in names) else "midlayer."
    other = "midlayer." if here == "layers.0." else "layers.0."

    def spelled(n: str) -> str:
        return here + n[len(other):] if n.startswith(other) else n
    specs = {spelled(n): TensorSpec(spelled(s.name), s.dtype, s.shape) for n, s in specs.items()}
    quantized = {spelled(m): q for m, q in quantized.items()}
    kv_outputs = frozenset(spelled(m) for m in kv_outputs)
    V, Vd = dc.vocab_size, dc.draft_vocab_size
    optional = {"t2d"}
    if Vd == V:
        # SpecForge's Eagle3 model saves both vocabulary buffers even with the full vocabulary (an
        # identity map: d2t all 0, t2d all true); the check reads their values.
        for t in (TensorSpec(keys.D2T, "I64", (V,)), TensorSpec(keys.T2D, "BOOL", (V,))):
            specs[t.name] = t
            optional.add(t.name)
    emb = TensorSpec("embed_tokens.weight", "BF16", (V, dc.hidden_size))
    specs.setdefault(emb.name, emb)
    optional.add(emb.name)
    # speculators' norm_before_fc: one RMSNorm over the concatenated aux states, before fc
    inorm = TensorSpec("input_norm.weight", "BF16", (dc.num_aux_hidden_states * dc.target_hidden_size,))
    specs[inorm.name] = inorm
    optional.add(inorm.name)
    return Schema(_draft_family(dc), specs, frozenset(n for n in optional if n in specs),
                  vocab_map=(V, Vd) if Vd != V else None, quantized=quantized,
                  attention=_attention_modules(specs) if kv_scales else frozenset(), kv_outputs=kv_outputs)


__all__ = ["Schema", "Extra", "schema_for", "module_extras", "stored_format", "dtype_ok", "FLOAT_TAGS", "INT_TAGS"]
