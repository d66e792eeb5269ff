"""The exact, batch-invariant torch reference backend (CPU, CUDA, ROCm).

Batch invariance by construction. A token's result must be bit-identical whether it is decoded
alone, verified with k drafts, or prefilled with 500 others. BLAS kernels pick different code
paths (and K-reduction orders) for different matrix shapes: measured on the CPU here, fp32
``x[:M] @ W.T`` differs from ``(x @ W.T)[:M]`` for M < 12 except 4 and 8 (two threads; M < 4
with one). So every floating-point reduction below runs with a shape that depends only on the
model, never on the batch:

* GEMMs (:func:`mm_rows`, :func:`bmm_rows`) run on tiles of exactly ``ROW_TILE`` rows (zero
  padded) as one ``bmm`` over the tiles; every tile is the same-shaped GEMM, whose row results
  depend only on that row (checked by ``tests/runtime/test_kernels_torch_ref.py`` on each run).
* Integer GEMMs (W4A8 with int8 activations) accumulate exactly in int32 (``torch._int_mm``); the
  FP8-activation variant accumulates FP8 x INT4/FP8 products in float64, which is exact too
  (every product is a multiple of 2^-18 of magnitude below 2^18, so any K < 2^17 sums exactly).
  Exact sums need no tiling at all.
* Attention computes every score as a row of a fixed-shape ``[R, D] x [D, KEY_TILE]`` tile GEMM
  (R query rows of one sequence, fixed per model) and every softmax partial sum per key tile as
  a fixed-shape GEMM / fixed-length row sum; the partial sums over key tiles are added in tile
  order (an outer, sequential reduction). Keys past a token's position get probability exactly
  0, so tiles past its own context add exact zeros: decode (a token alone, keys gathered per
  token) and long prefill chunks (keys gathered once per sequence, each key tile broadcast over
  the query tiles that see it, causally skipped tiles never computed) give the same bits. See
  the Attention section.
* Norms, RoPE, routing and the top-k combine are row-wise elementwise ops or inner reductions of
  model-fixed length.
* Transcendental pointwise ops (sigmoid, SiLU, exp, cos, sin) are NOT shape-invariant on CPU as
  such: TensorIterator runs the SIMD kernel on whole vectors and a scalar libm path on the tail,
  and the two differ by an ulp (measured: fp32 sigmoid/silu of row ``t`` change with the number
  of rows). :func:`pointwise` feeds them a strided view, which sends every element down the
  scalar path, so an element's result depends on its value only.

On CPU, bf16/fp16 models keep their GEMM operands in fp32 (:func:`compute_dtype`): the products
of bf16 values are exact in fp32, so this is a bf16 GEMM with fp32 accumulation, ~10x faster on
CPUs without AVX512-BF16; outputs are rounded back to the model dtype.

Numerics follow transformers' DeepseekV3 implementation where it defines them (RMSNorm weight
multiply in the activation dtype, cos/sin cast to the activation dtype, router in fp32, top-k
combine in fp32); attention runs in fp32 with one softmax over the whole context.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from eagle3.errors import ShapeError, UsageError
from eagle3.formats import codecs
from eagle3.runtime.kernels.base import (
    ActQuant,
    DenseWeight,
    FP8Weight,
    Int4Weight,
    KernelBackend,
    LinearOp,
    LinearWeight,
    MoEOp,
    MXFP4Weight,
    int4_channel_scale,
    register_backend,
    unpack_int4,
)

if TYPE_CHECKING:  # pragma: no cover
    from eagle3.runtime.context import AttnMetadata

ROW_TILE = 16  # GEMM rows per tile: every float GEMM is a [ROW_TILE, K] x [K, N] product
KEY_TILE = 64  # keys per attention tile
INT8_MAX = 127.0
# MoE execution plan, fixed per model (never per batch, so a token's bits do not depend on it):
# all experts for every token as two GEMMs when all expert weights together are this small
# (tiny and test models: fewest ops), else gather expert weights per row tile when one expert is
# small, else loop over the active experts.
_MOE_ALL_BYTES = 16 * 1024 * 1024
_MOE_GATHER_BYTES = 2 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Batch-invariant pointwise transcendental ops
# ---------------------------------------------------------------------------------------------


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with every element on the same (scalar) code path on CPU; see the module doc.
    GPU pointwise kernels apply one per-element function already."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    buf = x.new_empty(*x.shape, 2)
    buf[..., 0] = x
    return fn(buf[..., 0])


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


# ---------------------------------------------------------------------------------------------
# Batch-invariant GEMMs
# ---------------------------------------------------------------------------------------------


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim -2 of ``x`` up to a multiple of ``multiple`` (at least one tile)."""
    m = x.shape[-2]
    target = max(multiple, -(-m // multiple) * multiple)
    if target == m:
        return x
    return F.pad(x, (0, 0, 0, target - m))


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """GEMM operand dtype. CPUs without AVX512-BF16 run bf16 GEMMs ~10x slower than fp32 (measured
    here), so on CPU bf16/fp16 weights are widened to fp32 once at load and each GEMM output is
    rounded back to the model dtype: the same math as a bf16 GEMM with fp32 accumulation."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def mm_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w_t [K, N]`` computed as ``ceil(M / ROW_TILE)`` identical tile GEMMs, in
    ``w_t.dtype``; returns ``x.dtype``."""
    m, k = x.shape
    if m == 0:
        return x.new_empty(0, w_t.shape[1])
    xp = _pad_rows(x if x.dtype == w_t.dtype else x.to(w_t.dtype), ROW_TILE)
    nb = xp.shape[0] // ROW_TILE
    out = torch.bmm(xp.view(nb, ROW_TILE, k), w_t.expand(nb, k, w_t.shape[1])).view(nb * ROW_TILE, -1)[:m]
    return out if out.dtype == x.dtype else out.to(x.dtype)


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [B, M, K] @ w [B, K, N]`` with the M rows tiled as in :func:`mm_rows` (in ``w.dtype``,
    returns ``x.dtype``)."""
    b, m, k = x.shape
    n = w.shape[-1]
    if m == 0:
        return x.new_empty(b, 0, n)
    xp = _pad_rows(x if x.dtype == w.dtype else x.to(w.dtype), ROW_TILE)
    nb = xp.shape[1] // ROW_TILE
    if nb == 1:
        out = torch.bmm(xp, w)[:, :m]
        return out if out.dtype == x.dtype else out.to(x.dtype)
    # Per batch entry, its weight broadcast over the row tiles (stride 0): repeating the weight
    # per tile for one big bmm copied E experts x T/16 tiles of weights in a prefill step.
    out = xp.new_empty(b, nb * ROW_TILE, n)
    for i in range(b):
        torch.bmm(xp[i].reshape(nb, ROW_TILE, k), w[i].expand(nb, k, n), out=out[i].view(nb, ROW_TILE, n))
    return out[:, :m].to(x.dtype)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain ``bmm`` in ``b.dtype`` returning ``a.dtype`` (fixed-shape tiles only)."""
    return torch.bmm(a.to(b.dtype), b).to(a.dtype)


# ---------------------------------------------------------------------------------------------
# Dynamic activation quantization (per token row; per 32-block for MXFP4)
# ---------------------------------------------------------------------------------------------


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``scale = amax / 127``, ``q = round_half_even(x / scale)``."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3: ``scale = amax / 448`` (codecs.fp8_quantize saturates and rounds)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / codecs.FP8_E4M3_MAX, torch.ones_like(amax))
    return codecs.fp8_quantize(xf, scale[:, None]), scale


def mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP4 fake-quantization of activations (Quark "even" scales per 32-block of a row),
    returned in ``x.dtype``. An E2M1 value times a power of two is exact in bf16."""
    packed, scale = codecs.mxfp4_quantize(x.float())
    return codecs.mxfp4_dequantize(packed, scale, dtype=x.dtype)


def _bias(w: LinearWeight, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return None if w.bias is None else w.bias.to(device=device, dtype=dtype)


def _check_act(w: LinearWeight, act: ActQuant) -> str:
    """The execution mode for (weight kind, activation quant): dense | int8 | fp8 | mxfp4."""
    if act is None:
        return "dense"
    if act == "mxfp4":
        return "mxfp4"  # any weight: activations are fake-quantized, the GEMM is a float GEMM
    if act in ("int8", "fp8"):
        if isinstance(w, Int4Weight):
            return act
        if isinstance(w, FP8Weight) and act == "fp8" and w.block is None:
            return "fp8"
        raise UsageError(f"{act} activations with a {type(w).__name__} weight are not supported")
    raise UsageError(f"unknown activation quantization {act!r}")


# ---------------------------------------------------------------------------------------------
# Packed weights, decoded per call
# ---------------------------------------------------------------------------------------------
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
    xp = _pad_rows(x if x.dtype == cd else x.to(cd), ROW_TILE)
    nb = xp.shape[0] // ROW_TILE
    xt = xp.view(nb, ROW_TILE, k)
    out = xp.new_empty(nb, ROW_TILE, bank.n)
    for r0, r1 in tiles:
        w = bank.operand(e, (r0, r1), cd)
        torch.bmm(xt, w.t().expand(nb, k, r1 - r0), out=out[:, :, r0:r1])
    y = out.view(nb * ROW_TILE, bank.n)[:m]
    return y if y.dtype == x.dtype else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------


class TorchLinear(LinearOp):
    """Float GEMM on row tiles, or an exact integer / float64 GEMM for quantized activations; the
    weight stays packed and is decoded per call (see "Packed weights, decoded per call")."""

    def prepare(self, weight: LinearWeight, act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.mode = _check_act(weight, act)
        self.dtype = dtype
        self.cd = compute_dtype(dtype, device)
        self.bias = _bias(weight, dtype, device)
        self.bank = _Bank([[weight]], dtype, device)
        self.w_scale: torch.Tensor | None = None
        if self.mode in ("dense", "mxfp4"):
            row_bytes = self.bank.dense_bytes // self.out_features
        elif self.mode == "int8":
            assert isinstance(weight, Int4Weight)
            int4_channel_scale(weight)  # refuses group scales
            self.w_scale = self.bank.tensors["scale"][0]  # fp32 [N], stage scales merged
            # torch._int_mm on CUDA needs M > 16 (kernel_backends.md 2.3): pad rows there.
            self.min_rows = 17 if device.type == "cuda" else 1
            row_bytes = self.in_features
        else:  # fp8 activations, INT4 or per-channel FP8 weight: exact accumulation
            if isinstance(weight, Int4Weight):
                int4_channel_scale(weight)  # refuses group scales
            self.w_scale = self.bank.tensors["scale"][0]
            self.min_rows = 17 if device.type == "cuda" else 1
            # INT4: int8 codes and exact int32 digit GEMMs; FP8: the codes in float64
            row_bytes = self.in_features if isinstance(weight, Int4Weight) else 8 * self.in_features
        block = getattr(self.bank, "block", None)
        align = math.lcm(_TILE_ALIGN, block[0]) if block is not None else _TILE_ALIGN
        self.tiles = _row_tiles(self.out_features, row_bytes, LINEAR_SCRATCH_BYTES, align)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.bank.resident() + ([] if self.bias is None else [("dense", self.bias)])

    def dense(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight rows as the float GEMM's operand: model dtype first (bf16(q*s) for INT4),
        then widened to the compute dtype. Per call, never kept."""
        return self.bank.decode(None, rows)[0].to(self.cd)

    def _rows(self, x: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
        if self.mode in ("dense", "mxfp4"):
            return mm_rows(x, self.dense(r).t())  # (the per-call tensors: off CPU, or with autograd)
        assert self.w_scale is not None
        int4 = self.bank.kind is Int4Weight
        codes = self.bank.int_codes(0, r, "codes") if int4 and _scratch_ok(x) else self.bank.codes(None, r)[0]
        if self.mode == "int8":
            return int8_linear(x, codes, self.w_scale[r[0]: r[1]], self.min_rows).to(self.dtype)
        if int4 and x.device.type == "cpu":
            return fp8_int4_linear(x, codes, self.w_scale[r[0]: r[1]], self.min_rows).to(self.dtype)
        return fp8_linear(x, codes.to(torch.float64), self.w_scale[r[0]: r[1]]).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "mxfp4":
            x = mxfp4_qdq(x)
        if self.mode in ("dense", "mxfp4") and _scratch_ok(x):
            y = _bank_gemm(x, self.bank, 0, self.tiles, self.cd)
        elif len(self.tiles) == 1:
            y = self._rows(x, self.tiles[0])
        else:
            y = torch.cat([self._rows(x, r) for r in self.tiles], dim=-1)
        return y if self.bias is None else y + self.bias


def int8_linear(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """W4A8 (int8 activations): per-token int8 ``x``, ``int32 acc = x_q @ codes.T`` (exact),
    ``y = acc * s_x[m] * s_w[n]`` in fp32."""
    q, sx = quantize_int8_per_token(x)
    return int8_gemm(q, sx, codes, w_scale, min_rows)


def int8_gemm(q: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
              min_rows: int = 1) -> torch.Tensor:
    """:func:`int8_linear` of activations already quantized (``quantize_int8_per_token``)."""
    m = q.shape[0]
    if m < min_rows:
        q = F.pad(q, (0, 0, 0, min_rows - m))
    acc = torch._int_mm(q, codes.t())[:m]
    return acc.float() * sx[:, None] * w_scale[None, :]


def fp8_int4_linear(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """:func:`fp8_linear` for int8 INT4 ``codes [N, K]``, without widening them to float64: an E4M3
    value times 2^9 is an integer below 2^18 (3 mantissa bits, exponents -9..8), split here into
    three int8 digits (base 2^7); each digit's int32 GEMM with the codes is exact (|sum| < 127 * 8 *
    K), and so is their sum in int64. That is the exact sum fp8_linear forms in float64 (x 2^9, also
    exact), so the result has its bits."""
    if x.shape[1] >= FP8_DIGITS_MAX_K:  # (the int32 digit sums could overflow)
        return fp8_linear(x, codes.to(torch.float64), w_scale)
    digits, sx = fp8_digits(x)
    return fp8_digits_gemm(digits, sx, codes, w_scale, min_rows)


FP8_DIGITS_MAX_K = 1 << 20  # fan-in below which the int8 digit GEMMs of fp8_int4_linear are exact


def fp8_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token E4M3 ``x [M, K]`` as int8 base-2^7 digits ``[M, 3, K]`` of ``q * 2^9`` (high
    digit first), and the per-token scales ``[M]`` (see :func:`fp8_int4_linear`)."""
    q, sx = quantize_fp8_per_token(x)
    xi = (q.float() * 512).to(torch.int32)  # exact integers
    d2 = xi >> 14  # [-14, 14]
    r = xi - (d2 << 14)  # [0, 2^14)
    return torch.stack([d2, r >> 7, r & 127], dim=1).to(torch.int8), sx


def fp8_digits_gemm(digits: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
                    min_rows: int = 1) -> torch.Tensor:
    """:func:`fp8_int4_linear` of activations already split by :func:`fp8_digits`: the three
    digits of every row in one int32 GEMM (each row of it exact), recombined in int64."""
    m, _, k = digits.shape
    a = digits.reshape(3 * m, k)
    if 3 * m < min_rows:
        a = F.pad(a, (0, 0, 0, min_rows - 3 * m))
    parts = torch._int_mm(a, codes.t())[: 3 * m].view(m, 3, -1).to(torch.int64)
    acc = (parts[:, 0] << 14).add_(parts[:, 1] << 7).add_(parts[:, 2])
    return (acc.to(torch.float64) / 512).float() * sx[:, None] * w_scale[None, :]


def fp8_linear(x: torch.Tensor, w64: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8-activation variant: per-token E4M3 ``x`` times the weight codes, summed exactly in
    float64, then ``* s_x[m] * s_w[n]`` in fp32."""
    q, sx = quantize_fp8_per_token(x)
    acc = q.to(torch.float64) @ w64.t()
    return acc.float() * sx[:, None] * w_scale[None, :]


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


class TorchMoE(MoEOp):
    """Routed experts. Token-expert pairs are grouped by expert; float experts run as row-tiled
    GEMMs (all experts in one ``bmm`` when small, else the active experts gathered per row tile or
    one at a time), decoded per call from the packed weights; int8 / fp8-activation experts run the
    exact linear per active expert."""

    def prepare(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.num_experts = self.check_experts(gate, up, down)
        self.dtype = dtype
        self.cd = compute_dtype(dtype, device)
        self.mode = _check_act(gate[0], act)
        self.path = "loop"
        self.inter = gate[0].shape[0]
        self.hidden = gate[0].shape[1]
        if self.mode in ("dense", "mxfp4"):
            # gate rows then up rows, as transformers' fused gate_up_proj.
            self.w13 = _Bank([[g, u] for g, u in zip(gate, up, strict=True)], dtype, device)
            self.w2 = _Bank([[d] for d in down], dtype, device)
            per_expert = self.w13.dense_bytes + self.w2.dense_bytes
            self.path = ("all" if per_expert * self.num_experts <= _MOE_ALL_BYTES
                         else "gather" if per_expert <= _MOE_GATHER_BYTES else "loop")
            self.chunk = max(1, MOE_SCRATCH_BYTES // per_expert)  # experts decoded at once (gather)
            # loop path: one expert's rows a tile at a time, as a Linear's (LINEAR_SCRATCH_BYTES)
            self.tiles13 = _row_tiles(self.w13.n, self.w13.dense_bytes // self.w13.n, LINEAR_SCRATCH_BYTES)
            self.tiles2 = _row_tiles(self.w2.n, self.w2.dense_bytes // self.w2.n, LINEAR_SCRATCH_BYTES)
        else:  # int8 / fp8 activations: the exact linears, per-channel weights only
            if isinstance(gate[0], Int4Weight):
                int4_channel_scale(gate[0])  # refuses group scales
            self.w13 = _Bank([[g, u] for g, u in zip(gate, up, strict=True)], dtype, device)
            self.w2 = _Bank([[d] for d in down], dtype, device)
            code_bytes = 1 if self.mode == "int8" else 8  # int8 codes, or float64 for the exact GEMM
            self.chunk = max(1, MOE_SCRATCH_BYTES // ((self.w13.n + self.w2.n) * self.hidden * code_bytes))
            self.min_rows = 17 if device.type == "cuda" else 1

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.w13.resident() + self.w2.resident()

    def _dense(self, sel: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 ``[e, 2I, H]``, w2 ``[e, H, I]``) of experts ``sel`` in the compute dtype, per call."""
        return self.w13.decode(sel).to(self.cd), self.w2.decode(sel).to(self.cd)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        if self.path == "all":
            return self._all_experts(x, topk_ids, topk_weights)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.path == "gather":
            out_sorted = self._gathered(x, flat, order, counts, k)
        else:
            out_sorted = self._looped(x, order, counts, k)
        pair_out = torch.empty_like(out_sorted)
        pair_out[order] = out_sorted
        y = (pair_out.view(t, k, -1).float() * topk_weights.float()[..., None]).sum(1)
        return y.to(self.dtype)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        g, u = h.split(self.inter, dim=-1)
        a = silu(g) * u
        return mxfp4_qdq(a) if self.mode == "mxfp4" else a

    def _all_experts(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (row-tiled GEMMs), then pick the top-k rows: 3-4x the
        FLOPs of routing, but a handful of ops, which is what a small model's step costs."""
        t = x.shape[0]
        active = torch.nonzero(torch.bincount(ids.reshape(-1), minlength=self.num_experts)).reshape(-1)
        if 2 * active.numel() >= self.num_experts:  # most are used: one decode of all, no scatter
            w13, w2 = self._dense(None)
        else:
            # Only the experts this call uses are decoded; the others' weights are zero, and their
            # outputs, never picked, do not touch the used columns of the GEMMs (same bits).
            d13, d2 = self._dense(active)
            w13 = d13.new_zeros(self.num_experts, *d13.shape[1:]).index_copy_(0, active, d13)
            w2 = d2.new_zeros(self.num_experts, *d2.shape[1:]).index_copy_(0, active, d2)
        xin = mxfp4_qdq(x) if self.mode == "mxfp4" else x
        h = mm_rows(xin, w13.view(-1, self.hidden).t()).view(t, self.num_experts, 2 * self.inter)
        o = bmm_rows(self._act(h).transpose(0, 1), w2.transpose(1, 2))  # [E, T, H]
        picked = o.transpose(0, 1)[torch.arange(t, device=x.device)[:, None], ids]  # [T, k, H]
        return (picked.float() * w.float()[..., None]).sum(1).to(self.dtype)

    def _gathered(self, x: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                  k: int) -> torch.Tensor:
        r = ROW_TILE
        padded = (counts + r - 1) // r * r
        pad_start = torch.cumsum(padded, 0) - padded
        cnt_start = torch.cumsum(counts, 0) - counts
        e_sorted = flat[order]
        dest = pad_start[e_sorted] + torch.arange(order.numel(), device=x.device) - cnt_start[e_sorted]
        total = int(padded.sum())
        xin = x[order // k]
        if self.mode == "mxfp4":
            xin = mxfp4_qdq(xin)
        xbuf = x.new_zeros(total, self.hidden)
        xbuf[dest] = xin
        nt = total // r
        xt = xbuf.view(nt, r, self.hidden)
        o = x.new_empty(nt, r, self.hidden)
        # The active experts in chunks (tiles are ordered by expert): decoded per chunk, then every
        # tile of the chunk as one batched GEMM with its expert's weights, as one bmm over all tiles.
        active = torch.nonzero(counts).reshape(-1)
        tiles = (padded // r)[active].tolist()
        t0 = 0
        for c in range(0, active.numel(), self.chunk):
            sel = active[c: c + self.chunk]
            n_t = tiles[c: c + self.chunk]
            t1 = t0 + sum(n_t)
            local = torch.repeat_interleave(torch.arange(sel.numel(), device=x.device),
                                            torch.tensor(n_t, device=x.device), output_size=t1 - t0)
            w13, w2 = self._dense(sel)
            h = _bmm(xt[t0:t1], w13[local].transpose(1, 2))
            o[t0:t1] = _bmm(self._act(h), w2[local].transpose(1, 2))
            t0 = t1
        return o.reshape(total, self.hidden)[dest]

    def _looped(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        out = x.new_empty(order.numel(), self.hidden)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        n_of = counts.tolist()
        active = torch.nonzero(counts).reshape(-1)
        exact = self.mode in ("int8", "fp8")
        if not exact and _scratch_ok(x):
            # one expert at a time, its weights decoded a row tile at a time into the scratch
            for e in active.tolist():
                idx = slice(starts[e], starts[e] + n_of[e])
                rows = x[order[idx] // k]
                if self.mode == "mxfp4":
                    rows = mxfp4_qdq(rows)
                h = _bank_gemm(rows, self.w13, e, self.tiles13, self.cd)
                out[idx] = _bank_gemm(self._act(h), self.w2, e, self.tiles2, self.cd)
            return out
        if exact and self.w13.kind is Int4Weight and _scratch_ok(x):
            # one expert at a time, its int8 codes unpacked into the scratch (no float64 widening)
            segs = [(e, slice(starts[e], starts[e] + n_of[e])) for e in active.tolist()]
            h = self._int4_experts(x[order // k], segs, self.w13, "codes13")
            g, u = h.split(self.inter, dim=-1)
            return self._int4_experts(silu(g) * u, segs, self.w2, "codes2")
        for c in range(0, active.numel(), self.chunk if exact else 1):
            sel = active[c: c + (self.chunk if exact else 1)]
            if exact:  # the active experts' codes of a chunk in one decode
                c13, c2 = self.w13.codes(sel), self.w2.codes(sel)
                if self.mode == "fp8":
                    c13, c2 = c13.to(torch.float64), c2.to(torch.float64)
                s13 = self.w13.tensors["scale"].index_select(0, sel)
                s2 = self.w2.tensors["scale"].index_select(0, sel)
            else:
                w13, w2 = self._dense(sel)
            for i, e in enumerate(sel.tolist()):
                idx = slice(starts[e], starts[e] + n_of[e])
                rows = x[order[idx] // k]
                if not exact:
                    if self.mode == "mxfp4":
                        rows = mxfp4_qdq(rows)
                    h = mm_rows(rows, w13[i].t())
                    out[idx] = mm_rows(self._act(h), w2[i].t())
                else:
                    h = self._exact(rows, c13[i], s13[i])
                    g, u = h.split(self.inter, dim=-1)
                    out[idx] = self._exact(silu(g) * u, c2[i], s2[i])
        return out

    def _int4_experts(self, x: torch.Tensor, segs: list[tuple[int, slice]], bank: _Bank, name: str) -> torch.Tensor:
        """Rows ``x`` grouped by expert (``segs``: expert, its rows) through ``bank``'s INT4 experts:
        the bits of :func:`int8_linear` / :func:`fp8_int4_linear` per expert, with the activations
        quantized once for all rows (per-token quantization: a row's codes and scale do not depend
        on the other rows) and one integer GEMM per expert. A verification step routes each of its
        tokens to other experts, so per-expert work is what it adds over a decode step."""
        scale = bank.tensors["scale"]
        out = x.new_empty(x.shape[0], bank.n, dtype=self.dtype)
        if self.mode == "int8":
            q, sx = quantize_int8_per_token(x)
            for e, idx in segs:
                out[idx] = int8_gemm(q[idx], sx[idx], bank.int_codes(e, (0, bank.n), name), scale[e], self.min_rows)
            return out
        if x.shape[1] >= FP8_DIGITS_MAX_K:
            for e, idx in segs:
                out[idx] = fp8_int4_linear(x[idx], bank.int_codes(e, (0, bank.n), name), scale[e], self.min_rows)
            return out
        digits, sx = fp8_digits(x)
        for e, idx in segs:
            out[idx] = fp8_digits_gemm(digits[idx], sx[idx], bank.int_codes(e, (0, bank.n), name), scale[e],
                                       self.min_rows)
        return out

    def _exact(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8":
            return int8_linear(x, codes, scale, self.min_rows).to(self.dtype)
        return fp8_linear(x, codes, scale).to(self.dtype)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
#
# The numbers. Query rows are tiled per sequence: ``query_tile_tokens(G)`` consecutive tokens x G
# heads = R rows (a model constant), zero padded. Every score is a row of a fixed-shape
# ``[R, D] x [D, KEY_TILE]`` GEMM; every per-tile softmax numerator a row of a fixed-shape
# ``[R, KEY_TILE] x [KEY_TILE, Dv]`` GEMM and every denominator a row sum of fixed length
# KEY_TILE. A token's softmax is two-pass: the max over all its keys (exact in any order),
# ``exp(s - max)`` element by element on the scalar path, then the per-tile partials added in
# key-tile order starting from zero, in fp32. Tiles past a token's own position hold probability
# exactly 0 and add exact zeros, so computing them or skipping them changes nothing.
#
# Two schedules compute exactly these numbers:
#
# * gathered units (decode, verify, short chunks): every (row tile, key tile) pair of a group as
#   one batched GEMM, the keys gathered per pair (``index_select``: one copy per pair);
# * per sequence (prefill chunks of >= SEQ_PATH_MIN_TOKENS tokens): the sequence's keys gathered
#   once, then per key tile one batched GEMM over the row tiles that see it with the key tile
#   broadcast (stride 0, no copy); the row tiles that cannot see a key tile are skipped (causal
#   skipping halves a prefill's work). The 1,600-token prefill of the tiny target went from
#   ~11 s (every token gathering its own padded context) to ~1 s.
#
# Memory is bounded by ATTN_CHUNK_FLOATS per group of row tiles, never ``T x J``.
#
# Both schedules rely on the property the row-tiled linears rely on: a row of a fixed-shape
# batched GEMM does not depend on its position in the tile, on the other rows or on the batch
# size (measured here for MKL with R = 4..128, D = 16..576, N = 17..65, contiguous, transposed
# and stride-0 operands, 1 and 2 threads; below 4 rows MKL takes other kernels, hence
# ATTN_MIN_ROWS), and that a fixed-length row sum does not depend on the number of rows. Both
# are re-checked by tests/runtime/test_kernels_torch_ref.py on every run.

ATTN_MIN_ROWS = 4  # rows of a query tile at least (MKL's bmm rows differ below 4 rows, measured)
SEQ_PATH_MIN_TOKENS = 32  # query tokens of one sequence from which the per-sequence schedule runs
ATTN_CHUNK_FLOATS = 1 << 23  # fp32 elements of scores / gathered keys one attention chunk holds


def query_tile_tokens(group: int) -> int:
    """Query tokens per row tile for ``group`` query heads per kv head: the fewest giving at
    least :data:`ATTN_MIN_ROWS` rows (a model constant, never a batch one)."""
    return max(1, -(-ATTN_MIN_ROWS // group))


@dataclass
class _Units:
    """Gathered-units schedule for a group of row tiles (short sequences)."""

    tok: torch.Tensor | None  # [nqt, qt] query row per tile slot (T: the zero pad row); None: row = tile
    slots: torch.Tensor  # [nk, nqt, KEY_TILE] cache slot of each key (0 where there is none)
    masked: torch.Tensor  # [nk, nqt, qt, KEY_TILE] key NOT visible to the tile slot's token
    dst: torch.Tensor | None  # query rows of the real tile slots (None: all rows, in order)
    src: torch.Tensor | None  # flat tile-slot index of each of them


@dataclass
class _SeqChunk:
    """Per-sequence schedule for one long query chunk with ascending positions."""

    t0: int  # query rows t0 .. t1-1
    t1: int
    num_tiles: int  # row tiles (the last one zero padded)
    num_key_tiles: int
    key_slots: torch.Tensor  # [num_key_tiles * KEY_TILE] cache slot of key position j (0: none)
    first: list[int]  # first[j]: first row tile whose last token sees key tile j (ascending in j)
    masks: list[tuple[int, torch.Tensor]]  # per j: (lo, masked [n, qt, KEY_TILE]) for tiles lo..lo+n-1,
    #                                        the tiles that see key tile j only in part
    groups: list[tuple[int, int]]  # row-tile ranges whose scores are held at once


@dataclass
class _Schedule:
    units: list[_Units]
    seqs: list[_SeqChunk]


class AttnPlan:
    """Per-forward attention work, shared by every attention layer of a model. Built lazily per
    query-tile height and memory footprint (they depend on the model's head layout)."""

    def __init__(self, meta: AttnMetadata) -> None:
        self.device = meta.positions.device
        self.num_tokens = int(meta.positions.shape[0])
        self.positions = meta.positions.to("cpu", torch.int64)
        self.cu = meta.cu_seqlens_q.to("cpu", torch.int64).tolist()
        self.tables = meta.block_tables.to("cpu", torch.int64)
        self.block_size = int(meta.block_size)
        self._schedules: dict[tuple[int, int, int], _Schedule] = {}

    def schedule(self, qt: int, unit_floats: int, tile_floats: int) -> _Schedule:
        key = (qt, unit_floats, tile_floats)
        if key not in self._schedules:
            self._schedules[key] = self._build(qt, unit_floats, tile_floats)
        return self._schedules[key]

    # -- building --------------------------------------------------------------------------
    def _key_slots(self, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, present) of key positions ``0 .. length-1`` through block table rows
        ``tables [..., W]``; absent keys get slot 0 (finite data, never visible)."""
        bs = self.block_size
        kpos = torch.arange(length)
        bi = kpos // bs
        width = tables.shape[-1]
        blocks = tables[..., bi.clamp(max=width - 1)]
        ok = (bi < width) & (blocks >= 0)
        return torch.where(ok, blocks * bs + kpos % bs, 0), ok

    def _build(self, qt: int, unit_floats: int, tile_floats: int) -> _Schedule:
        seqs: list[_SeqChunk] = []
        short: list[int] = []
        for b in range(len(self.cu) - 1):
            t0, t1 = self.cu[b], self.cu[b + 1]
            if t1 == t0:
                continue
            pos = self.positions[t0:t1]
            chunk = None
            if t1 - t0 >= SEQ_PATH_MIN_TOKENS and bool((pos[1:] > pos[:-1]).all()):
                chunk = self._seq_chunk(b, t0, t1, pos, qt, tile_floats)
            if chunk is None:
                short.append(b)
            else:
                seqs.append(chunk)
        return _Schedule(self._unit_groups(short, qt, unit_floats), seqs)

    def _seq_chunk(self, b: int, t0: int, t1: int, pos: torch.Tensor, qt: int, tile_floats: int) -> _SeqChunk | None:
        n = t1 - t0
        nq = -(-n // qt)
        last = int(pos[-1])
        nk = last // KEY_TILE + 1
        slots, ok = self._key_slots(self.tables[b], nk * KEY_TILE)
        if not bool(ok[: last + 1].all()):
            return None  # a visible key without a block: let the gathered schedule mask it
        big = torch.iinfo(torch.int64).max
        tpos = torch.full((nq * qt,), big, dtype=torch.int64)
        tpos[:n] = pos
        tpos = tpos.view(nq, qt)  # zero-padded rows: no mask (their query is zero, result dropped)
        tile_last = pos[torch.clamp(torch.arange(1, nq + 1) * qt, max=n) - 1]
        tile_first = pos[torch.arange(nq) * qt]
        starts = torch.arange(nk) * KEY_TILE
        first = torch.searchsorted(tile_last, starts).tolist()  # tiles whose last token reaches tile j
        full = torch.searchsorted(tile_first, starts + KEY_TILE - 1).tolist()  # ... whose first sees all of it
        kpos = torch.arange(nk * KEY_TILE).view(nk, KEY_TILE)
        masks = []
        for j in range(nk):
            lo, hi = first[j], max(first[j], full[j])
            masks.append((lo, (kpos[j][None, None, :] > tpos[lo:hi, :, None]).to(self.device)))
        cost = ((tile_last // KEY_TILE) + 1).tolist()
        groups, lo, acc = [], 0, 0
        for i, c in enumerate(cost):
            if i > lo and (acc + c) * tile_floats > ATTN_CHUNK_FLOATS:
                groups.append((lo, i))
                lo, acc = i, 0
            acc += c
        groups.append((lo, nq))
        return _SeqChunk(t0, t1, nq, nk, slots.to(self.device), first, masks, groups)

    def _unit_groups(self, seqs: list[int], qt: int, unit_floats: int) -> list[_Units]:
        if not seqs:
            return []
        t = self.num_tokens
        toks: list[list[int]] = []
        tpos: list[list[int]] = []
        tseq: list[int] = []
        for b in seqs:
            t0, t1 = self.cu[b], self.cu[b + 1]
            p = self.positions[t0:t1].tolist()
            top = max(p)  # pad slots see the sequence's keys: finite scores, result dropped
            for i in range(t0, t1, qt):
                k = min(qt, t1 - i)
                toks.append(list(range(i, i + k)) + [t] * (qt - k))
                tpos.append(p[i - t0: i - t0 + k] + [top] * (qt - k))
                tseq.append(b)
        tok_all = torch.tensor(toks, dtype=torch.int64)
        pos_all = torch.tensor(tpos, dtype=torch.int64)
        seq_all = torch.tensor(tseq, dtype=torch.int64)
        nk_all = int(pos_all.max()) // KEY_TILE + 1
        per = max(1, ATTN_CHUNK_FLOATS // (nk_all * unit_floats))
        identity = len(seqs) == len(self.cu) - 1 and qt == 1 and per >= len(toks)
        groups = []
        for lo in range(0, len(toks), per):
            tok, tp = tok_all[lo: lo + per], pos_all[lo: lo + per]
            nqt = tok.shape[0]
            nk = int(tp.max()) // KEY_TILE + 1
            slots, ok = self._key_slots(self.tables[seq_all[lo: lo + per]], nk * KEY_TILE)  # [nqt, J]
            kpos = torch.arange(nk * KEY_TILE)
            masked = ~ok[:, None, :] | (kpos[None, None, :] > tp[:, :, None])  # [nqt, qt, J]
            slots = slots.view(nqt, nk, KEY_TILE).transpose(0, 1).contiguous()
            masked = masked.view(nqt, qt, nk, KEY_TILE).permute(2, 0, 1, 3).contiguous()
            dev = self.device
            if identity:
                groups.append(_Units(None, slots.to(dev), masked.to(dev), None, None))
            else:
                flat = tok.reshape(-1)
                src = torch.nonzero(flat < t).reshape(-1)
                groups.append(_Units(tok.to(dev), slots.to(dev), masked.to(dev), flat[src].to(dev), src.to(dev)))
        return groups


def plan_attention(meta: AttnMetadata) -> AttnPlan:
    return AttnPlan(meta)


def _exp_shifted(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(s - m)`` with every element on the scalar path (see :func:`pointwise`); the
    subtraction writes straight into the strided buffer."""
    if s.device.type != "cpu":
        return torch.exp(s - m)
    buf = s.new_empty(*s.shape, 2)
    torch.sub(s, m, out=buf[..., 0])
    return torch.exp(buf[..., 0])


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` in fp32. ``index_select`` copies whole rows (~10x faster than advanced
    indexing here); the fp32 copy is the GEMM operand."""
    return torch.index_select(cache, 0, slots).float()


def _partials(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One key tile's softmax partial sums: ``[..., R, kt] x [..., kt, dv]`` -> ``[..., R, dv + 1]``,
    numerator (fixed-shape GEMM rows) then denominator (a row sum of fixed length ``kt``)."""
    return torch.cat([torch.bmm(p, v), p.sum(-1, keepdim=True)], dim=-1)


def _attend_units(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, u: _Units,
                  out: torch.Tensor) -> None:
    """Gathered units: ``qs [T, hkv, g, d]`` (fp32, scaled) -> rows of ``out [T, hkv, g, dv]``.
    ``v_cache`` None: the values are the first ``dv`` dims of the keys (MLA latent)."""
    t, hkv, g, d = qs.shape
    dv = out.shape[-1]
    nk, nqt, kt = u.slots.shape
    qt = u.masked.shape[2]
    r = qt * g
    b = nk * nqt * hkv
    if u.tok is None:
        qtile = qs.view(1, nqt, hkv, r, d)
    else:
        qpad = torch.cat([qs, qs.new_zeros(1, hkv, g, d)])
        qtile = qpad[u.tok].transpose(1, 2).reshape(1, nqt, hkv, r, d)
    qb = qtile.expand(nk, nqt, hkv, r, d).reshape(b, r, d)
    flat = u.slots.view(-1)
    k = _gather(k_cache, flat).view(nk * nqt, kt, hkv, d)
    if hkv > 1:
        k = k.transpose(1, 2)
    kb = k.reshape(b, kt, d)
    s = torch.bmm(qb, kb.transpose(1, 2)).view(nk, nqt, hkv, qt, g, kt)
    s.masked_fill_(u.masked.view(nk, nqt, 1, qt, 1, kt), float("-inf"))
    m = s.amax(dim=(0, 5), keepdim=True)
    p = _exp_shifted(s, m).view(b, r, kt)  # masked keys: exp(-inf) = 0 exactly
    if v_cache is None:
        v = kb[..., :dv]  # a strided view: bmm reads it in place
    else:
        v = _gather(v_cache, flat).view(nk * nqt, kt, hkv, dv)
        v = (v.transpose(1, 2) if hkv > 1 else v).reshape(b, kt, dv)
    z = _partials(p, v).view(nk, nqt, hkv, r, dv + 1)
    acc = z[0] + 0.0  # 0 + x, as the per-sequence schedule starts from zeros
    for j in range(1, nk):
        acc += z[j]
    o = (acc[..., :dv] / acc[..., dv:]).view(nqt, hkv, qt, g, dv).transpose(1, 2).reshape(nqt * qt, hkv, g, dv)
    if u.dst is None:
        out.copy_(o)
    else:
        out.index_copy_(0, u.dst, o[u.src])


def _attend_seq(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, c: _SeqChunk,
                qt: int, out: torch.Tensor) -> None:
    """Per-sequence schedule for the rows ``c.t0 .. c.t1-1`` of ``qs`` (see :func:`_attend_units`)."""
    _, hkv, g, d = qs.shape
    dv = out.shape[-1]
    kt, nk, nq = KEY_TILE, c.num_key_tiles, c.num_tiles
    n = c.t1 - c.t0
    r = qt * g
    keys = _gather(k_cache, c.key_slots).view(nk, kt, hkv, d).permute(2, 0, 1, 3).contiguous()  # [hkv, nk, kt, d]
    if v_cache is None:
        vals = keys[..., :dv]
    else:
        vals = _gather(v_cache, c.key_slots).view(nk, kt, hkv, dv).permute(2, 0, 1, 3).contiguous()
    q = qs.new_zeros(nq * qt, hkv, g, d)
    q[:n] = qs[c.t0: c.t1]
    q = q.view(nq, qt, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, nq, r, d)
    o = qs.new_empty(hkv, nq, r, dv)
    for lo, hi in c.groups:
        for h in range(hkv):
            m = qs.new_full((hi - lo, r), float("-inf"))
            scores = []
            for j in range(nk):
                a = max(lo, c.first[j])
                if a >= hi:
                    break
                s = torch.bmm(q[h, a:hi], keys[h, j].t().expand(hi - a, d, kt))  # [hi - a, r, kt]
                mlo, masked = c.masks[j]
                s0, s1 = max(a, mlo), min(hi, mlo + masked.shape[0])
                if s1 > s0:
                    s[s0 - a: s1 - a].view(s1 - s0, qt, g, kt).masked_fill_(masked[s0 - mlo: s1 - mlo, :, None, :],
                                                                         float("-inf"))
                mm = m[a - lo:]
                torch.maximum(mm, s.amax(-1), out=mm)
                scores.append((a, s))
            num = qs.new_zeros(hi - lo, r, dv)
            den = qs.new_zeros(hi - lo, r)
            for j, (a, s) in enumerate(scores):  # the same fp32 sums as the gathered units' acc
                p = _exp_shifted(s, m[a - lo:, :, None])
                num[a - lo:] += torch.bmm(p, vals[h, j].expand(hi - a, kt, dv))
                den[a - lo:] += p.sum(-1)
            o[h, lo:hi] = num / den[..., None]
    out[c.t0: c.t1] = o.view(hkv, nq, qt, g, dv).permute(1, 2, 0, 3, 4).reshape(nq * qt, hkv, g, dv)[:n]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttnPlan,
                    scale: float) -> torch.Tensor:
    """fp32 causal attention over the paged cache with batch-invariant numerics (see above)."""
    t, hkv, g, d = q.shape
    dv = v_cache.shape[-1]
    out = q.new_empty(t, hkv, g, dv, dtype=torch.float32)
    if t == 0:
        return out.to(q.dtype)
    shared = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride() and dv <= d
    vc = None if shared else v_cache  # MLA: the values are the first kv_lora dims of the cached latent
    qt = query_tile_tokens(g)
    r = qt * g
    unit_floats = hkv * (KEY_TILE * (d + dv) + r * (d + 4 * KEY_TILE + dv + 1))
    sched = plan.schedule(qt, unit_floats, 2 * r * KEY_TILE)
    qs = q.float() * scale
    for u in sched.units:
        _attend_units(qs, k_cache, vc, u, out)
    for c in sched.seqs:
        _attend_seq(qs, k_cache, vc, c, qt, out)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class TorchBackend(KernelBackend):
    name = "torch"
    batch_invariant = True

    def linear(self) -> LinearOp:
        return TorchLinear()

    def moe(self) -> MoEOp:
        return TorchMoE()

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        return mm_rows(x, w_t.to(compute_dtype(w_t.dtype, w_t.device)))  # widened per call (CPU bf16)

    def bmm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return bmm_rows(x, w.to(compute_dtype(w.dtype, w.device)))

    def matrix(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return w.to(dtype).contiguous()  # kept in the model dtype; matmul / bmm widen it per call

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one op (bit-identical to the spelled-out
        # transformers form on CPU, tests/runtime/test_layers.py); the weight multiply stays in the
        # activation dtype as transformers does it.
        xf = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), eps=eps)
        return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise(torch.sigmoid, x)

    def cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise(torch.cos, angles), pointwise(torch.sin, angles)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def write_cache(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        slots = slot_mapping.to(device=cache.device, dtype=torch.int64)
        vals = values.to(cache.dtype)
        keep = slots >= 0
        # Under CUDA-graph capture there is no -1 slot (engine/graphs.py pads into a spare block) and
        # the check, a device sync, is not allowed.
        capturing = slots.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not bool(keep.all()):
            slots, vals = slots[keep], vals[keep]
        cache.index_copy_(0, slots, vals)

    def plan_attention(self, meta: AttnMetadata) -> AttnPlan:
        return plan_attention(meta)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, plan: AttnPlan | None = None) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, plan if plan is not None else plan_attention(meta), scale)


register_backend("torch", TorchBackend)
