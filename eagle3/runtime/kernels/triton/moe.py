"""Fused MoE (``TritonBackend.moe()``): grouped GEMMs over token-expert pairs sorted by expert.

Per call:

1. Align (one Triton program, ``moe_align.py``; as vLLM's ``moe_align_block_size``): the ``T * k`` token-expert pairs are
   sorted by expert (stable: token order inside an expert) and each expert's run is padded to a
   multiple of ``BLOCK_M`` with the sentinel ``T * k``; every block of ``BLOCK_M`` rows belongs to
   one expert (``expert_ids``). The buffers have a size fixed by the shapes (an upper bound), the
   unused blocks at the end have expert ``-1`` and the kernels skip them: no host sync, so the
   MoE can be captured in a CUDA / HIP graph.
2. Grouped GEMM 1 (:func:`linear._gemm_kernel`, ``GATHER=1, GLU``): each program reads its rows'
   tokens from ``x`` and one expert's gate and up rows (decoded in registers from the packed
   codes), and writes ``silu(gate) * up`` rounded as the reference rounds it, to the pair's row of
   the intermediate (one row per pair).
3. Grouped GEMM 2 (``GATHER=2, SCATTER``): the down projection of the pairs' intermediate rows,
   rounded to the model dtype, times the pair's routing weight in fp32, written to the pair's row.
   Both GEMMs split K as the weight's shape says (:mod:`gemm_tiles`; Kimi-K2.5: gate + up in 4
   chunks, down in 2): the chunks' partials are summed in chunk order by
   :func:`linear._splitk_kernel`, which then applies SiLU-and-mul / the routing weight.
4. The top-k combine: the fp32 per-pair rows summed over the slots with the reference's op, in
   slot order, then cast to the model dtype.

Weight formats: as :mod:`linear` (W4A16, W4A8 int8 and FP8-stage exact integer GEMMs, MXFP4,
FP8, dense). W4A8 activations are quantized per token before GEMM 1 and per pair before GEMM 2
(``act_quant``); MXFP4 activations are fake-quantized per 32-block as the reference does.

Batch invariance: a pair's row is one column of a fixed-shape tile's MMA, whatever the other rows
of its block are (padding rows are zeros and never written); its K chunks and their order follow
from the weight's shape; its combine sums the same k values in the same order; so a token's result
does not depend on the batch.
"""

from __future__ import annotations

import torch

from eagle3.errors import ShapeError
from eagle3.runtime.kernels import torch_ref
from eagle3.runtime.kernels.base import ActQuant, LinearWeight, MoEOp, QuantizedRows
from eagle3.runtime.kernels.triton import linear, moe_align
from eagle3.runtime.kernels.triton.common import INTERPRET, widen


def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the aligned row count from shapes alone: each of at most ``min(E, pairs)``
    used experts pads its run by at most ``block_m - 1`` rows. Sizing the buffers by it (as vLLM's
    ``max_num_tokens_padded``) keeps the MoE free of device reads, so CUDA / HIP graphs can capture it."""
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    return (bound + block_m - 1) // block_m * block_m


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``sorted_ids [P]``: pair index per padded row, ``T * k`` for padding; ``expert_ids
    [P / block_m]``: the expert of each block of rows, ``-1`` for the unused blocks at the end).
    ``P`` is :func:`max_padded_rows`; the used rows are the per-expert counts rounded up to
    ``block_m``. One Triton program (``moe_align.py``) up to ``moe_align.MAX_PAIRS`` pairs, else
    :func:`align_torch`: the same result, no host sync either way."""
    pairs = topk_ids.numel()
    if pairs <= moe_align.MAX_PAIRS and (INTERPRET or topk_ids.device.type != "cpu"):
        return moe_align.align(topk_ids, num_experts, block_m, max_padded_rows(pairs, num_experts, block_m))
    return align_torch(topk_ids, num_experts, block_m)


def align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align` in torch ops (~10 launches): device ops only, no host sync (``torch.bincount``
    would read the max id)."""
    flat = topk_ids.reshape(-1)
    dev = flat.device
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.long(), torch.ones(pairs, dtype=torch.int64, device=dev))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    pad_start = ends - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(pairs, device=dev) - cnt_start[e_sorted]
    total = max_padded_rows(pairs, num_experts, block_m)
    sorted_ids = torch.full((total,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    # block b holds rows b*block_m...: the expert whose padded run contains that row (none past the end)
    starts = torch.arange(total // block_m, device=dev, dtype=torch.int64) * block_m
    eid = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(eid < num_experts, eid, -1).to(torch.int32)
    return sorted_ids, expert_ids


class TritonMoE(MoEOp):
    """Routed experts as two grouped GEMMs on the packed expert weights (see the module doc)."""

    def prepare(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.num_experts = self.check_experts(gate, up, down)
        self.dtype = dtype
        self.mode = linear.check_act(gate[0], act)
        self.inter, self.hidden = gate[0].shape
        # gate rows then up rows per expert, as transformers' fused gate_up_proj
        self.w13 = linear.make_bank([[g, u] for g, u in zip(gate, up, strict=True)], dtype, device)
        self.w2 = linear.make_bank([[d] for d in down], dtype, device)
        if self.w2.n != self.hidden or self.w2.k != self.inter:
            raise ShapeError(f"down experts are [{self.w2.n}, {self.w2.k}], expected [{self.hidden}, {self.inter}]")
        # one BLOCK_M for both GEMMs: the alignment is shared
        self.block_m = linear.tiles(self.w13.fmt, self.w13.n, self.w13.k, self.w13.group).bm

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.w13.resident() + self.w2.resident()

    def _operand(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows as GEMM operand: per-row integer codes + scales (W4A8; ``xq``'s when the norm in
        front made them), else the float rows."""
        if self.mode in ("int8", "fp8"):
            return linear.quantize_rows(x, self.mode, xq)
        if self.mode == "mxfp4":
            x = torch_ref.mxfp4_qdq(x)
        return widen(x).contiguous(), None

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 xq: QuantizedRows | None = None) -> torch.Tensor:
        t, k = topk_ids.shape
        if t == 0:
            return x.new_empty(0, self.hidden)
        sorted_ids, expert_ids = align(topk_ids, self.num_experts, self.block_m)
        grid_m = int(sorted_ids.numel()) // self.block_m
        sdt = linear.store_dtype(self.dtype)
        pair_eids = topk_ids.reshape(-1)  # the expert of each pair (the exact path's split-K sum)
        a, sa = self._operand(x, xq)
        # one row per pair, written by GEMM 1 for every pair (padding rows are never stored)
        inter = torch.empty(t * k, self.inter, dtype=sdt, device=x.device)
        linear.launch(self.w13, a, sa, inter, mode=self.mode, dtype=self.dtype, m=t * k, n_out=self.inter,
                      grid_m=grid_m, rows=sorted_ids, eids=expert_ids, topk=k, gather=1, glu=True,
                      pair_eids=pair_eids)
        a2, sa2 = self._operand(inter.to(self.dtype) if sdt != self.dtype else inter)
        pair_out = torch.empty(t * k, self.hidden, dtype=torch.float32, device=x.device)
        rw = topk_weights.float().reshape(-1).contiguous()
        linear.launch(self.w2, a2, sa2, pair_out, mode=self.mode, dtype=self.dtype, m=t * k, n_out=self.hidden,
                      grid_m=grid_m, rows=sorted_ids, eids=expert_ids, topk=k, gather=2, rw=rw, pair_eids=pair_eids)
        # the reference's combine: fp32 products (made in the kernel) summed over the slots
        return pair_out.view(t, k, self.hidden).sum(1).to(self.dtype)
