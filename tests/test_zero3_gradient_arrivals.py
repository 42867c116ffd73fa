"""Every gradient that arrives counts, exactly once per use (issue 17).

* A parameter shared by two segments of reentrant activation checkpointing
  gets two gradients in one backward (each segment's recomputation runs an
  inner backward). Both count, at parity with DDP (``static_graph=True``,
  which DDP needs for this pattern), whether the second arrives before or
  after its bucket was reduced (a bucket smaller than a parameter makes
  every second arrival a late one; a bucket larger than the model, none).
* A parameter no rank used in a step has no gradient and no optimizer
  update, inside a leaf unit too: parity with DDP
  (``find_unused_parameters=True``, gradients set to None) on a per-expert
  MoE under top-1 and top-2 routing, with AdamW's weight decay.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.zero3_models import Case, PairResult, assert_pair, train_pair

SHARDED = {"param_persistence_threshold": 0}


def run_case(ctx: Any, case: Case) -> PairResult:
    return train_pair(ctx, case)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("bucket", [8, 500_000_000], ids=["late", "in_bucket"])
def test_shared_parameter_under_reentrant_checkpointing(pools: Any, world: int, bucket: int) -> None:
    case = Case("shared_ckpt_reentrant", {**SHARDED, "reduce_bucket_size": bucket}, static_graph=True, steps=6)
    results = pools.run(world, run_case, case)
    assert_pair(results)


@pytest.mark.parametrize("workload", ["shared_ckpt_nonreentrant", "shared_ckpt_reentrant"])
def test_shared_parameter_with_accumulation_and_reduce_scatter(pools: Any, workload: str) -> None:
    config = {**SHARDED, "gradient_accumulation_steps": 2, "reduce_scatter": True, "reduce_bucket_size": 64}
    case = Case(workload, config, static_graph=True, accumulation=2, steps=4)
    assert_pair(pools.run(2, run_case, case))


@pytest.mark.parametrize("world", [2, 4])
def test_hf_shared_layers_with_reentrant_gradient_checkpointing(pools: Any, world: int) -> None:
    """One decoder layer shared by all three (ALBERT's pattern), under Hugging Face's gradient checkpointing."""
    case = Case("hf_shared_layers_ckpt", SHARDED, optimizer="adamw", static_graph=True, steps=4, lr=1e-3)
    assert_pair(pools.run(world, run_case, case))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("workload", ["moe", "moe_top2"])
def test_experts_no_rank_used_get_no_update(pools: Any, world: int, workload: str) -> None:
    """Leaf-unit experts without tokens on every rank: no gradient, so
    AdamW's weight decay and moments leave them alone, as under DDP."""
    case = Case(workload, SHARDED, optimizer="adamw", find_unused=True, leaf=("MoE",), steps=6)
    results = pools.run(world, run_case, case)
    assert_pair(results)
