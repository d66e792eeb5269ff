"""Draft trees: EAGLE-2's dynamic tree selection and the tensor helpers tree verification needs.

Knobs (SGLang's names): ``topk = K`` (``speculative_eagle_topk``), ``steps = S``
(``num_speculative_tokens``), ``num_nodes = N`` (``speculative_num_draft_tokens``, root included).

The tree grows from a *root*, the last committed token (its KV is not in the target's cache yet,
exactly like row 0 of a chain verify). Every candidate node has a score, the cumulative draft
log-probability of its root-to-node path:

* step 0: the root's draft distribution gives its top-K tokens, the K depth-1 candidates; they
  are the first *frontier*;
* step s >= 1: each of the K frontier nodes is expanded by its top-K tokens (K*K candidates,
  ``score = parent score + log q(token)``); the K best of them form the next frontier;
* after S steps the best N-1 candidates over all steps become the tree, plus the root.

A log-probability is <= 0, so a child never scores above its parent; ranking by score with ties
broken by creation order (a parent is always created before its children) therefore puts every
parent ahead of its children, and the best N-1 candidates are closed under "parent of": they
form a tree. ``K = 1`` gives the top-1 chain of S tokens (with ``N - 1 >= S``).

A :class:`DraftTree` lists its nodes in creation order, which is topological (``parents[i] < i``)
and by depth. Trees of a batch share one width N; a shorter tree is padded at the end with nodes
whose parent is -1 (only node 0 is a root).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.errors import ShapeError, UsageError


@dataclass
class DraftTree:
    """``B`` draft trees of ``N`` nodes each (node 0: the root; padding: parent -1 at the end)."""

    parents: torch.Tensor  # int64 [B, N]: parent node, -1 for the root (and padding)
    tokens: torch.Tensor  # int64 [B, N]: the node's token (node 0: the root token)
    depth: torch.Tensor  # int64 [B, N]: 0 for the root (and padding)
    scores: torch.Tensor  # float32 [B, N]: cumulative draft log-prob of the path (root: 0)
    # float32 [B, N, V]: the distribution a node's children were chosen from (zero rows for nodes
    # never expanded), or None when not kept. See tree_rejection for which verifier uses it.
    draft_probs: torch.Tensor | None = None

    @property
    def num_nodes(self) -> torch.Tensor:
        """int64 [B]: real nodes per tree (root included)."""
        return node_valid(self.parents).sum(-1)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0


def node_valid(parents: torch.Tensor) -> torch.Tensor:
    """bool [..., N]: the root and every node with a parent (padding is the rest)."""
    n = parents.shape[-1]
    return (parents >= 0) | (torch.arange(n, device=parents.device) == 0)


def check_parents(parents: torch.Tensor) -> None:
    """UsageError unless every tree of ``parents [B, N]`` is a root at 0 followed by nodes whose
    parent comes before them, then padding (parent -1) only."""
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise ShapeError(f"tree parents must be [B, N] with N >= 1, got {list(parents.shape)}")
    idx = torch.arange(parents.shape[1], device=parents.device)
    if bool((parents[:, 0] != -1).any()):
        raise UsageError("node 0 of a draft tree must be the root (parent -1)")
    if bool((parents >= idx).any()) or bool((parents < -1).any()):
        raise UsageError("a draft tree node's parent must come before it (parents[i] < i)")
    pad = parents[:, 1:] < 0
    if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
        raise UsageError("draft tree padding (parent -1) must come after every real node")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """int64 [B, N] depth of every node (root and padding 0); nodes are topological, so one pass."""
    d = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        d[:, i] = torch.where(p >= 0, d.gather(1, p.clamp_min(0)[:, None]).squeeze(1) + 1, 0)
    return d


def tree_kv_slots(topk: int, steps: int, num_nodes: int) -> int:
    """KV slots a tree step may write past a sequence's last token: the verify's ``num_nodes``
    nodes after the root, or the draft's region of ``(steps - 1) * topk`` frontier nodes after an
    accepted path of up to ``steps`` tokens, whichever reaches further."""
    return max(num_nodes - 1, steps + (steps - 1) * topk)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool [B, N, N]: ``mask[b, i, j]`` iff node j is node i or one of its ancestors: the keys of
    the tree that node i's query may see (tree attention). Padding rows see only themselves."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    rows = torch.arange(b, device=parents.device)
    for i in range(1, n):  # row i = row of its parent + itself (parents come first)
        p = parents[:, i]
        has = p >= 0
        mask[:, i] |= mask[rows, p.clamp_min(0)] & has[:, None]
    return mask


def tree_positions(depth: torch.Tensor, root_position: torch.Tensor) -> torch.Tensor:
    """int64 [B, N] absolute positions (RoPE) of the nodes: the root's position plus the depth.
    Siblings share a position; the cache slot of node i is its own (see AttnMetadata.tree)."""
    return root_position.to(torch.int64)[:, None] + depth


def children(parents: torch.Tensor, max_children: int | None = None) -> torch.Tensor:
    """int64 [B, N, C]: the children of every node in node order, -1 padded. ``C`` is the largest
    number of children any node has (at least 1), or ``max_children``."""
    b, n = parents.shape
    is_child = parents[:, None, :] == torch.arange(n, device=parents.device)[None, :, None]  # [B, N(parent), N]
    count = is_child.sum(-1)
    c = max(int(count.max()) if count.numel() else 0, 1) if max_children is None else max_children
    # Stable sort puts the children (True) first, in node order.
    order = torch.sort(is_child.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :c]
    slot = torch.arange(c, device=parents.device)
    return torch.where(slot < count[..., None], order, -1)


def path(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root to ``node`` of one tree ``parents [N]``."""
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Root-to-leaf node paths of one tree ``parents [N]`` (padding excluded), leaves in node order."""
    valid = node_valid(parents[None])[0]
    has_child = torch.zeros_like(valid)
    has_child[parents[parents >= 0]] = True
    return [path(parents, i) for i in range(parents.shape[0]) if bool(valid[i]) and not bool(has_child[i])]


class TreeBuilder:
    """EAGLE-2's dynamic tree, built one draft step at a time (see the module docstring).

    The caller runs the draft: step 0 on the roots, then each step on the frontier returned by the
    previous :meth:`expand` (its tokens, at depth = step, parents given by :meth:`frontier_parents`),
    feeding back the draft's log-probabilities. :func:`build_tree` runs it over given distributions.
    """

    def __init__(self, root_tokens: torch.Tensor, topk: int, keep_probs: bool = False) -> None:
        if topk < 1:
            raise UsageError(f"speculative_eagle_topk must be >= 1, got {topk}")
        self.k = topk
        self.root_tokens = root_tokens.to(torch.int64)
        self.keep_probs = keep_probs
        b, dev = root_tokens.shape[0], root_tokens.device
        # Candidates in creation order (index c); parent -1 = the root.
        self.tokens = torch.empty(b, 0, dtype=torch.int64, device=dev)
        self.scores = torch.empty(b, 0, dtype=torch.float32, device=dev)
        self.parents = torch.empty(b, 0, dtype=torch.int64, device=dev)
        self.frontier = torch.full((b, 1), -1, dtype=torch.int64, device=dev)  # candidate ids (-1: root)
        self.expanded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (candidate ids [B, F], probs [B, F, V])

    @property
    def steps(self) -> int:
        return len(self.expanded)

    def expand(self, logprobs: torch.Tensor) -> torch.Tensor:
        """One draft step. ``logprobs`` float32 [B, F, V]: the draft's log-distribution at each node
        of the current frontier (F = 1 at step 0: the root). Returns the next frontier's tokens
        int64 [B, K] (best first); :attr:`frontier` holds their candidate ids."""
        b, f, v = logprobs.shape
        if f != self.frontier.shape[1]:
            raise ShapeError(f"expected log-probs for {self.frontier.shape[1]} frontier nodes, got {f}")
        k = min(self.k, v)
        logprobs = logprobs.float().clamp_max(0.0)  # a log-prob is <= 0: keeps children below parents
        if self.keep_probs:
            self.expanded.append((self.frontier, logprobs.exp()))
        else:
            self.expanded.append((self.frontier, logprobs.new_empty(0)))
        top_lp, top_tok = logprobs.topk(k, dim=-1)  # [B, F, K], best first
        parent_score = self._score(self.frontier)  # [B, F]
        new_scores = (parent_score[:, :, None] + top_lp).reshape(b, f * k)
        first = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, top_tok.reshape(b, f * k)], 1)
        self.scores = torch.cat([self.scores, new_scores], 1)
        self.parents = torch.cat([self.parents, self.frontier.repeat_interleave(k, dim=1)], 1)
        best = _rank(new_scores)[:, :k]  # ties: earlier candidate first
        self.frontier = best + first
        return self.tokens.gather(1, self.frontier)

    def frontier_parents(self) -> torch.Tensor:
        """Candidate id of each frontier node's parent (-1: the root), int64 [B, K]."""
        return self.parents.gather(1, self.frontier)

    def _score(self, cand: torch.Tensor) -> torch.Tensor:
        if self.scores.shape[1] == 0:
            return torch.zeros(cand.shape, dtype=torch.float32, device=cand.device)
        return torch.where(cand >= 0, self.scores.gather(1, cand.clamp_min(0)), 0.0)

    def build(self, num_nodes: int) -> DraftTree:
        """The best ``num_nodes - 1`` candidates (all of them if fewer) and the root, in creation
        order (topological, depth-ascending)."""
        if num_nodes < 1:
            raise UsageError(f"speculative_num_draft_tokens must be >= 1, got {num_nodes}")
        b, c = self.tokens.shape
        keep = min(num_nodes - 1, c)
        chosen = _rank(self.scores)[:, :keep].sort(dim=-1).values  # [B, keep] candidate ids, creation order
        dev = self.tokens.device
        node_of = torch.full((b, c), -1, dtype=torch.int64, device=dev)  # candidate id -> tree node
        node_of.scatter_(1, chosen, torch.arange(1, keep + 1, device=dev).expand(b, keep))
        cand_parent = self.parents.gather(1, chosen)
        parents = torch.where(cand_parent >= 0, node_of.gather(1, cand_parent.clamp_min(0)), 0)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), parents], 1)
        tokens = torch.cat([self.root_tokens[:, None], self.tokens.gather(1, chosen)], 1)
        scores = torch.cat([torch.zeros(b, 1, device=dev), self.scores.gather(1, chosen)], 1)
        return DraftTree(parents, tokens, depths(parents), scores, self._probs(node_of, keep + 1))

    def _probs(self, node_of: torch.Tensor, n: int) -> torch.Tensor | None:
        """[B, n, V] draft distribution of every expanded tree node (zero rows elsewhere)."""
        if not self.keep_probs or not self.expanded:
            return None
        b = node_of.shape[0]
        v = self.expanded[0][1].shape[-1]
        out = torch.zeros(b, n, v, dtype=torch.float32, device=node_of.device)
        rows = torch.arange(b, device=node_of.device)[:, None]
        for cand, probs in self.expanded:
            node = torch.where(cand >= 0, node_of.gather(1, cand.clamp_min(0)), 0)  # root -> node 0
            present = node >= 0  # an expanded candidate may have been left out of the tree
            out[rows.expand_as(node)[present], node[present]] = probs[present]
        return out


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """Candidate ids by descending score, ties in creation order (a stable sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def build_tree(root_tokens: torch.Tensor, step_logprobs: list[torch.Tensor], topk: int, num_nodes: int,
               keep_probs: bool = False) -> DraftTree:
    """EAGLE-2 selection over given per-step draft log-distributions: ``step_logprobs[0]`` is
    [B, 1, V] (the root), ``step_logprobs[s]`` [B, K, V] for the frontier of step s, row j for the
    j-th frontier node as :meth:`TreeBuilder.expand` returned it (best first)."""
    builder = TreeBuilder(root_tokens, topk, keep_probs)
    for lp in step_logprobs:
        builder.expand(lp)
    return builder.build(num_nodes)
