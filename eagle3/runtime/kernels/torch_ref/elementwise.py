"""Batch-invariant pointwise transcendental ops (see the package doc: every element on the
scalar path on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    pass



def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with every element on the same (scalar) code path on CPU; see the module doc.
    GPU pointwise kernels apply one per-element function already."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    buf = x.new_empty(*x.shape, 2)
    buf[..., 0] = x
    return fn(buf[..., 0])


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)
