"""Block manager and scheduler: block accounting, chunked prefill, budget, preemption, rollback."""

from __future__ import annotations

import pytest

from eagle3.runtime.engine.block_manager import BlockManager
from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.engine.scheduler import Scheduler
from eagle3.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus
from eagle3.runtime.sampling import SamplingParams


def _seq(n: int, rid: str = "r", max_tokens: int = 100, k: int = 3) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), None, k)


def test_block_manager_allocate_trim_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(5)
    assert bm.blocks_needed(s, 9) == 3 and bm.can_allocate(s, 9)
    bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(s, 12)  # still 3 blocks
    assert len(s.block_table) == 3
    assert not bm.can_allocate(s, 33)
    bm.trim(s, 5)  # positions 0..4 -> 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    s.block_table.append(0)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(s)


def _sched(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8, k: int = 3) -> Scheduler:
    config = EngineConfig(num_speculative_tokens=max(k, 1), block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs)
    return Scheduler(BlockManager(num_blocks, block_size), config, 4096, frozenset({0}), speculating=k > 0)


def test_chunked_prefill_and_budget() -> None:
    sch = _sched(budget=8)
    a, b = _seq(13, "a"), _seq(3, "b")
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert [(i.seq.request_id, i.start, i.num_tokens, i.samples) for i in out.scheduled] == [("a", 0, 8, False)]
    sch.commit(out.scheduled[0], [])
    assert a.num_computed_tokens == 8
    out = sch.schedule()  # a's last 5 tokens, then b's 3
    assert [(i.seq.request_id, i.start, i.num_tokens, i.samples) for i in out.scheduled] == [
        ("a", 8, 5, True), ("b", 0, 3, True)]
    # a samples: its reservation covers its prompt plus k - 1 draft-step slots.
    assert len(a.block_table) * 4 >= 13 + 3 - 1


def test_drafts_ride_with_the_last_token_and_rollback() -> None:
    sch = _sched(k=3)
    a = _seq(4)
    sch.add(a)
    item = sch.schedule().scheduled[0]
    sch.commit(item, [50])
    assert a.num_computed_tokens == 4 and a.token_ids[-1] == 50
    a.draft_token_ids = [51, 52, 53]
    out = sch.schedule()
    item = out.scheduled[0]
    assert item.input_ids() == [50, 51, 52, 53] and item.start == 4
    # One draft accepted, then a recovered token: committed = last token + 1 accepted draft.
    assert sch.commit(item, [51, 60]) == 2
    assert a.num_computed_tokens == 6 and a.token_ids[-2:] == [51, 60] and a.draft_token_ids == []
    assert a.stats.num_drafts == 1 and a.stats.accepted_hist == [0, 1, 0, 0]
    sch.finish_step(out)
    assert len(a.block_table) == 2  # positions 0..5 at block_size 4; the tail block was released


def test_stop_inside_the_accepted_run() -> None:
    sch = _sched()
    a = _seq(2)
    sch.add(a)
    item = sch.schedule().scheduled[0]
    sch.commit(item, [7, 0, 9])  # 0 is EOS: 9 must not be emitted
    assert a.output_token_ids == [7, 0] and a.finish_reason == FinishReason.STOP


def test_preempts_latest_arrival_and_recomputes() -> None:
    sch = _sched(num_blocks=4, block_size=4, k=1)  # 16 slots
    a, b = _seq(6, "a"), _seq(6, "b")
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a", "b"]  # 2 blocks each
    for it in out.scheduled:
        sch.commit(it, [20, 21])  # 1 draft ... pretend 2 tokens
    sch.finish_step(out)
    a.token_ids += [22, 23, 24]  # a grows past its blocks
    out = sch.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_preemptions == 1
    assert sch.waiting[0] is b


def test_abort_frees_blocks() -> None:
    sch = _sched(num_blocks=8)
    a = _seq(9)
    sch.add(a)
    sch.schedule()
    assert sch.block_manager.num_free_blocks < 8
    assert sch.abort("r") is a
    assert sch.block_manager.num_free_blocks == 8 and a.finish_reason == FinishReason.ABORT
    assert not sch.has_unfinished()
