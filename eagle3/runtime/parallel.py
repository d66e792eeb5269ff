"""The tensor-parallel process group: this process's rank (:class:`TPGroup`), the rank-order
collectives the layers call, and joining the group (:func:`init_rank`). The worker processes that
make up the group are started by :mod:`eagle3.runtime.engine.worker`; which rows or columns of a
weight a rank holds is decided by the parallel layers themselves (``runtime/layers``).

Determinism: :meth:`TPGroup.reduce` all-gathers the partials and sums them locally in rank order, so
a row's sum does not depend on the batch (an all_reduce picks its algorithm by message size). The
sum is in a different order than a TP=1 GEMM's, so logits differ from TP=1 by rounding only.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch

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
