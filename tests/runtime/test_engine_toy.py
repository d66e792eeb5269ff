"""The engine end to end on toy models with a real paged cache (eagle3.testing.toy_models).

The toy target's output is an exact function of what it reads back through the block tables, so
comparing with the cache-free reference catches any slot / rollback / preemption bug; the oracle
draft reaches full acceptance only if the draft's own cache is kept right as well.
"""

from __future__ import annotations

import threading

import pytest

from eagle3.errors import UsageError
from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing.toy_models import ToyDraft, ToyTarget, toy_reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % 60 for j in range(1 + (5 * i) % 19)] for i in range(n)]


def _llm(target: ToyTarget, mode: str | None, **kw) -> LLM:
    draft = ToyDraft(target, mode) if mode else None
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(target, draft, tokenizer=None, **kw)


def _no_leak(llm: LLM) -> None:
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.has_unfinished()


@pytest.mark.parametrize(("batch", "k", "mode", "kw"), [
    (1, 1, "oracle", {}),
    (3, 3, "noisy", {"block_size": 1}),
    (8, 5, "noisy", {"max_num_batched_tokens": 7}),  # chunked prefill, budget-truncated drafts
    (8, 3, "oracle", {"num_blocks": 18}),  # preemption
    (3, 5, "wrong", {"num_blocks": 22, "block_size": 2}),
    (8, 1, None, {"num_blocks": 14}),  # no draft, preemption
])
def test_greedy_output_matches_reference(batch: int, k: int, mode: str | None, kw: dict) -> None:
    target = ToyTarget()
    llm = _llm(target, mode, num_speculative_tokens=k, **kw)
    prompts = _prompts(batch)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == toy_reference_greedy(target, p, GREEDY.max_tokens)
        assert o.finish_reason == "length"
    if "num_blocks" in kw:
        assert sum(o.num_preemptions for o in outs) == llm.num_preemptions > 0
    _no_leak(llm)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_draft_is_always_accepted(k: int) -> None:
    target = ToyTarget()
    llm = _llm(target, "oracle", num_speculative_tokens=k)
    steps = 4
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1))  # no truncated last draft
    outs = llm.generate(_prompts(3), params)
    s = llm.stats
    assert s.num_drafts == 3 * steps and s.acceptance_rate == 1.0
    assert s.mean_acceptance_length == k + 1 and s.accepted_hist[k] == s.num_drafts
    assert s.per_position_acceptance == [1.0] * k
    for o in outs:
        assert o.spec_stats.num_accepted_tokens == steps * k
    assert llm.num_steps == 1 + steps  # one prefill step, then every step emits k + 1 tokens
    assert "acceptance: 100.00%" in llm.stats_line()


def test_wrong_draft_is_never_accepted_and_changes_nothing() -> None:
    target = ToyTarget()
    llm = _llm(target, "wrong", num_speculative_tokens=3)
    prompts = _prompts(3)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats.num_draft_tokens > 0 and llm.stats.num_accepted_tokens == 0
    assert llm.stats.accepted_hist[0] == llm.stats.num_drafts
    assert [o.token_ids for o in outs] == [toy_reference_greedy(target, p, 24) for p in prompts]


def test_sampling_with_an_exact_draft_accepts_everything() -> None:
    """p == q makes min(1, p/q) = 1: every sampled draft must be accepted."""
    target = ToyTarget()
    llm = _llm(target, "oracle", num_speculative_tokens=3)
    llm.generate(_prompts(4), SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_tokens=21))
    assert llm.stats.acceptance_rate == 1.0


def test_seeded_sampling_is_independent_of_batch_and_speculation_depth() -> None:
    target = ToyTarget()
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    other = SamplingParams(temperature=1.0, max_tokens=30)
    alone = _llm(target, "noisy", num_speculative_tokens=3).generate([_prompts(1)[0]], seeded)[0]
    mixed = _llm(target, "noisy", num_speculative_tokens=3, block_size=2).generate(
        _prompts(4), [seeded, other, other, other])[0]
    assert mixed.token_ids == alone.token_ids
    again = _llm(target, "noisy", num_speculative_tokens=3).generate([_prompts(1)[0]], seeded)[0]
    assert again.token_ids == alone.token_ids
    different = _llm(target, "noisy", num_speculative_tokens=3).generate(
        [_prompts(1)[0]], SamplingParams(temperature=1.0, seed=4321, max_tokens=20))[0]
    assert different.token_ids != alone.token_ids


def test_stop_conditions() -> None:
    target = ToyTarget()
    prompt = _prompts(2)[1]
    ref = toy_reference_greedy(target, prompt, 24)
    stop = ref[5]
    first = ref.index(stop)
    llm = _llm(target, "oracle", num_speculative_tokens=5)
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))[0]
    assert o.token_ids == ref[: first + 1] and o.finish_reason == "stop"
    eos_target = ToyTarget(eos_token_id=stop)
    llm = _llm(eos_target, "oracle", num_speculative_tokens=5)
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    assert o.token_ids == ref[: first + 1] and o.finish_reason == "stop"
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert o.token_ids == ref and o.finish_reason == "length"
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    assert o.token_ids == ref[:1] and o.finish_reason == "length"
    _no_leak(llm)


def test_max_model_len() -> None:
    target = ToyTarget()
    llm = _llm(target, "oracle", num_speculative_tokens=3, max_model_len=20)
    prompt = _prompts(3)[2]  # 11 tokens
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None))[0]
    assert o.token_ids == toy_reference_greedy(target, prompt, 9) and o.finish_reason == "length"
    with pytest.raises(UsageError, match="max_model_len"):
        llm.add_request(list(range(20)))


def test_incremental_api_deltas_and_abort() -> None:
    target = ToyTarget()
    llm = _llm(target, "noisy", num_speculative_tokens=3)
    prompts = _prompts(3)
    rids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=40)) for p in prompts]
    assert llm.has_unfinished() and llm.num_waiting == 3 and llm.num_running == 0
    first = llm.step()
    assert llm.num_running == 3 and llm.num_waiting == 0 and 0 < llm.kv_cache_usage < 1
    got: dict[str, list[int]] = {o.request_id: o.new_token_ids for o in first}
    finished: dict[str, str] = {}
    steps = 0
    while llm.has_unfinished():
        for o in llm.step():
            got[o.request_id] += o.new_token_ids
            assert o.token_ids == got[o.request_id]
            if o.finished:
                finished[o.request_id] = o.finish_reason
        steps += 1
        if steps == 3:
            llm.abort(rids[1])
    assert finished == {rids[0]: "length", rids[1]: "abort", rids[2]: "length"}
    assert got[rids[0]] == toy_reference_greedy(target, prompts[0], 40)
    assert 0 < len(got[rids[1]]) < 40
    _no_leak(llm)
    assert llm.kv_cache_usage == 0.0


def test_requests_added_from_another_thread() -> None:
    target = ToyTarget()
    llm = _llm(target, "oracle", num_speculative_tokens=2)
    prompts = _prompts(6)
    done: dict[str, list[int]] = {}
    rids: list[str] = []

    def client() -> None:
        for p in prompts:
            rids.append(llm.add_request(p, GREEDY))

    t = threading.Thread(target=client)
    t.start()
    while t.is_alive() or llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    t.join()
    assert [done[r] for r in rids] == [toy_reference_greedy(target, p, 24) for p in prompts]


def test_kv_cache_bounds_the_sequence_length() -> None:
    target = ToyTarget()
    with pytest.raises(UsageError, match="does not fit the KV cache"):
        _llm(target, "oracle", num_blocks=4, block_size=4, max_model_len=16)
    llm = _llm(target, "oracle", num_blocks=4, block_size=4, num_speculative_tokens=3)  # 16 slots
    assert llm.max_model_len == 13
    o = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=None))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 10
    assert o.token_ids == toy_reference_greedy(target, [1, 2, 3], 10)
    with pytest.raises(UsageError, match="empty"):
        llm.add_request([])
    llm.add_request([1, 2], request_id="x")
    with pytest.raises(UsageError, match="already in use"):
        llm.add_request([1, 2], request_id="x")
    with pytest.raises(UsageError, match="max_model_len"):
        llm.add_request(list(range(13)))
    with pytest.raises(UsageError, match="tokenizer"):
        llm.add_request("hello")
