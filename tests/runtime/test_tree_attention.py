"""Tree attention in the torch reference (``AttnMetadata.tree``): every node attends to the cached
context, its ancestors and itself.

* each node's output equals its root-to-node path run as an ordinary chain bit for bit (fp32 and
  bf16; the chain as a decode row and as a verify of the whole path);
* changing the keys/values of a node's non-ancestors leaves its output bit-identical;
* a chain-shaped tree gives the bits of ordinary causal attention.

Shapes: GQA MHA (the Llama draft) and MLA-shaped MQA with values a prefix view of the latent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata, TreeMask, pack_tree_paths
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.spec.tree import ancestor_mask, build_tree, path
from tests.runtime.model_kit import single_thread

BE = get_backend("torch")
BLOCK = 4
SLOTS = 1024

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_tree(seed: int, k: int = 3, steps: int = 3, n: int = 10) -> torch.Tensor:
    g = _gen(seed)
    lps = [torch.randn(1, 1 if s == 0 else k, 12, generator=g).log_softmax(-1) for s in range(steps)]
    return build_tree(torch.zeros(1, dtype=torch.int64), lps, topk=k, num_nodes=n).parents[0]


class _Batch:
    """Sequences with ``ctx`` cached tokens, then ``pre`` ordinary query tokens, then a tree
    (``parents``, or none), on scattered blocks."""

    def __init__(self, ctx: list[int], pre: list[int], trees: list[torch.Tensor | None], seed: int) -> None:
        g = _gen(seed)
        perm = torch.randperm(SLOTS // BLOCK, generator=g).tolist()
        self.tables, pos, slots, self.slot_of, self.rows = [], [], [], {}, {}
        self.ctx, self.pre, self.trees = ctx, pre, trees
        nmax = max([t.shape[0] for t in trees if t is not None] + [1])
        anc = torch.zeros(len(ctx), nmax, nmax, dtype=torch.bool)
        num_nodes = []
        t = 0
        for b, (c, p, tree) in enumerate(zip(ctx, pre, trees, strict=True)):
            n = 0 if tree is None else tree.shape[0]
            total = c + p + n
            table = [perm.pop() for _ in range(-(-total // BLOCK))]
            self.tables.append(table)
            for j in range(total):
                self.slot_of[(b, j)] = table[j // BLOCK] * BLOCK + j % BLOCK
            start = c + p
            pos += list(range(c, start))
            if tree is not None:
                depth = [len(path(tree, i)) - 1 for i in range(n)]
                pos += [start + d for d in depth]
                anc[b, :n, :n] = ancestor_mask(tree[None])[0]
            slots += [self.slot_of[(b, j)] for j in range(c, total)]
            for i in range(p + n):
                self.rows[(b, i)] = t
                t += 1
            num_nodes.append(n)
        width = max(len(x) for x in self.tables)
        bt = torch.full((len(ctx), width), -1, dtype=torch.int32)
        for b, x in enumerate(self.tables):
            bt[b, : len(x)] = torch.tensor(x)
        lens = [c + p + (0 if tr is None else tr.shape[0]) for c, p, tr in zip(ctx, pre, trees, strict=True)]
        cu = torch.tensor([0] + torch.tensor([p + ln - c - p for c, p, ln in zip(ctx, pre, lens, strict=True)])
                          .cumsum(0).tolist(), dtype=torch.int32)
        self.meta = AttnMetadata(torch.tensor(pos), cu, torch.tensor(lens, dtype=torch.int32),
                                 torch.tensor(slots), bt, BLOCK, tree=TreeMask(num_nodes, anc))
        self.num_tokens = t


def _caches(hkv: int, d: int, dv: int, shared: bool, seed: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(storage, k_cache, v_cache): MLA-shaped when ``shared`` (values = first dv dims of the keys)."""
    g = _gen(seed)
    if shared:
        lat = torch.randn(SLOTS, d, generator=g).to(dtype)
        return lat, lat[:, None, :], lat[:, None, :dv]
    kv = torch.randn(SLOTS, 2, hkv, d, generator=g).to(dtype)
    return kv, kv[:, 0], kv[:, 1, :, :dv]


def _chain_output(bt: _Batch, b: int, node: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  shared: bool, scale: float, verify: bool = False, be: Any = BE) -> torch.Tensor:
    """Node ``node`` of sequence ``b`` run as an ordinary chain: the context then its path, laid
    out contiguously in a fresh cache, the node's query at the last position (``verify``: every
    path node queried, as a chain verify does, the ancestors' queries from their own rows), on
    backend ``be`` (the tensors' device)."""
    tree = bt.trees[b]
    assert tree is not None
    start = bt.ctx[b] + bt.pre[b]
    nodes = path(tree, node)
    src = [bt.slot_of[(b, j)] for j in range(start)] + [bt.slot_of[(b, start + j)] for j in nodes]
    length = len(src)
    nb = -(-length // BLOCK)
    idx = torch.tensor(src + [src[-1]] * (nb * BLOCK - length), device=k_cache.device)
    if shared:
        lat = k_cache[:, 0][idx]
        kc, vc = lat[:, None, :], lat[:, None, : v_cache.shape[-1]]
    else:
        kc, vc = k_cache[idx], v_cache[idx]
    rows = [bt.rows[(b, bt.pre[b] + j)] for j in (nodes if verify else nodes[-1:])]
    m = len(rows)
    dev = k_cache.device
    meta = AttnMetadata(torch.arange(length - m, length, device=dev), torch.tensor([0, m], dtype=torch.int32, device=dev),
                        torch.tensor([length], dtype=torch.int32, device=dev), torch.full((m,), -1, device=dev),
                        torch.arange(nb, dtype=torch.int32, device=dev)[None], BLOCK)
    return be.attention(q[torch.tensor(rows, device=q.device)], kc, vc, meta, scale)[-1]


# query tiles of 2, 1, 1 and 4 tokens (query_tile_tokens): tree paths packed into shared tiles or not
SHAPES = [pytest.param(2, 3, 16, 8, False, id="mha-gqa"), pytest.param(1, 4, 48, 32, True, id="mla-latent"),
          pytest.param(1, 16, 64, 48, True, id="mla-16-heads"), pytest.param(2, 1, 16, 16, False, id="mha-group-1")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES)
def test_each_node_equals_its_path_run_as_a_chain(hkv: int, g: int, d: int, dv: int, shared: bool,
                                                  dtype: torch.dtype) -> None:
    trees = [_random_tree(1), None, _random_tree(2, k=2, steps=4, n=9), _random_tree(3, k=4, steps=2, n=6)]
    # contexts across key tiles (sequence 0: its tree's node-order positions straddle the tile
    # boundary at 64, its paths' chain positions do not all); sequence 1 is a plain decode row;
    # sequence 3 has a prefill chunk before its tree
    bt = _Batch(ctx=[58, 30, 3, 60], pre=[0, 1, 0, 5], trees=trees, seed=4)
    _, k_cache, v_cache = _caches(hkv, d, dv, shared, seed=5, dtype=dtype)
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=_gen(6)).to(dtype)
    out = BE.attention(q, k_cache, v_cache, bt.meta, 0.25)
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        for i in range(tree.shape[0]):
            got = out[bt.rows[(b, bt.pre[b] + i)]]
            for verify in (False, True):
                want = _chain_output(bt, b, i, q, k_cache, v_cache, shared, 0.25, verify)
                assert torch.equal(got, want), (b, i, verify, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES[:2])
def test_non_ancestors_do_not_change_a_node_bits(hkv: int, g: int, d: int, dv: int, shared: bool) -> None:
    tree = _random_tree(7, k=3, steps=3, n=12)
    bt = _Batch(ctx=[67, 9], pre=[0, 2], trees=[tree, tree.clone()], seed=8)
    store, k_cache, v_cache = _caches(hkv, d, dv, shared, seed=9)
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=_gen(10))
    out = BE.attention(q, k_cache, v_cache, bt.meta, 0.3)
    anc = ancestor_mask(tree[None])[0]
    g2 = _gen(11)
    for b in range(2):
        start = bt.ctx[b] + bt.pre[b]
        for i in range(tree.shape[0]):
            others = [bt.slot_of[(b, start + j)] for j in range(tree.shape[0]) if not bool(anc[i, j])]
            if not others:
                continue
            changed = store.clone()
            changed[torch.tensor(others)] = torch.randn(changed[torch.tensor(others)].shape, generator=g2) * 5.0
            kc, vc = (changed[:, None, :], changed[:, None, :dv]) if shared else (changed[:, 0], changed[:, 1, :, :dv])
            row = bt.rows[(b, bt.pre[b] + i)]
            assert torch.equal(BE.attention(q, kc, vc, bt.meta, 0.3)[row], out[row]), (b, i)


@pytest.mark.parametrize("n", [5, 40])  # 40: without the tree a long chunk takes the per-sequence schedule
def test_chain_shaped_tree_gives_causal_bits(n: int) -> None:
    chain = torch.arange(-1, n - 1)
    bt = _Batch(ctx=[50, 3], pre=[0, 0], trees=[chain, chain.clone()], seed=12)
    _, k_cache, v_cache = _caches(2, 16, 16, False, seed=13)
    q = torch.randn(bt.num_tokens, 2, 2, 16, generator=_gen(14))
    causal = AttnMetadata(bt.meta.positions, bt.meta.cu_seqlens_q, bt.meta.context_lens, bt.meta.slot_mapping,
                          bt.meta.block_tables, BLOCK)
    assert torch.equal(BE.attention(q, k_cache, v_cache, bt.meta, 0.2), BE.attention(q, k_cache, v_cache, causal, 0.2))


def test_frontier_queries_see_ancestors_cached_by_earlier_steps() -> None:
    """A draft step queries only the newest nodes of a tree region whose older nodes are already
    cached: those rows get the same bits as in a forward that queries every node."""
    tree = _random_tree(15, k=3, steps=3, n=10)
    bt = _Batch(ctx=[66, 7], pre=[0, 0], trees=[tree, tree.clone()], seed=16)
    _, k_cache, v_cache = _caches(1, 48, 32, False, seed=17)
    q = torch.randn(bt.num_tokens, 1, 4, 48, generator=_gen(18))
    full = BE.attention(q, k_cache, v_cache, bt.meta, 0.2)
    m = 4  # the last m nodes of each tree are this step's queries
    rows = torch.tensor([bt.rows[(b, j)] for b in range(2) for j in range(10 - m, 10)])
    meta = AttnMetadata(bt.meta.positions[rows], torch.tensor([0, m, 2 * m], dtype=torch.int32), bt.meta.context_lens,
                        bt.meta.slot_mapping[rows], bt.meta.block_tables, BLOCK, tree=bt.meta.tree)
    assert torch.equal(BE.attention(q[rows], k_cache, v_cache, meta, 0.2), full[rows])


def test_ancestor_mask_narrower_than_the_tree_is_refused() -> None:
    bt = _Batch(ctx=[5], pre=[0], trees=[torch.tensor([-1, 0, 0])], seed=1)
    bt.meta.tree = TreeMask([4], bt.meta.tree.ancestors)
    _, k_cache, v_cache = _caches(1, 8, 8, False, seed=2)
    with pytest.raises(UsageError, match="tree of 4 nodes"):
        BE.attention(torch.randn(3, 1, 1, 8), k_cache, v_cache, bt.meta, 1.0)


def test_tree_queries_share_tiles_along_one_path_only() -> None:
    """``pack_tree_paths``: groups of at most ``size`` queries, each on one root-to-node path (every
    query an ancestor of the next), so the deepest query's key map serves the group."""
    tree = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6])
    paths = [[10 + j for j in path(tree, i)] for i in range(8)]
    assert pack_tree_paths(paths, 3) == [[0, 1, 3], [2, 5], [4], [6, 7]]
    assert pack_tree_paths(paths, 1) == [[i] for i in range(8)]
    frontier = paths[3:5]  # a draft step: the queries' parents are cached, not queried
    assert pack_tree_paths(frontier, 4) == [[0], [1]]


@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES[:2])
def test_tree_tiles_share_their_context_keys_with_the_same_bits(monkeypatch, hkv: int, g: int, d: int, dv: int,
                                                                 shared: bool) -> None:
    """Where this BLAS allows stacking, a tree's query tiles read each context key tile in one
    stacked GEMM (blocks of several tiles, their real rows packed without the padding token
    slots) while the key tiles of their own virtual positions stay theirs; the outputs are those of
    the unstacked tiles, bit for bit."""
    from eagle3.runtime.kernels.torch_ref import attention as tr

    trees = [_random_tree(12, k=3, steps=3, n=12), None, _random_tree(13, k=2, steps=4, n=9)]
    bt = _Batch(ctx=[150, 30, 70], pre=[0, 1, 3], trees=trees, seed=14)
    _, k_cache, v_cache = _caches(hkv, d, dv, shared, seed=15)
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=_gen(16))
    plan = tr.plan_attention(bt.meta)
    out = BE.attention(q, k_cache, v_cache, bt.meta, 0.2, plan)
    units = next(iter(plan._schedules.values())).units
    qt = tr.query_tile_tokens(g)
    if len(tr._stack_sizes(q.device, qt * g, d, dv, d if shared else dv)) > 1:
        blocks = [(b, u.slots.shape[0]) for u in units for b in (u.blocks or [])]
        sizes = [b.tile.shape[1] // (qt * g) for b, _ in blocks]
        assert max(sizes) > 1 and 1 in sizes  # shared context tiles, and tiles of one path's own keys
        # packed: some block's rows come from more query tiles than it has row tiles (the one-path
        # tiles' padding token slots left out; tiles of one token have none)
        assert qt == 1 or any(len(set(b.tile[i][b.dst[i] < nk].tolist())) > b.tile.shape[1] // (qt * g)
                   for b, nk in blocks for i in range(b.tile.shape[0]))
    monkeypatch.setattr(tr, "_stack_sizes", lambda *a: (1,))
    assert torch.equal(BE.attention(q, k_cache, v_cache, bt.meta, 0.2, tr.plan_attention(bt.meta)), out)
