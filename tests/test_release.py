"""Release policies: which of an exiting module's parameters to free.

The stock policy is checked against a brute-force reading of the frozen
trace (reuse distances recomputed from the fetch list), with no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from z3kit.release import ImmediateReleasePolicy, ReleasePolicy, StockReleasePolicy
from z3kit.trace import TraceFetch, TraceRecorder, TraceState

from tests.test_trace import bf_reuse_distance, fetch_lists, recorded

FAST = settings(max_examples=200, deadline=None)

E, A, B, C = 1000, 1001, 1002, 1003


def tied_trace() -> TraceRecorder:
    """Embedding E used at fetch 0 and again at fetch 3 (tied lm_head)."""
    return recorded(
        [
            TraceFetch(0, (E,), (100,)),
            TraceFetch(1, (A,), (10,)),
            TraceFetch(2, (B,), (20,)),
            TraceFetch(3, (E, C), (100, 5)),
        ]
    )


# -- protocol and configuration ----------------------------------------------


def test_stock_and_immediate_satisfy_the_protocol() -> None:
    assert isinstance(StockReleasePolicy(), ReleasePolicy)
    assert isinstance(ImmediateReleasePolicy(), ReleasePolicy)
    assert not isinstance(object(), ReleasePolicy)


def test_stock_defaults_match_deepspeed() -> None:
    p = StockReleasePolicy()
    assert p.max_reuse_distance == 1_000_000_000
    assert p.param_persistence_threshold == 100_000
    assert p.max_live_parameters == 1_000_000_000


@pytest.mark.parametrize("field", ["max_reuse_distance", "param_persistence_threshold", "max_live_parameters"])
@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (-1, ValueError, "must be >= 0, got -1"),
        (True, TypeError, "must be an int, got bool"),
        (1.5, TypeError, "must be an int, got float"),
        ("10", TypeError, "must be an int, got str"),
    ],
)
def test_stock_rejects_bad_config(field: str, value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=f"{field} {match}"):
        StockReleasePolicy(**{field: value})  # type: ignore[arg-type]


def test_stock_is_frozen() -> None:
    p = StockReleasePolicy()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.max_reuse_distance = 5  # type: ignore[misc]


def test_persistence_threshold_is_strict() -> None:
    p = StockReleasePolicy(param_persistence_threshold=100)
    assert p.is_persistent(99) and p.is_persistent(0)
    assert not p.is_persistent(100) and not p.is_persistent(101)
    assert not StockReleasePolicy(param_persistence_threshold=0).is_persistent(0)


# -- stock policy: examples ------------------------------------------------------


@pytest.mark.parametrize("state", ["invalid", "record"])
def test_stock_releases_all_without_a_complete_trace(state: str) -> None:
    trace = TraceRecorder()
    if state == "record":
        trace.begin_step()
        trace.on_fetch(0, [A, B], [10, 10])
        trace.on_fetch(1, [A, B], [10, 10])
    assert trace.state is TraceState(state)
    p = StockReleasePolicy(param_persistence_threshold=0)
    assert p.to_release(0, [(A, 10), (B, 10)], trace, live_numel=20) == [A, B]


def test_stock_keeps_tied_weight_within_window() -> None:
    trace = tied_trace()
    p = StockReleasePolicy(max_reuse_distance=31, param_persistence_threshold=0)
    assert p.to_release(0, [(E, 100)], trace, live_numel=100) == []
    # At the last fetch E is not used again in the training step: release.
    assert p.to_release(3, [(E, 100), (C, 5)], trace, live_numel=105) == [E, C]


def test_stock_reuse_window_is_strict() -> None:
    # E's reuse distance from fetch 0 is exactly 30 elements.
    trace = tied_trace()
    assert trace.reuse_distance(E, 0) == 30
    assert StockReleasePolicy(max_reuse_distance=31, param_persistence_threshold=0).to_release(0, [(E, 100)], trace, 100) == []
    assert StockReleasePolicy(max_reuse_distance=30, param_persistence_threshold=0).to_release(0, [(E, 100)], trace, 100) == [E]


def test_stock_zero_reuse_distance_keeps_nothing_for_reuse() -> None:
    # As in DeepSpeed, 0 turns reuse-keeping off, even for a parameter used
    # by the very next fetch (distance 0).
    trace = recorded([TraceFetch(0, (A,), (10,)), TraceFetch(1, (A,), (10,))])
    assert trace.reuse_distance(A, 0) == 0
    p = StockReleasePolicy(max_reuse_distance=0, param_persistence_threshold=0)
    assert p.to_release(0, [(A, 10)], trace, live_numel=10) == [A]
    assert StockReleasePolicy(max_reuse_distance=1, param_persistence_threshold=0).to_release(0, [(A, 10)], trace, 10) == []


def test_stock_fetch_minus_one_reads_the_whole_trace_ahead() -> None:
    # A caller with no fetch index for the module passes -1: E's first use
    # (fetch 0) is 0 elements away, B's (fetch 2) 110.
    p = StockReleasePolicy(max_reuse_distance=100, param_persistence_threshold=0)
    assert p.to_release(-1, [(E, 100), (B, 20)], tied_trace(), live_numel=120) == [B]


def test_stock_never_releases_persistent_parameters() -> None:
    p = StockReleasePolicy(param_persistence_threshold=50)
    assert p.to_release(0, [(A, 10), (B, 60)], TraceRecorder(), live_numel=70) == [B]
    assert p.to_release(3, [(E, 100), (C, 5)], tied_trace(), live_numel=105) == [E]


def test_stock_live_bound_ignores_parameter_order() -> None:
    # A is reused at the next fetch, B never: releasing B alone brings the
    # live total to 10 <= 15, so A stays, whichever comes first.
    trace = recorded([TraceFetch(0, (A, B), (10, 10)), TraceFetch(1, (A,), (10,))])
    p = StockReleasePolicy(max_reuse_distance=100, param_persistence_threshold=0, max_live_parameters=15)
    assert p.to_release(0, [(A, 10), (B, 10)], trace, live_numel=20) == [B]
    assert p.to_release(0, [(B, 10), (A, 10)], trace, live_numel=20) == [B]
    # The bound is inclusive: 10 live of 10 still fits.
    assert attrs.evolve(p, max_live_parameters=10).to_release(0, [(A, 10), (B, 10)], trace, live_numel=20) == [B]
    # With the bound at 9 A has to go too.
    tight = attrs.evolve(p, max_live_parameters=9)
    assert tight.to_release(0, [(A, 10), (B, 10)], trace, live_numel=20) == [A, B]


# -- stock policy: properties -----------------------------------------------------


@FAST
@given(
    fetches=fetch_lists(min_size=2),
    data=st.data(),
    window=st.integers(0, 120),
    threshold=st.integers(0, 60),
    max_live=st.integers(0, 300),
    extra_live=st.integers(0, 200),
)
def test_stock_policy_against_brute_force(
    fetches: list[TraceFetch],
    data: st.DataObject,
    window: int,
    threshold: int,
    max_live: int,
    extra_live: int,
) -> None:
    trace = recorded(fetches)
    fetch = data.draw(st.integers(0, len(fetches) - 1))
    params = list(zip(fetches[fetch].param_ids, fetches[fetch].numels))
    params = data.draw(st.permutations(params))
    live = sum(n for _, n in params) + extra_live
    p = StockReleasePolicy(max_reuse_distance=window, param_persistence_threshold=threshold, max_live_parameters=max_live)

    released = p.to_release(fetch, params, trace, live)

    candidates = [(pid, n) for pid, n in params if n >= threshold]
    # Only non-persistent candidates, each once, in the order given.
    assert released == [pid for pid, _ in candidates if pid in released]

    def reused(pid: int) -> bool:
        d = bf_reuse_distance(fetches, pid, fetch)
        return d is not None and d < window

    eligible = [(pid, n) for pid, n in candidates if reused(pid)]
    # Everything not reused within the window goes.
    for pid, _ in candidates:
        if not reused(pid):
            assert pid in released
    live_after_must = live - sum(n for pid, n in candidates if not reused(pid))
    dropped = [pid for pid, _ in eligible if pid in released]
    # Reused parameters are dropped in order, and only while the live total
    # (after the ones that go anyway) is over the bound.
    assert dropped == [pid for pid, _ in eligible[: len(dropped)]]
    live_before_last = live_after_must - sum(n for _, n in eligible[: max(len(dropped) - 1, 0)])
    if dropped:
        assert live_before_last > max_live
    if len(dropped) < len(eligible):
        assert live_after_must - sum(n for _, n in eligible[: len(dropped)]) <= max_live


@FAST
@given(fetches=fetch_lists(min_size=2), data=st.data(), max_live=st.integers(0, 300))
def test_stock_policy_keeps_within_live_bound(fetches: list[TraceFetch], data: st.DataObject, max_live: int) -> None:
    # The headline property alone: if anything is kept for reuse, the live
    # total after the release is within max_live_parameters.
    trace = recorded(fetches)
    fetch = data.draw(st.integers(0, len(fetches) - 1))
    params = list(zip(fetches[fetch].param_ids, fetches[fetch].numels))
    live = sum(n for _, n in params) + data.draw(st.integers(0, 200))
    p = StockReleasePolicy(max_reuse_distance=10**9, param_persistence_threshold=0, max_live_parameters=max_live)
    released = p.to_release(fetch, params, trace, live)
    kept = [pid for pid, _ in params if pid not in released]
    if kept:
        assert live - sum(n for pid, n in params if pid in released) <= max_live


# -- immediate policy ---------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(fetches=fetch_lists(min_size=2), numel=st.integers(0, 10**12))
def test_immediate_releases_everything(fetches: list[TraceFetch], numel: int) -> None:
    p = ImmediateReleasePolicy()
    assert not p.is_persistent(numel)
    params = list(zip(fetches[0].param_ids, fetches[0].numels))
    live = sum(n for _, n in params)
    assert p.to_release(0, params, recorded(fetches), live) == [pid for pid, _ in params]
    assert p.to_release(0, params, TraceRecorder(), live) == [pid for pid, _ in params]


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fetch", "params", "live", "exc", "match"),
    [
        (-2, [(A, 1)], 1, ValueError, "fetch must be >= -1, got -2"),
        (True, [(A, 1)], 1, TypeError, "fetch must be an int, got bool"),
        (0, [(A, -1)], 1, ValueError, "parameter numels must be >= 0, got -1"),
        (0, [(A, True)], 1, TypeError, "parameter numels must be ints, got bool"),
        (0, [(A, 1.0)], 1, TypeError, "parameter numels must be ints, got float"),
        (0, [("a", 1)], 1, TypeError, "parameter ids must be ints, got str"),
        (0, [(A, 1)], True, TypeError, "live_numel must be an int, got bool"),
        (0, [(A, 5), (B, 5)], 9, ValueError, "live_numel 9 is less than the 10 elements of params"),
    ],
)
def test_stock_to_release_rejects_bad_input(
    fetch: object, params: Sequence[tuple[object, object]], live: object, exc: type[Exception], match: str
) -> None:
    p = StockReleasePolicy(param_persistence_threshold=0)
    with pytest.raises(exc, match=match):
        p.to_release(fetch, params, tied_trace(), live)  # type: ignore[arg-type]
