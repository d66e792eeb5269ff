"""The quantization of a checkpoint: the schemes its ``quantization_config`` declares (config side)
and the tensor layout each quantized Linear has on disk (file side), which must agree. The exact
tensors of every layout are in :mod:`eagle3.formats.sizing`.

This module is the one reader of ``quantization_config``: :func:`quantization_config` finds it (the
lookup itself lives in ``sizing``, which must stay torch-free; the schema, the loader, ``convert``
and ``serve --engine`` use it), :func:`_config_schemes` describes it for ``inspect``, and
:class:`QuantSpec` is what the runtime takes from it."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3.checkpoint import TensorInfo
from eagle3.errors import FormatError
from eagle3.formats import keys
from eagle3.formats.sizing import find_quantization_config
from eagle3.formats.summary import QuantInfo

# (quantization_config, where): the one lookup of the field (formats/sizing.py, torch-free).
quantization_config = find_quantization_config

# ---------------------------------------------------------------------------------------------
# What the runtime needs from quantization_config (activation quantization, Quark's pack order)
# ---------------------------------------------------------------------------------------------

# Dynamic activation quantization in front of a quantized Linear (None: weight-only), as the
# runtime's kernel backends take it (runtime/kernels/base.py).
ActQuant = Literal["int8", "fp8", "mxfp4"] | None


@dataclass(frozen=True)
class QuantSpec:
    """What the runtime needs from ``quantization_config`` beyond the weights' layouts (those come
    from :func:`eagle3.formats.sizing.resolver`, as the schema's do, in ``runtime/weights.py``).

    ``act``: dynamic activation quantization in front of every quantized Linear (None =
    weight-only). Quark records W4A8 inputs as ``fp8_e4m3 per_tensor dynamic``; the runtime
    quantizes per token (what the serving kernels do), and ``act_override`` in the loader picks
    the int8 variant. ``layer_act``: Quark ``layer_quant_config`` patterns with their own input
    spec (fnmatch if the pattern has ``*``, else substring, as vLLM matches)."""

    method: str | None = None  # compressed-tensors | quark | fp8 | None
    act: ActQuant = None
    layer_act: tuple[tuple[str, ActQuant], ...] = ()
    pack_method: str = "reorder"  # Quark INT4 nibble order (the export's, not the layout's: same sizes)

    @staticmethod
    def from_config(qc: dict[str, Any] | None, where: str) -> QuantSpec:
        if not qc:
            return QuantSpec()
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            acts = []
            for g in (qc.get("config_groups") or {}).values():
                acts.append(_ct_act((g or {}).get("input_activations"), where))
            act = acts[0] if acts else None
            return QuantSpec(method=method, act=act)
        if method == "quark":
            glob = qc.get("global_quant_config") or {}
            act = _quark_act(glob.get("input_tensors"), where)
            layer = []
            for pat, lc in (qc.get("layer_quant_config") or {}).items():
                if isinstance(lc, dict):
                    layer.append((str(pat), _quark_act(lc.get("input_tensors"), where)))
            pack = ((qc.get("export") or {}).get("pack_method")) or "reorder"
            return QuantSpec(method=method, act=act, layer_act=tuple(layer), pack_method=str(pack))
        if method == "fp8":
            # DeepSeek FP8: activations are quantized per 1x128 group by the engines; the reference
            # runs them in the compute dtype (weight-only emulation), documented in runtime/weights.py.
            return QuantSpec(method=method)
        raise FormatError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                          f"(compressed-tensors, quark, fp8)")

    def act_for(self, module: str) -> ActQuant:
        import fnmatch

        for pat, act in self.layer_act:
            if ("*" in pat and fnmatch.fnmatch(module, pat)) or ("*" not in pat and pat in module):
                return act
        return self.act


def _ct_act(spec: Any, where: str) -> ActQuant:
    if not spec:
        return None
    bits, typ = spec.get("num_bits"), spec.get("type")
    if bits == 8 and typ == "int":
        return "int8"
    if bits == 8 and typ == "float":
        return "fp8"
    raise FormatError(f"{where}: compressed-tensors input_activations {bits}-bit {typ} is not supported")


def _quark_act(spec: Any, where: str) -> ActQuant:
    if not spec:
        return None
    if isinstance(spec, list):  # a progressive input spec: the runtime uses its last stage
        spec = spec[-1] if spec else None
        if not spec:
            return None
    dt = str(spec.get("dtype"))
    if dt == "int8":
        return "int8"
    if dt.startswith("fp8_e4m3"):
        return "fp8"
    if dt == "fp4":
        return "mxfp4"
    raise FormatError(f"{where}: Quark input_tensors dtype {dt!r} is not supported (int8, fp8_e4m3, fp4)")


# ---------------------------------------------------------------------------------------------
# Quantization schemes (config side) and tensor layouts (file side)
# ---------------------------------------------------------------------------------------------

CT_INT4 = "ct-int4"  # compressed-tensors pack-quantized INT4 (Moonshot Kimi, W4A16)
CT_FP8 = "ct-fp8"  # compressed-tensors float-quantized FP8
FP8_BLOCK = "fp8-block"  # DeepSeek / Kimi-K2 quant_method fp8, 128x128 weight_scale_inv
QUARK_W4A8 = "quark-w4a8"  # Quark progressive FP8 -> INT4 per-channel weight (amd/Kimi-K2.5-W4A8)
QUARK_INT4 = "quark-int4"  # Quark single-stage INT4 weight (weight-only or with INT8/FP8 activations)
QUARK_MXFP4 = "quark-mxfp4"  # Quark OCP MXFP4 (E2M1 + E8M0 per 32)
QUARK_FP8 = "quark-fp8"  # Quark FP8 E4M3 weights (e.g. ptpc_fp8 drafts)
QUANT_SCHEMES = (CT_INT4, CT_FP8, FP8_BLOCK, QUARK_W4A8, QUARK_INT4, QUARK_MXFP4, QUARK_FP8)

# Tensor layout of one quantized Linear -> the schemes that write it.
_LAYOUT_SCHEMES: dict[str, frozenset[str]] = {
    "int4_ct": frozenset({CT_INT4}),
    "int4": frozenset({QUARK_INT4}),
    "int4_2stage": frozenset({QUARK_W4A8}),
    "fp4": frozenset({QUARK_MXFP4}),
    "fp8_block": frozenset({FP8_BLOCK}),
    "fp8": frozenset({CT_FP8, QUARK_FP8}),
}
_LAYOUT_TEXT = {
    "int4_ct": "compressed-tensors INT4 (int32 weight_packed + weight_scale)",
    "int4": "Quark INT4 (int32 weight + weight_scale)",
    "int4_2stage": "Quark W4A8 (int32 weight + weight_scale + weight_scale_2)",
    "fp4": "MXFP4 (uint8 weight + uint8 weight_scale)",
    "fp8_block": "FP8 block (float8 weight + weight_scale_inv)",
    "fp8": "FP8 (float8 weight + weight_scale)",
}
_FLOAT_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
_FP8_TAGS = {"F8_E4M3", "F8_E5M2"}



def _spec_text(spec: dict[str, Any]) -> str:
    """Short text of one Quark QTensorConfig: "int4 per_channel sym", "fp4 per_group g32 e8m0"."""
    parts = [str(spec.get("dtype")), str(spec.get("qscheme"))]
    if spec.get("group_size"):
        parts.append(f"g{spec['group_size']}")
    if spec.get("scale_format"):
        parts.append(str(spec["scale_format"]))
    if spec.get("symmetric") is True:
        parts.append("sym")
    return " ".join(parts)


def _quark_scheme(weight: Any, cfg_file: Path, where: str) -> str:
    if isinstance(weight, list):
        dts = [str(s.get("dtype")) if isinstance(s, dict) else None for s in weight]
        if len(dts) == 2 and dts[0] and dts[0].startswith("fp8_e4m3") and dts[1] == "int4":
            return QUARK_W4A8
        raise FormatError(f"{cfg_file}: field '{where}' is a {len(weight)}-stage weight spec {dts}; "
                          f"eagle3 reads the two-stage [fp8_e4m3, int4] (W4A8) only")
    if not isinstance(weight, dict):
        raise FormatError(f"{cfg_file}: field '{where}' is {weight!r}, expected a Quark QTensorConfig object")
    dt = str(weight.get("dtype"))
    if dt in ("int4", "uint4"):
        return QUARK_INT4
    if dt == "fp4":
        return QUARK_MXFP4
    if dt.startswith("fp8_e4m3"):
        return QUARK_FP8
    raise FormatError(f"{cfg_file}: field '{where}.dtype' is {dt!r}; eagle3 reads Quark int4, fp4 (MXFP4), "
                      f"fp8_e4m3 and the [fp8_e4m3, int4] W4A8 weight")


def _config_schemes(qc: dict[str, Any], cfg_file: Path, qfield: str) -> dict[str, Any]:
    """Parse a quantization_config into the QuantInfo fields that come from the config."""
    method = qc.get("quant_method")
    out: dict[str, Any] = {"method": method, "activations": None, "group_size": None, "pack_method": None,
                           "exclude": None}
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise FormatError(f"{cfg_file}: field '{qfield}.config_groups' is missing or empty")
        schemes: list[str] = []
        for gname, g in groups.items():
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict):
                raise FormatError(f"{cfg_file}: field '{qfield}.config_groups.{gname}.weights' is missing")
            bits, typ = w.get("num_bits"), w.get("type")
            if bits == 4 and typ == "int" and fmt == "pack-quantized":
                s = CT_INT4
                gs = f"g{w['group_size']} " if w.get("group_size") else ""  # none for the channel strategy
                out["weights"] = f"int4 {w.get('strategy')} {gs}{'sym' if w.get('symmetric', True) else 'asym'}"
                out["group_size"] = w.get("group_size")
            elif bits == 8 and typ == "float":
                s = CT_FP8
                out["weights"] = f"fp8_e4m3 {w.get('strategy')}"
            else:
                raise FormatError(f"{cfg_file}: field '{qfield}.config_groups.{gname}.weights' is {bits}-bit "
                                  f"{typ} ({fmt}); eagle3 reads pack-quantized int4 and float-quantized fp8")
            acts = g.get("input_activations")
            if isinstance(acts, dict):
                out["activations"] = (f"{acts.get('type')}{acts.get('num_bits')} {acts.get('strategy')} "
                                      f"{'dynamic' if acts.get('dynamic') else 'static'}")
            if s not in schemes:
                schemes.append(s)
        out["schemes"] = schemes
        out["exclude"] = len(qc.get("ignore") or [])
    elif method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise FormatError(f"{cfg_file}: field '{qfield}.weight_block_size' is {block!r}, "
                              f"expected [128, 128] for a DeepSeek-style FP8 checkpoint")
        out["schemes"] = [FP8_BLOCK]
        out["weights"] = f"fp8_e4m3 block {block[0]}x{block[1]}"
        out["activations"] = f"fp8_e4m3 {qc.get('activation_scheme', 'dynamic')}"
        out["exclude"] = len(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    elif method == "quark":
        g = qc.get("global_quant_config")
        if not isinstance(g, dict):
            raise FormatError(f"{cfg_file}: field '{qfield}.global_quant_config' is missing")
        specs: list[tuple[str, dict[str, Any]]] = []
        if g.get("weight") is not None:
            specs.append((f"{qfield}.global_quant_config.weight", g))
        for k in ("layer_quant_config", "layer_type_quant_config"):
            sub = qc.get(k) or {}
            if not isinstance(sub, dict):
                raise FormatError(f"{cfg_file}: field '{qfield}.{k}' is {type(sub).__name__}, expected an object")
            for pat, lc in sub.items():
                if isinstance(lc, dict) and lc.get("weight") is not None:
                    specs.append((f"{qfield}.{k}.{pat}.weight", lc))
        if not specs:
            raise FormatError(f"{cfg_file}: field '{qfield}.global_quant_config.weight' is null and no layer "
                              f"config quantizes weights")
        schemes = []
        for where, lc in specs:
            s = _quark_scheme(lc["weight"], cfg_file, where)
            if s not in schemes:
                schemes.append(s)
        first = specs[0][1]
        w = first["weight"]
        out["weights"] = " -> ".join(_spec_text(x) for x in w) if isinstance(w, list) else _spec_text(w)
        stages = w if isinstance(w, list) else [w]
        out["group_size"] = next((s.get("group_size") for s in stages if s.get("group_size")), None)
        a = first.get("input_tensors")
        if isinstance(a, dict):
            out["activations"] = f"{_spec_text(a)} {'dynamic' if a.get('is_dynamic') else 'static'}"
        exp = qc.get("export")
        out["pack_method"] = exp.get("pack_method") if isinstance(exp, dict) else None
        out["exclude"] = len(qc.get("exclude") or [])
        out["schemes"] = schemes
    else:
        raise FormatError(f"{cfg_file}: field '{qfield}.quant_method' is {method!r}; eagle3 reads "
                          f"compressed-tensors, fp8 and quark")
    return out


def _module_layout(mod: str, params: dict[str, TensorInfo]) -> str | None:
    """Tensor layout of one module: a key of _LAYOUT_SCHEMES, "dense:<dtype>" for an
    unquantized Linear-like weight, or None for what is not a Linear (norms, embeddings, biases)."""
    if keys.CT_PACKED in params:
        w = params[keys.CT_PACKED]
        if w.dtype != "I32":
            raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype}; compressed-tensors packs INT4 into I32")
        if keys.SCALE not in params:
            raise FormatError(f"{w.file}: tensor {w.name!r} has no {mod}.{keys.SCALE} beside it")
        return "int4_ct"
    w = params.get(keys.WEIGHT)
    if w is None:
        return None
    scale = params.get(keys.SCALE)
    if w.dtype in ("I32", "U32"):
        if scale is None:
            raise FormatError(f"{w.file}: tensor {w.name!r} is packed INT4 ({w.dtype}) but has no "
                              f"{mod}.{keys.SCALE} beside it")
        return "int4_2stage" if keys.SCALE_2 in params else "int4"
    if w.dtype == "U8":
        if scale is None or scale.dtype != "U8":
            got = "no weight_scale" if scale is None else f"weight_scale {scale.dtype}"
            raise FormatError(f"{w.file}: tensor {w.name!r} is uint8 (packed FP4) but has {got}; "
                              f"MXFP4 needs a uint8 E8M0 weight_scale")
        return "fp4"
    if w.dtype in _FP8_TAGS:
        if keys.SCALE_INV in params:
            return "fp8_block"
        if scale is not None:
            return "fp8"
        raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype} but has neither {keys.SCALE_INV} "
                          f"nor {keys.SCALE} beside it")
    if w.dtype in _FLOAT_NAMES:
        # Embeddings and convolutions (vision patch_embed) are not Linears; 1-D weights are norms.
        if len(w.shape) != 2 or "embed" in mod:
            return None
        return "dense:" + _FLOAT_NAMES[w.dtype]
    if w.dtype in ("I8", "U16", "I16"):
        raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype}, a quantized weight layout eagle3 "
                          f"does not read")
    return None


def _detect_quant(cfg: dict[str, Any], cfg_file: Path, infos: dict[str, TensorInfo],
                  warnings: list[str]) -> QuantInfo:
    qc, where = quantization_config(cfg)
    qfield = "quantization_config" if where != "text_config" else "text_config.quantization_config"
    parsed = _config_schemes(qc, cfg_file, qfield) if qc is not None else None
    tc = cfg.get("text_config")
    if where == "top-level" and isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        if tc["quantization_config"] != qc:
            warnings.append("text_config.quantization_config differs from the top-level one (ATOM copies the "
                            "nested one up; remove it, as Quark's export does)")

    modules: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in infos.items():
        mod, param = keys.split_param(name)
        if param in keys.QUANT_PARAMS:
            modules[mod][param] = info
    allowed = set(parsed["schemes"]) if parsed else set()
    counts: Counter[str] = Counter()
    for mod, params in modules.items():
        layout = _module_layout(mod, params)
        if layout is None:
            continue
        if layout.startswith("dense:"):
            counts[layout[len("dense:"):]] += 1
            continue
        fits = _LAYOUT_SCHEMES[layout] & allowed
        t = params.get(keys.CT_PACKED) or params[keys.WEIGHT]
        if not parsed:
            raise FormatError(f"{t.file}: tensor {t.name!r} is {_LAYOUT_TEXT[layout]} but {cfg_file} has no "
                              f"quantization_config")
        if not fits:
            raise FormatError(f"{cfg_file}: field '{qfield}' declares {', '.join(parsed['schemes'])} but tensor "
                              f"{t.name!r} in {t.file.name} is {_LAYOUT_TEXT[layout]}")
        # A layout that two declared schemes share (fp8) is counted under the first declared one.
        counts[next(s for s in parsed["schemes"] if s in fits)] += 1

    dense = {k: v for k, v in counts.items() if k not in QUANT_SCHEMES}
    if parsed:
        scheme = parsed["schemes"][0]
        if not any(counts.get(s) for s in parsed["schemes"]):
            warnings.append(f"{qfield} declares {scheme} but no tensor is quantized (everything excluded?)")
    elif dense:
        scheme = max(dense.items(), key=lambda kv: kv[1])[0]
    else:
        floats = Counter({_FLOAT_NAMES[i.dtype]: i.nbytes for i in infos.values() if i.dtype in _FLOAT_NAMES})
        scheme = floats.most_common(1)[0][0] if floats else "unknown"
    ordered = {s: counts[s] for s in QUANT_SCHEMES if counts.get(s)}
    ordered.update(sorted(dense.items()))
    return QuantInfo(
        scheme=scheme,
        method=parsed["method"] if parsed else None,
        config_location=where,
        schemes=list(parsed["schemes"]) if parsed else [],
        weights=parsed.get("weights") if parsed else None,
        activations=parsed["activations"] if parsed else None,
        group_size=parsed["group_size"] if parsed else None,
        pack_method=parsed["pack_method"] if parsed else None,
        exclude=parsed["exclude"] if parsed else None,
        modules=ordered,
    )


# -- target -------------------------------------------------------------------------------------


