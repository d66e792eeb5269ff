"""The teacher signal, from the runtime's own target model (no second target implementation).

For a group of training sequences the target runs once (several sequences per forward, as a
ragged batch over a scratch paged KV cache, exactly how the engine prefills) and returns, per
position:

* the EAGLE-3 aux hidden states of the configured layers in the runtime's convention ("input to
  layer k", concatenated in ascending id order) - what the draft's ``fc`` sees when serving;
* the post-norm hidden state, from which :meth:`Teacher.logits` gives the target's next-token
  logits through the target's own ``lm_head`` when a training batch needs them, for the rows it
  reads labels from. Keeping the hidden (H values per token) instead of the distribution (V values)
  keeps the states small.

:meth:`Teacher.generate` is ``--regenerate``: the prompt's prefill, then greedy decoding one token
per forward over the same KV cache, so the target's own continuation and its states come out of
one pass (a separate generation and teacher pass would prefill every prompt twice). The tokens are
the runtime's greedy tokens (argmax of the target's logits; tests/train check them against
``LLM.generate``).

Nothing is kept here between groups: :mod:`eagle3.train.teacher_cache` writes each group's states
to disk, so memory follows the group, not the data set (at Kimi's size the states are 57 KB per
token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.interfaces import TargetModel, allocate_kv_cache

_BLOCK = 16


@dataclass
class TeacherStates:
    """One sequence's teacher signal: its token ``ids``, ``aux [L, n*H]`` and the post-norm ``hidden [L, H]``."""

    ids: list[int]
    aux: torch.Tensor
    hidden: torch.Tensor


class Teacher:
    def __init__(self, target: TargetModel, aux_layer_ids: Sequence[int]) -> None:
        self.target = target
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.device = torch.device(getattr(getattr(target, "backend", None), "device", "cpu"))

    # -- states of given sequences ------------------------------------------------------------
    @torch.no_grad()
    def states(self, seqs: Sequence[Sequence[int]]) -> list[TeacherStates]:
        """Teacher states of ``seqs`` (one forward for all of them)."""
        kv, tables = self._kv([len(s) for s in seqs])
        hidden, aux = self._forward([list(s) for s in seqs], [0] * len(seqs), tables, kv)
        out, row = [], 0
        for s in seqs:
            n = len(s)
            out.append(TeacherStates(list(s), aux[row: row + n].cpu().clone(), hidden[row: row + n].cpu().clone()))
            row += n
        return out

    # -- greedy continuation + states ---------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new: int, eos: Sequence[int],
                 max_len: int) -> list[TeacherStates]:
        """Each prompt continued greedily by the target (up to ``max_new`` tokens, the first stop
        token included, at most ``max_len`` tokens in all), with the states of every row."""
        stop = set(eos)
        ids = [list(p) for p in prompts]
        limit = [min(len(p) + max_new, max_len) for p in prompts]
        kv, tables = self._kv(limit)
        done = [0] * len(ids)  # rows whose states are computed
        aux_parts: list[list[torch.Tensor]] = [[] for _ in ids]
        hid_parts: list[list[torch.Tensor]] = [[] for _ in ids]
        finished = [len(p) >= lim for p, lim in zip(ids, limit, strict=True)]
        active = list(range(len(ids)))
        while active:
            chunks = [ids[i][done[i]:] for i in active]
            hidden, aux = self._forward(chunks, [done[i] for i in active], [tables[i] for i in active], kv)
            rows = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1  # each sequence's last row
            nxt = self.target.compute_logits(hidden[rows.to(hidden.device)]).argmax(-1).tolist()
            row = 0
            for i, c, tok in zip(active, chunks, nxt, strict=True):
                aux_parts[i].append(aux[row: row + len(c)].cpu())
                hid_parts[i].append(hidden[row: row + len(c)].cpu())
                row += len(c)
                done[i] += len(c)
                if not finished[i]:
                    ids[i].append(int(tok))
                    finished[i] = int(tok) in stop or len(ids[i]) >= limit[i]
            active = [i for i in active if done[i] < len(ids[i])]
        return [TeacherStates(ids[i], torch.cat(aux_parts[i]), torch.cat(hid_parts[i])) for i in range(len(ids))]

    # -- the target ----------------------------------------------------------------------------
    def _kv(self, lengths: Sequence[int]) -> tuple[list[torch.Tensor], list[list[int]]]:
        tables, nb = [], 0
        for n in lengths:
            m = -(-max(n, 1) // _BLOCK)
            tables.append(list(range(nb, nb + m)))
            nb += m
        return allocate_kv_cache(self.target.kv_cache_spec(), self.target.num_layers, nb, _BLOCK,
                                 self.device), tables

    def _forward(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]],
                 kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        meta = build_attn_metadata(tables, starts, [len(c) for c in chunks], _BLOCK, self.device)
        tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        hidden, aux = self.target.forward(tokens, meta, kv, self.aux_layer_ids)
        assert aux is not None
        return hidden, aux

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target next-token logits (float32) of post-norm hidden states ``[..., H]``."""
        shape = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.device)
        return self.target.compute_logits(flat).reshape(*shape, -1)
