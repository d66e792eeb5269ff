"""The torch reference kernels: batch invariance of every primitive, exactness of the integer and
FP8 GEMMs, quantized linears against their dequantized references, paged attention against a
naive float64 softmax, MoE against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3.formats import codecs
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.kernels.base import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, dequantize
from eagle3.runtime.kernels.torch_ref import (
    KEY_TILE,
    ROW_TILE,
    bmm_rows,
    fp8_int4_linear,
    int8_linear,
    mm_rows,
    mxfp4_qdq,
    pointwise,
    quantize_fp8_per_token,
    quantize_int8_per_token,
    silu,
)
from tests.runtime.model_kit import single_thread  # noqa: E402

BE = get_backend("torch")
DTYPES = [torch.float32, torch.bfloat16]


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    g = _gen(0)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(3 * ROW_TILE + 5, 64, generator=g).to(dtype)
    full = mm_rows(x, w.t())
    for m in (1, 2, 3, 5, 7, 9, 13, ROW_TILE, ROW_TILE + 1, 40):
        assert torch.equal(mm_rows(x[:m], w.t()), full[:m]), m
        assert torch.equal(mm_rows(x[m - 1: m], w.t())[0], full[m - 1]), m  # alone vs in a batch
    wb = torch.randn(4, 64, 32, generator=g).to(dtype)
    xb = torch.randn(4, 2 * ROW_TILE + 3, 64, generator=g).to(dtype)
    fb = bmm_rows(xb, wb)
    for m in (1, 3, ROW_TILE, 2 * ROW_TILE + 1):
        assert torch.equal(bmm_rows(xb[:, :m], wb), fb[:, :m])
    # the tiled product is the product
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, torch.exp, torch.cos, torch.sin])
def test_pointwise_ops_are_batch_invariant(fn) -> None:
    # Measured on CPU: plain fp32 sigmoid/silu of a row change with the number of rows (SIMD body vs
    # scalar tail); pointwise() must not.
    x = torch.randn(200, 8, generator=_gen(1)) * 3
    full = pointwise(fn, x)
    for t in range(1, 60):
        assert torch.equal(pointwise(fn, x[:t]), full[:t])
    torch.testing.assert_close(full, fn(x), rtol=1e-6, atol=1e-6)


def test_int8_gemm_accumulates_exactly() -> None:
    g = _gen(2)
    codes = torch.randint(-8, 8, (48, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(48, generator=g) + 0.5
    x = torch.randn(9, 256, generator=g) * 3
    q, sx = quantize_int8_per_token(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    acc_ref = q.long() @ codes.long().t()  # exact int64
    y = int8_linear(x, codes, scale)
    want = acc_ref.float() * sx[:, None] * scale[None, :]
    assert torch.equal(y, want)  # the int32 accumulator was exact, scaling is the same fp32 math
    # and the per-token result is independent of the batch
    assert torch.equal(int8_linear(x[4:5], codes, scale), y[4:5])


def _w4a8_weight(g: torch.Generator, n: int = 40, k: int = 128) -> tuple[Int4Weight, torch.Tensor]:
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s2 = torch.rand(n, generator=g) * 0.02 + 0.01
    s1 = torch.tensor(0.37)
    w = Int4Weight(codes, s2, None, tensor_scale=s1)
    return w, codes.float() * (s2 * s1)[:, None]


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_w4a8_linear_matches_dequantized_reference(act: str) -> None:
    g = _gen(3)
    w, dense = _w4a8_weight(g)
    x = torch.randn(11, 128, generator=g)
    op = BE.linear()
    op.prepare(w, act, torch.float32, torch.device("cpu"))
    y = op(x)
    ref = x @ dense.t()
    # error of an 8-bit per-token activation quantizer: |dx| <= amax/254 (int8) or 2^-4 relative (fp8)
    step = x.abs().amax(-1, keepdim=True) / (254 if act == "int8" else 16)
    bound = (step * dense.abs().sum(-1)[None, :]).max()
    assert (y - ref).abs().max() <= bound
    assert (y - ref).abs().max() > 0  # it really quantized the activations
    if act == "fp8":
        q, sx = quantize_fp8_per_token(x)
        exact = (q.double() @ w.codes.double().t()).float() * sx[:, None] * (w.scale * w.tensor_scale)[None, :]
        assert torch.equal(y, exact)
    for t in (0, 5, 10):
        assert torch.equal(op(x[t: t + 1]), y[t: t + 1])


def test_mxfp4_linear_is_qdq_then_float_gemm() -> None:
    g = _gen(4)
    w = torch.randn(64, 128, generator=g) * 0.1
    packed, scale = codecs.mxfp4_quantize(w)
    mw = MXFP4Weight(packed, scale)
    x = torch.randn(7, 128, generator=g)
    op = BE.linear()
    op.prepare(mw, "mxfp4", torch.float32, torch.device("cpu"))
    y = op(x)
    wq = codecs.mxfp4_dequantize(packed, scale)
    xq = mxfp4_qdq(x)
    # the activation fake-quant keeps at most 8 distinct magnitudes per 32-block (the E2M1 grid)
    assert max(len(torch.unique(b.abs())) for b in xq.view(-1, 32)) <= 8
    torch.testing.assert_close(y, xq @ wq.t(), rtol=1e-5, atol=1e-5)
    # MXFP4 keeps ~2 significant bits per element and block: loose bound against the float product
    rel = (y - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.25
    # weight-only MXFP4 (W4A16) is exactly the dequantized weight
    op2 = BE.linear()
    op2.prepare(mw, None, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(op2(x), x @ wq.t(), rtol=1e-5, atol=1e-5)


def test_int4_group_dequant_matches_compressed_tensors_rule() -> None:
    g = _gen(5)
    q = torch.randint(-8, 8, (32, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(32, 2, generator=g) * 0.05).to(torch.bfloat16)
    packed = codecs.ct_int4_pack(q)
    w = Int4Weight(codecs.ct_int4_unpack(packed, 64), scale, group_size=32)
    # compressed-tensors forms q * s in the scale dtype (bf16): the codec's own dequantize
    assert torch.equal(dequantize(w, torch.bfloat16), codecs.ct_int4_dequantize(packed, scale, (32, 64)))
    assert torch.equal(dequantize(w, torch.float32), codecs.ct_int4_dequantize(packed, scale, (32, 64)).float())


def test_fp8_block_weight_dequant() -> None:
    g = _gen(6)
    w = torch.randn(256, 192, generator=g)
    q, s = codecs.fp8_block_quantize(w)
    fw = FP8Weight(q, s, block=(128, 128))
    torch.testing.assert_close(dequantize(fw, torch.float32), codecs.fp8_block_dequantize(q, s, dtype=torch.float32))
    assert (dequantize(fw, torch.float32) - w).abs().max() < 0.07 * w.abs().max()


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def _paged(lens_new: list[int], lens_ctx: list[int], block: int, slots_total: int, seed: int):
    """Random scattered block tables for sequences with ``ctx`` cached + ``new`` query tokens."""
    g = _gen(seed)
    perm = torch.randperm(slots_total // block, generator=g).tolist()
    tables, pos, slot_of = [], [], {}
    for b, (n, c) in enumerate(zip(lens_new, lens_ctx, strict=True)):
        total = c + n
        nb = -(-total // block)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        for p in range(total):
            slot_of[(b, p)] = table[p // block] * block + p % block
        pos += list(range(c, total))
    width = max(len(t) for t in tables)
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t)
    cu = torch.tensor([0] + list(torch.tensor(lens_new).cumsum(0)), dtype=torch.int32)
    meta = AttnMetadata(torch.tensor(pos), cu, torch.tensor([c + n for n, c in zip(lens_new, lens_ctx, strict=True)],
                                                               dtype=torch.int32),
                        torch.tensor([slot_of[(b, p)] for b in range(len(tables)) for p in
                                      range(lens_ctx[b], lens_ctx[b] + lens_new[b])]), bt, block)
    return meta, slot_of


@pytest.mark.parametrize("hkv,g,d,dv", [(2, 3, 16, 8), (1, 4, 48, 32)])  # GQA MHA; MLA-shaped MQA
def test_paged_attention_matches_naive_float64(hkv: int, g: int, d: int, dv: int) -> None:
    lens_new, lens_ctx = [3, 1, 70], [5, 80, 0]  # verify-like, decode, long prefill (2 key tiles)
    meta, slot_of = _paged(lens_new, lens_ctx, block=4, slots_total=512, seed=7)
    gen = _gen(8)
    k_cache = torch.randn(512, hkv, d, generator=gen)
    v_cache = torch.randn(512, hkv, dv, generator=gen)
    t = sum(lens_new)
    q = torch.randn(t, hkv, g, d, generator=gen)
    scale = 0.3
    out = BE.attention(q, k_cache, v_cache, meta, scale)
    row = 0
    for b, (n, c) in enumerate(zip(lens_new, lens_ctx, strict=True)):
        for i in range(n):
            p = c + i
            slots = torch.tensor([slot_of[(b, j)] for j in range(p + 1)])
            k, v = k_cache[slots].double(), v_cache[slots].double()  # [L, hkv, d]
            s = torch.einsum("hgd,lhd->hgl", q[row].double(), k) * scale
            ref = torch.einsum("hgl,lhd->hgd", s.softmax(-1), v)
            torch.testing.assert_close(out[row].double(), ref, rtol=1e-5, atol=1e-5)
            row += 1
    assert KEY_TILE < 70 + 1  # the long prefill really spans two key tiles
    # a token's output does not depend on its batch: the decode query alone
    meta1 = AttnMetadata(meta.positions[3:4], torch.tensor([0, 1], dtype=torch.int32), meta.context_lens[1:2],
                         meta.slot_mapping[3:4], meta.block_tables[1:2], 4)
    assert torch.equal(BE.attention(q[3:4], k_cache, v_cache, meta1, scale), out[3:4])


@pytest.mark.parametrize("r,d,dv", [(4, 48, 32), (4, 32, 32), (16, 64, 64), (64, 576, 512)])
def test_attention_tile_products_are_row_invariant(r: int, d: int, dv: int) -> None:
    """What both attention schedules rest on, checked on this machine's BLAS: a row of the
    fixed-shape score GEMM ``[R, D] x [D, KEY_TILE]`` (keys as a transposed view, contiguous or
    broadcast with stride 0) and of the value GEMM ``[R, KEY_TILE] x [KEY_TILE, dv]`` (values a
    strided prefix of the keys, as MLA reads them) depends on that row only - not on its position
    in the tile, the other rows or the batch size - and so does a row sum of length KEY_TILE."""
    g = _gen(11)
    n = 9
    q = torch.randn(n, r, d, generator=g)
    keys = torch.randn(n, KEY_TILE, d, generator=g)
    s = torch.bmm(q, keys.transpose(1, 2))
    p = torch.rand(n, r, KEY_TILE, generator=g)
    pv = torch.bmm(p, keys[..., :dv])
    den = p.sum(-1)
    for b, row, at in ((0, 0, r - 1), (4, r - 1, 0), (8, r // 2, r // 3)):
        alone = torch.zeros(1, r, d)
        alone[0, at] = q[b, row]
        assert torch.equal(torch.bmm(alone, keys[b: b + 1].transpose(1, 2))[0, at], s[b, row])
        three = torch.zeros(3, r, d)
        three[1, at] = q[b, row]
        assert torch.equal(torch.bmm(three, keys[b].t().expand(3, d, KEY_TILE))[1, at], s[b, row])
        pa = torch.zeros(2, r, KEY_TILE)
        pa[1, at] = p[b, row]
        assert torch.equal(torch.bmm(pa, keys[b, :, :dv].expand(2, KEY_TILE, dv))[1, at], pv[b, row])
        assert torch.equal(pa.sum(-1)[1, at], den[b, row])
    assert torch.equal(torch.bmm(q[:2], keys[:2].transpose(1, 2)), s[:2])


def test_row_stacking_probe_stops_where_a_blas_rows_depend_on_m(monkeypatch) -> None:
    """Row tiles are stacked into one GEMM only up to the tile counts whose rows the probe saw
    keep their tile bits; a BLAS that rounds a tall product differently (simulated) stops the
    stacking below that height, one whose rows depend on their place in the tile stacks nothing,
    and a GEMM of mixed tile counts is split into probed ones."""
    from eagle3.runtime.kernels.torch_ref import gemm

    probe = gemm.stack_sizes.__wrapped__
    assert probe(4, 48, 32, (1, 48), torch.float32, 1)[0] == 1
    real_mm = torch.mm

    def tall_differs(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
        out = real_mm(a, b, **kw)
        return out.mul_(1 + 2 ** -20) if a.shape[0] > 64 else out

    monkeypatch.setattr(torch, "mm", tall_differs)
    assert max(probe(4, 48, 32, (1, 48), torch.float32, 1)) <= 16
    assert gemm.split_tiles(75, (1, 2, 4, 8, 16, 32, 64)) == [64, 8, 2, 1]

    def first_row_differs(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:  # a row's place matters
        out = real_mm(a, b, **kw)
        out[0].mul_(1 + 2 ** -20)
        return out

    monkeypatch.setattr(torch, "mm", first_row_differs)
    assert probe(4, 48, 32, (1, 48), torch.float32, 1) == (1,)  # no stacking, so no packed rows either


def test_tile_gemm_rows_keep_their_tile_bits() -> None:
    """With the tile counts the probe allows on this machine, ``tile_gemm`` over many row tiles
    (stacked or not) gives each row the bits of its own tile GEMM."""
    from eagle3.runtime.kernels.torch_ref import gemm

    gen = _gen(5)
    w = torch.randn(96, 40, generator=gen)
    sizes = gemm.stack_sizes(16, 40, 96, tuple(w.t().stride()), torch.float32, torch.get_num_threads())
    for rows, nb in ((16, 1), (16, 7), (16, 75)):
        x = torch.randn(nb * rows, 40, generator=gen)
        tiles = torch.bmm(x.view(nb, rows, 40), w.t().expand(nb, 40, 96)).view(nb * rows, 96)
        assert torch.equal(gemm.tile_gemm(x, w.t(), rows, sizes), tiles)
        assert torch.equal(gemm.tile_gemm(x, w.t(), rows, (1,)), tiles)


def _single_token_meta(meta: AttnMetadata, b: int, row: int) -> AttnMetadata:
    """The query row ``row`` (of sequence ``b``) alone in a forward, as a decode step runs it."""
    p = meta.positions[row: row + 1]
    return AttnMetadata(p, torch.tensor([0, 1], dtype=torch.int32), (p + 1).to(torch.int32),
                        meta.slot_mapping[row: row + 1], meta.block_tables[b: b + 1], meta.block_size)


@pytest.mark.parametrize("hkv,g,d,dv,shared", [(1, 4, 48, 32, True), (4, 1, 32, 32, False), (2, 3, 16, 8, False),
                                               (1, 16, 64, 48, True)])
def test_attention_schedules_give_decode_bits(monkeypatch, hkv: int, g: int, d: int, dv: int, shared: bool) -> None:
    """Long prefill chunks (per-sequence schedule), a short chunk and a decode row (gathered
    units), in one forward, in memory-bounded groups or not: every row is bit-identical to the
    same query decoded alone."""
    from eagle3.runtime.kernels.torch_ref import attention as tr  # (tunables live in their module)

    lens_new, lens_ctx = [300, 40, 7, 1], [0, 100, 150, 250]
    meta, _ = _paged(lens_new, lens_ctx, block=4, slots_total=1024, seed=12)
    gen = _gen(13)
    if shared:  # MLA: values are the first dv dims of the cached latent
        lat = torch.randn(1024, d, generator=gen).to(torch.bfloat16)
        k_cache, v_cache = lat[:, None, :], lat[:, None, :dv]
    else:
        kv = torch.randn(1024, 2, hkv, d, generator=gen).to(torch.bfloat16)
        k_cache, v_cache = kv[:, 0], kv[:, 1, :, :dv]
    q = torch.randn(sum(lens_new), hkv, g, d, generator=gen).to(torch.bfloat16)
    plan = tr.plan_attention(meta)
    qt = tr.query_tile_tokens(g)
    out = BE.attention(q, k_cache, v_cache, meta, 0.2, plan)
    sched = next(iter(plan._schedules.values()))
    assert [c.t1 - c.t0 for c in sched.seqs] == [300, 40] and len(sched.units) == 1
    # the 7-token chunk's row tiles share their key tiles: stacked where this BLAS allows it
    assert (sched.units[0].blocks is not None) == (len(tr._stack_sizes(q.device, qt * g, d, dv, d if shared else dv)) > 1)
    assert sum(lens_new) > 4 * KEY_TILE and qt * g >= tr.ATTN_MIN_ROWS
    cu = meta.cu_seqlens_q.tolist()
    for b in range(len(lens_new)):
        for row in sorted({cu[b], cu[b + 1] - 1, (cu[b] + cu[b + 1]) // 2}):
            one = BE.attention(q[row: row + 1], k_cache, v_cache, _single_token_meta(meta, b, row), 0.2)
            assert torch.equal(one, out[row: row + 1]), (b, row)
    monkeypatch.setattr(tr, "ATTN_CHUNK_FLOATS", 20_000)  # many small groups in both schedules
    small = tr.plan_attention(meta)
    assert torch.equal(BE.attention(q, k_cache, v_cache, meta, 0.2, small), out)
    sched = next(iter(small._schedules.values()))
    assert len(sched.seqs[0].groups) > 2 and len(sched.units) > 1
    with monkeypatch.context() as m:  # both schedules as R-row tiles, no stacked rows
        m.setattr(tr, "_stack_sizes", lambda *a: (1,))
        assert torch.equal(BE.attention(q, k_cache, v_cache, meta, 0.2, tr.plan_attention(meta)), out)
    monkeypatch.setattr(tr, "SEQ_PATH_MIN_TOKENS", 10**9)  # everything through gathered units
    gathered = tr.plan_attention(meta)
    assert torch.equal(BE.attention(q, k_cache, v_cache, meta, 0.2, gathered), out)
    assert not next(iter(gathered._schedules.values())).seqs


def test_write_cache_skips_negative_slots() -> None:
    cache = torch.zeros(8, 3)
    BE.write_cache(cache, torch.tensor([2, -1, 5]), torch.ones(3, 3) * torch.tensor([[1.0], [2.0], [3.0]]))
    assert cache[2].tolist() == [1, 1, 1] and cache[5].tolist() == [3, 3, 3] and cache.sum() == 12


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def _moe_ref(x, ids, w, gate, up, down):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(x[t] @ gate[e].t()) * (x[t] @ up[e].t())
            out[t] += w[t, j] * (h @ down[e].t()).float()
    return out


@pytest.mark.parametrize("path", ["all", "gather", "loop"])
def test_moe_matches_per_token_loop_and_is_batch_invariant(path: str) -> None:
    g = _gen(9)
    e_, h_, i_ = 6, 64, 32
    gate = [torch.randn(i_, h_, generator=g) / 8 for _ in range(e_)]
    up = [torch.randn(i_, h_, generator=g) / 8 for _ in range(e_)]
    down = [torch.randn(h_, i_, generator=g) / 6 for _ in range(e_)]
    op = BE.moe()
    op.prepare([DenseWeight(w) for w in gate], [DenseWeight(w) for w in up], [DenseWeight(w) for w in down], None,
               torch.float32, torch.device("cpu"))
    if path != "all":  # the small test experts pick "all"; force the other plans
        op.path = path
    x = torch.randn(37, h_, generator=g)
    ids = torch.stack([torch.randperm(e_, generator=g)[:3] for _ in range(37)])
    w = torch.rand(37, 3, generator=g)
    y = op(x, ids, w)
    torch.testing.assert_close(y, _moe_ref(x, ids, w, gate, up, down), rtol=1e-5, atol=1e-5)
    for t in (0, 17, 36):
        assert torch.equal(op(x[t: t + 1], ids[t: t + 1], w[t: t + 1]), y[t: t + 1])
    assert math.isfinite(float(y.sum()))


def test_moe_w4a8_experts_loop_exactly() -> None:
    g = _gen(10)
    e_, h_, i_ = 4, 64, 32
    ws = [[_w4a8_weight(g, n, k) for _ in range(e_)] for n, k in ((i_, h_), (i_, h_), (h_, i_))]
    op = BE.moe()
    op.prepare([a for a, _ in ws[0]], [a for a, _ in ws[1]], [a for a, _ in ws[2]], "int8", torch.float32,
               torch.device("cpu"))
    x = torch.randn(9, h_, generator=g)
    ids = torch.stack([torch.randperm(e_, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    y = op(x, ids, w)
    ref = _moe_ref(x, ids, w, [d for _, d in ws[0]], [d for _, d in ws[1]], [d for _, d in ws[2]])
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()
    assert torch.equal(op(x[3:4], ids[3:4], w[3:4]), y[3:4])


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_w4a8_batched_quantization_keeps_per_expert_bits(act: str, dtype: torch.dtype) -> None:
    """The INT4 experts quantize all routed rows' activations once, then run one integer GEMM per
    expert: the bits of each expert's own exact linear (int8_linear / fp8_int4_linear) on its rows,
    as a per-expert loop computes them, here written out independently."""
    g = _gen(11)
    e_, h_, i_ = 5, 64, 32
    ws = [[_w4a8_weight(g, n, k)[0] for _ in range(e_)] for n, k in ((i_, h_), (i_, h_), (h_, i_))]
    op = BE.moe()
    op.prepare(ws[0], ws[1], ws[2], act, dtype, torch.device("cpu"))
    x = torch.randn(13, h_, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e_, generator=g)[:2] for _ in range(13)])
    tw = torch.rand(13, 2, generator=g)
    lin = int8_linear if act == "int8" else fp8_int4_linear

    def expert(w: Int4Weight, rows: torch.Tensor) -> torch.Tensor:
        return lin(rows, w.codes, w.scale * w.tensor_scale).to(dtype)

    ref = torch.zeros(13, h_, dtype=torch.float32)
    for e in range(e_):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            gu = torch.cat([expert(ws[0][e], x[tok]), expert(ws[1][e], x[tok])], dim=-1)
            gate, up = gu.split(i_, dim=-1)
            y_e = expert(ws[2][e], silu(gate) * up)  # (the backend's batch-invariant silu)
            ref.index_add_(0, tok, y_e.float() * tw[tok, slot, None])
    y = op(x, ids, tw)
    assert torch.equal(y, ref.to(dtype))


def test_unit_groups_count_a_sequences_shared_keys_once(monkeypatch) -> None:
    """With stacking, a sequence's later row tiles read its first tile's gathered keys, so a
    memory-bounded group holds more of them; without it every tile pays for its own keys."""
    from eagle3.runtime.kernels.torch_ref import attention as tr

    monkeypatch.setattr(tr, "ATTN_CHUNK_FLOATS", 1000)
    bounds = tr.AttnPlan._group_bounds
    seqs, chain = [0, 0, 0, 0, 1, 1], [0] * 6
    assert bounds(seqs, chain, 2, 100, 90, 1) == [(0, 5), (5, 6)]  # 200 floats a tile: five fit
    assert bounds(seqs, chain, 2, 100, 90, 8) == [(0, 6)]  # later tiles of a sequence: 20 floats
    assert bounds(seqs, chain, 2, 100, 90, 2) == [(0, 6)]  # 200 + 20, 200 + 20, 200 + 20
    assert bounds(seqs, [0, 2, 2, 2, 0, 0], 2, 100, 90, 8) == [(0, 5), (5, 6)]  # tree tiles: own keys
    assert bounds([0, 1, 2], [0] * 3, 20, 100, 90, 8) == [(0, 1), (1, 2), (2, 3)]  # over budget: alone
