"""Invariants, API and bad input of the stock zero3 runtime.

Distributed cases run on the session's gloo pools (world 2 unless the case
is about scaling with the world size) and, where they train, compare with a
DDP reference from ``tests/zero3_models.py``. Configuration tests need no
process group.
"""

from __future__ import annotations

import json
import math
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from tests.zero3_models import (
    WORKLOADS,
    Case,
    PairResult,
    assert_pair,
    build_pair,
    finish,
    new_result,
    rel_norm_error,
    train_steps,
)
from z3kit.prefetch import PrefetchLimiter
from z3kit.sharded_param import parameter_of
from z3kit.recorded_step import Phase, RecordedStep
from z3kit.release import StockReleasePolicy
from z3kit.schedule_plan import SchedulePlan
from z3kit.trace import TraceRecorder
from z3kit_recipes.zero3 import DeepSpeedNote, Zero3Config

SHARDED = {"param_persistence_threshold": 0}
STACK_LAYER = 64 * 64 + 64  # elements of one Linear(64, 64)
#: stock prefetch may coalesce several layers into one gather
PREFETCH_CONFIG = {"param_persistence_threshold": 0, "prefetch_bucket_size": 4 * STACK_LAYER}
#: the stock release policy keeps at most about two layers gathered (plus the running fetch)
TIGHT_CONFIG = {"param_persistence_threshold": 0, "max_live_parameters": 2 * STACK_LAYER,
                "prefetch_bucket_size": STACK_LAYER}


# --------------------------------------------------------------------------- #
# Release after every step
# --------------------------------------------------------------------------- #


def run_release_after_step(ctx: Any, overlap: bool) -> dict[str, Any]:
    # biases (64 elements) are persistent, weights (4096) are not
    case = Case("stack", {"param_persistence_threshold": 100, "overlap_comm": overlap}, steps=6)
    engine, ref, model = build_pair(ctx, case)
    seen: list[dict[str, Any]] = []

    def after_step(step: int) -> None:
        seen.append({
            # the gathered storage of each parameter (between uses a module holds its sharded form)
            "data_numel": {n: parameter_of(p).data.numel() for n, p in model.named_parameters()},
            "gathered": engine.gathered_numel(),
            "live": engine.stats().live_numel,
        })

    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref), after_step)
    return {"seen": seen, "pair": finish(engine, ref, res)}


@pytest.mark.parametrize("overlap", [False, True])
def test_non_persistent_released_after_every_step(pools: Any, overlap: bool) -> None:
    persistent_total = 8 * 64
    for r in pools.run(2, run_release_after_step, overlap):
        assert_pair([r["pair"]])
        assert r["pair"].persistent_numel == persistent_total
        assert len(r["seen"]) == 6
        for s in r["seen"]:
            for name, numel in s["data_numel"].items():
                if name.endswith("weight"):
                    assert numel == 0, f"{name} still gathered after step(): {numel} elements"
                elif not overlap:
                    assert numel == 64, f"persistent {name} not gathered after step(): {numel} elements"
            # gathered or in flight: the persistent ones, nothing else
            assert s["live"] == persistent_total
            if not overlap:
                assert s["gathered"] == persistent_total


def test_gathered_numel_after_step_counts_persistent_with_overlap(pools: Any) -> None:
    for r in pools.run(2, run_release_after_step, True):
        assert [s["gathered"] for s in r["seen"]] == [8 * 64] * 6


# --------------------------------------------------------------------------- #
# Live-parameter bound
# --------------------------------------------------------------------------- #


def run_live_bound(ctx: Any) -> dict[str, Any]:
    max_live = TIGHT_CONFIG["max_live_parameters"]
    case = Case("stack", TIGHT_CONFIG, steps=10)
    engine, ref, model = build_pair(ctx, case)
    measured = {"max": 0}

    def probe(*_: Any) -> None:
        # What is really held: param.data sizes, not the runtime's own counter.
        # Torch functions are disabled around the call so that the engine's
        # ParamUseMode does not take the reads for uses (see
        # test_gathered_numel_inside_forward_has_no_side_effects).
        with torch._C.DisableTorchFunction():
            measured["max"] = max(measured["max"], engine.gathered_numel())

    def on_input(_: nn.Module, args: tuple[Any, ...]) -> None:
        probe()
        if args[0].requires_grad:
            args[0].register_hook(probe)

    def on_output(_: nn.Module, __: Any, out: torch.Tensor) -> None:
        probe()
        out.register_hook(probe)

    for layer in model.layers:
        layer.register_forward_pre_hook(on_input)
        layer.register_forward_hook(on_output)
    per_step: list[tuple[int, int, int]] = []

    def after_step(step: int) -> None:
        s = engine.stats()
        per_step.append((s.peak_live_numel, s.largest_fetch_numel, measured["max"]))
        measured["max"] = 0

    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref), after_step)
    return {"per_step": per_step, "max_live": max_live, "pair": finish(engine, ref, res)}


def test_live_parameters_stay_within_bound(pools: Any) -> None:
    for r in pools.run(2, run_live_bound):
        pair: PairResult = r["pair"]
        assert_pair([pair])
        bound_base = r["max_live"]
        # the bound is below the model size: gathering everything would break it
        assert pair.stats.model_numel > bound_base + pair.stats.largest_fetch_numel
        assert len(r["per_step"]) == 10
        for step, (peak, largest, measured) in enumerate(r["per_step"]):
            assert largest == STACK_LAYER
            assert 0 < peak <= bound_base + largest, f"step {step}: peak {peak}"
            assert 0 < measured <= bound_base + largest, f"step {step}: {measured} elements really gathered"


def run_observe_inside_forward(ctx: Any) -> dict[str, Any]:
    case = Case("stack", TIGHT_CONFIG, steps=4)
    engine, ref, model = build_pair(ctx, case)
    seen: list[int] = []

    def observe(module: nn.Module, args: Any) -> None:
        seen.append(engine.gathered_numel())  # a user logging memory per layer

    model.layers[3].register_forward_pre_hook(observe)
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    return {"seen": seen, "pair": finish(engine, ref, res)}


def test_gathered_numel_inside_forward_has_no_side_effects(pools: Any) -> None:
    for r in pools.run(2, run_observe_inside_forward):
        pair: PairResult = r["pair"]
        assert_pair([pair])  # the numbers stay right either way
        assert pair.stats.largest_fetch_numel == STACK_LAYER
        assert pair.stats.trace_invalidations == 0
        # what the live bound allows, not the whole model
        assert max(r["seen"]) <= 3 * STACK_LAYER < pair.stats.model_numel


# --------------------------------------------------------------------------- #
# Resident storage is 1/N
# --------------------------------------------------------------------------- #


def run_resident(ctx: Any) -> dict[str, Any]:
    out = {}
    for dtype in ("fp32", "bf16"):
        case = Case("gpt_functional", {**SHARDED, "compute_dtype": dtype}, steps=2)
        engine, ref, model = build_pair(ctx, case)
        n_params = len(list(model.parameters()))
        res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
        optimizer_state = sum(
            t.numel() for st in engine.optimizer.state.values() for k, t in st.items() if k == "exp_avg"
        )
        out[dtype] = {"stats": engine.stats(), "n_params": n_params, "adam_state": optimizer_state,
                      "gathered": engine.gathered_numel(), "losses": (res.engine_losses, res.ddp_losses)}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_resident_storage_is_one_nth(pools: Any, world: int) -> None:
    for r in pools.run(world, run_resident):
        for dtype, d in r.items():
            s, n_params = d["stats"], d["n_params"]
            low = s.model_numel / world
            high = low + n_params  # at most one padding element per parameter per rank

            def within(x: int, what: str) -> None:
                assert low <= x <= high, f"{dtype}: {what} {x} not within [{low}, {high}] at world {world}"

            within(s.resident_param_numel, "resident_param_numel")
            assert s.resident_grad_numel == 0  # the partitions go with the optimizer step
            # Adam's state lives on the master shards: 1/N as well
            within(d["adam_state"], "Adam exp_avg elements")
            if dtype == "bf16":
                within(s.resident_master_numel, "resident_master_numel")
            else:
                assert s.resident_master_numel == 0  # the fp32 shards are the masters
            assert d["gathered"] == 0
            assert all(math.isfinite(x) for x in d["losses"][0])


# --------------------------------------------------------------------------- #
# Collective count is fixed once the trace is complete
# --------------------------------------------------------------------------- #


def run_collectives(ctx: Any) -> list[dict[str, dict[str, int]]]:
    case = Case("gpt_hf", SHARDED, steps=8)
    engine, ref, _ = build_pair(ctx, case)
    seen: list[dict[str, dict[str, int]]] = []
    train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref),
                lambda step: seen.append(engine.stats().collectives))
    return seen


def test_collectives_per_step_fixed_after_trace(pools: Any) -> None:
    for seen in pools.run(2, run_collectives):
        assert len(seen) == 8
        steady = seen[2:]  # after steps 3..8
        assert all(c == steady[0] for c in steady), steady
        assert steady[0]["all_gather"]["calls"] > 0 and steady[0]["all_reduce"]["calls"] > 0


# --------------------------------------------------------------------------- #
# Custom schedulers
# --------------------------------------------------------------------------- #


class NeverPrefetch(PrefetchLimiter):
    """Every fetch is a demand fetch."""

    def budget(self) -> int:
        self.asked = getattr(self, "asked", 0) + 1
        return 0


class KeepUntilBackward:
    """A SchedulePlanner: nothing is persistent; everything gathered in
    forward stays gathered until backward, where each unit's parameters go at
    its exit; nothing is prefetched."""

    def __init__(self) -> None:
        self.calls = 0

    def is_persistent(self, numel: int) -> bool:
        return False

    def plan(self, step: RecordedStep) -> SchedulePlan:
        self.calls += 1
        in_flight = step.in_flight_after()
        release = []
        for k, e in enumerate(step.exits):
            backward = e.fetch >= 0 and step.fetches[e.fetch].phase is Phase.BACKWARD
            busy = {p for ids in in_flight[k].values() for p in ids}
            release.append([p for p in e.param_ids if backward and p not in busy and p not in e.keep])
        return SchedulePlan.of([()] * len(step.fetches), release, planner="KeepUntilBackward")


class CountingTrace(TraceRecorder):
    def __init__(self) -> None:
        super().__init__()
        self.fetch_calls = 0

    def on_fetch(self, module_id: int, param_ids: Sequence[int], numels: Sequence[int]) -> bool:
        self.fetch_calls += 1
        return super().on_fetch(module_id, param_ids, numels)


def run_custom_policies(ctx: Any, which: str, config: dict[str, Any]) -> dict[str, Any]:
    case = Case("stack", config, steps=10)
    kwargs: dict[str, Any] = {"trace": CountingTrace()}
    if which == "never_prefetch":
        kwargs["prefetch_limiter"] = NeverPrefetch()
    elif which == "keep_until_backward":
        kwargs["planner"] = KeepUntilBackward()
    engine, ref, model = build_pair(ctx, case, **kwargs)
    wl = WORKLOADS["stack"]
    res = new_result(engine, ref)
    after_forward, gathers = [], []
    for step in range(case.steps):
        b = wl.batch(ctx.rank, step, 0, 0)
        loss = wl.loss(engine, b, step)
        after_forward.append(engine.gathered_numel())
        engine.backward(loss)
        assert engine.step()
        res.engine_losses.append(float(loss.detach()))
        res.ddp_losses.append(ref.micro_step([b], step, 0))
        ref.step()
        gathers.append(engine.stats().collectives["all_gather"]["calls"])
    return {
        "pair": finish(engine, ref, res),
        "after_forward": after_forward,
        "gathers": gathers,
        "trace_fetches": kwargs["trace"].fetch_calls,
        "budget_asked": getattr(kwargs.get("prefetch_limiter"), "asked", None),
        "policy_calls": getattr(kwargs.get("planner"), "calls", None),
        "model_numel": engine.stats().model_numel,
    }


def _check_policy_runs(runs: dict[str, list[dict[str, Any]]]) -> None:
    for which, results in runs.items():
        assert_pair([r["pair"] for r in results])
        for r in results:
            assert r["trace_fetches"] > 0, f"{which}: the user's TraceRecorder was not used"
    losses = {which: results[0]["pair"].engine_losses for which, results in runs.items()}
    assert len({tuple(v) for v in losses.values()}) == 1, losses  # the same numbers as the stock policies


def test_custom_prefetch_limiter_never_prefetch(pools: Any) -> None:
    runs = {w: pools.run(2, run_custom_policies, w, PREFETCH_CONFIG) for w in ("stock", "never_prefetch")}
    _check_policy_runs(runs)
    stock, never = runs["stock"][0], runs["never_prefetch"][0]
    # asked, refused: every fetch gathers on its own, where stock prefetch coalesces
    assert never["budget_asked"] > 0
    assert sum(never["gathers"][2:]) > sum(stock["gathers"][2:])


def test_custom_release_policy_keep_until_backward(pools: Any) -> None:
    runs = {w: pools.run(2, run_custom_policies, w, TIGHT_CONFIG) for w in ("stock", "keep_until_backward")}
    _check_policy_runs(runs)
    stock, keep = runs["stock"][0], runs["keep_until_backward"][0]
    # once planned (the first step records the trace), the whole model is gathered
    # between forward and backward, where the stock planner keeps to max_live_parameters
    assert keep["policy_calls"] == 1
    assert keep["after_forward"][1:] == [keep["model_numel"]] * 9
    assert max(stock["after_forward"]) < stock["model_numel"]


# --------------------------------------------------------------------------- #
# gathered_parameters
# --------------------------------------------------------------------------- #


def run_gathered_parameters(ctx: Any, dtype: str) -> dict[str, Any]:
    case = Case("mlp", {**SHARDED, "compute_dtype": dtype}, steps=10)
    engine, ref, model = build_pair(ctx, case)
    names = [n for n, _ in model.named_parameters()]
    res = train_steps(ctx, engine, ref, case, range(3), new_result(engine, ref))
    out: dict[str, Any] = {"ddp_at_3": ref.params()}
    with engine.gathered_parameters() as params:
        out["read"] = {n: p.detach().clone() for n, p in zip(names, params)}
        out["gathered_inside"] = engine.gathered_numel()
    out["gathered_after_read"] = engine.gathered_numel()
    # without modifier_rank a change is discarded
    with engine.gathered_parameters(model.layers[1]) as params:
        with torch.no_grad():
            params[0].fill_(9.0)
    out["after_discarded"] = engine.full_state_dict()
    # with modifier_rank=0, rank 0's change reaches every rank
    with engine.gathered_parameters(model.layers[1], modifier_rank=0) as params:
        if ctx.rank == 0:
            with torch.no_grad():
                params[0].fill_(0.5)
    out["gathered_after_modify"] = engine.gathered_numel()
    out["after_modify"] = engine.full_state_dict()
    with torch.no_grad():
        ref.model.layers[1].weight.fill_(0.5)
    train_steps(ctx, engine, ref, case, range(3, case.steps), res)
    out["pair"] = finish(engine, ref, res)
    out["padded_numel"] = sum(-(-p.numel() // ctx.world) * ctx.world for p in ref.model.parameters())
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gathered_parameters_read_and_modify(pools: Any, dtype: str) -> None:
    results = pools.run(2, run_gathered_parameters, dtype)
    for r in results:
        tol = {} if dtype == "fp32" else {"rtol": 1e-2, "atol": 1e-2}
        for name, want in r["ddp_at_3"].items():
            torch.testing.assert_close(r["read"][name].float(), want, **tol, msg=lambda m: f"{name}: {m}")
        assert r["gathered_inside"] == r["padded_numel"]  # every parameter, with its padding
        assert r["gathered_after_read"] == 0 and r["gathered_after_modify"] == 0
        # full_state_dict reads the fp32 masters; rounded to the compute dtype they are the shards
        def as_read(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            return state[name].to(r["read"][name].dtype)

        for name in r["read"]:
            assert torch.equal(as_read(r["after_discarded"], name), r["read"][name]), f"{name} changed without modifier_rank"
        assert torch.all(r["after_modify"]["layers.1.weight"] == 0.5)
        for name in r["read"]:
            if name != "layers.1.weight":
                assert torch.equal(as_read(r["after_modify"], name), r["read"][name])
        pair: PairResult = r["pair"]
        if dtype == "fp32":
            assert_pair([pair])
        else:
            # the fp32 masters took the change too: otherwise the next step would write the old values back
            assert rel_norm_error(pair.engine_params, pair.ddp_params) <= 3e-2
            got, want = torch.tensor(pair.engine_losses), torch.tensor(pair.ddp_losses)
            assert ((got - want).abs() / want.abs()).max() <= 3e-2


# --------------------------------------------------------------------------- #
# eval / no_grad forwards between steps
# --------------------------------------------------------------------------- #


def run_eval_forwards(ctx: Any, mode: str) -> dict[str, Any]:
    # LayerNorm parameters (18 elements) persistent, the rest sharded
    case = Case("gpt_hf", {"param_persistence_threshold": 20}, steps=8)
    engine, ref, model = build_pair(ctx, case)
    wl = WORKLOADS["gpt_hf"]
    probes: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        if step % 2:
            return
        idx = wl.batch(ctx.rank, 100 + step, 0, 0)["idx"]
        if mode in ("eval_no_grad", "eval_with_grad"):
            engine.eval()
            ref.model.eval()
        if mode == "eval_with_grad":
            got = engine(idx)
        else:
            with torch.no_grad():
                got = engine(idx)
        with torch.no_grad():
            want = ref.model(idx)
        engine.train()
        ref.model.train()
        probes.append({"diff": float((got.detach() - want).abs().max()), "gathered": engine.gathered_numel()})

    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref), evaluate)
    return {"probes": probes, "pair": finish(engine, ref, res)}


def _check_eval(results: list[dict[str, Any]]) -> None:
    for r in results:
        pair: PairResult = r["pair"]
        assert_pair([pair])
        assert 0 < pair.persistent_numel < pair.stats.model_numel
        assert len(r["probes"]) == 4
        for p in r["probes"]:
            assert p["diff"] <= 1e-5
            assert p["gathered"] == pair.persistent_numel, p


@pytest.mark.parametrize("mode", ["eval_no_grad", "train_no_grad"])
def test_eval_and_no_grad_forwards_between_steps(pools: Any, mode: str) -> None:
    _check_eval(pools.run(2, run_eval_forwards, mode))


def test_eval_forward_with_grad_enabled_leaves_only_persistent_parameters_gathered(pools: Any) -> None:
    _check_eval(pools.run(2, run_eval_forwards, "eval_with_grad"))


# --------------------------------------------------------------------------- #
# Zero3Config
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"prefetch_bucket_size": -1}, ValueError, "prefetch_bucket_size"),
        ({"max_live_parameters": -5}, ValueError, "max_live_parameters"),
        ({"reduce_bucket_size": 0}, ValueError, "reduce_bucket_size"),
        ({"param_persistence_threshold": True}, TypeError, "param_persistence_threshold"),
        ({"gradient_accumulation_steps": 1.5}, TypeError, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
        ({"overlap_comm": 1}, TypeError, "overlap_comm"),
        ({"compute_dtype": "fp8"}, ValueError, "compute_dtype"),
        ({"compute_dtype": torch.float64}, ValueError, "compute_dtype"),
        ({"loss_scaling": {"hysteresis": 1}}, TypeError, "loss_scaling"),
        ({"gradient_clipping": -0.5}, ValueError, "gradient_clipping"),
        ({"gradient_clipping": float("nan")}, ValueError, "gradient_clipping"),
        ({"gradient_clipping": "1.0"}, TypeError, "gradient_clipping"),
        ({"reduce_scatter": "yes"}, TypeError, "reduce_scatter"),
        ({"max_inflight_gathers": 0}, ValueError, "max_inflight_gathers"),
    ],
)
def test_config_validators_name_the_field(kwargs: dict[str, Any], error: type[Exception], field: str) -> None:
    with pytest.raises(error, match=field):
        Zero3Config(**kwargs)


def test_config_accepts_valid_values() -> None:
    c = Zero3Config(compute_dtype=torch.bfloat16, gradient_clipping=1, reduce_bucket_size=1, max_live_parameters=0)
    assert c.compute_dtype == "bf16" and c.torch_dtype == torch.bfloat16
    assert c.gradient_clipping == 1 and c.reduce_bucket_size == 1


DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 32,  # 4 x 8 x one rank (related to the world size only by initialize)
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "fp16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1000,
    },
}


def from_deepspeed(*args: Any, **kwargs: Any) -> Zero3Config:
    """``Zero3Config.from_deepspeed`` without the DeepSpeedNotes it gives
    (what they say is tested in tests/test_zero3_deepspeed_json.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeepSpeedNote)
        return Zero3Config.from_deepspeed(*args, **kwargs)


def test_from_deepspeed_maps_keys() -> None:
    c = from_deepspeed(DEEPSPEED, hidden_size=64)
    assert c.gradient_accumulation_steps == 8
    assert c.gradient_clipping == 1.0
    assert c.compute_dtype == "bf16"
    assert c.overlap_comm is False and c.contiguous_gradients is True
    assert c.reduce_bucket_size == 500_000_000 and isinstance(c.reduce_bucket_size, int)
    assert c.prefetch_bucket_size == 50_000_000 and isinstance(c.prefetch_bucket_size, int)
    assert c.max_live_parameters == 1_000_000_000
    assert c.max_reuse_distance == 1000
    assert c.param_persistence_threshold == 640  # "auto": from the model, 10 * hidden_size
    assert from_deepspeed({"bf16": {"enabled": False}}).compute_dtype == "fp32"
    # a JSON that leaves gradient_clipping out clips as DeepSpeed does by default
    assert from_deepspeed({}) == Zero3Config(gradient_clipping=1.0)


def test_primitive_defaults_agree_with_zero3config() -> None:
    # The same DeepSpeed knob has the same default whichever entry point a user starts from.
    c, policy, limiter = Zero3Config(), StockReleasePolicy(), PrefetchLimiter()
    assert (policy.max_reuse_distance, policy.param_persistence_threshold, policy.max_live_parameters) == (
        c.max_reuse_distance, c.param_persistence_threshold, c.max_live_parameters)
    assert (limiter.max_live_parameters, limiter.prefetch_bucket_size, limiter.max_inflight) == (
        c.max_live_parameters, c.prefetch_bucket_size, c.max_inflight_gathers)


def test_gradient_clipping_is_off_unless_set() -> None:
    # The one default that differs from DeepSpeed's (1.0), as README and
    # Zero3Config's docstring say: a Zero3Config that leaves it out does not
    # clip; a DeepSpeed JSON that leaves it out gets DeepSpeed's default.
    assert Zero3Config().gradient_clipping == 0.0
    with pytest.warns(DeepSpeedNote, match="gradient_clipping is not in the DeepSpeed config, so DeepSpeed's default"):
        assert Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3}}).gradient_clipping == 1.0


def test_from_deepspeed_reads_a_json_file(tmp_path: Any) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED))
    from_dict = from_deepspeed(DEEPSPEED, hidden_size=64)
    assert from_deepspeed(path, hidden_size=64) == from_dict
    assert from_deepspeed(str(path), hidden_size=64) == from_dict


def test_from_deepspeed_fills_auto_sizes_from_the_model_only() -> None:
    sizes = ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "reduce_bucket_size",
             "stage3_max_reuse_distance", "stage3_max_live_parameters")
    ds = {"zero_optimization": {"stage": 3, **dict.fromkeys(sizes, "auto")}}
    # a block of width 8: 12 * 8 * 8 + 13 * 8 = 872 elements; live: two blocks and a quarter (1744 + 218)
    c = from_deepspeed(ds, hidden_size=8)
    assert (c.param_persistence_threshold, c.prefetch_bucket_size, c.reduce_bucket_size,
            c.max_reuse_distance, c.max_live_parameters) == (80, 872, 872, 872, 1962)
    assert from_deepspeed(ds, hidden_size=16).prefetch_bucket_size == 12 * 16 * 16 + 13 * 16
    # without the model there is no value for "auto": refused, every key named, the way out said
    with pytest.raises(ValueError, match="hidden_size") as info:
        Zero3Config.from_deepspeed(ds)
    assert all(f"zero_optimization.{key}" in str(info.value) for key in sizes)
    # a written number is taken as written, with or without the model
    fixed = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}
    assert from_deepspeed(fixed, hidden_size=8).reduce_bucket_size == 1000
    assert from_deepspeed(fixed).reduce_bucket_size == 1000


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
        ({"gradient_clipping": "auto"}, "gradient_clipping"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
        ({"zero_optimization": {"stage": 3, "overlap_comm": "auto"}}, "zero_optimization.overlap_comm"),
    ],
)
def test_from_deepspeed_refuses_auto_that_the_model_cannot_give(config: dict[str, Any], named: str) -> None:
    # nothing in the model sets these; without TrainingValues (tests/test_zero3_deepspeed_json.py) there is no value
    for hidden_size in (None, 64):
        with pytest.raises(ValueError, match='"auto"') as info:
            Zero3Config.from_deepspeed(config, hidden_size=hidden_size)
        assert named in str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2, "3"])
def test_from_deepspeed_rejects_other_stages(stage: Any) -> None:
    with pytest.raises(ValueError, match="stage"):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb'"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
    ],
)
def test_from_deepspeed_rejects_unknown_keys_by_name(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Zero3Config.from_deepspeed(config)


def test_from_deepspeed_validates_values() -> None:
    with pytest.raises(ValueError, match="max_live_parameters"):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}})
    with pytest.raises(TypeError, match="reduce_bucket_size"):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5.5}})


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


def _factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _raises(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks the type and message
        return type(e).__name__, str(e)
    return None


def _trains(engine: Any, model_in: int = 7) -> list[float]:
    """Three optimizer steps through the engine on one fixed batch: the losses
    (they go down when training works)."""
    losses = []
    x = torch.randn(4, model_in, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        assert engine.step()
        losses.append(float(loss.detach()))
    return losses


def _full_and_trainable(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(
        p.requires_grad and p.shape == before[n].shape and torch.equal(p.detach(), before[n])
        for n, p in model.named_parameters()
    )


def bad_no_parameters(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    err = _raises(
        lambda: zero3.initialize(nn.Sequential(nn.Tanh(), nn.Identity()), _factory, Zero3Config(**SHARDED), ctx.group)
    )
    engine = zero3.initialize(nn.Linear(7, 3), _factory, Zero3Config(**SHARDED), ctx.group)
    return {"error": err, "losses": _trains(engine)}


def bad_meta_device(ctx: Any) -> dict[str, Any]:
    """A meta parameter that nothing can initialize is refused by name and
    nothing changes; once its module can initialize itself, a model that is
    partly on the meta device trains (the rest comes from rank 0)."""
    from z3kit_recipes import zero3

    class Bare(nn.Module):  # no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, 5, device="meta"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    model = nn.Sequential(nn.Linear(7, 5), Bare())
    err = _raises(lambda: zero3.initialize(model, _factory, Zero3Config(**SHARDED), ctx.group))
    unchanged = model[0].weight.numel() == 35 and model[1].weight.is_meta
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3, device="meta"))
    engine = zero3.initialize(model, _factory, Zero3Config(**SHARDED), ctx.group)
    return {"error": err, "unchanged": unchanged, "losses": _trains(engine)}


def bad_config_value(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = nn.Linear(7, 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}
    err = _raises(lambda: zero3.initialize(model, _factory, ds, ctx.group))
    untouched = _full_and_trainable(model, before)
    ds["zero_optimization"]["stage3_max_live_parameters"] = 1000
    engine = zero3.initialize(model, _factory, ds, ctx.group)
    return {"error": err, "untouched": untouched, "losses": _trains(engine)}


def bad_optimizer_factory(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = nn.Linear(7, 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    err = _raises(lambda: zero3.initialize(model, lambda params: list(params), Zero3Config(**SHARDED), ctx.group))
    untouched = _full_and_trainable(model, before)
    # plain torch still trains it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 7)).pow(2).mean().backward()
    opt.step()
    moved = all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return {"error": err, "untouched": untouched, "moved": moved}


def bad_step_before_backward(ctx: Any) -> dict[str, Any]:
    case = Case("mlp", SHARDED, steps=4)
    engine, ref, _ = build_pair(ctx, case)
    err = _raises(engine.step)
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    return {"error": err, "pair": finish(engine, ref, res)}


def bad_parameter_added(ctx: Any) -> dict[str, Any]:
    case = Case("mlp", SHARDED, steps=6)
    engine, ref, model = build_pair(ctx, case)
    res = train_steps(ctx, engine, ref, case, range(2), new_result(engine, ref))
    model.layers[1].extra_scale = nn.Parameter(torch.ones(3))
    err = _raises(lambda: WORKLOADS["mlp"].loss(engine, WORKLOADS["mlp"].batch(ctx.rank, 2, 0, 0), 2))
    gathered_after_error = engine.gathered_numel()
    del model.layers[1].extra_scale
    train_steps(ctx, engine, ref, case, range(2, case.steps), res)
    return {"error": err, "gathered_after_error": gathered_after_error, "pair": finish(engine, ref, res)}


def bad_input_mid_forward(ctx: Any) -> dict[str, Any]:
    """A forward that fails half-way (the second layer raises after the
    engine gathered it): the engine frees what it gathered and keeps training."""
    case = Case("mlp", SHARDED, steps=6)
    engine, ref, model = build_pair(ctx, case)
    res = train_steps(ctx, engine, ref, case, range(2), new_result(engine, ref))
    seen = {}

    def fail(module: nn.Module, args: Any) -> None:
        seen["gathered_at_failure"] = engine.gathered_numel()
        raise ValueError("bad input reached layer 1")

    handle = model.layers[1].register_forward_pre_hook(fail)
    err = _raises(lambda: WORKLOADS["mlp"].loss(engine, WORKLOADS["mlp"].batch(ctx.rank, 2, 0, 0), 2))
    handle.remove()
    gathered_after_error = engine.gathered_numel()
    backward_err = _raises(lambda: engine.backward(torch.tensor(1.0)))
    train_steps(ctx, engine, ref, case, range(2, case.steps), res)
    return {"error": err, "backward_error": backward_err, "gathered_after_error": gathered_after_error,
            "gathered_at_failure": seen.get("gathered_at_failure"), "pair": finish(engine, ref, res)}


BAD_INPUTS = {
    "no_parameters": bad_no_parameters,
    "meta_device": bad_meta_device,
    "config_value": bad_config_value,
    "optimizer_factory": bad_optimizer_factory,
    "step_before_backward": bad_step_before_backward,
    "parameter_added": bad_parameter_added,
    "input_mid_forward": bad_input_mid_forward,
}


def run_bad_inputs(ctx: Any) -> dict[str, Any]:
    out = {}
    for name, fn in BAD_INPUTS.items():
        try:
            out[name] = fn(ctx)
        except Exception:  # noqa: BLE001 - reported per case by the tests
            out[name] = {"crashed": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def bad_inputs(pools: Any) -> list[dict[str, Any]]:
    return pools.run(2, run_bad_inputs)


def _case(bad_inputs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [r[name] for r in bad_inputs]
    for rank, r in enumerate(out):
        assert "crashed" not in r, f"rank {rank}:\n{r.get('crashed')}"
    return out


def _assert_error(err: tuple[str, str] | None, kind: str, *words: str) -> None:
    assert err is not None, f"expected {kind}, nothing was raised"
    assert err[0] == kind, err
    for w in words:
        assert w in err[1], f"{w!r} not in the message: {err[1]}"


def test_bad_model_without_parameters(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "no_parameters"):
        _assert_error(r["error"], "ValueError", "Sequential", "no parameters")
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0]


def test_bad_parameter_on_meta_device(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "meta_device"):
        _assert_error(r["error"], "ValueError", "1.weight on the meta device", "param_init_fn")
        assert r["unchanged"]
        assert r["losses"][-1] < r["losses"][0]


def test_bad_config_value(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "config_value"):
        _assert_error(r["error"], "ValueError", "max_live_parameters")
        assert r["untouched"]
        assert r["losses"][-1] < r["losses"][0]


def test_bad_optimizer_factory_leaves_model_untouched(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "optimizer_factory"):
        _assert_error(r["error"], "TypeError", "torch.optim.Optimizer", "list")
        assert r["untouched"] and r["moved"]


def test_step_before_backward(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "step_before_backward"):
        _assert_error(r["error"], "RuntimeError", "backward")
        assert_pair([r["pair"]])


def test_parameter_added_after_initialize(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "parameter_added"):
        _assert_error(r["error"], "RuntimeError", "layers.1.extra_scale")
        assert r["gathered_after_error"] == 0
        assert_pair([r["pair"]])


def test_forward_error_leaves_engine_usable(bad_inputs: list[dict[str, Any]]) -> None:
    for r in _case(bad_inputs, "input_mid_forward"):
        _assert_error(r["error"], "ValueError", "bad input reached layer 1")
        assert r["gathered_at_failure"] > 0  # the failure came with parameters gathered
        assert r["gathered_after_error"] == 0
        _assert_error(r["backward_error"], "ValueError", "does not require grad")
        assert_pair([r["pair"]])


def run_forward_on_one_rank_inside_gathered(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    config = zero3.Zero3Config(param_persistence_threshold=0)
    engine = zero3.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), config, ctx.group)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    calls_before = engine.log.total_calls()
    out = None
    with engine.gathered_parameters():
        if ctx.rank == 0:  # the other ranks do not join: this must need no collective
            with torch.no_grad():
                out = engine(x)
    expected = torch.nn.functional.linear(
        torch.tanh(torch.nn.functional.linear(x, reference[0], reference[1])), reference[2], reference[3]
    )
    return {
        "calls_inside": engine.log.total_calls() - calls_before,
        "close": out is None or torch.allclose(out, expected),
        "gathered_after": engine.gathered_numel(),
    }


def test_gathered_parameters_pins_for_a_forward_on_one_rank(pools: Any) -> None:
    for r in pools.run(2, run_forward_on_one_rank_inside_gathered):
        assert r["calls_inside"] == 1  # the block's one coalesced gather; rank 0's forward adds none
        assert r["close"] and r["gathered_after"] == 0
