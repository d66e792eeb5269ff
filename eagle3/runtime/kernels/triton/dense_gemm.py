"""The small dense products of the Triton backend: the MoE router (``x.float() @ W_gate.T`` in
fp32) and the absorbed MLA ``bmm`` (``q_nope[h] @ W_UK[h]``, ``o_lat[h] @ W_UV[h]``).

Why not cuBLAS: the torch reference computes these as row tiles of 16 (``torch_ref.gemm``), which
makes a row's bits independent of the batch on the CPU, but on a GPU cuBLAS picks its kernel (and
its split-K) from the whole call's shape, the number of tiles included: the same token routed in
a batch of 16 rows and in one of 20 got router logits an ulp apart, and the hidden states drifted
from there (the Triton batch-invariance test failed on an H200 by ~1e-5 in fp32).

Here ``out[b] = x[b] @ w[b]`` runs as programs of ``BM`` (16) rows x ``BN`` columns per batch
entry, walking K in steps of ``BK`` as ``acc[BN, BM] += w_tile.T @ x_tile.T`` (the weight columns
on the MMA's M side, the few decode rows on its N side, as ``linear.py``); tile sizes and the split of K follow from the weight's shape
and dtype only (``gemm_tiles.dense_tiles``, the rule of the quantized GEMMs): a long ``K`` is cut
into equal chunks until one row block launches enough programs (the router's 7168-wide reduction
in 16 chunks of 448, 12 x 16 = 192 programs at batch 1); each chunk's fp32 partial is written
aside and the partials are summed in chunk order by a second kernel. The chunking depends on the
weight alone, so a row's bits never depend on the other rows or on their number. fp32 operands run ``tl.dot`` in IEEE precision (not
TF32: the reference is fp32); bf16 / fp16 operands use the tensor cores with fp32 accumulation,
rounded once to the output dtype (as cuBLAS does).

Operands take any strides (``q_nope.transpose(0, 1)`` and the weights are read in place) and any
float dtypes: the computation dtype is the wider of the two (or the caller's: the router asks for
fp32), a narrower operand is widened in registers as it is loaded (bf16 -> fp32 is exact, so the
result equals the product of the widened copies the reference makes), and the result is in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import INTERPRET, dot_dtype, mma, tl_dtype, widen
from eagle3.runtime.kernels.triton.gemm_tiles import GemmTiles, dense_tiles

SUM_BLOCK = 1024  # elements per program of the split-K sum


def tiles(n: int, k: int, dtype: torch.dtype) -> GemmTiles:
    """Launch shape for a weight ``[K, N]`` of ``dtype`` (fp32: the IEEE router), never the row count."""
    return dense_tiles(n, k, fp32=dtype == torch.float32)


@triton.jit
def _bmm_kernel(x_ptr, w_ptr, o_ptr, M, N, K, s_xb, s_xm, s_xk, s_wb, s_wk, s_wn, s_os, s_ob, s_om,
                DOT: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr, KC: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``o[s, b, m, n] = sum over k in chunk s (``KC`` wide) of x[b, m, k] * w[b, k, n]`` (one
    chunk when ``SPLITS == 1``, then ``o`` is the output itself). Grid: (row tiles, column tiles,
    B * SPLITS)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2) // SPLITS
    s = tl.program_id(2) % SPLITS
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk0 = tl.arange(0, BK)
    xb = x_ptr + b.to(tl.int64) * s_xb
    wb = w_ptr + b.to(tl.int64) * s_wb
    k_lo = s * KC
    k_hi = tl.minimum(k_lo + KC, K)
    acc = tl.zeros([BN, BM], tl.float32)  # out.T: the weight columns are the MMA's M side, the rows its N
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + rk0
        k_ok = rk < k_hi
        a = tl.load(xb + rm[:, None] * s_xm + rk[None, :] * s_xk, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(wb + rn[:, None] * s_wn + rk[None, :] * s_wk, mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)
        acc += mma(w.to(DOT), tl.trans(a.to(DOT)), IEEE)
    o = o_ptr + s.to(tl.int64) * s_os + b.to(tl.int64) * s_ob
    tl.store(o + rm[:, None] * s_om + rn[None, :], tl.trans(acc).to(o_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, o_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``o[i] = p[0, i] + p[1, i] + ...`` in chunk order (fp32), rounded once to ``o``'s dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=ok)


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16 results go through fp32 under the interpreter (no bf16 there: common.py)."""
    return torch.float32 if INTERPRET and dtype == torch.bfloat16 else dtype


def bmm(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [B, M, K] @ w [B, K, N]`` (a weight of one batch entry may be broadcast: stride 0) in
    ``dtype`` (default: the wider of the operands' dtypes) with fp32 accumulation, returned in that
    dtype as a contiguous ``[B, M, N]``. A narrower operand is widened in registers (exact): the
    router reads its bf16 weight and activations as they are and multiplies in fp32."""
    bsz, m, k = x.shape
    n = w.shape[-1]
    if w.shape[0] != bsz or w.shape[1] != k:
        raise ValueError(f"bmm operands {list(x.shape)} x {list(w.shape)} do not fit")
    cd = dtype or torch.promote_types(x.dtype, w.dtype)
    out = torch.empty(bsz, m, n, dtype=_store_dtype(cd), device=x.device)
    if m and n and bsz:
        t = tiles(n, k, cd)
        bm, bn, bk, splits = t.bm, t.bn, t.bk, t.split
        dd = dot_dtype(cd)
        xs, ws = widen(x), widen(w)
        dest = out if splits == 1 else torch.empty(splits, bsz, m, n, dtype=torch.float32, device=x.device)
        s_os = 0 if splits == 1 else dest.stride(0)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), bsz * splits)
        _bmm_kernel[grid](xs, ws, dest, m, n, k, xs.stride(0), xs.stride(1), xs.stride(2), ws.stride(0),
                          ws.stride(1), ws.stride(2), s_os, out.stride(0), out.stride(1),
                          DOT=tl_dtype(dd), IEEE=dd == torch.float32, SPLITS=splits, KC=k // splits,
                          BM=bm, BN=bn, BK=bk, num_warps=t.warps, num_stages=t.stages)
        if splits > 1:
            numel = out.numel()
            _sum_splits_kernel[(triton.cdiv(numel, SUM_BLOCK),)](dest, out, numel, SPLITS=splits, BLOCK=SUM_BLOCK)
    return out if out.dtype == cd else out.to(cd)


def matmul(x: torch.Tensor, w_t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N]`` (the router): :func:`bmm` with one batch entry."""
    return bmm(x[None], w_t[None], dtype)[0]
