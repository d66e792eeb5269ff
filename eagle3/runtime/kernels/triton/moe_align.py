"""The fused MoE's alignment (:func:`moe.align`) as one Triton program instead of ~10 small torch
launches (sort, scatter-add, cumsums, searchsorted, ...) per MoE layer and step.

The result is the torch version's, element for element: the ``P`` token-expert pairs sorted by
expert, stable (a pair's rank inside its expert is the number of earlier pairs with that expert,
so token order is kept), each expert's run padded to a multiple of ``BLOCK_M`` with the sentinel
``P``, the rows after the last run all sentinels, and the expert of each block of ``BLOCK_M``
rows (``-1`` past the last run). Every output element is written exactly once (the pairs' rows,
each expert's padding, the tail), so the one program needs no ordering between its stores; it
reads nothing on the host, and its buffers are sized from the shapes (``moe.max_padded_rows``),
so a CUDA / HIP graph captures it.

One program walks the pairs twice in chunks of ``CHUNK``: once to count the pairs per expert
(``tl.histogram``), then to place each pair at ``start of its expert's run (tl.gather) + pairs of
that expert in earlier chunks + earlier pairs of that expert in this chunk`` (a ``CHUNK x CHUNK``
comparison). That is ``O(P x CHUNK)`` work on one SM: a few microseconds at decode (Kimi, batch 64:
512 pairs, 384 experts), but for a prefill of thousands of tokens one SM is slower than the torch
ops' whole GPU, so :func:`moe.align` uses this kernel up to :data:`MAX_PAIRS` pairs (the same
result either way: which one runs never changes a bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 4096  # up to here one program (decode, verify, short prefill chunks); torch beyond
CHUNK = 64  # pairs per step of the program's loops


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, eid_ptr, P, TOTAL, E: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    # 1. pairs per expert
    counts = tl.zeros([E_PAD], tl.int32)
    for c in range(0, P, CHUNK):
        i = c + lanes
        e = tl.load(ids_ptr + i, mask=i < P, other=0).to(tl.int32)
        counts += tl.histogram(e, E_PAD, mask=i < P)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    # 2. each pair at its expert's start + its rank among that expert's pairs (earlier chunks, then
    # earlier lanes of this chunk)
    before = tl.zeros([E_PAD], tl.int32)
    earlier = lanes[None, :] < lanes[:, None]  # [i, j]: lane j comes before lane i
    for c in range(0, P, CHUNK):
        i = c + lanes
        ok = i < P
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
        rank = tl.sum(((e[None, :] == e[:, None]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_ptr + tl.gather(starts + before, e, 0) + rank, i.to(tl.int32), mask=ok)
        before += tl.histogram(e, E_PAD, mask=ok)
    # 3. the padding of each run, then every row after the last run: the sentinel P
    fill = tl.zeros([E_PAD], tl.int32) + P
    for j in tl.static_range(BLOCK_M - 1):  # at most BLOCK_M - 1 padding rows per run
        tl.store(sorted_ptr + starts + counts + j, fill, mask=j < padded - counts)
    used = tl.sum(padded, axis=0)
    for c in range(used, TOTAL, CHUNK):
        r = c + lanes
        tl.store(sorted_ptr + r, tl.zeros([CHUNK], tl.int32) + P, mask=r < TOTAL)
    # 4. the expert of each block of rows: each run's blocks, then -1 for every block after the last
    for j in range(0, tl.max(padded, axis=0) // BLOCK_M):
        tl.store(eid_ptr + starts // BLOCK_M + j, experts, mask=j < padded // BLOCK_M)
    for b0 in range(used // BLOCK_M, TOTAL // BLOCK_M, CHUNK):
        b = b0 + lanes
        tl.store(eid_ptr + b, tl.zeros([CHUNK], tl.int32) - 1, mask=b < TOTAL // BLOCK_M)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe.align`'s ``(sorted_ids [total], expert_ids [total / block_m])`` in one launch
    (``total``: ``moe.max_padded_rows``)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    sorted_ids = torch.empty(total, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(total // block_m, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, sorted_ids, expert_ids, flat.numel(), total, E=num_experts,
                        E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=CHUNK)
    return sorted_ids, expert_ids
