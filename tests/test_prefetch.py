"""PrefetchLimiter: the prefetch budget under its three limits.

Plain counters; a hypothesis state machine plays a caller that issues
demand fetches and prefetches (the latter only within ``budget()``), waits
on them and releases, and checks the limiter against a model of its own.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from z3kit.prefetch import PrefetchLimiter


def test_defaults_match_deepspeed() -> None:
    lim = PrefetchLimiter()
    assert (lim.max_live_parameters, lim.prefetch_bucket_size, lim.max_inflight) == (1_000_000_000, 50_000_000, 2)
    assert (lim.live_numel, lim.inflight, lim.high_water) == (0, 0, 0)
    assert lim.budget() == 50_000_000


def test_budget_is_the_tightest_of_the_three_limits() -> None:
    lim = PrefetchLimiter(max_live_parameters=100, prefetch_bucket_size=30, max_inflight=2)
    assert lim.budget() == 30  # bucket size
    lim.on_gather(80)
    assert lim.budget() == 20  # headroom under max_live_parameters
    lim.on_gather(20)
    assert lim.inflight == 2 and lim.budget() == 0  # fetch slots (and headroom)
    lim.on_gather_done()
    lim.on_gather_done()
    assert lim.budget() == 0  # still no headroom: 100 live of 100
    lim.on_release(50)
    assert lim.budget() == 30
    lim.on_gather(0)
    lim.on_gather(0)
    assert lim.budget() == 0  # two fetches in flight, plenty of headroom


def test_demand_fetch_may_exceed_the_bound_and_budget_stays_zero() -> None:
    # A demand fetch is always allowed; afterwards prefetch must wait.
    lim = PrefetchLimiter(max_live_parameters=10, prefetch_bucket_size=10)
    lim.on_gather(25)
    lim.on_gather_done()
    assert lim.live_numel == 25 and lim.budget() == 0
    lim.on_release(20)
    assert lim.budget() == 5


def test_zero_bucket_disables_prefetch() -> None:
    lim = PrefetchLimiter(prefetch_bucket_size=0)
    assert lim.budget() == 0


def test_high_water_tracks_peak_and_resets_to_live() -> None:
    lim = PrefetchLimiter()
    lim.on_gather(40)
    lim.on_gather(60)
    lim.on_release(70)
    assert (lim.live_numel, lim.high_water) == (30, 100)
    lim.reset_high_water()
    assert lim.high_water == 30
    lim.on_gather(5)
    assert lim.high_water == 35


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "least"), [("max_live_parameters", 0), ("prefetch_bucket_size", 0), ("max_inflight", 1)]
)
@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (-1, ValueError, "must be >= {least}, got -1"),
        (True, TypeError, "must be an int, got bool"),
        (2.0, TypeError, "must be an int, got float"),
    ],
)
def test_rejects_bad_config(field: str, least: int, value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=f"PrefetchLimiter.{field} {match.format(least=least)}"):
        PrefetchLimiter(**{field: value})  # type: ignore[arg-type]


def test_max_inflight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_inflight must be >= 1, got 0"):
        PrefetchLimiter(max_inflight=0)


def test_config_is_validated_on_assignment_too() -> None:
    lim = PrefetchLimiter()
    with pytest.raises(ValueError, match="max_live_parameters must be >= 0, got -5"):
        lim.max_live_parameters = -5
    with pytest.raises(ValueError, match="max_inflight must be >= 1, got 0"):
        lim.max_inflight = 0


@pytest.mark.parametrize("method", ["on_gather", "on_release"])
@pytest.mark.parametrize(
    ("numel", "exc", "match"),
    [
        (-1, ValueError, "numel must be >= 0, got -1"),
        (True, TypeError, "numel must be an int, got bool"),
        (1.0, TypeError, "numel must be an int, got float"),
        (None, TypeError, "numel must be an int, got NoneType"),
    ],
)
def test_counters_reject_bad_numel(method: str, numel: object, exc: type[Exception], match: str) -> None:
    lim = PrefetchLimiter()
    lim.on_gather(10)
    with pytest.raises(exc, match=match):
        getattr(lim, method)(numel)
    assert (lim.live_numel, lim.inflight, lim.high_water) == (10, 1, 10)


def test_release_more_than_live_is_refused() -> None:
    lim = PrefetchLimiter()
    lim.on_gather(10)
    with pytest.raises(ValueError, match="cannot release 11 elements with 10 live"):
        lim.on_release(11)
    assert lim.live_numel == 10


def test_gather_done_without_gather_is_refused() -> None:
    lim = PrefetchLimiter()
    with pytest.raises(ValueError, match="on_gather_done without a gather in flight"):
        lim.on_gather_done()
    lim.on_gather(1)
    lim.on_gather_done()
    with pytest.raises(ValueError, match="on_gather_done without a gather in flight"):
        lim.on_gather_done()
    assert lim.inflight == 0


# -- state machine ---------------------------------------------------------------------


class LimiterMachine(RuleBasedStateMachine):
    """A caller that respects ``budget()`` for prefetches, against a model.

    ``demand`` is switched per run: without demand fetches the limits are
    hard bounds; with them only the budget's answers are.
    """

    lim: PrefetchLimiter

    @initialize(
        max_live=st.integers(0, 200),
        bucket=st.integers(0, 80),
        max_inflight=st.integers(1, 4),
        demand=st.booleans(),
    )
    def setup(self, max_live: int, bucket: int, max_inflight: int, demand: bool) -> None:
        self.lim = PrefetchLimiter(max_live_parameters=max_live, prefetch_bucket_size=bucket, max_inflight=max_inflight)
        self.demand = demand
        self.live = 0
        self.inflight = 0
        self.peak = 0

    def _gathered(self, numel: int) -> None:
        self.lim.on_gather(numel)
        self.live += numel
        self.inflight += 1
        self.peak = max(self.peak, self.live)

    @precondition(lambda self: self.lim.budget() > 0)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        self._gathered(data.draw(st.integers(1, self.lim.budget())))

    @precondition(lambda self: self.demand)
    @rule(numel=st.integers(0, 120))
    def demand_fetch(self, numel: int) -> None:
        self._gathered(numel)

    @precondition(lambda self: self.inflight > 0)
    @rule()
    def wait(self) -> None:
        self.lim.on_gather_done()
        self.inflight -= 1

    @precondition(lambda self: self.live > 0)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        numel = data.draw(st.integers(1, self.live))
        self.lim.on_release(numel)
        self.live -= numel

    @rule()
    def reset_high_water(self) -> None:
        self.lim.reset_high_water()
        self.peak = self.live

    @invariant()
    def counters_match_model(self) -> None:
        assert (self.lim.live_numel, self.lim.inflight, self.lim.high_water) == (self.live, self.inflight, self.peak)

    @invariant()
    def high_water_covers_live(self) -> None:
        assert self.lim.high_water >= self.lim.live_numel

    @invariant()
    def budget_matches_limits(self) -> None:
        lim = self.lim
        b = lim.budget()
        assert 0 <= b <= lim.prefetch_bucket_size
        assert lim.live_numel + b <= max(lim.max_live_parameters, lim.live_numel)
        if lim.inflight >= lim.max_inflight:
            assert b == 0
        else:
            assert b == max(0, min(lim.prefetch_bucket_size, lim.max_live_parameters - lim.live_numel))

    @invariant()
    def prefetch_only_stays_within_limits(self) -> None:
        if not self.demand:
            assert self.lim.live_numel <= self.lim.max_live_parameters
            assert self.lim.high_water <= self.lim.max_live_parameters
            assert self.lim.inflight <= self.lim.max_inflight


TestLimiterMachine = LimiterMachine.TestCase
TestLimiterMachine.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
