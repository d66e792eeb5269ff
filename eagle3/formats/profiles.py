"""Per-engine EAGLE-3 / 3.1 draft profiles: what each serving engine registers, loads best and reads.

``eagle3 convert --engine E`` writes a draft in the form of profile ``E``. A profile is format
knowledge only (this module does no I/O): the architecture name the engine's registry maps to its
draft class, the decoder-layer key prefix its loader takes natively, which tensors it can hold,
how it reads the aux-layer ids, and how the config is laid out (plain HF config or the
speculators format). :func:`render_config` turns a normalised :class:`DraftSpec` into the
``config.json`` of a profile.

Sources: the engines' draft loaders (config fields and who reads them),
4 (vLLM: ``llama_eagle3.py``/``deepseek_eagle3.py``, speculators config path ``update_eagle3``),
5 (SGLang: ``llama_eagle3.py``, ``kimi_k25_eagle3.py``, aux capture heuristic), 7 (speculators
on-disk format), 8 (aux-id conventions), 9 (ATOM), 11 (key names) and 12 (checklist).

Choices made here, and why:

* Layer prefix: vLLM's mapper turns ``midlayer.`` into its own ``layers.0.``; ATOM's Llama model
  names the layer ``midlayer`` and maps ``layers.0.`` onto it, while its MLA model is built with
  ``layers.0``; SGLang's Llama loader (old versions) only knows ``midlayer`` and its MLA loader
  maps ``layers.0.`` to ``midlayer``; speculators writes ``layers.0.``. Each profile writes the
  engine's native spelling, so no loader-side rename is needed.
* ``draft_vocab_size`` is always written: SGLang reads ``null`` as "take the target's lm_head".
* ``eagle_config`` always carries ``use_aux_hidden_state: true``: ATOM reads a missing key as False.
* Aux ids go top-level *and* into ``eagle_config`` (vLLM reads the top level first, SGLang and
  ATOM read ``eagle_config``), with the same ids in both places so that no reader sees a conflict.
  vLLM, ATOM, speculators and eagle3 get the "input to layer k" convention. SGLang shifts ids by
  +1 only when the first id is 1 (PR #25454; before it, always), so the SGLang profile writes the
  "output of layer k" ids when they start at 1 (right for every SGLang version), else the input ids
  (right since PR #25454) -- see :func:`sglang_aux_ids`.
* ``norm_before_residual`` is always written: vLLM's speculators path defaults it to True.
* ``t2d`` is a training-only mask that every serving engine skips: dropped, except in the
  speculators format, whose loader derives the target vocab size from it; there it is regenerated
  from ``d2t`` (``t2d[d + d2t[d]] = True``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3.formats import keys

Variant = Literal["llama", "mla"]
ENGINES = ("vllm", "sglang", "atom", "speculators", "eagle3")

# Top-level config fields that describe the EAGLE head rather than the draft's decoder layer; the
# converter owns them (normalises, then writes them per profile). Everything else in a source config
# is a decoder-layer / model field and is carried over unchanged.
EAGLE_FIELDS = frozenset({
    "architectures", "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm",
    "use_aux_norm", "norm_output", "norm_before_fc", "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids", "eagle_config", "quantization_config", "eagle3_canonical",
})
# Fields that only exist in the speculators format (never carried into a plain HF config).
SPECULATORS_FIELDS = frozenset({
    "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "auto_map", "embed_requires_grad",
})
# Token ids and dtype live at the top level in both layouts (speculators copies them up too).
TOP_LEVEL_COMMON = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")

CANONICAL_VERSION = 1
SPECULATORS_VERSION = "0.3.0"  # the speculators release whose Eagle3 config has fc_norm/norm_output
DEFAULT_VERIFIER = "moonshotai/Kimi-K2.5"
DEFAULT_VERIFIER_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)
DEFAULT_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class DraftProfile:
    """How one engine wants an EAGLE-3 / 3.1 draft on disk."""

    engine: str
    architecture: dict[str, str]  # variant -> architecture name written
    registered: dict[str, frozenset[str]]  # variant -> names the engine's registry accepts
    layer_prefix: dict[str, str]  # variant -> native decoder-layer key prefix
    accepted_prefixes: dict[str, frozenset[str]]  # variant -> prefixes its loader maps onto the native one
    variants: frozenset[str]  # draft attention variants the engine implements
    reads: tuple[str, ...]  # config fields the engine's draft path reads (documentation and report)
    aux_convention: str  # "input" | "sglang" (see sglang_aux_ids)
    config_style: str  # "hf" | "speculators"
    d2t: bool  # loads the draft->target offset map (reduced draft vocabulary)
    t2d: str  # "drop" | "regenerate"
    input_norm: bool  # norm_before_fc (input_norm.weight over n_aux * H_t)
    fc_norm: bool  # EAGLE-3.1 per-aux fc_norm.{i}.weight
    norm_before_residual: bool  # honours norm_before_residual=True
    attention_bias: bool  # q/k/v/o biases of the Llama draft layer
    multi_layer: bool  # drafts with num_hidden_layers > 1
    rope_scaling_llama: bool  # the Llama draft honours rope_scaling (ATOM's uses rope_theta only)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def arch(self, variant: str) -> str:
        return self.architecture[variant]

    def prefix(self, variant: str) -> str:
        return self.layer_prefix[variant]


_L, _M = "llama", "mla"

PROFILES: dict[str, DraftProfile] = {
    # vLLM registry: LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM -> llama_eagle3,
    # Eagle3DeepseekV2/V3ForCausalLM -> deepseek_eagle3; both models map midlayer. -> layers.0.
    "vllm": DraftProfile(
        engine="vllm",
        architecture={_L: "Eagle3LlamaForCausalLM", _M: "Eagle3DeepseekV2ForCausalLM"},
        registered={_L: frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}),
                    _M: frozenset({"Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"})},
        layer_prefix={_L: keys.LAYERS0, _M: keys.LAYERS0},
        accepted_prefixes={_L: frozenset({keys.LAYERS0, keys.MIDLAYER}), _M: frozenset({keys.LAYERS0, keys.MIDLAYER})},
        variants=frozenset({_L, _M}),
        reads=("draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm", "norm_output",
               "norm_before_fc", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
               "eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_config.use_aux_hidden_state",
               "eagle_config.norm_before_fc", "logit_scale"),
        aux_convention="input", config_style="hf", d2t=True, t2d="drop", input_norm=True, fc_norm=True,
        norm_before_residual=True, attention_bias=True, multi_layer=True, rope_scaling_llama=True,
        notes=("fc_norm needs vLLM >= 0.22 (PR #42764; PR #43482 for the MLA draft)",),
    ),
    # SGLang: llama_eagle3.py (LlamaForCausalLMEagle3, native midlayer), kimi_k25_eagle3.py
    # (Eagle3DeepseekV2ForCausalLM, maps layers.0. -> midlayer.).
    "sglang": DraftProfile(
        engine="sglang",
        architecture={_L: "LlamaForCausalLMEagle3", _M: "Eagle3DeepseekV2ForCausalLM"},
        registered={_L: frozenset({"LlamaForCausalLMEagle3"}), _M: frozenset({"Eagle3DeepseekV2ForCausalLM"})},
        layer_prefix={_L: keys.MIDLAYER, _M: keys.MIDLAYER},
        accepted_prefixes={_L: frozenset({keys.MIDLAYER}), _M: frozenset({keys.MIDLAYER, keys.LAYERS0})},
        variants=frozenset({_L, _M}),
        reads=("draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm", "use_aux_norm",
               "norm_output", "norm_before_fc", "eagle_config.eagle_aux_hidden_state_layer_ids",
               "eagle_config.use_aux_hidden_state", "tie_word_embeddings", "bias"),
        aux_convention="sglang", config_style="hf", d2t=True, t2d="drop", input_norm=True, fc_norm=True,
        norm_before_residual=False, attention_bias=True, multi_layer=False, rope_scaling_llama=True,
        notes=("SGLang replaces the draft's embed_tokens with the target's unless target_hidden_size != "
               "hidden_size", "fc_norm / norm_output need SGLang with PR #24663 (Llama) / #26506 (MLA)"),
    ),
    # ATOM: hf_config_override rewrites LlamaForCausalLMEagle3 -> Eagle3LlamaModel and
    # Eagle3DeepseekV2ForCausalLM -> Eagle3DeepseekMLAModel; the Llama model is named midlayer (maps
    # layers.0. onto it), the MLA model layers.0.
    "atom": DraftProfile(
        engine="atom",
        architecture={_L: "LlamaForCausalLMEagle3", _M: "Eagle3DeepseekV2ForCausalLM"},
        registered={_L: frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaModel"}),
                    _M: frozenset({"Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekMLAModel"})},
        layer_prefix={_L: keys.MIDLAYER, _M: keys.LAYERS0},
        accepted_prefixes={_L: frozenset({keys.MIDLAYER, keys.LAYERS0}), _M: frozenset({keys.LAYERS0})},
        variants=frozenset({_L, _M}),
        reads=("target_hidden_size", "num_aux_hidden_states", "fc_norm", "norm_output",
               "eagle_config.use_aux_hidden_state", "eagle_config.eagle_aux_hidden_state_layer_ids",
               "rope_theta", "kv_lora_rank"),
        aux_convention="input", config_style="hf", d2t=False, t2d="drop", input_norm=False, fc_norm=True,
        norm_before_residual=False, attention_bias=False, multi_layer=False, rope_scaling_llama=False,
        notes=("ATOM's lm_head has vocab_size rows (no d2t): reduced-vocabulary drafts cannot be served",),
    ),
    # vllm-project/speculators Eagle3Speculator (vLLM's SpeculatorsConfig -> update_eagle3).
    "speculators": DraftProfile(
        engine="speculators",
        architecture={_L: "Eagle3Speculator"},
        registered={_L: frozenset({"Eagle3Speculator", "Eagle3DraftModel"})},
        layer_prefix={_L: keys.LAYERS0},
        accepted_prefixes={_L: frozenset({keys.LAYERS0})},
        variants=frozenset({_L}),
        reads=("speculators_model_type", "speculators_config.proposal_methods.0.speculative_tokens",
               "speculators_config.verifier.name_or_path", "transformer_layer_config", "draft_vocab_size",
               "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
               "eagle_aux_hidden_state_layer_ids"),
        aux_convention="input", config_style="speculators", d2t=True, t2d="regenerate", input_norm=True,
        fc_norm=True, norm_before_residual=True, attention_bias=True, multi_layer=True, rope_scaling_llama=True,
        notes=("vLLM builds the draft config from transformer_layer_config (a Llama layer): no MLA drafts",),
    ),
    # eagle3's own runtime: one canonical form, every field explicit, input-convention aux ids.
    "eagle3": DraftProfile(
        engine="eagle3",
        architecture={_L: "Eagle3LlamaForCausalLM", _M: "Eagle3DeepseekV2ForCausalLM"},
        registered={_L: frozenset({"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}),
                    _M: frozenset({"Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"})},
        layer_prefix={_L: keys.LAYERS0, _M: keys.LAYERS0},
        accepted_prefixes={_L: frozenset({keys.LAYERS0, keys.MIDLAYER}), _M: frozenset({keys.LAYERS0, keys.MIDLAYER})},
        variants=frozenset({_L, _M}),
        reads=("draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm", "norm_output",
               "norm_before_fc", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "eagle3_canonical"),
        aux_convention="input", config_style="hf", d2t=True, t2d="drop", input_norm=True, fc_norm=True,
        norm_before_residual=True, attention_bias=True, multi_layer=True, rope_scaling_llama=True,
    ),
}


def get_profile(engine: str) -> DraftProfile:
    try:
        return PROFILES[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})") from None


# ---------------------------------------------------------------------------------------------
# Aux-layer ids
# ---------------------------------------------------------------------------------------------


def sglang_aux_ids(input_ids: list[int]) -> tuple[list[int], str, str | None]:
    """Ids for SGLang's ``eagle_config`` and a warning when no form is right for every version.

    SGLang adds +1 to configured ids only when the first id is 1 (PR #25454); before that PR it
    always added +1. Returns (ids, convention written, warning or None)."""
    out = [i - 1 for i in input_ids]
    if out and out[0] == 1:
        return out, "output", None  # shifted by every SGLang version -> the right layers
    if input_ids and input_ids[0] != 1:
        return list(input_ids), "input", (
            f"SGLang aux ids written as {list(input_ids)} (input convention): right for SGLang with PR #25454; "
            f"older SGLang adds +1 to every id")
    # input ids start at 1: newer SGLang would shift them, so only output ids (first id 0) work, and
    # only on SGLang before PR #25454.
    return out, "output", (
        f"SGLang aux ids written as {out} (output convention): only SGLang before PR #25454 reads ids starting "
        f"at 0 as outputs; newer SGLang reads them as inputs")


def profile_aux_ids(profile: DraftProfile, input_ids: list[int]) -> tuple[list[int], str, str | None]:
    """(ids to write, their convention, warning) for ``profile``."""
    if profile.aux_convention == "sglang":
        return sglang_aux_ids(input_ids)
    return list(input_ids), "input", None


# ---------------------------------------------------------------------------------------------
# The normalised draft and its per-profile config
# ---------------------------------------------------------------------------------------------


@dataclass
class DraftSpec:
    """Everything an engine needs to know about a draft, normalised from any source format.

    ``layer`` is the decoder-layer config (Llama or DeepSeek-MLA fields, ``vocab_size`` = the
    target vocabulary, ``hidden_size`` = the draft width); ``extra`` holds source top-level fields
    that are neither layer nor EAGLE fields (carried into plain HF configs)."""

    variant: str
    layer: dict[str, Any]
    draft_vocab_size: int
    target_hidden_size: int
    aux_input_ids: list[int]
    fc_norm: bool
    norm_output: bool
    norm_before_fc: bool
    norm_before_residual: bool
    use_aux_hidden_state: bool = True
    eagle_config_extra: dict[str, Any] = field(default_factory=dict)  # other eagle_config keys of the source
    extra: dict[str, Any] = field(default_factory=dict)
    quantization_config: dict[str, Any] | None = None
    speculators_config: dict[str, Any] | None = None
    speculators_version: str | None = None
    verifier: str | None = None
    verifier_architectures: list[str] | None = None

    @property
    def num_aux(self) -> int:
        return len(self.aux_input_ids)

    @property
    def vocab_size(self) -> int | None:
        return self.layer.get("vocab_size")

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])


def eagle_flags(spec: DraftSpec) -> dict[str, Any]:
    """The EAGLE-3/3.1 config fields every profile writes explicitly (engines default them differently)."""
    return {
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "num_aux_hidden_states": spec.num_aux,
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        "norm_before_fc": spec.norm_before_fc,
        "norm_before_residual": spec.norm_before_residual,
    }


def render_config(profile: DraftProfile, spec: DraftSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` of ``spec`` in ``profile``'s layout; returns (config, aux facts for the report)."""
    ids, conv, warn = profile_aux_ids(profile, spec.aux_input_ids)
    aux = {"written": ids, "convention": conv, "input_ids": list(spec.aux_input_ids), "warning": warn}
    eagle_config = {**copy.deepcopy(spec.eagle_config_extra), "eagle_aux_hidden_state_layer_ids": list(ids),
                    "use_aux_hidden_state": spec.use_aux_hidden_state}
    flags = {
        **eagle_flags(spec),
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "eagle_config": eagle_config,
    }
    if profile.config_style == "speculators":
        return _render_speculators(profile, spec, flags), aux
    cfg: dict[str, Any] = {"architectures": [profile.arch(spec.variant)]}
    cfg.update(copy.deepcopy(spec.extra))
    cfg.update(copy.deepcopy(spec.layer))
    cfg.update(flags)
    if spec.quantization_config is not None:
        cfg["quantization_config"] = copy.deepcopy(spec.quantization_config)
    if profile.engine == "eagle3":
        cfg["eagle3_canonical"] = {"version": CANONICAL_VERSION, "aux_layer_ids_convention": "input",
                                   "layer_prefix": profile.prefix(spec.variant).rstrip(".")}
    return cfg, aux


def _render_speculators(profile: DraftProfile, spec: DraftSpec, flags: dict[str, Any]) -> dict[str, Any]:
    layer = copy.deepcopy(spec.layer)
    # vLLM's update_eagle3 picks the draft class from transformer_layer_config.model_type.
    layer.setdefault("model_type", "llama")
    layer["architectures"] = ["LlamaForCausalLM"] if layer["model_type"] == "llama" else layer.get(
        "architectures", ["LlamaForCausalLM"])
    sc = copy.deepcopy(spec.speculators_config) if spec.speculators_config else {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": DEFAULT_SPECULATIVE_TOKENS, "verifier_accept_k": 1}],
        "verifier": {},
    }
    ver = sc.setdefault("verifier", {})
    if spec.verifier is not None:
        ver["name_or_path"] = spec.verifier
    ver.setdefault("name_or_path", DEFAULT_VERIFIER)
    if spec.verifier_architectures is not None:
        ver["architectures"] = list(spec.verifier_architectures)
    ver.setdefault("architectures", list(DEFAULT_VERIFIER_ARCHITECTURES))
    cfg: dict[str, Any] = {
        "architectures": [profile.arch(spec.variant)],
        "speculators_model_type": "eagle3",
        "speculators_version": spec.speculators_version or SPECULATORS_VERSION,
        "speculators_config": sc,
        **flags,
        "transformer_layer_config": layer,
    }
    for k in TOP_LEVEL_COMMON:
        if k in spec.layer:
            cfg[k] = copy.deepcopy(spec.layer[k])
        elif k in spec.extra:
            cfg[k] = copy.deepcopy(spec.extra[k])
    if spec.quantization_config is not None:
        cfg["quantization_config"] = copy.deepcopy(spec.quantization_config)
    return cfg


def split_source_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split a draft config (either layout) into (layer fields, EAGLE fields, other top-level fields).

    In the speculators layout the layer config is ``transformer_layer_config`` and the top-level
    token ids / dtype are kept in the layer config too (where HF-style drafts keep them)."""
    tlc = cfg.get("transformer_layer_config")
    eagle = {k: copy.deepcopy(v) for k, v in cfg.items() if k in EAGLE_FIELDS}
    if isinstance(tlc, dict):
        layer = copy.deepcopy(tlc)
        layer.pop("architectures", None)
        for k in TOP_LEVEL_COMMON:
            if k in cfg and k not in layer:
                layer[k] = copy.deepcopy(cfg[k])
        extra = {k: copy.deepcopy(v) for k, v in cfg.items()
                 if k not in EAGLE_FIELDS and k not in SPECULATORS_FIELDS and k not in TOP_LEVEL_COMMON}
        return layer, eagle, extra
    layer = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in EAGLE_FIELDS and k not in SPECULATORS_FIELDS}
    return layer, eagle, {}


# ---------------------------------------------------------------------------------------------
# quantization_config key renames (quantized drafts keep their tensors; names must follow)
# ---------------------------------------------------------------------------------------------

_PREFIX_SPELLINGS = {
    keys.MIDLAYER: ("midlayer.", "midlayer\\."),
    keys.LAYERS0: ("layers.0.", "layers\\.0\\."),
}


def rename_quant_config(qc: dict[str, Any], to_prefix: str) -> tuple[dict[str, Any], int]:
    """Rewrite the draft layer prefix inside a quantization_config (Quark ``exclude``,
    ``layer_quant_config`` / ``kv_cache_quant_config`` patterns, ``export.kv_cache_group``;
    compressed-tensors ``ignore`` and ``config_groups.*.targets``), literal and regex-escaped
    spellings alike. Returns (new config, number of strings changed)."""
    (src_prefix,) = [p for p in _PREFIX_SPELLINGS if p != to_prefix]
    (lit_from, re_from), (lit_to, re_to) = _PREFIX_SPELLINGS[src_prefix], _PREFIX_SPELLINGS[to_prefix]
    changed = 0

    def fix(s: str) -> str:
        nonlocal changed
        new = s.replace(re_from, re_to).replace(lit_from, lit_to)
        changed += new != s
        return new

    out = copy.deepcopy(qc)
    for k in ("exclude", "ignore"):
        if isinstance(out.get(k), list):
            out[k] = [fix(x) if isinstance(x, str) else x for x in out[k]]
    for k in ("layer_quant_config", "kv_cache_quant_config"):
        if isinstance(out.get(k), dict):
            out[k] = {fix(p) if isinstance(p, str) else p: v for p, v in out[k].items()}
    exp = out.get("export")
    if isinstance(exp, dict) and isinstance(exp.get("kv_cache_group"), list):
        exp["kv_cache_group"] = [fix(x) if isinstance(x, str) else x for x in exp["kv_cache_group"]]
    groups = out.get("config_groups")
    if isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and isinstance(g.get("targets"), list):
                g["targets"] = [fix(x) if isinstance(x, str) else x for x in g["targets"]]
    return out, changed


# ---------------------------------------------------------------------------------------------
# Tensor roles (what a draft may contain) -- used to refuse silently dropping anything
# ---------------------------------------------------------------------------------------------

# Layer-relative module names of the draft decoder layer; their weight may be quantized, so any
# quantization parameter (keys.QUANT_PARAMS) of these modules is allowed too.
_LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MLA_LINEARS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_MLA_NORMS = ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")
_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def tensor_role(name: str, variant: str) -> str | None:
    """Role of a canonically named draft tensor (``layers.N.`` prefix, ``fc_norm.{i}``), or None
    for a tensor no EAGLE-3 draft format defines.

    Roles: embed, fc, fc_norm, input_norm, norm, lm_head, d2t, t2d, layer (a Linear weight or one of
    its quantization parameters, or a norm), bias, and "<role>_quant" for quantization parameters of
    fc / lm_head."""
    if name in (keys.D2T, keys.T2D):
        return name
    if name == keys.DRAFT_EMBED:
        return "embed"
    if name == keys.DRAFT_NORM:
        return "norm"
    if name == keys.DRAFT_INPUT_NORM:
        return "input_norm"
    if keys.fc_norm_index(name) is not None:
        return "fc_norm"
    mod, param = keys.split_param(name)
    if mod in ("fc", "lm_head"):
        if param == keys.WEIGHT:
            return mod
        if param in keys.QUANT_PARAMS:
            return mod + "_quant"
        return None
    prefix = keys.draft_layer_prefix(name)
    if prefix is None or prefix == keys.MIDLAYER:
        return None
    rel_mod = mod[len(prefix):]
    linears = _MLA_LINEARS if variant == "mla" else _LLAMA_LINEARS
    if rel_mod in linears and param in keys.QUANT_PARAMS:
        return "layer"
    if rel_mod in _LAYER_NORMS + (_MLA_NORMS if variant == "mla" else ()) and param == keys.WEIGHT:
        return "layer"
    if variant == "llama" and rel_mod in _BIASES and param == "bias":
        return "bias"
    if rel_mod in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") and param == "bias":
        return "bias"
    return None


def representable(profile: DraftProfile, role: str) -> str | None:
    """Why ``profile`` cannot hold a tensor of ``role`` (None when it can)."""
    if role == "d2t" and not profile.d2t:
        return f"{profile.engine} has no draft->target vocabulary map (d2t)"
    if role == "input_norm" and not profile.input_norm:
        return f"{profile.engine} has no norm_before_fc input_norm"
    if role == "fc_norm" and not profile.fc_norm:
        return f"{profile.engine} has no EAGLE-3.1 fc_norm"
    if role == "bias" and not profile.attention_bias:
        return f"{profile.engine}'s draft layer has no biases"
    return None
