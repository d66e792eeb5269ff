"""Packed weights, decoded per call into a reused scratch (CPU), and the row-tiled GEMM over them."""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

from eagle3.errors import ShapeError, UsageError
from eagle3.formats import codecs
from eagle3.runtime.kernels.base import (
    DenseWeight,
    FP8Weight,
    Int4Weight,
    LinearWeight,
    MXFP4Weight,
    int4_channel_scale,
    unpack_int4,
)

if TYPE_CHECKING:  # pragma: no cover
    pass

from eagle3.runtime.kernels.torch_ref.gemm import ROW_TILE, _pad_rows, compute_dtype

#
# Quantized weights stay as they are on disk (codes + scales); every call decodes the values it
# needs into a scratch, with the same codec tables, the same op order and the same dtypes as a
# load-time decode, so the GEMMs see bit-identical operands. On CPU the scratch is a set of buffers
# reused from call to call (:func:`scratch`; ``REUSE_SCRATCH``), elsewhere per-call tensors. It is
# bounded: one Linear's weight (or a tile of LINEAR_SCRATCH_BYTES of its rows), the experts of one
# MoE layer when they are smaller than _MOE_ALL_BYTES together, else the active experts in chunks
# of at most MOE_SCRATCH_BYTES, or one expert at a time, a row tile at a time (full-width experts).
# Dense weights are kept in the model dtype; on CPU they are widened to fp32 (compute_dtype) per
# call the same way. The FP8-activation GEMM of INT4 codes is exact in int8 digits (fp8_int4_linear).
#
# Row tiles: a GEMM over a tile of weight rows gives the same bits as those output columns of the
# whole GEMM (measured for MKL here, 1 and 2 threads, K 128..7168, tiles of 64..2048 rows); tiles
# depend on the weight's shape only, never on the batch, so batch invariance holds either way.

LINEAR_SCRATCH_BYTES = 64 * 1024 * 1024  # dense rows of one Linear decoded at once, at most
MOE_SCRATCH_BYTES = 64 * 1024 * 1024  # dense experts decoded at once (gathered path), at most
_TILE_ALIGN = 128  # row tiles are multiples of this (FP8 128-row blocks, 8-row INT4 words)
# Values decoded per pass through the intermediates: a whole 64 MiB tile. Smaller, cache-sized passes
# were slower on the shared 2-core machine here: each op is an OpenMP region whose sync costs ~10 ms
# when another job holds a core, so fewer, larger ops win.
DECODE_PASS_ELEMS = LINEAR_SCRATCH_BYTES // 4

# The per-call scratch, reused across calls (CPU). Decoding into fresh tensors cost more than the
# decode itself at full width: every 64 MiB tile was a new mmap whose pages the kernel faults in and
# zeroes (4M minor faults, half the wall time of a decode step of the 2-layer Kimi-K2.5 slice). The
# buffers belong to the calling thread (the engine, a test, a draft thread never share one) and
# are bounded by the tile budgets above; they are runtime memory, never a weight.
_SCRATCH = threading.local()
# False: decode into per-call tensors instead, the behaviour before the scratch (the same bits, slower);
# benchmarks/decode_ab.py times the two against each other.
REUSE_SCRATCH = True


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused 1-D buffer of ``numel`` elements, named per use so that buffers alive at once
    never alias; the caller overwrites it before reading it."""
    bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = _SCRATCH.__dict__.setdefault("bufs", {})
    key = (name, dtype, device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buf = torch.empty(numel, dtype=dtype, device=device)
        bufs[key] = buf
    return buf[:numel]


def release_scratch() -> None:
    """Drop the calling thread's reused buffers (the next call makes them again): for a caller that
    runs one layer at a time and needs the memory in between (the calibration pass)."""
    _SCRATCH.__dict__.pop("bufs", None)


def _scratch_ok(x: torch.Tensor) -> bool:
    """Decode into the reused scratch (CPU, no autograd through the ``out=`` GEMMs); elsewhere the
    per-call tensors (the CUDA caching allocator reuses blocks by itself)."""
    return REUSE_SCRATCH and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())


def _round_through(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str) -> None:
    """Round fp32 ``t`` in place through each of ``dtypes`` in turn (``t.to(d1).to(d2)...`` back in
    fp32: the casts of a per-call decode, without allocating)."""
    last = torch.float32
    for d in dtypes:
        if d in (torch.float32, last):  # widening to fp32, or rounding twice to one dtype: the identity
            continue
        tmp = scratch(name, t.numel(), d, t.device).view(t.shape)
        tmp.copy_(t)
        t.copy_(tmp)
        last = d


class _Bank:
    """Canonical weights of one kind stacked over a leading expert dim (one entry for a Linear), kept
    packed as on disk. Each entry may be several weights stacked along rows (gate then up); the bank
    keeps their per-row scales so that the rows decode exactly as each weight alone would."""

    def __init__(self, experts: list[list[LinearWeight]], dtype: torch.dtype, device: torch.device) -> None:
        first = experts[0][0]
        kinds = {type(w) for parts in experts for w in parts}
        if len(kinds) != 1:
            raise UsageError("cannot stack weights of different formats: " + ", ".join(sorted(k.__name__ for k in kinds)))
        self.kind = type(first)
        self.k = first.shape[1]
        self.n = sum(w.shape[0] for w in experts[0])
        if any(sum(w.shape[0] for w in parts) != self.n or any(w.shape[1] != self.k for w in parts)
               for parts in experts):
            raise ShapeError(f"experts are not all [{self.n}, {self.k}]")
        self.num = len(experts)
        self.dtype = dtype
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self.roles: dict[str, str] = {}

        def put(name: str, role: str, per_expert: list[torch.Tensor]) -> None:
            if len(per_expert) == 1:  # one weight: a view, no copy
                t = per_expert[0].to(device)[None]
            else:
                t = torch.stack([x.to(device) for x in per_expert])
            self.tensors[name] = t
            self.roles[name] = role

        def rows(get: Any) -> list[torch.Tensor]:
            """Per expert, its parts' tensors concatenated along rows."""
            return [p[0] if len(p) == 1 else torch.cat(p) for p in ([get(w) for w in parts] for parts in experts)]

        if isinstance(first, DenseWeight):
            put("weight", "dense", rows(lambda w: w.weight.to(dtype)))
        elif isinstance(first, Int4Weight):
            ws: list[Int4Weight] = [w for parts in experts for w in parts]  # type: ignore[misc]
            if len({(w.packing, w.group_size) for w in ws}) != 1:
                raise UsageError("cannot stack INT4 weights of different packings or group sizes")
            self.packing, self.group = first.packing, first.group_size
            put("codes", "packed", rows(lambda w: w.codes))
            if self.group is not None:
                if any(w.scale.shape != (w.shape[0], self.k // self.group) for w in ws):
                    raise ShapeError(f"INT4 group scales do not fit [N, {self.k // self.group}]")
                put("scale", "scales", rows(lambda w: w.scale))
                self.row_ts = any(w.tensor_scale is not None for w in ws)
                if self.row_ts:
                    if any(w.tensor_scale is None for w in ws):
                        raise UsageError("cannot stack INT4 weights with and without a tensor scale")
                    put("row_ts", "scales", rows(lambda w: w.tensor_scale.float().reshape(1).expand(w.shape[0])))
            else:
                put("scale", "scales", rows(int4_channel_scale))  # fp32, stage scales merged
        elif isinstance(first, MXFP4Weight):
            put("packed", "packed", rows(lambda w: w.packed))
            put("scale", "scales", rows(lambda w: w.scale))
        elif isinstance(first, FP8Weight):
            fs: list[FP8Weight] = [w for parts in experts for w in parts]  # type: ignore[misc]
            self.block = first.block
            if any(w.block != self.block for w in fs):
                raise UsageError("cannot stack FP8 weights with different blocks")
            put("weight", "packed", rows(lambda w: w.weight))
            if self.block is not None:
                bn = self.block[0]
                if len(experts[0]) > 1 and any(w.shape[0] % bn for w in fs):
                    # parts whose rows do not align to the block (gate + up of a small expert): one
                    # scale row per weight row; W = fp8 * scale is the same fp32 product either way
                    self.block = (1, self.block[1])
                    put("scale", "scales", rows(lambda w: w.scale.float().repeat_interleave(bn, 0)[: w.shape[0]]))
                else:
                    put("scale", "scales", rows(lambda w: w.scale.float()))
            else:
                put("scale", "scales", rows(_fp8_channel_scale))
        else:
            raise TypeError(f"not a canonical weight: {type(first).__name__}")
        self.fast = self._fast_kind()

    @property
    def dense_bytes(self) -> int:
        """Bytes of one entry decoded to the compute dtype."""
        return self.n * self.k * torch.empty(0, dtype=compute_dtype(self.dtype, self.device)).element_size()

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return [(self.roles[k], t) for k, t in self.tensors.items()]

    def decode(self, sel: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``[e, r, K]`` in ``dtype`` (default: the model dtype) of entries ``sel`` (all by
        default) and rows ``rows``: the values (and bits) of ``dequantize`` element by element."""
        r0, r1 = rows if rows is not None else (0, self.n)
        dtype = dtype or self.dtype

        def get(name: str, lo: int = r0, hi: int = r1) -> torch.Tensor:
            t = self.tensors[name][:, lo:hi]
            return t if sel is None else t.index_select(0, sel)

        if self.kind is DenseWeight:
            return get("weight").to(dtype)
        if self.kind is Int4Weight:
            words, g = get("codes"), self.group
            if g is not None and self.packing == "ct" and not self.row_ts and words.dim() == 3:
                # compressed-tensors' own decode (bf16(q * s) through fp32, a per-byte table): the
                # same bits as the product in the scale dtype below, ~2x faster
                e, r = words.shape[:2]
                sc = get("scale")
                out = codecs.ct_int4_dequantize(words.reshape(e * r, -1), sc.reshape(e * r, -1), (e * r, self.k))
                return out.view(e, r, self.k).to(dtype)
            codes = unpack_int4(words, self.packing, self.k)
            if g is not None:
                sc = get("scale")
                # q * s in the scale's dtype (compressed-tensors' rule), the scale broadcast per group
                out = (codes.to(sc.dtype).view(*codes.shape[:-1], -1, g) * sc[..., None]).view(codes.shape)
                if self.row_ts:
                    out = out.float() * get("row_ts")[..., None]
                return out.to(dtype)
            return (codes.float() * get("scale")[..., None]).to(dtype)
        if self.kind is MXFP4Weight:
            return codecs.mxfp4_dequantize(get("packed"), get("scale"), dtype=dtype)
        if self.block is not None:  # FP8 blocks: the codec is 2-D, one entry at a time
            bn = self.block[0]
            if r0 % bn or (r1 % bn and r1 != self.n):
                raise UsageError(f"FP8 block rows {r0}..{r1} do not align to the {bn}-row block")
            w, sc = get("weight"), get("scale", r0 // bn, -(-r1 // bn))
            return torch.stack([codecs.fp8_block_dequantize(w[e], sc[e], block=self.block, dtype=dtype)
                                for e in range(w.shape[0])])
        return (get("weight").float() * get("scale")[..., None]).to(dtype)

    def _fast_kind(self) -> str | None:
        """The decode :meth:`operand` runs into the scratch (``None``: the generic :meth:`decode`)."""
        if self.device.type != "cpu":
            return None
        if self.kind is DenseWeight:
            return "dense"
        if self.kind is MXFP4Weight:
            return "mxfp4" if self.k % 32 == 0 and self.tensors["packed"].shape[-1] * 2 == self.k else None
        if (self.kind is Int4Weight and self.packing == "ct" and self.group is not None and not self.row_ts
                and self.k % 8 == 0 and self.k % self.group == 0 and sys.byteorder == "little"
                and self.tensors["codes"].dtype == torch.int32
                and self.tensors["scale"].dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return "ct"
        return None

    def operand(self, e: int, rows: tuple[int, int], cd: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` of entry ``e`` as a float GEMM operand ``[r, K]`` in ``cd``: the bits of
        ``decode(e, rows).to(cd)``. On CPU in fp32 they are decoded into the reused scratch (valid
        until the next call) with the same ops and dtypes as :meth:`decode`, one pass per op."""
        r0, r1 = rows
        fast = self.fast if cd == torch.float32 else None
        if fast is None:
            sel = None if self.num == 1 else torch.tensor([e], device=self.device)
            return self.decode(sel, rows)[0].to(cd)
        if fast == "dense":
            w = self.tensors["weight"][e, r0:r1]
            if w.dtype == torch.float32:
                return w
            out = scratch("operand", w.numel(), torch.float32, self.device).view(w.shape)
            out.copy_(w)  # the per-call widening, into the reused tile
            return out
        k = self.k
        out = scratch("operand", (r1 - r0) * k, torch.float32, self.device).view(r1 - r0, k)
        step = max(1, DECODE_PASS_ELEMS // k)
        if fast == "ct":  # codecs.ct_int4_dequantize: (q - 8) per byte pair from the table, * s in fp32
            words, sc, lut, g = self.tensors["codes"][e], self.tensors["scale"][e], codecs._CT_PAIR_LUT_I64, self.group
            casts: tuple[torch.dtype, ...] = (sc.dtype, self.dtype)  # bf16(q * s) as the scale's dtype
        else:  # codecs.mxfp4_dequantize: E2M1 pairs from the table, * 2^e in fp32
            words, sc, lut, g = self.tensors["packed"][e], self.tensors["scale"][e], codecs._FP4_PAIR_LUT_I64, 32
            casts = (self.dtype,)
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            o = out[a - r0: b - r0]
            byts = words[a:b].reshape(-1).view(torch.uint8)
            idx = scratch("operand.idx", byts.numel(), torch.int32, self.device)
            idx.copy_(byts)
            torch.index_select(lut, 0, idx, out=o.view(-1).view(torch.int64))
            s = sc[a:b] if fast == "ct" else codecs.e8m0_to_float(sc[a:b])  # (ct: fp32 * bf16 in fp32)
            o.view(b - a, -1, g).mul_(s.unsqueeze(-1))
            _round_through(o, casts, "operand.round")
        return out

    def codes(self, sel: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Integer / FP8 codes ``[e, r, K]`` of entries ``sel`` (int8 for INT4, FP8 as stored)."""
        r0, r1 = rows if rows is not None else (0, self.n)
        t = self.tensors["codes" if self.kind is Int4Weight else "weight"][:, r0:r1]
        t = t if sel is None else t.index_select(0, sel)
        return unpack_int4(t, self.packing, self.k).to(torch.int8) if self.kind is Int4Weight else t

    def int_codes(self, e: int, rows: tuple[int, int], name: str) -> torch.Tensor:
        """int8 codes ``[r, K]`` of INT4 entry ``e``, rows ``rows``: ``codes([e], rows)[0]``, on CPU
        unpacked into the reused scratch ``name`` (valid until its next use) with a 16-bit table:
        each packed word's two halves give its 8 codes as two gathers and an OR, where the
        shift-and-mask unpack takes a dozen passes over int64."""
        r0, r1 = rows
        words = self.tensors["codes"][e, r0:r1]
        if (self.device.type != "cpu" or self.packing is None or self.k % 8 or sys.byteorder != "little"
                or words.dtype != torch.int32):
            return self.codes(torch.tensor([e], device=self.device), rows)[0]
        halves = words.reshape(-1).view(torch.uint16)  # low half of each word first (little-endian)
        idx = scratch(name + ".idx", halves.numel(), torch.int32, self.device)
        idx.copy_(halves)
        out = scratch(name, words.numel() * 8, torch.int8, self.device)
        lo, hi = out.view(torch.int64), scratch(name + ".hi", words.numel(), torch.int64, self.device)
        lut = _int4_half_lut(self.packing)
        torch.index_select(lut[0], 0, idx[0::2], out=lo)
        torch.index_select(lut[1], 0, idx[1::2], out=hi)
        return lo.bitwise_or_(hi).view(torch.int8).view(r1 - r0, self.k)


@functools.cache
def _int4_half_lut(packing: str) -> torch.Tensor:
    """``[2, 65536]`` int64 for an INT4 ``packing``: entry ``[h, v]`` holds, as 8 bytes, the int8
    codes that the low (h=0) / high (h=1) 16 bits ``v`` of a packed word decode to, each at its
    element's byte and 0 in the bytes of the other half's elements; built from the codec itself."""
    def word(v: int) -> torch.Tensor:
        return torch.tensor([[v - (1 << 32) if v >= 1 << 31 else v]], dtype=torch.int32)

    base = unpack_int4(word(0), packing, 8)[0]
    elem = [int(torch.nonzero(unpack_int4(word(1 << 4 * j), packing, 8)[0] != base)) for j in range(8)]
    code = torch.tensor([int(unpack_int4(word(n), packing, 8)[0, elem[0]]) for n in range(16)], dtype=torch.int8)
    v = torch.arange(1 << 16)
    out = torch.zeros(2, 1 << 16, 8, dtype=torch.int8)
    for h in range(2):
        for i in range(4):
            out[h, :, elem[4 * h + i]] = code[(v >> 4 * i) & 15]
    return out.view(torch.int64).reshape(2, 1 << 16)


def _fp8_channel_scale(w: FP8Weight) -> torch.Tensor:
    s = w.scale.float().reshape(-1)
    return s.expand(w.shape[0]) if s.numel() == 1 else s


def _row_tiles(n: int, row_bytes: int, budget: int, align: int = _TILE_ALIGN) -> list[tuple[int, int]]:
    """Row ranges covering ``0..n-1``: the whole when it fits ``budget``, else equal tiles of a
    multiple of ``align`` rows (a function of the weight's shape only)."""
    if n * row_bytes <= budget:
        return [(0, n)]
    step = max(align, budget // row_bytes // align * align)
    return [(r, min(n, r + step)) for r in range(0, n, step)]


def _bank_gemm(x: torch.Tensor, bank: _Bank, e: int, tiles: list[tuple[int, int]], cd: torch.dtype) -> torch.Tensor:
    """``x [M, K] @ W_e.T`` of bank entry ``e`` -> ``[M, N]`` in ``x.dtype``: per row tile of the
    weight, its operand decoded into the scratch and one :func:`mm_rows` GEMM of the same shape,
    written into its columns of the output (the bits of ``cat([mm_rows(x, W[tile].T) ...])``; the
    activations are widened and padded once, not per tile)."""
    m, k = x.shape
    if m == 0:
        return x.new_empty(0, bank.n)
    xp = _pad_rows(x, ROW_TILE, cd)
    nb = xp.shape[0] // ROW_TILE
    xt = xp.view(nb, ROW_TILE, k)
    out = xp.new_empty(nb, ROW_TILE, bank.n)
    for r0, r1 in tiles:
        w = bank.operand(e, (r0, r1), cd)
        torch.bmm(xt, w.t().expand(nb, k, r1 - r0), out=out[:, :, r0:r1])
    y = out.view(nb * ROW_TILE, bank.n)[:m]
    return y if y.dtype == x.dtype else y.to(x.dtype)
