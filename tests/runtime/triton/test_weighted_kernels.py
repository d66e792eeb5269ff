"""The weighted Triton ops (``kernels/triton/linear.py``, ``moe.py``) against the torch reference,
on small shapes, for every canonical weight format.

* Integer paths (W4A8 with int8 activations, the FP8-stage variant, FP8 weights x FP8 activations)
  are bit-exact: the same integer sums as ``torch._int_mm`` / the float64 reference, scaled in the
  same order.
* Float paths decode each weight element exactly as ``base.dequantize`` does; only the summation
  order differs from the reference's fp32 GEMM, hence the tolerances in ``TOL`` (a few fp32 ulps of
  the largest output; one ulp of the model dtype for fp16 / bf16 results).
* Row invariance: a row's output bits do not change with the rows around it or the batch size.
* Both tile shapes run on every machine: the interpreter's whole-width tiles and the compiled (GPU)
  ones, every model dtype for the shapes the machine itself uses, fp32 for the other.
* Split-K: the compiled tiles with K cut into 32-wide chunks (the small test weights split only
  when forced): the partials and their chunk-order sum kernel, for the Linear and the fused MoE.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import UsageError  # noqa: E402
from eagle3.formats import codecs  # noqa: E402
from eagle3.runtime.kernels import torch_ref  # noqa: E402
from eagle3.runtime.kernels.base import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, dequantize  # noqa: E402
from eagle3.runtime.kernels.triton import gemm_tiles, linear, moe, moe_align  # noqa: E402
from eagle3.runtime.kernels.triton.common import INTERPRET  # noqa: E402

# (rtol, atol relative to the largest |reference| output) of the float paths, per model dtype: the
# reference sums in fp32 in another order (fp32: a few ulps); fp16 / bf16 results: one ulp.
TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N, K = 48, 96


def _weight(fmt: str, n: int, k: int, g: torch.Generator):
    wf = torch.randn(n, k, generator=g) * 0.1
    if fmt == "int4-g32-ct":  # Moonshot / compressed-tensors W4A16
        q, s = codecs.ct_int4_quantize(wf, 32)
        return Int4Weight(q, s.to(torch.bfloat16), 32, packing="ct", in_features=k)
    if fmt.startswith("int4-chan"):  # Quark W4A8: per-channel codes and the FP8 stage scale
        packing = {"int4-chan-quark": "quark", "int4-chan-order": "quark_order", "int4-chan-int8": None}[fmt]
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        codes = q if packing is None else codecs.quark_int4_pack(q, reorder=packing == "quark")
        return Int4Weight(codes, torch.rand(n, generator=g) * 0.01 + 1e-3, None, torch.tensor(0.75), packing=packing,
                          in_features=k if packing else None)
    if fmt == "int4-g16-quark":  # Quark per-group weight-only (int4-draft), with a tensor scale
        q, s = codecs.quark_int4_quantize(wf, 16)
        return Int4Weight(codecs.quark_int4_pack(q), s.to(torch.float16), 16, torch.tensor(0.5), packing="quark",
                          in_features=k)
    if fmt == "mxfp4":
        return MXFP4Weight(*codecs.mxfp4_quantize(wf))
    if fmt == "mxfp4-wide-scales":  # E8M0 bytes outside [2, 252] (here 2^-126): the general decode, not the bit one
        packed, scale = codecs.mxfp4_quantize(wf)
        scale[::3, 0] = 1
        return MXFP4Weight(packed, scale)
    if fmt == "fp8-block":
        # 64-wide K blocks: the compiled tiles (BK 64) read one scale per row, the interpreted
        # ones (BK 128) gather them per element
        return FP8Weight(*codecs.fp8_block_quantize(wf, (16, 64)), block=(16, 64))
    if fmt == "fp8-chan":
        return FP8Weight(*codecs.fp8_per_channel_quantize(wf))
    if fmt == "fp8-tensor":
        return FP8Weight(*codecs.fp8_per_tensor_quantize(wf))
    assert fmt == "dense"
    return DenseWeight(wf, torch.randn(n, generator=g))


# (weight format, activation quantization); the integer paths are the ones with int8 / fp8 activations
LINEAR_CASES = [("int4-g32-ct", None), ("int4-g16-quark", None), ("int4-chan-quark", None),
                ("int4-chan-quark", "int8"), ("int4-chan-order", "int8"), ("int4-chan-int8", "int8"),
                ("int4-chan-quark", "fp8"), ("mxfp4", None), ("mxfp4", "mxfp4"), ("mxfp4-wide-scales", None),
                ("fp8-block", None), ("fp8-chan", None), ("fp8-tensor", "fp8"), ("dense", None), ("dense", "mxfp4")]


def _check(y: torch.Tensor, ref: torch.Tensor, exact: bool, dtype: torch.dtype) -> None:
    if exact:
        assert torch.equal(y, ref)
    else:
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol * float(ref.float().abs().max()))


@pytest.fixture(params=["interpreted-tiles", "compiled-tiles"])
def tile_shapes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tile shapes are forced either way: the default follows ``TRITON_INTERPRET``, so without
    this a GPU would run its compiled tiles twice and the whole-width ones never."""
    tiles, interpret = linear.tiles, request.param == "interpreted-tiles"
    monkeypatch.setattr(linear, "tiles", lambda fmt, n, k, group=0: tiles(fmt, n, k, group, interpret=interpret))
    return request.param


@pytest.mark.parametrize(("fmt", "act"), LINEAR_CASES, ids=[f"{f}-{a or 'w-only'}" for f, a in LINEAR_CASES])
def test_linear_matches_reference(fmt: str, act: str | None, tile_shapes: str, device: torch.device) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(fmt.encode()) % 1000)  # (str hash() changes per process)
    w = _weight(fmt, N, K, g)
    x = torch.randn(33, K, generator=g)  # three row blocks, the last one partial
    exact = act in ("int8", "fp8")
    native = (tile_shapes == "interpreted-tiles") == INTERPRET  # the shapes this machine runs: every dtype
    for dtype in DTYPES if native else [torch.float32]:
        ref, op = torch_ref.TorchLinear(), linear.TritonLinear()
        ref.prepare(w, act, dtype, device)
        op.prepare(w, act, dtype, device)
        xd = x.to(device, dtype)
        y = op(xd)
        assert y.dtype == dtype and y.shape == (33, N)
        _check(y, ref(xd), exact, dtype)
        # row invariance: alone, in a smaller batch at another offset, after other rows
        assert torch.equal(op(xd[20:21]), y[20:21])
        assert torch.equal(op(xd[17:22]), y[17:22])
        assert torch.equal(op(torch.cat([xd[:3] * 2, xd[20:21]]))[3:], y[20:21])


def test_integer_accumulation_is_exact(device: torch.device) -> None:
    """Before any scaling: the int8 x INT4 sums equal ``torch._int_mm``'s int32 sums, and E4M3 x
    INT4 / E4M3 x E4M3 sums the float64 ones (unit scales, sums below 2^24)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    ones = torch.ones(N)
    bank = linear.make_bank([[Int4Weight(codecs.quark_int4_pack(q), ones, packing="quark", in_features=K)]],
                            torch.float32, device)
    a = torch.randint(-127, 128, (21, K), generator=g, dtype=torch.int8)
    out = torch.empty(21, N, device=device)  # (the kernel writes here: on the GPU too, not a host copy)
    linear.launch(bank, a.to(device), torch.ones(21, device=device), out, mode="int8",
                  dtype=torch.float32, m=21, n_out=N, grid_m=2)
    assert torch.equal(out.cpu(), torch._int_mm(a, q.t().contiguous()).float())
    a8 = (torch.randn(21, K, generator=g) * 30).to(torch.float8_e4m3fn)
    exact = (a8.double() @ q.double().t()).float()
    linear.launch(bank, a8.view(torch.uint8).to(device), torch.ones(21, device=device), out, mode="fp8",
                  dtype=torch.float32, m=21, n_out=N, grid_m=2)
    assert torch.equal(out.cpu(), exact)
    w8 = (torch.randn(N, K, generator=g) * 30).to(torch.float8_e4m3fn)
    bank8 = linear.make_bank([[FP8Weight(w8, ones)]], torch.float32, device)
    linear.launch(bank8, a8.view(torch.uint8).to(device), torch.ones(21, device=device), out, mode="fp8",
                  dtype=torch.float32, m=21, n_out=N, grid_m=2)
    assert torch.equal(out.cpu(), (a8.double() @ w8.double().t()).float())


def test_weights_stay_packed_and_refusals_match_the_reference(device: torch.device) -> None:
    g = torch.Generator().manual_seed(2)
    op = linear.TritonLinear()
    w = _weight("int4-g32-ct", N, K, g)
    op.prepare(w, None, torch.bfloat16, device)
    assert all(t.numel() < N * K for _, t in op.resident())  # codes: N*K/8 words; scales: N*K/32
    assert {r for r, _ in op.resident()} == {"packed", "scales"}
    with pytest.raises(UsageError, match="per-channel INT4"):
        linear.TritonLinear().prepare(w, "int8", torch.bfloat16, device)
    with pytest.raises(UsageError, match="not supported"):
        linear.TritonLinear().prepare(_weight("fp8-block", N, K, g), "fp8", torch.bfloat16, device)


MOE_CASES = [("int4-g32-ct", None), ("int4-chan-quark", "int8"), ("int4-chan-quark", "fp8"), ("mxfp4", "mxfp4"),
             ("fp8-block", None), ("fp8-chan", "fp8"), ("dense", None)]
E, H, INTER, T, TOPK = 4, 64, 32, 9, 2


@pytest.mark.parametrize(("fmt", "act"), MOE_CASES, ids=[f"{f}-{a or 'w-only'}" for f, a in MOE_CASES])
def test_fused_moe_matches_reference(fmt: str, act: str | None, device: torch.device) -> None:
    """fp16 / bf16: the integer GEMMs give the reference's bits and the SiLU rounds to the same
    model-dtype value here; fp32 keeps the SiLU's last-ulp differences (exp), hence TOL."""
    g = torch.Generator().manual_seed(3)
    gate, up = ([_weight(fmt, INTER, H, g) for _ in range(E)] for _ in range(2))
    down = [_weight(fmt, H, INTER, g) for _ in range(E)]
    x = torch.randn(T, H, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(device)
    wts = torch.rand(T, TOPK, generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16) if act != "fp8" else (torch.bfloat16,):  # fp8: 3-9 dots, slow
        ref, op = torch_ref.TorchMoE(), moe.TritonMoE()
        ref.prepare(gate, up, down, act, dtype, device)
        op.prepare(gate, up, down, act, dtype, device)
        xd = x.to(dtype)
        y = op(xd, ids, wts)
        assert y.dtype == dtype and y.shape == (T, H)
        _check(y, ref(xd, ids, wts), False, dtype)
        assert torch.equal(op(xd[4:6], ids[4:6], wts[4:6]), y[4:6])  # a token's bits: not the batch's
        assert torch.equal(op(xd[6:7], ids[6:7], wts[6:7]), y[6:7])


def test_moe_alignment() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, expert_ids = moe.align(ids, 4, 4)
    pad = ids.numel()
    # stable: token order; the buffers are sized by the bound 6 + 4 * 3 -> 20 rows, unused blocks -1
    assert moe.max_padded_rows(6, 4, 4) == 20
    assert sorted_ids.tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad] + [pad] * 8
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]


def test_moe_alignment_shapes_depend_on_shapes_only() -> None:
    """What a CUDA graph needs: the same buffer sizes whatever the routing (no device read), and
    the bound always holds (every expert used, one expert used, a single pair)."""
    gen = torch.Generator().manual_seed(0)
    for t, k, e, bm in ((1, 8, 48, 16), (5, 2, 8, 4), (64, 8, 16, 16), (3, 2, 2, 16)):
        shapes = set()
        for trial in range(6):
            ids = (torch.zeros(t, k, dtype=torch.int64) if trial == 0 else
                   torch.randint(0, e, (t, k), generator=gen))
            sorted_ids, expert_ids = moe.align(ids, e, bm)
            shapes.add((sorted_ids.shape, expert_ids.shape))
            used = expert_ids[expert_ids >= 0]
            assert torch.equal(used, used.sort().values)  # experts in order, unused blocks only at the end
            assert (expert_ids[len(used):] == -1).all()
            rows = sorted_ids[: len(used) * bm].view(-1, bm)
            real = rows < t * k
            assert sorted(sorted_ids[sorted_ids < t * k].tolist()) == list(range(t * k))  # each pair once
            assert (ids.reshape(-1)[rows[real].long()] == used.repeat_interleave(bm).view(-1, bm)[real]).all()
        assert len(shapes) == 1


@pytest.fixture
def split_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled tile rule with K cut into chunks of one 32-wide step (the rule itself splits
    only long K: ``test_gemm_tiles.py``), so the partials and :func:`linear._splitk_kernel` run."""

    def forced(fmt: int, n: int, k: int, group: int = 0) -> gemm_tiles.GemmTiles:
        bk = max(32, group)
        return dataclasses.replace(gemm_tiles.gemm_tiles(fmt, n, k, group), bk=bk, split=k // bk)

    monkeypatch.setattr(linear, "tiles", forced)


SPLIT_CASES = [("int4-g32-ct", None), ("int4-g16-quark", None), ("int4-chan-quark", "int8"),
               ("int4-chan-quark", "fp8"), ("mxfp4", "mxfp4"), ("fp8-block", None), ("fp8-tensor", "fp8"),
               ("dense", None)]


@pytest.mark.parametrize(("fmt", "act"), SPLIT_CASES, ids=[f"{f}-{a or 'w-only'}" for f, a in SPLIT_CASES])
def test_split_k_linear_matches_reference(fmt: str, act: str | None, split_tiles: None, device: torch.device) -> None:
    """K = 96 in three chunks. Bitwise: the integer paths against the reference (int64 chunk sums
    are exact in any order), and a row alone / in another batch against itself in the batch (the
    rows are the N side of every dot - other rows are other MMA / BLAS columns, whose values never
    enter a row's sums - and the chunks are added in chunk order). Float paths: TOL."""
    g = torch.Generator().manual_seed(zlib.crc32(fmt.encode()) % 1000 + 7)
    w = _weight(fmt, N, K, g)
    x = torch.randn(33, K, generator=g)
    ref, op = torch_ref.TorchLinear(), linear.TritonLinear()
    ref.prepare(w, act, torch.float32, device)
    op.prepare(w, act, torch.float32, device)
    assert linear.tiles(op.bank.fmt, N, K, op.bank.group).split == 3
    xd = x.to(device)
    y = op(xd)
    _check(y, ref(xd), act in ("int8", "fp8"), torch.float32)
    assert torch.equal(op(xd[20:21]), y[20:21])
    assert torch.equal(op(torch.cat([xd[:3] * 2, xd[20:21]]))[3:], y[20:21])


MOE_SPLIT_CASES = [("int4-g32-ct", None), ("int4-chan-quark", "int8"), ("mxfp4", "mxfp4")]


@pytest.mark.parametrize(("fmt", "act"), MOE_SPLIT_CASES, ids=[f"{f}-{a or 'w-only'}" for f, a in MOE_SPLIT_CASES])
def test_split_k_fused_moe_matches_reference(fmt: str, act: str | None, split_tiles: None,
                                             device: torch.device) -> None:
    """Both grouped GEMMs split (K = 64 in two chunks): SiLU-and-mul, the W4A8 weight scales of each
    pair's expert and the routing weight applied after the chunk sum. A token's bits: bitwise
    alone and in the batch (as above); the reference: TOL (exact for the integer GEMMs, but the
    SiLU's exp and the fp32 combine are float)."""
    g = torch.Generator().manual_seed(5)
    h, inter = 64, 64
    gate, up = ([_weight(fmt, inter, h, g) for _ in range(E)] for _ in range(2))
    down = [_weight(fmt, h, inter, g) for _ in range(E)]
    x = torch.randn(T, h, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).to(device)
    wts = torch.rand(T, TOPK, generator=g).to(device)
    ref, op = torch_ref.TorchMoE(), moe.TritonMoE()
    ref.prepare(gate, up, down, act, torch.float32, device)
    op.prepare(gate, up, down, act, torch.float32, device)
    assert linear.tiles(op.w13.fmt, 2 * inter, h, op.w13.group).split == 2
    assert linear.tiles(op.w2.fmt, h, inter, op.w2.group).split == 2
    y = op(x, ids, wts)
    _check(y, ref(x, ids, wts), False, torch.float32)
    assert torch.equal(op(x[4:6], ids[4:6], wts[4:6]), y[4:6])
    assert torch.equal(op(x[6:7], ids[6:7], wts[6:7]), y[6:7])


def test_compiled_bf16_decode_recipes_match_dequantize() -> None:
    """The decodes only a GPU runs (``linear.py``, ``BF16W``), replayed in torch on the words
    ``make_bank`` stores: INT4 ``bf16(128 + u) - 136`` times the bf16 group scale in bf16 (one
    rounding of the exact product, as ``mul.rn.bf16x2``), and the MXFP4 bit construction read as
    bf16, are bitwise ``base.dequantize``'s bf16 weights. Pure integer / bf16 arithmetic: bitwise
    on any machine."""
    g = torch.Generator().manual_seed(11)
    wf = torch.randn(8, 64, generator=g) * torch.logspace(-3, 1, 8)[:, None]  # scales over 4 decades
    q, scale = codecs.ct_int4_quantize(wf, 32)
    w4 = Int4Weight(q, scale.to(torch.bfloat16), 32, packing="ct", in_features=64)
    words = linear.make_bank([[w4]], torch.bfloat16, torch.device("cpu")).w[0]
    halves = torch.stack([(words >> (4 * i)) & 0x000F000F for i in range(4)], dim=-1)  # [N, W, pair i]
    pairs = (halves | 0x43004300).contiguous().view(torch.bfloat16).view(8, 8, 4, 2)  # bf16 (128 + u), K order
    s = w4.scale.repeat_interleave(32, dim=1).view(8, 8, 4, 2)
    v = (pairs - torch.tensor(136.0, dtype=torch.bfloat16)) * s
    assert torch.equal(v.reshape(8, 64), dequantize(w4, torch.bfloat16))

    mx = MXFP4Weight(*codecs.mxfp4_quantize(wf))
    bank = linear.make_bank([[mx]], torch.bfloat16, torch.device("cpu"))
    assert bank.mx_fast
    sx = (mx.scale.to(torch.int32) - 1).repeat_interleave(4, dim=1) << 7  # per word
    sx = sx | (sx << 16)
    ws = torch.stack([bank.w[0] >> (4 * i) for i in range(4)], dim=-1)
    j = ws & 0x00070007
    val = j * 64 + sx[..., None]
    nz = ((j ^ 0x00010001) + 0x7FFF7FFF) & -2147450880
    bits = (((ws << 12) & -2147450880) | val) & ((nz - ((nz >> 15) & 0x00010001)) | -2147450880)
    v = bits.contiguous().view(torch.bfloat16).view(8, 64)
    assert torch.equal(v, dequantize(mx, torch.bfloat16))


def test_moe_alignment_kernel_equals_the_torch_ops() -> None:
    """The one-program alignment (moe_align.py) gives the torch ops' buffers element for element:
    the same stable order by expert, padding, tail and block experts (unused experts, one expert
    for every pair, pairs over several chunks, a block size of 1)."""
    gen = torch.Generator().manual_seed(1)
    for t, k, e, bm in ((1, 8, 48, 16), (5, 2, 8, 4), (40, 4, 12, 16), (3, 2, 2, 16), (9, 3, 5, 1)):
        for trial in range(3):
            ids = (torch.full((t, k), e - 1, dtype=torch.int64) if trial == 0 else
                   torch.randint(0, e, (t, k), generator=gen))
            total = moe.max_padded_rows(t * k, e, bm)
            got = moe_align.align(ids, e, bm, total)
            want = moe.align_torch(ids, e, bm)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (t, k, e, bm, trial)
