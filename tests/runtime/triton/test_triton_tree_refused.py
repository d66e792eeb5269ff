"""The Triton attention kernels have no tree mask yet: tree metadata is refused, never ignored."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import UsageError  # noqa: E402
from eagle3.runtime.context import AttnMetadata, TreeMask  # noqa: E402
from eagle3.runtime.kernels import get_backend  # noqa: E402


def test_tree_metadata_is_refused(device: torch.device) -> None:
    be = get_backend("triton", device)
    anc = torch.ones(1, 2, 2, dtype=torch.bool).tril()
    meta = AttnMetadata(torch.tensor([4, 5], device=device), torch.tensor([0, 2], dtype=torch.int32, device=device),
                        torch.tensor([6], dtype=torch.int32, device=device), torch.tensor([4, 5], device=device),
                        torch.tensor([[0, 1]], dtype=torch.int32, device=device), 4, tree=TreeMask([2], anc))
    with pytest.raises(UsageError, match="no tree attention"):
        be.plan_attention(meta)
    cache = torch.zeros(8, 1, 8, device=device)
    with pytest.raises(UsageError, match="no tree attention"):
        be.attention(torch.zeros(2, 1, 1, 8, device=device), cache, cache, meta, 1.0)
