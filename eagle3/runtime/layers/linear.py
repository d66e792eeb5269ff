"""Linear layers in any supported weight format (bf16 | INT4 W4A16 | W4A8 | MXFP4 | FP8).

The module holds a backend :class:`~eagle3.runtime.kernels.base.LinearOp`; ``load`` hands it a
canonical weight once (``prepare``), ``forward`` calls it. The loader decides the format from the
checkpoint's tensors and the activation quantization from ``quantization_config``."""

from __future__ import annotations

import torch
from torch import nn

from eagle3.errors import ShapeError
from eagle3.runtime.kernels.base import ActQuant, KernelBackend, LinearOp, LinearWeight


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, backend: KernelBackend, name: str = "") -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.name = name
        self.op: LinearOp | None = None
        self.kind = "unloaded"
        self.act: ActQuant = None

    def load(self, weight: LinearWeight, act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        if weight.shape != (self.out_features, self.in_features):
            raise ShapeError(f"{self.name}: weight is {list(weight.shape)} ([out, in]), expected "
                             f"{[self.out_features, self.in_features]}")
        op = self.backend.linear()
        op.prepare(weight, act, dtype, device)
        self.op = op
        self.kind = type(weight).__name__
        self.act = act

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        """The op's tensors (packed codes + scales for a quantized weight, never a dense copy)."""
        return [] if self.op is None else self.op.resident()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is None:
            raise RuntimeError(f"{self.name}: weights not loaded")
        return self.op(x)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind}, act={self.act}"
