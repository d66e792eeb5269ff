"""Tree attention in the Triton kernels (MLA latent and paged GQA), against the torch reference:
the same metadata (``AttnMetadata.tree``) gives the reference's outputs within fp32 rounding, each
node gives the bits of its root-to-node path run through the same kernel as a chain (a tree query
reads its virtual key positions: context, then its ancestors in depth order), a node's output bits
do not depend on its non-ancestors, and trees over 64 nodes are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import UsageError  # noqa: E402
from eagle3.runtime.context import AttnMetadata, TreeMask  # noqa: E402
from eagle3.runtime.kernels import get_backend  # noqa: E402
from eagle3.runtime.spec.tree import ancestor_mask  # noqa: E402
from tests.runtime.test_tree_attention import _Batch, _caches, _chain_output, _random_tree  # noqa: E402

SHAPES = [pytest.param(2, 3, 16, 8, False, id="paged-gqa"), pytest.param(1, 4, 48, 32, True, id="mla-latent")]


def _to(meta: AttnMetadata, device: torch.device) -> AttnMetadata:
    assert meta.tree is not None
    return AttnMetadata(meta.positions.to(device), meta.cu_seqlens_q.to(device), meta.context_lens.to(device),
                        meta.slot_mapping.to(device), meta.block_tables.to(device), meta.block_size,
                        tree=TreeMask(meta.tree.num_nodes, meta.tree.ancestors.to(device)))


@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES)
def test_tree_attention_matches_the_reference(device: torch.device, hkv: int, g: int, d: int, dv: int,
                                              shared: bool) -> None:
    trees = [_random_tree(1), None, _random_tree(3, k=4, steps=2, n=6)]
    bt = _Batch(ctx=[40, 9, 33], pre=[0, 1, 3], trees=trees, seed=4)
    _, k_cache, v_cache = _caches(hkv, d, dv, shared, seed=5)
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=torch.Generator().manual_seed(6))
    want = get_backend("torch").attention(q, k_cache, v_cache, bt.meta, 0.25)
    be = get_backend("triton", device)
    meta = _to(bt.meta, device)
    kc, vc = k_cache.to(device), v_cache.to(device)
    if shared:  # MLA: the values are a prefix view of the same latent rows (the kernel's latent path)
        lat = k_cache[:, 0].to(device)
        kc, vc = lat[:, None, :], lat[:, None, :dv]
    got = be.attention(q.to(device), kc, vc, meta, 0.25, be.plan_attention(meta))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES)
def test_each_node_equals_its_path_run_as_a_chain(device: torch.device, hkv: int, g: int, d: int, dv: int,
                                                  shared: bool, dtype: torch.dtype) -> None:
    # sequence 0's tree straddles the kernels' key tile boundary at 32 (BLOCK_N); sequence 2 has
    # an ordinary chunk before its tree
    trees = [_random_tree(1), None, _random_tree(3, k=4, steps=2, n=6)]
    bt = _Batch(ctx=[27, 9, 30], pre=[0, 1, 3], trees=trees, seed=4)
    store, k_cache, v_cache = _caches(hkv, d, dv, shared, seed=5, dtype=dtype)
    store = store.to(device)
    kc, vc = (store[:, None, :], store[:, None, :dv]) if shared else (store[:, 0], store[:, 1, :, :dv])
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    be = get_backend("triton", device)
    meta = _to(bt.meta, device)
    out = be.attention(q, kc, vc, meta, 0.25, be.plan_attention(meta))
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        for i in range(tree.shape[0]):
            got = out[bt.rows[(b, bt.pre[b] + i)]]
            for verify in (False, True):
                want = _chain_output(bt, b, i, q, kc, vc, shared, 0.25, verify, be)
                assert torch.equal(got, want), (b, i, verify, float((got.float() - want.float()).abs().max()))


@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES)
def test_non_ancestors_do_not_change_a_node_bits(device: torch.device, hkv: int, g: int, d: int, dv: int,
                                                 shared: bool) -> None:
    tree = _random_tree(7, k=3, steps=3, n=9)
    bt = _Batch(ctx=[35], pre=[0], trees=[tree], seed=8)
    store, _, _ = _caches(hkv, d, dv, shared, seed=9)
    be = get_backend("triton", device)
    meta = _to(bt.meta, device)
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=torch.Generator().manual_seed(10)).to(device)

    def run(st: torch.Tensor) -> torch.Tensor:
        st = st.to(device)
        kc, vc = (st[:, None, :], st[:, None, :dv]) if shared else (st[:, 0], st[:, 1, :, :dv])
        return be.attention(q, kc, vc, meta, 0.3, be.plan_attention(meta))

    out = run(store)
    anc = ancestor_mask(tree[None])[0]
    g2 = torch.Generator().manual_seed(11)
    for i in (3, 8):
        others = torch.tensor([bt.slot_of[(0, 35 + j)] for j in range(9) if not bool(anc[i, j])])
        changed = store.clone()
        changed[others] = torch.randn(changed[others].shape, generator=g2) * 5.0
        row = bt.rows[(0, i)]
        assert torch.equal(run(changed)[row], out[row]), i


def test_trees_over_64_nodes_are_refused(device: torch.device) -> None:
    n = 65
    chain = torch.arange(-1, n - 1)
    bt = _Batch(ctx=[3], pre=[0], trees=[chain], seed=1)
    with pytest.raises(UsageError, match="up to 64 tree nodes"):
        get_backend("triton", device).plan_attention(_to(bt.meta, device))


def _graph_meta(meta: AttnMetadata) -> AttnMetadata:
    """``meta`` as a CUDA graph's metadata carries it: the host ``cu`` and a device-tensor cache."""
    assert meta.tree is not None
    return AttnMetadata(meta.positions, meta.cu_seqlens_q, meta.context_lens, meta.slot_mapping, meta.block_tables,
                        meta.block_size, host_cu=meta.cu_seqlens_q.tolist(), cache={}, tree=meta.tree)


@pytest.mark.parametrize(("hkv", "g", "d", "dv", "shared"), SHAPES)
def test_graph_metadata_gives_the_eager_bits(device: torch.device, hkv: int, g: int, d: int, dv: int,
                                             shared: bool) -> None:
    """Under a graph every tree query gets a chunk of its own (the tree changes per replay): the
    same bits as the eager chunks along root-to-node paths."""
    trees = [_random_tree(12, k=3, steps=3, n=9), None, _random_tree(13, k=2, steps=3, n=5)]
    bt = _Batch(ctx=[30, 9, 41], pre=[0, 2, 0], trees=trees, seed=14)
    store, _, _ = _caches(hkv, d, dv, shared, seed=15)
    store = store.to(device)
    kc, vc = (store[:, None, :], store[:, None, :dv]) if shared else (store[:, 0], store[:, 1, :, :dv])
    q = torch.randn(bt.num_tokens, hkv, g, d, generator=torch.Generator().manual_seed(16)).to(device)
    be = get_backend("triton", device)
    eager, graph = _to(bt.meta, device), _graph_meta(_to(bt.meta, device))
    want = be.attention(q, kc, vc, eager, 0.25, be.plan_attention(eager))
    got = be.attention(q, kc, vc, graph, 0.25, be.plan_attention(graph))
    assert torch.equal(got, want)


def test_graph_metadata_reads_no_device_value(device: torch.device) -> None:
    """A capture may not copy a device value to the host: with every tensor of the metadata on
    the ``meta`` device (no values at all) the plan of a graph's tree step still builds."""
    bt = _Batch(ctx=[30, 12], pre=[0, 0], trees=[_random_tree(17, k=2, steps=3, n=6), _random_tree(18, n=6)],
                seed=19)
    meta = _graph_meta(bt.meta)
    dev = torch.device("meta")
    meta = AttnMetadata(meta.positions.to(dev), meta.cu_seqlens_q.to(dev), meta.context_lens.to(dev),
                        meta.slot_mapping.to(dev), meta.block_tables.to(dev), meta.block_size, host_cu=meta.host_cu,
                        cache={}, tree=TreeMask(meta.tree.num_nodes, meta.tree.ancestors.to(dev)))
    plan = get_backend("triton", device).plan_attention(meta)
    assert plan.tree is not None and plan.tree[1].device == dev
    assert plan.chunks(2).shape[0] == 12 and plan.order(2).device == dev  # one chunk per tree query
    with pytest.raises(NotImplementedError):  # what an eager plan does here (it reads the paths back)
        get_backend("triton", device).plan_attention(
            AttnMetadata(meta.positions, meta.cu_seqlens_q, meta.context_lens, meta.slot_mapping, meta.block_tables,
                         meta.block_size, host_cu=meta.host_cu, tree=meta.tree))
