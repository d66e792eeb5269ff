"""Error-feedback solvers on a fixed grid: round to nearest, GPTQ, and GPTQ fitted to quantized inputs.

GPTQ (Frantar et al., arXiv 2210.17323) quantizes a weight ``W [N, K]`` one input column at a time
and spreads each column's rounding error over the columns not yet quantized, weighted by the
inverse of the inputs' second-moment matrix ``H = X^T X`` (``X [T, K]`` the layer's inputs), so
that the layer's *output* error ``||X W^T - X Q^T||`` is what it minimises, not the weight error.
Implemented as in the paper: the upper Cholesky factor of ``H^-1`` (after damping), blocks of
``block`` columns with the rank-``block`` update of the rest deferred ("lazy batch"), optional
activation order (columns by decreasing ``H[j, j]``; the grid's scales stay those of the natural
column order, "static groups").

Why not Quark's ``quark.torch.algorithm.gptq`` (the algorithm is the same):

* its processor runs whole Hugging Face decoder blocks with hooks on ``nn.Linear`` modules and
  keeps every calibration example's block input; eagle3's runtime keeps routed experts packed in
  one fused op with no module per expert, and the calibration here streams one layer at a time
  (:mod:`.capture`);
* its quantizer is Quark's ``ScaledFakeQuantize``, whose arithmetic is not the native engine's
  (W4A8's two scales, the E2M1 rounding of :mod:`eagle3.formats.codecs`): a solver must feed back
  the error of exactly the values that are exported;
* it zeroes every column whose Hessian diagonal is 0 (an input no calibration token exercised),
  and with it a whole expert that no token reached; here such a column keeps its round-to-nearest
  value (its Hessian row and column are 0, so it neither gives nor takes error feedback);
* importing it takes tens of seconds and a C++ toolchain; the runtime's dependencies do not need it.

The Cholesky recipe (damping by a fraction of the mean diagonal, retried with more when the
factorisation fails) follows Quark's ``_compute_hinv_cholesky_factor``.

GPTAQ-style fitting to quantized inputs (:func:`asymmetric_target`): when the layer's inputs come
from the already-quantized model (``X~``) while the target stays the source model's output
``X W^T``, the objective ``||X W^T - X~ Q^T||`` equals ``||X~ (W* - Q)^T||`` plus a constant, with
``W* = W X^T X~ (X~^T X~)^-1``: GPTQ on ``W*`` with ``H~ = X~^T X~`` minimises it. This is the exact
reduction of GPTAQ's objective (arXiv 2504.02692), applied as a change of target before plain
GPTQ, not GPTAQ's per-column update; ``alpha`` scales the correction like Quark's ``alpha`` and
the damping keeps ``W*`` at ``W`` in directions the calibration inputs never take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.errors import ShapeError, UsageError
from eagle3.quantize.calibrate.grids import Grid

DEFAULT_DAMP = 0.01  # fraction of the mean Hessian diagonal added to it (GPTQ's and Quark's default)
DEFAULT_BLOCK = 128  # columns per lazy batch (GPTQ's and Quark's default)
_MAX_DAMP_TRIES = 6


@dataclass
class HessianFactor:
    """What GPTQ needs of ``H`` once, shared by every weight that reads the same inputs (gate and
    up of one expert): the column order and the upper Cholesky factor of the damped ``H^-1`` in
    that order."""

    hinv_u: torch.Tensor  # fp32 [K, K], upper triangular
    perm: torch.Tensor | None  # int64 [K] (act order) or None (natural order)
    dead: torch.Tensor  # bool [K]: inputs that were always zero
    damp: float  # the damping that was added to the diagonal


def factor(h: torch.Tensor, damp: float = DEFAULT_DAMP, act_order: bool = False,
           dtype: torch.dtype = torch.float32) -> HessianFactor:
    """Damped ``H`` -> the upper Cholesky factor of its inverse, computed in ``dtype`` (fp32 as in
    GPTQ's and Quark's code; float64 for a reference). Memory: about three ``K x K`` matrices of
    ``dtype`` at once (Kimi-K2.5's dense down_proj, K = 18432: 1.4 GB each in fp32).

    Dead inputs (``H[j, j] == 0``) get ``H[j, j] = 1``: their column is rounded to nearest and
    exchanges no error with the others (Quark would zero it instead; see the module docstring)."""
    k = h.shape[0]
    if h.dim() != 2 or h.shape[1] != k:
        raise ShapeError(f"Hessian must be square [K, K], got {list(h.shape)}")
    H = h.to(dtype=dtype, copy=True)
    diag = torch.diagonal(H)
    dead = diag == 0
    diag[dead] = 1.0
    perm = None
    if act_order:
        perm = torch.argsort(diag, descending=True, stable=True)
        H = H[perm][:, perm]
        diag = torch.diagonal(H)
    mean = float(diag.mean())
    lam = damp * mean
    diag += lam
    for _ in range(_MAX_DAMP_TRIES):
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0:
            break
        extra = max(lam * 9, mean * 1e-6, 1e-12)  # to 10x the damping, as Quark retries
        diag += extra
        lam += extra
    else:
        raise UsageError(f"GPTQ: the Hessian [{k}, {k}] is not positive definite even with damping {lam:.3g}")
    del H, diag
    hinv = torch.cholesky_inverse(L)
    del L
    hinv_u = torch.linalg.cholesky(hinv, upper=True)
    del hinv
    return HessianFactor(hinv_u.float(), perm, dead, lam)


@dataclass
class Solution:
    """A solver's result: the codes on the grid and their values (fp32 [N, K])."""

    codes: torch.Tensor
    values: torch.Tensor


def rtn(w: torch.Tensor, grid: Grid) -> Solution:
    """Round to nearest on ``grid``."""
    vals, codes = grid.qdq(w.float(), slice(0, w.shape[1]))
    return Solution(codes, vals)


def gptq(w: torch.Tensor, f: HessianFactor, grid: Grid, block: int = DEFAULT_BLOCK) -> Solution:
    """GPTQ of ``w`` [N, K] on ``grid`` with the inputs' Hessian factor ``f`` (module docstring).

    Works on ``W^T`` [K, N] so that a column of ``W`` is one contiguous row: each step's error
    feedback is a rank-1 update of the block's remaining rows (BLAS ``ger``), each block's deferred
    update one GEMM; on a CPU this is ~10x faster than updating strided columns of ``W``."""
    n, k = w.shape
    if f.hinv_u.shape[0] != k:
        raise ShapeError(f"GPTQ: weight [{n}, {k}] and Hessian [{f.hinv_u.shape[0]}]^2 disagree")
    perm = f.perm
    wt = w.float().t().contiguous()  # [K, N]; permuted as rows (contiguous gathers, not strided columns)
    if perm is not None:
        wt = wt.index_select(0, perm)
    cols = perm.tolist() if perm is not None else list(range(k))
    hinv = f.hinv_u
    qt = torch.empty_like(wt)
    codes_t: torch.Tensor | None = None
    threads = torch.get_num_threads()
    try:
        for i1 in range(0, k, block):
            i2 = min(i1 + block, k)
            err = torch.empty(i2 - i1, n)
            # One thread for the column steps: each op touches one row of W^T (a few thousand
            # values), where a thread pool's fork/join costs more than the op (10x slower with 2
            # threads on a busy 2-core machine); the block's deferred GEMM gets every thread.
            torch.set_num_threads(1)
            for i in range(i1, i2):
                q, c = grid.qdq(wt[i], cols[i])
                if codes_t is None:
                    codes_t = torch.empty(k, n, dtype=c.dtype)
                qt[i] = q
                codes_t[i] = c
                e = err[i - i1]
                torch.sub(wt[i], q, out=e).div_(hinv[i, i])
                if i + 1 < i2:
                    wt[i + 1: i2].addr_(hinv[i, i + 1: i2], e, alpha=-1.0)
            torch.set_num_threads(threads)
            if i2 < k:
                wt[i2:].addmm_(hinv[i1:i2, i2:].t(), err, alpha=-1.0)
    finally:
        torch.set_num_threads(threads)
    assert codes_t is not None
    if perm is not None:
        inv = torch.argsort(perm)
        qt, codes_t = qt.index_select(0, inv), codes_t.index_select(0, inv)
    return Solution(codes_t.t().contiguous(), qt.t().contiguous())


def asymmetric_target(w: torch.Tensor, h_q: torch.Tensor, cross: torch.Tensor, damp: float = DEFAULT_DAMP,
                      alpha: float = 1.0) -> torch.Tensor:
    """``W* = W + alpha * W (C - H~) (H~ + lam I)^-1`` (module docstring): the weight whose outputs on
    the quantized model's inputs ``X~`` best match the source's ``X W^T``, with ``H~ = X~^T X~``
    (``h_q``) and ``C = X^T X~`` (``cross``) over the same tokens; ``lam`` is ``damp`` times the
    mean diagonal of ``H~``. With ``X~ == X`` it returns ``W``."""
    k = h_q.shape[0]
    if cross.shape != (k, k) or w.shape[1] != k:
        raise ShapeError(f"asymmetric target: weight {list(w.shape)}, H~ {list(h_q.shape)}, C {list(cross.shape)}")
    H = h_q.double()
    diag = torch.diagonal(H)
    lam = damp * float(diag.mean()) if float(diag.mean()) > 0 else 1.0
    A = H + lam * torch.eye(k, dtype=H.dtype)
    delta = (cross.double() - H)  # (X - X~)^T X~
    # W delta A^-1 = (A^-1 delta^T W^T)^T, A symmetric positive definite
    corr = torch.linalg.solve(A, delta.t() @ w.double().t()).t()
    return (w.double() + alpha * corr).float()
