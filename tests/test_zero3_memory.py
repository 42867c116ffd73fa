"""What a rank holds, checked against the analytic ZeRO-3 bound (gloo, world 1, 2, 4).

The engine's ``MemoryLedger`` counts every buffer it allocates; these tests
pin its figures to what the layout implies (a shard of ceil(numel / N)
elements per parameter; gradient partitions only from the first micro-step
of a window to the optimizer step; buckets only during backward; Adam's two
moments over the master shards) and check them against the tensors
themselves where the tensors can be read. No test here times anything or
reads the process's memory: the bench measures that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.errors import error_of, unchanged
from tests.zero3_models import WORKLOADS, Case, assert_pair, build_pair, engine_micro_step, finish, new_result, train_steps
from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.sharded_param import parameter_of
from z3kit_recipes.zero3.config.budget import TRANSIENT_FLOOR_NUMEL, plan_memory, transient_cap
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.training.layout import CHUNK_NUMEL
from z3kit_recipes.zero3.training.reductions import MAX_FLIGHTS

SHARDED = {"param_persistence_threshold": 0}


def shard_numels(model: torch.nn.Module, world: int) -> list[int]:
    return [max(1, -(-p.numel() // world)) for p in model.parameters()]


def current(engine: Any) -> dict[str, int]:
    return dict(engine.stats().memory.current)


# --------------------------------------------------------------------------- #
# The life of each kind of buffer, step by step
# --------------------------------------------------------------------------- #


def run_lifecycle(ctx: Any, dtype: str) -> dict[str, Any]:
    case = Case("gpt_functional", {**SHARDED, "compute_dtype": dtype, "gradient_accumulation_steps": 2}, steps=2,
                accumulation=2)
    engine, ref, model = build_pair(ctx, case)
    out: dict[str, Any] = {
        "shards": shard_numels(ref.model, ctx.world),
        "elsize": torch.finfo(engine.zero3_config.torch_dtype).bits // 8,
        "after_init": current(engine),
        "model_data_numel": sum(parameter_of(p).data.numel() for p in model.parameters()),
        "init_broadcast": engine.log.snapshot()["broadcast"],
        "model_bytes": sum(p.numel() * p.element_size() for p in ref.model.parameters()),
    }
    wl = WORKLOADS[case.workload]
    batches = [wl.batch(ctx.rank, 0, 0, 0)]
    engine_micro_step(engine, case, batches, 0)  # micro-step 0 of 2: no optimizer step yet
    out["after_micro_0"] = current(engine)
    engine_micro_step(engine, case, [wl.batch(ctx.rank, 0, 1, 0)], 0)
    stats = engine.stats()
    out["after_step"] = dict(stats.memory.current)
    out["peak_of_step"] = dict(stats.memory.peak)
    out["peak_total"] = stats.memory.peak_total
    out["bucket_cap"] = engine.stats().reduce_bucket_numel
    out["largest_padded"] = max(-(-p.numel() // ctx.world) * ctx.world for p in ref.model.parameters())
    out["adam_moments"] = sum(
        t.numel() * t.element_size() for st in engine.optimizer.state.values() for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    out["device_peak"] = stats.memory.device_peak
    out["gathered_numel"] = engine.gathered_numel()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_buffer_lives_when_it_should(pools: Any, world: int, dtype: str) -> None:
    for r in pools.run(world, run_lifecycle, dtype):
        shards, elsize = sum(r["shards"]), r["elsize"]
        masters = 0 if dtype == "fp32" else shards * 4
        # after initialize: the shards (and fp32 masters), nothing else; the model's own tensors are gone
        assert r["after_init"] == {
            "param_shards": shards * elsize, "gathered_params": 0, "grad_buckets": 0, "grad_partitions": 0,
            "fp32_masters": masters, "optimizer_state": 0,
        }
        assert r["model_data_numel"] == 0
        # rank 0's values came one chunk at a time (every parameter of this model is one chunk's worth)
        assert r["init_broadcast"]["bytes"] == (r["model_bytes"] if world > 1 else 0)
        # within an accumulation window the partitions (fp32) stay; buckets are gone with the backward
        assert r["after_micro_0"]["grad_partitions"] == shards * 4
        assert r["after_micro_0"]["grad_buckets"] == 0 and r["after_micro_0"]["gathered_params"] == 0
        # after the optimizer step: shards, masters and Adam's state only
        after = r["after_step"]
        assert after["grad_partitions"] == 0 and after["grad_buckets"] == 0 and after["gathered_params"] == 0
        assert after["param_shards"] == shards * elsize and after["fp32_masters"] == masters
        assert r["adam_moments"] == 2 * shards * 4
        # Adam's moments plus one step counter per parameter
        assert r["adam_moments"] <= after["optimizer_state"] <= r["adam_moments"] + 8 * len(r["shards"])
        assert r["gathered_numel"] == 0
        # peaks over the step: partitions at their full size; buckets within the cap
        # (two alternating, or one gradient reduced on its own)
        peak = r["peak_of_step"]
        assert peak["grad_partitions"] == shards * 4
        if world == 1:  # gradients go straight into the partitions: no bucket (zero3.training.grads)
            assert peak["grad_buckets"] == 0
        else:
            assert 0 < peak["grad_buckets"] <= ((MAX_FLIGHTS + 1) * r["bucket_cap"] + r["largest_padded"]) * elsize
        if world == 1:  # the shards are the full parameters (z3kit.shard's Note at world 1): nothing gathered
            assert peak["gathered_params"] == 0
        else:
            assert 0 < peak["gathered_params"]
        assert max(peak.values()) <= r["peak_total"] <= sum(peak.values())
        assert r["device_peak"] is None  # a CPU has no allocator peak


def run_gathered_matches_tensors(ctx: Any) -> list[tuple[int, int]]:
    """(ledger's gathered elements, elements measured on the tensors) inside every forward."""
    case = Case("stack", {**SHARDED, "max_live_parameters": 3 * 64 * 64}, steps=3)
    engine, ref, model = build_pair(ctx, case)
    seen: list[tuple[int, int]] = []

    def observe(module: torch.nn.Module, args: Any) -> None:
        ledger = engine.stats().memory.current["gathered_params"] // 4
        seen.append((ledger, engine.gathered_numel()))

    for layer in model.layers:
        layer.register_forward_pre_hook(observe)
    train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    return seen


def test_ledger_agrees_with_the_tensors(pools: Any) -> None:
    for seen in pools.run(2, run_gathered_matches_tensors):
        assert seen and all(ledger == measured for ledger, measured in seen), seen


# --------------------------------------------------------------------------- #
# A memory budget
# --------------------------------------------------------------------------- #


def run_budget(ctx: Any, budget: float) -> dict[str, Any]:
    case = Case("stack", {"param_persistence_threshold": 0, "memory_budget": budget}, steps=6)
    engine, ref, model = build_pair(ctx, case)
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    stats = engine.stats()
    return {"pair": finish(engine, ref, res), "plan": stats.memory_plan, "peak": dict(stats.memory.peak),
            "live_limit": stats.max_live_parameters, "model_numel": stats.model_numel}


@pytest.mark.parametrize("world", [2, 4])
def test_budget_bounds_what_is_gathered_and_trains_like_ddp(pools: Any, world: int) -> None:
    results = pools.run(world, run_budget, 0.25)
    assert_pair([r["pair"] for r in results])
    for r in results:
        plan = r["plan"]
        assert plan is not None and plan.budget_bytes == int(0.25 * r["model_numel"] * 4)
        assert r["live_limit"] == plan.max_live_parameters
        # gathered: the live bound, plus the module that runs when it is reached,
        # plus a coalesced prefetch's output buffer (a quarter of the live bound)
        bound = plan.max_live_parameters + plan.largest_fetch_numel + plan.prefetch_bucket_size
        assert r["peak"]["gathered_params"] <= bound * 4 + 64 * world * 4
        # buckets: those in flight and the one filling, each of the planned size or one gradient larger
        per_bucket = max(plan.reduce_bucket_size, 64 * 64)
        assert r["peak"]["grad_buckets"] <= (MAX_FLIGHTS + 1) * per_bucket * 4


def test_plan_splits_the_budget() -> None:
    plan = plan_memory(
        8_000, model_numel=10_000, element_size=4, largest_fetch_numel=500, persistent_numel=100, world=2, buckets=2
    )
    spare = 8_000 // 4 - 100  # elements left after the persistent parameters
    assert plan.reduce_bucket_size == spare // 8
    assert plan.max_live_parameters == 100 + spare - 2 * (spare // 8)
    assert plan.max_reuse_distance == spare - 2 * (spare // 8)
    assert plan.prefetch_bucket_size == plan.max_reuse_distance // 4
    assert plan.bound_bytes == plan.budget_bytes == 8_000
    assert "persistent" in plan.describe()
    # a fraction of the model
    assert plan_memory(0.5, model_numel=10_000, element_size=2, largest_fetch_numel=1, persistent_numel=0,
                       world=1, buckets=1).budget_bytes == 10_000
    # a module larger than the budget sets the floor, and the plan says so
    tight = plan_memory(400, model_numel=10_000, element_size=4, largest_fetch_numel=5_000, persistent_numel=0,
                        world=4, buckets=2)
    assert tight.bound_bytes > tight.budget_bytes and "largest module" in tight.describe()
    assert tight.reduce_bucket_size >= 4  # a bucket holds at least one element per rank


def test_budget_config_is_checked() -> None:
    assert Zero3Config(memory_budget=0.125).memory_budget == 0.125
    assert Zero3Config(memory_budget=1 << 30).memory_budget == 1 << 30
    for bad, kind, words in [
        (0.0, ValueError, "(0, 1]"), (1.5, ValueError, "(0, 1]"), (0, ValueError, ">= 1"),
        ("1GB", TypeError, "bytes"), (True, TypeError, "bytes"),
    ]:
        err = error_of(Zero3Config, memory_budget=bad)
        assert err.startswith(kind.__name__) and words in err, (bad, err)
    err = error_of(Zero3Config, memory_budget=0.5, reduce_bucket_size=1000)
    assert err.startswith("ValueError") and "do not also set reduce_bucket_size" in err


# --------------------------------------------------------------------------- #
# The primitives' side
# --------------------------------------------------------------------------- #


def test_transient_buffers_stay_within_one_partition() -> None:
    # DeepSpeed's default bucket (5e8) would hold all of a 40M-element model;
    # two transient buffers hold one rank's partition at most
    assert transient_cap(40_000_000, world=2) == 40_000_000 // 4
    assert transient_cap(40_000_000, world=4) == 40_000_000 // 8
    # small models keep one buffer for everything (the count of collectives matters more)
    assert transient_cap(10_000, world=2) == TRANSIENT_FLOOR_NUMEL
    assert transient_cap(8 * TRANSIENT_FLOOR_NUMEL, world=8) == TRANSIENT_FLOOR_NUMEL


def run_caps(ctx: Any) -> dict[str, int]:
    from z3kit_recipes import zero3

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 8.4M elements
    total = sum(-(-p.numel() // ctx.world) * ctx.world for p in model.parameters())
    engine = zero3.initialize(model, torch.optim.Adam, zero3.Zero3Config(), ctx.group)
    stats = engine.stats()
    return {"total": total, "bucket": stats.reduce_bucket_numel, "prefetch": engine.limiter.prefetch_bucket_size}


def test_default_sizes_are_capped_and_reported(pools: Any) -> None:
    for r in pools.run(2, run_caps):
        cap = transient_cap(r["total"], 2)
        assert cap < r["total"] < 50_000_000  # DeepSpeed's default prefetch and bucket exceed this model
        assert r["bucket"] == cap - cap % 2 and r["prefetch"] == cap


def test_ledger_counts_current_and_peak() -> None:
    ledger = MemoryLedger()
    ledger.allocate(MemoryKind.GRAD_BUCKETS, 100)
    ledger.allocate(MemoryKind.GATHERED_PARAMS, 50)
    ledger.free(MemoryKind.GRAD_BUCKETS, 100)
    ledger.allocate(MemoryKind.GATHERED_PARAMS, 20)
    report = ledger.report()
    assert report.current["gathered_params"] == 70 and report.current["grad_buckets"] == 0
    assert report.peak["grad_buckets"] == 100 and report.peak["gathered_params"] == 70
    assert report.peak_total == 150 and report.current_total == 70
    ledger.reset_peaks()
    assert ledger.report().peak_total == 70 and ledger.report().peak["grad_buckets"] == 0
    assert error_of(ledger.free, MemoryKind.GRAD_BUCKETS, 1).startswith("ValueError: cannot free 1 bytes")
    assert error_of(ledger.allocate, MemoryKind.GRAD_BUCKETS, -1).startswith("ValueError")
    assert error_of(ledger.allocate, MemoryKind.GRAD_BUCKETS, 1.5).startswith("TypeError")


# --------------------------------------------------------------------------- #
# initialize: nothing model-sized, nothing half-applied
# --------------------------------------------------------------------------- #


def run_failing_factory(ctx: Any, failing_rank: int) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(ctx.rank)  # different values per rank: a broadcast would show
    model = WORKLOADS["mlp"].build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def factory(params: Any) -> torch.optim.Optimizer:
        if ctx.rank == failing_rank:
            raise KeyError("no such learning-rate schedule")
        return torch.optim.Adam(params)

    try:
        zero3.initialize(model, factory, {"zero_optimization": {"stage": 3}}, ctx.group)
        err: BaseException | None = None
    except (KeyError, RuntimeError) as e:
        err = e
    return {"error": repr(err), "unchanged": unchanged(before, dict(model.named_parameters()))}


def test_a_factory_failing_on_one_rank_fails_everywhere_and_changes_nothing(pools: Any) -> None:
    results = pools.run(2, run_failing_factory, 1)
    assert "no such learning-rate schedule" in results[1]["error"]
    assert "failed on rank(s) [1]" in results[0]["error"]
    assert all(r["unchanged"] for r in results)


def test_large_parameters_are_broadcast_alone() -> None:
    from z3kit_recipes.zero3.training.layout import ShardLayout, _chunks

    sizes = [10, CHUNK_NUMEL, 20, CHUNK_NUMEL // 2, CHUNK_NUMEL // 2 + 1, 5]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    layout = ShardLayout.allocate(params, rank=0, world=2, dtype=torch.float32, device=torch.device("cpu"))
    chunks = _chunks(layout.shards)
    assert sorted(p for c in chunks for p in c) == list(range(len(sizes)))
    assert [1] in chunks  # at CHUNK_NUMEL a parameter goes alone
    for chunk in chunks:
        assert len(chunk) == 1 or sum(sizes[p] for p in chunk) <= CHUNK_NUMEL
    # the smallest first: the largest shards are written when most of the model is gone
    totals = [sum(sizes[p] for p in c) for c in chunks]
    assert totals == sorted(totals)
