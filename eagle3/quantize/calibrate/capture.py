"""Calibration tokens through the source model one decoder layer at a time, with the runtime's layers.

Nothing holds the model: :class:`SourceLayers` reads one decoder layer's tensors into the runtime's
own torch modules (:class:`eagle3.runtime.models.deepseek_v3.DecoderLayer`, loaded by the runtime
loader's per-layer function), runs it, and drops it. Between layers only the hidden states of
the calibration tokens are kept (:class:`TokenStream`: ``tokens x hidden`` in the model dtype), so
memory is bounded by one layer's weights plus the tokens' states, whatever the depth, and the
numerics are those the runtime serves (same modules, same kernels, same dtype; each sequence's
attention reads a KV cache of that one layer).

Per layer the caller gets the MLP's input ``x`` for every token (after attention and the
post-attention norm) and, in an MoE layer, the router's choice for every token
(:meth:`SourceLayers.route`): what the calibrated solvers need. :func:`routed_tokens` groups the
tokens by expert (each expert sees exactly the tokens whose top-k includes it, as in the forward).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3.formats import keys
from eagle3.runtime.config import TargetSpec
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.kernels.base import LinearWeight, dequantize
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.layers.rotary import RotaryEmbedding
from eagle3.runtime.loader import _load_target_layer, target_spec
from eagle3.runtime.models.deepseek_v3 import DecoderLayer
from eagle3.runtime.weights import WeightReader

CPU = torch.device("cpu")
BLOCK_SIZE = 16  # KV-cache block of the per-layer attention (any size gives the same bits)
ATTN_BATCH_TOKENS = 4096  # sequences are run through attention together up to this many tokens
MLP_CHUNK_TOKENS = 4096  # tokens per MLP call (the runtime's results do not depend on the chunking)


@dataclass(frozen=True)
class AttnBatch:
    """Whole sequences run through one layer's attention together: tokens ``t0 .. t1`` of the flat
    token order, their metadata and the number of KV blocks they need."""

    t0: int
    t1: int
    meta: AttnMetadata
    num_blocks: int


class TokenStream:
    """The calibration sequences laid out flat (sequence after sequence) and cut into attention
    batches; the hidden states themselves are plain ``[T, H]`` tensors the caller passes along."""

    def __init__(self, sequences: Sequence[Sequence[int]], batch_tokens: int = ATTN_BATCH_TOKENS,
                 block_size: int = BLOCK_SIZE) -> None:
        self.sequences = [list(s) for s in sequences]
        self.ids = torch.tensor([t for s in self.sequences for t in s], dtype=torch.int64)
        self.block_size = block_size
        self.batches: list[AttnBatch] = []
        group: list[int] = []
        t0 = 0
        for i, s in enumerate(self.sequences):
            if group and sum(len(self.sequences[j]) for j in group) + len(s) > batch_tokens:
                self.batches.append(self._batch(group, t0))
                t0 += sum(len(self.sequences[j]) for j in group)
                group = []
            group.append(i)
        if group:
            self.batches.append(self._batch(group, t0))

    def _batch(self, group: list[int], t0: int) -> AttnBatch:
        tables, counts, nb = [], [], 0
        for j in group:
            n = len(self.sequences[j])
            blocks = -(-n // self.block_size)
            tables.append(list(range(nb, nb + blocks)))
            counts.append(n)
            nb += blocks
        meta = build_attn_metadata(tables, [0] * len(group), counts, self.block_size, CPU)
        return AttnBatch(t0, t0 + sum(counts), meta, nb)

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


class SourceLayers:
    """A target checkpoint read one decoder layer at a time into the runtime's torch modules."""

    def __init__(self, path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> None:
        self.path = path
        self.spec: TargetSpec = target_spec(path)
        self.dtype = dtype
        self.backend = get_backend("torch", CPU)
        self.reader = WeightReader(path, self.spec.quant, dtype, CPU)
        self.rotary = RotaryEmbedding(self.spec.mla.rope, self.backend)
        self.kv_dtype = self.backend.kv_storage("auto", dtype)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def prefix(self, i: int) -> str:
        """Tensor-name prefix of decoder layer ``i`` (checkpoint naming)."""
        return f"{self.spec.prefix}model.layers.{i}."

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` [T] (only those rows are read: a full-size vocabulary's
        table is 2.3 GB), in the model dtype, as ``DeepseekV3Model.embed``."""
        name = f"{self.spec.prefix}{keys.TARGET_EMBED}"
        uniq = torch.unique(ids)
        rows = torch.empty(uniq.numel(), self.spec.hidden_size, dtype=self.dtype)
        u = uniq.tolist()
        i = 0
        while i < len(u):  # contiguous runs of ids: one read each
            j = i
            while j + 1 < len(u) and u[j + 1] == u[j] + 1:
                j += 1
            rows[i: j + 1] = self.reader.reader.get_rows(name, u[i], u[j] + 1).to(self.dtype)
            i = j + 1
        return rows[torch.searchsorted(uniq, ids)]

    def load(self, i: int) -> DecoderLayer:
        """Decoder layer ``i`` with the source's weights, as the runtime loads it (the same module
        and loader function as ``load_target``, for this one layer)."""
        layer = DecoderLayer(self.spec, i, self.rotary, self.backend, f"{self.spec.prefix}model.layers.{i}")
        with torch.no_grad():
            _load_target_layer(self.reader, layer, self.prefix(i))
        layer.eval()
        return layer

    def linear(self, module: str) -> LinearWeight:
        """A Linear's canonical weight as the runtime reads it."""
        return self.reader.linear(module)[0]

    def dense(self, module: str) -> torch.Tensor:
        """A Linear's weight as the runtime computes with it (model dtype), e.g. for a smoothing
        check; solvers take the fp32 source values from :mod:`eagle3.quantize.sources` instead."""
        return dequantize(self.linear(module), self.dtype)

    @torch.no_grad()
    def attention(self, layer: DecoderLayer, stream: TokenStream, h: torch.Tensor) -> torch.Tensor:
        """``h + self_attn(input_layernorm(h))`` for every token: the first half of
        ``DecoderLayer.forward``, batch by batch, each batch over a fresh cache of this layer."""
        out = torch.empty_like(h)
        width = self.spec.mla.cache_width
        for b in stream.batches:
            cache = torch.zeros(b.num_blocks, stream.block_size, width, dtype=self.kv_dtype)
            cos, sin = self.rotary.cos_sin(b.meta.positions, self.dtype)
            plan = self.backend.plan_attention(b.meta)
            hb = h[b.t0: b.t1]
            out[b.t0: b.t1] = hb + layer.self_attn(layer.input_layernorm(hb), cos, sin, b.meta, cache, plan)
        return out

    @torch.no_grad()
    def mlp_input(self, layer: DecoderLayer, h_attn: torch.Tensor) -> torch.Tensor:
        """``post_attention_layernorm`` of the attention's output: what every MLP weight reads."""
        return _chunked(layer.post_attention_layernorm, h_attn)

    @torch.no_grad()
    def mlp(self, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output (``mlp`` the layer's, or one rebuilt with quantized weights)."""
        return _chunked(mlp, x)

    @torch.no_grad()
    def route(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor | None:
        """The router's top-k expert ids ``[T, k]`` for MLP inputs ``x`` (None in a dense layer)."""
        if not isinstance(layer.mlp, MoE):
            return None
        mlp = layer.mlp
        return torch.cat([mlp.route(x[t: t + MLP_CHUNK_TOKENS])[0] for t in range(0, x.shape[0], MLP_CHUNK_TOKENS)])


def _chunked(fn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= MLP_CHUNK_TOKENS:
        return fn(x)
    return torch.cat([fn(x[t: t + MLP_CHUNK_TOKENS]) for t in range(0, x.shape[0], MLP_CHUNK_TOKENS)])


def routed_tokens(ids: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    """Per expert, the (ascending) indices of the tokens whose top-k ``ids`` [T, k] include it."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tok = order // k
    out, s = [], 0
    for e in range(num_experts):
        out.append(tok[s: s + counts[e]])
        s += counts[e]
    return out
