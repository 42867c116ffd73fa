"""The model as ``torch.distributed.checkpoint``'s state-dict calls take it
(``ShardedModelView``); the Notes are in ``zero3.weights.dcp_state``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.dcp_optimizer import ReplacedState, check_usable, held_parameters
from z3kit_recipes.zero3.weights.flat_shards import flat_dtensor, flat_mesh, local_slice
from z3kit_recipes.zero3.weights.pretrained import persistent_buffers
from z3kit_recipes.zero3.weights.together import Together


class IncompatibleKeys(NamedTuple):
    """What ``ShardedModelView.load_state_dict`` did not use, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class ShardedModelView(nn.Module):
    """The model as DCP's state-dict calls take it: its own tree, with a
    sharded ``state_dict`` and ``load_state_dict`` (see the Notes in ``zero3.weights.dcp_state``)."""

    _engine: EngineCore
    _replaced: ReplacedState

    def __init__(self, engine: EngineCore, replaced: ReplacedState) -> None:
        super().__init__()
        model = engine.module
        # the model's tree itself, not a copy: DCP finds the same names and parameter objects
        # (object.__setattr__: nn.Module's would register the engine, a module, into that tree)
        for shared in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            object.__setattr__(self, shared, getattr(model, shared))
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_replaced", replaced)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Each parameter as this rank's flat DTensor slice (fp32 master; a frozen one: its shard) and the buffers."""
        if args or kwargs:
            raise TypeError("the sharded view's state_dict() takes no arguments (DCP's get_state_dict calls it so)")
        engine = self._engine
        check_usable(engine, "get_state_dict")
        self._replaced.drop()
        mesh, masters = flat_mesh(engine), engine.layout.master_of()
        out: dict[str, Any] = {}
        for pid, shard in enumerate(engine.shards):
            start, stop = engine.layout.local_range(pid)
            out[engine.param_names[pid]] = flat_dtensor(masters.get(pid, shard.shard), shard.numel, start, stop, mesh)
        out.update({name: buffer.detach() for name, buffer in persistent_buffers(engine.module).items()})
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Write the entries into the shards and masters, or refuse on every rank with nothing written."""
        engine = self._engine
        try:
            check_usable(engine, "set_state_dict")
            values, buffers, missing, unexpected = Together.of(engine).agreed(
                "set_state_dict (the model)", lambda: self._checked(state_dict, strict, assign))
        except BaseException:
            self._replaced.put_back(engine)
            raise
        self._replaced.drop()
        engine.synchronize()  # a refresh of the persistent parameters may still read the shards
        with torch.no_grad():
            for pid, local in values.items():
                engine.layout.fill_local(pid, local)
            for name, value in buffers.items():
                target = persistent_buffers(engine.module)[name]
                if value is not target:
                    target.copy_(value)
        engine.shards_changed()
        return IncompatibleKeys(missing, unexpected)

    def _checked(self, state_dict: Any, strict: bool, assign: bool) -> tuple[
            dict[int, torch.Tensor], dict[str, torch.Tensor], list[str], list[str]]:
        engine: EngineCore = self._engine
        if not isinstance(state_dict, dict):
            raise ValueError(f"the model's state dict is a {type(state_dict).__name__}, not a dict")
        names = {pid: [name for name, _ in held] for pid, held in held_parameters(engine).items()}  # tied: several
        mesh, errors, missing = flat_mesh(engine), [], []
        values: dict[int, torch.Tensor] = {}
        for pid, shard in enumerate(engine.shards):
            key = next((n for n in names.get(pid, [engine.param_names[pid]]) if n in state_dict), None)
            if key is None:
                missing.append(engine.param_names[pid])
                continue
            try:
                values[pid] = local_slice(key, state_dict[key], shard, engine.layout.local_range(pid), mesh)
            except ValueError as exc:
                errors.append(str(exc))
        buffers: dict[str, torch.Tensor] = {}
        for name, buffer in persistent_buffers(engine.module).items():
            value = state_dict.get(name)
            if value is None:
                missing.append(name)
            elif not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
                errors.append(f"{name}: {getattr(value, 'shape', type(value).__name__)}, where the buffer's shape "
                              f"is {tuple(buffer.shape)}")
            else:
                buffers[name] = value
        known = {n for ns in names.values() for n in ns} | set(persistent_buffers(engine.module))
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            errors[:0] = [f"{what}: {', '.join(map(repr, keys[:6]))}"
                          + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
                          for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        if assign:
            errors.append("assign=True: the parameters are sharded and stay the engine's; their values are copied in")
        if errors:
            raise ValueError("refused, nothing was loaded: " + "; ".join(errors))
        return values, buffers, missing, unexpected
