"""MLA attention split over the keys at fixed positions (``triton/mla_attention.py``).

A row's keys are cut into splits of ``S`` absolute positions whose partials merge in split order;
the split launch (stage 1 per split + merge) and the serial launch (one program walking its splits)
must compute exactly that. Checked: both against the torch reference (fp32 1e-5, as
test_attention_kernels.py) for contexts shorter than, equal to and longer than ``S``, several
splits, verify windows and prefill chunks straddling a split boundary (splits past a row's position
must not enter its merge), an fp8 latent; and bitwise, where the claim holds on any machine:

* split launch == serial launch: the same chunks, tile shapes and rows feed the same dots (so
  even the interpreter's BLAS, whose bits may follow a row's place in a tile, sees identical
  inputs), and the merges are elementwise;
* at 64 heads (one token per program, the Kimi layout), a token alone, among other sequences, as
  the last token of a verify window, under a wider block table (a graph's static width: more
  programs that exit) and through either launch: each time its program holds the same 64 query
  rows at the same tile positions over the same key tiles, so the bits agree under any dot that
  is row independent for a fixed tile (tensor cores; numpy for fixed inputs);
* a draft-tree node and its root-to-node path run as a chain (64 heads, splits of 32 keys).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime import kv_cache  # noqa: E402
from eagle3.runtime.context import AttnMetadata  # noqa: E402
from eagle3.runtime.kernels import get_backend  # noqa: E402
from eagle3.runtime.kernels.triton import mla_attention as mla  # noqa: E402
from eagle3.runtime.kernels.triton.plan import TritonAttnPlan  # noqa: E402
from tests.runtime.test_tree_attention import _Batch, _caches, _chain_output, _random_tree  # noqa: E402
from tests.runtime.triton.test_attention_kernels import DEVICE, _meta, _one_token, _randn, _slots  # noqa: E402
from tests.runtime.triton.test_triton_tree_attention import _to  # noqa: E402

REF = get_backend("torch")
D_LAT, D_ROPE = 32, 16
S = 32  # keys per split in these tests (one 32-key tile each)
MODES = ["split", "serial"]
# (context after the step, query tokens): shorter than S, equal, one past, two splits exactly, a
# verify window across 32 and one ending on a boundary, a prefill chunk across three splits
SEQS = [(20, 1), (32, 1), (33, 1), (64, 2), (35, 4), (96, 3), (75, 12)]


def _attend(q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, mode: str | None, split: int | None = S,
            kv_scale: float = 1.0) -> torch.Tensor:
    return mla.mla_attention(q, cache, D_LAT, TritonAttnPlan(meta), 0.25, kv_scale, split=split, mode=mode)


def _reference(q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, kv_scale: float = 1.0) -> torch.Tensor:
    return REF.attention(q[:, None], cache[:, None], cache[:, None, :D_LAT], meta, 0.25, k_scale=kv_scale,
                         v_scale=kv_scale)[:, 0]


@pytest.mark.parametrize(("mode", "heads"), [("split", 4), ("serial", 4), ("split", 64)])
def test_split_matches_the_reference(mode: str, heads: int) -> None:
    meta = _meta(SEQS, 4)
    cache = _randn(_slots(meta), D_LAT + D_ROPE, dtype=torch.float32, seed=1)
    q = _randn(meta.num_tokens, heads, D_LAT + D_ROPE, dtype=torch.float32, seed=2)
    torch.testing.assert_close(_attend(q, cache, meta, mode), _reference(q, cache, meta), rtol=1e-5, atol=1e-5)


def test_split_and_serial_launches_give_the_same_bits() -> None:
    """4 heads x 16 tokens per program: verify windows and a prefill chunk share programs across
    split boundaries (64 heads: the next test)."""
    meta = _meta(SEQS, 4, seed=3)
    cache = _randn(_slots(meta), D_LAT + D_ROPE, dtype=torch.float32, seed=4)
    q = _randn(meta.num_tokens, 4, D_LAT + D_ROPE, dtype=torch.float32, seed=5)
    assert torch.equal(_attend(q, cache, meta, "split"), _attend(q, cache, meta, "serial"))


def _wider(meta: AttnMetadata, extra: int) -> AttnMetadata:
    """``meta`` with ``extra`` unused (-1) block-table columns, as a graph's static width has."""
    pad = torch.full((meta.block_tables.shape[0], extra), -1, dtype=torch.int32, device=meta.block_tables.device)
    return AttnMetadata(meta.positions, meta.cu_seqlens_q, meta.context_lens, meta.slot_mapping,
                        torch.cat([meta.block_tables, pad], 1), meta.block_size)


def test_a_row_has_its_bits_alone_in_a_batch_in_a_verify_window_and_under_a_graph_width() -> None:
    meta = _meta([(20, 1), (33, 1), (35, 4), (70, 5)], 4, seed=6)
    heads = 64
    assert mla.tile_shape(heads, D_LAT) == (64, 1)  # one token per program: rows = heads
    cache = _randn(_slots(meta), D_LAT + D_ROPE, dtype=torch.float32, seed=7)
    q = _randn(meta.num_tokens, heads, D_LAT + D_ROPE, dtype=torch.float32, seed=8)
    full = _attend(q, cache, meta, "split")
    for mode in MODES:  # a graph's static width: more split programs, all exiting
        assert torch.equal(_attend(q, cache, _wider(meta, 40), mode), full), mode
    for t in range(meta.num_tokens):  # every verify window's and prefill chunk's token as a decode row
        alone = _attend(q[t: t + 1], cache, _one_token(meta, t), None)
        assert torch.equal(alone[0], full[t]), f"token {t}"


def test_the_launch_follows_the_workspace_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla, "INTERPRET", False)
    assert mla.launch_mode(64, 16, 64, 512) == "split"  # Kimi decode at batch 64 over 4096 keys: 134 MB
    assert mla.launch_mode(64, 1024, 64, 512) == "serial"  # a graph of 64 rows over 256 Ki positions
    assert mla.launch_mode(1, 1, 64, 512) == "serial"  # one split: no workspace at all
    monkeypatch.setattr(mla, "INTERPRET", True)
    assert mla.launch_mode(64, 16, 64, 512) == "serial"


@pytest.mark.parametrize("mode", MODES)
def test_split_over_an_fp8_latent(mode: str) -> None:
    meta = _meta(SEQS, 4, seed=9)
    sc = 0.02
    cache = kv_cache.quantize(_randn(_slots(meta), D_LAT + D_ROPE, dtype=torch.float32, seed=10) * 3,
                              torch.float8_e4m3fn, sc)
    q = _randn(meta.num_tokens, 4, D_LAT + D_ROPE, dtype=torch.float32, seed=11)
    got = _attend(q, cache, meta, mode, kv_scale=sc)
    want = _reference(q, cache, meta, kv_scale=sc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_kimi_head_shapes_over_several_default_splits() -> None:
    """64 heads, latent 512 + rope 64, fp16: the model's own split (256 keys; a TP-8 shard's 64)."""
    assert mla.split_size(64, 512, 64) == 256 and mla.split_size(8, 512, 64) == 64
    be = get_backend("triton", DEVICE)
    meta = _meta([(260, 1), (258, 3)], 16)
    cache = _randn(_slots(meta), 576, dtype=torch.float16, seed=12) * 0.2
    q = _randn(meta.num_tokens, 1, 64, 576, dtype=torch.float16, seed=13) * 0.2
    args = (q, cache[:, None, :], cache[:, None, :512], meta, 576 ** -0.5)
    torch.testing.assert_close(be.attention(*args), REF.attention(*args), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize(("mode", "verify"), [("split", False), ("serial", True)])
def test_tree_nodes_equal_their_chains_across_splits(monkeypatch: pytest.MonkeyPatch, mode: str, verify: bool) -> None:
    """Through the backend (the plan's tree chunks) with splits of 32 keys, each launch."""
    monkeypatch.setattr(mla, "split_size", lambda *a: S)
    monkeypatch.setattr(mla, "launch_mode", lambda *a: mode)
    trees = [_random_tree(1), None, _random_tree(3, k=4, steps=2, n=6)]
    bt = _Batch(ctx=[27, 9, 40], pre=[0, 1, 3], trees=trees, seed=4)  # trees straddle key 32, then past it
    store, _, _ = _caches(1, 48, 32, True, seed=5)
    store = store.to(DEVICE)
    kc, vc = store[:, None, :], store[:, None, :32]
    q = torch.randn(bt.num_tokens, 1, 64, 48, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    be = get_backend("triton", DEVICE)
    meta = _to(bt.meta, DEVICE)
    out = be.attention(q, kc, vc, meta, 0.25, be.plan_attention(meta))
    torch.testing.assert_close(out.cpu(), get_backend("torch").attention(q.cpu(), kc.cpu(), vc.cpu(), bt.meta, 0.25),
                               rtol=1e-5, atol=1e-5)
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        for i in range(tree.shape[0]):
            got = out[bt.rows[(b, bt.pre[b] + i)]]
            want = _chain_output(bt, b, i, q, kc, vc, True, 0.25, verify, be)
            assert torch.equal(got, want), (b, i)
