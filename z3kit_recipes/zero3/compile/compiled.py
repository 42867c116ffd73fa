"""torch.compile with the zero3 runtime: per-block and whole-model.

Users compile the way they would without z3kit: ``block.compile()`` (or
``model.layers[i] = torch.compile(block)``) on the model's repeated blocks,
or ``model.compile()`` / ``torch.compile(model)`` on the whole model,
before or after ``zero3.initialize``. This module makes the runtime fit
around the compiled code; the engine's forward runs inside a
``ForwardContext``.

Note: what never runs inside a compiled graph.
    Gathering and releasing (the ``param.data`` swaps, the collectives),
    the backward hooks and every counter of the runtime run in hooks that
    ``z3kit.hooks`` keeps out of compiled code (``torch._dynamo.disable``).
    Parameter-use tracking (``ParamUseMode``, a ``TorchFunctionMode``) is
    off inside compiled modules; see the Note on learning forwards.

Note: a compiled block is one fetch unit.
    A compiled submodule fetches its whole subtree at its own hooks
    (``hook_plan.fetch_groups``), which run outside its compiled forward, so
    the block's forward is one graph that finds every parameter gathered:
    no hook inside it breaks the graph. Identical blocks share that graph
    (dynamo makes a module's parameters graph inputs, so identical blocks
    pass the same guards). Blocks compiled after ``initialize`` are noticed at the next
    forward and regrouped the same way, between steps (the trace is then
    recorded again). A compiled root is not a unit (that would gather the
    whole model at once): under whole-model compile every module that owns
    parameters keeps its own hooks, and each of them is a graph break (its
    pre- and post-forward hook run eagerly between two graphs).

Note: learning forwards.
    Inside compiled code nothing can watch which parameters a module uses
    (dynamo would trace the mode, and guard on the identity of every tensor
    it looks up). So the forwards that find out run eagerly, with the mode
    on, under ``torch.compiler.set_stance("force_eager")``: a training
    forward while the trace is being recorded (the first step, and the step
    after anything invalidated the trace), and the first forward outside
    training after the fetch groups were set. A parameter used outside its
    module (a tied weight read by the parent) is added to the user's fetch
    list there, as in eager runs, so compiled forwards later find it
    gathered. In compiled forwards the mode stays on outside compiled
    modules and is popped off the mode stack for the time a compiled
    module runs (its hooks do that; under whole-model compile the root's
    hooks, for the whole forward), so dynamo never sees it. Seen by
    dynamo, the mode would also meet a torch 2.13 bug: with it on the stack,
    the resume function after a graph break in a Hugging Face
    ``LlamaModel.forward`` passed a ``torch.Size`` as ``device`` to
    ``torch.arange``. ``ParamUseMode`` itself passes every call through
    unwatched while dynamo traces, should anything compiled run under it.

Note: no recompilation.
    Dynamo guards on a parameter's size, stride, dtype, device and
    ``requires_grad``; a gathered parameter has the same ones every step
    (``param.data`` is a view of offset 0 of its own full buffer). A
    compiled region is only entered with its parameters gathered, so no
    guard sees a released (empty) parameter. The full buffer keeps one
    storage for the whole run (its bytes are freed and given back in
    place), so tensors a compiled graph saved for backward read the
    re-gathered values. CUDA graphs (``mode="reduce-overhead"``) are not
    supported: gathered parameters change address from step to step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn.modules import module as module_registry

from z3kit.dynamo import compile_totals, current_function_mode, is_compiled, on_frame_compiled
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.trace import TraceState
from z3kit_recipes.zero3.step.state import Forward, Phase, StepState
from z3kit_recipes.zero3.training.hook_plan import compiled_units, fetch_groups
from z3kit_recipes.zero3.training.param_use import ParamUseMode
from z3kit_recipes.zero3.training.params import ParamCoordinator


@attrs.frozen
class CompileCounts:
    """torch.compile's work in a span of time (process-wide: dynamo counts every compilation)."""

    #: graphs compiled (dynamo's ``unique_graphs``)
    graphs: int = 0
    #: frames compiled again after a guard failed on an earlier compilation
    recompiles: int = 0
    #: graph breaks met while compiling (each one is a fallback to eager at run time, every call)
    graph_breaks: int = 0

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(
            max(0, self.graphs - other.graphs),
            max(0, self.recompiles - other.recompiles),
            max(0, self.graph_breaks - other.graph_breaks),
        )


@attrs.frozen
class CompileStats:
    """How the model is compiled and what compiling cost (``Zero3Stats.compile``).

    ``last_step`` counts what was compiled from the first training forward
    after the previous optimizer step to the last one: zero once the
    compiled code is warm (no graph compiled, no recompilation per step).
    ``total`` counts since the engine first found compiled code.
    """

    #: compiled blocks, each gathered as one unit
    units: tuple[str, ...]
    #: the root is compiled (``model.compile()`` / ``torch.compile(model)``)
    whole_model: bool
    #: forwards run eagerly to learn parameter uses (see the Note on learning forwards)
    eager_forwards: int
    last_step: CompileCounts
    total: CompileCounts


class ForwardContext:
    """What surrounds each forward of a ``Zero3Engine``: ``ParamUseMode``,
    and, once anything in the model is compiled, the fetch units of compiled
    blocks, the learning forwards and the compile counters (see the Notes).

    Cheap without torch.compile: one look at each module per forward, to
    find compiled ones; the mode is pushed and popped as before.
    """

    def __init__(
        self,
        mode: ParamUseMode,
        module: nn.Module,
        hooks: ModuleHooks,
        coordinator: ParamCoordinator,
        leaves: Iterable[nn.Module],
        units: Iterable[nn.Module],
        step: StepState,
    ) -> None:
        self._mode = mode
        self._model, self._hooks, self._coordinator = module, hooks, coordinator
        self._leaves = list(leaves)
        self._fetch_units = list(units)  # the fetch units (``zero3.training.unit_rule``)
        #: where the step is; this context sets whether the forward under way learns (``StepState.learning``)
        self._step = step
        #: the model's modules, listed again after a module registration anywhere
        self._modules: list[nn.Module] | None = None
        #: compiled modules of the model at the last sync, by id
        self._compiled: tuple[int, ...] = ()
        #: hooked compiled modules -> the actions they had before this context wrapped them
        self._wrapped: dict[nn.Module, HookActions] = {}
        self._units: tuple[str, ...] = ()
        self._whole_model = False
        self._eval_learned = False
        self._stance: Any = None
        #: per compiled-module call in progress: whether its pre-forward popped the mode
        self._suspended: list[bool] = []
        self._eager_forwards = 0
        self._recompiles = 0
        self._counting = False
        self._window_step = -1
        self._window_start = CompileCounts()
        self._first = CompileCounts()
        self._last_step = CompileCounts()
        self_ref = weakref.ref(self)

        def on_registration(owner: nn.Module, name: str, value: Any) -> None:
            live = self_ref()
            if live is not None:
                live._modules = None

        weakref.finalize(self, module_registry.register_module_module_registration_hook(on_registration).remove)

    # -- the forward --------------------------------------------------------------------------
    def __enter__(self) -> ForwardContext:
        # entered at the start of a root forward (``zero3.runtime.root_hooks``): the step state knows its kind
        training = self._step.forward is Forward.TRAINING
        self._sync(training)
        self._suspended.clear()
        step = self._step
        step.learning = False
        if self._compiled and not torch.compiler.is_compiling():
            self._roll_window()
            if training:
                step.learning = self._coordinator.trace.state is not TraceState.COMPLETE
            else:
                step.learning = not self._eval_learned
            if step.learning:
                self._eager_forwards += 1
                self._stance = torch.compiler.set_stance("force_eager")
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # a compiled module that raised never ran its post-forward: the mode is off the stack already
        if not any(self._suspended):
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self._suspended.clear()
        if self._stance is not None:
            self._stance.__exit__(exc_type, exc, tb)
            self._stance = None
            if exc is None and self._step.forward is not Forward.TRAINING:
                self._eval_learned = True
        self._step.learning = False

    # -- the mode around compiled modules --------------------------------------------------------
    def _suspend(self) -> None:
        """Pre-forward of a compiled module: pop the mode (unless learning) until its post-forward."""
        popped = False
        if not self._step.learning and current_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            popped = True
        self._suspended.append(popped)

    def _resume(self) -> None:
        if self._suspended and self._suspended.pop():
            self._mode.__enter__()  # type: ignore[no-untyped-call]

    def _wrap(self, actions: HookActions) -> HookActions:
        def pre_forward(module: nn.Module) -> None:
            actions.pre_forward(module)
            self._suspend()

        def post_forward(module: nn.Module, output: Any) -> None:
            self._resume()
            actions.post_forward(module, output)

        return attrs.evolve(actions, pre_forward=pre_forward, post_forward=post_forward)

    # -- finding compiled modules --------------------------------------------------------------
    def _sync(self, training: bool) -> None:
        modules = self._modules
        if modules is None:
            modules = self._modules = list(self._model.modules())
        compiled = tuple(id(m) for m in modules if is_compiled(m))
        if compiled == self._compiled:
            return
        # only between steps: at the start of the forward that opened a training step
        # (the trace counts fetches from the step's start), or of a forward outside a
        # training step; else look again at the next forward
        if not (self._step.first_forward_of_step if training else self._step.phase is Phase.IDLE):
            return
        self._compiled = compiled
        if compiled and not self._counting:
            self._start_counting()
        self._regroup()

    def _regroup(self) -> None:
        """Fetch units for the compiled blocks (only when they changed), and
        the mode's suspension around every hooked compiled module."""
        model, hooks, coordinator = self._model, self._hooks, self._coordinator
        groups = fetch_groups(model, [s.param for s in coordinator.shards], self._leaves, self._fetch_units)
        old = coordinator.module_params
        if list(groups) != list(old):
            parents = {child: parent for parent in model.modules() for child in parent.children()}
            for m, pids in old.items():
                owner: nn.Module | None = m
                while owner is not None and owner not in groups:
                    owner = parents.get(owner)
                if owner is None:  # no longer part of the model
                    continue
                target = groups[owner]
                target.extend(p for p in pids if p not in target)  # what it learned it uses goes along
            for m in hooks.modules:
                if m not in groups:
                    hooks.detach(m)
                    self._wrapped.pop(m, None)
            attached = set(hooks.modules)
            for m in groups:
                if m not in attached:
                    hooks.attach(m)
            coordinator.regroup(groups)  # the trace records afresh
            self._eval_learned = False
        units = compiled_units(model, self._leaves)
        for m in hooks.modules:
            if (m in units or is_compiled(m)) and m not in self._wrapped:
                self._wrapped[m] = hooks.actions_of(m)
                hooks.set_actions(m, self._wrap(self._wrapped[m]))
        names = {m: name for name, m in model.named_modules()}
        self._units = tuple(names[m] for m in units)
        self._whole_model = is_compiled(model)

    # -- counting -------------------------------------------------------------------------------
    def _start_counting(self) -> None:
        self_ref = weakref.ref(self)

        def on_compiled(frame_compile_id: int) -> None:
            live = self_ref()
            if live is not None and frame_compile_id > 0:
                live._recompiles += 1

        weakref.finalize(self, on_frame_compiled(on_compiled))
        self._counting = True
        self._first = self._window_start = self._counts()

    def _counts(self) -> CompileCounts:
        graphs, graph_breaks = compile_totals()
        return CompileCounts(graphs=graphs, recompiles=self._recompiles, graph_breaks=graph_breaks)

    def _roll_window(self) -> None:
        """Close the per-step window once an optimizer step was taken since it opened."""
        step = self._step.global_step
        if step != self._window_step:
            now = self._counts()
            if self._window_step >= 0:
                self._last_step = now - self._window_start
            self._window_start, self._window_step = now, step

    def stats(self) -> CompileStats | None:
        """None while nothing in the model is compiled."""
        if not self._compiled:
            return None
        self._roll_window()
        return CompileStats(
            units=self._units,
            whole_model=self._whole_model,
            eager_forwards=self._eager_forwards,
            last_step=self._last_step,
            total=self._counts() - self._first,
        )
