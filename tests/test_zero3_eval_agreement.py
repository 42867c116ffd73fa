"""Eval and no_grad forwards whose ranks gather different things (issue 28, item 3).

An eval forward with an early exit on one rank (rank 1 skips a module)
used to pair its gathers with the wrong modules: a silently wrong output
where the skipped and the next module have the same size, a gloo abort
where not, and a following training step that died inside gloo. Now every
rank raises ``RanksDisagree`` within seconds, naming both modules, before
any gather could pair wrongly; the engine goes on, and the next training
steps match DDP's.

* A normal eval forward matches the unsharded model, and costs one small
  all-gather per gathering fetch plus one at its end (pinned here).
* With every parameter persistent (nothing to gather) an eval forward
  compares nothing.
* Two ranks that leave a recorded trace at the same fetch doing different
  things raise at once, not after ``collective_timeout_s``.
* Under NCCL's waiting semantics (``tests.accelerator_double``) the
  comparisons are read at the end of each eval forward, with no host sync
  of their own; a divergent eval forward whose gathers still pair is
  refused there on every rank, and the engine stops (its gathers may have
  paired wrongly). One whose gathers differ in size fails inside the
  backend first (on the double, gloo underneath aborts the process), so
  that case is not run here.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import D_IN, D_OUT, HIDDEN, assert_params_match, vec_batch


class SkipModel(nn.Module):
    """``mid`` runs unless ``skip`` is set (the test sets it on one rank);
    ``nxt`` follows it, of the same size, or without a bias (another size)."""

    def __init__(self, same_size: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.nxt = nn.Linear(HIDDEN, HIDDEN, bias=same_size)
        self.head = nn.Linear(HIDDEN, D_OUT)
        self.skip = False
        #: run ``nxt`` where ``mid`` would run
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.swap:
            h = torch.tanh(self.nxt(h))
        elif not self.skip:
            h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.nxt(h)))


def _train(engine: Any, ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> tuple[float, float]:
    b = vec_batch(rank, step, 0, 0)
    loss = F.mse_loss(engine(b["x"]), b["y"])
    engine.backward(loss)
    engine.step()
    ref = F.mse_loss(ddp(b["x"]), b["y"])
    ref.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), ref.item()


def run_eval_exit(ctx: WorkerContext, same_size: bool, how: str) -> dict[str, Any]:
    """One training step; an eval forward in which rank 1 skips ``mid``
    (``how``: under ``model.eval()`` and ``no_grad``, or ``no_grad`` only);
    two more training steps; a normal eval forward."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = SkipModel(same_size)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=60)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))
    losses = [_train(engine, ddp, opt, ctx.rank, 0)]
    x = vec_batch(0, 50, 0, 0)["x"]
    out: dict[str, Any] = {"caught": None}
    model.skip = ctx.rank == 1
    if how == "eval":
        model.eval()
    started = time.monotonic()
    try:
        with torch.no_grad():
            out["output"] = engine(x)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out["caught"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    model.skip = False
    model.train()
    losses += [_train(engine, ddp, opt, ctx.rank, step) for step in (1, 2, 3)]
    train_only = engine.stats()  # collectives are counted per optimizer step: step 3's, a training step alone
    model.eval()
    with torch.no_grad():
        got = engine(x)
        plain = copy.deepcopy(ddp.module).eval()
        out["eval_close"] = torch.allclose(got, plain(x), atol=1e-6)
    out["eval_checks"] = engine.stats().fetch_checks - train_only.fetch_checks
    model.train()
    losses.append(_train(engine, ddp, opt, ctx.rank, 4))
    with_eval = engine.stats()  # step 4's: the eval forward and a training step
    out["eval_gathers"] = with_eval.collectives["all_gather"]["calls"] - train_only.collectives["all_gather"]["calls"]
    out["losses"] = losses
    out["state"] = engine.full_state_dict()
    out["ddp"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return out


@pytest.mark.parametrize("how", ["eval", "no_grad"])
@pytest.mark.parametrize("same_size", [True, False])
def test_an_eval_forward_that_skips_a_module_on_one_rank_is_refused_and_training_goes_on(
    pools: Any, same_size: bool, how: str
) -> None:
    results = pools.run(2, run_eval_exit, same_size, how, timeout=120)
    for rank, r in enumerate(results):
        caught = r["caught"]
        assert caught is not None and caught.startswith("RanksDisagree"), (rank, r.get("caught"))
        assert "eval or no_grad forward" in caught and "'mid'" in caught and "'nxt'" in caught, (rank, caught)
        assert "the engine goes on" in caught, (rank, caught)
        assert r["seconds"] < 10, (rank, r["seconds"])
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert_params_match(r["state"], r["ddp"])
        assert r["eval_close"], rank
        # four modules gather once each; each gather is compared first, and the end of the forward once
        assert (r["eval_gathers"], r["eval_checks"]) == (4, 5), (rank, r["eval_gathers"], r["eval_checks"])


def run_nothing_to_gather(ctx: WorkerContext) -> dict[str, Any]:
    """Every parameter persistent: an eval forward issues no collective at all."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = SkipModel(True)
    config = zero3.Zero3Config(param_persistence_threshold=10**6)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))
    b = vec_batch(ctx.rank, 0, 0, 0)
    engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
    engine.step()
    engine.synchronize()
    before = engine.stats()
    with torch.no_grad():
        engine(b["x"])
    after = engine.stats()
    return {"checks": after.fetch_checks - before.fetch_checks,
            "gathers": after.collectives["all_gather"]["calls"] - before.collectives["all_gather"]["calls"]}


def test_an_eval_forward_that_gathers_nothing_compares_nothing(pools: Any) -> None:
    for r in pools.run(2, run_nothing_to_gather):
        assert r == {"checks": 0, "gathers": 0}, r


# --------------------------------------------------------------------------- #
# Two ranks leave the recorded trace at the same point, doing different things
# --------------------------------------------------------------------------- #


class TwiceModel(nn.Module):
    """Three layers of one size; on the step the test picks, rank 0 skips
    ``b`` and rank 1 runs ``a`` twice: both leave the trace at fetch #1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.depart: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.depart == "skip":
            return self.c(h)
        if self.depart == "again":
            h = torch.tanh(self.a(h))
        return self.c(torch.tanh(self.b(h)))


def run_departures(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = TwiceModel()
    config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=60)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):  # the trace is recorded, then complete
        engine.backward(engine(x).square().mean())
        engine.step()
    model.depart = "skip" if ctx.rank == 0 else "again"
    started = time.monotonic()
    try:
        engine.backward(engine(x).square().mean())
        engine.step()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"caught": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"caught": None, "seconds": time.monotonic() - started}


def test_ranks_that_leave_the_trace_at_one_point_differently_raise_at_once(pools: Any) -> None:
    results = pools.run(2, run_departures, timeout=120)
    for rank, r in enumerate(results):
        caught = r["caught"]
        assert caught is not None and caught.startswith("RankFailed"), (rank, r)
        assert "left at the same point" in caught and "'c'" in caught and "'a'" in caught, (rank, caught)
        assert r["seconds"] < 10, (rank, r)


# --------------------------------------------------------------------------- #
# Accelerator semantics (``tests.accelerator_double``): no host sync per fetch
# --------------------------------------------------------------------------- #


def run_double_eval(ctx: WorkerContext) -> dict[str, Any]:
    """Eval forwards on a z3sim group: their fetch comparisons are read once,
    at the end of each forward, never per fetch."""
    from tests import accelerator_double as double
    from z3kit_recipes import zero3

    group = double.new_group(list(range(ctx.world)))
    out: dict[str, Any] = {}
    with double.DOUBLE.observing(strict=False) as seen:
        torch.manual_seed(0)
        model = SkipModel(True)
        plain = copy.deepcopy(model)
        config = zero3.Zero3Config(param_persistence_threshold=0)
        engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, group)
        b = vec_batch(ctx.rank, 0, 0, 0)
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()
        plain.load_state_dict(engine.full_state_dict())
        before = engine.stats().fetch_checks
        model.eval()
        outputs = []
        with seen.counting(), torch.no_grad():
            for _ in range(3):
                outputs.append(engine(b["x"]))
        out["checks"] = engine.stats().fetch_checks - before
        with torch.no_grad():
            out["close"] = all(torch.allclose(o, plain.eval()(b["x"]), atol=1e-6) for o in outputs)
        out["violations"] = list(double.DOUBLE.violations)
        out["issued"] = double.DOUBLE.issued()
    out["engine_syncs"] = {site: n for site, n in seen.syncs.by_site().items()
                           if site.split(" at ", 1)[1].startswith(("z3kit/", "zero3/", "ranks/"))}
    return out


def test_eval_fetch_comparisons_are_read_once_per_forward_on_accelerators(pools: Any) -> None:
    results = pools.run(2, run_double_eval, timeout=120)
    for rank, r in enumerate(results):
        assert r["close"] and not r["violations"], (rank, r["violations"])
        assert r["checks"] == 3 * 5, (rank, r["checks"])  # four gathering fetches and the end, three forwards
        # read through pinned memory at each forward's end (``HostCopy``), never with a sync of their own
        assert not r["engine_syncs"], (rank, r["engine_syncs"])
    # the same collectives in the same order on both ranks: a comparison before each gather, one at the end
    assert results[0]["issued"] == results[1]["issued"]
    # the engine's own group (``zero3.ranks.engine_group``) carries its collectives: the longest list
    engine_calls = max(results[0]["issued"].values(), key=len)
    last_forward = [(n, dtype) for _, n, dtype in engine_calls][-9:]
    check = (5, "torch.int64")
    assert last_forward[::2] == [check] * 5 and check not in last_forward[1::2], last_forward



def run_double_swap(ctx: WorkerContext) -> dict[str, Any]:
    """On a z3sim group rank 1's eval forward runs ``nxt`` where rank 0 runs
    ``mid`` (the same size, so the gathers pair): read at the forward's end,
    every rank raises, and the engine refuses from then on."""
    from tests import accelerator_double as double
    from z3kit_recipes import zero3

    group = double.new_group(list(range(ctx.world)))
    out: dict[str, Any] = {}
    with double.DOUBLE.observing(strict=False):
        torch.manual_seed(0)
        model = SkipModel(True)
        config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=30)
        engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, group)
        b = vec_batch(ctx.rank, 0, 0, 0)
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()
        model.swap = ctx.rank == 1
        started = time.monotonic()
        out["caught"] = out["after"] = None
        try:
            with torch.no_grad():
                engine(b["x"])
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out["caught"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - started
        model.swap = False
        try:
            engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out["after"] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_divergent_eval_forward_on_accelerators_is_refused_at_its_end(pools: Any) -> None:
    results = pools.run(2, run_double_swap, timeout=120)
    for rank, r in enumerate(results):
        caught = r["caught"]
        assert caught is not None and caught.startswith("RanksDisagree"), (rank, caught)
        assert "eval or no_grad forward" in caught and ("'mid'" if rank == 0 else "'nxt'") in caught, (rank, caught)
        assert r["seconds"] < 10, (rank, r["seconds"])
        assert r["after"] is not None and r["after"].startswith("RankFailed") and "restart" in r["after"], (rank, r)
