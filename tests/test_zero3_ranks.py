"""When ranks differ (gloo, world 2 and 4): buffers kept in step with rank
0's, inference-only engines next to trained ones, and pinned parameters
that stay gathered whatever runs inside ``gathered_parameters``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import fresh_group
from tests.zero3_models import D_IN, D_OUT, HIDDEN, MLP, vec_batch


class Normed(nn.Module):
    """BatchNorm between two layers: running statistics are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


# --------------------------------------------------------------------------- #
# Buffers follow rank 0's, as with DDP
# --------------------------------------------------------------------------- #


def run_buffers(ctx: Any, broadcast: bool) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = Normed()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group,
                                              broadcast_buffers=broadcast)
    # SGD: Adam would turn fp32 rounding differences of near-zero gradients into full steps
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    engine = zero3.initialize(model, lambda p: torch.optim.SGD(p, lr=0.05),
                              zero3.Zero3Config(param_persistence_threshold=0, broadcast_buffers=broadcast), ctx.group)
    losses = []
    for step in range(6):
        b = vec_batch(ctx.rank, step, 0, 0)
        b["x"] = b["x"] * (1 + ctx.rank)  # every rank sees other statistics
        loss = F.mse_loss(engine(b["x"]), b["y"])
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(b["x"]), b["y"])
        ref_loss.backward()
        ref_opt.step()
        losses.append((float(loss), float(ref_loss)))
    state = engine.full_state_dict()
    ref_state = {k: v.clone() for k, v in ref.module.state_dict().items()}
    engine.eval()
    ref.eval()  # DDP's eval forward broadcasts rank 0's buffers again; the engine's only before training ones
    x = vec_batch(0, 99, 0, 0)["x"]
    with torch.no_grad():
        eval_out = (engine(x), ref(x))
    return {"losses": losses, "eval": eval_out, "state": state, "ref_state": ref_state}


@pytest.mark.parametrize("world", [2, 4])
def test_buffers_are_broadcast_from_rank_0_like_ddp(pools: Any, world: int) -> None:
    results = pools.run(world, run_buffers, True)
    # rank 0 evaluates with its own statistics under both
    torch.testing.assert_close(results[0]["eval"][0], results[0]["eval"][1], rtol=1e-5, atol=1e-6)
    for r in results:
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
            assert name in r["state"]  # buffers are part of the full state
            torch.testing.assert_close(r["state"][name], r["ref_state"][name], rtol=1e-5, atol=1e-6)


def test_buffers_stay_local_without_broadcast_like_ddp(pools: Any) -> None:
    results = pools.run(2, run_buffers, False)
    for r in results:
        torch.testing.assert_close(r["state"]["norm.running_mean"], r["ref_state"]["norm.running_mean"])
    assert not torch.equal(results[0]["state"]["norm.running_mean"], results[1]["state"]["norm.running_mean"])


# --------------------------------------------------------------------------- #
# Inference-only engines, beside a trained one
# --------------------------------------------------------------------------- #


def run_actor_and_reference(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(3)
    actor_model, ref_model = MLP(), MLP()
    plain_ref = copy.deepcopy(ref_model)
    actor = zero3.initialize(actor_model, lambda p: torch.optim.Adam(p, lr=1e-2),
                             zero3.Zero3Config(param_persistence_threshold=0), ctx.group)
    reference = zero3.initialize(ref_model, None, zero3.Zero3Config(param_persistence_threshold=0), ctx.group)
    kl = []
    for step in range(4):
        b = vec_batch(ctx.rank, step, 0, 0)
        with torch.no_grad():
            ref_out = reference(b["x"])
        out = actor(b["x"])
        loss = F.mse_loss(out, b["y"]) + 0.1 * F.mse_loss(out, ref_out)
        actor.backward(loss)
        actor.step()
        kl.append(float(F.mse_loss(ref_out, plain_ref(b["x"]))))
    errors = {}
    for what, call in (("step", reference.step), ("backward", lambda: reference.backward(loss))):
        try:
            call()
        except RuntimeError as e:
            errors[what] = str(e)
    frozen_factory = None
    try:
        zero3.initialize(nn.Linear(3, 3).requires_grad_(False), torch.optim.Adam, None, ctx.group)
    except ValueError as e:
        frozen_factory = str(e)
    stats = reference.stats()
    return {"ref_vs_plain": kl, "errors": errors, "frozen_factory": frozen_factory,
            "ref_memory": dict(stats.memory.current), "actor_moved": actor.stats().global_step}


@pytest.mark.parametrize("world", [2, 4])
def test_inference_only_engine_beside_a_trained_one(pools: Any, world: int) -> None:
    for r in pools.run(world, run_actor_and_reference):
        assert max(r["ref_vs_plain"]) < 1e-12  # the reference computes what the unsharded model computes
        assert r["actor_moved"] == 4
        assert "optimizer=None" in r["errors"]["step"] and "optimizer=None" in r["errors"]["backward"]
        assert "pass optimizer=None" in r["frozen_factory"]
        mem = r["ref_memory"]
        assert mem["optimizer_state"] == mem["fp32_masters"] == mem["grad_partitions"] == 0


# --------------------------------------------------------------------------- #
# gathered_parameters keeps what it pinned
# --------------------------------------------------------------------------- #


def run_pinned_forwards(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(5)
    model = MLP()
    plain = copy.deepcopy(model)
    engine = zero3.initialize(model, lambda p: torch.optim.Adam(p), zero3.Zero3Config(param_persistence_threshold=0),
                              ctx.group)
    x = vec_batch(ctx.rank, 0, 0, 0)["x"]
    outs = []
    with engine.gathered_parameters():
        calls = engine.log.total_calls()
        if ctx.rank == 0:  # forwards on one rank only: they must need no collective
            engine.eval()
            with torch.no_grad():
                outs = [engine(x), engine(x)]
            engine.train()
        calls_inside = engine.log.total_calls() - calls
        gathered_inside = engine.gathered_numel()
    return {"outs": outs, "plain": plain(x).detach(), "calls_inside": calls_inside,
            "gathered_inside": gathered_inside, "gathered_after": engine.gathered_numel()}


def test_gathered_parameters_keeps_its_pins_through_one_rank_forwards(pools: Any) -> None:
    results = pools.run(2, run_pinned_forwards)
    assert len(results[0]["outs"]) == 2
    for out in results[0]["outs"]:
        torch.testing.assert_close(out, results[0]["plain"])
    for r in results:
        assert r["calls_inside"] == 0 and r["gathered_inside"] > 0 and r["gathered_after"] == 0


# --------------------------------------------------------------------------- #
# Rank-dependent gradients: zeros where absent, the same collectives everywhere
# --------------------------------------------------------------------------- #


class RankBranch(nn.Module):
    """``side`` runs on every rank; its output reaches the loss on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.side = nn.Linear(HIDDEN, D_OUT)
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, feed_side: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        side = self.side(h)
        out = self.head(h)
        return out + side if feed_side else out


def run_rank_branch(ctx: Any, config: dict[str, Any]) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(7)
    model = RankBranch()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group,
                                              find_unused_parameters=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    group = fresh_group(ctx)
    config = dict(config)
    leaves = [model.side] if config.pop("side_is_leaf", False) else []
    engine = zero3.initialize(model, lambda p: torch.optim.Adam(p, lr=1e-3), zero3.Zero3Config(**config), group,
                              leaf_modules=leaves)
    losses = []
    calls = []
    for step in range(5):
        b = vec_batch(ctx.rank, step, 0, 0)
        feed = ctx.rank == 0 or step % 2 == 1  # on odd steps every rank feeds it
        before = engine.log.total_calls()
        loss = F.mse_loss(engine(b["x"], feed), b["y"])
        engine.backward(loss)
        engine.step()
        calls.append(engine.log.total_calls() - before)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = F.mse_loss(ref(b["x"], feed), b["y"])
        ref_loss.backward()
        ref_opt.step()
        losses.append((float(loss), float(ref_loss)))
    return {"losses": losses, "calls": calls, "params": engine.full_state_dict(),
            "ref": {n: p.detach().clone() for n, p in ref.module.named_parameters()}}


@pytest.mark.parametrize(("world", "config"), [
    (2, {"param_persistence_threshold": 0}),
    (3, {"param_persistence_threshold": 0}),  # shards padded unevenly
    (4, {"param_persistence_threshold": 0}),
    (2, {"param_persistence_threshold": 0, "overlap_comm": False}),
    (4, {"param_persistence_threshold": 0, "overlap_comm": False}),
    (3, {"param_persistence_threshold": 0, "reduce_bucket_size": 50, "check_every_fetch": True}),
    (2, {"param_persistence_threshold": 0, "side_is_leaf": True}),  # a leaf unit whose output some ranks drop
])
def test_gradient_on_some_ranks_only_matches_ddp(pools: Any, world: int, config: dict[str, Any]) -> None:
    results = pools.run(world, run_rank_branch, config)
    for r in results:
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6)
    # the same collectives on every rank, every step
    assert all(r["calls"] == results[0]["calls"] for r in results)


# --------------------------------------------------------------------------- #
# A rank that fails, disagrees, or goes quiet: every rank raises, nobody hangs
# --------------------------------------------------------------------------- #


def run_one_rank_fails(ctx: Any) -> dict[str, Any]:
    import time

    from z3kit_recipes import zero3

    torch.manual_seed(1)
    engine = zero3.initialize(MLP(), torch.optim.Adam, zero3.Zero3Config(param_persistence_threshold=0),
                              fresh_group(ctx))
    b = vec_batch(ctx.rank, 0, 0, 0)
    engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
    engine.step()
    start = time.monotonic()
    caught = ""
    try:
        if ctx.rank == 1:
            raise_inside = engine.module.layers[1].register_forward_pre_hook(_raise_bad_batch)
        out = engine(b["x"])
        engine.backward(F.mse_loss(out, b["y"]))
        engine.step()
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        caught = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if ctx.rank == 1:
        raise_inside.remove()
    later = ""
    try:
        engine(b["x"])
    except Exception as e:  # noqa: BLE001
        later = f"{type(e).__name__}: {e}"
    return {"caught": caught, "seconds": seconds, "later": later}


def _raise_bad_batch(module: nn.Module, args: Any) -> None:
    raise ValueError("this batch is corrupt")


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_raises_stops_every_rank(pools: Any, world: int) -> None:
    results = pools.run(world, run_one_rank_fails)
    assert results[1]["caught"].startswith("ValueError: this batch is corrupt")
    for rank, r in enumerate(results):
        if rank != 1:
            assert r["caught"].startswith("RankFailed") and "rank 1 forward raised ValueError: this batch is corrupt" in r["caught"]
        assert r["seconds"] < 30  # not a hang: the notice board is read within a fraction of a second
        assert r["later"].startswith("RankFailed") and "resume from the last checkpoint with a new engine" in r["later"]


class Repeat(nn.Module):
    """Calls ``block`` twice on rank 0, once elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = torch.tanh(self.block(torch.tanh(self.inp(x))))
        if extra:
            h = torch.tanh(self.block(h))
        return self.head(h)


def run_extra_call(ctx: Any, threshold: int, every_fetch: str = "") -> dict[str, Any]:
    import os
    import time

    from z3kit_recipes import zero3

    torch.manual_seed(2)
    config = zero3.Zero3Config(param_persistence_threshold=threshold, collective_timeout_s=20.0,
                               check_every_fetch=every_fetch == "config")
    if every_fetch == "env":
        os.environ["Z3KIT_CHECK_EVERY_FETCH"] = "1"
    try:
        engine = zero3.initialize(Repeat(), torch.optim.Adam, config, fresh_group(ctx))
    finally:
        os.environ.pop("Z3KIT_CHECK_EVERY_FETCH", None)
    start = time.monotonic()
    caught = ""
    try:
        for step in range(4):
            b = vec_batch(ctx.rank, step, 0, 0)
            engine.backward(F.mse_loss(engine(b["x"], step == 2 and ctx.rank == 0), b["y"]))
            engine.step()
    except Exception as e:  # noqa: BLE001
        caught = f"{type(e).__name__}: {e}"
    return {"caught": caught, "seconds": time.monotonic() - start, "step": engine.global_step}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("threshold", [0, 100_000])  # sharded, or all persistent (no collective for the call)
def test_a_module_run_once_more_on_one_rank_is_a_clear_error(pools: Any, world: int, threshold: int) -> None:
    for rank, r in enumerate(pools.run(world, run_extra_call, threshold)):
        assert r["caught"].startswith("RankFailed"), r["caught"]
        assert "rank 0 left the recorded step" in r["caught"] and "'block'" in r["caught"], r["caught"]
        assert r["seconds"] < 20, r


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("every_fetch", ["config", "env"])
def test_checking_every_fetch_names_both_sides_where_they_part(pools: Any, world: int, every_fetch: str) -> None:
    results = pools.run(world, run_extra_call, 0, every_fetch)
    assert len({r["caught"] for r in results}) == 1  # the same error on every rank
    for r in results:
        assert r["caught"].startswith("RanksDisagree: the ranks are not running the same forward"), r["caught"]
        assert "rank 0 fetches 'block'" in r["caught"] and "rank 1 fetches 'head'" in r["caught"], r["caught"]
        assert r["step"] == 2 and r["seconds"] < 20


def run_rank_dies_or_stalls(ctx: Any, victim: int, how: str, released: str = "") -> dict[str, Any]:
    """``how="stalls"``: the victim stays away from the engine for up to 12 s, or until a
    file at ``released`` exists, which the others create once they have raised."""
    import os
    import time
    from pathlib import Path

    from z3kit_recipes import zero3

    torch.manual_seed(4)
    engine = zero3.initialize(MLP(), torch.optim.Adam, zero3.Zero3Config(param_persistence_threshold=0,
                              collective_timeout_s=1.5), fresh_group(ctx))
    caught, start = "", time.monotonic()
    try:
        for step in range(3):
            if step == 1 and ctx.rank == victim:
                if how == "dies":
                    os._exit(3)
                # stuck outside the engine, past everyone's collective_timeout_s: until the others
                # have given up on it (so they gave up without it), 12 s at most
                stall_until = time.monotonic() + 12.0
                while time.monotonic() < stall_until and not (released and Path(released).exists()):
                    time.sleep(0.05)
            b = vec_batch(ctx.rank, step, 0, 0)
            engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
            engine.step()
    except Exception as e:  # noqa: BLE001
        caught = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if released and ctx.rank != victim:
        Path(released).touch()
    return {"caught": caught, "seconds": seconds}


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_dies_is_named_by_the_others(world: int) -> None:
    from tests.dist_pool import LOST, DistPool

    pool = DistPool(world)  # of its own: a lost rank breaks a pool
    try:
        results = pool.run(run_rank_dies_or_stalls, world - 1, "dies", lost_ok=True, timeout=60)
    finally:
        pool.close()
    assert results[world - 1] == LOST
    for r in results[: world - 1]:
        assert r["caught"].startswith("RankFailed"), r["caught"]
        assert f"rank(s) [{world - 1}] posted nothing" in r["caught"] and "lost" in r["caught"], r["caught"]
        assert r["seconds"] < 30


def test_a_rank_stuck_elsewhere_is_named_after_collective_timeout_s(pools: Any, tmp_path: Path) -> None:
    stuck, waiting = pools.run(2, run_rank_dies_or_stalls, 1, "stalls", str(tmp_path / "released"))[::-1]
    assert waiting["caught"].startswith("RankFailed: rank 0 waited 2 s in a collective (collective_timeout_s)"), waiting
    assert "rank(s) [1] posted nothing" in waiting["caught"]
    assert waiting["seconds"] < 10, waiting  # the timeout and the others' moment to answer, not the 12 s stall
    # the stuck rank, once back, learns why the others stopped instead of waiting for them
    assert stuck["caught"].startswith("RankFailed") and "rank 0 waited" in stuck["caught"], stuck


def run_extra_backward(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(6)
    engine = zero3.initialize(MLP(), torch.optim.Adam, zero3.Zero3Config(param_persistence_threshold=0,
                              gradient_accumulation_steps=2, collective_timeout_s=20.0), fresh_group(ctx))
    caught = ""
    try:
        for step in range(3):
            for micro in range(3 if (ctx.rank == 1 and step == 1) else 2):  # rank 1 runs one backward more
                b = vec_batch(ctx.rank, step, micro, 0)
                engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
            engine.step()
    except Exception as e:  # noqa: BLE001
        caught = f"{type(e).__name__}: {e}"
    return {"caught": caught}


@pytest.mark.parametrize("world", [2, 4])
def test_a_backward_more_between_optimizer_steps_is_named(pools: Any, world: int) -> None:
    results = pools.run(world, run_extra_backward)
    assert len({r["caught"] for r in results}) == 1  # the same error on every rank
    caught = results[0]["caught"]
    assert caught.startswith("RanksDisagree: the ranks are not running the same step"), caught
    assert "rank 0 (2, 4)" in caught and "rank 1 (1, 4)" in caught and "ran one more" in caught, caught
