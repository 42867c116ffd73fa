"""Zero3Engine: the stock ZeRO-3 runtime, one part per stage of the data flow.

    initialize  (zero3.initialize) arguments checked; (zero3.runtime.build) the parts
                made: full parameter -> ShardLayout (1/N shards, fp32 masters)
    forward     ParamCoordinator (zero3.training.params): pre-forward fetch (trace,
                agreement, prefetch through the Gatherer, zero3.training.gathers)
                -> compute -> post-forward release (ReleasePolicy)
    backward    BackwardPass (zero3.training.backward): pre-backward fetch -> compute
                -> grad-ready hook -> GradReducer (zero3.training.grads: FlatBucket ->
                reduce -> GradPartitionBuffer) -> post-backward release;
                end-of-backward epilogue (ranks compared, everything freed)
    step        OptimizerStep (zero3.training.optim_step): clip -> optimizer on the
                master shards -> write back to the shards
    stats       StepStats (zero3.runtime.stats) -> Zero3Stats

Every gather and reduction runs on a stream pair and is completed by its one
owner (the Gatherer, the GradReducer); see ``z3kit.streams``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from z3kit_recipes.zero3.weights import full_values
from z3kit_recipes.zero3.runtime.build import EngineParts
from z3kit_recipes.zero3.lockstep.join import Join
from z3kit_recipes.zero3.training.phase import Phase
from z3kit_recipes.zero3.weights.pretrained import DEFAULT_MAX_SHARD_BYTES
from z3kit_recipes.zero3.runtime.root_hooks import RootForward
from z3kit_recipes.zero3.runtime.stats import Zero3Stats, collect_stats
from z3kit_recipes.zero3.training.timeline import TimelineEvent


class Zero3Engine:
    """A model trained with ZeRO-3 sharding. Build it with ``zero3.initialize``."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.module, self.config, self.group, self.device = parts.module, parts.config, parts.group, parts.device
        self.rank, self.world, self.log, self.memory = parts.rank, parts.world, parts.log, parts.memory
        self.layout, self.shards, self.masters = parts.layout, parts.layout.shards, parts.layout.masters
        self.trainable, self.param_names = parts.layout.trainable, parts.param_names
        #: None for an inference-only engine (``initialize(model, optimizer=None)``)
        self.optimizer = parts.optimizer
        self.coordinator, self.reducer, self.limiter = parts.coordinator, parts.reducer, parts.limiter
        self.trace, self.training_state, self.watch = parts.trace, parts.training_state, parts.watch
        #: the knobs ``config.memory_budget`` was turned into, when it is set
        self.memory_plan = parts.memory_plan
        #: the root's pre- and post-forward hooks: every forward's start and end (``zero3.runtime.root_hooks``)
        self.forwards = RootForward(parts, self._abort)

    @property
    def global_step(self) -> int:
        return self.training_state.global_step

    @property
    def micro_step(self) -> int:
        return self.training_state.micro_step

    @property
    def phase(self) -> Phase:
        return self.training_state.phase

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
        self.coordinator.abort(ranks_broken=self.watch.broken is not None)
        self.training_state.phase = Phase.IDLE
        self.watch.failed_here(what, exc, position)
        if what == "backward":  # after failed_here: it tells whether every rank failed at this point
            self.parts.backward.abort(ranks_in_step=self.watch.broken is None)

    # -- backward --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; gradients are averaged over ranks and over the
        ``gradient_accumulation_steps`` micro-steps (no loss scaling needed)."""
        self.require_optimizer("backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward needs the loss tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad()?")
        self.forwards.settle()  # before the check: aborting a lost forward may leave the ranks apart
        self.watch.check("backward")
        before = self.training_state.micro_step
        try:
            self.parts.backward.once.check()  # refused before autograd runs, so that _abort posts it once
            loss.backward()
        except BaseException as exc:
            self._abort("backward", exc)
            raise
        if self.training_state.micro_step == before:  # nothing in backward reached a hook of ours
            self.parts.backward.end()

    # -- optimizer step --------------------------------------------------------------------
    def is_accumulation_boundary(self) -> bool:
        return self.training_state.micro_step % self.config.gradient_accumulation_steps == 0

    def step(self) -> bool:
        """Optimizer step at a gradient-accumulation boundary (returns True),
        otherwise nothing (False). Grads are cleared after the step."""
        self.require_optimizer("step()")
        self.forwards.settle()
        self.watch.check("step()")
        if not self.training_state.backward_since_step_call:
            raise RuntimeError(
                "step() called without a backward since the last step(): run engine.backward(loss) "
                "(or loss.backward()) first"
            )
        self.training_state.micro_at_step_call = self.training_state.micro_step
        if not self.is_accumulation_boundary():
            return False
        if self.parts.optimizer_step is not None:
            self.parts.backward.before_step()
            self.parts.optimizer_step.run()
        self.coordinator.refresh_persistent()
        self.training_state.global_step += 1
        self.parts.stats.optimizer_step()
        self.parts.timeline.step_boundary()
        return True

    def capture_timeline(self) -> None:
        """Record every fetch, prefetch and release of the next optimizer step
        (from the step() after this call to the following one) into ``timeline``."""
        self.parts.timeline.arm()

    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last optimizer step."""
        if self.reducer is not None:
            self.reducer.window.end()

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Ranks with different numbers of batches (eval, or the last training
        ones), in the manner of ``torch.distributed.algorithms.Join``: wrap
        each rank's loop; a rank whose loop ends repeats its last forward of
        the kind the others run until every loop has ended (see ``zero3.lockstep.join``)."""
        if self.forwards.join is not None:
            raise RuntimeError("engine.join() blocks do not nest")
        join = self.forwards.join = Join(self, self.forwards.last)
        try:
            with self.parts.meeting.lockstep():  # the rounds keep the ranks' forwards together
                yield
                join.shadow()
        finally:
            self.forwards.join = None

    # -- full parameters on demand ----------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(
        self, module: nn.Module | None = None, modifier_rank: int | None = None
    ) -> Iterator[list[nn.Parameter]]:
        """Full parameters of ``module`` (default: the whole model) inside the block.

        With ``modifier_rank``, changes that rank makes to them are
        broadcast on exit and written into every rank's shards (and fp32
        masters); without it, changes are discarded.
        """
        target = self.module if module is None else module
        if not any(target is m for m in self.module.modules()):
            raise ValueError("gathered_parameters needs a submodule of the engine's model")
        if modifier_rank is not None and not 0 <= modifier_rank < self.world:
            raise ValueError(f"modifier_rank must be in [0, {self.world}), got {modifier_rank}")
        self.check_idle("gathered_parameters")
        pids = list(dict.fromkeys(self.coordinator.index[id(p)] for p in target.parameters()))
        # pinned for the whole block: whatever runs inside it (a forward on one
        # rank only, say) finds them gathered and needs no collective for them
        self.coordinator.pin(pids)
        try:
            yield [self.shards[p].param for p in pids]
            if modifier_rank is not None:
                full_values.adopt_full_values(self, pids, modifier_rank)
        finally:
            self.coordinator.unpin(pids)

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` inside a forward or backward."""
        self.forwards.settle()
        if self.parts.hooks.active or self.training_state.phase is Phase.BACKWARD:
            raise RuntimeError(f"{what} cannot be used inside a forward or backward")

    def shards_changed(self) -> None:
        """The shards were written from outside (a load): gathered copies are stale."""
        self.coordinator.gatherer.wait_inflight()
        self.coordinator.discard(range(len(self.shards)))

    def require_optimizer(self, what: str) -> torch.optim.Optimizer:
        """The optimizer, or a clear error for an inference-only engine."""
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs an optimizer, and this engine was initialized with optimizer=None")
        return self.optimizer

    def progress(self) -> tuple[int, int]:
        """(optimizer steps taken, backwards completed)."""
        return self.training_state.global_step, self.training_state.micro_step

    def restore_progress(self, global_step: int, micro_step: int, *, window_open: bool) -> None:
        """Counters of a resumed run (``window_open``: backwards since its last optimizer step)."""
        self.training_state.global_step, self.training_state.micro_step = global_step, micro_step
        self.training_state.micro_at_step_call = micro_step - 1 if window_open else micro_step
        if self.parts.optimizer_step is not None:
            self.parts.optimizer_step.measure_state()

    def synchronize(self) -> None:
        """Wait for this rank's communication in flight (``step()`` leaves the
        persistent parameters' refresh gathering). Call it before stopping a
        torch profiler: a gloo work issued under the profiler and completed
        after it stopped can crash the process."""
        self.coordinator.gatherer.wait_inflight()
        self.parts.gather_streams.synchronize()
        self.parts.reduce_streams.synchronize()

    # -- weights in and out (zero3.weights.full_values, zero3.weights.checkpoint, zero3.weights.pretrained) -----------------
    def train(self, mode: bool = True) -> Zero3Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Zero3Engine:
        return self.train(False)

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full parameter values and persistent buffers by name, on CPU (collective; see ``zero3.weights.full_values``)."""
        return full_values.full_state_dict(self, rank0_only=rank0_only)

    def save_checkpoint(self, path: str | os.PathLike[str], client_state: dict[str, Any] | None = None) -> None:
        """Write the training state under ``path``, each rank its own part
        (collective; see ``zero3.weights.checkpoint``). ``client_state`` is yours
        (a data position, a scheduler's state), returned by ``load_checkpoint``."""
        from z3kit_recipes.zero3.weights.checkpoint import save_checkpoint

        save_checkpoint(self, path, client_state)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Resume from ``path`` (saved at any world size; collective); returns its ``client_state``."""
        from z3kit_recipes.zero3.weights.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def load_deepspeed_checkpoint(
        self, path: str | os.PathLike[str], *, tag: str | None = None, load_optimizer_hyperparameters: bool = False
    ) -> dict[str, Any]:
        """Load a DeepSpeed ZeRO-3 ``save_checkpoint`` directory, saved at any
        world size (collective; see ``zero3.weights.deepspeed_import``); returns its client state."""
        from z3kit_recipes.zero3.weights.deepspeed_import import load_deepspeed_checkpoint

        return load_deepspeed_checkpoint(
            self, path, tag=tag, load_optimizer_hyperparameters=load_optimizer_hyperparameters
        )

    def load_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Load a Hugging Face checkpoint directory into the shards (see ``zero3.weights.pretrained``)."""
        from z3kit_recipes.zero3.weights.pretrained import load_pretrained

        load_pretrained(self, path)

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write the full model in the Hugging Face layout, one parameter at a time (collective)."""
        from z3kit_recipes.zero3.weights.pretrained import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes, dtype=dtype)

    def generate(self, *args: Any, rank: int | None = None, **kwargs: Any) -> Any:
        """The model's Hugging Face ``generate`` on every rank in lockstep
        (collective: call it on every rank). ``rank=r``: rank r's arguments
        and sampling seed are used everywhere, and only rank r gets the
        result (the others get None); see ``zero3.lockstep.generate``."""
        from z3kit_recipes.zero3.lockstep.generate import generate

        return generate(self, args, kwargs, rank)

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> Zero3Stats:
        return collect_stats(self.parts)

    def gathered_numel(self) -> int:
        """Elements of full parameter storage held right now, measured on the
        tensors (padding included), gathers in flight included (their
        buffers exist already)."""
        installed = sum(s.full.untyped_storage().nbytes() // s.full.element_size() for s in self.shards)
        return installed + self.coordinator.gatherer.staging_numel()
