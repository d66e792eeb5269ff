"""The recipes' weight grids, with their scales fixed, for solvers that choose values column by column.

A solver (round to nearest, GPTQ, ...) needs three things of a format once its scales are chosen:
the nearest grid value of one input column (every output row at once), the integer codes of what
it chose, and the native export tensors of those codes. The grids here are exactly the values the
native engine's tensors decode to (:func:`eagle3.quantize.native.decode`), so an error a solver
measures on its own values is the error the served model has.

* :class:`W4A8Grid`, ``fp8_int4``: ``W[n, k] = (q[n, k] * s2[n]) * s1`` with INT4 codes ``q`` in
  [-8, 7], the FP8 stage's per-tensor scale ``s1`` and the INT4 stage's per-channel ``s2`` (the
  product order of :func:`eagle3.formats.codecs.w4a8_dequantize`). The native engine rounds twice
  (to FP8, then to INT4); a solver here rounds once, to the nearest ``q * s2 * s1`` (the stored
  tensors are the same kind either way).
* :class:`MXFP4Grid`, ``mxfp4``: ``W[n, k] = e2m1(c[n, k]) * 2**e[n, k // 32]``, the codes rounded
  as :func:`eagle3.formats.codecs.fp4_encode` rounds them.

Scales are chosen before any solver runs ("static groups"): GPTQ's error feedback then moves each
column's rounding error onto columns not yet quantized, inside fixed grids. :func:`w4a8_grid`
chooses ``s2`` per row by a clipping search (the step that minimises the row's squared error,
optionally weighted by the inputs' second moments; why not the data-free search's: its docstring),
:func:`mxfp4_grid` takes Quark's ``even`` exponent per block, or the data-free search's
(:func:`eagle3.quantize.scale_search.mxfp4_exponents`: the best of it and its two neighbours by
weighted error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.errors import ShapeError, UsageError
from eagle3.formats import codecs, keys
from eagle3.quantize import scale_search

INT4_HALF_RANGE = codecs.INT4_HALF_RANGE  # Quark's symmetric INT4 divides amax by 7.5 (the code -8 is usable)
MX_BLOCK = codecs.MXFP4_BLOCK
# Clip ratios of the INT4 per-channel step search: amax * r / 7.5, r from 1 down to 0.5.
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))
SCALE_MODES = ("max", "mse")


def _check_2d(w: torch.Tensor, what: str) -> tuple[int, int]:
    if w.dim() != 2 or not w.is_floating_point():
        raise ShapeError(f"{what}: expected a 2-D float weight [out, in], got {w.dtype} {list(w.shape)}")
    return int(w.shape[0]), int(w.shape[1])


@dataclass
class W4A8Grid:
    """W4A8's values with fixed scales: ``(q * s2[n]) * s1``, q in [-8, 7] (module docstring)."""

    s1: torch.Tensor  # fp32 0-d: the FP8 stage's per-tensor scale
    s2: torch.Tensor  # fp32 [N]: the INT4 stage's per-channel scale

    def __post_init__(self) -> None:
        self.s1 = self.s1.float().reshape(())
        self.s2 = self.s2.float().reshape(-1)
        self._step = self.s2 * self.s1  # the grid step of each row, in weight units

    @property
    def rows(self) -> int:
        return int(self.s2.shape[0])

    def codes(self, w: torch.Tensor, cols: torch.Tensor | slice | int) -> torch.Tensor:
        """int8 codes of the nearest grid values of ``w`` (columns ``cols`` of the weight; the
        scale is per row, so the columns do not matter here)."""
        step = self._step if w.dim() == 1 else self._step[:, None]
        return torch.round(w.float() / step).clamp_(codecs.INT4_MIN, codecs.INT4_MAX).to(torch.int8)

    def values(self, codes: torch.Tensor, cols: torch.Tensor | slice | int) -> torch.Tensor:
        """fp32 values of ``codes`` (columns ``cols``), in the codec's product order."""
        s2 = self.s2 if codes.dim() == 1 else self.s2[:, None]
        return (codes.float() * s2) * self.s1

    def qdq(self, w: torch.Tensor, cols: torch.Tensor | slice | int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.codes(w, cols)
        return self.values(c, cols), c

    def native(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The export tensors of :class:`~eagle3.quantize.native.NativeEngine` for ``fp8_int4``."""
        return {keys.WEIGHT: codecs.quark_int4_pack(codes.to(torch.int8), reorder=True),
                keys.SCALE: self.s1.clone(), keys.SCALE_2: self.s2.clone()}


@dataclass
class MXFP4Grid:
    """MXFP4's values with fixed block exponents: ``e2m1(c) * 2**e[n, k // 32]``."""

    exponents: torch.Tensor  # int32 [N, K/32], unbiased, in [-126, 127]

    def __post_init__(self) -> None:
        self.exponents = self.exponents.to(torch.int32).clamp(-126, 127)
        e = self.exponents.double()
        self._scale = torch.exp2(e).float()
        self._inv = torch.exp2(-e).float()

    @property
    def rows(self) -> int:
        return int(self.exponents.shape[0])

    def _block(self, cols: torch.Tensor | slice | int) -> torch.Tensor | slice | int:
        if isinstance(cols, int):
            return cols // MX_BLOCK
        if isinstance(cols, slice):
            start, stop = cols.start or 0, cols.stop
            if start % MX_BLOCK or (stop - start) % MX_BLOCK:
                raise ValueError("MXFP4 column slices must cover whole blocks of 32")
            return torch.arange(start, stop) // MX_BLOCK
        return cols // MX_BLOCK

    def codes(self, w: torch.Tensor, cols: torch.Tensor | slice | int) -> torch.Tensor:
        b = self._block(cols)
        return codecs.fp4_encode(w.float() * self._inv[:, b])

    def values(self, codes: torch.Tensor, cols: torch.Tensor | slice | int) -> torch.Tensor:
        b = self._block(cols)
        return codecs.fp4_decode(codes) * self._scale[:, b]

    def qdq(self, w: torch.Tensor, cols: torch.Tensor | slice | int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.codes(w, cols)
        return self.values(c, cols), c

    def native(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The export tensors of :class:`~eagle3.quantize.native.NativeEngine` for ``mxfp4``."""
        return {keys.WEIGHT: codecs.fp4_pack(codes.to(torch.uint8)),
                keys.SCALE: (self.exponents + 127).to(torch.uint8)}


Grid = W4A8Grid | MXFP4Grid


def _weighted_sq_err(err: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    sq = err.square()
    return (sq if importance is None else sq * importance).sum(-1)


def w4a8_grid(w: torch.Tensor, scales: str = "mse", importance: torch.Tensor | None = None) -> W4A8Grid:
    """W4A8 scales of ``w`` [N, K] (fp32 source values): ``s1`` as the native engine takes it (the
    whole weight's amax / 448), ``s2`` per row as the native engine takes it (``scales="max"``: the
    row's largest FP8-stage value / 7.5, Quark's rule) or the clip ratio of :data:`CLIP_RATIOS` with
    the smallest squared error of the row's round to nearest, each input weighted by ``importance``
    [K] (``"mse"``; e.g. the diagonal of the inputs' second moments, so that inputs that carry more
    signal count more).

    Not :func:`eagle3.quantize.scale_search.int4_per_channel`'s step (``--method mse``, a wider
    screened search with a least-squares refit): that one minimises each row's round-to-nearest
    error, while GPTQ rounds every column after the earlier columns' errors were fed into it, so the
    best step for round to nearest is not the best for GPTQ. Measured on the trained tiny pair
    (docs/recipes.md's command, one recording), ``w4a8 --method gptq`` with the data-free search's
    step: mean KLD 0.00119, median 0.00034, p99 0.0122, against 0.00091, 0.00033, 0.0114 with this
    search (top-1 99.3 % against 99.0 %; the mean's gap is mostly one position); this one is kept."""
    n, k = _check_2d(w, "W4A8 grid")
    if scales not in SCALE_MODES:
        raise UsageError(f"W4A8 scales {scales!r}: choose one of {', '.join(SCALE_MODES)}")
    wf = w.float()
    s1 = codecs.fp8_per_tensor_scale(wf.abs().amax(), torch.float32)
    amax = wf.abs().amax(dim=1)
    # "max": the native engine's s2 exactly (its amax is that of the FP8 stage's values).
    amax8 = codecs.fp8_quantize(amax, s1).float()
    if scales == "max":
        return W4A8Grid(s1, torch.clamp(amax8 / INT4_HALF_RANGE, min=torch.finfo(torch.float32).eps))
    imp = None if importance is None else importance.float().reshape(1, k)
    best_err = torch.full((n,), float("inf"))
    chosen = torch.clamp(amax8 / INT4_HALF_RANGE, min=torch.finfo(torch.float32).eps) * s1
    for r in CLIP_RATIOS:
        step = torch.clamp(amax * r / INT4_HALF_RANGE, min=torch.finfo(torch.float32).eps)
        q = torch.round(wf / step[:, None]).clamp_(codecs.INT4_MIN, codecs.INT4_MAX)
        err = _weighted_sq_err(q * step[:, None] - wf, imp)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        chosen = torch.where(better, step, chosen)
    return W4A8Grid(s1, chosen / s1)


def mxfp4_grid(w: torch.Tensor, scales: str = "max", importance: torch.Tensor | None = None) -> MXFP4Grid:
    """MXFP4 block exponents of ``w`` [N, K]: Quark's ``even`` rule (``scales="max"``, what the
    native engine writes with ``--method rtn``), or the data-free search's
    (:func:`eagle3.quantize.scale_search.mxfp4_exponents`, ``"mse"``): per block the best of that
    exponent and its two neighbours by the block's squared error weighted by ``importance`` [K]."""
    n, k = _check_2d(w, "MXFP4 grid")
    if k % MX_BLOCK:
        raise ShapeError(f"MXFP4 grid: input dim {k} is not a multiple of {MX_BLOCK}")
    if scales not in SCALE_MODES:
        raise UsageError(f"MXFP4 scales {scales!r}: choose one of {', '.join(SCALE_MODES)}")
    if scales == "mse":
        return MXFP4Grid(scale_search.mxfp4_exponents(w, importance))
    blocks = w.float().reshape(n, k // MX_BLOCK, MX_BLOCK)
    return MXFP4Grid(codecs.mxfp4_scale_even(blocks.abs().amax(-1)).clamp(-126, 127))


def grid_for(fmt: str, w: torch.Tensor, scales: str | None = None,
             importance: torch.Tensor | None = None) -> Grid:
    """The grid of a recipe weight format (``fp8_int4`` | ``mxfp4``) with scales chosen for ``w``;
    ``scales`` None: each format's default (clipping search for INT4, Quark's ``even`` for MXFP4)."""
    if fmt == "fp8_int4":
        return w4a8_grid(w, scales or "mse", importance)
    if fmt == "mxfp4":
        return mxfp4_grid(w, scales or "max", importance)
    raise UsageError(f"calibrated methods quantize to fp8_int4 (W4A8) or mxfp4 weights, not {fmt!r}")
