"""Quantized and dense GEMMs on the packed canonical weights (``TritonBackend.linear()``), and the
grouped GEMM the fused MoE (``moe.py``) runs on.

One kernel, specialised by constexprs, computes ``y = act(x) @ W.T`` for ``BM`` rows x ``BN`` weight
rows per program, walking its K range in ``BK`` steps, as ``acc[BN, BM] += W_tile @ x_tile.T``: the
weight rows are the MMA's M side (64 on Hopper's wgmma) and the few decode tokens its N side. The
weight tile is decoded in registers from the codes and scales (never a dense copy of a quantized
weight):

* dense bf16 / fp16 / fp32 (``WFMT=0``);
* INT4 (``WFMT=1``): per-group scales (Moonshot group 32, W4A16), per-channel scales, Quark's
  per-tensor FP8 stage scale;
* MXFP4 (``WFMT=2``): E2M1 codes and E8M0 scales per 32 inputs, decoded with integer ops (no
  ``tl.dot_scaled``: Hopper and MI300 have no FP4 MMA);
* FP8 E4M3 (``WFMT=3``) per tensor / per channel / 128x128 blocks, decoded from the bits (so OCP
  e4m3fn weights decode the same on MI300, whose native FP8 is the fnuz variant).

Packed 4-bit codes (INT4 in any packing, unpacked INT4 codes, MXFP4) are kept in one layout,
made once in :func:`make_bank` (the same bytes, or half for unpacked codes): int32 words of 8
codes along K, element ``2i`` of a word in nibble ``i`` and element ``2i + 1`` in nibble ``i + 4``
(Quark's "reorder" slot order), INT4 stored as ``q + 8``. A program loads its ``[BN, BK / 8]``
words once, with 128-bit loads (16 B of one row per thread), and ``(w >> 4i) & 0x000F000F`` puts
elements ``2i`` and ``2i + 1`` in the two 16-bit halves of a register; ``| 0x43004300`` makes each
half the bf16 of ``128 + code``, so ``(x - 136) * s`` is the weight. The group scale is loaded once
per (group, row) and broadcast in registers to the words of its group. The four pairs are joined
and reshaped into K order in registers (``_assemble``).

Float path: every weight element is formed exactly as the reference's ``dequantize`` forms it
(``q * s`` rounded in the scale's dtype, then to the model dtype). Compiled in bf16 with bf16
group scales (Kimi's W4A16) that is one bf16x2 subtract (exact: small integers) and one bf16x2
multiply (rounds the exact product once, to nearest even: ``bf16(q * s)``) per two weights;
otherwise (fp32 / fp16 models, fp16 scales, tensor scales, the interpreter, which has no bf16)
the same halves are read as fp32 and rounded by :func:`_rnd` (integer ops on the fp32 bits).
Then ``tl.dot`` in the dot dtype with fp32 accumulation; results match the reference to
fp32-summation-order differences.

Exact path (W4A8): int8 per-token activations (``act_quant``) times INT4 codes as ``tl.dot``
int8 x int8 -> int32, the same integers as the reference's ``torch._int_mm``; FP8 activations (the
FP8-stage variant of AMD's checkpoint) and FP8 weights are first written as integers in units of
2^-9 (|v| < 2^18) and split into three signed 7-bit digits, every digit pair an int8 ``tl.dot``,
recombined in int64: the exact sum the reference forms in float64. ``acc -> fp32`` rounds once,
then ``* s_x[m] * s_w[n]`` in the reference's order, so the outputs are bit-identical.

Split-K (``gemm_tiles.split_k``, from the weight's shape): program ``s`` of a tile sums its K chunk
and writes the fp32 (exact path: int64) partial; :func:`_splitk_kernel` adds the chunks in chunk
order and applies the epilogue (scales, rounding, SiLU-and-mul, routing weight). Integer sums stay
exact; float sums differ from the unsplit order by fp32 rounding only.

Batch invariance: tile sizes, the split and the K order depend on the format and the weight's
shape only (:mod:`gemm_tiles`), never on the number of rows; a row's tile inputs are the same
whatever rows share its tile (other rows are other MMA columns), and its partials are summed in a
fixed order: a row's bits never depend on the rows around it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eagle3.errors import ShapeError, UsageError
from eagle3.runtime.kernels import torch_ref
from eagle3.runtime.kernels.base import (
    ActQuant,
    DenseWeight,
    FP8Weight,
    Int4Weight,
    LinearOp,
    LinearWeight,
    MXFP4Weight,
    QuantizedRows,
    int4_channel_scale,
)
from eagle3.runtime.kernels.triton import act_quant
from eagle3.runtime.kernels.triton.common import INTERPRET, dot_dtype, tl_dtype, widen
from eagle3.runtime.kernels.triton.gemm_tiles import BLOCK_M, DENSE, FP8, INT4, MXFP4, GemmTiles, gemm_tiles

__all__ = ["BLOCK_M", "DENSE", "FP8", "INT4", "MXFP4", "Bank", "TritonLinear", "launch", "make_bank", "tiles"]

_RND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SPLITK_ROWS = 16  # rows per program of the split-K sum


def tiles(fmt: int, n: int, k: int, group: int = 0, interpret: bool = INTERPRET) -> GemmTiles:
    """The launch shape for a weight of format ``fmt``, ``[n, k]``, INT4 group ``group``: never the
    number of rows (:func:`gemm_tiles.gemm_tiles`; tests patch this to force either rule)."""
    return gemm_tiles(fmt, n, k, group, interpret)


def _device_fn(fn):  # type: ignore[no-untyped-def]
    """``@triton.jit`` for device helpers, except under the interpreter, where they stay plain
    Python (run inside the interpreted kernel, with its patched ``triton.language``): each call of
    an interpreted jit helper re-patches the language module (~3 ms, measured with triton 3.9),
    which made the tiny models' GEMMs several times slower."""
    return fn if INTERPRET else triton.jit(fn)


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------


@_device_fn
def _rnd(v, RND: tl.constexpr):
    """fp32 ``v`` rounded to bf16 (``RND=1``) or fp16 (``2``), ties to even, kept in fp32; ``0``:
    unchanged. bf16 by integer ops on the bits: the interpreter has no bf16 (common.py), and the
    same code is a correct conversion on GPUs (finite values)."""
    if RND == 1:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif RND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@_device_fn
def _e4m3(bits):
    """E4M3 (OCP e4m3fn) bits (int32 0..255) -> fp32 value (finite codes)."""
    e = (bits >> 3) & 0xF
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(bits >= 128, -mag, mag)


@_device_fn
def _e4m3_units(bits):
    """E4M3 bits -> the value as an integer number of 2^-9 (|v| <= 448 * 512 < 2^18)."""
    e = (bits >> 3) & 0xF
    m = bits & 7
    mag = tl.where(e == 0, m, (m + 8) << tl.maximum(e - 1, 0))
    return tl.where(bits >= 128, -mag, mag)


@_device_fn
def _digit(v, IDX: tl.constexpr, N: tl.constexpr):
    """Digit ``IDX`` of ``N`` of the integer ``v``: ``v`` itself when ``N == 1`` (int8 / INT4 codes),
    else the signed base-128 digits of ``|v| < 2^21`` (``v = sum_i digit_i * 128^i``), as int8."""
    if N == 1:
        return v.to(tl.int8)  # already int8 / INT4 codes
    else:
        mag = (tl.abs(v) >> (7 * IDX)) & 127
        return tl.where(v < 0, -mag, mag).to(tl.int8)


@_device_fn
def _halves(t, BF16: tl.constexpr):
    """``[R, W]`` int32 holding two bf16 bit patterns -> ``[R, W, 2]`` (low half first): bf16, or
    the same values as fp32 (a bf16 pattern is the top half of the fp32 one)."""
    if BF16:
        lo = t.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (t << 16).to(tl.float32, bitcast=True)
        hi = (t & -65536).to(tl.float32, bitcast=True)
    return tl.join(lo, hi)


@_device_fn
def _code_pair(t):
    """``[R, W]`` int32 with a 4-bit code in each 16-bit half -> ``[R, W, 2]`` int32 codes."""
    return tl.join(t & 0xFFFF, t >> 16)


@_device_fn
def _assemble(v0, v1, v2, v3):
    """Pairs ``v_i [R, W, 2]`` (elements ``2i``, ``2i + 1`` of each word) -> ``[R, 8 W]`` in K order.
    Joins and a permutation of register dims: no data moves between threads."""
    x = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [R, W, half, i % 2, i // 2]
    x = tl.permute(x, (0, 1, 4, 3, 2))
    return tl.reshape(x, [v0.shape[0], v0.shape[1] * 8])


@_device_fn
def _per_word(s, G: tl.constexpr, BK: tl.constexpr):
    """Group values ``[R, BK / G]`` -> ``[R, BK / 8]``, one per packed word (``G`` a multiple of 8)."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], [s.shape[0], BK // G, G // 8]), [s.shape[0], BK // 8])


@_device_fn
def _mxfp4_value(c):
    """Stored MXFP4 codes (int32; magnitudes 0 and 1 swapped, :func:`_mxfp4_words`) -> fp32 values:
    E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 ((1 + m/2) * 2^(e-1), subnormal m/2), bit 3 the sign."""
    i = c & 7
    i = tl.where(i < 2, i ^ 1, i)
    mag = tl.where(i < 2, i.to(tl.float32) * 0.5,
                   (1.0 + (i % 2).to(tl.float32) * 0.5) * ((((i >> 1) + 126) << 23).to(tl.float32, bitcast=True)))
    return tl.where(c >= 8, -mag, mag)


@_device_fn
def _e8m0(sc):
    """E8M0 scale bytes (int32) -> fp32 ``2^(sc - 127)`` (0: 2^-127, a subnormal)."""
    return tl.where(sc == 0, 5.877471754111438e-39, (sc << 23).to(tl.float32, bitcast=True))


@_device_fn
def _mxfp4_bits(t, sx):
    """bf16 bit patterns of stored MXFP4 codes ``j`` (bits 0-3 and 16-19 of ``t``) times
    ``2^(sc - 127)``, by integer ops on both halves at once. With magnitudes 0 and 1 swapped in
    storage, ``sx + 64 j`` is the product's exponent and mantissa for every magnitude but zero
    (``j = 1``: masked): ``sx = (sc - 1) << 7`` is 0.5's, 64 j adds ``j // 2`` to the exponent and
    ``j & 1`` as its top mantissa bit (1, 1.5, 2, 3, 4, 6 for j = 2..7); the sign moves from bit 3
    to bit 15. Exact (the product is a bf16 value) when every scale byte is in ``[2, 252]`` (no
    subnormal, no overflow: ``Bank.mx_fast``)."""
    j = t & 0x00070007
    v = j * 64 + sx
    nz = ((j ^ 0x00010001) + 0x7FFF7FFF) & -2147450880  # bit 15 of a half set iff its j != 1 (-0x7fff8000)
    return (((t << 12) & -2147450880) | v) & ((nz - ((nz >> 15) & 0x00010001)) | -2147450880)


@_device_fn
def _pair_values(ws, s2, ts, WFMT: tl.constexpr, GROUP: tl.constexpr, HAS_TS: tl.constexpr,
                 S_RND: tl.constexpr, W_RND: tl.constexpr, EXACT: tl.constexpr, BF16W: tl.constexpr,
                 MXF: tl.constexpr):
    """Weights of elements ``2i``, ``2i + 1`` of each packed word, from ``ws = w >> 4i`` (their codes
    in bits 0-3 and 16-19): INT4 codes (exact path), or values in the model dtype (bf16 when
    ``BF16W``, else fp32). ``s2``: the scale per (row, word, half) or per row (MXFP4 with ``MXF``:
    ``(sc - 1) << 7`` per word and half); ``ts``: per-row tensor scales."""
    if EXACT:
        v = _code_pair(ws & 0x000F000F) - 8
    elif WFMT == 1:
        t = (ws & 0x000F000F) | 0x43004300  # bf16 halves 128 + u
        if BF16W:  # (128 + u) - 136 = q exactly; the multiply rounds q * s once to bf16
            v = (_halves(t, True) - tl.full([1, 1, 1], 136.0, tl.bfloat16)) * s2
        else:
            q = _halves(t, False) - 136.0
            if GROUP > 0:
                v = _rnd(q * s2, S_RND)  # q * s in the scale's dtype (compressed-tensors' rule)
                if HAS_TS:
                    v = v * ts
            else:
                v = q * s2  # merged fp32 channel scale
            v = _rnd(v, W_RND)
    elif MXF:  # (the bit decode masks what it needs)
        if BF16W:
            v = _halves(_mxfp4_bits(ws, s2), True)
        else:
            v = _rnd(_halves(_mxfp4_bits(ws, s2), False), W_RND)
    else:
        v = _rnd(_mxfp4_value(_code_pair(ws & 0x000F000F)) * s2, W_RND)
    return v


@_device_fn
def _w_tile(we, se, tse, wrow, n_ok, k0, s_wn, s_sn, K: tl.constexpr, WFMT: tl.constexpr, GROUP: tl.constexpr,
            SBN: tl.constexpr, SBK: tl.constexpr, HAS_TS: tl.constexpr, S_RND: tl.constexpr, W_RND: tl.constexpr,
            EXACT: tl.constexpr, BF16W: tl.constexpr, MXF: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr):
    """Weight tile ``[BN, BK]`` (rows ``wrow``, inputs ``k0 ..``): integer codes for the exact path,
    else model-dtype values (bf16, or fp32 holding them). ``we`` / ``se`` / ``tse``: this expert's
    codes / scales / tensor scales. Masked lanes hold finite values, met by zero activations or
    not stored."""
    if WFMT == 1 or WFMT == 2:  # packed 4-bit words, loaded once
        rkw = k0 // 8 + tl.arange(0, BK // 8)
        if EVEN_K:
            wm = n_ok[:, None]
        else:
            wm = n_ok[:, None] & (rkw < (K + 7) // 8)[None, :]
        words = tl.load(we + wrow[:, None] * s_wn + rkw[None, :], mask=wm, other=0, eviction_policy="evict_first")
        ts = 1.0
        if EXACT:
            s2 = 1.0
        elif WFMT == 2 or GROUP > 0:  # one scale per (group, row), broadcast to the group's words
            G: tl.constexpr = 32 if WFMT == 2 else GROUP
            rg = k0 // G + tl.arange(0, BK // G)
            sm = n_ok[:, None] if EVEN_K else n_ok[:, None] & (rg < (K + G - 1) // G)[None, :]
            if WFMT == 2:
                sc = _per_word(tl.load(se + wrow[:, None] * s_sn + rg[None, :], mask=sm, other=127).to(tl.int32), G,
                               BK)
                if MXF:  # the exponent field of code 1 (0.5) in both halves
                    s2 = ((sc - 1) << 7) | ((sc - 1) << 23)
                else:
                    s2 = tl.join(_e8m0(sc), _e8m0(sc))
            else:
                sw = _per_word(tl.load(se + wrow[:, None] * s_sn + rg[None, :], mask=sm, other=0.0), G, BK)
                if not BF16W:
                    sw = sw.to(tl.float32)
                s2 = tl.join(sw, sw)
            if HAS_TS:
                ts = tl.load(tse + wrow, mask=n_ok, other=0.0)[:, None, None]
        else:  # per-channel INT4: the merged fp32 row scale
            s2 = tl.load(se + wrow, mask=n_ok, other=0.0)[:, None, None]
        v0 = _pair_values(words, s2, ts, WFMT, GROUP, HAS_TS, S_RND, W_RND, EXACT, BF16W, MXF)
        v1 = _pair_values((words >> 4), s2, ts, WFMT, GROUP, HAS_TS, S_RND, W_RND, EXACT, BF16W, MXF)
        v2 = _pair_values((words >> 8), s2, ts, WFMT, GROUP, HAS_TS, S_RND, W_RND, EXACT, BF16W, MXF)
        v3 = _pair_values((words >> 12), s2, ts, WFMT, GROUP, HAS_TS, S_RND, W_RND, EXACT, BF16W, MXF)
        return _assemble(v0, v1, v2, v3)
    else:
        rk = k0 + tl.arange(0, BK)
        wm = n_ok[:, None] if EVEN_K else n_ok[:, None] & (rk < K)[None, :]
        if WFMT == 0:
            v = tl.load(we + wrow[:, None] * s_wn + rk[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
        else:
            bits = tl.load(we + wrow[:, None] * s_wn + rk[None, :], mask=wm, other=0, eviction_policy="evict_first")
            bits = bits.to(tl.int32)
            if EXACT:
                v = _e4m3_units(bits)
            else:
                if SBK > 0 and SBK % BK == 0:  # the K tile lies in one scale block: a column of scales
                    s = tl.load(se + (wrow // SBN) * s_sn + k0 // SBK, mask=n_ok, other=0.0)[:, None]
                elif SBK > 0:  # (a 2-D gather here fails to compile for gfx942 with triton 3.9; the tiles avoid it)
                    s = tl.load(se + (wrow[:, None] // SBN) * s_sn + rk[None, :] // SBK, mask=wm, other=0.0)
                else:
                    s = tl.load(se + wrow, mask=n_ok, other=0.0)[:, None]
                v = _rnd(_e4m3(bits) * s, W_RND)
        return v


@_device_fn
def _mma(a, b, IEEE: tl.constexpr):
    """``tl.dot``, fp32 accumulation; fp32 operands in IEEE precision (not TF32) when ``IEEE``."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@_device_fn
def _finish(acc, sa, sw, rw, EXACT: tl.constexpr, UNIT: tl.constexpr, OUT_RND: tl.constexpr, GLU: tl.constexpr,
            SCATTER: tl.constexpr, BO: tl.constexpr):
    """The epilogue of ``acc [rows, BN]``: exact sums -> fp32 (one rounding) times the row and
    weight scales in the reference's order; rounding to the model dtype; SiLU-and-mul of the
    interleaved gate / up columns (-> ``BO`` columns); the routing weight."""
    if EXACT:
        y = _rnd(acc.to(tl.float32) * UNIT * sa[:, None] * sw, OUT_RND)
    else:
        y = _rnd(acc, OUT_RND)
    if GLU:  # SiLU in fp32 rounded to the model dtype, then the product rounded (torch's op order)
        g, u = tl.split(tl.reshape(y, [y.shape[0], BO, 2]))
        y = _rnd(_rnd(g / (1.0 + tl.exp(-g)), OUT_RND) * u, OUT_RND)
    if SCATTER:
        y = y * rw[:, None]
    return y


@triton.jit
def _gemm_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, rw_ptr, rows_ptr, eid_ptr,
                 M, N_OUT, TOPK, stride_am, stride_om, s_we, s_wn, s_se, s_sn, s_tse, P_STRIDE,
                 K: tl.constexpr, WFMT: tl.constexpr, GROUP: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                 HAS_TS: tl.constexpr, S_RND: tl.constexpr, W_RND: tl.constexpr, OUT_RND: tl.constexpr,
                 EXACT: tl.constexpr, A_DIGITS: tl.constexpr, W_DIGITS: tl.constexpr, UNIT: tl.constexpr,
                 GATHER: tl.constexpr, GLU: tl.constexpr, SCATTER: tl.constexpr, DOT: tl.constexpr,
                 IEEE: tl.constexpr, BF16W: tl.constexpr, MXF: tl.constexpr, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out = epilogue(a @ W.T)``. ``GATHER=0``: rows ``0..M-1`` of ``a`` (a Linear). MoE
    (``GATHER`` 1 / 2): program row ``r`` is pair ``rows[r]`` (``>= M``: padding) of expert
    ``eid[r // BM]`` (``-1``: the block is skipped); its ``a`` row is token ``pair // TOPK`` (1) or
    the pair itself (2). Output row: the pair (the token for a Linear). ``GLU``: the weight holds
    gate rows then up rows (``N_OUT`` each), a program's ``BN`` weight rows interleave ``BN / 2``
    of each, the output is ``silu(g) * u``. ``SCATTER``: the output is multiplied by the routing
    weight ``rw[pair]`` (fp32 out). ``EXACT``: integer activations (int8, or E4M3 bits when
    ``A_DIGITS == 3``) with scales ``sa``; ``s_ptr`` is then the fp32 per-row weight scale.
    ``SPLIT > 1``: program ``(.., .., s)`` sums the ``s``-th K chunk and writes the raw sum to
    ``out[s, pair, BN * pid_n + column]`` (``P_STRIDE`` elements per chunk) for
    :func:`_splitk_kernel`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    if GATHER > 0:
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        if e < 0:  # an unused block past the aligned rows (buffers are sized by an upper bound)
            return
        pair = tl.load(rows_ptr + rm)
        row_ok = pair < M
        if GATHER == 1:
            arow = tl.where(row_ok, pair // TOPK, 0).to(tl.int64)
        else:
            arow = tl.where(row_ok, pair, 0).to(tl.int64)
    else:
        pair = rm
        row_ok = rm < M
        e = 0
        arow = rm.to(tl.int64)
    c = tl.arange(0, BN)
    BO: tl.constexpr = BN // 2 if GLU else BN  # output columns per program
    if GLU:  # gate and up rows interleaved: tile row 2j + p is weight row col_j + p * N_OUT
        col = pid_n * BO + c // 2
        wrow = col + (c % 2) * N_OUT
    else:
        col = pid_n * BO + c
        wrow = col
    n_ok = col < N_OUT
    we = w_ptr + e * s_we
    se = s_ptr + e * s_se
    tse = ts_ptr + e * s_tse
    EVEN_K: tl.constexpr = K % BK == 0
    KS: tl.constexpr = K // SPLIT  # a multiple of BK when SPLIT > 1
    if SPLIT == 1:
        k_lo = 0
    else:
        k_lo = tl.program_id(2) * KS
    if EXACT:
        acc = tl.zeros([BN, BM], tl.int64)
    else:
        acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(k_lo, k_lo + KS, BK):
        rk = k0 + tl.arange(0, BK)
        am = row_ok[:, None] if EVEN_K else row_ok[:, None] & (rk < K)[None, :]
        a = tl.load(a_ptr + arow[:, None] * stride_am + rk[None, :], mask=am, other=0)
        w = _w_tile(we, se, tse, wrow, n_ok, k0, s_wn, s_sn, K, WFMT, GROUP, SBN, SBK, HAS_TS, S_RND, W_RND, EXACT,
                    BF16W, MXF, EVEN_K, BK)
        if EXACT:
            if A_DIGITS == 3:
                a = _e4m3_units(a.to(tl.int32))
            for i in tl.static_range(A_DIGITS):
                at = tl.trans(_digit(a, i, A_DIGITS))
                for j in tl.static_range(W_DIGITS):
                    acc += tl.dot(_digit(w, j, W_DIGITS), at).to(tl.int64) << (7 * (i + j))
        else:
            acc += _mma(w.to(DOT), tl.trans(a.to(DOT)), IEEE)
    acc = tl.trans(acc)  # [BM, BN]: rows, weight rows
    orow = pair.to(tl.int64)
    if SPLIT == 1:
        sa = 1.0
        sw = 1.0
        rw = 1.0
        if EXACT:
            sa = tl.load(sa_ptr + arow, mask=row_ok, other=0.0)
            sw = tl.load(se + wrow, mask=n_ok, other=0.0)[None, :]
        if SCATTER:
            rw = tl.load(rw_ptr + pair, mask=row_ok, other=0.0)
        y = _finish(acc, sa, sw, rw, EXACT, UNIT, OUT_RND, GLU, SCATTER, BO)
        ocol = pid_n * BO + tl.arange(0, BO)
        tl.store(out_ptr + orow[:, None] * stride_om + ocol[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (ocol < N_OUT)[None, :])
    else:
        ncols = 2 * N_OUT if GLU else N_OUT
        p = out_ptr + tl.program_id(2).to(tl.int64) * P_STRIDE + orow[:, None] * ncols + (pid_n * BN + c)[None, :]
        tl.store(p, acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_kernel(part_ptr, sa_ptr, s_ptr, out_ptr, rw_ptr, pe_ptr, M, N_OUT, TOPK, stride_om, s_se, P_STRIDE,
                   EXACT: tl.constexpr, UNIT: tl.constexpr, OUT_RND: tl.constexpr, GATHER: tl.constexpr,
                   GLU: tl.constexpr, SCATTER: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr,
                   BN: tl.constexpr):
    """The split-K partials of :func:`_gemm_kernel` summed in chunk order (fp32, or int64 on the
    exact path), then its epilogue, for ``BR`` output rows x ``BN`` partial columns. ``pe``: the
    expert of each pair (the exact path's weight scales), ``GATHER`` as in the GEMM."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    r_ok = r < M
    c = tl.arange(0, BN)
    BO: tl.constexpr = BN // 2 if GLU else BN
    if GLU:
        col = tl.program_id(1) * BO + c // 2
        wrow = col + (c % 2) * N_OUT
    else:
        col = tl.program_id(1) * BO + c
        wrow = col
    n_ok = col < N_OUT
    ncols = 2 * N_OUT if GLU else N_OUT
    m2 = r_ok[:, None] & n_ok[None, :]
    p = part_ptr + r[:, None] * ncols + (tl.program_id(1) * BN + c)[None, :]
    acc = tl.load(p, mask=m2, other=0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p + s * P_STRIDE, mask=m2, other=0)
    sa = 1.0
    sw = 1.0
    rw = 1.0
    if EXACT:
        sa = tl.load(sa_ptr + (r // TOPK if GATHER == 1 else r), mask=r_ok, other=0.0)
        if GATHER > 0:
            e = tl.load(pe_ptr + r, mask=r_ok, other=0).to(tl.int64)
        else:
            e = tl.zeros([BR], tl.int64)
        sw = tl.load(s_ptr + e[:, None] * s_se + wrow[None, :], mask=m2, other=0.0)
    if SCATTER:
        rw = tl.load(rw_ptr + r, mask=r_ok, other=0.0)
    y = _finish(acc, sa, sw, rw, EXACT, UNIT, OUT_RND, GLU, SCATTER, BO)
    ocol = tl.program_id(1) * BO + tl.arange(0, BO)
    tl.store(out_ptr + r[:, None] * stride_om + ocol[None, :], y.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (ocol < N_OUT)[None, :])


# ---------------------------------------------------------------------------------------------
# Packed weight banks (host side)
# ---------------------------------------------------------------------------------------------


@dataclass
class Bank:
    """Canonical weights of one format stacked over a leading expert dim (``E = 1`` for a Linear):
    each entry may be several weights stacked along rows (gate then up). ``w``: the codes (4-bit
    formats in the kernels' word layout, :func:`pack_words`; FP8 bits) or the dense weight, ``s``:
    the scales (fp32 per row for per-channel formats), ``ts``: per-row FP8 stage scales of
    group-scaled INT4 (else an empty placeholder)."""

    fmt: int
    n: int
    k: int
    w: torch.Tensor
    s: torch.Tensor
    ts: torch.Tensor
    group: int = 0
    sbn: int = 0
    sbk: int = 0
    has_ts: bool = False
    s_rnd: int = 0
    mx_fast: bool = False  # MXFP4 with every E8M0 byte in [2, 252]: products built as bf16 bits (_mxfp4_bits)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        role = "dense" if self.fmt == DENSE else "packed"
        out = [(role, self.w)]
        if self.fmt != DENSE:
            out.append(("scales", self.s))
        if self.has_ts:
            out.append(("scales", self.ts))
        return out


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[N, K]`` (0..15, any integer dtype) -> int32 words ``[N, ceil(K / 8)]``:
    element ``2i`` of each 8 in nibble ``i``, element ``2i + 1`` in nibble ``i + 4`` (the kernels'
    layout: ``(w >> 4i) & 0x000F000F`` holds a consecutive pair; the last word zero-padded)."""
    if sys.byteorder != "little":  # the byte -> word view below
        raise UsageError("the packed 4-bit layout assumes a little-endian host")
    n, k = codes.shape
    u = codes.to(torch.uint8)
    if k % 8:
        u = torch.cat([u, u.new_zeros(n, 8 - k % 8)], dim=1)
    u = u.view(n, -1, 8)
    # byte b of a word holds nibbles 2b (low) and 2b + 1 (high): elements (0, 2), (4, 6), (1, 3), (5, 7)
    b = torch.stack([u[..., lo] | (u[..., hi] << 4) for lo, hi in ((0, 2), (4, 6), (1, 3), (5, 7))], dim=-1)
    return b.contiguous().view(torch.int32).view(n, -1)


def _int4_words(w: Int4Weight) -> torch.Tensor:
    """An INT4 weight's codes (any packing) as :func:`pack_words` of ``q + 8``."""
    return pack_words(w.unpack().to(torch.int16) + 8)


def _mxfp4_words(w: MXFP4Weight) -> torch.Tensor:
    """An MXFP4 weight's E2M1 codes (even element in the low nibble of each byte) as :func:`pack_words`,
    magnitudes 0 and 1 swapped (``c ^ 1`` when ``c & 6 == 0``, the sign bit kept): the kernels'
    decode is then linear in the code except for zero (:func:`_mxfp4_bits`)."""
    p = w.packed
    c = torch.stack([p & 0xF, p >> 4], dim=-1).view(p.shape[0], -1)
    return pack_words(torch.where(c & 6 == 0, c ^ 1, c))


def _scales(t: torch.Tensor) -> torch.Tensor:
    """A scale tensor as the kernels read it (bf16 widened under the interpreter: a copy of the
    scales, never of the codes)."""
    return widen(t).contiguous()


def make_bank(experts: list[list[LinearWeight]], dtype: torch.dtype, device: torch.device) -> Bank:
    """Stack ``experts[e] = [part, ...]`` (parts concatenated along rows) into one :class:`Bank`
    (4-bit codes re-laid one expert at a time: the temporary is one expert's codes)."""
    first = experts[0][0]
    if len({type(w) for parts in experts for w in parts}) != 1:
        raise UsageError("cannot stack weights of different formats")
    k = first.shape[1]
    n = sum(w.shape[0] for w in experts[0])
    if any(sum(w.shape[0] for w in parts) != n or any(w.shape[1] != k for w in parts) for parts in experts):
        raise ShapeError(f"experts are not all [{n}, {k}]")

    def stack(get) -> torch.Tensor:  # type: ignore[no-untyped-def]
        per = [torch.cat([get(w) for w in parts]) if len(parts) > 1 else get(parts[0]) for parts in experts]
        return torch.stack([p.to(device) for p in per]).contiguous()

    flat = [w for parts in experts for w in parts]
    empty = torch.zeros(1, 1, dtype=torch.float32, device=device)
    if isinstance(first, DenseWeight):
        return Bank(DENSE, n, k, stack(lambda w: w.weight.to(dtype)), empty, empty)
    if isinstance(first, Int4Weight):
        ws: list[Int4Weight] = flat  # type: ignore[assignment]
        if len({(w.packing, w.group_size) for w in ws}) != 1:
            raise UsageError("cannot stack INT4 weights of different packings or group sizes")
        group = first.group_size or 0
        codes = stack(_int4_words)
        if group:
            if any(w.scale.shape != (w.shape[0], k // group) for w in ws) or k % group or group % 8:
                raise ShapeError(f"INT4 group scales do not fit [N, {k // group}] (groups of a multiple of 8)")
            has_ts = any(w.tensor_scale is not None for w in ws)
            if has_ts and any(w.tensor_scale is None for w in ws):
                raise UsageError("cannot stack INT4 weights with and without a tensor scale")
            s = _scales(stack(lambda w: w.scale))
            ts = (stack(lambda w: w.tensor_scale.float().reshape(1).expand(w.shape[0])) if has_ts else empty)
            return Bank(INT4, n, k, codes, s, ts, group, has_ts=has_ts, s_rnd=_RND[first.scale.dtype])
        return Bank(INT4, n, k, codes, stack(int4_channel_scale), empty)
    if isinstance(first, MXFP4Weight):
        if k % 32:
            raise ShapeError(f"MXFP4 weight width {k} is not a multiple of 32")
        s = stack(lambda w: w.scale)
        fast = bool(s.numel()) and int(s.min()) >= 2 and int(s.max()) <= 252  # one read at load time
        return Bank(MXFP4, n, k, stack(_mxfp4_words), s, empty, mx_fast=fast)
    if isinstance(first, FP8Weight):
        fs: list[FP8Weight] = flat  # type: ignore[assignment]
        if any(w.block != first.block for w in fs):
            raise UsageError("cannot stack FP8 weights with different blocks")
        codes = stack(lambda w: w.weight.view(torch.uint8))  # decoded from the bits in the kernel
        if first.block is None:
            return Bank(FP8, n, k, codes, stack(lambda w: w.scale.float().reshape(-1).expand(w.shape[0])), empty)
        bn, bk = first.block
        if len(experts[0]) > 1 and any(w.shape[0] % bn for w in fs):
            # parts not aligned to the row block (gate + up of a small expert): one scale row per
            # weight row, the same fp32 product (as the reference's bank)
            s = stack(lambda w: w.scale.float().repeat_interleave(bn, 0)[: w.shape[0]])
            bn = 1
        else:
            s = stack(lambda w: w.scale.float())
        return Bank(FP8, n, k, codes, s, empty, sbn=bn, sbk=bk)
    raise TypeError(f"not a canonical weight: {type(first).__name__}")


def check_act(w: LinearWeight, act: ActQuant) -> str:
    """Execution mode for (weight, activation quantization), as the reference decides it:
    ``dense`` | ``int8`` | ``fp8`` (exact integer GEMMs) | ``mxfp4`` (activations fake-quantized)."""
    if act is None:
        mode = "dense"
    elif act == "mxfp4":
        mode = "mxfp4"  # any weight: activations fake-quantized, then the float GEMM
    elif act in ("int8", "fp8") and (isinstance(w, Int4Weight)
                                     or (isinstance(w, FP8Weight) and act == "fp8" and w.block is None)):
        mode = act
    else:
        raise UsageError(f"{act} activations with a {type(w).__name__} weight are not supported")
    if mode in ("int8", "fp8") and isinstance(w, Int4Weight):
        int4_channel_scale(w)  # refuses group scales, as the reference
    return mode


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype the kernels write (bf16 results go through fp32 under the interpreter)."""
    return torch.float32 if INTERPRET and dtype == torch.bfloat16 else dtype


def quantize_rows(x: torch.Tensor, mode: str, xq: QuantizedRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row activation codes (int8, or E4M3 bits as uint8) and fp32 scales for the exact path;
    ``xq``'s when they are of this mode (made by the fused norm in front: the same numbers)."""
    if xq is not None and xq.kind == mode:
        return (xq.codes.view(torch.uint8) if mode == "fp8" else xq.codes), xq.scales
    if mode == "int8":
        return act_quant.quantize_int8_per_token(x)
    q, s = act_quant.quantize_fp8_per_token(x)
    return q.view(torch.uint8), s


def launch(bank: Bank, a: torch.Tensor, sa: torch.Tensor | None, out: torch.Tensor, *, mode: str,
           dtype: torch.dtype, m: int, n_out: int, grid_m: int, rows: torch.Tensor | None = None,
           eids: torch.Tensor | None = None, topk: int = 1, gather: int = 0, glu: bool = False,
           rw: torch.Tensor | None = None, pair_eids: torch.Tensor | None = None) -> None:
    """Run :func:`_gemm_kernel` on ``bank`` (see its doc) and, when the weight's shape splits K,
    :func:`_splitk_kernel`; ``a`` as the kernel reads it. ``m``: output rows (tokens, or MoE
    pairs); ``pair_eids``: the expert of each pair (an exact-path MoE's split-K sum)."""
    t = tiles(bank.fmt, bank.n, bank.k, bank.group)
    exact = mode in ("int8", "fp8")
    dd = dot_dtype(dtype)
    dummy = bank.s
    w = widen(bank.w) if bank.fmt == DENSE else bank.w  # dense bf16 under the interpreter: fp32 per call
    bo = t.bn // 2 if glu else t.bn  # output columns per program
    ncols = 2 * n_out if glu else n_out
    dest, p_stride = out, 0
    if t.split > 1:  # raw partial sums, one [m, ncols] slab per K chunk
        dest = torch.empty(t.split, m, ncols, dtype=torch.int64 if exact else torch.float32, device=out.device)
        p_stride = m * ncols
    bf16 = not INTERPRET and not exact and dtype == torch.bfloat16  # compiled bf16: decode to bf16 directly
    bf16w = bf16 and ((bank.fmt == INT4 and bank.group > 0 and not bank.has_ts and bank.s.dtype == torch.bfloat16)
                      or (bank.fmt == MXFP4 and bank.mx_fast))
    unit = (2.0 ** -9 if mode == "fp8" else 1.0) * (2.0 ** -9 if exact and bank.fmt == FP8 else 1.0)
    _gemm_kernel[(grid_m, triton.cdiv(n_out, bo), t.split)](
        a, sa if sa is not None else dummy, w, bank.s, bank.ts, dest, rw if rw is not None else dummy,
        rows if rows is not None else dummy, eids if eids is not None else dummy,
        m, n_out, topk, a.stride(0), out.stride(0), w.stride(0), w.stride(1), bank.s.stride(0),
        bank.s.stride(1) if bank.s.dim() > 2 else 0, bank.ts.stride(0), p_stride,
        K=bank.k, WFMT=bank.fmt, GROUP=bank.group, SBN=bank.sbn, SBK=bank.sbk,
        HAS_TS=bank.has_ts, S_RND=bank.s_rnd, W_RND=_RND[dtype], OUT_RND=_RND[dtype], EXACT=exact,
        A_DIGITS=3 if mode == "fp8" else 1, W_DIGITS=3 if exact and bank.fmt == FP8 else 1, UNIT=unit,
        GATHER=gather, GLU=glu, SCATTER=rw is not None, DOT=tl_dtype(dd), IEEE=dd == torch.float32, BF16W=bf16w,
        MXF=bank.mx_fast, SPLIT=t.split, BM=t.bm, BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages)
    if t.split > 1:
        _splitk_kernel[(triton.cdiv(m, SPLITK_ROWS), triton.cdiv(n_out, bo))](
            dest, sa if sa is not None else dummy, bank.s, out, rw if rw is not None else dummy,
            pair_eids if pair_eids is not None else dummy, m, n_out, topk, out.stride(0), bank.s.stride(0), p_stride,
            EXACT=exact, UNIT=unit, OUT_RND=_RND[dtype], GATHER=gather, GLU=glu, SCATTER=rw is not None,
            SPLIT=t.split, BR=SPLITK_ROWS, BN=t.bn)


# ---------------------------------------------------------------------------------------------
# LinearOp
# ---------------------------------------------------------------------------------------------


class TritonLinear(LinearOp):
    """``y = act(x) @ W.T (+ bias)`` with :func:`_gemm_kernel`; the weight stays packed."""

    def prepare(self, weight: LinearWeight, act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.mode = check_act(weight, act)
        self.dtype = dtype
        self.bias = None if weight.bias is None else weight.bias.to(device=device, dtype=dtype)
        self.bank = make_bank([[weight]], dtype, device)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.bank.resident() + ([] if self.bias is None else [("dense", self.bias)])

    def __call__(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        t = x.shape[0]
        out = torch.empty(t, self.out_features, dtype=store_dtype(self.dtype), device=x.device)
        if t:
            sa = None
            if self.mode == "mxfp4":
                x = torch_ref.mxfp4_qdq(x)
            if self.mode in ("int8", "fp8"):
                a, sa = quantize_rows(x, self.mode, xq)
            else:
                a = widen(x).contiguous()
            launch(self.bank, a, sa, out, mode=self.mode, dtype=self.dtype, m=t, n_out=self.out_features,
                   grid_m=triton.cdiv(t, BLOCK_M))
        y = out.to(self.dtype)
        return y if self.bias is None else y + self.bias
