"""EAGLE-3 tree drafting: the draft model grows a :class:`~eagle3.runtime.spec.tree.TreeBuilder`
tree with tree attention (the engine calls it through :class:`TreeDrafting`, docs/trees.md).

Input: the draft's state after step 0 (the chain proposer's step 0, which runs over the committed
positions): per sequence the root row's ``post_norm`` / ``next_hidden`` at draft position
``root_pos``. Then, per draft step ``s = 1 .. S-1``, the K frontier nodes (depth ``s``) run as one
ragged forward: input = the node's token with its parent's ``next_hidden`` (the root's for depth
1), RoPE position ``root_pos + s``, and tree attention over the committed context plus the
frontier nodes of earlier steps that are its ancestors. The frontier nodes of step ``s`` are cached
at draft positions ``root_pos + 1 + (s-1) K + j`` (a region after the root, in step order), so the
draft cache needs ``(S-1) K`` slots past the root (a chain needs ``S-1``). With K = 1 this is the
chain proposer's argmax chain, bit for bit (a chain's tree mask is the causal mask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.runtime.context import TreeMask
from eagle3.runtime.interfaces import DraftModel
from eagle3.runtime.spec.engine_view import DraftingConfig
from eagle3.runtime.spec.tree import DraftTree, TreeBuilder

# One draft-tree step: (target ids [T], hidden [T, H], block_tables, cache starts, counts, RoPE
# positions int64 [T] on the host, tree mask) -> (post_norm [T, H], next_hidden [T, H]). The
# engine's is ModelRunner.forward_draft_tree (a CUDA graph replay when the step fits one).
TreeStepFn = Callable[[torch.Tensor, torch.Tensor, Sequence[Sequence[int]], Sequence[int], Sequence[int],
                       torch.Tensor, TreeMask], tuple[torch.Tensor, torch.Tensor]]


def _row_of(cands: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """For candidate ids ``wanted [B, K]``: their index in ``cands [B, R]`` (-1 where absent)."""
    if cands.shape[1] == 0:
        return torch.full_like(wanted, -1)
    hit = cands[:, None, :] == wanted[:, :, None]  # [B, K, R]
    return torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), -1)


def _grow_ancestors(anc: torch.Tensor, parent_rows: torch.Tensor) -> torch.Tensor:
    """Region ancestor mask ``[B, R, R]`` plus K new nodes whose parents sit at region rows
    ``parent_rows [B, K]`` (-1: the root, outside the region) -> ``[B, R+K, R+K]``."""
    b, r, _ = anc.shape
    k = parent_rows.shape[1]
    out = torch.zeros(b, r + k, r + k, dtype=torch.bool, device=anc.device)
    out[:, :r, :r] = anc
    rows = anc.gather(1, parent_rows.clamp_min(0)[:, :, None].expand(b, k, r)) if r else anc.new_zeros(b, k, 0)
    out[:, r:, :r] = rows & (parent_rows >= 0)[:, :, None]
    out[:, r:, r:] = torch.eye(k, dtype=torch.bool, device=anc.device)
    return out


def draft_tree(draft: DraftModel, step: TreeStepFn, root_tokens: torch.Tensor,
               root_post: torch.Tensor, root_next: torch.Tensor, root_pos: Sequence[int],
               block_tables: Sequence[Sequence[int]], topk: int, steps: int, num_nodes: int,
               target_vocab_size: int | None = None) -> DraftTree:
    """Draft ``B`` trees (EAGLE-2 selection over ``steps`` draft steps, ``num_nodes`` nodes with
    the root). ``root_tokens`` int64 [B] (target ids), ``root_post`` / ``root_next`` [B, H].
    Tokens come back as target ids. ``target_vocab_size``: also keep every expanded node's draft
    distribution, over the target vocabulary (``DraftTree.draft_probs``)."""
    b = root_tokens.shape[0]
    dev = root_post.device
    d2t = draft.to_target_ids(torch.arange(draft.vocab_size, device=dev)).to(torch.int64)
    builder = TreeBuilder(root_tokens, topk, keep_probs=target_vocab_size is not None)
    tok = builder.expand(draft.compute_logits(root_post).float().log_softmax(-1)[:, None])  # [B, K] draft ids
    k = tok.shape[1]
    hidden = root_next[:, None, :].expand(b, k, root_next.shape[-1])  # each frontier node's parent state
    region = torch.empty(b, 0, dtype=torch.int64, device=dev)  # candidate ids of the cached frontier nodes
    anc = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)
    for s in range(1, steps):
        frontier = builder.frontier
        anc = _grow_ancestors(anc, _row_of(region, builder.frontier_parents()))
        r = region.shape[1]
        region = torch.cat([region, frontier], 1)
        positions = torch.tensor([p + s for p in root_pos for _ in range(k)], dtype=torch.int64)
        post, nxt = step(d2t[tok].reshape(-1), hidden.reshape(b * k, -1), block_tables,
                         [p + 1 + r for p in root_pos], [k] * b, positions, TreeMask([r + k] * b, anc))
        logp = draft.compute_logits(post).float().log_softmax(-1).view(b, k, -1)
        tok = builder.expand(logp)
        rows = _row_of(frontier, builder.frontier_parents())  # new frontier's parents: rows of this step
        hidden = nxt.view(b, k, -1).gather(1, rows[:, :, None].expand(b, k, nxt.shape[-1]))
    tree = builder.build(num_nodes)
    tree.tokens = torch.cat([tree.tokens[:, :1], d2t[tree.tokens[:, 1:]]], 1)
    if tree.draft_probs is not None and target_vocab_size is not None:
        full = tree.draft_probs.new_zeros(*tree.draft_probs.shape[:2], target_vocab_size)
        full[..., d2t] = tree.draft_probs
        tree.draft_probs = full
    return tree


@dataclass
class TreeDrafting:
    """The engine's tree settings and forwards (``EagleProposer(tree=...)``): after step 0 each
    drafting sequence gets a tree of ``num_nodes`` nodes from ``steps`` draft steps, proposed as
    its ``num_nodes - 1`` node tokens with their parents. Children are the draft's top-K: they are
    verified as point masses (no ``q`` is kept). The shape is read from the engine's one config
    (``speculative_eagle_topk``, ``num_speculative_tokens``, ``speculative_num_draft_tokens``)."""

    config: DraftingConfig  # the engine's EngineConfig
    step: TreeStepFn

    @property
    def topk(self) -> int:
        return self._tree[0]

    @property
    def steps(self) -> int:
        return self.config.max_k

    @property
    def num_nodes(self) -> int:
        return self._tree[1]

    @property
    def _tree(self) -> tuple[int, int]:
        tree = self.config.tree
        assert tree is not None, "TreeDrafting needs speculative_eagle_topk > 1"
        return tree

    def propose(self, draft: DraftModel, roots: torch.Tensor, post: torch.Tensor, nxt: torch.Tensor,
                root_pos: Sequence[int], seqs: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
        """Per drafting sequence (``seqs``: their block tables): (node tokens, parents)."""
        tree = draft_tree(draft, self.step, roots, post, nxt, root_pos, [s.block_table for s in seqs],
                          self.topk, self.steps, self.num_nodes)
        return list(zip(tree.tokens[:, 1:].tolist(), tree.parents.tolist(), strict=True))
