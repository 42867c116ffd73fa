"""Muon on ZeRO-3 shards (``z3kit.sharded_muon`` through ``zero3.initialize``), gloo.

The bar is bit equality with torch's own optimizers: each step, the engine's
gradients (every rank's partitions, gathered whole) are also handed to a
single-process ``torch.optim.Muon`` plus ``torch.optim.AdamW`` on a full copy
of the model, and the engine's parameters after the step must equal the
copy's with ``torch.equal``. The model has a fused QKV projection (on Muon,
one matrix), a tied embedding / head (on AdamW) and matrices whose sizes do
not divide 2, 3 or 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.dist_pool import PoolSet, WorkerContext
from tests.zero3_models import SEQ, VOCAB, TinyTransformer

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "adjust_lr_fn": "match_rms_adamw"}
ADAMW = {"lr": 3e-3, "weight_decay": 0.01}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyTransformer("hf", d=13, heads=1, layers=1)  # qkv 39x13, proj 13x13, fc 26x13, out 13x26


def _on_muon(name: str, shape: torch.Size) -> bool:
    return len(shape) == 2 and "emb" not in name


def _factory(params: Any) -> torch.optim.Optimizer:
    from z3kit.sharded_muon import ShardedMuon

    named = params.named()
    return ShardedMuon([
        {"params": [p for n, p in named if _on_muon(n, params.full_shape(p))]},
        {"params": [p for n, p in named if not _on_muon(n, params.full_shape(p))], "use_muon": False, **ADAMW},
    ], params, **MUON)


def _reference(model: torch.nn.Module) -> tuple[dict[str, torch.nn.Parameter], list[torch.optim.Optimizer]]:
    """Full copies of the parameters and torch's Muon + AdamW on them, as a torch.optim.Muon user writes it."""
    params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    return params, [torch.optim.Muon([p for n, p in params.items() if _on_muon(n, p.shape)], **MUON),
                    torch.optim.AdamW([p for n, p in params.items() if not _on_muon(n, p.shape)], **ADAMW)]


def _whole(engine: Any, pid: int, shard: torch.Tensor) -> torch.Tensor:
    from z3kit.collectives import all_gather

    info = engine.shards[pid]
    out = shard.new_empty(shard.numel() * info.world)
    all_gather(out, shard.detach().contiguous(), engine.topology.shard_group)
    return out[:info.numel].view(info.shape).clone()


def _train(ctx: WorkerContext, engine: Any, ref: dict[str, torch.nn.Parameter], optimizers: list[torch.optim.Optimizer],
           steps: range) -> list[str]:
    """Train ``steps`` with the engine, step the reference on the engine's gradients; the mismatches."""
    grads: dict[str, torch.Tensor] = {}

    def grab(*_: object) -> None:  # runs inside engine.step(), where the masters' .grad are the partitions
        for pid, master in zip(engine.trainable, engine.masters):
            grads[engine.param_names[pid]] = _whole(engine, pid, master.grad)

    hook = engine.optimizer.register_step_pre_hook(grab)
    mismatches = []
    for step in steps:
        idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 * step + ctx.rank))
        logits = engine(idx)
        engine.backward(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1)))
        engine.step()
        for name, p in ref.items():
            p.grad = grads[name]
        for opt in optimizers:
            opt.step()
        for pid, master in zip(engine.trainable, engine.masters):
            name = engine.param_names[pid]
            if not torch.equal(_whole(engine, pid, master), ref[name].detach()):
                mismatches.append(f"step {step}: {name}")
    hook.remove()
    return mismatches


def _parity_worker(ctx: WorkerContext, save_to: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    from z3kit_recipes import zero3

    model = _model()
    ref, optimizers = _reference(model)
    engine = zero3.initialize(model, _factory, zero3.Zero3Config(param_persistence_threshold=0, **(config or {})),
                              ctx.group)
    mismatches = _train(ctx, engine, ref, optimizers, range(5))
    stats = engine.stats()
    momentum = {engine.param_names[pid]: engine.optimizer.state[m]["momentum_buffer"].numel()
                for pid, m in zip(engine.trainable, engine.masters) if "momentum_buffer" in engine.optimizer.state[m]}
    if save_to:
        engine.save_checkpoint(save_to)
        if ctx.rank == 0:
            torch.save({"params": {n: p.detach() for n, p in ref.items()},
                        "optimizers": [o.state_dict() for o in optimizers]}, Path(save_to) / "reference.pt")
    return {"mismatches": mismatches, "muon": stats.muon, "table": str(stats), "momentum_numel": momentum,
            "numel": {n: p.numel() for n, p in ref.items()}}


def _resume_worker(ctx: WorkerContext, load_from: str) -> list[str]:
    from z3kit_recipes import zero3

    engine = zero3.initialize(_model(), _factory, zero3.Zero3Config(param_persistence_threshold=0), ctx.group)
    engine.load_checkpoint(load_from)
    saved = torch.load(Path(load_from) / "reference.pt")
    ref, optimizers = _reference(_model())
    for name, p in ref.items():
        p.data.copy_(saved["params"][name])
    for opt, state in zip(optimizers, saved["optimizers"]):
        opt.load_state_dict(state)
    return _train(ctx, engine, ref, optimizers, range(5, 8))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_muon_equals_torch_muon_and_adamw(pools: PoolSet, world: int, tmp_path: Path) -> None:
    """5 steps bit-equal to torch.optim.Muon + AdamW; the report in stats(); momentum sharded 1/N;
    at world 2, the checkpoint resumes at world 3 bit-equal to the reference going on."""
    save_to = str(tmp_path / "ckpt") if world == 2 else ""
    results = pools.run(world, _parity_worker, save_to)
    for r in results:
        assert r["mismatches"] == []
        report = r["muon"]
        assert report.optimizer_of["blocks.0.attn.qkv.weight"] == "muon"  # fused QKV: one matrix
        assert report.optimizer_of["tok_emb.weight"] == "adamw"  # tied with lm_head.weight: one parameter
        assert report.optimizer_of["blocks.0.ln1.weight"] == "adamw"
        assert sorted(report.owner_of) == sorted(n for n, k in report.optimizer_of.items() if k == "muon")
        assert set(report.owner_of.values()) <= set(range(world)) and report.steps == 5
        assert (report.bytes_sent > 0) == (world > 1) and report.seconds > 0
        assert "muon" in r["table"]
        for name, numel in r["momentum_numel"].items():  # the momentum stays sharded
            assert numel == -(-r["numel"][name] // world)
    if world > 1:  # every rank owns some matrix (4 matrices, balanced by cost)
        assert {o for o in results[0]["muon"].owner_of.values()} == set(range(world))
    if world == 2:
        for mismatches in pools.run(3, _resume_worker, save_to):
            assert mismatches == []


@pytest.mark.parametrize(("world", "config"), [
    (2, {"compute_dtype": "bf16"}),  # fp32 masters of their own, bf16 compute
    (2, {"offload_optimizer": "OFFLOAD"}),  # masters and momentum on the host, stepped behind the next forward
    (4, {"mics_shard_size": 2}),  # HSDP: Muon within each shard group of 2, the replicas alike
])
def test_sharded_muon_with_bf16_compute_offload_and_hsdp(pools: PoolSet, world: int, config: dict[str, Any]) -> None:
    from z3kit_recipes.zero3.config.offload import OffloadConfig

    if "offload_optimizer" in config:
        config = {"offload_optimizer": OffloadConfig()}
    for r in pools.run(world, _parity_worker, "", config):
        assert r["mismatches"] == [] and r["muon"].steps == 5
        assert set(r["muon"].owner_of.values()) == set(range(min(world, 2)))


def _refused_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit.sharded_muon import ShardedMuon
    from z3kit_recipes import zero3

    model = _model()
    before = {n: p.shape for n, p in model.named_parameters()}
    try:
        zero3.initialize(model, lambda params: ShardedMuon(params, params), None, ctx.group)  # every parameter on Muon
    except ValueError as exc:
        refused = str(exc)
    unchanged = {n: p.shape for n, p in model.named_parameters()} == before
    json_engine = zero3.initialize(_model(), None, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
                                                   "optimizer": {"type": "Muon", "params": {"lr": 0.01}}}, ctx.group)
    idx = torch.zeros(2, SEQ, dtype=torch.long)
    json_engine.backward(json_engine(idx).float().mean())
    json_engine.step()
    return {"refused": refused, "unchanged": unchanged, "json": json_engine.stats().muon}


def test_muon_group_with_a_vector_is_refused_and_the_json_names_muon(pools: PoolSet) -> None:
    for r in pools.run(2, _refused_worker):
        assert "'pos_emb.weight'" not in r["refused"] and "'tok_emb.weight'" not in r["refused"]
        assert "2-D matrices only" in r["refused"] and "use_muon=False" in r["refused"]
        assert "'blocks.0.ln1.weight' of shape (13,)" in r["refused"]
        assert r["unchanged"]
        # DeepSpeed's rule: two or more dimensions, no "embed"/"lm_head" in the name
        assert r["json"].optimizer_of["blocks.0.attn.qkv.weight"] == "muon"
        assert r["json"].optimizer_of["blocks.0.ln1.bias"] == "adamw" and r["json"].steps == 1


def test_deepspeed_json_muon_params_are_read_in_deepspeeds_spelling() -> None:
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3.config.json_muon import JsonMuon, uses_muon

    read = zero3.Zero3Config.from_deepspeed(
        {"gradient_clipping": 0,
         "optimizer": {"type": "muon", "params": {"lr": 0.05, "adam_lr": 1e-3, "weight_decay": 0.1, "betas": [0.8, 0.9]}}},
        world=1)
    assert read.optimizer == JsonMuon(muon_lr=0.05, adam_lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9))
    assert JsonMuon.from_json({}) == JsonMuon(muon_lr=0.02, adam_lr=3e-4, momentum=0.95, weight_decay=0.0, eps=1e-10)
    assert uses_muon("h.0.attn.c_attn.weight", (39, 13)) and uses_muon("conv.weight", (4, 3, 3, 3))
    assert not uses_muon("model.embed_tokens.weight", (61, 13)) and not uses_muon("lm_head.weight", (61, 13))
    assert not uses_muon("ln.weight", (13,))
    for params, match in (({"ns_method": "gram"}, "ns_method is not supported"),
                          ({"per_head_muon": True}, "per_head_muon is not supported"),
                          ({"adam_w_mode": False}, "adam_w_mode false"),
                          ({"nesterov": True}, "unsupported Muon parameters: optimizer.params.nesterov")):
        with pytest.raises(ValueError, match=match):
            JsonMuon.from_json(params)
    with pytest.raises(TypeError, match="MasterShards"):
        JsonMuon()([torch.nn.Parameter(torch.zeros(3))])
