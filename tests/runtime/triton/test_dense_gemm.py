"""The Triton backend's small dense products (``kernels/triton/dense_gemm.py``: the fp32 router,
the MLA absorption ``bmm``) and where the backend sends them.

* The kernel against a float64 product: fp32 within a few ulps of the largest output (the long-K
  case runs the split-K path), bf16 within one bf16 ulp; strided and broadcast operands.
* A row's bits do not depend on the other rows or their number (alone, at another offset, after
  other rows).
* Dispatch: on the CPU the backend keeps the torch reference (its row tiles are exact there; the
  CPU bits stay the reference's), off the CPU it runs the kernel (cuBLAS picks its kernel by the
  call's shape, so the reference was not batch invariant on a GPU).
* A whole forward of the tiny target on ``backend="triton"`` calls no torch GEMM on a GPU (every
  product is a Triton kernel), and only the reference's row-tile ``bmm`` on the CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from eagle3.runtime.kernels import torch_ref  # noqa: E402
from eagle3.runtime.kernels.triton import common, dense_gemm  # noqa: E402
from eagle3.runtime.kernels.triton.backend import TritonBackend  # noqa: E402
from eagle3.runtime.loader import load_target  # noqa: E402
from tests.runtime.model_kit import PagedKV  # noqa: E402

# (batch, K, N, dtype, x transposed in memory, weight broadcast over the batch)
CASES = [(1, 128, 8, torch.float32, False, False),  # the tiny targets' router
         (1, 1024, 24, torch.float32, False, False),  # K split in four chunks (gemm_tiles.dense_tiles)
         (4, 128, 40, torch.bfloat16, True, False),  # q_nope.transpose(0, 1) @ W_UK
         (3, 96, 20, torch.float32, True, True)]
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}  # relative to the largest |output|


def _operands(b: int, m: int, k: int, n: int, dtype: torch.dtype, transposed: bool, broadcast: bool,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, b, k, generator=g).transpose(0, 1) if transposed else torch.randn(b, m, k, generator=g)
    w = torch.randn(1 if broadcast else b, k, n, generator=g) / k ** 0.5
    x, w = x.to(device, dtype), w.to(device, dtype)
    return x, (w.expand(b, k, n) if broadcast else w)


@pytest.mark.parametrize(("b", "k", "n", "dtype", "transposed", "broadcast"), CASES,
                         ids=["router", "split-k", "bf16-strided", "broadcast-w"])
def test_dense_bmm_matches_float64_and_rows_are_batch_invariant(b, k, n, dtype, transposed, broadcast,
                                                                device: torch.device) -> None:
    x, w = _operands(b, 40, k, n, dtype, transposed, broadcast, device)
    y = dense_gemm.bmm(x, w)
    assert y.dtype == dtype and y.shape == (b, 40, n)
    ref = x.double() @ w.double()
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=TOL[dtype] * float(ref.abs().max()))
    assert _batch_dependent_rows(x, w, y) == []
    if b == 1:
        assert torch.equal(dense_gemm.matmul(x[0], w[0]), y[0])


def test_router_reads_bf16_operands_and_multiplies_in_fp32(device: torch.device) -> None:
    """The router's product ``x.float() @ W.float()`` from the bf16 activations and weight as they
    are (widened where loaded: exact, so the bits of the fp32 product of widened copies), on the
    kernel and on the reference the CPU backend keeps (whose bits are unchanged)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1024, generator=g).to(device, torch.bfloat16)
    w_t = (torch.randn(1024, 24, generator=g) / 32).to(device, torch.bfloat16)
    y = dense_gemm.matmul(x, w_t, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, dense_gemm.matmul(x.float(), w_t.float()))
    assert torch.equal(dense_gemm.matmul(x.float(), w_t), y)  # the default: the wider operand's dtype
    xc, wc = x.cpu(), w_t.cpu()
    ref = torch_ref.TorchBackend("cpu").matmul(xc, wc, torch.float32)
    assert torch.equal(ref, torch_ref.mm_rows(xc.float(), wc.float()))  # the reference's bits as before


def _batch_dependent_rows(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> list[object]:
    """The row slices of ``y = bmm(x, w)`` whose bits change when computed alone, at other offsets,
    as one or several tiles, or after other rows."""
    bad: list[object] = []
    for lo, hi in [(20, 21), (17, 22), (0, 16), (3, 36)]:
        if not torch.equal(dense_gemm.bmm(x[:, lo:hi], w), y[:, lo:hi]):
            bad.append((lo, hi))
    other = torch.cat([x[:, :5] * 2, x[:, 30:31]], dim=1)
    if not torch.equal(dense_gemm.bmm(other, w)[:, 5:], y[:, 30:31]):
        bad.append("after other rows")
    return bad


def test_a_tile_chosen_by_the_row_count_is_caught(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """The check above can fail on any CPU (the interpreter's dot is BLAS-independent: conftest.py):
    a BLOCK_K picked from the number of rows, as a batch-tuned GEMM might, changes a row's bits."""
    real_bmm, real_tiles = dense_gemm.bmm, dense_gemm.tiles

    def batch_tuned(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        bk = 32 if x.shape[1] > 16 else 64
        monkeypatch.setattr(dense_gemm, "tiles", lambda n, k, dtype: dataclasses.replace(real_tiles(n, k, dtype), bk=bk))
        return real_bmm(x, w)

    monkeypatch.setattr(dense_gemm, "bmm", batch_tuned)
    x, w = _operands(1, 40, 128, 8, torch.float32, False, False, device)
    assert _batch_dependent_rows(x, w, dense_gemm.bmm(x, w)) != []


def test_backend_keeps_the_reference_on_the_cpu_and_the_kernel_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU backend on a GPU machine too (a first GPU run refused it there): its matmul / bmm on CPU
    # tensors are the torch reference, no Triton kernel runs.
    monkeypatch.setattr(common, "INTERPRET", True)
    be = TritonBackend("cpu")
    g = torch.Generator().manual_seed(5)
    x, w_t = torch.randn(20, 64, generator=g), torch.randn(64, 8, generator=g)
    xb, wb = torch.randn(4, 20, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    assert torch.equal(be.matmul(x, w_t), torch_ref.mm_rows(x, w_t))  # the CPU bits are the reference's
    assert torch.equal(be.bmm(xb, wb), torch_ref.bmm_rows(xb, wb))
    calls: list[str] = []

    def record(name: str):  # type: ignore[no-untyped-def]
        def run(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            calls.append(name)
            return torch.empty(*a.shape[:-1], b.shape[-1], device=a.device)
        return run

    monkeypatch.setattr(dense_gemm, "matmul", record("matmul"))
    monkeypatch.setattr(dense_gemm, "bmm", record("bmm"))
    meta = torch.device("meta")  # a tensor off the CPU (no GPU needed to see the dispatch)
    assert be.matmul(x.to(meta), w_t.to(meta)).shape == (20, 8)
    assert be.bmm(xb.to(meta), wb.to(meta)).shape == (4, 20, 32)
    assert calls == ["matmul", "bmm"]


GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "_int_mm", "mv", "dot", "matmul", "linear", "_scaled_mm"}


class _GemmLog(TorchDispatchMode):
    """Names of the torch GEMM ops run under it (any overload)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in GEMMS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_a_triton_forward_runs_no_torch_gemm_off_the_cpu(tiny_dir, device: torch.device) -> None:
    m = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32, device=device, backend="triton")
    kv = PagedKV(m)
    x, meta = kv.step({"a": [5, 9, 300, 17], "b": [44, 2]})
    log = _GemmLog()
    with torch.no_grad(), log:
        h, _ = m(x, meta, kv.caches)
        m.compute_logits(h)
    if device.type == "cpu":  # the router and the MLA absorption: the reference's row tiles (exact here)
        assert set(log.seen) == {"bmm"}, log.seen
    else:
        assert log.seen == []


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_triton_backend_decodes_a_packed_kv_b_once_at_load(fmt: str) -> None:
    """The MLA absorption matrices of a quantized kv_b_proj: the reference keeps the packed weight
    and decodes it per call; the Triton backend decodes it once at load (its decode step reads the
    matrices as they are), to the same bits, and holds the matrices instead of the packed weight."""
    from eagle3.formats import codecs
    from eagle3.runtime.config import MLASpec, RopeSpec
    from eagle3.runtime.kernels.base import FP8Weight, Int4Weight
    from eagle3.runtime.layers.attention import MLAAttention
    from eagle3.runtime.layers.rotary import RotaryEmbedding
    from eagle3.runtime.loader import resident_weight_bytes

    spec = MLASpec(4, None, 64, 32, 16, 32, RopeSpec(16, 10000.0, True), 1e-6)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4 * (32 + 32), 64, generator=g) * 0.05
    if fmt == "int4":
        q, s = codecs.ct_int4_quantize(w, 32)
        weight = Int4Weight(q, s.to(torch.bfloat16), 32, packing="ct", in_features=64)
    else:
        weight = FP8Weight(*codecs.fp8_block_quantize(w, (32, 32)), block=(32, 32))
    layers = {}
    for be in (torch_ref.TorchBackend("cpu"), TritonBackend("cpu")):
        m = MLAAttention(spec, 64, 64, RotaryEmbedding(spec.rope, be), be, "attn")
        m.load_kv_b(weight, torch.bfloat16, torch.device("cpu"))
        layers[be.name] = m
    ref, tri = layers["torch"], layers["triton"]
    assert ref.kv_b_packed is not None and ref.w_uk is None  # the reference: packed, decoded per call
    assert tri.kv_b_packed is None and tri.absorbed_matrices()[0] is tri.w_uk  # decoded once
    for a, b in zip(ref.absorbed_matrices(), tri.absorbed_matrices(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    decoded = 2 * spec.num_heads * 32 * 64 * 2  # two [4, 32, 64] bf16 matrices
    assert sum(resident_weight_bytes(tri).per_module["."].values()) == decoded
    assert sum(resident_weight_bytes(ref).per_module["."].values()) < decoded
