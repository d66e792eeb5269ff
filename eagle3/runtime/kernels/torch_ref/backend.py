"""The ``torch`` kernel backend: the ops of this package behind the KernelBackend interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eagle3.runtime import kv_cache
from eagle3.runtime.kernels.base import (
    KernelBackend,
    LinearOp,
    MoEOp,
    register_backend,
)

if TYPE_CHECKING:  # pragma: no cover
    from eagle3.runtime.context import AttnMetadata

from eagle3.runtime.kernels.torch_ref.attention import AttnPlan, paged_attention, plan_attention
from eagle3.runtime.kernels.torch_ref.elementwise import pointwise, silu
from eagle3.runtime.kernels.torch_ref.gemm import bmm_rows, compute_dtype, mm_rows
from eagle3.runtime.kernels.torch_ref.linear import TorchLinear
from eagle3.runtime.kernels.torch_ref.moe import TorchMoE


class TorchBackend(KernelBackend):
    name = "torch"

    def linear(self) -> LinearOp:
        return TorchLinear()

    def moe(self) -> MoEOp:
        return TorchMoE()

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or torch.promote_types(x.dtype, w_t.dtype)
        return mm_rows(x.to(dt), w_t.to(compute_dtype(dt, w_t.device)))  # widened per call (CPU bf16)

    def bmm(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or torch.promote_types(x.dtype, w.dtype)
        return bmm_rows(x.to(dt), w.to(compute_dtype(dt, w.device)))

    def matrix(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return w.to(dtype).contiguous()  # kept in the model dtype; matmul / bmm widen it per call

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one op (bit-identical to the spelled-out
        # transformers form on CPU, tests/runtime/test_layers.py); the weight multiply stays in the
        # activation dtype as transformers does it.
        xf = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), eps=eps)
        return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise(torch.sigmoid, x)

    def cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise(torch.cos, angles), pointwise(torch.sin, angles)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # The reference attention computes in fp32 on the CPU (compute_dtype): a bf16 cache was
        # widened on every read (a gather, then a copy of every key tile), 13% of a batch-16
        # decode step of the tiny target (measured: 55.9 -> 48.6 ms). Same numbers, twice the bytes.
        return compute_dtype(dtype, self.device)

    def write_cache(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor,
                    scale: float | tuple[float, float] = 1.0) -> None:
        slots = slot_mapping.to(device=cache.device, dtype=torch.int64)
        if kv_cache.is_fp8(cache.dtype):  # quantized on write (runtime/kv_cache.py defines the numbers)
            if isinstance(scale, tuple):
                vals = torch.stack([kv_cache.quantize(values[:, i], cache.dtype, s) for i, s in enumerate(scale)], 1)
            else:
                vals = kv_cache.quantize(values, cache.dtype, scale)
        else:
            vals = values.to(cache.dtype)
        keep = slots >= 0
        # Under CUDA-graph capture there is no -1 slot (engine/graphs.py pads into a spare block) and
        # the check, a device sync, is not allowed.
        capturing = slots.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not bool(keep.all()):
            slots, vals = slots[keep], vals[keep]
        kv_cache.bits(cache).index_copy_(0, slots, kv_cache.bits(vals))  # bits: no float8 index_copy on CPU

    def plan_attention(self, meta: AttnMetadata) -> AttnPlan:
        return plan_attention(meta)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, plan: AttnPlan | None = None, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, plan if plan is not None else plan_attention(meta), scale,
                               k_scale, v_scale)


register_backend("torch", TorchBackend)
