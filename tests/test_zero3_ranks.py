"""When ranks differ (gloo, world 2 and 4): buffers kept in step with rank
0's, inference-only engines next to trained ones, and pinned parameters
that stay gathered whatever runs inside ``gathered_parameters``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
