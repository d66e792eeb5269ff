"""One schema per architecture family: the exact tensors (name, dtype, shape) a checkpoint must hold,
derived from its typed config (:mod:`eagle3.formats.model_config`).

The layouts themselves live in :mod:`eagle3.formats.sizing` (the architectures' logical weights and,
per quantization scheme, what each Linear stores: packed weights, scales, zero points); ``eagle3 plan``,
``quantize``'s expected output (:func:`eagle3.quantize.native.expected_shapes`) and this schema all
derive from those functions, so there is one description of every format. What the schema adds is
what a checkpoint may legitimately vary in:

* drafts: the decoder layer's prefix (``midlayer.`` in SpecForge / EAGLE checkpoints, ``layers.0.`` in
  MLA and speculators ones; every engine loads both), the draft's own ``embed_tokens`` (SpecForge's
  reduced-vocabulary export drops it and uses the target's) and ``t2d`` (vLLM and SGLang read ``d2t``
  only);
* targets: the MTP layers after ``num_hidden_layers`` (DeepSeek-V3 ships one; engines skip it) and a
  K2.5 vision tower and projector left in a text-only checkpoint: named here as allowed extras.

Families: ``kimi-k2.5`` (the wrapper: ``language_model.`` text stack + MoonViT tower + projector),
``deepseek-v3`` (a bare text stack, as ``convert --text-only`` writes it), ``eagle3-llama``,
``eagle3-mla`` and ``speculators``; the source format (compressed-tensors INT4, FP8 block, bf16/fp32,
Quark W4A8 / MXFP4 / INT4 / FP8) is read from ``quantization_config`` (:func:`sizing.resolver`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from eagle3.formats import sizing
from eagle3.formats.model_config import DraftConfig, TextStackConfig
from eagle3.formats.sizing import TensorSpec

FLOAT_TAGS = frozenset({"BF16", "F16", "F32"})  # a dense tensor may be stored in any of these
_LAYER = re.compile(r"^(?P<p>(?:language_model\.)?model\.layers\.)(?P<i>\d+)\.")
_VISION = re.compile(r"^(?:vision_tower|mm_projector|multi_modal_projector)\.")
_BUFFERS = re.compile(r"(?:^|\.)rotary_emb\.inv_freq$")


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

    def dtype_ok(self, expected: str, got: str) -> bool:
        return got == expected or (expected in FLOAT_TAGS and got in FLOAT_TAGS)


def _draft_family(dc: DraftConfig) -> str:
    return "speculators" if dc.speculators else "eagle3-mla" if dc.mla else "eagle3-llama"


def schema_for(cfg: dict[str, Any], typed: TextStackConfig | DraftConfig, where: str = "config.json",
               names: set[str] | None = None) -> Schema:
    """The schema of the checkpoint ``cfg`` describes. ``names`` (the tensors in its files) picks
    between the spellings a family allows (a draft's ``midlayer.`` or ``layers.0.``)."""
    specs = {t.name: t for t in sizing.config_tensors(cfg, where)}
    if isinstance(typed, DraftConfig):
        return _draft_schema(specs, typed, names or set())
    alts = _dense_alternatives(cfg, where)
    mtp = typed.num_nextn_predict_layers
    prefix = "language_model.model.layers." if isinstance(cfg.get("text_config"), dict) else "model.layers."
    optional = {n for n in specs if (m := _LAYER.match(n)) and int(m.group("i")) >= typed.num_hidden_layers}
    family = "kimi-k2.5" if isinstance(cfg.get("text_config"), dict) else "deepseek-v3"
    return Schema(family, specs, frozenset(optional), typed.num_hidden_layers, prefix, mtp, dense_alternatives=alts)


def _dense_alternatives(cfg: dict[str, Any], where: str) -> dict[str, tuple[tuple[str, ...], TensorSpec]]:
    fmt = sizing.resolver(cfg, where)
    out = {}
    for w in sizing.logical_weights(cfg, where):
        if w.kind in ("linear", "router"):
            f = fmt(w.name, w.kind)
            if f.scheme != sizing.DENSE:
                n, k = w.shape
                q = tuple(t.name for t in sizing.linear_tensors(w.name, n, k, f))
                out[w.name] = (q, TensorSpec(f"{w.name}.weight", "BF16", (n, k)))
    return out


def _draft_schema(specs: dict[str, TensorSpec], dc: DraftConfig, names: set[str]) -> Schema:
    # sizing names the decoder layer as the engines' canonical spelling; a checkpoint in the other one
    # (both load everywhere) is the same draft.
    here = "layers.0." if any(n.startswith("layers.0.") for n in names) else "midlayer."
    other = "midlayer." if here == "layers.0." else "layers.0."
    specs = {(here + n[len(other):] if n.startswith(other) else n):
             TensorSpec(here + s.name[len(other):] if s.name.startswith(other) else s.name, s.dtype, s.shape)
             for n, s in specs.items()}
    V, Vd = dc.vocab_size, dc.draft_vocab_size
    optional = {"t2d"}
    emb = TensorSpec("embed_tokens.weight", "BF16", (V, dc.hidden_size))
    specs.setdefault(emb.name, emb)
    optional.add(emb.name)
    # speculators' norm_before_fc: one RMSNorm over the concatenated aux states, before fc
    inorm = TensorSpec("input_norm.weight", "BF16", (dc.num_aux_hidden_states * dc.target_hidden_size,))
    specs[inorm.name] = inorm
    optional.add(inorm.name)
    return Schema(_draft_family(dc), specs, frozenset(n for n in optional if n in specs),
                  vocab_map=(V, Vd) if Vd != V else None)


__all__ = ["Schema", "schema_for", "FLOAT_TAGS"]
