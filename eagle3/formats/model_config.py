"""The config fields eagle3 reads, parsed once with their types and ranges.

A checkpoint's ``config.json`` is JSON written by many tools; a value of the wrong type (a string
where a number is expected, a list where ``rope_scaling`` is an object) used to pass through
``convert`` and ``quantize`` and break the engine that loads the output. :func:`parse_config`
checks every field the schema (:mod:`eagle3.formats.schema`) and the commands read, and returns
the problems as one line each, naming the file and the field (``text_config.rms_norm_eps``).

The typed result (:class:`TextStackConfig`, :class:`DraftConfig`) is what the schema is derived
from; a config that has problems has no typed result (the schema of a bad config is meaningless).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# rope_scaling kinds the engines implement for these models (transformers' ROPE_INIT_FUNCTIONS keys
# that DeepSeek-V3 / Llama checkpoints use; "default" = none).
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "deepseek_yarn", "llama3", "longrope", "su", "ntk")


class _Fields:
    """Reads one JSON object's fields, recording a one-line problem per bad field."""

    def __init__(self, d: dict[str, Any], file: Path | str, prefix: str, problems: list[str]) -> None:
        self.d, self.file, self.prefix, self.problems = d, file, prefix, problems

    def _bad(self, key: str, v: Any, want: str) -> None:
        self.problems.append(f"{self.file}: field '{self.prefix}{key}' is {v!r}, expected {want}")

    def int(self, key: str, default: int | None = None, *, minimum: int = 1, required: bool = True) -> int | None:
        v = self.d.get(key, default)
        if v is None:
            if required:
                self._bad(key, v, "an integer" if key in self.d else "an integer (the field is missing)")
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self._bad(key, v, "an integer")
            return None
        if v < minimum:
            self._bad(key, v, f"an integer >= {minimum}")
            return None
        return v

    def float(self, key: str, default: float | None = None, *, positive: bool = True,
              required: bool = False) -> float | None:
        v = self.d.get(key, default)
        if v is None:
            if required:
                self._bad(key, v, "a number")
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            self._bad(key, v, "a finite number")
            return None
        if positive and v <= 0:
            self._bad(key, v, "a positive number")
            return None
        return float(v)

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.d.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            self._bad(key, v, "true or false")
            return default
        return v

    def rope_scaling(self, key: str = "rope_scaling") -> dict[str, Any] | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            self._bad(key, v, "an object (or null)")
            return None
        kind = v.get("rope_type", v.get("type"))
        if kind not in ROPE_KINDS:
            self.problems.append(f"{self.file}: field '{self.prefix}{key}.type' is {kind!r}, expected one of "
                                 f"{', '.join(ROPE_KINDS)}")
            return None
        sub = _Fields(v, self.file, f"{self.prefix}{key}.", self.problems)
        if kind != "default":
            sub.float("factor", required=kind in ("linear", "dynamic", "yarn", "deepseek_yarn", "llama3"))
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
            sub.float(k, positive=False)
        sub.int("original_max_position_embeddings", required=False)
        return v

    def str(self, key: str) -> str | None:
        v = self.d.get(key)
        if v is not None and not isinstance(v, str):
            self._bad(key, v, "a string")
            return None
        return v

    def token_ids(self, key: str) -> None:
        """``eos_token_id`` / ``bos_token_id``: a token id or a list of them (null: none)."""
        v = self.d.get(key)
        ok = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
        if v is not None and not (ok(v) or (isinstance(v, list) and all(ok(x) for x in v))):
            self._bad(key, v, "a token id or a list of token ids")

    def int_list(self, key: str) -> list[int] | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            self._bad(key, v, "a list of non-negative integers")
            return None
        if len(set(v)) != len(v):
            self._bad(key, v, "distinct layer ids")
            return None
        return v


@dataclass(frozen=True)
class TextStackConfig:
    """A DeepSeek-V3 / Kimi text stack (the K2.5 wrapper's ``text_config``, or a plain DeepSeek-V3)."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    kv_lora_rank: int
    intermediate_size: int
    n_routed_experts: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    rms_norm_eps: float | None
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool


@dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 / 3.1 draft (Llama ``midlayer`` or MLA ``layers.0``; speculators' nested layer)."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    target_hidden_size: int
    num_aux_hidden_states: int
    aux_layer_ids: list[int] | None
    rms_norm_eps: float | None
    rope_scaling: dict[str, Any] | None
    mla: bool
    speculators: bool
    fc_norm: bool


def _runtime_fields(f: _Fields) -> None:
    """Fields the runtime reads beside the schema's (runtime/config.py): typed here, so a quoted
    number or flag is one line naming it, not a value silently coerced (``int("64")``,
    ``bool("false")``) when the model is built."""
    f.str("hidden_act")
    f.token_ids("bos_token_id")
    f.token_ids("eos_token_id")


def _text_stack(tc: dict[str, Any], file: Path | str, prefix: str, problems: list[str]) -> TextStackConfig | None:
    f = _Fields(tc, file, prefix, problems)
    n0 = len(problems)
    vals = dict(
        hidden_size=f.int("hidden_size"), vocab_size=f.int("vocab_size"),
        num_hidden_layers=f.int("num_hidden_layers"), num_attention_heads=f.int("num_attention_heads"),
        qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"), q_lora_rank=f.int("q_lora_rank", required=False),
        kv_lora_rank=f.int("kv_lora_rank"), intermediate_size=f.int("intermediate_size"),
        n_routed_experts=f.int("n_routed_experts", 0, minimum=0),
        moe_intermediate_size=f.int("moe_intermediate_size", 0, minimum=0),
        n_shared_experts=f.int("n_shared_experts", 0, minimum=0),
        first_k_dense_replace=f.int("first_k_dense_replace", 0, minimum=0),
        moe_layer_freq=f.int("moe_layer_freq", 1), num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, minimum=0),
        rms_norm_eps=f.float("rms_norm_eps"), rope_scaling=f.rope_scaling(),
        tie_word_embeddings=f.bool("tie_word_embeddings"),
    )
    f.float("rope_theta")
    f.int("max_position_embeddings", required=False)
    if (vals["n_routed_experts"] or 0) > 0:
        f.int("moe_intermediate_size")
        f.int("num_experts_per_tok")
    _runtime_fields(f)
    # the MoE router's fields the runtime reads (runtime/config.TargetSpec)
    for k in ("scoring_func", "topk_method"):
        f.str(k)
    f.int("n_group", required=False)
    f.int("topk_group", required=False)
    f.bool("norm_topk_prob", True)
    f.float("routed_scaling_factor")
    f.bool("rope_interleave", True)
    if len(problems) > n0:
        return None
    return TextStackConfig(**vals)  # type: ignore[arg-type]


def _draft(cfg: dict[str, Any], file: Path | str, problems: list[str],
           target_layers: int | None) -> DraftConfig | None:
    n0 = len(problems)
    tl = cfg.get("transformer_layer_config")
    speculators = "speculators_model_type" in cfg
    if tl is not None and not isinstance(tl, dict):
        problems.append(f"{file}: field 'transformer_layer_config' is {tl!r}, expected an object")
        return None
    lc, lp = (tl, "transformer_layer_config.") if isinstance(tl, dict) else (cfg, "")
    top = _Fields(cfg, file, "", problems)
    f = _Fields(lc, file, lp, problems)
    H = f.int("hidden_size")
    V = f.int("vocab_size") if lc.get("vocab_size") is not None else top.int("vocab_size")
    Vd = top.int("draft_vocab_size", V, required=False)
    inter = f.int("intermediate_size")
    nh = f.int("num_attention_heads")
    f.int("num_key_value_heads", required=False)
    f.int("head_dim", required=False)
    Ht = top.int("target_hidden_size", H, required=False)
    n_aux = top.int("num_aux_hidden_states", 3, required=False)
    eps = f.float("rms_norm_eps")
    n_layers = f.int("num_hidden_layers", 1, required=False)
    if n_layers is not None and n_layers != 1:
        problems.append(f"{file}: field '{lp}num_hidden_layers' is {n_layers}, expected 1 (an EAGLE-3 draft has "
                        "one decoder layer)")
    rope = f.rope_scaling()
    f.float("rope_theta")
    _runtime_fields(f)
    for k in ("attention_bias", "mlp_bias"):
        f.bool(k)
    f.int("max_position_embeddings", required=False)
    top.float("logit_scale")
    if lc is not cfg:
        top.token_ids("eos_token_id")
    fc_norm = top.bool("fc_norm")
    archs = cfg.get("architectures") or []
    mla = any("Deepseek" in str(a) for a in archs) or lc.get("kv_lora_rank") is not None
    if mla:
        for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank"):
            f.int(k)
    aux = None
    for key, holder in (("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_config")),
                        ("eagle_aux_hidden_state_layer_ids", cfg), ("aux_hidden_state_layer_ids", cfg)):
        if isinstance(holder, dict) and holder.get(key) is not None:
            pre = "eagle_config." if holder is not cfg else ""
            aux = _Fields(holder, file, pre, problems).int_list(key)
            if aux is not None and target_layers is not None and any(i >= target_layers for i in aux):
                problems.append(f"{file}: field '{pre}{key}' is {aux}, expected layer ids below the target's "
                                f"{target_layers} layers")
            break
    if V is not None and Vd is not None and Vd > V:
        problems.append(f"{file}: field 'draft_vocab_size' is {Vd}, expected at most the vocab size {V}")
    if len(problems) > n0:
        return None
    # fields written as null mean their defaults (the layer's width, three aux states, the full vocab)
    return DraftConfig(hidden_size=H, vocab_size=V, draft_vocab_size=Vd or V, intermediate_size=inter,  # type: ignore[arg-type]
                       num_attention_heads=nh, target_hidden_size=Ht or H, num_aux_hidden_states=n_aux or 3,  # type: ignore[arg-type]
                       aux_layer_ids=aux, rms_norm_eps=eps, rope_scaling=rope, mla=mla, speculators=speculators,
                       fc_norm=fc_norm)


def is_draft(cfg: dict[str, Any]) -> bool:
    archs = [str(a) for a in cfg.get("architectures") or []] if isinstance(cfg.get("architectures"), list) else []
    return "speculators_model_type" in cfg or any("Eagle" in a for a in archs)


def parse_config(cfg: Any, file: Path | str, target_layers: int | None = None
                 ) -> tuple[TextStackConfig | DraftConfig | None, list[str]]:
    """(typed config, problems) of a target or draft ``config.json``; ``target_layers`` bounds a draft's
    aux layer ids when the target is known. A config eagle3 has no schema for gives (None, [])."""
    problems: list[str] = []
    if not isinstance(cfg, dict):
        return None, [f"{file}: is {type(cfg).__name__}, expected a JSON object"]
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        return None, [f"{file}: field 'architectures' is {archs!r}, expected a list of class names"]
    if is_draft(cfg):
        return _draft(cfg, file, problems, target_layers), problems
    tc = cfg.get("text_config")
    if tc is not None:
        if not isinstance(tc, dict):
            return None, [f"{file}: field 'text_config' is {tc!r}, expected an object"]
        vc = cfg.get("vision_config")
        if vc is not None and not isinstance(vc, dict):
            problems.append(f"{file}: field 'vision_config' is {vc!r}, expected an object")
        elif isinstance(vc, dict):
            v = _Fields(vc, file, "vision_config.", problems)
            for k in ("vt_hidden_size", "vt_intermediate_size", "vt_num_hidden_layers", "hidden_size",
                      "intermediate_size", "num_hidden_layers", "patch_size"):
                v.int(k, required=False)
        _Fields(cfg, file, "", problems).token_ids("eos_token_id")  # the wrapper's, read before text_config's
        return _text_stack(tc, file, "text_config.", problems), problems
    if any(a in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM") for a in archs or []) or cfg.get("kv_lora_rank"):
        return _text_stack(cfg, file, "", problems), problems
    return None, problems


def require_config(cfg: Any, file: Path | str, target_layers: int | None = None) -> TextStackConfig | DraftConfig | None:
    """:func:`parse_config`, raising its first problem as a one-line
    :class:`~eagle3.errors.FormatError` (exit 2): for code that reads the config without the
    checkpoint's tensors (the runtime's model specs)."""
    from eagle3.errors import FormatError

    typed, problems = parse_config(cfg, file, target_layers)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise FormatError(problems[0] + more)
    return typed


__all__ = ["ROPE_KINDS", "TextStackConfig", "DraftConfig", "parse_config", "is_draft", "require_config"]
