"""Compose z3kit primitives by hand: shard, gather, bucket, reduce, accumulate.

Two CPU processes on a gloo group each hold 1/2 of every parameter, gather
the full parameters for a forward/backward pass, reduce the gradients through
a FlatBucket and accumulate this rank's partitions in a GradPartitionBuffer
over two micro-steps. Each rank then checks its partitions against plain
torch: the gradient of the unsharded model averaged over both ranks' data.

    python examples/compose_primitives.py
"""

from __future__ import annotations

import copy
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from z3kit.flat_bucket import FlatBucket
from z3kit.grad_partition import GradPartitionBuffer
from z3kit.shard import ParamShard, gather_shards, partition_of

WORLD, MICRO_STEPS = 2, 2


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + step))


def worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)))
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    reference = copy.deepcopy(model)  # plain torch, never sharded
    params = list(model.parameters())

    # Shard: each rank keeps a flat, padded 1/WORLD of every parameter.
    shards = [ParamShard.from_param(p, rank, WORLD) for p in params]
    bucket = FlatBucket(64, rank=rank, world=WORLD)  # all-reduce layout
    grads = GradPartitionBuffer([s.shard_numel for s in shards])

    for step in range(MICRO_STEPS):
        gather_shards(shards, group)  # one coalesced all-gather -> full param.data
        model(batch(rank, step)).sum().backward()
        for key, p in enumerate(params):
            assert p.grad is not None
            bucket.add(key, p.grad)  # copy into the bucket's next slice
            p.grad = None
        for s in shards:
            s.release()  # back to shard-only
        for key, part in bucket.flush(group, scale=1.0 / WORLD).wait():
            grads.accumulate(key, part)  # copy_ on step 0, add_ after

    # Plain torch: mean over ranks of each rank's loss, summed over micro-steps.
    for step in range(MICRO_STEPS):
        for r in range(WORLD):
            (reference(batch(r, step)).sum() / WORLD).backward()
    for key, p in enumerate(reference.parameters()):
        assert p.grad is not None
        expected = partition_of(p.grad.reshape(-1), rank, WORLD)
        torch.testing.assert_close(grads.views[key], expected)
    dist.barrier()  # every rank done first: torch 2.13's gloo can abort in the teardown without it
    dist.destroy_process_group()
    if rank == 0:
        print(f"ok: {len(params)} gradient partitions match plain torch on {WORLD} ranks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD)
