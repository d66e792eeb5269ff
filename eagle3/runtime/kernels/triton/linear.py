"""Quantized and dense GEMMs on the packed canonical weights (``TritonBackend.linear()``), and the
grouped GEMM the fused MoE (``moe.py``) runs on.

One kernel, specialised by constexprs, computes ``y = act(x) @ W.T`` for a tile of ``BM`` rows x
``BN`` output columns, walking K in ``BK`` steps. The weight tile is decoded in registers from the
codes and scales as stored (never a dense copy of a quantized weight):

* dense bf16 / fp16 / fp32 (``WFMT=0``);
* INT4 (``WFMT=1``): int32 words of 8 nibbles in the compressed-tensors, Quark "reorder" or Quark
  natural packing (or unpacked int8 codes), per-group scales (Moonshot group 32, W4A16), per-channel
  scales, Quark's per-tensor FP8 stage scale;
* MXFP4 (``WFMT=2``): E2M1 nibbles and E8M0 scales per 32 inputs, decoded with integer ops (no
  ``tl.dot_scaled``: Hopper and MI300 have no FP4 MMA);
* FP8 E4M3 (``WFMT=3``) per tensor / per channel / 128x128 blocks, decoded from the bits (so OCP
  e4m3fn weights decode the same on MI300, whose native FP8 is the fnuz variant).

Float path: every weight element is formed exactly as the reference's ``dequantize`` forms it
(``q * s`` rounded in the scale's dtype, then to the model dtype; rounding emulated on fp32 bits,
see :func:`_rnd`), then ``tl.dot`` in the dot dtype with fp32 accumulation; results match the
reference to fp32-summation-order differences.

Exact path (W4A8): int8 per-token activations (``act_quant``) times INT4 codes as ``tl.dot``
int8 x int8 -> int32, the same integers as the reference's ``torch._int_mm``; FP8 activations (the
FP8-stage variant of AMD's checkpoint) and FP8 weights are first written as integers in units of
2^-9 (|v| < 2^18) and split into three signed 7-bit digits, every digit pair an int8 ``tl.dot``,
recombined in int64: the exact sum the reference forms in float64. ``acc -> fp32`` rounds once,
then ``* s_x[m] * s_w[n]`` in the reference's order, so the outputs are bit-identical.

Batch invariance: ``BM/BN/BK`` depend on the format and the weight's shape only (:func:`tiles`),
there is no split-K, and a row's accumulation order is the K loop's; a row's bits never depend on
the rows around it.
"""

from __future__ import annotations

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
    int4_channel_scale,
)
from eagle3.runtime.kernels.triton import act_quant
from eagle3.runtime.kernels.triton.common import INTERPRET, block, dot_dtype, tl_dtype, widen

DENSE, INT4, MXFP4, FP8 = 0, 1, 2, 3
_PACKS = {None: 0, "ct": 1, "quark": 2, "quark_order": 3}
_RND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK_M = 16  # rows per program, every format and shape (decode batches are small; tl.dot needs 16)


def tiles(fmt: int, n: int, k: int, interpret: bool = INTERPRET) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a weight of format ``fmt`` and shape ``[n, k]``: never the
    number of rows. Compiled: K steps of 32 for the group-32 formats (one INT4 group / E8M0 block
    per step). Interpreted: whole-width tiles (up to 1024 x 256), since the interpreter's cost is
    per tile op, not per element (the kernel tests run both shapes)."""
    if interpret:
        return BLOCK_M, min(1024, block(n)), min(256, block(k))
    bk = 32 if fmt in (INT4, MXFP4) else min(64, block(k))  # FP8: divides the 128-wide scale blocks
    return BLOCK_M, min(64, block(n)), bk


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
def _int4_codes(we, rn, rk, mask, s_wn, PACK: tl.constexpr):
    """Signed INT4 codes ``[BK, BN]`` (int32) of weight rows ``rn``, inputs ``rk``."""
    if PACK == 0:  # unpacked int8 codes [N, K]
        return tl.load(we + rn[None, :] * s_wn + rk[:, None], mask=mask, other=0).to(tl.int32)
    else:
        word = tl.load(we + rn[None, :] * s_wn + rk[:, None] // 8, mask=mask, other=0)
        j = rk[:, None] % 8
        if PACK == 2:  # Quark reorder: element j of a group of 8 sits in nibble slot (j%2)*4 + j//2
            j = (j % 2) * 4 + j // 2
        nib = (word >> (j * 4)) & 0xF
        if PACK == 1:  # compressed-tensors: nibble = q + 8
            return nib - 8
        else:  # Quark: 4-bit two's complement
            return (nib ^ 8) - 8


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
def _w_float(we, s_ptr, ts_ptr, rn, rk, k0, mask, n_ok, s_wn, s_sn, WFMT: tl.constexpr, PACK: tl.constexpr,
             GROUP: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, HAS_TS: tl.constexpr,
             S_RND: tl.constexpr, W_RND: tl.constexpr, BK: tl.constexpr):
    """Weight tile ``[BK, BN]`` (``W[rn, rk]`` transposed) as fp32 holding model-dtype values, formed
    element by element as ``base.dequantize`` forms them. ``s_ptr`` / ``ts_ptr``: this expert's."""
    nm = mask
    if WFMT == 0:
        v = tl.load(we + rn[None, :] * s_wn + rk[:, None], mask=nm, other=0.0).to(tl.float32)
    elif WFMT == 1:
        q = _int4_codes(we, rn, rk, nm, s_wn, PACK).to(tl.float32)
        if GROUP > 0:
            s = tl.load(s_ptr + rn[None, :] * s_sn + rk[:, None] // GROUP, mask=nm, other=0.0).to(tl.float32)
            v = _rnd(q * s, S_RND)  # q * s in the scale's dtype (compressed-tensors' rule)
            if HAS_TS:
                v = v * tl.load(ts_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            v = q * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]  # merged fp32 channel scale
        v = _rnd(v, W_RND)
    elif WFMT == 2:
        byte = tl.load(we + rn[None, :] * s_wn + rk[:, None] // 2, mask=nm, other=0).to(tl.int32)
        c = (byte >> ((rk[:, None] % 2) * 4)) & 0xF
        i = c & 7  # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: (1 + m/2) * 2^(e-1), subnormal m/2
        mag = tl.where(i < 2, i.to(tl.float32) * 0.5,
                       (1.0 + (i % 2).to(tl.float32) * 0.5) * ((((i >> 1) + 126) << 23).to(tl.float32, bitcast=True)))
        val = tl.where(c >= 8, -mag, mag)
        sc = tl.load(s_ptr + rn[None, :] * s_sn + rk[:, None] // 32, mask=nm, other=127).to(tl.int32)
        scale = tl.where(sc == 0, 5.877471754111438e-39, (sc << 23).to(tl.float32, bitcast=True))  # 2^(sc-127)
        v = _rnd(val * scale, W_RND)
    else:
        bits = tl.load(we + rn[None, :] * s_wn + rk[:, None], mask=nm, other=0).to(tl.int32)
        if SBK > 0 and SBK % BK == 0:  # the K tile lies in one scale block: a row of scales
            s = tl.load(s_ptr + (rn // SBN) * s_sn + k0 // SBK, mask=n_ok, other=0.0)[None, :]
        elif SBK > 0:  # (a 2-D gather here fails to compile for gfx942 with triton 3.9; the tiles avoid it)
            s = tl.load(s_ptr + (rn[None, :] // SBN) * s_sn + rk[:, None] // SBK, mask=nm, other=0.0)
        else:
            s = tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        v = _rnd(_e4m3(bits) * s, W_RND)
    return v  # masked lanes hold finite values (loads' ``other``), met by zero activations or not stored


@_device_fn
def _mma(a, b, IEEE: tl.constexpr):
    """``tl.dot``, fp32 accumulation; fp32 operands in IEEE precision (not TF32) when ``IEEE``."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@_device_fn
def _w_units(we, rn, rk, mask, s_wn, WFMT: tl.constexpr, PACK: tl.constexpr):
    """Integer weight codes ``[BK, BN]`` (int32) for the exact path: INT4 codes, or FP8 values in
    units of 2^-9."""
    if WFMT == 1:
        q = _int4_codes(we, rn, rk, mask, s_wn, PACK)
    else:
        q = _e4m3_units(tl.load(we + rn[None, :] * s_wn + rk[:, None], mask=mask, other=0).to(tl.int32))
    return q  # masked lanes: finite codes, met by zero activations or not stored


@triton.jit
def _gemm_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, rw_ptr, rows_ptr, eid_ptr,
                 M, N_OUT, TOPK, stride_am, stride_om, s_we, s_wn, s_se, s_sn, s_tse,
                 K: tl.constexpr, WFMT: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr,
                 SBN: tl.constexpr, SBK: tl.constexpr, HAS_TS: tl.constexpr, S_RND: tl.constexpr,
                 W_RND: tl.constexpr, OUT_RND: tl.constexpr, EXACT: tl.constexpr, A_DIGITS: tl.constexpr,
                 W_DIGITS: tl.constexpr, UNIT: tl.constexpr, GATHER: tl.constexpr, GLU: tl.constexpr,
                 SCATTER: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out = epilogue(a @ W.T)``. ``GATHER=0``: rows ``0..M-1`` of ``a`` (a Linear). MoE
    (``GATHER`` 1 / 2): program row ``r`` is pair ``rows[r]`` (``>= M``: padding) of expert
    ``eid[r // BM]`` (``-1``: the block is skipped); its ``a`` row is token ``pair // TOPK`` (1) or ``r`` itself (2). ``GLU``: the
    weight holds gate rows then up rows (``N_OUT`` each), the output is ``silu(g) * u``. ``SCATTER``:
    the output row ``pair`` is multiplied by the routing weight ``rw[pair]`` (fp32 out).
    ``EXACT``: integer activations (int8, or E4M3 bits when ``A_DIGITS == 3``) with scales ``sa``;
    ``s_ptr`` is then the fp32 per-row weight scale."""
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
            arow = rm.to(tl.int64)
    else:
        pair = rm
        row_ok = rm < M
        e = 0
        arow = rm.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)  # output columns
    if GLU:  # one tile of 2 * BN weight rows, gate and up interleaved: column 2j + p is row j + p * N_OUT
        c = tl.arange(0, 2 * BN)
        col = pid_n * BN + c // 2
        n_ok = col < N_OUT
        wrow = col + (c % 2) * N_OUT
    else:
        n_ok = rn < N_OUT
        wrow = rn
    rk0 = tl.arange(0, BK)
    we = w_ptr + e * s_we
    se = s_ptr + e * s_se
    tse = ts_ptr + e * s_tse
    NC: tl.constexpr = 2 * BN if GLU else BN
    if EXACT:
        acc = tl.zeros([BM, NC], tl.int64)
    else:
        acc = tl.zeros([BM, NC], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + rk0
        k_ok = rk < K
        wm = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptr + arow[:, None] * stride_am + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        if EXACT:
            if A_DIGITS == 3:
                a = _e4m3_units(a.to(tl.int32))
            w = _w_units(we, wrow, rk, wm, s_wn, WFMT, PACK)
            for i in tl.static_range(A_DIGITS):
                ai = _digit(a, i, A_DIGITS)
                for j in tl.static_range(W_DIGITS):
                    acc += tl.dot(ai, _digit(w, j, W_DIGITS)).to(tl.int64) << (7 * (i + j))
        else:
            w = _w_float(we, se, tse, wrow, rk, k0, wm, n_ok, s_wn, s_sn, WFMT, PACK, GROUP, SBN, SBK, HAS_TS, S_RND,
                         W_RND, BK)
            acc += _mma(a.to(tl.float32).to(DOT), w.to(DOT), IEEE)
    if EXACT:  # acc -> fp32 (one rounding), * s_x[m] * s_w[n]: the reference's order
        sa = tl.load(sa_ptr + arow, mask=row_ok, other=0.0)
        y = _rnd(acc.to(tl.float32) * UNIT * sa[:, None] * tl.load(se + wrow, mask=n_ok, other=0.0)[None, :],
                 OUT_RND)
    else:
        y = _rnd(acc, OUT_RND)
    if GLU:  # SiLU in fp32 rounded to the model dtype, then the product rounded (torch's op order)
        g, u = tl.split(tl.reshape(y, [BM, BN, 2]))
        y = _rnd(_rnd(g / (1.0 + tl.exp(-g)), OUT_RND) * u, OUT_RND)
    if SCATTER:
        y = y * tl.load(rw_ptr + pair, mask=row_ok, other=0.0)[:, None]
        orow = pair.to(tl.int64)
        om = row_ok[:, None] & (rn < N_OUT)[None, :]
    else:
        orow = rm.to(tl.int64)
        om = (rm < M)[:, None] & (rn < N_OUT)[None, :] if GATHER == 0 else (rn < N_OUT)[None, :]  # sorted rows: all
    tl.store(out_ptr + orow[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=om)


# ---------------------------------------------------------------------------------------------
# Packed weight banks (host side)
# ---------------------------------------------------------------------------------------------


@dataclass
class Bank:
    """Canonical weights of one format stacked over a leading expert dim (``E = 1`` for a Linear),
    as stored: each entry may be several weights stacked along rows (gate then up). ``w``: the codes
    (or the dense weight), ``s``: the scales (fp32 per row for per-channel formats), ``ts``: per-row
    FP8 stage scales of group-scaled INT4 (else an empty placeholder)."""

    fmt: int
    n: int
    k: int
    w: torch.Tensor
    s: torch.Tensor
    ts: torch.Tensor
    pack: int = 0
    group: int = 0
    sbn: int = 0
    sbk: int = 0
    has_ts: bool = False
    s_rnd: int = 0

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        role = "dense" if self.fmt == DENSE else "packed"
        out = [(role, self.w)]
        if self.fmt != DENSE:
            out.append(("scales", self.s))
        if self.has_ts:
            out.append(("scales", self.ts))
        return out


def _scales(t: torch.Tensor) -> torch.Tensor:
    """A scale tensor as the kernels read it (bf16 widened under the interpreter: a copy of the
    scales, never of the codes)."""
    return widen(t).contiguous()


def make_bank(experts: list[list[LinearWeight]], dtype: torch.dtype, device: torch.device) -> Bank:
    """Stack ``experts[e] = [part, ...]`` (parts concatenated along rows) into one :class:`Bank`."""
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
        pack, group = _PACKS[first.packing], first.group_size or 0
        codes = stack(lambda w: w.codes)
        if group:
            if any(w.scale.shape != (w.shape[0], k // group) for w in ws) or k % group:
                raise ShapeError(f"INT4 group scales do not fit [N, {k // group}]")
            has_ts = any(w.tensor_scale is not None for w in ws)
            if has_ts and any(w.tensor_scale is None for w in ws):
                raise UsageError("cannot stack INT4 weights with and without a tensor scale")
            s = _scales(stack(lambda w: w.scale))
            ts = (stack(lambda w: w.tensor_scale.float().reshape(1).expand(w.shape[0])) if has_ts else empty)
            return Bank(INT4, n, k, codes, s, ts, pack, group, has_ts=has_ts, s_rnd=_RND[first.scale.dtype])
        return Bank(INT4, n, k, codes, stack(int4_channel_scale), empty, pack)
    if isinstance(first, MXFP4Weight):
        if k % 32:
            raise ShapeError(f"MXFP4 weight width {k} is not a multiple of 32")
        return Bank(MXFP4, n, k, stack(lambda w: w.packed), stack(lambda w: w.scale), empty)
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


def quantize_rows(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row activation codes (int8, or E4M3 bits as uint8) and fp32 scales for the exact path."""
    if mode == "int8":
        return act_quant.quantize_int8_per_token(x)
    q, s = act_quant.quantize_fp8_per_token(x)
    return q.view(torch.uint8), s


def launch(bank: Bank, a: torch.Tensor, sa: torch.Tensor | None, out: torch.Tensor, *, mode: str,
           dtype: torch.dtype, m: int, n_out: int, grid_m: int, rows: torch.Tensor | None = None,
           eids: torch.Tensor | None = None, topk: int = 1, gather: int = 0, glu: bool = False,
           rw: torch.Tensor | None = None) -> None:
    """Run :func:`_gemm_kernel` on ``bank`` (see its doc); ``a`` as the kernel reads it."""
    bm, bn, bk = tiles(bank.fmt, bank.n, bank.k)
    exact = mode in ("int8", "fp8")
    dd = dot_dtype(dtype)
    dummy = bank.s
    w = widen(bank.w) if bank.fmt == DENSE else bank.w  # dense bf16 under the interpreter: fp32 per call
    grid = (grid_m, triton.cdiv(n_out, bn))
    _gemm_kernel[grid](
        a, sa if sa is not None else dummy, w, bank.s, bank.ts, out, rw if rw is not None else dummy,
        rows if rows is not None else dummy, eids if eids is not None else dummy,
        m, n_out, topk, a.stride(0), out.stride(0), w.stride(0), w.stride(1), bank.s.stride(0),
        bank.s.stride(1) if bank.s.dim() > 2 else 0, bank.ts.stride(0),
        K=bank.k, WFMT=bank.fmt, PACK=bank.pack, GROUP=bank.group, SBN=bank.sbn, SBK=bank.sbk,
        HAS_TS=bank.has_ts, S_RND=bank.s_rnd, W_RND=_RND[dtype], OUT_RND=_RND[dtype], EXACT=exact,
        A_DIGITS=3 if mode == "fp8" else 1, W_DIGITS=3 if exact and bank.fmt == FP8 else 1,
        UNIT=(2.0 ** -9 if mode == "fp8" else 1.0) * (2.0 ** -9 if exact and bank.fmt == FP8 else 1.0),
        GATHER=gather, GLU=glu, SCATTER=rw is not None, DOT=tl_dtype(dd), IEEE=dd == torch.float32,
        BM=bm, BN=bn, BK=bk)


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        out = torch.empty(t, self.out_features, dtype=store_dtype(self.dtype), device=x.device)
        if t:
            sa = None
            if self.mode == "mxfp4":
                x = torch_ref.mxfp4_qdq(x)
            if self.mode in ("int8", "fp8"):
                a, sa = quantize_rows(x, self.mode)
            else:
                a = widen(x).contiguous()
            launch(self.bank, a, sa, out, mode=self.mode, dtype=self.dtype, m=t, n_out=self.out_features,
                   grid_m=triton.cdiv(t, BLOCK_M))
        y = out.to(self.dtype)
        return y if self.bias is None else y + self.bias
