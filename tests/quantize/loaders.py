"""What vLLM, SGLang and ATOM check when they load a Quark checkpoint, written as predicates
(written from each engine's loader source for these schemes).

Each ``check_<engine>(ckpt_dir)`` returns a :class:`Verdict`: the scheme every engine-level layer
resolves to, and the problems that would make the engine raise (or, worse, silently load a bf16
tensor as quantized or the other way round). The engines are not installed here (they need GPUs);
these predicates are the spec of their loaders, applied to our real output files.

Engine module naming is modelled too, because that is where exclusion goes wrong (4.1-4, open
vLLM issue #54547): vLLM names Kimi-K2.5's text stack ``language_model.layers.N`` and drafts
``model.layers.0``/``model.fc``, fuses q_a+kv_a (``fused_qkv_a_proj``), q/k/v (``qkv_proj``) and
gate+up (``gate_up_proj``), and sees all routed experts of a layer as one FusedMoE ``mlp.experts``.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

# Fused engine layers and their checkpoint shards (packed_modules_mapping of the DeepSeek/Llama models).
FUSED = {
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
SHARD_TO_FUSED = {s: f for f, shards in FUSED.items() for s in shards}
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj$")


@dataclass
class Verdict:
    engine: str
    loadable: bool
    schemes: dict[str, int] = field(default_factory=dict)  # scheme -> number of engine layers
    problems: list[str] = field(default_factory=list)


def load(ckpt: Path) -> tuple[dict[str, Any], dict[str, dict[str, tuple[str, list[int]]]]]:
    """(config, {module: {param: (dtype, shape)}}) from config.json and the safetensors headers."""
    cfg = json.loads((ckpt / "config.json").read_text())
    mods: dict[str, dict[str, tuple[str, list[int]]]] = defaultdict(dict)
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                mod, _, param = name.rpartition(".")
                sl = h.get_slice(name)
                mods[mod][param] = (sl.get_dtype(), list(sl.get_shape()))
    return cfg, mods


def linear_modules(mods: dict[str, dict[str, tuple[str, list[int]]]]) -> dict[str, str]:
    """Checkpoint Linear modules -> storage ("bf16", "int4", "int4x2stage", "fp4", "fp8")."""
    out = {}
    for m, ps in mods.items():
        w = ps.get("weight")
        if w is None or m.endswith("norm") or "embed" in m:
            continue
        dt, shape = w
        if dt in ("BF16", "F16", "F32") and len(shape) == 2:
            out[m] = "bf16"
        elif dt == "I32":
            out[m] = "int4x2stage" if "weight_scale_2" in ps else "int4"
        elif dt == "U8":
            out[m] = "fp4"
        elif dt.startswith("F8"):
            out[m] = "fp8"
    return out


# ---------------------------------------------------------------------------------------------
# Scheme selection (4.1-6/7, 4.2-4/5, 4.3-2/4)
# ---------------------------------------------------------------------------------------------


def _d(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def vllm_linear_scheme(lc: dict[str, Any]) -> str | None:
    w, a = lc.get("weight"), lc.get("input_tensors")
    if isinstance(w, dict) and isinstance(a, dict) and w.get("dtype") == "fp8_e4m3" == a.get("dtype") \
            and not w.get("is_dynamic") and w.get("qscheme") in ("per_tensor", "per_channel") \
            and (a.get("is_dynamic") or a.get("qscheme") == "per_tensor"):
        return "QuarkW8A8Fp8"
    if isinstance(w, dict) and w.get("qscheme") == "per_group" and w.get("group_size") == 32 \
            and w.get("scale_format") == "e8m0" and w.get("dtype") in ("fp4", "fp6_e3m2", "fp6_e2m3"):
        if not isinstance(a, dict):
            return None  # QuarkOCP_MX reads input_quant_spec["dtype"]
        if not a.get("is_dynamic"):
            return None  # static input scales: NotImplementedError
        return "QuarkOCP_MX"
    if isinstance(w, dict) and w.get("dtype") == "int4" and a is None:
        return "QuarkW4A16Int4 (vLLM PR #48606)"
    return None  # NotImplementedError("No quark compatible scheme")


def vllm_moe_scheme(lc: dict[str, Any]) -> str | None:
    w, a = lc.get("weight"), _d(lc.get("input_tensors"))
    if isinstance(w, list) and len(w) == 2:
        w0, w1 = _d(w[0]), _d(w[1])
        if w0.get("dtype") == "fp8_e4m3" and w1.get("dtype") == "int4" and a.get("dtype") == "fp8_e4m3" \
                and not w0.get("is_dynamic") and not w1.get("is_dynamic") and w0.get("qscheme") == "per_tensor" \
                and w1.get("qscheme") == "per_channel" and w1.get("symmetric") is True and w1.get("ch_axis") == 0 \
                and (a.get("is_dynamic") or a.get("qscheme") == "per_tensor"):
            return "QuarkW4A8Fp8MoE (ROCm AITER)"
        return None
    if not isinstance(w, dict):
        return None
    if w.get("dtype") == "fp8_e4m3" == a.get("dtype"):
        if (w.get("qscheme"), a.get("qscheme")) == ("per_tensor", "per_tensor") or \
                (w.get("qscheme") == "per_channel" and a.get("qscheme") == "per_channel" and a.get("is_dynamic")):
            return "QuarkW8A8Fp8MoE"
        return None
    if w.get("qscheme") == "per_group" and w.get("group_size") == 32 and w.get("scale_format") == "e8m0" \
            and w.get("dtype") in ("fp4", "fp6_e3m2", "fp6_e2m3"):
        if a.get("dtype", "").startswith("fp") and a.get("dtype") != "fp8_e4m3" and not a.get("is_dynamic"):
            return None
        return "QuarkOCP_MX_MoE"
    return None  # RuntimeError


def sglang_linear_scheme(lc: dict[str, Any]) -> str | None:
    w, a = _d(lc.get("weight")), lc.get("input_tensors")
    a = _d(a)

    def mx(s: dict[str, Any]) -> bool:
        return s.get("dtype") == "fp4" and s.get("qscheme") == "per_group" and s.get("group_size") == 32 \
            and s.get("scale_format") == "e8m0"

    if mx(w) and mx(a) and w.get("is_dynamic") is not True and a.get("is_dynamic") is not False:
        return "QuarkW4A4MXFP4"
    if w.get("dtype") == "fp8_e4m3" == a.get("dtype") and not w.get("is_dynamic"):
        return "QuarkW8A8Fp8"
    return None


def sglang_moe_scheme(lc: dict[str, Any]) -> str | None:
    w = lc.get("weight")
    if isinstance(w, list):  # AMD's kimi branch only (4.2-5): has_int4 and has_fp8
        dts = [_d(s).get("dtype", "") for s in w]
        if "int4" in dts and any(d.startswith("fp8_e4m3") for d in dts):
            return "QuarkW4A8Int4Fp8MoE (AMD SGLang branch)"
        return None
    s = sglang_linear_scheme(lc)
    return {"QuarkW4A4MXFP4": "QuarkW4A4MXFp4MoE", "QuarkW8A8Fp8": "QuarkW8A8FP8MoE"}.get(s or "")


_ATOM_DTYPES = {"fp4": "fp4x2", "int4": "int4x2", "fp8_e4m3": "fp8", "int8": "i8"}
_ATOM_QTYPES = {"per_channel": "per_Token", "per_tensor": "per_Tensor", "per_group": "per_1x32",
                "per_block": "per_1x128"}


def atom_spec(lc: dict[str, Any]) -> tuple[str, str] | None:
    """ATOM's QuarkParser (4.3-2): weight must be a dict; -> (dtype, QuantType)."""
    w = lc.get("weight")
    if not isinstance(w, dict):
        return None  # weight.get(...) on a list raises
    dt = _ATOM_DTYPES.get(str(w.get("dtype")))
    qt = _ATOM_QTYPES.get(str(w.get("qscheme")))
    return (dt, qt) if dt and qt else None


# ---------------------------------------------------------------------------------------------
# Exclusion (4.1-4, 4.2-2, 4.3-3)
# ---------------------------------------------------------------------------------------------


def _match_vllm(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None  # anchored at the start only
    return name == entry


def vllm_ignored(layer: str, shards: list[str], exclude: list[str], moe: bool) -> bool | None:
    """should_ignore_layer: fused layers check each shard; all must agree (else None = ValueError)."""
    names = shards or [layer]
    votes = {any(_match_vllm(n, e) for e in exclude) for n in names}
    if moe:  # newer vLLM, check_children: an exclude entry that is a child of mlp.experts
        votes = {v or any(e.startswith(layer + ".") for e in exclude) for v in votes}
    return votes.pop() if len(votes) == 1 else None


def _match_atom(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.search(entry[3:], name) is not None
    if "*" in entry or "?" in entry:
        return fnmatch.fnmatch(name, entry) or fnmatch.fnmatch(name + ".*", entry)
    return name == entry or name.startswith(entry + ".")


def _atom_entry(entry: str) -> str:
    if entry.startswith("re:"):
        return entry
    parts = entry.split(".")
    parts = [SHARD_TO_FUSED.get(p, p) for p in parts]
    e = ".".join(parts)
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head", "lm_head")):
        if e.startswith(old):
            e = new + e[len(old):]
    return e


# ---------------------------------------------------------------------------------------------
# Engine layers from checkpoint modules
# ---------------------------------------------------------------------------------------------


def _rename(module: str, engine: str, family: str) -> str:
    """Checkpoint module name -> the engine's module name (before fusion, except ATOM's remap)."""
    if engine == "atom":
        if family == "draft" and module.startswith("layers.0."):  # ATOM maps layers.0. -> midlayer.
            module = "midlayer." + module[len("layers.0."):]
        return _atom_entry(module)  # text-stack rename + shard -> fused leaf
    if family == "kimi-k25" and engine == "vllm":
        if module.startswith("language_model.model."):
            return "language_model." + module[len("language_model.model."):]
        if module == "language_model.lm_head":
            return "lm_head"
    if family == "draft":
        for p in ("midlayer.", "layers.0."):
            if module.startswith(p):
                return "model.layers.0." + module[len(p):]
        return module if module == "lm_head" else "model." + module
    return module


def engine_layers(linears: dict[str, str], engine: str, family: str) -> dict[str, dict[str, Any]]:
    """{engine layer: {"moe": bool, "shards": [engine-named shard names], "storage": {formats}}}.

    vLLM/SGLang decide exclusion per shard of a fused layer (all must agree); ATOM remaps the
    exclude entries to the fused name instead, so its layers carry no shards."""
    layers: dict[str, dict[str, Any]] = {}
    for mod, storage in linears.items():
        m = _EXPERT.match(mod)
        if m:
            layer, shards, moe = _rename(m.group(1), engine, family), [], True
        else:
            name = _rename(mod, engine, family)
            parent, _, leaf = name.rpartition(".")
            fused = None if engine == "atom" else SHARD_TO_FUSED.get(leaf)
            layer, shards, moe = (f"{parent}.{fused}" if fused else name), ([name] if fused else []), False
        ent = layers.setdefault(layer, {"moe": moe, "shards": [], "storage": set()})
        ent["storage"].add(storage)
        ent["shards"].extend(shards)
    return layers


def _family(cfg: dict[str, Any], linears: dict[str, str]) -> str:
    if any(m.startswith("language_model.") for m in linears):
        return "kimi-k25"
    if any(m.startswith(("midlayer.", "layers.")) for m in linears):
        return "draft"
    return "text"


def _expected_storage(scheme: str | None) -> set[str]:
    if scheme is None:
        return {"bf16"}
    if "W4A8" in scheme:
        return {"int4x2stage"}
    if "MX" in scheme:
        return {"fp4"}
    if "Fp8" in scheme or "FP8" in scheme:
        return {"fp8"}
    if "Int4" in scheme:
        return {"int4"}
    return set()


def check(ckpt: Path, engine: str) -> Verdict:
    cfg, mods = load(ckpt)
    qc = cfg.get("quantization_config")
    v = Verdict(engine, True)
    if not isinstance(qc, dict) or qc.get("quant_method") != "quark":
        v.problems.append("no top-level quark quantization_config")
    else:
        exp = qc.get("export")
        if not isinstance(exp, dict) or not isinstance(exp.get("kv_cache_group"), list):
            v.problems.append("export.kv_cache_group missing or not a list")
        for k in ("layer_quant_config", "layer_type_quant_config"):
            if not isinstance(qc.get(k), dict):
                v.problems.append(f"{k} is not a dict")
        g = qc.get("global_quant_config") or {}
        if g.get("output_tensors") or g.get("bias"):
            v.problems.append("output_tensors/bias set: NotImplementedError")
        if engine == "atom" and atom_spec(g) is None:
            v.problems.append("QuarkParser: 'weight' is not a dict (two-stage W4A8 config)")
    if "quantization_config" in json.dumps({k: x for k, x in cfg.items() if k != "quantization_config"}):
        v.problems.append("a nested quantization_config remains (ATOM copies it to the top level)")
    if v.problems:
        v.loadable = False
        return v
    g = qc["global_quant_config"]
    exclude = list(qc["exclude"])
    linears = linear_modules(mods)
    family = _family(cfg, linears)
    if engine == "sglang":  # keeps checkpoint names and their stripped variants (PRs #24477/#25390)
        exclude += [e[len("language_model."):] for e in exclude if e.startswith("language_model.")]
    if engine == "atom":
        exclude = [_atom_entry(e) for e in exclude]
    for layer, ent in sorted(engine_layers(linears, engine, family).items()):
        if engine == "atom":
            ign: bool | None = any(_match_atom(layer, e) for e in exclude)
        else:
            ign = vllm_ignored(layer, ent["shards"], exclude, ent["moe"])
        if ign is None:
            v.problems.append(f"{layer}: fused shards disagree on exclusion (ValueError)")
            continue
        if ign:
            scheme = None
        elif engine == "vllm":
            scheme = (vllm_moe_scheme if ent["moe"] else vllm_linear_scheme)(g)
        elif engine == "sglang":
            scheme = (sglang_moe_scheme if ent["moe"] else sglang_linear_scheme)(g)
        else:
            spec = atom_spec(g)
            scheme = None if spec is None else f"{spec[0]} {spec[1]}"
            if ent["moe"] and spec and spec[0] != "fp4x2":
                v.problems.append(f"{layer}: ATOM FusedMoE dispatches only bf16 / fp8 / fp4x2, got {spec[0]}")
        if not ign and scheme is None:
            v.problems.append(f"{layer}: not excluded but no {engine} scheme matches the config")
            continue
        want = _expected_storage(scheme) if engine != "atom" else (
            {"bf16"} if ign else {"fp4" if "fp4" in scheme else "int4x2stage" if "int4" in scheme else "fp8"})
        if engine == "atom" and not ign and scheme and "int4" in scheme:
            want = {"int4", "int4x2stage"}
        if not ent["storage"] <= want:
            v.problems.append(f"{layer}: {'excluded' if ign else scheme} but stored as {sorted(ent['storage'])}")
        key = scheme or "excluded (bf16)"
        v.schemes[key] = v.schemes.get(key, 0) + 1
    v.loadable = not v.problems
    return v


def sglang_shared_fusion_ok(ckpt: Path) -> bool:
    """SGLang's shared-expert fusion for Kimi (4.2-6) copies shared experts into the routed-expert
    tensors; it needs them in the same format (or fusion disabled by the user)."""
    _, mods = load(ckpt)
    lin = linear_modules(mods)
    routed = {s for m, s in lin.items() if _EXPERT.match(m)}
    shared = {s for m, s in lin.items() if ".shared_experts." in m}
    return not shared or routed == shared
