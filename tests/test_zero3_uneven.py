"""Forwards that only some ranks run (issue 17): met on every rank, or
refused on every rank within seconds, naming what each rank did.

* Rank 0 alone runs a ``no_grad`` forward mid-training (a logged sample),
  or ranks run different numbers of eval batches: every rank raises
  ``RankFailed`` within seconds; nobody waits out a timeout or names a live
  rank as lost.
* Every rank running the same evals, at any point, computes what the
  unsharded model computes; with every parameter persistent (nothing to
  gather) a one-rank forward just works.
* ``engine.generate(..., rank=0)``, called on every rank, gives rank 0 the
  tokens of the unsharded model's ``generate`` on rank 0's prompt.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import MLP, hf_llama, vec_batch


def _engine(ctx: WorkerContext, model: torch.nn.Module, threshold: int = 0, timeout_s: float = 60.0) -> Any:
    from z3kit_recipes import zero3

    config = zero3.Zero3Config(param_persistence_threshold=threshold, collective_timeout_s=timeout_s)
    # a group of its own: the refused cases leave a gather unpaired
    return zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))


def _train_step(engine: Any, step: int, rank: int) -> None:
    b = vec_batch(rank, step, 0, 0)
    engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
    engine.step()


def run_uneven(ctx: WorkerContext, pattern: str, threshold: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    plain = copy.deepcopy(model)
    engine = _engine(ctx, model, threshold)
    _train_step(engine, 0, ctx.rank)
    x = vec_batch(0, 50, 0, 0)["x"]
    started = time.monotonic()
    try:
        if pattern == "sample_on_rank_0":
            if ctx.rank == 0:
                with torch.no_grad():
                    engine(x)
            _train_step(engine, 1, ctx.rank)
        elif pattern == "eval_batches":
            engine.eval()
            for _ in range(3 if ctx.rank == 0 else 2):
                with torch.no_grad():
                    engine(x)
            engine.train()
            _train_step(engine, 1, ctx.rank)
        elif pattern == "same_evals":
            outs = []
            for step in range(1, 3):
                with torch.no_grad():
                    outs.append(engine(x))
                _train_step(engine, step, ctx.rank)
            with torch.no_grad():
                want = engine.full_state_dict()
                plain.load_state_dict(want)
                return {"caught": None, "close": torch.allclose(engine(x), plain(x), atol=1e-6)}
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"caught": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"caught": None, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern", ["sample_on_rank_0", "eval_batches"])
def test_a_forward_on_some_ranks_only_is_named_on_every_rank_in_seconds(pools: Any, world: int, pattern: str) -> None:
    results = pools.run(world, run_uneven, pattern, 0, timeout=90)
    for rank, r in enumerate(results):
        caught = r["caught"]
        assert caught is not None and caught.startswith("RankFailed"), (rank, r)
        assert "eval or no_grad forward" in caught, (rank, caught)
        assert "lost" not in caught and "collective_timeout_s" not in caught, (rank, caught)
        assert r["seconds"] < 10, (rank, r)


@pytest.mark.parametrize("world", [2, 4])
def test_evals_every_rank_runs_compute_the_unsharded_model(pools: Any, world: int) -> None:
    for r in pools.run(world, run_uneven, "same_evals", 0):
        assert r["caught"] is None and r["close"], r


def test_nothing_to_gather_one_rank_forward_just_works(pools: Any) -> None:
    """Every parameter persistent (under the threshold): a sample on rank 0 needs no collective."""
    for r in pools.run(2, run_uneven, "sample_on_rank_0", 10**6):
        assert r["caught"] is None, r


def run_generate(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = hf_llama()
    plain = copy.deepcopy(model)
    engine = _engine(ctx, model)
    prompt = torch.tensor([[5, 9, 17, 3]]) if ctx.rank == 0 else None  # only rank 0 has one
    out = engine.generate(prompt, rank=0, max_new_tokens=6, do_sample=False)
    sampled = engine.generate(prompt, rank=0, max_new_tokens=6, do_sample=True, top_k=5)
    want = plain.generate(torch.tensor([[5, 9, 17, 3]]), max_new_tokens=6, do_sample=False)
    b = {"ids": torch.randint(0, 128, (2, 16))}
    loss = engine(input_ids=b["ids"], labels=b["ids"]).loss
    engine.backward(loss)
    engine.step()  # training goes on after generate
    return {"out": out, "sampled": sampled, "want": want}


@pytest.mark.parametrize("world", [2, 4])
def test_generate_on_one_rank(pools: Any, world: int) -> None:
    results = pools.run(world, run_generate)
    assert torch.equal(results[0]["out"], results[0]["want"])
    assert results[0]["sampled"].shape == (1, 10)
    assert all(r["out"] is None and r["sampled"] is None for r in results[1:])
