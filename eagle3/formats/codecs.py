"""Bit-exact, vectorised codecs for the quantized weight formats eagle3 reads and writes.

Storage formats (pack / unpack / dequantize):

* compressed-tensors ``pack-quantized`` INT4 (Moonshot Kimi): code ``q + 8`` as an unsigned nibble,
  8 per int32 along the input dim in natural order, one scale per group.
* AMD Quark INT4: two's-complement nibbles, 8 per int32, ``reorder`` ([0,2,4,6,1,3,5,7]) or
  natural ``order`` nibble placement; per-group weights are transposed before packing.
* OCP E2M1 FP4 (Quark MXFP4): two codes per uint8, the even element in the low nibble; E8M0 scales
  stored as ``exponent + 127``.
* FP8 E4M3: DeepSeek/Kimi-K2 128x128 block ``weight_scale_inv`` and per-tensor / per-channel scales.

Quantizers that reproduce AMD Quark 0.13 bit-for-bit, one weight tensor at a time (what a streaming
file-to-file quantizer needs): INT4 per-channel and per-group, W4A8 (FP8 per-tensor then INT4
per-channel), MXFP4, FP8 per-tensor and per-channel. Each one repeats Quark's observer arithmetic
*in the same dtypes* (a bf16 weight gets a bf16-rounded INT4 scale, a bf16 ``w / s`` before the FP8
cast, ...), because that is where a "mathematically equal" rewrite stops being bit-equal.

Specification: the layouts table in :mod:`eagle3.formats.sizing` and docs/recipes.md. tests/formats/test_codecs.py checks all of this against the ``compressed-tensors``
library and Quark's own primitives. We keep our own implementation (rather than calling those
libraries at run time) because both are heavy optional installs (Quark's import takes 20-40 s and
needs g++; its INT4 packer is a Python loop over columns), and the runtime must decode on any device
without them.

Conventions: a Linear weight is ``[N, K]`` = ``[out_features, in_features]``; INT4 codes are int8 in
[-8, 7]; every function is vectorised (no Python loop over rows, groups or blocks).
"""

from __future__ import annotations

import sys

import torch

from eagle3.errors import ShapeError

INT4_MIN, INT4_MAX = -8, 7
# Quark's symmetric INT4 divides amax by (qmax - qmin) / 2 = 7.5, not by 7: the code -8 is usable.
INT4_HALF_RANGE = 7.5
MXFP4_BLOCK = 32  # OCP MX: one E8M0 scale per 32 elements
# Quark's observers replace a zero scale by float32 eps (2**-23, exact in bf16 and fp16 too).
_F32_EPS = torch.finfo(torch.float32).eps
FP8_E4M3_MAX = 448.0

# ---------------------------------------------------------------------------------------------
# INT4 nibble packing
# ---------------------------------------------------------------------------------------------

# Quark "reorder": nibble slot j of word c holds element 8c + QUARK_REORDER[j].
QUARK_REORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Inverse permutation: element e of a group of 8 sits in slot _QUARK_SLOT_OF[e].
_QUARK_SLOT_OF = (0, 4, 1, 5, 2, 6, 3, 7)
# Bit offset of element e (0..7) of a group of 8 inside its int32 word. Packing with permuted shifts
# does the reorder for free (no gather over the tensor).
_SHIFTS_NATURAL = tuple(4 * j for j in range(8))
_SHIFTS_REORDER = tuple(4 * j for j in _QUARK_SLOT_OF)
_SHIFT_TENSORS = {s: torch.tensor(s, dtype=torch.int32) for s in (_SHIFTS_NATURAL, _SHIFTS_REORDER)}


_DEVICE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level constant ``table`` (a lookup table, the nibble shifts) on ``device``: copied
    there once and kept, not per call (a copy from pageable host memory per call costs a host
    sync, and is refused while a CUDA graph is being captured). The CPU gets the table itself."""
    if device.type == "cpu":
        return table
    key = (id(table), device)
    got = _DEVICE_TABLES.get(key)
    if got is None:
        got = _DEVICE_TABLES[key] = table.to(device)
    return got


def _shifts(shifts: tuple[int, ...]) -> torch.Tensor:
    """The nibble shifts of one of the two layouts as a kept int32 tensor: :func:`on_device` caches
    by the table's identity, so a tensor made per call must never reach it."""
    return _SHIFT_TENSORS[shifts]


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim up to a multiple (both libraries pack a ragged tail as zero nibbles)."""
    pad = (-x.shape[-1]) % multiple
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad))


def _pack_nibbles(u: torch.Tensor, shifts: tuple[int, ...] = _SHIFTS_NATURAL) -> torch.Tensor:
    """u: integers 0..15, shape [..., K] -> int32 [..., ceil(K/8)]; element e of each group of 8 goes
    to bits shifts[e]..shifts[e]+3."""
    u = _pad_last(u.to(torch.int32), 8)
    u = u.reshape(*u.shape[:-1], -1, 8)
    # The fields do not overlap, so their int32 sum is their bitwise OR; the nibble shifted to bits
    # 28..31 wraps to the negative int32 with the right bit pattern (torch shifts as unsigned).
    sh = on_device(_shifts(shifts), u.device)
    return (u << sh).sum(-1, dtype=torch.int32)


def _unpack_nibbles(words: torch.Tensor, shifts: tuple[int, ...] = _SHIFTS_NATURAL) -> torch.Tensor:
    """int32 [..., W] -> int32 values 0..15 [..., 8W] (inverse of :func:`_pack_nibbles`)."""
    if words.dtype != torch.int32:
        raise ShapeError(f"packed INT4 tensor must be int32, got {words.dtype}")
    sh = on_device(_shifts(shifts), words.device)
    u = (words.unsqueeze(-1) >> sh) & 0xF  # arithmetic shift; the mask drops the sign copies
    return u.reshape(*words.shape[:-1], -1)


def _check_codes(q: torch.Tensor, what: str) -> None:
    if q.is_floating_point() or q.is_complex():
        raise ShapeError(f"{what}: INT4 codes must be an integer tensor, got {q.dtype}")


def ct_int4_pack(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32``: signed codes in [-8, 7], [..., K] -> int32 [..., ceil(K/8)].

    Stored nibble = q + 8, natural order; a ragged tail is padded with the nibble 0 (not 8), like
    the library (it offsets first, then pads)."""
    _check_codes(q, "ct_int4_pack")
    return _pack_nibbles(q.to(torch.int32) + 8)


def ct_int4_unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors ``unpack_from_int32``: int32 [..., ceil(K/8)] -> int8 codes [..., K]."""
    if packed.shape[-1] * 8 < k:
        raise ShapeError(f"weight_packed has {packed.shape[-1]} words per row, too few for {k} columns")
    return _unpack_nibbles_natural_u8(packed)[..., :k].to(torch.int8).sub_(8)


def _unpack_nibbles_natural_u8(words: torch.Tensor) -> torch.Tensor:
    """Natural-order unpack on uint8 (1 byte per code instead of 4): int32 [..., W] -> uint8 0..15
    [..., 8W]. On a little-endian host byte i of the words holds elements 2i (low nibble) and 2i+1
    (high nibble); this is the hot loop of every INT4 dequant (convert, quantize, runtime load)."""
    if words.dtype != torch.int32:
        raise ShapeError(f"packed INT4 tensor must be int32, got {words.dtype}")
    if sys.byteorder != "little":
        return _unpack_nibbles(words).to(torch.uint8)
    b = words.contiguous().view(torch.uint8)
    out = torch.empty(*b.shape, 2, dtype=torch.uint8, device=b.device)
    torch.bitwise_and(b, 0xF, out=out[..., 0])
    torch.bitwise_right_shift(b, 4, out=out[..., 1])
    return out.reshape(*words.shape[:-1], -1)


def ct_int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int] | torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W[n,k] = q[n,k] * scale[n, k // g]`` for a compressed-tensors group-quantized weight.

    The product is computed in fp32 (or the wider of ``scale.dtype`` and ``dtype``) and then cast
    to ``dtype`` (default ``scale.dtype``). So ``dtype=None`` with Kimi's bf16 scales rounds once to
    bf16 exactly like ``compressed_tensors`` ``dequantize``; ``dtype=torch.float32`` gives the exact
    fp32 product that Quark's file-to-file path quantizes from (it upcasts the scale first)."""
    n, k = (int(x) for x in (shape.tolist() if isinstance(shape, torch.Tensor) else shape))
    if packed.dim() != 2 or packed.shape[0] != n or packed.shape[-1] != (k + 7) // 8:
        raise ShapeError(f"weight_packed has shape {list(packed.shape)} but weight_shape ({n}, {k}) needs "
                         f"[{n}, {(k + 7) // 8}]")
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ShapeError(f"weight_scale has shape {list(scale.shape)}, not [{n}, {k}/group_size]")
    g = k // scale.shape[1]
    out_dtype = scale.dtype if dtype is None else dtype
    # At least fp32: q * s of a 16-bit scale is exact in fp32, so the one final rounding gives the
    # same bits as the libraries' bf16/fp16 multiply, and fp32 arithmetic is several times faster
    # than bf16 arithmetic on CPU.
    compute = torch.promote_types(torch.promote_types(scale.dtype, out_dtype), torch.float32)
    if compute == torch.float32 and sys.byteorder == "little" and packed.dtype == torch.int32:
        # One table lookup per byte gives both of its codes as fp32 ``q - 8`` (read as one int64):
        # unpack, convert and offset in one pass, ~2x faster than the nibble unpack below.
        b = packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
        q = on_device(_CT_PAIR_LUT_I64, packed.device).index_select(0, b).view(torch.float32).view(n, -1)
        q = (q if q.shape[1] == k else q[:, :k].contiguous()).reshape(n, -1, g)
    else:
        q = _unpack_nibbles_natural_u8(packed)[:, :k].to(compute).sub_(8).reshape(n, -1, g)
    return q.mul_(scale.to(compute).unsqueeze(-1)).reshape(n, k).to(out_dtype)


# byte -> (low nibble - 8, high nibble - 8) as an fp32 pair, read as one little-endian int64.
_CT_PAIR_LUT_I64 = (torch.stack([(torch.arange(256) & 0xF) - 8, (torch.arange(256) >> 4) - 8], -1)
                    .float().contiguous().view(torch.int64).reshape(256))


def ct_int4_quantize(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors symmetric group quantization (``calculate_qparams`` + ``quantize``):
    ``scale = amax / 7.5`` in w's dtype (0 -> that dtype's eps), ``q = round_half_even(clamp(w /
    scale, -8, 7))`` with the division in w's dtype. Returns (int32 packed [N, K/8], scale [N, K/g])."""
    if w.dim() != 2:
        raise ShapeError(f"ct_int4_quantize expects a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if k % group_size:
        raise ShapeError(f"input dim {k} is not divisible by the group size {group_size}")
    wg = w.reshape(n, k // group_size, group_size)
    scale = wg.abs().amax(-1, keepdim=True) / INT4_HALF_RANGE
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    q = torch.round(torch.clamp(wg / scale, INT4_MIN, INT4_MAX)).to(torch.int8).reshape(n, k)
    return ct_int4_pack(q), scale.reshape(n, -1)


def quark_int4_pack(q: torch.Tensor, reorder: bool = True) -> torch.Tensor:
    """Quark ``Pack_4_bits`` along the last dim: signed codes [..., K] -> int32 [..., ceil(K/8)] of
    two's-complement nibbles; ``reorder`` puts element 8c+QUARK_REORDER[j] in nibble slot j (the
    export default, ``pack_method: "reorder"``); ``reorder=False`` is natural order (``"order"``).
    No transpose here: per-group callers pack ``q.T`` (see :func:`quark_int4_per_group_quantize`)."""
    _check_codes(q, "quark_int4_pack")
    if q.dtype in (torch.int8, torch.uint8) and q.shape[-1] % 8 == 0 and q.dim() > 0:
        return _pack_bytes_by_8(q, reorder)
    return _pack_nibbles(q.to(torch.int32) & 0xF, _SHIFTS_REORDER if reorder else _SHIFTS_NATURAL)


_LO_NIBBLES = 0x0F0F0F0F0F0F0F0F
_EVERY_2ND_BYTE_NIBBLE = 0x000F000F000F000F


def _pack_bytes_by_8(q: torch.Tensor, reorder: bool) -> torch.Tensor:
    """:func:`quark_int4_pack` of int8 codes [..., 8W] by bit moves inside int64 words: each group of
    8 codes is read as one little-endian int64 (code e in byte e) and its low nibbles are gathered to
    their slots with shifts and masks over 1/8 as many elements as the codes, instead of widening
    every code to int32, shifting and summing (~3x faster, same bits)."""
    # Flatten first: a size-1 dim may carry any stride even in a "contiguous" tensor (e.g. a
    # transposed [8, 1]), and .view() to a wider dtype refuses such strides.
    x = q.reshape(-1).view(torch.int64).bitwise_and(_LO_NIBBLES).reshape(*q.shape[:-1], q.shape[-1] // 8)
    if reorder:
        # slots 0-3 hold elements 0,2,4,6 (even bytes), slots 4-7 elements 1,3,5,7 (odd bytes):
        # compress each half's four nibbles (16 bits apart) into 16 bits, odd half above.
        ev = x.bitwise_and(_EVERY_2ND_BYTE_NIBBLE)
        od = (x >> 8).bitwise_and_(_EVERY_2ND_BYTE_NIBBLE)
        for t in (ev, od):
            t.bitwise_or_(t >> 12).bitwise_and_(0x000000FF000000FF)
            t.bitwise_or_(t >> 24)  # bits 0..15 are the packed half (bits 32+ are ignored below)
        w = ev.bitwise_or_(od.bitwise_left_shift_(16))
    else:
        w = x.bitwise_or_(x >> 4).bitwise_and_(0x00FF00FF00FF00FF)
        w.bitwise_or_(w >> 8).bitwise_and_(0x0000FFFF0000FFFF)
        w.bitwise_or_(w >> 16)
    # The low (little-endian) half of each int64; copied into a fresh buffer because .contiguous()
    # keeps the stride-2 view when the last dim is 1, which callers could not .view() as bytes.
    return torch.empty(w.shape, dtype=torch.int32, device=w.device).copy_(w.view(torch.int32)[..., 0::2])


def quark_int4_unpack(packed: torch.Tensor, reorder: bool = True, k: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quark_int4_pack`: int32 [..., W] -> int8 codes [..., k] (default 8W)."""
    if packed.dtype == torch.int32 and packed.dim() > 0:
        u = _unpack_words_to_int8(packed, reorder)
        if k is not None and k > u.shape[-1]:
            raise ShapeError(f"packed INT4 tensor has {packed.shape[-1]} words per row, too few for {k} values")
        return u if k is None or k == u.shape[-1] else u[..., :k].contiguous()
    u = _unpack_nibbles(packed, _SHIFTS_REORDER if reorder else _SHIFTS_NATURAL)
    if k is not None:
        if k > u.shape[-1]:
            raise ShapeError(f"packed INT4 tensor has {packed.shape[-1]} words per row, too few for {k} values")
        u = u[..., :k]
    return ((u ^ 8) - 8).to(torch.int8)  # sign-extend the 4-bit two's complement


def _unpack_words_to_int8(packed: torch.Tensor, reorder: bool) -> torch.Tensor:
    """Inverse of :func:`_pack_bytes_by_8`: each int32 word's 8 nibbles are spread into the 8 bytes
    of an int64 (element e in byte e) with shifts and masks, then sign-extended per byte; the codes
    come out as int8 [..., 8W] without widening them to int32 (~3x faster, same values)."""
    u = packed.reshape(-1).to(torch.int64).bitwise_and_(0xFFFFFFFF)  # 1-D: .view() below needs plain strides
    if reorder:
        ev = u.bitwise_and(0xFFFF)  # slots 0-3: elements 0,2,4,6
        od = (u >> 16)  # slots 4-7: elements 1,3,5,7
        for t in (ev, od):
            t.bitwise_or_(t << 24).bitwise_and_(0x000000FF000000FF)
            t.bitwise_or_(t << 12).bitwise_and_(_EVERY_2ND_BYTE_NIBBLE)
        x = ev.bitwise_or_(od.bitwise_left_shift_(8))
    else:
        x = u.bitwise_or_(u << 16).bitwise_and_(0x0000FFFF0000FFFF)
        x.bitwise_or_(x << 8).bitwise_and_(0x00FF00FF00FF00FF)
        x.bitwise_or_(x << 4).bitwise_and_(_LO_NIBBLES)
    # 4-bit two's complement -> int8: flip bit 3 (q + 8 in 0..15), then subtract 8 per byte.
    x.bitwise_xor_(0x0808080808080808)
    return x.view(torch.int8).sub_(8).reshape(*packed.shape[:-1], -1)


def quark_int4_zero_point_like(scale: torch.Tensor) -> torch.Tensor:
    """The ``weight_zero_point`` tensor Quark's export writes next to a symmetric INT4 scale: zeros,
    packed 8 per int32 along the scale's last dim ([N] -> [N/8], [K/g, N] -> [K/g, N/8]). The
    Quark importer and transformers refuse a Quark INT4 checkpoint without it."""
    shape = list(scale.shape) or [1]
    shape[-1] = (shape[-1] + 7) // 8
    return torch.zeros(shape, dtype=torch.int32, device=scale.device)


# ---------------------------------------------------------------------------------------------
# Quark INT4 quantization (symmetric, per-channel / per-group), Quark 0.13 numerics
# ---------------------------------------------------------------------------------------------


def _quark_int4_scale(amax: torch.Tensor) -> torch.Tensor:
    # PerChannel/PerGroupMinMaxObserver keep min/max in the *input* dtype, so for a bf16 weight the
    # scale is bf16(amax / 7.5) even when scale_type="float32" asks for fp32 storage.
    return torch.clamp(amax / INT4_HALF_RANGE, min=_F32_EPS)


def _quark_int4_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # scaled_real_quantize multiplies by the fp32 reciprocal (to mimic aten's fake_quantize), it does
    # not divide; torch.round is round-half-to-even.
    inv = 1.0 / scale.float()
    return torch.round(x.float() * inv).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)


def quark_int4_quantize(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark ``Int4PerChannelSpec(ch_axis=0)`` / ``Int4PerGroupSpec(ch_axis=-1)`` symmetric
    quantization of a weight [N, K], unpacked: returns (int8 codes [N, K], scale) with scale [N]
    (``group_size=None``) or [N, K/g], in w's dtype (its value is rounded to w's dtype either way).

    ``scale = max(amax / 7.5, eps)`` in w's dtype; ``q = clamp(round_half_even(w * fp32(1/scale)),
    -8, 7)`` in fp32."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ShapeError(f"INT4 quantization expects a 2-D float weight, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    if group_size is None:
        scale = _quark_int4_scale(w.abs().amax(dim=1))
        return _quark_int4_round(w, scale[:, None]), scale
    if group_size <= 0 or k % group_size:
        raise ShapeError(f"input dim {k} of weight {list(w.shape)} is not divisible by group size {group_size}")
    wg = w.reshape(n, k // group_size, group_size)
    scale = _quark_int4_scale(wg.abs().amax(dim=-1))
    return _quark_int4_round(wg, scale[..., None]).reshape(n, k), scale


def quark_int4_per_channel_quantize(w: torch.Tensor, reorder: bool = True,
                                    scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 per-output-channel symmetric weight in Quark's export layout.

    Returns (``weight`` int32 [N, ceil(K/8)], ``weight_scale`` [N]). ``reorder=True`` is
    ``export_safetensors``' default packing; Quark 0.13 file-to-file writes ``reorder=False``.
    ``scale_dtype=None`` stores the scale in w's dtype (``scale_type="float"``, the in-memory export);
    ``torch.float32`` is ``scale_type="float32"`` / file-to-file. Pair it with
    :func:`quark_int4_zero_point_like` for a Quark-loadable export."""
    q, scale = quark_int4_quantize(w)
    return quark_int4_pack(q, reorder), scale.to(scale_dtype or w.dtype)


def quark_int4_per_channel_dequantize(packed: torch.Tensor, scale: torch.Tensor, k: int | None = None,
                                      reorder: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 [N, ceil(K/8)] + scale [N] -> W [N, K] = q * scale[n] (fp32 product, cast to dtype)."""
    if packed.dim() != 2 or scale.dim() != 1 or scale.shape[0] != packed.shape[0]:
        raise ShapeError(f"per-channel INT4: weight {list(packed.shape)} and weight_scale {list(scale.shape)} "
                         f"are not [N, K/8] and [N]")
    q = quark_int4_unpack(packed, reorder, k)
    return (q.float() * scale.float()[:, None]).to(dtype)


def quark_int4_per_group_quantize(w: torch.Tensor, group_size: int = 128, reorder: bool = True,
                                  scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 per-group (along K) symmetric weight in Quark's *export* layout, which is transposed:
    returns (``weight`` int32 [K, ceil(N/8)] = pack(q.T), ``weight_scale`` [K/g, N]).

    Quark 0.13 file-to-file differs: ``reorder=False`` and an untransposed
    [N, K/g] scale (``scale.T`` of this one). ``scale_dtype`` as in
    :func:`quark_int4_per_channel_quantize`."""
    q, scale = quark_int4_quantize(w, group_size)
    return quark_int4_pack(q.t(), reorder), scale.t().contiguous().to(scale_dtype or w.dtype)


def quark_int4_per_group_dequantize(packed: torch.Tensor, scale: torch.Tensor, reorder: bool = True,
                                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Export layout int32 [K, ceil(N/8)] + scale [K/g, N] -> W [N, K] = q[n,k] * scale[k//g, n]."""
    if packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] == 0 or packed.shape[0] % scale.shape[0]:
        raise ShapeError(f"per-group INT4: weight {list(packed.shape)} and weight_scale {list(scale.shape)} "
                         f"are not [K, N/8] and [K/group, N]")
    k, n = packed.shape[0], scale.shape[1]
    if packed.shape[1] != (n + 7) // 8:
        raise ShapeError(f"per-group INT4: weight {list(packed.shape)} does not match {n} output channels")
    g = k // scale.shape[0]
    qt = quark_int4_unpack(packed, reorder, n).float()  # [K, N]
    w = qt.reshape(-1, g, n) * scale.float()[:, None, :]
    return w.reshape(k, n).t().contiguous().to(dtype)


# ---------------------------------------------------------------------------------------------
# FP8 E4M3
# ---------------------------------------------------------------------------------------------


# byte -> its float8_e4m3fn value in fp32 (0x7F / 0xFF are NaN, as torch's cast gives).
_FP8_E4M3_LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _fp8_e4m3_to_float32(x8: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32, the same bits as ``x8.to(torch.float32)``: a 256-entry table lookup,
    ~4x faster than torch's element-wise FP8 cast on CPU (the W4A8 stage-2 hot spot)."""
    idx = x8.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return on_device(_FP8_E4M3_LUT, x8.device).index_select(0, idx).reshape(x8.shape)


def _fp8_cast(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_cast_owned(x: torch.Tensor) -> torch.Tensor:
    """:func:`_fp8_cast` of a fresh buffer the caller owns (clamped in place: one temporary fewer)."""
    return x.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_scale(amax: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.Tensor:
    # Quark's get_scale("float32") casts amax to the scale dtype *before* dividing by 448, so
    # scale_type="float32" gives an fp32 quotient even for a bf16 weight, "float" a bf16 one.
    s = amax.to(scale_dtype or amax.dtype) / FP8_E4M3_MAX
    return s.masked_fill(s == 0, _F32_EPS)


def fp8_per_tensor_scale(amax: torch.Tensor, scale_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The per-tensor FP8 scale Quark derives from a weight's ``amax`` (0-d, in the weight's dtype),
    for callers that quantize a weight a row chunk at a time (pass it as ``scale=`` below)."""
    return _fp8_scale(amax, scale_dtype)


def fp8_per_tensor_quantize(w: torch.Tensor, scale_dtype: torch.dtype | None = torch.float32,
                            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark ``FP8E4M3PerTensorSpec`` (min_max, static) of a weight: returns (float8_e4m3fn, 0-d scale).

    ``scale = amax / 448`` in ``scale_dtype`` (default fp32 = ``scale_type="float32"``, also what
    file-to-file forces; ``None`` = w's dtype). ``q = fp8(clamp(w / scale, +-448))`` where the
    quotient has *w's* dtype: for a bf16 weight it is rounded to bf16 before the FP8 cast, as in
    Quark (``bf16_tensor / fp32_0d_tensor`` stays bf16 under torch's promotion rules).
    ``scale``: the whole weight's :func:`fp8_per_tensor_scale` when ``w`` is a row slice of it."""
    if not w.is_floating_point():
        raise ShapeError(f"FP8 quantization expects a float tensor, got {w.dtype}")
    if scale is None:
        scale = _fp8_scale(w.abs().amax(), scale_dtype)
    return _fp8_cast_owned(w / scale), scale  # the quotient is a fresh buffer


def fp8_per_channel_quantize(w: torch.Tensor, scale_dtype: torch.dtype | None = torch.float32
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark ``FP8E4M3PerChannelSpec(ch_axis=0)`` static weight (the ``ptpc_fp8`` scheme): returns
    (float8_e4m3fn [N, K], scale [N]).

    ``scale[n] = amax_n / 448`` in ``scale_dtype`` (as :func:`fp8_per_tensor_quantize`); Quark then
    casts the scale to *w's* dtype before dividing (``real_quantize_fp8_per_channel_with_scale``), so
    a bf16 weight is divided by a bf16-rounded scale in bf16 while the stored scale keeps fp32."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ShapeError(f"FP8 per-channel quantization expects a 2-D float weight, got {w.dtype} {list(w.shape)}")
    scale = _fp8_scale(w.abs().amax(dim=1), scale_dtype)
    return _fp8_cast_owned(w / scale.to(w.dtype)[:, None]), scale  # the quotient is a fresh buffer


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-tensor (scale shape () or [1]) or per-output-channel (scale [N] or [N, 1]) FP8 weight
    [N, K] -> ``q * scale`` computed in fp32, cast to dtype."""
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(())
    elif q.dim() == 2 and s.numel() == q.shape[0] and s.dim() <= 2:
        s = s.reshape(-1, 1)
    else:
        raise ShapeError(f"FP8 weight_scale of shape {list(scale.shape)} is neither per-tensor nor per-channel "
                         f"for a weight of shape {list(q.shape)}")
    return (q.float() * s).to(dtype)


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSeek-V3 / Kimi-K2 FP8: ``W = fp8 * scale_inv[n // 128, k // 128]`` (computed in fp32)."""
    if w.dim() != 2:
        raise ShapeError(f"FP8 block weight must be 2-D, got shape {list(w.shape)}")
    n, k = w.shape
    bn, bk = block
    want = ((n + bn - 1) // bn, (k + bk - 1) // bk)
    if tuple(scale_inv.shape) != want:
        raise ShapeError(f"weight_scale_inv has shape {list(scale_inv.shape)} but weight {[n, k]} with "
                         f"{bn}x{bk} blocks needs {list(want)}")
    if n % bn == 0 and k % bk == 0:  # broadcast over block views: no full-size scale tensor
        x = w.to(torch.float32, copy=True).view(n // bn, bn, k // bk, bk)
        return x.mul_(scale_inv.float()[:, None, :, None]).view(n, k).to(dtype)
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() * s).to(dtype)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block quantization (for synthetic fixtures): ``scale_inv = amax / 448`` per
    block in fp32 (1 for an all-zero block), ``q = fp8(w / scale_inv)``."""
    if w.dim() != 2:
        raise ShapeError(f"FP8 block quantization expects a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    bn, bk = block
    pn, pk = (-n) % bn, (-k) % bk
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = x.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_E4M3_MAX)
    q = (blocks / s[:, None, :, None]).reshape(n + pn, k + pk)[:n, :k]
    return _fp8_cast(q), s


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_e4m3fn(clamp(x / scale, -448, 448))`` in fp32 (scale broadcast against x)."""
    return _fp8_cast(x.float() / scale.float())


# ---------------------------------------------------------------------------------------------
# W4A8: FP8 per-tensor, then INT4 per-channel (Quark ProgressiveSpec / the int4_fp8 scheme)
# ---------------------------------------------------------------------------------------------


def w4a8_quantize(w: torch.Tensor, reorder: bool = True, stage2_dtype: torch.dtype | None = torch.float32,
                  weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W4A8 weights of ``amd/Kimi-K2.5-W4A8`` (Quark ``ProgressiveSpec`` = the ``int4_fp8`` scheme:
    FP8-E4M3 per-tensor, then INT4 per-channel):

    stage 1: ``s1 = amax(W) / 448`` (fp32), ``x8 = fp8(W / s1)``;
    stage 2 on x8's values in ``stage2_dtype``: ``s2[n] = max(amax_n / 7.5, eps)`` in that dtype,
    ``q = clamp(round_half_even(x8 * fp32(1/s2)), -8, 7)``.

    ``stage2_dtype=torch.float32`` is Quark 0.13 file-to-file (``_progressive_quantize_weight``, what
    AMD's artifact was made with); ``None`` (= w's dtype) is the in-memory ``quantize_model`` +
    ``export_safetensors`` path, whose s2 is bf16-rounded for a bf16 weight (x8 is exact in bf16).

    Returns (``weight`` int32 [N, ceil(K/8)], ``weight_scale`` fp32 0-d = s1, ``weight_scale_2``
    fp32 [N] = s2). To match AMD's artifact, pass the *fp32* dequant of the Moonshot INT4 source
    (``ct_int4_dequantize(..., dtype=torch.float32)``). Stage 2 is per row, so a row slice of W
    quantizes to the same bits given the whole weight's s1 as ``weight_scale``
    (:func:`fp8_per_tensor_scale` of its amax)."""
    if w.dim() != 2:
        raise ShapeError(f"W4A8 quantization expects a 2-D weight, got shape {list(w.shape)}")
    x8, s1 = fp8_per_tensor_quantize(w, torch.float32, weight_scale)
    dt = stage2_dtype or w.dtype
    if dt == torch.float32:
        q, s2 = _w4a8_stage2_f32(x8)
    else:
        q, s2 = quark_int4_quantize(x8.to(dt))
    return quark_int4_pack(q, reorder), s1, s2.float()


def _w4a8_stage2_f32(x8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quark_int4_quantize` (per channel) of ``x8.to(torch.float32)``, by table lookup.

    x8 has only 256 values, so row n's codes are ``table[n, byte]`` with ``table[n, j] =
    clamp(round(fp32(j) * inv[n]), -8, 7)``: the very same fp32 product and rounding as the
    element-wise formulation, evaluated 256 times per row instead of K times, and without the fp32
    copy of x8 (~3x faster, same bits). amax_n is the largest ``byte & 0x7F``: E4M3 magnitudes order
    like their 7 low bits (0x7F, NaN, cannot occur after the +-448 clamp)."""
    b = x8.view(torch.uint8)
    n, k = b.shape
    lut = on_device(_FP8_E4M3_LUT, b.device)
    amax = lut.index_select(0, b.bitwise_and(0x7F).amax(dim=1).to(torch.int32))
    scale = _quark_int4_scale(amax)
    table = _quark_int4_round(lut[None, :], scale[:, None])  # [n, 256] int8
    idx = b.to(torch.int32).add_(torch.arange(0, 256 * n, 256, dtype=torch.int32, device=b.device)[:, None])
    return table.view(-1).index_select(0, idx.reshape(-1)).view(n, k), scale


def w4a8_dequantize(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    k: int | None = None, reorder: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W = (q * weight_scale_2[n]) * weight_scale`` in fp32 (Quark's reverse-dequant order; loaders
    that merge ``weight_scale_2 * weight_scale`` first can differ by one fp32 ulp)."""
    if weight_scale.numel() != 1:
        raise ShapeError(f"W4A8 weight_scale must be per-tensor, got shape {list(weight_scale.shape)}")
    x = quark_int4_per_channel_dequantize(packed, weight_scale_2, k, reorder, torch.float32)
    return (x * weight_scale.float().reshape(())).to(dtype)


# ---------------------------------------------------------------------------------------------
# FP4 E2M1, E8M0 and OCP MXFP4
# ---------------------------------------------------------------------------------------------

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)
# byte -> (value of its low nibble, value of its high nibble): decodes packed FP4 a byte at a time.
_FP4_PAIR_LUT = torch.stack([_E2M1_LUT[torch.arange(256) & 0xF], _E2M1_LUT[torch.arange(256) >> 4]], -1)
_FP4_PAIR_LUT_I64 = _FP4_PAIR_LUT.contiguous().view(torch.int64).reshape(256)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) [..., K] -> uint8 [..., K/2], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ShapeError(f"FP4 packing needs an even last dim, got {list(codes.shape)}")
    if codes.dtype == torch.int32 and codes.is_contiguous():
        # Read each (low, high) int32 pair as one little-endian int64 ``lo + hi * 2**32``: then
        # ``lo | hi << 4`` is ``(w | w >> 28) & 0xFF``, three passes over contiguous words instead
        # of strided uint8 slices (the encoder below hands its int32 codes straight here).
        w = codes.view(torch.int64)
        return (w >> 28).bitwise_or_(w).bitwise_and_(0xFF).to(torch.uint8)
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    if packed.dtype != torch.uint8:
        raise ShapeError(f"packed FP4 tensor must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 values."""
    return on_device(_E2M1_LUT, codes.device)[codes.long()]


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> E2M1 codes (uint8 0..15): saturate at +-6, round half to even mantissa, and a value
    that rounds to zero is +0 (code 0, never 8), as Quark's ``fake_quantize_to_low_precision_fp``.
    ``x`` is already divided by its block scale.

    Branch-free: on [0,2) the grid step is 0.5, on [2,4) 1, on [4,6] 2, i.e. 2**(e-1) with
    e = clamp(floor(log2|x|), 0, 2) read from the float's exponent bits; ``round(x / step)`` (exact:
    power-of-two step, round-half-even) counts grid steps, and the code index is that count plus
    2e. A negative count implies a nonzero magnitude, so -0 never gets the sign bit. In-place ops
    on one fp32 buffer: ~4x faster than a ``torch.where`` formulation, same bits."""
    return _fp4_encode_owned(x.float().clamp(-6.0, 6.0)).to(torch.uint8)


def _fp4_encode_owned(xc: torch.Tensor) -> torch.Tensor:
    """:func:`fp4_encode` of an fp32 buffer the caller owns (it is overwritten) -> int32 codes.

    All int32/fp32 in-place work: bool masks and float -> uint8 casts cost 5-10x a plain int op on
    CPU, so the sign is taken from the fp32 sign bit (``(bits >> 28) & 8`` is 8 for a negative x)
    and kept only for a nonzero magnitude m (0..7): ``m + 7`` has bit 3 set exactly when m > 0."""
    xc = xc.clamp_(-6.0, 6.0)
    xi = xc.view(torch.int32)
    sign = (xi >> 28).bitwise_and_(8)
    e = (xi >> 23).bitwise_and_(0xFF).sub_(127).clamp_(0, 2)
    xc.mul_(torch.bitwise_left_shift(128 - e, 23).view(torch.float32)).round_().abs_()  # |x| / 2**(e-1), rounded
    m = xc.to(torch.int32).add_(e.bitwise_left_shift_(1))
    return m.bitwise_or_(sign.bitwise_and_(m + 7))


def _fp4_x17_lut() -> torch.Tensor:
    """[4096] uint8: 17 * the E2M1 code of every fp32 whose bits ``b`` have
    ``(b >> 20) | (b & 0xFFFFF != 0) == i``. All floats sharing sign, exponent, the top two mantissa
    bits and "third mantissa bit or anything below it set" round to the same E2M1 code: on [1, 8)
    the kept bit, the round bit and the sticky bit decide; on [0.5, 1) and [0.25, 0.5) (step 0.5)
    fewer bits do; below, 0; above (and inf), saturation. So the table is :func:`fp4_encode` of one
    member of each class (``i << 20``), and a lookup gives its exact bits."""
    members = (torch.arange(4096, dtype=torch.int32) << 20).view(torch.float32)
    return (fp4_encode(members).to(torch.int32) * 17).to(torch.uint8)


_FP4_X17_LUT = _fp4_x17_lut()


# E8M0 byte -> float32 2**(e-127) (byte 0 is the subnormal 2**-127, 255 is NaN): a table lookup is
# ~5x cheaper than ldexp + where on the scale tensors of a verification pass.
_E8M0_LUT = torch.where(torch.arange(256) == 255, float("nan"),
                        torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)).float()


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 uint8 -> float32 ``2**(e-127)``; 255 is NaN."""
    return on_device(_E8M0_LUT, e.device).index_select(0, e.reshape(-1).to(torch.int32)).reshape(e.shape)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Positive float scale -> E8M0 uint8, as Quark's ``to_e8m0_uint8``: the nearest power of two
    (log2 rounded half-even) biased by 127, with the exponent clamped to [-126, 127]. Note -126,
    not -127: Quark stores an all-zero block's 2**-127 scale as byte 1."""
    # Quark takes the log2 in the scale's own dtype (fp32 from its MX observer).
    s = scale if scale.dtype in (torch.float32, torch.float64, torch.bfloat16) else scale.float()
    e = torch.log2(s.clamp(min=2.0**-126)).round()
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


def mxfp4_scale_even(amax: torch.Tensor) -> torch.Tensor:
    """Quark ``scale_calculation_mode="even"``: the shared exponent of a 32-block.

    Round amax's mantissa to one bit (half up, carrying into the exponent), take the exponent,
    subtract E2M1's emax (2), clamp to [-127, 127]; amax 0 counts as 2**-126. Returns the unbiased
    exponent as int32 (the block scale is ``2**e``)."""
    return _mxfp4_exponent_of_abs_bits(amax.float().abs().view(torch.int32))


def _mxfp4_exponent_of_abs_bits(bits: torch.Tensor) -> torch.Tensor:
    """:func:`mxfp4_scale_even` of amax given as the int32 bits of a non-negative fp32 (consumed).

    ``(bits + 2**21) >> 23`` is the exponent field after rounding the mantissa to one bit half up.
    A field of 0 (amax 0 or subnormal) gives -129 and clamps to -127 like Quark's 2**-126 floor
    (-128 -> -127); a carry to 255 (inf) is Quark's log2 = inf -> 127, hence the ``+ (f+1) >> 8``."""
    field = bits.add_(1 << 21).bitwise_right_shift_(23)
    return (field + 1).bitwise_right_shift_(8).add_(field).sub_(129).clamp_(-127, 127)


def mxfp4_quantize(w: torch.Tensor, group_size: int = MXFP4_BLOCK,
                   exponents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 along the last dim as Quark ``OCP_MXFP4Spec`` (``PerBlockMXObserver``, "even"
    scales): returns (uint8 packed [..., K/2], uint8 E8M0 scales [..., K/32]).

    ``exponents`` (int32 [..., K/32], unbiased, in [-126, 127]): each block's scale exponent chosen by
    the caller (a scale search) instead of the ``even`` rule; the elements are rounded exactly as
    for the rule's exponents.

    Quark works in fp32 whatever the weight dtype (bf16 -> fp32 is exact). To reproduce AMD's
    Kimi MXFP4 artifact from the Moonshot INT4 source, pass its fp32 dequant. ``w`` is not modified.

    Same bits as ``fp4_pack(fp4_encode(x / 2**e))`` (what Quark computes), in ~5 passes over the
    data instead of ~20, each into a buffer allocated once (fresh multi-MB temporaries cost page
    faults that were most of the old time): the block amax is an int32 max over the |x| bits,
    ``x / 2**e`` is ``x * 2**-e`` (the same correctly rounded real, subnormals included), and the
    E2M1 code is a table lookup on the top bits of ``x / 2**e`` (see :data:`_FP4_X17_LUT`)."""
    k = w.shape[-1]
    if k % group_size:
        raise ShapeError(f"input dim {k} is not divisible by the MXFP4 group size {group_size}")
    lead = w.shape[:-1]
    x = w.float().contiguous().reshape(*lead, k // group_size, group_size)
    given = None
    if exponents is not None:
        if tuple(exponents.shape) != (*lead, k // group_size):
            raise ShapeError(f"MXFP4 exponents {list(exponents.shape)} do not match weight {list(w.shape)}")
        given = exponents.to(torch.int32).clamp(-126, 127).reshape(*lead, k // group_size, 1)
    if sys.byteorder != "little":
        e = mxfp4_scale_even(x.abs().amax(-1, keepdim=True)) if given is None else given.clone()
        codes = _fp4_encode_owned(x / torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)).reshape(w.shape)
        return fp4_pack(codes), (e.clamp(min=-126) + 127).to(torch.uint8).reshape(*lead, -1)
    # |x| as int32 bits: for non-negative floats the integer order is the float order.
    buf = torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF)
    e = _mxfp4_exponent_of_abs_bits(buf.amax(-1, keepdim=True)) if given is None else given.clone()
    # 2**-e exactly: bits (127 - e) << 23, except e = 127 whose reciprocal 2**-127 is the
    # subnormal 0x00400000 (e = 127 is the only value with (e + 129) >> 8 == 1).
    inv = (127 - e).bitwise_left_shift_(23).bitwise_or_((e + 129).bitwise_right_shift_(8).bitwise_left_shift_(22))
    y = torch.mul(x, inv.view(torch.float32), out=buf.view(torch.float32))  # reuses buf: == x / 2**e
    yi = y.view(torch.int32)
    # Table index: the top 12 bits of x / 2**e (sign, exponent, 2 mantissa bits) and, as bit 0, the
    # third mantissa bit ORed with "any lower bit set" ((low 20 bits + 0xFFFFF) carries into bit 20).
    sticky = torch.bitwise_and(yi, 0xFFFFF).add_(0xFFFFF)
    idx = yi.bitwise_or_(sticky).bitwise_right_shift_(20).bitwise_and_(0xFFF)
    del sticky
    codes = on_device(_FP4_X17_LUT, w.device).index_select(0, idx.reshape(-1))
    # Each table byte is code * 17 (the code in both nibbles). Read as little-endian int16 pairs
    # ``lo17 + 256 * hi17``, the low byte of ``pair >> 4`` is ``lo | hi << 4``: the packed byte.
    packed = codes.view(torch.int16).bitwise_right_shift_(4).to(torch.uint8)
    # Stored byte = to_e8m0_uint8(scale): exact for powers of two, except 2**-127 -> byte 1.
    return packed.reshape(*lead, k // 2), (e.clamp_(min=-126) + 127).to(torch.uint8).reshape(*lead, -1)


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (already divided by its block scale) -> the E2M1 value it encodes to, as fp32: the
    rounding of :func:`fp4_encode` (saturate at +-6, half to even on the grid), computed in the float
    domain without codes (a scale search compares the errors of candidate scales with it)."""
    a = y.float().abs().clamp_(max=6.0)
    e = (a.view(torch.int32) >> 23).sub_(127).clamp_(0, 2)  # grid step 2**(e-1) on [2**e, 2**(e+1))
    step = torch.bitwise_left_shift(e.add_(126), 23).view(torch.float32)  # 2**(e-1)
    return a.div_(step).round_().mul_(step).copysign_(y)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     group_size: int = MXFP4_BLOCK) -> torch.Tensor:
    """uint8 packed [..., K/2] + uint8 E8M0 [..., K/32] -> dense [..., K] (fp32 product, cast)."""
    if packed.dtype != torch.uint8:
        raise ShapeError(f"packed FP4 tensor must be uint8, got {packed.dtype}")
    # One table lookup per byte gives both values (low nibble first): no unpack. The pair is read
    # as one int64 so the lookup is a flat index_select, ~2.5x faster than an embedding of pairs.
    lut = on_device(_FP4_PAIR_LUT_I64, packed.device)
    vals = lut.index_select(0, packed.reshape(-1).to(torch.int32)).view(torch.float32)
    vals = vals.reshape(*packed.shape[:-1], -1)
    k = vals.shape[-1]
    if scale.shape[-1] * group_size != k or scale.shape[:-1] != packed.shape[:-1]:
        raise ShapeError(f"MXFP4 weight_scale {list(scale.shape)} does not match weight {list(packed.shape)} "
                         f"(needs [..., {k // group_size}])")
    s = e8m0_to_float(scale).unsqueeze(-1)
    return vals.view(*vals.shape[:-1], -1, group_size).mul_(s).reshape(vals.shape).to(dtype)  # vals is fresh
