"""Weight-only smoothing of a SwiGLU expert: rescale ``up``'s rows and ``down``'s columns.

``down(silu(gate(x)) * up(x))`` is unchanged when row ``i`` of ``up`` is multiplied by ``s_i > 0`` and
column ``i`` of ``down`` divided by it: ``silu(g) * (u * s)`` then ``down / s``. Nothing is added to
the model (no new tensor, no runtime op), so the export format is kept. What changes is how the
two weights and the activation between them quantize: ``down``'s input ``a = silu(g) * u`` becomes
``a * s``, ``down``'s columns ``d / s``. The scales follow SmoothQuant's rule (Xiao et al., arXiv
2211.10438, the rule Quark's ``smooth`` applies to a per-expert up -> down pair),
``s_i = max|d_i|^(1 - alpha) / max|a_i|^alpha`` (``max|a_i|`` over the calibration tokens routed to
the expert): large activations are scaled down (what an MXFP4 activation block cares about), the
columns of ``down`` they multiply scaled up, so that those columns round more finely relative to
the rest of their row.

Every scale is rounded to a power of two: multiplying by ``2**k`` commutes with floating-point
rounding, so the smoothed expert computes the *same bits* as the source in bf16 and fp32 (not only
the same function in exact arithmetic), and an MXFP4 row of ``up`` only shifts its block exponents.

``alpha`` is chosen per expert from :data:`ALPHAS` (and "no smoothing") by the expert's output error
on its calibration tokens after round-to-nearest quantization of the three weights and the recipe's
activation quantization: the choice that is best on the calibration data, never worse than none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle3.quantize.calibrate.grids import grid_for

ALPHAS = (0.25, 0.5, 0.75)
STATS = ("rms", "max")  # the activation statistic a scale is computed from
MAX_SCORE_TOKENS = 1024  # tokens the alpha choice is scored on (an even subsample beyond that)
_EPS = 1e-12

ActQuant = Callable[[torch.Tensor], torch.Tensor]


def swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)``: the input of ``down``."""
    return torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())


def scales(a_stat: torch.Tensor, wd: torch.Tensor, alpha: float, pow2: bool = False) -> torch.Tensor:
    """Smoothing scales ``s`` [I] from a per-channel statistic of the activations ``a`` (their max
    or root mean square, ``[I]``) and ``down`` ``wd`` [H, I] (module docstring), normalised to a
    geometric mean of 1; ``pow2``: rounded to powers of two."""
    w_max = wd.abs().amax(0).double().clamp(min=_EPS)
    a_max = a_stat.double().clamp(min=_EPS)
    log_s = (1 - alpha) * torch.log2(w_max) - alpha * torch.log2(a_max)
    log_s = log_s - log_s.mean()
    return torch.exp2(torch.round(log_s) if pow2 else log_s).float()


def apply(wu: torch.Tensor, wd: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(up * s[:, None], down / s[None, :])``."""
    return wu * s[:, None], wd / s[None, :]


def _subsample(x: torch.Tensor, limit: int) -> torch.Tensor:
    if x.shape[0] <= limit:
        return x
    idx = torch.linspace(0, x.shape[0] - 1, limit).round().long()
    return x[idx]


def _rtn(w: torch.Tensor, fmt: str) -> torch.Tensor:
    g = grid_for(fmt, w)
    return g.qdq(w, slice(0, w.shape[1]))[0]


def expert_error(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, fmt: str,
                 act_in: ActQuant, act_mid: ActQuant, y_ref: torch.Tensor) -> float:
    """Squared output error of the expert with its weights rounded to nearest on ``fmt``'s grid and
    its activations quantized (``act_in`` before gate/up, ``act_mid`` before down)."""
    xq = act_in(x)
    a = act_mid(swiglu(xq, _rtn(wg, fmt), _rtn(wu, fmt)))
    return float((a @ _rtn(wd, fmt).t() - y_ref).square().sum())


@dataclass(frozen=True)
class Smoothing:
    """The chosen scales (None: no smoothing won), its name in ``errors`` ("none" or "STAT ALPHA")
    and the calibration error of each candidate."""

    s: torch.Tensor | None
    alpha: float | None
    choice: str
    errors: dict[str, float]


def choose(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, fmt: str,
           act_in: ActQuant, act_mid: ActQuant, alphas: tuple[float, ...] = ALPHAS,
           pow2: bool = False) -> Smoothing:
    """The smoothing of one expert with the smallest quantized output error on its tokens ``x``
    [n, H] (fp32 source weights ``wg``, ``wu`` [I, H], ``wd`` [H, I]): each statistic of
    :data:`STATS` with each ``alpha``, or none."""
    xs = _subsample(x.float(), MAX_SCORE_TOKENS)
    a = swiglu(xs, wg, wu)
    y_ref = a @ wd.t()
    a_all = swiglu(x.float(), wg, wu) if x.shape[0] <= 4 * MAX_SCORE_TOKENS else a
    stats = {"rms": a_all.square().mean(0).sqrt(), "max": a_all.abs().amax(0)}
    errors = {"none": expert_error(xs, wg, wu, wd, fmt, act_in, act_mid, y_ref)}
    best: tuple[float, float | None, torch.Tensor | None, str] = (errors["none"], None, None, "none")
    for stat in STATS:
        for alpha in alphas:
            s = scales(stats[stat], wd, alpha, pow2)
            wu_s, wd_s = apply(wu, wd, s)
            key = f"{stat} {alpha:g}"
            errors[key] = expert_error(xs, wg, wu_s, wd_s, fmt, act_in, act_mid, y_ref)
            if errors[key] < best[0]:
                best = (errors[key], alpha, s, key)
    return Smoothing(best[2], best[1], best[3], errors)
