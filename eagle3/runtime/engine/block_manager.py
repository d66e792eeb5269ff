"""Paged KV cache bookkeeping: a free list of fixed-size blocks and one block table per sequence.

The target's cache and the draft's cache are separate tensors with the same number of blocks;
a sequence's block table indexes both (SGLang shares ``req_to_token`` between its target and draft
pools the same way), so one allocation covers the target's latent cache and the draft's MHA or
latent cache. The slot of position ``p`` is ``block_table[p // block_size] * block_size +
p % block_size``.

There is no prefix caching, so blocks have no reference counts: a block belongs to exactly one
sequence, which keeps rollback trivial (free whole tail blocks past the committed length).
"""

from __future__ import annotations

from collections import deque

from eagle3.runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """Extra blocks ``seq`` needs so that positions ``0 .. num_slots - 1`` have a slot."""
        return max(0, self.blocks_for(num_slots) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_slots: int) -> bool:
        return self.blocks_needed(seq, num_slots) <= len(self._free)

    def allocate(self, seq: Sequence, num_slots: int) -> None:
        n = self.blocks_needed(seq, num_slots)
        assert n <= len(self._free), "allocate() without can_allocate()"
        for _ in range(n):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def trim(self, seq: Sequence, num_slots: int) -> None:
        """Release the blocks past those holding positions ``0 .. num_slots - 1``."""
        keep = self.blocks_for(num_slots)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        while seq.block_table:
            self._release(seq.block_table.pop())

    def _release(self, block: int) -> None:
        assert block in self._used, f"double free of KV block {block}"
        self._used.remove(block)
        self._free.append(block)
