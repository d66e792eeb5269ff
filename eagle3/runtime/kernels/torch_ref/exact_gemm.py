"""Exact integer / float64 GEMMs for quantized activations (W4A8 int8, FP8 activations)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    pass

from eagle3.runtime.kernels.torch_ref.act_quant import quantize_fp8_per_token, quantize_int8_per_token


def int8_linear(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """W4A8 (int8 activations): per-token int8 ``x``, ``int32 acc = x_q @ codes.T`` (exact),
    ``y = acc * s_x[m] * s_w[n]`` in fp32."""
    q, sx = quantize_int8_per_token(x)
    return int8_gemm(q, sx, codes, w_scale, min_rows)


def int8_gemm(q: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
              min_rows: int = 1) -> torch.Tensor:
    """:func:`int8_linear` of activations already quantized (``quantize_int8_per_token``)."""
    m = q.shape[0]
    if m < min_rows:
        q = F.pad(q, (0, 0, 0, min_rows - m))
    acc = torch._int_mm(q, codes.t())[:m]
    return acc.float() * sx[:, None] * w_scale[None, :]


def fp8_int4_linear(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """:func:`fp8_linear` for int8 INT4 ``codes [N, K]``, without widening them to float64: an E4M3
    value times 2^9 is an integer below 2^18 (3 mantissa bits, exponents -9..8), split here into
    three int8 digits (base 2^7); each digit's int32 GEMM with the codes is exact (|sum| < 127 * 8 *
    K), and so is their sum in int64. That is the exact sum fp8_linear forms in float64 (x 2^9, also
    exact), so the result has its bits."""
    if x.shape[1] >= FP8_DIGITS_MAX_K:  # (the int32 digit sums could overflow)
        return fp8_linear(x, codes.to(torch.float64), w_scale)
    digits, sx = fp8_digits(x)
    return fp8_digits_gemm(digits, sx, codes, w_scale, min_rows)


FP8_DIGITS_MAX_K = 1 << 20  # fan-in below which the int8 digit GEMMs of fp8_int4_linear are exact


def fp8_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token E4M3 ``x [M, K]`` as int8 base-2^7 digits ``[M, 3, K]`` of ``q * 2^9`` (high
    digit first), and the per-token scales ``[M]`` (see :func:`fp8_int4_linear`)."""
    q, sx = quantize_fp8_per_token(x)
    xi = (q.float() * 512).to(torch.int32)  # exact integers
    d2 = xi >> 14  # [-14, 14]
    r = xi - (d2 << 14)  # [0, 2^14)
    return torch.stack([d2, r >> 7, r & 127], dim=1).to(torch.int8), sx


def fp8_digits_gemm(digits: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
                    min_rows: int = 1) -> torch.Tensor:
    """:func:`fp8_int4_linear` of activations already split by :func:`fp8_digits`: the three
    digits of every row in one int32 GEMM (each row of it exact), recombined in int64."""
    m, _, k = digits.shape
    a = digits.reshape(3 * m, k)
    if 3 * m < min_rows:
        a = F.pad(a, (0, 0, 0, min_rows - 3 * m))
    parts = torch._int_mm(a, codes.t())[: 3 * m].view(m, 3, -1).to(torch.int64)
    acc = (parts[:, 0] << 14).add_(parts[:, 1] << 7).add_(parts[:, 2])
    return (acc.to(torch.float64) / 512).float() * sx[:, None] * w_scale[None, :]


def fp8_linear(x: torch.Tensor, w64: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8-activation variant: per-token E4M3 ``x`` times the weight codes, summed exactly in
    float64, then ``* s_x[m] * s_w[n]`` in fp32."""
    q, sx = quantize_fp8_per_token(x)
    acc = q.to(torch.float64) @ w64.t()
    return acc.float() * sx[:, None] * w_scale[None, :]
