"""Batch-invariant float GEMMs: row tiles of exactly ``ROW_TILE`` rows (see the package doc)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    pass



ROW_TILE = 16  # GEMM rows per tile: every float GEMM is a [ROW_TILE, K] x [K, N] product

# Stacked row tiles (``tile_gemm``, used by the attention's key tiles). Where this process's CPU
# BLAS gives each row of one ``[m*R, K] x [K, N]`` GEMM the bits it has in its own
# ``[R, K] x [K, N]`` tile (MKL on the x86-64 machine measured here does: it picks kernels by K and
# N, not M), ``m`` tiles run as one GEMM. Only tile counts the probe checked are stacked
# (``stack_sizes``), for exactly the operand's shape, strides and dtype; elsewhere the tiles run as
# a batched GEMM. Either way every row has its tile's bits. The linears keep their batched row
# tiles: stacking them measured no faster end to end (batch-16 prefill of the tiny target).
_STACK_PROBE = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256)  # tile counts the probe may check
_STACK_PROBE_MACS = 1 << 27  # multiply-adds one probe may spend (big weights probe fewer counts)


def _pad_rows(x: torch.Tensor, multiple: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` in ``dtype`` (default its own) with dim -2 zero-padded up to a multiple of ``multiple``
    (at least one tile): the widening and the padding in one copy (the same values as
    ``F.pad(x.to(dtype), ...)``: a widening cast is exact)."""
    dtype = dtype or x.dtype
    m = x.shape[-2]
    target = max(multiple, -(-m // multiple) * multiple)
    if target == m:
        return x if x.dtype == dtype else x.to(dtype)
    # Every linear of a decode step pads (1 token -> 16 rows): one op where no cast is needed,
    # else zeros and one widening copy (~3x / ~1.5x fewer microseconds than empty, copy, zero).
    if x.dtype == dtype:
        return torch.constant_pad_nd(x, (0, 0, 0, target - m))
    out = x.new_zeros(*x.shape[:-2], target, x.shape[-1], dtype=dtype)
    out[..., :m, :] = x
    return out


@functools.cache
def stack_sizes(rows: int, k: int, n: int, stride: tuple[int, int], dtype: torch.dtype,
                threads: int) -> tuple[int, ...]:
    """Tile counts ``m`` (ascending, 1 first) for which a row of ``[m*rows, k] x [k, n]`` - as
    ``mm``, and as an entry of a ``bmm`` with broadcast or distinct operands - has the bits of the
    same row in a ``[rows, k]`` tile GEMM, the ``[k, n]`` operand with strides ``stride`` and
    ``dtype``, at ``threads`` intra-op threads; probed once per process on seeded data. ``(1,)``:
    never stack (also when a row's bits depend on its place in the tile)."""
    gen = torch.Generator().manual_seed(20261126)
    span = (k - 1) * stride[0] + (n - 1) * stride[1] + 1

    def operand() -> torch.Tensor:
        return torch.randn(span, generator=gen).to(dtype).as_strided((k, n), stride)

    w, w2 = operand(), operand()
    # A row's bits must not depend on its place in the tile either: stacked blocks pack the real
    # rows of several tiles (attention._Blocks), which moves a row to another place.
    x = torch.randn(rows, k, generator=gen).to(dtype)
    if rows > 1 and not torch.equal(torch.mm(x.roll(1, 0), w).roll(-1, 0), torch.mm(x, w)):
        return (1,)
    ok = [1]
    for m in _STACK_PROBE[1:]:
        if m * rows * k * n > _STACK_PROBE_MACS:
            break
        x, x2 = (torch.randn(m * rows, k, generator=gen).to(dtype) for _ in range(2))
        tiles = torch.bmm(x.view(m, rows, k), w.expand(m, k, n)).view(m * rows, n)
        tiles2 = torch.bmm(x2.view(m, rows, k), w2.expand(m, k, n)).view(m * rows, n)
        distinct = torch.bmm(torch.stack([x2, x]), torch.stack([w2, w]))  # the blocks' form
        if not (torch.equal(torch.mm(x, w), tiles)
                and torch.equal(torch.bmm(x.expand(2, m * rows, k), w.expand(2, k, n))[1], tiles)
                and torch.equal(distinct[0], tiles2) and torch.equal(distinct[1], tiles)):
            break  # the first count that differs ends the stacking: larger ones are not trusted
        ok.append(m)
    return tuple(ok)


def split_tiles(count: int, sizes: tuple[int, ...]) -> list[int]:
    """``count`` row tiles as consecutive chunks of probed ``sizes`` (largest first)."""
    out = []
    for m in reversed(sizes):
        while count >= m:
            out.append(m)
            count -= m
    return out


def tile_gemm(x: torch.Tensor, w_t: torch.Tensor, rows: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """``x [nb*rows, K] @ w_t [K, N]``: every row with the bits of its ``rows``-row tile GEMM,
    ``sizes`` (from :func:`stack_sizes` for this operand; ``(1,)``: none) tiles stacked per GEMM."""
    m, k = x.shape
    n = w_t.shape[1]
    nb = m // rows
    if len(sizes) == 1:
        return torch.bmm(x.view(nb, rows, k), w_t.expand(nb, k, n)).view(m, n)
    out = x.new_empty(m, n)
    a = 0
    for c in split_tiles(nb, sizes):
        torch.mm(x[a * rows: (a + c) * rows], w_t, out=out[a * rows: (a + c) * rows])
        a += c
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
