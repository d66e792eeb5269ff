"""Per-forward attention indices shared by every attention layer (the backend's ``plan``).

Query tokens are cut into *chunks*: up to ``qt`` consecutive query tokens of one sequence (a
verify window of k+1 tokens, or a run of a prefill chunk), so that one attention program reads
the sequence's keys once for all of them. ``qt`` is a per-model constant (it follows from the
head layout, never from the batch). A token's output does not depend on its chunk-mates: each
row is masked by its own position, and key tiles past it contribute exact zeros (see the
attention kernels).
"""

from __future__ import annotations

import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata

TREE_MAX_NODES = 64  # a tree query's ancestors are one int64 bit mask over the tree region


class TritonAttnPlan:
    """Per query token its absolute position, the block tables (int32, on the device), and
    lazily per chunk height ``qt`` the chunk list ``(first token, tokens, sequence)``."""

    def __init__(self, meta: AttnMetadata) -> None:
        dev = meta.positions.device
        self.device = dev
        self.positions = meta.positions.to(dev, torch.int32).contiguous()
        self.block_tables = meta.block_tables.to(dev, torch.int32).contiguous()
        self.block_size = int(meta.block_size)
        # The host copy when the builder kept one: no device sync, which a CUDA-graph capture forbids.
        self.cu = list(meta.host_cu) if meta.host_cu is not None else meta.cu_seqlens_q.to("cpu", torch.int64).tolist()
        # Chunk lists depend only on cu (fixed for a graph's batch bucket): a metadata that carries a
        # cache (engine/graphs.py) keeps them across warm-up, capture and replay, so that the capture
        # never copies from the host. positions / block_tables above are converted per forward by
        # device ops (no copy when already int32), which a graph records and replays.
        self._chunks: dict[object, torch.Tensor] = meta.cache if meta.cache is not None else {}
        # Draft trees (AttnMetadata.tree): the kernels mask by ``reach`` (a tree node's own cache
        # position) instead of the position, and hide the tree keys that are not ancestors.
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None
        if meta.tree is not None:
            self.positions, lo, bits = tree_arrays(meta, self.cu)
            self.tree = (lo, bits)

    def chunks(self, qt: int) -> torch.Tensor:
        """int32 ``[C, 3]``: (first query token, number of tokens <= qt, sequence index)."""
        key = ("triton_chunks", qt)
        if key not in self._chunks:
            rows = [(t, min(qt, t1 - t), b) for b, (t0, t1) in enumerate(zip(self.cu[:-1], self.cu[1:], strict=True))
                    for t in range(t0, t1, qt)]
            self._chunks[key] = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int32).reshape(-1, 3).to(self.device)
        return self._chunks[key]


def tree_arrays(meta: AttnMetadata, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token (on the metadata's device): ``reach`` int32 (the last cache position it
    may see), ``lo`` int32 (the first tree position; ``reach + 1`` for ordinary tokens) and
    ``bits`` int64 (bit ``j``: tree position ``lo + j`` is visible), so that key ``k`` is visible
    iff ``k <= reach`` and (``k < lo`` or bit ``k - lo`` is set). Built on the host: tree steps run
    eagerly, never under a CUDA graph."""
    assert meta.tree is not None
    dev = meta.positions.device
    reach = meta.positions.to("cpu", torch.int64).clone()
    lo = reach + 1
    bits = torch.zeros_like(reach)
    ctx = meta.context_lens.to("cpu", torch.int64).tolist()
    anc = meta.tree.ancestors.to("cpu", torch.bool)
    weights = torch.ones(TREE_MAX_NODES, dtype=torch.int64) << torch.arange(TREE_MAX_NODES)  # bit 63: the sign bit
    for b, n in enumerate(meta.tree.num_nodes):
        if n <= 0:
            continue
        if n > TREE_MAX_NODES or n > anc.shape[-1]:
            raise UsageError(f"the triton tree mask holds up to {TREE_MAX_NODES} tree nodes per sequence "
                             f"(sequence {b}: {n}, ancestor mask width {anc.shape[-1]})")
        t0, t1 = cu[b], cu[b + 1]
        start = ctx[b] - n
        for i in range(n - min(n, t1 - t0), n):  # the query tokens are the last nodes
            t = t1 - n + i
            reach[t], lo[t] = start + i, start
            bits[t] = int((anc[b, i, : i + 1].to(torch.int64) * weights[: i + 1]).sum())
    return reach.to(dev, torch.int32), lo.to(dev, torch.int32), bits.to(dev)


def plan_attention(meta: AttnMetadata) -> TritonAttnPlan:
    return TritonAttnPlan(meta)
