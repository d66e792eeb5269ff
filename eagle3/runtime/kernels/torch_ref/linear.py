"""The torch reference Linear: row-tiled float GEMMs or the exact integer GEMMs, weights packed."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from eagle3.runtime.kernels.base import (
    ActQuant,
    Int4Weight,
    LinearOp,
    LinearWeight,
    QuantizedRows,
    int4_channel_scale,
)

if TYPE_CHECKING:  # pragma: no cover
    pass

from eagle3.runtime.kernels.torch_ref import packed
from eagle3.runtime.kernels.torch_ref.act_quant import _check_act, mxfp4_qdq
from eagle3.runtime.kernels.torch_ref.exact_gemm import fp8_int4_linear, fp8_linear, int8_linear
from eagle3.runtime.kernels.torch_ref.gemm import compute_dtype, mm_rows
from eagle3.runtime.kernels.torch_ref.packed import _TILE_ALIGN, _Bank, _bank_gemm, _row_tiles


def _bias(w: LinearWeight, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return None if w.bias is None else w.bias.to(device=device, dtype=dtype)



class TorchLinear(LinearOp):
    """Float GEMM on row tiles, or an exact integer / float64 GEMM for quantized activations; the
    weight stays packed and is decoded per call (see "Packed weights, decoded per call")."""

    def prepare(self, weight: LinearWeight, act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.mode = _check_act(weight, act)
        self.dtype = dtype
        self.cd = compute_dtype(dtype, device)
        self.bias = _bias(weight, dtype, device)
        self.bank = _Bank([[weight]], dtype, device)
        self.w_scale: torch.Tensor | None = None
        if self.mode in ("dense", "mxfp4"):
            row_bytes = self.bank.dense_bytes // self.out_features
        elif self.mode == "int8":
            assert isinstance(weight, Int4Weight)
            int4_channel_scale(weight)  # refuses group scales
            self.w_scale = self.bank.tensors["scale"][0]  # fp32 [N], stage scales merged
            # torch._int_mm on CUDA needs M > 16 (its cuBLASLt int8 path): pad rows there.
            self.min_rows = 17 if device.type == "cuda" else 1
            row_bytes = self.in_features
        else:  # fp8 activations, INT4 or per-channel FP8 weight: exact accumulation
            if isinstance(weight, Int4Weight):
                int4_channel_scale(weight)  # refuses group scales
            self.w_scale = self.bank.tensors["scale"][0]
            self.min_rows = 17 if device.type == "cuda" else 1
            # INT4: int8 codes and exact int32 digit GEMMs; FP8: the codes in float64
            row_bytes = self.in_features if isinstance(weight, Int4Weight) else 8 * self.in_features
        block = getattr(self.bank, "block", None)
        align = math.lcm(_TILE_ALIGN, block[0]) if block is not None else _TILE_ALIGN
        self.tiles = _row_tiles(self.out_features, row_bytes, packed.LINEAR_SCRATCH_BYTES, align)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        return self.bank.resident() + ([] if self.bias is None else [("dense", self.bias)])

    def dense(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight rows as the float GEMM's operand: model dtype first (bf16(q*s) for INT4),
        then widened to the compute dtype. Per call, never kept."""
        return self.bank.decode(None, rows)[0].to(self.cd)

    def _rows(self, x: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
        if self.mode in ("dense", "mxfp4"):
            return mm_rows(x, self.dense(r).t())  # (the per-call tensors: off CPU, or with autograd)
        assert self.w_scale is not None
        int4 = self.bank.kind is Int4Weight
        codes = self.bank.int_codes(0, r, "codes") if int4 and packed._scratch_ok(x) else self.bank.codes(None, r)[0]
        if self.mode == "int8":
            return int8_linear(x, codes, self.w_scale[r[0]: r[1]], self.min_rows).to(self.dtype)
        if int4 and x.device.type == "cpu":
            return fp8_int4_linear(x, codes, self.w_scale[r[0]: r[1]], self.min_rows).to(self.dtype)
        return fp8_linear(x, codes.to(torch.float64), self.w_scale[r[0]: r[1]]).to(self.dtype)

    def __call__(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        # xq unused: the reference quantizes its input itself (the same numbers)
        if self.mode == "mxfp4":
            x = mxfp4_qdq(x)
        if self.mode in ("dense", "mxfp4") and packed._scratch_ok(x):
            y = _bank_gemm(x, self.bank, 0, self.tiles, self.cd)
        elif len(self.tiles) == 1:
            y = self._rows(x, self.tiles[0])
        else:
            y = torch.cat([self._rows(x, r) for r in self.tiles], dim=-1)
        return y if self.bias is None else y + self.bias
