"""z3kit.matrix_owners: owners and both exchanges without a process group, simulated rank by
rank; and a second optimizer composed from it (``z3kit.spectral_sgd``) against its unsharded form, on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from z3kit.matrix_owners import (
    MatrixPlan,
    assign_owners,
    newton_schulz_cost,
    pack_at_owner,
    pack_for_owners,
    unpack_at_owner,
    unpack_slices,
)
from z3kit.partition import partition_of
from tests.dist_pool import PoolSet, WorkerContext

SHAPES = [(7, 5), (39, 13), (13, 13), (1, 9), (26, 13), (3, 2)]


def test_owners_are_balanced_by_cost_and_deterministic() -> None:
    assert newton_schulz_cost((39, 13)) == 39 * 13 * 13 and newton_schulz_cost((8,)) == 8
    assert assign_owners([5, 9, 5, 1], 2) == (1, 0, 1, 0)  # 9 -> 0; 5 -> 1; 5 -> 1 (5 < 9); 1 -> 0 (9 < 10)
    assert assign_owners([4, 4, 4], 3) == (0, 1, 2)  # ties go to the lowest rank, in order
    assert assign_owners([], 4) == ()
    plan = MatrixPlan.balanced(SHAPES, 3)
    assert plan == MatrixPlan.balanced(tuple(SHAPES), 3)  # the same on every call (every rank)
    loads = [plan.load(r) for r in range(3)]
    assert max(loads) == plan.load(plan.owners[1]) == newton_schulz_cost((39, 13))  # the largest alone
    assert sorted(i for r in range(3) for i in plan.owned_by(r)) == list(range(len(SHAPES)))
    with pytest.raises(ValueError, match="one owner per matrix"):
        MatrixPlan(SHAPES, 2, (0,))
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, 2\)"):
        MatrixPlan([(2, 2)], 2, (2,))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_and_scatter_round_trip(world: int) -> None:
    """Every rank packs its slices, the all-to-all is done by hand, the owners get the whole
    matrices; their results come back as exactly the slices ``partition_of`` cuts."""
    plan = MatrixPlan.balanced(SHAPES, world)
    g = torch.Generator().manual_seed(world)
    full = [torch.randn(s, generator=g) for s in SHAPES]
    packed = [pack_for_owners(plan, [partition_of(t.reshape(-1), r, world) for t in full]) for r in range(world)]

    def exchange(buffers: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        pieces = [list(b.split(splits)) for b, splits in buffers]
        return [torch.cat([pieces[src][dst] for src in range(world)]) for dst in range(world)]

    for rank, received in enumerate(exchange(packed)):
        whole = unpack_at_owner(plan, rank, received)
        assert sorted(whole) == list(plan.owned_by(rank))
        for i, m in whole.items():
            assert torch.equal(m, full[i])
    results = [{i: full[i] * 2 for i in plan.owned_by(r)} for r in range(world)]
    back = exchange([pack_at_owner(plan, r, results[r], torch.bfloat16, torch.device("cpu")) for r in range(world)])
    for rank, received in enumerate(back):
        for i, piece in enumerate(unpack_slices(plan, received)):
            assert piece.dtype == torch.bfloat16
            assert torch.equal(piece, partition_of((full[i] * 2).reshape(-1), rank, world).bfloat16())
    sent = sum(plan.bytes_per_exchange(r, 4)[0] for r in range(world))
    assert sent == sum(plan.bytes_per_exchange(r, 4)[1] for r in range(world))
    assert sent == sum(plan.shard_numel(i) * (world - 1) * 4 for i in range(len(SHAPES)))


def test_bad_slices_are_refused() -> None:
    plan = MatrixPlan.balanced([(3, 3)], 2)
    with pytest.raises(ValueError, match=r"matrix 0 of shape \(3, 3\) has slices of 5 elements over 2 ranks"):
        pack_for_owners(plan, [torch.zeros(4)])
    with pytest.raises(ValueError, match="one slice per matrix"):
        pack_for_owners(plan, [])
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        pack_at_owner(plan, plan.owners[0], {0: torch.zeros(9)}, torch.float32, torch.device("cpu"))


class _Shards:
    """A ``ShardedParams`` over hand-cut shards."""

    def __init__(self, group: Any, shards: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> None:
        self._group = group
        self._shapes = {id(s): torch.Size(shape) for s, shape in zip(shards, shapes)}

    @property
    def group(self) -> Any:
        return self._group

    def full_shape(self, shard: torch.Tensor) -> torch.Size:
        return self._shapes[id(shard)]

    def name_of(self, shard: torch.Tensor) -> str:
        return f"w{list(self._shapes).index(id(shard))}"


def _spectral_worker(ctx: WorkerContext) -> dict[str, Any]:
    from z3kit.spectral_sgd import ShardedSpectralSGD, spectral_sgd_reference

    g = torch.Generator().manual_seed(7)
    full = [torch.randn(s, generator=g) for s in SHAPES]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    bufs = [torch.zeros_like(t) for t in full]
    shards = [torch.nn.Parameter(partition_of(t.reshape(-1), ctx.rank, ctx.world)) for t in full]
    opt = ShardedSpectralSGD(shards, _Shards(ctx.group, shards, SHAPES), lr=0.05, momentum=0.8)
    equal = []
    for _ in range(5):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for p, s, grad in zip(ref, shards, grads):
            p.grad, s.grad = grad, partition_of(grad.reshape(-1), ctx.rank, ctx.world)
        spectral_sgd_reference(ref, bufs, lr=0.05, momentum=0.8)
        opt.step()
        equal.append(all(torch.equal(s.detach(), partition_of(p.detach().reshape(-1), ctx.rank, ctx.world))
                         for s, p in zip(shards, ref)))
    moved = not torch.equal(ref[0].detach(), full[0])
    vector = torch.nn.Parameter(torch.zeros(5))
    try:
        ShardedSpectralSGD([vector], _Shards(ctx.group, [vector], [(9,)]))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"equal": equal, "moved": moved, "refused": refused}


@pytest.mark.parametrize("world", [2, 3])
def test_spectral_sgd_on_shards_equals_its_unsharded_form(pools: PoolSet, world: int) -> None:
    for r in pools.run(world, _spectral_worker):
        assert r["equal"] == [True] * 5 and r["moved"]
        assert "parameter 'w0' of shape (9,) is in a spectral SGD group, but spectral SGD steps 2-D matrices" \
            in r["refused"]
