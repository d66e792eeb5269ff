"""aot_check compiles each kernel as the JIT specialises it at run time: the case descriptions'
integer arguments and pointers get the same ``tt.divisibility`` / constant-1 specialisation that
triton's JIT computes for the arguments the runtime's wrappers really pass at Kimi-K2.5's widths.

The wrappers run with their kernels replaced by recorders (nothing is launched: no interpreter
time), on Kimi's widths (hidden 7168, expert width 2048, 64 MLA heads) with a few rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from eagle3.formats import codecs  # noqa: E402
from eagle3.runtime.kernels.base import Int4Weight  # noqa: E402
from eagle3.runtime.kernels.triton import (  # noqa: E402
    act_quant,
    aot_check,
    dense_gemm,
    linear,
    moe,
    moe_align,
    rmsnorm,
    rotary,
)

# integer arguments that follow the batch: the table compiles them unspecialised
BATCH_ARGS = {"M", "m", "ntok", "P", "TOTAL"}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``k[grid](*args, **kw)`` records the launch."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.arg_names = fn.arg_names
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kw: self.calls.append((args, kw))


def _record(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> Recorder:
    rec = Recorder(getattr(module, name))
    monkeypatch.setattr(module, name, rec)
    return rec


def _case(label: str) -> tuple[Any, dict[str, str], dict[str, Any], tuple[str, ...]]:
    for lab, fn, ptrs, consts, floats in aot_check._cases():
        if lab.startswith(label):
            return fn, ptrs, consts, floats
    raise KeyError(label)


def _check(label: str, rec: Recorder, call: int = 0) -> None:
    """The recorded launch's arguments, specialised by triton's JIT, against the case's spec."""
    fn, ptrs, consts, floats = _case(label)
    spec = aot_check.launch_spec(fn, ptrs, consts, floats)
    args, kw = rec.calls[call]
    ints = consts.get("_ints", {})
    for i, (name, value) in enumerate(zip(fn.arg_names, args, strict=False)):
        if name in consts:  # a kernel constexpr given by keyword, never positional
            continue
        jit = native_specialize_impl(BaseBackend, value, False, True, True)
        if isinstance(value, torch.Tensor):
            assert jit[1] == "D" and spec.attrs.get((i,)) == [["tt.divisibility", 16]], (label, name)
        elif isinstance(value, int) and not isinstance(value, bool):
            if name in BATCH_ARGS:
                assert name not in ints, (label, name)
                continue
            assert name in ints, f"{label}: integer argument {name} = {value} has no _ints value"
            if jit[0] == "constexpr":
                assert spec.signature[name] == "constexpr" and spec.constexprs[name] == 1, (label, name)
            else:
                assert spec.signature[name] != "constexpr", (label, name, value)
                assert (spec.attrs.get((i,)) == [["tt.divisibility", 16]]) == (jit[1] == "D"), (label, name, value)
    for opt in ("num_warps", "num_stages", "enable_fp_fusion"):
        if opt in kw:
            assert spec.options.get(opt) == kw[opt], (label, opt)


def test_launch_spec_specialises_as_the_jit() -> None:
    fn, ptrs, consts, floats = _case("act quant int8 h7168")
    spec = aot_check.launch_spec(fn, ptrs, dict(consts, _ints=dict(stride_x=1, stride_q=7168, n=7169)), floats)
    assert spec.signature["stride_x"] == "constexpr" and spec.constexprs["stride_x"] == 1
    names = fn.arg_names
    assert spec.attrs[(names.index("stride_q"),)] == [["tt.divisibility", 16]]
    assert (names.index("n"),) not in spec.attrs and spec.signature["n"] == "i32"
    assert spec.attrs[(names.index("x_ptr"),)] == [["tt.divisibility", 16]]
    big = aot_check.launch_spec(fn, ptrs, dict(consts, _ints=dict(stride_x=2**33)), floats)
    assert big.signature["stride_x"] == "i64"
    with pytest.raises(ValueError, match="names no argument"):
        aot_check.launch_spec(fn, ptrs, dict(consts, _ints=dict(nope=16)), floats)


def test_small_kernels_cases_match_their_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7168, generator=g)
    rec = _record(monkeypatch, rmsnorm, "_rms_norm_kernel")
    rmsnorm.rms_norm(x, torch.ones(7168), 1e-6, x.clone())
    rmsnorm.rms_norm_quant(x, torch.ones(7168), 1e-6, "int8", x.clone())
    _check("rms_norm+residual h7168", rec, 0)
    _check("rms_norm+residual+int8 quant h7168", rec, 1)
    rec = _record(monkeypatch, act_quant, "_quant_kernel")
    act_quant.quantize_int8_per_token(x)
    act_quant.quantize_fp8_per_token(x)
    _check("act quant int8 h7168", rec, 0)
    _check("act quant fp8 h7168", rec, 1)
    rec = _record(monkeypatch, rotary, "_rope_kernel")
    rotary.apply_rope(torch.randn(3, 65, 64, generator=g), torch.randn(3, 32, generator=g),
                      torch.randn(3, 32, generator=g), True)
    _check("rope interleaved 64+1 heads x 64", rec)
    rec = _record(monkeypatch, moe_align, "_align_kernel")
    moe.align(torch.randint(0, 384, (3, 8), generator=g), 384, 16)
    _check("moe align 384 experts, block 16", rec)


def test_dense_gemm_cases_match_their_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    rec = _record(monkeypatch, dense_gemm, "_bmm_kernel")
    _record(monkeypatch, dense_gemm, "_sum_splits_kernel")
    q = torch.randn(3, 64, 192, generator=g)  # MLA: q_nope is a view of q
    q_nope = q.split([128, 64], dim=-1)[0]
    dense_gemm.bmm(q_nope.transpose(0, 1), torch.randn(64, 128, 512, generator=g))
    dense_gemm.bmm(torch.randn(3, 64, 512, generator=g).transpose(0, 1), torch.randn(64, 512, 128, generator=g))
    dense_gemm.matmul(torch.randn(3, 7168, generator=g), torch.randn(7168, 384, generator=g), torch.float32)
    _check("dense bmm bf16 mla absorption q_nope @ W_UK", rec, 0)
    _check("dense bmm bf16 mla absorption o_lat @ W_UV", rec, 1)
    _check("dense gemm router f32 ieee 7168 -> 384", rec, 2)


def _int4(n: int, k: int, g: torch.Generator) -> Int4Weight:
    q, s = codecs.ct_int4_quantize(torch.randn(n, k, generator=g) * 0.1, 32)
    return Int4Weight(q, s.to(torch.bfloat16), 32, packing="ct", in_features=k)


def test_gemm_cases_match_their_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A W4A16 Linear 7168 -> 64 rows and a two-expert MoE at Kimi's expert shape (7168 x 2048)."""
    g = torch.Generator().manual_seed(0)
    rec = _record(monkeypatch, linear, "_gemm_kernel")
    lin = linear.TritonLinear()
    lin.prepare(_int4(64, 7168, g), None, torch.float32, torch.device("cpu"))
    lin(torch.randn(3, 7168, generator=g))
    _check("gemm w4a16 g32 7168 -> 4096", rec, 0)
    op = moe.TritonMoE()
    experts = range(2)
    op.prepare([_int4(2048, 7168, g) for _ in experts], [_int4(2048, 7168, g) for _ in experts],
               [_int4(7168, 2048, g) for _ in experts], None, torch.float32, torch.device("cpu"))
    op(torch.randn(2, 7168, generator=g), torch.tensor([[0, 1] * 4, [1, 0] * 4]), torch.rand(2, 8, generator=g))
    _check("gemm moe w13 w4a16 g32 7168 -> 2x2048", rec, 1)
    _check("gemm moe w2 w4a16 g32 2048 -> 7168", rec, 2)
