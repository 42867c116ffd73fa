"""A ZeRO-3 runtime in about 60 lines, composed from z3kit primitives only.

``PerModuleZero3`` gathers each module's own parameters just before the
module runs, in forward and in backward, and releases them after. Each
parameter's gradient goes into a reduce-scatter bucket as soon as autograd
has accumulated it; when backward ends (``at_backward_end``, queued from
the first backward hook) the bucket is reduce-scattered into this rank's
gradient partitions. So the training loop is torch's own:
``loss.backward()`` (as many times as there are micro-batches), then
``runtime.step()``. docs/runtime-tutorial.md shows the runtime part of this
file; tests/test_small_runtime.py checks that they are the same text and
that it trains as torch DDP does.

    python examples/small_runtime.py

trains an MLP and a small GPT for three steps of two micro-batches on two
CPU processes, beside DDP, and prints how far their parameters are apart.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# --- the runtime (shown in docs/runtime-tutorial.md) ---
from z3kit.flat_bucket import FlatBucket, ReduceMode
from z3kit.grad_hooks import on_grad_accumulated
from z3kit.grad_partition import GradPartitionBuffer
from z3kit.hook_context import at_backward_end
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.shard import ParamShard, ParamStatus, gather_shards


class PerModuleZero3:
    """Each rank keeps 1/N of every parameter and of its gradient; the optimizer steps on the shards."""

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 group: dist.ProcessGroup) -> None:
        self.params = list(model.parameters())  # a tied parameter once
        if not all(p.requires_grad for p in self.params):
            raise ValueError("PerModuleZero3 trains every parameter; use z3kit_recipes.zero3 for frozen ones")
        self.group, self.world = group, dist.get_world_size(group)
        self.shards = [ParamShard.from_param(p, dist.get_rank(group), self.world) for p in self.params]
        shard_of = dict(zip(self.params, self.shards))
        self.units = {m: [shard_of[p] for p in m.parameters(recurse=False)] for m in model.modules()}
        self.units = {m: shards for m, shards in self.units.items() if shards}  # modules that own parameters
        self.hooks = ModuleHooks(HookActions(self.gather, lambda m, _: self.release(m), self.pre_backward, self.release))
        for module in self.units:
            self.hooks.attach(module)
        for key, p in enumerate(self.params):
            on_grad_accumulated(p, self.grad_ready, key)
        self.bucket = FlatBucket(sum(s.padded_numel for s in self.shards), rank=dist.get_rank(group),
                                 world=self.world, mode=ReduceMode.REDUCE_SCATTER)
        self.grads = GradPartitionBuffer([s.shard_numel for s in self.shards])
        self.masters = [nn.Parameter(s.shard) for s in self.shards]  # views of the shards: a step updates them
        self.optimizer = make_optimizer(self.masters)
        self.reduce_queued = False

    def gather(self, module: nn.Module) -> None:
        wanted = [s for s in self.units[module] if s.status is ParamStatus.NOT_AVAILABLE]  # a tied one may be up
        if wanted:
            gather_shards(wanted, self.group)  # one all-gather; param.data is the full tensor after it

    def release(self, module: nn.Module) -> None:
        for shard in self.units[module]:
            shard.release()

    def start_backward(self) -> None:
        """The first backward hook of a backward: reserve every gradient's slice in one order on
        every rank, and reduce once the last gradient is in, whoever called backward."""
        if not self.reduce_queued:
            self.reduce_queued = True
            for key, shard in enumerate(self.shards):
                self.bucket.reserve(key, shard.numel)
            at_backward_end(self.reduce)

    def pre_backward(self, module: nn.Module) -> None:
        self.start_backward()
        self.gather(module)

    def grad_ready(self, param: torch.Tensor, key: int) -> None:
        self.start_backward()
        assert param.grad is not None
        self.bucket.add(key, param.grad)  # copied into its reserved slice
        param.grad = None

    def reduce(self) -> None:
        self.reduce_queued = False
        self.hooks.finish_backward()  # releases modules whose inputs needed no gradient (embeddings)
        self.bucket.zero_missing()  # a parameter this rank did not use
        for key, part in self.bucket.flush(self.group, scale=1.0 / self.world).wait():  # DDP's mean
            self.grads.accumulate(key, part)  # copy_ on the first backward of a step, add_ after

    def step(self) -> None:
        for master, grad in zip(self.masters, self.grads.optimizer_grads()):
            master.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grads.new_window()
# --- end of the runtime ---


def full_parameters(runtime: PerModuleZero3) -> list[torch.Tensor]:
    """Every parameter's full value (a collective: call it on every rank)."""
    gather_shards(runtime.shards, runtime.group)
    full = [p.detach().clone() for p in runtime.params]
    for shard in runtime.shards:
        shard.release()
    return full


def build(name: str) -> tuple[nn.Module, Callable[[int, int], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """A model, its batch for (rank, step) and its loss; ``name`` is "mlp" or "gpt"."""
    model: nn.Module
    if name == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        return model, lambda r, s: torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * r + s)), \
            lambda out, x: out.pow(2).mean()
    from z3kit_recipes.models import GPT, GPTConfig  # tok_emb.weight is lm_head.weight: one Parameter, two modules

    model = GPT(GPTConfig(vocab_size=32, width=16, n_layer=2, n_head=2, seq_len=8))
    return model, lambda r, s: torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(100 * r + s)), \
        lambda out, x: F.cross_entropy(out.flatten(0, 1), x.flatten())


def train_beside_ddp(name: str, group: dist.ProcessGroup, steps: int = 3, micro_batches: int = 2) -> float:
    """Train ``name`` with PerModuleZero3 and with DDP on the same data; the largest parameter difference."""
    torch.manual_seed(0)
    model, batch, loss_of = build(name)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=group)
    # SGD with momentum: Adam would scale fp32 rounding noise in near-zero gradients up to lr
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    runtime = PerModuleZero3(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), group)
    rank = dist.get_rank(group)
    for step in range(steps):
        for micro in range(micro_batches):
            x = batch(rank, micro_batches * step + micro)
            (loss_of(model(x), x) / micro_batches).backward()  # plain torch: the runtime reduces at its end
            (loss_of(ddp(x), x) / micro_batches).backward()
        runtime.step()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad(set_to_none=True)
    full = full_parameters(runtime)
    return max(float((a - b.detach()).abs().max()) for a, b in zip(full, ddp.module.parameters()))


def worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    assert group is not None  # the default group is up
    for name in ("mlp", "gpt"):
        gap = train_beside_ddp(name, group)
        if rank == 0:
            print(f"{name}: PerModuleZero3 against DDP on {world} ranks, largest parameter difference {gap:.1e}")
    dist.barrier()  # every rank done first: torch 2.13's gloo can abort in the teardown without it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    mp.spawn(worker, args=(2, free_port()), nprocs=2)
