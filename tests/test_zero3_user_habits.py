"""What users' own code does to a sharded model: right (DDP's answer) or refused, never silently wrong.

Each case is a habit of plain PyTorch, Hugging Face or PEFT code, run on
the engine's model and on a DDP twin fed the same data: clipping by hand,
``model.state_dict()`` and ``load_state_dict``, ``save_pretrained``,
``zero_grad()`` after every ``step()`` call inside an accumulation window,
gradients set to None before ``step()`` (a bad batch dropped), ``no_sync()``,
and a rank that calls a collective alone.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.zero3_models import WORKLOADS, Case, build_pair, hf_batch, hf_loss, vec_batch, vec_loss

SHARDED = {"param_persistence_threshold": 0}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _train_both(ctx: WorkerContext, engine: Any, ref: Any, model: Any, workload: str, steps: range) -> None:
    """Optimizer steps of ``workload`` on the engine's model and on its DDP twin, one micro-step each."""
    wl = WORKLOADS[workload]
    for step in steps:
        b = wl.batch(ctx.rank, step, 0, 0)
        engine.backward(wl.loss(model, b, step))
        engine.step()
        ref.micro_step([b], step, 0)
        ref.step()


# -- clipping ---------------------------------------------------------------------------------------
def _clip_worker(ctx: WorkerContext, accumulation: int) -> dict[str, Any]:
    from z3kit.withheld import ValueWithheld

    case = Case("mlp", {**SHARDED, "gradient_accumulation_steps": accumulation}, accumulation=accumulation)
    engine, ref, model = build_pair(ctx, case)
    out: dict[str, Any] = {"refused": [], "norms": [], "ref_norms": []}
    for step in range(4):
        for micro in range(accumulation):
            b = vec_batch(ctx.rank, step, micro, 0)
            engine.backward(vec_loss(model, b, step))
            ref.micro_step([b], step, micro)
        for habit in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05),
                      lambda: torch.nn.utils.clip_grad_norm_(engine.parameters(), 0.05),
                      lambda: torch.nn.utils.clip_grad_norm_(engine.optimizer.param_groups[0]["params"], 0.05),
                      lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 0.01),
                      lambda: [p.grad.norm() for p in model.parameters()]):
            try:
                habit()
                out["refused"].append(None)
            except ValueWithheld as exc:
                out["refused"].append(str(exc))
        steps_before = [float(st["step"]) for st in engine.optimizer.state.values()]
        try:  # the DDP habit of stepping the optimizer: refused before it changes anything
            engine.optimizer.step()
            out["direct_step"] = None
        except RuntimeError as exc:
            out["direct_step"] = str(exc)
        out["steps_kept"] = steps_before == [float(st["step"]) for st in engine.optimizer.state.values()]
        out["norms"].append(float(engine.clip_grad_norm_(0.05)))
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.05)))
        ref.opt.step()
        ref.opt.zero_grad()
        assert engine.step()
        out["grads_after_step"] = [p.grad for p in model.parameters()]
    out["params"], out["ref_params"] = engine.full_state_dict(), ref.params()
    return out


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_by_hand_refuses_and_engine_clip_is_ddps(pools: PoolSet, accumulation: int) -> None:
    for r in pools.run(2, _clip_worker, accumulation):
        assert all(msg is not None and "engine.clip_grad_norm_" in msg for msg in r["refused"]), r["refused"]
        assert r["grads_after_step"] == [None] * len(r["grads_after_step"])  # the stand-ins leave with the window
        assert r["direct_step"] is not None and "Call engine.step() instead" in r["direct_step"] and r["steps_kept"]
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=1e-5, atol=1e-7)
        assert min(r["ref_norms"]) > 0.05  # every step clipped
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6)


# -- zero_grad inside a window, no_sync --------------------------------------------------------------
def _zero_grad_worker(ctx: WorkerContext, clear: str) -> dict[str, Any]:
    case = Case("mlp", {**SHARDED, "gradient_accumulation_steps": 2}, accumulation=2)
    engine, ref, model = build_pair(ctx, case)
    for step in range(3):
        for micro in range(2):
            b = vec_batch(ctx.rank, step, micro, 0)
            engine.backward(vec_loss(model, b, step))
            engine.step()
            (engine if clear == "engine" else engine.optimizer).zero_grad()  # after every step() call
            ref.micro_step([b], step, micro)
        ref.step()
    try:
        engine.no_sync()
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return {"params": engine.full_state_dict(), "ref": ref.params(), "no_sync": refused}


@pytest.mark.parametrize("clear", ["engine", "optimizer"])
def test_zero_grad_after_every_step_call_keeps_the_window(pools: PoolSet, clear: str) -> None:
    for r in pools.run(2, _zero_grad_worker, clear):
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6)
        assert r["no_sync"] is not None and "gradient_accumulation_steps" in r["no_sync"]


def _zero_grad_at_boundary_worker(ctx: WorkerContext) -> dict[str, Any]:
    """zero_grad after the window's last backward discards it: the step that follows changes nothing."""
    case = Case("mlp", SHARDED)
    engine, _, model = build_pair(ctx, case)
    before = engine.full_state_dict()
    engine.backward(vec_loss(model, vec_batch(ctx.rank, 0, 0, 0), 0))
    engine.zero_grad()
    grads = [p.grad for p in model.parameters()]
    engine.step()
    return {"changed": any(not torch.equal(v, before[k]) for k, v in engine.full_state_dict().items()),
            "grads": grads}


def test_zero_grad_at_the_boundary_discards(pools: PoolSet) -> None:
    for r in pools.run(2, _zero_grad_at_boundary_worker):
        assert not r["changed"] and r["grads"] == [None] * len(r["grads"])


def _clear(model: torch.nn.Module, optimizer: torch.optim.Optimizer, which: str) -> None:
    if which == "model":
        model.zero_grad()  # set_to_none=True
    elif which == "optimizer":  # the engine's: built on the master shards
        optimizer.zero_grad()
    else:  # one layer's, by hand
        for p in model.layers[0].parameters():  # type: ignore[index, union-attr]
            p.grad = None


def _discard_worker(ctx: WorkerContext, which: str, micro_to_clear: int, hsdp: bool, save_to: str) -> dict[str, Any]:
    """Gradients set to None before step() (a bad batch dropped) are gone, as under DDP,
    and from a checkpoint saved then; cleared after a step() call they stay (the loop above)."""
    from tests.checkpoint_at import save_at
    from z3kit_recipes.zero3.weights.commit import CHECKPOINT_KIND, read_manifest

    config = {**SHARDED, "gradient_accumulation_steps": 2, **({"mics_shard_size": 2} if hsdp else {})}
    case = Case("mlp", config, accumulation=2)
    engine, ref, model = build_pair(ctx, case)
    saved: list[str] = []
    for step in range(3):
        for micro in range(2):
            b = vec_batch(ctx.rank, step, micro, 0)
            engine.backward(vec_loss(model, b, step))
            ref.micro_step([b], step, micro)
            if micro == micro_to_clear and step != 1:
                _clear(model, engine.optimizer, which)
                _clear(ref.model, ref.opt, which)
                if step == 0 and micro == 0:
                    save_at(engine, save_to)
                    saved = read_manifest(Path(save_to), CHECKPOINT_KIND)["open_window"]
            engine.step()
        ref.step()
    return {"params": engine.full_state_dict(), "ref": ref.params(), "saved": saved}


@pytest.mark.parametrize("world,which,micro_to_clear,hsdp", [
    (2, "model", 0, False), (2, "layer", 0, False), (2, "optimizer", 0, False),
    (2, "model", 1, False), (2, "layer", 1, False), (2, "optimizer", 1, False),
    (1, "layer", 0, False), (4, "layer", 0, True),
])
def test_gradients_set_to_none_before_step_are_discarded_as_under_ddp(
    pools: PoolSet, world: int, which: str, micro_to_clear: int, hsdp: bool, tmp_path: Path
) -> None:
    for r in pools.run(world, _discard_worker, which, micro_to_clear, hsdp, str(tmp_path / "ckpt")):
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=1e-6)
        if micro_to_clear == 0:  # the checkpoint's open window holds what was kept, and only that
            kept = [n for n in r["ref"] if which == "layer" and not n.startswith("layers.0.")]
            assert sorted(r["saved"]) == sorted(kept), r["saved"]


def _discard_on_one_rank_worker(ctx: WorkerContext) -> str | None:
    from z3kit_recipes.zero3 import RanksDisagree

    case = Case("mlp", {**SHARDED, "gradient_accumulation_steps": 2}, accumulation=2)
    engine, _, model = build_pair(ctx, case)
    try:
        for micro in range(2):
            engine.backward(vec_loss(model, vec_batch(ctx.rank, 0, micro, 0), 0))
            if micro == 0 and ctx.rank == 0:
                model.zero_grad()
            engine.step()
    except RanksDisagree as exc:
        return str(exc)
    return None


def test_gradients_set_to_none_on_one_rank_only_is_named_on_every_rank(pools: PoolSet) -> None:
    for message in pools.run(2, _discard_on_one_rank_worker):
        assert message is not None and "zero_grad" in message and "rank 0: gradients set to None" in message, message


# -- the model's own state_dict and load_state_dict --------------------------------------------------
def _state_dict_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit.withheld import ValueWithheld

    engine, ref, model = build_pair(ctx, Case("mlp", SHARDED))
    _train_both(ctx, engine, ref, model, "mlp", range(2))
    out: dict[str, Any] = {"model": model.state_dict(), "module": engine.module.state_dict(), "ref": ref.params()}
    # a load through the model: another model's values go into the shards
    torch.manual_seed(77)
    other = WORKLOADS["mlp"].build().state_dict()
    result = model.load_state_dict(other)
    out["load_result"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["after_load"], out["other"] = engine.full_state_dict(), other
    # refused loads change nothing, on every rank
    wrong = dict(other)
    wrong["layers.0.weight"] = torch.zeros(3, 3)
    mine = {k: v + ctx.rank for k, v in other.items()}  # rank 1 loads other values than rank 0
    for name, bad in (("shape", wrong), ("ranks", mine)):
        try:
            model.load_state_dict(bad)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    out["after_refused"] = engine.full_state_dict()
    # the twin trains on from the loaded values
    ref.model.load_state_dict(other)
    _train_both(ctx, engine, ref, model, "mlp", range(5, 6))
    out["trained"], out["ref_trained"] = engine.full_state_dict(), ref.params()
    try:
        torch.save(engine.module.state_dict(keep_vars=False), "/dev/null")
        out["saved"] = True
    except ValueWithheld:
        out["saved"] = False
    return out


def test_model_state_dict_and_load_state_dict(pools: PoolSet) -> None:
    for r in pools.run(2, _state_dict_worker):
        for which in ("model", "module"):
            assert set(r[which]) == set(r["ref"])
            for name, want in r["ref"].items():
                torch.testing.assert_close(r[which][name], want, rtol=1e-5, atol=1e-6)
        assert r["load_result"] == ([], [])
        for name, want in r["other"].items():
            torch.testing.assert_close(r["after_load"][name], want)
            torch.testing.assert_close(r["after_refused"][name], want)
        assert "shape (3, 3) in the state dict" in r["shape"]
        assert "rank(s) [1]" in r["ranks"]
        for name, want in r["ref_trained"].items():
            torch.testing.assert_close(r["trained"][name], want, rtol=1e-5, atol=1e-6)
        assert r["saved"]


def _frozen_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit.withheld import ValueWithheld

    engine, ref, model = build_pair(ctx, Case("frozen", SHARDED))
    sd = model.state_dict()
    frozen = [n for n, p in ref.model.named_parameters() if not p.requires_grad]
    refusals = []
    for name in frozen:
        for read in (lambda: sd[name].sum(), lambda: torch.save(sd[name], "/dev/null"), lambda: sd[name].shape):
            try:
                read()
                refusals.append(None)
            except ValueWithheld as exc:
                refusals.append(str(exc))
    trainable = {n: sd[n] for n, p in ref.model.named_parameters() if p.requires_grad}
    return {"refusals": refusals, "frozen": frozen, "trainable": trainable, "ref": ref.params()}


def test_frozen_parameters_are_withheld_not_empty(pools: PoolSet) -> None:
    for r in pools.run(2, _frozen_worker):
        assert r["frozen"] and r["trainable"]
        assert all(m is not None and "engine.full_state_dict()" in m for m in r["refusals"]), r["refusals"]
        for name, got in r["trainable"].items():
            torch.testing.assert_close(got, r["ref"][name])


# -- a rank that calls a collective alone -----------------------------------------------------------
def _alone_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit_recipes.zero3 import RanksDisagree

    group = fresh_group(ctx)
    engine, _, model = build_pair(ctx, Case("mlp", {**SHARDED, "collective_timeout_s": 60}), process_group=group)
    started = time.monotonic()
    try:
        if ctx.rank == 0:
            model.state_dict()
        else:
            engine.backward(vec_loss(model, vec_batch(ctx.rank, 0, 0, 0), 0))
        error = None
    except RanksDisagree as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


def test_state_dict_on_one_rank_alone_is_refused_on_every_rank(pools: PoolSet) -> None:
    for r in pools.run(2, _alone_worker):
        assert r["error"] is not None and "state_dict()" in r["error"], r
        assert r["seconds"] < 10


# -- Hugging Face and PEFT saves through the model ---------------------------------------------------
def _hf_save_worker(ctx: WorkerContext, path: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    engine, ref, model = build_pair(ctx, Case("hf_gpt2", SHARDED))
    _train_both(ctx, engine, ref, model, "hf_gpt2", range(2))
    model.save_pretrained(path, is_main_process=ctx.rank == 0)
    torch.distributed.barrier(ctx.group)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    return {"loaded": _params(loaded), "ref": ref.params()}


def test_hf_save_pretrained_on_the_model(pools: PoolSet, tmp_path: Any) -> None:
    r = pools.run(2, _hf_save_worker, str(tmp_path / "gpt2"))[0]
    assert set(r["loaded"]) == set(r["ref"])
    for name, want in r["ref"].items():
        torch.testing.assert_close(r["loaded"][name], want, rtol=1e-5, atol=1e-6)


def _peft_worker(ctx: WorkerContext, path: str) -> dict[str, Any]:
    from peft import LoraConfig, PeftModel, get_peft_model

    from tests.zero3_models import hf_llama
    from z3kit_recipes import zero3

    torch.manual_seed(3)
    base = hf_llama()
    pristine = copy.deepcopy(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    twin = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(twin, process_group=ctx.group)
    opt = torch.optim.Adam([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), zero3.Zero3Config(**SHARDED), ctx.group)
    for step in range(3):
        b = hf_batch(ctx.rank, step, 0, 0)
        engine.backward(hf_loss(model, b, step))
        engine.step()
        hf_loss(ddp, b, step).backward()
        opt.step()
        opt.zero_grad()
    from z3kit.collectives import CollectiveKind

    sent_before = engine.log.bytes[CollectiveKind.ALL_GATHER]
    model.save_pretrained(path, is_main_process=ctx.rank == 0)
    sent = engine.log.bytes[CollectiveKind.ALL_GATHER] - sent_before
    torch.distributed.barrier(ctx.group)
    reloaded = PeftModel.from_pretrained(pristine, path)
    adapter = {n: p for n, p in _params(reloaded).items() if "lora_" in n}
    want = {n: p for n, p in _params(twin).items() if "lora_" in n}
    sizes = {n: p.numel() * p.element_size() for n, p in twin.named_parameters()}
    return {"adapter": adapter, "want": want, "sent": sent,
            "adapter_bytes": sum(b for n, b in sizes.items() if "lora_" in n), "all_bytes": sum(sizes.values())}


def test_peft_adapter_saves_and_reloads(pools: PoolSet, tmp_path: Any) -> None:
    pytest.importorskip("peft")
    r = pools.run(2, _peft_worker, str(tmp_path / "adapter"))[0]
    assert r["adapter"] and set(r["adapter"]) == set(r["want"])
    # only the adapter was gathered (each rank sends its half of it, padding aside), not the frozen base
    assert 0 < r["sent"] <= r["adapter_bytes"] < r["all_bytes"] / 10
    for name, want in r["want"].items():
        torch.testing.assert_close(r["adapter"][name], want, rtol=1e-5, atol=1e-6)


def _gathered_alone_worker(ctx: WorkerContext, path: str) -> dict[str, Any]:
    """DeepSpeed's habit: gather everything, then rank 0 alone reads the model's state_dict."""
    engine, ref, model = build_pair(ctx, Case("mlp", SHARDED))
    _train_both(ctx, engine, ref, model, "mlp", range(1))
    with engine.gathered_parameters():
        if ctx.rank == 0:
            torch.save(model.state_dict(), path)
    torch.distributed.barrier(ctx.group)
    return {"saved": torch.load(path), "ref": ref.params()}


def test_state_dict_inside_gathered_parameters_on_one_rank(pools: PoolSet, tmp_path: Any) -> None:
    for r in pools.run(2, _gathered_alone_worker, str(tmp_path / "sd.pt")):
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["saved"][name], want, rtol=1e-5, atol=1e-6)


def _alone_in_barrier_worker(ctx: WorkerContext) -> dict[str, Any]:
    """Rank 0 saves alone while rank 1 waits in the user's own barrier: rank 0 warns early, then raises."""
    import warnings

    from z3kit_recipes.zero3 import RankFailed
    from z3kit_recipes.zero3.ranks import rank_watch

    user_group = fresh_group(ctx)
    engine, _, model = build_pair(ctx, Case("mlp", {**SHARDED, "collective_timeout_s": 4}),
                                  process_group=fresh_group(ctx))
    patience, rank_watch.PATIENCE_S = rank_watch.PATIENCE_S, 1.0
    out: dict[str, Any] = {"error": None, "warned": []}
    try:
        if ctx.rank == 0:
            started = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    model.state_dict()
                except RankFailed as exc:
                    out["error"] = str(exc)
            out["seconds"] = time.monotonic() - started
            out["warned"] = [str(w.message) for w in caught if "has waited" in str(w.message)]
        torch.distributed.barrier(user_group)  # the user's own barrier: rank 0 reaches it after its error
    finally:
        rank_watch.PATIENCE_S = patience
    return out


def test_state_dict_on_rank_0_while_the_others_wait_in_a_barrier(pools: PoolSet) -> None:
    r = pools.run(2, _alone_in_barrier_worker)[0]
    assert len(r["warned"]) == 1 and "rank(s) [1] have not done the same" in r["warned"][0], r["warned"]
    assert r["error"] is not None and "state_dict()" in r["error"] and 4 <= r["seconds"] < 12, r
