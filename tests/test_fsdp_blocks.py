"""The fsdp_blocks runtime: parity with torch DDP on gloo, the static
prefetch plan, refusals of bad block lists, and no dependency on zero3.

Each parity case trains one model of ``tests/zero3_models.py`` for ten
optimizer steps twice on every rank, side by side: through
``fsdp_blocks.initialize`` and through DDP on a deep copy, on the same
rank-local data, with the same optimizer; losses at every micro-step and
the final full parameters must agree to fp32 rounding.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.zero3_models import (
    WORKLOADS, Block, Case, DDPReference, FrozenModel, PairResult, TinyTransformer, assert_pair, make_optimizer,
    train_steps,
)
from z3kit.collectives import CollectiveKind
from z3kit.shard import ParamStatus
from z3kit_recipes import fsdp_blocks
from z3kit_recipes.fsdp_blocks import BlocksConfig


def _gpt2_blocks(m: Any) -> list[Any]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    # a class to match, and lm_head, whose weight is tied to wte (outside every block)
    return [GPT2Block, m.lm_head]


#: the blocks each workload is sharded by (built inside the ranks)
BLOCKS: dict[str, Callable[[Any], list[Any]]] = {
    "mlp": lambda m: list(m.layers),
    "frozen": lambda m: list(m.mlp.layers),
    # tok_emb.weight is lm_head.weight: held by a block and by the root, so it joins the root unit
    "gpt_hf": lambda m: [Block, m.lm_head],
    "hf_gpt2": _gpt2_blocks,
    "hf_llama": lambda m: list(m.model.layers),
    # blocks run under torch.utils.checkpoint: gathered again for their recomputation in backward
    "ckpt_reentrant": lambda m: [m.inp, *m.blocks, m.head],
    "ckpt_nonreentrant": lambda m: [m.inp, *m.blocks, m.head],
}


def train_blocks(ctx: Any, case: Case, blocks: str = "") -> PairResult:
    """``case`` trained by fsdp_blocks and by DDP side by side (the zero3
    suites' ``build_pair`` for this runtime, then their ``train_steps``)."""
    wl = WORKLOADS[case.workload]
    torch.manual_seed(1000 + case.seed)
    model = wl.build()
    ref = DDPReference(ctx, copy.deepcopy(model), case)
    engine = fsdp_blocks.initialize(
        model, lambda ps: make_optimizer(case.optimizer, ps, case.lr),
        blocks=BLOCKS[blocks or case.workload](model), process_group=ctx.group, config=BlocksConfig(**case.config),
    )
    res = train_steps(ctx, engine, ref, case, range(case.steps), PairResult([], [], [], {}, {}, [], [], None, [], 0),
                      grad_norm=lambda e: None if e.last_grad_norm is None else float(e.last_grad_norm))
    res.engine_params = engine.full_state_dict()
    res.ddp_params = ref.params()
    res.extra = {
        "resident": sum(u.flat.numel() for u in engine.units),
        "model": sum(p.numel() for p in ref.model.parameters()),
        "units": [u.names for u in engine.units],
        "collectives": engine.log.snapshot(),
    }
    return res


#: Note: tolerance of the Hugging Face models beyond two ranks.
#:     gloo sums a reduction in ring order over chunks of the flat buffer; DDP's buckets and
#:     fsdp_blocks' units lay gradients out differently, so from three ranks on an element's
#:     summands are added in another order (at two, a + b is commutative: exact). Adam turns
#:     that rounding into parameter steps where a gradient is near zero (GPT-2's key bias is
#:     zero up to rounding), about 1e-6 after six steps. Everything else stays at fp32 rounding.
HF_ATOL_BEYOND_TWO = 1e-5


def check(results: list[PairResult], world: int, atol: float = 1e-6) -> None:
    assert len(results) == world
    assert_pair(results, atol=atol)
    for r in results:
        assert all(g == 0 for g in r.gathered_after_step), "everything is released between steps"
        if world > 1:
            assert r.extra["resident"] < r.extra["model"], "the model was not sharded"


# --------------------------------------------------------------------------- #
# Parity with DDP
# --------------------------------------------------------------------------- #

CASES = {
    "mlp": Case("mlp"),
    "gpt_hf_tied": Case("gpt_hf", optimizer="adamw"),
    # lr as the zero3 suite runs these models (GPT-2's key bias gets gradients that are zero up
    # to rounding, which Adam turns into steps of up to lr)
    "hf_gpt2_tied": Case("hf_gpt2", lr=3e-3, steps=6),
    "hf_llama": Case("hf_llama", optimizer="adamw", lr=3e-3, steps=6),
    "frozen": Case("frozen"),
    "accumulation": Case("mlp", {"gradient_accumulation_steps": 4}, accumulation=4, steps=5),
    "clipping": Case("mlp", {"gradient_clipping": 0.5}, clip=0.5),
    "clipping_accumulation": Case("gpt_hf", {"gradient_clipping": 0.25, "gradient_accumulation_steps": 2},
                                  clip=0.25, accumulation=2, steps=5),
    "checkpoint_reentrant": Case("ckpt_reentrant"),
    "checkpoint_nonreentrant": Case("ckpt_nonreentrant"),
}
#: which worlds each case runs at: every case at 2, and each of 1, 3 and 4 by several
WORLDS = {
    "mlp": [1, 2, 3, 4], "gpt_hf_tied": [1, 2, 3, 4], "hf_gpt2_tied": [2, 4], "hf_llama": [2, 3],
    "frozen": [2, 3], "accumulation": [1, 4], "clipping": [2, 3], "clipping_accumulation": [4],
    "checkpoint_reentrant": [2], "checkpoint_nonreentrant": [2],
}


@pytest.mark.parametrize(("name", "world"), [(n, w) for n, ws in WORLDS.items() for w in ws])
def test_parity_with_ddp(pools: Any, name: str, world: int) -> None:
    case = CASES[name]
    results = pools.run(world, train_blocks, case)
    check(results, world, HF_ATOL_BEYOND_TWO if case.workload.startswith("hf_") and world > 2 else 1e-6)
    r = results[0]
    if case.accumulation > 1:
        assert r.stepped == ([False] * (case.accumulation - 1) + [True]) * case.steps
    if case.clip > 0:
        assert max(r.ddp_norms) > case.clip, "clipping never engaged"
        torch.testing.assert_close(torch.tensor(r.engine_norms, dtype=torch.float64),
                                   torch.tensor(r.ddp_norms, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    if case.workload in ("gpt_hf", "hf_gpt2"):
        # the tied weight is in the root unit; the lm_head block owns no parameter of its own
        root = r.extra["units"][-1]
        tied = "tok_emb.weight" if case.workload == "gpt_hf" else "transformer.wte.weight"
        assert tied in root and [] in r.extra["units"][:-1]
    calls = r.extra["collectives"]
    # one rank: no all-gather (the shard is the parameter: z3kit.shard's Note at world 1)
    assert (calls["all_gather"]["calls"] > 0) == (world > 1) and calls["reduce_scatter"]["calls"] > 0


def test_frozen_parameters_keep_their_values(pools: Any) -> None:
    (r, _) = pools.run(2, train_blocks, CASES["frozen"])
    torch.manual_seed(1000)
    initial = {n: p.detach() for n, p in FrozenModel().named_parameters()}
    for frozen in ("mlp.layers.0.weight", "mlp.layers.0.bias", "mlp.layers.1.bias"):
        assert torch.equal(r.engine_params[frozen], initial[frozen]), frozen
    assert not torch.equal(r.engine_params["mlp.layers.1.weight"], initial["mlp.layers.1.weight"])


# --------------------------------------------------------------------------- #
# The static prefetch plan
# --------------------------------------------------------------------------- #


def prefetch_order(ctx: Any, prefetch: bool) -> dict[str, Any]:
    """Inside each block's forward: whether the next block's gather is in
    flight already; and the kinds of collective of one backward, in order."""
    torch.manual_seed(0)
    model = WORKLOADS["mlp"].build()  # three Linear blocks, no root parameters
    engine = fsdp_blocks.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), blocks=list(model.layers),
                                    process_group=ctx.group, config=BlocksConfig(prefetch=prefetch))
    engine.log.order = []
    seen: list[tuple[str, ...]] = []

    def probe(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:  # runs after the engine's own pre-forward
            seen.append(tuple(u.shards[0].status.name for u in engine.blocks))
        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(probe(i))
    loss = engine(torch.randn(4, 7)).sum()
    forward = [k.value for k, _ in engine.log.order]
    engine.log.order.clear()
    engine.backward(loss)
    backward = [k.value for k, _ in engine.log.order]
    return {"seen": seen, "forward": forward, "backward": backward}


@pytest.mark.parametrize("world", [1, 2])
def test_next_block_is_gathered_while_this_one_runs(pools: Any, world: int) -> None:
    A, I, N = ParamStatus.AVAILABLE.name, ParamStatus.INFLIGHT.name, ParamStatus.NOT_AVAILABLE.name
    ag, rs = CollectiveKind.ALL_GATHER.value, CollectiveKind.REDUCE_SCATTER.value
    on, off = pools.run(world, prefetch_order, True)[0], pools.run(world, prefetch_order, False)[0]
    # forward: block i runs while block i + 1's all-gather is in flight
    assert on["seen"] == [(A, I, N), (N, A, I), (N, N, A)]
    assert off["seen"] == [(A, N, N), (N, A, N), (N, N, A)]
    if world == 1:  # the shards are the parameters: the gathers call no collective
        assert on["forward"] == off["forward"] == [] and on["backward"] == off["backward"] == [rs] * 3
        return
    assert on["forward"] == off["forward"] == [ag] * 3
    # backward: the previous block's gather is issued before this block's reduction
    assert on["backward"] == [ag, ag, rs, ag, rs, rs]
    assert off["backward"] == [ag, rs, ag, rs, ag, rs]


def run_under_nccl_semantics(ctx: Any, name: str) -> dict[str, Any]:
    """``CASES[name]`` trained by fsdp_blocks on a ``z3sim`` group (NCCL's
    waiting semantics, ``tests.accelerator_double``) with a recording stream
    pair, next to DDP on gloo: every violation, the engine's host syncs, and
    the losses and parameters of both runs."""
    from tests import accelerator_double as double
    from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker

    case, wl = CASES[name], WORKLOADS[CASES[name].workload]
    checker = StreamOrderChecker()
    with double.DOUBLE.observing(checker, strict=False) as seen:
        torch.manual_seed(1000 + case.seed)
        model = wl.build()
        ref = DDPReference(ctx, copy.deepcopy(model), case)
        engine = fsdp_blocks.initialize(
            model, lambda ps: make_optimizer(case.optimizer, ps, case.lr), blocks=BLOCKS[case.workload](model),
            process_group=double.new_group(list(range(ctx.world))), config=BlocksConfig(**case.config),
            streams=RecordingStreamPair(checker, device=torch.device("cpu")),
        )
        losses, ref_losses = [], []
        for step in range(case.steps):
            batch = wl.batch(ctx.rank, step, 0, 0)
            with seen.counting():
                loss = wl.loss(engine, batch, step)
                engine.backward(loss)
                engine.step()
            losses.append(float(loss.detach()))
            ref_losses.append(ref.micro_step([batch], step, 0))
            ref.step()
        params, ref_params = engine.full_state_dict(), ref.params()
    # the optimizer reading its step counters is no sync: they stay on the host on an accelerator too
    engine_syncs = {k: n for k, n in seen.syncs.by_site().items()
                    if ("fsdp_blocks/" in k or " at z3kit/" in k) and "via torch/optim/" not in k}
    return {"violations": list(seen.violations), "syncs": engine_syncs, "losses": losses, "ref_losses": ref_losses,
            "params": params, "ref_params": ref_params}


@pytest.mark.parametrize("name", ["gpt_hf_tied", "clipping", "hf_llama"])
def test_nccl_semantics_no_host_sync_and_parity(pools: Any, name: str) -> None:
    """No timed or host-blocking wait on a collective, no buffer outside its
    ticket, no host sync in the engine's forward, backward and step."""
    for rank, r in enumerate(pools.run(2, run_under_nccl_semantics, name)):
        assert r["violations"] == [], f"rank {rank}: {r['violations'][:3]}"
        assert r["syncs"] == {}, f"rank {rank}: host syncs in the engine: {r['syncs']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        for n, p in r["ref_params"].items():
            torch.testing.assert_close(r["params"][n], p, rtol=1e-5, atol=1e-5, msg=n)


def backward_raises_then_trains(ctx: Any) -> dict[str, Any]:
    """A backward raises half-way (a gradient hook of the user's); the next
    forward, backward and step run as usual: everything is released after
    them and the parameters moved."""
    torch.manual_seed(0)
    model = WORKLOADS["mlp"].build()
    engine = fsdp_blocks.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), blocks=list(model.layers),
                                    process_group=ctx.group)
    fail = [True]

    def raise_once(grad: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            fail[0] = False
            raise ValueError("a user's hook failed")
        return grad

    model.layers[1].register_forward_hook(lambda m, a, out: out.register_hook(raise_once) and None)
    x = torch.randn(4, 7)
    caught = ""
    try:
        engine.backward(engine(x).square().sum())
    except ValueError as e:
        caught = str(e)
    before = engine.full_state_dict()
    engine.backward(engine(x).square().sum())
    engine.step()
    after = engine.full_state_dict()
    return {"caught": caught, "gathered": engine.gathered_numel(),
            "moved": all(not torch.equal(before[n], after[n]) for n in before)}


def test_a_backward_that_raised_does_not_stop_the_next(pools: Any) -> None:
    for r in pools.run(2, backward_raises_then_trains):
        assert r == {"caught": "a user's hook failed", "gathered": 0, "moved": True}, r


def train_and_drop(ctx: Any) -> dict[str, bool]:
    """One training step, then the engine is dropped: it must be freed with its
    shards (``z3kit.grad_hooks``: the parameters' gradient hooks hold it weakly)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = WORKLOADS["mlp"].build()
    engine = fsdp_blocks.initialize(model, lambda ps: torch.optim.Adam(ps, lr=0.1), blocks=list(model.layers),
                                    process_group=ctx.group)
    engine.backward(engine(torch.randn(4, 7)).sum())
    engine.step()
    engine_ref, flat_refs = weakref.ref(engine), [weakref.ref(u.flat) for u in engine.blocks]
    del engine, model
    gc.collect()
    return {"engine": engine_ref() is not None, "shards": any(r() is not None for r in flat_refs)}


def test_a_dropped_engine_is_freed(pools: Any) -> None:
    for r in pools.run(2, train_and_drop):
        assert r == {"engine": False, "shards": False}, r


# --------------------------------------------------------------------------- #
# Refusals, before anything changes
# --------------------------------------------------------------------------- #


def _refused(model: nn.Module, blocks: Any, error: type[Exception], match: str) -> None:
    before = {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    with pytest.raises(error, match=match):
        fsdp_blocks.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), blocks=blocks,
                               process_group=object())  # type: ignore[arg-type]
    assert {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()} == before, "the model was changed"
    assert not model._forward_pre_hooks and not any(m._forward_hooks for m in model.modules())


def test_bad_block_lists_are_refused_by_name() -> None:
    m = TinyTransformer("hf")
    _refused(m, [], ValueError, "blocks is empty: name at least one submodule")
    _refused(m, m.blocks[0], TypeError, "blocks must be a list")
    _refused(m, [nn.Linear(3, 3)], ValueError, r"blocks\[0\] \(Linear\) is not a submodule of the model")
    _refused(m, [copy.deepcopy(m.blocks[0])], ValueError, "not a submodule of the model; pass modules the model holds")
    _refused(m, [m.blocks[0], m.blocks[0].attn], ValueError,
             "block 'blocks.0.attn' is nested in block 'blocks.0'.*not both")
    _refused(m, [m.blocks[1].fc, Block], ValueError, "block 'blocks.1.fc' is nested in block 'blocks.1'")
    _refused(m, [m.blocks[0], m.blocks[0]], ValueError, "block 'blocks.0' is listed twice")
    _refused(m, [m], ValueError, "blocks\\[0\\] is the model itself")
    _refused(m, [nn.GRU], ValueError, "the class GRU matches no submodule")
    _refused(m, ["blocks.0"], TypeError, r"blocks\[0\] is a str")
    _refused(m.double(), [m.blocks[0]], TypeError, "parameter 'tok_emb.weight' is torch.float64.*model.float")


def test_bad_arguments_are_refused() -> None:
    m = TinyTransformer("hf")
    with pytest.raises(ValueError, match="process_group is required"):
        fsdp_blocks.initialize(m, torch.optim.SGD, blocks=[m.blocks[0]], process_group=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a BlocksConfig"):
        fsdp_blocks.initialize(m, torch.optim.SGD, blocks=[m.blocks[0]], process_group=object(),  # type: ignore[arg-type]
                               config={"gradient_accumulation_steps": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        BlocksConfig(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="gradient_clipping"):
        BlocksConfig(gradient_clipping=-1.0)
    with pytest.raises(TypeError, match="prefetch"):
        BlocksConfig(prefetch=1)  # type: ignore[arg-type]


def test_does_not_import_zero3() -> None:
    code = ("import sys, z3kit_recipes.fsdp_blocks as fb; import z3kit_recipes.fsdp_blocks.engine; "
            "print(sorted(m for m in sys.modules if m.startswith('z3kit_recipes.zero3')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
