"""``engine.optimizer`` as ``torch.distributed.checkpoint``'s state-dict calls
take it (``ShardedOptimizerView``), and what both DCP views check first; the
Notes are in ``zero3.weights.dcp_state``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.flat_shards import FlatMesh, flat_dtensor, flat_mesh, local_slice
from z3kit_recipes.zero3.weights.together import Together

_SAVE_ROUTE = "engine.save_checkpoint(path) (engine.load_checkpoint(path) to resume)"
_READ_ONLY = "the DCP view's param_groups and state are engine.optimizer's: change engine.optimizer's"


def check_usable(engine: EngineCore, what: str) -> None:
    """Refuse ``what`` inside a forward or backward, or with an accumulation window open (see the Notes)."""
    engine.check_idle(what)
    engine.settle()
    engine.parts.trainable_watch.follow()  # parameters unfrozen since the last forward get their masters
    if engine.reducer is not None and engine.reducer.window.partitions is not None:
        raise RuntimeError(
            f"{what}: an accumulation window is open (backwards since its last optimizer step), and DCP's state "
            f"dicts hold no gradients: call it after the window's engine.step(), or use {_SAVE_ROUTE}, which saves it")


class ReplacedState:
    """The optimizer state that a ``set_state_dict``'s optimizer load
    replaced, kept until its model load ends (DCP loads the optimizer first)."""

    def __init__(self) -> None:
        self.previous: dict[str, Any] | None = None
        self.at: tuple[int, int] = (-1, -1)

    def hold(self, previous: dict[str, Any], at: tuple[int, int]) -> None:
        self.previous, self.at = previous, at

    def put_back(self, engine: EngineCore) -> None:
        """A refused model load: the optimizer as it was (only if nothing stepped in between)."""
        previous, self.previous = self.previous, None
        if previous is not None and self.at == engine.progress():
            engine.require_optimizer("set_state_dict").load_state_dict(previous)

    def drop(self) -> None:
        self.previous = None


def held_parameters(engine: EngineCore) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """Each parameter's names and the object the model holds under each now, by
    parameter id: the objects ``model.named_parameters()`` gives DCP (a parameter
    may be held in one form between uses and another while gathered; tied names share one)."""
    index = {id(s.param): pid for pid, s in enumerate(engine.shards)}
    index.update((id(s.between_uses), pid) for pid, s in enumerate(engine.shards)
                 if getattr(s, "between_uses", None) is not None)
    held: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in index:
            held.setdefault(index[id(p)], []).append((name, p))
    return held


def _padded(local: torch.Tensor, held: Any, master: torch.Tensor) -> torch.Tensor:
    """``local`` as a state tensor shaped like ``master``: the one held now when
    ``local`` is its own view (``dcp.load`` wrote it in place), else a new one."""
    if (isinstance(held, torch.Tensor) and held.shape == master.shape and local.numel()
            and local.data_ptr() == held.data_ptr()):
        held.detach()[local.numel():].zero_()
        return held
    out = torch.zeros(master.shape, dtype=local.dtype, device=master.device)
    out[: local.numel()].copy_(local)
    return out


class ShardedOptimizerView(torch.optim.Optimizer):
    """``engine.optimizer`` as DCP's state-dict calls take it: its groups and
    state under the model's parameters (see the Notes in ``zero3.weights.dcp_state``). It steps
    nothing itself: training steps with ``engine.step()``."""

    def __init__(self, engine: EngineCore, replaced: ReplacedState) -> None:
        # no Optimizer.__init__: the groups and state are engine.optimizer's, read through the properties
        self._engine, self._replaced = engine, replaced
        self.inner = engine.require_optimizer("dcp_view()")

    def _pids(self) -> dict[int, int]:
        """Parameter id of each master, by the master's identity."""
        return {id(master): pid for pid, master in self._engine.layout.master_of().items()}

    def _model_params(self) -> dict[int, torch.Tensor]:
        """The model's parameter object for each master, by the master's identity."""
        held = held_parameters(self._engine)
        return {id(m): held[pid][0][1] for pid, m in self._engine.layout.master_of().items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """``engine.optimizer``'s groups (new dicts), each master replaced by its model parameter."""
        params = self._model_params()
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[id(m)] for m in g["params"]]}
                for g in self.inner.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError(_READ_ONLY)

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """``engine.optimizer``'s state (the same per-parameter dicts; empty
        ones where it has none yet), keyed by the model's parameters. Never
        empty while something trains, so that DCP's ``_init_optim_state`` leaves
        the model's parameters alone: ``state_dict()`` makes a first state."""
        params, masters = self._model_params(), self._engine.layout.master_of().values()
        return defaultdict(dict, {params[id(m)]: self.inner.state.get(m, {}) for m in masters})

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        raise AttributeError(_READ_ONLY)

    def step(self, closure: Any = None) -> Any:
        """Refused: the view steps nothing."""
        raise RuntimeError("the DCP view of engine.optimizer steps nothing: train with engine.step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears its gradients when it steps."""

    def _make_state(self) -> None:
        """The first state of an optimizer that has not stepped, made as DCP
        makes it (a step of zero gradients at learning rate 0), the masters put back."""
        masters = [m for g in self.inner.param_groups for m in g["params"]]
        kept = [m.detach().clone() for m in masters]
        lrs = [g.get("lr") for g in self.inner.param_groups]
        try:
            for g in self.inner.param_groups:
                if "lr" in g:
                    g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
            for m in masters:
                m.grad = torch.zeros_like(m)
            self.inner.step()
        finally:
            for g, lr in zip(self.inner.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            with torch.no_grad():
                for m, values in zip(masters, kept):
                    m.grad = None
                    m.copy_(values)

    def state_dict(self) -> dict[str, Any]:
        """Positions as ``Optimizer.state_dict`` has them; state shaped like a master as flat DTensors."""
        engine: EngineCore = self._engine
        check_usable(engine, "get_state_dict (the optimizer)")
        self._replaced.drop()
        if not self.inner.state:  # what DCP would make: something for dcp.load to read into
            self._make_state()
        mesh, pids = flat_mesh(engine), self._pids()
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        position = 0
        for g in self.inner.param_groups:
            positions = []
            for m in g["params"]:
                shard = engine.shards[pids[id(m)]]
                start, stop = engine.layout.local_range(pids[id(m)])
                if m in self.inner.state:
                    state[position] = {k: flat_dtensor(v, shard.numel, start, stop, mesh) if _like_master(v, m) else v
                                       for k, v in self.inner.state[m].items()}
                positions.append(position)
                position += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": positions})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load DCP's state dict (keyed by the model's names) into ``engine.optimizer``,
        or refuse on every rank with nothing loaded."""
        engine: EngineCore = self._engine
        check_usable(engine, "set_state_dict (the optimizer)")
        local = Together.of(engine).agreed("set_state_dict (the optimizer)", lambda: self._checked(state_dict))
        previous = self.inner.state_dict()  # the tensors it holds, not copies
        self.inner.load_state_dict(local)
        self._replaced.hold(previous, engine.progress())

    def _checked(self, state_dict: Any) -> dict[str, Any]:
        """``state_dict`` for ``engine.optimizer``: positions, this rank's slices padded like the masters."""
        engine: EngineCore = self._engine
        saved_groups, saved_state = (state_dict.get(k) if isinstance(state_dict, dict) else None
                                     for k in ("param_groups", "state"))
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError("an optimizer state dict holds 'state' (a dict) and 'param_groups' (a list)")
        groups = self.inner.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(f"{len(saved_groups)} parameter groups in the state dict, {len(groups)} in engine.optimizer")
        mesh, pids, errors = flat_mesh(engine), self._pids(), []
        state: dict[int, dict[str, Any]] = {}
        out_groups: list[dict[str, Any]] = []
        used: set[Any] = set()
        position = 0
        for saved, group in zip(saved_groups, groups):
            keys = list(saved.get("params", []))
            names = [engine.param_names[pids[id(m)]] for m in group["params"]]
            if len(keys) != len(names):
                errors.append(f"a group of {len(keys)} parameters in the state dict, of {len(names)} in engine.optimizer")
            for key, master, name in zip(keys, group["params"], names):
                used.add(key)
                entry, held = saved_state.get(key), self.inner.state.get(master, {})
                if isinstance(key, str) and key != name:
                    errors.append(f"{key!r} in the state dict where engine.optimizer has {name!r}")
                elif entry is None and held:
                    errors.append(f"no state for {name!r}")
                elif entry is not None:
                    state[position] = self._entry(name, entry, held, master, pids[id(master)], mesh, errors)
                position += 1
            out_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                               "params": list(range(position - len(names), position))})
        errors += [f"state for {k!r}, which is not a parameter of engine.optimizer" for k in saved_state if k not in used]
        if errors:
            raise ValueError("refused, nothing was loaded: " + "; ".join(errors[:8])
                             + (f" and {len(errors) - 8} more" if len(errors) > 8 else ""))
        return {"state": state, "param_groups": out_groups}

    def _entry(self, name: str, entry: Any, held: dict[str, Any], master: torch.Tensor, pid: int,
               mesh: FlatMesh, errors: list[str]) -> dict[str, Any]:
        engine: EngineCore = self._engine
        if not isinstance(entry, dict) or (held and set(entry) != set(held)):
            errors.append(f"{name}: state {sorted(entry) if isinstance(entry, dict) else type(entry).__name__}, "
                          f"where engine.optimizer's is {sorted(held)}")
            return {}
        out: dict[str, Any] = {}
        shard = engine.shards[pid]
        for key, value in entry.items():
            now = held.get(key)
            if isinstance(value, DTensor) or _like_master(now, master) or (
                    now is None and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard.numel):
                try:
                    local = local_slice(f"{name}.{key}", value, shard, engine.layout.local_range(pid), mesh)
                except ValueError as exc:
                    errors.append(str(exc))
                    continue
                out[key] = _padded(local, now, master)
            elif isinstance(now, torch.Tensor) and getattr(value, "shape", None) != now.shape:
                errors.append(f"{name}.{key}: {getattr(value, 'shape', type(value).__name__)}, where engine.optimizer "
                              f"holds a tensor of shape {tuple(now.shape)}")
            else:
                out[key] = value
        return out


def _like_master(value: Any, master: torch.Tensor) -> bool:
    """A state tensor holding one value per element of the master (Adam's moments)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == master.shape
