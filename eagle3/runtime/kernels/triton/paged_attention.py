"""Paged causal MHA / GQA attention for the Llama-style draft (prefill, decode and verify).

``q [T, Hkv, G, D]`` against ``k_cache [S, Hkv, D]`` and ``v_cache [S, Hkv, Dv]`` (flat slots, any
row / head strides, so the halves of a ``[S, 2, Hkv, D]`` cache are read in place). Grid: (chunk
of up to ``QT`` query tokens of one sequence, kv head); the score tile's rows are the chunk's
tokens x the ``G`` query heads sharing the kv head (``QT * next_pow2(G) >= 16`` rows). Each row is
masked by its own position; key tiles of ``BLOCK_N`` from position 0 with an online softmax in
fp32. Batch invariance: fixed tiles, no split over keys (the draft's contexts are short; MLA's
kernel splits at fixed positions), fixed order, exact zeros from key tiles past a row's position.
Draft trees (``TREE``): as in ``mla_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import block, dot_dtype, mma, tl_dtype, tree_key_positions, widen
from eagle3.runtime.kernels.triton.plan import TREE_MAX_NODES, TritonAttnPlan

BLOCK_M = 16  # score-tile rows at least: query tokens x group heads
BLOCK_N = 32  # keys per tile


def tile_shape(group: int) -> tuple[int, int]:
    """(padded group, query tokens per program) for ``group`` query heads per kv head."""
    bg = triton.next_power_of_2(group)
    return bg, max(1, BLOCK_M // bg)


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, o_ptr, chunk_ptr, pos_ptr, bt_ptr, lo_ptr, path_ptr, order_ptr, stride_qt,
                  stride_qh, stride_qg, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_og,
                  stride_bt, group, d, dv, block_size, scale, v_scale, DOT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_G: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_V: tl.constexpr, TREE: tl.constexpr, PATH: tl.constexpr):
    c = tl.program_id(0)
    kh = tl.program_id(1).to(tl.int64)
    t0 = tl.load(chunk_ptr + 3 * c).to(tl.int64)
    nt = tl.load(chunk_ptr + 3 * c + 1)
    b = tl.load(chunk_ptr + 3 * c + 2).to(tl.int64)
    r = tl.arange(0, BLOCK_G * QT)
    tok = r // BLOCK_G
    g = r % BLOCK_G
    rm = (tok < nt) & (g < group)
    if TREE:  # rows are entries of the plan's order; a tree chunk is one path, its last row the deepest
        tid = tl.load(order_ptr + t0 + tok, mask=tok < nt, other=0).to(tl.int64)
        deep = tl.load(order_ptr + t0 + nt - 1).to(tl.int64)
    else:
        tid = t0 + tok
    pos = tl.load(pos_ptr + tid, mask=tok < nt, other=0)  # pad rows see key 0 only: finite
    last = tl.max(pos, axis=0)
    dd = tl.arange(0, BLOCK_D)
    dvv = tl.arange(0, BLOCK_V)
    q = tl.load(q_ptr + tid[:, None] * stride_qt + kh * stride_qh + g[:, None] * stride_qg + dd[None, :],
                mask=rm[:, None] & (dd[None, :] < d), other=0.0).to(DOT)
    m = tl.full([BLOCK_G * QT], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G * QT], tl.float32)
    acc = tl.zeros([BLOCK_G * QT, BLOCK_V], tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        km = k <= last
        kc = k
        if TREE:  # virtual key positions: a tree query's ancestors in depth order after the context
            kc = tree_key_positions(k, km, lo_ptr, path_ptr, deep, PATH)
        blk = tl.load(bt_ptr + b * stride_bt + kc // block_size, mask=km, other=0).to(tl.int64)
        slot = blk * block_size + kc % block_size
        kt = tl.load(k_ptr + slot[:, None] * stride_ks + kh * stride_kh + dd[None, :],
                     mask=km[:, None] & (dd[None, :] < d), other=0.0).to(DOT)
        vt = tl.load(v_ptr + slot[:, None] * stride_vs + kh * stride_vh + dvv[None, :],
                     mask=km[:, None] & (dvv[None, :] < dv), other=0.0).to(DOT)
        s = mma(q, tl.trans(kt), IEEE)
        s = tl.where(k[None, :] <= pos[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(DOT), vt, IEEE)
        m = m_new
    o = acc / den[:, None] * v_scale  # an fp8 cache's value scale (1.0 otherwise: exact)
    tl.store(o_ptr + tid[:, None] * stride_ot + kh * stride_oh + g[:, None] * stride_og + dvv[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rm[:, None] & (dvv[None, :] < dv))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonAttnPlan,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Returns ``[T, Hkv, G, Dv]`` in ``q.dtype``. fp8 caches: codes loaded as they are, ``k_scale``
    folded into the score scale, ``v_scale`` into the output (runtime/kv_cache.py)."""
    t, hkv, group, d = q.shape
    dv = v_cache.shape[-1]
    dtype = q.dtype
    qs = widen(q)
    if qs.stride(-1) != 1:
        qs = qs.contiguous()
    kc, vc = widen(k_cache), widen(v_cache)
    if kc.stride(-1) != 1:
        kc = kc.contiguous()
    if vc.stride(-1) != 1:
        vc = vc.contiguous()
    out = torch.empty((t, hkv, group, dv), dtype=qs.dtype, device=q.device)
    if t:
        bg, qt = tile_shape(group)
        chunks = plan.chunks(qt)
        dd = dot_dtype(qs.dtype)
        lo, paths = plan.tree if plan.tree is not None else (plan.positions, plan.positions)  # unread without TREE
        order = plan.order(qt) if plan.tree is not None else plan.positions
        _paged_kernel[(chunks.shape[0], hkv)](
            qs, kc, vc, out, chunks, plan.positions, plan.block_tables, lo, paths, order, qs.stride(0),
            qs.stride(1), qs.stride(2), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0),
            out.stride(1), out.stride(2), plan.block_tables.stride(0), group, d, dv, plan.block_size,
            float(scale * k_scale), float(v_scale),
            DOT=tl_dtype(dd), IEEE=dd == torch.float32, BLOCK_G=bg, QT=qt, BLOCK_N=BLOCK_N, BLOCK_D=block(d),
            BLOCK_V=block(dv), TREE=plan.tree is not None, PATH=TREE_MAX_NODES)
    return out if out.dtype == dtype else out.to(dtype)
