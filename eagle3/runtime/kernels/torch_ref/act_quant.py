"""Dynamic activation quantization (per token row; per 32-block for MXFP4) and the execution
mode of a (weight, activation quantization) pair."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from eagle3.errors import UsageError
from eagle3.formats import codecs
from eagle3.runtime.kernels.base import (
    ActQuant,
    FP8Weight,
    Int4Weight,
    LinearWeight,
)

if TYPE_CHECKING:  # pragma: no cover
    pass



INT8_MAX = 127.0


def _scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``amax / qmax`` (1 for an all-zero row) with IEEE division on every device. The divisor is a
    tensor on ``amax``'s device on purpose: for ``tensor / python_scalar`` PyTorch's CUDA kernel
    computes ``tensor * (1 / scalar)`` (BinaryDivTrueKernel.cu, "may lose one bit of precision"),
    which differs by an ulp from the CPU's true division and from the Triton kernel's ``div_rn``."""
    return torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``scale = amax / 127``, ``q = round_half_even(x / scale)``."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = _scale(amax, INT8_MAX)
    q = torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3: ``scale = amax / 448`` (codecs.fp8_quantize saturates and rounds)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = _scale(amax, codecs.FP8_E4M3_MAX)
    return codecs.fp8_quantize(xf, scale[:, None]), scale


def mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP4 fake-quantization of activations (Quark "even" scales per 32-block of a row),
    returned in ``x.dtype``. An E2M1 value times a power of two is exact in bf16."""
    packed, scale = codecs.mxfp4_quantize(x.float())
    return codecs.mxfp4_dequantize(packed, scale, dtype=x.dtype)


def _check_act(w: LinearWeight, act: ActQuant) -> str:
    """The execution mode for (weight kind, activation quant): dense | int8 | fp8 | mxfp4."""
    if act is None:
        return "dense"
    if act == "mxfp4":
        return "mxfp4"  # any weight: activations are fake-quantized, the GEMM is a float GEMM
    if act in ("int8", "fp8"):
        if isinstance(w, Int4Weight):
            return act
        if isinstance(w, FP8Weight) and act == "fp8" and w.block is None:
            return "fp8"
        raise UsageError(f"{act} activations with a {type(w).__name__} weight are not supported")
    raise UsageError(f"unknown activation quantization {act!r}")
