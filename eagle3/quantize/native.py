"""The native engine: eagle3's vectorised torch codecs (:mod:`eagle3.formats.codecs`), applied a
chunk of output rows at a time, with the numbers a :mod:`method <eagle3.quantize.methods>` chooses:
``rtn`` reproduces Quark 0.13's numerics bit for bit, ``mse`` searches the scales (same tensors).

Why chunks: a torch element-wise op over a whole 2048x7168 weight streams ~60 MB through memory
and allocates fresh pages for every temporary; over ~128K-element row chunks the same ops run in
cache and allocate nothing new, about 5-10x faster on CPU, and peak memory per tensor drops to a
few MB. Per-channel and per-group schemes quantize each row on its own, so chunking gives the same
bits (the tests compare with Quark on every scheme). Schemes with a per-tensor stage (W4A8's FP8
stage, FP8 per-tensor) need the whole tensor's amax and run on the full tensor.

The same module decodes (dequantizes) exported tensors for the verification pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from eagle3.errors import Eagle3Error, ShapeError
from eagle3.formats import codecs, keys
from eagle3.quantize.methods import NO_STATS, RTN, InputStats, Method, RowsContext
from eagle3.quantize.recipes import WeightSpec
from eagle3.quantize.sources import RowSource

CHUNK_ELEMENTS = 1 << 19  # 2 MB of fp32 per chunk: the measured sweet spot between per-op overhead and cache
FEEDBACK_CHUNK_ELEMENTS = 1 << 22  # 16 MB: a method with error feedback along the rows (expert_inputs)


def chunk_rows(n: int, k: int, align: int = 1, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk: about ``elements`` elements, a multiple of 8 (INT4 packs output channels
    8 per word in the per-group layout) and of ``align`` (FP8 source blocks)."""
    step = 8 * align // _gcd(8, align)
    rows = max(step, (elements // max(k, 1)) // step * step)
    return min(rows, max(n, 1))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _chunks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


def _amax(src: RowSource, rows: int) -> torch.Tensor:
    """amax(|W|) of the whole weight, in its dtype (what Quark's per-tensor observer sees)."""
    return torch.stack([src.rows(r0, r1).abs().amax() for r0, r1 in _chunks(src.shape[0], rows)]).amax()


def check_shape(spec: WeightSpec, shape: tuple[int, int], name: str) -> None:
    """One-line error when a weight cannot take the scheme (group size, packing width)."""
    n, k = shape
    if k % spec.k_multiple:
        what = f"group size {spec.group_size}" if spec.group_size else f"packing width {spec.k_multiple}"
        raise ShapeError(f"tensor {name}.weight has shape [{n}, {k}]: input dim {k} is not divisible by the "
                         f"{spec.describe()} {what}")
    if spec.format == "int4" and spec.qscheme == "per_group" and n % 8:
        raise ShapeError(f"tensor {name}.weight has shape [{n}, {k}]: per-group INT4 packs output channels by 8, "
                         f"{n} is not divisible by 8")


Observer = Callable[[int, int, dict[str, torch.Tensor], torch.Tensor], None]


class NativeEngine:
    """Quantize a weight into Quark's export tensors with eagle3's codecs, its numbers chosen by a
    :mod:`method <eagle3.quantize.methods>` (round to nearest by default: Quark's bits)."""

    name = "native"

    def quantize(self, src: RowSource, spec: WeightSpec, zero_point: bool = False,
                 observe: Observer | None = None, method: Method = RTN,
                 inputs: InputStats = NO_STATS) -> dict[str, torch.Tensor]:
        """-> {parameter suffix: tensor}, e.g. {"weight": int32, "weight_scale": f32, ...}.

        ``observe(r0, r1, out, rows)`` is called after each row chunk is quantized, with the
        output tensors (rows r0:r1 already filled) and the source rows they came from: the
        verification pass measures the error there, while the source chunk is still at hand.
        ``inputs``: what is known about the weight's inputs, for the methods that use it."""
        n, k = src.shape
        # Error feedback steps column by column, a few ops per column and chunk: larger chunks for it
        # (still under glibc's largest mmap threshold, 32 MB, so the buffers are reused, not faulted in).
        rows = chunk_rows(n, k, src.row_align, FEEDBACK_CHUNK_ELEMENTS if inputs.moments is not None else CHUNK_ELEMENTS)
        s1: torch.Tensor | None = None
        if spec.format == "fp8_int4" or (spec.format == "fp8" and spec.qscheme == "per_tensor"):
            # The FP8 stage's per-tensor scale needs the whole weight's amax: one pass for it, then
            # row chunks with that scale (stage 2 of W4A8 is per row).
            s1 = codecs.fp8_per_tensor_scale(_amax(src, rows), torch.float32)
        ctx = RowsContext(spec, (n, k), s1, inputs)
        out = _allocate(spec, n, k, s1)
        if inputs.solved is not None:  # a calibrated method's numbers, solved before this pass
            out = _solved(out, inputs.solved, inputs.source)
            if observe is not None:
                for r0, r1 in _chunks(n, rows):
                    observe(r0, r1, out, src.rows(r0, r1))
        else:
            for r0, r1 in _chunks(n, rows):
                x = src.rows(r0, r1)
                _place(out, method.rows(x, ctx), spec, r0, r1)
                if observe is not None:
                    observe(r0, r1, out, x)
        if zero_point and spec.format == "fp8_int4":
            # Two-stage W4A8: the INT4 stage's zeros; Quark's importer wants them as
            # weight_zero_point_2 (its weight_quantizer.1.zero_point), the FP8 stage has none.
            out[keys.ZERO_POINT_2] = codecs.quark_int4_zero_point_like(out[keys.SCALE_2])
        elif zero_point:
            out[keys.ZERO_POINT] = codecs.quark_int4_zero_point_like(out[keys.SCALE])
        return out


def _allocate(spec: WeightSpec, n: int, k: int, s1: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The export tensors of a whole [n, k] weight, to be filled a row chunk at a time."""
    f32 = torch.float32
    if spec.format == "fp8" and s1 is not None:
        return {keys.WEIGHT: torch.empty(n, k, dtype=torch.float8_e4m3fn), keys.SCALE: s1}
    if spec.format == "fp8_int4":
        assert s1 is not None
        return {keys.WEIGHT: torch.empty(n, (k + 7) // 8, dtype=torch.int32), keys.SCALE: s1,
                keys.SCALE_2: torch.empty(n, dtype=f32)}
    if spec.format == "mxfp4":
        return {keys.WEIGHT: torch.empty(n, k // 2, dtype=torch.uint8),
                keys.SCALE: torch.empty(n, k // 32, dtype=torch.uint8)}
    if spec.format == "fp8":
        return {keys.WEIGHT: torch.empty(n, k, dtype=torch.float8_e4m3fn), keys.SCALE: torch.empty(n, dtype=f32)}
    if spec.format == "int4" and spec.qscheme == "per_channel":
        return {keys.WEIGHT: torch.empty(n, (k + 7) // 8, dtype=torch.int32), keys.SCALE: torch.empty(n, dtype=f32)}
    if spec.format == "int4" and spec.qscheme == "per_group":
        # Export layout is transposed: weight [K, N/8], scale [K/g, N]; row chunks of W are
        # column chunks of both (chunk rows are multiples of 8, so words never straddle chunks).
        g = int(spec.group_size or 0)
        return {keys.WEIGHT: torch.empty(k, (n + 7) // 8, dtype=torch.int32),
                keys.SCALE: torch.empty(k // g, n, dtype=f32)}
    raise ValueError(f"unsupported weight spec {spec}")


def _solved(out: dict[str, torch.Tensor], solved: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The solved export tensors in place of the allocated ones, when they are exactly those: same
    names, dtypes and shapes (values may differ anywhere, the per-tensor FP8-stage scale included:
    smoothing rescales a weight's rows or columns before its grid is chosen)."""
    if set(solved) != set(out):
        raise Eagle3Error(f"{name}: calibrated tensors {sorted(solved)}, expected {sorted(out)}")
    for key, want in out.items():
        got = solved[key]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise Eagle3Error(f"{name}.{key}: calibrated as {got.dtype}{list(got.shape)}, the format writes "
                              f"{want.dtype}{list(want.shape)}")
    return {key: solved[key].contiguous() for key in out}


def _place(out: dict[str, torch.Tensor], part: dict[str, torch.Tensor], spec: WeightSpec, r0: int, r1: int) -> None:
    """Rows r0:r1 of each export tensor (per-group INT4: its columns, the layout is transposed)."""
    if spec.format == "int4" and spec.qscheme == "per_group":
        pw = part[keys.WEIGHT]
        out[keys.WEIGHT][:, r0 // 8: r0 // 8 + pw.shape[1]] = pw
        out[keys.SCALE][:, r0:r1] = part[keys.SCALE]
        return
    for key, t in part.items():
        out[key][r0:r1] = t


def decode(tensors: dict[str, torch.Tensor], spec: WeightSpec, shape: tuple[int, int],
           r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Exported tensors -> fp32 weight rows [r0:r1] (eagle3's codecs, the verification pass)."""
    n, k = shape
    r1 = n if r1 is None else r1
    w = tensors[keys.WEIGHT]
    s = tensors[keys.SCALE]
    if spec.format == "fp8_int4":
        return codecs.w4a8_dequantize(w[r0:r1], s, tensors[keys.SCALE_2][r0:r1], k, True, torch.float32)
    if spec.format == "mxfp4":
        return codecs.mxfp4_dequantize(w[r0:r1], s[r0:r1], torch.float32)
    if spec.format == "fp8":
        return codecs.fp8_dequantize(w[r0:r1], s if s.numel() == 1 else s[r0:r1], torch.float32)
    if spec.qscheme == "per_channel":
        return codecs.quark_int4_per_channel_dequantize(w[r0:r1], s[r0:r1], k, True, torch.float32)
    if r0 % 8:
        raise ValueError("per-group INT4 decodes in row chunks that start on a multiple of 8")
    return codecs.quark_int4_per_group_dequantize(w[:, r0 // 8: (r1 + 7) // 8], s[:, r0:r1], True,
                                                  torch.float32)[: r1 - r0]


def expected_shapes(spec: WeightSpec, shape: tuple[int, int], zero_point: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The exported tensors of one module: {suffix: (shape, dtype)} (Quark's export layout). The layout
    is :func:`eagle3.formats.sizing.linear_tensors`'s, the one ``eagle3 plan`` sizes checkpoints with."""
    from eagle3.checkpoint import dtype_from_tag
    from eagle3.formats import sizing

    n, k = shape
    if spec.format == "fp8_int4":
        fmt = sizing.LinearFormat(sizing.QUARK_W4A8, qscheme="per_channel", zero_point=zero_point)
    elif spec.format == "mxfp4":
        fmt = sizing.LinearFormat(sizing.QUARK_MXFP4, group_size=32, qscheme="per_group")
    elif spec.format == "fp8":
        fmt = sizing.LinearFormat(sizing.QUARK_FP8, qscheme=spec.qscheme)
    else:
        fmt = sizing.LinearFormat(sizing.QUARK_INT4, qscheme=spec.qscheme, group_size=spec.group_size,
                                  zero_point=zero_point)
    return {t.name[2:]: (t.shape, dtype_from_tag(t.dtype)) for t in sizing.linear_tensors("m", n, k, fmt)}
