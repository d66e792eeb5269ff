"""The adaptive-speculation policy (runtime/spec/adaptive.py) with stubbed cost models."""

from __future__ import annotations

import pytest

from eagle3.runtime.spec.adaptive import AcceptanceWindow, AdaptivePolicy, MeasuredCostModel


class LinearCost:
    """Target forward = fixed + per_row * batch * query_len; draft forward = draft * batch."""

    def __init__(self, fixed: float, per_row: float, draft: float) -> None:
        self.fixed, self.per_row, self.draft = fixed, per_row, draft

    def target_time(self, batch: int, query_len: int) -> float:
        return self.fixed + self.per_row * batch * query_len

    def draft_time(self, batch: int) -> float:
        return self.draft * batch


def test_drafting_that_cannot_pay_chooses_zero():
    # Every query row costs as much as a whole forward and half the drafts are accepted.
    policy = AdaptivePolicy(4, LinearCost(fixed=0.0, per_row=1.0, draft=0.5), probe_interval=0)
    for _ in range(50):
        policy.observe(1, 0)
        policy.observe(1, 1)
    assert [policy.choose(b) for b in (1, 4, 16)] == [0, 0, 0]
    assert policy.histogram == [3, 0, 0, 0, 0]


def test_cheap_verification_and_high_acceptance_drafts_the_maximum():
    policy = AdaptivePolicy(4, LinearCost(fixed=1.0, per_row=1e-4, draft=1e-4))
    for _ in range(50):
        policy.observe(4, 4)
    assert policy.choose(1) == 4


def test_low_acceptance_drafts_less_than_high_acceptance():
    cost = LinearCost(fixed=1.0, per_row=0.02, draft=0.01)
    high, low = AdaptivePolicy(5, cost), AdaptivePolicy(5, cost)
    for _ in range(200):
        high.observe(5, 5)
        low.observe(5, 0)
    assert high.best(4) > low.best(4)
    assert low.best(4) == 0


def test_batch_size_moves_the_choice():
    # Cost per row grows with the batch: drafting pays at batch 1, not at batch 64.
    policy = AdaptivePolicy(3, LinearCost(fixed=1.0, per_row=0.05, draft=0.001))
    for _ in range(100):
        policy.observe(1, 0)
        policy.observe(1, 1)
    assert policy.best(1) >= 1
    assert policy.best(64) == 0


def test_probe_runs_the_least_recently_chosen_k():
    policy = AdaptivePolicy(2, LinearCost(fixed=0.0, per_row=1.0, draft=1.0), probe_interval=3)
    for _ in range(100):
        policy.observe(1, 0)
    assert [policy.choose(1) for _ in range(9)] == [0, 0, 1, 0, 0, 2, 0, 0, 1]


def test_acceptance_window_conditional_rates():
    w = AcceptanceWindow(100)
    for _ in range(1000):  # position 1 always accepted, position 2 never
        w.observe(2, 1)
    w.observe(0, 0)  # a step that did not draft says nothing
    a1, a2 = w.conditional(2)
    assert a1 == pytest.approx(1.0, abs=0.03) and a2 == pytest.approx(0.0, abs=0.03)
    assert len(w.items) == 100
    exp = w.expected_accepted(3)
    assert exp[0] == 0.0 and exp[1] == pytest.approx(1.0, abs=0.03)
    assert exp[3] == pytest.approx(exp[2], abs=0.01)  # nothing past a rejected position


def test_window_forgets_old_acceptance():
    w = AcceptanceWindow(10)
    for _ in range(10):
        w.observe(1, 0)
    for _ in range(10):
        w.observe(1, 1)
    assert w.conditional(1)[0] > 0.8


def test_profile_interpolates_and_serving_steps_replace_what_they_measure():
    m = MeasuredCostModel(alpha=0.5)
    m.seed_target(1, 1, 1.0)
    m.seed_target(1, 5, 3.0)
    m.seed_target(4, 1, 4.0)
    m.seed_target(4, 5, 8.0)
    m.seed_draft(1, 0.1)
    m.seed_draft(4, 0.4)
    assert m.target_time(1, 3) == pytest.approx(2.0)
    assert m.target_time(2, 1) == pytest.approx(2.0)
    assert m.target_time(8, 5) == pytest.approx(16.0)  # proportional past the last bucket
    assert m.draft_time(2) == pytest.approx(0.2)
    assert not m.measured(1, 1)
    m.observe_target(1, 1, 1.5)  # a serving step: its cell is what it measured...
    assert m.measured(1, 1) and m.target_time(1, 1) == pytest.approx(1.5)
    assert m.target_time(1, 5) == pytest.approx(3.0 * 1.5)  # ... and the bucket's scale moves the rest
    m.observe_target(1, 1, 2.5)  # EMA: halfway
    assert m.target_time(1, 1) == pytest.approx(2.0)
    assert m.target_time(1, 5) == pytest.approx(3.0 * 2.0)
    assert m.target_time(4, 5) == pytest.approx(8.0)  # another bucket: unchanged
    m.observe_draft(1, 10.0)  # a stall: clipped to twice the estimate before the EMA
    assert m.draft_time(1) == pytest.approx(0.15)


def test_serving_steps_refine_the_profiled_buckets():
    # Profiled buckets 1, 2, 4 at q = 1 and 6; a serving step of 3 sequences at q = 1 refines bucket
    # 4's row instead of starting a row {1: ...} at batch 3 that would extrapolate q = 6 from q = 1.
    m = MeasuredCostModel(alpha=0.5, buckets=[1, 2, 4])
    for b, t1, t6 in ((1, 1.0, 1.1), (2, 1.0, 1.2), (4, 1.0, 1.4)):
        m.seed_target(b, 1, t1)
        m.seed_target(b, 6, t6)
    m.observe_target(3, 1, 1.2)
    assert sorted(m.target) == [1, 2, 4] and m.measured(4, 1) and m.measured(3, 1) and not m.measured(2, 1)
    assert m.target_time(4, 1) == pytest.approx(1.2)
    # between buckets 2 and 4, no extrapolation; bucket 4's q = 6 scaled by its measured 1.2
    assert m.target_time(3, 6) == pytest.approx(1.2 + (1.4 * 1.2 - 1.2) / 2)
    m.observe_draft(3, 0.2)
    assert sorted(m.draft) == [4]


def test_rows_that_do_not_bracket_the_query_length_are_not_extrapolated():
    m = MeasuredCostModel()  # no buckets: rows as observed
    m.observe_target(1, 1, 1.0)
    m.observe_target(1, 6, 1.1)
    m.observe_target(8, 1, 2.0)
    m.observe_target(8, 6, 2.4)
    m.observe_target(3, 1, 1.2)  # a sparse row (q = 1 only)
    # q = 4 at batch 3: from the rows that measured q <= 4 <= their largest q (1 and 8)
    assert m.target_time(3, 4) == pytest.approx(1.06 + (2.24 - 1.06) * 2 / 7)


def test_a_step_where_nothing_samples_chooses_nothing():
    policy = AdaptivePolicy(3, LinearCost(fixed=1.0, per_row=1e-4, draft=1e-4), probe_interval=2)
    assert policy.choose(0) == 0
    assert policy.histogram == [0, 0, 0, 0]
    assert [policy.choose(1) for _ in range(2)] == [3, 0]  # the probe counts choices, not prefill steps


@pytest.mark.parametrize("kwargs, message", [
    ({"num_speculative_tokens": "auto", "max_speculative_tokens": 0}, "max_speculative_tokens must be"),
    ({"num_speculative_tokens": "auto", "max_speculative_tokens": 9}, "max_speculative_tokens must be"),
    ({"num_speculative_tokens": "three"}, "or 'auto'"),
    ({"num_speculative_tokens": 0}, "or 'auto'"),
    ({"num_speculative_tokens": 2, "max_speculative_tokens": 4}, "goes with num_speculative_tokens='auto'"),
])
def test_engine_config_checks_the_speculative_options(kwargs, message):
    from eagle3.errors import UsageError
    from eagle3.runtime.engine.config import EngineConfig

    with pytest.raises(UsageError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_auto_ceiling():
    from eagle3.runtime.engine.config import EngineConfig

    assert EngineConfig(num_speculative_tokens="auto").max_k == 5
    assert EngineConfig(num_speculative_tokens="auto", max_speculative_tokens=2).max_k == 2
    assert EngineConfig(num_speculative_tokens=4).max_k == 4 and not EngineConfig().adaptive


def test_profile_discards_the_first_call_and_keeps_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    # A shape's first call pays one-time costs (graph capture, autotuning): it is run untimed, then
    # the fastest of the timed calls is recorded. The clock is scripted: call i takes durations[i].
    from types import SimpleNamespace

    from eagle3.runtime.engine import model_runner

    durations = iter([9.0, 3.0, 2.0])
    now = [0.0]
    calls: list[float] = []

    def fn() -> None:
        now[0] += next(durations)
        calls.append(now[0])

    monkeypatch.setattr(model_runner, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    recorded: list[float] = []
    model_runner.ModelRunner._profile(SimpleNamespace(_sync=lambda: None), fn, recorded.append)
    assert len(calls) == 3 and recorded == [2.0]


def test_a_close_k_whose_width_was_never_measured_is_tried_once():
    """The profile says k = 1 is best and k = 3 close (within EXPLORE_MARGIN), k = 5 far off; serving
    steps measured only k = 1's width. The policy tries k = 3 once; once its width is measured (here
    cheaper than the profile said, as at real contexts) it keeps it, and never tries k = 5."""
    m = MeasuredCostModel(alpha=0.5, buckets=[4])
    for q, t in enumerate((1.0, 1.0, 2.0, 2.2, 4.0, 5.0), start=1):
        m.seed_target(4, q, t)
    m.seed_draft(4, 0.1)
    policy = AdaptivePolicy(5, m, probe_interval=0)
    for _ in range(100):
        policy.observe(5, 5)  # every draft accepted: rate differences are the costs'
    m.observe_target(4, 2, 1.1)  # k = 1's verification, measured while serving
    r = policy.rates(4)
    assert policy.best(4) == 1 and r[3] >= 0.8 * r[1] and r[5] < 0.8 * r[1]
    assert policy.choose(4) == 3  # tried: its width (4 rows) is unmeasured
    m.observe_target(4, 4, 1.3)  # the next step verified 4 rows: cheaper than profiled
    assert [policy.choose(4) for _ in range(5)] == [3] * 5
    assert policy.histogram[5] == 0


def test_a_stub_cost_model_is_never_explored():
    policy = AdaptivePolicy(3, LinearCost(fixed=1.0, per_row=1e-4, draft=1e-4), probe_interval=0)
    for _ in range(50):
        policy.observe(3, 3)
    assert {policy.choose(2) for _ in range(10)} == {3}


def test_close_contenders_are_measured_again_every_recheck_interval():
    """k = 1 is best, k = 3 within EXPLORE_MARGIN, k = 5 far off, all measured: every 8th step runs
    k = 3 so that one slow measurement of it cannot keep it out; k = 5 is never run."""
    m = MeasuredCostModel(alpha=0.5, buckets=[4])
    for q, t in enumerate((1.0, 1.0, 2.0, 2.2, 4.0, 5.0), start=1):
        m.seed_target(4, q, t)
        m.observe_target(4, q, t)  # every width measured: nothing left to explore
    m.seed_draft(4, 0.1)
    policy = AdaptivePolicy(5, m, probe_interval=0, recheck_interval=8)
    for _ in range(100):
        policy.observe(5, 5)
    r = policy.rates(4)
    assert policy.best(4) == 1 and r[3] >= 0.8 * r[1] and r[5] < 0.8 * r[1]
    chosen = [policy.choose(4) for _ in range(16)]
    assert [i + 1 for i, k in enumerate(chosen) if k != 1] == [8, 16] and chosen[7] == chosen[15] == 3
    assert AdaptivePolicy(5, m, probe_interval=0, recheck_interval=0).choose(4) == 1
