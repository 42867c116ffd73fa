"""Optimizer offload (``Zero3Config.offload_optimizer``): the masters and the
optimizer state on the host, at bitwise parity with the run without it.

Every run here is real: gloo processes from the pool, the engine's own
copies between separate host and "device" tensors (both CPU here).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.zero3_models import MLP
from z3kit_recipes import zero3
from z3kit_recipes.zero3.config.offload import OffloadConfig

STEPS = 4


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 7, generator=gen)


def _train(ctx: WorkerContext, config: zero3.Zero3Config, steps: int = STEPS,
           engine_out: list[Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    engine = zero3.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), config,
                              fresh_group(ctx))
    losses = []
    for step in range(steps):
        for micro in range(config.gradient_accumulation_steps):
            loss = engine(_batch(ctx.rank, step, micro)).pow(2).mean()
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    if engine_out is not None:
        engine_out.append(engine)
    stats = engine.stats()
    return dict(losses=losses, params=engine.full_state_dict(), memory=dict(stats.memory.current),
                shards=[s.shard.detach().clone() for s in engine.shards], norm=stats.last_grad_norm)


def _pair(ctx: WorkerContext, base: dict[str, Any], offload: OffloadConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    plain = _train(ctx, zero3.Zero3Config(**base))
    offloaded = _train(ctx, zero3.Zero3Config(**base, offload_optimizer=offload))
    return plain, offloaded


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for x, y in zip(a["shards"], b["shards"]):
        assert torch.equal(x, y)
    assert a["norm"] == b["norm"]


CASES = {
    "fp32": dict(param_persistence_threshold=0),
    "bf16": dict(param_persistence_threshold=0, compute_dtype="bf16"),
    # loss scaling on the device, the optimizer on the host: the scaler's verdict gates the host step
    "fp16": dict(param_persistence_threshold=0, compute_dtype="fp16", gradient_clipping=1.0),
    "accumulate_and_clip": dict(param_persistence_threshold=0, gradient_accumulation_steps=3, gradient_clipping=0.05),
}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_offloaded_training_is_bitwise_the_plain_one(pools: PoolSet, world: int, case: str) -> None:
    for plain, offloaded in pools.run(world, _pair, CASES[case], OffloadConfig()):
        _same(plain, offloaded)
        mem = offloaded["memory"]
        # ratio 1.0: nothing of the optimizer's on the device, all of it on the host
        assert mem["fp32_masters"] == 0 and mem["optimizer_state"] == 0
        assert mem["host_fp32_masters"] > 0 and mem["host_optimizer_state"] > 0 and mem["host_grad_partitions"] > 0
        assert "host_fp32_masters" not in plain["memory"]  # host kinds are reported once used
        if case in ("bf16", "fp16"):
            assert mem["host_fp32_masters"] == plain["memory"]["fp32_masters"]
        assert mem["host_optimizer_state"] == plain["memory"]["optimizer_state"]


@pytest.mark.parametrize("world", [2])
def test_a_partial_ratio_splits_the_state_and_keeps_parity(pools: PoolSet, world: int) -> None:
    for plain, offloaded in pools.run(world, _pair, CASES["bf16"], OffloadConfig(ratio=0.5)):
        _same(plain, offloaded)
        mem = offloaded["memory"]
        for kind in ("fp32_masters", "optimizer_state"):
            assert 0 < mem[kind] < plain["memory"][kind]
            assert 0 < mem[f"host_{kind}"] < plain["memory"][kind]
        assert mem["fp32_masters"] + mem["host_fp32_masters"] == plain["memory"]["fp32_masters"]


def test_host_params_takes_parameters_in_order_up_to_the_ratio() -> None:
    assert OffloadConfig().host_params([3, 5, 2]) == {0, 1, 2}
    assert OffloadConfig(ratio=0.5).host_params([3, 5, 2]) == {0, 1}
    assert OffloadConfig(ratio=0.1).host_params([3, 5, 2]) == {0}


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    (dict(device="gpu"), ValueError, "OffloadConfig.device"),
    (dict(device="nvme"), ValueError, "NVMe"),
    (dict(ratio=0.0), ValueError, "OffloadConfig.ratio"),
    (dict(ratio=1.5), ValueError, "OffloadConfig.ratio"),
    (dict(ratio="half"), TypeError, "OffloadConfig.ratio"),
    (dict(pin_memory="yes"), TypeError, "pin_memory"),
])
def test_bad_offload_settings_are_refused_by_name(kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        OffloadConfig(**kwargs)


def test_zero3_config_takes_an_offload_config_only() -> None:
    with pytest.raises(TypeError, match="offload_optimizer"):
        zero3.Zero3Config(offload_optimizer={"device": "cpu"})  # type: ignore[arg-type]


def _json(offload: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": offload, **extra}, "gradient_clipping": 0.0}


def test_deepspeed_json_offload_optimizer_cpu_maps_to_the_offload_config() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = zero3.Zero3Config.from_deepspeed(_json({"device": "cpu", "pin_memory": False, "ratio": 0.25}))
    assert config.offload_optimizer == OffloadConfig(pin_memory=False, ratio=0.25)
    assert not any("does not offload" in str(w.message) for w in seen)
    assert zero3.Zero3Config.from_deepspeed(_json({"device": "cpu"})).offload_optimizer == OffloadConfig()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        none = zero3.Zero3Config.from_deepspeed(_json({"device": "none"}, offload_param={"device": "cpu"}))
    assert none.offload_optimizer is None
    notes = " ".join(str(w.message) for w in seen)
    assert "offload_param" in notes and "does not offload parameters" in notes
    with pytest.raises(ValueError, match="NVMe"):
        zero3.Zero3Config.from_deepspeed(_json({"device": "nvme"}))
    with pytest.raises(ValueError, match="zero_optimization.offload_optimizer: OffloadConfig.ratio"):
        zero3.Zero3Config.from_deepspeed(_json({"device": "cpu", "ratio": 2}))
    with pytest.raises(ValueError, match="offload_param.ratio"):
        zero3.Zero3Config.from_deepspeed(_json({"device": "none"}, offload_param={"device": "cpu", "ratio": 0.5}))


def _json_worker(ctx: WorkerContext) -> tuple[dict[str, Any], dict[str, Any]]:
    ds = _json({"device": "cpu", "pin_memory": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = zero3.Zero3Config.from_deepspeed(ds)
    assert config.offload_optimizer is not None
    return _train(ctx, zero3.Zero3Config(gradient_clipping=0.0)), _train(ctx, config)


def test_a_deepspeed_json_with_offload_optimizer_cpu_trains_offloaded(pools: PoolSet) -> None:
    for plain, offloaded in pools.run(2, _json_worker):
        _same(plain, offloaded)
        assert offloaded["memory"]["optimizer_state"] == 0 and offloaded["memory"]["host_optimizer_state"] > 0


def _resume_worker(ctx: WorkerContext, root: str, base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    config = zero3.Zero3Config(**base, offload_optimizer=OffloadConfig())
    straight = _train(ctx, config, steps=4)
    engines: list[Any] = []
    _train(ctx, config, steps=2, engine_out=engines)
    engines[0].save_checkpoint(root)
    torch.manual_seed(123)
    fresh = zero3.initialize(MLP(), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), config,
                             fresh_group(ctx))
    fresh.load_checkpoint(root)
    assert fresh.stats().memory.current["host_optimizer_state"] > 0
    assert fresh.stats().memory.current["optimizer_state"] == 0
    losses = []
    for step in range(2, 4):
        for micro in range(config.gradient_accumulation_steps):
            loss = fresh(_batch(ctx.rank, step, micro)).pow(2).mean()
            fresh.backward(loss)
            losses.append(loss.item())
        fresh.step()
    resumed = dict(losses=straight["losses"][: len(straight["losses"]) - len(losses)] + losses,
                   params=fresh.full_state_dict(), shards=[s.shard.detach().clone() for s in fresh.shards],
                   norm=fresh.stats().last_grad_norm)
    return straight, resumed


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_checkpoint_of_an_offloaded_engine_resumes_exactly(pools: PoolSet, tmp_path: Path, case: str) -> None:
    for straight, resumed in pools.run(2, _resume_worker, str(tmp_path / "ckpt"), CASES[case]):
        _same(straight, resumed)
