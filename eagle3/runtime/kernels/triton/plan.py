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

from eagle3.runtime.context import AttnMetadata


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

    def chunks(self, qt: int) -> torch.Tensor:
        """int32 ``[C, 3]``: (first query token, number of tokens <= qt, sequence index)."""
        key = ("triton_chunks", qt)
        if key not in self._chunks:
            rows = [(t, min(qt, t1 - t), b) for b, (t0, t1) in enumerate(zip(self.cu[:-1], self.cu[1:], strict=True))
                    for t in range(t0, t1, qt)]
            self._chunks[key] = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int32).reshape(-1, 3).to(self.device)
        return self._chunks[key]


def plan_attention(meta: AttnMetadata) -> TritonAttnPlan:
    return TritonAttnPlan(meta)
