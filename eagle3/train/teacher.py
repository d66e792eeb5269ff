"""The teacher signal, from the runtime's own target model (no second target implementation).

For every training sequence the target runs once (several sequences per forward, as a ragged
batch over a scratch paged KV cache, exactly how the engine prefills) and returns, per position:

* the EAGLE-3 aux hidden states of the configured layers in the runtime's convention ("input to
  layer k", concatenated in ascending id order) - what the draft's ``fc`` sees when serving;
* the post-norm hidden state, from which :meth:`Teacher.logits` gives the target's next-token
  logits through the target's own ``lm_head`` when a training batch needs them. Keeping the
  hidden (H values per token) instead of the distribution (V values) keeps the cache small.

The cache lives in memory in the target's dtype: fine for the tiny and small targets this runs on
(a real-size Kimi would need an on-disk cache: 57 KB per token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.interfaces import TargetModel, allocate_kv_cache

_BLOCK = 16


@dataclass
class TeacherStates:
    """One sequence's teacher signal: ``aux [L, n*H]`` and ``hidden [L, H]`` (post-norm)."""

    aux: torch.Tensor
    hidden: torch.Tensor


class Teacher:
    def __init__(self, target: TargetModel, aux_layer_ids: Sequence[int], max_batch_tokens: int = 4096) -> None:
        self.target = target
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.max_batch_tokens = max_batch_tokens
        self.device = torch.device(getattr(getattr(target, "backend", None), "device", "cpu"))

    def run(self, seqs: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None) -> list[TeacherStates]:
        """Teacher states of every sequence (in order), batching up to ``max_batch_tokens`` tokens."""
        out: list[TeacherStates] = []
        batch: list[Sequence[int]] = []
        tokens = 0
        for s in seqs:
            if batch and tokens + len(s) > self.max_batch_tokens:
                out += self._forward(batch)
                if progress:
                    progress(len(batch))
                batch, tokens = [], 0
            batch.append(s)
            tokens += len(s)
        if batch:
            out += self._forward(batch)
            if progress:
                progress(len(batch))
        return out

    @torch.no_grad()
    def _forward(self, seqs: list[Sequence[int]]) -> list[TeacherStates]:
        tables, nb = [], 0
        for s in seqs:
            n = -(-len(s) // _BLOCK)
            tables.append(list(range(nb, nb + n)))
            nb += n
        kv = allocate_kv_cache(self.target.kv_cache_spec(), self.target.num_layers, nb, _BLOCK, self.device)
        meta = build_attn_metadata(tables, [0] * len(seqs), [len(s) for s in seqs], _BLOCK, self.device)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=self.device)
        hidden, aux = self.target.forward(ids, meta, kv, self.aux_layer_ids)
        assert aux is not None
        out, row = [], 0
        for s in seqs:
            # kept in host memory (the whole data set's states; a GPU holds the models)
            out.append(TeacherStates(aux[row: row + len(s)].cpu().clone(), hidden[row: row + len(s)].cpu().clone()))
            row += len(s)
        return out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target next-token logits (float32) of post-norm hidden states ``[..., H]``."""
        shape = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.device)
        return self.target.compute_logits(flat).reshape(*shape, -1)
