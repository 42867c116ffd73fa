"""Module hooks: the four points of a module's parameter lifecycle.

``ModuleHooks`` calls user-supplied actions at a module's pre-forward,
post-forward, pre-backward and post-backward. Forward points are torch's
module forward hooks. The backward points hang on the autograd graph of
each call:

* pre-backward: a pre-hook on the autograd node that made each output
  runs when the gradients of that node's outputs arrive, i.e. before the
  module's own backward ops, and fires *pre-backward* (once per call and
  backward pass: the first of the call's nodes to run fires it);
* post-backward: inputs pass through ``PostBackward``, a
  ``torch.autograd.Function``: its backward runs once the gradients of all
  of the call's inputs are computed, i.e. after the module's backward ops,
  and marks the call done.

Both are ``z3kit.backward_points``' (with why pre-backward is a node
pre-hook, and what its Functions do with outputs and unused gradients).

Note: outputs an inner call returned.
    A module that returns a hooked child's output as it is (a container, a
    model returning its head's logits) must fire its pre-backward before
    the child's, as the outer call it is. Pre-hooks on one node run in the
    order they were added, the child's first; so such an output passes
    through ``PreBackward`` instead, whose node runs before the child's.

Note: reference counting.
    A module called k times in one forward has k calls in flight in
    backward: pre-backward fires k times (each call's output gradients
    arrive separately). A call counts as open from its pre-backward until
    its input gradients are done; post-backward fires when a module has no
    open call left, so calls whose backwards interleave do not release
    parameters another call still needs. A call whose pre-backward never
    fires (its outputs got no gradient, or it was a recomputation whose
    graph was discarded by non-reentrant checkpointing) is never counted.

Note: modules whose inputs need no gradient.
    Their ``PostBackward`` node never runs (nothing flows to it), so the
    module would stay open. ``finish_backward()``, called from the
    end-of-backward callback, fires post-backward for every module still
    open, so everything is released by the end of backward at the latest.

Note: chains.
    In a sequence of hooked modules each call's only input that needs a
    gradient is usually the previous call's output (a decoder layer's
    hidden states, beside masks and positions that need none). The
    pre-hook on that output's node runs once the gradient of that tensor
    is done, i.e. after the later call's backward ops, so it can mark the
    later call's input gradients done too, just before it fires its own
    pre-backward: the later call then needs no ``PostBackward`` node of
    its own, and a chain of hooked modules adds no autograd node at all.

Note: hook bodies run with torch-function dispatch disabled.
    Wrapping, gathering and releasing are bookkeeping: a runtime watching
    parameter use through a ``TorchFunctionMode`` must not see them, and
    skipping their Python dispatch keeps the per-module cost low.

Note: hooks under torch.compile.
    The forward hooks are wrapped in ``torch.compiler.disable``
    (``outside_graphs``), as FSDP2 wraps its own: no hook body (a
    ``param.data`` swap, a collective, a counter) is ever traced. A hook
    called from compiled code breaks the graph and runs eagerly; a module
    compiled on its own runs its hooks outside its compiled forward, which
    stays one graph. The backward points are node pre-hooks and Functions
    those hooks add.

Outputs and inputs may be tensors or any nesting of tuples, lists, dicts,
dataclasses and namedtuples; only tensors that require grad are wrapped,
and ``nn.Parameter`` objects are passed through untouched so that a
consumer sees the parameter itself. State lives in this object's side
tables, never on the modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from z3kit.backward_points import (
    BackwardEntry, BackwardPoints, PostBackward, PreBackward, needing_points, replaced, through,
)
from z3kit.hook_context import in_backward, outside_graphs
from z3kit.host_work import HostWork


@attrs.frozen
class HookActions:
    """What to do at each point. ``post_forward`` also receives the outputs
    (a runtime keeps parameters that a module returns gathered)."""

    pre_forward: Callable[[nn.Module], None]
    post_forward: Callable[[nn.Module, Any], None]
    pre_backward: Callable[[nn.Module], None]
    post_backward: Callable[[nn.Module], None]


@attrs.define(eq=False)
class _Call:
    """One forward call of a hooked module, as seen by backward."""

    module: nn.Module
    actions: HookActions
    #: len(active) when its forward started, and whether that was a recomputation
    depth: int = 0
    recompute: bool = False
    #: counted in ``ModuleHooks._open`` (pre-backward fired, post-backward not yet)
    open: bool = False


#: outputs remembered before the dead ones among them are dropped (forwards that never see a backward)
_WATCHED_PRUNE_AT = 4096


class ModuleHooks:
    """Fires lifecycle actions for the modules attached to it.

    ``attach(module, actions)`` hooks one module (``actions`` defaults to
    the ones given at construction). ``active`` is the stack of modules
    whose forward is running, innermost last. ``finish_backward()`` must be
    called at the end of each backward (see the Note on modules whose
    inputs need no gradient).
    """

    def __init__(self, actions: HookActions, work: HostWork | None = None) -> None:
        self.default_actions = actions
        #: the hook calls and Function applications counted (``z3kit.host_work``)
        self.work = HostWork() if work is None else work
        self.active: list[nn.Module] = []
        self._handles: dict[nn.Module, list[RemovableHandle]] = {}
        self._actions: dict[nn.Module, HookActions] = {}
        self._calls: dict[nn.Module, list[_Call]] = {}
        self._open: dict[nn.Module, list[_Call]] = {}
        #: what the backward points of every call fire (``z3kit.backward_points``)
        self._points = BackwardPoints(opened=self._pre_backward, closed=self._post_backward, work=self.work)
        #: outputs whose node carries an entry since the last reset, by id (see the Note on outputs
        #: an inner call returned)
        self._watched: dict[int, weakref.ref[torch.Tensor]] = {}
        self._prune_at = _WATCHED_PRUNE_AT
        #: the last call's only output (a weak reference) and its entry: a call taking it is chained
        self._last_output: tuple[weakref.ref[torch.Tensor], BackwardEntry] | None = None

    def attach(self, module: nn.Module, actions: HookActions | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"can only hook an nn.Module, got {type(module).__name__}")
        if module in self._handles:
            raise ValueError(f"{type(module).__name__} is already hooked; detach it first")
        self._actions[module] = actions or self.default_actions

        @outside_graphs
        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if mod is not module:  # a copy of the module (copy.deepcopy) carries this hook: not ours
                return None
            self.work.hooks += 1
            with torch._C.DisableTorchFunction():
                return self._pre_forward(mod, self._actions[module], args, kwargs)

        @outside_graphs
        def post(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if mod is not module:
                return None
            self.work.hooks += 1
            with torch._C.DisableTorchFunction():
                return self._post_forward(mod, self._actions[module], output)

        self._handles[module] = [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post),
        ]

    def detach(self, module: nn.Module) -> None:
        for handle in self._handles.pop(module, []):
            handle.remove()
        self._calls.pop(module, None)
        self._actions.pop(module, None)

    def actions_of(self, module: nn.Module) -> HookActions:
        """The actions ``module`` was attached with (or given by ``set_actions``)."""
        return self._actions[module]

    def set_actions(self, module: nn.Module, actions: HookActions) -> None:
        """Fire ``actions`` for ``module`` from its next call on (it stays
        attached: its hooks keep their place among the module's other hooks)."""
        if module not in self._actions:
            raise ValueError(f"{type(module).__name__} is not hooked; attach it first")
        self._actions[module] = actions

    def detach_all(self) -> None:
        for module in list(self._handles):
            self.detach(module)

    @property
    def modules(self) -> list[nn.Module]:
        return list(self._handles)

    @property
    def watched_outputs(self) -> int:
        """Outputs remembered as carrying a pre-hook of these hooks since the last reset (see the
        Note on outputs an inner call returned): those alive, and dead ones not yet forgotten."""
        return len(self._watched)

    def innermost(self) -> nn.Module | None:
        """The innermost hooked module whose forward is running, if any."""
        return self.active[-1] if self.active else None

    def open_modules(self) -> list[nn.Module]:
        """Modules with a backward call in progress."""
        return list(self._open)

    def reset(self) -> None:
        """Forget calls in progress (after an exception aborted a forward or backward)."""
        self.active.clear()
        self._calls.clear()
        self._last_output = None
        self._watched = {}
        self._close_all()

    # -- forward --------------------------------------------------------------
    def _pre_forward(
        self, module: nn.Module, actions: HookActions, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        actions.pre_forward(module)
        call = _Call(module, actions, depth=len(self.active), recompute=in_backward())
        self.active.append(module)
        self._calls.setdefault(module, []).append(call)
        if not torch.is_grad_enabled():
            return None
        single = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
        targets = needing_points(args[0] if single else (args, kwargs))
        if not targets:
            return None
        last = self._last_output
        if len(targets) == 1 and last is not None and last[0]() is targets[0]:
            # the only input that needs a gradient is the previous call's only output: a chain
            last[1].closes.append(call)
            return None
        wrapped = through(self.work, PostBackward, self._points, call, *targets)
        if single:
            return wrapped, kwargs
        return replaced((args, kwargs), targets, wrapped)

    def _post_forward(self, module: nn.Module, actions: HookActions, output: Any) -> Any:
        calls = self._calls.get(module)
        call = calls.pop() if calls else _Call(module, actions)
        if self.active and self.active[-1] is module:
            self.active.pop()
        actions.post_forward(module, output)
        if not torch.is_grad_enabled():
            return None
        single = isinstance(output, torch.Tensor)
        targets = needing_points(output)
        if not targets:
            return None
        entry = BackwardEntry(self._points, call)
        passed = []  # through PreBackward (see the Note on outputs an inner call returned)
        watched = self._watched
        for t in targets:
            node = t.grad_fn
            seen = watched.get(id(t))
            if node is None or (seen is not None and seen() is t):
                passed.append(t)
            else:
                node.register_prehook(entry)
                watched[id(t)] = weakref.ref(t)
        if len(watched) > self._prune_at:  # forwards without a backward: forget the dead
            self._watched = {k: r for k, r in watched.items() if r() is not None}
            self._prune_at = max(_WATCHED_PRUNE_AT, 2 * len(self._watched))
        if not passed:
            if len(targets) == 1:  # what a chained call would take as its input
                self._last_output = (weakref.ref(targets[0]), entry)
            return None
        wrapped = through(self.work, PreBackward, entry, *passed)
        return wrapped[0] if single else replaced(output, passed, wrapped)

    # -- backward -------------------------------------------------------------
    # A call is open from its pre-backward to its post-backward, then closed:
    # a second backward through a retained graph fires both points again.
    def _pre_backward(self, call: _Call) -> None:
        if call.open:
            return
        call.open = True
        self._open.setdefault(call.module, []).append(call)
        call.actions.pre_backward(call.module)

    def _post_backward(self, call: _Call) -> None:
        if not call.open:
            return
        call.open = False
        calls = self._open[call.module]
        calls.remove(call)
        if calls:
            return
        del self._open[call.module]
        call.actions.post_backward(call.module)

    def _close_all(self) -> list[tuple[nn.Module, HookActions]]:
        """Close every open call; ``(module, actions)`` of each module that had one."""
        closed = []
        for module, calls in self._open.items():
            for call in calls:
                call.open = False
            closed.append((module, calls[0].actions))
        self._open.clear()
        return closed

    def _drop_unfinished_recomputations(self) -> None:
        """Note: recomputations that stop early.
        Non-reentrant checkpointing stops a recomputation (by raising inside
        it) as soon as it has the tensors backward needs, so the post-forward
        of the modules it was inside never runs. Their entries would stay on
        ``active`` and in the call stacks for good; at the end of backward
        every recomputation is over, so they are dropped here."""
        unfinished = [c for calls in self._calls.values() for c in calls if c.recompute]
        if not unfinished:
            return
        del self.active[min(c.depth for c in unfinished) :]
        for calls in self._calls.values():
            calls[:] = [c for c in calls if not c.recompute]

    def finish_backward(self) -> list[nn.Module]:
        """Fire post-backward for every module still open, the most recently
        opened first (children before their parents, as in backward);
        returns them in that order. Also drops the forward state of
        recomputations that stopped early."""
        self._drop_unfinished_recomputations()
        closed = self._close_all()[::-1]
        for module, actions in closed:
            actions.post_backward(module)
        return [module for module, _ in closed]
