"""RMSNorm with transformers' numerics: normalise in fp32, cast back, multiply by the weight in
the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from eagle3.errors import ShapeError
from eagle3.runtime.kernels.base import KernelBackend, QuantizedRows


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

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows | None]:
        """``(norm(x + residual), x + residual, xq)``: the residual add fused into the norm, and with
        ``quant`` (the next GEMMs' per-token int8 / fp8) their quantization of the normed rows where
        the backend fuses it (``KernelBackend.add_rms_norm_quant``; the same numbers as separate ops)."""
        return self.backend.add_rms_norm_quant(x, residual, self.weight, self.eps, quant)
