"""Linear layers in any supported weight format (bf16 | INT4 W4A16 | W4A8 | MXFP4 | FP8).

The module holds a backend :class:`~eagle3.runtime.kernels.base.LinearOp`; ``load`` hands it a
canonical weight once (``prepare``), ``forward`` calls it. The loader decides the format from the
checkpoint's tensors and the activation quantization from ``quantization_config``.

Tensor parallelism lives here (as nano-vllm's parallel layers): :class:`ColumnParallelLinear` holds
a contiguous range of the output features, :class:`RowParallelLinear` a range of the input features
(its partial outputs are summed over the ranks by the block that owns it). Each layer computes its
range once from the process group and names it in :attr:`Linear.shard`; the loader reads exactly
that part of the checkpoint tensor (each rank reads only its shard) and knows nothing of ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle3.errors import ShapeError
from eagle3.runtime.kernels.base import (
    PER_TOKEN_QUANTS,
    ActQuant,
    KernelBackend,
    LinearOp,
    LinearWeight,
    QuantizedRows,
)
from eagle3.runtime.parallel import SINGLE, TPGroup


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint weight ``[out, in]`` a layer holds: output rows ``rows`` (column
    parallel) or input columns ``cols`` (row parallel), the whole weight when both are None.
    ``keep_bias``: a row-parallel bias is added once, on one rank."""

    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    keep_bias: bool = True

    @staticmethod
    def of_rows(tp: TPGroup, total: int, unit: int = 1) -> Shard:
        """This rank's output rows of ``total`` split in blocks of ``unit`` (an attention head's rows)."""
        if tp.world == 1:
            return Shard()
        lo, hi = tp.split(total // unit)
        return Shard(rows=(lo * unit, hi * unit))

    @staticmethod
    def of_cols(tp: TPGroup, total: int, unit: int = 1) -> Shard:
        """This rank's input columns of ``total`` split in blocks of ``unit``; the bias stays on rank 0."""
        if tp.world == 1:
            return Shard()
        lo, hi = tp.split(total // unit)
        return Shard(cols=(lo * unit, hi * unit), keep_bias=tp.rank == 0)

    def size(self, total: int) -> int:
        """How many of ``total`` rows / columns this shard holds (its range's length, or all)."""
        part = self.rows or self.cols
        return total if part is None else part[1] - part[0]

    def take_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This shard's rows of a plain tensor (a tied lm_head's embedding)."""
        return t if self.rows is None else t[self.rows[0]: self.rows[1]]


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
        self.shard = Shard()  # the whole checkpoint weight

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

    @property
    def token_quant(self) -> str | None:
        """The per-token activation quantization this layer applies to its input (int8 / fp8), which
        the norm in front may make for it (:meth:`RMSNorm.add_norm`); None for any other."""
        return self.act if self.act in PER_TOKEN_QUANTS else None

    def forward(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        if self.op is None:
            raise RuntimeError(f"{self.name}: weights not loaded")
        return self.op(x, xq)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind}, act={self.act}"


class ColumnParallelLinear(Linear):
    """Output features split over the ranks (``unit`` rows at a time: an attention head's); each
    rank computes its part of the output. Whole at TP=1."""

    def __init__(self, in_features: int, out_total: int, backend: KernelBackend, name: str = "",
                 tp: TPGroup = SINGLE, unit: int = 1) -> None:
        shard = Shard.of_rows(tp, out_total, unit)
        super().__init__(in_features, shard.size(out_total), backend, name)
        self.shard = shard


class RowParallelLinear(Linear):
    """Input features split over the ranks (``unit`` columns at a time); each rank's output is a
    partial sum that the owning block reduces (``TPGroup.reduce``). Whole at TP=1."""

    def __init__(self, in_total: int, out_features: int, backend: KernelBackend, name: str = "",
                 tp: TPGroup = SINGLE, unit: int = 1) -> None:
        shard = Shard.of_cols(tp, in_total, unit)
        super().__init__(shard.size(in_total), out_features, backend, name)
        self.shard = shard


class VocabParallelLMHead(ColumnParallelLinear):
    """The lm_head split by vocabulary rows; :meth:`logits` gathers every rank's columns (fp32)."""

    def __init__(self, hidden: int, vocab_size: int, backend: KernelBackend, name: str = "",
                 tp: TPGroup = SINGLE) -> None:
        super().__init__(hidden, vocab_size, backend, name, tp)
        self.vocab_size = vocab_size
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_cols(self(hidden).float(), self.vocab_size)
