"""Attention over the paged KV cache: DeepSeek MLA (latent cache, absorbed form) and Llama MHA.

MLA (DeepSeek-V3). Per token and layer the cache holds ``[c (kv_lora, after
kv_a_layernorm), k_pe (qk_rope, after RoPE)]``. The absorbed form folds ``kv_b_proj`` into the
query and the output::

    q_abs[h] = W_UK[h]^T q_nope[h]        (W_UK = kv_b.view(nh, dn+dv, rkv)[:, :dn])
    o_lat[h] = softmax((q_abs[h].c + q_pe[h].k_pe) * scale) . c
    o[h]     = W_UV[h] o_lat[h]            (W_UV = kv_b.view(nh, dn+dv, rkv)[:, dn:])

which is the attention of ``nh`` query heads over one shared 576-wide key (MQA), so prefill,
decode and multi-token verify are one call. The naive form (``absorbed=False``) expands the whole
cache through ``kv_b_proj`` into per-head keys and values; it exists for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from eagle3.errors import ShapeError, UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.config import MHASpec, MLASpec
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.kernels.base import (
    ActQuant,
    DenseWeight,
    KernelBackend,
    LinearWeight,
    QuantizedRows,
    concat_out_features,
    dequantize,
    weight_tensors,
    weight_to,
)
from eagle3.runtime.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, Shard
from eagle3.runtime.layers.norm import RMSNorm
from eagle3.runtime.layers.rotary import RotaryEmbedding
from eagle3.runtime.parallel import SINGLE, TPGroup


def _zeros_view(*shape: int) -> torch.Tensor:
    """Zeros of ``shape`` that hold one element (a broadcast view): a placeholder never computed with."""
    return torch.zeros(()).expand(*shape)


class MLAAttention(nn.Module):
    """MLA over the paged latent cache. Tensor parallel by heads: this rank holds ``spec.num_heads
    / tp.world`` of them (q_b / q and kv_b rows, o_proj input columns; q_a / kv_a replicated) and
    returns the attention output summed over the ranks."""

    def __init__(self, spec: MLASpec, in_dim: int, out_dim: int, rotary: RotaryEmbedding, backend: KernelBackend,
                 name: str = "", tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if spec.num_heads % tp.world:
            raise UsageError(f"{name}: {spec.num_heads} attention heads do not split over "
                             f"tensor_parallel_size={tp.world}")
        full_heads = spec.num_heads
        spec = dataclasses.replace(spec, num_heads=full_heads // tp.world)  # this rank's heads
        self.spec = spec
        self.tp = tp
        self.backend = backend
        self.rotary = rotary
        self.name = name
        nh, dqk = spec.num_heads, spec.qk_head_dim
        if spec.q_lora_rank is not None:
            self.q_a_proj = Linear(in_dim, spec.q_lora_rank, backend, name + ".q_a_proj")
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.latent_norm_eps, backend)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, full_heads * dqk, backend, name + ".q_b_proj",
                                                 tp, unit=dqk)
        else:
            self.q_proj = ColumnParallelLinear(in_dim, full_heads * dqk, backend, name + ".q_proj", tp, unit=dqk)
        # kv_b_proj is absorbed (not a Linear): this rank's heads' rows of it.
        self.kv_b_shard = Shard.of_rows(tp, full_heads * (spec.qk_nope_head_dim + spec.v_head_dim),
                                        spec.qk_nope_head_dim + spec.v_head_dim)
        self.kv_a_proj_with_mqa = Linear(in_dim, spec.cache_width, backend,
                                         name + ".kv_a_proj_with_mqa")
        # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM when their formats agree
        # (vLLM's fused_qkv_a_proj); `load_a` decides.
        self.fused_a: Linear | None = None
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, spec.latent_norm_eps, backend)
        self.o_proj = RowParallelLinear(full_heads * spec.v_head_dim, out_dim, backend, name + ".o_proj", tp,
                                        unit=spec.v_head_dim)
        # Placeholders until load_kv_b replaces them: zeros of the right shape as one broadcast
        # element. Allocated in full, every layer's were zeroed at construction before any was
        # loaded: 2 GB of host memory for Kimi-K2.5 (61 layers x 64 heads, fp32), 14 MB for the tiny
        # target (a load of it measured 0.36 -> 0.26 CPU-s, medians of loads alternating in one
        # process; less where freed pages are reused).
        self.register_buffer("w_uk", _zeros_view(nh, spec.qk_nope_head_dim, spec.kv_lora_rank))  # [nh, dn, rkv]
        self.register_buffer("w_uv_t", _zeros_view(nh, spec.kv_lora_rank, spec.v_head_dim))  # [nh, rkv, dv]
        # A quantized kv_b_proj stays packed and the two absorbed matrices are decoded from it per
        # call, unless the backend decodes them once at load (KernelBackend.absorb_at_load).
        self.kv_b_packed: LinearWeight | None = None
        self.dtype = torch.float32
        self.absorbed = True
        # The latent cache's per-tensor scale (an fp8 cache; runtime/kv_cache.py): set by the loader
        # from the checkpoint's kv scales, 1.0 otherwise.
        self.kv_scale = 1.0

    def load_a(self, q_a: LinearWeight, act_q: ActQuant, kv_a: LinearWeight, act_kv: ActQuant, dtype: torch.dtype,
               device: torch.device) -> None:
        """Load ``q_a_proj`` and ``kv_a_proj_with_mqa`` (fused into one GEMM when possible)."""
        s = self.spec
        if type(q_a) is type(kv_a) and act_q == act_kv and s.q_lora_rank is not None:
            try:
                fused = concat_out_features([q_a, kv_a])
            except Exception:
                fused = None
            if fused is not None and fused.shape[1] == self.kv_a_proj_with_mqa.in_features:
                self.fused_a = Linear(fused.shape[1], fused.shape[0], self.backend, self.name + ".q_a+kv_a")
                self.fused_a.load(fused, act_q, dtype, device)
                del self.q_a_proj, self.kv_a_proj_with_mqa
                return
        self.q_a_proj.load(q_a, act_q, dtype, device)
        self.kv_a_proj_with_mqa.load(kv_a, act_kv, dtype, device)

    def load_kv_b(self, weight: LinearWeight, dtype: torch.dtype, device: torch.device) -> None:
        """``kv_b_proj`` is absorbed: a dense one is kept as its two per-head matrices (the same
        values, one copy, in the model dtype); a quantized one stays packed and the matrices are
        decoded from it per call (:meth:`absorbed_matrices`), or once here when the backend says
        so (``absorb_at_load``: the Triton decode step then reads them as they are; the same
        bits, the packed copy dropped)."""
        s = self.spec
        want = (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        if tuple(weight.shape) != want:
            raise ShapeError(f"{self.name}.kv_b_proj: weight is {list(weight.shape)}, expected {list(want)}")
        self.dtype = dtype
        if isinstance(weight, DenseWeight):
            self.kv_b_packed = None
            self.w_uk, self.w_uv_t = self._split(dequantize(weight, dtype).to(device))
        elif self.backend.absorb_at_load:
            self.kv_b_packed = None
            self.w_uk, self.w_uv_t = self._split(dequantize(weight_to(weight, device), dtype))  # as per call
        else:
            self.kv_b_packed = weight_to(weight, device)
            self.w_uk = self.w_uv_t = None

    def _split(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, be = self.spec, self.backend
        per_head = w.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return (be.matrix(per_head[:, : s.qk_nope_head_dim], self.dtype),
                be.matrix(per_head[:, s.qk_nope_head_dim:].transpose(1, 2), self.dtype))

    def absorbed_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``w_uk [nh, dn, rkv]``, ``w_uv_t [nh, rkv, dv]``), decoded per call when kv_b is packed."""
        if self.kv_b_packed is None:
            assert self.w_uk is not None and self.w_uv_t is not None
            return self.w_uk, self.w_uv_t
        return self._split(dequantize(self.kv_b_packed, self.dtype))

    def kv_b_matrix(self) -> torch.Tensor:
        """The whole ``kv_b_proj`` weight ``[nh * (dn + dv), rkv]`` (naive form), rebuilt per call."""
        w_uk, w_uv_t = self.absorbed_matrices()
        return torch.cat([w_uk, w_uv_t.transpose(1, 2)], dim=1).reshape(-1, self.spec.kv_lora_rank)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors kept besides the registered buffers and the Linear sub-modules (the packed kv_b)."""
        return [] if self.kv_b_packed is None else weight_tensors(self.kv_b_packed)

    @property
    def token_quant(self) -> str | None:
        """The per-token quantization of the layer's input (its first projection's), if any: the
        norm in front makes it when its backend fuses the two (:meth:`RMSNorm.add_norm`)."""
        first = (self.fused_a if self.fused_a is not None
                 else getattr(self, "q_a_proj" if self.spec.q_lora_rank is not None else "q_proj"))
        return first.token_quant

    def _q_b(self, qa: torch.Tensor) -> torch.Tensor:
        """``q_b_proj(q_a_layernorm(qa))``, the norm making q_b's per-token quantization where fused."""
        qn, _, qq = self.q_a_layernorm.add_norm(qa, None, self.q_b_proj.token_quant)
        return self.q_b_proj(qn, qq)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                cache: torch.Tensor, plan: Any = None, xq: QuantizedRows | None = None) -> torch.Tensor:
        """``xq``: ``x``'s per-token quantization made by the norm in front (:attr:`token_quant`)."""
        s, be = self.spec, self.backend
        t, nh = x.shape[0], s.num_heads
        if self.fused_a is not None:
            qa, ckv = self.fused_a(x, xq).split([s.q_lora_rank, self.spec.cache_width], dim=-1)
            q = self._q_b(qa)
        elif s.q_lora_rank is not None:
            q = self._q_b(self.q_a_proj(x, xq))
            ckv = self.kv_a_proj_with_mqa(x, xq)
        else:
            q = self.q_proj(x, xq)
            ckv = self.kv_a_proj_with_mqa(x, xq)
        q = q.view(t, nh, s.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c, k_pe = ckv.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        # one rotation for the nh query heads and the shared key
        pe = self.rotary(torch.cat([q_pe, k_pe[:, None, :]], dim=1), cos, sin)
        q_pe, k_pe = pe[:, :nh], pe[:, nh]
        flat = cache.view(-1, self.spec.cache_width)
        # rounded to the model dtype here, whatever dtype the backend stores the cache in (fp8: then
        # quantized with the layer's scale)
        sc = self.kv_scale
        be.write_cache(flat, meta.slot_mapping, torch.cat([c, k_pe], dim=-1).to(x.dtype), sc)
        if self.absorbed:
            w_uk, w_uv_t = self.absorbed_matrices()
            q_abs = be.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, nh, rkv]
            q_lat = torch.cat([q_abs, q_pe], dim=-1).view(t, 1, nh, self.spec.cache_width)
            o_lat = be.attention(q_lat, flat[:, None, :], flat[:, None, : s.kv_lora_rank], meta, s.softmax_scale, plan,
                                 k_scale=sc, v_scale=sc)
            o = be.bmm(o_lat.view(t, nh, s.kv_lora_rank).transpose(0, 1), w_uv_t).transpose(0, 1)
        else:
            o = self._naive(q_nope, q_pe, flat, meta, plan)
        return self.tp.reduce(self.o_proj(o.reshape(t, nh * s.v_head_dim)))

    def _naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, flat: torch.Tensor, meta: AttnMetadata,
               plan: Any) -> torch.Tensor:
        """Expand every cached latent into per-head keys/values (the prefill form: one K/V per head, then ordinary attention)."""
        s, be = self.spec, self.backend
        t, nh = q_nope.shape[0], s.num_heads
        if kv_cache.is_fp8(flat.dtype):  # this test-only form expands the cache: its values first
            flat = kv_cache.dequantize(flat, self.kv_scale, q_nope.dtype)
        kv = be.matmul(flat[:, : s.kv_lora_rank].contiguous(), self.kv_b_matrix().t()).view(-1, nh, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k_pe = flat[:, None, s.kv_lora_rank:].expand(-1, nh, s.qk_rope_head_dim)
        k = torch.cat([k_nope, k_pe], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).view(t, nh, 1, s.qk_head_dim)
        o = be.attention(q, k, v.contiguous(), meta, s.softmax_scale, plan)
        return o.view(t, nh, s.v_head_dim)


class MHAAttention(nn.Module):
    """Llama attention (GQA, NeoX RoPE) over a paged ``[slots, 2, kv_heads, head_dim]`` cache."""

    def __init__(self, spec: MHASpec, in_dim: int, out_dim: int, rotary: RotaryEmbedding, backend: KernelBackend,
                 name: str = "") -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.rotary = rotary
        nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.sizes = [nq, nkv, nkv]
        self.qkv_proj = Linear(in_dim, nq + 2 * nkv, backend, name + ".qkv_proj")
        self.o_proj = Linear(nq, out_dim, backend, name + ".o_proj")
        self.kv_scales = (1.0, 1.0)  # K and V scales of an fp8 cache (runtime/kv_cache.py), set by the loader

    def load(self, q: LinearWeight, k: LinearWeight, v: LinearWeight, o: LinearWeight, act_qkv: ActQuant,
             act_o: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.qkv_proj.load(concat_out_features([q, k, v]), act_qkv, dtype, device)
        self.o_proj.load(o, act_o, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                cache: torch.Tensor, plan: Any = None) -> torch.Tensor:
        s, be = self.spec, self.backend
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.rotary(q.view(t, s.num_heads, s.head_dim), cos, sin)
        k = self.rotary(k.view(t, s.num_kv_heads, s.head_dim), cos, sin)
        flat = cache.view(-1, 2, s.num_kv_heads, s.head_dim)
        kv = torch.stack([k, v.view(t, s.num_kv_heads, s.head_dim)], dim=1).to(x.dtype)  # the model dtype's values
        ks, vs = self.kv_scales
        be.write_cache(flat, meta.slot_mapping, kv, (ks, vs))
        g = s.num_heads // s.num_kv_heads
        o = be.attention(q.view(t, s.num_kv_heads, g, s.head_dim), flat[:, 0], flat[:, 1], meta, s.softmax_scale, plan,
                         k_scale=ks, v_scale=vs)
        return self.o_proj(o.reshape(t, s.num_heads * s.head_dim))
