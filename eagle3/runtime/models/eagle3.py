"""EAGLE-3 / EAGLE-3.1 draft: one decoder layer (Llama MHA or DeepSeek MLA) over
``[input_layernorm(embed(token)), hidden_norm(h)]``.

::

    combine_aux:  A = input_norm(A)                  (norm_before_fc)
                  A = cat(fc_norm_i(chunk_i(A)))     (fc_norm, EAGLE-3.1)
                  g = fc(A)
    forward:      x   = cat(input_layernorm(e), hidden_norm(h))          # embeds first
                  res = hidden_norm(h) if norm_before_residual else h
                  r1  = res + attn(x) ; out = r1 + mlp(post_attention_layernorm(r1))
                  y   = norm(out)
                  next_hidden = y if norm_output else out
    logits:       lm_head(y) * logit_scale  (draft vocab);  target id = d + d2t[d]
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.errors import UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.config import DraftSpec
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.interfaces import KVCacheSpec
from eagle3.runtime.kernels.base import KernelBackend
from eagle3.runtime.layers.attention import MHAAttention, MLAAttention
from eagle3.runtime.layers.linear import Linear
from eagle3.runtime.layers.moe import DenseMLP
from eagle3.runtime.layers.norm import RMSNorm
from eagle3.runtime.layers.rotary import RotaryEmbedding


class Eagle3DraftModel(nn.Module):
    """The runtime's :class:`~eagle3.runtime.interfaces.DraftModel`."""

    num_layers = 1

    def __init__(self, spec: DraftSpec, aux_layer_ids: tuple[int, ...], backend: KernelBackend,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.spec = spec
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.backend = backend
        self.dtype = dtype
        name = kv_cache.canonical(kv_cache_dtype)
        self.kv_format = kv_cache.KVFormat(name, backend.kv_storage(name, dtype))
        self.hidden_size = h = spec.hidden_size
        self.vocab_size = spec.draft_vocab_size
        ht, n = spec.target_hidden_size, spec.num_aux
        eps = spec.rms_norm_eps
        p = spec.layer_prefix
        self.register_buffer("embed_tokens", torch.zeros(0, h))
        self.fc = Linear(n * ht, h, backend, "fc")
        self.input_norm = RMSNorm(n * ht, eps, backend) if spec.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(ht, eps, backend) for _ in range(n)) if spec.fc_norm else None
        self.input_layernorm = RMSNorm(h, eps, backend)
        self.hidden_norm = RMSNorm(h, eps, backend)
        self.post_attention_layernorm = RMSNorm(h, eps, backend)
        self.self_attn: nn.Module
        if spec.attention == "mla":
            assert spec.mla is not None
            self.rotary = RotaryEmbedding(spec.mla.rope, backend)
            self.self_attn = MLAAttention(spec.mla, 2 * h, h, self.rotary, backend, p + "self_attn")
        else:
            assert spec.mha is not None
            self.rotary = RotaryEmbedding(spec.mha.rope, backend)
            self.self_attn = MHAAttention(spec.mha, 2 * h, h, self.rotary, backend, p + "self_attn")
        self.mlp = DenseMLP(h, spec.intermediate_size, backend, p + "mlp")
        self.norm = RMSNorm(h, eps, backend)
        self.lm_head = Linear(h, spec.draft_vocab_size, backend, "lm_head")
        self.register_buffer("d2t", None)

    def kv_cache_spec(self) -> KVCacheSpec:
        s = self.spec
        if s.attention == "mla":
            assert s.mla is not None
            return KVCacheSpec((s.mla.cache_width,), self.kv_format.dtype)
        assert s.mha is not None
        return KVCacheSpec((2, s.mha.num_kv_heads, s.mha.head_dim), self.kv_format.dtype)

    def kv_scales(self) -> tuple[float, float]:
        """The cache's (K, V) scales (the MLA latent's one scale twice); 1.0 unless fp8 took the checkpoint's."""
        a = self.self_attn
        return (a.kv_scale, a.kv_scale) if self.spec.attention == "mla" else a.kv_scales

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        want = self.spec.num_aux * self.spec.target_hidden_size
        if aux.shape[-1] != want:
            raise UsageError(f"draft expects aux states of width {want} ({self.spec.num_aux} x "
                             f"{self.spec.target_hidden_size}), got {aux.shape[-1]}")
        a = aux.to(self.dtype)
        if self.input_norm is not None:
            a = self.input_norm(a)
        if self.fc_norm is not None:
            chunks = a.chunk(self.spec.num_aux, dim=-1)
            a = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(a)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed_tokens[input_ids]
        hidden = hidden.to(self.dtype)
        hn = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(e), hn], dim=-1)
        res = hn if self.spec.norm_before_residual else hidden
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)
        plan = self.backend.plan_attention(meta)
        # each residual add fused into the norm after it (RMSNorm.add_norm: the same numbers)
        xn, r1, xq = self.post_attention_layernorm.add_norm(self.self_attn(x, cos, sin, meta, kv_cache, plan), res,
                                                            self.mlp.token_quant)
        y, out, _ = self.norm.add_norm(self.mlp(xn, xq), r1)
        return y, (y if self.spec.norm_output else out)

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(post_norm).float()
        return logits * self.spec.logit_scale if self.spec.logit_scale != 1.0 else logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        # the map lives with the weights; the ids may come from the host (the proposer's table)
        ids = draft_ids.to(self.d2t.device)
        return (ids + self.d2t[ids]).to(draft_ids.device)
