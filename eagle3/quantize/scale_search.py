"""The data-free scale search of ``--method mse``: scales chosen by their squared error against the
source values (each input channel's error weighted by its importance, when one is known), elements
rounded to nearest within them. Vectorised over a block of rows; what it costs is in docs/recipes.md.

INT4 per output channel (W4A8's INT4 stage, ``int4`` per_channel). Round to nearest takes the step
``amax / 7.5``, which is rarely the best one: the source is Moonshot's INT4 with a scale per 32
inputs, so a row of 7168 inputs holds 224 groups of different ranges, and one step for all of them
trades the largest values' clipping error against every other value's rounding error. Per row, the
search

1. screens clip ratios ``r`` (step ``r * amax / 7.5``, :data:`CLIP_RATIOS`: 0.2 to 7.5/7, where the
   largest positive value lands exactly on code 7) on a strided subset of about
   :data:`SCREEN_COLUMNS` columns (the error is a sum over columns; the subset ranks the ratios);
2. measures on every column the step of round to nearest (``r = 1``), the two best screened ratios
   and their half-way neighbours, and keeps the best;
3. refits the step to the kept codes by least squares (``sum(w x q) / sum(w q^2)``), kept if the
   error drops.

So the kept step is never worse than round to nearest's by the search's own measure. In W4A8 the
step is the product of the INT4 stage's ``weight_scale_2`` and the per-tensor FP8 stage's
``weight_scale``: every loader multiplies the two (vLLM folds ``scale_2 *= scale`` at load), so the
search picks the product, keeps the FP8 stage's scale as round to nearest takes it (the weight's
amax / 448) and stores ``weight_scale_2 = step / weight_scale``; the codes are rounded against the
source directly (once), not through the FP8 stage's values (twice).

With a data-free model of a weight's inputs (a routed expert's ``down_proj``:
:mod:`eagle3.quantize.expert_inputs`), :func:`int4_mean_feedback` then rounds within the chosen steps
with error feedback for the inputs' mean (GPTQ for a diagonal-plus-rank-one Hessian, in ``O(N K)``).

MXFP4: each block of 32 has a power-of-two scale; Quark's ``even`` rule already rounds the block's
max up before taking its exponent, so besides it only its two neighbours are sensible. The search
keeps, per block, the one of the three with the smallest (weighted) squared error, the ``even``
exponent on ties.
"""

from __future__ import annotations

import numpy as np
import torch

from eagle3.formats import codecs

INT4_HALF_RANGE = codecs.INT4_HALF_RANGE  # round to nearest's step is amax / 7.5 (Quark's symmetric INT4)
CLIP_LO, CLIP_HI = 0.2, 7.5 / 7.0
N_COARSE = 9  # screened first, geometric from CLIP_HI down to CLIP_LO (steps of ~23%)
FINE = (-2 / 3, -1 / 3, 1 / 3, 2 / 3)  # then around the best one, in coarse steps: ~7% apart
COARSE_STEP = (CLIP_HI / CLIP_LO) ** (1 / (N_COARSE - 1))
COARSE_RATIOS = [CLIP_HI / COARSE_STEP ** i for i in range(N_COARSE)]
SCREEN_COLUMNS = 512
BLOCK_ELEMENTS = 1 << 16
_TINY = torch.finfo(torch.float32).tiny
FEEDBACK_DAMP = 0.01  # int4_mean_feedback: added to H's diagonal, as a fraction of its mean (GPTQ's default)


def int4_per_channel(x: torch.Tensor, importance: torch.Tensor | None = None,
                     s1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 per-output-channel codes (int8 [R, K], in [-8, 7]) and scales (fp32 [R]) of rows ``x``.

    ``s1`` (W4A8): the FP8 stage's per-tensor scale; the scale returned is then ``weight_scale_2``
    (step / s1), and the codes are rounded against ``weight_scale_2 * s1``, the product loaders
    dequantize with. ``importance`` [K]: each input channel's weight in the squared error."""
    xf = x.float()
    r, k = xf.shape
    w = None if importance is None else importance.float().reshape(k)
    amax = xf.abs().amax(dim=1)
    base = torch.where(amax > 0, amax / INT4_HALF_RANGE, torch.ones_like(amax))
    ratio = _screen(xf, w, base)
    codes = torch.empty(r, k, dtype=torch.int8)
    scale = torch.empty(r)
    # Blocks of rows of about BLOCK_ELEMENTS: the buffers of these multi-pass loops then stay in the
    # core's cache (2-3x faster than over the engine's 2 MB chunks).
    rows = max(1, BLOCK_ELEMENTS // max(k, 1))
    for r0 in range(0, r, rows):
        sl = slice(r0, r0 + rows)
        codes[sl], scale[sl] = _measure_block(xf[sl], w, base[sl], ratio[sl], s1)
    return codes, scale


def _stored(step: torch.Tensor, s1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scale a checkpoint stores, the step loaders dequantize with) for a wanted ``step``."""
    step = step.clamp(min=_TINY)
    if s1 is None:
        return step, step
    s2 = (step / s1.float()).clamp_(min=_TINY)
    return s2, s2 * s1.float()


class _Terms:
    """Codes of rows for a step and the sums their squared error is made of."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor | None) -> None:
        self.x, self.w = x, w
        self.xw = x if w is None else x * w
        self.tmp = torch.empty_like(x)  # the products summed below: one buffer, no allocation per call

    def __call__(self, step: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``codes = clamp(round(x / step))`` (written in place); returns ``sum(w (x - step q)^2) -
        sum(w x^2)`` per row (``step (step B - 2 A)``) and ``A = sum(w x q)``, ``B = sum(w q^2)``."""
        torch.div(self.x, step[:, None], out=codes)
        codes.round_().clamp_(codecs.INT4_MIN, codecs.INT4_MAX)
        a = torch.mul(self.xw, codes, out=self.tmp).sum(dim=1)
        sq = torch.mul(codes, codes, out=self.tmp)
        b = sq.sum(dim=1) if self.w is None else sq @ self.w
        return (step * (step * b - 2 * a)).nan_to_num_(nan=float("inf")), a, b


def _measure_block(x: torch.Tensor, w: torch.Tensor | None, base: torch.Tensor, ratio: torch.Tensor,
                   s1: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """On every column: round to nearest's step (``base``), the screened ``ratio`` of it, then the
    least-squares refit of the better one; the best of the three per row -> (codes, stored scale)."""
    terms = _Terms(x, w)
    kept, alt = torch.empty_like(x), torch.empty_like(x)
    scale, step = _stored(base, s1)
    err, a, b = terms(step, kept)
    for refit in (False, True):
        # the refit: the least-squares step of the kept codes, the minimum of step^2 B - 2 step A
        want = torch.where(b > 0, a / b.clamp(min=_TINY), step) if refit else base * ratio
        s_new, step_new = _stored(want, s1)
        e_new, a_new, b_new = terms(step_new, alt)
        better = e_new < err
        rows = torch.nonzero(better).reshape(-1)
        if rows.numel():
            kept.index_copy_(0, rows, alt.index_select(0, rows))
            err, a, b = torch.where(better, e_new, err), torch.where(better, a_new, a), torch.where(better, b_new, b)
            scale, step = torch.where(better, s_new, scale), torch.where(better, step_new, step)
    return kept.to(torch.int8), scale


def _screen(x: torch.Tensor, w: torch.Tensor | None, base: torch.Tensor) -> torch.Tensor:
    """The clip ratio with the smallest error on a strided subset of about :data:`SCREEN_COLUMNS`
    columns of ``x``: the best of :data:`COARSE_RATIOS`, then of it and :data:`FINE` around it -> [R]."""
    k = x.shape[1]
    stride = max(1, k // SCREEN_COLUMNS)
    xs = x[:, ::stride].contiguous() if stride > 1 else x
    ws = None if w is None else (w[::stride].contiguous() if stride > 1 else w)
    terms = _Terms(xs, ws)
    buf = torch.empty_like(xs)
    coarse = torch.tensor(COARSE_RATIOS)
    errs = torch.stack([terms((base * c).clamp_(min=_TINY), buf)[0] for c in COARSE_RATIOS], 1)
    best_err, i = errs.min(dim=1)
    best = coarse[i]
    for f in FINE:
        c = coarse[i] * COARSE_STEP ** f
        e = terms((base * c).clamp_(min=_TINY), buf)[0]
        better = e < best_err
        best_err, best = torch.where(better, e, best_err), torch.where(better, c, best)
    return best


MX_BLOCK = codecs.MXFP4_BLOCK


def mxfp4_exponents(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Per 32-block of rows ``x`` [R, K]: the exponent (int32 [R, K/32]) among Quark's ``even``
    exponent and its two neighbours whose E2M1 rounding has the smallest squared error (each input
    weighted by ``importance`` [K]); the ``even`` exponent wins ties.

    The block divided by ``2**even`` is computed once; the neighbours' quotients are it times 2 and
    times 1/2 (exact), and their errors, in units of ``4**even``, are scaled by 4 and 1/4 (exact)."""
    r, k = x.shape
    blocks = x.float().reshape(r, k // MX_BLOCK, MX_BLOCK)
    even = codecs.mxfp4_scale_even(blocks.abs().amax(-1)).clamp_(-126, 127)
    w = None if importance is None else importance.float().reshape(1, k // MX_BLOCK, MX_BLOCK)
    y = blocks * torch.exp2(-even.float()).unsqueeze(-1)  # exact powers of two
    best, best_err = even, None
    for d in (0, -1, 1):
        yd = y if d == 0 else y * 2.0 ** -d
        diff = codecs.e2m1_round(yd).sub_(yd).square_()
        err = (diff if w is None else diff.mul_(w)).sum(-1).mul_(4.0 ** d).nan_to_num_(nan=float("inf"))
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, (even + d).clamp_(-126, 127), best)
    return best


def int4_mean_feedback(w: torch.Tensor, mean: torch.Tensor, square: torch.Tensor, s1: torch.Tensor,
                       s2: torch.Tensor, damp: float = FEEDBACK_DAMP) -> torch.Tensor:
    """INT4 codes (int8 [N, K]) of rows ``w`` on W4A8's grid ``(q * s2[n]) * s1`` (the scales fixed,
    as :class:`eagle3.quantize.calibrate.grids.W4A8Grid` decodes them), GPTQ for ``H = diag(E[x^2] -
    E[x]^2) + E[x] E[x]^T`` for the inputs' per-channel ``mean`` and ``square`` (fp32 [K]): each column,
    in GPTQ's activation order, rounded from its source value shifted to cancel the running ``sum mu_j
    (w_j - value_j)`` of the columns already rounded; why this is GPTQ's result for that ``H``, and
    where the moments come from: :mod:`eagle3.quantize.expert_inputs`."""
    n, k = w.shape
    mu = mean.double()
    var = (square.double() - mu * mu).clamp(min=0)
    h_diag = var + mu * mu
    mean_diag = float(h_diag.mean())
    var += damp * mean_diag if mean_diag > 0 else 1.0
    order = torch.argsort(h_diag, descending=True, stable=True)
    remaining = (mu * mu / var)[order].flip(0).cumsum(0).flip(0)  # sum of mu^2 / D over columns not yet rounded
    gain = ((mu / var)[order] / (1 + remaining)).float().tolist()  # how much of the running shift a column takes
    mus = mu[order].float().tolist()
    # The column steps in NumPy: a handful of ops on N values each, K times per row chunk, where
    # torch's per-op dispatch (several microseconds) would cost 3-4x the arithmetic.
    s1f = np.float32(s1.float().item())
    s2f = s2.float().numpy()
    step = s2f * s1f  # the grid step of each row, as W4A8Grid rounds with it
    wt = w.float().t().contiguous().numpy()  # [K, N]: a column of w is a contiguous row here
    codes = np.empty((k, n), dtype=np.int8)
    shift = np.zeros(n, dtype=np.float32)  # per row: sum of mu_j * (w_j - value_j) over the rounded columns
    c, v = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)  # no allocation per column
    for i, j in enumerate(order.tolist()):
        np.multiply(shift, np.float32(gain[i]), out=v)
        np.add(wt[j], v, out=v)
        np.divide(v, step, out=c)
        np.clip(np.rint(c, out=c), codecs.INT4_MIN, codecs.INT4_MAX, out=c)
        codes[j] = c
        np.multiply(c, s2f, out=v)
        np.multiply(v, s1f, out=v)  # the decoded value, in the codec's product order
        np.subtract(wt[j], v, out=v)
        np.multiply(v, np.float32(mus[i]), out=v)
        np.add(shift, v, out=shift)
    return torch.from_numpy(codes.T.copy())
