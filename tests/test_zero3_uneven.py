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

import contextlib
import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import D_IN, D_OUT, HIDDEN, MLP, ParentModel, hf_llama, vec_batch


def _engine(ctx: WorkerContext, model: torch.nn.Module, threshold: int = 0, timeout_s: float = 60.0) -> Any:
    from z3kit_recipes import zero3

    config = zero3.Zero3Config(param_persistence_threshold=threshold, collective_timeout_s=timeout_s)
    # a group of its own: the refused cases leave a gather unpaired
    return zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))


def _train_step(engine: Any, step: int, rank: int) -> None:
    b = vec_batch(rank, step, 0, 0)
    engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
    engine.step()


def _model(name: str) -> torch.nn.Module:
    if name == "parent":  # the root gathers parameters of its own before its children
        return ParentModel()
    if name == "normed":  # buffers: a training forward broadcasts them first
        return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN), torch.nn.Tanh(),
                                   torch.nn.Linear(HIDDEN, D_OUT))
    return MLP()


def run_uneven(ctx: WorkerContext, pattern: str, threshold: int, model_name: str = "mlp") -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model(model_name)
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


@pytest.mark.parametrize(("world", "model"), [(2, "mlp"), (4, "mlp"), (2, "parent"), (2, "normed")])
@pytest.mark.parametrize("pattern", ["sample_on_rank_0", "eval_batches"])
def test_a_forward_on_some_ranks_only_is_named_on_every_rank_in_seconds(
    pools: Any, world: int, model: str, pattern: str
) -> None:
    results = pools.run(world, run_uneven, pattern, 0, model, timeout=90)
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


# --------------------------------------------------------------------------- #
# engine.join(): different numbers of batches
# --------------------------------------------------------------------------- #


def _batches(rank: int) -> int:
    return 5 if rank == 0 else 3


def run_join_training(ctx: WorkerContext, accumulation: int, reference: str) -> dict[str, Any]:
    """Rank 0 has 5 optimizer steps of batches, the others 3. The reference is
    DDP under ``torch.distributed.algorithms.Join`` (``"ddp_join"``), or DDP
    whose finished ranks keep stepping with a zero loss on their last batch
    (``"ddp_zero_loss"``): what ``engine.join`` promises, and what DDP's Join
    computes without gradient accumulation."""
    from torch.distributed.algorithms.join import Join

    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    config = zero3.Zero3Config(param_persistence_threshold=0, gradient_accumulation_steps=accumulation)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, ctx.group)
    mine, everyone = _batches(ctx.rank) * accumulation, _batches(0) * accumulation
    losses, ref_losses = [], []
    with engine.join():
        for step in range(mine):
            b = vec_batch(ctx.rank, step, 0, 0)
            loss = F.mse_loss(engine(b["x"]), b["y"])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    with engine.join(), torch.no_grad():  # uneven evals: a block of their own, or they would meet training forwards
        evals = [engine(vec_batch(0, 90 + i, 0, 0)["x"]) for i in range(ctx.rank + 1)]
    with Join([ref]) if reference == "ddp_join" else contextlib.nullcontext():
        for step in range(mine if reference == "ddp_join" else everyone):
            b = vec_batch(ctx.rank, min(step, mine - 1), 0, 0)
            ref_loss = F.mse_loss(ref(b["x"]), b["y"]) / accumulation
            (ref_loss if step < mine else ref_loss * 0.0).backward()
            if (step + 1) % accumulation == 0:
                ref_opt.step()
                ref_opt.zero_grad()
            if step < mine:
                ref_losses.append(float(ref_loss) * accumulation)
    state = engine.full_state_dict()
    plain = copy.deepcopy(ref.module)
    with torch.no_grad():
        want_evals = [plain(vec_batch(0, 90 + i, 0, 0)["x"]) for i in range(ctx.rank + 1)]
    return {"losses": losses, "ref_losses": ref_losses, "state": state,
            "ref": {n: p.detach().clone() for n, p in ref.module.named_parameters()},
            "evals": [torch.allclose(a, b, atol=1e-6) for a, b in zip(evals, want_evals)],
            "steps": engine.stats().global_step}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("accumulation", "reference"), [(1, "ddp_join"), (2, "ddp_zero_loss")])
def test_join_trains_uneven_batches_like_ddp(pools: Any, world: int, accumulation: int, reference: str) -> None:
    from tests.zero3_models import assert_params_match

    results = pools.run(world, run_join_training, accumulation, reference)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == _batches(rank) * accumulation
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, r["losses"], r["ref_losses"])
        assert_params_match(r["state"], r["ref"])
        assert all(r["evals"]) and r["steps"] == 5  # every rank took every optimizer step
    assert_params_match(results[0]["state"], results[-1]["state"])


def run_join_refused(ctx: WorkerContext) -> str:
    engine = _engine(ctx, MLP())
    try:
        with engine.join():
            if ctx.rank == 0:  # rank 1 runs nothing: it has no forward to repeat
                _train_step(engine, 0, ctx.rank)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_join_without_a_batch_to_repeat_is_refused_on_every_rank(pools: Any) -> None:
    for msg in pools.run(2, run_join_refused, timeout=60):
        assert msg.startswith("JoinRefused: rank(s) [1] finished their batches inside engine.join() and never ran "
                              "a training forward"), msg


# --------------------------------------------------------------------------- #
# A backward that raises on every rank at the same point
# --------------------------------------------------------------------------- #


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a check the user's code makes in backward)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            raise FloatingPointError("a gradient check failed")
        return grad


class _Checked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp.layers[0](x)
        h = _FailOnce.apply(torch.tanh(h))  # between the layers: some gradients are in, some are not
        for layer in self.mlp.layers[1:-1]:
            h = torch.tanh(layer(h))
        return self.mlp.layers[-1](h)


def run_backward_fails_everywhere(ctx: WorkerContext, bucket: int) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = _Checked()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    config = zero3.Zero3Config(param_persistence_threshold=0, reduce_bucket_size=bucket)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), config, fresh_group(ctx))
    losses, caught = [], []
    for step in range(5):
        b = vec_batch(ctx.rank, step, 0, 0)
        _FailOnce.armed = step == 2
        try:
            loss = F.mse_loss(engine(b["x"]), b["y"])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        except FloatingPointError as exc:
            caught.append(str(exc))
        finally:
            _FailOnce.armed = False
        if step != 2:  # the reference skips the failed step
            ref_loss = F.mse_loss(ref(b["x"]), b["y"])
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses[-1] = (losses[-1], float(ref_loss))  # type: ignore[assignment]
    return {"losses": losses, "caught": caught}


@pytest.mark.parametrize("bucket", [40, 500_000_000], ids=["small_buckets", "one_bucket"])
def test_a_backward_that_fails_on_every_rank_discards_its_gradients(pools: Any, bucket: int) -> None:
    """Every rank raises at the same point of one backward: the engine stays usable, the failed
    micro-step's gradients are dropped, and training goes on as if the step had been skipped."""
    for r in pools.run(2, run_backward_fails_everywhere, bucket, timeout=90):
        assert r["caught"] == ["a gradient check failed"], r
        for got, want in r["losses"]:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), r["losses"]
