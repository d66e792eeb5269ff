"""The tensor-parallel process group: this process's rank (:class:`TPGroup`), the rank-order
collectives the layers call, and joining the group (:func:`init_rank`). The worker processes that
make up the group are started by :mod:`eagle3.runtime.engine.worker`; which rows or columns of a
weight a rank holds is decided by the parallel layers themselves (``runtime/layers``).

Determinism: :meth:`TPGroup.reduce` all-gathers the partials and sums them locally in rank order, so
a row's sum does not depend on the batch (an all_reduce picks its algorithm by message size). The
sum is in a different order than a TP=1 GEMM's, so logits differ from TP=1 by rounding only.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch

from eagle3.runtime.kernels.base import (
    DenseWeight,
    FP8Weight,
    Int4Weight,
    LinearWeight,
    MXFP4Weight,
    dequantize,
)

logger = logging.getLogger("eagle3.runtime")

# Collective timeout: a rank that stops answering fails the step after this long instead of
# hanging it (a dead rank's closed sockets fail it at once).
_TIMEOUT_S = float(os.environ.get("EAGLE3_TP_TIMEOUT", "300"))


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (``world == 1``: no parallelism)."""

    rank: int = 0
    world: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """This rank's contiguous part ``[lo, hi)`` of ``n`` items (the first ``n % world`` ranks
        take one more)."""
        return split(n, self.world, self.rank)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in rank order (batch invariant, see the module docstring)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def gather_cols(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate every rank's ``x [R, cols_r]`` (cols split as :func:`split` of ``total``) along
        the last dim; uneven parts are padded for the collective."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        width = -(-total // self.world)
        pad = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        pad[:, : x.shape[1]] = x
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad)
        return torch.cat([p[:, : hi - lo] for p, (lo, hi) in
                          zip(parts, (split(total, self.world, r) for r in range(self.world)), strict=True)], dim=1)


SINGLE = TPGroup()


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


# ---------------------------------------------------------------------------------------------
# Slicing canonical weights
# ---------------------------------------------------------------------------------------------


def slice_out(w: LinearWeight, r0: int, r1: int) -> LinearWeight:
    """Rows ``r0 .. r1-1`` (output features) of a canonical weight: column-parallel layers. Every
    packed format is row-major in N, so this is a plain slice of codes and scales."""
    bias = None if w.bias is None else w.bias[r0:r1]
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[r0:r1], bias)
    if isinstance(w, Int4Weight):
        return dataclasses.replace(w, codes=w.codes[r0:r1], scale=w.scale[r0:r1], bias=bias)
    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(w.packed[r0:r1], w.scale[r0:r1], bias)
    if isinstance(w, FP8Weight):
        s = w.scale
        if w.block is not None:
            bn = w.block[0]
            if r0 % bn or (r1 % bn and r1 != w.shape[0]):
                return DenseWeight(dequantize(w, torch.float32, (r0, r1)), bias)
            s = s[r0 // bn: -(-r1 // bn)]
        elif s.dim() >= 1 and s.shape[0] == w.shape[0]:
            s = s[r0:r1]
        return FP8Weight(w.weight[r0:r1], s, w.block, bias)
    raise TypeError(f"not a canonical weight: {type(w).__name__}")


def slice_in(w: LinearWeight, k0: int, k1: int, keep_bias: bool) -> LinearWeight:
    """Input columns ``k0 .. k1-1`` of a canonical weight: row-parallel layers (``o_proj``,
    ``down_proj``), whose partial outputs are summed across ranks; the bias stays on one rank
    (``keep_bias``). Packed words / scale groups are sliced when the range falls on their
    boundaries; otherwise (a tiny model's FP8 128-blocks) the slice is decoded to a dense weight."""
    bias = w.bias if keep_bias else None
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[:, k0:k1], bias)
    if isinstance(w, Int4Weight):
        g = w.group_size
        if w.packing is None:
            codes = w.codes[:, k0:k1]
        elif k0 % 8 == 0 and (k1 % 8 == 0 or k1 == w.shape[1]):
            codes = w.codes[:, k0 // 8: -(-k1 // 8)]
        else:
            codes = None
        if codes is not None and (g is None or (k0 % g == 0 and (k1 - k0) % g == 0)):
            scale = w.scale if g is None else w.scale[:, k0 // g: k1 // g]
            return dataclasses.replace(w, codes=codes, scale=scale, bias=bias,
                                       in_features=None if w.packing is None else k1 - k0)
    elif isinstance(w, MXFP4Weight):
        if k0 % 32 == 0 and (k1 - k0) % 32 == 0:
            return MXFP4Weight(w.packed[:, k0 // 2: k1 // 2], w.scale[:, k0 // 32: k1 // 32], bias)
    elif isinstance(w, FP8Weight):
        if w.block is None:
            return FP8Weight(w.weight[:, k0:k1], w.scale, None, bias)
        bk = w.block[1]
        if k0 % bk == 0 and (k1 % bk == 0 or k1 == w.shape[1]):
            return FP8Weight(w.weight[:, k0:k1], w.scale[:, k0 // bk: -(-k1 // bk)], w.block, bias)
    else:
        raise TypeError(f"not a canonical weight: {type(w).__name__}")
    # Not on a packing boundary: the local slice only, decoded (a fallback the real shapes never take).
    return DenseWeight(dequantize(w, torch.float32)[:, k0:k1].contiguous(), bias)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"  # ROCm builds report "cuda" and run RCCL as nccl


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank: rank r uses device index (base + r); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_rank(rank: int, world: int, port: int, device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_dist_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=_TIMEOUT_S))
