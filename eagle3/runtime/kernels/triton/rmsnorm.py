"""RMSNorm, fused residual-add + RMSNorm, and either fused with the per-token activation quantization
that follows it (W4A8: int8 / FP8 E4M3 codes of the normed rows for the next GEMM).

Numerics follow the torch reference (``TorchBackend.rms_norm``, transformers' DeepseekV3): the
sum of squares and the normalisation in fp32, the result cast to the activation dtype, then the
weight multiply in the activation dtype. With a residual, ``x + residual`` is formed (and
returned) in the activation dtype first. A row's reduction runs over one block of
``next_pow2(hidden)`` lanes whatever the number of rows (narrow rows are handled a few per
program, a count fixed by the hidden size), so the result is batch invariant.

The quantization (``QUANT``) is :mod:`.act_quant`'s arithmetic on the normed row as stored (rounded
to the activation dtype): one launch instead of two and the row read once, the same codes and
scales bit for bit (max, IEEE division and rounding are exact operations, so the layout of the
tile does not matter). Under the interpreter a bf16 model runs on fp32 copies with every bf16
rounding made explicit (``BF16``: ``common.bf16_round`` where torch rounds its bf16 ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton import act_quant
from eagle3.runtime.kernels.triton.common import INTERPRET, bf16_round, block, widen


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, q_ptr, s_ptr, stride_x, stride_r, stride_o, stride_ro,
                     stride_q, m, n, eps, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, QUANT: tl.constexpr,
                     QMAX: tl.constexpr, BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``QUANT``: 0 none, 1 int8, 2 E4M3 codes of the output rows (``q``, scales ``s``)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (row < m) & (offs < n)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = bf16_round(x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0), BF16)
        tl.store(r_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n
    rstd = tl.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))
    y = bf16_round((xf * rstd[:, None]).to(x.dtype), BF16)
    if HAS_W:
        y = bf16_round(y * tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(x.dtype), BF16)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if QUANT != 0:  # act_quant._quant_kernel on the row just stored (padding lanes hold exact zeros)
        v = y.to(tl.float32)
        scale = act_quant.quant_scale(tl.max(tl.abs(v), axis=1), QMAX)
        tl.store(q_ptr + row * stride_q + offs, act_quant.quant_codes(v, scale[:, None], QMAX, QUANT == 1), mask=mask)
        tl.store(s_ptr + row, scale[:, None], mask=row < m)


def rows_per_program(n: int) -> int:
    """Rows per program: a function of the hidden size only (never of the row count), so a row's
    reduction is the same whatever the batch; several rows per program only for narrow rows."""
    return max(1, min(16, 4096 // block(n, 1)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(xs: torch.Tensor, rs: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            quant: str | None = None, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None, torch.Tensor | None]:
    """The kernel over rows ``xs`` (+ ``rs``): (normed rows, their sum with ``rs``, codes, scales)."""
    m, n = xs.shape
    out = torch.empty_like(xs)
    r_out = torch.empty_like(xs) if rs is not None else out
    q = s = None
    if quant is not None:
        q = torch.empty(m, n, dtype=act_quant.CODE_DTYPE[quant], device=xs.device)
        s = torch.empty(m, dtype=torch.float32, device=xs.device)
    if m:
        rows = rows_per_program(n)
        _rms_norm_kernel[(triton.cdiv(m, rows),)](
            xs, rs if rs is not None else xs, weight if weight is not None else xs, out, r_out,
            q if q is not None else out, s if s is not None else out, xs.stride(0),
            rs.stride(0) if rs is not None else 0, out.stride(0), r_out.stride(0), q.stride(0) if q is not None else 0,
            m, n, float(eps), HAS_RES=rs is not None, HAS_W=weight is not None,
            QUANT={None: 0, "int8": 1, "fp8": 2}[quant], QMAX=act_quant.QMAX.get(quant, 1.0), BF16=bf16, ROWS=rows,
            BLOCK=block(n, 1))
    return out, (r_out if rs is not None else None), q, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight * norm(x [+ residual]), x [+ residual])`` over the last dim; the second item is
    None without a residual."""
    shape = x.shape
    dtype = x.dtype
    emulate = INTERPRET and dtype == torch.bfloat16  # see common.py: finish the bf16 steps in torch
    xs = _rows(x.float() if emulate else x)
    rs = None if residual is None else _rows(residual.float() if emulate else residual.to(x.dtype))
    if emulate and rs is not None:
        xs = _rows((x + residual.to(dtype)).float())  # the bf16 add, exactly as torch does it
        rs = None
    out, r_out, _, _ = _launch(xs, rs, None if emulate else weight, eps)
    if emulate:
        summed = (x + residual.to(dtype)) if residual is not None else None
        return weight * out.to(dtype).view(shape), summed
    return out.view(shape), (r_out.view(shape) if r_out is not None else None)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: str,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                                   torch.Tensor]:
    """``(y, summed, codes, scales)``: :func:`rms_norm` of ``x [T, H]`` (+ ``residual``) and the
    per-token ``quant`` (``int8`` | ``fp8``) quantization of ``y`` as ``act_quant`` makes it (int8 /
    float8_e4m3fn codes ``[T, H]``, fp32 scales ``[T]``), in one launch."""
    dtype = x.dtype
    bf16 = INTERPRET and dtype == torch.bfloat16  # fp32 copies, the bf16 roundings in the kernel
    xs = _rows(widen(x))
    rs = None if residual is None else _rows(widen(residual.to(dtype)))
    out, r_out, q, s = _launch(xs, rs, widen(weight.to(dtype)), eps, quant, bf16)
    assert q is not None and s is not None
    y = out.to(dtype).view(x.shape)
    return y, (None if r_out is None else r_out.to(dtype).view(x.shape)), q, s
