"""Dynamic per-token activation quantization: symmetric int8 and FP8 E4M3, one program per row.

Bit-exact with the torch reference (``torch_ref.quantize_int8_per_token`` /
``quantize_fp8_per_token``): ``scale = amax / 127`` (``/ 448`` for FP8, 1 for an all-zero row),
``q = x / scale`` with IEEE division (``tl.div_rn``: plain ``/`` may be approximate on GPUs),
rounded half-to-even for int8 (torch.round) by the 1.5 * 2^23 trick, which is exact for
|v| <= 2^22 and portable to every backend (no libdevice ``rint``), clamped to +-127; for FP8
clamped to +-448, rounded to the E4M3 grid
(ties to even) and converted. On MI300 (gfx942) the native FP8 is
the fnuz variant: the adapter will convert, this kernel writes OCP e4m3fn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import block, widen

_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: v + M - M rounds fp32 v to an integer, ties to even


@triton.jit
def _round_to_e4m3_grid(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest E4M3 value, ties to even, still in fp32.

    The conversion that follows is then exact. Done by hand because the interpreter's fp32 -> fp8
    cast does not carry into the exponent when the mantissa rounds up (31.77 became 16, verified
    with triton 3.9); on a GPU this is a no-op before the hardware conversion."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # binade; E4M3 subnormals share 2^-6's ulp
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    mag = ((tl.abs(v) * inv + 12582912.0) - 12582912.0) * ulp
    # keep the sign bit, so that tiny negatives round to -0 as the hardware conversion does
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quant_scale(amax, QMAX: tl.constexpr):
    """A row's scale from its largest magnitude: ``amax / QMAX`` (IEEE division), 1 for a zero row."""
    return tl.where(amax > 0, tl.div_rn(amax, QMAX), 1.0)


@triton.jit
def quant_codes(x, scale, QMAX: tl.constexpr, TO_INT8: tl.constexpr):
    """fp32 ``x / scale`` as int8 (round half to even) or E4M3 codes, clamped to ``+-QMAX``."""
    v = tl.div_rn(x, scale)
    if TO_INT8:
        r = (v + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int8)
    else:
        return _round_to_e4m3_grid(tl.minimum(tl.maximum(v, -QMAX), QMAX)).to(tl.float8e4nv)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n, QMAX: tl.constexpr, TO_INT8: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = quant_scale(tl.max(tl.abs(x), axis=0), QMAX)
    tl.store(q_ptr + row * stride_q + offs, quant_codes(x, scale, QMAX, TO_INT8), mask=mask)
    tl.store(s_ptr + row, scale)


def _quantize(x: torch.Tensor, qdtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    xs = widen(x)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    m, n = xs.shape
    q = torch.empty((m, n), dtype=qdtype, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quant_kernel[(m,)](xs, q, s, xs.stride(0), q.stride(0), n, QMAX=qmax, TO_INT8=qdtype == torch.int8,
                            BLOCK=block(n, 1))
    return q, s


QMAX = {"int8": 127.0, "fp8": 448.0}  # per-token kinds: the largest code
CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (int8 codes ``[M, K]``, fp32 scales ``[M]``)."""
    return _quantize(x, torch.int8, 127.0)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn codes ``[M, K]``, fp32 scales ``[M]``)."""
    return _quantize(x, torch.float8_e4m3fn, 448.0)
