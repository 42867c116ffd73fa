"""The accelerator path's rules, checked on gloo (world 2 and 4):

- one communicator, one order: every rank issues the same collectives in
  the same order (``CollectiveLog.order``), gathers and reductions alike,
  on graphs where gradients reach the ranks differently (a leaf MoE whose
  experts get tokens on some ranks only, a parameter no rank uses, late
  gradients under reentrant checkpointing), with parity against DDP;
- no host sync in a training step: ``z3kit.host_sync.HostSyncCounter``
  around forward, backward and step counts none after the first step;
- a parameter that some ranks give a gradient and others do not, after
  every rank always did, is named (``zero3.training.step_checks``);
- ``collective_timeout_s`` stays under the process group's own timeout.

``tests/test_accelerator_semantics.py`` runs the same path under NCCL's
wait semantics.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_pool import fresh_group
from tests.zero3_models import D_IN, WORKLOADS, Case, assert_params_match, build_pair, vec_batch

SHARDED = {"param_persistence_threshold": 0}

CASES = {
    "mlp": Case("mlp", SHARDED, steps=4),
    "gpt_hf_clipped": Case("gpt_hf", {**SHARDED, "gradient_clipping": 0.05}, optimizer="adamw", clip=0.05, steps=4),
    "moe_leaf_uneven_tokens": Case("moe", SHARDED, find_unused=True, leaf=("MoE",), steps=4),
    "never_used_param": Case("unused", SHARDED, find_unused=True, steps=4),
    "late_gradients": Case("shared_ckpt_reentrant", {**SHARDED, "reduce_bucket_size": 64}, static_graph=True, steps=4),
    "accumulation_small_buckets": Case("gpt_hf", {**SHARDED, "gradient_accumulation_steps": 2, "reduce_bucket_size": 300},
                                       accumulation=2, steps=3),
}


def run_path(ctx: Any, case: Case) -> dict[str, Any]:
    from z3kit.host_sync import HostSyncCounter

    engine, ref, _ = build_pair(ctx, case)
    engine.log.order = []
    wl = WORKLOADS[case.workload]
    syncs, calls, losses, ref_losses = [], [], [], []
    for step in range(case.steps):
        counted = 0
        for micro in range(case.accumulation):
            batches = [wl.batch(ctx.rank, step, micro, k) for k in range(case.forwards)]
            with HostSyncCounter("cpu") as counter:
                loss = sum(wl.loss(engine, b, step) for b in batches)
                engine.backward(loss)
                engine.step()
            # the models' own code may sync (an MoE's routing calls nonzero): only the engine's count
            ours = [c for c in counter.calls if "zero3_models.py" not in c]
            counted += len(ours)
            calls += ours
            losses.append(float(loss.detach()))
            ref_losses.append(ref.micro_step(batches, step, micro))
        ref.step()
        syncs.append(counted)
    return {"order": engine.log.order, "syncs": syncs, "calls": calls, "losses": losses, "ref_losses": ref_losses,
            "params": engine.full_state_dict(), "ref_params": ref.params()}


#: every case at world 2; at world 4 the cases whose ranks differ most
WORLDS_AND_CASES = [(2, name) for name in sorted(CASES)] + [
    (4, name) for name in ("accumulation_small_buckets", "moe_leaf_uneven_tokens")]


@pytest.mark.parametrize(("world", "name"), WORLDS_AND_CASES)
def test_one_order_no_host_sync_and_parity(pools: Any, world: int, name: str) -> None:
    results = pools.run(world, run_path, CASES[name])
    first = results[0]["order"]
    assert first, "no collective was recorded"
    for rank, r in enumerate(results):
        assert r["order"] == first, f"rank {rank} issued its collectives in another order than rank 0"
        assert r["syncs"][1:] == [0] * (len(r["syncs"]) - 1), f"rank {rank} host syncs per step {r['syncs']}: {r['calls']}"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        assert_params_match(r["params"], r["ref_params"])


class SometimesBias(nn.Module):
    """A bias used on every rank at first, then on rank 0 only: the case a
    reduction issued early on one rank and late on another would mispair."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D_IN, 4)
        self.extra = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.lin(x)
        return y + self.extra if use_extra else y


def run_rank_conditional(ctx: Any) -> str:
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3.ranks.agreement import RanksDisagree

    torch.manual_seed(0)
    engine = zero3.initialize(SometimesBias(), lambda p: torch.optim.SGD(p, lr=0.1),
                              zero3.Zero3Config(collective_timeout_s=20.0), fresh_group(ctx))
    for step in range(6):
        x = vec_batch(ctx.rank, step, 0, 0)["x"]
        try:
            engine.backward(engine(x, use_extra=step < 3 or ctx.rank == 0).square().mean())
            engine.step()
        except RanksDisagree as exc:
            return f"step {step}: {exc}"
    return "no error"


def test_rank_conditional_use_after_steady_state_is_named(pools: Any) -> None:
    outs = pools.run(2, run_rank_conditional)
    for out in outs:
        assert out.startswith("step 4: "), out  # step 3's check is read at the end of step 4's backward
        assert "'extra'" in out and "rank(s) [0] only" in out and "leaf module" in out


def run_timeouts(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from z3kit_recipes import zero3

    group = dist.new_group(ranks=list(range(ctx.world)), timeout=timedelta(seconds=100), use_local_synchronization=True)
    out: dict[str, Any] = {}
    engine = zero3.initialize(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), None, group)
    out["default"] = engine.watch.timeout_s
    try:
        zero3.initialize(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                         zero3.Zero3Config(collective_timeout_s=100.0), group)
        out["too_long"] = "accepted"
    except ValueError as exc:
        out["too_long"] = str(exc)
    return out


def test_collective_timeout_stays_under_the_groups(pools: Any) -> None:
    for out in pools.run(2, run_timeouts):
        assert out["default"] == pytest.approx(90.0)
        assert "must be shorter than the process group's timeout (100 s)" in out["too_long"]


def run_without_store(ctx: Any) -> list[str]:
    import warnings

    from z3kit import process_group
    from z3kit_recipes import zero3

    shared_store = process_group.shared_store
    process_group.shared_store = lambda: None  # a group made without init_process_group's store
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zero3.initialize(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), None, fresh_group(ctx))
    finally:
        process_group.shared_store = shared_store
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_no_shared_store_is_said_loudly(pools: Any) -> None:
    for said in pools.run(2, run_without_store):
        assert any("cannot tell the others" in m and "init_process_group" in m for m in said), said
