"""Who hands each gradient to the reducer: its module's post-backward, or its own hook.

Note: one hand-over per module.
    A parameter that only one hooked module fetches gets its gradient from
    that module's backward alone, so the module's post-backward hands every
    such gradient over in one call, as FSDP2 does per group and as a leaf
    unit does (``z3kit.leaf``: the autograd engine runs ``AccumulateGrad``
    nodes first, so the gradients are in ``.grad`` by then; a module whose
    inputs need no gradient is closed at the end of backward). That saves a
    Python hook call per parameter. A parameter that several modules fetch
    (a tied embedding read by the head, one used outside its module) keeps
    a gradient-ready hook of its own (``z3kit.grad_hooks``): only that
    hook knows when the last contribution has landed. The lists change
    when a unit's parameters do (``FetchUnits.version``); a parameter that
    gets a hook keeps it. Whatever is still in a module-handed ``.grad``
    at the end of backward (a contribution from outside any module) is
    handed over there, as a second arrival where the first went before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Set

from torch import nn

from z3kit_recipes.zero3.training.fetch_units import FetchUnits


class GradOwners:
    """Per hooked module, the trainable parameters whose gradients its post-backward hands over."""

    def __init__(self, units: FetchUnits, leaf_params: Set[int]) -> None:
        self.units, self.leaf_params = units, leaf_params
        self.trainable: set[int] = set()
        #: parameters with a gradient-ready hook of their own (never handed by a module)
        self.hooked: set[int] = set()
        #: module -> the parameters its post-backward hands over
        self.by_module: dict[nn.Module, list[int]] = {}
        #: every parameter some module hands over
        self.module_handed: list[int] = []
        self._version = -1

    def add_trainable(self, pids: Iterable[int]) -> list[int]:
        """``pids`` are trainable from now on; returns those that need a hook of their own now."""
        self.trainable.update(pids)
        return self.sync(force=True)

    def sync(self, *, force: bool = False) -> list[int]:
        """Redo the lists if the units changed; returns the parameters that need a hook of their own now."""
        if self._version == self.units.version and not force:
            return []
        self._version = self.units.version
        fetchers = Counter(p for pids in self.units.module_params.values() for p in set(pids))
        need = sorted(p for p in self.trainable
                      if p not in self.hooked and p not in self.leaf_params and fetchers[p] != 1)
        self.hooked.update(need)
        owned = {p for p in self.trainable if p not in self.hooked and p not in self.leaf_params}
        self.by_module = {m: [p for p in dict.fromkeys(pids) if p in owned]
                          for m, pids in self.units.module_params.items()}
        self.module_handed = sorted(owned)
        return need
