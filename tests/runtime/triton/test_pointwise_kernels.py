"""RMSNorm (+ residual), rotary and per-token activation quantization against the torch reference.

Compute dtypes fp32 and fp16 (the interpreter's bf16 is broken, see kernels/triton/common.py;
bf16 runs through the interpreter shim and is checked too). Integer outputs are compared bit for
bit; float tolerances are written next to each check with the reason.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime.config import RopeSpec  # noqa: E402
from eagle3.runtime.kernels import torch_ref  # noqa: E402
from eagle3.runtime.kernels.triton import act_quant, rmsnorm, rotary  # noqa: E402
from eagle3.runtime.layers.rotary import RotaryEmbedding  # noqa: E402

REF = torch_ref.TorchBackend()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on CPU


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 128])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    x = _randn(37, hidden, dtype=dtype) * 3
    w = _randn(hidden, dtype=dtype, seed=1)
    res = _randn(37, hidden, dtype=dtype, seed=2)
    got = rmsnorm.rms_norm(x, w, 1e-6)[0]
    want = REF.rms_norm(x, w, 1e-6)
    # fp32: the sum of squares is a tree reduction in the kernel and a vectorised one in torch,
    # which may differ in the last bit of rstd -> 2 ulp of the output. fp16/bf16: the result is
    # rounded to 8-11 bits after the fp32 math, so it matches exactly except where that last bit
    # of rstd sits on a rounding boundary (1 ulp of the output dtype).
    tol = {torch.float32: 2.4e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    y, summed = rmsnorm.rms_norm(x, w, 1e-6, res)
    assert summed is not None and torch.equal(summed, x + res)  # the add is one rounding, as torch's
    torch.testing.assert_close(y, REF.rms_norm(x + res, w, 1e-6), rtol=tol, atol=tol)


def test_rms_norm_rows_are_batch_invariant() -> None:
    x = _randn(40, 96, dtype=torch.float32)
    w = _randn(96, dtype=torch.float32, seed=1)
    full = rmsnorm.rms_norm(x, w, 1e-5)[0]
    for lo, hi in [(0, 1), (3, 4), (5, 22), (17, 40)]:
        assert torch.equal(rmsnorm.rms_norm(x[lo:hi], w, 1e-5)[0], full[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_rms_norm_quant_equals_the_unfused_pair(dtype: torch.dtype, quant: str) -> None:
    """RMSNorm (+ residual) fused with the per-token quantization: the normed rows, the residual
    sum, the codes and the scales bit for bit those of rms_norm then act_quant; rows batch invariant."""
    x = _randn(37, 96, dtype=dtype) * 3
    w = _randn(96, dtype=dtype, seed=1)
    res = _randn(37, 96, dtype=dtype, seed=2)
    x[5] = 0  # a zero row: scale 1
    res[5] = 0
    unfused = act_quant.quantize_int8_per_token if quant == "int8" else act_quant.quantize_fp8_per_token
    for r in (None, res):
        y, summed, q, s = rmsnorm.rms_norm_quant(x, w, 1e-6, quant, r)
        y_ref, summed_ref = rmsnorm.rms_norm(x, w, 1e-6, r)
        q_ref, s_ref = unfused(y_ref)
        assert y.dtype == dtype and torch.equal(y, y_ref)
        assert (summed is None) == (r is None) and (r is None or torch.equal(summed, summed_ref))
        assert q.dtype == q_ref.dtype and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref) and s[5] == 1
    for lo, hi in [(0, 1), (5, 6), (17, 30)]:  # a row's codes alone and in any batch
        _, _, q1, s1 = rmsnorm.rms_norm_quant(x[lo:hi], w, 1e-6, quant, res[lo:hi])
        assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)[lo:hi]) and torch.equal(s1, s[lo:hi])


def _yarn(dim: int, interleaved: bool) -> RotaryEmbedding:
    """Kimi's YaRN settings (factor 64, mscale 1/1), the cos/sin from the runtime's module."""
    spec = RopeSpec(dim=dim, theta=50000.0, interleaved=interleaved, kind="yarn", factor=64.0,
                    original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    return RotaryEmbedding(spec, REF)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rope_matches_reference(dtype: torch.dtype, interleaved: bool) -> None:
    rot = _yarn(64, interleaved)
    pos = torch.tensor([0, 1, 7, 300, 4095, 4096, 9000, 163839])
    cos, sin = (t.to(DEVICE) for t in rot.cos_sin(pos, dtype))
    x = _randn(8, 5, 64, dtype=dtype)
    x_strided = torch.cat([x, x], dim=-1)[..., :64]  # a non-contiguous head view, as the models pass
    got = rotary.apply_rope(x_strided, cos, sin, interleaved)
    want = REF.rope(x, cos, sin, interleaved)
    if DEVICE.type == "cuda" and dtype == torch.bfloat16:
        # compiled bf16 arithmetic may skip torch's per-op rounding: 1 bf16 ulp (unverified on GPU)
        torch.testing.assert_close(got, want, rtol=7.9e-3, atol=7.9e-3)
    else:
        # every product and sum is rounded to the dtype in torch's order (no FMA contraction; bf16
        # under the interpreter by explicit rounding of the widened values): exact
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int8_act_quant_is_bit_exact(dtype: torch.dtype) -> None:
    x = _randn(33, 200, dtype=dtype) * 5
    x[3] = 0  # all-zero row: scale 1
    x[4, :] = torch.arange(200, dtype=torch.float32).to(DEVICE, dtype) - 100  # halfway cases after / scale
    x[5, :] = 127 * torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5] * 40).to(DEVICE, dtype) / 127  # ties to even
    x[5, 0] = 127
    q, s = act_quant.quantize_int8_per_token(x)
    q_ref, s_ref = torch_ref.quantize_int8_per_token(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref)
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp8_act_quant_is_bit_exact(dtype: torch.dtype) -> None:
    x = _randn(33, 200, dtype=dtype) * 3
    x[3] = 0
    x[6] = (torch.logspace(-12, 2, 200) * torch.tensor([1.0, -1.0] * 100)).to(DEVICE, dtype)  # subnormals
    q, s = act_quant.quantize_fp8_per_token(x)
    q_ref, s_ref = torch_ref.quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


def test_act_quant_rows_are_batch_invariant() -> None:
    x = _randn(20, 64, dtype=torch.float32)
    for fn in (act_quant.quantize_int8_per_token, act_quant.quantize_fp8_per_token):
        q, s = fn(x)
        q1, s1 = fn(x[7:9])
        assert torch.equal(q1.view(torch.uint8), q[7:9].view(torch.uint8)) and torch.equal(s1, s[7:9])
