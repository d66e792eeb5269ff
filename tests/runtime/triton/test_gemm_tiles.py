"""The GEMM launch shapes (``kernels/triton/gemm_tiles.py``) at Kimi-K2.5's weight shapes, as
plain arithmetic (no kernel runs): the tiles and the split of K come from the weight's format and
shape only, a decode GEMM or one expert's GEMM launches enough programs for ~132 SMs, and every
K chunk is whole K steps holding whole INT4 groups / E8M0 blocks."""

from __future__ import annotations

import inspect

import pytest

from eagle3.runtime.kernels.triton.gemm_tiles import (
    DENSE,
    FP8,
    INT4,
    MXFP4,
    GemmTiles,
    dense_tiles,
    gemm_tiles,
)

HIDDEN, INTER = 7168, 2048  # Kimi-K2.5: hidden size, routed-expert width

# (format, weight rows, inputs, INT4 group) -> (bn, bk, split): the MoE's gate + up (both halves in
# one bank) and down projections in each shipped format, and a dense 7168 -> 4096
KIMI = {
    "moe w13 w4a16 g32": ((INT4, 2 * INTER, HIDDEN, 32), (64, 128, 4)),
    "moe w2 w4a16 g32": ((INT4, HIDDEN, INTER, 32), (64, 128, 2)),
    "moe w13 w4a8 (per-channel INT4)": ((INT4, 2 * INTER, HIDDEN, 0), (64, 128, 4)),
    "moe w2 w4a8 (per-channel INT4)": ((INT4, HIDDEN, INTER, 0), (64, 128, 2)),
    "moe w13 mxfp4": ((MXFP4, 2 * INTER, HIDDEN, 0), (64, 128, 4)),
    "moe w2 mxfp4": ((MXFP4, HIDDEN, INTER, 0), (64, 128, 2)),
    "dense w4a16 7168 -> 4096": ((INT4, 4096, HIDDEN, 32), (64, 128, 4)),
    "dense bf16 7168 -> 4096": ((DENSE, 4096, HIDDEN, 0), (64, 64, 4)),
    "fp8 block 7168 -> 2048": ((FP8, 2048, HIDDEN, 0), (64, 64, 8)),
}


@pytest.mark.parametrize("name", list(KIMI))
def test_kimi_shapes_fill_the_gpu_with_whole_k_chunks(name: str) -> None:
    (fmt, n, k, group), (bn, bk, split) = KIMI[name]
    t = gemm_tiles(fmt, n, k, group)
    assert (t.bm, t.bn, t.bk, t.split) == (16, bn, bk, split)
    assert -(-n // t.bn) * t.split >= 200  # one row block (a decode GEMM, one expert): ~1.5 programs per SM
    chunk = k // t.split
    assert k % t.split == 0 and chunk % t.bk == 0 and chunk // t.bk >= 8  # whole steps, >= 8 per chunk
    assert t.bk % 8 == 0 and t.bk % 32 == 0 and t.bk % max(group, 1) == 0  # whole words, blocks, groups


def test_dense_products_at_kimi_shapes() -> None:
    router = dense_tiles(384, HIDDEN, fp32=True)  # x.float() @ W_gate.T, IEEE fp32
    assert (router.bn, router.bk, router.split) == (32, 32, 16)
    assert 384 // router.bn * router.split == 192 and HIDDEN // router.split % router.bk == 0
    for n, k in ((512, 128), (128, 512)):  # MLA absorption per head: q_nope @ W_UK, o_lat @ W_UV
        t = dense_tiles(n, k, fp32=False)
        assert (t.bn, t.bk, t.split) == (64, 64, 1)  # 64 heads x 8 (or 2) column tiles: no split needed
    assert dense_tiles(24, 1024, fp32=True).split == 4  # test_dense_gemm's split-K case


def test_tiles_never_see_the_rows_and_the_interpreter_runs_whole_weights() -> None:
    """The rule's inputs are the weight's format and shape: nothing about the batch can change a
    row's tile, K loop or split."""
    assert list(inspect.signature(gemm_tiles).parameters) == ["fmt", "n", "k", "group", "interpret"]
    assert list(inspect.signature(dense_tiles).parameters) == ["n", "k", "fp32"]
    # interpreted (CPU tests): one program covers up to 1024 x 256 of the weight, never split
    assert gemm_tiles(INT4, 2 * INTER, HIDDEN, 32, interpret=True) == GemmTiles(16, 1024, 256, 1)
    assert gemm_tiles(INT4, 48, 96, 16, interpret=True) == GemmTiles(16, 64, 128, 1)
    # the kernel tests' small weights: one column tile, K in one masked step, no split
    assert gemm_tiles(INT4, 48, 96, 32) == GemmTiles(16, 64, 128, 1)
    assert gemm_tiles(INT4, 64, 64, 128).bk == 128  # a K step holds whole groups
