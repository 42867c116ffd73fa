"""fp16 with dynamic loss scaling (``zero3.training.loss_scale``).

The spec is a plain reference written out in ``_Reference``: DDP over an
fp16 copy of the model, fp32 master parameters stepped by the optimizer,
``torch.amp.GradScaler`` scaling the loss, unscaling the masters' gradients
and skipping an overflowing step, with its scale set each step from
DeepSpeed's own ``DynamicLossScaler`` driven by the same overflows (DeepSpeed
doubles on the (window + 1)-th clean step, GradScaler on the window-th, and
GradScaler has no hysteresis; the scale schedule is DeepSpeed's). The scaler
alone is also checked against ``DynamicLossScaler`` on random overflow
sequences. An inf is forced into ONE rank's input at chosen steps: every
rank must skip that step and the scale must drop as the reference's.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.zero3_models import BATCH, D_IN, D_OUT, MLP
from z3kit_recipes import zero3
from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig
from z3kit_recipes.zero3.training.backward_once import EngineBackwardRequired
from z3kit_recipes.zero3.training.loss_scale import LossScaleAtMinimum, LossScaler

HF_JSON = Path(__file__).parent / "data" / "ds_config_zero3.json"
LR = 1e-2


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH * world, D_IN, generator=g), torch.randn(BATCH * world, D_OUT, generator=g)
    return x[rank * BATCH : (rank + 1) * BATCH].half(), y[rank * BATCH : (rank + 1) * BATCH]


def _poisoned(x: torch.Tensor, step: int, rank: int, inject: tuple[int, set[int]]) -> torch.Tensor:
    """``x`` with an inf in it where ``inject`` (a rank, its steps) says."""
    if rank == inject[0] and step in inject[1]:
        x = x.clone()
        x[0, 0] = float("inf")
    return x


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _deepspeed_scaler(c: LossScaleConfig) -> Any:
    """DeepSpeed's own ``DynamicLossScaler`` for ``c`` (it asks deepspeed.comm for the rank)."""
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from z3kit_recipes.bench.runners.deepspeed_zero3 import skip_cpu_shm_comm_build

    if not ds_comm.is_initialized():
        skip_cpu_shm_comm_build()  # a compile that only inference uses
        ds_comm.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    return DynamicLossScaler(init_scale=c.initial_scale, scale_window=c.loss_scale_window, min_scale=c.min_loss_scale,
                             delayed_shift=c.hysteresis, consecutive_hysteresis=False)


def _sum_then_average(group: Any, bucket: Any) -> Any:
    """DDP's communication, summing the fp16 gradients before dividing by the ranks as
    DeepSpeed does (DDP's default divides first, which overflows later near the edge)."""
    import torch.distributed as dist

    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda f: f.value()[0].div_(dist.get_world_size(group)))


# DDP checks the hook's annotations as objects, which ``from __future__ import annotations`` leaves as strings
_sum_then_average.__annotations__ = {"group": Any, "bucket": torch.distributed.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}


class _Reference:
    """GradScaler + DDP over an fp16 model copy, fp32 masters stepped (the spec)."""

    def __init__(self, model: nn.Module, group: Any, scaling: LossScaleConfig, clip: float) -> None:
        self.masters = copy.deepcopy(model)
        self.half = DistributedDataParallel(copy.deepcopy(model).half(), process_group=group)
        self.half.register_comm_hook(group, _sum_then_average)
        self.optimizer = torch.optim.AdamW(self.masters.parameters(), lr=LR)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=scaling.initial_scale, growth_factor=2.0,
                                           backoff_factor=0.5, growth_interval=scaling.loss_scale_window)
        self.schedule = _deepspeed_scaler(scaling)
        self.clip = clip

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], bool]:
        """One optimizer step over ``batches`` (micro-steps, averaged in fp32 on the masters)."""
        masters, halves = list(self.masters.parameters()), list(self.half.parameters())
        losses = []
        for x, y in batches:
            loss = _loss(self.half(x), y)
            self.scaler.scale(loss).backward()  # DDP averages the fp16 gradients over the ranks
            losses.append(float(loss.detach()))
            for m, h in zip(masters, halves):
                assert h.grad is not None
                part = h.grad.float() / len(batches)
                m.grad, h.grad = part if m.grad is None else m.grad + part, None
        overflow = not all(bool(torch.isfinite(m.grad).all()) for m in masters if m.grad is not None)
        self.scaler.unscale_(self.optimizer)
        if self.clip > 0 and not overflow:
            torch.nn.utils.clip_grad_norm_(masters, self.clip)
        self.scaler.step(self.optimizer)  # skipped on an inf or nan, which every rank sees after DDP's all-reduce
        self.schedule.update_scale(overflow)
        self.scaler.update(new_scale=float(self.schedule.cur_scale))
        self.optimizer.zero_grad(set_to_none=True)
        if not overflow:
            with torch.no_grad():
                for m, h in zip(masters, halves):
                    h.copy_(m)
        return losses, overflow


def _parity_worker(ctx: WorkerContext, scaling: LossScaleConfig, clip: float, inject: tuple[int, set[int]],
                   steps: int, accumulation: int) -> dict[str, Any]:
    group = fresh_group(ctx)
    torch.manual_seed(0)
    model = MLP()
    ref = _Reference(model, group, scaling, clip)
    config = zero3.Zero3Config(compute_dtype="fp16", loss_scaling=scaling, gradient_clipping=clip,
                               param_persistence_threshold=0, gradient_accumulation_steps=accumulation)
    engine = zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=LR), config, process_group=group)
    rows = []
    for step in range(steps):
        batches = [_batch(step * accumulation + micro, ctx.rank, ctx.world) for micro in range(accumulation)]
        batches[0] = (_poisoned(batches[0][0], step, ctx.rank, inject), batches[0][1])
        ref_losses, ref_skipped = ref.step(batches)
        for micro, (x, y) in enumerate(batches):
            loss = _loss(engine(x), y)
            engine.backward(loss)
            assert engine.step() is (micro == accumulation - 1)
        stats = engine.stats()
        rows.append({"loss": float(loss.detach()), "ref_loss": ref_losses[-1], "skipped": engine.last_step_skipped,
                     "ref_skipped": ref_skipped, "scale": stats.loss_scale, "ref_scale": ref.scaler.get_scale(),
                     "skipped_steps": stats.skipped_steps})
    full = engine.full_state_dict()
    diffs = {name: float((full[name] - p.detach()).abs().max()) for name, p in ref.masters.named_parameters()}
    return {"rows": rows, "diffs": diffs, "shard_dtype": str(engine.layout.flat.dtype),
            "master_dtype": str(engine.layout.masters[0].dtype), "global_step": engine.global_step}


@pytest.mark.parametrize(
    ("hysteresis", "clip", "accumulation"),
    [(1, 0.0, 1), (2, 0.5, 1), (2, 0.5, 2)],
)
def test_fp16_matches_gradscaler_ddp_with_an_overflow_on_one_rank(
    pools: PoolSet, hysteresis: int, clip: float, accumulation: int
) -> None:
    # 2**20 overflows the fp16 gradients at first (the scale falls until they fit); an inf
    # on rank 1 at steps 9 and 10 overflows there only; a window of 3 lets the scale grow between
    scaling = LossScaleConfig(initial_scale_power=20, loss_scale_window=3, hysteresis=hysteresis)
    steps = 16
    outs = pools.run(2, _parity_worker, scaling, clip, (1, {9, 10}), steps, accumulation)
    for rank, out in enumerate(outs):
        rows = out["rows"]
        assert (out["shard_dtype"], out["master_dtype"], out["global_step"]) == ("torch.float16", "torch.float32", steps)
        assert [r["skipped"] for r in rows] == [r["ref_skipped"] for r in rows], rows
        assert [r["scale"] for r in rows] == [r["ref_scale"] for r in rows], rows
        assert rows[-1]["skipped_steps"] == sum(r["ref_skipped"] for r in rows)
        assert rows[0]["skipped"] and rows[9]["skipped"], rows  # the natural overflow, and rank 1's inf on every rank
        assert not all(r["skipped"] for r in rows[1:9]) and rows[-1]["scale"] > rows[0]["scale"] / 2 ** 8
        for r in rows:
            if not r["skipped"] and r["loss"] == r["loss"]:
                assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), (rank, rows)
        # measured bit-equal here (the same fp16 sums in the same order); the bound leaves room for other CPUs
        assert max(out["diffs"].values()) < 1e-5, out["diffs"]
    agreed = [[(r["skipped"], r["scale"]) for r in out["rows"]] for out in outs]
    assert agreed[0] == agreed[1]  # the ranks agree on every skip and scale


def _schedule_worker(ctx: WorkerContext) -> list[str]:
    rng, problems = random.Random(7), []
    for hysteresis in (1, 2, 3):
        for window in (1, 2, 5):
            for trial in range(4):
                c = LossScaleConfig(initial_scale_power=6, loss_scale_window=window, hysteresis=hysteresis,
                                    min_loss_scale=2.0)
                ours = LossScaler(c)
                theirs = _deepspeed_scaler(c)
                for i in range(60):
                    overflow = rng.random() < (0.2 + 0.2 * trial)
                    try:
                        theirs.update_scale(overflow)
                    except Exception:
                        with pytest.raises(LossScaleAtMinimum):
                            ours.update(overflow)
                        break
                    ours.update(overflow)
                    if (ours.scale, ours.hysteresis_left) != (theirs.cur_scale, theirs.cur_hysteresis):
                        problems.append(f"h={hysteresis} w={window} trial {trial} step {i}: "
                                        f"{ours.scale, ours.hysteresis_left} != {theirs.cur_scale, theirs.cur_hysteresis}")
                        break
    return problems


def test_the_scale_follows_deepspeeds_dynamic_loss_scaler(pools: PoolSet) -> None:
    (problems,) = pools.run(1, _schedule_worker)  # DeepSpeed's scaler asks torch.distributed for the rank
    assert problems == []


def _resume_worker(ctx: WorkerContext, root: str, save_at: int, steps: int, resume: bool) -> dict[str, Any]:
    group = fresh_group(ctx)
    torch.manual_seed(0)
    config = zero3.Zero3Config(compute_dtype="fp16", gradient_clipping=1.0, param_persistence_threshold=0,
                               loss_scaling=LossScaleConfig(initial_scale_power=18, loss_scale_window=2))
    engine = zero3.initialize(MLP(), lambda ps: torch.optim.AdamW(ps, lr=LR), config, process_group=group)
    start = 0
    if resume:
        engine.load_checkpoint(root)
        start = save_at
    losses = []
    for step in range(start, steps):
        x, y = _batch(step, ctx.rank, ctx.world)
        x = _poisoned(x, step, 0, (0, {1}))
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if not resume and step + 1 == save_at:
            engine.save_checkpoint(root)
    stats = engine.stats()
    return {"losses": losses, "scale": stats.loss_scale, "skipped": stats.skipped_steps,
            "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}


def test_a_resumed_fp16_run_equals_the_uninterrupted_one(pools: PoolSet, tmp_path: Path) -> None:
    root, save_at, steps = str(tmp_path / "ckpt"), 4, 9
    whole = pools.run(2, _resume_worker, root, save_at, steps, False)
    resumed = pools.run(2, _resume_worker, root, save_at, steps, True)
    for w, r in zip(whole, resumed):
        assert r["losses"] == w["losses"][save_at:]
        assert (r["scale"], r["skipped"]) == (w["scale"], w["skipped"]) and w["skipped"] >= 1
        assert all(torch.equal(w["state"][k], r["state"][k]) for k in w["state"])


def _direct_backward_worker(ctx: WorkerContext) -> str:
    group = fresh_group(ctx)
    engine = zero3.initialize(MLP(), lambda ps: torch.optim.AdamW(ps, lr=LR), zero3.Zero3Config(compute_dtype="fp16"),
                              process_group=group)
    x, y = _batch(0, ctx.rank, ctx.world)
    with pytest.raises(EngineBackwardRequired) as info:
        _loss(engine(x), y).backward()
    return str(info.value)


def test_a_direct_loss_backward_is_refused_under_fp16(pools: PoolSet) -> None:
    (message,) = pools.run(1, _direct_backward_worker)
    assert "engine.backward(loss)" in message and "fp16" in message


def _hf_json_worker(ctx: WorkerContext) -> dict[str, Any]:
    group = fresh_group(ctx)
    torch.manual_seed(0)
    values = zero3.TrainingValues(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=2,
                                  micro_batch_size=BATCH, gradient_accumulation_steps=1, max_grad_norm=1.0,
                                  bf16=False, fp16=True)
    config = zero3.Zero3Config.from_deepspeed(json.loads(HF_JSON.read_text()), hidden_size=D_IN, auto=values,
                                              world=ctx.world)
    engine = zero3.initialize(MLP(), None, config, process_group=group)
    losses = []
    for step in range(12):
        x, y = _batch(step % 3, ctx.rank, ctx.world)
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    stats = engine.stats()
    return {"dtype": config.compute_dtype, "scaling": config.loss_scaling, "losses": losses,
            "scale": stats.loss_scale, "skipped": stats.skipped_steps}


def test_the_hf_json_with_fp16_auto_trains(pools: PoolSet) -> None:
    for out in pools.run(2, _hf_json_worker):
        assert out["dtype"] == "fp16" and out["scaling"] == LossScaleConfig()  # the JSON's values are DeepSpeed's defaults
        assert out["scale"] == 2.0**16 and out["skipped"] == 0
        assert out["losses"][-1] < out["losses"][0]


def test_loss_scale_config_and_its_refusals() -> None:
    c = LossScaleConfig()
    assert (c.loss_scale, c.initial_scale_power, c.loss_scale_window, c.hysteresis, c.min_loss_scale) == (0, 16, 1000, 2, 1)
    assert c.dynamic and c.initial_scale == 2.0**16 and LossScaleConfig(loss_scale=128).initial_scale == 128
    for bad in ({"hysteresis": 0}, {"loss_scale_window": 0}, {"min_loss_scale": 0}, {"loss_scale": -1},
                {"initial_scale_power": 2, "min_loss_scale": 8}):
        with pytest.raises(ValueError):
            LossScaleConfig(**bad)
    with pytest.raises(ValueError, match="compute_dtype=\"fp16\""):
        zero3.Zero3Config(loss_scaling=LossScaleConfig(hysteresis=1))
    assert zero3.Zero3Config(compute_dtype=torch.float16).compute_dtype == "fp16"
    read = zero3.Zero3Config.from_deepspeed({"gradient_clipping": 1.0, "fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 1,
        "min_loss_scale": 0.5}})
    assert read.compute_dtype == "fp16"
    assert read.loss_scaling == LossScaleConfig(initial_scale_power=8, loss_scale_window=50, hysteresis=1, min_loss_scale=0.5)


def test_a_static_scale_skips_an_overflow_and_stays() -> None:
    s = LossScaler(LossScaleConfig(loss_scale=64))
    for overflow in (False, True, True, False):
        s.update(overflow)
    assert (s.scale, s.skipped, s.iteration) == (64, 2, 4)
    restored = LossScaler(LossScaleConfig(loss_scale=64))
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def _sync_worker(ctx: WorkerContext) -> list[list[str]]:
    from z3kit.host_sync import HostSyncCounter

    group = fresh_group(ctx)
    torch.manual_seed(0)
    config = zero3.Zero3Config(compute_dtype="fp16", gradient_clipping=1.0, param_persistence_threshold=0)
    engine = zero3.initialize(MLP(), lambda ps: torch.optim.AdamW(ps, lr=LR), config, process_group=group)
    calls = []
    for step in range(4):
        x, y = _batch(step, ctx.rank, ctx.world)
        with HostSyncCounter("cpu") as counter:
            engine.backward(_loss(engine(x), y))
            engine.step()
        calls.append(list(counter.calls))
    return calls


def test_fp16_adds_one_host_read_per_optimizer_step(pools: PoolSet) -> None:
    # fp32 and bf16 steps have none after the first (tests/test_zero3_accelerator_path.py); fp16 reads
    # the overflow verdict once per optimizer step, in zero3.training.loss_scale
    for calls in pools.run(2, _sync_worker):
        for step_calls in calls[1:]:
            assert len(step_calls) == 1 and "loss_scale.py" in step_calls[0], calls
