"""Planners on hand-built steps, without a process group (``z3kit.schedule_plan``).

Each example planner (``z3kit_recipes.planners``) is checked for what it
promises on a chain and on a root in flight around its blocks; the plan
checker is checked to refuse what would break a step, naming the planner,
the unit and the id; the stock planner is checked on a step against what
its replay must do. The runtime's side (parity with DDP, the effect in
``stats()``, the stock planner reproducing the old sequence) is in
``tests/test_zero3_planners.py``.
"""

from __future__ import annotations

import pytest

from z3kit.policy_planner import StockPlanner
from z3kit.recorded_step import Phase, RecordedStep
from z3kit.schedule_plan import PlanError, SchedulePlan, SchedulePlanner, check_plan, own_releases
from z3kit.testing import StepBuilder, root_around_blocks
from z3kit_recipes.planners import KeepLastUnits, KeepUnitsGathered, MemoryBudget, PrefetchAhead

CHAIN = RecordedStep.chain([("emb", [0]), ("b0", [1, 2]), ("b1", [3, 4]), ("head", [5])],
                           [100, 50, 50, 50, 50, 100])


def _live_after_each_event(plan: SchedulePlan, step: RecordedStep) -> list[int]:
    return [int(line.rsplit("live ", 1)[1].replace(",", "")) for line in plan.describe(step).splitlines()]


@pytest.mark.parametrize("planner", [KeepLastUnits(2), PrefetchAhead(1), MemoryBudget(700), StockPlanner()])
@pytest.mark.parametrize("step", [CHAIN, root_around_blocks()], ids=["chain", "root_around_blocks"])
def test_every_example_planner_is_a_planner_and_its_plans_pass_the_check(planner: SchedulePlanner,
                                                                         step: RecordedStep) -> None:
    assert isinstance(planner, SchedulePlanner)
    plan = planner.plan(step)
    summary = check_plan(plan, step, repr(planner))
    assert summary.peak_live_numel == max(_live_after_each_event(plan, step))


def test_keep_last_units_keeps_the_last_k_and_k0_is_the_fallback() -> None:
    assert KeepLastUnits(0).plan(CHAIN).release == tuple(own_releases(CHAIN))
    plan = KeepLastUnits(2).plan(CHAIN)
    assert plan.release[2] == (0,)  # b1's exit lets emb go: three units exited
    assert plan.release[3] == (1, 2)  # head's lets b0 go
    # the forward's last two units (b1, head) are still gathered when backward fetches them: no gather there
    live = _live_after_each_event(plan, CHAIN)
    assert live[7] == live[8] == live[10] == 200
    assert plan.release[6] == (5,)  # b0's backward exit: head is the least recent of three
    assert check_plan(plan, CHAIN, "k2").prefetches == 0


def test_keep_units_gathered_keeps_the_named_units_from_step_to_step() -> None:
    step = root_around_blocks(blocks=3)  # '<root>' (#0) in flight around blocks.0-2 (#1-#6), 100 elements each
    plan = KeepUnitsGathered(("blocks.1", "blocks")).plan(step)  # "blocks" covers the units under it
    assert plan.keep_units == ("blocks.1", "blocks.0", "blocks.2")
    assert not {p for ids in plan.release for p in ids} & set(range(1, 7))  # never released
    summary = check_plan(plan, step, "keep")
    assert (summary.kept, summary.kept_numel, summary.peak_live_numel) == (frozenset(range(1, 7)), 600, 1000)
    # each block gathered in forward and in backward (6), instead one gather after the optimizer step
    assert summary.saved_gathers == 5
    assert plan.describe(step).splitlines()[0] == ("kept gathered across steps: blocks.1, blocks.0, blocks.2 "
                                                   "(#1,#2,#3,#4,#5,#6), 600 elements")
    assert check_plan(KeepUnitsGathered(()).plan(step), step, "none") == check_plan(
        SchedulePlan.of([()] * len(step.fetches), own_releases(step)), step, "fallback")


def test_keeping_units_is_checked() -> None:
    step = root_around_blocks(blocks=2)
    with pytest.raises(PlanError, match=r"^planner keep keeps unit 'blocks' gathered across steps, but the step has "
                                        r"no unit of that name \(its units: '<root>', 'blocks.0', 'blocks.1'\)$"):
        check_plan(SchedulePlan.of([()] * len(step.fetches), own_releases(step), keep_units=["blocks"]), step, "keep")
    with pytest.raises(PlanError, match=r"releases parameter #1 at the exit of 'blocks.0' \(exit 0\), but keeps it "
                                        r"gathered across steps \(keep_units \['blocks.0'\]\)"):
        check_plan(SchedulePlan.of([()] * len(step.fetches), own_releases(step), keep_units=["blocks.0"]), step, "k")
    with pytest.raises(PlanError, match="keeps unit 'lm_head' gathered"):
        check_plan(KeepUnitsGathered(["lm_head"]).plan(step), step, "keep")
    with pytest.raises(TypeError, match=r"got the string 'blocks.0': use \('blocks.0',\)"):
        KeepUnitsGathered("blocks.0")  # type: ignore[arg-type]


def test_prefetch_ahead_gathers_the_next_n_units() -> None:
    plan = PrefetchAhead(2).plan(CHAIN)
    assert plan.prefetch[0] == (1, 2, 3, 4)
    assert plan.prefetch[3] == (5, 3, 4)  # head's forward fetch: its backward fetch, then b1's
    assert plan.prefetch[-1] == ()


def test_memory_budget_stays_within_its_limit_and_refuses_a_unit_over_it() -> None:
    plan = MemoryBudget(250).plan(CHAIN)
    assert check_plan(plan, CHAIN, "m").peak_live_numel <= 250
    assert plan.prefetch[0] == (1, 2, 3)  # as far ahead as fits: parameter 4 would pass the limit
    with pytest.raises(PlanError, match=r"MemoryBudget\(limit=90.*'emb'.*over its live limit of 90"):
        check_plan(MemoryBudget(90).plan(CHAIN), CHAIN, repr(MemoryBudget(90)))


def _plan_with(step: RecordedStep, *, prefetch: dict[int, tuple[object, ...]] | None = None,
               release: dict[int, tuple[object, ...]] | None = None) -> SchedulePlan:
    pre = [(prefetch or {}).get(i, ()) for i in range(len(step.fetches))]
    rel = [(release or {}).get(k, ()) for k in range(len(step.exits))]
    return SchedulePlan(tuple(pre), tuple(rel))  # type: ignore[arg-type]


def test_a_release_of_what_a_unit_in_flight_needs_is_refused_naming_planner_unit_and_id() -> None:
    step = root_around_blocks()
    # blocks.0's exit (exit 0) releases the root's parameter 0 while the root's forward is in flight
    with pytest.raises(PlanError, match=r"planner Mine releases parameter #0 at the exit of 'blocks.0' \(exit 0\), "
                                        r"while '<root>', in flight, still needs it"):
        check_plan(_plan_with(step, release={0: (0,)}), step, "Mine")


@pytest.mark.parametrize("bad", [99, -1, "3", 2.0])
def test_a_bad_id_is_refused_naming_it_and_where(bad: object) -> None:
    with pytest.raises(PlanError, match=rf"planner Mine names parameter id {bad!r} at fetch 1 \('b0'\)"):
        check_plan(_plan_with(CHAIN, prefetch={1: (bad,)}), CHAIN, "Mine")
    with pytest.raises(PlanError, match=rf"names parameter id {bad!r} at the exit of 'b1'"):
        check_plan(_plan_with(CHAIN, release={2: (bad,)}), CHAIN, "Mine")


def test_persistent_kept_and_misshapen_plans_are_refused() -> None:
    step = StepBuilder([10, 10, 10]).fetch("a", [0, 1]).exit("a", [0, 1], keep=[1]).build(persistent=[2])
    with pytest.raises(PlanError, match="persistent parameter #2"):
        check_plan(_plan_with(step, release={0: (2,)}), step, "Mine")
    with pytest.raises(PlanError, match="releases parameter #1 at the exit of 'a'.*forward returned it"):
        check_plan(_plan_with(step, release={0: (1,)}), step, "Mine")
    with pytest.raises(PlanError, match=r"one prefetch entry per fetch \(1\) and one release entry per exit \(1\)"):
        check_plan(SchedulePlan((), ()), step, "Mine")
    with pytest.raises(PlanError, match="returned dict, not a SchedulePlan"):
        check_plan({}, step, "Mine")


def test_a_plan_prints_one_line_per_fetch_and_exit_and_diffs() -> None:
    a, b = PrefetchAhead(1).plan(CHAIN).describe(CHAIN), KeepLastUnits(1).plan(CHAIN).describe(CHAIN)
    assert len(a.splitlines()) == len(CHAIN.events) == len(b.splitlines())
    assert a.splitlines()[0] == "fetch   0 forward  emb  prefetch #1,#2  | live 200"
    assert a != b


def test_the_stock_planner_replays_deepspeeds_rules_on_a_chain() -> None:
    # a bucket of 100 elements: each prefetch takes the next unit's two blocks' worth at most
    plan = StockPlanner(param_persistence_threshold=0, prefetch_bucket_size=100).plan(CHAIN)
    assert plan.prefetch[0] == (1, 2)
    # with no reuse distance, every exit releases its own parameters; within the reuse window, kept
    assert StockPlanner(max_reuse_distance=0, param_persistence_threshold=0).plan(CHAIN).release == \
        tuple(own_releases(CHAIN))
    kept = StockPlanner(param_persistence_threshold=0).plan(CHAIN)
    assert kept.release[3] == ()  # head is fetched again right after its forward exit


def test_hand_built_steps_are_checked() -> None:
    with pytest.raises(ValueError, match="out of range"):
        StepBuilder([1]).fetch("a", [0]).exit("a", [3]).build()
    with pytest.raises(ValueError, match="fetch events must number"):
        step = StepBuilder([1]).fetch("a", [0]).exit("a", [0])
        RecordedStep(tuple(step.fetches), tuple(step.exits), tuple(reversed(step.events[:1])) * 2, step.numels)
    assert Phase.BACKWARD in {f.phase for f in root_around_blocks().fetches}
