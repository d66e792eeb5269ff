"""Verification of draft trees against the target: greedy and lossless (recursive) rejection sampling.

The tree generalisation of :mod:`eagle3.runtime.spec.rejection` (same notation: ``p`` the target
distribution after temperature / top-k / top-p, ``q`` the draft's). The walk starts at the root
with ``p`` = the target's distribution at the root and tries the node's children in node order:

* child ``x`` is accepted with probability ``min(1, p(x) / q(x))``; then emit ``x``, move to the
  child and start again with the target's ``p`` there (and the child's own ``q``);
* on rejection ``p <- norm(max(p - q, 0))``. The next sibling was drawn from ``q`` *without
  replacement*, so it comes from ``q`` with ``x`` removed: ``q(x) <- 0``, renormalised;
* when every child is rejected, emit a token from the residual ``p`` and stop; at a leaf (or a node
  without children) emit the *bonus* token from ``p`` and stop.

Each rejection step emits exactly what the remaining ``p`` asks for, whatever the child proposed,
so the emitted tokens are distributed as if sampled from the target one by one.

``draft_probs=None`` is the point-mass case (the children were chosen deterministically, e.g.
EAGLE-2's top-K): child ``x`` has ``q = one_hot(x)``, so it is accepted with probability
``p(x)`` and rejected tokens are removed from ``p``. This is the exact verifier for trees from
:class:`~eagle3.runtime.spec.tree.TreeBuilder`; the ``q`` form is exact only for trees whose
children were *sampled* from ``q`` without replacement, in node order.

Greedy rows follow the child whose token is the target's argmax at its parent, as long as one
exists, and emit the argmax at the node where they stop. A chain (one child per node) gives the
chain sampler's results bit for bit, random numbers included: ``N - 1`` uniforms (one per non-root
node, used when that node is tried) and ``V`` exponentials per non-greedy request.

Output: the accepted tokens along the path then the recovered / bonus token, ``[B, D + 1]`` padded
with -1 (``D`` the deepest tree's depth), and the accepted path's node ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.runtime.sampling import SamplingBatch, draw_uniform, logits_to_probs, sample_from_weights
from eagle3.runtime.spec.rejection import PLACEHOLDER, _residual, _select
from eagle3.runtime.spec.tree import DraftTree, children, node_valid


@dataclass
class TreeVerifyOutput:
    token_ids: torch.Tensor  # int64 [B, D+1]: accepted drafts then the recovered / bonus token, -1 padded
    num_accepted: torch.Tensor  # int64 [B]
    node_ids: torch.Tensor  # int64 [B, D]: tree node of each accepted draft, -1 padded

    def rows(self) -> list[list[int]]:
        """Emitted tokens per request (accepted drafts + one recovered/bonus token)."""
        ids = self.token_ids.tolist()
        return [r[: int(a) + 1] for r, a in zip(ids, self.num_accepted.tolist(), strict=True)]

    @property
    def last_node(self) -> torch.Tensor:
        """int64 [B]: the node the walk stopped at (0: the root, nothing accepted)."""
        if self.node_ids.shape[1] == 0:
            return torch.zeros_like(self.num_accepted)
        last = self.node_ids.gather(1, (self.num_accepted - 1).clamp_min(0)[:, None]).squeeze(1)
        return torch.where(self.num_accepted > 0, last, 0)


@dataclass
class _Walk:
    """Where each row's walk is: the current node, still walking, and what it accepted so far."""

    cur: torch.Tensor  # int64 [B]
    alive: torch.Tensor  # bool [B]
    num_acc: torch.Tensor  # int64 [B]
    nodes: torch.Tensor  # int64 [B, D]

    @classmethod
    def start(cls, b: int, d: int, device: torch.device) -> _Walk:
        return cls(torch.zeros(b, dtype=torch.int64, device=device), torch.ones(b, dtype=torch.bool, device=device),
                   torch.zeros(b, dtype=torch.int64, device=device),
                   torch.full((b, d), PLACEHOLDER, dtype=torch.int64, device=device))

    def advance(self, accepted: torch.Tensor, child: torch.Tensor, depth: int) -> None:
        """Rows with ``accepted`` move to ``child``; the others stop where they are."""
        self.nodes[:, depth] = torch.where(accepted, child, PLACEHOLDER)
        self.num_acc = self.num_acc + accepted.to(torch.int64)
        self.cur = torch.where(accepted, child, self.cur)
        self.alive = self.alive & accepted


def tree_rejection_sample(target_logits: torch.Tensor, tree: DraftTree, batch: SamplingBatch,
                          draft_probs: torch.Tensor | None = None,
                          generator: torch.Generator | None = None) -> TreeVerifyOutput:
    """Verify ``B`` draft trees of ``N`` nodes (padded trees allowed, see tree.DraftTree).

    Args:
      target_logits: float32 ``[B, N, V]``; row ``i`` is the target's prediction for the token
        after node ``i`` (its root-to-node path appended to the committed context).
      tree: parents and tokens (target vocabulary) of the trees, on any device (walked on the
        logits' device).
      batch: one sampling row per request.
      draft_probs: float32 ``[B, N, V]``: row ``i`` the distribution node ``i``'s children were
        sampled from without replacement, or None for point-mass children (see the module
        docstring). Only used on non-greedy rows.
      generator: the engine's generator for rows without their own.
    """
    b, n, v = target_logits.shape
    # The engine's trees are host structure (scheduler lists; the step's attention metadata is
    # built from them there): their shape (depth, children) is read where they are, without a
    # device sync, and the index tensors the walk needs go where the logits are. (On a GPU a host
    # tree failed every tree step: "indices should be either on cpu or on the same device".)
    d = tree.max_depth
    dev = target_logits.device
    kids = children(torch.where(node_valid(tree.parents), tree.parents, -1)).to(dev)  # [B, N, C]
    tokens = tree.tokens.to(dev).clamp(0, v - 1)
    walk = _walk_greedy(target_logits.argmax(dim=-1), kids, tokens, d)
    final = target_logits.argmax(dim=-1).gather(1, walk.cur[:, None]).squeeze(1)

    stochastic = ~batch.greedy
    if bool(stochastic.any()):
        idx = stochastic.nonzero().squeeze(1)
        walk_s, final_s = _walk_stochastic(
            target_logits[idx], kids[idx], tokens[idx], d, _select(batch, idx),
            None if draft_probs is None else draft_probs[idx], generator)
        for name in ("cur", "num_acc", "nodes"):
            getattr(walk, name)[idx] = getattr(walk_s, name)
        final = final.clone()
        final[idx] = final_s

    node_tok = tokens.gather(1, walk.nodes.clamp_min(0))
    out = torch.full((b, d + 1), PLACEHOLDER, dtype=torch.int64, device=target_logits.device)
    out[:, :d] = torch.where(walk.nodes >= 0, node_tok, PLACEHOLDER)
    out.scatter_(1, walk.num_acc[:, None], final[:, None])
    return TreeVerifyOutput(out, walk.num_acc, walk.nodes)


def _child(kids: torch.Tensor, cur: torch.Tensor, j: int) -> torch.Tensor:
    """int64 [B]: the j-th child of each row's current node (-1: none)."""
    return kids[torch.arange(kids.shape[0], device=kids.device), cur, j]


def _walk_greedy(argmax: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, d: int) -> _Walk:
    """Follow the child equal to the target's argmax at its parent (children hold distinct tokens
    in a drafted tree; the first match wins otherwise)."""
    b = argmax.shape[0]
    walk = _Walk.start(b, d, argmax.device)
    for depth in range(d):
        want = argmax.gather(1, walk.cur[:, None]).squeeze(1)
        hit = torch.zeros(b, dtype=torch.bool, device=argmax.device)
        nxt = walk.cur
        for j in range(kids.shape[-1]):
            child = _child(kids, walk.cur, j)
            match = walk.alive & ~hit & (child >= 0) & (tokens.gather(1, child.clamp_min(0)[:, None]).squeeze(1) == want)
            nxt = torch.where(match, child, nxt)
            hit = hit | match
        walk.advance(hit, nxt, depth)
    return walk


def _walk_stochastic(logits: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, d: int, batch: SamplingBatch,
                     draft_probs: torch.Tensor | None, generator: torch.Generator | None
                     ) -> tuple[_Walk, torch.Tensor]:
    b, n, v = logits.shape
    rows = SamplingBatch(batch.temperature.repeat_interleave(n), batch.top_k.repeat_interleave(n),
                         batch.top_p.repeat_interleave(n), batch.greedy.repeat_interleave(n), [])
    p = logits_to_probs(logits.reshape(b * n, v), rows).view(b, n, v)  # [B, N, V]
    u = draw_uniform(n - 1, batch.generators, generator, logits.device)  # [B, N-1]: node i uses u[:, i-1]
    walk = _Walk.start(b, d, logits.device)
    weights = p[:, 0].clone()  # where each row stops: its residual, or the bonus distribution
    for depth in range(d + 1):
        w, accepted, nxt = _try_children(p, walk, kids, tokens, u, draft_probs)
        stop = walk.alive & ~accepted
        weights = torch.where(stop[:, None], w, weights)
        if depth == d:
            break
        walk.advance(accepted, nxt, depth)
        if not bool(walk.alive.any()):
            break
    return walk, sample_from_weights(weights, batch.generators, generator)


def _try_children(p: torch.Tensor, walk: _Walk, kids: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor,
                  draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One node of the walk: try its children in order. Returns (the residual ``p`` after the
    rejections, unnormalised; the target's ``p`` if no child was tried), accepted, the accepted child."""
    b, _, v = p.shape
    ar = torch.arange(b, device=p.device)
    w = p[ar, walk.cur]  # [B, V] the remaining target distribution, unnormalised ...
    mass = torch.ones(b, device=p.device)  # ... and its mass (exactly 1 before any rejection, as in the chain)
    q = None if draft_probs is None else draft_probs[ar, walk.cur]
    accepted = torch.zeros(b, dtype=torch.bool, device=p.device)
    nxt = walk.cur
    for j in range(kids.shape[-1]):
        child = _child(kids, walk.cur, j)
        tried = walk.alive & ~accepted & (child >= 0)
        if not bool(tried.any()):
            break
        safe = child.clamp_min(1)
        x = tokens.gather(1, safe[:, None])  # [B, 1]
        q_row = torch.zeros_like(w).scatter_(1, x, 1.0) if q is None else q
        q_x = q_row.gather(1, x).squeeze(1)
        u_x = u.gather(1, (safe - 1)[:, None]).squeeze(1)
        # p(x) / mass >= u * q(x), without a division; q(x) == 0: the child cannot have been drawn.
        acc = tried & (q_x > 0) & (w.gather(1, x).squeeze(1) >= u_x * q_x * mass)
        nxt = torch.where(acc, child, nxt)
        accepted = accepted | acc
        rej = tried & ~acc
        resid = _residual(w, q_row * mass[:, None])  # max(p - q, 0) in w's scale
        # p == q on the support makes the residual vanish; the rejection then had probability 0.
        resid = torch.where((resid.sum(-1) <= 0)[:, None], w, resid)
        w = torch.where(rej[:, None], resid, w)
        mass = torch.where(rej, w.sum(-1), mass)
        if q is not None:  # the next sibling was drawn from q without x
            q = torch.where(rej[:, None], _without(q, x), q)
    return w, accepted, nxt


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``q [B, V]`` conditioned on not drawing ``x [B, 1]``: ``q(x) <- 0``, renormalised (all
    zeros when ``x`` held all the mass: no further sibling can have been drawn)."""
    q_wo = q.scatter(1, x, 0.0)
    total = q_wo.sum(-1, keepdim=True)
    return torch.where(total > 0, q_wo / total.clamp_min(1e-30), 0.0)
