"""MLA decode / verify / prefill attention over the paged latent cache, absorbed form, split over
the keys at fixed positions.

The model (``layers/attention.py``) turns MLA into MQA: per token ``nh`` query rows of width
``kv_lora + rope`` (Kimi: 64 heads, 512 + 64) against one shared cached row ``[c, k_pe]``; the
values are the first ``kv_lora`` dims of that same row. So one kernel serves decode (query length
1), EAGLE verify (k+1 queries of a sequence) and prefill chunks: query token ``t`` of sequence
``b`` at position ``p`` attends the cached keys at positions ``0..p`` through ``block_tables[b]``
(causal by absolute position, which is also the mask inside a verify window).

**What a row computes** (its bits are a function of its own query, keys and position only):
the keys are cut into *splits* of ``S`` absolute positions, split ``j`` holding keys ``[j*S,
(j+1)*S)``; ``S`` follows from the model (heads and latent width: :func:`split_size`),
never from the batch. Within a split an online softmax in fp32 walks key tiles of ``BLOCK_N``
from the split's first key (scores as two dots, latent part and rope part, so 576 is not padded
to 1024; then ``p`` in the dot dtype times the latent tile, which doubles as the value tile: the
cache is read once), giving a partial ``(o, l, m)`` (unnormalized output, sum of exponentials,
running max). A row at position ``p`` has splits ``0 .. p // S``; their partials are merged in
split order, left to right (:func:`_weights` / :func:`_mix`, the larger max's weight exactly 1,
explicit fma so that no compiler contracts differently), and the output is ``o / l * v_scale``.
Keys past a row's position inside its last split add exact zeros (``p = exp(-inf) = 0``,
``alpha = exp(0) = 1``), and the first key of each of its splits is visible to it, so every max
is finite; splits past its position never enter its merge.

**Two launch modes compute exactly that** (the same jit helpers, tile shapes and warps, so the
same bits; tested bitwise), chosen per launch by memory only (:func:`launch_mode`; the serial one
under the interpreter, where each program costs Python time):

* *split* (decode and verify): stage 1, grid (chunk x head block, split), one program per split
  writing its fp32 partial per query token; stage 2, grid (token, head group, column block),
  merges a token's own splits. The grid is sized from the widest block table (the batch's on an
  eager step, the static width under a CUDA graph: no device value decides it); programs past
  their chunk's last position exit at once. Workspace: tokens x splits x heads x (latent + 2)
  fp32, used while it fits :data:`WORKSPACE_BUDGET`.
* *serial* (prefill, or a graph whose static width makes that workspace too large): one program
  per (chunk, head block) walks its splits in order, folding each split's partial into a running
  partial per token kept in global memory (tokens x heads x (latent + 2) fp32, twice), merged in
  column blocks so that no second ``rows x latent`` accumulator lives in registers. A chunk
  whose keys fit one split needs no workspace and is the whole story for short contexts.

Tiles (:func:`tiles`): the score tile has ``QT * BLOCK_H`` rows (token-major). On sm90 all 64
Kimi heads are one head block (64 rows at decode), so each key's 576 values are loaded once per
query token, not once per 16 heads; on gfx942 (64 KiB of LDS, 4 warps for 512 registers a lane)
32 heads, the two head blocks of a token adjacent in the grid so that the second reads the
latent from L2. Fewer heads (a TP shard, the tiny models) fill the rows with query tokens of the
same sequence, so a verify window shares each latent tile it reads. On sm90 the 64 x 512 fp32
accumulator (128 registers a thread over 8 warps) leaves the pipelined loop a few registers
short: ptxas spills 24 bytes a thread (docs/kernels.md has the table).

Draft trees (``TREE``, plan.tree_arrays): a tree query's ``pos`` is its virtual position (tree
start + depth) and its virtual keys ``start ..`` are read at its ancestors' cache positions in depth
order (``tree_key_positions``): the same keys, split boundaries and tiles, in the same order, as
the same token in a chain, so a tree node's bits are its chain's (and a plain decode row's), and
non-ancestors are never read. A tree chunk holds queries on one root-to-node path (the deepest
one's key map serves them all), listed by the plan's ``order``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eagle3.runtime.kernels.triton.common import (
    INTERPRET,
    block,
    dot_dtype,
    mma,
    tl_dtype,
    tree_key_positions,
    widen,
)
from eagle3.runtime.kernels.triton.plan import TREE_MAX_NODES, TritonAttnPlan
from eagle3.runtime.split_kv import SPLIT_MAX, SPLIT_MIN, split_size, workspace_bytes  # noqa: F401 - re-exported

BLOCK_N = 32  # keys per tile (a split holds a whole number of tiles)
# fp32 accumulator elements per program (rows x latent block): the register budget. sm90: 64 rows
# x 512 is 128 registers a thread over 8 warps; gfx942 keeps half (its 64 KiB of LDS holds the
# staged tiles of 32 rows, not 64: aot_check).
ACC_FLOATS = {"cuda": 32768, "hip": 16384}
WORKSPACE_BUDGET = 1 << 30  # bytes of split partials above which a launch runs serially
MERGE_TILE = 1024  # fp32 elements per merge tile (heads x columns, or rows x columns)


@dataclass(frozen=True)
class Tiles:
    """One program's shape and launch: ``block_h`` heads x ``qt`` query tokens (score-tile rows,
    token-major), ``warps`` and software-pipeline ``stages``."""

    block_h: int
    qt: int
    warps: int
    stages: int


def tiles(heads: int, d_lat: int, target: str = "cuda") -> Tiles:
    """Constants of the model and the GPU family (``"cuda"`` or ``"hip"``), never of the batch.
    Rows = tokens x heads, 16..64 within the accumulator budget (Kimi, latent 512: 64 heads x 1
    token on sm90, 32 x 1 on gfx942; a TP-8 shard's 8 heads x 8 tokens; the tiny models, latent
    32: 4 heads x 16 tokens). sm90: 8 warps over the 64 x 512 accumulator (two warpgroups split
    its columns), 3 stages of cp.async. gfx942: 4 warps, so that a wave may use 512 VGPRs + AGPRs
    (8 warps cap it at 256 and spill), one stage (the LDS holds the staged key tile once)."""
    rows = max(16, min(64, ACC_FLOATS[target] // block(d_lat)))
    bh = min(rows, triton.next_power_of_2(heads))
    if target == "hip":
        warps, stages = 4, 1
    else:
        warps, stages = (8 if rows * block(d_lat) >= 8192 else 4), 3
    return Tiles(bh, max(1, rows // bh), warps, stages)


def tile_shape(heads: int, d_lat: int, target: str = "cuda") -> tuple[int, int]:
    """(heads per program, query tokens per program) of :func:`tiles`."""
    t = tiles(heads, d_lat, target)
    return t.block_h, t.qt


# -- shared pieces: every launch mode computes a row through these ---------------------------------

@triton.jit
def _rows(chunk_ptr, pos_ptr, order_ptr, c, hb, heads, BLOCK_H: tl.constexpr, QT: tl.constexpr,
          TREE: tl.constexpr):
    """A program's rows: (sequence, query token per row, the chunk's deepest token, head per row,
    row mask, position per row). Pad rows (past the chunk's tokens) sit at position 0."""
    t0 = tl.load(chunk_ptr + 3 * c).to(tl.int64)
    nt = tl.load(chunk_ptr + 3 * c + 1)
    b = tl.load(chunk_ptr + 3 * c + 2).to(tl.int64)
    r = tl.arange(0, BLOCK_H * QT)
    tok = r // BLOCK_H
    h = hb * BLOCK_H + r % BLOCK_H
    rm = (tok < nt) & (h < heads)
    if TREE:  # rows are entries of the plan's order; a tree chunk is one path, its last row the deepest
        tid = tl.load(order_ptr + t0 + tok, mask=tok < nt, other=0).to(tl.int64)
        deep = tl.load(order_ptr + t0 + nt - 1).to(tl.int64)
    else:
        tid = t0 + tok
        deep = t0
    pos = tl.load(pos_ptr + tid, mask=tok < nt, other=0)
    return b, tid, deep, h, rm, pos


@triton.jit
def _attend(q_lat, q_pe, pos, kv_ptr, bt_ptr, lo_ptr, path_ptr, b, deep, start, stop, stride_kv, stride_bt,
            block_size, scale, DOT: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
            TREE: tl.constexpr, PATH: tl.constexpr):
    """Online softmax of the rows over the keys ``[start, stop)`` (one split, fresh state): the
    split's partial ``(o, l, m)``. Rows whose position is below ``start`` get garbage, never read."""
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_L], tl.float32)
    for k0 in range(start, stop, BLOCK_N):
        k = k0 + tl.arange(0, BLOCK_N)
        km = k < stop
        kc = k
        if TREE:  # virtual key positions: a tree query's ancestors in depth order after the context
            kc = tree_key_positions(k, km, lo_ptr, path_ptr, deep, PATH)
        blk = tl.load(bt_ptr + b * stride_bt + kc // block_size, mask=km, other=0).to(tl.int64)
        slot = blk * block_size + kc % block_size
        krow = kv_ptr + slot[:, None] * stride_kv
        k_lat = tl.load(krow + dl[None, :], mask=km[:, None] & (dl[None, :] < D_LAT), other=0.0).to(DOT)
        k_pe = tl.load(krow + D_LAT + dr[None, :], mask=km[:, None] & (dr[None, :] < D_ROPE), other=0.0).to(DOT)
        s = mma(q_lat, tl.trans(k_lat), IEEE) + mma(q_pe, tl.trans(k_pe), IEEE)
        s = tl.where(k[None, :] <= pos[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: zeros, not NaN
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(DOT), k_lat, IEEE)
        m = m_new
    return acc, den, m


@triton.jit
def _weights(l_a, m_a, l_b, m_b):
    """Merging partial ``a`` (earlier splits) with ``b`` (the next split): the merged ``(l, m)``
    and the weights of ``a`` and ``b``; the side holding the max weighs exactly 1."""
    m = tl.maximum(m_a, m_b)
    w_a = tl.where(m_a == m, 1.0, tl.exp(m_a - m))
    w_b = tl.where(m_b == m, 1.0, tl.exp(m_b - m))
    return tl.fma(l_a, w_a, l_b * w_b), m, w_a, w_b


@triton.jit
def _mix(o_a, w_a, o_b, w_b):
    return tl.fma(o_a, w_a[:, None], o_b * w_b[:, None])


@triton.jit
def _finish(o, den, v_scale):
    return o / den[:, None] * v_scale  # an fp8 cache's value scale (1.0 otherwise: exact)


@triton.jit
def _load_q(q_ptr, tid, h, rm, stride_qt, stride_qh, DOT: tl.constexpr, D_LAT: tl.constexpr,
            D_ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    qrow = q_ptr + tid[:, None] * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(qrow + dl[None, :], mask=rm[:, None] & (dl[None, :] < D_LAT), other=0.0).to(DOT)
    q_pe = tl.load(qrow + D_LAT + dr[None, :], mask=rm[:, None] & (dr[None, :] < D_ROPE), other=0.0).to(DOT)
    return q_lat, q_pe


# -- split mode -----------------------------------------------------------------------------------

@triton.jit
def _mla_split_kernel(q_ptr, kv_ptr, po_ptr, pl_ptr, pm_ptr, chunk_ptr, pos_ptr, bt_ptr, lo_ptr, path_ptr,
                      order_ptr, stride_qt, stride_qh, stride_kv, stride_bt, heads, n_splits, block_size, scale,
                      DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_H: tl.constexpr, QT: tl.constexpr,
                      HB: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, D_LAT: tl.constexpr,
                      D_ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, TREE: tl.constexpr,
                      PATH: tl.constexpr):
    """Stage 1: the partial of split ``program_id(1)`` for the rows of one (chunk, head block),
    stored per (query token, split, head) into ``po [T, n_splits, heads, D_LAT]`` / ``pl`` / ``pm``."""
    c = tl.program_id(0) // HB
    hb = tl.program_id(0) % HB
    j = tl.program_id(1)
    b, tid, deep, h, rm, pos = _rows(chunk_ptr, pos_ptr, order_ptr, c, hb, heads, BLOCK_H, QT, TREE)
    last = tl.max(pos, axis=0)
    start = j * SPLIT
    if start <= last:  # programs past the chunk's keys (the grid follows the widest table) do nothing
        q_lat, q_pe = _load_q(q_ptr, tid, h, rm, stride_qt, stride_qh, DOT, D_LAT, D_ROPE, BLOCK_L, BLOCK_R)
        acc, den, m = _attend(q_lat, q_pe, pos, kv_ptr, bt_ptr, lo_ptr, path_ptr, b, deep, start,
                              tl.minimum(start + SPLIT, last + 1), stride_kv, stride_bt, block_size, scale, DOT, IEEE,
                              BLOCK_H * QT, BLOCK_N, D_LAT, D_ROPE, BLOCK_L, BLOCK_R, TREE, PATH)
        mine = rm & (pos >= start)  # the rows this split belongs to
        at = (tid * n_splits + j) * heads + h
        dl = tl.arange(0, BLOCK_L)
        tl.store(po_ptr + at[:, None] * D_LAT + dl[None, :], acc, mask=mine[:, None] & (dl[None, :] < D_LAT))
        tl.store(pl_ptr + at, den, mask=mine)
        tl.store(pm_ptr + at, m, mask=mine)


@triton.jit
def _mla_merge_kernel(po_ptr, pl_ptr, pm_ptr, o_ptr, pos_ptr, stride_ot, stride_oh, heads, n_splits, v_scale,
                      SPLIT: tl.constexpr, D_LAT: tl.constexpr, HG: tl.constexpr, BD: tl.constexpr):
    """Stage 2: for query token ``program_id(0)``, heads ``HG`` x columns ``BD``, its splits
    ``0 .. pos // SPLIT`` merged in order and normalized."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HG + tl.arange(0, HG)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    hm = h < heads
    dm = hm[:, None] & (d[None, :] < D_LAT)
    n = tl.load(pos_ptr + t) // SPLIT + 1
    at = t * n_splits * heads + h
    o = tl.load(po_ptr + at[:, None] * D_LAT + d[None, :], mask=dm, other=0.0)
    den = tl.load(pl_ptr + at, mask=hm, other=1.0)
    m = tl.load(pm_ptr + at, mask=hm, other=0.0)
    for j in range(1, n):
        at = (t * n_splits + j) * heads + h
        o_b = tl.load(po_ptr + at[:, None] * D_LAT + d[None, :], mask=dm, other=0.0)
        l_b = tl.load(pl_ptr + at, mask=hm, other=1.0)
        m_b = tl.load(pm_ptr + at, mask=hm, other=0.0)
        den, m, w_a, w_b = _weights(den, m, l_b, m_b)
        o = _mix(o, w_a, o_b, w_b)
    out = _finish(o, den, v_scale)
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=dm)


# -- serial mode ----------------------------------------------------------------------------------

@triton.jit
def _mla_serial_kernel(q_ptr, kv_ptr, o_ptr, ro_ptr, rl_ptr, rm_ptr, so_ptr, sl_ptr, sm_ptr, chunk_ptr, pos_ptr,
                       bt_ptr, lo_ptr, path_ptr, order_ptr, stride_qt, stride_qh, stride_kv, stride_ot, stride_oh,
                       stride_bt, heads, block_size, scale, v_scale, DOT: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_H: tl.constexpr, QT: tl.constexpr, HB: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_N: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_R: tl.constexpr, BD: tl.constexpr, TREE: tl.constexpr, PATH: tl.constexpr):
    """One (chunk, head block) over all its splits in order. A chunk within one split writes its
    output from registers; otherwise each split's partial goes to the scratch ``so / sl / sm [T,
    heads, ...]`` and is folded, column block by column block, into the running partial ``ro / rl
    / rm`` (a row's first split is taken as it is, as the split merge does), the output written at
    the row's last split."""
    c = tl.program_id(0) // HB
    hb = tl.program_id(0) % HB
    b, tid, deep, h, rm, pos = _rows(chunk_ptr, pos_ptr, order_ptr, c, hb, heads, BLOCK_H, QT, TREE)
    last = tl.max(pos, axis=0)
    n_row = pos // SPLIT + 1
    q_lat, q_pe = _load_q(q_ptr, tid, h, rm, stride_qt, stride_qh, DOT, D_LAT, D_ROPE, BLOCK_L, BLOCK_R)
    dl = tl.arange(0, BLOCK_L)
    lm = dl[None, :] < D_LAT
    if last < SPLIT:  # one split: no workspace
        acc, den, m = _attend(q_lat, q_pe, pos, kv_ptr, bt_ptr, lo_ptr, path_ptr, b, deep, 0, last + 1, stride_kv,
                              stride_bt, block_size, scale, DOT, IEEE, BLOCK_H * QT, BLOCK_N, D_LAT, D_ROPE, BLOCK_L,
                              BLOCK_R, TREE, PATH)
        tl.store(o_ptr + tid[:, None] * stride_ot + h[:, None] * stride_oh + dl[None, :],
                 _finish(acc, den, v_scale).to(o_ptr.dtype.element_ty), mask=rm[:, None] & lm)
    else:
        at = tid * heads + h  # [T, heads] slots of the running / scratch partials
        for j in range(0, last // SPLIT + 1):
            start = j * SPLIT
            acc, den, m = _attend(q_lat, q_pe, pos, kv_ptr, bt_ptr, lo_ptr, path_ptr, b, deep, start,
                                  tl.minimum(start + SPLIT, last + 1), stride_kv, stride_bt, block_size, scale, DOT,
                                  IEEE, BLOCK_H * QT, BLOCK_N, D_LAT, D_ROPE, BLOCK_L, BLOCK_R, TREE, PATH)
            mine = rm & (j < n_row)
            tl.store(so_ptr + at[:, None] * D_LAT + dl[None, :], acc, mask=mine[:, None] & lm)
            tl.store(sl_ptr + at, den, mask=mine)
            tl.store(sm_ptr + at, m, mask=mine)
            tl.debug_barrier()  # the column blocks below are read by other threads than wrote them
            _fold(o_ptr, ro_ptr, rl_ptr, rm_ptr, so_ptr, sl_ptr, sm_ptr, tid, h, at, mine, j, n_row, stride_ot,
                  stride_oh, v_scale, D_LAT, BLOCK_L, BD)
            tl.debug_barrier()  # the next split overwrites the scratch these reads came from


@triton.jit
def _fold(o_ptr, ro_ptr, rl_ptr, rm_ptr, so_ptr, sl_ptr, sm_ptr, tid, h, at, mine, j, n_row, stride_ot, stride_oh,
          v_scale, D_LAT: tl.constexpr, BLOCK_L: tl.constexpr, BD: tl.constexpr):
    """The serial kernel's merge of split ``j`` (scratch) into the running partial, per row: its
    first split becomes the running partial, a later one is merged as the split merge does; at the
    row's last split the result goes to the output instead. Loads through L2 (``.cg``): a gfx942
    CU's vector L1 may hold this slot's previous split."""
    l_b = tl.load(sl_ptr + at, mask=mine, other=1.0, cache_modifier=".cg")
    m_b = tl.load(sm_ptr + at, mask=mine, other=0.0, cache_modifier=".cg")
    first = j == 0
    l_a = tl.load(rl_ptr + at, mask=mine & ~first, other=1.0, cache_modifier=".cg")
    m_a = tl.load(rm_ptr + at, mask=mine & ~first, other=0.0, cache_modifier=".cg")
    den, m, w_a, w_b = _weights(l_a, m_a, l_b, m_b)
    if first:
        den = l_b
        m = m_b
    fin = mine & (j == n_row - 1)
    keep = mine & (j < n_row - 1)
    for d0 in range(0, BLOCK_L, BD):
        d = d0 + tl.arange(0, BD)
        dm = mine[:, None] & (d[None, :] < D_LAT)
        o = tl.load(so_ptr + at[:, None] * D_LAT + d[None, :], mask=dm, other=0.0, cache_modifier=".cg")
        if not first:
            o_a = tl.load(ro_ptr + at[:, None] * D_LAT + d[None, :], mask=dm, other=0.0, cache_modifier=".cg")
            o = _mix(o_a, w_a, o, w_b)
        tl.store(o_ptr + tid[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                 _finish(o, den, v_scale).to(o_ptr.dtype.element_ty), mask=fin[:, None] & (d[None, :] < D_LAT))
        tl.store(ro_ptr + at[:, None] * D_LAT + d[None, :], o, mask=keep[:, None] & (d[None, :] < D_LAT))
    tl.store(rl_ptr + at, den, mask=keep)
    tl.store(rm_ptr + at, m, mask=keep)


# -- launch ---------------------------------------------------------------------------------------

def launch_mode(tokens: int, n_splits: int, heads: int, d_lat: int) -> str:
    """``"split"`` while its partials (tokens x splits x heads x (latent + 2) fp32) fit
    :data:`WORKSPACE_BUDGET` and there is more than one split; else ``"serial"``, as always under
    the interpreter (which runs each program in Python: fewer programs, the same bits)."""
    fits = 1 < n_splits <= 65535 and workspace_bytes(tokens, n_splits, heads, d_lat) <= WORKSPACE_BUDGET
    return "split" if fits and not INTERPRET else "serial"


def _target(device: torch.device) -> str:
    return "hip" if device.type == "cuda" and getattr(torch.version, "hip", None) else "cuda"


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, d_lat: int, plan: TritonAttnPlan,
                  scale: float, kv_scale: float = 1.0, *, split: int | None = None,
                  mode: str | None = None) -> torch.Tensor:
    """``q [T, H, d_lat + d_rope]`` against ``kv_cache [S, d_lat + d_rope]`` (flat slots) ->
    ``[T, H, d_lat]`` in ``q.dtype``. An fp8 cache is loaded as its codes (exact in the dot dtype)
    with ``kv_scale`` folded into the score scale and the output (runtime/kv_cache.py).

    ``split`` (keys per split, a multiple of :data:`BLOCK_N`) and ``mode`` (``"split"`` /
    ``"serial"``) are for tests: by default the split follows :func:`split_size` and the mode the
    workspace it needs (serial under the interpreter); both modes give the same bits."""
    t, heads, d = q.shape
    d_rope = d - d_lat
    dtype = q.dtype
    qs = widen(q)
    if qs.stride(-1) != 1:
        qs = qs.contiguous()
    kv = widen(kv_cache)
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    out = torch.empty((t, heads, d_lat), dtype=qs.dtype, device=q.device)
    if not t:
        return out if out.dtype == dtype else out.to(dtype)
    s = split if split is not None else split_size(heads, d_lat, d_rope)
    if s % BLOCK_N or s & (s - 1):
        raise ValueError(f"split {s}: a power of two multiple of {BLOCK_N} keys")
    shape = tiles(heads, d_lat, _target(q.device))
    bh, qt = shape.block_h, shape.qt
    hb = triton.cdiv(heads, bh)
    chunks = plan.chunks(qt)
    n_splits = triton.cdiv(plan.block_tables.shape[1] * plan.block_size, s)  # host shapes only
    mode = mode or launch_mode(t, n_splits, heads, d_lat)
    dd = dot_dtype(qs.dtype)
    tree = plan.tree is not None
    lo, paths = plan.tree if tree else (plan.positions, plan.positions)  # unread without TREE
    order = plan.order(qt) if tree else plan.positions
    bl, br = block(d_lat), block(d_rope)
    rows = bh * qt
    common = dict(DOT=tl_dtype(dd), IEEE=dd == torch.float32, BLOCK_H=bh, QT=qt, HB=hb, SPLIT=s, BLOCK_N=BLOCK_N,
                  D_LAT=d_lat, D_ROPE=d_rope, BLOCK_L=bl, BLOCK_R=br, TREE=tree, PATH=TREE_MAX_NODES,
                  num_warps=shape.warps, num_stages=shape.stages)
    if mode == "split":
        po = torch.empty((t, n_splits, heads, d_lat), dtype=torch.float32, device=q.device)
        pl = torch.empty((t, n_splits, heads), dtype=torch.float32, device=q.device)
        pm = torch.empty_like(pl)
        _mla_split_kernel[(chunks.shape[0] * hb, n_splits)](
            qs, kv, po, pl, pm, chunks, plan.positions, plan.block_tables, lo, paths, order, qs.stride(0),
            qs.stride(1), kv.stride(0), plan.block_tables.stride(0), heads, n_splits, plan.block_size,
            float(scale * kv_scale), **common)
        hg = min(triton.next_power_of_2(heads), max(1, MERGE_TILE // bl))
        bd = min(bl, MERGE_TILE // hg)
        _mla_merge_kernel[(t, triton.cdiv(heads, hg), triton.cdiv(d_lat, bd))](
            po, pl, pm, out, plan.positions, out.stride(0), out.stride(1), heads, n_splits, float(kv_scale),
            SPLIT=s, D_LAT=d_lat, HG=hg, BD=bd, num_warps=4)
    elif mode == "serial":
        if n_splits > 1:  # running and scratch partials per (token, head)
            ws = torch.empty((2, t, heads, d_lat), dtype=torch.float32, device=q.device)
            ml = torch.empty((4, t, heads), dtype=torch.float32, device=q.device)
            ro, so, rl, rmx, sl, smx = ws[0], ws[1], ml[0], ml[1], ml[2], ml[3]
        else:  # every chunk's keys fit one split: no workspace is touched
            ro = so = rl = rmx = sl = smx = torch.empty(1, dtype=torch.float32, device=q.device)
        _mla_serial_kernel[(chunks.shape[0] * hb,)](
            qs, kv, out, ro, rl, rmx, so, sl, smx, chunks, plan.positions, plan.block_tables, lo, paths, order,
            qs.stride(0), qs.stride(1), kv.stride(0), out.stride(0), out.stride(1), plan.block_tables.stride(0),
            heads, plan.block_size, float(scale * kv_scale), float(kv_scale), BD=max(16, min(bl, MERGE_TILE // rows)),
            **common)
    else:
        raise ValueError(f"mode {mode!r}: expected 'split' or 'serial'")
    return out if out.dtype == dtype else out.to(dtype)
