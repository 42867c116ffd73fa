"""The engine under a recording stream pair: accelerator stream order, checked on CPU.

Every gather and reduction of these runs goes through
``z3kit.stream_check.RecordingStreamPair``, with a dispatch mode watching
every tensor operation of forward, backward and step: compute touching
memory of a communication it has not waited for, or overwriting memory a
communication still reads, raises. Each communication starts after a
random pause of up to ``DELAY_S`` (a different sequence on each rank), so
the ranks issue their collectives at different times; the runs must still
match DDP to fp32 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch

from tests.zero3_models import Case, PairResult, assert_pair, build_pair, finish, new_result, train_steps
from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker

SHARDED = {"param_persistence_threshold": 0}
DELAY_S = 0.002

CASES = {
    "mlp": Case("mlp", SHARDED, steps=4),
    "transformer_tied_hf": Case("gpt_hf", SHARDED, optimizer="adamw", steps=4),
    "moe_leaf": Case("moe", SHARDED, find_unused=True, leaf=("MoE",), steps=4),
    "checkpoint_reentrant": Case("ckpt_reentrant", SHARDED, steps=4),
    "returns_its_parameter": Case("returns_param", SHARDED, steps=4),
    "accumulation": Case("mlp", {**SHARDED, "gradient_accumulation_steps": 2}, accumulation=2, steps=3),
    "reduce_scatter_small_buckets": Case("gpt_hf", {**SHARDED, "reduce_scatter": True, "reduce_bucket_size": 64}, steps=3),
    "no_overlap": Case("mlp", {**SHARDED, "overlap_comm": False}, steps=3),
    "default_persistence": Case("gpt_hf", {}, optimizer="adamw", steps=3),
}

#: cases with several gathers and buckets a step, so that compute runs while one is in flight
OVERLAPPING = ("transformer_tied_hf", "reduce_scatter_small_buckets", "default_persistence")


def _recorded(ctx: Any, case: Case) -> PairResult:
    checker = StreamOrderChecker()

    def pairs(device: Any) -> RecordingStreamPair:
        return RecordingStreamPair(checker, device=device, delay_s=DELAY_S, seed=ctx.rank)

    with checker.watching():
        engine, ref, _ = build_pair(ctx, case, stream_pairs=pairs)
        result = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
        result = finish(engine, ref, result)
        # demand gathers outside a step, read at once: completed before compute reads them
        with engine.gathered_parameters() as params:
            result.extra["gathered"] = all(
                torch.equal(p.detach().cpu(), result.engine_params[name])
                for name, p in zip(engine.param_names, params)
            )
    result.extra["stream"] = (checker.issued, checker.completed, checker.checked_ops, checker.inflight())
    return result


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("name", list(CASES))
def test_parity_under_recorded_stream_order(pools: Any, name: str, world: int) -> None:
    results = pools.run(world, _recorded, CASES[name])
    assert_pair(results)
    for r in results:
        assert r.extra["gathered"] is True
        issued, completed, checked, inflight = r.extra["stream"]
        assert issued > 0, "the recording pair was not in the loop"
        # with overlap, compute runs while communication is in flight, and every such op was checked
        # (the small models' one gather and one bucket a step have nothing to overlap with)
        if name == "no_overlap":
            assert checked == 0
        elif name in OVERLAPPING:
            assert checked > 0
        # only the persistent parameters' refresh after the last step may still be in flight
        assert issued - completed == len(inflight)
        assert all(label.startswith("all_gather") for label in inflight)
