"""Ranks that would not pair: different models or settings at initialize,
and a second backward over one forward on one rank.

``zero3.init_agreement`` is tested without a process group (its summary and
its diff); the rest runs on gloo pools of 2 and 4 ranks, where every rank
must raise a z3kit error that names the cause, within seconds, instead of a
gloo abort, a timeout that names nothing, or silent acceptance.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.errors import unchanged
from tests.zero3_models import MLP, ddp_vec_step, vec_batch, vec_loss
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import StockReleasePolicy
from z3kit.trace import TraceRecorder
from z3kit_recipes.zero3 import Zero3Config
from z3kit_recipes.zero3.init_agreement import MAX_SHOWN, InitSummary, differences, disagreement, summarize
from z3kit_recipes.zero3.runtime.build import Policies


class Tiny(nn.Module):
    """A Linear, a weight ``w`` of 24 elements (its shape varies) and a scale
    whose name varies; the forward works for every variant."""

    def __init__(self, w_shape: tuple[int, int] = (4, 6), scale_name: str = "scale") -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.w = nn.Parameter(torch.randn(*w_shape))
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.ones(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale: torch.Tensor = getattr(self, self.scale_name)
        return (self.fc(x) + x @ self.w.reshape(4, 6).t()) * scale


# --------------------------------------------------------------------------- #
# The summary and its diff, without a process group
# --------------------------------------------------------------------------- #


def _summary(model: nn.Module | None = None, world: int = 2, **config: Any) -> InitSummary:
    cfg = Zero3Config(**config)
    policies = Policies(
        TraceRecorder(),
        StockReleasePolicy(param_persistence_threshold=cfg.param_persistence_threshold),
        PrefetchLimiter(),
    )
    torch.manual_seed(0)
    return summarize(
        model or Tiny(), cfg, world=world, training=True, leaves=[], policies=policies, derived_knobs=None,
        init_seed=None, param_init_fn=None,
    )


def test_alike_summaries_have_no_differences() -> None:
    a, b = _summary(), _summary()
    assert differences([a, b]) == [] and disagreement([a, b]) is None
    assert a.digest() == b.digest()


def test_a_config_field_is_named_with_each_ranks_value() -> None:
    summaries = [_summary(), _summary(reduce_bucket_size=1000)]
    assert summaries[0].digest() != summaries[1].digest()
    assert differences(summaries) == ["config.reduce_bucket_size: rank 0 500000000, rank 1 1000"]


def test_ranks_with_the_same_value_are_grouped() -> None:
    summaries = [_summary(), _summary(compute_dtype="bf16"), _summary(), _summary()]
    assert differences(summaries) == ["config.compute_dtype: ranks 0, 2-3 'fp32', rank 1 'bf16'"]


def test_an_int_and_a_float_of_the_same_value_agree() -> None:
    assert differences([_summary(gradient_clipping=1), _summary(gradient_clipping=1.0)]) == []


def test_the_environment_switch_for_fetch_checks_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _summary()
    monkeypatch.setenv("Z3KIT_CHECK_EVERY_FETCH", "1")
    assert differences([plain, _summary()]) == ["config.check_every_fetch: rank 0 False, rank 1 True"]


def test_a_parameter_of_another_shape_with_as_many_elements() -> None:
    lines = differences([_summary(Tiny()), _summary(Tiny(w_shape=(6, 4)))])
    assert lines == ["parameter 'w' shape: rank 0 [4, 6], rank 1 [6, 4]"]


def test_a_parameter_missing_on_one_rank() -> None:
    lines = differences([_summary(Tiny()), _summary(Tiny(scale_name="gain"))])
    assert lines == ["parameter 'scale': rank 0 present, rank 1 absent",
                     "parameter 'gain': rank 0 absent, rank 1 present"]


def test_requires_grad_and_persistence_differ() -> None:
    frozen = Tiny()
    frozen.fc.bias.requires_grad_(False)
    assert differences([_summary(Tiny()), _summary(frozen)]) == [
        "parameter 'fc.bias' requires_grad: rank 0 True, rank 1 False"]
    lines = differences([_summary(param_persistence_threshold=0), _summary(param_persistence_threshold=10)])
    assert lines == ["config.param_persistence_threshold: rank 0 0, rank 1 10",
                     "parameter 'scale' persistent: rank 0 False, rank 1 True",  # its own parameters first
                     "parameter 'fc.bias' persistent: rank 0 False, rank 1 True"]


def test_the_same_parameters_in_another_order() -> None:
    a = nn.Sequential()
    a.add_module("p", nn.Linear(2, 2))
    a.add_module("q", nn.Linear(2, 2))
    b = nn.Sequential()
    b.add_module("q", nn.Linear(2, 2))
    b.add_module("p", nn.Linear(2, 2))
    assert differences([_summary(a), _summary(b)]) == [
        "model order at #0: rank 0 parameter 'p.weight', rank 1 parameter 'q.weight'"]


def test_engine_kind_leaves_policies_and_buffers_are_compared() -> None:
    cfg = Zero3Config()
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    other = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(4))
    stock = Policies(TraceRecorder(), StockReleasePolicy(), PrefetchLimiter())
    custom = Policies(TraceRecorder(), StockReleasePolicy(), type("MyLimiter", (PrefetchLimiter,), {})())
    common: dict[str, Any] = {"world": 2, "derived_knobs": None, "init_seed": None, "param_init_fn": None}
    a = summarize(model, cfg, training=True, leaves=[], policies=stock, **common)
    b = summarize(other, cfg, training=False, leaves=[other[0]], policies=custom, **common)
    text = "\n".join(differences([a, b]))
    assert "optimizer: rank 0 'a factory (training engine)', rank 1 'None (inference-only engine)'" in text
    assert "leaf modules: rank 0 [], rank 1 ['0']" in text
    assert "prefetch limiter type: rank 0 'z3kit.prefetch.PrefetchLimiter'" in text and "MyLimiter" in text
    assert "buffer '1.running_mean' shape: rank 0 [3], rank 1 [4]" in text


def test_the_message_shows_the_first_few_and_counts_the_rest() -> None:
    many = dict(prefetch_bucket_size=1, max_live_parameters=2, max_reuse_distance=3, reduce_bucket_size=4,
                overlap_comm=False, contiguous_gradients=False, gradient_accumulation_steps=2)
    message = disagreement([_summary(), _summary(**many)])
    assert message is not None
    assert message.startswith("zero3.initialize: the ranks were not given the same model and settings: "
                              "config.prefetch_bucket_size: rank 0 50000000, rank 1 1; "), message
    assert f"and {len(many) - MAX_SHOWN} more difference(s)" in message
    assert "gradient_accumulation_steps" not in message and "nothing was changed" in message


# --------------------------------------------------------------------------- #
# initialize on ranks that differ: the same error on every rank, nothing changed
# --------------------------------------------------------------------------- #


def _setup(case: str, rank: int) -> tuple[nn.Module, Any, Zero3Config]:
    """The model, optimizer factory and config of ``rank``: rank 0 differs for
    bf16 (as reported), rank 1 for the rest."""
    torch.manual_seed(0)
    odd = rank == (0 if case == "bf16" else 1)
    config: dict[str, Any] = {"param_persistence_threshold": 0, "collective_timeout_s": 20.0}
    model = Tiny()
    optimizer: Any = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    if odd:
        if case == "bf16":
            config["compute_dtype"] = "bf16"
        elif case == "reduce_bucket_size":
            config["reduce_bucket_size"] = 1000
        elif case == "param_persistence_threshold":
            config["param_persistence_threshold"] = 10
        elif case == "shape":
            torch.manual_seed(0)
            model = Tiny(w_shape=(6, 4))
        elif case == "missing":
            torch.manual_seed(0)
            model = Tiny(scale_name="gain")
        elif case == "requires_grad":
            model.fc.bias.requires_grad_(False)
        elif case == "inference":
            optimizer = None
    return model, optimizer, Zero3Config(**config)


def run_disagreeing_initialize(ctx: Any, case: str) -> dict[str, Any]:
    from z3kit_recipes import zero3

    model, optimizer, config = _setup(case, ctx.rank)
    plain = copy.deepcopy(model)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    start = time.monotonic()
    caught = ""
    try:
        zero3.initialize(model, optimizer, config, ctx.group)
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        caught = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    # nothing changed, and no hook is left: the model still computes and trains as plain torch does
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    same_grads = all(
        (p.grad is None and q.grad is None) or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
        for p, q in zip(model.parameters(), plain.parameters())
    )
    return {
        "caught": caught, "seconds": seconds, "is_value_error": caught.startswith("RanksDisagreeAtInit"),
        "unchanged": unchanged(before, model.state_dict()) and flags == [p.requires_grad for p in model.parameters()],
        "same_grads": same_grads,
    }


#: case -> what the message must say
CASES = {
    "bf16": ["config.compute_dtype: rank 0 'bf16', rank"],
    "reduce_bucket_size": ["config.reduce_bucket_size: rank", " 500000000, rank 1 1000"],
    "param_persistence_threshold": ["config.param_persistence_threshold: rank", " 0, rank 1 10",
                                    "parameter 'fc.bias' persistent: "],
    "shape": ["parameter 'w' shape: rank", " [4, 6], rank 1 [6, 4]"],
    "missing": ["parameter 'scale': rank", " present, rank 1 absent", "parameter 'gain': "],
    "requires_grad": ["parameter 'fc.bias' requires_grad: rank", " True, rank 1 False"],
    "inference": ["optimizer: rank", "rank 1 'None (inference-only engine)'"],
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_differ_at_initialize_all_raise_the_same_error(pools: Any, world: int, case: str) -> None:
    results = pools.run(world, run_disagreeing_initialize, case, timeout=60)
    assert len({r["caught"] for r in results}) == 1, results  # the same error on every rank
    caught = results[0]["caught"]
    assert caught.startswith("RanksDisagreeAtInit: zero3.initialize: the ranks were not given the same model"), caught
    for words in CASES[case]:
        assert words in caught, f"{words!r} not in {caught}"
    others = "ranks 0, 2-3" if world == 4 and case != "bf16" else ("ranks 1-3" if world == 4 else "rank")
    assert others in caught, caught
    for r in results:
        assert r["is_value_error"] and r["unchanged"] and r["same_grads"], r
        assert r["seconds"] < 10, r


def run_alike_initialize(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    model, optimizer, config = _setup("alike", ctx.rank)
    engine = zero3.initialize(model, optimizer, config, ctx.group)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(ctx.rank))
    losses = []
    for _ in range(3):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses}


def test_ranks_alike_still_train(pools: Any) -> None:
    for r in pools.run(2, run_alike_initialize, timeout=60):
        assert r["losses"][-1] < r["losses"][0]


# --------------------------------------------------------------------------- #
# A second backward over one forward
# --------------------------------------------------------------------------- #


def run_double_backward(ctx: Any, how: str, threshold: int, who: str) -> dict[str, Any]:
    import torch.distributed as dist

    from z3kit_recipes import zero3

    torch.manual_seed(3)
    group = dist.new_group(ranks=list(range(ctx.world)), use_local_synchronization=True)
    config = zero3.Zero3Config(param_persistence_threshold=threshold, collective_timeout_s=20.0)
    engine = zero3.initialize(MLP(), lambda p: torch.optim.SGD(p, lr=0.05), config, group)
    offends = who == "all" or ctx.rank == 1
    caught, start, losses = "", 0.0, []
    try:
        for step in range(4):
            b = vec_batch(ctx.rank, step, 0, 0)
            loss = F.mse_loss(engine(b["x"]), b["y"])
            if step == 1:
                start = time.monotonic()
            try:
                if how == "retain_graph":
                    loss.backward(retain_graph=True)
                    if step == 1 and offends:
                        loss.backward()
                else:
                    engine.backward(loss)
                    if step == 1 and offends:
                        engine.backward(loss)
            except Exception as e:  # noqa: BLE001
                if who != "all":
                    raise
                caught = f"{type(e).__name__}: {e}"  # every rank refused it: the engine goes on
            engine.step()
            losses.append(float(loss.detach()))
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        caught = f"{type(e).__name__}: {e}"
    return {"caught": caught, "seconds": time.monotonic() - start, "losses": losses}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["retain_graph", "engine"])
@pytest.mark.parametrize("threshold", [0, 100_000])  # sharded, or all persistent
def test_a_second_backward_on_one_rank_is_refused_there_and_named_elsewhere(
    pools: Any, world: int, how: str, threshold: int
) -> None:
    results = pools.run(world, run_double_backward, how, threshold, "one", timeout=90)
    refused = results[1]["caught"]
    assert refused.startswith("BackwardTwice: backward ran twice after one forward"), refused
    assert "retain_graph=True" in refused and "sum the losses and call backward once" in refused
    for rank, r in enumerate(results):
        if rank != 1:
            assert r["caught"].startswith("RankFailed"), r["caught"]
            assert "rank 1 backward raised BackwardTwice: backward ran twice" in r["caught"], r["caught"]
        assert r["seconds"] < 15, r


@pytest.mark.parametrize("how", ["retain_graph", "engine"])
def test_a_second_backward_on_every_rank_is_refused_and_training_goes_on(pools: Any, how: str) -> None:
    for r in pools.run(2, run_double_backward, how, 0, "all", timeout=90):
        assert r["caught"].startswith("BackwardTwice: backward ran twice after one forward"), r["caught"]
        assert len(r["losses"]) == 4, r


def run_direct_calls(ctx: Any) -> list[tuple[float, float]]:
    """The model called directly (``model(x)``, ``loss.backward()``) and through the engine, alternately."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), zero3.Zero3Config(param_persistence_threshold=0),
                              ctx.group)
    ddp = torch.nn.parallel.DistributedDataParallel(reference, process_group=ctx.group)
    ddp_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        batch = vec_batch(ctx.rank, step, 0, 0)
        loss = vec_loss(model if step % 2 == 0 else engine, batch, step)
        loss.backward()
        engine.step()
        losses.append((float(loss), ddp_vec_step(ddp, ddp_opt, batch, step)))
    return losses


def test_direct_model_calls_count_as_forwards(pools: Any) -> None:
    """A forward of the model itself allows its backward, as one through the engine does."""
    for losses in pools.run(2, run_direct_calls):
        for got, want in losses:
            assert abs(got - want) <= 1e-6, losses
