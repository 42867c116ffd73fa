"""Rank-divergent graphs, opt in (``Zero3Config(divergent_graphs=True)``, issue 17).

A data-dependent early exit and a per-expert ``nn.Module`` MoE without a
leaf unit run different modules on different ranks. With the switch they
train at parity with DDP (``find_unused_parameters=True``) at worlds 2, 3
and 4, with and without gradient accumulation; eval forwards that exit at
different depths compute what the unsharded model computes. Without the
switch a divergent training graph is refused with ``RanksDisagree`` on
every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import Case, EarlyExitModel, PairResult, assert_pair, train_pair, vec_batch

DIVERGENT = {"param_persistence_threshold": 0, "divergent_graphs": True}


def run_case(ctx: WorkerContext, case: Case) -> PairResult:
    return train_pair(ctx, case)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("workload", ["early_exit", "moe", "moe_top2"])
def test_divergent_graphs_train_like_ddp(pools: Any, world: int, workload: str) -> None:
    case = Case(workload, DIVERGENT, optimizer="adamw", find_unused=True, steps=6)
    results = pools.run(world, run_case, case)
    assert_pair(results)
    assert all(r.stats.collectives["all_gather"]["calls"] > 0 for r in results)


def test_divergent_graphs_with_accumulation_and_small_buckets(pools: Any) -> None:
    config = {**DIVERGENT, "gradient_accumulation_steps": 2, "reduce_bucket_size": 40, "overlap_comm": False}
    assert_pair(pools.run(2, run_case, Case("early_exit", config, find_unused=True, accumulation=2, steps=4)))


def run_exits(ctx: WorkerContext, divergent: bool, training: bool) -> dict[str, Any]:
    """Rank 0 exits early, the others do not (inputs shifted by rank)."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = EarlyExitModel()
    plain = copy.deepcopy(model)
    config = zero3.Zero3Config(param_persistence_threshold=0, divergent_graphs=divergent, collective_timeout_s=30)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))
    x = vec_batch(ctx.rank, 0, 0, 0)["x"] + (1.0 if ctx.rank == 0 else -1.0)
    try:
        with torch.set_grad_enabled(training):
            got = engine(x)
            if training:
                engine.backward(got.square().mean())
                engine.step()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"caught": f"{type(exc).__name__}: {exc}"}
    return {"caught": None, "close": torch.allclose(got, plain(x), atol=1e-6)}


@pytest.mark.parametrize("world", [2, 4])
def test_eval_forwards_that_exit_at_different_depths(pools: Any, world: int) -> None:
    for r in pools.run(world, run_exits, True, False):
        assert r["caught"] is None and r["close"], r


def test_without_the_switch_a_divergent_training_graph_is_refused_on_every_rank(pools: Any) -> None:
    for r in pools.run(2, run_exits, False, True, timeout=90):
        assert r["caught"] is not None and r["caught"].startswith(("RanksDisagree", "RankFailed")), r
