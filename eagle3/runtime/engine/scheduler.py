"""Continuous batching: which sequences run in the next forward, with how many tokens.

One rule serves prefill, chunked prefill, decode and speculative verification (vLLM v1 style): a
sequence schedules its uncomputed tokens (``token_ids[num_computed_tokens:]``, capped by the
token budget, i.e. a prefill chunk) and, when that reaches its end, its pending draft tokens.
Running sequences go first, in arrival order; waiting ones are admitted while blocks, budget and
``max_num_seqs`` allow. When the running sequences need more KV blocks than are free, the most
recently arrived running sequence is preempted by recomputation (its blocks are freed and it
goes back to the front of the queue to be prefilled again, prompt and output together).

Slot reservation per step: the target writes positions ``start .. start + n + d - 1`` (``n`` real
tokens, ``d`` drafts); after verification the proposer writes draft KV for the committed
positions and then ``k - 1`` more, so a sequence that samples needs ``start + n + d + k - 1``
slots. Blocks past the committed length are released at the end of the step.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eagle3.runtime.engine.block_manager import BlockManager
from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.engine.sequence import FinishReason, ScheduledSeq, Sequence, SequenceStatus
from eagle3.runtime.spec.adaptive import AdaptivePolicy
from eagle3.runtime.spec.stats import SpecStats
from eagle3.runtime.spec.tree import tree_kv_slots

if TYPE_CHECKING:
    from eagle3.runtime.engine.model_runner import StepOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """``config``: the engine's one :class:`EngineConfig` (batch limits, k, the draft tree), read
    where it is used; ``speculating``: a draft runs (without one, k is 0 whatever the config says);
    ``max_model_len``: the context limit ``LLM`` resolved (the config's, or the model's fitted to
    the cache)."""

    def __init__(self, block_manager: BlockManager, config: EngineConfig, max_model_len: int,
                 eos_ids: frozenset[int], *, speculating: bool, policy: AdaptivePolicy | None = None) -> None:
        self.block_manager = block_manager
        self.config = config
        self.speculating = speculating
        self.max_model_len = max_model_len
        # Draft trees: KV slots past the sequence's last token that a step may write (the tree's
        # nodes for the target, then the draft's tree region after the accepted path); 0: chains.
        tree = config.tree if speculating else None
        self.tree_slots = tree_kv_slots(tree[0], self.k, tree[1]) if tree is not None else 0
        self.policy = policy  # auto: sees every verification's acceptance (spec/adaptive.py)
        self.eos_ids = eos_ids
        # Engine-wide acceptance counters (each request also keeps its own in seq.stats).
        self.stats = SpecStats(max(self.k, 1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def k(self) -> int:
        """Draft tokens a step may verify: the config's k (auto: its ceiling, the slots reserved for
        it); 0 without a draft."""
        return self.config.max_k if self.speculating else 0

    # -- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                if seq in self.running:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)
                self.block_manager.free(seq)
                seq.finish(FinishReason.ABORT)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------
    def slots_needed(self, seq: Sequence, num_tokens: int, num_drafts: int) -> int:
        end = seq.num_computed_tokens + num_tokens + num_drafts
        if self.k and end - num_drafts == seq.num_tokens:
            if self.tree_slots:
                return max(end, seq.num_tokens + self.tree_slots)
            end += self.k - 1  # draft steps 1..k-1 after verification
        return end

    def _plan(self, seq: Sequence, budget: int) -> tuple[int, list[int]]:
        """(real tokens, drafts) for ``seq`` within ``budget`` query tokens."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > budget:
            return budget, []  # a prefill chunk; drafts only ride along with the last chunk
        if seq.draft_parents is not None and remaining + len(seq.draft_token_ids) > budget:
            return remaining, []  # a tree is verified whole or not at all
        return remaining, seq.draft_token_ids[: budget - remaining]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        queue = list(self.running)
        self.running = []
        while queue and budget > 0:
            seq = queue.pop(0)
            n, drafts = self._plan(seq, budget)
            need = self.slots_needed(seq, n, len(drafts))
            while not bm.can_allocate(seq, need):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, need)
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, drafts))
                self.running.append(seq)
                budget -= n + len(drafts)
        self.running.extend(queue)  # out of budget this step; still running

        # Admit waiting sequences only when nothing was preempted: admitting work while evicting
        # other work would thrash.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            n, drafts = self._plan(seq, budget)
            need = self.slots_needed(seq, n, len(drafts))
            if not bm.can_allocate(seq, need):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bm.allocate(seq, need)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, drafts))
            self.running.append(seq)
            budget -= n + len(drafts)
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    # -- after the forward -----------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, result: StepOutput) -> list[Sequence]:
        """Apply one step's result: commit each sequence's tokens (with stop checks and the
        acceptance statistics) and their logprobs, adopt the proposals of those still running, then free finished
        sequences' blocks and trim the others'. A sequence whose bookkeeping raises fails alone.
        Returns the sequences that finished."""
        for i, (item, emitted, proposal) in enumerate(zip(out.scheduled, result.emitted, result.proposals,
                                                          strict=True)):
            seq = item.seq
            if seq.is_finished:  # failed inside the step (LLM._isolated)
                continue
            try:
                before = seq.num_tokens
                self.commit(item, emitted)
                seq.add_logprobs(result.prompt_logprobs[i], result.logprobs[i], seq.num_tokens - before)
            except Exception as err:
                fail(seq, err)
                continue
            if proposal is not None and not seq.is_finished:
                seq.draft_token_ids, seq.draft_probs = proposal.token_ids, proposal.probs
                seq.draft_parents = proposal.parents
        return self.finish_step(out)

    def commit(self, item: ScheduledSeq, emitted: list[int]) -> int:
        """Apply one sequence's result: the chunk's KV is committed; when it sampled,
        ``emitted`` (accepted drafts + the recovered / bonus token) is appended with stop checks.
        Returns the number of committed positions this step (rows the proposer runs over)."""
        seq = item.seq
        if not item.samples:
            seq.num_computed_tokens += item.num_tokens
            return item.num_tokens
        num_drafts = len(item.draft_ids)
        num_accepted = len(emitted) - 1
        seq.stats.observe(num_drafts, num_accepted)
        seq.clear_drafts()
        # KV is valid for the last real token and the accepted drafts; the final emitted token
        # (recovered or bonus) is the input of the next forward. Rejected slots are dropped here.
        seq.num_computed_tokens = item.start + item.num_tokens + num_accepted
        seq.append_checked(emitted, self.eos_ids, self.max_model_len)
        self.stats.observe(num_drafts, num_accepted)
        if self.policy is not None:
            self.policy.observe(num_drafts, num_accepted)
        return item.num_tokens + num_accepted

    def finish_step(self, out: SchedulerOutput) -> list[Sequence]:
        """Free finished sequences' blocks and release tail blocks past the committed length."""
        finished = []
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:
                self.block_manager.free(seq)
                if seq in self.running:
                    self.running.remove(seq)
                finished.append(seq)
            elif seq.status == SequenceStatus.RUNNING:
                self.block_manager.trim(seq, seq.num_computed_tokens)
        return finished

    def release(self, seqs: list[Sequence]) -> None:
        """Free the blocks of those ``seqs`` that finished after :meth:`finish_step` (a request
        that failed while its output was built) and drop them from the running set."""
        for seq in seqs:
            if seq.is_finished and seq.block_table:
                self.block_manager.free(seq)
                if seq in self.running:
                    self.running.remove(seq)


def fail(seq: Sequence, err: BaseException) -> None:
    """End ``seq`` with an error of its own; the other sequences of the step go on."""
    logger.warning("request %s failed inside the engine step (the others go on): %s: %s",
                   seq.request_id, type(err).__name__, err, exc_info=err)
    seq.fail(err)
