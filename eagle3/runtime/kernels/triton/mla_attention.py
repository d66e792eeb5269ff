"""MLA decode / verify / prefill attention over the paged latent cache, absorbed form.

The model (``layers/attention.py``) turns MLA into MQA: per token ``nh`` query rows of width
``kv_lora + rope`` (Kimi: 64 heads, 512 + 64) against one shared cached row ``[c, k_pe]``; the
values are the first ``kv_lora`` dims of that same row. So one kernel serves decode (query length
1), EAGLE verify (k+1 queries of a sequence) and prefill chunks: query token ``t`` of sequence
``b`` at position ``p`` attends the cached keys at positions ``0..p`` through ``block_tables[b]``
(causal by absolute position, which is also the mask inside a verify window).

Grid: (chunk of up to ``QT`` query tokens of one sequence, block of ``BLOCK_H`` heads). The score
tile has ``QT * BLOCK_H`` rows (token-major), so the queries of a verify window share each latent
key tile they read. A program walks key tiles of ``BLOCK_N`` from position 0
up to its last token's position with an online softmax in fp32: scores as two dots (latent part
and rope part, so 576 is not padded to 1024), then ``p`` (cast to the dot dtype) times the latent
tile, which doubles as the value tile (the cache is read once).

Batch invariance: ``BLOCK_M/H/N`` follow from the head count only; there is no split over keys;
a row's key tiles are visited in the same order whatever shares its chunk, and tiles past its own
position add exact zeros (``p = exp(-inf) = 0``, ``alpha = exp(0) = 1``), so its output bits
depend only on its own query and keys. Every row sees key 0, so ``m`` is finite after tile 0.
Draft trees (``TREE``, plan.tree_arrays): a tree query's ``pos`` is its virtual position (tree
start + depth) and its virtual keys ``start ..`` are read at its ancestors' cache positions in depth
order (``tree_key_positions``): the same key tiles, in the same order, as the same token in a
chain, and non-ancestors are never read. A tree chunk holds queries on one root-to-node path (the
deepest one's key map serves them all), listed by the plan's ``order`` (they need not be
consecutive tokens).
Not yet (docs/kernels.md): a fixed-size split-KV for long decode contexts at small batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import block, dot_dtype, mma, tl_dtype, tree_key_positions, widen
from eagle3.runtime.kernels.triton.plan import TREE_MAX_NODES, TritonAttnPlan

BLOCK_H_MAX = 16  # heads per program at most
BLOCK_N = 32  # keys per tile
ACC_FLOATS = 16384  # fp32 accumulator elements per program (rows x latent block): register budget


def tile_shape(heads: int, d_lat: int) -> tuple[int, int]:
    """(heads per program, query tokens per program): model constants. Score-tile rows =
    tokens x heads, 16..64 within the accumulator budget (Kimi, latent 512: 16 heads x 2 tokens;
    the tiny models, latent 32: 4 heads x 16 tokens)."""
    rows = max(16, min(64, ACC_FLOATS // block(d_lat)))
    bh = min(BLOCK_H_MAX, triton.next_power_of_2(heads))
    return bh, max(1, rows // bh)


@triton.jit
def _mla_kernel(q_ptr, kv_ptr, o_ptr, chunk_ptr, pos_ptr, bt_ptr, lo_ptr, path_ptr, order_ptr, stride_qt, stride_qh,
                stride_kv, stride_ot, stride_oh, stride_bt, heads, d_lat, d_rope, block_size, scale, v_scale,
                DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_H: tl.constexpr, QT: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, TREE: tl.constexpr,
                PATH: tl.constexpr):
    c = tl.program_id(0)
    hb = tl.program_id(1)
    t0 = tl.load(chunk_ptr + 3 * c).to(tl.int64)
    nt = tl.load(chunk_ptr + 3 * c + 1)
    b = tl.load(chunk_ptr + 3 * c + 2).to(tl.int64)
    r = tl.arange(0, BLOCK_H * QT)
    tok = r // BLOCK_H
    h = hb * BLOCK_H + r % BLOCK_H
    rm = (tok < nt) & (h < heads)
    if TREE:  # rows are entries of the plan's order; a tree chunk is one path, its last row the deepest
        tid = tl.load(order_ptr + t0 + tok, mask=tok < nt, other=0).to(tl.int64)
        deep = tl.load(order_ptr + t0 + nt - 1).to(tl.int64)
    else:
        tid = t0 + tok
    pos = tl.load(pos_ptr + tid, mask=tok < nt, other=0)  # pad rows see key 0 only: finite
    last = tl.max(pos, axis=0)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    qrow = q_ptr + tid[:, None] * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(qrow + dl[None, :], mask=rm[:, None] & (dl[None, :] < d_lat), other=0.0).to(DOT)
    q_pe = tl.load(qrow + d_lat + dr[None, :], mask=rm[:, None] & (dr[None, :] < d_rope), other=0.0).to(DOT)
    m = tl.full([BLOCK_H * QT], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H * QT], tl.float32)
    acc = tl.zeros([BLOCK_H * QT, BLOCK_L], tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        km = k <= last
        kc = k
        if TREE:  # virtual key positions: a tree query's ancestors in depth order after the context
            kc = tree_key_positions(k, km, lo_ptr, path_ptr, deep, PATH)
        blk = tl.load(bt_ptr + b * stride_bt + kc // block_size, mask=km, other=0).to(tl.int64)
        slot = blk * block_size + kc % block_size
        krow = kv_ptr + slot[:, None] * stride_kv
        k_lat = tl.load(krow + dl[None, :], mask=km[:, None] & (dl[None, :] < d_lat), other=0.0).to(DOT)
        k_pe = tl.load(krow + d_lat + dr[None, :], mask=km[:, None] & (dr[None, :] < d_rope), other=0.0).to(DOT)
        s = mma(q_lat, tl.trans(k_lat), IEEE) + mma(q_pe, tl.trans(k_pe), IEEE)
        s = tl.where(k[None, :] <= pos[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(DOT), k_lat, IEEE)
        m = m_new
    o = acc / den[:, None] * v_scale  # an fp8 cache's value scale (1.0 otherwise: exact)
    tl.store(o_ptr + tid[:, None] * stride_ot + h[:, None] * stride_oh + dl[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rm[:, None] & (dl[None, :] < d_lat))


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, d_lat: int, plan: TritonAttnPlan,
                  scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """``q [T, H, d_lat + d_rope]`` against ``kv_cache [S, d_lat + d_rope]`` (flat slots) ->
    ``[T, H, d_lat]`` in ``q.dtype``. An fp8 cache is loaded as its codes (exact in the dot dtype)
    with ``kv_scale`` folded into the score scale and the output (runtime/kv_cache.py)."""
    t, heads, d = q.shape
    dtype = q.dtype
    qs = widen(q)
    if qs.stride(-1) != 1:
        qs = qs.contiguous()
    kv = widen(kv_cache)
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    out = torch.empty((t, heads, d_lat), dtype=qs.dtype, device=q.device)
    if t:
        bh, qt = tile_shape(heads, d_lat)
        big = bh * qt * block(d_lat) >= 8192  # unmeasured guess: more warps for the 512-wide latent
        chunks = plan.chunks(qt)
        dd = dot_dtype(qs.dtype)
        lo, paths = plan.tree if plan.tree is not None else (plan.positions, plan.positions)  # unread without TREE
        order = plan.order(qt) if plan.tree is not None else plan.positions
        _mla_kernel[(chunks.shape[0], triton.cdiv(heads, bh))](
            qs, kv, out, chunks, plan.positions, plan.block_tables, lo, paths, order, qs.stride(0), qs.stride(1),
            kv.stride(0), out.stride(0), out.stride(1), plan.block_tables.stride(0), heads, d_lat, d - d_lat,
            plan.block_size, float(scale * kv_scale), float(kv_scale), DOT=tl_dtype(dd), IEEE=dd == torch.float32, BLOCK_H=bh, QT=qt,
            BLOCK_N=BLOCK_N, BLOCK_L=block(d_lat), BLOCK_R=block(d - d_lat), TREE=plan.tree is not None,
            PATH=TREE_MAX_NODES, num_warps=8 if big else 4)
    return out if out.dtype == dtype else out.to(dtype)
