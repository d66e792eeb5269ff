"""RMSNorm with transformers' numerics: normalise in fp32, cast back, multiply by the weight in
the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from eagle3.errors import ShapeError
from eagle3.runtime.kernels.base import KernelBackend


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.size = size
        self.eps = eps
        self.backend = backend
        self.register_buffer("weight", torch.ones(size))

    def load(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        if tuple(weight.shape) != (self.size,):
            raise ShapeError(f"RMSNorm weight has shape {list(weight.shape)}, expected [{self.size}]")
        self.weight = weight.to(dtype=dtype)  # stays on the device the loader put it on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)
