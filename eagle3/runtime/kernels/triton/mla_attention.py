"""MLA decode / verify / prefill attention over the paged latent cache, absorbed form.

The model (``layers/attention.py``) turns MLA into MQA: per token ``nh`` query rows of width
``kv_lora + rope`` (Kimi: 64 heads, 512 + 64) against one shared cached row ``[c, k_pe]``; the
values are the first ``kv_lora`` dims of that same row. So one kernel serves decode (query length
1), EAGLE verify (k+1 queries of a sequence) and prefill chunks: query token ``t`` of sequence
``b`` at position ``p`` attends the cached keys at positions ``0..p`` through ``block_tables[b]``
(causal by absolute position, which is also the mask inside a verify window).

Grid: (query token, block of ``BLOCK_H`` heads). A program walks its own keys in tiles of
``BLOCK_N`` with an online softmax in fp32: scores ``[BLOCK_H, BLOCK_N]`` as two dots (latent part
and rope part, so 576 is not padded to 1024), ``p`` cast to the dot dtype times the latent tile
(the key tile is reused as the value tile: the cache is read once). Batch invariance: tile sizes
are constants, there is no split over keys, and a token's loop runs over keys ``0..p`` in order
whatever other tokens share the launch, so its output bits depend only on its own query and keys.

Not yet (docs/kernels.md): stacking the k+1 verify queries of a sequence into one tile (reads the
latent once per verify instead of k+1 times) and a fixed-size split-KV for long decode contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import block, dot_dtype, mma, tl_dtype, widen
from eagle3.runtime.kernels.triton.plan import TritonAttnPlan

BLOCK_H = 16  # query heads per program (rows of the score tile; tl.dot needs >= 16)
BLOCK_N = 32  # keys per tile


@triton.jit
def _mla_kernel(q_ptr, kv_ptr, o_ptr, seq_ptr, pos_ptr, bt_ptr, stride_qt, stride_qh, stride_kv, stride_ot,
                stride_oh, stride_bt, heads, d_lat, d_rope, block_size, scale,
                DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    b = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    hm = h < heads
    qrow = q_ptr + t * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(qrow + dl[None, :], mask=hm[:, None] & (dl[None, :] < d_lat), other=0.0).to(DOT)
    q_pe = tl.load(qrow + d_lat + dr[None, :], mask=hm[:, None] & (dr[None, :] < d_rope), other=0.0).to(DOT)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        km = k <= pos
        blk = tl.load(bt_ptr + b * stride_bt + k // block_size, mask=km, other=0).to(tl.int64)
        slot = blk * block_size + k % block_size
        krow = kv_ptr + slot[:, None] * stride_kv
        k_lat = tl.load(krow + dl[None, :], mask=km[:, None] & (dl[None, :] < d_lat), other=0.0).to(DOT)
        k_pe = tl.load(krow + d_lat + dr[None, :], mask=km[:, None] & (dr[None, :] < d_rope), other=0.0).to(DOT)
        s = mma(q_lat, tl.trans(k_lat), IEEE) + mma(q_pe, tl.trans(k_pe), IEEE)
        s = tl.where(km[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(DOT), k_lat, IEEE)
        m = m_new
    o = acc / den[:, None]
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + dl[None, :], o.to(o_ptr.dtype.element_ty),
             mask=hm[:, None] & (dl[None, :] < d_lat))


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, d_lat: int, plan: TritonAttnPlan,
                  scale: float) -> torch.Tensor:
    """``q [T, H, d_lat + d_rope]`` against ``kv_cache [S, d_lat + d_rope]`` (flat slots) ->
    ``[T, H, d_lat]`` in ``q.dtype``."""
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
        grid = (t, triton.cdiv(heads, BLOCK_H))
        _mla_kernel[grid](qs, kv, out, plan.seq_ids, plan.positions, plan.block_tables, qs.stride(0), qs.stride(1),
                          kv.stride(0), out.stride(0), out.stride(1), plan.block_tables.stride(0), heads, d_lat,
                          d - d_lat, plan.block_size, float(scale), DOT=tl_dtype(dot_dtype(qs.dtype)), IEEE=dot_dtype(qs.dtype) == torch.float32,
                          BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_L=block(d_lat), BLOCK_R=block(d - d_lat))
    return out if out.dtype == dtype else out.to(dtype)
