"""The calibrated solvers on tiny synthetic weights: GPTQ against round to nearest, the GPTAQ target,
smoothing, the fallback, and the export layout against the native engine's decoder."""

from __future__ import annotations

import pytest
import torch

from eagle3.quantize import native
from eagle3.quantize.calibrate import gptq as solvers
from eagle3.quantize.calibrate import grids, smooth, solve
from eagle3.quantize.calibrate.methods import CalibConfig, act_qdq
from eagle3.quantize.calibrate.mlp import solve_mlp
from eagle3.quantize.recipes import WeightSpec
from eagle3.quantize.sources import DenseRows

FORMATS = ("fp8_int4", "mxfp4")
SPECS = {"fp8_int4": WeightSpec("fp8_int4", "per_channel"), "mxfp4": WeightSpec("mxfp4", "per_group", 32)}


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with a few dominant, correlated directions and uneven channel scales (what makes
    error feedback pay: rounding errors can be moved where the inputs are small)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, k // 4, generator=g, dtype=torch.float64)
    mix = torch.randn(k // 4, k, generator=g, dtype=torch.float64)
    scale = torch.exp(torch.randn(k, generator=g, dtype=torch.float64))
    return (z @ mix + 0.05 * torch.randn(t, k, generator=g, dtype=torch.float64)) * scale


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02


def _out_err(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x @ w.double().t() - x @ q.double().t()).norm())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_cuts_the_layer_output_error_against_round_to_nearest(fmt: str, act_order: bool) -> None:
    x = _correlated_inputs(512, 128, seed=1)
    w = _weight(48, 128, seed=2)
    h = x.t() @ x
    grid = grids.grid_for(fmt, w, "max")  # the same fixed scales for both
    e_rtn = _out_err(x, w, solvers.rtn(w, grid).values)
    e_gptq = _out_err(x, w, solvers.gptq(w, solvers.factor(h, act_order=act_order), grid, block=32).values)
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_an_identity_hessian_is_round_to_nearest(fmt: str, act_order: bool) -> None:
    w = _weight(16, 96, seed=3)
    grid = grids.grid_for(fmt, w)
    got = solvers.gptq(w, solvers.factor(torch.eye(96), act_order=act_order), grid, block=32)
    want = solvers.rtn(w, grid)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.values, want.values)


@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_no_input_reached_keep_their_rounded_values(fmt: str) -> None:
    x = _correlated_inputs(256, 64, seed=4)
    dead = torch.tensor([3, 17, 40, 63])
    x[:, dead] = 0.0
    w = _weight(16, 64, seed=5)
    grid = grids.grid_for(fmt, w)
    got = solvers.gptq(w, solvers.factor(x.t() @ x, act_order=True), grid, block=16)
    rtn = solvers.rtn(w, grid)
    assert torch.equal(got.values[:, dead], rtn.values[:, dead])
    assert bool((got.values[:, dead] != 0).any())  # not zeroed, as Quark's GPTQ would


def test_hessian_factor_is_the_cholesky_of_the_damped_inverse() -> None:
    x = _correlated_inputs(200, 40, seed=6)
    h = x.t() @ x
    f = solvers.factor(h, damp=0.01, dtype=torch.float64)
    lam = 0.01 * float(torch.diagonal(h).mean())
    want = torch.linalg.inv(h + lam * torch.eye(40, dtype=torch.float64))
    u = f.hinv_u.double()
    assert torch.allclose(u.t() @ u, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(u, torch.triu(u))


@pytest.mark.parametrize("fmt", FORMATS)
def test_solve_writes_the_native_engines_tensors(fmt: str) -> None:
    """The export tensors have the native engine's names, dtypes and shapes, and its decoder reads
    back exactly the values the solver fed its error back from."""
    x = _correlated_inputs(256, 64, seed=7)
    w = _weight(24, 64, seed=8)
    grid = grids.grid_for(fmt, w)
    sol = solvers.gptq(w, solvers.factor(x.t() @ x, act_order=True), grid)
    tensors = solve(w, x.t() @ x, grid, act_order=True)
    spec = SPECS[fmt]
    expected = native.expected_shapes(spec, (24, 64), zero_point=False)
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == {k: (tuple(s), d) for k, (s, d) in expected.items()}
    assert torch.equal(native.decode(tensors, spec, (24, 64)), sol.values)


def test_mxfp4_round_to_nearest_with_even_scales_is_the_native_engine() -> None:
    w = _weight(32, 128, seed=9) * torch.exp(torch.randn(1, 128))
    got = solve(w, None, grids.mxfp4_grid(w, "max"))
    want = native.NativeEngine().quantize(DenseRows(w), SPECS["mxfp4"])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_w4a8_round_to_nearest_keeps_the_native_scales_and_never_rounds_farther() -> None:
    """W4A8 with ``max`` scales: the native engine's stored scales exactly; the grid rounds once to
    the nearest ``q * s2 * s1`` where the native engine rounds through FP8 first (the FP8 step is
    a sizeable part of an INT4 step), so each value is at least as close to the source."""
    w = _weight(32, 128, seed=10)
    want = native.NativeEngine().quantize(DenseRows(w), SPECS["fp8_int4"])
    got = solve(w, None, grids.w4a8_grid(w, "max"))
    assert torch.equal(got["weight_scale"], want["weight_scale"])
    assert torch.equal(got["weight_scale_2"], want["weight_scale_2"])
    v_got, v_want = (native.decode(t, SPECS["fp8_int4"], (32, 128)) for t in (got, want))
    assert bool(((v_got - w).abs() <= (v_want - w).abs() + 1e-9).all())
    assert float((v_got == v_want).float().mean()) > 0.9


def test_mse_clipping_never_raises_a_rows_weighted_error() -> None:
    w = _weight(16, 256, seed=11)
    w[:, 5] *= 8  # an outlier column: clipping it pays for the other 255
    imp = torch.ones(256)
    for g, name in ((grids.w4a8_grid(w, "max"), "max"), (grids.w4a8_grid(w, "mse", imp), "mse")):
        err = (g.qdq(w, slice(0, 256))[0] - w).square().sum(1)
        if name == "max":
            base = err
        else:
            assert bool((err <= base * (1 + 1e-6)).all())
            assert float(err.sum()) < float(base.sum())


def test_asymmetric_target_is_the_least_squares_fit_to_quantized_inputs() -> None:
    x = _correlated_inputs(400, 32, seed=12)
    xq = x + 0.05 * torch.randn(400, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    w = _weight(8, 32, seed=14).double()
    assert torch.allclose(solvers.asymmetric_target(w.float(), x.t() @ x, x.t() @ x).double(), w, atol=1e-7)
    got = solvers.asymmetric_target(w.float(), xq.t() @ xq, x.t() @ xq, damp=0.0, alpha=1.0).double()
    want = torch.linalg.lstsq(xq, x @ w.t()).solution.t()  # min ||X W^T - X~ Q^T||
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fitting_to_the_quantized_inputs_beats_gptq_on_the_served_error(fmt: str) -> None:
    """Inputs of the served layer come from a quantized model (here: the source's plus a
    systematic error): GPTQ on the asymmetric target has a smaller error against the source's
    outputs than GPTQ fitted to the source's inputs."""
    x = _correlated_inputs(512, 64, seed=15)
    g = torch.Generator().manual_seed(16)
    xq = x @ (torch.eye(64, dtype=torch.float64) + 0.1 * torch.randn(64, 64, generator=g, dtype=torch.float64))
    w = _weight(32, 64, seed=17)

    def served(q: torch.Tensor) -> float:
        return float((x @ w.double().t() - xq @ q.double().t()).norm())

    plain = solvers.gptq(w, solvers.factor(x.t() @ x), grids.grid_for(fmt, w)).values
    target = solvers.asymmetric_target(w, xq.t() @ xq, x.t() @ xq, alpha=1.0)
    fitted = solvers.gptq(target, solvers.factor(xq.t() @ xq), grids.grid_for(fmt, target)).values
    assert served(fitted) < 0.7 * served(plain), (served(fitted), served(plain))


def _expert(h: int, i: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=dtype) * 0.1 for s in ((i, h), (i, h), (h, i)))


def test_smoothing_keeps_the_experts_output() -> None:
    """``silu(g) * (u * s)`` then ``down / s`` is the same function: in float64 within rounding for
    any positive scales (the method's default), and bit for bit for power-of-two scales."""
    wg, wu, wd = _expert(64, 96, seed=18, dtype=torch.float64)
    x = torch.randn(40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(19))
    ref = smooth.swiglu(x, wg, wu) @ wd.t()
    s_any = torch.exp(torch.randn(96, dtype=torch.float64, generator=torch.Generator().manual_seed(20)))
    u2, d2 = smooth.apply(wu, wd, s_any)
    assert torch.allclose(smooth.swiglu(x, wg, u2) @ d2.t(), ref, rtol=1e-12, atol=1e-14)
    a_max = smooth.swiglu(x, wg, wu).abs().amax(0)
    s = smooth.scales(a_max, wd, 0.5, pow2=True)
    assert bool((torch.log2(s) == torch.round(torch.log2(s))).all()) and float(s.min()) < 1 < float(s.max())
    for dt in (torch.float64, torch.float32):
        u3, d3 = smooth.apply(wu.to(dt), wd.to(dt), s.to(dt))
        xs = x.to(dt)
        assert torch.equal(smooth.swiglu(xs, wg.to(dt), u3) @ d3.t(), smooth.swiglu(xs, wg.to(dt), wu.to(dt)) @ wd.to(dt).t())


@pytest.mark.parametrize("fmt,act", [("mxfp4", "mxfp4"), ("fp8_int4", "fp8")])
def test_smoothing_is_chosen_only_when_it_lowers_the_calibration_error(fmt: str, act: str) -> None:
    wg, wu, wd = (t.float() for t in _expert(64, 96, seed=21, dtype=torch.float64))
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(22))
    x[:, 7] *= 20  # an outlier input channel makes some of down's inputs large
    q = act_qdq(act)
    sm = smooth.choose(x, wg, wu, wd, fmt, q, q)
    assert sm.errors[sm.choice] == min(sm.errors.values()) and (sm.s is None) == (sm.choice == "none")


@pytest.mark.parametrize("method", ["gptq", "gptaq", "smooth+gptq"])
def test_an_mlp_too_few_tokens_reach_keeps_its_data_free_values(method: str) -> None:
    wg, wu, wd = (t.float() for t in _expert(64, 32, seed=23, dtype=torch.float64))
    w = {"gate": wg, "up": wu, "down": wd}
    few = torch.randn(63, 64, generator=torch.Generator().manual_seed(24))  # < 1 token per input
    cfg = CalibConfig(method=method)
    q = act_qdq("mxfp4")
    r = solve_mlp(w, {"gate", "up", "down"}, few, few, "mxfp4", q, q, cfg)
    assert r.fallback and r.alpha is None
    for role in ("gate", "up", "down"):
        want = grids.grid_for("mxfp4", w[role])
        assert torch.equal(r.tensors[role]["weight"], want.native(solvers.rtn(w[role], want).codes)["weight"])
    many = torch.randn(640, 64, generator=torch.Generator().manual_seed(25))
    r2 = solve_mlp(w, {"gate", "up", "down"}, many, many, "mxfp4", q, q, cfg)
    assert not r2.fallback and r2.err < r2.err_rtn


def test_the_mxfp4_grids_mse_exponents_are_the_best_of_three_by_its_own_decode() -> None:
    """``scales="mse"`` (the data-free search's exponents): per block the best of the even rule's
    exponent and its two neighbours by the grid's own decode, weighted error, the even one on ties."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(24, 256, generator=g) * torch.exp(torch.randn(24, 256, generator=g))  # outliers in blocks
    imp = torch.rand(256, generator=g) + 0.05
    got = grids.mxfp4_grid(w, "mse", imp).exponents
    even = grids.mxfp4_grid(w, "max").exponents
    cols = slice(0, 256)

    def block_err(e: torch.Tensor) -> torch.Tensor:
        grid = grids.MXFP4Grid(e)
        return ((grid.qdq(w, cols)[0] - w).square() * imp).reshape(24, 8, 32).sum(-1)

    errs = torch.stack([block_err(even + d) for d in (0, -1, 1)])
    best = errs.amin(0)
    assert (got != even).any()  # the search moved some blocks
    assert torch.allclose(block_err(got), best, rtol=1e-5, atol=0)
    assert torch.equal(got[errs[0] == best], even[errs[0] == best])  # even wins ties
