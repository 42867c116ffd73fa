"""Parameters used outside their module, seen through a TorchFunctionMode.

Note: parameters used outside their module.
    A module may use a parameter it does not own (``F.linear(x,
    self.embed.weight)`` in a parent, tied weights) or return one of its own
    parameters for another module to use. ``ParamUseMode`` sees every torch
    call during the engine's forward; when a managed parameter shows up in
    a module that does not list it, the parameter is gathered if needed and
    added to that module's list for good, so later fetches (and backward)
    gather it with the module. The changed fetch list invalidates the trace
    once, and the next step records the new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from z3kit.hooks import ModuleHooks
from z3kit_recipes.zero3.training.params import ParamCoordinator


_is_compiling = torch.compiler.is_compiling

#: reads whose answer does not depend on a parameter being gathered: not a use
_METADATA_READS = frozenset(
    getattr(torch.Tensor, name).__get__
    for name in ("dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda", "grad")
)


class ParamUseMode(TorchFunctionMode):
    """Sees the parameters passed to every torch call in the engine's forward
    (see the Note on parameters used outside their module). Reading a
    parameter's dtype or device is not a use of it."""

    def __init__(self, coordinator: ParamCoordinator, hooks: ModuleHooks) -> None:
        super().__init__()
        self.coordinator, self.hooks = coordinator, hooks

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_compiling():  # traced by torch.compile: not watched (see zero3.compile.compiled)
            return func(*args, **kwargs)
        self.hooks.work.torch_functions += 1
        if func in _METADATA_READS:
            return func(*args, **kwargs)
        index = self.coordinator.index
        for arg in (*args, *kwargs.values()) if kwargs else args:
            pid = index.get(id(arg))
            if pid is not None:
                self.coordinator.on_param_use(pid, self.hooks.innermost())
            elif type(arg) is list or type(arg) is tuple:
                for item in arg:
                    pid = index.get(id(item))
                    if pid is not None:
                        self.coordinator.on_param_use(pid, self.hooks.innermost())
        return func(*args, **kwargs)
