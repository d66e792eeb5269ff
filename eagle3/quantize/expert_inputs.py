"""What a routed expert's ``down_proj`` reads, modelled without data, and the rounding that uses it.

``down_proj`` reads ``a = silu(x G^T) * (x U^T)`` (``G``, ``U`` [K, d]: the same expert's
``gate_proj`` and ``up_proj``). Its intermediate channels do not average to zero: ``a_k`` has a mean
``mu_k`` (from the correlation of gate row ``k`` with up row ``k``), so a row's rounding errors
``delta`` [K] shift that output on every token by ``delta . mu``, on top of the per-token noise. The
data-free rounding here keeps that shift near zero: it is GPTQ (sequential rounding with error
feedback, arXiv 2210.17323) for the input second moments ``H = diag(var) + mu mu^T``, whose rank-one
part makes the feedback cheap.

**The model of the inputs.** ``x ~ N(0, I_d)`` (an RMSNorm's output has unit mean square per
channel; the norm's own weight was measured no help, docs/recipes.md). Then ``(p, q) = (g_k . x,
u_k . x)`` is bivariate Gaussian and, since ``q`` given ``p`` is Gaussian,
``mu_k = E[silu(p) q] = (c / s^2) E[silu(p) p]`` and ``E[a_k^2] = E[silu(p)^2 (c^2 p^2 / s^4 + |u|^2 -
c^2 / s^2)]`` (``s^2 = |g_k|^2``, ``c = g_k . u_k``) are 1-D Gaussian integrals, by Gauss-Hermite
quadrature: ``O(K d)`` for the row norms and dot products, no sampling.

**The rounding.** For ``H = D + mu mu^T`` (``D = diag(E[a^2] - mu^2)`` plus GPTQ's damping) the
optimum of the columns not yet rounded, given the rounded ones, has a closed form: with ``s = sum
mu_j delta_j`` over the rounded columns (per row), each remaining column's value is its source value
plus ``(mu_j / D_j) s / (1 + sum_remaining mu_l^2 / D_l)``. Rounding column after column to that
value is exactly GPTQ's result for this ``H`` (GPTQ's update *is* that conditional optimum), in
``O(N K)`` instead of GPTQ's ``O(N K^2)`` and without its ``K x K`` factorisations. Columns go in
GPTQ's activation order (largest ``H[j, j]`` first) on W4A8's grid with the scales the scale
search chose (:func:`eagle3.quantize.scale_search.int4_mean_feedback`).

What it buys and what was tried beside it (the full ``E[a a^T]`` to second order in the rows'
cross-covariances; a first-order one): docs/recipes.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from eagle3.checkpoint import CheckpointReader
from eagle3.formats import keys
from eagle3.quantize.methods import NO_STATS, InputStats
from eagle3.quantize.native import chunk_rows
from eagle3.quantize.sources import SourceInfo, find_modules, open_rows

DOWN, GATE, UP = "down_proj", "gate_proj", "up_proj"
QUADRATURE_NODES = 64  # probabilists' Gauss-Hermite; the integrands are smooth and polynomially bounded


@dataclass(frozen=True)
class InputMoments:
    """Per input channel of a weight: ``mean = E[x_k]`` and ``square = E[x_k^2]`` (fp32 [K])."""

    mean: torch.Tensor
    square: torch.Tensor


def swiglu_moments(gate: torch.Tensor, up: torch.Tensor) -> InputMoments:
    """``E[a]`` and ``E[a^2]`` of ``a = silu(x G^T) * (x U^T)``, ``x ~ N(0, I)`` (module docstring)."""
    g, u = gate.float(), up.float()
    return moments_from_dots(*_row_dots(g, u))


def _row_dots(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ``|g|^2``, ``|u|^2``, ``g . u`` (float64)."""
    return tuple(torch.linalg.vecdot(x, y).double() for x, y in ((g, g), (u, u), (g, u)))  # type: ignore[return-value]


@functools.cache
def _quadrature() -> tuple[torch.Tensor, torch.Tensor]:
    nodes, weights = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)
    return torch.from_numpy(nodes), torch.from_numpy(weights / np.sqrt(2 * np.pi))


def moments_from_dots(var_p: torch.Tensor, var_q: torch.Tensor, cov: torch.Tensor) -> InputMoments:
    """:func:`swiglu_moments` from each row pair's ``|g|^2``, ``|u|^2`` and ``g . u`` alone."""
    z, w = _quadrature()
    slope = torch.where(var_p > 0, cov / var_p.clamp(min=1e-300), torch.zeros_like(cov))  # E[q | p] = slope p
    resid = (var_q - slope * cov).clamp(min=0)  # Var[q | p]
    p = var_p.sqrt()[:, None] * z[None, :]
    f = torch.nn.functional.silu(p)
    mean = slope * ((f * p) @ w)
    square = (f * f * (slope[:, None] ** 2 * p * p + resid[:, None])) @ w
    return InputMoments(mean.float(), square.float())


class ExpertInputs:
    """``input_stats`` of the data-free default (``quantize(..., input_stats=)``): a routed expert's
    ``down_proj`` gets the :func:`swiglu_moments` of its inputs, from the source's ``gate_proj`` /
    ``up_proj`` of the same expert (read again: the file-to-file pass holds one module at a time);
    every other module gets nothing."""

    def __init__(self, reader: CheckpointReader, source: SourceInfo) -> None:
        self.reader = reader
        self.modules = find_modules(reader, source)

    def __call__(self, name: str) -> InputStats:
        if keys.expert_index(name) is None or not name.endswith(DOWN):
            return NO_STATS
        base = name[: -len(DOWN)]
        down, gate, up = (self.modules.get(base + p) for p in (DOWN, GATE, UP))
        if down is None or gate is None or up is None or gate.shape != up.shape or gate.shape[0] != down.shape[1]:
            return NO_STATS  # not a SwiGLU expert eagle3 can read: the searched step, rounded to nearest
        g, u = open_rows(self.reader, gate), open_rows(self.reader, up)
        k, step = gate.shape[0], chunk_rows(*gate.shape)  # row chunks: buffers the allocator reuses
        dots = [_row_dots(g.rows(r0, min(r0 + step, k)), u.rows(r0, min(r0 + step, k))) for r0 in range(0, k, step)]
        moments = moments_from_dots(*(torch.cat(parts) for parts in zip(*dots, strict=True)))
        return InputStats(moments=moments, source="expert model")
