"""hpZ (``Zero3Config.hpz_partition_size``, ``zero3.training.secondary``): flat
ZeRO-3 whose backward gathers collect secondary slices within a node.

A secondary slice is an exact copy of part of the gathered parameter, so an
hpZ run is bitwise the flat run on the same data (flat ZeRO-3 is at parity
with DDP in ``test_zero3_parity``). Every run is real: 4 gloo ranks as 2
"nodes" of 2 (``LOCAL_WORLD_SIZE=2``, which the traffic figures read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.two_nodes import two_node_engine
from tests.zero3_models import WORKLOADS
from z3kit.collectives import CollectiveKind
from z3kit_recipes import zero3
from z3kit_recipes.zero3.config.offload import OffloadConfig

STEPS = 3


def _engine(ctx: WorkerContext, workload: str, **config: Any) -> Any:
    return two_node_engine(ctx, workload, config, lr=3e-3)


def _backward_traffic(engine: Any, loss: torch.Tensor) -> dict[str, int]:
    """What one backward moved: bytes by kind, and received over inter-node links."""
    kinds, links = engine.log.snapshot(), engine.log.link_snapshot()
    engine.backward(loss)
    after, links_after = engine.log.snapshot(), engine.log.link_snapshot()
    out = {kind: after[kind]["bytes"] - kinds[kind]["bytes"] for kind in after}
    out["inter_node"] = links_after["inter_node"] - links["inter_node"]
    return out


def _train(ctx: WorkerContext, workload: str, **config: Any) -> dict[str, Any]:
    engine = _engine(ctx, workload, **config)
    w, losses, backwards = WORKLOADS[workload], [], []
    accumulation = engine.zero3_config.gradient_accumulation_steps
    for step in range(STEPS):
        for micro in range(accumulation):
            loss = w.loss(engine, w.batch(ctx.rank, step, micro, 0), step)
            backwards.append(_backward_traffic(engine, loss))
            losses.append(loss.item())
        engine.step()
    memory = dict(engine.stats().memory.peak)  # the window's: its step freed the slices
    return dict(losses=losses, params=engine.full_state_dict(), backwards=backwards, memory=memory,
                padded=sum(s.padded_numel * s.shard.element_size() for s in engine.shards))


def _flat_hpz_offloaded(ctx: WorkerContext, workload: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    return [_train(ctx, workload, **config), _train(ctx, workload, **config, hpz_partition_size="node"),
            _train(ctx, workload, **config, hpz_partition_size=2, offload_optimizer=OffloadConfig())]


CASES = {
    "mlp_fp32_accumulate_clip": ("mlp", dict(gradient_accumulation_steps=2, gradient_clipping=0.05)),
    "mlp_bf16": ("mlp", dict(compute_dtype="bf16")),
    # reentrant activation checkpointing: the recomputed forward gathers again inside backward
    "hf_llama_shared_checkpointed": ("hf_shared_layers_ckpt", {}),
    # tied input and output embeddings: one parameter, gathered in forward and again in backward
    "hf_gpt2_tied": ("hf_gpt2", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hpz_trains_bitwise_as_flat_zero3_and_backward_gathers_stay_in_the_node(pools: PoolSet, case: str) -> None:
    workload, config = CASES[case]
    if workload.startswith("hf"):
        pytest.importorskip("transformers")
    # nothing persistent, nothing held from forward to backward: backward gathers every parameter again
    base = dict(param_persistence_threshold=0, max_reuse_distance=0)
    for flat, hpz, offloaded in pools.run(4, _flat_hpz_offloaded, workload, dict(base, **config)):
        for other in (hpz, offloaded):
            assert other["losses"] == flat["losses"]
            assert all(torch.equal(flat["params"][k], other["params"][k]) for k in flat["params"])
        gather, reduce = CollectiveKind.ALL_GATHER.value, CollectiveKind.ALL_REDUCE.value
        for f, h in zip(flat["backwards"], hpz["backwards"]):
            gathered, reduced = f[gather], f[reduce]
            assert gathered > 0 and f[CollectiveKind.REDUCE_SCATTER.value] == 0  # gloo reduces by all-reduce
            assert h[reduce] == reduced
            # every backward gather collects the node's 2 slices (each rank gives 1/2 of the
            # parameter, the log's bytes) instead of the 4 shards (1/4 each)
            assert h[gather] == 2 * gathered
            # 4 ranks, 2 per node: an all-reduce of t bytes brings t across nodes (2 remote peers x 2t/4);
            # flat: each gather of a shard of c bytes brings 2c (from the 2 ranks on the other node)
            assert f["inter_node"] == reduced + 2 * gathered
            assert h["inter_node"] == reduced  # hpZ: backward's gathers bring nothing across nodes
        # a slice of 1/2 of every parameter (all gathered in training forwards), in the compute dtype
        assert hpz["memory"]["hpz_secondary"] == hpz["padded"] // 2
        assert flat["memory"].get("hpz_secondary", 0) == 0


def _resume(ctx: WorkerContext, root: str) -> list[list[float]]:
    """A load makes the slices kept before it stale, even inside an accumulation window."""
    w = WORKLOADS["mlp"]
    config = dict(param_persistence_threshold=0, max_reuse_distance=0, hpz_partition_size=2,
                  gradient_accumulation_steps=2)

    def micro(engine: Any, step: int, m: int, shift: int = 0) -> float:
        loss = w.loss(engine, w.batch(ctx.rank + shift, step, m, 0), step)
        engine.backward(loss)
        engine.step()
        return float(loss)

    straight = _engine(ctx, "mlp", **config)
    losses = [micro(straight, 0, 0), micro(straight, 0, 1)]
    straight.save_checkpoint(root)
    losses += [micro(straight, step, m) for step in (1, 2) for m in (0, 1)]
    # another run: other data (other shards after its step), slices kept in the next window's first
    # micro-step; then the checkpoint is loaded and training goes on as the straight run did
    other = _engine(ctx, "mlp", **config)
    for m in (0, 1):
        micro(other, 0, m, shift=10)
    micro(other, 1, 0, shift=10)
    other.load_checkpoint(root)
    resumed = [micro(other, step, m) for step in (1, 2) for m in (0, 1)]
    return [losses[2:], resumed]


def test_a_load_makes_the_kept_slices_stale(pools: PoolSet, tmp_path: Path) -> None:
    for straight, resumed in pools.run(4, _resume, str(tmp_path / "ckpt")):
        assert resumed == straight


def _refusals(ctx: WorkerContext) -> list[str]:
    out = []
    for config in (dict(hpz_partition_size=2, mics_shard_size=2), dict(hpz_partition_size=3),
                   dict(hpz_partition_size=2, divergent_graphs=True)):
        try:
            _engine(ctx, "mlp", **config)
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_hpz_refusals(pools: PoolSet) -> None:
    for with_hsdp, not_dividing, divergent in pools.run(4, _refusals):
        assert "with HSDP" in with_hsdp and "choose one of them" in with_hsdp
        assert "hpz_partition_size=3 does not divide the world size 4" in not_dividing
        assert "divergent_graphs" in divergent


def test_deepspeed_json_zero_hpz_partition_size() -> None:
    def read(value: Any) -> zero3.Zero3Config:
        return zero3.Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": value},
                                                 "gradient_clipping": 0.0})

    assert read(8).hpz_partition_size == 8 and read(8.0).hpz_partition_size == 8
    assert read(1).hpz_partition_size == 1  # DeepSpeed's default: off
    with pytest.raises(ValueError, match="hpz_partition_size must be a positive int"):
        read(0)
    with pytest.raises(ValueError, match="hpz_partition_size must be a positive int"):
        zero3.Zero3Config(hpz_partition_size="nodes")
