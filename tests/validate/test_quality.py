"""The comparison numbers of eagle3.validate.quality against independent computations (torch's
full-vocabulary KL, numpy statistics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eagle3.validate import quality


def _dist(seed: int, v: int = 40, temp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64) / temp, -1)


def _top(lp: torch.Tensor, n: int) -> dict[int, float]:
    v, i = lp.topk(n)
    return {int(k): float(x) for k, x in zip(i, v, strict=True)}


def test_identical_distributions_give_exactly_zero() -> None:
    lp = _dist(0)
    top = _top(lp, 20)
    assert quality.topn_kld(top, dict(top)) == 0.0


def test_full_vocabulary_top_n_is_the_exact_kl() -> None:
    p, q = _dist(1), _dist(2)
    exact = float(torch.sum(p.exp() * (p - q)))
    got = quality.topn_kld(_top(p, p.numel()), _top(q, q.numel()))
    assert got == pytest.approx(exact, rel=1e-9)


def test_top_n_is_the_kl_of_the_top_n_plus_tail_partition() -> None:
    """When the served top-N holds the source's top-N, the number is exactly the KL of the two
    distributions collapsed to {source's top N, everything else}; it never exceeds the full KL."""
    p = _dist(3)
    q = torch.log_softmax(p + 0.05 * _dist(4), -1)  # a close served model: same top tokens
    n = 8
    src, srv = _top(p, n), _top(q, n + 4)
    assert set(src) <= set(srv)
    ids = torch.tensor(sorted(src))
    rest = torch.ones(p.numel(), dtype=torch.bool)
    rest[ids] = False
    pc = torch.cat([p.exp()[ids], p.exp()[rest].sum()[None]])
    qc = torch.cat([q.exp()[ids], q.exp()[rest].sum()[None]])
    coarse = float(torch.sum(pc * (pc.log() - qc.log())))
    got = quality.topn_kld(src, srv)
    assert got == pytest.approx(coarse, rel=1e-9, abs=1e-15)
    assert got <= float(torch.sum(p.exp() * (p - q))) + 1e-12


def test_a_source_token_missing_from_the_served_top_n_keeps_a_proper_distribution() -> None:
    p, q = _dist(5, temp=0.5), _dist(6, temp=0.5)
    src, srv = _top(p, 10), _top(q, 10)
    assert set(src) - set(srv)  # some of the source's tokens are not in the served top 10
    got = quality.topn_kld(src, srv)
    assert math.isfinite(got) and got > 0.0


def test_sequence_comparison_top1_and_first_divergence() -> None:
    tokens = [3, 5, 7]
    source = [{3: -0.1, 4: -2.5}, {5: -0.2, 1: -1.9}, {7: -0.3, 2: -1.5}]
    served = [{3: -0.2, 4: -2.0}, {1: -0.5, 5: -1.0}, {7: -0.1}]
    c = quality.compare_sequence(tokens, source, served)
    assert c.top1 == [True, False, True] and c.first_divergence == 1
    assert c.kld[0] > 0 and len(c.kld) == 3
    with pytest.raises(ValueError, match="positions differ"):
        quality.compare_sequence(tokens, source, served[:2])


def test_an_exact_tie_at_the_top_is_agreement_in_any_listed_order() -> None:
    # vLLM lists the forced prompt token first in echo logprobs: {forced, then the top N by rank}
    for served in ({543: -2.0126, 361: -2.0126, 50: -2.1}, {361: -2.0126, 543: -2.0126, 50: -2.1}):
        for tok in (361, 543):
            assert quality.compare_sequence([tok], [{tok: -2.0}], [served]).top1 == [True]
    assert quality.is_top1(50, {50: -2.1, 361: -2.0126}) is False  # listed first, but less likely
    assert quality.is_top1(7, {361: -0.1}) is False  # not among the served tokens


def test_flips_and_the_paired_interval_match_numpy() -> None:
    src = [True, True, False, False, True, False, True, True]
    got = [True, False, True, False, True, False, False, True]
    f = quality.flips(src, got)
    d = np.array(got, dtype=float) - np.array(src, dtype=float)
    half = 1.959963984540054 * d.std(ddof=1) / math.sqrt(len(d))
    assert (f["right_to_wrong"], f["wrong_to_right"], f["flips"]) == (2, 1, 3)
    assert f["accuracy_delta"] == pytest.approx(d.mean())
    assert f["accuracy_delta_ci95"] == pytest.approx([d.mean() - half, d.mean() + half])
    assert f["flip_rate"] == pytest.approx(3 / 8)


def test_summaries_and_histogram() -> None:
    vals = [0.0, 1e-7, 2e-3, 0.5, 3.0]
    s = quality.kld_summary(vals)
    assert s["mean"] == pytest.approx(np.mean(vals)) and s["p99"] == pytest.approx(np.percentile(vals, 99))
    assert s["max"] == 3.0 and s["tokens"] == 5
    assert quality.histogram(vals, (0.0, 1e-6, 1e-2, 1.0, float("inf"))) == [2, 1, 1, 1]
    d = quality.divergence_summary([None, 4, 10, None])
    assert d == {"sequences": 4, "identical": 2, "mean_first_divergence": 7.0, "min_first_divergence": 4}
