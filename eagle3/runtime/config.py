"""Model specs: the typed, validated view of an HF ``config.json`` that the runtime models build on.

* :class:`TargetSpec` - DeepSeek-V3 / Kimi text stack (``text_config`` of the K2.5 wrapper, or the
  top level of a text-only K2 / K2-Thinking config).
* :class:`DraftSpec` - EAGLE-3 / 3.1 draft, Llama/MHA or MLA, native (``midlayer.*``), vLLM-style
  (``layers.0.*``) or speculators (``transformer_layer_config``) configs.
* :class:`RopeSpec` - shared; :class:`QuantSpec` (what ``quantization_config`` asks of the runtime) is
  parsed by :mod:`eagle3.formats.quant_detect`, the one reader of that field.

Which checkpoint is which (family, flags, aux-id convention, vocabulary maps) is decided by
``eagle3.formats.detect``; this module only turns those facts and the config's numbers into specs.
The fields follow the checkpoints' ``config.json`` (DeepSeek-V3 / Kimi text config; EAGLE-3 drafts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from eagle3.errors import FormatError
from eagle3.formats.quant_detect import QuantSpec  # noqa: F401 (the specs' quant field; parsed in formats)

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _req(cfg: dict[str, Any], key: str, where: str, kind: type = int) -> Any:
    v = cfg.get(key)
    if v is None:
        raise FormatError(f"{where}: field '{key}' is missing")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise FormatError(f"{where}: field '{key}' is {v!r}, expected an integer")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise FormatError(f"{where}: field '{key}' is {v!r}, expected a number")
    return kind(v)


def _opt_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int | None:
    v = cfg.get(key)
    return default if v is None else int(v)


def _eos_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(i) for i in v)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeSpec:
    """RoPE over ``dim`` dims. ``kind``: default | linear | dynamic (treated as default at
    inference for positions below the original length) | yarn | llama3.

    ``interleaved``: rotate pairs ``(x[2i], x[2i+1])`` (DeepSeek / Kimi MLA, vLLM
    ``is_neox_style=False``); otherwise NeoX halves (Llama drafts)."""

    dim: int
    theta: float
    interleaved: bool
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @staticmethod
    def from_config(cfg: dict[str, Any], dim: int, interleaved: bool, where: str) -> RopeSpec:
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        r: dict[str, Any] = {}
        for d in (params, scaling):  # transformers 5 writes rope_parameters; files carry rope_scaling
            if isinstance(d, dict):
                r = {**d, **r}
        theta = cfg.get("rope_theta", r.get("rope_theta", 10000.0))
        kind = str(r.get("rope_type") or r.get("type") or "default")
        if kind not in ("default", "linear", "dynamic", "yarn", "llama3", "deepseek_yarn"):
            raise FormatError(f"{where}: rope type {kind!r} is not supported (default, linear, dynamic, yarn, llama3)")
        if kind == "deepseek_yarn":
            kind = "yarn"

        def num(key: str, default: float | None) -> float | None:
            v = r.get(key)
            return default if v is None else float(v)

        return RopeSpec(
            dim=dim,
            theta=float(theta),
            interleaved=interleaved,
            kind=kind,
            factor=num("factor", 1.0) or 1.0,
            original_max_position_embeddings=_opt_int(r, "original_max_position_embeddings",
                                                      _opt_int(cfg, "max_position_embeddings")),
            beta_fast=num("beta_fast", 32.0) or 32.0,
            beta_slow=num("beta_slow", 1.0) or 1.0,
            mscale=num("mscale", None),
            mscale_all_dim=num("mscale_all_dim", None),
            attention_factor=num("attention_factor", None),
            low_freq_factor=num("low_freq_factor", 1.0) or 1.0,
            high_freq_factor=num("high_freq_factor", 4.0) or 4.0,
        )

    def softmax_mscale(self) -> float:
        """DeepSeek YaRN multiplies the MLA softmax scale by ``mscale(factor, mscale_all_dim)^2``
        (transformers ``DeepseekV3Attention``; 2.0047 for Kimi)."""
        if self.kind == "yarn" and self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---------------------------------------------------------------------------------------------
# Attention dims shared by the target and the MLA draft
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLASpec:
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeSpec
    latent_norm_eps: float  # q_a_layernorm / kv_a_layernorm eps (rms_norm_eps, or 1e-6 like HF)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale()

    @property
    def cache_width(self) -> int:
        """Values per token in the latent KV cache (and kv_a_proj's output): the normalised latent
        ``c`` then the RoPE'd shared key ``k_pe`` (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_config(cfg: dict[str, Any], where: str, eps: float, latent_norm_eps: float | None) -> MLASpec:
        dr = _req(cfg, "qk_rope_head_dim", where)
        return MLASpec(
            num_heads=_req(cfg, "num_attention_heads", where),
            q_lora_rank=_opt_int(cfg, "q_lora_rank"),
            kv_lora_rank=_req(cfg, "kv_lora_rank", where),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim", where),
            qk_rope_head_dim=dr,
            v_head_dim=_req(cfg, "v_head_dim", where),
            rope=RopeSpec.from_config(cfg, dr, interleaved=bool(cfg.get("rope_interleave", True)), where=where),
            latent_norm_eps=eps if latent_norm_eps is None else latent_norm_eps,
        )


@dataclass(frozen=True)
class MHASpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    attention_bias: bool = False

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetSpec:
    """DeepSeek-V3 / Kimi text stack. ``prefix`` is the tensor-name prefix of the text stack
    (``language_model.`` in the K2.5 wrapper, ``""`` in a text-only checkpoint)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str
    rms_norm_eps: float
    mla: MLASpec
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    prefix: str = ""
    quant: QuantSpec = field(default_factory=QuantSpec)
    model_type: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0

    @staticmethod
    def from_config(cfg: dict[str, Any], where: str = "config.json", prefix: str = "",
                    quant: dict[str, Any] | None = None, latent_norm_eps: float | None = None,
                    top: dict[str, Any] | None = None) -> TargetSpec:
        """``cfg`` is the text config; ``top`` the wrapper config (for eos/bos/tie fields)."""
        top = top or cfg
        eps = _req(cfg, "rms_norm_eps", where, float)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise FormatError(f"{where}: hidden_act {act!r} is not supported (silu)")
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring not in ("sigmoid", "softmax"):
            raise FormatError(f"{where}: scoring_func {scoring!r} is not supported (sigmoid, softmax)")
        n_routed = _opt_int(cfg, "n_routed_experts", 0) or 0
        return TargetSpec(
            vocab_size=_req(cfg, "vocab_size", where),
            hidden_size=_req(cfg, "hidden_size", where),
            num_layers=_req(cfg, "num_hidden_layers", where),
            intermediate_size=_req(cfg, "intermediate_size", where),
            moe_intermediate_size=_opt_int(cfg, "moe_intermediate_size", 0) or 0,
            first_k_dense_replace=_opt_int(cfg, "first_k_dense_replace", 0) or 0,
            moe_layer_freq=_opt_int(cfg, "moe_layer_freq", 1) or 1,
            n_routed_experts=n_routed,
            num_experts_per_tok=_opt_int(cfg, "num_experts_per_tok", 0) or 0,
            n_shared_experts=_opt_int(cfg, "n_shared_experts", 0) or 0,
            n_group=_opt_int(cfg, "n_group", 1) or 1,
            topk_group=_opt_int(cfg, "topk_group", 1) or 1,
            scoring_func=scoring,
            topk_method=str(cfg.get("topk_method", "noaux_tc")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            hidden_act=act,
            rms_norm_eps=eps,
            mla=MLASpec.from_config(cfg, where, eps, latent_norm_eps),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=_opt_int(cfg, "max_position_embeddings", 4096) or 4096,
            bos_token_id=_opt_int(cfg, "bos_token_id", _opt_int(top, "bos_token_id")),
            eos_token_ids=_eos_ids(top.get("eos_token_id", cfg.get("eos_token_id"))),
            prefix=prefix,
            quant=QuantSpec.from_config(quant, where),
            model_type=cfg.get("model_type"),
        )


# ---------------------------------------------------------------------------------------------
# Draft
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSpec:
    """One-layer EAGLE-3 / 3.1 draft. ``attention`` is ``"mha"`` (Llama) or ``"mla"``.

    Flags: ``fc_norm`` (3.1: an RMSNorm per aux chunk before fc),
    ``norm_before_fc`` (one RMSNorm over the whole aux concat), ``norm_output`` (3.1: carry the
    post-norm hidden), ``norm_before_residual`` (residual = hidden_norm(h)).
    ``aux_layer_ids`` are in the input-to-layer convention (None: the target's default)."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (embedding rows)
    draft_vocab_size: int  # lm_head rows
    rms_norm_eps: float
    attention: str
    mha: MHASpec | None
    mla: MLASpec | None
    num_aux: int
    aux_layer_ids: tuple[int, ...] | None
    layer_prefix: str  # "midlayer." | "layers.0."
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    own_embedding: bool = True
    own_lm_head: bool = True
    has_d2t: bool = False
    logit_scale: float = 1.0
    mlp_bias: bool = False
    eagle_version: str = "3"
    family: str = ""
    quant: QuantSpec = field(default_factory=QuantSpec)
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096

    @staticmethod
    def from_detected(cfg: dict[str, Any], layer_cfg: dict[str, Any], info: Any, family: str,
                      where: str, quant: dict[str, Any] | None = None,
                      latent_norm_eps: float | None = None) -> DraftSpec:
        """``info`` is ``eagle3.formats.detect.DraftInfo``; ``layer_cfg`` the config of the decoder
        layer (``transformer_layer_config`` for speculators, else the top level)."""
        if info.num_layers != 1:
            raise FormatError(f"{where}: num_hidden_layers is {info.num_layers}; the runtime runs one-layer drafts")
        if not info.aux_layers.use_aux_hidden_state:
            raise FormatError(f"{where}: eagle_config.use_aux_hidden_state is false; the runtime needs the "
                              f"aux-hidden-state (fc) form of EAGLE-3")
        eps = _req(layer_cfg, "rms_norm_eps", where, float)
        hidden = info.hidden_size
        mha = mla = None
        if info.attention == "mla":
            mla = MLASpec.from_config(layer_cfg, where, eps, latent_norm_eps)
        else:
            nh = _req(layer_cfg, "num_attention_heads", where)
            hd = _opt_int(layer_cfg, "head_dim") or hidden // nh
            mha = MHASpec(num_heads=nh, num_kv_heads=_opt_int(layer_cfg, "num_key_value_heads", nh) or nh,
                          head_dim=hd, rope=RopeSpec.from_config(layer_cfg, hd, interleaved=False, where=where),
                          attention_bias=bool(layer_cfg.get("attention_bias", False)))
        act = layer_cfg.get("hidden_act", "silu")
        if act != "silu":
            raise FormatError(f"{where}: hidden_act {act!r} is not supported (silu)")
        ids = info.aux_layers.input_ids
        vocab = info.vocab_size or _req(layer_cfg, "vocab_size", where)
        return DraftSpec(
            hidden_size=hidden,
            target_hidden_size=info.target_hidden_size,
            intermediate_size=_req(layer_cfg, "intermediate_size", where),
            vocab_size=vocab,
            draft_vocab_size=info.draft_vocab_size or vocab,
            rms_norm_eps=eps,
            attention=info.attention,
            mha=mha,
            mla=mla,
            num_aux=info.aux_layers.count,
            aux_layer_ids=tuple(ids) if ids else None,
            layer_prefix=info.layer_prefix + ".",
            fc_norm=info.fc_norm,
            norm_before_fc=info.norm_before_fc,
            norm_output=info.norm_output,
            norm_before_residual=info.norm_before_residual,
            own_embedding=info.own_embedding,
            own_lm_head=info.own_lm_head,
            has_d2t=info.d2t,
            logit_scale=float(cfg.get("logit_scale", layer_cfg.get("logit_scale", 1.0)) or 1.0),
            mlp_bias=bool(layer_cfg.get("mlp_bias", False)),
            eagle_version=info.eagle_version,
            family=family,
            quant=QuantSpec.from_config(quant, where),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id", layer_cfg.get("eos_token_id"))),
            max_position_embeddings=_opt_int(layer_cfg, "max_position_embeddings", 4096) or 4096,
        )
