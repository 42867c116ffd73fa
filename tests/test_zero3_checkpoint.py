"""Sharded checkpoints (gloo): exact resume, resharding N -> M, safe commit,
corruption and model-mismatch errors. Every save and load is collective on
a real process group; checkpoints go to a directory every rank sees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.zero3_models import WORKLOADS, Case, engine_micro_step

CASE = Case("gpt_functional", {"param_persistence_threshold": 0, "gradient_accumulation_steps": 2},
            optimizer="adamw", accumulation=2)


def new_engine(ctx: Any, seed: int = 0, config: dict[str, Any] | None = None) -> Any:
    from z3kit_recipes import zero3
    from tests.zero3_models import make_optimizer

    torch.manual_seed(1000 + seed)
    model = WORKLOADS[CASE.workload].build()
    return zero3.initialize(model, lambda p: make_optimizer(CASE.optimizer, p, CASE.lr),
                            zero3.Zero3Config(**(config or CASE.config)), ctx.group)


def micro_steps(ctx: Any, engine: Any, first: int, count: int) -> list[float]:
    wl = WORKLOADS[CASE.workload]
    losses = []
    for i in range(first, first + count):
        loss, _ = engine_micro_step(engine, CASE, [wl.batch(ctx.rank, i // 2, i % 2, 0)], i // 2)
        losses.append(loss)
    return losses


def full_optimizer_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every sharded optimizer-state tensor, whole (gathered over the shard group:
    every rank's under flat ZeRO-3), checking that this rank's padding past the
    parameter's end is zero."""
    from z3kit.collectives import all_gather

    out: dict[str, torch.Tensor] = {}
    for pid, master in zip(engine.trainable, engine.masters):
        shard = engine.shards[pid]
        for key, value in sorted(engine.optimizer.state[master].items()):
            if value.dim() == 1:
                whole = value.new_empty(value.numel() * shard.world)
                all_gather(whole, value.detach().contiguous(), engine.topology.shard_group)
                out[f"{engine.param_names[pid]}.{key}"] = whole[: shard.numel].clone()
                start, stop = engine.layout.local_range(pid)
                assert bool((value[stop - start :] == 0).all()), "padding past the end is zero"
            else:
                out[f"{engine.param_names[pid]}.{key}"] = value.detach().clone()
    return out


# --------------------------------------------------------------------------- #
# Exact resume
# --------------------------------------------------------------------------- #


def run_resume(ctx: Any, root: str, cut: int) -> dict[str, Any]:
    straight = new_engine(ctx)
    want = micro_steps(ctx, straight, 0, 10)
    first = new_engine(ctx)
    got = micro_steps(ctx, first, 0, cut)
    first.save_checkpoint(root, client_state={"next_micro_step": cut})
    del first
    second = new_engine(ctx, seed=5)  # other initial values: everything must come from the checkpoint
    path, client = second.load_checkpoint(root)  # DeepSpeed's (path, client_state), from root/latest
    assert path == str(Path(root) / f"global_step{cut // 2}")
    got += micro_steps(ctx, second, client["next_micro_step"], 10 - cut)
    a, b = straight.full_state_dict(), second.full_state_dict()
    return {"want": want, "got": got, "params_equal": all(torch.equal(a[n], b[n]) for n in a),
            "progress": (second.progress(), straight.progress()),
            "optim_equal": all(torch.equal(x, y) for x, y in
                               zip(full_optimizer_state(straight).values(), full_optimizer_state(second).values()))}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("cut", [4, 5])  # at a step boundary, and inside an accumulation window
def test_resume_is_bitwise_exact(pools: Any, world: int, cut: int, tmp_path: Path) -> None:
    for r in pools.run(world, run_resume, str(tmp_path / "ckpt"), cut):
        assert r["got"] == r["want"]  # every loss, bit for bit
        assert r["params_equal"] and r["optim_equal"]
        assert r["progress"][0] == r["progress"][1]


# --------------------------------------------------------------------------- #
# Resharding
# --------------------------------------------------------------------------- #


def run_train_and_save(ctx: Any, root: str) -> dict[str, Any]:
    engine = new_engine(ctx)
    micro_steps(ctx, engine, 0, 6)
    engine.save_checkpoint(root)
    return {"params": engine.full_state_dict(), "optim": full_optimizer_state(engine)}


def run_load_and_continue(ctx: Any, root: str) -> dict[str, Any]:
    engine = new_engine(ctx, seed=9)
    engine.load_checkpoint(root)
    out = {"params": engine.full_state_dict(), "optim": full_optimizer_state(engine), "progress": engine.progress()}
    out["losses"] = micro_steps(ctx, engine, 6, 4)
    out["moved"] = any(not torch.equal(out["params"][n], p) for n, p in engine.full_state_dict().items())
    return out


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 4), (4, 2), (2, 3), (4, 1)])
def test_checkpoint_reshards(pools: Any, saved_at: int, loaded_at: int, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = pools.run(saved_at, run_train_and_save, root)[0]
    for r in pools.run(loaded_at, run_load_and_continue, root):
        assert r["params"].keys() == saved["params"].keys()
        assert all(torch.equal(r["params"][n], saved["params"][n]) for n in saved["params"])
        assert r["optim"].keys() == saved["optim"].keys()
        assert all(torch.equal(r["optim"][k], saved["optim"][k]) for k in saved["optim"])
        assert r["progress"] == (3, 6)
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["moved"]


# --------------------------------------------------------------------------- #
# Safe commit, corruption, mismatch
# --------------------------------------------------------------------------- #


def run_interrupted_save(ctx: Any, root: str) -> dict[str, Any]:
    from z3kit_recipes.zero3.weights import checkpoint

    engine = new_engine(ctx)
    micro_steps(ctx, engine, 0, 2)
    engine.save_checkpoint(root, client_state={"which": "first"})
    micro_steps(ctx, engine, 2, 2)
    real_commit = checkpoint.commit

    def dies_before_commit(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("killed while saving")

    checkpoint.commit = dies_before_commit  # the files are written; the manifest and rename never happen
    try:
        engine.save_checkpoint(root, client_state={"which": "second"})
    except KeyboardInterrupt:
        pass
    finally:
        checkpoint.commit = real_commit
    return {"client": new_engine(ctx).load_checkpoint(root)[1]}


def test_interrupted_save_leaves_the_previous_checkpoint(pools: Any, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "ckpt"
    for r in pools.run(2, run_interrupted_save, str(root)):
        assert r["client"] == {"which": "first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the interrupted save's staging folder removed
    # what a killed save leaves (no manifest) is recognizably incomplete
    partial = tmp_path / ".ckpt.partial-killed"
    shutil.copytree(root / (root / "latest").read_text().strip(), partial)
    (partial / "z3kit_manifest.json").unlink()
    err = pools.run(2, run_load_error, str(partial))[0]
    assert "no z3kit_manifest.json" in err and "did not finish" in err


def run_load_error(ctx: Any, root: str, config: dict[str, Any] | None = None) -> str:
    engine = new_engine(ctx, config=config)
    try:
        engine.load_checkpoint(root)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return "no error"


def test_corrupt_file_is_named(pools: Any, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    pools.run(2, run_train_and_save, str(root))
    victim = sorted(root.rglob("*.distcp"))[-1]  # root/global_step3/
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    for err in pools.run(2, run_load_error, str(root)):
        assert f"is corrupt: {victim.name}" in err


def run_other_model(ctx: Any, root: str) -> str:
    from z3kit_recipes import zero3

    model = WORKLOADS["mlp"].build()
    engine = zero3.initialize(model, torch.optim.Adam, None, ctx.group)
    try:
        engine.load_checkpoint(root)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_model_names_the_first_parameter(pools: Any, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    pools.run(2, run_train_and_save, str(root))
    for err in pools.run(2, run_other_model, str(root)):
        assert "layers.0.weight" in err and "not in checkpoint" in err
    err = pools.run(2, run_load_error, str(root), {"param_persistence_threshold": 0, "gradient_accumulation_steps": 2})[0]
    assert err == "no error"  # the same model loads
