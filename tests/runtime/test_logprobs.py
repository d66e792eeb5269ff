"""``SamplingParams(logprobs=N, prompt_logprobs=M)`` through ``LLM`` on the trained tiny pair.

The invariant: logprobs come from the target's logits alone, so plain decoding and speculative
decoding (chain, tree, k = auto; chunked prefill; preemption) return the same entries bit for bit
(the runtime's kernels are batch invariant: a row's bits never depend on the other rows of its
forward). The reference is independent of the engine: one prefill of the model over prompt +
output (``forced_logits``), then ``torch.log_softmax``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.errors import UsageError
from eagle3.runtime.engine.llm import LLM, RequestOutput
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing import tiny, trained
from eagle3.testing.numerics import forced_logits
from tests.runtime.model_kit import single_thread

TOP = 5
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
DRAFT = f"{trained.NAME}-eagle3"

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def target(trained_pair: Path):
    from eagle3.runtime.loader import load_target

    return load_target(trained_pair / trained.NAME, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = tiny.build_tokenizer()
    return [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in trained.QUESTIONS[:2]]


@pytest.fixture(scope="module")
def plain(target, prompts) -> list[RequestOutput]:
    return LLM(target, None, tokenizer=None, num_blocks=64, max_num_seqs=4).generate(prompts, GREEDY)


def test_entries_equal_the_models_log_softmax(target, prompts, plain) -> None:
    """Output and prompt entries: the chosen token's logprob, its rank and the top N are those of
    log_softmax over one prefill of prompt + output (fp32, within 1e-5; measured: identical)."""
    for p, out in zip(prompts, plain, strict=True):
        assert len(out.logprobs) == len(out.token_ids) and len(out.prompt_logprobs) == len(p)
        assert out.prompt_logprobs[0] is None  # the first prompt token has no logprob (vLLM)
        ref = forced_logits(target, p + out.token_ids).log_softmax(-1)  # row i scores token i + 1
        seq = p + out.token_ids
        entries = out.prompt_logprobs[1:] + out.logprobs
        assert [e.token_id for e in entries] == seq[1:]
        for i, e in enumerate(entries):
            row = ref[i]
            assert e.logprob == pytest.approx(row[seq[i + 1]].item(), abs=1e-5)
            assert e.rank == int((row >= row[seq[i + 1]]).sum())
            n = TOP if i >= len(p) - 1 else 3  # prompt entries carry prompt_logprobs' N
            top_lp, top_ids = row.topk(n)
            assert [t for t, _ in e.top] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), top_lp, rtol=0, atol=1e-5)
        assert all(e.rank == 1 for e in out.logprobs)  # greedy: every output token is the argmax
        assert any(e.rank > 1 for e in out.prompt_logprobs[1:])


@pytest.mark.parametrize("kw", [
    {"num_speculative_tokens": 3},
    {"num_speculative_tokens": 3, "speculative_eagle_topk": 2},  # draft trees
    {"num_speculative_tokens": "auto"},
    {"num_speculative_tokens": 2, "max_num_batched_tokens": 48},  # chunked prefill
    {"num_speculative_tokens": 3, "block_size": 4, "num_blocks": 66},  # preemption
], ids=["chain", "tree", "auto", "chunked", "preempted"])
def test_speculative_logprobs_equal_plain_bit_for_bit(trained_pair: Path, target, prompts, plain,
                                                      kw: dict) -> None:
    kw = {"num_blocks": 64, "max_num_seqs": 4, **kw}
    llm = LLM(target, trained_pair / DRAFT, tokenizer=None, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats.num_accepted_tokens > 0  # drafts were really accepted: rows past the first
    for a, b in zip(plain, outs, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == a.logprobs  # dataclass equality of floats: the same bits
        assert b.prompt_logprobs == a.prompt_logprobs
    if kw.get("block_size") == 4:  # both prompts fit, both outputs do not
        assert sum(o.num_preemptions for o in outs) > 0  # prompt entries still counted once


def test_a_stop_inside_an_accepted_run_drops_the_later_entries(trained_pair: Path, target, prompts, plain) -> None:
    """A stop token id in the middle of a verified chain: the tokens after it are not emitted, and
    neither are their entries."""
    ref = plain[0]
    stop = ref.token_ids[9]
    cut = ref.token_ids.index(stop) + 1
    llm = LLM(target, trained_pair / DRAFT, num_speculative_tokens=3, tokenizer=None, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=TOP, stop_token_ids=[stop])
    out = llm.generate(prompts[:1], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[:cut]
    assert out.logprobs == ref.logprobs[:cut]


def test_logprobs_are_raw_and_follow_every_step(target, prompts) -> None:
    """Sampled at temperature 0.7 / top-p 0.9: the entries are the model's own log_softmax (not the
    tempered, filtered distribution), and each step's output carries its new tokens' entries."""
    llm = LLM(target, None, tokenizer=None, num_blocks=64)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=1)
    rid = llm.add_request(prompts[0], params)
    streamed, final = [], None
    while llm.has_unfinished():
        for o in llm.step():
            assert o.request_id == rid and len(o.new_logprobs) == len(o.new_token_ids)
            streamed += o.new_logprobs
            final = o
    assert final is not None and final.prompt_logprobs is None and streamed == final.logprobs
    ref = forced_logits(target, prompts[0] + final.token_ids).log_softmax(-1)[len(prompts[0]) - 1:]
    got = torch.tensor([e.logprob for e in final.logprobs])
    torch.testing.assert_close(got, ref[:-1].gather(1, torch.tensor(final.token_ids)[:, None])[:, 0],
                               rtol=0, atol=1e-5)


def test_requests_without_logprobs_compute_none(monkeypatch: pytest.MonkeyPatch, trained_pair: Path, target,
                                                prompts) -> None:
    """No request asked: the logprob code never runs (no cost), and outputs say None."""
    from eagle3.runtime.engine import model_runner

    def boom(*args, **kwargs):
        raise AssertionError("logprobs computed for a request that did not ask")

    import eagle3.runtime.logprobs as lp

    monkeypatch.setattr(lp, "token_logprobs", boom)  # every entry is made here
    monkeypatch.setattr(model_runner, "step_prompt_logprobs", boom)
    llm = LLM(target, trained_pair / DRAFT, num_speculative_tokens=3, tokenizer=None, num_blocks=64)
    out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.logprobs is None and out.new_logprobs is None and out.prompt_logprobs is None


def test_bad_counts_are_usage_errors_naming_the_field(target, prompts) -> None:
    with pytest.raises(UsageError, match=r"SamplingParams\.logprobs must be an integer >= 0"):
        SamplingParams(logprobs=-1)
    with pytest.raises(UsageError, match=r"SamplingParams\.prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
    with pytest.raises(UsageError, match="max_logprobs must be an integer >= 0"):
        LLM(target, None, tokenizer=None, num_blocks=8, max_logprobs=-1)
    llm = LLM(target, None, tokenizer=None, num_blocks=16, max_logprobs=4)
    with pytest.raises(UsageError, match=r"SamplingParams\.logprobs=5 exceeds .*max_logprobs=4"):
        llm.add_request(prompts[0], SamplingParams(logprobs=5))
    with pytest.raises(UsageError, match=r"SamplingParams\.prompt_logprobs=9 exceeds"):
        llm.add_request(prompts[0], SamplingParams(prompt_logprobs=9))
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2, logprobs=4, prompt_logprobs=0))[0]
    assert all(len(e.top) == 4 for e in out.logprobs)
    assert all(e.top == () for e in out.prompt_logprobs[1:])  # 0: the prompt token's own logprob only


@pytest.mark.slow  # two TP=2 engines (one worker process for both)
def test_tensor_parallel_logprobs(trained_pair: Path, target, prompts, plain) -> None:
    """TP=2 (gloo, 2 ranks): logits rows through ``compute_logits_at`` with the workers, prompt rows
    included; speculative == plain bit for bit at TP=2. Against TP=1, what the cross-rank summation
    order guarantees (tests/runtime/test_tensor_parallel.py): greedy tokens up to the first near
    tie, and every logprob over the same history (the prompt's, and the output's up to the first
    token where the two part) within its logit tolerance, 1e-4."""
    from eagle3.testing.numerics import FP32_ROUTER_TOL, assert_tokens_until_near_tie
    from tests.runtime.test_tensor_parallel import LOGITS_ATOL

    outs, ranks = {}, []
    for draft in (None, trained_pair / DRAFT):
        llm = LLM(trained_pair / trained.NAME, draft, dtype="float32", tokenizer=None, num_blocks=64,
                  tensor_parallel_size=2, num_speculative_tokens=3)
        try:
            ranks.append(llm._workers.procs[0].pid)
            outs[draft is None] = llm.generate(prompts, GREEDY)
            assert draft is None or llm.stats.num_accepted_tokens > 0
        except BaseException:
            llm.close()
            raise
        # the plain engine's worker process waits for the speculative one (same checkpoint and
        # settings) and joins its group: one rank process started, not two (~2.5 CPU-s each)
        llm.close(rejoin=draft is None)
    assert ranks[0] == ranks[1]  # the waiting rank joined
    assert_tokens_until_near_tie(target, prompts, [o.token_ids for o in plain],
                                 {"tp=2": [o.token_ids for o in outs[True]]}, LOGITS_ATOL, FP32_ROUTER_TOL,
                                 "TP=2 vs TP=1")
    for tp_plain, tp_spec, one in zip(outs[True], outs[False], plain, strict=True):
        assert tp_spec.token_ids == tp_plain.token_ids
        assert tp_spec.logprobs == tp_plain.logprobs and tp_spec.prompt_logprobs == tp_plain.prompt_logprobs
        # entry i scores token i after the same history in both while the tokens before it agree
        same = next((i for i, (a, b) in enumerate(zip(tp_plain.token_ids, one.token_ids, strict=True)) if a != b),
                    len(one.token_ids))
        got = [e.logprob for e in tp_plain.prompt_logprobs[1:] + tp_plain.logprobs[:same]]
        want = [e.logprob for e in one.prompt_logprobs[1:] + one.logprobs[:same]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 2}], ids=["chain", "tree"])
def test_graph_replays_give_the_eager_logprobs(monkeypatch: pytest.MonkeyPatch, trained_pair: Path, target,
                                               prompts, plain, tree: dict) -> None:
    """The CUDA-graph path on the CPU (tests/runtime/test_graphs.py's eager capturer): the logits are
    computed from the hidden states a replay returns, so the entries are the eager engine's."""
    from eagle3.runtime.engine import graphs

    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "default_capturer", graphs.EagerCapturer)
    llm = LLM(target, trained_pair / DRAFT, num_speculative_tokens=3, tokenizer=None, num_blocks=64,
              max_num_seqs=4, **tree)
    outs = llm.generate(prompts, GREEDY)
    assert llm.cuda_graphs and llm.runner.target_graphs.replays > 0 and llm.stats.num_accepted_tokens > 0
    for a, b in zip(plain, outs, strict=True):
        assert (b.token_ids, b.logprobs, b.prompt_logprobs) == (a.token_ids, a.logprobs, a.prompt_logprobs)
