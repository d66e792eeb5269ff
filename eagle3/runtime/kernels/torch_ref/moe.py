"""The torch reference routed experts (MoE)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from eagle3.runtime.kernels.base import (
    ActQuant,
    Int4Weight,
    LinearWeight,
    MoEOp,
    QuantizedRows,
    int4_channel_scale,
)

if TYPE_CHECKING:  # pragma: no cover
    pass

from eagle3.runtime.kernels.torch_ref import packed
from eagle3.runtime.kernels.torch_ref.act_quant import _check_act, mxfp4_qdq, quantize_int8_per_token
from eagle3.runtime.kernels.torch_ref.elementwise import silu
from eagle3.runtime.kernels.torch_ref.exact_gemm import (
    FP8_DIGITS_MAX_K,
    fp8_digits,
    fp8_digits_gemm,
    fp8_int4_linear,
    fp8_linear,
    int8_gemm,
    int8_linear,
)
from eagle3.runtime.kernels.torch_ref.gemm import ROW_TILE, _bmm, bmm_rows, compute_dtype, mm_rows
from eagle3.runtime.kernels.torch_ref.packed import _Bank, _bank_gemm, _row_tiles

# MoE execution plan, fixed per model (never per batch, so a token's bits do not depend on it):
# all experts for every token as two GEMMs when all expert weights together are this small
# (tiny and test models: fewest ops), else gather expert weights per row tile when one expert is
# small, else loop over the active experts.
_MOE_ALL_BYTES = 16 * 1024 * 1024
_MOE_GATHER_BYTES = 2 * 1024 * 1024


class TorchMoE(MoEOp):
    """Routed experts. Token-expert pairs are grouped by expert; float experts run as row-tiled
    GEMMs (all experts in one ``bmm`` when small, else the active experts gathered per row tile or
    one at a time), decoded per call from the packed weights; int8 / fp8-activation experts run the
    exact linear per active expert."""

    def prepare(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.num_experts = self.check_experts(gate, up, down)
        self.dtype = dtype
        self.cd = compute_dtype(dtype, device)
        self.mode = _check_act(gate[0], act)
        self.path = "loop"
        self.inter = gate[0].shape[0]
        self.hidden = gate[0].shape[1]
        if self.mode in ("dense", "mxfp4"):
            # gate rows then up rows, as transformers' fused gate_up_proj.
            self.w13 = _Bank([[g, u] for g, u in zip(gate, up, strict=True)], dtype, device)
            self.w2 = _Bank([[d] for d in down], dtype, device)
            per_expert = self.w13.dense_bytes + self.w2.dense_bytes
            self.path = ("all" if per_expert * self.num_experts <= _MOE_ALL_BYTES
                         else "gather" if per_expert <= _MOE_GATHER_BYTES else "loop")
            self.chunk = max(1, packed.MOE_SCRATCH_BYTES // per_expert)  # experts decoded at once (gather)
            # loop path: one expert's rows a tile at a time, as a Linear's (LINEAR_SCRATCH_BYTES)
            self.tiles13 = _row_tiles(self.w13.n, self.w13.dense_bytes // self.w13.n, packed.LINEAR_SCRATCH_BYTES)
            self.tiles2 = _row_tiles(self.w2.n, self.w2.dense_bytes // self.w2.n, packed.LINEAR_SCRATCH_BYTES)
        else:  # int8 / fp8 activations: the exact linears, per-channel weights only
            if isinstance(gate[0], Int4Weight):
                int4_channel_scale(gate[0])  # refuses group scales
            self.w13 = _Bank([[g, u] for g, u in zip(gate, up, strict=True)], dtype, device)
            self.w2 = _Bank([[d] for d in down], dtype, device)
            code_bytes = 1 if self.mode == "int8" else 8  # int8 codes, or float64 for the exact GEMM
            self.chunk = max(1, packed.MOE_SCRATCH_BYTES // ((self.w13.n + self.w2.n) * self.hidden * code_bytes))
            self.min_rows = 17 if device.type == "cuda" else 1

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.w13.resident() + self.w2.resident()

    def _dense(self, sel: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 ``[e, 2I, H]``, w2 ``[e, H, I]``) of experts ``sel`` in the compute dtype, per call."""
        return self.w13.decode(sel).to(self.cd), self.w2.decode(sel).to(self.cd)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 xq: QuantizedRows | None = None) -> torch.Tensor:
        # xq unused: the reference quantizes its input itself (the same numbers)
        t, k = topk_ids.shape
        if self.path == "all":
            return self._all_experts(x, topk_ids, topk_weights)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.path == "gather":
            out_sorted = self._gathered(x, flat, order, counts, k)
        else:
            out_sorted = self._looped(x, order, counts, k)
        pair_out = torch.empty_like(out_sorted)
        pair_out[order] = out_sorted
        y = (pair_out.view(t, k, -1).float() * topk_weights.float()[..., None]).sum(1)
        return y.to(self.dtype)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        g, u = h.split(self.inter, dim=-1)
        a = silu(g) * u
        return mxfp4_qdq(a) if self.mode == "mxfp4" else a

    def _all_experts(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (row-tiled GEMMs), then pick the top-k rows: 3-4x the
        FLOPs of routing, but a handful of ops, which is what a small model's step costs."""
        t = x.shape[0]
        active = torch.nonzero(torch.bincount(ids.reshape(-1), minlength=self.num_experts)).reshape(-1)
        if 2 * active.numel() >= self.num_experts:  # most are used: one decode of all, no scatter
            w13, w2 = self._dense(None)
        else:
            # Only the experts this call uses are decoded; the others' weights are zero, and their
            # outputs, never picked, do not touch the used columns of the GEMMs (same bits).
            d13, d2 = self._dense(active)
            w13 = d13.new_zeros(self.num_experts, *d13.shape[1:]).index_copy_(0, active, d13)
            w2 = d2.new_zeros(self.num_experts, *d2.shape[1:]).index_copy_(0, active, d2)
        xin = mxfp4_qdq(x) if self.mode == "mxfp4" else x
        h = mm_rows(xin, w13.view(-1, self.hidden).t()).view(t, self.num_experts, 2 * self.inter)
        o = bmm_rows(self._act(h).transpose(0, 1), w2.transpose(1, 2))  # [E, T, H]
        picked = o.transpose(0, 1)[torch.arange(t, device=x.device)[:, None], ids]  # [T, k, H]
        return (picked.float() * w.float()[..., None]).sum(1).to(self.dtype)

    def _gathered(self, x: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                  k: int) -> torch.Tensor:
        r = ROW_TILE
        padded = (counts + r - 1) // r * r
        pad_start = torch.cumsum(padded, 0) - padded
        cnt_start = torch.cumsum(counts, 0) - counts
        e_sorted = flat[order]
        dest = pad_start[e_sorted] + torch.arange(order.numel(), device=x.device) - cnt_start[e_sorted]
        total = int(padded.sum())
        xin = x[order // k]
        if self.mode == "mxfp4":
            xin = mxfp4_qdq(xin)
        xbuf = x.new_zeros(total, self.hidden)
        xbuf[dest] = xin
        nt = total // r
        xt = xbuf.view(nt, r, self.hidden)
        o = x.new_empty(nt, r, self.hidden)
        # The active experts in chunks (tiles are ordered by expert): decoded per chunk, then every
        # tile of the chunk as one batched GEMM with its expert's weights, as one bmm over all tiles.
        active = torch.nonzero(counts).reshape(-1)
        tiles = (padded // r)[active].tolist()
        t0 = 0
        for c in range(0, active.numel(), self.chunk):
            sel = active[c: c + self.chunk]
            n_t = tiles[c: c + self.chunk]
            t1 = t0 + sum(n_t)
            local = torch.repeat_interleave(torch.arange(sel.numel(), device=x.device),
                                            torch.tensor(n_t, device=x.device), output_size=t1 - t0)
            w13, w2 = self._dense(sel)
            h = _bmm(xt[t0:t1], w13[local].transpose(1, 2))
            o[t0:t1] = _bmm(self._act(h), w2[local].transpose(1, 2))
            t0 = t1
        return o.reshape(total, self.hidden)[dest]

    def _looped(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        out = x.new_empty(order.numel(), self.hidden)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        n_of = counts.tolist()
        active = torch.nonzero(counts).reshape(-1)
        exact = self.mode in ("int8", "fp8")
        if not exact and packed._scratch_ok(x):
            # one expert at a time, its weights decoded a row tile at a time into the scratch
            for e in active.tolist():
                idx = slice(starts[e], starts[e] + n_of[e])
                rows = x[order[idx] // k]
                if self.mode == "mxfp4":
                    rows = mxfp4_qdq(rows)
                h = _bank_gemm(rows, self.w13, e, self.tiles13, self.cd)
                out[idx] = _bank_gemm(self._act(h), self.w2, e, self.tiles2, self.cd)
            return out
        if exact and self.w13.kind is Int4Weight and packed._scratch_ok(x):
            # one expert at a time, its int8 codes unpacked into the scratch (no float64 widening)
            segs = [(e, slice(starts[e], starts[e] + n_of[e])) for e in active.tolist()]
            h = self._int4_experts(x[order // k], segs, self.w13, "codes13")
            g, u = h.split(self.inter, dim=-1)
            return self._int4_experts(silu(g) * u, segs, self.w2, "codes2")
        for c in range(0, active.numel(), self.chunk if exact else 1):
            sel = active[c: c + (self.chunk if exact else 1)]
            if exact:  # the active experts' codes of a chunk in one decode
                c13, c2 = self.w13.codes(sel), self.w2.codes(sel)
                if self.mode == "fp8":
                    c13, c2 = c13.to(torch.float64), c2.to(torch.float64)
                s13 = self.w13.tensors["scale"].index_select(0, sel)
                s2 = self.w2.tensors["scale"].index_select(0, sel)
            else:
                w13, w2 = self._dense(sel)
            for i, e in enumerate(sel.tolist()):
                idx = slice(starts[e], starts[e] + n_of[e])
                rows = x[order[idx] // k]
                if not exact:
                    if self.mode == "mxfp4":
                        rows = mxfp4_qdq(rows)
                    h = mm_rows(rows, w13[i].t())
                    out[idx] = mm_rows(self._act(h), w2[i].t())
                else:
                    h = self._exact(rows, c13[i], s13[i])
                    g, u = h.split(self.inter, dim=-1)
                    out[idx] = self._exact(silu(g) * u, c2[i], s2[i])
        return out

    def _int4_experts(self, x: torch.Tensor, segs: list[tuple[int, slice]], bank: _Bank, name: str) -> torch.Tensor:
        """Rows ``x`` grouped by expert (``segs``: expert, its rows) through ``bank``'s INT4 experts:
        the bits of :func:`int8_linear` / :func:`fp8_int4_linear` per expert, with the activations
        quantized once for all rows (per-token quantization: a row's codes and scale do not depend
        on the other rows) and one integer GEMM per expert. A verification step routes each of its
        tokens to other experts, so per-expert work is what it adds over a decode step."""
        scale = bank.tensors["scale"]
        out = x.new_empty(x.shape[0], bank.n, dtype=self.dtype)
        if self.mode == "int8":
            q, sx = quantize_int8_per_token(x)
            for e, idx in segs:
                out[idx] = int8_gemm(q[idx], sx[idx], bank.int_codes(e, (0, bank.n), name), scale[e], self.min_rows)
            return out
        if x.shape[1] >= FP8_DIGITS_MAX_K:
            for e, idx in segs:
                out[idx] = fp8_int4_linear(x[idx], bank.int_codes(e, (0, bank.n), name), scale[e], self.min_rows)
            return out
        digits, sx = fp8_digits(x)
        for e, idx in segs:
            out[idx] = fp8_digits_gemm(digits[idx], sx[idx], bank.int_codes(e, (0, bank.n), name), scale[e],
                                       self.min_rows)
        return out

    def _exact(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8":
            return int8_linear(x, codes, scale, self.min_rows).to(self.dtype)
        return fp8_linear(x, codes, scale).to(self.dtype)
