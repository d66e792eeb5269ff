"""Sampling filters against transformers' logits warpers, the sampler, and acceptance statistics."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle3.errors import UsageError
from eagle3.runtime.sampling import Sampler, SamplingBatch, SamplingParams, logits_to_probs
from eagle3.runtime.spec.stats import SpecStats


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                              (0.5, 10, 0.6), (1.0, 1, 0.3)])
def test_filters_match_transformers(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = logits_to_probs(logits, SamplingBatch.build([params] * 6, [None] * 6))
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(ours, ref.softmax(-1))


def test_rows_use_their_own_settings() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.5)]
    probs = logits_to_probs(logits, SamplingBatch.build(params, [None] * 3))
    assert int((probs[0] > 0).sum()) == 1 and int((probs[1] > 0).sum()) == 20
    assert 1 <= int((probs[2] > 0).sum()) < 20


def test_sampler_greedy_seeded_and_frequencies() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 4000, [None] * 4000)
    assert bool((Sampler()(logits, greedy) == 2).all())
    sampler = Sampler(torch.Generator().manual_seed(0))
    batch = SamplingBatch.build([SamplingParams()] * 4000, [None] * 4000)
    freq = torch.bincount(sampler(logits, batch), minlength=4).double() / 4000
    torch.testing.assert_close(freq, logits[0].double().softmax(-1), atol=0.03, rtol=0)

    def seeded() -> list[int]:
        g = torch.Generator().manual_seed(5)
        return Sampler()(logits[:1], SamplingBatch.build([SamplingParams(seed=5)], [g])).tolist()

    assert seeded() == seeded()


def test_sampling_params_validation() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}):
        with pytest.raises(UsageError):
            SamplingParams(**bad)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_spec_stats_counters_and_line() -> None:
    s = SpecStats(3)
    s.observe(3, 3)
    s.observe(3, 1)
    s.observe(3, 0)
    s.observe(2, 2)  # a truncated draft near max_tokens
    s.observe(0, 0)  # prefill: not a draft
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 11, 6)
    assert s.accepted_per_pos == [3, 2, 1] and s.accepted_hist == [1, 1, 1, 1]
    assert s.acceptance_rate == pytest.approx(6 / 11)
    assert s.mean_acceptance_length == pytest.approx(2.5)
    assert s.per_position_acceptance == [0.75, 0.5, 0.25]
    assert s.line() == "acceptance: 54.55%  avg toks/fwd: 2.50  dist 0/1/2/3: 25.00/25.00/25.00/25.00%"
    total = SpecStats(3)
    total.merge(s)
    total.merge(s)
    assert total.num_accepted_tokens == 12 and total.accepted_hist == [2, 2, 2, 2]
    assert total.as_dict()["mean_acceptance_length"] == pytest.approx(2.5)
