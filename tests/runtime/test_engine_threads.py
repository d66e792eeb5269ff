"""The engine driven from several threads at once, and requests that must never wait forever.

Regression for a hang seen in a loaded full-suite run: a test called ``LLM.generate()`` on the LLM
that a server's engine thread was stepping. ``step()`` hands a step's outputs to whichever
thread called it; when the engine thread happened to run the step that finished generate()'s
request, generate() never saw the result and looped forever on ``step()``. Idle on a quiet
machine (generate() finishes before the engine thread's next idle poll), near certain under load.
"""

from __future__ import annotations

import threading

import pytest

from eagle3.errors import UsageError
from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing.toy_models import ToyDraft, ToyTarget, toy_reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _llm(**kw) -> tuple[ToyTarget, LLM]:
    target = ToyTarget()
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return target, LLM(target, ToyDraft(target, "noisy"), num_speculative_tokens=3, tokenizer=None, **kw)


def _in_thread(fn, timeout: float = 60.0) -> None:
    """Run ``fn``; fail (instead of hanging the suite) when it does not return in time."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the test thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} did not return within {timeout:.0f} s (lost results?)"
    if err:
        raise err[0]


def test_generate_gets_its_results_while_another_thread_steps() -> None:
    target, llm = _llm()
    stop = threading.Event()

    def engine_thread() -> None:  # what the server's AsyncEngine does, without its idle wait
        while not stop.is_set():
            if llm.has_unfinished():
                llm.step()

    stepper = threading.Thread(target=engine_thread, daemon=True)
    stepper.start()
    prompts = [[(5 * i + j) % 50 + 1 for j in range(3 + i % 7)] for i in range(24)]
    results: list[list[int]] = []

    def generate_one_by_one() -> None:
        for p in prompts:
            results.append(llm.generate([p], GREEDY)[0].token_ids)

    try:
        _in_thread(generate_one_by_one)
    finally:
        stop.set()
        stepper.join(10)
    assert results == [toy_reference_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm._collect and not llm._results  # nothing kept per finished generate()


def test_generate_that_fails_to_add_leaves_nothing_behind() -> None:
    target, llm = _llm()
    with pytest.raises(UsageError, match="empty"):
        llm.generate([[1, 2, 3], []], GREEDY)  # the first is queued, the second refused
    out = llm.generate([[4, 5]], GREEDY)[0]  # the first was aborted, not left running
    assert out.token_ids == toy_reference_greedy(target, [4, 5], GREEDY.max_tokens)
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_abort_of_a_queued_request_frees_its_id() -> None:
    _, llm = _llm()
    llm.add_request([1, 2, 3], GREEDY, request_id="r")
    llm.abort("r")
    (out,) = llm.step()  # nothing left to schedule: the abort is reported all the same
    assert out.request_id == "r" and out.finish_reason == "abort" and not llm.has_unfinished()
    llm.add_request([1, 2, 3], GREEDY, request_id="r")  # its id is free again (was kept forever)
    while llm.has_unfinished():
        llm.step()


@pytest.mark.parametrize(("num_blocks", "block_size", "k", "n"), [(4, 4, 3, 6), (6, 2, 1, 9), (8, 4, 5, 12)])
def test_requests_that_fill_the_whole_cache_all_finish(num_blocks: int, block_size: int, k: int, n: int) -> None:
    """Every request the engine accepts fits the KV cache on its own, so however many arrive at
    once, each one runs in turn (preempting or waiting) and none waits forever."""
    target = ToyTarget()
    llm = LLM(target, ToyDraft(target, "noisy"), num_speculative_tokens=k, tokenizer=None,
              num_blocks=num_blocks, block_size=block_size)
    room = llm.max_model_len
    prompts = [[(3 * i + j) % 40 + 1 for j in range(1 + (i * 5) % (room - 1))] for i in range(n)]
    outs: list = []
    _in_thread(lambda: outs.extend(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=None))))
    for p, o in zip(prompts, outs, strict=True):
        assert len(p) + len(o.token_ids) == room and o.finish_reason == "length"
        assert o.token_ids == toy_reference_greedy(target, p, room - len(p))
    assert llm.block_manager.num_free_blocks == num_blocks
    with pytest.raises(UsageError, match="max_model_len"):  # one that could never fit is refused up front
        llm.add_request(list(range(1, room + 1)))
