"""Per-forward attention metadata, shared by every model and attention kernel.

One layout serves prefill (chunks included), decode and multi-token speculative verification: a
forward is a ragged batch of query tokens, grouped per sequence, each at a known absolute
position. Query token at position ``p`` attends to the cached keys at positions ``0..p`` of its own
sequence, so "causal" needs no separate prefill/decode modes (draft trees are the exception: see
:class:`TreeMask`). New keys/values are written into the paged cache at ``slot_mapping`` *before*
attention reads the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TreeMask:
    """Tree verification / tree drafting: the last ``num_nodes[b]`` cache positions of sequence
    ``b`` hold the nodes of a draft tree in node order (``num_nodes[b] == 0``: no tree): node ``j``
    at cache position ``context_lens[b] - num_nodes[b] + j``.

    The last ``m = min(num_nodes[b], query tokens of b)`` query tokens are the last ``m`` nodes
    (a verify: every node, root first; a draft step: the new frontier, whose ancestors were cached
    by earlier steps). Their ``positions`` (RoPE) are the root's position plus their depth. Node
    ``i``'s query sees the cache positions before the tree and the nodes ``j`` with
    ``ancestors[b, i, j]`` (its ancestors and itself, ``spec.tree.ancestor_mask``), nothing else.
    Query tokens of the sequence before the tree are ordinary causal ones.

    The backends reduce a node's keys as the same token's in a chain (its root-to-node path run
    causally): the context, then its ancestors in depth order at the *virtual* positions ``start,
    start + 1, ..``, itself at ``start + depth``, in the chain's key tiles. So a node's output is its
    chain's bit for bit and does not depend on the tree's other nodes."""

    num_nodes: list[int]  # [B] on the host
    ancestors: torch.Tensor  # bool [B, N, N], N >= max(num_nodes); rows/cols past num_nodes[b] unused


def pack_tree_paths(paths: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Tree queries, given by their paths (the cache positions of their ancestors and themselves in
    depth order; parents listed before children), packed greedily into groups of at most ``size``
    that each lie on one root-to-node path, every query an ancestor of the next. Returns indices
    into ``paths``. The attention kernels share one key map per group of query rows: the deepest
    query's path serves the whole group, the shallower ones masking past their own depth."""
    groups: list[list[int]] = []
    open_groups: dict[int, int] = {}  # cache position of a group's deepest node -> group index
    for i, path in enumerate(paths):
        j = open_groups.pop(path[-2], None) if len(path) > 1 else None
        if j is None:
            j = len(groups)
            groups.append([])
        groups[j].append(i)
        if len(groups[j]) < size:
            open_groups[path[-1]] = j
    return groups


@dataclass
class AttnMetadata:
    positions: torch.Tensor  # int64 [T]: absolute position of each query token
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: query tokens of sequence b are [cu[b], cu[b+1])
    context_lens: torch.Tensor  # int32 [B]: KV length of each sequence once these tokens are written
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # int32 [B, max_blocks]: physical block ids, -1 padded
    block_size: int
    # cu_seqlens_q on the host when the builder has it (no device -> host copy per forward; under
    # CUDA-graph capture such a copy is not allowed at all).
    host_cu: list[int] | None = None
    # Device tensors derived from host-side fields (e.g. the Triton plan's chunk list), kept for the
    # forwards that reuse this metadata: a graph's warm-up run fills it, its capture finds them.
    # None: no caching (ordinary per-step metadata).
    cache: dict[Any, Any] | None = None
    # Draft-tree attention for some sequences (see TreeMask); None: every query is causal by position.
    # The torch reference and the Triton kernels (up to 64 tree nodes) implement it.
    tree: TreeMask | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
