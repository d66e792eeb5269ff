"""The Quark engine: each weight computed with AMD Quark 0.13's own per-tensor primitives, and the
exported ``quantization_config`` built with Quark's own config classes.

Why not Quark's ``direct_quantize_checkpoint`` itself: in 0.13 its
single-stage INT4 output is packed in natural nibble order while config.json says ``reorder``,
has no zero points and untransposed per-group scales (transformers reloads it silently wrong);
FP8-block sources are a silent no-op on CPU; it fails with ``KeyError: 'weight_packed'`` when a
module's packed weight and scale lie in different shards and with ``NameError`` without
compressed-tensors. So eagle3 streams the files itself (shared with the native engine) and asks
Quark only for what Quark is the reference of: the numbers. The sequence per weight is that of
``file2file_quantization._single_stage_quantize_weight`` / ``_progressive_quantize_weight``
(observer -> ``scaled_real_quantize`` -> ``create_pack_method(...).pack``), including its
promotion of ``scale_type="float"`` to fp32 scales, with the export defaults (``reorder`` packing,
transposed per-group scales, packed zero points) instead of 0.13's file-to-file deviations.

Importing ``quark.torch`` takes 20-40 s and needs a C++ compiler; this module imports it lazily,
with ``QUARK_DISABLE_COMPILE=1`` (torch.compile of fake-quant ops costs 14-42 s and changes no bit).
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from eagle3.errors import UsageError
from eagle3.formats import keys
from eagle3.quantize.recipes import ActivationSpec, Recipe, WeightSpec
from eagle3.quantize.sources import RowSource


@lru_cache(maxsize=1)
def quark_api() -> SimpleNamespace:
    """Import the pieces of ``quark.torch`` eagle3 uses (once per process)."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    try:
        import quark.torch.kernel as kernel
        from quark.torch.quantization.config import config as C
        from quark.torch.quantization.config.type import ScaleType
        from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
        from quark.torch.utils.numerics import to_e8m0_uint8
        from quark.torch.utils.pack import create_pack_method
    except ImportError as e:
        raise UsageError(f"--engine quark needs AMD Quark 0.13 (pip install 'eagle3[quark]'): {e}") from None
    except RuntimeError as e:  # the hw-emulation extension is JIT-built with g++ on every import
        raise UsageError(f"--engine quark: Quark failed to import (it needs a C++ compiler): {e}") from None
    return SimpleNamespace(C=C, kernel=kernel, ScaleType=ScaleType, FakeQuantizeBase=FakeQuantizeBase,
                           to_e8m0_uint8=to_e8m0_uint8, create_pack_method=create_pack_method)


# ---------------------------------------------------------------------------------------------
# Recipe -> Quark config classes
# ---------------------------------------------------------------------------------------------


def weight_qspec(spec: WeightSpec) -> Any:
    """QTensorConfig (or the two-stage list) of a recipe's weight scheme."""
    C = quark_api().C
    if spec.format == "fp8_int4":  # AMD's Kimi-K2.5-W4A8 script, verbatim
        return C.ProgressiveSpec(
            first_stage=C.FP8E4M3PerTensorSpec(observer_method="min_max", scale_type="float32", is_dynamic=False),
            second_stage=C.Int4PerChannelSpec(symmetric=True, scale_type="float32", round_method="half_even",
                                              is_dynamic=False, ch_axis=0),
        ).to_quantization_spec()
    if spec.format == "int4" and spec.qscheme == "per_channel":
        return C.Int4PerChannelSpec(ch_axis=0, symmetric=True, scale_type="float32", round_method="half_even",
                                    is_dynamic=False).to_quantization_spec()
    if spec.format == "int4":
        return C.Int4PerGroupSpec(ch_axis=-1, group_size=int(spec.group_size or 0), symmetric=True,
                                  scale_type="float32", round_method="half_even",
                                  is_dynamic=False).to_quantization_spec()
    if spec.format == "mxfp4":
        return C.OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    if spec.qscheme == "per_channel":
        return C.FP8E4M3PerChannelSpec(ch_axis=0, scale_type="float32", is_dynamic=False).to_quantization_spec()
    return C.FP8E4M3PerTensorSpec(observer_method="min_max", scale_type="float32",
                                  is_dynamic=False).to_quantization_spec()


def input_qspec(act: ActivationSpec) -> Any:
    C = quark_api().C
    if act.format == "none":
        return None
    if act.format == "fp8" and act.qscheme == "per_tensor":  # the W4A8 script's input spec
        return C.FP8E4M3PerTensorSpec(observer_method="min_max", scale_type="float32",
                                      is_dynamic=True).to_quantization_spec()
    if act.format == "fp8":  # per-token = per_channel on ch_axis 1, dynamic (the ptpc_fp8 template)
        return C.FP8E4M3PerChannelSpec(ch_axis=1, is_dynamic=True).to_quantization_spec()
    if act.format == "int8":
        return C.Int8PerChannelSpec(ch_axis=1, symmetric=True, is_dynamic=True).to_quantization_spec()
    return C.OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()


def quantization_config(recipe: Recipe, exclude: list[str]) -> dict[str, Any]:
    """``config.json["quantization_config"]`` built with Quark's QConfig, as Quark's file-to-file
    export writes it (``QConfig.to_dict()`` + the ``export`` block, sorted exclude list)."""
    C = quark_api().C
    cfg = C.QConfig(global_quant_config=C.QLayerConfig(weight=weight_qspec(recipe.weight),
                                                       input_tensors=input_qspec(recipe.activation)),
                    exclude=list(exclude))
    d = cfg.to_dict()
    d["export"] = {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None}
    d["exclude"] = sorted(exclude)
    return d


# ---------------------------------------------------------------------------------------------
# Per-tensor quantization with Quark's primitives
# ---------------------------------------------------------------------------------------------


def _stage(w: torch.Tensor, qspec: Any) -> tuple[torch.Tensor, Any]:
    """One Quark quantization stage: observer, then ``scaled_real_quantize``. Returns (codes, quantizer)."""
    api = quark_api()
    qspec = copy.deepcopy(qspec)
    # file2file's promotion: non-MX "float" scales are computed and stored in fp32.
    if qspec.scale_format != "e8m0" and qspec.scale_type == api.ScaleType.float:
        qspec.scale_type = api.ScaleType.float32
    fq = api.FakeQuantizeBase.get_fake_quantize(qspec)
    fq.enable_observer()
    fq.disable_fake_quant()
    fq(w)
    q = api.kernel.scaled_real_quantize(qspec.dtype.value, w, fq.scale, fq.zero_point, qspec.ch_axis,
                                        qspec.group_size, fq.quant_min, fq.quant_max, qspec.round_method.value,
                                        qspec.qscheme.value)
    return q, fq


class QuarkEngine:
    """Quantize a weight into Quark's export tensors with Quark's own per-tensor primitives."""

    name = "quark"

    def __init__(self) -> None:
        quark_api()  # fail early (and pay the import once) rather than on the first tensor
        self._specs: dict[WeightSpec, Any] = {}

    def _qspec(self, spec: WeightSpec) -> Any:
        if spec not in self._specs:
            self._specs[spec] = weight_qspec(spec)
        return self._specs[spec]

    def quantize(self, src: RowSource, spec: WeightSpec, zero_point: bool = False) -> dict[str, torch.Tensor]:
        api = quark_api()
        qspec = self._qspec(spec)
        w = src.full()
        with torch.no_grad():
            if isinstance(qspec, list):  # progressive: FP8 per-tensor, then INT4 per-channel on the FP8 values
                x8, fq1 = _stage(w, qspec[0])
                x8 = x8.float()
                q, fq2 = _stage(x8, qspec[1])
                pm = api.create_pack_method(qscheme=qspec[1].qscheme.value, dtype=qspec[1].dtype.value)
                out = {keys.WEIGHT: pm.pack(q, True).contiguous(), keys.SCALE: fq1.scale.float().contiguous(),
                       keys.SCALE_2: fq2.scale.float().contiguous()}
                if zero_point:  # the INT4 stage's zeros, as Quark's importer reads them
                    out[keys.ZERO_POINT_2] = pm.pack(fq2.zero_point.to(torch.int32), True).contiguous()
                return out
            q, fq = _stage(w, qspec)
            pm = api.create_pack_method(qscheme=qspec.qscheme.value, dtype=qspec.dtype.value)
            out = {keys.WEIGHT: pm.pack(q, True).contiguous()}
            if qspec.scale_format == "e8m0":
                out[keys.SCALE] = api.to_e8m0_uint8(fq.scale).contiguous()
            else:
                # Quark's export transposes per-group scales to [K/g, N], like the packed weight.
                out[keys.SCALE] = pm.transpose(fq.scale).float().contiguous()
            if zero_point:
                # pack() transposes per-group tensors itself: [N, K/g] -> [K/g, N/8].
                out[keys.ZERO_POINT] = pm.pack(fq.zero_point.to(torch.int32), True).contiguous()
            return out
