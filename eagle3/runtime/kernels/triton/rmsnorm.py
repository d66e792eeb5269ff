"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow the torch reference (``TorchBackend.rms_norm``, transformers' DeepseekV3): the
sum of squares and the normalisation in fp32, the result cast to the activation dtype, then the
weight multiply in the activation dtype. With a residual, ``x + residual`` is formed (and
returned) in the activation dtype first. A row's reduction runs over one block of
``next_pow2(hidden)`` lanes whatever the number of rows (narrow rows are handled a few per
program, a count fixed by the hidden size), so the result is batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import INTERPRET, block


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, stride_x, stride_r, stride_o, stride_ro, m, n, eps,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (row < m) & (offs < n)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(r_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n
    rstd = tl.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))
    y = (xf * rstd[:, None]).to(x.dtype)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(x.dtype)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rows_per_program(n: int) -> int:
    """Rows per program: a function of the hidden size only (never of the row count), so a row's
    reduction is the same whatever the batch; several rows per program only for narrow rows."""
    return max(1, min(16, 4096 // block(n, 1)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight * norm(x [+ residual]), x [+ residual])`` over the last dim; the second item is
    None without a residual."""
    n = x.shape[-1]
    shape = x.shape
    dtype = x.dtype
    emulate = INTERPRET and dtype == torch.bfloat16  # see common.py: finish the bf16 steps in torch
    xs = _rows(x.float() if emulate else x)
    rs = None if residual is None else _rows(residual.float() if emulate else residual.to(x.dtype))
    if emulate and rs is not None:
        xs = _rows((x + residual.to(dtype)).float())  # the bf16 add, exactly as torch does it
        rs = None
    out = torch.empty_like(xs)
    r_out = torch.empty_like(xs) if rs is not None else out
    if xs.shape[0]:
        rows = rows_per_program(n)
        _rms_norm_kernel[(triton.cdiv(xs.shape[0], rows),)](
            xs, rs if rs is not None else xs, weight, out, r_out, xs.stride(0),
            rs.stride(0) if rs is not None else 0, out.stride(0), r_out.stride(0), xs.shape[0], n, float(eps),
            HAS_RES=rs is not None, HAS_W=not emulate, ROWS=rows, BLOCK=block(n, 1))
    if emulate:
        summed = (x + residual.to(dtype)) if residual is not None else None
        return weight * out.to(dtype).view(shape), summed
    return out.view(shape), (r_out.view(shape) if rs is not None else None)
