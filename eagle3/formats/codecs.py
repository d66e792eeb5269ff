"""Bit-exact, vectorised codecs for the quantized weight formats eagle3 reads and writes.

* compressed-tensors ``pack-quantized`` INT4 (Moonshot Kimi): code ``q + 8`` as an unsigned nibble,
  8 per int32 along the input dim in natural order, one scale per group.
* AMD Quark INT4: two's-complement nibbles, 8 per int32, ``reorder`` ([0,2,4,6,1,3,5,7]) or
  natural ``order`` nibble placement.
* OCP E2M1 FP4 (Quark MXFP4): two codes per uint8, the even element in the low nibble; E8M0 scales
  stored as ``exponent + 127``.
* FP8 E4M3: DeepSeek/Kimi-K2 128x128 block ``weight_scale_inv`` and per-tensor / per-channel scales.

Specification: shared/docs/research/kimi_quant_formats.md sections 2 and 3, quark_handson.md
section 4. The tests check these bit-for-bit against the ``compressed-tensors`` library and AMD
Quark's own pack methods. We keep our own implementation (rather than calling those libraries at
run time) because both are heavy optional installs (Quark's import takes 20-40 s and needs g++),
and the runtime must decode on any device without them.
"""

from __future__ import annotations

import torch

from eagle3.errors import ShapeError

# ---------------------------------------------------------------------------------------------
# INT4 nibble packing
# ---------------------------------------------------------------------------------------------

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble slot j -> bits 4j..4j+3
# Quark "reorder": nibble slot j of word c holds element 8c + REORDER[j].
QUARK_REORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """u: integer tensor [..., 8*W] with values 0..15 -> int32 [..., W] (slot j = element 8w+j)."""
    if u.shape[-1] % 8:
        raise ShapeError(f"INT4 packing needs a last dim divisible by 8, got {list(u.shape)}")
    u = u.to(torch.int64).reshape(*u.shape[:-1], -1, 8)
    words = (u << _SHIFTS.to(torch.int64)).sum(-1)
    # Map 0..2^32-1 onto the int32 bit pattern.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8-valued int16 [..., 8*W] with the nibble of slot j at 8w+j."""
    w = words.to(torch.int32).unsqueeze(-1)
    u = (w >> _SHIFTS.to(w.device)) & 0xF
    return u.reshape(*words.shape[:-1], -1).to(torch.int16)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    if k % 8 == 0:
        return x
    pad = torch.zeros(*x.shape[:-1], 8 - k % 8, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], -1)


def ct_int4_pack(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors: signed codes q in [-8, 7], shape [N, K] -> int32 [N, ceil(K/8)]."""
    return _pack_nibbles(_pad8(q.to(torch.int16) + 8))


def ct_int4_unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors: int32 [N, ceil(K/8)] -> int8 codes [N, K]."""
    return (_unpack_nibbles(packed)[..., :k] - 8).to(torch.int8)


def ct_int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int] | torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W[n,k] = q[n,k] * scale[n, k // g]``.

    ``dtype=None`` rounds like compressed-tensors does (product in the scale's dtype, bf16 for
    Kimi); ``dtype=torch.float32`` gives the exact fp32 product that Quark's file-to-file path
    quantizes from (kimi_quant_formats.md 3.3)."""
    n, k = (int(x) for x in (shape.tolist() if isinstance(shape, torch.Tensor) else shape))
    if packed.shape[0] != n or packed.shape[-1] != (k + 7) // 8:
        raise ShapeError(f"weight_packed has shape {list(packed.shape)} but weight_shape ({n}, {k}) needs "
                         f"[{n}, {(k + 7) // 8}]")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ShapeError(f"weight_scale has shape {list(scale.shape)}, not [{n}, {k}/group]")
    g = k // scale.shape[1]
    q = ct_int4_unpack(packed, k)
    out_dtype = scale.dtype if dtype is None else dtype
    s = scale.to(out_dtype).repeat_interleave(g, dim=1)
    return q.to(out_dtype) * s


def ct_int4_quantize(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors symmetric group quantization: ``scale = amax / 7.5`` (in w's dtype),
    ``q = round_half_even(clamp(w / scale, -8, 7))``. Returns (int32 packed, scale)."""
    n, k = w.shape
    if k % group_size:
        raise ShapeError(f"input dim {k} is not divisible by the group size {group_size}")
    wg = w.reshape(n, k // group_size, group_size)
    amax = wg.abs().amax(-1, keepdim=True)
    scale = (amax / 7.5).to(w.dtype)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    q = torch.round(torch.clamp(wg / scale, -8, 7)).to(torch.int8).reshape(n, k)
    return ct_int4_pack(q), scale.reshape(n, -1)


def quark_int4_pack(q: torch.Tensor, reorder: bool = True) -> torch.Tensor:
    """Quark ``Pack_4_bits``: signed codes [..., K] (K % 8 == 0) -> int32 [..., K/8] of
    two's-complement nibbles; ``reorder`` puts element 8c+REORDER[j] in nibble slot j."""
    u = q.to(torch.int16) & 0xF
    if reorder:
        if u.shape[-1] % 8:
            raise ShapeError(f"INT4 packing needs a last dim divisible by 8, got {list(u.shape)}")
        idx = torch.tensor(QUARK_REORDER, device=u.device)
        u = u.reshape(*u.shape[:-1], -1, 8)[..., idx].reshape(u.shape)
    return _pack_nibbles(u)


def quark_int4_unpack(packed: torch.Tensor, reorder: bool = True) -> torch.Tensor:
    """Inverse of :func:`quark_int4_pack`: int32 [..., W] -> int8 codes [..., 8W]."""
    u = _unpack_nibbles(packed)
    if reorder:
        inv = torch.argsort(torch.tensor(QUARK_REORDER, device=u.device))
        u = u.reshape(*u.shape[:-1], -1, 8)[..., inv].reshape(u.shape)
    return torch.where(u >= 8, u - 16, u).to(torch.int8)


# ---------------------------------------------------------------------------------------------
# FP4 E2M1 and E8M0
# ---------------------------------------------------------------------------------------------

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) [..., K] -> uint8 [..., K/2], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ShapeError(f"FP4 packing needs an even last dim, got {list(codes.shape)}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], -1)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 values."""
    return _E2M1_LUT.to(codes.device)[codes.long()]


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> E2M1 codes: saturate at +-6, round half to even mantissa, no negative zero
    (Quark's convention). ``x`` is already divided by its block scale."""
    x = x.float()
    a = x.abs().clamp(max=6.0)
    mids = _E2M1_MIDS.to(x.device)
    lo = torch.searchsorted(mids, a, right=False)
    hi = torch.searchsorted(mids, a, right=True)
    # On an exact tie lo and hi are the two neighbours; the even index has the even mantissa.
    idx = torch.where((hi != lo) & (lo % 2 == 1), hi, lo)
    sign = (x < 0) & (idx != 0)
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 uint8 -> float32 ``2**(e-127)``; 255 is NaN."""
    e = e.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scale -> E8M0 uint8 (the biased exponent field of the float32)."""
    bits = scale.float().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def mxfp4_scale_even(amax: torch.Tensor) -> torch.Tensor:
    """Quark ``scale_calculation_mode="even"``: the shared exponent of a 32-block.

    Round amax's mantissa to one bit (half up), take its exponent, subtract E2M1's emax (2),
    clamp to [-127, 127]. Returns the unbiased exponent as int32."""
    a = amax.float()
    a = torch.where(a == 0, torch.full_like(a, torch.finfo(torch.float32).tiny), a)
    bits = a.view(torch.int32)
    bits = (bits + (1 << 21)) & 0x7F800000
    exp = (bits >> 23) - 127
    return (exp - 2).clamp(-127, 127)


def mxfp4_quantize(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 along the last dim: returns (uint8 packed [..., K/2], uint8 E8M0 scales [..., K/32]).
    Computed in float32 from ``w`` (pass an fp32 source for bit-exact parity with Quark)."""
    k = w.shape[-1]
    if k % group_size:
        raise ShapeError(f"input dim {k} is not divisible by the MXFP4 group size {group_size}")
    x = w.float().reshape(*w.shape[:-1], k // group_size, group_size)
    e = mxfp4_scale_even(x.abs().amax(-1, keepdim=True))
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    codes = fp4_encode(x / scale).reshape(w.shape)
    return fp4_pack(codes), (e + 127).to(torch.uint8).reshape(*w.shape[:-1], -1)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     group_size: int = 32) -> torch.Tensor:
    """uint8 packed [..., K/2] + uint8 E8M0 [..., K/32] -> dense [..., K]."""
    vals = fp4_decode(fp4_unpack(packed))
    k = vals.shape[-1]
    if scale.shape[-1] * group_size != k:
        raise ShapeError(f"MXFP4 scale has {scale.shape[-1]} groups per row but the weight has {k} columns")
    s = e8m0_to_float(scale).repeat_interleave(group_size, dim=-1)
    return (vals * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# FP8 E4M3
# ---------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSeek-V3 / Kimi-K2 FP8: ``W = fp8 * scale_inv[n // 128, k // 128]`` (computed in fp32)."""
    n, k = w.shape
    bn, bk = block
    want = ((n + bn - 1) // bn, (k + bk - 1) // bk)
    if tuple(scale_inv.shape) != want:
        raise ShapeError(f"weight_scale_inv has shape {list(scale_inv.shape)} but weight {[n, k]} with "
                         f"{bn}x{bk} blocks needs {list(want)}")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() * s).to(dtype)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block quantization: ``scale_inv = amax / 448`` per block."""
    n, k = w.shape
    bn, bk = block
    pn, pk = (-n) % bn, (-k) % bk
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = x.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_E4M3_MAX)
    q = (blocks / s[:, None, :, None]).reshape(n + pn, k + pk)[:n, :k]
    return q.to(torch.float8_e4m3fn), s


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_e4m3fn(clamp(x / scale, -448, 448))`` in fp32 (scale broadcast against x)."""
    return (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
