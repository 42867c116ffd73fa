"""``Unit``: one block's parameters (or the root's), sharded in one flat
buffer, gathered by one coalesced all-gather and reduced by one
reduce-scatter.

A unit is the only owner of its gather in flight (``handle``): ``issue``
starts it, ``wait`` completes it on the stream pair (``GatherHandle.wait``
closes its ``CommTicket``, which held the buffers the collective used),
``release`` frees the gathered values. A unit's reduction hands back a
``BucketFlush`` whose ticket holds the bucket until the engine completes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from z3kit.collectives import CollectiveLog
from z3kit.flat_bucket import BucketFlush, FlatBucket, ReduceMode
from z3kit.shard import GatherHandle, ParamShard, ParamStatus, gather_shards, shard_numel_for
from z3kit.streams import StreamPairLike
from z3kit_recipes.fsdp_blocks.plan import UnitPlan


class Unit:
    """Shards, gather state and gradient reduction of one unit on this rank."""

    def __init__(
        self, plan: UnitPlan, group: dist.ProcessGroup, streams: StreamPairLike, log: CollectiveLog
    ) -> None:
        self.name, self.module = plan.name, plan.module
        self.names = [n for n, _ in plan.params]
        self.group, self.streams, self.log = group, streams, log
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        sizes = [shard_numel_for(p.numel(), world) for _, p in plan.params]
        device = plan.params[0][1].device if plan.params else torch.device("cpu")
        #: this rank's shards of every parameter of the unit, back to back (one
        #: view for the coalesced gather, no concatenation copy)
        self.flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        views = self.flat.split(sizes) if sizes else ()
        self.shards = [ParamShard.from_param(p, rank, world, out=v) for (_, p), v in zip(plan.params, views)]
        #: positions of the shards whose parameter requires grad
        self.trainable = [i for i, s in enumerate(self.shards) if s.param.requires_grad]
        #: the engine's gradient-partition index of each trainable shard
        self.grad_keys: list[int] = []
        self.handle: GatherHandle | None = None
        #: gradients that arrived in this backward, and whether the unit was reduced in it
        self.arrived = 0
        self.reduced = False

    @property
    def gathered(self) -> bool:
        return bool(self.shards) and self.shards[0].status is ParamStatus.AVAILABLE

    def numel(self) -> int:
        return sum(s.numel for s in self.shards)

    def issue(self) -> None:
        """Start the unit's all-gather unless it is gathered or in flight (or has no parameters)."""
        if self.shards and self.handle is None and not self.gathered:
            label = f"all_gather {self.name}"
            with torch.profiler.record_function(label):
                self.handle = gather_shards(self.shards, self.group, streams=self.streams, async_op=True, log=self.log)

    def wait(self) -> None:
        """The unit's parameters are gathered (issued now if they were not)."""
        self.issue()
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.wait()

    def release(self) -> None:
        """Only the shards stay; a gather still in flight is completed first."""
        if self.handle is not None:
            self.wait()
        if self.gathered:
            for s in self.shards:
                s.release()

    def reduce(self, scale: float) -> BucketFlush:
        """Reduce-scatter the gradients of the trainable parameters (``param.grad``,
        then set to None; zeros for one without a gradient on this rank)
        into this rank's partitions, keyed by ``grad_keys``; issued, not completed."""
        padded = sum(self.shards[i].padded_numel for i in self.trainable)
        # allocated per reduction, on the compute stream; the flush's ticket holds it until completed
        bucket = FlatBucket(padded, rank=self.shards[0].rank, world=self.shards[0].world,
                            device=self.flat.device, mode=ReduceMode.REDUCE_SCATTER)
        params: list[nn.Parameter] = []
        for key, i in zip(self.grad_keys, self.trainable):
            bucket.reserve(key, self.shards[i].numel)
            params.append(self.shards[i].param)
        for key, p in zip(self.grad_keys, params):
            if p.grad is not None:
                bucket.add(key, p.grad)
                p.grad = None
        bucket.zero_missing()
        self.arrived, self.reduced = 0, True
        with torch.profiler.record_function(f"reduce_scatter {self.name}"):
            return bucket.flush(self.group, streams=self.streams, scale=scale, async_op=True, log=self.log)

    def full_values(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (a collective: every rank calls it at the same point)."""
        was = self.gathered
        self.wait()
        out = {n: s.param.detach().clone() for n, s in zip(self.names, self.shards)}
        if not was:
            self.release()
        return out
