"""The stock engine under NCCL's waiting semantics, on CPU (``tests.accelerator_double``).

Each case trains on a ``z3sim`` group next to DDP on gloo and must keep,
besides parity: no violation (no timed wait, no collective touching memory
outside its ticket), the same collectives in the same order on every rank
of each group the engine uses, and no host sync in the engine's own code
during forward, backward and step. A rank that raises in forward must
still stop the others within seconds.

These fail on the engine as it is (it polls its collectives with timed
waits and reads its step check on the host): they are the yardstick of the
rewrite of its wait path, not marked xfail.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import accelerator_double as double
from tests.accelerator_double import DOUBLE
from tests.zero3_models import MLP, Case, assert_pair, build_pair, finish, new_result, train_steps, vec_batch
from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker


def _group(ctx: Any) -> double.SimGroup:
    return double.new_group(list(range(ctx.world)))


SHARDED = {"param_persistence_threshold": 0}
ENGINE_CASES = {
    "mlp": Case("mlp", SHARDED, steps=3),
    "gpt_hf_tied": Case("gpt_hf", SHARDED, optimizer="adamw", steps=3),
    "moe_leaf": Case("moe", SHARDED, find_unused=True, leaf=("MoE",), steps=3),
    "checkpoint_reentrant": Case("ckpt_reentrant", SHARDED, steps=3),
    "accumulation": Case("mlp", {**SHARDED, "gradient_accumulation_steps": 2}, accumulation=2, steps=2),
    "reduce_scatter_small_buckets": Case("gpt_hf", {**SHARDED, "reduce_scatter": True, "reduce_bucket_size": 64}, steps=3),
}
#: where the engine's own code lives: a host sync there is the engine's, one in tests/ is the user model's
ENGINE_DIRS = ("z3kit/", "zero3/")
#: syncs the engine makes through torch code that keeps them off the device: the optimizer
#: reads its step counters, which are CPU tensors on an accelerator too (Adam, AdamW)
OFF_DEVICE = ("via torch/optim/",)


def _engines_own(site: str) -> bool:
    return site.split(" ", 1)[0].startswith(ENGINE_DIRS) and not any(v in site for v in OFF_DEVICE)


class _Counted:
    """The engine, the host syncs of its forward, backward and step counted
    (``Observed.counting``); the loss the user computes around them is not."""

    def __init__(self, engine: Any, seen: double.Observed) -> None:
        self._engine, self._seen = engine, seen

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._seen.counting():
            return self._engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        with self._seen.counting():
            self._engine.backward(loss)

    def step(self) -> bool:
        with self._seen.counting():
            return bool(self._engine.step())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def run_engine_case(ctx: Any, case: Case) -> dict[str, Any]:
    """Train ``case`` on a z3sim group next to DDP on gloo, recording every
    violation (not raising: one run lists them all), the issued order and the host syncs."""
    group = _group(ctx)
    checker = StreamOrderChecker()

    def pairs(device: Any) -> RecordingStreamPair:
        return RecordingStreamPair(checker, device=device)

    out: dict[str, Any] = {"error": "", "result": None}
    with DOUBLE.observing(checker, strict=False) as seen:
        try:
            engine, ref, _ = build_pair(ctx, case, process_group=group, stream_pairs=pairs)
            result = train_steps(ctx, _Counted(engine, seen), ref, case, range(case.steps), new_result(engine, ref))
            out["result"] = finish(engine, ref, result)
        except Exception:  # noqa: BLE001 - reported with what was recorded up to it
            out["error"] = traceback.format_exc()
        out["violations"] = list(DOUBLE.violations)
        out["issued"] = DOUBLE.issued()
    out["syncs"] = seen.syncs.by_site()
    out["engine_syncs"] = {k: n for k, n in out["syncs"].items() if _engines_own(k.split(" at ", 1)[1])}
    return out


def engine_faults(results: list[dict[str, Any]]) -> list[str]:
    """Every way the ranks' runs broke the rules (module docstring), one line each."""
    faults = []
    for rank, r in enumerate(results):
        if r["error"]:
            faults.append(f"rank {rank} raised: {r['error'].strip().splitlines()[-1]}")
        if r["violations"]:
            distinct = list(dict.fromkeys(r["violations"]))
            faults.append(f"rank {rank}: {len(r['violations'])} violations ({len(distinct)} distinct), the first: "
                          f"{distinct[0]}" + "".join(f"\n    then: {v}" for v in distinct[1:3]))
    if not any(r["error"] for r in results):
        try:
            assert_pair([r["result"] for r in results])
        except AssertionError as e:
            faults.append(f"DDP parity: {e}")
    for rank, r in enumerate(results[1:], 1):
        for name in sorted(set(results[0]["issued"]) | set(r["issued"])):
            mine, theirs = r["issued"].get(name, []), results[0]["issued"].get(name, [])
            if mine != theirs:
                at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                faults.append(f"group {name[:8]}: rank {rank} issued {mine[at:at + 1]} where rank 0 issued "
                              f"{theirs[at:at + 1]} (collective #{at})")
    for rank, r in enumerate(results):
        if r["engine_syncs"]:
            faults.append(f"rank {rank}: {sum(r['engine_syncs'].values())} host syncs in the engine's own code "
                          f"during forward/backward/step: {r['engine_syncs']}")
    return faults


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_the_engine_keeps_accelerator_semantics(pools: Any, name: str) -> None:
    faults = engine_faults(pools.run(2, run_engine_case, ENGINE_CASES[name]))
    assert not faults, "\n".join(faults)


# --------------------------------------------------------------------------- #
# A rank that raises in forward: the others hear of it within seconds
# --------------------------------------------------------------------------- #


def _raise_bad_batch(module: nn.Module, args: Any) -> None:
    raise ValueError("this batch is corrupt")


def _timed_step(engine: Any, b: dict[str, Any]) -> tuple[str, float]:
    """One training step: what it raised ("" if nothing), and how long it took."""
    start = time.monotonic()
    try:
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "", time.monotonic() - start


def run_rank_raises_in_forward(ctx: Any) -> dict[str, Any]:
    """One healthy step, then rank 1's forward raises: the others, waiting in a
    collective rank 1 never joins, must raise ``RankFailed`` (on NCCL, a plain
    wait does not block the host, so only something beside it, aborting the
    group, can stop a rank that waits for a dead peer; see the double's abort)."""
    from z3kit_recipes import zero3

    group = _group(ctx)
    out: dict[str, Any] = {"setup": "", "caught": "", "seconds": 0.0}
    with DOUBLE.observing():
        torch.manual_seed(1)
        b = vec_batch(ctx.rank, 0, 0, 0)
        try:
            engine = zero3.initialize(MLP(), torch.optim.Adam, zero3.Zero3Config(param_persistence_threshold=0), group)
            engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
            engine.step()
        except Exception as e:  # noqa: BLE001 - what each rank sees is the result
            out["setup"] = f"{type(e).__name__}: {e}"
        if not out["setup"]:
            if ctx.rank == 1:
                engine.module.layers[1].register_forward_pre_hook(_raise_bad_batch)
            out["caught"], out["seconds"] = _timed_step(engine, b)
        out["violations"] = list(DOUBLE.violations)
    return out


@pytest.mark.parametrize("world", [2])
def test_a_rank_that_raises_stops_the_others_within_seconds(pools: Any, world: int) -> None:
    results = pools.run(world, run_rank_raises_in_forward, timeout=90)
    for rank, r in enumerate(results):
        assert not r["setup"], f"rank {rank}, the healthy step: {r['setup']}"
    assert results[1]["caught"].startswith("ValueError: this batch is corrupt"), results[1]
    for rank, r in enumerate(results):
        if rank != 1:
            assert r["caught"].startswith("RankFailed") and "rank 1 forward raised ValueError" in r["caught"], r
            assert r["seconds"] < 5, r


def run_rank_stuck_outside(ctx: Any) -> dict[str, Any]:
    """One healthy step, then rank 1 is busy outside the engine for longer
    than ``collective_timeout_s``: rank 0's gathers never finish. Its plain
    waits return at once (NCCL), so it is the watcher thread that must find
    the stalled collective, name the rank and abort the group."""
    from z3kit_recipes import zero3

    group = _group(ctx)
    out: dict[str, Any] = {"caught": "", "seconds": 0.0}
    with DOUBLE.observing():
        torch.manual_seed(1)
        b = vec_batch(ctx.rank, 0, 0, 0)
        config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=2.0)
        engine = zero3.initialize(MLP(), torch.optim.Adam, config, group)
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()
        if ctx.rank == 1:
            time.sleep(8.0)
        out["caught"], out["seconds"] = _timed_step(engine, b)
        out["violations"] = list(DOUBLE.violations)
    return out


def test_a_stalled_collective_is_named_by_the_watcher(pools: Any) -> None:
    waiting, stuck = pools.run(2, run_rank_stuck_outside, timeout=90)
    assert waiting["caught"].startswith("RankFailed") and "has not finished after" in waiting["caught"], waiting
    assert waiting["seconds"] < 10, waiting  # 2 s of timeout, then up to 3 s for the others' answers
    assert stuck["caught"].startswith("RankFailed"), stuck  # it learns it was left behind at its next call
    assert not waiting["violations"] and not stuck["violations"]
