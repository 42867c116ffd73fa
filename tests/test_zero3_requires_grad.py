"""``requires_grad`` changed after initialize is followed (issue 17).

Staged fine-tuning freezes and unfreezes layers between optimizer steps.
Freezing a parameter that trained at initialize, unfreezing it again, and
unfreezing one that was frozen at initialize all train at parity with DDP
(``find_unused_parameters=True``) on the same data. Unfreezing in the middle
of an accumulation window, in an inference-only engine, or on one rank only
is refused on every rank, with nothing changed.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch

from tests.dist_pool import WorkerContext, fresh_group
from tests.errors import unchanged
from tests.zero3_models import MLP, assert_params_match, ddp_vec_step, make_optimizer, vec_batch, vec_loss

SHARDED = {"param_persistence_threshold": 0}
#: optimizer step -> {layer index: requires_grad}, applied to both runs before that step
SCHEDULE = {2: {0: False}, 4: {0: True, 2: False}, 6: {2: True}}


def _set(model: torch.nn.Module, changes: dict[int, bool]) -> None:
    for i, on in changes.items():
        model.layers[i].requires_grad_(on)


def run_staged(ctx: WorkerContext, frozen_at_init: tuple[int, ...], dtype: str, groups: bool) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(3)
    model = MLP(depth=3)
    ddp_model = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, process_group=ctx.group, find_unused_parameters=True)
    _set(model, {i: False for i in frozen_at_init})
    _set(ddp_model, {i: False for i in frozen_at_init})  # after DDP is built: DDP reduces every parameter

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if not groups:
            return make_optimizer("adamw", params, 1e-2)
        # the usual no-decay rule, on 1-D shards: every other master in a group of its own
        return torch.optim.AdamW([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2,
                                 weight_decay=0.1)

    ddp_opt = factory(list(ddp_model.parameters()))
    engine = zero3.initialize(model, factory, zero3.Zero3Config(**SHARDED, compute_dtype=dtype), ctx.group)
    losses: list[tuple[float, float]] = []
    for step in range(8):
        _set(model, SCHEDULE.get(step, {}))
        _set(ddp_model, SCHEDULE.get(step, {}))
        batch = vec_batch(ctx.rank, step, 0, 0)
        loss = vec_loss(engine, batch, step)
        engine.backward(loss)
        engine.step()
        losses.append((float(loss), ddp_vec_step(ddp, ddp_opt, batch, step)))
    return {"losses": losses, "engine": engine.full_state_dict(),
            "ddp": {n: p.detach().clone() for n, p in ddp_model.named_parameters()}}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("frozen_at_init", [(), (0, 2)], ids=["trainable_at_init", "frozen_at_init"])
def test_staged_unfreezing_matches_ddp(pools: Any, world: int, frozen_at_init: tuple[int, ...]) -> None:
    for r in pools.run(world, run_staged, frozen_at_init, "fp32", False):
        for step, (got, want) in enumerate(r["losses"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"step {step}: {got} vs DDP {want}"
        assert_params_match(r["engine"], r["ddp"])


def test_unfrozen_parameters_join_the_factorys_groups(pools: Any) -> None:
    """The factory's no-decay split decides the group of an unfrozen master, as at initialize."""
    for r in pools.run(2, run_staged, (0, 2), "fp32", True):
        for got, want in r["losses"]:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want))
        assert_params_match(r["engine"], r["ddp"])


def test_bf16_unfreezing_trains_close_to_fp32(pools: Any) -> None:
    for r in pools.run(2, run_staged, (0, 2), "bf16", False):
        got, want = torch.tensor(r["losses"]).unbind(1)
        assert ((got - want).abs() / want.abs()).max() <= 3e-2


def run_refused(ctx: WorkerContext, case: str) -> str:
    from z3kit_recipes import zero3

    torch.manual_seed(3)
    model = MLP(depth=3)
    model.layers[0].requires_grad_(False)
    config = zero3.Zero3Config(**SHARDED, gradient_accumulation_steps=2, collective_timeout_s=30)
    factory = None if case == "inference" else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    engine = zero3.initialize(model, factory, config, fresh_group(ctx))  # the refused cases leave a gather unpaired
    batch = vec_batch(ctx.rank, 0, 0, 0)
    if case == "window":
        engine.backward(vec_loss(engine, batch, 0))  # a window is open
    before = {**engine.full_state_dict(), **{f"master{i}": m.detach().clone() for i, m in enumerate(engine.masters)}}
    if case != "one_rank" or ctx.rank == 0:
        model.layers[0].requires_grad_(True)
    started = time.monotonic()
    try:
        with torch.set_grad_enabled(True):
            vec_loss(engine, batch, 0)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        took = time.monotonic() - started
        after = {**engine.full_state_dict(), **{f"master{i}": m.detach().clone() for i, m in enumerate(engine.masters)}} \
            if case != "one_rank" else before
        return f"{type(exc).__name__} after {took:.0f}s unchanged={unchanged(before, after)}: {exc}"
    return "no error"


@pytest.mark.parametrize("case, words", [
    ("window", "middle of a gradient-accumulation window"),
    ("inference", "without an optimizer"),
])
def test_unfreezing_refused_everywhere(pools: Any, case: str, words: str) -> None:
    for msg in pools.run(2, run_refused, case):
        assert msg.startswith("RuntimeError after 0s unchanged=True"), msg
        assert words in msg and "layers.0.weight" in msg, msg


def test_unfreezing_on_one_rank_is_named_on_every_rank(pools: Any) -> None:
    """Rank 0 unfreezes, rank 1 does not: each raises within seconds, instead of reductions that do not pair."""
    got = pools.run(2, run_refused, "one_rank", timeout=60)
    assert all(m.startswith("RankFailed after") and "unfroze 2 parameter(s)" in m for m in got), got
    assert all(int(m.split(" after ")[1].split("s")[0]) <= 10 for m in got), got


def run_resume_later_stage(ctx: WorkerContext, tmp: str, unfreeze_first: bool) -> dict[str, Any]:
    """Stage 2 (layer 0 unfrozen) is saved; a fresh engine built as in stage 1 (layer 0 frozen) loads it."""
    from z3kit_recipes import zero3

    def build() -> Any:
        torch.manual_seed(3)
        model = MLP(depth=3)
        model.layers[0].requires_grad_(False)
        return zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                zero3.Zero3Config(**SHARDED), fresh_group(ctx))

    engine = build()
    engine.module.layers[0].requires_grad_(True)
    for step in range(3):
        b = vec_batch(ctx.rank, step, 0, 0)
        engine.backward(vec_loss(engine, b, step))
        engine.step()
    engine.save_checkpoint(tmp)
    saved = engine.full_state_dict()
    fresh = build()
    if unfreeze_first:
        fresh.module.layers[0].requires_grad_(True)
    try:
        fresh.load_checkpoint(tmp)
    except ValueError as exc:
        return {"caught": str(exc)}
    loaded = fresh.full_state_dict()
    b = vec_batch(ctx.rank, 3, 0, 0)
    losses = []
    for e in (engine, fresh):
        loss = vec_loss(e, b, 3)
        e.backward(loss)
        e.step()
        losses.append(float(loss))
    return {"caught": None, "loaded_as_saved": all(torch.equal(saved[k], v) for k, v in loaded.items()),
            "losses": losses, "after": [e.full_state_dict() for e in (engine, fresh)]}


@pytest.mark.parametrize("unfreeze_first", [True, False])
def test_a_later_stage_resumes_into_an_engine_built_frozen(pools: Any, tmp_path: Any, unfreeze_first: bool) -> None:
    for r in pools.run(2, run_resume_later_stage, str(tmp_path / "ckpt"), unfreeze_first):
        if unfreeze_first:
            assert r["caught"] is None and r["loaded_as_saved"], r
            assert r["losses"][0] == r["losses"][1]
            assert_params_match(r["after"][1], r["after"][0], rtol=0, atol=0)
        else:
            assert "was trainable when the checkpoint was saved" in r["caught"], r
            assert "requires_grad_(True)) before load_checkpoint" in r["caught"], r
