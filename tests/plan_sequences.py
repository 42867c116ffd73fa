"""The parameter sequence of a steady training step, for the planner tests.

``sequence`` runs three steps of a bench workload and returns the third
step's fetches, prefetches and releases as ``engine.timeline`` records
them: (kind, unit, elements, live elements after). The golden sequences
in ``tests/data/plan_sequences.json`` were taken with the runtime that
consulted the release policy and the prefetch limiter module by module,
before plans existed; the stock planner must reproduce them exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist_pool import WorkerContext
from z3kit_recipes import zero3
from z3kit_recipes.models import LLAMA_CONFIG, LlamaWorkload, Workload, make_workload

NARROW_LLAMA = {**LLAMA_CONFIG, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                "num_attention_heads": 4, "num_key_value_heads": 2}

#: name -> (workload, Zero3Config keyword arguments, initialize keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gpt": ("gpt", {}, {}),
    "gpt_small_live": ("gpt", {"max_live_parameters": 2_400_000, "prefetch_bucket_size": 900_000,
                               "param_persistence_threshold": 2_000, "max_reuse_distance": 1_500_000}, {}),
    "gpt_per_module": ("gpt", {"param_persistence_threshold": 1_000, "prefetch_bucket_size": 600_000,
                               "max_live_parameters": 3_000_000}, {"fetch_units": ()}),
    "gpt_no_overlap": ("gpt", {"overlap_comm": False, "param_persistence_threshold": 1_000}, {}),
    "llama": ("llama", {"param_persistence_threshold": 100, "max_live_parameters": 60_000}, {}),
}


def _workload(name: str) -> Workload:
    return make_workload("gpt") if name == "gpt" else LlamaWorkload(config=NARROW_LLAMA)


def sequence(ctx: WorkerContext, case: str) -> list[list[Any]]:
    name, config, init = CASES[case]
    workload = _workload(name)
    torch.manual_seed(0)
    engine = zero3.initialize(workload.build_model(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                              zero3.Zero3Config(**config), ctx.group, **init)
    for step in range(3):
        if step == 1:
            engine.capture_timeline()
        x, y = workload.batch(ctx.rank, step)
        engine.backward(workload.loss(engine(x), y))
        engine.step()
    return [[e.kind, e.module, e.numel, e.live_numel] for e in engine.timeline]
