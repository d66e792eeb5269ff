"""How far a served model is from its source: the numbers of a two-pass reference comparison.

The source's server records, at every position of its own greedy continuation, its top-N
log-probabilities (:mod:`eagle3.validate.reference`); the served model is then teacher-forced
through the same tokens and returns its own top-N at the same positions. From the two:

- **Per-token KL divergence** ``KL(P_source || Q_served)``, with N of the vocabulary's entries known
  on each side. The source's top-N tokens are kept as they are and the rest of the vocabulary is
  one "tail" bucket (``1 - sum of the top-N``) on both sides. When every one of the source's top-N
  is in the served top-N (or is the token forced at that position, whose logprob a server always
  returns), this coarse-grained KL is exact for that partition and, by the log-sum inequality, a
  lower bound of the full-vocabulary KL; a source token missing from the served top-N is below the
  served N-th probability, and gets ``min(p_N, remaining mass / (missing + 1))`` of the served
  distribution, so the estimate stays a proper distribution. Identical inputs give exactly 0.
  llama.cpp's ``--kl-divergence`` computes the full-vocabulary KL from stored logits; an
  OpenAI-compatible server returns at most N (vLLM: 20) entries per position, hence this form.
- **Top-1 agreement**: the served argmax equals the source's greedy token.
- **First divergence**: the first position where it does not (the served model's greedy text would
  leave the source's there); None when the whole continuation agrees.
- **Answer flips** between the source's and the served model's scored answers (right -> wrong,
  wrong -> right) and the paired accuracy difference with its 95% interval (normal approximation
  of the paired differences, as "Accuracy is Not All You Need" recommends reporting flips next to
  accuracy).

Only the standard library: these numbers are pure arithmetic on what the servers returned.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

TokenKey = Hashable  # a token id (int), or the token's text when a server returns no ids
TopLogprobs = Mapping[TokenKey, float]

Z95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal


def _xlogx_ratio(p: float, q: float) -> float:
    """``p * log(p / q)`` with ``0 log 0 = 0`` (q is kept positive by the callers)."""
    return 0.0 if p <= 0.0 else p * (math.log(p) - math.log(q))


def topn_kld(source: TopLogprobs, served: TopLogprobs) -> float:
    """KL(source || served) over the source's top-N tokens plus one tail bucket (module docstring).

    ``source``: the source's top-N log-probabilities at one position; ``served``: the served model's
    top-N there plus, if the server gave it, the forced token's own log-probability."""
    p = {k: math.exp(v) for k, v in source.items()}
    q_known = {k: math.exp(v) for k, v in served.items()}
    missing = [k for k in p if k not in q_known]
    q = {k: q_known[k] for k in p if k in q_known}
    if missing:
        # the served N-th probability bounds a token outside its top N; the forced token a server adds
        # beside its top N may be smaller still, so take the N-th largest, not the smallest
        vals = sorted(q_known.values(), reverse=True)
        floor = vals[min(len(p), len(vals)) - 1] if vals else 1.0
        rest = max(0.0, 1.0 - sum(q_known.values()))
        share = min(floor, rest / (len(missing) + 1))
        for k in missing:
            q[k] = share
    p_tail = max(0.0, 1.0 - sum(p.values()))
    q_tail = max(0.0, 1.0 - sum(q.values()))
    tiny = 1e-300  # a zero served probability where the source has mass: a (huge) finite value
    kl = sum(_xlogx_ratio(pk, max(q[k], tiny)) for k, pk in p.items())
    kl += _xlogx_ratio(p_tail, max(q_tail, tiny))
    return max(kl, 0.0)


def argmax_key(top: TopLogprobs) -> TokenKey | None:
    """The most likely token of a top-N map (ties: the first listed)."""
    best: TokenKey | None = None
    best_lp = -math.inf
    for k, lp in top.items():
        if lp > best_lp:
            best, best_lp = k, lp
    return best


def is_top1(token: TokenKey, top: TopLogprobs) -> bool:
    """``token`` is a served top-1: no token of ``top`` is strictly more likely. An exact tie (bf16
    logits tie at the top now and then) counts as agreement whatever the order the server lists
    them in: vLLM and eagle3 list the forced prompt token first in echo logprobs, not by rank."""
    lp = top.get(token)
    return lp is not None and all(v <= lp for v in top.values())


@dataclass
class SequenceComparison:
    """One prompt's continuation, source vs served."""

    kld: list[float]  # per position
    top1: list[bool]  # per position: no served token is more likely than the source's (:func:`is_top1`)
    first_divergence: int | None  # first position with top1 False; None: all agree


def compare_sequence(tokens: Sequence[TokenKey], source: Sequence[TopLogprobs],
                     served: Sequence[TopLogprobs]) -> SequenceComparison:
    """Compare the source's greedy continuation ``tokens`` (with its top-N per position) with the
    served model's top-N at the same positions (teacher-forced through ``tokens``)."""
    if not len(tokens) == len(source) == len(served):
        raise ValueError(f"positions differ: {len(tokens)} tokens, {len(source)} source and {len(served)} "
                         f"served distributions")
    kld = [topn_kld(s, q) for s, q in zip(source, served, strict=True)]
    top1 = [is_top1(t, q) for t, q in zip(tokens, served, strict=True)]
    first = next((i for i, ok in enumerate(top1) if not ok), None)
    return SequenceComparison(kld, top1, first)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default), NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def kld_summary(per_token: Sequence[float]) -> dict[str, float | int]:
    """Mean / median / p99 / max per-token KLD over every compared position."""
    n = len(per_token)
    return {"tokens": n, "mean": sum(per_token) / n if n else math.nan, "median": percentile(per_token, 50),
            "p99": percentile(per_token, 99), "max": max(per_token) if n else math.nan}


def divergence_summary(firsts: Sequence[int | None]) -> dict[str, float | int | None]:
    """How many continuations agree all the way, and where the others leave the source's text."""
    div = [f for f in firsts if f is not None]
    return {"sequences": len(firsts), "identical": len(firsts) - len(div),
            "mean_first_divergence": sum(div) / len(div) if div else None,
            "min_first_divergence": min(div) if div else None}


def flips(source_correct: Sequence[bool], served_correct: Sequence[bool]) -> dict[str, float | int | None]:
    """Answer flips between two scored runs of the same questions and the paired accuracy
    difference (served - source) with its 95% interval."""
    if len(source_correct) != len(served_correct):
        raise ValueError("flips need the same questions on both sides")
    n = len(source_correct)
    d = [int(b) - int(a) for a, b in zip(source_correct, served_correct, strict=True)]
    right_to_wrong = sum(1 for x in d if x < 0)
    wrong_to_right = sum(1 for x in d if x > 0)
    mean = sum(d) / n if n else math.nan
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        half = Z95 * sd / math.sqrt(n)
        ci: list[float] | None = [mean - half, mean + half]
    else:
        ci = None
    return {"questions": n, "right_to_wrong": right_to_wrong, "wrong_to_right": wrong_to_right,
            "flips": right_to_wrong + wrong_to_right, "flip_rate": (right_to_wrong + wrong_to_right) / n if n else None,
            "source_accuracy": sum(map(int, source_correct)) / n if n else None,
            "served_accuracy": sum(map(int, served_correct)) / n if n else None,
            "accuracy_delta": mean, "accuracy_delta_ci95": ci}


def histogram(values: Sequence[float], edges: Sequence[float]) -> list[int]:
    """Counts per ``[edges[i], edges[i+1])`` bucket, the last bucket closed (for the report's plot)."""
    counts = [0] * (len(edges) - 1)
    for v in values:
        for i in range(len(edges) - 1):
            if edges[i] <= v < edges[i + 1] or (i == len(edges) - 2 and v == edges[-1]):
                counts[i] += 1
                break
    return counts
