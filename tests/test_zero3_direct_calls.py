"""Calling the model itself (``model(x)``) instead of the engine
(``engine(x)``), as Hugging Face Trainer-style code and eval code do: the
root's own hooks run the engine's part of the forward (``zero3.runtime.root_hooks``),
so both calls train alike, against DDP on a deep copy (gloo, worlds 1 and 2).

* Training by ``model(x)`` and ``loss.backward()``, or mixing the two calls,
  matches DDP, on a parent that uses a child's weight too.
* An eval under ``no_grad`` by ``model(x)`` computes the unsharded model's
  output, and training goes on at parity.
* A forward that raises on every rank is aborted once and leaves the engine
  usable; one that raises on one rank gives ``RankFailed`` on the others.
  A ``KeyboardInterrupt``, which torch's ``always_call`` hooks do not see,
  is aborted once too.
* The root called inside its own forward is part of the outer forward.
* An unmodified Hugging Face model trained by ``model(input_ids=...,
  labels=...)`` matches DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import (
    D_IN,
    D_OUT,
    HIDDEN,
    MLP,
    WORKLOADS,
    Case,
    DDPReference,
    PairResult,
    Workload,
    assert_pair,
    build_pair,
    finish,
    new_result,
    vec_batch,
    vec_loss,
)

SHARDED = {"param_persistence_threshold": 0}


class Nested(nn.Module):
    """Calls itself inside its forward, and uses its own weight after that call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)
        self.mix = nn.Parameter(torch.randn(D_OUT, D_OUT) * 0.3)

    def forward(self, x: torch.Tensor, inner: bool = True) -> torch.Tensor:
        h: torch.Tensor = self.out(torch.tanh(self.inp(x)))
        if inner:
            h = h + self(x, inner=False) @ self.mix
        return h


WORKLOADS.setdefault("nested", Workload(Nested, vec_batch, vec_loss))


def _caller(how: str, engine: Any, model: nn.Module, step: int) -> Any:
    """What the step calls: the model, the engine, or each in turn."""
    if how == "mixed":
        return engine if step % 2 else model
    return model if how == "model" else engine


def train_direct(
    ctx: WorkerContext, case: Case, how: str, steps: range, engine: Any, ref: DDPReference, model: nn.Module,
    res: PairResult,
) -> PairResult:
    """``case`` on both runs, the engine's side called ``how``; a call of the
    model backs its loss with ``loss.backward()``, as plain torch code does."""
    wl = WORKLOADS[case.workload]
    for step in steps:
        b = wl.batch(ctx.rank, step, 0, 0)
        caller = _caller(how, engine, model, step)
        loss = wl.loss(caller, b, step)
        if caller is model:
            loss.backward()
        else:
            engine.backward(loss)
        res.stepped.append(engine.step())
        res.engine_losses.append(float(loss.detach()))
        res.ddp_losses.append(ref.micro_step([b], step, 0))
        ref.step()
        res.gathered_after_step.append(engine.gathered_numel())
    return res


def run_direct(ctx: WorkerContext, case: Case, how: str) -> PairResult:
    engine, ref, model = build_pair(ctx, case)
    res = train_direct(ctx, case, how, range(case.steps), engine, ref, model, new_result(engine, ref))
    return finish(engine, ref, res)


def _check(results: list[PairResult], steps: int) -> None:
    assert_pair(results)
    for r in results:
        assert r.stepped == [True] * steps
        assert all(g == 0 for g in r.gathered_after_step)  # nothing left gathered after a step


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["model", "mixed"])
@pytest.mark.parametrize("workload", ["gpt_hf", "gpt_functional", "mlp"])
def test_training_by_calling_the_model_matches_ddp(pools: Any, workload: str, how: str, world: int) -> None:
    """``gpt_functional``'s root reads the token embedding's weight (a parent
    using a child's weight): without the root's hooks, a size mismatch."""
    case = Case(workload, SHARDED, steps=6, optimizer="adamw" if workload.startswith("gpt") else "adam")
    _check(pools.run(world, run_direct, case, how), 6)


@pytest.mark.parametrize("how", ["model", "engine"])
def test_the_root_called_inside_its_own_forward(pools: Any, how: str) -> None:
    """The inner call is part of the outer forward: the root's weight used after it is gathered."""
    _check(pools.run(2, run_direct, Case("nested", SHARDED, steps=5), how), 5)


# --------------------------------------------------------------------------- #
# Eval by calling the model, then training again
# --------------------------------------------------------------------------- #


def run_eval_then_train(ctx: WorkerContext) -> dict[str, Any]:
    case = Case("gpt_functional", SHARDED, steps=6, optimizer="adamw")
    engine, ref, model = build_pair(ctx, case)
    res = new_result(engine, ref)
    train_direct(ctx, case, "model", range(3), engine, ref, model, res)
    idx = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(5))
    model.eval()
    ref.model.eval()
    with torch.no_grad():
        got, want = model(idx), ref.model(idx)
    gathered_after_eval = engine.gathered_numel()
    model.train()
    ref.model.train()
    train_direct(ctx, case, "model", range(3, 6), engine, ref, model, res)
    out = finish(engine, ref, res)
    out.extra = {"eval_close": torch.allclose(got, want, rtol=1e-5, atol=1e-6),
                 "gathered_after_eval": gathered_after_eval}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_eval_by_calling_the_model_then_training_goes_on(pools: Any, world: int) -> None:
    results = pools.run(world, run_eval_then_train)
    _check(results, 6)
    for r in results:
        assert r.extra == {"eval_close": True, "gathered_after_eval": 0}


# --------------------------------------------------------------------------- #
# Forwards that raise
# --------------------------------------------------------------------------- #


def _raiser(exc: BaseException) -> Callable[[nn.Module, Any], None]:
    def hook(module: nn.Module, args: Any) -> None:
        raise exc

    return hook


def run_raise_everywhere(ctx: WorkerContext, how: str, kind: str) -> dict[str, Any]:
    """Step 2's forward raises on every rank inside a child (a ValueError, or
    a KeyboardInterrupt that torch's always-called hooks do not see); the
    step is run again and training goes on."""
    case = Case("gpt_functional", SHARDED, steps=6, optimizer="adamw")
    engine, ref, model = build_pair(ctx, case)
    aborts: list[str] = []
    abort = engine.coordinator.abort

    def counted(**kwargs: Any) -> None:  # one per aborted forward or backward
        aborts.append("abort")
        abort(**kwargs)

    engine.coordinator.abort = counted
    res = new_result(engine, ref)
    train_direct(ctx, case, how, range(2), engine, ref, model, res)
    exc: BaseException = ValueError("corrupt batch") if kind == "error" else KeyboardInterrupt()
    handle = model.blocks[1].register_forward_pre_hook(_raiser(exc))
    caught = ""
    try:
        b = WORKLOADS[case.workload].batch(ctx.rank, 2, 0, 0)
        _caller(how, engine, model, 0)(b["idx"])
    except (ValueError, KeyboardInterrupt) as e:
        caught = type(e).__name__
    handle.remove()
    aborted_at_once = len(aborts)
    train_direct(ctx, case, how, range(2, 6), engine, ref, model, res)
    out = finish(engine, ref, res)
    out.extra = {"caught": caught, "aborted_at_once": aborted_at_once, "aborts": len(aborts)}
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("how", "kind"), [("model", "error"), ("engine", "error"), ("model", "interrupt"),
                                           ("engine", "interrupt")])
def test_a_forward_that_raises_everywhere_leaves_the_engine_usable(
    pools: Any, world: int, how: str, kind: str
) -> None:
    results = pools.run(world, run_raise_everywhere, how, kind)
    _check(results, 6)
    for r in results:
        assert r.extra["caught"] == ("ValueError" if kind == "error" else "KeyboardInterrupt")
        # aborted exactly once: at once, or (an interrupted model(x), whose
        # post-forward never ran) at the next forward
        assert r.extra["aborts"] == 1, r.extra
        assert r.extra["aborted_at_once"] == (0 if (how, kind) == ("model", "interrupt") else 1)


def run_one_rank_raises(ctx: WorkerContext) -> dict[str, Any]:
    import time

    from z3kit_recipes import zero3

    torch.manual_seed(1)
    model = MLP()
    engine = zero3.initialize(model, torch.optim.Adam, zero3.Zero3Config(**SHARDED), fresh_group(ctx))
    b = vec_batch(ctx.rank, 0, 0, 0)
    F.mse_loss(model(b["x"]), b["y"]).backward()
    engine.step()
    handle = model.layers[1].register_forward_pre_hook(_raiser(ValueError("this batch is corrupt"))) \
        if ctx.rank == 1 else None
    start = time.monotonic()
    caught = ""
    try:
        F.mse_loss(model(b["x"]), b["y"]).backward()
        engine.step()
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        caught = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if handle is not None:
        handle.remove()
    later = ""
    try:
        model(b["x"])
    except Exception as e:  # noqa: BLE001
        later = f"{type(e).__name__}: {e}"
    return {"caught": caught, "seconds": seconds, "later": later}


def test_a_forward_that_raises_on_one_rank_stops_the_others(pools: Any) -> None:
    results = pools.run(2, run_one_rank_raises)
    assert results[1]["caught"].startswith("ValueError: this batch is corrupt")
    assert results[0]["caught"].startswith("RankFailed"), results[0]
    assert "rank 1 forward raised ValueError: this batch is corrupt" in results[0]["caught"]
    for r in results:
        assert r["seconds"] < 30  # the notice board, not a timeout
        assert r["later"].startswith("RankFailed") and "resume from the last checkpoint with a new engine" in r["later"]


# --------------------------------------------------------------------------- #
# engine.join() with calls of the model
# --------------------------------------------------------------------------- #


def run_join(ctx: WorkerContext) -> dict[str, Any]:
    """Rank 0 has 3 batches, rank 1 has 2, each called as ``model(x)``
    inside ``engine.join()``: the calls take part in its rounds."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = MLP()
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), zero3.Zero3Config(**SHARDED),
                              fresh_group(ctx))
    with engine.join():
        for step in range(3 if ctx.rank == 0 else 2):
            b = vec_batch(ctx.rank, step, 0, 0)
            F.mse_loss(model(b["x"]), b["y"]).backward()
            engine.step()
    return {"steps": engine.stats().global_step, "state": engine.full_state_dict()}


def test_calls_of_the_model_inside_join(pools: Any) -> None:
    from tests.zero3_models import assert_params_match

    results = pools.run(2, run_join, timeout=120)
    assert [r["steps"] for r in results] == [3, 3]
    assert_params_match(results[0]["state"], results[1]["state"])


# --------------------------------------------------------------------------- #
# A root compiled in place: engine(x) only
# --------------------------------------------------------------------------- #


def run_compiled_root(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), zero3.Zero3Config(**SHARDED),
                              ctx.group)
    model.compile(backend="aot_eager")
    b = vec_batch(ctx.rank, 0, 0, 0)
    refused = ""
    try:
        model(b["x"])
    except RuntimeError as e:
        refused = str(e)
    losses = []
    for step in range(2):  # an eager learning forward, then a compiled one
        b = vec_batch(ctx.rank, step, 0, 0)
        loss = F.mse_loss(engine(b["x"]), b["y"])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"refused": refused, "losses": losses}


def test_a_root_compiled_in_place_is_called_through_the_engine(pools: Any) -> None:
    (r,) = pools.run(1, run_compiled_root, timeout=180)
    assert r["refused"].startswith("this model was compiled in place (model.compile())"), r
    assert "engine(x)" in r["refused"]
    assert len(r["losses"]) == 2


# --------------------------------------------------------------------------- #
# Unmodified Hugging Face models
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workload", ["hf_llama", "hf_gpt2"])
def test_hugging_face_model_called_directly_matches_ddp(pools: Any, workload: str, world: int) -> None:
    """``model(input_ids=..., labels=...).loss``, ``loss.backward()``, ``engine.step()``.
    A small lr: Adam turns the rounding noise of near-zero gradients into
    steps of size lr (at lr 3e-3 one Llama key weight at world 1 drifts by
    1.7e-6, through ``engine(x)`` exactly as through ``model(x)``)."""
    pytest.importorskip("transformers")
    _check(pools.run(world, run_direct, Case(workload, SHARDED, steps=4, lr=1e-3), "model"), 4)

