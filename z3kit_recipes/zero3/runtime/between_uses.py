"""The model's parameters between uses: honest sharded tensors.

After ``initialize`` each module holds, while its parameter is released, a
``ShardedParam`` (``z3kit.sharded_param``) of the parameter's logical shape
whose values are this rank's shard, and the plain gathered parameter while
it is gathered (``ParamShard.show_between_uses``). ``ParamsBetweenUses`` is
the runtime those sharded tensors ask (``ShardAccess``): for a parameter's
whole value, for the gathered parameter a forward uses, to write its shard,
and for its ``.grad``.

Note: uses outside a module's forward.
    A function that needs a released parameter's whole value outside any
    hooked module's forward (a penalty before the forward, a fused loss
    that takes ``lm_head.weight`` into its own ``autograd.Function`` after
    it, ``parameters_to_vector``, an EMA's read) gathers it for that call:
    outside a forward and a backward the ranks first agree that each of
    them gathers this parameter now (``EvalMeeting.collective_call``: a
    rank that does it alone is named on every rank, never paired with
    another collective), the values are copied out of the gathered buffer
    and the parameter is released again unless a module or pin holds it.
    Under autograd the copy is differentiable and its gradient arrives in
    the sharded tensor's own ``.grad`` through torch's accumulation; the
    grad-ready hook there hands it to the reducer, as a module's use would
    (``BackwardPass.take_external_grad``). Inside a hooked module's forward
    the parameter joins that module instead (``ParamCoordinator.on_param_use``)
    and the forward computes with the gathered parameter itself.

Note: writes.
    An elementwise in-place function on a released parameter (``p.mul_``,
    ``p.copy_(values)``, ``p.data.zero_()``) writes the shard through
    ``write``: on its fp32 master first where it has one (so a bf16 run keeps
    fp32 values), then ``EngineCore.shards_changed`` drops every stale copy.
    Like every shard write it is refused inside a forward or backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from z3kit.collectives import all_gather
from z3kit.sharded_param import ShardedParam, ShardedTensor, ShardSpec, write_shard
from z3kit.shard import ParamStatus
from z3kit_recipes.zero3.runtime.build import EngineParts


class ParamsBetweenUses:
    """The runtime the model's sharded parameters ask (see the module docstring)."""

    def __init__(self, parts: EngineParts, *, shards_changed: Callable[[Sequence[int]], None],
                 check_idle: Callable[[str], None]) -> None:
        self.parts = parts
        self.shards = parts.layout.shards
        self._shards_changed, self._check_idle = shards_changed, check_idle
        index = parts.coordinator.index
        registrations: list[list[tuple[nn.Module, str]]] = [[] for _ in self.shards]
        for module in parts.module.modules():
            for name, p in module._parameters.items():
                pid = index.get(id(p))
                if pid is not None:
                    registrations[pid].append((module, name))
        for pid, shard in enumerate(self.shards):
            plain = shard.param
            spec = ShardSpec(shard.shape, shard.rank, shard.world)
            sharded = ShardedParam(spec, shard.shard, self, home=pid, requires_grad=plain.requires_grad)
            for attr in ("ds_shape", "ds_numel"):  # DeepSpeed's names, which Hugging Face and PEFT read
                if hasattr(plain, attr):
                    setattr(sharded, attr, getattr(plain, attr))
            index[id(sharded)] = pid
            shard.show_between_uses(sharded, registrations[pid])
        parts.backward.watch_external_gradients(list(parts.layout.trainable))
        parts.model_watch.also_known_as({id(s.between_uses): id(s.param) for s in self.shards})

    def _pid(self, t: ShardedTensor) -> int | None:
        home = t._home  # set only on the sharded parameters this runtime made (copies have none)
        return home if isinstance(home, int) else None

    # -- ShardAccess ----------------------------------------------------------------------------------------
    def parameter(self, t: ShardedTensor) -> nn.Parameter | None:
        pid = self._pid(t)
        return None if pid is None else self.shards[pid].param

    def master(self, t: ShardedTensor) -> torch.Tensor | None:
        pid = self._pid(t)
        if pid is None:
            return t._master
        layout = self.parts.layout
        if layout.masters_are_shards:
            return None
        master = layout.master_of().get(pid)
        return None if master is None else master.data

    def in_forward(self, t: ShardedTensor) -> torch.Tensor | None:
        pid = self._pid(t)
        user = self.parts.hooks.innermost()
        if pid is None or user is None:
            return None
        self.parts.coordinator.on_param_use(pid, user)
        return self.shards[pid].param

    def full_values(self, t: ShardedTensor) -> torch.Tensor:
        pid = self._pid(t)
        coordinator = self.parts.coordinator
        outside = not self.parts.step_state.busy
        if pid is None:  # a copy (copy.deepcopy): its own shard, gathered over the same ranks
            with self._meeting(outside, f"a function on a copied sharded tensor of shape {tuple(t.shape)}"):
                local = t._local.detach()
                out = local.new_empty(local.numel() * t._spec.world)
                if t._spec.world > 1:
                    all_gather(out, local, self.parts.topology.shard_group, log=self.parts.log)
                else:
                    out.copy_(local)
            return out[: t._spec.numel].view(t._spec.shape)
        shard = self.shards[pid]
        released = shard.status is not ParamStatus.AVAILABLE
        name = self.parts.param_names[pid]
        with self._meeting(released and outside, f"a function on the sharded parameter {name!r} outside a forward"):
            coordinator.ensure_gathered([pid])
            with torch.no_grad():
                values = shard.param.detach().clone()
            if released and not coordinator.holds.held(pid) and not coordinator.stays_gathered(pid):
                coordinator.gatherer.free([pid])
        return values

    def _meeting(self, needed: bool, what: str) -> contextlib.AbstractContextManager[None]:
        """Outside a forward and a backward a gather is a collective call the
        ranks meet for first (``EvalMeeting.collective_call``)."""
        if not needed:
            return contextlib.nullcontext()
        self.parts.watch.check(what)
        return self.parts.meeting.collective_call(what)

    def write(self, t: ShardedTensor, apply: Callable[[torch.Tensor], None]) -> None:
        pid = self._pid(t)
        if pid is None:
            write_shard(t, apply, t._master)
            return
        self._check_idle(f"an in-place write to the sharded parameter {self.parts.param_names[pid]!r}")
        write_shard(t, apply, self.master(t))
        self._shards_changed([pid])


def adopt_sharded_copies(model: nn.Module) -> None:
    """Before ``initialize`` shards ``model``: each parameter that is a sharded
    tensor (the model is a ``copy.deepcopy`` of a sharded one: an EMA or a
    reference model) becomes a plain parameter of its whole value, gathered
    one at a time (collective: every rank initializes the same model), under
    every name it has."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if not isinstance(p, ShardedTensor):
                continue
            plain = replaced.get(id(p))
            if plain is None:
                with torch.no_grad():
                    values = p.full_tensor().detach().clone()
                plain = replaced[id(p)] = nn.Parameter(values, requires_grad=p.requires_grad)
            module._parameters[name] = plain
