"""A sharded parameter between uses is one honest object: its real shape, right or refused.

The conformance table (``tests/honest_params_table.py``) on the engine's
model against an unsharded twin of the same values, at worlds 2 and 3
(sizes that do not divide the world); then the uses outside a module's
forward that users' training code makes, each against DDP on the same data:
a penalty computed before the forward, a custom ``autograd.Function`` that
takes ``lm_head``'s weight itself (a fused linear cross-entropy, the TRL and
Liger pattern), and an ``AveragedModel`` EMA; ``copy.deepcopy`` of the model,
and a bf16 state-dict round trip.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests import honest_params_table as table
from tests.dist_pool import PoolSet, WorkerContext


class Net(nn.Module):
    """Sizes that divide neither 2 nor 4 ranks: 35 + 7 + 63 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 7)
        self.head = nn.Linear(7, 9, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if target is None:
            return self.head(self.hidden(x))
        # TRL's fused forward: the head's weight handed to a custom autograd.Function, the head never called
        logp = table._Fused.apply(self.hidden(x), self.head.weight)
        return -logp.gather(1, target[:, None]).mean()


def _plain(value: Any) -> Any:
    """Results as plain tensors (a sharded one's whole value: collective, every rank)."""
    from z3kit.sharded_param import ShardedTensor

    if isinstance(value, ShardedTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _engine(ctx: WorkerContext, model: nn.Module, **config: Any) -> Any:
    from z3kit_recipes import zero3

    return zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            zero3.Zero3Config(param_persistence_threshold=0, **config), ctx.group)


def _refusal(row: table.Row, model: nn.Module, x: torch.Tensor) -> tuple[str, str | None, str | None]:
    from z3kit.sharded_param import ShardedValueError
    from z3kit.withheld import ValueWithheld

    try:
        row.run(model, x)
    except (ShardedValueError, ValueWithheld) as exc:
        return row.habit, "z3kit", str(exc)
    except RuntimeError as exc:
        return row.habit, "torch", str(exc)
    return row.habit, None, None


def _table_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    engine = _engine(ctx, model)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {"reads": [], "refusals": []}
    for row in table.READS:
        out["reads"].append((row.habit, _plain(row.run(model, x)), _plain(row.run(twin, x))))
    for row in table.WRITES_ROWS:
        row.run(model, x)
        row.run(twin, x)
    out["after_writes"] = (engine.full_state_dict(), {k: v.clone() for k, v in twin.state_dict().items()})
    # the engine trains on from the written values, as the twin does (the same batch on every rank)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        twin_opt.zero_grad()
        twin(x).pow(2).mean().backward()
        twin_opt.step()
    out["trained"] = (engine.full_state_dict(), {k: v.clone() for k, v in twin.state_dict().items()})
    for row in table.REFUSALS:
        out["refusals"].append(_refusal(row, model, x))
    # between a backward and the optimizer step
    engine.backward(engine(x).pow(2).mean())
    twin(x).pow(2).mean().backward()
    for row in table.AFTER_BACKWARD:
        if row.expect == table.REFUSED:
            out["refusals"].append(_refusal(row, model, x))
        else:
            out["reads"].append((row.habit, _plain(row.run(model, x)), _plain(row.run(twin, x))))
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    return out


def _same(got: Any, want: Any, habit: str) -> None:
    assert type(got) is type(want), habit
    if isinstance(want, list):
        assert len(got) == len(want), habit
        for g, w in zip(got, want):
            _same(g, w, habit)
    elif isinstance(want, torch.Tensor):
        assert got.numel() > 0 or want.numel() == 0, habit
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=habit)
    else:
        assert got == want, habit


@pytest.mark.parametrize("world", [2, 3])
def test_conformance_table(pools: PoolSet, world: int) -> None:
    assert len(table.ROWS) >= 40
    for r in pools.run(world, _table_worker):
        assert r["shapes"] == [(7, 5), (7,), (9, 7)]
        for habit, got, want in r["reads"]:
            _same(got, want, habit)
        for stage in ("after_writes", "trained"):
            got, want = r[stage]
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{stage}: {name}")
        for habit, kind, message in r["refusals"]:
            assert kind is not None, f"not refused: {habit}"
            if "autograd" in habit:
                assert kind == "torch" and "in-place" in message, (habit, message)
            elif habit.startswith("after backward"):
                assert kind == "z3kit" and "engine.clip_grad_norm_" in message, (habit, message)
            else:
                assert kind == "z3kit" and "gathered_parameters" in message, (habit, message)


def test_docs_show_the_table() -> None:
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "your-code-and-the-model.md").read_text()
    assert table.markdown() in doc, "regenerate the table: python -m tests.honest_params_table"


# -- training through uses outside a module's forward, against DDP ----------------------------------------
def _training_worker(ctx: WorkerContext, habit: str, world_seed: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(world_seed)
    model = Net()
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model, process_group=ctx.group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = _engine(ctx, model)
    ema = ref_ema = None
    if habit == "ema":
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        ref_ema = AveragedModel(ref_model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    losses: list[tuple[float, float]] = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, target = torch.randn(4, 5, generator=g), torch.randint(0, 9, (4,), generator=g)
        pair = []
        for net, run in ((model, engine), (ref_model, ref)):
            if habit == "penalty":  # computed before the forward, from model.parameters()
                penalty = sum(p.pow(2).sum() for p in net.parameters())
                loss = torch.nn.functional.cross_entropy(run(x), target) + 1e-2 * penalty
            elif habit == "fused":  # lm_head's weight handed to a custom autograd.Function
                loss = run(x, target)
            else:
                loss = torch.nn.functional.cross_entropy(run(x), target)
            pair.append(loss)
        engine.backward(pair[0])
        engine.step()
        ref_opt.zero_grad()
        pair[1].backward()
        ref_opt.step()
        if ema is not None and ref_ema is not None:
            ema.update_parameters(model)
            ref_ema.update_parameters(ref_model)
        losses.append((float(pair[0]), float(pair[1])))
    out: dict[str, Any] = {"losses": losses, "params": engine.full_state_dict(),
                           "ref": {k: v.clone() for k, v in ref_model.state_dict().items()}}
    if ema is not None and ref_ema is not None:
        out["ema"] = [_plain(p) for p in ema.parameters()]
        out["ref_ema"] = [p.detach().clone() for p in ref_ema.parameters()]
        with torch.no_grad():
            out["ema_out"] = _plain(ema(torch.ones(2, 5)))
            out["ref_ema_out"] = ref_ema(torch.ones(2, 5)).clone()
    return out


@pytest.mark.parametrize("habit", ["penalty", "fused", "ema"])
def test_uses_outside_forward_train_as_ddp(pools: PoolSet, habit: str) -> None:
    for r in pools.run(2, _training_worker, habit, 7):
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-5)
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        if habit == "ema":
            assert len(r["ema"]) == len(r["ref_ema"]) and all(p.numel() > 0 for p in r["ema"])
            for got, want in zip(r["ema"], r["ref_ema"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["ema_out"], r["ref_ema_out"], rtol=1e-5, atol=1e-6)


# -- deepcopy, dtype ---------------------------------------------------------------------------------------
def _copy_and_dtype_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit.sharded_param import ShardedTensor
    from z3kit_recipes import zero3

    torch.manual_seed(3)
    model = Net()
    twin = copy.deepcopy(model)
    engine = _engine(ctx, model, compute_dtype="bf16")
    before = engine.full_state_dict()
    model.load_state_dict(model.state_dict())
    after = engine.full_state_dict()
    clone = copy.deepcopy(model)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        copied_out = _plain(clone(x.bfloat16()))
        engine_out = _plain(engine(x.bfloat16()))
    out: dict[str, Any] = {
        "roundtrip": [(k, torch.equal(before[k], after[k])) for k in before],
        "copy_kinds": [isinstance(p, ShardedTensor) and p.numel() > 0 for p in clone.parameters()],
        "copy_out": (copied_out, engine_out),
        "twin_close": [(k, (before[k] - v).abs().max().item()) for k, v in twin.state_dict().items()],
    }
    second = zero3.initialize(clone, None, zero3.Zero3Config(compute_dtype="bf16"), ctx.group)
    with torch.no_grad():
        out["second_out"] = _plain(second(x.bfloat16()))
    return out


def test_deepcopy_and_bf16_round_trip(pools: PoolSet) -> None:
    for r in pools.run(2, _copy_and_dtype_worker):
        assert all(same for _, same in r["roundtrip"]), r["roundtrip"]
        assert all(r["copy_kinds"])
        torch.testing.assert_close(r["copy_out"][0], r["copy_out"][1])
        torch.testing.assert_close(r["second_out"], r["copy_out"][1])
        assert all(diff == 0.0 for _, diff in r["twin_close"])  # the masters are the model's fp32 values


# -- a rank that gathers alone -------------------------------------------------------------------------------
def _alone_worker(ctx: WorkerContext) -> dict[str, Any]:
    import time

    from tests.dist_pool import fresh_group
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3 import RanksDisagree

    torch.manual_seed(0)
    model = Net()
    engine = zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                              zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=60),
                              fresh_group(ctx))
    started = time.monotonic()
    try:
        if ctx.rank == 0:  # rank-0-only logging of a weight's norm, while rank 1 trains
            float(model.head.weight.norm())
        else:
            engine.backward(engine(torch.ones(2, 5)).sum())
        error = None
    except RanksDisagree as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_rank_that_gathers_alone_is_named_on_every_rank(pools: PoolSet) -> None:
    for r in pools.run(2, _alone_worker):
        assert r["error"] is not None and "head.weight" in r["error"], r
        assert r["seconds"] < 10


# -- an unmodified Hugging Face model's own counts and reads --------------------------------------------------
def _hf_worker(ctx: WorkerContext) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=36, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    twin = copy.deepcopy(model)
    _engine(ctx, model)
    reads = lambda m: [m.num_parameters(), m.num_parameters(only_trainable=True), m.dtype, m.device,  # noqa: E731
                       _plain(m.get_output_embeddings().weight.norm()), _plain(m.get_input_embeddings().weight[3])]
    return {"engine": reads(model), "twin": reads(twin)}


def test_a_hugging_face_model_counts_and_reads_as_unsharded(pools: PoolSet) -> None:
    for r in pools.run(2, _hf_worker):
        _same(r["engine"], r["twin"], "HF reads")
