"""Adaptive speculation (``num_speculative_tokens="auto"``): the draft length ``k`` in ``0..max_k``
for each engine step, chosen to maximise the expected tokens per second of the batch.

Per step and sequence, a chain of ``k`` drafts yields ``1 + sum_{i=1..k} prod_{j<=i} a_j`` tokens
(the bonus / recovered token always comes), where ``a_j`` is the acceptance of draft position
``j`` given that positions ``1..j-1`` were accepted, observed over a recent window of verifications
(:class:`AcceptanceWindow`). The step costs the target forward over ``k + 1`` query rows per
sequence plus the draft forwards: draft step 0 runs over the committed positions at every ``k``
(k = 0 included: it keeps the draft's KV cache complete, so acceptance is unchanged when drafting
resumes) and yields the first draft; steps ``1..k-1`` are one more draft forward each. So

    rate(k) = (1 + E[accepted | k]) / (T(B, k + 1) + max(k, 1) * D(B))

with ``T`` / ``D`` from a :class:`CostModel`. :class:`MeasuredCostModel` is the engine's own: a
start-up profile over the batch buckets (dummy forwards at every query length,
``ModelRunner.profile_costs``), then EMAs of the step times measured while serving. Anything with ``target_time`` and
``draft_time`` can stand in for it (tests stub it).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

# With no observation yet, position j is assumed accepted with this probability (optimistic, so
# that a fresh engine drafts and measures); PRIOR_WEIGHT pseudo-observations keep a handful of
# real verifications from being overruled. A position never reached yet takes the estimate of the
# position before it (acceptance decays with depth, never rises much).
PRIOR_ACCEPTANCE = 0.8
PRIOR_WEIGHT = 2.0
WINDOW = 512  # verifications kept (a few steps of a large batch; dozens at batch 1)
EMA_ALPHA = 0.2  # weight of a new step-time measurement
# A measurement further than this factor from the estimate is clipped to it before the EMA: on a
# shared machine single steps stall 10x when another process runs; a real change of cost still
# moves the estimate by up to (1 + alpha * (CLIP - 1)) per step.
CLIP = 2.0
# Every PROBE_INTERVAL-th step runs the k chosen least recently instead of the best one: its step
# time is measured again under the machine's present load (a k never chosen keeps the figure of
# its last measurement, possibly from a quieter or busier moment), and after a run of k = 0 steps
# the acceptance window gets fresh verifications. Costs at most 1/64 of the steps at another k;
# 0 disables it.
PROBE_INTERVAL = 64
# A k whose verification width no serving step has measured in this batch bucket is tried once
# when its expected rate (from the profile) is within this fraction of the best: the profile ran
# at one context length, and the relative cost of query lengths moves with the context.
EXPLORE_MARGIN = 0.2
# Every RECHECK_INTERVAL-th step runs, instead of the best k, the close contender (rate within
# EXPLORE_MARGIN of the best) chosen least recently: one measurement of a cell taken in a slow
# moment of a shared machine otherwise keeps a good k out until the next PROBE_INTERVAL probe
# (measured: at batch 1 auto held k = 4 while static k = 3 and 5 ran faster). Costs at most 1/8 of
# the steps at a k expected within 20% of the best; 0 disables it.
RECHECK_INTERVAL = 8


class CostModel(Protocol):
    def target_time(self, batch: int, query_len: int) -> float:
        """Seconds of one target forward over ``batch`` sequences of ``query_len`` rows each."""

    def draft_time(self, batch: int) -> float:
        """Seconds of one draft forward over ``batch`` sequences (one row each)."""


def _interp(keys: list[int], values: list[float], x: int) -> float:
    """Piecewise-linear in ``x`` through the sorted ``keys``; proportional above the last key
    (step time grows about linearly with rows once the batch fills the machine), flat below the first."""
    if x <= keys[0]:
        return values[0]
    if x >= keys[-1]:
        return values[-1] * x / keys[-1]
    i = bisect.bisect_left(keys, x)
    if keys[i] == x:
        return values[i]
    x0, x1, y0, y1 = keys[i - 1], keys[i], values[i - 1], values[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class MeasuredCostModel:
    """Step times measured by the engine.

    The start-up profile (:meth:`seed_target`, :meth:`seed_draft`) measures every batch bucket at
    every query length and one draft step, at one context length. Serving steps
    (:meth:`observe_target`, :meth:`observe_draft`) then keep an EMA of each (bucket, query length)
    they measure, which replaces the profiled figure, and a per-bucket *scale* (EMA of measured /
    profiled time) that carries the difference to the query lengths not measured while serving:
    real contexts are longer than the profile's and the machine's load changes, and a profiled
    figure left as it was looked cheaper than the measured ones (measured at batch 4 on the CPU
    before this: the policy chose k = 1 in 21 of 27 steps, k = 3 being the best static setting).
    The scale is only a guess for those cells (their relative cost changes with the context too),
    so :class:`AdaptivePolicy` also tries a k whose cell is unmeasured when its rate is close to the
    best (:meth:`measured`).

    A step over ``b`` sequences belongs to the smallest of ``buckets`` holding ``b`` (the batch
    sizes the profile measured; a CUDA graph runs a batch padded to its bucket, and eager steps of
    nearby sizes cost about the same). A bucket or query length the profile did not reach is
    seeded by the first serving step that measures it."""

    alpha: float = EMA_ALPHA
    buckets: list[int] = field(default_factory=list)  # sorted; empty: every batch size is its own row
    target: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> query_len -> profiled s
    draft: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of one draft step
    served: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> query_len -> serving EMA
    target_scale: dict[int, float] = field(default_factory=dict)  # bucket -> served / profiled

    def bucket(self, batch: int) -> int:
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else batch

    def seed_target(self, batch: int, query_len: int, seconds: float) -> None:
        """A profiled target forward."""
        row = self.target.setdefault(self.bucket(batch), {})
        row[query_len] = self._ema(row.get(query_len), seconds)

    def seed_draft(self, batch: int, seconds: float) -> None:
        """A profiled draft step."""
        b = self.bucket(batch)
        self.draft[b] = self._ema(self.draft.get(b), seconds)

    def observe_target(self, batch: int, query_len: int, seconds: float) -> None:
        """A serving step's target forward."""
        b = self.bucket(batch)
        row = self.target.get(b)
        if row is None or not min(row) <= query_len <= max(row):
            self.seed_target(batch, query_len, seconds / self.target_scale.get(b, 1.0))
            return
        self.target_scale[b] = self._ema(self.target_scale.get(b), seconds / self._target_at(b, query_len))
        cells = self.served.setdefault(b, {})
        cells[query_len] = self._ema(cells.get(query_len), seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        """A serving step's draft step (the proposer's time per draft forward)."""
        self.seed_draft(batch, seconds)

    def measured(self, batch: int, query_len: int) -> bool:
        """Whether a serving step measured this (bucket, query length)."""
        return query_len in self.served.get(self.bucket(batch), {})

    def _ema(self, old: float | None, x: float) -> float:
        if old is None:
            return x
        x = min(max(x, old / CLIP), old * CLIP)
        return old + self.alpha * (x - old)

    @property
    def ready(self) -> bool:
        return bool(self.target) and bool(self.draft)

    def _target_at(self, batch: int, query_len: int) -> float:
        row = self.target[batch]
        qs = sorted(row)
        return _interp(qs, [row[q] for q in qs], query_len)

    def _estimate(self, batch: int, query_len: int) -> float:
        served = self.served.get(batch, {}).get(query_len)
        if served is not None:
            return served
        return self._target_at(batch, query_len) * self.target_scale.get(batch, 1.0)

    def target_time(self, batch: int, query_len: int) -> float:
        # Rows whose measured query lengths bracket ``query_len`` interpolate it; the others would
        # extrapolate, so they are used only when no row brackets it.
        covering = sorted(b for b, row in self.target.items() if min(row) <= query_len <= max(row))
        bs = covering or sorted(self.target)
        return _interp(bs, [self._estimate(b, query_len) for b in bs], batch)

    def draft_time(self, batch: int) -> float:
        bs = sorted(self.draft)
        return _interp(bs, [self.draft[b] for b in bs], batch)


class AcceptanceWindow:
    """The last ``size`` verifications as (drafts proposed, drafts accepted)."""

    def __init__(self, size: int = WINDOW) -> None:
        self.items: deque[tuple[int, int]] = deque(maxlen=size)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts > 0:  # only steps that drafted say anything about acceptance
            self.items.append((num_drafts, num_accepted))

    def conditional(self, max_k: int) -> list[float]:
        """``a_j`` for j = 1..max_k: accepted at j among the verifications that reached j
        (drafted >= j tokens with the first j - 1 accepted), shrunk towards the prior."""
        rates: list[float] = []
        prior = PRIOR_ACCEPTANCE
        for j in range(1, max_k + 1):
            reached = sum(1 for d, a in self.items if d >= j and a >= j - 1)
            accepted = sum(1 for _, a in self.items if a >= j)
            rate = (accepted + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)
            rates.append(rate)
            prior = rate
        return rates

    def expected_accepted(self, max_k: int) -> list[float]:
        """Expected accepted drafts for k = 0..max_k."""
        out, run, total = [0.0], 1.0, 0.0
        for a in self.conditional(max_k):
            run *= a
            total += run
            out.append(total)
        return out


class AdaptivePolicy:
    """Chooses k per step (:meth:`choose`) and records what it chose (``histogram[k]``)."""

    def __init__(self, max_k: int, cost: CostModel | None = None, window: int = WINDOW,
                 probe_interval: int = PROBE_INTERVAL, recheck_interval: int = RECHECK_INTERVAL) -> None:
        self.max_k = max_k
        self.cost: CostModel = cost if cost is not None else MeasuredCostModel()
        self.acceptance = AcceptanceWindow(window)
        self.probe_interval = probe_interval
        self.recheck_interval = recheck_interval
        self.histogram = [0] * (max_k + 1)  # steps that chose k = 0..max_k
        self._steps = 0
        self._last_chosen = [-1] * (max_k + 1)  # step at which each k last ran

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(num_drafts, num_accepted)

    def rates(self, batch: int) -> list[float]:
        """Expected tokens per second of the batch for k = 0..max_k."""
        acc = self.acceptance.expected_accepted(self.max_k)
        d = self.cost.draft_time(batch)
        return [batch * (1.0 + acc[k]) / max(self.cost.target_time(batch, k + 1) + max(k, 1) * d, 1e-12)
                for k in range(self.max_k + 1)]

    def best(self, batch: int) -> int:
        """The k of the highest expected rate (the smallest k on a tie: drafting must pay)."""
        return _argmax(self.rates(batch))

    def choose(self, batch: int) -> int:
        """k for a step whose next verification has ``batch`` sequences; counted in the histogram
        (a step where no sequence samples chooses nothing: 0, not counted)."""
        if batch <= 0:
            return 0  # nothing samples (prefill chunks only): no choice made, nothing counted
        self._steps += 1
        r = self.rates(batch)  # once per step: every rule below reads the same rates
        k = self._unmeasured_contender(batch, r)
        if k is None:
            k = _argmax(r)
            if self.recheck_interval and self._steps % self.recheck_interval == 0:
                k = self._stale_contender(k, r)
        if self.probe_interval and self._steps % self.probe_interval == 0:
            k = min(range(self.max_k + 1), key=lambda j: self._last_chosen[j])
        self._last_chosen[k] = self._steps
        self.histogram[k] += 1
        return k

    def _unmeasured_contender(self, batch: int, r: list[float]) -> int | None:
        """The best-rated k whose verification (k + 1 query rows) no serving step measured in this
        batch bucket, if its rate ``r[k]`` is within EXPLORE_MARGIN of the best; None otherwise (or
        when the cost model does not say what it measured: a stub)."""
        measured = getattr(self.cost, "measured", None)
        if measured is None:
            return None
        top = max(r)
        open_ = [k for k in range(self.max_k + 1) if not measured(batch, k + 1) and r[k] >= (1 - EXPLORE_MARGIN) * top]
        return _argmax(r, open_) if open_ else None

    def _stale_contender(self, best: int, r: list[float]) -> int:
        """The close contender of ``best`` (rate within EXPLORE_MARGIN) chosen least recently, or
        ``best`` when there is none (or the cost model measures nothing itself: a stub)."""
        if getattr(self.cost, "measured", None) is None:
            return best
        close = [k for k in range(self.max_k + 1) if k != best and r[k] >= (1 - EXPLORE_MARGIN) * r[best]]
        return min(close, key=lambda k: self._last_chosen[k]) if close else best

    def histogram_line(self) -> str:
        """``k 0/1/2/3: 10.00/0.00/5.00/85.00%`` of the steps."""
        n = sum(self.histogram) or 1
        ks = "/".join(str(k) for k in range(self.max_k + 1))
        return f"k {ks}: " + "/".join(f"{100 * c / n:.2f}" for c in self.histogram) + "%"

    @property
    def mean_k(self) -> float:
        n = sum(self.histogram)
        return sum(k * c for k, c in enumerate(self.histogram)) / n if n else 0.0


def _argmax(r: list[float], ks: list[int] | None = None) -> int:
    """The k (of ``ks``, default all) with the highest rate, the smallest k on a tie."""
    return max(range(len(r)) if ks is None else ks, key=lambda k: (r[k], -k))
