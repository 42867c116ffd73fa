"""``EngineCore``: forward, backward and step over the assembled parts.

This is the engine without its features: what ``zero3.runtime.build`` made,
run. The features (weights in and out, ``engine.join()``,
``engine.generate``) are given an ``EngineCore`` and use its public surface;
the public ``Zero3Engine`` (``zero3.engine``) is this core with their
methods added, and the map of the data flow is its module docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from z3kit.freed_heap import PROCESS_HEAP
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.ranks.rank_watch import RankFailed
from z3kit_recipes.zero3.runtime.between_uses import ParamsBetweenUses
from z3kit_recipes.zero3.runtime.build import EngineParts
from z3kit_recipes.zero3.runtime.monitor import StepMonitor
from z3kit_recipes.zero3.runtime.progress import report_progress
from z3kit_recipes.zero3.runtime.root_hooks import RootForward
from z3kit_recipes.zero3.runtime.stats import Zero3Stats, collect_stats
from z3kit_recipes.zero3.step.state import Phase
from z3kit_recipes.zero3.training.timeline import TimelineEvent


class EngineCore:
    """Forward, backward and step of a model sharded by ``zero3.initialize`` (see the module docstring)."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.module, self.zero3_config, self.group, self.device = parts.module, parts.config, parts.group, parts.device
        self.rank, self.world, self.log, self.memory = parts.rank, parts.world, parts.log, parts.memory
        #: the shard group and the replicas (``zero3.ranks.topology``); ``group`` is every rank
        self.topology = parts.topology
        self.layout, self.shards, self.masters = parts.layout, parts.layout.shards, parts.layout.masters
        self.trainable, self.param_names = parts.layout.trainable, parts.param_names
        #: None for an inference-only engine (``initialize(model, optimizer=None)``)
        self.optimizer = parts.optimizer
        #: the DeepSpeed JSON's learning-rate schedule, stepped after each optimizer step (None: none)
        self.lr_scheduler = parts.lr_scheduler
        self.coordinator, self.reducer, self.limiter = parts.coordinator, parts.reducer, parts.limiter
        self.trace, self.watch = parts.trace, parts.watch
        #: where the engine is in its training step (``zero3.step.state``)
        self.step_state = parts.step_state
        #: the knobs ``config.memory_budget`` was turned into, when it is set
        self.memory_plan = parts.memory_plan
        #: the root's pre- and post-forward hooks: every forward's start and end (``zero3.runtime.root_hooks``)
        self.forwards = RootForward(parts, self._abort)
        #: what the modules hold between uses: honest sharded parameters (``zero3.runtime.between_uses``)
        self.between_uses = ParamsBetweenUses(parts, shards_changed=self.shards_changed, check_idle=self.check_idle)
        config = self.zero3_config
        micro = config.micro_batch_size
        #: rank 0's TensorBoard / CSV monitors (``Zero3Config.monitors``), None where none writes
        self.monitor = StepMonitor.open(config.monitors, self.rank, None if micro is None else
                                        micro * config.gradient_accumulation_steps * self.world)
        if config.steps_per_print is not None and self.optimizer is not None and self.rank == 0:
            report_progress(0, 0, self.optimizer, self.rank)  # DeepSpeed's line once its optimizer is built

    @property
    def global_step(self) -> int:
        return self.step_state.global_step

    @property
    def micro_step(self) -> int:
        return self.step_state.micro_step

    @property
    def phase(self) -> Phase:
        return self.step_state.phase

    @property
    def timeline(self) -> list[TimelineEvent]:
        """The parameter timeline of the last captured step (see ``capture_timeline``)."""
        return self.parts.timeline.last

    # -- forward ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward: ``engine(x)`` is ``model(x)``, whose root hooks
        do the engine's part (see ``zero3.runtime.root_hooks``)."""
        return self.forwards.call(args, kwargs)

    def _abort(self, what: str, exc: BaseException) -> None:
        """A forward or backward raised: forget what was in progress, free what was gathered."""
        position = self.parts.record.gathers, len(self.parts.record.fetches)
        self.parts.record.clear()
        self.parts.hooks.reset()
        self.coordinator.abort(ranks_broken=self.step_state.broken is not None)
        self.parts.backward.stand_ins.clear()
        was = self.step_state.abort()
        self.watch.failed_here(what, exc, position)
        if was is Phase.BACKWARD:  # after failed_here: it tells whether every rank failed at this point
            self.parts.backward.abort(ranks_in_step=self.step_state.broken is None)

    # -- backward --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; gradients are averaged over ranks and over the
        ``gradient_accumulation_steps`` micro-steps. fp16: the loss is
        multiplied by the loss scale first (``zero3.training.loss_scale``)."""
        self.require_optimizer("backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward needs the loss tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad()?")
        self.forwards.settle()  # before the check: aborting a lost forward may leave the ranks apart
        self.watch.check("backward")
        self.parts.backward.take_back_stand_ins()
        before = self.step_state.micro_step
        try:
            self.parts.backward.once.check()  # refused before autograd runs, so that _abort posts it once
            scaler = self.parts.loss_scaler
            self.parts.backward.once.in_engine_backward = True
            (loss if scaler is None else scaler.scale_loss(loss)).backward()
        except BaseException as exc:
            broken = self.watch.broken  # before this rank's own failure is posted
            self._abort("backward", exc)
            if broken is not None and isinstance(exc, RuntimeError) and not isinstance(exc, RanksDisagree):
                raise RankFailed(broken) from exc  # the watcher broke the engine and aborted its group: that is why
            raise
        finally:
            self.parts.backward.once.in_engine_backward = False
        if self.step_state.micro_step == before:  # nothing in backward reached a hook of ours
            self.parts.backward.end()
        if self.monitor is not None:
            self.monitor.loss(loss)

    # -- optimizer step --------------------------------------------------------------------
    def is_accumulation_boundary(self) -> bool:
        return self.step_state.micro_step % self.zero3_config.gradient_accumulation_steps == 0

    def step(self) -> bool:
        """Optimizer step at a gradient-accumulation boundary (returns True),
        otherwise nothing (False). Grads are cleared after the step. fp16: a
        step whose gradients overflowed is skipped on every rank at its
        boundary (still True; ``last_step_skipped``, ``stats().skipped_steps``)."""
        self.require_optimizer("step()")
        self.forwards.settle()
        self.watch.check("step()")
        if not self.step_state.backward_since_step_call:
            raise RuntimeError(
                "step() called without a backward since the last step(): run engine.backward(loss) "
                "(or loss.backward()) first"
            )
        self.parts.backward.discard_cleared()  # before this call counts as one (discard_cleared)
        self.step_state.micro_at_step_call = self.step_state.micro_step
        if not self.is_accumulation_boundary():
            return False
        if self.parts.optimizer_step is not None:
            self.parts.backward.before_step()
            stepped = self.parts.optimizer_step.run()
            self.parts.backward.stand_ins.clear()
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step()  # once per optimizer step, after it, as DeepSpeed's engine does
        # every shard, stepped or not: what the window kept for its backwards (hpZ's slices) is freed;
        # persistent parameters that an offloaded step is still writing are gathered by the next
        # forward as it needs them, not here, where the gather would wait for the host (host_step's Note)
        step = self.parts.optimizer_step
        self.shards_changed(written_later=frozenset() if step is None else step.written_later())
        self.step_state.global_step += 1
        if self.monitor is not None:  # after the scheduler's step: the lr the next step uses, as DeepSpeed writes
            scaler = self.parts.loss_scaler
            self.monitor.step(self.global_step, None if self.optimizer is None else self.optimizer.param_groups[0]["lr"],
                              None if scaler is None else scaler.scale)
        every = self.zero3_config.steps_per_print
        if every is not None and self.rank == 0 and self.global_step % every == 0:  # DeepSpeed's progress line
            report_progress(self.global_step, self.skipped_steps, self.optimizer, self.rank)
        self.parts.stats.optimizer_step()
        self.parts.timeline.step_boundary()
        PROCESS_HEAP.step_ended()  # the host heap the step freed goes back to the kernel (z3kit.freed_heap)
        return True

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for an fp16 gradient overflow."""
        return self.parts.loss_scaler is not None and self.parts.loss_scaler.last_skipped

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for an fp16 gradient overflow (DeepSpeed's ``skipped_steps``)."""
        return 0 if self.parts.loss_scaler is None else self.parts.loss_scaler.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm the last optimizer step measured before
        clipping (None: no clipping, or no step yet). Reading it waits for
        the device; the step itself never does."""
        return None if self.parts.optimizer_step is None else self.parts.optimizer_step.last_grad_norm

    def capture_timeline(self) -> None:
        """Record every fetch, prefetch and release of the next optimizer step
        (from the step() after this call to the following one) into ``timeline``."""
        self.parts.timeline.arm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the window's gradients at its boundary (its last backward
        ran, no step was taken); inside an accumulation window keep them, as
        DeepSpeed does, so that a loop that clears after every ``step()``
        call accumulates (``set_to_none``: accepted as ``nn.Module.zero_grad``
        takes it)."""
        if self.reducer is None or not self.is_accumulation_boundary():
            return
        self.settle()
        self.reducer.end_window()
        self.parts.backward.stand_ins.clear()
        if self.parts.optimizer_step is not None:
            self.parts.optimizer_step.requested_clip = 0.0

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the window's gradients by their global 2-norm at this window's
        optimizer step, as ``torch.nn.utils.clip_grad_norm_`` does under DDP
        (collective: every rank calls it), and return that norm now, on the
        device. With ``gradient_clipping`` set too, the smaller limit holds."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
            raise ValueError(f"clip_grad_norm_ needs a positive finite max_norm, got {max_norm!r}")
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_ computes the 2-norm (norm_type=2.0) only, got norm_type={norm_type!r}")
        self.require_optimizer("clip_grad_norm_()")
        self.forwards.settle()
        self.watch.check("clip_grad_norm_()")
        if self.step_state.busy:
            raise RuntimeError("clip_grad_norm_() cannot be used inside a forward or backward")
        if self.parts.optimizer_step is None:
            raise RuntimeError("clip_grad_norm_() needs gradients, and this engine has no trainable parameters")
        self.parts.backward.discard_cleared()  # a norm without what the user's code set to None
        return self.parts.optimizer_step.request_clip(float(max_norm))

    def no_sync(self) -> Any:
        """Refused, as DeepSpeed refuses it under ZeRO-3: gradients are reduced as they arrive."""
        raise RuntimeError(
            "engine.no_sync() does not apply to ZeRO-3: each gradient is reduced into its rank's partition as it "
            "arrives, so there is no reduction to skip. Accumulate with Zero3Config(gradient_accumulation_steps=k) "
            "(or the JSON's gradient_accumulation_steps) and call engine.backward(loss) and engine.step() on every "
            "micro-step; step() takes the optimizer step at the window's end")

    # -- between steps -------------------------------------------------------------------------
    def check_idle(self, what: str) -> None:
        """Refuse ``what`` inside a forward or backward, or once the ranks no
        longer run together; else wait for an optimizer step still running."""
        self.forwards.settle()
        self.watch.check(what)
        if self.step_state.busy:
            raise RuntimeError(f"{what} cannot be used inside a forward or backward")
        self.settle()

    def settle(self) -> None:
        """Wait for an optimizer step still running on the host (``zero3.training.offload``)."""
        if self.parts.optimizer_step is not None:
            self.parts.optimizer_step.settle()

    def shards_changed(self, pids: Iterable[int] | None = None, *,
                       written_later: frozenset[int] = frozenset()) -> None:
        """The shards (and masters) of ``pids`` were written: drop every copy
        made from them. ``pids``: parameter ids, positions in ``shards`` and
        ``param_names``; None: every parameter. Collective: every rank calls
        it with the same ``pids``, between forwards (inside a forward or a
        backward it raises). ``written_later``: ids whose shards are still
        being written (``step()`` with the optimizer offloaded): their
        persistent copies are gathered again by their next use, not now.

        Note: one owner for "the shards changed".
            Every path that writes shard values ends here, once it has
            written them: the optimizer step (``step()``; with the optimizer
            offloaded, the host step writes the shards behind the next
            forward, and every gather waits for its own parameters' update:
            ``zero3.training.host_step``), the loads (``load_checkpoint``,
            ``load_pretrained``, ``load_deepspeed_checkpoint``), and an edit
            under ``gathered_parameters(modifier_rank=...)``; a writer
            first calls ``check_idle``, which waits for a host step still
            running. What is dropped (``ParamCoordinator.shards_changed``):
            hpZ's secondary slices (freed: no backward can use them), the
            gathered copies (persistent and pinned ones are gathered again),
            the gathers in flight, and the prefetch position in the trace.
            Unfreezing writes no shard: a new master starts from its shard's
            values (``zero3.training.trainable``)."""
        if self.step_state.busy:
            raise RuntimeError("the shards cannot change inside a forward or backward")
        changed = range(len(self.shards)) if pids is None else sorted(set(pids))
        wrong = [p for p in changed if not (isinstance(p, int) and 0 <= p < len(self.shards))]
        if wrong:
            raise ValueError(f"shards_changed takes parameter ids in [0, {len(self.shards)}), got {wrong[:4]}")
        self.coordinator.shards_changed(changed, written_later=written_later)

    def require_optimizer(self, what: str) -> torch.optim.Optimizer:
        """The optimizer, or a clear error for an inference-only engine."""
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs an optimizer, and this engine was initialized with optimizer=None")
        return self.optimizer

    def progress(self) -> tuple[int, int]:
        """(optimizer steps taken, backwards completed)."""
        return self.step_state.global_step, self.step_state.micro_step

    def restore_progress(self, global_step: int, micro_step: int, *, window_open: bool) -> None:
        """Counters of a resumed run (``window_open``: backwards since its last optimizer step)."""
        self.step_state.global_step, self.step_state.micro_step = global_step, micro_step
        self.step_state.micro_at_step_call = micro_step - 1 if window_open else micro_step
        if self.parts.optimizer_step is not None:
            self.parts.optimizer_step.measure_state()

    def synchronize(self) -> None:
        """Wait for this rank's communication in flight (``step()`` leaves the
        persistent parameters' refresh gathering, unless an offloaded step
        still writes them) and for an offloaded
        optimizer step still running on the host. Call it before stopping a
        torch profiler: a gloo work issued under the profiler and completed
        after it stopped can crash the process."""
        self.settle()
        self.coordinator.gatherer.wait_inflight()
        self.parts.backward.complete_checks()  # issued by the last backward, read by the next one
        self.parts.gather_streams.synchronize()
        self.parts.reduce_streams.synchronize()

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> Zero3Stats:
        self.settle()
        return collect_stats(self.parts)

    def gathered_numel(self) -> int:
        """Elements of full parameter storage held right now, measured on the
        tensors (padding included), gathers in flight included (their
        buffers exist already)."""
        installed = sum(s.held_numel() for s in self.shards)
        return installed + self.coordinator.gatherer.staging_numel()
