"""Per-forward attention indices shared by every attention layer (the backend's ``plan``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.runtime.context import AttnMetadata


@dataclass
class TritonAttnPlan:
    """Per query token its sequence and absolute position, and the block tables, as int32 on the
    cache's device. Each attention program reads only its own token's entries, so nothing here
    couples rows."""

    seq_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int32 [T]
    block_tables: torch.Tensor  # int32 [B, W], contiguous, -1 padded
    block_size: int


def plan_attention(meta: AttnMetadata) -> TritonAttnPlan:
    dev = meta.positions.device
    cu = meta.cu_seqlens_q.to(dev, torch.int64)
    counts = cu[1:] - cu[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(counts.shape[0], device=dev), counts)
    return TritonAttnPlan(seq_ids.to(torch.int32), meta.positions.to(torch.int32).contiguous(),
                          meta.block_tables.to(dev, torch.int32).contiguous(), int(meta.block_size))
