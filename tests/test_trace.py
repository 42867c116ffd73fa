"""TraceRecorder: the INVALID -> RECORD -> COMPLETE state machine.

Pure bookkeeping over integer ids: every test drives the recorder directly
with fetches and checks it against a brute-force reading of the same list.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from z3kit.trace import TraceFetch, TraceRecorder, TraceState

FAST = settings(max_examples=150, deadline=None)

# Parameter ids live far from module ids and fetch indices so that a test
# that mixes them up cannot pass by coincidence.
PID0 = 1000


@st.composite
def fetch_lists(draw: st.DrawFn, min_size: int = 1, max_size: int = 8) -> list[TraceFetch]:
    """One training step's fetches; a parameter keeps one size across fetches, as a real
    parameter does, and may appear in several fetches (tied weights)."""
    n_params = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.integers(0, 50), min_size=n_params, max_size=n_params))
    n = draw(st.integers(min_size, max_size))
    fetches = []
    for _ in range(n):
        module = draw(st.integers(0, 5))
        idx = draw(st.lists(st.integers(0, n_params - 1), unique=True, max_size=4))
        fetches.append(TraceFetch(module, tuple(PID0 + i for i in idx), tuple(sizes[i] for i in idx)))
    return fetches


def state_of(rec: TraceRecorder) -> TraceState:
    # Read through a call: mypy narrows ``rec.state`` after one assert and
    # then calls the next state check (after a method call) unreachable.
    return rec.state


def run_step(rec: TraceRecorder, fetches: Sequence[TraceFetch]) -> list[bool]:
    rec.begin_step()
    results = [rec.on_fetch(f.module_id, f.param_ids, f.numels) for f in fetches]
    rec.end_step()
    return results


def recorded(fetches: Sequence[TraceFetch]) -> TraceRecorder:
    rec = TraceRecorder()
    run_step(rec, fetches)
    assert state_of(rec) is TraceState.COMPLETE
    return rec


# -- brute-force readings of a fetch list ------------------------------------


def bf_param_order(fetches: Sequence[TraceFetch]) -> list[int]:
    order: list[int] = []
    for f in fetches:
        for pid in f.param_ids:
            if pid not in order:
                order.append(pid)
    return order


def bf_last_use(fetches: Sequence[TraceFetch]) -> dict[int, int]:
    return {pid: i for i, f in enumerate(fetches) for pid in f.param_ids}


def bf_next_use(fetches: Sequence[TraceFetch], pid: int, after: int) -> int | None:
    for j in range(after + 1, len(fetches)):
        if pid in fetches[j].param_ids:
            return j
    return None


def bf_reuse_distance(fetches: Sequence[TraceFetch], pid: int, at: int) -> int | None:
    nxt = bf_next_use(fetches, pid, at)
    if nxt is None:
        return None
    return sum(sum(fetches[k].numels) for k in range(at + 1, nxt))


# -- lifecycle -----------------------------------------------------------------


def test_new_recorder_is_invalid_and_empty() -> None:
    rec = TraceRecorder()
    assert state_of(rec) is TraceState.INVALID
    assert rec.invalidations == 0
    assert rec.fetches == ()
    assert not rec.in_step
    assert rec.param_order() == [] and rec.last_use() == {}


def test_fetch_outside_a_step_is_ignored() -> None:
    rec = TraceRecorder()
    assert rec.on_fetch(1, [PID0], [4]) is False
    assert state_of(rec) is TraceState.INVALID and rec.fetches == () and rec.cursor == 0


def test_first_step_records_then_freezes() -> None:
    rec = TraceRecorder()
    rec.begin_step()
    assert state_of(rec) is TraceState.RECORD and rec.in_step
    assert rec.on_fetch(7, [PID0, PID0 + 1], [3, 5]) is False  # recording: no prefetch yet
    assert rec.on_fetch(8, [], []) is False
    assert rec.cursor == 2
    rec.end_step()
    assert state_of(rec) is TraceState.COMPLETE and not rec.in_step
    assert rec.fetches == (TraceFetch(7, (PID0, PID0 + 1), (3, 5)), TraceFetch(8, (), ()))


def test_step_without_fetches_records_nothing_and_retries() -> None:
    rec = TraceRecorder()
    run_step(rec, [])
    assert state_of(rec) is TraceState.INVALID and rec.invalidations == 0
    rec.begin_step()
    assert state_of(rec) is TraceState.RECORD


def test_nested_begin_and_stray_end_are_no_ops() -> None:
    # Hooks may call begin_step from every root module; only the first counts.
    rec = TraceRecorder()
    rec.end_step()
    assert state_of(rec) is TraceState.INVALID
    rec.begin_step()
    rec.on_fetch(1, [PID0], [2])
    rec.begin_step()  # must not reset the cursor or drop the recording
    assert rec.cursor == 1
    rec.on_fetch(2, [PID0 + 1], [3])
    rec.end_step()
    rec.end_step()
    assert state_of(rec) is TraceState.COMPLETE and len(rec.fetches) == 2 and rec.invalidations == 0


def test_explicit_invalidate_counts_only_complete_traces() -> None:
    rec = TraceRecorder()
    rec.invalidate()
    assert rec.invalidations == 0
    rec.begin_step()
    rec.on_fetch(1, [PID0], [2])
    rec.invalidate()  # while recording: drop it, nothing frozen to count
    assert rec.invalidations == 0 and state_of(rec) is TraceState.INVALID
    assert rec.on_fetch(2, [PID0], [2]) is False  # rest of this step is not recorded
    rec.end_step()
    assert state_of(rec) is TraceState.INVALID and rec.fetches == ()
    run_step(rec, [TraceFetch(3, (PID0,), (2,))])
    assert state_of(rec) is TraceState.COMPLETE
    rec.invalidate()
    assert rec.invalidations == 1 and state_of(rec) is TraceState.INVALID
    assert rec.fetches == () and rec.last_use() == {} and rec.next_use(PID0, -1) is None


# -- replay and deviation -------------------------------------------------------


@FAST
@given(fetches=fetch_lists(), replays=st.integers(1, 4))
def test_identical_replay_stays_complete(fetches: list[TraceFetch], replays: int) -> None:
    rec = recorded(fetches)
    for _ in range(replays):
        assert run_step(rec, fetches) == [True] * len(fetches)
        assert state_of(rec) is TraceState.COMPLETE
        assert rec.fetches == tuple(fetches)
        assert rec.invalidations == 0


def deviate(fetches: list[TraceFetch], kind: str, at: int) -> tuple[list[TraceFetch], int]:
    """``fetches`` changed in one way; returns it and the first differing index."""
    at = min(at, len(fetches) - 1)
    f = fetches[at]
    changed = list(fetches)
    if kind == "module":
        changed[at] = TraceFetch(f.module_id + 100, f.param_ids, f.numels)
    elif kind == "params":
        changed[at] = TraceFetch(f.module_id, (*f.param_ids, 99), (*f.numels, 1))
    elif kind == "param_order":
        if len(f.param_ids) < 2:
            changed[at] = TraceFetch(f.module_id, (99, *f.param_ids), (1, *f.numels))
        else:
            changed[at] = TraceFetch(f.module_id, f.param_ids[::-1], f.numels[::-1])
    elif kind == "numels":
        if not f.param_ids:
            changed[at] = TraceFetch(f.module_id, (99,), (1,))
        else:
            changed[at] = TraceFetch(f.module_id, f.param_ids, (f.numels[0] + 1, *f.numels[1:]))
    elif kind == "shorter":
        return fetches[:at], at
    elif kind == "longer":
        return [*fetches, TraceFetch(0, (), ())], len(fetches)
    else:
        raise AssertionError(kind)
    return changed, at


@FAST
@given(
    fetches=fetch_lists(),
    kind=st.sampled_from(["module", "params", "param_order", "numels", "shorter", "longer"]),
    at=st.integers(0, 7),
    afterwards=fetch_lists(),
)
def test_single_deviation_invalidates_once_then_rerecords(
    fetches: list[TraceFetch], kind: str, at: int, afterwards: list[TraceFetch]
) -> None:
    rec = recorded(fetches)
    changed, first_diff = deviate(fetches, kind, at)

    results = run_step(rec, changed)
    # Matches up to the deviation, and no prefetch from the deviation on.
    assert results[:first_diff] == [True] * min(first_diff, len(changed))
    assert not any(results[first_diff:])
    assert state_of(rec) is TraceState.INVALID
    assert rec.invalidations == 1
    assert rec.fetches == ()

    # The next step records afresh, whatever it is, and freezes it.
    assert run_step(rec, afterwards) == [False] * len(afterwards)
    assert state_of(rec) is TraceState.COMPLETE and rec.fetches == tuple(afterwards)
    assert run_step(rec, afterwards) == [True] * len(afterwards)
    assert rec.invalidations == 1


def test_branching_graph_costs_one_recording_per_switch() -> None:
    a = [TraceFetch(0, (PID0,), (4,)), TraceFetch(1, (PID0 + 1,), (4,))]
    b = [TraceFetch(0, (PID0,), (4,)), TraceFetch(2, (PID0 + 2,), (4,))]
    rec = TraceRecorder()
    for path in [a, a, b, b, b, a]:
        run_step(rec, path)
    # a: record, replay; b: invalidate, record, replay; a: invalidate.
    assert rec.invalidations == 2
    assert state_of(rec) is TraceState.INVALID


def test_bad_fetch_does_not_disturb_a_complete_trace() -> None:
    fetches = [TraceFetch(0, (PID0,), (4,))]
    rec = recorded(fetches)
    rec.begin_step()
    with pytest.raises(ValueError, match="numels must be >= 0"):
        rec.on_fetch(0, [PID0], [-4])
    assert state_of(rec) is TraceState.COMPLETE and rec.cursor == 0
    assert rec.on_fetch(0, [PID0], [4]) is True
    rec.end_step()
    assert state_of(rec) is TraceState.COMPLETE and rec.invalidations == 0


# -- derived views ------------------------------------------------------------------


@FAST
@given(fetches=fetch_lists())
def test_param_order_and_last_use_match_brute_force(fetches: list[TraceFetch]) -> None:
    rec = recorded(fetches)
    assert rec.param_order() == bf_param_order(fetches)
    assert rec.last_use() == bf_last_use(fetches)


@FAST
@given(fetches=fetch_lists(), data=st.data())
def test_next_use_and_reuse_distance_match_brute_force(fetches: list[TraceFetch], data: st.DataObject) -> None:
    rec = recorded(fetches)
    pids = [*bf_param_order(fetches), 7]  # 7: never fetched
    for _ in range(10):
        pid = data.draw(st.sampled_from(pids))
        at = data.draw(st.integers(-1, len(fetches) + 1))
        assert rec.next_use(pid, at) == bf_next_use(fetches, pid, at)
        assert rec.reuse_distance(pid, at) == bf_reuse_distance(fetches, pid, at)


def test_reuse_distance_counts_only_fetches_strictly_between() -> None:
    # Tied embedding: used at fetch 0 and fetch 3; 10 + 20 elements between.
    fetches = [
        TraceFetch(0, (PID0,), (100,)),
        TraceFetch(1, (PID0 + 1,), (10,)),
        TraceFetch(2, (PID0 + 2,), (20,)),
        TraceFetch(3, (PID0, PID0 + 3), (100, 5)),
    ]
    rec = recorded(fetches)
    assert rec.reuse_distance(PID0, 0) == 30
    assert rec.reuse_distance(PID0, 2) == 0
    assert rec.reuse_distance(PID0, 3) is None  # not used again within the training step
    assert rec.reuse_distance(PID0 + 1, 1) is None
    assert rec.next_use(PID0, 0) == 3
    # -1: before the first fetch; E's first use is fetch 0, nothing before it.
    assert rec.reuse_distance(PID0, -1) == 0
    assert rec.reuse_distance(PID0 + 2, -1) == 110


def test_queries_without_a_complete_trace_find_nothing() -> None:
    rec = TraceRecorder()
    rec.begin_step()
    rec.on_fetch(0, [PID0], [1])
    rec.on_fetch(1, [PID0], [1])
    assert state_of(rec) is TraceState.RECORD
    assert rec.next_use(PID0, 0) is None
    assert rec.reuse_distance(PID0, 0) is None
    assert rec.last_use() == {}


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module_id", "param_ids", "numels", "exc", "match"),
    [
        (0, [PID0, PID0 + 1], [1], ValueError, "2 parameter ids but 1 sizes"),
        (0, [PID0], [], ValueError, "1 parameter ids but 0 sizes"),
        (True, [PID0], [1], TypeError, "module_id must be an int, got bool"),
        ("m", [PID0], [1], TypeError, "module_id must be an int, got str"),
        (0, [True], [1], TypeError, "parameter ids must be ints, got bool"),
        (0, ["p"], [1], TypeError, "parameter ids must be ints, got str"),
        (0, [PID0], [-1], ValueError, "numels must be >= 0, got -1"),
        (0, [PID0], [True], TypeError, "numels must be ints, got bool"),
        (0, [PID0], [1.0], TypeError, "numels must be ints, got float"),
        (0, [PID0, PID0], [1, 1], ValueError, "duplicate parameter ids"),
    ],
)
def test_on_fetch_rejects_bad_input(
    module_id: object, param_ids: list[object], numels: list[object], exc: type[Exception], match: str
) -> None:
    rec = TraceRecorder()
    rec.begin_step()
    with pytest.raises(exc, match=match):
        rec.on_fetch(module_id, param_ids, numels)  # type: ignore[arg-type]
    assert rec.fetches == () and rec.cursor == 0  # nothing half-recorded


def test_reuse_distance_rejects_bad_index() -> None:
    rec = recorded([TraceFetch(0, (PID0,), (3,)), TraceFetch(1, (PID0,), (3,))])
    # A negative index used to read the cumulative sizes from the end.
    with pytest.raises(ValueError, match=r"at \(a fetch index\) must be >= -1, got -2"):
        rec.reuse_distance(PID0, -2)
    with pytest.raises(TypeError, match=r"at \(a fetch index\) must be an int, got bool"):
        rec.reuse_distance(PID0, True)
