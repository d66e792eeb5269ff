"""EAGLE-3 / 3.1 chain proposer: k draft steps per target step (top-1 chain).

Step 0 runs the draft over every position the target step committed, pairing the target's aux
state at position ``p`` (through ``fc``, :meth:`DraftModel.combine_aux`) with token ``p + 1`` (the
inputs shifted left by one, the newly sampled token last), at draft position ``p``. That writes the
draft's KV for the whole committed context, so the draft cache always holds "true" entries for
positions ``0 .. num_computed_tokens - 1``, like the target's. The last row's logits give the
first draft token. Steps ``1 .. k-1`` each feed one token: the previous draft token (a target id)
with the previous step's ``next_hidden`` (pre-norm for EAGLE-3, post-norm for EAGLE-3.1
``norm_output``; the model decides), one position further. Their KV is speculative and is
overwritten by the next step 0 before anything reads it.

Drafts are sampled from the draft distribution ``q`` (temperature / top-k / top-p applied as for
the target, ``sampling.logits_to_probs``) and ``q`` is kept for exact rejection sampling; greedy
requests use argmax. With ``draft_sampling="greedy"`` every request drafts by argmax and the
verifier treats the draft as a point mass (vLLM v1 EAGLE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eagle3.runtime.interfaces import DraftModel
from eagle3.runtime.sampling import SamplingBatch, logits_to_probs, sample_from_weights
from eagle3.runtime.spec.engine_view import DraftingConfig, DraftingSeq
from eagle3.runtime.spec.tree_proposer import TreeDrafting


@dataclass
class ProposeItem:
    """One sequence's input to the proposer for this step."""

    seq: DraftingSeq  # the engine's Sequence
    start: int  # first committed position of this step (draft step 0 runs over start .. start+count-1)
    next_ids: list[int]  # the token after each of those positions (the inputs shifted left by one)
    aux: torch.Tensor  # [count, n*H] target aux states of those positions
    num_drafts: int  # tokens to propose after step 0 (0: only fill the draft KV)

    @property
    def count(self) -> int:
        return len(self.next_ids)


@dataclass
class Proposal:
    """The drafts proposed for one sequence: target-vocabulary ids, and the draft distribution
    they were sampled from (float32 [len(token_ids), V]; None for argmax / point-mass drafts)."""

    token_ids: list[int]
    probs: torch.Tensor | None
    parents: list[int] | None = None  # a draft tree's parents (root -1 first, then per token); None: a chain


# (input_ids, hidden, block_tables, starts, counts) -> (post_norm, next_hidden)
DraftForward = Callable[[torch.Tensor, torch.Tensor, Sequence[Sequence[int]], Sequence[int], Sequence[int]],
                        tuple[torch.Tensor, torch.Tensor]]


class EagleProposer:
    """``config``: the engine's one ``EngineConfig``, read as a :class:`DraftingConfig`
    (``draft_sampling``); how many tokens each sequence drafts comes with its :class:`ProposeItem`
    (the model runner's k, or auto's choice)."""

    def __init__(self, draft: DraftModel, config: DraftingConfig, forward_fn: DraftForward,
                 generator: torch.Generator | None = None, tree: TreeDrafting | None = None) -> None:
        self.draft = draft
        self.config = config
        self.tree = tree  # draft trees instead of chains (spec/tree_proposer.py)
        # One draft step over its KV cache (ModelRunner.forward_draft: a CUDA graph when uniform).
        self.forward_fn = forward_fn
        self.generator = generator
        ids = torch.arange(draft.vocab_size, dtype=torch.int64)
        self.draft_to_target = draft.to_target_ids(ids).to(torch.int64).cpu()
        self._identity_vocab = bool(torch.equal(self.draft_to_target, ids))

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem], target_vocab_size: int) -> list[Proposal | None]:
        """Run the draft; returns each item's proposal (``None`` where it drafts nothing). The
        sequences are not changed: the scheduler adopts the proposals when it commits the step."""
        proposals: list[Proposal | None] = [None] * len(items)
        if not items:
            return proposals
        ids: list[int] = []
        for it in items:
            ids += it.next_ids
        device = items[0].aux.device
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        hidden = self.draft.combine_aux(torch.cat([it.aux for it in items]))
        post, nxt = self.forward_fn(input_ids, hidden, [it.seq.block_table for it in items],
                                    [it.start for it in items], [it.count for it in items])

        drafting = [i for i, it in enumerate(items) if it.num_drafts > 0]
        if not drafting:
            return proposals
        seqs = [items[i].seq for i in drafting]
        last = torch.tensor([sum(it.count for it in items[: i + 1]) - 1 for i in drafting], device=device)
        post, nxt = post[last], nxt[last]
        pos = [items[i].start + items[i].count - 1 for i in drafting]  # draft position of `post`
        if self.tree is not None:
            roots = torch.tensor([items[i].next_ids[-1] for i in drafting], dtype=torch.int64, device=device)
            for i, (toks, parents) in zip(drafting, self.tree.propose(self.draft, roots, post, nxt, pos, seqs),
                                          strict=True):
                proposals[i] = Proposal(toks, None, parents)
            return proposals
        steps = max(items[i].num_drafts for i in drafting)
        batch = SamplingBatch.build([s.params for s in seqs], [s.generator for s in seqs], device=device)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        wanted = [items[i].num_drafts for i in drafting]
        for step in range(steps):
            # A seeded request draws from its own generator only for tokens it keeps, so its
            # random stream does not depend on what else is in the batch.
            gens = [g if step < n else None for g, n in zip(batch.generators, wanted, strict=True)]
            step_batch = SamplingBatch(batch.temperature, batch.top_k, batch.top_p, batch.greedy, gens)
            tok, q = self._sample(self.draft.compute_logits(post), step_batch, target_vocab_size)
            tokens.append(tok)
            probs.append(q)
            if step + 1 == steps:
                break
            pos = [p + 1 for p in pos]
            post, nxt = self.forward_fn(tok, nxt, [s.block_table for s in seqs], pos, [1] * len(seqs))

        toks = torch.stack(tokens, dim=1).tolist()  # [B, steps]
        for b, i in enumerate(drafting):
            n = items[i].num_drafts
            sampled = probs[0] is not None and not items[i].seq.params.greedy
            proposals[i] = Proposal(toks[b][:n], torch.stack([q[b] for q in probs[:n]]) if sampled else None)
        return proposals

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, target_vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocab logits [B, V_d] -> (target-id tokens [B], q over the target vocab [B, V] or None)."""
        d = logits.argmax(dim=-1)
        q_full = None
        if self.config.draft_sampling == "sample" and not batch.all_greedy:
            q = logits_to_probs(logits, batch)
            d = torch.where(batch.greedy, d, sample_from_weights(q, batch.generators, self.generator))
            if self._identity_vocab and q.shape[-1] == target_vocab_size:
                q_full = q
            else:
                q_full = q.new_zeros(q.shape[0], target_vocab_size)
                q_full[:, self.draft_to_target.to(q.device)] = q
        return self.draft_to_target.to(d.device)[d], q_full
