"""One SwiGLU MLP (a routed expert, the shared experts, a dense MLP) solved from its calibration inputs.

Inputs: the three weights' fp32 source values (what the native engine would quantize), the MLP's
inputs ``x`` [n, H] on the calibration tokens that reach it (for a routed expert: the tokens routed
to it), and for ``gptaq`` the same tokens' inputs in the already-quantized model ``xq``. Gate and
up read the same input, so they share one Hessian (and its Cholesky factor); down's Hessian comes
from ``silu(gate) * up`` of those tokens.

An MLP reached by fewer than ``min_tokens_per_input * H`` tokens keeps its data-free values
(:data:`.methods.MIN_TOKENS_PER_INPUT` says why): the driver leaves it out of the store, so the
quantizer writes the recipe's data-free default for it; its reported error (and, for ``gptaq``, the
quantized stream after it) use round to nearest on the format's default grid, a close stand-in.

The result carries, besides the export tensors, the relative output error of the MLP on its
calibration tokens with the data-free values and with the method's (served numerics: weights on
the grid, activations quantized as the recipe says), which the calibration report sums per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3.quantize.calibrate import gptq as solvers
from eagle3.quantize.calibrate import smooth
from eagle3.quantize.calibrate.grids import Grid, grid_for
from eagle3.quantize.calibrate.methods import ActQdq, CalibConfig

ROLES = ("gate", "up", "down")
MAX_ERROR_TOKENS = 1024  # tokens the reported output errors are measured on (an even subsample)


@dataclass
class MLPResult:
    tensors: dict[str, dict[str, torch.Tensor]]  # role -> native export tensors (roles in scope only)
    values: dict[str, torch.Tensor]  # role -> fp32 values as served (quantized, or the source's)
    tokens: int
    fallback: bool
    alpha: float | None = None  # smoothing chosen (None: none)
    err_rtn: float = float("nan")  # relative output error with the data-free values
    err: float = float("nan")  # ... with the method's values
    stats: dict[str, float] = field(default_factory=dict)


def _gram(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a = a.to(dtype)
    return a.t() @ a


def _cross(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return a.to(dtype).t() @ b.to(dtype)


def _subsample(x: torch.Tensor, limit: int) -> torch.Tensor:
    if x.shape[0] <= limit:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, limit).round().long()]


def mlp_output(x: torch.Tensor, w: dict[str, torch.Tensor], act_in: ActQdq, act_mid: ActQdq) -> torch.Tensor:
    """``down(act_mid(silu(gate(act_in(x))) * up(act_in(x))))`` in fp32."""
    xq = act_in(x.float())
    return act_mid(smooth.swiglu(xq, w["gate"], w["up"])) @ w["down"].t()


def _rel_err(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    return float((y - y_ref).square().sum() / y_ref.square().sum().clamp(min=1e-30))


def _rtn_all(w: dict[str, torch.Tensor], fmt: str, scope: set[str]) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                                           dict[str, torch.Tensor]]:
    tensors, values = {}, {}
    for r in ROLES:
        if r in scope:
            g = grid_for(fmt, w[r])
            sol = solvers.rtn(w[r], g)
            tensors[r], values[r] = g.native(sol.codes), sol.values
        else:
            values[r] = w[r]
    return tensors, values


def solve_mlp(w: dict[str, torch.Tensor], scope: set[str], x: torch.Tensor, xq: torch.Tensor | None, fmt: str,
              act_in: ActQdq, act_mid: ActQdq, cfg: CalibConfig) -> MLPResult:
    """Solve the roles in ``scope`` of one MLP (module docstring). ``w``: role -> fp32 [out, in]."""
    n, hidden = int(x.shape[0]), int(w["gate"].shape[1])
    rtn_tensors, rtn_values = _rtn_all(w, fmt, scope)
    xe = _subsample(x.float(), MAX_ERROR_TOKENS)
    y_ref = mlp_output(xe, w, lambda t: t, lambda t: t)
    err_rtn = _rel_err(mlp_output(xe, rtn_values, act_in, act_mid), y_ref) if n else float("nan")
    if n < cfg.min_tokens_per_input * hidden:
        return MLPResult(rtn_tensors, rtn_values, n, True, err_rtn=err_rtn, err=err_rtn)
    del rtn_tensors, rtn_values  # not needed past the error: at Kimi-K2.5's width 176 MB in the solver's peak
    w = dict(w)
    alpha = None
    if cfg.smooth and {"up", "down"} <= scope:
        sm = smooth.choose(x, w["gate"], w["up"], w["down"], fmt, act_in, act_mid, pow2=cfg.smooth_pow2)
        if sm.s is not None:
            w["up"], w["down"] = smooth.apply(w["up"], w["down"], sm.s)
            alpha = sm.alpha
    if cfg.solver == "rtn":
        tensors, values = _rtn_all(w, fmt, scope)
    else:
        tensors, values = _solve_error_feedback(w, scope, x, xq, fmt, act_in, act_mid, cfg)
    err = _rel_err(mlp_output(xe, values, act_in, act_mid), y_ref)
    return MLPResult(tensors, values, n, False, alpha, err_rtn, err)


def _solve_weight(wt: torch.Tensor, f: solvers.HessianFactor, h_diag: torch.Tensor, fmt: str,
                  cfg: CalibConfig) -> tuple[Grid, solvers.Solution]:
    g = grid_for(fmt, wt, cfg.scales, importance=h_diag)
    return g, solvers.gptq(wt, f, g, cfg.block)


def _solve_error_feedback(w: dict[str, torch.Tensor], scope: set[str], x: torch.Tensor, xq: torch.Tensor | None,
                          fmt: str, act_in: ActQdq, act_mid: ActQdq,
                          cfg: CalibConfig) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    dt = cfg.hessian_dtype
    xs = x.float()
    asym = cfg.solver == "gptaq"
    if asym:
        if xq is None:
            raise ValueError("gptaq needs the quantized model's inputs")
        xt = act_in(xq.float())  # what the served kernel multiplies
        h = _gram(xt, dt)
    else:
        xt = xs
        h = _gram(xs, dt)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    values: dict[str, torch.Tensor] = {}
    if {"gate", "up"} & scope:
        f = solvers.factor(h, cfg.damp, cfg.act_order, cfg.factor_dtype)
        cross = _cross(xs, xt, dt) if asym else None
        for r in ("gate", "up"):
            if r not in scope:
                values[r] = w[r]
                continue
            target = solvers.asymmetric_target(w[r], h, cross, cfg.damp, cfg.alpha) if cross is not None else w[r]
            g, sol = _solve_weight(target, f, torch.diagonal(h), fmt, cfg)
            tensors[r], values[r] = g.native(sol.codes), sol.values
        del f
    else:
        values.update(gate=w["gate"], up=w["up"])
    del h
    if "down" in scope:
        a = smooth.swiglu(xs, w["gate"], w["up"])  # the source's down input (smoothed when smoothing)
        if asym:
            at = act_mid(smooth.swiglu(xt, values["gate"], values["up"]))
            hd = _gram(at, dt)
            target = solvers.asymmetric_target(w["down"], hd, _cross(a, at, dt), cfg.damp, cfg.alpha)
        else:
            hd = _gram(a, dt)
            target = w["down"]
        fd = solvers.factor(hd, cfg.damp, cfg.act_order, cfg.factor_dtype)
        g, sol = _solve_weight(target, fd, torch.diagonal(hd), fmt, cfg)
        tensors["down"], values["down"] = g.native(sol.codes), sol.values
    else:
        values["down"] = w["down"]
    return tensors, values
