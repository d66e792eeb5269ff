"""W4A8's data-free rounding of a routed expert's ``down_proj`` (``eagle3.quantize.expert_inputs``):
the modelled input moments against Monte-Carlo inputs through the expert's own ``gate_proj`` /
``up_proj``, the closed-form feedback against the general GPTQ solver on the same Hessian, and the
output error on fresh sampled inputs."""

from __future__ import annotations

import torch

from eagle3.formats import codecs
from eagle3.quantize import methods
from eagle3.quantize.calibrate import gptq, grids
from eagle3.quantize.expert_inputs import swiglu_moments
from eagle3.quantize.recipes import load_recipe
from eagle3.quantize.scale_search import int4_mean_feedback, int4_per_channel


def _expert_inputs(gate: torch.Tensor, up: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``a = silu(x G^T) * (x U^T)`` for ``n`` inputs ``x ~ N(0, I)`` (float64 [n, K])."""
    x = torch.randn(n, gate.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.silu(x @ gate.double().T) * (x @ up.double().T)


def _lattice(w: torch.Tensor) -> torch.Tensor:
    """``w`` on Moonshot's INT4 group-32 lattice (what a Kimi source's experts decode to)."""
    rows, k = w.shape
    packed, scale = codecs.ct_int4_quantize(w.bfloat16(), 32)
    return codecs.ct_int4_dequantize(packed, scale, (rows, k), dtype=torch.float32)


def _expert(k: int, d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) on the INT4 lattice. A trained expert's gate and up rows are correlated
    (``E[a]`` is not 0), which i.i.d. random rows are not: then there is no mean to feed back."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(k, d, generator=g) * 0.1
    up = 1.0 * gate + torch.randn(k, d, generator=g) * 0.05
    return _lattice(gate), _lattice(up), _lattice(torch.randn(n, k, generator=g) * 0.05)


def test_moments_match_monte_carlo() -> None:
    g = torch.Generator().manual_seed(0)
    k, d = 32, 48
    for std in (0.05, 0.15, 0.4):  # pre-activations from silu's near-quadratic to its near-linear range
        gate = torch.randn(k, d, generator=g) * std
        up = 0.5 * gate + torch.randn(k, d, generator=g) * std
        mo = swiglu_moments(gate, up)
        a = _expert_inputs(gate, up, 400_000, seed=1)
        mean, square = a.mean(0), a.square().mean(0)
        scale = square.sqrt()  # the mean's error relative to the channel's RMS (a mean can be ~0)
        assert float(((mo.mean - mean) / scale).abs().max()) < 0.01, std
        rel = ((mo.square - square) / square).abs()  # E[a^4] is heavy: the estimate's own noise is ~1 %
        assert float(rel.mean()) < 0.015 and float(rel.max()) < 0.05, std


def test_closed_form_feedback_is_gptq_for_its_hessian() -> None:
    gate, up, down = _expert(64, 96, 80, seed=2)
    mo = swiglu_moments(gate, up)
    s1 = codecs.fp8_per_tensor_scale(down.abs().amax(), torch.float32)
    _, s2 = int4_per_channel(down, None, s1)
    h = torch.outer(mo.mean, mo.mean)
    h.diagonal().copy_(mo.square)  # E[a a^T] with the off-diagonal covariances dropped
    ref = gptq.gptq(down, gptq.factor(h, act_order=True), grids.W4A8Grid(s1, s2)).codes
    codes = int4_mean_feedback(down, mo.mean, mo.square, s1, s2)
    assert codes.dtype == torch.int8 and codes.shape == down.shape
    # the same sequence of roundings; float rounding of the two formulas may flip a tie
    assert float((codes != ref).float().mean()) < 1e-3


def test_down_proj_with_mean_feedback_has_less_output_error() -> None:
    d, k, n = 96, 64, 96  # hidden, intermediate, down's outputs
    gate, up, down = _expert(k, d, n, seed=3)
    spec = load_recipe("w4a8").weight
    s1 = codecs.fp8_per_tensor_scale(down.abs().amax(), torch.float32)
    a = _expert_inputs(gate, up, 20_000, seed=4)  # fresh inputs, not a model of them

    def output_error(inputs: methods.InputStats) -> float:
        t = methods.METHODS["mse"].rows(down, methods.RowsContext(spec, (n, k), s1, inputs))
        q = codecs.w4a8_dequantize(t["weight"], s1, t["weight_scale_2"], k)
        return float((a @ (down - q).double().T).square().mean())

    plain = output_error(methods.NO_STATS)
    fed_back = output_error(methods.InputStats(moments=swiglu_moments(gate, up)))
    assert fed_back < 0.93 * plain, (fed_back, plain)  # 0.86x here
