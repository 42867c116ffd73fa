"""The model's own ``state_dict()`` and ``load_state_dict()``, made honest.

Between uses a sharded parameter is an empty placeholder, and
``nn.Module.state_dict`` would hand out its ``(0,)`` tensor as the value:
``torch.save(model.state_dict())``, Hugging Face's ``save_pretrained`` and
PEFT's adapter saves would write empty weights without a word. After
``initialize`` every module of the model carries torch's public state-dict
hooks, so that what those calls see is right or refuses.

Note: what ``model.state_dict()`` holds.
    - A trainable parameter: its full values, gathered one module at a
      time (collective: every rank calls it, and the ranks meet first on
      the notice board, as eval forwards do, so that a rank that calls it
      alone gets an error naming what the others did, never gathers paired
      with theirs; inside ``engine.gathered_parameters()``, where nothing is
      left to gather, one rank may call it alone), copied to CPU in the
      compute dtype. Tied names share one copy, as they share one parameter.
    - A frozen parameter: a ``Withheld`` tensor (``z3kit.withheld``) that
      refuses every read, naming ``engine.full_state_dict()`` and
      ``engine.save_pretrained``. Frozen weights are the base model the
      user already has; gathering them on every call would cost a whole
      model per rank, where PEFT only wants its adapter: PEFT's
      ``get_peft_model_state_dict`` reads only the adapter's entries, so it
      works and gathers only the adapter.
    - Buffers: as they are (never sharded).
    - ``keep_vars=True`` asks for the parameters themselves (identities, as
      Hugging Face uses it): they are returned as they are, not gathered.

Note: what ``model.load_state_dict()`` does.
    The outermost module's pre-hook takes every managed parameter's entry
    out of the state dict, checks all of them (full shape), has the ranks
    agree that they load the same values (a digest each; a rank that loads
    alone, or other values, is refused on every rank before anything is
    written), writes each into this rank's shard and fp32 master, and then
    tells the engine the shards changed. The entries it took are not
    reported missing. A refused load changes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from z3kit.shard import ParamStatus
from z3kit.withheld import Withheld
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.together import Together


def _frozen_reason(name: str) -> str:
    return (f"model.state_dict() does not gather the frozen parameter {name!r} (a frozen base stays sharded; "
            "trainable parameters and buffers are gathered): for every weight call engine.full_state_dict() or "
            "engine.save_pretrained(path) on every rank")


class ModelStateHooks:
    """``state_dict`` and ``load_state_dict`` hooks on every module of the engine's model (see the Notes)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._index = {id(s.param): pid for pid, s in enumerate(engine.shards)}
        self._index.update((id(s.between_uses), pid) for pid, s in enumerate(engine.shards) if s.between_uses is not None)
        self._module_names = {id(m): n for n, m in engine.module.named_modules(remove_duplicate=False)}
        self._saving = 0  # depth of the state_dict call under way
        self._keep_vars = False
        self._pinned: list[list[int]] = []
        #: the meeting of the outermost state_dict call, left when it ends
        self._meeting = contextlib.ExitStack()
        self._copies: dict[int, torch.Tensor] = {}  # one per parameter and call: tied names share it
        #: the trainable parameters, read once at the outermost call
        self._trainable: frozenset[int] = frozenset()
        self._loading = 0
        self._taken: set[str] = set()
        self.handles: list[Any] = []
        # plain functions, not bound methods: torch marks a post-hook, and a deepcopy of the model copies
        # functions by reference (a bound method would be deep-copied with this object and its engine)
        def before_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            self._before_save(module, prefix, keep_vars)

        def after_save(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self._after_save(module, state_dict, prefix, local_metadata)

        def before_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
            self._before_load(module, state_dict, prefix)

        def after_load(module: nn.Module, incompatible: Any) -> None:
            self._after_load(module, incompatible)

        for module in engine.module.modules():
            self.handles += [
                module.register_state_dict_pre_hook(before_save),
                module.register_state_dict_post_hook(after_save),
                module.register_load_state_dict_pre_hook(before_load),
                module.register_load_state_dict_post_hook(after_load),
            ]

    def _own(self, module: nn.Module) -> Iterator[tuple[str, int]]:
        """``module``'s own managed parameters: (name, id)."""
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            pid = self._index.get(id(p))
            if pid is not None:
                yield name, pid

    def _what(self, module: nn.Module, call: str) -> str:
        name = self._module_names.get(id(module), "")
        return f"{name or 'model'}.{call}"

    # -- state_dict ----------------------------------------------------------------------------------
    def _before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        outermost = self._saving == 0
        if outermost:
            self._keep_vars = keep_vars
        self._saving += 1
        if self._keep_vars:
            return
        try:
            if outermost:
                self.engine.check_idle("model.state_dict()")
                self._copies = {}
                self._trainable = frozenset(self.engine.trainable)  # once per call, not per module
                if not self._all_gathered(module):  # inside gathered_parameters() a rank may save alone
                    self._enter_meeting(self._what(module, "state_dict()"))
            pids = sorted({pid for _, pid in self._own(module) if pid in self._trainable})
            self.engine.coordinator.pin(pids)
        except BaseException:  # no post-hook will run for this call: undo all of it
            for pinned in self._pinned:
                self.engine.coordinator.unpin(pinned)
            self._pinned, self._saving, self._copies = [], 0, {}
            self._leave_meeting()
            raise
        self._pinned.append(pids)

    def _after_save(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        self._saving -= 1
        if self._keep_vars:
            return
        pids = self._pinned.pop()
        try:
            for name, pid in self._own(module):
                key = prefix + name
                if key not in state_dict:
                    continue
                if pid in self._trainable:
                    if pid not in self._copies:
                        self._copies[pid] = self.engine.shards[pid].param.detach().to("cpu", copy=True)
                    state_dict[key] = self._copies[pid]
                else:
                    shard = self.engine.shards[pid]
                    state_dict[key] = Withheld(tuple(shard.shape), shard.param.dtype, torch.device("cpu"),
                                               _frozen_reason(key))
        finally:
            self.engine.coordinator.unpin(pids)
            if self._saving == 0:
                self._copies = {}
                self._leave_meeting()

    def _all_gathered(self, module: nn.Module) -> bool:
        """Every trainable parameter under ``module`` is gathered already: its state needs no collective."""
        return all(self.engine.shards[pid].status is ParamStatus.AVAILABLE
                   for p in module.parameters() if (pid := self._index.get(id(p))) is not None and pid in self._trainable)

    def _enter_meeting(self, what: str) -> None:
        self._meeting.enter_context(self.engine.parts.meeting.collective_call(what))

    def _leave_meeting(self) -> None:
        self._meeting.close()

    # -- load_state_dict -----------------------------------------------------------------------------
    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        self._loading += 1
        if self._loading > 1:
            return  # the outermost call took every entry of the subtree
        self._taken = set()
        try:
            self._load_subtree(module, state_dict, prefix)
        except BaseException:
            self._loading = 0
            raise

    def _load_subtree(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        engine = self.engine
        engine.check_idle("model.load_state_dict()")
        entries: dict[str, tuple[int, Any]] = {}
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            pid = self._index.get(id(p))
            if pid is not None and name in state_dict:
                entries[name] = (pid, state_dict[name])
        with engine.parts.meeting.collective_call(self._what(module, "load_state_dict()")):
            together = Together.of(engine)
            fulls = together.agreed("model.load_state_dict()", lambda: self._checked(entries))
            digests = together.exchange(_digest(fulls))
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            if differ:
                raise ValueError(
                    f"model.load_state_dict() got other values on rank(s) {differ} than on rank 0: every rank must "
                    "load the same state dict (each rank writes its own shard from it); nothing was loaded")
            engine.synchronize()  # a refresh of the persistent parameters may still read the shards
            for pid, full in fulls.items():
                start, stop = engine.layout.local_range(pid)
                engine.layout.fill_local(pid, full[start:stop].to(engine.device), keep_rounded=True)
            engine.shards_changed(list(fulls))
        for key in entries:
            del state_dict[key]
        self._taken = set(entries)

    def _checked(self, entries: dict[str, tuple[int, Any]]) -> dict[int, torch.Tensor]:
        """Each parameter's flat full values in its dtype (the first of its names), or the errors of all."""
        fulls: dict[int, torch.Tensor] = {}
        errors = []
        for key, (pid, value) in entries.items():
            shard = self.engine.shards[pid]
            if isinstance(value, Withheld):
                errors.append(f"{key}: a withheld entry (a frozen parameter of a model.state_dict()); load full "
                              "values (engine.full_state_dict()), or leave it out and pass strict=False")
            elif not isinstance(value, torch.Tensor):
                errors.append(f"{key}: not a tensor ({type(value).__name__})")
            elif tuple(value.shape) != tuple(shard.shape):
                errors.append(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(shard.shape)} in the model")
            elif pid not in fulls:
                fulls[pid] = value.detach().reshape(-1).to(shard.param.dtype)
        if errors:
            raise ValueError("model.load_state_dict() refused, nothing was loaded: " + "; ".join(errors))
        return fulls

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        self._loading -= 1
        if self._loading == 0 and self._taken:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._taken]
            self._taken = set()


def _digest(fulls: dict[int, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for pid, full in sorted(fulls.items()):
        h.update(pid.to_bytes(8, "little"))
        h.update(full.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
