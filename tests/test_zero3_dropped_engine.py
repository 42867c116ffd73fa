"""A dropped engine is freed: its shards, buffers and optimizer state go
with it, and its watcher thread ends.

Users build engines and drop them (an actor and a reference model, a
restart after an error, a benchmark's cases one after another). The
engine hooks the user's parameters, and torch keeps a parameter's
post-accumulate-grad hooks where the garbage collector does not look: a
hook that held the engine kept every dropped engine alive (seen on an
H200 as 4 GiB still allocated after the GPU check's first cases).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest

from tests import accelerator_double as double
from tests.zero3_models import Case, build_pair, new_result, train_steps

SHARDED = {"param_persistence_threshold": 0}
CASES = {
    "mlp": Case("mlp", SHARDED, steps=2),
    "gpt_hf_tied_accumulation": Case("gpt_hf", {**SHARDED, "gradient_accumulation_steps": 2}, accumulation=2, steps=2),
    "moe_leaf": Case("moe", SHARDED, find_unused=True, leaf=("MoE",), steps=2),
    "checkpoint_reentrant": Case("ckpt_reentrant", SHARDED, steps=2),
}


def _watcher_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "z3kit-peer-watch")


def run_and_drop(ctx: Any, case: Case, nccl_semantics: bool) -> dict[str, Any]:
    threads_before = _watcher_threads()
    group = double.new_group(list(range(ctx.world))) if nccl_semantics else None
    engine, ref, model = build_pair(ctx, case, process_group=group)
    train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    threads_while_alive = _watcher_threads()
    engine_ref, model_ref = weakref.ref(engine), weakref.ref(model)
    shard_refs = [weakref.ref(s.shard) for s in engine.parts.layout.shards]
    del engine, model, ref
    # the engine's parts refer to each other: a garbage collection frees them, and the watcher
    # thread, which follows the last collectives until they finish, ends at its next look after
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        if engine_ref() is None and _watcher_threads() == threads_before or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {
        "engine_alive": engine_ref() is not None,
        "model_alive": model_ref() is not None,
        "shards_alive": sum(r() is not None for r in shard_refs),
        "shards": len(shard_refs),
        "threads_while_alive": threads_while_alive - threads_before,
        "threads_left": _watcher_threads() - threads_before,
    }


@pytest.mark.parametrize(("world", "nccl_semantics"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dropped_engine_is_freed(pools: Any, world: int, nccl_semantics: bool, name: str) -> None:
    for rank, r in enumerate(pools.run(world, run_and_drop, CASES[name], nccl_semantics)):
        assert r["shards"] > 0
        assert not r["engine_alive"], f"rank {rank}: the dropped engine is still referenced"
        assert not r["model_alive"], f"rank {rank}: the dropped engine's model is still referenced"
        assert r["shards_alive"] == 0, f"rank {rank}: {r['shards_alive']} of {r['shards']} shards outlive the engine"
        assert r["threads_left"] == 0, f"rank {rank}: the dropped engine's watcher thread still runs"
        if nccl_semantics:
            assert r["threads_while_alive"] == 1, "an engine on an accelerator backend runs one watcher thread"
