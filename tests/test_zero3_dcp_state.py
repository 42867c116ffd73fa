"""FSDP2 scripts' checkpoints through DCP's own calls (``zero3.weights.dcp_state``).

The script is FSDP2's: ``get_state_dict`` then ``dcp.save``; to resume, a new
process group and a new engine, ``get_state_dict``, ``dcp.load`` and
``set_state_dict``. Saved at 2 ranks, resumed at 2 and then at 3, it matches
an uninterrupted run (losses and final weights; the Adam state bit for bit).
Separate fp32 masters (bf16), a tied head and frozen blocks resume exactly. A
``set_state_dict`` with a missing or misnamed entry is refused on every rank,
with nothing applied; the calls that cannot work name what to use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.test_zero3_checkpoint import full_optimizer_state

GLOBAL_BATCH = 6  # splits evenly at 2 and at 3 ranks: the same global step at either


def _engine(group: Any, seed: int) -> Any:
    from z3kit_recipes import zero3
    from z3kit_recipes.models import TinyMLP

    torch.manual_seed(seed)
    return zero3.initialize(TinyMLP(depth=3, width=8),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9)),
                            zero3.Zero3Config(param_persistence_threshold=0), group)


def _train(engine: Any, group: Any, steps: range) -> list[float]:
    """Optimizer steps on global batches of ``GLOBAL_BATCH`` rows, each rank its share; the global losses."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    share = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 8, generator=gen)
        rows = slice(rank * share, (rank + 1) * share)
        loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    return losses


def _save(engine: Any, group: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = engine.dcp_view()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)


def _resume(engine: Any, group: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = engine.dcp_view()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def run_phase(ctx: WorkerContext, root: str, phase: str) -> dict[str, Any]:
    group = fresh_group(ctx)  # every phase on a process group of its own, as a new job's
    out: dict[str, Any] = {}
    if phase == "straight":
        engine = _engine(group, seed=0)
        out["losses"] = _train(engine, group, range(9))
    elif phase == "first":
        engine = _engine(group, seed=0)
        out["losses"] = _train(engine, group, range(3))
        _save(engine, group, f"{root}/step3")
    else:
        engine = _engine(group, seed=7)  # other initial values: everything must come from the checkpoint
        before = engine.optimizer.param_groups[0]["lr"]
        engine.optimizer.param_groups[0]["lr"] = 0.5  # a hyperparameter the checkpoint must put back
        _resume(engine, group, f"{root}/step{3 if phase == 'second' else 6}")
        out["lr_back"] = engine.optimizer.param_groups[0]["lr"] == before
        out["resumed_optim"] = full_optimizer_state(engine)
        first = 3 if phase == "second" else 6
        out["losses"] = _train(engine, group, range(first, first + 3))
        if phase == "second":
            _save(engine, group, f"{root}/step6")
    if phase == "second":  # what the third phase must resume: the optimizer state as saved
        out["saved_optim"] = full_optimizer_state(engine)
    out["weights"] = engine.full_state_dict()
    out["optim"] = full_optimizer_state(engine)
    return out


def test_an_fsdp2_dcp_script_resumes_at_2_then_3_ranks_as_if_uninterrupted(pools: PoolSet, tmp_path: Path) -> None:
    root = str(tmp_path)
    straight = pools.run(2, run_phase, root, "straight")[0]
    first = pools.run(2, run_phase, root, "first")[0]
    second = pools.run(2, run_phase, root, "second")[0]
    third = pools.run(3, run_phase, root, "third")
    assert second["lr_back"] and third[0]["lr_back"]
    # at the same world size nothing differs: bit for bit
    assert first["losses"] + second["losses"] == straight["losses"][:6]
    # the Adam state resumes exactly, across the change of world size too
    saved = second["saved_optim"]
    for r in third:
        assert r["resumed_optim"].keys() == saved.keys() and len(saved) == 18  # 6 parameters: exp_avg, exp_avg_sq, step
        assert all(torch.equal(r["resumed_optim"][k], saved[k]) for k in saved), "Adam state resumed exactly"
    # at 3 ranks the reductions add in another order: fp32 rounding only
    torch.testing.assert_close(third[0]["losses"], straight["losses"][6:], rtol=1e-5, atol=1e-7)
    for name, value in straight["weights"].items():
        torch.testing.assert_close(third[0]["weights"][name], value, rtol=1e-5, atol=1e-6)


# -- refusals ---------------------------------------------------------------------------------------
def run_refusals(ctx: WorkerContext, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    group = fresh_group(ctx)
    engine = _engine(group, seed=0)
    _train(engine, group, range(2))
    _save(engine, group, root)
    saved = engine.full_state_dict()
    _train(engine, group, range(2, 3))  # the engine moves on from what was saved
    engine.optimizer.param_groups[0]["lr"] = 0.5  # and its lr differs from the saved 1e-2
    weights, optim = engine.full_state_dict(), full_optimizer_state(engine)
    # the state dicts to load come from another engine that read the checkpoint, so that
    # they share no memory with this one (dcp.load writes in place into what they view)
    other = _engine(group, seed=7)
    other_model, other_optimizer = other.dcp_view()
    model_sd, optim_sd = get_state_dict(other_model, other_optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root, process_group=group)
    model, optimizer = engine.dcp_view()
    cases = {
        "missing": lambda s: s["model"].pop("blocks.1.linear.weight"),
        "misnamed": lambda s: s["model"].__setitem__("blocks.9.linear.bias", s["model"].pop("blocks.2.linear.bias")),
        "wrong_shape": lambda s: s["model"].__setitem__("blocks.0.linear.bias", torch.zeros(3)),
        "optim_missing": lambda s: s["optim"]["state"].pop("blocks.0.linear.weight"),
        "optim_wrong_shape": lambda s: s["optim"]["state"]["blocks.0.linear.bias"].__setitem__("exp_avg", torch.ones(5)),
        "sound": lambda s: None,  # the control: the same call with nothing spoiled loads
    }
    out: dict[str, Any] = {}
    for name, spoil in cases.items():
        model_sd, optim_sd = get_state_dict(other_model, other_optimizer)  # the checkpoint's values
        state = {"model": model_sd, "optim": optim_sd}
        spoil(state)
        try:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            out[name] = None
        except (ValueError, RuntimeError) as exc:
            out[name] = str(exc)
        now, now_optim = engine.full_state_dict(), full_optimizer_state(engine)
        out[f"{name}_untouched"] = (all(torch.equal(now[n], v) for n, v in weights.items())
                                    and all(torch.equal(now_optim[k], v) for k, v in optim.items())
                                    and engine.optimizer.param_groups[0]["lr"] == 0.5)
    out["sound_loaded"] = (all(torch.equal(engine.full_state_dict()[n], v) for n, v in saved.items())
                           and engine.optimizer.param_groups[0]["lr"] == 1e-2)
    # the calls that cannot work name what to use, and change nothing
    try:
        get_state_dict(engine, engine.optimizer)
    except RuntimeError as exc:
        out["engine_itself"] = str(exc)
    optim = full_optimizer_state(engine)
    try:
        get_state_dict(engine.module, engine.optimizer)
    except RuntimeError as exc:
        out["engine_optimizer"] = str(exc)
    out["engine_optimizer_untouched"] = all(torch.equal(full_optimizer_state(engine)[k], v) for k, v in optim.items())
    fresh, twin = _engine(group, seed=3), _engine(group, seed=3)  # not stepped yet: DCP would make their state
    try:
        get_state_dict(fresh.module, fresh.optimizer)
    except RuntimeError as exc:
        out["fresh_refused"] = "engine.dcp_view()" in str(exc) and not fresh.optimizer.state
    try:  # torch fails before any call of the optimizer's that could refuse: its zero step is undone at the next step
        set_state_dict(fresh.module, fresh.optimizer, model_state_dict={}, optim_state_dict=optim_sd)
    except KeyError:
        out["fresh_set_keyerror"] = True
    _train(fresh, group, range(1))
    _train(twin, group, range(1))
    a, b = full_optimizer_state(fresh), full_optimizer_state(twin)
    out["fresh_as_twin"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and all(
        torch.equal(x, y) for x, y in zip(fresh.masters, twin.masters))
    engine.backward(torch.nn.functional.mse_loss(engine(torch.ones(2, 8)), torch.zeros(2, 8)))
    try:
        get_state_dict(model, optimizer)
    except RuntimeError as exc:
        out["open_window"] = str(exc)
    engine.step()
    return out


def test_set_state_dict_with_a_wrong_entry_is_refused_everywhere_with_nothing_applied(
        pools: PoolSet, tmp_path: Path) -> None:
    for r in pools.run(2, run_refusals, str(tmp_path / "ckpt")):
        assert "missing: 'blocks.1.linear.weight'" in r["missing"] and "nothing was loaded" in r["missing"]
        assert "unexpected: 'blocks.9.linear.bias'" in r["misnamed"]
        assert "blocks.0.linear.bias: shape (3,)" in r["wrong_shape"]
        assert "blocks.0.linear.weight" in r["optim_missing"]  # torch's own check, before the optimizer is touched
        assert "blocks.0.linear.bias.exp_avg: shape (5,)" in r["optim_wrong_shape"]
        for case in ("missing", "misnamed", "wrong_shape", "optim_missing", "optim_wrong_shape"):
            assert r[f"{case}_untouched"], case
        assert r["sound"] is None and not r["sound_untouched"] and r["sound_loaded"]
        assert "engine.dcp_view()" in r["engine_itself"]
        assert "given engine.optimizer" in r["engine_optimizer"] and "engine.dcp_view()" in r["engine_optimizer"]
        assert r["engine_optimizer_untouched"] and r["fresh_refused"] and r["fresh_set_keyerror"] and r["fresh_as_twin"]
        assert "accumulation window is open" in r["open_window"] and "engine.save_checkpoint" in r["open_window"]


# -- separate fp32 masters, a tied head, frozen parameters ----------------------------------------
def run_bf16_tied_frozen(ctx: WorkerContext, root: str) -> dict[str, Any]:
    from z3kit_recipes import zero3
    from z3kit_recipes.models import GPT, GPTConfig

    group = fresh_group(ctx)

    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=32, width=16, n_layer=2, n_head=2, seq_len=8))  # lm head tied to tok_emb
        for name, p in model.named_parameters():
            p.requires_grad_("blocks.0." not in name)
        return zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                zero3.Zero3Config(compute_dtype="bf16", param_persistence_threshold=0), group)

    def train(engine: Any, steps: range) -> None:
        for step in steps:
            ids = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(10 * step + ctx.rank))
            logits = engine(ids[:, :-1]).float()
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
            engine.step()

    saved = build(0)
    train(saved, range(3))
    _save(saved, group, root)
    resumed = build(5)
    _resume(resumed, group, root)
    a, b = full_optimizer_state(saved), full_optimizer_state(resumed)
    out = {"masters": all(torch.equal(x, y) for x, y in zip(saved.masters, resumed.masters)),
           "shards": all(torch.equal(x.shard, y.shard) for x, y in zip(saved.shards, resumed.shards)),
           "optim": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "trainable": len(saved.masters)}
    train(saved, range(3, 5))
    train(resumed, range(3, 5))
    x, y = saved.full_state_dict(), resumed.full_state_dict()
    out["continued"] = all(torch.equal(x[n], y[n]) for n in x)
    return out


def test_bf16_masters_a_tied_head_and_frozen_blocks_resume_exactly(pools: PoolSet, tmp_path: Path) -> None:
    for r in pools.run(2, run_bf16_tied_frozen, str(tmp_path / "ckpt")):
        assert r["trainable"] > 0 and r["masters"] and r["shards"] and r["optim"] and r["continued"], r
