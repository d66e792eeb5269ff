"""Batch-invariant float GEMMs: row tiles of exactly ``ROW_TILE`` rows (see the package doc)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    pass



ROW_TILE = 16  # GEMM rows per tile: every float GEMM is a [ROW_TILE, K] x [K, N] product


def _pad_rows(x: torch.Tensor, multiple: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` in ``dtype`` (default its own) with dim -2 zero-padded up to a multiple of ``multiple``
    (at least one tile): the widening and the padding in one copy (the same values as
    ``F.pad(x.to(dtype), ...)``: a widening cast is exact)."""
    dtype = dtype or x.dtype
    m = x.shape[-2]
    target = max(multiple, -(-m // multiple) * multiple)
    if target == m:
        return x if x.dtype == dtype else x.to(dtype)
    out = x.new_empty(*x.shape[:-2], target, x.shape[-1], dtype=dtype)
    out[..., :m, :].copy_(x)
    out[..., m:, :].zero_()
    return out


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """GEMM operand dtype. CPUs without AVX512-BF16 run bf16 GEMMs ~10x slower than fp32 (measured
    here), so on CPU bf16/fp16 weights are widened to fp32 once at load and each GEMM output is
    rounded back to the model dtype: the same math as a bf16 GEMM with fp32 accumulation."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def mm_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N]`` computed as ``ceil(M / ROW_TILE)`` identical tile GEMMs, in
    ``w_t.dtype``; returns ``x.dtype``."""
    m, k = x.shape
    if m == 0:
        return x.new_empty(0, w_t.shape[1])
    xp = _pad_rows(x, ROW_TILE, w_t.dtype)
    nb = xp.shape[0] // ROW_TILE
    out = torch.bmm(xp.view(nb, ROW_TILE, k), w_t.expand(nb, k, w_t.shape[1])).view(nb * ROW_TILE, -1)[:m]
    return out if out.dtype == x.dtype else out.to(x.dtype)


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [B, M, K] @ w [B, K, N]`` with the M rows tiled as in :func:`mm_rows` (in ``w.dtype``,
    returns ``x.dtype``)."""
    b, m, k = x.shape
    n = w.shape[-1]
    if m == 0:
        return x.new_empty(b, 0, n)
    xp = _pad_rows(x, ROW_TILE, w.dtype)
    nb = xp.shape[1] // ROW_TILE
    if nb == 1:
        out = torch.bmm(xp, w)[:, :m]
        return out if out.dtype == x.dtype else out.to(x.dtype)
    # Per batch entry, its weight broadcast over the row tiles (stride 0): repeating the weight
    # per tile for one big bmm copied E experts x T/16 tiles of weights in a prefill step.
    out = xp.new_empty(b, nb * ROW_TILE, n)
    for i in range(b):
        torch.bmm(xp[i].reshape(nb, ROW_TILE, k), w[i].expand(nb, k, n), out=out[i].view(nb, ROW_TILE, n))
    return out[:, :m].to(x.dtype)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain ``bmm`` in ``b.dtype`` returning ``a.dtype`` (fixed-shape tiles only)."""
    return torch.bmm(a.to(b.dtype), b).to(a.dtype)
