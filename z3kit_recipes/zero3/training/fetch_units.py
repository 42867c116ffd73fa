"""The fetch units of the stock runtime: which hooked module gathers which parameters.

Each hooked module's fetch gathers a list of parameter ids
(``zero3.training.hook_plan`` makes them; compiled blocks become one unit
each, ``zero3.compile.compiled``). A parameter a module turns out to use
outside its own (a tied weight read by the parent) joins that module's
list (``join``). The trace sees a fetch as (module key, parameter ids,
sizes); messages see a module by its qualified name.

Pure bookkeeping over module objects and parameter ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

#: what a fetch looks like to the trace: (parameter ids, their sizes)
FetchKey = tuple[tuple[int, ...], tuple[int, ...]]


class FetchUnits:
    """The hooked modules, in hook order (the root first), with their parameters and names."""

    def __init__(self, module_params: dict[nn.Module, list[int]], numels: Sequence[int]) -> None:
        self.numels = numels
        self.regroup(module_params)

    #: grows whenever some unit's parameters change (``regroup``, ``join``): readers that derive
    #: something from the lists compare it with the value they derived it at
    version = 0

    def regroup(self, module_params: dict[nn.Module, list[int]]) -> None:
        """The units from now on (at initialize, and when compiled blocks become units)."""
        self.version += 1
        #: module -> the ids of the parameters its fetch gathers
        self.module_params = module_params
        #: module -> its key in the trace
        self.keys = {m: key for key, m in enumerate(module_params)}
        self._fetch_keys = {m: self._key_of(pids) for m, pids in module_params.items()}
        self._names = {m: name or "<root>" for name, m in _named(module_params)}
        #: module -> (its name, the elements its fetch gathers), what a step's record lists per fetch;
        #: made once here (and at ``join``), not on every fetch
        self.records = {m: (self._names[m], sum(key[1])) for m, key in self._fetch_keys.items()}

    def _key_of(self, pids: list[int]) -> FetchKey:
        return tuple(pids), tuple(self.numels[p] for p in pids)

    def fetch_key(self, module: nn.Module) -> FetchKey:
        return self._fetch_keys[module]

    def numel(self, module: nn.Module) -> int:
        """Elements ``module``'s fetch gathers."""
        return self.records[module][1]

    def name(self, module: nn.Module) -> str:
        """The module's qualified name in the model (its type for a module that is no unit)."""
        return self._names.get(module, type(module).__name__)

    def name_of_key(self, key: int) -> str:
        """The quoted name of the unit with trace key ``key``."""
        return repr(self.name(list(self.module_params)[key]))

    def is_foreign(self, module: nn.Module, pid: int) -> bool:
        """``module`` is a unit, and parameter ``pid`` is not one of its own."""
        return module in self.module_params and pid not in self.module_params[module]

    def join(self, module: nn.Module, pid: int) -> None:
        """``module`` uses parameter ``pid`` outside its owner: its fetches gather it from now on."""
        self.version += 1
        self.module_params[module].append(pid)
        self._fetch_keys[module] = key = self._key_of(self.module_params[module])
        self.records[module] = (self.name(module), sum(key[1]))

    @property
    def root(self) -> nn.Module:
        """The model: the first hooked module."""
        return next(iter(self.module_params))


def _named(module_params: dict[nn.Module, list[int]]) -> list[tuple[str, nn.Module]]:
    """Qualified names of the hooked modules (the first module is the root)."""
    modules = list(module_params)
    if not modules:
        return []
    names = {m: n for n, m in modules[0].named_modules()}
    return [(names.get(m, type(m).__name__), m) for m in modules]
