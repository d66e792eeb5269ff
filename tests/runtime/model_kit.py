"""Shared helpers for the runtime model tests: a minimal paged-KV bookkeeper that builds
``AttnMetadata`` the way the engine does (block tables with scattered physical blocks), and
forwards over token chunks."""

from __future__ import annotations

import random

import torch

from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.interfaces import allocate_kv_cache


class PagedKV:
    """Per-sequence block tables over one pool; ``step`` schedules ``{seq: tokens}`` and returns
    (input_ids, meta). Physical blocks are handed out in a shuffled order so that any confusion
    between logical and physical blocks shows up."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0, num_layers: int | None = None):
        shape, dtype = model.kv_cache_spec()
        self.block_size = block_size
        self.caches = allocate_kv_cache(model.kv_cache_spec(), num_layers or model.num_layers, num_blocks, block_size)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def step(self, batch: dict[object, list[int]], start: dict[object, int] | None = None) -> tuple[torch.Tensor, AttnMetadata]:
        """Schedule ``batch[seq]`` new tokens per sequence (positions continue from the committed
        length, or from ``start[seq]`` to overwrite, as after a rejection)."""
        ids, pos, slots, cu, ctx = [], [], [], [0], []
        for sid, toks in batch.items():
            table = self.tables.setdefault(sid, [])
            p0 = (start or {}).get(sid, self.lens.get(sid, 0))
            for j, tok in enumerate(toks):
                p = p0 + j
                while p // self.block_size >= len(table):
                    table.append(self.free.pop())
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[sid] = p0 + len(toks)
            cu.append(cu[-1] + len(toks))
            ctx.append(self.lens[sid])
        width = max(len(self.tables[s]) for s in batch)
        bt = torch.full((len(batch), width), -1, dtype=torch.int32)
        for b, sid in enumerate(batch):
            bt[b, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        meta = AttnMetadata(positions=torch.tensor(pos, dtype=torch.int64),
                            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                            context_lens=torch.tensor(ctx, dtype=torch.int32),
                            slot_mapping=torch.tensor(slots, dtype=torch.int64),
                            block_tables=bt, block_size=self.block_size)
        return torch.tensor(ids, dtype=torch.int64), meta
