"""DeepSeek-V3 / Kimi-K2.x target: MLA attention over a paged latent
cache, dense SwiGLU in the first ``first_k_dense_replace`` layers, MoE after; returns the
post-norm hidden states and the EAGLE-3 aux states ("input to layer k", concatenated in
ascending id order; ``k == num_layers`` is the last layer's output before the final norm)."""

from __future__ import annotations

import torch
from torch import nn

from eagle3.errors import UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.config import TargetSpec
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.interfaces import KVCacheSpec
from eagle3.runtime.kernels.base import KernelBackend
from eagle3.runtime.layers.attention import MLAAttention
from eagle3.runtime.layers.linear import VocabParallelLMHead
from eagle3.runtime.layers.moe import DenseMLP, MoE
from eagle3.runtime.layers.norm import RMSNorm
from eagle3.runtime.layers.rotary import RotaryEmbedding
from eagle3.runtime.parallel import SINGLE, TPGroup


class DecoderLayer(nn.Module):
    def __init__(self, spec: TargetSpec, index: int, rotary: RotaryEmbedding, backend: KernelBackend,
                 name: str, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps, backend)
        self.self_attn = MLAAttention(spec.mla, h, h, rotary, backend, name + ".self_attn", tp)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps, backend)
        self.mlp: nn.Module
        if spec.is_moe_layer(index):
            self.mlp = MoE(h, spec.moe_intermediate_size, spec.n_routed_experts, spec.num_experts_per_tok,
                           spec.n_shared_experts, spec.n_group, spec.topk_group, spec.scoring_func,
                           spec.norm_topk_prob, spec.routed_scaling_factor, backend, name + ".mlp", tp)
        else:
            self.mlp = DenseMLP(h, spec.intermediate_size, backend, name + ".mlp", tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                cache: torch.Tensor, plan: object,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``h + pending`` in, ``(h', mlp_out)`` out: the layer's output is their sum, left to the
        next layer's input norm to form (``pending``), so that each residual add is fused into the
        norm after it, and each norm makes the per-token quantization of the GEMMs it feeds where
        the backend fuses that (:meth:`RMSNorm.add_norm`; the same numbers as separate ops)."""
        x, h, xq = self.input_layernorm.add_norm(h, pending, self.self_attn.token_quant)
        a = self.self_attn(x, cos, sin, meta, cache, plan, xq)
        x, h, xq = self.post_attention_layernorm.add_norm(a, h, self.mlp.token_quant)
        return h, self.mlp(x, xq)


class DeepseekV3Model(nn.Module):
    """The runtime's :class:`~eagle3.runtime.interfaces.TargetModel` for DeepSeek-V3 / Kimi."""

    def __init__(self, spec: TargetSpec, backend: KernelBackend, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.dtype = dtype
        name = kv_cache.canonical(kv_cache_dtype)
        self.kv_format = kv_cache.KVFormat(name, backend.kv_storage(name, dtype))  # refused here, before any weight
        self.num_layers = spec.num_layers
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.rotary = RotaryEmbedding(spec.mla.rope, backend)
        self.register_buffer("embed_tokens", torch.zeros(0, spec.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.rotary, backend, f"{spec.prefix}model.layers.{i}", tp)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.lm_head = VocabParallelLMHead(spec.hidden_size, spec.vocab_size, backend, f"{spec.prefix}lm_head", tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((self.spec.mla.cache_width,), self.kv_format.dtype)

    def kv_scales(self) -> list[float]:
        """Each layer's latent-cache scale (1.0 unless an fp8 cache took the checkpoint's)."""
        return [layer.self_attn.kv_scale for layer in self.layers]

    def set_absorbed(self, absorbed: bool) -> None:
        """Absorbed MLA (default) or the naive per-head expansion (tests)."""
        for layer in self.layers:
            layer.self_attn.absorbed = absorbed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[input_ids]

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv_caches: list[torch.Tensor],
                aux_layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(kv_caches) != self.num_layers:
            raise UsageError(f"target needs {self.num_layers} KV cache tensors, got {len(kv_caches)}")
        want = self._check_aux(aux_layer_ids)
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)
        plan = self.backend.plan_attention(meta)
        aux: list[torch.Tensor] = []
        pending: torch.Tensor | None = None  # the last layer's MLP output, not yet added to h
        for i, layer in enumerate(self.layers):
            if i in want:  # the layer's input itself: the add made here, not in its norm
                if pending is not None:
                    h, pending = h + pending, None
                aux.append(h)
            h, pending = layer(h, cos, sin, meta, kv_caches[i], plan, pending)
        if self.num_layers in want and pending is not None:
            h, pending = h + pending, None
        y, h, _ = self.norm.add_norm(h, pending)
        if self.num_layers in want:
            aux.append(h)
        return y, (torch.cat(aux, dim=-1) if aux_layer_ids else None)

    def _check_aux(self, ids: tuple[int, ...] | None) -> frozenset[int]:
        if not ids:
            return frozenset()
        ids = tuple(ids)
        if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > self.num_layers:
            raise UsageError(f"aux layer ids must be strictly ascending in 0..{self.num_layers}, got {list(ids)}")
        return frozenset(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)
