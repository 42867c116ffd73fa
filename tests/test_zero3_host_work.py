"""The host work of a training step, counted, not timed (``z3kit.host_work``).

A ZeRO-3 runtime's time on the host is the work in its hooks times the
units it hooks. These counts pin that work for the bench's GPT and Llama
(``z3kit_recipes.models``), at one and two ranks, with the default config
(fetch units: one per block): the Python hooks torch calls into the engine,
the autograd Functions it applies, its ``__torch_function__`` calls, and
the collectives. A change that adds host work per module or per
parameter changes them, on any machine, without a timing.

When a change alters them on purpose, say why in its commit and update
the figures here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import WorkerContext
from z3kit_recipes import zero3
from z3kit_recipes.models import LLAMA_CONFIG, LlamaWorkload, Workload, make_workload

#: the bench's Llama at a twelfth of its width: the same modules, parameters and ops, in a second a step less
NARROW_LLAMA = {**LLAMA_CONFIG, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                "num_attention_heads": 4, "num_key_value_heads": 2}


def _counts(ctx: WorkerContext, name: str) -> dict[str, Any]:
    workload: Workload = make_workload("gpt") if name == "gpt" else LlamaWorkload(config=NARROW_LLAMA)
    engine = zero3.initialize(workload.build_model(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), None, ctx.group)
    for step in range(2):  # the first records the trace; the second is a steady step
        x, y = workload.batch(ctx.rank, step)
        engine.backward(workload.loss(engine(x), y))
        engine.step()
    stats = engine.stats()
    model = engine.module
    return {
        "fetch_units": stats.fetch_units,
        "parameters": sum(1 for _ in model.parameters()),
        **stats.host_work,
    }


#: (workload, world) -> the last step's counts. The hooks: a pre- and post-forward per fetch unit (13 x 2 on the GPT,
#: 12 x 2 on the Llama), the backward pre- and post-points (14, 21), and a gradient-ready hook per parameter that
#: two units fetch (the GPT's tied embedding and head: 1); every other gradient goes over with its unit's
#: post-backward (``zero3.training.grad_owners``). Functions: the backward points' autograd nodes.
_GPT = {"fetch_units": 13, "parameters": 100, "hooks": 41, "functions": 14, "torch_functions": 176}
_LLAMA = {"fetch_units": 12, "parameters": 75, "hooks": 45, "functions": 21, "torch_functions": 591}
EXPECTED: dict[tuple[str, int], dict[str, int]] = {
    # one rank: none (a gather only points each parameter at its shard: z3kit.shard's Note at world 1)
    ("gpt", 1): {**_GPT, "collectives": 0},
    ("llama", 1): {**_LLAMA, "collectives": 0},
    # two ranks: the gradient buckets' reductions and the rank checks on top
    ("gpt", 2): {**_GPT, "collectives": 15},
    ("llama", 2): {**_LLAMA, "collectives": 3},
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_host_work_per_step_is_pinned(pools: Any, name: str, world: int) -> None:
    counts = pools.run(world, _counts, name)
    assert counts[0] == counts[-1]  # every rank does the same work
    assert counts[0] == EXPECTED[(name, world)]
