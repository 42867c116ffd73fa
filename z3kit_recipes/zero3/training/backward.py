"""The backward pass of the stock runtime: gradients handed over, and its end.

``BackwardPass`` hands the trainable parameters' gradients to the reducer:
each hooked module's post-backward hands over those only it fetches, in
one call, and a parameter that several modules fetch has a grad-ready hook
of its own (``zero3.training.grad_owners``; a leaf unit hands its
parameters' gradients over in one call too). It queues
the end-of-backward callback from inside the first backward hook, and at the
end of backward fetches the schedule's remaining entries, finishes the
reductions, has the ranks compare what they did (``zero3.ranks.agreement``) and
frees every gathered parameter.

Note: the module hooks are made here.
    The module hooks (``z3kit.hooks.ModuleHooks``) fire the coordinator's
    fetch and release and this pass's pre-backward, and this pass ends each
    backward through them (``finish_backward``, ``reset``). So the pass
    makes them, with its own bound methods, and attaches every hooked
    module (a leaf unit's root with the unit's actions, whose reduction is
    this pass's too): each object is made from objects that exist.
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set

import torch
from torch import nn

from z3kit.grad_hooks import on_grad_accumulated
from z3kit.hook_context import at_backward_end, in_backward
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.leaf import LeafModuleHook, ParamGrads
from z3kit.shard import ParamShard
from z3kit.sharded_param import take_accumulated_grad
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree, StepRecord
from z3kit_recipes.zero3.ranks.fetch_agreement import FetchAgreement
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
from z3kit_recipes.zero3.step.state import Phase, StepState
from z3kit_recipes.zero3.training.backward_once import OneBackwardPerForward
from z3kit_recipes.zero3.training.grad_owners import GradOwners
from z3kit_recipes.zero3.training.grad_stand_ins import GradStandIns
from z3kit_recipes.zero3.training.grads import GradReducer
from z3kit_recipes.zero3.training.params import ParamCoordinator
from z3kit_recipes.zero3.training.step_checks import StepChecks


class BackwardPass:
    """Gradients into the reducer; the end-of-backward epilogue (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        names: Sequence[str],
        trainable: Sequence[int],
        masters: Sequence[nn.Parameter],
        leaf_roots: Set[nn.Module],
        *,
        coordinator: ParamCoordinator,
        reducer: GradReducer | None,
        record: StepRecord,
        watch: RankWatch,
        agreement: FetchAgreement,
        step: StepState,
        defer_reductions: bool,
        engine_backward_required: bool = False,
    ) -> None:
        self.shards, self.names, self.trainable = shards, names, trainable
        #: each parameter, by id (read once per gradient: not through its shard)
        self.params = [s.param for s in shards]
        self.coordinator, self.reducer, self.record = coordinator, reducer, record
        self.watch, self.agreement = watch, agreement
        #: where the step is: the backward opens and closes it
        self.step = step
        #: what the module hooks do (see the Note): a leaf unit's root gets the unit's version of them
        self.actions = HookActions(
            pre_forward=coordinator.fetch, post_forward=coordinator.forward_exit,
            pre_backward=self.pre_backward, post_backward=self.post_backward,
        )
        self.hooks = ModuleHooks(self.actions)
        leaf_params: set[int] = set()
        for m in coordinator.module_params:
            if m in leaf_roots:
                unit = LeafModuleHook(m, self.actions, self.reduce_leaf)
                leaf_params.update(coordinator.index[id(p)] for p in unit.params)
                self.hooks.attach(m, unit.actions)
            else:
                self.hooks.attach(m)
        #: parameters of leaf units, whose gradients the unit hands over
        self.leaf_params = frozenset(leaf_params)
        #: which module hands over which gradient, and which parameters have a hook of their own
        self.owners = GradOwners(coordinator.units, self.leaf_params)
        #: refuses a second backward over one forward (see ``zero3.training.backward_once``)
        self.once = OneBackwardPerForward(watch, self.hooks, record, coordinator.root,
                                          engine_backward_required=engine_backward_required)
        #: seconds spent finishing the ranks' comparison of a backward
        self.check_s = 0.0
        #: the step checks in flight and what they taught (``zero3.training.step_checks``)
        self.checks = None if reducer is None else StepChecks(
            reducer, watch, agreement.device, names, global_step=lambda: step.global_step,
            defer_all=defer_reductions)
        #: what ``param.grad`` holds between backward and step (``zero3.training.grad_stand_ins``)
        self.stand_ins = GradStandIns(self.params, names, trainable, masters, shards[0].world if shards else 1)
        self._grad_handles: list[torch.utils.hooks.RemovableHandle] = []  # kept so the hooks can be removed
        #: parameters whose sharded form hands its gradients over (``watch_external_gradients``)
        self._external: set[int] = set()
        self.watch_gradients(trainable)

    def watch_gradients(self, pids: Sequence[int]) -> None:
        """Hand the gradients of ``pids`` to the reducer from now on (at initialize, and when they are unfrozen)."""
        self._hook(self.owners.add_trainable(pids))
        self.watch_external_gradients(pids)

    def watch_external_gradients(self, pids: Sequence[int]) -> None:
        """Hand the gradients that uses outside a module's forward accumulate in
        the sharded parameters of ``pids`` to the reducer (``take_external_grad``)."""
        for pid in pids:
            sharded = self.shards[pid].between_uses
            if sharded is None or pid in self._external:
                continue
            self._external.add(pid)
            with torch._C.DisableTorchFunctionSubclass():  # on the sharded tensor itself, not its parameter
                sharded.requires_grad_(True)
                self._grad_handles.append(on_grad_accumulated(sharded, self.take_external_grad, pid))

    def _hook(self, pids: Sequence[int]) -> None:
        self._grad_handles += [on_grad_accumulated(self.shards[p].param, self._on_grad_ready, p) for p in pids]

    def post_backward(self, module: torch.nn.Module) -> None:
        """The module's backward is done: the gradients only it fetches, handed over; its parameters released."""
        self._hand_over_held(self.owners.by_module.get(module, ()))
        self.coordinator.release(module)

    def _hand_over_held(self, pids: Sequence[int]) -> None:
        """Hand over what ``.grad`` of each of ``pids`` holds, if anything."""
        params = self.params
        for pid in pids:
            param = params[pid]
            grad = param.grad
            if grad is not None:
                self._hand_over(pid, param, grad)

    def _on_grad_ready(self, param: torch.Tensor, pid: int) -> None:
        self.hooks.work.hooks += 1
        if param.grad is not None:
            self._hand_over(pid, param, param.grad)

    def _hand_over(self, pid: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A full gradient is ready: into the reducer, out of ``param.grad``."""
        if self.reducer is None:
            return
        self.queue_epilogue()
        self.reducer.add(pid, grad)
        param.grad = None

    def take_external_grad(self, sharded: torch.Tensor, pid: int) -> None:
        """A gradient accumulated in a sharded parameter itself (a use outside a
        module's forward: ``zero3.runtime.between_uses``): into the reducer."""
        grad = take_accumulated_grad(sharded)
        if grad is None or self.reducer is None or pid not in self.trainable:
            return
        self.hooks.work.hooks += 1
        self.queue_epilogue()
        self.reducer.add(pid, grad)

    def reduce_leaf(self, grads: ParamGrads) -> None:
        """A leaf unit's gradients, all at once (``LeafModuleHook``); one
        that got none here is reduced as zeros without counting as arrived."""
        for param, grad in grads:
            pid = self.coordinator.index[id(param)]
            if grad is not None:
                self._hand_over(pid, param, grad)
            elif self.reducer is not None:
                self.queue_epilogue()
                self.reducer.skip(pid)

    def pre_backward(self, module: torch.nn.Module) -> None:
        self.queue_epilogue()
        self.coordinator.fetch_for_backward(module)

    def queue_epilogue(self) -> None:
        """Queue the end-of-backward callback once per backward, from inside
        it (the first hook to fire is the root's, in the outermost backward)."""
        if self.step.phase is Phase.BACKWARD or not in_backward():
            return
        self._hook(self.owners.sync())  # a parameter that joined another unit since the last backward
        self.once.backward_starts()
        self.step.start_backward()
        at_backward_end(self.end)

    def host_waits(self) -> int:
        """Reads of the ranks' comparisons that had to wait for the device (``Zero3Stats.host_waits``)."""
        return self.agreement.host_waits + (0 if self.checks is None else self.checks.host_waits)

    def settle_checks(self) -> None:
        """Apply the step checks still in flight (collective; ``StepChecks.settle``)."""
        if self.checks is not None:
            self.checks.settle()

    def complete_checks(self) -> None:
        """Let the step checks' collectives in flight finish, reading nothing (``StepChecks.complete``)."""
        if self.checks is not None:
            self.checks.complete()

    def discard_cleared(self) -> None:
        """Drop from the window the gradients the user's code set to None since
        the last backward and before any ``step()`` call, as they are gone under
        DDP (``zero3.training.grad_stand_ins``); the next step check compares
        which across ranks."""
        pids = self.stand_ins.take_cleared()
        # cleared after a step() call instead: a DeepSpeed loop's zero_grad after every step() call,
        # inside a window that step() kept open (as DeepSpeed keeps it)
        if pids and self.reducer is not None and self.step.backward_since_step_call:
            self.reducer.discard(pids)
            self.record.note_discarded([self.names[p] for p in pids])

    def take_back_stand_ins(self) -> None:
        """Before a training pass accumulates into ``.grad`` again: what the user
        cleared is discarded, then the stand-ins are taken away."""
        self.discard_cleared()
        self.stand_ins.clear()

    def before_step(self) -> None:
        """The optimizer step is next: what got a gradient in the window is settled (``zero3.training.step_checks``)."""
        if self.checks is not None:
            self.checks.before_step()

    def abort(self, *, ranks_in_step: bool) -> None:
        """A backward that reached a hook of ours raised (``ranks_in_step``:
        on every rank at the same point): no epilogue comes; its gradients
        are dropped. (One refused before it reached a hook of ours changed
        nothing, and keeps the window: the engine does not call this.)"""
        if self.reducer is not None:
            self.reducer.abort_backward(ranks_in_step=ranks_in_step)

    def end(self) -> None:
        """End of backward (or a backward that reached no hook of ours)."""
        try:
            self.hooks.finish_backward()
            self._hand_over_held(self.owners.module_handed)  # a contribution from outside any module (grad_owners)
            self.coordinator.finish_schedule()
            self.coordinator.finish_rounds()
            if self.reducer is not None and self.checks is not None:
                self.reducer.finish()  # every reduction issued, before the check: one order on every rank
                started = time.perf_counter()
                try:
                    self.agreement.settle()
                    # with rank-divergent graphs the ranks' fetches differ by design (``zero3.training.rounds``)
                    record = self.record if self.coordinator.rounds is None else StepRecord()
                    self.checks.end_of_backward(self.trainable, record, self.step.micro_step)
                except RanksDisagree as exc:
                    self.step.broken = str(exc)  # every rank raised it: none may go on alone
                    raise
                finally:
                    self.record.clear()
                    self.check_s += time.perf_counter() - started
            late = [self.names[p] for p in self.leaf_params if self.shards[p].param.grad is not None]
            if late:
                raise RuntimeError(
                    f"gradients of leaf-unit parameters {late[:5]} arrived after their unit was reduced; "
                    "a parameter of a leaf module is being used outside it"
                )
        finally:
            self.coordinator.end_step()
            self.hooks.reset()
            self.step.close_step()
        self.step.micro_step += 1
        if self.reducer is not None and self.reducer.window_open:
            self.stand_ins.show()
        self.coordinator.plan_step()  # last: a refused plan (PlanError) leaves the step closed
