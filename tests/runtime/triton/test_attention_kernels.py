"""MLA latent attention and paged GQA attention against the torch reference, plus row invariance.

Paged layouts with shuffled physical blocks, block sizes 1 / 4 / 16, query lengths 1 (decode),
k+1 (verify: causal inside the window by absolute position) and longer prefill chunks, contexts
crossing several 32-key tiles. fp32 and fp16 compute (the interpreter's bf16 dot is broken).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime.context import AttnMetadata  # noqa: E402
from eagle3.runtime.kernels import get_backend, torch_ref  # noqa: E402

REF = torch_ref.TorchBackend()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on CPU

# fp32: online softmax (rescaled per 32-key tile) vs the reference's two-pass softmax, and
# q.k then * scale vs (q * scale).k: a few fp32 ulps of values of size ~1.
# fp16: p is rounded to fp16 for the p.V product (flash-attention practice) and the output is
# rounded to fp16 (ulp 2^-10 near 1): a couple of fp16 ulps.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def _meta(seqs: list[tuple[int, int]], block_size: int, seed: int = 0) -> AttnMetadata:
    """Sequences of (context length after this step, query tokens), blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c, _ in seqs) + 1
    total = sum(-(-c // block_size) for c, _ in seqs)
    perm = torch.randperm(total + 3, generator=g)[:total] + 0
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    pos, cu, slots, n = [], [0], [], 0
    for b, (c, ql) in enumerate(seqs):
        nb = -(-c // block_size)
        tables[b, :nb] = perm[n: n + nb].to(torch.int32)
        n += nb
        for p in range(c - ql, c):
            pos.append(p)
            slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + ql)
    return AttnMetadata(torch.tensor(pos, device=DEVICE), torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                        torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE),
                        torch.tensor(slots, device=DEVICE), tables.to(DEVICE), block_size)


def _slots(meta: AttnMetadata) -> int:
    return (int(meta.block_tables.max()) + 4) * meta.block_size


def _one_token(meta: AttnMetadata, t: int) -> AttnMetadata:
    """``meta`` restricted to query token ``t`` (a decode step of that token alone)."""
    b = int(torch.searchsorted(meta.cu_seqlens_q[1:].long().cpu(), torch.tensor(t), right=True))
    return AttnMetadata(meta.positions[t: t + 1], torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                        meta.context_lens[b: b + 1], meta.slot_mapping[t: t + 1], meta.block_tables[b: b + 1],
                        meta.block_size)


SEQS = [  # (context, query tokens): decode, verify windows, prefill chunks, a long context
    [(1, 1), (5, 1), (9, 4), (40, 4), (70, 6), (13, 13)],
    [(33, 2), (64, 1), (3, 3)],
]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("case", "block_size"), [(0, 4), (0, 16), (1, 1)])
def test_mla_attention_matches_reference(dtype: torch.dtype, case: int, block_size: int) -> None:
    be = get_backend("triton", DEVICE)
    meta = _meta(SEQS[case], block_size, seed=case)
    heads, d_lat, d_rope = 4, 32, 16  # the tiny models' latent layout
    cache = _randn(_slots(meta), d_lat + d_rope, dtype=dtype, seed=1)
    q = _randn(meta.num_tokens, 1, heads, d_lat + d_rope, dtype=dtype, seed=2)
    args = (q, cache[:, None, :], cache[:, None, :d_lat], meta, 0.25)
    got = be.attention(*args, plan=be.plan_attention(meta))
    want = REF.attention(*args)
    assert got.shape == want.shape == (meta.num_tokens, 1, heads, d_lat) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_mla_attention_at_kimi_head_shapes() -> None:
    """64 heads, latent 512 + rope 64 (4 programs of 16 heads x 4 query tokens), short contexts."""
    be = get_backend("triton", DEVICE)
    meta = _meta([(3, 1), (37, 4)], 16)
    dtype = torch.float16
    cache = _randn(_slots(meta), 576, dtype=dtype, seed=3) * 0.2
    q = _randn(meta.num_tokens, 1, 64, 576, dtype=dtype, seed=4) * 0.2
    args = (q, cache[:, None, :], cache[:, None, :512], meta, 576 ** -0.5)
    torch.testing.assert_close(be.attention(*args), REF.attention(*args), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("hkv", "group", "head_dim"), [(4, 1, 32), (2, 4, 24), (1, 3, 16)])
def test_paged_gqa_attention_matches_reference(dtype: torch.dtype, hkv: int, group: int, head_dim: int) -> None:
    be = get_backend("triton", DEVICE)
    meta = _meta(SEQS[0], 4)
    kv = _randn(_slots(meta), 2, hkv, head_dim, dtype=dtype, seed=5)  # the draft's [S, 2, Hkv, D] cache
    q = _randn(meta.num_tokens, hkv, group, head_dim, dtype=dtype, seed=6)
    args = (q, kv[:, 0], kv[:, 1], meta, head_dim ** -0.5)
    got = be.attention(*args, plan=be.plan_attention(meta))
    torch.testing.assert_close(got, REF.attention(*args), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_attention_rows_are_batch_invariant(kind: str) -> None:
    """A token's output is bit-identical alone (decode) and among any other tokens (verify windows,
    prefill chunks, other sequences), including chunk-mates with later positions."""
    be = get_backend("triton", DEVICE)
    meta = _meta(SEQS[0], 4)
    if kind == "mla":
        cache = _randn(_slots(meta), 48, dtype=torch.float32, seed=7)
        q = _randn(meta.num_tokens, 1, 4, 48, dtype=torch.float32, seed=8)
        k, v = cache[:, None, :], cache[:, None, :32]
    else:
        kv = _randn(_slots(meta), 2, 2, 32, dtype=torch.float32, seed=9)
        q = _randn(meta.num_tokens, 2, 2, 32, dtype=torch.float32, seed=10)
        k, v = kv[:, 0], kv[:, 1]
    full = be.attention(q, k, v, meta, 0.2)
    for t in range(meta.num_tokens):
        alone = be.attention(q[t: t + 1], k, v, _one_token(meta, t), 0.2)
        assert torch.equal(alone[0], full[t]), f"token {t}"
    # the same sequences in another order and next to other work
    order = [2, 0, 5, 1, 4, 3]
    seqs = [SEQS[0][i] for i in order]
    meta2 = _meta(seqs, 4)
    # rebuild q / caches so that every sequence keeps its keys and queries
    cu = meta.cu_seqlens_q.tolist()
    q2 = torch.cat([q[cu[i]: cu[i + 1]] for i in order])
    if kind == "mla":
        k2 = torch.zeros(_slots(meta2), 1, 48, device=DEVICE)
        v2 = k2[..., :32]  # the latent prefix, as the model passes it
    else:
        k2 = torch.zeros(_slots(meta2), *k.shape[1:], device=DEVICE)
        v2 = torch.zeros(_slots(meta2), *v.shape[1:], device=DEVICE)
    for nb, ob in enumerate(order):
        c = seqs[nb][0]
        bs = 4
        for p in range(c):
            src = int(meta.block_tables[ob, p // bs]) * bs + p % bs
            dst = int(meta2.block_tables[nb, p // bs]) * bs + p % bs
            k2[dst] = k[src]
            if kind == "gqa":
                v2[dst] = v[src]
    got = be.attention(q2, k2, v2, meta2, 0.2)
    want = torch.cat([full[cu[i]: cu[i + 1]] for i in order])
    assert torch.equal(got, want)
