"""What the engine watches on the user's model after initialize.

Parameters and submodules registered on the model after ``initialize`` are
refused at the next forward (they were never sharded). Buffers are kept in
the compute dtype on the device, and rank 0's are broadcast before each
training forward, as DDP does; the list of buffers is kept between steps
and made again only when a buffer is registered.

Hugging Face's ``resize_token_embeddings`` and ``tie_weights`` are guarded
(``zero3.training.model_rebuilds``): refused by name where they would
change the sharded parameters.

Torch's global registration hooks say when something may have changed, so
the full check of the model's parameters runs only then. The hooks hold the
watch weakly and go away with it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_registry

from z3kit.collectives import Blocker, CollectiveLog, ProcessGroup, broadcast
from z3kit_recipes.zero3.training.model_rebuilds import guard_rebuilds


def place_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every buffer on ``device``, floating-point ones in ``dtype``."""
    for name, buf in list(module.named_buffers()):
        converted = buf.to(device, dtype) if buf.is_floating_point() else buf.to(device)
        if converted is not buf:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, attr, converted)  # an existing buffer's name: stays a buffer, persistent or not


class ModelWatch:
    """Registrations on one model after initialize (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._param_ids = tuple(id(p) for p in module.parameters())
        #: the id of each tensor a module holds in a parameter's place between uses, to that parameter's id
        self._aliases: dict[int, int] = {}
        self._changed = False
        #: the buffers broadcast before each training forward (None: list them again)
        self._buffers: list[torch.Tensor] | None = None
        model_modules = {id(m) for m in module.modules()}
        watch = weakref.ref(self)

        def on_registration(owner: nn.Module, name: str, value: Any) -> None:
            live = watch()
            if live is not None and id(owner) in model_modules:
                live._changed = True

        def on_buffer(owner: nn.Module, name: str, value: Any) -> None:
            live = watch()
            if live is not None and id(owner) in model_modules:
                live._buffers = None

        for register, hook in (
            (module_registry.register_module_parameter_registration_hook, on_registration),
            (module_registry.register_module_module_registration_hook, on_registration),
            (module_registry.register_module_buffer_registration_hook, on_buffer),
        ):
            weakref.finalize(self, register(hook).remove)
        weakref.finalize(self, guard_rebuilds(module))

    def also_known_as(self, aliases: dict[int, int]) -> None:
        """Modules hold these tensors (by id) in place of those parameters (by id) between uses."""
        self._aliases.update(aliases)

    def check_parameters(self) -> None:
        """Refuse a model whose parameters changed after initialize."""
        if not self._changed:
            return
        aliases = self._aliases
        current = [(name, aliases.get(id(p), id(p))) for name, p in self.module.named_parameters()]
        if len(current) == len(self._param_ids) and all(p == i for (_, p), i in zip(current, self._param_ids)):
            self._changed = False
            return
        known = set(self._param_ids)
        added = [name for name, p in current if p not in known]
        raise RuntimeError(
            f"parameters changed after zero3.initialize (new: {added or 'none'}, "
            f"count {len(self._param_ids)} -> {len(current)}); ZeRO-3 shards parameters at initialize: "
            "add them before initialize, or remove them to keep training with this engine"
        )

    def broadcast_buffers(self, group: ProcessGroup, log: CollectiveLog, waiter: Blocker) -> None:
        """Rank 0's buffers (BatchNorm statistics, ...) to every rank: one broadcast per dtype,
        completed through ``waiter`` (a rank in an eval forward alone posts on the notice board;
        a blocking broadcast would never read it)."""
        if self._buffers is None:  # kept between steps: walking the modules costs as much as a small step
            self._buffers = [b for b in self.module.buffers() if b.numel()]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self._buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for same in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in same])
                pending = broadcast(flat, 0, group, async_op=True, log=log)
                waiter(pending.is_completed, pending.wait)
                for b, value in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(value.view_as(b))
