"""HSDP (DeepSpeed's MiCS): shards within a shard group, replicas across groups.

At world 4 as 2 x 2 (two replicas of a two-rank shard group), on gloo: the
engine trains like torch DDP on the same data (fp32 to rounding, with
clipping and accumulation; bf16 within bf16 tolerance; an unmodified
Hugging Face model from a DeepSpeed JSON's ``mics_shard_size``); each rank
holds half of the model, not a quarter; gathers and reduce-scatters use the
shard group, the gradient all-reduce the replicate group; checkpoints saved
flat load as HSDP and back, exactly. Configuration errors are named. Each
distributed case is one pool call, several checks at once (world-4 runs are
the expensive part).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_zero3_checkpoint import full_optimizer_state
from tests.zero3_models import (
    MLP,
    WORKLOADS,
    Case,
    DDPReference,
    PairResult,
    assert_pair,
    assert_params_match,
    engine_micro_step,
    finish,
    make_optimizer,
    new_result,
    rel_norm_error,
    train_steps,
    vec_batch,
)

SHARDED = {"param_persistence_threshold": 0}
MESH_NAMES = ("replicate", "shard")


def _mesh(shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = MESH_NAMES) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def run_pair(ctx: Any, case: Case, how: str, ds_json: dict[str, Any] | None = None) -> PairResult:
    """``case`` under zero3 (HSDP through ``how``: "config", "mesh" or "json")
    and under DDP over all four ranks, side by side."""
    from z3kit_recipes import zero3

    torch.manual_seed(1000 + case.seed)
    model = WORKLOADS[case.workload].build()
    ref = DDPReference(ctx, copy.deepcopy(model), case)
    config: Any = ds_json if how == "json" else zero3.Zero3Config(**case.config)
    kwargs = {"device_mesh": _mesh()} if how == "mesh" else {}
    engine = zero3.initialize(model, lambda p: make_optimizer(case.optimizer, p, case.lr), config, **kwargs)
    res = finish(engine, ref, train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref)))
    t = engine.topology
    res.extra = {
        "shape": t.shape,
        "shard": _ranks(t.shard_group),
        "replicate": _ranks(t.replicate_group),
        "gathers": _ranks(engine.parts.coordinator.gatherer.group),
        "reductions": _ranks(engine.reducer.group),
        "across_replicas": _ranks(None if engine.reducer.replicas is None else engine.reducer.replicas.group),
        "collectives": engine.log.snapshot(),
        "reduction": (engine.reducer.mode.value, engine.reducer.bucket_capacity),
    }
    return res


def assert_hsdp_layout(results: list[PairResult]) -> None:
    """Rank r is in shard group {2(r//2), 2(r//2)+1} and replicate group {r%2, r%2+2};
    the data path uses exactly those; each rank holds about half of the model."""
    for rank, r in enumerate(results):
        shard, replicas = [2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2]
        assert r.extra["shape"] == [2, 2]
        assert r.extra["shard"] == r.extra["gathers"] == r.extra["reductions"] == shard
        assert r.extra["replicate"] == r.extra["across_replicas"] == replicas
        stats = r.stats
        # 1/2 of every parameter (padded to even sizes), not 1/4
        assert stats.model_numel / 2 <= stats.resident_param_numel <= stats.model_numel / 2 + 64
        assert r.extra["collectives"]["all_reduce"]["calls"] > 0


def test_fp32_parity_with_clipping_and_accumulation(pools: Any) -> None:
    """Mean over all four ranks' micro-batches, as DDP; the clipping norm is
    the global one (summed over one shard group, not over the replicas too)."""
    case = Case("mlp", {**SHARDED, "mics_shard_size": 2, "gradient_accumulation_steps": 2,
                        "gradient_clipping": 0.05}, accumulation=2, clip=0.05, steps=4)
    results = pools.run(4, run_pair, case, "config")
    for r in results:
        assert all(n > 0.05 for n in r.ddp_norms), "clipping must engage for this test to mean anything"
        # summed over the replicas too, the norm would be sqrt(2) times DDP's
        torch.testing.assert_close(torch.tensor(r.engine_norms, dtype=torch.float64),
                                   torch.tensor(r.ddp_norms, dtype=torch.float64), rtol=1e-5, atol=1e-7)
        assert r.stepped == [False, True] * 4
    gap = max(abs(a - b) for r in results for a, b in zip(r.engine_losses, r.ddp_losses))
    assert gap <= 1e-6, f"fp32 losses differ from DDP's by {gap:.3g}"
    assert_pair(results)
    assert_hsdp_layout(results)


def test_bf16_parity_from_a_device_mesh(pools: Any) -> None:
    """Through reduce-scatter buckets (gloo's default is all-reduce: the fp32 case takes that path)."""
    config = {**SHARDED, "compute_dtype": "bf16", "reduce_scatter": True}
    results = pools.run(4, run_pair, Case("gpt_hf", config, optimizer="adamw", steps=4), "mesh")
    for r in results:
        got = torch.tensor(r.engine_losses, dtype=torch.float64)
        want = torch.tensor(r.ddp_losses, dtype=torch.float64)
        rel = ((got - want).abs() / want.abs()).max().item()
        assert 0 < rel <= 3e-2, f"bf16 losses differ from fp32 by {rel:.3g} (relative)"
        assert rel_norm_error(r.engine_params, r.ddp_params) <= 3e-2
        assert r.extra["reduction"][0] == "reduce_scatter"
    assert_hsdp_layout(results)


def test_huggingface_model_from_a_deepspeed_json(pools: Any) -> None:
    pytest.importorskip("transformers")
    # each gradient reduced by its own collectives (contiguous_gradients off), in both stages
    ds = {"zero_optimization": {"stage": 3, "mics_shard_size": 2, "stage3_param_persistence_threshold": 0,
                                "contiguous_gradients": False}, "gradient_clipping": 0.0}
    results = pools.run(4, run_pair, Case("hf_llama", {}, lr=3e-3, steps=3), "json", ds)
    for r in results:
        gap = max(abs(a - b) for a, b in zip(r.engine_losses, r.ddp_losses))
        assert gap <= 1e-6, f"fp32 losses differ from DDP's by {gap:.3g}"
        # Adam turns rounding-level gradient differences (another order of the sum over 4 ranks)
        # into lr-sized steps on elements whose gradient is almost 0: flat ZeRO-3 at world 4
        # differs from DDP by 3.5e-6 on this model too
        assert_params_match(r.engine_params, r.ddp_params, atol=1e-5)
        assert r.extra["reduction"] == ("all_reduce", 0)  # no buckets: every gradient on its own
    assert_hsdp_layout(results)


@pytest.mark.parametrize(("layout", "dtype"), [("mics_shard_size", "bf16"), ("hpz_partition_size", "fp32"),
                                               ("hpz_partition_size", "bf16")])
def test_huggingface_llama_parity_at_2x2(pools: Any, layout: str, dtype: str) -> None:
    """An unmodified Hugging Face Llama against DDP over the 4 ranks: HSDP in bf16, hpZ
    (flat ZeRO-3 with backward gathers in node groups of 2) in fp32 and bf16."""
    pytest.importorskip("transformers")
    case = Case("hf_llama", {**SHARDED, "compute_dtype": dtype, layout: 2}, lr=3e-3, steps=3)
    for r in pools.run(4, run_pair, case, "config"):
        if dtype == "fp32":
            gap = max(abs(a - b) for a, b in zip(r.engine_losses, r.ddp_losses))
            assert gap <= 1e-6, f"fp32 losses differ from DDP's by {gap:.3g}"
            continue
        got = torch.tensor(r.engine_losses, dtype=torch.float64)
        want = torch.tensor(r.ddp_losses, dtype=torch.float64)
        assert ((got - want).abs() / want.abs()).max().item() <= 3e-2
        assert rel_norm_error(r.engine_params, r.ddp_params) <= 3e-2


def run_fp16_overflow(ctx: Any) -> dict[str, Any]:
    """fp16 with an inf in rank 3's input at step 2 only (rank 3: the second replica)."""
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig

    torch.manual_seed(0)
    config = zero3.Zero3Config(compute_dtype="fp16", loss_scaling=LossScaleConfig(initial_scale_power=8),
                               param_persistence_threshold=0, mics_shard_size=2)
    engine = zero3.initialize(MLP(), lambda p: torch.optim.AdamW(p, lr=1e-2), config)
    skipped, scales = [], []
    for step in range(4):
        b = vec_batch(ctx.rank, step, 0, 0)
        x = b["x"].half()
        if ctx.rank == 3 and step == 2:
            x[0, 0] = float("inf")
        engine.backward(((engine(x).float() - b["y"]) ** 2).mean())
        engine.step()
        skipped.append(engine.last_step_skipped)
        scales.append(engine.stats().loss_scale)
    return {"skipped": skipped, "scales": scales, "params": engine.full_state_dict()}


def test_fp16_overflow_on_one_replica_skips_everywhere(pools: Any) -> None:
    """The overflow verdict (a sum over the shard group) sees an inf of any rank:
    the replicate all-reduce carried it into every replica's partitions."""
    results = pools.run(4, run_fp16_overflow)
    for r in results:
        assert r["skipped"] == [False, False, True, False]
        assert r["scales"] == results[0]["scales"]
        # the replicas stayed equal, bit for bit
        assert _equal(r["params"], results[0]["params"])


# --------------------------------------------------------------------------- #
# Checkpoints: flat <-> HSDP
# --------------------------------------------------------------------------- #

CKPT = Case("mlp", {**SHARDED, "gradient_accumulation_steps": 2}, optimizer="adamw", accumulation=2)


def _engine(ctx: Any, seed: int, mics: int | None) -> Any:
    from z3kit_recipes import zero3

    torch.manual_seed(1000 + seed)
    return zero3.initialize(WORKLOADS[CKPT.workload].build(), lambda p: make_optimizer(CKPT.optimizer, p, CKPT.lr),
                            zero3.Zero3Config(**CKPT.config, mics_shard_size=mics))


def _micro_steps(ctx: Any, engine: Any, first: int, count: int) -> list[float]:
    wl = WORKLOADS[CKPT.workload]
    return [engine_micro_step(engine, CKPT, [wl.batch(ctx.rank, i // 2, i % 2, 0)], i // 2)[0]
            for i in range(first, first + count)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_checkpoints(ctx: Any, root: str) -> dict[str, Any]:
    from z3kit_recipes.zero3.weights.commit import CHECKPOINT_KIND, read_manifest

    flat = _engine(ctx, 0, None)
    _micro_steps(ctx, flat, 0, 3)  # inside an accumulation window: its gradient partitions are saved too
    flat.save_checkpoint(f"{root}/flat")
    saved_params, saved_optim = flat.full_state_dict(), full_optimizer_state(flat)
    want = _micro_steps(ctx, flat, 3, 5)

    hsdp = _engine(ctx, 5, 2)  # other initial values: everything must come from the checkpoint
    hsdp.load_checkpoint(f"{root}/flat")
    loaded = _equal(hsdp.full_state_dict(), saved_params) and _equal(full_optimizer_state(hsdp), saved_optim)
    got = _micro_steps(ctx, hsdp, 3, 2)
    hsdp.save_checkpoint(f"{root}/hsdp_open")  # HSDP inside a window
    got += _micro_steps(ctx, hsdp, 5, 3)
    hsdp.save_checkpoint(f"{root}/hsdp")
    hsdp_params, hsdp_optim = hsdp.full_state_dict(), full_optimizer_state(hsdp)
    hsdp.save_pretrained(f"{root}/export")  # full values gathered in each shard group, written by rank 0
    imported = _engine(ctx, 8, 2)
    imported.load_pretrained(f"{root}/export")
    exported_exact = _equal(imported.full_state_dict(), hsdp_params)

    resumed = _engine(ctx, 6, 2)
    resumed.load_checkpoint(f"{root}/hsdp_open")
    resumed_losses = _micro_steps(ctx, resumed, 5, 3)
    resumed_exact = (resumed_losses == got[2:] and _equal(resumed.full_state_dict(), hsdp_params)
                     and _equal(full_optimizer_state(resumed), hsdp_optim))

    back = _engine(ctx, 7, None)
    back.load_checkpoint(f"{root}/hsdp")
    back_loaded = _equal(back.full_state_dict(), hsdp_params) and _equal(full_optimizer_state(back), hsdp_optim)
    next_losses = (_micro_steps(ctx, hsdp, 8, 4), _micro_steps(ctx, back, 8, 4))
    saves = [Path(root) / name for name in ("flat", "hsdp")]  # each save_dir's last tag (DeepSpeed's latest file)
    meshes = [read_manifest(d / (d / "latest").read_text().strip(), CHECKPOINT_KIND)["mesh"] for d in saves]
    return {"loaded": loaded, "want": want, "got": got, "resumed_exact": resumed_exact, "back_loaded": back_loaded,
            "exported_exact": exported_exact,
            "next": next_losses, "meshes": meshes, "progress": (hsdp.progress(), back.progress())}


def test_flat_checkpoint_loads_as_hsdp_and_back(pools: Any, tmp_path: Path) -> None:
    """Saved flat at 4, loaded as 2 x 2 and saved again, loaded flat: the
    values (parameters, optimizer state, an open window's gradients) move
    bit for bit; an HSDP run resumed from its own checkpoint is the
    uninterrupted one bit for bit. Across layouts the training continues
    within rounding, not bitwise: the gradients are summed in another order
    (over 4 ranks at once, or over 2 and then across the 2 replicas)."""
    for r in pools.run(4, run_checkpoints, str(tmp_path)):
        assert r["loaded"], "the flat checkpoint's values, resharded to the shard group, bit for bit"
        torch.testing.assert_close(torch.tensor(r["got"], dtype=torch.float64),
                                   torch.tensor(r["want"], dtype=torch.float64), rtol=0, atol=1e-6)
        assert r["resumed_exact"], "an HSDP run resumed from its checkpoint (inside a window) is exact"
        assert r["back_loaded"], "the HSDP checkpoint loads flat, bit for bit"
        assert r["exported_exact"], "save_pretrained / load_pretrained under HSDP"
        torch.testing.assert_close(torch.tensor(r["next"][0], dtype=torch.float64),
                                   torch.tensor(r["next"][1], dtype=torch.float64), rtol=0, atol=1e-6)
        assert r["meshes"] == [[1, 4], [2, 2]]
        assert r["progress"][0] == r["progress"][1] == (6, 12)


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def run_config_errors(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    def opt(p: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1)

    errors: dict[str, str | None] = {}

    def catch(key: str, **kwargs: Any) -> None:
        try:
            zero3.initialize(MLP(), opt, kwargs.pop("config", None), **kwargs)
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = str(e)

    catch("not_dividing", config=zero3.Zero3Config(mics_shard_size=3))
    catch("one_dim", device_mesh=_mesh((4,), ("dp",)))
    catch("names", device_mesh=_mesh((2, 2), ("dp", "tp")))
    mesh = _mesh()
    catch("both", process_group=ctx.group, device_mesh=mesh)
    catch("disagree", config=zero3.Zero3Config(mics_shard_size=4), device_mesh=mesh)
    from torch.distributed.device_mesh import DeviceMesh

    catch("order", device_mesh=DeviceMesh("cpu", torch.tensor([[1, 0], [3, 2]]), mesh_dim_names=MESH_NAMES))
    whole = zero3.initialize(MLP(), opt, zero3.Zero3Config(mics_shard_size=4))
    t = whole.topology
    with torch.device("meta"):  # made on every rank from one seed: the replicas start equal
        on_meta = MLP()
    hsdp = zero3.initialize(on_meta, opt, zero3.Zero3Config(mics_shard_size=2))
    return {"errors": errors, "flat": (t.replicate_group is None, t.mesh is None, t.shape, whole.shards[0].world),
            "meta_init": hsdp.full_state_dict()}


def test_configuration_errors(pools: Any) -> None:
    results = pools.run(4, run_config_errors)
    r = results[0]
    e = r["errors"]
    assert "mics_shard_size=3" in e["not_dividing"] and "world size 4" in e["not_dividing"]
    assert "2-D" in e["one_dim"] and "2-D" in e["names"] and "('replicate', 'shard')" in e["names"]
    assert "not both" in e["both"]
    assert "disagree" in e["disagree"]
    assert "increasing order" in e["order"]
    assert r["flat"] == (True, True, [1, 4], 4), "mics_shard_size equal to the world is flat ZeRO-3"
    assert all(_equal(x["meta_init"], r["meta_init"]) for x in results)


def test_deepspeed_json_mics_shard_size() -> None:
    from z3kit_recipes.zero3 import Zero3Config

    def read(**zero: Any) -> Any:
        return Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, **zero}, "gradient_clipping": 0})

    assert read(mics_shard_size=8).mics_shard_size == 8
    assert read(mics_shard_size=8.0).mics_shard_size == 8
    assert read(mics_shard_size=-1).mics_shard_size is None  # DeepSpeed's default: off
    assert read().mics_shard_size is None
    with pytest.raises(ValueError, match="mics_shard_size must be a positive"):
        read(mics_shard_size=0)
    assert read(zero_hpz_partition_size=2).hpz_partition_size == 2  # hpZ: tests/test_zero3_hpz.py
    read(zero_hpz_partition_size=1)  # DeepSpeed's default: hpZ off


def test_shard_size_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from z3kit_recipes.zero3 import Zero3Config
    from z3kit_recipes.zero3.ranks.topology import resolve_shard_size

    for bad in (0, -2, 1.5, True, "nodes"):
        with pytest.raises(ValueError, match="mics_shard_size"):
            Zero3Config(mics_shard_size=bad)
    assert resolve_shard_size(None, 8) == 8 and resolve_shard_size(2, 8) == 2
    with pytest.raises(ValueError, match="mics_shard_size=3 does not divide the world size 8"):
        resolve_shard_size(3, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_shard_size("node", 16) == 4
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4.*does not divide the world size 6"):
        resolve_shard_size("node", 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE, which is not set"):
        resolve_shard_size("node", 8)
    # a JSON-like dump of the config keeps it
    assert json.loads(json.dumps({"m": Zero3Config(mics_shard_size="node").mics_shard_size})) == {"m": "node"}


def run_traffic(ctx: Any, accumulation: int) -> dict[str, Any]:
    import os

    from z3kit_recipes import zero3

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks, as torchrun would say
    try:
        torch.manual_seed(0)
        engine = zero3.initialize(MLP(), lambda p: torch.optim.AdamW(p, lr=1e-2), zero3.Zero3Config(
            mics_shard_size="node", param_persistence_threshold=0, gradient_accumulation_steps=accumulation))
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    inter = []
    for step in range(2):
        for micro in range(accumulation):
            b = vec_batch(ctx.rank, step, micro, 0)
            engine.backward(((engine(b["x"]) - b["y"]) ** 2).mean())
            engine.step()
        inter.append(engine.stats().link_bytes["inter_node"])
    return {"inter": inter, "partition_bytes": sum(engine.shards[p].shard_numel * 4 for p in engine.trainable),
            "params": engine.full_state_dict()}


@pytest.mark.parametrize("accumulation", [1, 3])
def test_gradients_cross_nodes_once_per_window(pools: Any, accumulation: int) -> None:
    """Only the replica all-reduce crosses nodes, once per accumulation window: each rank
    receives its gradient partition's bytes (its one peer replica's share, in the direct
    model of z3kit.links), whatever the number of micro-steps."""
    for r in pools.run(4, run_traffic, accumulation):
        assert r["inter"] == [r["partition_bytes"]] * 2
