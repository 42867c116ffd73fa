"""``BlocksEngine``: the fsdp_blocks runtime, wiring units to the model's
forward and backward.

    root pre-forward      gather the root unit (and prefetch block 0)
    block pre-forward     complete the block's gather; prefetch the next block
    block post-forward    release the block
    block pre-backward    complete the block's gather; prefetch the previous block
    grad ready            when a unit's trainable parameters all have .grad:
                          reduce-scatter them (completing the reduction before)
    block post-backward   release the block
    end of backward       reduce units still due, complete every reduction into
                          the gradient partitions, release everything
    step                  at each accumulation boundary: clip, optimizer step
                          over the fp32 shards, new window

Every rank must run the same blocks in the same order (as FSDP2 needs):
the collectives pair up by issue order. No host sync anywhere: the norm
stays a device tensor, and collectives complete through their tickets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from z3kit.collectives import CollectiveLog, Pending, all_reduce, broadcast
from z3kit.flat_bucket import BucketFlush
from z3kit.grad_hooks import on_grad_accumulated
from z3kit.grad_partition import GradPartitionBuffer, clip_coefficient
from z3kit.hook_context import at_backward_end, in_backward
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.streams import StreamPairLike, stream_pair_for
from z3kit_recipes.fsdp_blocks.config import BlocksConfig
from z3kit_recipes.fsdp_blocks.plan import Plan
from z3kit_recipes.fsdp_blocks.unit import Unit

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class BlocksEngine:
    """A model sharded by blocks; call it as the model, then ``backward`` and ``step``."""

    def __init__(
        self, model: nn.Module, plan: Plan, optimizer: OptimizerFactory, group: dist.ProcessGroup, config: BlocksConfig,
        streams: StreamPairLike | None = None,
    ) -> None:
        self.module, self.config, self.group = model, config, group
        self.world = dist.get_world_size(group)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        #: compute and communication streams (a recording pair in tests)
        self.streams = stream_pair_for(device) if streams is None else streams
        self.log = CollectiveLog()
        for p in model.parameters():  # rank 0's values everywhere, as DDP starts
            self._run(p.data, lambda t: broadcast(t, 0, group, async_op=True, log=self.log))
        self.blocks = [Unit(u, group, self.streams, self.log) for u in plan.blocks]
        self.root = Unit(plan.root, group, self.streams, self.log)
        self.plan = plan
        trainable = [(u, i) for u in self.units for i in u.trainable]
        for key, (u, _) in enumerate(trainable):
            u.grad_keys.append(key)
        self.grads = GradPartitionBuffer([u.shards[i].shard_numel for u, i in trainable], device=device)
        #: the optimizer's parameters: the fp32 shards themselves (a step updates them in place)
        self.masters = [nn.Parameter(u.shards[i].shard) for u, i in trainable]
        self.optimizer = optimizer(self.masters)
        self._index = {id(u.module): i for i, u in enumerate(self.blocks)}
        self._owner = {id(u.shards[i].param): u for u, i in trainable}
        self._reductions: list[BucketFlush] = []
        self._queued = False
        self.micro_steps = self.global_step = 0
        #: the global gradient norm before clipping, a device tensor (None without clipping)
        self.last_grad_norm: torch.Tensor | None = None
        self.hooks = ModuleHooks(HookActions(self._pre_forward, self._post_forward, self._pre_backward, self._post_backward))
        for u in self.blocks:
            self.hooks.attach(u.module)
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for u, i in trainable:
            on_grad_accumulated(u.shards[i].param, self._grad_ready)

    @property
    def units(self) -> list[Unit]:
        """Every unit: the blocks in forward order, then the root."""
        return [*self.blocks, self.root]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except BaseException:
            # autograd never ran the end-of-backward callback: forget the backward's
            # progress so that the next one queues its own (its reductions still run)
            self._queued = False
            self.hooks.reset()
            for u in self.units:
                u.arrived, u.reduced = 0, False
            raise

    # -- forward ----------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return  # a recomputation: the root is gathered until the end of backward
        self.root.issue()
        if self.config.prefetch and self.blocks:
            self.blocks[0].issue()
        self.root.wait()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for u in self.blocks:  # prefetches the forward did not use
            u.release()
        if not torch.is_grad_enabled():
            self.root.release()  # no backward follows

    def _block(self, module: nn.Module) -> int:
        return self._index[id(module)]

    def _pre_forward(self, module: nn.Module) -> None:
        i = self._block(module)
        self.blocks[i].wait()
        nxt = self.plan.forward_next(i)
        if self.config.prefetch and nxt is not None and not in_backward():
            self.blocks[nxt].issue()

    def _post_forward(self, module: nn.Module, output: Any) -> None:
        self.blocks[self._block(module)].release()

    # -- backward ---------------------------------------------------------------
    def _queue_end(self) -> None:
        if not self._queued and in_backward():
            self._queued = True
            at_backward_end(self._end_backward)

    def _pre_backward(self, module: nn.Module) -> None:
        self._queue_end()
        i = self._block(module)
        self.blocks[i].wait()
        prev = self.plan.backward_next(i)
        if self.config.prefetch and prev is not None:
            self.blocks[prev].issue()

    def _post_backward(self, module: nn.Module) -> None:
        self.blocks[self._block(module)].release()

    def _grad_ready(self, param: torch.Tensor) -> None:
        self._queue_end()
        unit = self._owner[id(param)]
        unit.arrived += 1
        if unit.arrived == len(unit.trainable):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        self._complete_reductions()  # one reduction in flight at a time: its bucket is the only one alive
        scale = 1.0 / (self.world * self.config.gradient_accumulation_steps)
        self._reductions.append(unit.reduce(scale))

    def _complete_reductions(self) -> None:
        for flush in self._reductions:
            for key, part in flush.wait():
                self.grads.accumulate(key, part)
        self._reductions.clear()

    def _end_backward(self) -> None:
        self.hooks.finish_backward()
        for u in [*reversed(self.blocks), self.root]:
            if u.trainable and (u.arrived or not u.reduced):
                self._reduce(u)  # some gradients never came on this rank: zeros in their place
        self._complete_reductions()
        for u in self.units:
            u.release()
            u.reduced = False
        self._queued = False

    # -- step -------------------------------------------------------------------
    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary clip, step the
        optimizer and start a new window. True when the optimizer stepped."""
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        self._complete_reductions()
        if self.config.gradient_clipping > 0:
            squared = self.grads.squared_norm()
            self._run(squared, lambda t: all_reduce(t, self.group, async_op=True, log=self.log))
            norm = squared.sqrt()
            self.grads.scale_(clip_coefficient(norm, self.config.gradient_clipping))
            self.last_grad_norm = norm
        for master, grad in zip(self.masters, self.grads.optimizer_grads()):
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self.grads.new_window()
        self.global_step += 1
        return True

    def _run(self, tensor: torch.Tensor, issue: Callable[[torch.Tensor], Pending]) -> None:
        """One in-place collective on ``tensor``, held by its ticket until completed."""
        with self.streams.communicate(reads=[tensor], writes=[tensor], label="fsdp_blocks") as ticket:
            pending = issue(tensor)
        self.streams.complete(ticket, pending.wait)

    # -- inspection -------------------------------------------------------------
    def gathered_numel(self) -> int:
        """Elements of parameters gathered now."""
        return sum(u.numel() for u in self.units if u.gathered)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value under every name a plain model's
        ``state_dict`` lists it by (tied ones share the tensor), on every
        rank (every rank calls it)."""
        values: dict[str, torch.Tensor] = {}
        for u in self.units:
            values.update(u.full_values())
        first = {id(p): name for name, p in self.module.named_parameters()}
        return {name: values[first[id(p)]] for name, p in self.module.named_parameters(remove_duplicate=False)}

    def synchronize(self) -> None:
        self.streams.synchronize()
