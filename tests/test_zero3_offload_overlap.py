"""The offloaded optimizer step behind the next forward (``zero3.training.host_step``,
``chunked_optimizer``) and the gradients streamed to the host as they land.

The host step's pieces run here on real torch optimizers, on a thread of
their own. ``_Gate`` stands in for the device event that the host thread
waits on before it reads the gradients (the copies to the host done): it
lets a test hold the step at its start, as a slow copy would, and change
the optimizer meanwhile. The engine tests are real gloo runs against the
same loop without offload.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.zero3_models import MLP
from z3kit_recipes import zero3
from z3kit_recipes.zero3.config.offload import OffloadConfig
from z3kit_recipes.zero3.training.chunked_optimizer import ChunkedStep, supports, unhooked_step
from z3kit_recipes.zero3.training.host_step import HostStep, HostStepFailed, cut


class _Gate:
    """What the host thread waits on before it reads the gradients (a device event's ``synchronize``)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        assert self.open.wait(30), "the test never opened the gate"


def _masters(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 3, 8, 2, 7, 4)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen) for n in (5, 3, 8, 2, 7, 4)]


def _launch(host: HostStep, optimizer: torch.optim.Optimizer, masters: list[nn.Parameter],
            grads: list[torch.Tensor], shards: list[torch.Tensor], *, factor: Any = None, gate: Any = None) -> None:
    optimizer.step()  # as the engine does: the step hooks once, on the real optimizer (no .grad: no update)
    pairs = {pid: (m, g.clone(), s) for pid, (m, g, s) in enumerate(zip(masters, grads, shards))}
    order = [4, 0, 5, 1, 3, 2]  # the next forward's order, not the parameters'
    chunks = cut(order, {pid: m.numel() for pid, m in enumerate(masters)}, chunks=3)
    assert len(chunks) == 3 and sorted(p for c in chunks for p in c) == list(range(6))
    host.launch(ChunkedStep(optimizer, masters), chunks, pairs, grads_ready=gate, factor=factor)


def _reference_step(optimizer: torch.optim.Optimizer, masters: list[nn.Parameter], grads: list[torch.Tensor],
                    factor: Any = None) -> None:
    for m, g in zip(masters, grads):
        m.grad = g.clone() if factor is None else g.clone().mul_(factor)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
])
def test_a_chunked_host_step_is_bitwise_one_optimizer_step(make: Any) -> None:
    ours, theirs = _masters(), _masters()
    opt, ref = make(ours), make(theirs)
    shards = [torch.zeros(m.numel(), dtype=torch.bfloat16) for m in ours]
    host = HostStep(torch.device("cpu"))
    factor = torch.tensor(0.37)
    for step in range(3):
        _launch(host, opt, ours, _grads(step), shards, factor=factor)
        host.settle()
        _reference_step(ref, theirs, _grads(step), factor)
        for a, b, shard in zip(ours, theirs, shards):
            assert torch.equal(a, b)
            assert torch.equal(shard, b.detach().to(torch.bfloat16))  # written back in the compute dtype
        assert all(m.grad is None for m in ours)  # the masters' own .grad is never set
    mine, reference = opt.state_dict()["state"], ref.state_dict()["state"]
    assert mine.keys() == reference.keys() and mine
    for index, state in reference.items():
        assert state.keys() == mine[index].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(mine[index][k])) for k, v in state.items())


def test_the_step_keeps_the_hyperparameters_of_its_engine_step_call() -> None:
    ours, theirs = _masters(), _masters()
    opt, ref = torch.optim.AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 10.0 ** -step)
    shards = [torch.zeros(m.numel()) for m in ours]
    host, gate = HostStep(torch.device("cpu")), _Gate()
    _launch(host, opt, ours, _grads(0), shards, gate=gate)
    assert host.running
    # what a training loop does right after engine.step(), while the host step still waits for its gradients
    schedule.step()
    opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    gate.open.set()
    host.settle()
    _reference_step(ref, theirs, _grads(0))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # the next step takes the schedule's new rate
    _launch(host, opt, ours, _grads(1), shards)
    host.settle()
    ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    _reference_step(ref, theirs, _grads(1))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_gather_waits_for_its_chunk_and_state_reads_for_the_whole_step() -> None:
    masters = _masters()
    opt = torch.optim.AdamW(masters, lr=0.1)
    before = [m.detach().clone() for m in masters]
    shards = [m.detach().clone() for m in masters]
    host, gate = HostStep(torch.device("cpu")), _Gate()
    _launch(host, opt, masters, _grads(0), shards, gate=gate)
    fenced = threading.Event()
    waiter = threading.Thread(target=lambda: (host.fence([4]), fenced.set()))
    waiter.start()
    assert not fenced.wait(0.3)  # parameter 4 is in the first chunk, which waits for its gradients
    assert torch.equal(shards[4], before[4])
    gate.open.set()
    waiter.join(30)
    assert fenced.is_set() and not torch.equal(shards[4], before[4])
    host.fence([7, 99])  # parameters of no chunk wait for nothing
    opt.state_dict()  # a plain read of the state: it must see the whole step
    host.settle()
    assert all(not torch.equal(s, b) for s, b in zip(shards, before))


def test_a_host_step_that_raises_is_raised_at_the_next_gather_and_once_at_settle() -> None:
    masters = _masters()
    opt = torch.optim.AdamW(masters, lr=0.1)
    grads = _grads(0)
    grads[2] = torch.zeros(99)  # the wrong size: AdamW raises on the host thread
    host = HostStep(torch.device("cpu"))
    _launch(host, opt, masters, grads, [m.detach().clone() for m in masters])
    with pytest.raises(HostStepFailed, match="host thread"):
        host.fence([0, 1, 2, 3, 4, 5])
    with pytest.raises(HostStepFailed, match="host thread"):
        host.settle()
    host.settle()  # raised once: a load can start from here
    assert not host.running


def test_every_parameter_of_a_host_step_is_in_exactly_one_chunk() -> None:
    masters = _masters()
    opt = torch.optim.AdamW(masters, lr=0.1)
    pairs = {pid: (m, torch.zeros_like(m), m.detach().clone()) for pid, m in enumerate(masters)}
    with pytest.raises(ValueError, match="exactly one chunk"):
        HostStep(torch.device("cpu")).launch(ChunkedStep(opt, masters), [[0, 1, 2], [2, 3, 4, 5]], pairs,
                                             grads_ready=None, factor=None)


def test_torch_optimizers_keep_the_hook_wrapper_the_chunked_step_goes_under() -> None:
    """Pins the one private detail ``chunked_optimizer`` reads (see its Note)."""
    masters = _masters()
    opt = torch.optim.AdamW(masters, lr=0.1)
    assert unhooked_step(torch.optim.AdamW) is not None and supports(opt)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    ChunkedStep(opt, masters).step([(m, torch.ones_like(m)) for m in masters])
    assert calls == [] and "step" in [k for s in opt.state.values() for k in s]
    opt.step()  # the real step still runs its hooks
    assert calls == ["pre", "post"]


def test_only_per_parameter_torch_optimizers_are_stepped_in_chunks() -> None:
    class MyAdam(torch.optim.AdamW):
        pass

    p = [nn.Parameter(torch.ones(2))]
    assert supports(torch.optim.SGD(p, lr=0.1))
    assert not supports(MyAdam(p))  # a subclass may count steps or mix parameters
    assert not supports(torch.optim.LBFGS(p))
    with pytest.raises(TypeError, match="in chunks"):
        ChunkedStep(MyAdam(p), p)


# -- the engine ---------------------------------------------------------------------------------
def _loop(ctx: WorkerContext, offload: OffloadConfig | None, accumulation: int) -> dict[str, Any]:
    """A loop as users write it: zero_grad at the top, a schedule and an eval forward right after
    the step, a layer unfrozen at step 2."""
    torch.manual_seed(0)
    model = MLP()
    model.layers[0].weight.requires_grad_(False)
    config = zero3.Zero3Config(param_persistence_threshold=20, gradient_accumulation_steps=accumulation,
                               gradient_clipping=0.5, offload_optimizer=offload)
    engine = zero3.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), config,
                              fresh_group(ctx))
    optimizer = engine.optimizer
    assert optimizer is not None
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses, host_grads = [], []
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(5):
        if step == 2:
            model.layers[0].weight.requires_grad_(True)
        optimizer.zero_grad()
        for _ in range(accumulation):
            loss = engine(torch.randn(6, 7, generator=gen)).pow(2).mean()
            engine.backward(loss)
            losses.append(loss.item())
            host_grads.append(engine.stats().memory.current.get("host_grad_partitions", 0))
        engine.step()
        schedule.step()
        engine.eval()
        with torch.no_grad():
            losses.append(engine(torch.ones(2, 7)).sum().item())
        engine.train()
    return dict(losses=losses, params=engine.full_state_dict(), host_grads=host_grads)


def _three_ways(ctx: WorkerContext, accumulation: int) -> list[dict[str, Any]]:
    return [_loop(ctx, offload, accumulation) for offload in (None, OffloadConfig(), OffloadConfig(overlap=False))]


@pytest.mark.parametrize("accumulation", [1, 3])
def test_an_overlapped_host_step_trains_bitwise_as_without_offload(pools: PoolSet, accumulation: int) -> None:
    for plain, overlapped, inline in pools.run(2, _three_ways, accumulation):
        for other in (overlapped, inline):
            assert other["losses"] == plain["losses"]
            assert all(torch.equal(plain["params"][k], other["params"][k]) for k in plain["params"])
        # the gradients reach the host in the backward that ends the window, not at the step
        first_window = overlapped["host_grads"][:accumulation]
        assert first_window[:-1] == [0] * (accumulation - 1) and first_window[-1] > 0


def _hsdp_with_and_without_offload(ctx: WorkerContext) -> list[dict[str, Any]]:
    out = []
    for offload in (None, OffloadConfig()):
        torch.manual_seed(0)
        config = zero3.Zero3Config(param_persistence_threshold=0, mics_shard_size=2, gradient_clipping=0.5,
                                   gradient_accumulation_steps=2, offload_optimizer=offload)
        engine = zero3.initialize(MLP(), lambda p: torch.optim.AdamW(p, lr=1e-2), config, fresh_group(ctx))
        gen, losses = torch.Generator().manual_seed(ctx.rank), []
        for _ in range(6):  # 3 windows of 2 micro-steps
            loss = engine(torch.randn(6, 7, generator=gen)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append(dict(losses=losses, params=engine.full_state_dict(), memory=dict(engine.stats().memory.current)))
    return out


def test_offload_under_hsdp_is_bitwise_hsdp(pools: PoolSet) -> None:
    """Shards, masters and state per shard group of 2, replicated twice (2x2), with the optimizer
    on the host; the gradients cross the replicas once per window, then stream to the host."""
    for plain, offloaded in pools.run(4, _hsdp_with_and_without_offload):
        assert offloaded["losses"] == plain["losses"]
        assert all(torch.equal(plain["params"][k], offloaded["params"][k]) for k in plain["params"])
        assert offloaded["memory"]["optimizer_state"] == 0
        assert offloaded["memory"]["host_optimizer_state"] == plain["memory"]["optimizer_state"] > 0


def _held_first_chunk(ctx: WorkerContext) -> dict[str, Any]:
    """Steps with the first chunk of the host step held at its start until ``step()`` has returned,
    against the same steps without offload."""
    from z3kit.collective_log import CollectiveKind
    from z3kit.shard import ParamStatus

    out: dict[str, Any] = {}
    for offload in (None, OffloadConfig()):
        torch.manual_seed(0)
        config = zero3.Zero3Config(param_persistence_threshold=20, gradient_clipping=0.5, offload_optimizer=offload)
        engine = zero3.initialize(MLP(), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), config,
                                  fresh_group(ctx))
        persistent = [pid for pid, shard in enumerate(engine.shards) if shard.numel < 20]
        gen, losses, order = torch.Generator().manual_seed(ctx.rank), [], []
        for step in range(4):
            loss = engine(torch.randn(6, 7, generator=gen)).pow(2).mean()
            engine.backward(loss)
            losses.append(loss.item())
            if offload is None or step == 0:
                engine.step()
                continue
            gate = threading.Event()

            def held(index: int, gate: threading.Event = gate) -> None:
                if index == 0:
                    order.append("chunk 0 starts")
                    order.append("chunk 0 steps" if gate.wait(10) else "chunk 0 gave up waiting")

            # the backward settled the last host step (its first gradient copy waits for it): no thread runs now
            host_step = engine.parts.optimizer_step.host_step
            assert not host_step.running
            host_step.on_chunk = held
            gathers = engine.log.calls[CollectiveKind.ALL_GATHER]
            engine.step()
            order.append("step() returned")
            # nothing gathered by the step: the persistent parameters wait for the next forward
            out.setdefault("gathers_in_step", []).append(engine.log.calls[CollectiveKind.ALL_GATHER] - gathers)
            out.setdefault("persistent_after_step", []).append(
                [engine.shards[p].status is ParamStatus.NOT_AVAILABLE for p in persistent])
            gate.set()  # and the next forward runs with the host step in flight, each gather behind its fence
        if offload is not None:
            out["order"] = order
        out["persistent"] = persistent
        out["plain" if offload is None else "offloaded"] = dict(losses=losses, params=engine.full_state_dict())
    return out


def test_step_returns_before_the_host_steps_its_first_chunk(pools: PoolSet) -> None:
    """The first chunk holds the first parameters the next forward gathers: ``engine.step()``
    returns while that chunk is held, having gathered nothing (the persistent parameters are
    left to the next forward, whose gathers wait for their chunks), and training stays bitwise
    the run without offload."""
    for out in pools.run(2, _held_first_chunk):
        assert out["persistent"]  # the MLP's biases (13, 13, 5 elements) stay gathered between forwards
        # the gate opens once step() has returned: a step() that waited for the chunk would see it give up
        assert "chunk 0 gave up waiting" not in out["order"] and len(out["order"]) == 9
        for i in range(0, 9, 3):  # whether the thread reached the chunk before step() returned is its own affair
            step = out["order"][i : i + 3]
            assert sorted(step) == ["chunk 0 starts", "chunk 0 steps", "step() returned"]
            assert step.index("step() returned") < step.index("chunk 0 steps")
        assert out["gathers_in_step"] == [0, 0, 0]
        assert out["persistent_after_step"] == [[True] * len(out["persistent"])] * 3
        assert out["offloaded"]["losses"] == out["plain"]["losses"]
        plain, offloaded = out["plain"]["params"], out["offloaded"]["params"]
        assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
