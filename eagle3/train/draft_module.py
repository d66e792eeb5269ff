"""A trainable EAGLE-3 / 3.1 draft (Llama MHA or DeepSeek MLA) with the runtime draft's math.

The runtime's :class:`~eagle3.runtime.models.eagle3.Eagle3DraftModel` is inference-only: its
Linear layers hold backend ops prepared once at load and its attention reads and writes a paged
KV cache. Training needs autograd and whole sequences at once, so this module re-states the same
forward (runtime/models/eagle3.py) with ``nn.Linear`` / ``nn.Parameter`` weights and plain attention
over in-memory keys. tests/train/test_draft_module.py checks it equal (fp32 logits) to the runtime's
draft run through the runtime on the same checkpoint, for both variants.

Parameter names are the on-disk names of the ``eagle3`` draft profile (``layers.0.*``,
``fc_norm.{i}.weight``), so ``state_dict()`` is what gets written.

Attention in training-time test (:mod:`eagle3.train.ttt`): step 0 runs over every position ``t``
of a sequence (the runtime's step 0 over a committed context); step ``i >= 1`` runs one query per
``t`` at position ``t + i``, which sees the step-0 keys of positions ``<= t`` and its own chain's
keys of steps ``1..i`` (all at index ``t``), exactly what the runtime's chained single-token
draft steps see after a step 0 that ended at position ``t``.

Chains need not start at every ``t``: with ``KVChain.query`` (row indices ``[B, Tq]``) step 0 still
computes keys and values of every position (the context the chains attend), but queries, the
residual and the MLP only for the chains' rows, and the later steps run on those rows alone. The
loss of a long few-shot prompt can so sit on its last problem only, at a cost that grows with the
rows that carry loss rather than with the square of the context (gradients stay exact: the context
rows' outputs were never used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.runtime.config import DraftSpec, RopeSpec
from eagle3.runtime.layers.rotary import compute_inv_freq


class RMSNorm(nn.Module):
    """The runtime's RMSNorm: normalise in fp32, cast back, multiply by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Frequencies from the runtime's :func:`compute_inv_freq`; rotation as the torch reference
    backend does it (interleaved pairs come out in rotate-half order, for queries and keys alike)."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        inv_freq, self.attention_factor = compute_inv_freq(spec)
        self.interleaved = spec.interleaved
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, T, heads, d]``, ``cos/sin [B, T, d/2]``."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@dataclass
class KVChain:
    """Keys/values of the steps run so far: ``[0]`` the step-0 keys of every position (attended
    causally, ``[B, T, heads, d]``), the rest one per later step (attended at the query's own row
    only, ``[B, Tq, heads, d]``). ``query``: the rows ``[B, Tq]`` chains start at (None: every row)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    query: torch.Tensor | None = None


def rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x[b, index[b, j]]`` for ``x [B, T, ...]`` and ``index [B, Tq]`` (``x`` itself when None)."""
    if index is None:
        return x
    idx = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return torch.gather(x, 1, idx)


def chain_attention(q: torch.Tensor, chain: KVChain, scale: float) -> torch.Tensor:
    """``q [B, Tq, H, D]`` over ``chain`` (keys/values already expanded to ``H`` heads) -> ``[B, Tq, H, Dv]``.
    Scores and softmax in fp32, as the runtime's attention."""
    b, tq, h, _ = q.shape
    qf = q.float() * scale
    k0, v0 = chain.keys[0].float(), chain.values[0].float()
    t = k0.shape[1]
    s0 = torch.einsum("bthd,bshd->bhts", qf, k0)
    if chain.query is None:
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    else:  # key s is visible to the chain of row query[b, j] when s <= that row
        causal = (torch.arange(t, device=q.device)[None, None, :] > chain.query[:, :, None])[:, None]
    s0 = s0.masked_fill(causal, float("-inf"))
    diag = [torch.einsum("bthd,bthd->bht", qf, k.float()) for k in chain.keys[1:]]
    scores = torch.cat([s0] + [d[..., None] for d in diag], dim=-1) if diag else s0
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", p[..., :t], v0)
    for j, v in enumerate(chain.values[1:]):
        out = out + p[..., t + j].transpose(1, 2)[..., None] * v.float()
    return out.to(q.dtype)


def _query_rows(x: torch.Tensor, positions: torch.Tensor, chain: KVChain) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 with chain rows: the queries' inputs and positions; later steps: all rows are queries."""
    if chain.keys or chain.query is None:
        return x, positions
    return rows(x, chain.query), rows(positions, chain.query)


class LlamaAttention(nn.Module):
    def __init__(self, spec: DraftSpec) -> None:
        super().__init__()
        assert spec.mha is not None
        m = spec.mha
        self.spec = m
        h2, bias = 2 * spec.hidden_size, m.attention_bias
        self.q_proj = nn.Linear(h2, m.num_heads * m.head_dim, bias=bias)
        self.k_proj = nn.Linear(h2, m.num_kv_heads * m.head_dim, bias=bias)
        self.v_proj = nn.Linear(h2, m.num_kv_heads * m.head_dim, bias=bias)
        self.o_proj = nn.Linear(m.num_heads * m.head_dim, spec.hidden_size, bias=bias)
        self.rotary = Rotary(m.rope)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, chain: KVChain) -> torch.Tensor:
        m = self.spec
        b, t, _ = x.shape
        xq, pq = _query_rows(x, positions, chain)
        tq = xq.shape[1]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        k = self.rotary(self.k_proj(x).view(b, t, m.num_kv_heads, m.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, m.num_kv_heads, m.head_dim)
        cos, sin = self.rotary.cos_sin(pq, x.dtype)
        q = self.rotary(self.q_proj(xq).view(b, tq, m.num_heads, m.head_dim), cos, sin)
        g = m.num_heads // m.num_kv_heads  # query head h reads kv head h // g (the runtime's GQA view)
        chain.keys.append(k.repeat_interleave(g, dim=2))
        chain.values.append(v.repeat_interleave(g, dim=2))
        o = chain_attention(q, chain, m.softmax_scale)
        return self.o_proj(o.reshape(b, tq, m.num_heads * m.head_dim))


class MLAAttention(nn.Module):
    """DeepSeek MLA in its naive (per-head expanded) form; the runtime's absorbed form is the same
    product reassociated."""

    def __init__(self, spec: DraftSpec) -> None:
        super().__init__()
        assert spec.mla is not None
        m = spec.mla
        self.spec = m
        h2, nh = 2 * spec.hidden_size, m.num_heads
        if m.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(h2, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.latent_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, nh * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h2, nh * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.latent_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * m.v_head_dim, spec.hidden_size, bias=False)
        self.rotary = Rotary(m.rope)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, chain: KVChain) -> torch.Tensor:
        m = self.spec
        b, t, _ = x.shape
        nh = m.num_heads
        xq, pq = _query_rows(x, positions, chain)
        tq = xq.shape[1]
        if m.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(xq)))
        else:
            q = self.q_proj(xq)
        q_nope, q_pe = q.view(b, tq, nh, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, nh, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        k_pe = self.rotary(k_pe[:, :, None, :], cos, sin).expand(b, t, nh, m.qk_rope_head_dim)
        cos, sin = self.rotary.cos_sin(pq, x.dtype)
        q_pe = self.rotary(q_pe, cos, sin)
        chain.keys.append(torch.cat([k_nope, k_pe], dim=-1))
        chain.values.append(v)
        o = chain_attention(torch.cat([q_nope, q_pe], dim=-1), chain, m.softmax_scale)
        return self.o_proj(o.reshape(b, tq, nh * m.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, spec: DraftSpec) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn: nn.Module = MLAAttention(spec) if spec.attention == "mla" else LlamaAttention(spec)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, spec.intermediate_size, spec.mlp_bias)


class TrainableDraft(nn.Module):
    """The EAGLE-3 / 3.1 draft of ``spec`` (a runtime :class:`DraftSpec`), trainable."""

    def __init__(self, spec: DraftSpec) -> None:
        super().__init__()
        if spec.draft_vocab_size != spec.vocab_size and not spec.has_d2t:
            raise ValueError("a reduced draft vocabulary needs d2t")
        self.spec = spec
        h, ht, n, eps = spec.hidden_size, spec.target_hidden_size, spec.num_aux, spec.rms_norm_eps
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.input_norm = RMSNorm(n * ht, eps) if spec.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(ht, eps) for _ in range(n)) if spec.fc_norm else None
        self.layers = nn.ModuleList([DraftLayer(spec)])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., n * H_t]`` -> ``[..., H]`` (norm_before_fc, fc_norm, fc)."""
        a = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            a = self.input_norm(a)
        if self.fc_norm is not None:
            chunks = a.chunk(self.spec.num_aux, dim=-1)
            a = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(a)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             chain: KVChain) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over ``[B, T]`` tokens (target ids) -> ``(post_norm, next_hidden)``, both
        ``[B, T, H]`` (``[B, Tq, H]``, the chains' rows, at step 0 with ``chain.query``); appends
        this step's keys/values to ``chain``."""
        layer = self.layers[0]
        e = self.embed_tokens(input_ids)
        hidden = hidden.to(e.dtype)
        hn = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(e), hn], dim=-1)
        res = hn if self.spec.norm_before_residual else hidden
        if not chain.keys:
            res = rows(res, chain.query)
        r1 = res + layer.self_attn(x, positions, chain)
        out = r1 + layer.mlp(layer.post_attention_layernorm(r1))
        y = self.norm(out)
        return y, (y if self.spec.norm_output else out)

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(post_norm).float()
        return logits * self.spec.logit_scale if self.spec.logit_scale != 1.0 else logits


def load_trainable(path: Path, target_embed: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[TrainableDraft, torch.Tensor | None]:
    """The draft checkpoint at ``path`` (any format the runtime reads whose tensor names are the
    ``layers.0.*`` canonical ones, e.g. the eagle3 profile) as a trainable module, plus its ``d2t``.
    A draft without ``embed_tokens`` takes ``target_embed`` (the target's table, as engines do)."""
    from eagle3.checkpoint import CheckpointReader
    from eagle3.errors import CheckpointError
    from eagle3.formats import keys
    from eagle3.runtime.loader import draft_spec

    spec = draft_spec(path)
    model = TrainableDraft(spec).to(dtype)
    reader = CheckpointReader(path)
    state = {}
    for name in model.state_dict():
        if name in reader:
            state[name] = reader.get(name).to(dtype)
        elif name == keys.DRAFT_EMBED and target_embed is not None:
            state[name] = target_embed.to(dtype)
        else:
            raise CheckpointError(f"{path}: missing tensor {name!r} (trainable drafts read the layers.0.* names)")
    model.load_state_dict(state)
    d2t = reader.get(keys.D2T).to(torch.int64) if keys.D2T in reader and spec.has_d2t else None
    return model, d2t
