"""BackwardSchedule: the reverse of the forward's finished order, walked by pre-backward hooks."""

from __future__ import annotations

from torch import nn

from z3kit_recipes.zero3.training.schedule import BackwardSchedule


def test_hooks_in_schedule_order_fetch_nothing_extra() -> None:
    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    schedule = BackwardSchedule([a, b, c])  # forwards finished a, b, c: backward meets c first
    assert schedule.advance_to(c) == [c]
    assert schedule.advance_to(b) == [b]
    assert schedule.advance_to(a) == [a]
    assert schedule.rest() == []


def test_passed_over_entries_come_with_the_module_and_the_rest_at_the_end() -> None:
    a, b, c, d = (nn.Linear(1, 1) for _ in range(4))
    schedule = BackwardSchedule([a, b, c, d])
    assert schedule.advance_to(b) == [d, c, b]  # d and c are ghosts: fetched although their hooks did not fire yet
    assert schedule.advance_to(c) is None  # its entry is behind the cursor: already fetched
    assert schedule.rest() == [a]  # what no hook reached is fetched at the end of backward, on every rank
    assert schedule.advance_to(a) is None


def test_a_module_called_twice_has_two_entries() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    schedule = BackwardSchedule([a, b, a])
    assert schedule.advance_to(a) == [a]
    assert schedule.advance_to(a) == [b, a]
    assert schedule.rest() == []
