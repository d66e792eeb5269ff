"""Each engine's documented draft-loading rules, written as predicates over an output directory.

Written from the engines' draft loaders (vLLM, SGLang, ATOM, speculators: key names and config
fields) independently of eagle3.formats.profiles, so the tests check the converter against
the engines' rules rather than against itself. Tensor names are read with the ``safetensors``
library (not eagle3's reader). Each ``<engine>_load(d)`` returns ``(problems, seen)``: the rules
the checkpoint breaks, and what the engine would do with it (the aux layers it captures in the
"input to layer k" convention, draft vocabulary, EAGLE-3.1 flags).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

LLAMA_LAYER = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
MLA_LAYER = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
             "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
             "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
QUANT_SUFFIXES = ("weight_scale", "weight_zero_point", "input_scale", "weight_scale_2", "output_scale")


def config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def tensors(d: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) over every shard, via the safetensors library."""
    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for n in st.keys():
                sl = st.get_slice(n)
                out[n] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def _base(name: str) -> str:
    """Quantized modules keep their module name: map their parameters to ``<module>.weight``."""
    mod, _, param = name.rpartition(".")
    return f"{mod}.weight" if param in QUANT_SUFFIXES else name


def _layer_params(prefix: str, rel: set[str]) -> set[str]:
    return {prefix + r for r in rel}


def _num_aux(cfg: dict[str, Any], ec: dict[str, Any]) -> int:
    return cfg.get("num_aux_hidden_states") or len(ec.get("eagle_aux_hidden_state_layer_ids") or []) or 3


def _common_shapes(cfg: dict[str, Any], ts: dict[str, tuple[str, list[int]]], n_aux: int, problems: list[str]) -> None:
    hidden = cfg["hidden_size"]
    th = cfg.get("target_hidden_size") or hidden
    fc = ts.get("fc.weight")
    if fc and fc[0] in ("BF16", "F16", "F32", "F8_E4M3") and fc[1] != [hidden, n_aux * th]:
        problems.append(f"fc.weight {fc[1]} != [{hidden}, {n_aux} * {th}]")


def _aux_default(num_target_layers: int) -> list[int]:
    n = num_target_layers
    return [2, n // 2, n - 3]


# ---------------------------------------------------------------------------------------------
# vLLM (llama_eagle3.py / deepseek_eagle3.py, and the speculators config path)
# ---------------------------------------------------------------------------------------------

VLLM_ARCHS = {"LlamaForCausalLMEagle3": "llama", "Eagle3LlamaForCausalLM": "llama",
              "Eagle3DeepseekV2ForCausalLM": "mla", "Eagle3DeepseekV3ForCausalLM": "mla"}


def vllm_load(d: Path, target_layers: int = 7) -> tuple[list[str], dict[str, Any]]:
    cfg = config(d)
    ts = tensors(d)
    problems: list[str] = []
    if "speculators_model_type" in cfg:
        # SpeculatorsConfig: the HF config vLLM builds IS transformer_layer_config, updated by update_eagle3.
        sc = cfg.get("speculators_config") or {}
        pm = (sc.get("proposal_methods") or [{}])[0]
        if not isinstance(pm.get("speculative_tokens"), int):
            problems.append("speculators_config.proposal_methods[0].speculative_tokens missing")
        if not (sc.get("verifier") or {}).get("name_or_path"):
            problems.append("speculators_config.verifier.name_or_path missing")
        tlc = cfg.get("transformer_layer_config")
        if not isinstance(tlc, dict):
            return problems + ["transformer_layer_config is not a dict"], {}
        hf = dict(tlc)
        hf["draft_vocab_size"] = cfg.get("draft_vocab_size")
        if cfg.get("target_hidden_size") is not None:
            hf["target_hidden_size"] = cfg["target_hidden_size"]
        hf["norm_before_residual"] = cfg.get("norm_before_residual", True)
        hf["norm_before_fc"] = cfg.get("norm_before_fc", False)
        hf["fc_norm"] = cfg.get("fc_norm", False)
        hf["norm_output"] = cfg.get("norm_output", False)
        arch = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}.get(hf.get("model_type"))
        if arch is None:
            problems.append(f"transformer_layer_config.model_type {hf.get('model_type')!r} has no Eagle3 class")
            arch = "?"
        hf["architectures"] = [arch]
        if cfg.get("eagle_aux_hidden_state_layer_ids"):
            hf["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    else:
        hf = cfg
        hf.setdefault("norm_before_residual", False)  # getattr default for native checkpoints
    archs = hf.get("architectures") or []
    variant = next((VLLM_ARCHS[a] for a in archs if a in VLLM_ARCHS), None)
    if variant is None:
        problems.append(f"architectures {archs} not in vLLM's EAGLE-3 registry")
        variant = "llama"
    ec = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
    use_aux = ec.get("use_aux_hidden_state", True)
    n_aux = _num_aux(hf, ec)
    fc_norm = bool(hf.get("fc_norm", False))
    norm_before_fc = bool(ec.get("norm_before_fc", hf.get("norm_before_fc", False)))
    allowed = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
    if use_aux:
        allowed.add("model.fc.weight")
    if fc_norm:
        allowed |= {f"model.fc_norm.{i}.weight" for i in range(n_aux)}
    if norm_before_fc:
        allowed.add("model.input_norm.weight")
    allowed |= _layer_params("model.layers.0.", MLA_LAYER if variant == "mla" else LLAMA_LAYER)
    params: set[str] = set()
    for n in ts:
        if "t2d" in n:
            continue
        if "d2t" in n:
            params.add("draft_id_to_target_id")
        elif "lm_head" in n:
            params.add(_base(n))
        else:
            params.add(_base("model." + n.replace("midlayer.", "layers.0.")))
    if params - allowed:
        problems.append(f"parameters vLLM does not have: {sorted(params - allowed)[:3]}")
    required = {"model.norm.weight", "lm_head.weight"} | _layer_params("model.layers.0.", MLA_LAYER if variant == "mla"
                                                                       else LLAMA_LAYER)
    if use_aux:
        required.add("model.fc.weight")
    if fc_norm:
        required |= {f"model.fc_norm.{i}.weight" for i in range(n_aux)}
    if required - params:
        problems.append(f"parameters vLLM would leave uninitialised: {sorted(required - params)[:3]}")
    dv = hf.get("draft_vocab_size") or hf.get("vocab_size")
    head = ts.get("lm_head.weight")
    if head and head[1][0] != dv:
        problems.append(f"lm_head has {head[1][0]} rows but vLLM sizes it draft_vocab_size={dv}")
    if dv != hf.get("vocab_size") and "d2t" not in ts:
        problems.append("reduced draft vocab without d2t: vLLM maps draft ids with a zero (identity) map")
    if "d2t" in ts and ts["d2t"][0] != "I64":
        problems.append(f"d2t is {ts['d2t'][0]}, vLLM's draft_id_to_target_id is int64")
    _common_shapes(hf, ts, n_aux, problems)
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or ec.get("eagle_aux_hidden_state_layer_ids")
    seen = {"aux_input_ids": list(ids) if ids else _aux_default(target_layers), "draft_vocab": dv,
            "fc_norm": fc_norm, "norm_output": bool(hf.get("norm_output", False)),
            "norm_before_residual": bool(hf.get("norm_before_residual")), "variant": variant}
    return problems, seen


# ---------------------------------------------------------------------------------------------
# SGLang (llama_eagle3.py old and new, kimi_k25_eagle3.py)
# ---------------------------------------------------------------------------------------------


def sglang_load(d: Path, target_layers: int = 7) -> tuple[list[str], dict[str, Any]]:
    cfg = config(d)
    ts = tensors(d)
    problems: list[str] = []
    archs = cfg.get("architectures") or []
    if "LlamaForCausalLMEagle3" in archs:
        variant = "llama"
    elif "Eagle3DeepseekV2ForCausalLM" in archs:
        variant = "mla"
    else:
        return [f"architectures {archs} not registered by SGLang's EAGLE-3 models"], {}
    if cfg.get("num_hidden_layers", 1) != 1:
        problems.append("SGLang's EAGLE-3 models take exactly one decoder layer")
    if cfg.get("draft_vocab_size") is None:
        problems.append("draft_vocab_size is null: SGLang would replace the draft lm_head with the target's")
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    n_aux = _num_aux(cfg, ec)
    fc_norm = bool(cfg.get("fc_norm", cfg.get("use_aux_norm", False)))
    allowed = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"}
    if fc_norm:
        allowed |= {f"model.fc_norm.{i}.weight" for i in range(n_aux)}
    if cfg.get("norm_before_fc"):
        allowed.add("model.input_norm.weight")
    allowed |= _layer_params("model.midlayer.", MLA_LAYER if variant == "mla" else LLAMA_LAYER)
    params = set()
    for n in ts:
        if n in ("d2t", "t2d"):
            continue
        if variant == "mla":
            n = re.sub(r"^layers\.0\.", "midlayer.", n)
        elif n.startswith("layers.0."):
            problems.append(f"{n}: SGLang's Llama EAGLE-3 loader (before PR #24663) knows midlayer.* only")
        params.add(_base(n if n.startswith("lm_head.") else "model." + n))
    if params - allowed:
        problems.append(f"parameters SGLang does not have: {sorted(params - allowed)[:3]}")
    if fc_norm and not {f"model.fc_norm.{i}.weight" for i in range(n_aux)} <= params:
        problems.append("fc_norm set but fc_norm tensors missing")
    _common_shapes(cfg, ts, n_aux, problems)
    head = ts.get("lm_head.weight")
    if head and cfg.get("draft_vocab_size") is not None and head[1][0] != cfg["draft_vocab_size"]:
        problems.append(f"lm_head has {head[1][0]} rows, draft_vocab_size {cfg['draft_vocab_size']}")
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        new = old = _aux_default(target_layers)
    else:
        new = [i + 1 for i in ids] if ids[0] == 1 else list(ids)  # PR #25454
        old = [i + 1 for i in ids]  # before PR #25454
    seen = {"aux_input_ids": new, "aux_input_ids_old_sglang": old, "draft_vocab": cfg.get("draft_vocab_size"),
            "fc_norm": fc_norm, "norm_output": bool(cfg.get("norm_output", False)),
            "norm_before_residual": False, "variant": variant}
    return problems, seen


# ---------------------------------------------------------------------------------------------
# ATOM (atom/config.py hf_config_override, eagle3_llama.py, eagle3_deepseek_mla.py)
# ---------------------------------------------------------------------------------------------

ATOM_ARCHS = {"LlamaForCausalLMEagle3": "Eagle3LlamaModel", "Eagle3DeepseekV2ForCausalLM": "Eagle3DeepseekMLAModel",
              "Eagle3LlamaModel": "Eagle3LlamaModel", "Eagle3DeepseekMLAModel": "Eagle3DeepseekMLAModel"}


def atom_load(d: Path, target_layers: int = 7) -> tuple[list[str], dict[str, Any]]:
    cfg = config(d)
    ts = tensors(d)
    problems: list[str] = []
    archs = cfg.get("architectures") or []
    model = next((ATOM_ARCHS[a] for a in archs if a in ATOM_ARCHS), None)
    if model is None:
        return [f"architectures {archs} not in ATOM's support_eagle_model_arch_dict"], {}
    mla = model == "Eagle3DeepseekMLAModel"
    if mla and cfg.get("kv_lora_rank") is None:
        problems.append("ATOM's MLA draft needs kv_lora_rank")
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict):
        use_aux = ec.get("use_aux_hidden_state", False)  # ATOM: missing key -> False
        ids = ec.get("eagle_aux_hidden_state_layer_ids") if use_aux else None
    else:
        use_aux, ids = True, None
    if not use_aux:
        problems.append("ATOM reads use_aux_hidden_state as False: fc would be skipped")
    n_aux = cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    fc_norm = bool(cfg.get("fc_norm", False))
    layer = "layers.0." if mla else "midlayer."
    allowed = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"}
    if fc_norm:
        allowed |= {f"fc_norm.{i}.weight" for i in range(n_aux)}
    allowed |= _layer_params(layer, MLA_LAYER if mla else LLAMA_LAYER)
    params = set()
    for n in ts:
        if not mla:
            n = n.replace("layers.0.", "midlayer.", 1) if n.startswith("layers.0.") else n  # weights_mapping
        params.add(_base(n))
    if params - allowed:
        problems.append(f"tensors ATOM would not load: {sorted(params - allowed)[:3]}")
    head = ts.get("lm_head.weight")
    if head and head[1][0] != cfg.get("vocab_size"):
        problems.append(f"ATOM's lm_head has vocab_size={cfg.get('vocab_size')} rows, the tensor {head[1][0]}")
    _common_shapes(cfg, ts, n_aux, problems)
    seen = {"aux_input_ids": list(ids) if ids else _aux_default(target_layers), "draft_vocab": cfg.get("vocab_size"),
            "fc_norm": fc_norm, "norm_output": bool(cfg.get("norm_output", False)), "norm_before_residual": False,
            "variant": "mla" if mla else "llama"}
    return problems, seen


# ---------------------------------------------------------------------------------------------
# speculators (the on-disk format, section 7.2; served through vLLM's speculators path)
# ---------------------------------------------------------------------------------------------


def speculators_load(d: Path, target_layers: int = 7) -> tuple[list[str], dict[str, Any]]:
    cfg = config(d)
    ts = tensors(d)
    problems: list[str] = []
    if cfg.get("architectures") != ["Eagle3Speculator"]:
        problems.append(f"architectures {cfg.get('architectures')} != ['Eagle3Speculator']")
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append("speculators_model_type is not eagle3")
    if (cfg.get("speculators_config") or {}).get("algorithm") != "eagle3":
        problems.append("speculators_config.algorithm is not eagle3")
    if "norm_before_residual" not in cfg:
        problems.append("norm_before_residual not written: vLLM would default it to True")
    if not isinstance(cfg.get("draft_vocab_size"), int):
        problems.append("draft_vocab_size missing (speculators defaults it to 32000)")
    if any(n.startswith("midlayer.") for n in ts):
        problems.append("midlayer.* keys: the speculators format uses layers.0.*")
    tlc = cfg.get("transformer_layer_config") or {}
    if "d2t" in ts:
        t2d = ts.get("t2d")
        if t2d is None or t2d[1] != [tlc.get("vocab_size")] or t2d[0] != "BOOL":
            problems.append(f"t2d {t2d} is not a bool mask over the target vocab {tlc.get('vocab_size')}")
    p, seen = vllm_load(d, target_layers)
    return problems + p, seen


# ---------------------------------------------------------------------------------------------
# eagle3's own canonical form
# ---------------------------------------------------------------------------------------------

CANONICAL_FIELDS = ("draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm", "norm_output",
                    "norm_before_fc", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "eagle_config")


def eagle3_load(d: Path, target_layers: int = 7) -> tuple[list[str], dict[str, Any]]:
    cfg = config(d)
    ts = tensors(d)
    problems = [f"{k} not explicit" for k in CANONICAL_FIELDS if k not in cfg]
    canon = cfg.get("eagle3_canonical") or {}
    if canon.get("aux_layer_ids_convention") != "input":
        problems.append("eagle3_canonical.aux_layer_ids_convention is not 'input'")
    if any(n.startswith("midlayer.") for n in ts) or "t2d" in ts:
        problems.append("canonical form uses layers.0.* and no t2d")
    p, seen = vllm_load(d, target_layers)  # the canonical form is also a valid vLLM checkpoint
    return problems + p, seen


LOADERS = {"vllm": vllm_load, "sglang": sglang_load, "atom": atom_load, "speculators": speculators_load,
           "eagle3": eagle3_load}
