"""Tile shapes and split-K of the Triton GEMMs (``linear.py``, ``moe.py``, ``dense_gemm.py``), from
the weight's format and shape only, never from the number of rows: a row's tile inputs, its K
loop and the order its split-K partials are summed in are then the same alone and in any batch,
which is what keeps a token's bits independent of the batch (speculative greedy == plain greedy).

Pure Python (no triton import) so the choices at Kimi-K2.5's shapes are tested as plain
arithmetic (``tests/runtime/triton/test_gemm_tiles.py``).

Why these numbers (an H200 has 132 SMs; decode GEMMs are memory bound):

* ``bm`` 16 rows (tokens) per program, the smallest ``tl.dot`` operand: at decode a program's
  rows are one to a few tokens, and the kernels put them on the MMA's N side (``w @ x.T``), so
  the weight rows fill the MMA's M side (64 on Hopper's wgmma).
* ``bn`` 64 weight rows x ``bk`` 128 inputs per step for the 4-bit formats: 4 KB of packed codes,
  16 B (one 128-bit load) per thread per row, 96 registers and ~25 KB of shared memory compiled
  for sm90, so several programs share an SM and keep enough loads in flight.
* ``split``: the K range is cut into ``split`` equal chunks (each a multiple of ``bk``, at least
  :data:`MIN_STEPS` steps long) until one row block launches at least :data:`TARGET_PROGRAMS`
  programs: a decode GEMM 7168 -> 4096 runs 64 column tiles x 4 chunks = 256 programs instead of
  64, an expert's gate + up (4096 x 7168) the same, its down projection (7168 x 2048) 112 x 2.
  The fp32 partials are summed in chunk order by a second kernel (never atomics).

Under the Triton interpreter (CPU tests) the cost is per tile operation, not per element, so
tiles cover the whole weight (up to 1024 x 256) and nothing is split; the kernel tests run both
rules.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE, INT4, MXFP4, FP8 = 0, 1, 2, 3  # weight formats of linear.Bank

BLOCK_M = 16  # rows per program, every format and shape (tl.dot needs 16)
TARGET_PROGRAMS = 256  # programs one row block should launch (~2 per SM of an H100 / H200)
MIN_STEPS = 8  # K steps per split chunk at least (shorter loops spend their time filling the pipeline)


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's launch shape: ``bm`` rows x ``bn`` weight rows per program (a gate + up tile
    holds ``bn / 2`` of each), ``bk`` inputs per K step, ``split`` K chunks, and the compile
    options ``warps`` / ``stages``."""

    bm: int
    bn: int
    bk: int
    split: int = 1
    warps: int = 4
    stages: int = 3


def pow2_at_least(n: int, minimum: int = 16) -> int:
    """The power of two covering ``n`` (at least ``minimum``: tl.dot needs dims >= 16)."""
    p = 1
    while p < max(int(n), 1):
        p *= 2
    return max(minimum, p)


def split_k(n_tiles: int, k: int, bk: int) -> int:
    """K chunks for a weight of ``n_tiles`` column tiles and ``k`` inputs: doubled while one row
    block launches fewer than :data:`TARGET_PROGRAMS` programs, each chunk stays a multiple of
    ``bk`` and at least :data:`MIN_STEPS` steps long."""
    split = 1
    while (n_tiles * split < TARGET_PROGRAMS and k % (2 * split * bk) == 0
           and k // (2 * split) >= MIN_STEPS * bk):
        split *= 2
    return split


def gemm_tiles(fmt: int, n: int, k: int, group: int = 0, interpret: bool = False) -> GemmTiles:
    """Tiles of ``linear._gemm_kernel`` for a weight of format ``fmt``, ``n`` rows (gate and up
    rows together for a fused gate + up bank), ``k`` inputs and INT4 ``group`` size (0: none).
    ``bk`` is a multiple of 8 (one packed word), of 32 (one MXFP4 / E8M0 block) and of ``group``."""
    step = max(32, group)
    if interpret:
        bk = max(step, min(256, pow2_at_least(k)))
        return GemmTiles(BLOCK_M, min(1024, pow2_at_least(n)), bk)
    if fmt in (INT4, MXFP4):
        bk = 128  # 64 B of codes per row: four 128-bit loads per row
    elif fmt == FP8:
        bk = 64  # 64 B per row; divides the 128-wide block scales
    else:
        bk = 64  # bf16 / fp16: 128 B per row
    bk = max(step, min(bk, pow2_at_least(k)))
    bn = min(64, pow2_at_least(n))
    return GemmTiles(BLOCK_M, bn, bk, split_k(-(-n // bn), k, bk))


def dense_tiles(n: int, k: int, fp32: bool) -> GemmTiles:
    """Tiles of ``dense_gemm._bmm_kernel`` (``x [M, K] @ w [K, N]`` per batch entry) by the same
    rule, for a dense weight of ``n`` columns in fp32 (the router: an IEEE ``tl.dot`` on the CUDA
    cores, so 32-wide steps) or bf16 / fp16. Used compiled and interpreted alike (the kernel runs
    off the CPU only; its tests are small)."""
    bk = min(32 if fp32 else 64, pow2_at_least(k))
    bn = min(32 if fp32 else 64, pow2_at_least(n))
    return GemmTiles(BLOCK_M, bn, bk, split_k(-(-n // bn), k, bk))
