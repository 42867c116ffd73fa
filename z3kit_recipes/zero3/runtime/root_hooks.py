"""The root's pre-forward and post-forward: the engine's part of every
forward of the model, called through the engine (``engine(x)``) or on the
model itself (``model(x)``, as Hugging Face Trainer-style code and eval
code do), as FSDP2's root pre-forward is.

Note: what the root's hooks do.
    The pre-forward hook refuses a forward once the ranks no longer run
    together or the model's parameters changed, joins the round of an
    ``engine.join()`` block, keeps the arguments that block may repeat,
    casts floating-point inputs to the compute dtype and, in a training
    forward, applies unfreezing, starts the traced step and broadcasts the
    buffers; then it enters the ``ForwardContext`` (``ParamUseMode``: a
    parent that uses a child's weight finds it gathered). The post-forward
    hook leaves that context and, after an eval forward, frees what it
    gathered. A forward that raises is aborted (``EngineCore._abort``:
    the other ranks learn of it) once, by whichever part sees it first.

Note: the order among the root's hooks.
    The pre-forward hook is prepended after the runtime's other root hooks
    are registered, so it runs first: before the eval meeting
    (``zero3.ranks.uneven``), which reads whether a training step is open, before
    the root's own fetch (``z3kit.hooks``), which must run under the mode,
    and before the forward count (``zero3.training.backward_once``). The
    post-forward hook is appended last, so the root's release runs under
    the mode too, and it is ``always_call``: torch runs it when the
    forward, or a hook before it, raises. It then runs inside torch's
    ``except`` clause, where ``sys.exc_info()`` holds the failure; an
    exception that was being handled where the model was called (a forward
    run from an ``except`` block) is told apart by identity.

Note: nested calls.
    The root called inside its own forward (a forward that calls the model
    again) belongs to the outer forward: its hooks do nothing. A call is
    nested while the frame of the outer call of the root
    (``nn.Module.__call__``) is still on the stack; frames are kept, not
    counted, so that a forward whose post-forward never ran is not taken
    for an outer one forever (next Note). Forwards inside a backward
    (recomputations of activation checkpointing) are backward's.

Note: failures a hook cannot see.
    torch runs ``always_call`` hooks for an ``Exception`` only (not for a
    ``KeyboardInterrupt``), and not when the root is compiled in place
    (dynamo traces ``Module.__call__`` without its ``except`` clause).
    Such a forward ends with its post-forward not run. ``engine(x)``
    catches it itself and aborts it; after ``model(x)``, the next forward
    of the root, ``backward``, ``step`` and whatever refuses to run inside
    a forward find the call's frame gone and abort it then (``settle``),
    before they start.

Note: a root compiled in place.
    After ``model.compile()`` a call of the model enters compiled code
    before any hook of the root runs, and a stance set inside that call
    does not reach it, so the forwards that must run eagerly to learn
    parameter uses (``zero3.compile.compiled``) cannot be made eager from the hook.
    ``engine(x)`` therefore starts the forward itself before the call, and
    the pre-forward hook takes it over; a direct call of such a model is
    refused at once, before it starts anything, naming the ways that work
    (``engine.generate``'s own forwards are let through, as they were
    before these hooks; their learning forward runs compiled). A
    ``torch.compile(model)`` wrapper given to ``initialize`` is the root,
    and its hooks run before its compiled forward: called directly, it
    works. A wrapper made after ``initialize`` cannot be told from inside
    its call: its learning forwards run compiled.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from z3kit.dynamo import is_compile_wrapper, is_compiled
from z3kit.hook_context import in_backward, outside_graphs
from z3kit.nested import map_tensors
from z3kit_recipes.zero3.runtime.build import EngineParts
from z3kit_recipes.zero3.runtime.call_frames import call_frame, on_stack
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.ranks.rank_watch import RankFailed
from z3kit_recipes.zero3.step.state import Forward, Phase

#: a forward's arguments: (args, kwargs)
Arguments = tuple[tuple[Any, ...], dict[str, Any]]


class JoinRounds(Protocol):
    """An ``engine.join()`` block under way, as the root's pre-forward sees it (``zero3.lockstep.join.Join``)."""

    def before_forward(self, training: bool) -> None:
        """This rank's own forward starts (before any collective of it): its round."""
        ...


class ForwardLost(RuntimeError):
    """A forward of the model ended without its post-forward hook (see the Note on failures a hook cannot see)."""


class BackwardLost(RuntimeError):
    """A backward reached a hook of the engine and never its end: a plain ``loss.backward()`` that raised."""


LOST_BACKWARD = ("loss.backward() did not reach its end on this rank: it raised (the exception is in this rank's "
                 "own traceback) or was interrupted")


LOST = ("the model's previous forward ended without finishing (interrupted, or raised inside a compiled root) "
        "and is aborted now")
COMPILED_ROOT = (
    "this model was compiled in place (model.compile()), so a call of it starts inside compiled code, before the "
    "engine's root hook could run the forwards that learn parameter uses eagerly (see "
    "z3kit_recipes.zero3.compile.compiled); call it through the engine (engine(x)), compile its blocks instead "
    "(block.compile()), or pass torch.compile(model) to zero3.initialize"
)


class RootForward:
    """The root's pre-forward and post-forward hooks (see the module Notes)."""

    def __init__(self, parts: EngineParts, abort: Callable[[str, BaseException], None]) -> None:
        self.parts = parts
        self._abort = abort
        #: the ``engine.join()`` block under way, if any (see ``zero3.lockstep.join``)
        self.join: JoinRounds | None = None
        #: this rank's last forward of each kind (training or not): its arguments, repeated in ``engine.join()``
        self.last: dict[bool, Arguments] = {}
        #: started by ``engine(x)`` before the call of a root compiled in place, whose pre-forward takes it over
        self._handed = False
        #: the frames of the root's calls under way, outermost first (None where no frame was found)
        self._calls: list[FrameType | None] = []
        #: what the forward entered (the ForwardContext)
        self._contexts: contextlib.ExitStack | None = None
        #: the exception being handled where the forward was called (see the Note on order)
        self._handled: BaseException | None = None
        self._engine_forwards = 0

        @outside_graphs
        def pre_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if module is not root:  # a copy of the model (copy.deepcopy) carries this hook: not ours
                return None
            return self._pre_forward(module, args, kwargs)

        @outside_graphs
        def post_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if module is root:
                self._post_forward()

        root = parts.module
        self._handles = [
            root.register_forward_pre_hook(pre_forward, with_kwargs=True, prepend=True),
            root.register_forward_hook(post_forward, with_kwargs=True, always_call=True),
        ]

    @property
    def _started(self) -> bool:
        """A forward started and has not finished (``StepState.forward``)."""
        return self.parts.step_state.forward is not None

    # -- engine(x) and the checks of other calls ---------------------------------------------
    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``engine(x)``: the model's own call, and a failure its hooks could not see aborted here."""
        root = self.parts.module
        self.settle()
        if not self._started and starts_compiled(root):
            args, kwargs = self._start(root, args, kwargs)
            self._handed = True
        try:
            return root(*args, **kwargs)
        except BaseException as exc:
            broken = self.parts.watch.broken  # before this rank's own failure is posted
            self._settle(exc)
            if broken is not None and isinstance(exc, RuntimeError) and not isinstance(exc, RanksDisagree):
                raise RankFailed(broken) from exc  # the watcher broke the engine and aborted its group: that is why
            raise

    def settle(self) -> None:
        """Abort a forward that ended without its post-forward (see the Note on failures a hook cannot see),
        or a backward that ended without its end."""
        if self._started:
            self._settle(ForwardLost(LOST))
        self.settle_backward()

    def settle_backward(self) -> None:
        """A backward that started and never ended, seen from outside any
        backward, raised: a plain ``loss.backward()``, with no engine call
        around it to post why, so it is posted now (named by the exception
        being handled here, if any), before this rank goes on to collectives
        the others would take for a departure from the recorded step. Raises
        ``RankFailed`` unless every rank failed at the same point."""
        if self.parts.step_state.phase is not Phase.BACKWARD or in_backward():
            return
        handled = sys.exc_info()[1]
        self._abort("backward", BackwardLost(LOST_BACKWARD) if handled is None else handled)
        if self.parts.watch.broken is not None:
            raise RankFailed(self.parts.watch.broken)

    def _settle(self, exc: BaseException) -> None:
        if self._started and not (self._calls and on_stack(self._calls[0])):
            self._fail(exc)

    @contextlib.contextmanager
    def engine_forwards(self) -> Iterator[None]:
        """Forwards the engine runs itself (``generate``'s): not kept for
        ``engine.join()`` to repeat (they hold the key/value cache), and
        let through on a root compiled in place (see the Note on compiled roots)."""
        self._engine_forwards += 1
        try:
            yield
        finally:
            self._engine_forwards -= 1

    # -- the hooks ------------------------------------------------------------------------------
    def _pre_forward(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if in_backward():
            return None  # a recomputation of activation checkpointing: backward's, not a forward
        self.settle_backward()
        frame = call_frame()
        if self._handed:  # engine(x) started this forward already (a root compiled in place)
            self._handed = False
            self._calls.append(frame)
            return None
        if self._started:
            if self._calls and on_stack(self._calls[0]):
                self._calls.append(frame)  # a nested call: the outer forward's
                return None
            self._fail(ForwardLost(LOST))
        if starts_compiled(root) and not self._engine_forwards:
            raise RuntimeError(COMPILED_ROOT)
        args, kwargs = self._start(root, args, kwargs)
        self._calls.append(frame)
        return args, kwargs

    def _start(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Arguments:
        """The forward's start (see the Note on what the root's hooks do); the arguments to run it on."""
        parts = self.parts
        parts.watch.check("forward")
        parts.model_watch.check_parameters()
        # A traced training step is a grad-enabled forward in train mode. An
        # eval() forward with grad on is usually not followed by a backward,
        # so it must not keep parameters gathered for one.
        training = torch.is_grad_enabled() and root.training
        if training and parts.config.micro_batch_size is not None:
            try:
                _check_batch(parts.config.micro_batch_size, args, kwargs)  # before the forward starts anything
            except ValueError as exc:
                self._abort("forward", exc)  # posted: a rank whose batch alone is short stops the others too
                raise
        if self.join is not None:  # before any collective of the forward (see zero3.lockstep.join)
            self.join.before_forward(training)
        if not self._engine_forwards:
            self.last[training] = (args, kwargs)
        dtype = parts.config.torch_dtype
        if dtype != torch.float32:
            args, kwargs = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
        if torch.is_grad_enabled():  # its backward accumulates into .grad: no stand-in may be there
            parts.backward.take_back_stand_ins()
        parts.step_state.start_forward(training=training)
        self._handled = sys.exc_info()[1]
        contexts = self._contexts = contextlib.ExitStack()
        try:
            if training:
                parts.trainable_watch.follow()
                parts.stats.training_forward()
                parts.coordinator.begin_step()
                # the step is open before the first collective (the buffers'), so that
                # the notice board places this rank in its training forward while it waits
                parts.step_state.open_step()
                if parts.config.broadcast_buffers and parts.world > 1:
                    parts.model_watch.broadcast_buffers(parts.group, parts.log, parts.watch.wait)
            contexts.enter_context(parts.forward_context)
        except BaseException as exc:
            self._fail(exc)
            raise
        return args, kwargs

    def _post_forward(self) -> None:
        frame = call_frame()
        # this call, and calls inside it whose post-forward never ran
        mine = [i for i, f in enumerate(self._calls) if f is frame]
        if not mine:
            return  # a call whose pre-forward started nothing (a recomputation, a forward refused at once)
        del self._calls[mine[-1]:]
        if self._calls:
            return  # a nested call ended: the outer forward goes on
        failed = sys.exc_info()[1]
        if failed is not None and failed is not self._handled:
            self._fail(failed)  # run from torch's except clause: the forward raised
            return
        contexts, self._contexts = self._contexts, None
        self._handled = None
        untraced = self.parts.step_state.forward is Forward.UNTRACED
        try:
            if contexts is not None:
                contexts.close()
            if untraced:
                self.parts.meeting.finish()  # its fetches compared, before its output is handed back
        except BaseException as exc:
            self._abort("forward", exc)
            raise
        finally:
            self.parts.step_state.end_forward()
        if untraced:
            self.parts.coordinator.finish_rounds()
            self.parts.coordinator.release_all()

    def _fail(self, exc: BaseException) -> None:
        """The forward under way raised ``exc``: leave its contexts, abort it (once: it is over)."""
        self._calls.clear()
        contexts, self._contexts = self._contexts, None
        self._handed, self._handled = False, None
        try:
            if contexts is not None:
                contexts.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self._abort("forward", exc)  # the step state is aborted with the forward


def _check_batch(micro: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a training batch of another size than the config's micro batch
    (dim 0 of the forward's first tensor argument): DeepSpeed's batch
    arithmetic (``train_batch_size``) and the user's would silently differ.
    The data gives each rank the same batch size, so every rank refuses alike."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if first is not None and first.shape[0] != micro:
        raise ValueError(
            f"this training batch has {first.shape[0]} samples (dim 0 of the forward's first tensor argument), but "
            f"the config's train_micro_batch_size_per_gpu is {micro}: feed {micro} samples per rank and forward "
            "(drop_last=True in the DataLoader, say), or set train_micro_batch_size_per_gpu to the data's batch size")


def starts_compiled(root: nn.Module) -> bool:
    """A call of ``root`` starts inside compiled code: it was compiled in place
    (``model.compile()``). A ``torch.compile(model)`` wrapper runs its hooks
    before its compiled forward."""
    return is_compiled(root) and not is_compile_wrapper(root)
