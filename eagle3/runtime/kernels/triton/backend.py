"""``backend="triton"``: the runtime's GPU path (Hopper and MI300-class GPUs from one source).

Triton kernels: the weighted ops - quantized and dense GEMMs on the packed canonical weights
(``linear.py``: W4A16, W4A8 int8 / FP8-stage, MXFP4, FP8, dense) and the fused MoE (``moe.py``) -
the small dense products (router, MLA absorption ``bmm``: ``dense_gemm.py``, on a GPU), RMSNorm
(+ fused residual add), rotary, per-token int8 / fp8 activation quantization, MLA attention over
the paged latent cache and paged MHA / GQA attention. Every op here keeps the reference's
batch-invariance contract, so speculative greedy output equals plain greedy output.

On a CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before triton
is imported); that is how CI checks them.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.kernels.base import PER_TOKEN_QUANTS, LinearOp, MoEOp, QuantizedRows, register_backend
from eagle3.runtime.kernels.torch_ref import TorchBackend
from eagle3.runtime.kernels.triton import (
    act_quant,
    common,
    dense_gemm,
    mla_attention,
    paged_attention,
    rmsnorm,
    rotary,
)
from eagle3.runtime.kernels.triton.linear import TritonLinear
from eagle3.runtime.kernels.triton.moe import TritonMoE
from eagle3.runtime.kernels.triton.plan import TritonAttnPlan, plan_attention


class TritonBackend(TorchBackend):
    """Inherits from the torch reference every op it does not override (below): ``matrix``,
    SiLU / sigmoid, ``cos_sin`` (once per forward; the YaRN math stays in layers/rotary.py) and
    ``write_cache`` (elementwise or copies: a row's bits never depend on the batch); inheriting
    keeps this backend complete whatever the interface gains meanwhile."""

    name = "triton"
    absorb_at_load = True  # a packed kv_b_proj's absorbed matrices decoded once (docs/kernels.md)

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if self.device.type == "cpu" and not common.INTERPRET:
            raise UsageError("kernel backend 'triton' needs a GPU, or TRITON_INTERPRET=1 set before triton is "
                             "imported to run its kernels on the CPU")

    # -- Triton kernels ----------------------------------------------------------------------
    def linear(self) -> LinearOp:
        return TritonLinear()

    def moe(self) -> MoEOp:
        return TritonMoE()

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The router GEMM: a Triton kernel off the CPU (cuBLAS picks its kernel from the whole
        call's shape, so the reference's row tiles are batch invariant only on the CPU), which
        widens narrower operands in registers (the router's bf16 weight and activations: no fp32
        copy per step); on the CPU the reference itself, whose row tiles are exact there (the
        interpreter would only be slower, and the CPU bits stay the reference's)."""
        if x.device.type == "cpu":
            return super().matmul(x, w_t, dtype)
        return dense_gemm.matmul(x, w_t, dtype)

    def bmm(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The MLA absorption products, dispatched as :meth:`matmul`."""
        if x.device.type == "cpu":
            return super().bmm(x, w, dtype)
        return dense_gemm.bmm(x, w, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm.rms_norm(x, weight, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` in one pass."""
        y, summed = rmsnorm.rms_norm(x, weight, eps, residual)
        assert summed is not None
        return y, summed

    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows | None]:
        """The residual add, RMSNorm and the next GEMMs' per-token quantization in one launch
        (``rmsnorm.rms_norm_quant``; without ``quant`` the fused add + norm): the separate ops'
        numbers, bit for bit."""
        if quant in PER_TOKEN_QUANTS and x.dim() == 2:
            y, summed, q, s = rmsnorm.rms_norm_quant(x, weight, eps, quant, residual)
            return y, (x if summed is None else summed), QuantizedRows(quant, q, s)
        if residual is None:
            return self.rms_norm(x, weight, eps), x, None
        y, summed = self.add_rms_norm(x, residual, weight, eps)
        return y, summed, None

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return rotary.apply_rope(x, cos, sin, interleaved)

    def quantize_act(self, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``int8`` / ``fp8`` codes and fp32 scales (for the quantized GEMMs to come)."""
        if kind == "int8":
            return act_quant.quantize_int8_per_token(x)
        if kind == "fp8":
            return act_quant.quantize_fp8_per_token(x)
        raise UsageError(f"unknown per-token activation quantization {kind!r} (int8, fp8)")

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # the kernels read the cache in the model dtype (as on the GPU, so in the interpreter)

    def plan_attention(self, meta: AttnMetadata) -> TritonAttnPlan:
        return plan_attention(meta)

    def fp8_kv_unsupported(self, name: str, dtype: torch.dtype) -> str | None:
        """The kernels load fp8 codes natively; on NVIDIA GPUs Triton converts e4m3 from sm_89 on."""
        dev = self.device
        if dev.type == "cuda" and not getattr(torch.version, "hip", None):
            major, minor = torch.cuda.get_device_capability(dev)
            if (major, minor) < (8, 9):
                return f"{torch.cuda.get_device_name(dev)} is sm_{major}{minor}; Triton's fp8 needs sm_89 or newer"
        return None

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, plan: Any = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        p = plan if isinstance(plan, TritonAttnPlan) else plan_attention(meta)
        t, hkv, g, d = q.shape
        dv = v_cache.shape[-1]
        latent = (hkv == 1 and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
                  and dv <= d)
        if latent:  # MLA: the values are the first kv_lora dims of the cached latent row (one scale)
            if k_scale != v_scale:
                raise UsageError(f"MLA latent cache with two scales ({k_scale}, {v_scale}): the latent has one")
            o = mla_attention.mla_attention(q.view(t, g, d), k_cache[:, 0], dv, p, scale, k_scale)
            return o.view(t, 1, g, dv)
        return paged_attention.paged_attention(q, k_cache, v_cache, p, scale, k_scale, v_scale)


register_backend("triton", TritonBackend)
