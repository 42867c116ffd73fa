"""LeafModuleHook: a whole subtree (an MoE block) treated as one unit.

Inside a mixture-of-experts block the set of experts that run depends on
the routing, which differs between ranks and between steps. Per-module
hooks there would gather and reduce different parameters on different
ranks, and a collective that one rank issues and another does not
deadlocks. A leaf unit avoids that: all of the subtree's parameters are
fetched at its entry and released at its exit, and its gradients are
reduced by one callback once the gradients of all of its inputs are done.
The callback names every parameter of the unit, ``None`` standing for the
gradient of one that received none (an expert with no tokens), so every
rank hands the same parameters, in the same order, to the reduction; the
runtime reduces zeros in their place but does not invent a gradient for
the optimizer (a parameter that no rank used is skipped by it, as DDP
leaves its ``.grad`` None).

Note: why the gradients are complete at that point.
    The callback runs from the ``PostBackward`` node on the unit's inputs
    (see ``z3kit.hooks``), after every backward op inside the unit. The
    autograd engine runs ``AccumulateGrad`` nodes as soon as they are ready
    (they have the highest priority), so a parameter used only inside the
    unit has its ``.grad`` by then. If the unit's inputs need no gradient
    the callback runs from ``ModuleHooks.finish_backward`` at the end of
    backward, when every gradient is done.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import nn

from z3kit.hooks import HookActions

#: ``(param, grad)`` of every parameter of a unit that requires grad; ``grad`` is
#: None where the parameter received none in this backward
ParamGrads = list[tuple[nn.Parameter, torch.Tensor | None]]


class LeafModuleHook:
    """Lifecycle actions for one leaf unit, to attach with ``ModuleHooks``.

    ``params`` is every parameter of the subtree (deduplicated, in
    ``module.parameters()`` order): the unit's fetch list. ``actions`` are
    the runtime's ordinary actions for the unit's root, which fetch and
    release ``params``; the unit adds the reduction: at post-backward,
    ``reduce`` receives ``(param, grad)`` for every subtree parameter that
    requires grad, ``grad`` being ``param.grad`` (None when it received
    none), and runs before ``actions.post_backward``,
    while the parameters are still gathered. The subtree's other modules
    (``submodules()``) must not be hooked on their own.
    """

    def __init__(
        self,
        module: nn.Module,
        actions: HookActions,
        reduce: Callable[[ParamGrads], None],
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"a leaf unit is an nn.Module, got {type(module).__name__}")
        self.module = module
        self.params: tuple[nn.Parameter, ...] = tuple(module.parameters())
        if not self.params:
            raise ValueError(f"leaf module {type(module).__name__} has no parameters; mark a module that owns some")
        self._inner, self._reduce = actions, reduce
        self.actions = attrs.evolve(actions, post_backward=self._on_post_backward)

    def submodules(self) -> list[nn.Module]:
        """Modules inside the unit, the root excluded."""
        return [m for m in self.module.modules() if m is not self.module]

    def gradients(self) -> ParamGrads:
        """``(param, grad or None)`` for every subtree parameter that requires grad."""
        return [(p, p.grad) for p in self.params if p.requires_grad]

    def _on_post_backward(self, module: nn.Module) -> None:
        self._reduce(self.gradients())
        self._inner.post_backward(module)
