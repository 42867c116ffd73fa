"""Planners in the stock runtime (``zero3.training.step_plans``).

- The stock planner reproduces, event for event, the fetches, prefetches
  and releases of the runtime that asked its policies module by module
  (``tests/plan_sequences.py`` holds those sequences, taken before plans).
- The three example planners (``z3kit_recipes.planners``) train at DDP
  parity, and their effect shows in ``stats()``.
- A plan that would break a step is refused at the end of the first
  backward, before any optimizer step, on every rank, naming the planner,
  the unit and the id; the model is left as it was.
- A planner with the config's scheduling knobs set warns that they are not used.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import RankFailure, fresh_group
from tests.plan_sequences import CASES, sequence
from tests.zero3_models import Case, assert_pair, build_pair, finish, new_result, train_steps
from z3kit.recorded_step import RecordedStep
from z3kit.release import StockReleasePolicy
from z3kit.schedule_plan import SchedulePlan, own_releases
from z3kit_recipes import zero3
from z3kit_recipes.planners import KeepLastUnits, KeepUnitsGathered, MemoryBudget, PrefetchAhead

GOLDEN = json.loads((Path(__file__).parent / "data" / "plan_sequences.json").read_text())


def _moved(events: list[list[Any]]) -> list[list[Any]]:
    """The events that gather or free something (a release of nothing is not one)."""
    return [e for e in events if not (e[0] == "release" and e[2] == 0)]


def _sequences(ctx: Any) -> dict[str, list[list[Any]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notes about fetch units split to fit max_live_parameters
        return {case: sequence(ctx, case) for case in CASES}


@pytest.mark.parametrize("world", [1, 2])
def test_the_stock_planner_reproduces_the_policies_sequence_exactly(pools: Any, world: int) -> None:
    got = pools.run(world, _sequences)
    for case in CASES:
        assert got[0][case] == got[-1][case]
        assert _moved(got[0][case]) == _moved(GOLDEN[f"{case}@{world}"]), case


STACK = {"param_persistence_threshold": 0}
PLANNERS: dict[str, Any] = {
    "fallback": KeepLastUnits(0),
    "keep_last_3": KeepLastUnits(3),
    "prefetch_2": PrefetchAhead(2),
    "budget": MemoryBudget(3 * (64 * 64 + 64)),  # three of the stack's layers
}


def _train(ctx: Any, workload: str, which: str) -> dict[str, Any]:
    case = Case(workload, STACK, steps=5)
    engine, ref, _ = build_pair(ctx, case, planner=PLANNERS[which])
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    stats = engine.stats()
    plan = engine.schedule_plan()
    return {"pair": finish(engine, ref, res), "plan": plan, "gathers": stats.collectives["all_gather"]["calls"],
            "planner": stats.planner, "prefetches": stats.plan_prefetches, "peak": stats.peak_live_numel,
            "planned_peak": stats.plan_peak_live_numel}


@pytest.mark.parametrize("workload", ["stack", "gpt_hf"])
def test_example_planners_train_at_ddp_parity_and_show_in_stats(pools: Any, workload: str) -> None:
    runs = {which: pools.run(2, _train, workload, which) for which in PLANNERS}
    for which, results in runs.items():
        assert_pair([r["pair"] for r in results])
        assert results[0]["planner"] == repr(PLANNERS[which])
    if workload != "stack":
        return  # the tied GPT: parity; the effects are measured on the stack, where units are layers
    fallback, keep, ahead, budget = (runs[w][0] for w in PLANNERS)
    # keeping the last 3 layers spares their gathers at the turn from forward to backward
    assert keep["gathers"] == fallback["gathers"] - 3 and keep["peak"] > fallback["peak"]
    assert fallback["prefetches"] == keep["prefetches"] == 0 and ahead["prefetches"] > 0
    assert budget["planned_peak"] <= PLANNERS["budget"].limit and budget["peak"] <= PLANNERS["budget"].limit
    assert budget["prefetches"] > 0
    # printed, one line per fetch and exit of the step, the root's and the 8 layers', forward and backward
    lines = ahead["plan"].splitlines()
    assert lines[0] == f"planner {PLANNERS['prefetch_2']!r}" and len(lines) == 1 + 2 * 2 * 9
    assert "prefetch #" in ahead["plan"] and "prefetch #" not in keep["plan"]


#: the embedding (tied to the head) and the last two of four blocks
KEEP = ("tok_emb", "blocks.2", "blocks.3")


def _keep(ctx: Any, names: tuple[str, ...]) -> dict[str, Any]:
    case = Case("gpt_hf_4", STACK, steps=3)
    engine, ref, _ = build_pair(ctx, case, planner=KeepUnitsGathered(names))
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    stats = engine.stats()
    kept = {id(p): p.numel() for name in KEEP for p in ref.model.get_submodule(name).parameters()}  # DDP's full copy
    return {"pair": finish(engine, ref, res), "gathers": stats.collectives["all_gather"]["calls"],
            "saved": stats.plan_saved_gathers, "kept_numel": stats.plan_kept_numel, "units": stats.plan_kept_units,
            "gathered_after_step": res.gathered_after_step, "numel": sum(kept.values()),
            "text": str(stats), "plan": engine.schedule_plan()}


def test_a_planner_keeps_named_units_gathered_across_steps(pools: Any) -> None:
    """KeepUnitsGathered keeps the embedding (tied to the head) and the last
    two blocks gathered from step to step, at DDP parity (so a kept copy is
    gathered afresh after each optimizer step, never stale), and the
    all-gathers a step makes fall by what stats() says keeping saves."""
    kept, plain = pools.run(2, _keep, KEEP), pools.run(2, _keep, ())
    assert_pair([r["pair"] for r in kept])
    assert_pair([r["pair"] for r in plain])
    k, p = kept[0], plain[0]
    numel = k["numel"]  # the embedding (also the head's weight) and both blocks
    assert k["units"] == KEEP and k["kept_numel"] == numel
    # each step starts with them gathered again (the refresh after the optimizer step), and the rest freed
    assert k["gathered_after_step"] == [numel] * 3 and p["gathered_after_step"] == [0] * 3
    # forward: the embedding, both blocks and the head; backward the same four: one refresh instead
    assert (k["saved"], p["saved"]) == (7, 0)
    assert (k["gathers"], p["gathers"]) == (9, 16)  # 16: every fetch but the root's (no parameters of its own)
    assert "planner               KeepUnitsGathered(names=('tok_emb', 'blocks.2', 'blocks.3')" in k["text"]
    assert f"keeps tok_emb, blocks.2, blocks.3 gathered across steps ({numel / 1000:.2f}k elements), 7 all-gather(s) per step saved" in k["text"]
    assert "prefetch" not in k["text"].split("buckets")[1].splitlines()[0]  # the stock knob does not apply
    assert k["plan"].splitlines()[1].startswith("kept gathered across steps: tok_emb, blocks.2, blocks.3")


class ReleasesTheRoot:
    """A planner whose plan releases, at the first block's exit, a parameter the root still needs."""

    def is_persistent(self, numel: int) -> bool:
        return False

    def plan(self, step: RecordedStep) -> SchedulePlan:
        release = [list(ids) for ids in own_releases(step)]
        busy = step.in_flight_after()[0]
        release[0].append(next(p for ids in busy.values() for p in ids))
        return SchedulePlan.of([()] * len(step.fetches), release)

    def __repr__(self) -> str:
        return "ReleasesTheRoot()"


class BadId(ReleasesTheRoot):
    def plan(self, step: RecordedStep) -> SchedulePlan:
        return SchedulePlan.of([(10_000,)] * len(step.fetches), own_releases(step))

    def __repr__(self) -> str:
        return "BadId()"


def _refused(ctx: Any, planner: Any) -> dict[str, Any]:
    group = fresh_group(ctx)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(2)))  # the root's own: in flight around the layers
    forward = model.forward
    model.forward = lambda x: forward(x) * model.scale  # type: ignore[method-assign]
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), None, group, planner=planner)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    errors = []
    for _ in range(2):
        try:
            engine.backward(engine(torch.randn(4, 8)).sum())
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            errors.append(f"{type(exc).__name__}: {exc}")
    after = engine.full_state_dict()
    return {"errors": errors, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.parametrize("planner, message", [
    (ReleasesTheRoot(), r"PlanError: planner ReleasesTheRoot\(\) releases parameter #\d at the exit of '0' "
                        r"\(exit 0\), while '<root>', in flight, still needs it"),
    (BadId(), r"PlanError: planner BadId\(\) names parameter id 10000 at fetch 0 \('<root>'\), which is no "
               r"parameter of the model"),
])
def test_a_bad_plan_is_refused_before_any_step_on_every_rank(pools: Any, planner: Any, message: str) -> None:
    for result in pools.run(2, _refused, planner):
        assert len(result["errors"]) == 2  # the first backward, and every one after until the trace changes
        for error in result["errors"]:
            assert __import__("re").search(message, error), error
        assert result["unchanged"]


def _init(ctx: Any, config: dict[str, Any], **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zero3.initialize(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), zero3.Zero3Config(**config),
                         ctx.group, **kwargs)
    return [str(w.message) for w in seen if issubclass(w.category, UserWarning)]


def test_a_planner_says_which_knobs_it_replaces(pools: Any) -> None:
    said = pools.run(1, _init, {"max_live_parameters": 10, "prefetch_bucket_size": 5}, planner=PrefetchAhead(1))[0]
    assert any("PrefetchAhead replaces the stock planner, whose arguments the config's max_live_parameters, "
               "prefetch_bucket_size are: they are not used" in s for s in said), said
    assert not any("stock planner" in s for s in pools.run(1, _init, {}, planner=PrefetchAhead(1))[0])
    with pytest.raises(RankFailure, match="pass planner, or release_policy / prefetch_limiter, not both"):
        pools.run(1, _init, {}, planner=PrefetchAhead(1), release_policy=StockReleasePolicy())
    with pytest.raises(RankFailure, match="planner must implement z3kit.schedule_plan.SchedulePlanner"):
        pools.run(1, _init, {}, planner=object())
