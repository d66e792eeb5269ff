"""Rotary embedding application (interleaved DeepSeek / Kimi MLA pairs, or NeoX halves).

The cos/sin tables come from the runtime's :class:`~eagle3.runtime.layers.rotary.RotaryEmbedding`
(default / linear / llama3 / YaRN frequencies and the YaRN attention factor live there, once), so
this kernel only rotates: ``x [T, H, D]``, ``cos/sin [T, D/2]`` in the activation dtype. Output is
in rotate-half order (``[x1*c - x2*s, x2*c + x1*s]``) for both layouts, as the reference. Every
product and difference is rounded to the activation dtype as torch does it elementwise (also for
bf16 under the interpreter, by explicit rounding of the widened fp32 values); an
elementwise op, so a row never sees its neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import bf16_round, block, widen


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                 stride_oh, ntok, heads, half, INTERLEAVED: tl.constexpr, BF16: tl.constexpr,
                 TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.arange(0, TOKENS * BLOCK_H)
    t = tl.program_id(0).to(tl.int64) * TOKENS + r // BLOCK_H  # rows: tokens x heads
    h = r % BLOCK_H
    i = tl.arange(0, BLOCK_D)
    rm = (t < ntok) & (h < heads)
    mask = rm[:, None] & (i[None, :] < half)
    if INTERLEAVED:
        o1, o2 = 2 * i, 2 * i + 1
    else:
        o1, o2 = i, i + half
    base = x_ptr + t[:, None] * stride_xt + h[:, None] * stride_xh
    x1 = tl.load(base + o1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + o2[None, :], mask=mask, other=0.0)
    c = tl.load(cos_ptr + t[:, None] * stride_ct + i[None, :], mask=mask, other=0.0).to(x1.dtype)
    s = tl.load(sin_ptr + t[:, None] * stride_st + i[None, :], mask=mask, other=0.0).to(x1.dtype)
    y1 = bf16_round(bf16_round(x1 * c, BF16) - bf16_round(x2 * s, BF16), BF16)
    y2 = bf16_round(bf16_round(x2 * c, BF16) + bf16_round(x1 * s, BF16), BF16)
    obase = out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh
    tl.store(obase + i[None, :], y1, mask=mask)
    tl.store(obase + half + i[None, :], y2, mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos/sin [T, D/2]``; returns a new contiguous ``[T, H, D]``."""
    t, heads, d = x.shape
    dtype = x.dtype
    xs = widen(x)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    c, s = widen(cos), widen(sin)
    if c.stride(-1) != 1:
        c = c.contiguous()
    if s.stride(-1) != 1:
        s = s.contiguous()
    out = torch.empty((t, heads, d), dtype=xs.dtype, device=x.device)
    if t:
        bh, bd = block(heads, 1), block(d // 2, 1)
        tokens = max(1, min(16, 2048 // (bh * bd)))  # rows per program from the head layout only
        _rope_kernel[(triton.cdiv(t, tokens),)](
            xs, c, s, out, xs.stride(0), xs.stride(1), c.stride(0), s.stride(0), out.stride(0), out.stride(1), t,
            heads, d // 2, INTERLEAVED=interleaved, BF16=xs.dtype != dtype, TOKENS=tokens, BLOCK_H=bh, BLOCK_D=bd,
            enable_fp_fusion=False)  # no FMA contraction: round every product as torch does
    return out if out.dtype == dtype else out.to(dtype)
