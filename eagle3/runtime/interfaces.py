"""The contract between the runtime's models (``models/``, ``loader.py``) and its engine
(``engine/``, ``spec/``, ``sampling.py``).

The engine owns the paged KV cache memory, the scheduling and the sampling; a model owns its
weights and the math. They meet in four places, all defined here:

* :class:`KVCacheSpec`: what one cached token of one layer looks like. The engine allocates each
  layer's cache with :func:`allocate_kv_cache` as ``[num_blocks, block_size, *spec.shape]``; a
  model views it as ``[num_blocks * block_size, *spec.shape]`` and indexes it with
  ``AttnMetadata.slot_mapping`` / ``block_tables`` (``eagle3.runtime.context``).
* :class:`TargetModel`: one forward over a ragged batch (prefill chunks, decode, speculative
  verify: the same call) returning the post-norm hidden states and the EAGLE-3 aux states.
* :class:`DraftModel`: ``combine_aux`` (fc over the target's aux states, first draft step only)
  and one draft forward returning ``(post_norm, next_hidden)``.
* :func:`default_aux_layer_ids`: which target layers feed the draft when its config says nothing.

Loading (``eagle3.runtime.loader``)::

    load_target(path, dtype=torch.bfloat16, device="cpu", backend="torch") -> TargetModel
    load_draft(path, target, dtype=None, device=None, backend=None) -> DraftModel  # defaults: target's

Both read every weight format directly (bf16, compressed-tensors INT4, Quark W4A8 / INT4 / MXFP4,
FP8) from the checkpoint files; there is no convert step.

Batch invariance (what the engine's "speculative == plain greedy" invariant rests on): every
model forward returns, for each token, bit-identical results however many other tokens or
sequences share the forward (decode of 1 token, verify of k+1 tokens, prefill chunks). The torch
reference kernels guarantee it by running every reduction with a shape that depends only on the
token itself (fixed row tiles for GEMMs, per-token padded key length for attention), see
``eagle3/runtime/kernels/torch_ref.py``.

Aux-state convention (vLLM's "input to layer k"): aux id ``k`` is the residual stream *entering*
decoder layer ``k`` (= HF ``hidden_states[k]``; ``k == num_layers`` is the output of the last
layer before the final norm). ``aux`` is the concatenation over ascending ids, ``[T, n * H]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from eagle3.formats.detect import default_aux_layer_ids  # noqa: F401 - the one definition, re-exported
from eagle3.runtime.kv_cache import bits

if TYPE_CHECKING:  # pragma: no cover - typing only
    from eagle3.runtime.config import DraftSpec, TargetSpec
    from eagle3.runtime.context import AttnMetadata


class KVCacheSpec(NamedTuple):
    """Per-layer, per-token cache layout. A tuple so that ``shape, dtype = m.kv_cache_spec()``.

    * MLA (target and MLA draft): ``shape = (MLASpec.cache_width,)`` = ``(kv_lora_rank + qk_rope_head_dim,)`` - the
      normalised latent ``c`` followed by the RoPE'd shared key ``k_pe`` (576 for Kimi).
    * MHA (Llama draft): ``shape = (2, num_key_value_heads, head_dim)`` - K then V, K after RoPE.

    ``dtype``: what the cache is stored in (``KernelBackend.kv_storage``: the model dtype, the CPU
    reference's fp32 holding the same bf16-rounded values, or an fp8 dtype holding codes with the
    layers' per-tensor scales, ``eagle3.runtime.kv_cache``).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype


def allocate_kv_cache(spec: KVCacheSpec, num_layers: int, num_blocks: int, block_size: int,
                      device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One zero-filled tensor ``[num_blocks, block_size, *spec.shape]`` per layer.

    Zero-filled (not ``empty``) on purpose: attention multiplies masked-out slots by exactly 0,
    and ``0 * NaN`` from uninitialised memory would poison the result."""
    shape = (num_blocks, block_size, *spec.shape)
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(num_layers)]
    return [_calloc_zeros(shape, spec.dtype) for _ in range(num_layers)]


def _calloc_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory comes from ``calloc`` (numpy's ``zeros``), not a fill: a large
    block is fresh pages that the kernel zeroes only when a block is first written. ``torch.zeros``
    wrote every byte of the default 256 MiB CPU cache at each model load (~0.27 CPU-s, and all of
    it resident) where a short run touches a few blocks."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:  # (torch cannot reinterpret an empty byte buffer)
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def model_device(model: object) -> torch.device:
    """Where a loaded model computes: its kernel backend's device (the models keep their weights as
    buffers, not parameters), else its first parameter's or buffer's, else the CPU. The engine and
    the test helpers put the KV caches and the attention metadata there."""
    dev = getattr(getattr(model, "backend", None), "device", None)
    if dev is not None:
        return torch.device(dev)
    for get in ("parameters", "buffers"):
        for t in getattr(model, get, lambda: iter(()))():
            return t.device
    return torch.device("cpu")


@runtime_checkable
class TargetModel(Protocol):
    """DeepSeek-V3 / Kimi target (``eagle3.runtime.models.deepseek_v3.DeepseekV3Model``)."""

    spec: TargetSpec
    num_layers: int
    vocab_size: int
    hidden_size: int

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv_caches: list[torch.Tensor],
                aux_layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids`` int64 ``[T]`` -> ``(hidden [T, H] after the final norm, aux [T, n*H] | None)``.

        Writes this forward's latents into ``kv_caches[layer]`` at ``meta.slot_mapping`` before
        attending; a query at position ``p`` attends its sequence's positions ``0..p``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> float32 ``[T, vocab_size]``."""
        ...

    def kv_cache_spec(self) -> KVCacheSpec:
        ...


@runtime_checkable
class DraftModel(Protocol):
    """EAGLE-3 / 3.1 draft (``eagle3.runtime.models.eagle3.Eagle3DraftModel``), one decoder layer.

    ``aux_layer_ids`` are the target layers (input-to-layer convention) whose states the draft
    was trained on; pass them to :meth:`TargetModel.forward`."""

    spec: DraftSpec
    aux_layer_ids: tuple[int, ...]
    num_layers: int  # KV cache layers the draft needs (1)
    vocab_size: int  # draft vocab V_d (rows of lm_head)
    hidden_size: int

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """``[T, n*H_t]`` -> ``[T, H]``: norm_before_fc / fc_norm, then ``fc``."""
        ...

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over a ragged batch -> ``(post_norm [T, H], next_hidden [T, H])``.

        ``input_ids`` are *target* ids (the draft embeds with its own or the target's table).
        ``next_hidden`` is the pre-norm layer output (EAGLE-3) or ``post_norm`` (``norm_output``)."""
        ...

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> float32 ``[T, V_d]`` (draft vocab ids)."""
        ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids -> target vocab ids (``d + d2t[d]``; identity without ``d2t``), on the
        device of ``draft_ids`` whichever device the map lives on."""
        ...

    def kv_cache_spec(self) -> KVCacheSpec:
        ...


def compact_tree_kv(kv_caches: Sequence[torch.Tensor], block_table: Sequence[int], block_size: int, start: int,
                    node_ids: Sequence[int]) -> None:
    """After a tree verify (root at ``start``, node ``j`` cached at ``start + j``): move the KV of
    the accepted path's nodes ``node_ids`` (root excluded, in path order) to the chain positions
    ``start + 1 ..``, so the cache reads as if the path had been verified as a chain. Each cache
    is ``[num_blocks, block_size, ...]``; the values are copied as they are (bits kept)."""
    if not node_ids:
        return

    def slots(positions: list[int]) -> torch.Tensor:
        return torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in positions],
                            dtype=torch.int64)

    src = slots([start + int(j) for j in node_ids])
    dst = slots([start + 1 + k for k in range(len(node_ids))])
    for cache in kv_caches:
        flat = bits(cache).view(-1, *cache.shape[2:])  # an fp8 cache's codes as bytes (no float8 index_put)
        rows = flat[src.to(flat.device)]  # gathered first: a source may be another node's destination
        flat[dst.to(flat.device)] = rows
