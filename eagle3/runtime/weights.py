"""Checkpoint tensors -> canonical weights (:mod:`eagle3.runtime.kernels.base`), one module at a time:
the whole weight, or the part a tensor-parallel layer holds (its rows or input columns, read straight
from the bytes where the format allows, layers/linear.py ``Shard``).

Which layout each Linear is in comes from the checkpoint's config through the same resolver the
schema is built from (:func:`eagle3.formats.sizing.resolver`, :func:`eagle3.formats.schema.stored_format`),
never from probing its tensors: a tensor that is not what the config says is one error naming it.
Formats read (every bit decode goes through ``eagle3.formats.codecs``):

* bf16 / fp16 / fp32 weights;
* compressed-tensors ``pack-quantized`` INT4 (Moonshot Kimi routed experts, W4A16):
  ``weight_packed`` + ``weight_scale`` (groups, or [N, 1] for the channel strategy) + ``weight_shape``
  (any integer width); all-zero ``weight_zero_point`` and an in-order ``weight_g_idx`` are accepted,
  others refused (:meth:`WeightReader._refuse_unsupported`);
* Quark W4A8: reorder-packed INT4 ``weight`` int32 + per-tensor ``weight_scale`` (0-d or [1]) +
  per-channel ``weight_scale_2`` [N], with dynamic per-token FP8 (default, as the config says) or
  INT8 (``act_override="int8"``) activations;
* Quark INT4 per-channel (or per-group, stored transposed) ``weight`` + ``weight_scale``;
* Quark MXFP4: uint8 E2M1 ``weight`` + uint8 E8M0 ``weight_scale``, dynamic MXFP4 activations
  when ``input_tensors`` says so;
* FP8 E4M3: DeepSeek 128x128 ``weight_scale_inv`` blocks, compressed-tensors block / per-channel /
  per-tensor ``weight_scale``, or Quark per-channel / per-tensor ``weight_scale`` (ptpc_fp8
  drafts, with dynamic per-token FP8 activations when the config asks for them).

The Kimi-K2.5 wrapper's ``vision_tower.*`` / ``mm_projector.*`` tensors are never read.

What the runtime does with each format (first steps, documented):

* Every quantized weight stays packed in memory as it is on disk (codes + scales; Quark's
  transposed per-group INT4 is relaid out once to words along the input dim, the same bytes).
  The torch reference decodes per call, exactly as compressed-tensors / Quark do (``bf16(q * s)``
  for INT4 W4A16), into a bounded scratch; no backend keeps a dense copy
  (:func:`resident_weight_bytes` accounts for it).
* DeepSeek block-FP8 weights run weight-only with compute-dtype activations (engines quantize
  activations per 1x128 group; the reference does not).
* W4A8 runs as an integer GEMM (INT8) or an exact float64 GEMM (FP8 activations), see
  ``kernels/torch_ref.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

from eagle3.checkpoint import CheckpointReader
from eagle3.errors import CheckpointError, FormatError, ShapeError, UsageError
from eagle3.formats import codecs, detect, keys, sizing
from eagle3.formats.schema import dtype_ok, stored_format
from eagle3.formats.sizing import LinearFormat
from eagle3.runtime.config import QuantSpec
from eagle3.runtime.kernels.base import (
    ActQuant,
    DenseWeight,
    FP8Weight,
    Int4Weight,
    LinearWeight,
    MXFP4Weight,
    dequantize,
)
from eagle3.runtime.layers.linear import Linear, Shard
from eagle3.runtime.layers.norm import RMSNorm

# ``act_override`` of the loader: "int8" / "fp8" for W4A8 layers, or WEIGHT_ONLY: no quantized Linear
# quantizes its activations (EngineConfig.activation_quant "none", the weight-only emulation).
WEIGHT_ONLY = "none"
ActOverride = ActQuant | Literal["none"]


class WeightReader:
    """Reads named tensors and decodes one Linear module into a canonical weight."""

    def __init__(self, path: str | os.PathLike[str], quant: QuantSpec, dtype: torch.dtype, device: torch.device,
                 act_override: ActOverride = None, tp: Any = None) -> None:
        self.reader = CheckpointReader(path)
        # linear_part's default for input-column parts: ``tp`` (a parallel.TPGroup, or None for a
        # whole model) keeps the bias on its first member. Parallel layers pass their own (Shard).
        self.keep_bias = tp is None or tp.rank == 0
        self.path = self.reader.path
        self.quant = quant
        self.dtype = dtype
        self.device = device
        self.act_override = act_override
        self.used: dict[str, int] = {}  # tensor -> bytes read of it (a shard's rows only, when sliced)
        # module -> the layout its config gives it: the same resolver the schema, `plan` and
        # `quantize` derive from (eagle3.formats.sizing), so the loader reads what the checker checked
        self._layout = sizing.resolver(detect.load_config(self.path), str(detect.checkpoint_dir(self.path) / "config.json"))

    def has(self, name: str) -> bool:
        return name in self.reader

    @property
    def used_bytes(self) -> int:
        """Bytes of the checkpoint tensors read so far (what the model was built from)."""
        return sum(self.used.values())

    def get(self, name: str) -> torch.Tensor:
        self.used[name] = self.reader.info(name).nbytes
        return self.reader.get(name)

    def get_part(self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows / columns of one tensor, reading only those bytes (a tensor-parallel shard)."""
        info = self.reader.info(name)
        r0, r1 = rows if rows is not None else (0, info.shape[0])
        c0, c1 = cols if cols is not None else (None, None)
        t = self.reader.get_rows(name, r0, r1, c0, c1)
        self.used[name] = self.used.get(name, 0) + t.numel() * t.element_size()
        return t

    def norm(self, module: RMSNorm, name: str) -> None:
        t = self.get(name)
        if tuple(t.shape) != (module.size,):
            raise ShapeError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected [{module.size}]")
        module.load(t.to(self.device), self.dtype)

    def linear(self, module: str) -> tuple[LinearWeight, ActQuant]:
        """Decode ``<module>.*`` in the layout the config gives it (:meth:`format_of`) -> (weight,
        activation quant)."""
        w = self._decode(module)
        bias_name = f"{module}.bias"
        if self.has(bias_name):
            w.bias = self.get(bias_name)
        return w, self._act(module, w)

    def _act(self, module: str, w: LinearWeight) -> ActQuant:
        """The activation quantization in front of ``module`` (None: the compute dtype)."""
        if isinstance(w, DenseWeight):
            return None
        if isinstance(w, FP8Weight) and w.block is not None:
            return None  # weight-only emulation of block FP8 (module docstring)
        if self.act_override == WEIGHT_ONLY:
            return None
        act = self.quant.act_for(module)
        if self.act_override is not None and act in ("int8", "fp8") and isinstance(w, Int4Weight):
            act = self.act_override
        return act

    def load_linear(self, layer: Linear, module: str) -> None:
        """Load the part of ``module`` that ``layer`` holds (:attr:`Linear.shard`: whole, or a
        tensor-parallel layer's rows / columns)."""
        w, act = self.shard_part(module, layer.shard)
        with named_errors(self, module):
            layer.load(w, act, self.dtype, self.device)

    def shard_part(self, module: str, shard: Shard) -> tuple[LinearWeight, ActQuant]:
        """The part of ``module`` a layer's :class:`~eagle3.runtime.layers.linear.Shard` names."""
        return self.linear_part(module, shard.rows, shard.cols, shard.keep_bias)

    def linear_part(self, module: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                    keep_bias: bool | None = None) -> tuple[LinearWeight, ActQuant]:
        """Output rows ``rows`` or input columns ``cols`` of a Linear, reading only those bytes where
        the format allows; the whole weight when neither is given. ``keep_bias`` (with ``cols``):
        whether this part carries the bias (a row-parallel bias is added once); default: as the
        reader was built (``tp``: the group's first member keeps it)."""
        if keep_bias is None:
            keep_bias = self.keep_bias
        if rows is not None or cols is not None:
            part = self._decode_part(module, rows, cols, keep_bias)
            if part is not None:
                return part
        w, act = self.linear(module)
        if rows is not None:
            w = slice_out(w, *rows)
        if cols is not None:
            w = slice_in(w, *cols, keep_bias=keep_bias)
            if isinstance(w, DenseWeight) and act is not None:
                act = None  # decoded fallback of slice_in: runs as a float weight
        return w, act

    def _decode_part(self, m: str, rows: tuple[int, int] | None,
                     cols: tuple[int, int] | None, keep_bias: bool) -> tuple[LinearWeight, ActQuant] | None:
        """Rows (output features) or input columns of module ``m``, read straight from
        the shard's bytes (:meth:`CheckpointReader.get_rows`): packed words and scale groups are
        cut on their boundaries. None when the layout or the range does not allow it (then the
        caller reads the whole tensor and slices, or raises the whole decode's error: Quark's
        transposed per-group INT4 off a word boundary, a range across a packing boundary, a tensor
        that is not what the config says)."""
        self._refuse_unsupported(m)
        fmt = self.format_of(m)
        w = self._read_part(m, fmt, rows, cols)
        if w is None:
            return None
        bias_name = f"{m}.bias"
        if self.has(bias_name):
            if rows is not None:
                w.bias = self.get_part(bias_name, rows)
            elif keep_bias:  # row parallel: the bias is added once, on one rank
                w.bias = self.get(bias_name)
        return w, self._act(m, w)

    def _read_part(self, m: str, fmt: LinearFormat, rows: tuple[int, int] | None,
                   cols: tuple[int, int] | None) -> LinearWeight | None:
        n_w, n_scale = f"{m}.{keys.WEIGHT}", f"{m}.{keys.SCALE}"
        s = fmt.scheme

        def ok(lo: int, hi: int, total: int, step: int) -> bool:
            return lo % step == 0 and (hi % step == 0 or hi == total)

        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        if s == sizing.CT_INT4:
            if not (self.has(f"{m}.{keys.CT_PACKED}") and self.has(n_scale) and self.has(f"{m}.{keys.CT_SHAPE}")):
                return None
            n, k = (int(x) for x in self.get(f"{m}.{keys.CT_SHAPE}").tolist())
            sk = self.reader.info(n_scale).shape
            if len(sk) != 2 or not sk[1] or k % sk[1]:
                return None
            g = k // sk[1]
            r, c = rows or (0, n), cols or (0, k)
            if not (ok(*c, k, 8) and c[0] % g == 0 and (c[1] - c[0]) % g == 0):
                return None
            packed = self.get_part(f"{m}.{keys.CT_PACKED}", r, (c[0] // 8, cdiv(c[1], 8)) if cols else None)
            scale = self.get_part(n_scale, r, (c[0] // g, c[1] // g) if cols else None)
            return Int4Weight(packed, scale, group_size=g, packing="ct", in_features=c[1] - c[0])
        if not self.has(n_w):
            return None
        info = self.reader.info(n_w)
        if len(info.shape) != 2 or not self._stored_as(n_w, fmt):
            return None
        if s == sizing.DENSE:
            return DenseWeight(self.get_part(n_w, rows, cols))
        if s == sizing.QUARK_INT4 and fmt.qscheme == "per_group":
            # Stored transposed: weight [K, N/8], scale [K/G, N]. The part's output rows are stored
            # columns (whole words of 8), its input columns stored rows.
            k, n = info.shape[0], info.shape[1] * 8
            sk = self.reader.info(n_scale).shape
            if len(sk) != 2 or not sk[0] or k % sk[0]:
                return None
            g = k // sk[0]
            r, c = rows or (0, n), cols or (0, k)
            if not (ok(*r, n, 8) and c[0] % g == 0 and (c[1] - c[0]) % g == 0):
                return None
            stored = self.get_part(n_w, c, (r[0] // 8, cdiv(r[1], 8)) if rows else None)
            st_scale = self.get_part(n_scale, (c[0] // g, c[1] // g), r if rows else None)
            reorder = self.quant.pack_method == "reorder"
            codes = codecs.quark_int4_unpack(stored, reorder=reorder)[:, : r[1] - r[0]].t().contiguous()
            return Int4Weight(codecs.quark_int4_pack(codes, reorder=reorder), st_scale.float().t().contiguous(),
                              group_size=g, packing="quark" if reorder else "quark_order", in_features=c[1] - c[0])
        if s in (sizing.QUARK_INT4, sizing.QUARK_W4A8):  # words along the input dim
            n, k = info.shape[0], info.shape[1] * 8
            c = cols or (0, k)
            if not ok(*c, k, 8):
                return None
            words = self.get_part(n_w, rows, (c[0] // 8, cdiv(c[1], 8)) if cols else None)
            # The scales as _quark_int4 reads them (a stride-0 stand-in for the words: no memory).
            full = self._quark_int4(m, torch.zeros((), dtype=torch.int32).expand(n, info.shape[1]), fmt)
            r = rows or (0, n)
            return Int4Weight(words, full.scale[r[0]: r[1]], None, tensor_scale=full.tensor_scale,
                              packing=full.packing, in_features=c[1] - c[0])
        if s == sizing.QUARK_MXFP4:
            k = info.shape[1] * 2
            c = cols or (0, k)
            if not ok(*c, k, 32):
                return None
            return MXFP4Weight(self.get_part(n_w, rows, (c[0] // 2, c[1] // 2) if cols else None),
                               self.get_part(n_scale, rows, (c[0] // 32, c[1] // 32) if cols else None))
        # FP8: DeepSeek block (weight_scale_inv), compressed-tensors block / channel / tensor, Quark FP8
        n, k = info.shape
        r, c = rows or (0, n), cols or (0, k)
        block, n_s = _fp8_block(fmt), f"{m}.{_fp8_scale_param(fmt)}"
        if not self.has(n_s):
            return None
        if block is not None:
            bn, bk = block
            if not (ok(*r, n, bn) and ok(*c, k, bk)):
                return None
            scale = self.get_part(n_s, (r[0] // bn, cdiv(r[1], bn)), (c[0] // bk, cdiv(c[1], bk)) if cols else None)
            return FP8Weight(self.get_part(n_w, rows, cols), scale.float(), block=block)
        sc = self.get(n_s).float()
        if sc.dim() >= 1 and sc.shape[0] == n and n > 1:
            sc = sc[r[0]: r[1]]
        return FP8Weight(self.get_part(n_w, rows, cols), sc)

    def format_of(self, m: str) -> LinearFormat:
        """The layout Linear ``m`` is stored in: what the checkpoint's config says
        (:func:`eagle3.formats.sizing.resolver`, the schema's source), or dense where a quantizer left
        it in the model dtype (:func:`eagle3.formats.schema.stored_format`). The tensors are never
        probed to guess a format."""
        return stored_format(m, self._layout(m, "linear"), self._dtype_tag)

    def _dtype_tag(self, name: str) -> str | None:
        return self.reader.info(name).dtype if name in self.reader else None

    def _require(self, m: str, param: str, fmt: LinearFormat) -> torch.Tensor:
        """Tensor ``<m>.<param>`` of the layout the config gives ``m``, in the dtype that layout
        stores it in (:func:`eagle3.formats.sizing.linear_params`, as the schema checks it)."""
        name = f"{m}.{param}"
        if not self.has(name):
            raise CheckpointError(f"{self.path}: missing tensor {name!r}: the config stores module {m!r} as "
                                  f"{fmt.describe()}")
        if not self._stored_as(name, fmt):
            raise FormatError(f"{self.path}: tensor {name!r} is {self.reader.info(name).dtype}, but the config "
                              f"stores module {m!r} as {fmt.describe()}")
        return self.get(name)

    def _stored_as(self, name: str, fmt: LinearFormat) -> bool:
        """Whether tensor ``name`` has the dtype its parameter has in ``fmt``."""
        expected = sizing.linear_params(fmt).get(name.rpartition(".")[2])
        return expected is not None and dtype_ok(expected, self.reader.info(name).dtype, name)

    def _decode(self, m: str) -> LinearWeight:
        self._refuse_unsupported(m)
        fmt = self.format_of(m)
        s = fmt.scheme
        if s == sizing.CT_INT4:
            return self._ct_int4(m, fmt)
        w = self._require(m, keys.WEIGHT, fmt)
        if s == sizing.DENSE:
            return DenseWeight(w)
        if s in (sizing.QUARK_INT4, sizing.QUARK_W4A8):
            return self._quark_int4(m, w, fmt)
        if s == sizing.QUARK_MXFP4:
            scale = self._require(m, keys.SCALE, fmt)
            if scale.shape[0] != w.shape[0] or scale.shape[1] * 32 != w.shape[1] * 2:
                raise ShapeError(f"{self.path}: tensor {m + '.' + keys.SCALE!r} is {scale.dtype}{list(scale.shape)}; "
                                 f"MXFP4 weight {list(w.shape)} needs uint8 [{w.shape[0]}, {w.shape[1] * 2 // 32}]")
            return MXFP4Weight(w, scale)
        scale = self._require(m, _fp8_scale_param(fmt), fmt).float()
        return FP8Weight(w, scale, block=_fp8_block(fmt))

    def _ct_int4(self, m: str, fmt: LinearFormat) -> Int4Weight:
        """compressed-tensors pack-quantized INT4, kept packed as on disk; the backend decodes it
        (codecs.ct_int4_unpack) when it runs."""
        n_packed, n_scale = f"{m}.{keys.CT_PACKED}", f"{m}.{keys.SCALE}"
        packed = self._require(m, keys.CT_PACKED, fmt)
        scale = self._require(m, keys.SCALE, fmt)
        shape = self._require(m, keys.CT_SHAPE, fmt).tolist()
        n, k = int(shape[0]), int(shape[1])
        if packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] * 8 < k:
            raise ShapeError(f"{self.path}: tensor {n_packed!r} is {packed.dtype}{list(packed.shape)}, not int32 "
                             f"[{n}, {-(-k // 8)}] for weight_shape {[n, k]}")
        if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
            raise ShapeError(f"{self.path}: tensor {n_scale!r} has shape {list(scale.shape)}, not [{n}, {k}/group]")
        return Int4Weight(packed, scale, group_size=k // scale.shape[1], packing="ct", in_features=k)

    def _refuse_unsupported(self, m: str) -> None:
        """Optional tensors the checkpoint schema lets through but this runtime would silently
        misread: a non-zero zero point (the decode is symmetric) and a group index that is not in
        column order (activation-ordered groups). Each is one small tensor per module: read whole.
        ``input_scale`` is ignored on purpose: activations are quantized dynamically (or not at all),
        at least as precise as the static scale. ``k_scale`` / ``v_scale`` (and Quark's kv-cache
        ``output_scale``) are read by the loader when the KV cache is fp8 (``loader._kv_scales``)."""
        n_gidx = f"{m}.{keys.G_IDX}"
        # Quark's export writes all-zero zero points for symmetric schemes (int4-draft, W4A8's INT4
        # stage with --quark-zero-points): those are fine.
        for n_zp in (f"{m}.{keys.ZERO_POINT}", f"{m}.{keys.ZERO_POINT_2}"):
            if self.has(n_zp) and not self._zero_point_is_zero(m, self.get(n_zp)):
                raise FormatError(f"{self.path}: tensor {n_zp!r}: asymmetric (zero-point) quantization is not "
                                  f"supported")
        if self.has(n_gidx):
            gidx = self.get(n_gidx).reshape(-1).to(torch.int64)
            k = gidx.numel()
            groups = self.reader.info(f"{m}.{keys.SCALE}").shape[-1] if self.has(f"{m}.{keys.SCALE}") else 1
            in_order = torch.arange(k, dtype=torch.int64) // -(-k // max(int(groups), 1))
            if not torch.equal(gidx, in_order):
                raise FormatError(f"{self.path}: tensor {n_gidx!r}: activation-ordered groups (a group index not "
                                  f"in column order) are not supported")

    def _zero_point_is_zero(self, m: str, zp: torch.Tensor) -> bool:
        """Whether every zero point is 0. compressed-tensors pack-quantized zero points are packed 8 to
        an int32 along the rows ([ceil(N/8), groups]) with the same +8 offset as the weight codes, so
        a zero one is stored as nibble 8, not as 0."""
        n_shape = f"{m}.{keys.CT_SHAPE}"
        if self.has(f"{m}.{keys.CT_PACKED}") and self.has(n_shape) and zp.dtype == torch.int32 and zp.dim() == 2:
            n = int(self.get(n_shape).reshape(-1)[0])
            if zp.shape[0] == -(-n // 8) and zp.shape[0] != n:
                return not bool(codecs.ct_int4_unpack(zp.t().contiguous(), n).any())
        return not bool(zp.any())

    def _quark_int4(self, m: str, w: torch.Tensor, fmt: LinearFormat) -> Int4Weight:
        """Quark INT4 or W4A8 (``fmt``), kept packed (int32 words along the input dim, Quark's nibble
        order)."""
        reorder = self.quant.pack_method == "reorder"
        packing = "quark" if reorder else "quark_order"
        scale = self._require(m, keys.SCALE, fmt).float()
        if w.dim() != 2:
            raise ShapeError(f"{self.path}: tensor {m + '.' + keys.WEIGHT!r} has shape {list(w.shape)}, not 2-D")
        if fmt.scheme == sizing.QUARK_INT4 and fmt.qscheme == "per_group":
            # Stored transposed: [K, N/8], scale [K/G, N]. Relaid out once to words along the input
            # dim (the same codes, the same bytes), so that rows decode independently like every
            # other INT4 weight.
            codes = codecs.quark_int4_unpack(w, reorder=reorder).t().contiguous()
            n, k = codes.shape
            scale = scale.t().contiguous()
            if scale.shape[0] != n or k % scale.shape[1]:
                raise ShapeError(f"{self.path}: {m}: per-group scale {list(scale.shape)} does not fit weight [{n}, {k}]")
            return Int4Weight(codecs.quark_int4_pack(codes, reorder=reorder), scale, group_size=k // scale.shape[1],
                              packing=packing, in_features=k)
        n, k = int(w.shape[0]), int(w.shape[1]) * 8
        if fmt.scheme == sizing.QUARK_W4A8:  # two stages: W = q * scale_2[n] * scale
            s2 = self._require(m, keys.SCALE_2, fmt).float().reshape(-1)
            if s2.shape[0] != n or scale.numel() != 1:
                raise ShapeError(f"{self.path}: {m}: W4A8 weight {[n, k]} needs weight_scale_2 "
                                 f"[{n}] and a per-tensor weight_scale, got {list(s2.shape)} and "
                                 f"{list(scale.shape)}")
            return Int4Weight(w, s2, None, tensor_scale=scale.reshape(()), packing=packing, in_features=k)
        if scale.numel() == 1:
            return Int4Weight(w, scale.reshape(1).expand(n).contiguous(), packing=packing, in_features=k)
        if scale.reshape(-1).shape[0] != n:
            raise ShapeError(f"{self.path}: {m}: per-channel scale {list(scale.shape)} does not fit weight "
                             f"{[n, k]}")
        return Int4Weight(w, scale.reshape(-1), packing=packing, in_features=k)


def _fp8_block(fmt: LinearFormat) -> tuple[int, int] | None:
    """The [rows, cols] block of a block-scaled FP8 layout, None for per-channel / per-tensor scales."""
    if fmt.scheme == sizing.FP8_BLOCK:
        return fmt.block or (128, 128)
    if fmt.scheme == sizing.CT_FP8 and fmt.qscheme == "block":
        return fmt.block
    return None


def _fp8_scale_param(fmt: LinearFormat) -> str:
    return keys.SCALE_INV if fmt.scheme == sizing.FP8_BLOCK else keys.SCALE


@contextlib.contextmanager
def named_errors(wr: WeightReader, what: str) -> Iterator[None]:
    """Name the checkpoint and module in shape / fusion errors raised while loading ``what``."""
    try:
        yield
    except ShapeError as e:
        raise ShapeError(f"{wr.path}: {e}") from None
    except UsageError as e:  # weights that cannot be fused (different formats)
        raise FormatError(f"{wr.path}: {what}: {e}") from None



def slice_out(w: LinearWeight, r0: int, r1: int) -> LinearWeight:
    """Rows ``r0 .. r1-1`` (output features) of a canonical weight: column-parallel layers. Every
    packed format is row-major in N, so this is a plain slice of codes and scales."""
    bias = None if w.bias is None else w.bias[r0:r1]
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[r0:r1], bias)
    if isinstance(w, Int4Weight):
        return dataclasses.replace(w, codes=w.codes[r0:r1], scale=w.scale[r0:r1], bias=bias)
    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(w.packed[r0:r1], w.scale[r0:r1], bias)
    if isinstance(w, FP8Weight):
        s = w.scale
        if w.block is not None:
            bn = w.block[0]
            if r0 % bn or (r1 % bn and r1 != w.shape[0]):
                return DenseWeight(dequantize(w, torch.float32, (r0, r1)), bias)
            s = s[r0 // bn: -(-r1 // bn)]
        elif s.dim() >= 1 and s.shape[0] == w.shape[0]:
            s = s[r0:r1]
        return FP8Weight(w.weight[r0:r1], s, w.block, bias)
    raise TypeError(f"not a canonical weight: {type(w).__name__}")


def slice_in(w: LinearWeight, k0: int, k1: int, keep_bias: bool) -> LinearWeight:
    """Input columns ``k0 .. k1-1`` of a canonical weight: row-parallel layers (``o_proj``,
    ``down_proj``), whose partial outputs are summed across ranks; the bias stays on one rank
    (``keep_bias``). Packed words / scale groups are sliced when the range falls on their
    boundaries; otherwise (a tiny model's FP8 128-blocks) the slice is decoded to a dense weight."""
    bias = w.bias if keep_bias else None
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[:, k0:k1], bias)
    if isinstance(w, Int4Weight):
        g = w.group_size
        if w.packing is None:
            codes = w.codes[:, k0:k1]
        elif k0 % 8 == 0 and (k1 % 8 == 0 or k1 == w.shape[1]):
            codes = w.codes[:, k0 // 8: -(-k1 // 8)]
        else:
            codes = None
        if codes is not None and (g is None or (k0 % g == 0 and (k1 - k0) % g == 0)):
            scale = w.scale if g is None else w.scale[:, k0 // g: k1 // g]
            return dataclasses.replace(w, codes=codes, scale=scale, bias=bias,
                                       in_features=None if w.packing is None else k1 - k0)
    elif isinstance(w, MXFP4Weight):
        if k0 % 32 == 0 and (k1 - k0) % 32 == 0:
            return MXFP4Weight(w.packed[:, k0 // 2: k1 // 2], w.scale[:, k0 // 32: k1 // 32], bias)
    elif isinstance(w, FP8Weight):
        if w.block is None:
            return FP8Weight(w.weight[:, k0:k1], w.scale, None, bias)
        bk = w.block[1]
        if k0 % bk == 0 and (k1 % bk == 0 or k1 == w.shape[1]):
            return FP8Weight(w.weight[:, k0:k1], w.scale[:, k0 // bk: -(-k1 // bk)], w.block, bias)
    else:
        raise TypeError(f"not a canonical weight: {type(w).__name__}")
    # Not on a packing boundary: the local slice only, decoded (a fallback the real shapes never take).
    return DenseWeight(dequantize(w, torch.float32)[:, k0:k1].contiguous(), bias)
