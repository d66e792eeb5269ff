"""The exported ``config.json``: Quark's ``quantization_config`` schema, written by eagle3's own
code, with the hygiene that vLLM, SGLang and ATOM all need.

The JSON is exactly what ``QConfig(...).to_dict()`` of AMD Quark 0.13 gives for the recipe plus the
``export`` block of Quark's file-to-file export (tests/quantize compare the two on every recipe).
eagle3 writes it itself rather than through Quark's classes on the default (native) path because
importing ``quark.torch`` costs 20-40 s and a C++ compiler; ``--engine quark`` builds it with
Quark's classes (:func:`eagle3.quantize.quark.quantization_config`).

Hygiene:
* every nested ``quantization_config`` (Moonshot's compressed-tensors one in ``text_config``) is
  removed and the Quark one sits at the top level (ATOM copies a nested one up and would load the
  stale scheme); ``model_type`` and everything else is left as it was (``kimi_k2`` keeps vLLM off its
  DeepSeek-V3 dynamic-MXFP4 attention path);
* ``export.kv_cache_group: []`` (vLLM/SGLang call ``len()`` on it), ``layer_quant_config: {}`` and
  ``layer_type_quant_config: {}`` (both must be dicts), ``output_tensors``/``bias`` null;
* ``exclude`` = the explicit name of every Linear left unquantized, in checkpoint naming (what
  Quark writes; SGLang and ATOM map those names) plus the recipe's prefix-agnostic ``re:`` regexes
  (vLLM matches its own module names, which differ from the checkpoint's for Kimi-K2.5).
"""

from __future__ import annotations

import copy
from typing import Any

from eagle3.quantize.recipes import ActivationSpec, Recipe, WeightSpec

QUARK_VERSION = "0.13"  # the Quark release whose schema (and numerics) eagle3 reproduces
EXPORT_BLOCK: dict[str, Any] = {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                                "weight_format": "real_quantized", "weight_merge_groups": None}
_OBSERVERS = {"per_tensor": "PerTensorMinMaxObserver", "per_channel": "PerChannelMinMaxObserver",
              "per_group": "PerGroupMinMaxObserver"}


def _tensor(dtype: str, qscheme: str, *, is_dynamic: bool, ch_axis: int | None = None,
            group_size: int | None = None, symmetric: bool | None = True, scale_type: str = "float",
            mx: bool = False) -> dict[str, Any]:
    """One QTensorConfig.to_dict(), keys in Quark's order."""
    return {
        "dtype": dtype,
        "is_dynamic": is_dynamic,
        "qscheme": qscheme,
        "ch_axis": ch_axis,
        "group_size": group_size,
        "block_size": None,
        "symmetric": None if mx else symmetric,
        "round_method": "half_even",
        "scale_type": scale_type,
        "zero_point_type": "int32",
        "scale_format": "e8m0" if mx else None,
        "scale_calculation_mode": "even" if mx else None,
        "mx_element_dtype": None,
        "observer_cls": "PerBlockMXObserver" if mx else _OBSERVERS[qscheme],
        "is_scale_quant": False,
        "enable_buffer_reuse": False,
        "max_input_numel": 4194304,
    }


def weight_dict(spec: WeightSpec) -> dict[str, Any] | list[dict[str, Any]]:
    if spec.format == "fp8_int4":
        return [_tensor("fp8_e4m3", "per_tensor", is_dynamic=False, scale_type="float32"),
                _tensor("int4", "per_channel", is_dynamic=False, ch_axis=0, scale_type="float32")]
    if spec.format == "int4" and spec.qscheme == "per_channel":
        return _tensor("int4", "per_channel", is_dynamic=False, ch_axis=0, scale_type="float32")
    if spec.format == "int4":
        return _tensor("int4", "per_group", is_dynamic=False, ch_axis=-1, group_size=spec.group_size,
                       scale_type="float32")
    if spec.format == "mxfp4":
        return _tensor("fp4", "per_group", is_dynamic=False, ch_axis=-1, group_size=32, mx=True)
    if spec.qscheme == "per_channel":
        return _tensor("fp8_e4m3", "per_channel", is_dynamic=False, ch_axis=0, scale_type="float32")
    return _tensor("fp8_e4m3", "per_tensor", is_dynamic=False, scale_type="float32")


def input_dict(act: ActivationSpec) -> dict[str, Any] | None:
    if act.format == "none":
        return None
    if act.format == "fp8" and act.qscheme == "per_tensor":
        return _tensor("fp8_e4m3", "per_tensor", is_dynamic=True, scale_type="float32")
    if act.format == "fp8":
        return _tensor("fp8_e4m3", "per_channel", is_dynamic=True, ch_axis=1)
    if act.format == "int8":
        return _tensor("int8", "per_channel", is_dynamic=True, ch_axis=1)
    return _tensor("fp4", "per_group", is_dynamic=True, ch_axis=-1, group_size=32, mx=True)


def quantization_config(recipe: Recipe, exclude: list[str]) -> dict[str, Any]:
    """``config.json["quantization_config"]`` for a recipe, in Quark 0.13's file-to-file form."""
    return {
        "global_quant_config": {
            "input_tensors": input_dict(recipe.activation),
            "output_tensors": None,
            "weight": weight_dict(recipe.weight),
            "bias": None,
            "target_device": None,
        },
        "exclude": sorted(exclude),
        "algo_config": None,
        "softmax_quant_spec": None,
        "quant_method": "quark",
        "layer_type_quant_config": {},
        "layer_quant_config": {},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "quant_mode": "eager_mode",
        "version": QUARK_VERSION,
        "export": copy.deepcopy(EXPORT_BLOCK),
    }


def exclude_list(unquantized_modules: list[str], regexes: tuple[str, ...] | list[str]) -> list[str]:
    """Explicit module names (checkpoint naming) plus the portable regexes, no duplicates."""
    return list(dict.fromkeys([*unquantized_modules, *regexes]))


def _strip_quantization_configs(d: dict[str, Any]) -> None:
    for k in [k for k in d if k == "quantization_config"]:
        del d[k]
    for v in d.values():
        if isinstance(v, dict):
            _strip_quantization_configs(v)


def export_config(source_config: dict[str, Any], quant_config: dict[str, Any]) -> dict[str, Any]:
    """The output ``config.json``: the source's, every nested quantization_config removed, Quark's
    at the top level; nothing else changes (``model_type`` included)."""
    cfg = copy.deepcopy(source_config)
    _strip_quantization_configs(cfg)
    cfg["quantization_config"] = quant_config
    return cfg
