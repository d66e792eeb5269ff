"""Corpus cases of issue 21: checkpoints that are well-formed safetensors but wrong as models.

Each class (a config value of the wrong type or range; a tensor whose shape or dtype disagrees with
the config at the same byte size; the config's layer count against the files; a reduced-vocabulary
draft's ``d2t`` / ``t2d``; the index against the shards; a missing or unexpected tensor) has several
instances. ``convert``, ``quantize``, ``verify`` (the broken copy given a manifest) and ``serve``
(``--validate``, and ``--engine vllm --dry-run``; a draft beside the intact tiny target) must refuse them (exit 2, one line, nothing
left behind); ``inspect --strict`` too (plain ``inspect`` lists them: ``test_schema.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.robustness.corpus import INDEX, ONE, S1, S2, Ctx, case, edit_header, edit_json, edit_tensors

I_SCHEMA = "21 the model against its schema"
ALL = ("inspect", "convert", "quantize", "verify", "serve", "serve-engine")
T1, T2, T3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


def _strict(ctx: Ctx) -> None:
    ctx.also("--strict", on=("inspect",))


def _config(key: str, value: Any, sub: str | None = None) -> Any:
    def fn(ctx: Ctx) -> None:
        _strict(ctx)

        def put(c: dict[str, Any]) -> None:
            (c[sub] if sub else c)[key] = value
        edit_json(ctx.src / "config.json", put)
    return fn


def _shape(file: str, name: str, shape: list[int], dtype: str | None = None) -> Any:
    def fn(ctx: Ctx) -> None:
        _strict(ctx)

        def ed(h: dict[str, Any]) -> None:
            h[name]["shape"] = shape
            if dtype:
                h[name]["dtype"] = dtype
        edit_header(ctx.src / file, ed)
    return fn


def _rename(file: str, old: str, new: str, index: bool = True) -> Any:
    def fn(ctx: Ctx) -> None:
        _strict(ctx)
        edit_header(ctx.src / file, lambda h: h.__setitem__(new, h.pop(old)))
        if index:
            def ix(j: dict[str, Any]) -> None:
                j["weight_map"][new] = j["weight_map"].pop(old)
            edit_json(ctx.src / INDEX, ix)
    return fn


def _register(cases: list[tuple[str, str, tuple[Any, ...], Any]]) -> None:
    for cid, model, expect, fn in cases:
        case(cid, model, ALL, expect, I_SCHEMA)(fn)


LN = "language_model.model.layers."

_register([
    # --- config values of the wrong type or range -------------------------------------------
    ("schema-draft-rms-norm-eps-string", "draft", ("config.json", "rms_norm_eps"), _config("rms_norm_eps", "1e-6")),
    ("schema-draft-rope-scaling-string", "draft", ("config.json", "rope_scaling"), _config("rope_scaling", "yarn")),
    ("schema-draft-rope-scaling-unknown-kind", "draft", ("config.json", "rope_scaling"),
     _config("rope_scaling", {"type": "spiral", "factor": 2.0})),
    ("schema-draft-rope-factor-string", "draft", ("config.json", "rope_scaling.factor"),
     _config("rope_scaling", {"type": "yarn", "factor": "64"})),
    ("schema-draft-two-layers", "draft", ("config.json", "num_hidden_layers"), _config("num_hidden_layers", 2)),
    ("schema-mla-q-lora-rank-string", "mla", ("config.json", "q_lora_rank"), _config("q_lora_rank", "64")),
    ("schema-mla-rms-norm-eps-negative", "mla", ("config.json", "rms_norm_eps"), _config("rms_norm_eps", -1e-5)),
    ("schema-target-rms-norm-eps-zero", "target", ("config.json", "text_config.rms_norm_eps"),
     _config("rms_norm_eps", 0, sub="text_config")),
    ("schema-target-rope-scaling-list", "target", ("config.json", "text_config.rope_scaling"),
     _config("rope_scaling", ["yarn", 64], sub="text_config")),
    ("schema-target-heads-zero", "target", ("config.json", "text_config.num_attention_heads"),
     _config("num_attention_heads", 0, sub="text_config")),
    ("schema-target-experts-per-tok-string", "target", ("config.json", "text_config.num_experts_per_tok"),
     _config("num_experts_per_tok", "2", sub="text_config")),
    # fields the runtime reads beside the schema's: a quoted value used to be coerced silently
    ("schema-target-routed-scaling-string", "target", ("config.json", "text_config.routed_scaling_factor"),
     _config("routed_scaling_factor", "2.5", sub="text_config")),
    ("schema-target-norm-topk-prob-string", "target", ("config.json", "text_config.norm_topk_prob"),
     _config("norm_topk_prob", "false", sub="text_config")),
    ("schema-target-n-group-float", "target", ("config.json", "text_config.n_group"),
     _config("n_group", 1.5, sub="text_config")),
    ("schema-target-eos-string", "target", ("config.json", "eos_token_id"), _config("eos_token_id", "eos")),
    ("schema-draft-mlp-bias-string", "draft", ("config.json", "mlp_bias"), _config("mlp_bias", "false")),
    ("schema-draft-hidden-act-list", "draft", ("config.json", "hidden_act"), _config("hidden_act", ["silu"])),
    ("schema-mla-max-positions-string", "mla", ("config.json", "max_position_embeddings"),
     _config("max_position_embeddings", "4096")),
    # --- shape / dtype disagreeing with the config at the same byte size ---------------------
    ("schema-mla-fc-norm-reshaped", "mla", (S1, "fc_norm.0.weight"),
     _shape(S1, "fc_norm.0.weight", [2, 64])),
    ("schema-draft-norm-f32-half-width", "draft", (S1, "midlayer.input_layernorm.weight"),
     _shape(S1, "midlayer.input_layernorm.weight", [64], "F32")),
    ("schema-draft-fc-transposed", "draft", (S1, "fc.weight"), _shape(S1, "fc.weight", [384, 128])),
    ("schema-draft-lm-head-transposed", "draft", (S2, "lm_head.weight"), _shape(S2, "lm_head.weight", [128, 1024])),
    ("schema-target-layernorm-reshaped", "target", (LN + "0.input_layernorm.weight",),
     _shape(T1, LN + "0.input_layernorm.weight", [2, 64])),
    ("schema-target-kv-a-norm-f32-half", "target", (LN + "1.self_attn.kv_a_layernorm.weight",),
     _shape(T1, LN + "1.self_attn.kv_a_layernorm.weight", [256], "F32")),
    # --- the config's layer count against the files ------------------------------------------
    ("schema-target-num-layers-fewer", "target", ("config.json", "text_config.num_hidden_layers"),
     _config("num_hidden_layers", 6, sub="text_config")),
    ("schema-target-num-layers-more", "target", ("config.json", "text_config.num_hidden_layers"),
     _config("num_hidden_layers", 8, sub="text_config")),
    # --- d2t / t2d against each other and draft_vocab_size -----------------------------------
    ("schema-d2t-t2d-extra-true", "d2t", (ONE, "t2d"), None),
    ("schema-d2t-t2d-moved-true", "d2t", (ONE, "d2t"), None),
    ("schema-d2t-offsets-shifted", "d2t", (ONE, "d2t"), None),
    ("schema-d2t-map-without-reduced-vocab", "draft", (S1, "d2t"), None),
    # --- the index against the shards --------------------------------------------------------
    ("schema-index-misses-draft-tensor", "draft", (INDEX, "fc.weight"), None),
    ("schema-index-misses-target-tensor", "target", (INDEX, LN + "3.mlp.experts.2.up_proj.weight_scale"), None),
    ("schema-index-misses-mla-fc-norm", "mla", (INDEX, "fc_norm.1.weight"), None),
    ("schema-index-points-to-other-shard", "draft", (INDEX, "fc.weight"), None),
    # --- missing / unexpected tensors --------------------------------------------------------
    ("schema-draft-fc-renamed", "draft", (("fc.weight", "fc2.weight"),), _rename(S1, "fc.weight", "fc2.weight")),
    ("schema-mla-layer-prefix-mixed", "mla", (("layers.0.hidden_norm.weight", "midlayer.hidden_norm.weight"),),
     _rename(S1, "layers.0.hidden_norm.weight", "midlayer.hidden_norm.weight")),
    ("schema-target-expert-renamed", "target",
     ((LN + "2.mlp.experts.9.gate_proj.weight_packed", LN + "2.mlp.experts.1.gate_proj.weight_packed"),),
     _rename(T1, LN + "2.mlp.experts.1.gate_proj.weight_packed", LN + "2.mlp.experts.9.gate_proj.weight_packed")),
    ("schema-target-layer-renumbered", "target", ("num_hidden_layers",), None),
])


def _fill(cid: str) -> Any:
    """Register the breaking function of a case declared above with ``None``."""
    def deco(fn: Any) -> Any:
        from tests.robustness import corpus

        i = next(i for i, c in enumerate(corpus.CASES) if c.id == cid)
        corpus.CASES[i] = corpus.Case(**{**corpus.CASES[i].__dict__, "breaks": fn})
        return fn
    return deco


def _tensors(ctx: Ctx, fn: Any) -> None:
    _strict(ctx)
    edit_tensors(ctx.src / ONE, fn)


@_fill("schema-d2t-t2d-extra-true")
def _(ctx: Ctx) -> None:
    def fn(t: dict[str, torch.Tensor]) -> None:
        m = t["t2d"].clone()
        m[int((~m).nonzero()[0])] = True
        t["t2d"] = m
    _tensors(ctx, fn)


@_fill("schema-d2t-t2d-moved-true")
def _(ctx: Ctx) -> None:
    def fn(t: dict[str, torch.Tensor]) -> None:
        m = t["t2d"].clone()
        on, off = int(m.nonzero()[-1]), int((~m).nonzero()[0])
        m[on], m[off] = False, True  # as many trues, one of them where d2t points nowhere
        t["t2d"] = m
    _tensors(ctx, fn)


@_fill("schema-d2t-offsets-shifted")
def _(ctx: Ctx) -> None:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t["d2t"] = t["d2t"] + 1
    _tensors(ctx, fn)


@_fill("schema-d2t-map-without-reduced-vocab")
def _(ctx: Ctx) -> None:
    _strict(ctx)

    def fn(t: dict[str, torch.Tensor]) -> None:
        t["d2t"] = torch.zeros(1024, dtype=torch.int64)
    edit_tensors(ctx.src / S1, fn)
    edit_json(ctx.src / INDEX, lambda j: j["weight_map"].__setitem__("d2t", S1))


def _unlist(name: str) -> Any:
    def fn(ctx: Ctx) -> None:
        _strict(ctx)
        edit_json(ctx.src / INDEX, lambda j: j["weight_map"].pop(name))
    return fn


_fill("schema-index-misses-draft-tensor")(_unlist("fc.weight"))
_fill("schema-index-misses-target-tensor")(_unlist(LN + "3.mlp.experts.2.up_proj.weight_scale"))
_fill("schema-index-misses-mla-fc-norm")(_unlist("fc_norm.1.weight"))


@_fill("schema-index-points-to-other-shard")
def _(ctx: Ctx) -> None:
    """The index lists fc.weight in the shard that does not hold it (and not in the one that does)."""
    _strict(ctx)
    edit_json(ctx.src / INDEX, lambda j: j["weight_map"].__setitem__("fc.weight", S2))


@_fill("schema-target-layer-renumbered")
def _(ctx: Ctx) -> None:
    """Layer 5's tensors renamed to layer 9 (headers and index): the files hold 0-4, 6, 9."""
    _strict(ctx)
    moved: dict[str, str] = {}
    for f in (T1, T2, T3):
        def ed(h: dict[str, Any]) -> None:
            for k in [k for k in h if k.startswith(LN + "5.")]:
                new = LN + "9." + k[len(LN + "5."):]
                h[new] = h.pop(k)
                moved[k] = new
        edit_header(ctx.src / f, ed)

    def ix(j: dict[str, Any]) -> None:
        for old, new in moved.items():
            j["weight_map"][new] = j["weight_map"].pop(old)
    edit_json(ctx.src / INDEX, ix)
