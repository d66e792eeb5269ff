"""Sizes of the MLA split over the keys, in plain Python (no torch, no triton): keys per split, how
many splits a block-table width makes, and the fp32 partials a split launch writes.

One definition for the places that need the numbers: the Triton kernel
(``kernels/triton/mla_attention.py``: its split and its launch mode) and the CUDA-graph context caps
(``engine/graphs.py``: a graph's split grid and workspace follow its block-table width, its cap).
The memory plan (``eagle3.plan``) counts graphs in its runtime reserve (4 GiB), which holds
:data:`GRAPH_WORKSPACE_BUDGET` many times over.
"""

from __future__ import annotations

SPLIT_MIN, SPLIT_MAX = 64, 1024  # keys per split
FP32 = 4
# Split partials one graph may hold (bytes): a graph's default context cap is the longest whose
# workspace at its query tokens fits (:func:`graph_context_cap`). The graphs share one memory pool
# and replay one at a time, so the pool keeps about one budget for as long as they live: small
# beside the KV cache.
GRAPH_WORKSPACE_BUDGET = 256 << 20


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def split_size(heads: int, d_lat: int, d_rope: int) -> int:
    """Keys per split: the smallest power of two whose latent, at two bytes a value, covers the
    split's fp32 partial written by stage 1 and read back by the merge (Kimi, 64 heads: 256; a
    TP-8 shard of 8 heads: 64). Not halved for an fp8 cache: at 64 heads a program is bound by its
    dots (139 kFLOP per key, 121 FLOP per bf16 byte, the H200's ridge ~206), so a split's time
    follows its keys, not its bytes, and fewer, longer splits would only cut the parallelism. A
    model constant: never the batch."""
    partial = 2 * heads * (d_lat + 2) * FP32
    row = (d_lat + d_rope) * 2
    return min(SPLIT_MAX, max(SPLIT_MIN, _pow2_at_least(-(-partial // row))))


def num_splits(keys: int, split: int) -> int:
    """Splits covering ``keys`` key positions (a block table's width x block size)."""
    return max(1, -(-int(keys) // split))


def workspace_bytes(tokens: int, splits: int, heads: int, d_lat: int) -> int:
    """The split launch's partials: ``(o, l, m)`` in fp32 per query token, split and head."""
    return tokens * splits * heads * (d_lat + 2) * FP32


def graph_workspace_bytes(tokens: int, context: int, heads: int, d_lat: int, d_rope: int) -> int:
    """The split workspace of a graph of ``tokens`` query tokens whose static block tables cover
    ``context`` positions (its cap): what one MLA layer of its replay allocates (the layers reuse
    it; one graph replays at a time). 0 when that context is one split (no workspace)."""
    splits = num_splits(context, split_size(heads, d_lat, d_rope))
    return 0 if splits <= 1 else workspace_bytes(tokens, splits, heads, d_lat)


def graph_context_cap(tokens: int, heads: int, d_lat: int, d_rope: int, budget: int | None = None) -> int:
    """The longest context, a whole number of splits, whose graph workspace for ``tokens`` query
    tokens fits ``budget`` (default :data:`GRAPH_WORKSPACE_BUDGET`); one split (no workspace) at
    least. Kimi-K2.5's 64 heads (splits of 256 keys, 33.7 MB per split at 256 tokens): a verify
    graph of 64 sequences x 4 tokens 7 splits = 1,792 positions, a decode graph of 64 rows 31
    splits = 7,936, one sequence's decode 2,039 splits (past 256 Ki: its whole context)."""
    split = split_size(heads, d_lat, d_rope)
    budget = GRAPH_WORKSPACE_BUDGET if budget is None else budget
    return max(1, budget // workspace_bytes(max(1, tokens), 1, heads, d_lat)) * split
