"""Zero3Engine: the stock ZeRO-3 runtime, wired from z3kit primitives.

Data flow (see ../shared/DESIGN.md):

    initialize: full parameter -> ParamShard (1/N, compute dtype)
                                -> fp32 master shard (the optimizer's parameter)
    forward:    pre-forward fetch (gather, trace, prefetch) -> compute
                -> post-forward release (ReleasePolicy)
    backward:   pre-backward fetch -> compute -> grad-ready hook
                -> GradReducer (FlatBucket -> reduce -> GradPartitionBuffer)
                -> post-backward release; end-of-backward epilogue
    step:       (clip) -> optimizer on master shards -> write back to shards
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from z3kit.collectives import CollectiveLog, ProcessGroup, all_gather, broadcast, failed_ranks
from z3kit.device import BACKEND_FOR_DEVICE_TYPE
from z3kit.memory import MemoryKind, MemoryLedger, MemoryReport, device_peak_bytes, storage_bytes, tensor_bytes
from z3kit.flat_bucket import ReduceMode
from z3kit.hooks import HookActions, ModuleHooks, in_backward, iter_tensors, map_tensors
from z3kit.leaf import LeafModuleHook, ParamGrads
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import ReleasePolicy, StockReleasePolicy
from z3kit.shard import ParamStatus, fill_partition, shard_numel_for
from z3kit.streams import StreamPairLike, stream_pair_for
from z3kit.trace import TraceRecorder
from z3kit_recipes.zero3.agreement import RanksDisagree, StepCheck, StepRecord, start_step_check
from z3kit_recipes.zero3.budget import MemoryPlan, plan_memory, transient_cap
from z3kit_recipes.zero3.config import BUDGET_DERIVED, Zero3Config
from z3kit_recipes.zero3.hook_plan import LeafSpec, fetch_groups, resolve_leaves
from z3kit_recipes.zero3.layout import ShardLayout
from z3kit_recipes.zero3.checkpoint import load_checkpoint, save_checkpoint
from z3kit_recipes.zero3.ranks import FetchAgreement, RankWatch
from z3kit_recipes.zero3.pretrained import DEFAULT_MAX_SHARD_BYTES, load_pretrained, persistent_buffers, save_pretrained
from z3kit_recipes.zero3.materialize import InitFn, check_materializable, has_meta_tensors, materialize
from z3kit_recipes.zero3.grads import MAX_FLIGHTS, GradReducer
from z3kit_recipes.zero3.params import ParamCoordinator, ParamUseMode, TimelineEvent

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

#: device type served by each process-group backend (the inverse of z3kit.device's table)
_DEVICE_FOR_BACKEND = {backend: device_type for device_type, backend in BACKEND_FOR_DEVICE_TYPE.items()}


@attrs.frozen
class MetaInit:
    """How tensors built on the meta device get their values (see ``zero3.materialize``)."""

    init_fn: InitFn | None
    seed: int


@attrs.frozen
class Zero3Stats:
    """Figures of the last step, as data (``engine.stats()``).

    ``collectives`` counts calls and bytes per kind since the previous
    ``step()`` boundary; memory figures count elements on this rank.
    """

    global_step: int
    micro_step: int
    model_numel: int
    #: elements of parameter shards, fp32 master shards (when separate) and gradient partitions held by this rank
    resident_param_numel: int
    resident_master_numel: int
    resident_grad_numel: int
    #: elements of full parameters gathered right now (persistent ones included)
    live_numel: int
    #: high-water of gathered elements in the last optimizer step (and since), against the limit
    peak_live_numel: int
    max_live_parameters: int
    largest_fetch_numel: int
    #: elements of one gradient bucket and of one prefetch, as used (the knobs,
    #: capped so that transient buffers stay within one rank's partition)
    reduce_bucket_numel: int
    prefetch_bucket_numel: int
    collectives: dict[str, dict[str, int]]
    trace_state: str
    trace_invalidations: int
    last_grad_norm: float | None
    #: wall time from the previous optimizer step to the last one, and the part of it blocked on communication
    step_time_s: float
    comm_wait_s: float
    #: the part of the step spent making sure the ranks agree (``zero3.agreement``)
    rank_check_s: float

    #: bytes held by kind, now and at their peak since the last training forward after a step
    memory: MemoryReport
    #: the knobs ``memory_budget`` chose, when it is set
    memory_plan: MemoryPlan | None

    @property
    def comm_wait_share(self) -> float:
        return self.comm_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def collectives_per_step(self) -> int:
        return sum(kind["calls"] for kind in self.collectives.values())


class Zero3Engine:
    """A model trained with ZeRO-3 sharding. Build it with ``initialize``."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory | None,
        config: Zero3Config,
        group: ProcessGroup,
        device: torch.device,
        leaf_modules: list[nn.Module],
        trace: TraceRecorder,
        release_policy: ReleasePolicy,
        limiter: PrefetchLimiter,
        memory_plan: MemoryPlan | None = None,
        meta_init: MetaInit | None = None,
        stream_pairs: Callable[[torch.device], StreamPairLike] = stream_pair_for,
    ) -> None:
        meta_init = meta_init or MetaInit(None, 0)
        self.module = module
        self.config = config
        #: the knobs ``config.memory_budget`` was turned into, when it is set
        self.memory_plan = memory_plan
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.log = CollectiveLog()
        self.global_step = 0  # optimizer steps taken
        self.micro_step = 0  # backwards completed since initialize
        self.watch = RankWatch(
            group,
            timeout_s=config.collective_timeout_s,
            describe=lambda: f"at optimizer step {self.global_step}, micro-step {self.micro_step}",
            position=lambda: (self.micro_step, self.coordinator.position()),
        )
        #: fetches no trace vouches for are agreed on a group of their own
        self.agreement = FetchAgreement(_twin_group(group), device, self.watch, lambda: self.micro_step)
        #: gathers and reductions each have a communication stream of their own
        self.gather_streams: StreamPairLike = stream_pairs(device)
        self.reduce_streams: StreamPairLike = stream_pairs(device)
        dtype = config.torch_dtype

        named = list(module.named_parameters())  # each parameter once, tied ones included
        self.param_names = [name for name, _ in named]
        params = [p for _, p in named]
        index = {id(p): pid for pid, p in enumerate(params)}
        leaf_roots = set(leaf_modules)
        self.memory = MemoryLedger()

        # 1. the layout is allocated empty and the optimizer built on it; a
        #    factory that fails (on any rank) leaves every model untouched
        layout = ShardLayout.allocate(
            params, rank=self.rank, world=self.world, dtype=dtype, device=device, trainable=optimizer_factory is not None
        )
        optimizer: torch.optim.Optimizer | None = None
        try:
            if optimizer_factory is not None:
                optimizer = optimizer_factory(layout.masters)
                _check_optimizer(optimizer, layout.masters)
        except BaseException:
            failed_ranks(False, group, device)
            raise
        failed = failed_ranks(True, group, device)
        if failed:
            raise RuntimeError(
                f"the optimizer factory failed on rank(s) {failed}; see their error. Nothing was changed here"
            )

        # 2. the values into the shards, one parameter (or chunk, or module) at a time:
        #    rank 0's where the model has them, made on every rank where it was built on meta
        real = [pid for pid, p in enumerate(params) if not p.is_meta]
        layout.fill_from_rank0(real, group, self.log)
        if len(real) < len(params) or has_meta_tensors(module):
            materialize(module, layout, meta_init.init_fn, meta_init.seed, device)
        self.layout = layout
        self.shards = layout.shards
        self.masters = layout.masters
        self.trainable = layout.trainable
        self.masters_are_shards = layout.masters_are_shards
        #: None for an inference-only engine (``initialize(model, optimizer=None)``)
        self.optimizer = optimizer
        if optimizer is None:
            for p in params:
                p.requires_grad_(False)  # nothing would consume their gradients
        self.memory.set(MemoryKind.PARAM_SHARDS, tensor_bytes(layout.flat))
        if not self.masters_are_shards:
            self.memory.set(MemoryKind.FP32_MASTERS, storage_bytes(self.masters))
        for buf_name, buf in list(module.named_buffers()):
            converted = buf.to(device, dtype) if buf.is_floating_point() else buf.to(device)
            if converted is not buf:
                _set_buffer(module, buf_name, converted)
        shards = self.shards
        trainable = self.trainable

        hooked = fetch_groups(module, params, leaf_roots)
        #: what this rank did since the last backward ended, compared across ranks then
        self.record = StepRecord()

        self.trace, self.policy, self.limiter = trace, release_policy, limiter
        self.coordinator = ParamCoordinator(
            shards,
            hooked,
            group=group,
            streams=self.gather_streams,
            trace=trace,
            policy=release_policy,
            limiter=limiter,
            log=self.log,
            memory=self.memory,
            record=self.record,
            waiter=self.watch.wait,
            ranks=self.agreement,
            overlap=config.overlap_comm,
            check_every_fetch=config.checks_every_fetch,
        )
        reduce_scatter = config.reduce_scatter
        if reduce_scatter is None:
            reduce_scatter = dist.get_backend(group) != "gloo"
        #: reductions run on a process group of their own (see the Note in zero3.grads)
        self.reduce_group = _twin_group(group) if trainable else group
        self.reducer = GradReducer(
            shards,
            trainable,
            group=self.reduce_group,
            waiter=self.watch.wait,
            streams=self.reduce_streams,
            log=self.log,
            memory=self.memory,
            bucket_size=config.reduce_bucket_size if memory_plan is None else memory_plan.reduce_bucket_size,
            bucket_dtype=dtype,  # reduce in the compute dtype, as DeepSpeed does; accumulate in fp32
            mode=ReduceMode.REDUCE_SCATTER if reduce_scatter else ReduceMode.ALL_REDUCE,
            overlap=config.overlap_comm,
            contiguous=config.contiguous_gradients,
            scale=1.0 / (self.world * config.gradient_accumulation_steps),
        ) if trainable else None

        actions = HookActions(
            pre_forward=self.coordinator.fetch,
            post_forward=self._post_forward,
            pre_backward=self._pre_backward,
            post_backward=self.coordinator.release,
        )
        self.hooks = ModuleHooks(actions)
        leaf_params: set[int] = set()
        self.leaf_units: list[LeafModuleHook] = []
        for m in hooked:
            if m in leaf_roots:
                unit = LeafModuleHook(m, actions, self._reduce_leaf)
                self.leaf_units.append(unit)
                leaf_params.update(index[id(p)] for p in unit.params)
                self.hooks.attach(m, unit.actions)
            else:
                self.hooks.attach(m)
        self._grad_handles = [  # kept so the hooks can be removed
            shards[pid].param.register_post_accumulate_grad_hook(self._make_grad_hook(pid))
            for pid in trainable
            if pid not in leaf_params
        ]
        self.leaf_param_ids = frozenset(leaf_params)
        self._use_mode = ParamUseMode(self.coordinator, self.hooks)
        self._param_ids = tuple(id(p) for p in params)
        #: the buffers broadcast before each training forward (None: list them again)
        self._buffers_to_broadcast: list[torch.Tensor] | None = None
        self._watch_registrations()

        self._backward_since_step = False
        self._epilogue_queued = False
        self._last_grad_norm: float | None = None
        self._log_at_step = self.log.snapshot()
        self._last_step_collectives = _diff(self.log.snapshot(), self._log_at_step)
        self._step_started = time.perf_counter()
        self._wait_at_step = 0.0
        self._last_step_time = 0.0
        self._last_comm_wait = 0.0
        self._step_check_s = self._check_at_step = self._last_rank_check = 0.0
        self._capture_armed = False
        self._last_peak_live = 0
        self._new_memory_window = True
        self._state_entries = 0
        #: the parameter timeline of the last captured step (see ``capture_timeline``)
        self.timeline: list[TimelineEvent] = []

    # -- construction helpers -----------------------------------------------------------
    def _make_grad_hook(self, pid: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if param.grad is not None:
                self._hand_over(pid, param, param.grad)

        return on_grad_ready

    def _hand_over(self, pid: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A full gradient is ready: into the reducer, out of ``param.grad``."""
        if self.reducer is None:
            return
        self._queue_epilogue()
        self.reducer.add(pid, grad)
        param.grad = None

    # -- forward ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.watch.check("forward")
        if self._registrations_seen:
            self._check_parameters_unchanged()
        dtype = self.config.torch_dtype
        if dtype != torch.float32:
            args, kwargs = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
        # A traced training step is a grad-enabled forward in train mode. An
        # eval() forward with grad on is usually not followed by a backward,
        # so it must not keep parameters gathered for one.
        training = torch.is_grad_enabled() and self.module.training
        was_tracing = self.coordinator.tracing
        self.coordinator.tracing = training
        if training:
            if self._new_memory_window:
                self._new_memory_window = False
                self.memory.reset_peaks()
            if self.config.broadcast_buffers:
                self._broadcast_buffers()
            self.coordinator.start_step()
        try:
            with self._use_mode:
                out = self.module(*args, **kwargs)
        except BaseException as exc:
            position = self._position()
            self._abort()
            self.watch.failed_here("forward", exc, position)
            raise
        finally:
            if not training:
                self.coordinator.tracing = was_tracing
        if not training:
            self.coordinator.release_all()
        return out

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm statistics, ...) to every rank before a
        training forward, as DDP does: one broadcast per dtype."""
        if self.world == 1:
            return
        if self._buffers_to_broadcast is None:  # kept between steps: walking the modules costs as much as a small step
            self._buffers_to_broadcast = [b for b in self.module.buffers() if b.numel()]
        buffers = self._buffers_to_broadcast
        if not buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in group])
                broadcast(flat, 0, self.group, log=self.log)
                for b, value in zip(group, flat.split([b.numel() for b in group])):
                    b.copy_(value.view_as(b))

    def _position(self) -> tuple[int, int]:
        """Where this rank is in the step: gathers issued, modules fetched."""
        return self.record.gathers, len(self.record.fetches)

    def _post_forward(self, module: nn.Module, output: Any) -> None:
        if in_backward():
            return  # a checkpoint recomputation: backward uses these now; post-backward releases
        if self.coordinator.tracing:
            needs_grad = (output.requires_grad if isinstance(output, torch.Tensor)
                          else any(t.requires_grad for t in iter_tensors(output)))
            self.coordinator.forward_done(module, needs_grad)
        self.coordinator.release(module, keep=self.coordinator.params_in(output))

    # -- backward ---------------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module) -> None:
        self._queue_epilogue()
        self.coordinator.fetch_for_backward(module)

    def _queue_epilogue(self) -> None:
        """Queue the end-of-backward callback once per backward, from inside
        it (the first hook to fire is the root's, in the outermost backward)."""
        if self._epilogue_queued or not in_backward():
            return
        self._epilogue_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reduce_leaf(self, grads: ParamGrads) -> None:
        for param, grad in grads:
            self._hand_over(self.coordinator.index[id(param)], param, grad)

    def _end_of_backward(self) -> None:
        self._epilogue_queued = False
        try:
            self.hooks.finish_backward()
            self.coordinator.finish_schedule()
            if self.reducer is not None:
                check = self._start_step_check()
                self.reducer.finish()
                try:
                    self._agree_on_backward(check)
                except RanksDisagree as exc:
                    self.watch.broken = str(exc)  # every rank raised it: none may go on alone
                    raise
            late = [self.param_names[p] for p in self.leaf_param_ids if self.shards[p].param.grad is not None]
            if late:
                raise RuntimeError(
                    f"gradients of leaf-unit parameters {late[:5]} arrived after their unit was reduced; "
                    "a parameter of a leaf module is being used outside it"
                )
        finally:
            self.coordinator.release_all()
            self.coordinator.end_step()
            self.coordinator.tracing = False
            self.hooks.reset()
        self.micro_step += 1
        self._backward_since_step = True

    def _start_step_check(self) -> StepCheck | None:
        """Begin comparing this backward across ranks (see ``zero3.agreement``);
        None on one rank."""
        assert self.reducer is not None
        if self.world == 1:
            return None
        arrived = self.reducer.arrived
        # not on the reduction group: the ranks may still have different
        # bucket flushes to issue there (zero-filled where no gradient came)
        return start_step_check(
            self.agreement.group,
            self.device,
            global_step=self.global_step,
            micro_step=self.micro_step,
            record=self.record,
            used=[pid in arrived for pid in self.trainable],
        )

    def _agree_on_backward(self, check: StepCheck | None) -> None:
        """Finish the comparison: the parameters that got a gradient on some
        rank are the window's (see ``zero3.agreement``)."""
        assert self.reducer is not None
        if check is None:
            arrived = self.reducer.arrived
            used = [pid in arrived for pid in self.trainable]
        else:
            started = time.perf_counter()
            used = check.result(self.watch.wait)
            self._step_check_s += time.perf_counter() - started
        self.record.clear()
        self.reducer.mark_used(pid for pid, u in zip(self.trainable, used) if u)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; gradients are averaged over ranks and over the
        ``gradient_accumulation_steps`` micro-steps (no loss scaling needed)."""
        self.require_optimizer("backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward needs the loss tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad()?")
        self.watch.check("backward")
        before = self.micro_step
        try:
            loss.backward()
        except BaseException as exc:
            position = self._position()
            self._abort()
            self.watch.failed_here("backward", exc, position)
            raise
        if self.micro_step == before:  # nothing in backward reached a hook of ours
            self._end_of_backward()

    # -- optimizer step --------------------------------------------------------------------------
    def is_accumulation_boundary(self) -> bool:
        return self.micro_step % self.config.gradient_accumulation_steps == 0

    def step(self) -> bool:
        """Optimizer step at a gradient-accumulation boundary (returns True),
        otherwise nothing (False). Grads are cleared after the step."""
        self.require_optimizer("step()")
        self.watch.check("step()")
        if not self._backward_since_step:
            raise RuntimeError(
                "step() called without a backward since the last step(): run engine.backward(loss) "
                "(or loss.backward()) first"
            )
        self._backward_since_step = False
        if not self.is_accumulation_boundary():
            return False
        if self.reducer is not None and self.optimizer is not None:
            if self.config.gradient_clipping > 0:
                self._last_grad_norm = float(self.reducer.clip_(self.config.gradient_clipping))
            for master, grad in zip(self.masters, self.reducer.optimizer_grads()):
                master.grad = grad
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
            if not self.masters_are_shards:
                for pid, master in zip(self.trainable, self.masters):
                    self.shards[pid].shard.copy_(master.detach())
            self.reducer.end_window()
            if len(self.optimizer.state) != self._state_entries:
                # optimizers create a parameter's state at its first step and keep
                # its size after that: measure only when new entries appear
                self._state_entries = len(self.optimizer.state)
                self.memory.set(MemoryKind.OPTIMIZER_STATE, _optimizer_state_bytes(self.optimizer))
        self.coordinator.refresh_persistent()
        self._new_memory_window = True
        self.global_step += 1
        now = self.log.snapshot()
        self._last_step_collectives = _diff(now, self._log_at_step)
        self._log_at_step = now
        clock, waited, checked = time.perf_counter(), self._comm_wait_total(), self._rank_check_total()
        self._last_step_time, self._last_comm_wait = clock - self._step_started, waited - self._wait_at_step
        self._last_rank_check = checked - self._check_at_step
        self._step_started, self._wait_at_step, self._check_at_step = clock, waited, checked
        self._last_peak_live = self.limiter.high_water
        self.limiter.reset_high_water()
        if self.coordinator.timeline is not None:
            self.timeline, self.coordinator.timeline = self.coordinator.timeline, None
        if self._capture_armed:
            self._capture_armed = False
            self.coordinator.timeline = []
        return True

    def capture_timeline(self) -> None:
        """Record every fetch, prefetch and release of the next optimizer step
        (from the step() after this call to the following one) into ``timeline``."""
        self._capture_armed = True

    def _rank_check_total(self) -> float:
        return self._step_check_s + self.agreement.seconds

    def _comm_wait_total(self) -> float:
        reducer_wait = 0.0 if self.reducer is None else self.reducer.comm_wait_s
        return self.coordinator.comm_wait_s + reducer_wait

    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last optimizer step."""
        if self.reducer is not None:
            self.reducer.end_window()

    # -- full parameters on demand ----------------------------------------------------------------
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
        self.coordinator.ensure_gathered(pids)
        # pinned for the whole block: whatever runs inside it (a forward on one
        # rank only, say) finds them gathered and needs no collective for them
        self.coordinator.pin(pids)
        try:
            yield [self.shards[p].param for p in pids]
            if modifier_rank is not None:
                self._adopt_full_values(pids, modifier_rank)
        finally:
            self.coordinator.unpin(pids)

    def _adopt_full_values(self, pids: list[int], src: int) -> None:
        """Rank ``src``'s full values of ``pids`` into every rank's shards and
        masters, one parameter at a time (broadcast in place: the gathered
        copies are dropped right after)."""
        master_of = {} if self.masters_are_shards else self.layout.master_of()
        for pid in pids:
            shard = self.shards[pid]
            full = shard.param.detach().reshape(-1)
            broadcast(full, src, self.group, log=self.log)
            shard.load_full(full)
            master = master_of.get(pid)
            if master is not None:
                fill_partition(master.data, full, self.rank, self.world)
        self.coordinator.discard(p for p in pids if self.coordinator.persistent[p])

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` inside a forward or backward."""
        if self.hooks.active or self._epilogue_queued:
            raise RuntimeError(f"{what} cannot be used inside a forward or backward")

    def shards_changed(self) -> None:
        """The shards were written from outside (a load): gathered copies are stale."""
        self.coordinator.wait_inflight()
        self.coordinator.discard(range(len(self.shards)))

    def require_optimizer(self, what: str) -> torch.optim.Optimizer:
        """The optimizer, or a clear error for an inference-only engine."""
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs an optimizer, and this engine was initialized with optimizer=None")
        return self.optimizer

    def progress(self) -> tuple[int, int]:
        """(optimizer steps taken, backwards completed)."""
        return self.global_step, self.micro_step

    def restore_progress(self, global_step: int, micro_step: int, *, window_open: bool) -> None:
        """Counters of a resumed run (``window_open``: backwards since its last optimizer step)."""
        self.global_step, self.micro_step = global_step, micro_step
        self._backward_since_step = window_open
        if self.optimizer is not None:
            self._state_entries = len(self.optimizer.state)
            self.memory.set(MemoryKind.OPTIMIZER_STATE, _optimizer_state_bytes(self.optimizer))

    # -- weights in and out ---------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str], client_state: dict[str, Any] | None = None) -> None:
        """Write the training state under ``path``, each rank its own part
        (collective; see ``zero3.checkpoint``). ``client_state`` is yours
        (a data position, a scheduler's state), returned by ``load_checkpoint``."""
        save_checkpoint(self, path, client_state)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Resume from ``path`` (saved at any world size; collective); returns its ``client_state``."""
        return load_checkpoint(self, path)

    def load_deepspeed_checkpoint(
        self, path: str | os.PathLike[str], *, tag: str | None = None, load_optimizer_hyperparameters: bool = False
    ) -> dict[str, Any]:
        """Load a DeepSpeed ZeRO-3 ``save_checkpoint`` directory, saved at any
        world size (collective; see ``zero3.deepspeed_import``); returns its client state."""
        from z3kit_recipes.zero3.deepspeed_import import load_deepspeed_checkpoint

        return load_deepspeed_checkpoint(
            self, path, tag=tag, load_optimizer_hyperparameters=load_optimizer_hyperparameters
        )

    def load_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Load a Hugging Face checkpoint directory into the shards (see ``zero3.pretrained``)."""
        load_pretrained(self, path)

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write the full model in the Hugging Face layout, one parameter at a time (collective)."""
        save_pretrained(self, path, max_shard_bytes=max_shard_bytes, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for this rank's communication in flight (``step()`` leaves the
        persistent parameters' refresh gathering). Call it before stopping a
        torch profiler: a gloo work issued under the profiler and completed
        after it stopped can crash the process."""
        self.coordinator.wait_inflight()
        self.gather_streams.synchronize()
        self.reduce_streams.synchronize()

    # -- observability ---------------------------------------------------------------------------
    def stats(self) -> Zero3Stats:
        model_numel = sum(s.numel for s in self.shards)
        fetch_sizes = [sum(self.coordinator.numels[p] for p in pids) for pids in self.coordinator.module_params.values()]
        return Zero3Stats(
            global_step=self.global_step,
            micro_step=self.micro_step,
            model_numel=model_numel,
            resident_param_numel=_storage_numel(s.shard for s in self.shards),
            resident_master_numel=0 if self.masters_are_shards else _storage_numel(self.masters),
            resident_grad_numel=self.memory.current(MemoryKind.GRAD_PARTITIONS) // 4,
            live_numel=self.limiter.live_numel,
            peak_live_numel=max(self._last_peak_live, self.limiter.high_water),
            max_live_parameters=self.limiter.max_live_parameters,
            largest_fetch_numel=max(fetch_sizes, default=0),
            reduce_bucket_numel=0 if self.reducer is None else self.reducer.bucket_capacity,
            prefetch_bucket_numel=self.limiter.prefetch_bucket_size,
            collectives=self._last_step_collectives,
            trace_state=self.trace.state.value,
            trace_invalidations=self.trace.invalidations,
            last_grad_norm=self._last_grad_norm,
            step_time_s=self._last_step_time,
            comm_wait_s=self._last_comm_wait,
            rank_check_s=self._last_rank_check,
            memory=self.memory.report(device_peak_bytes(self.device)),
            memory_plan=self.memory_plan,
        )

    def gathered_numel(self) -> int:
        """Elements of full parameter storage held right now, measured on the
        tensors (padding included), gathers in flight included (their
        buffers exist already)."""
        installed = sum(s.full.untyped_storage().nbytes() // s.full.element_size() for s in self.shards)
        return installed + self.coordinator.staging_numel()

    # -- conveniences -------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Zero3Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Zero3Engine:
        return self.train(False)

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full parameter values and persistent buffers by name, on CPU
        (collective: every rank calls it), gathered one parameter at a time.

        Trainable parameters come from the fp32 master shards (in bf16 runs
        too, so a checkpoint keeps full precision); frozen ones in their
        compute dtype. With ``rank0_only`` the other ranks return ``{}`` and
        hold one parameter at a time.
        """
        self.check_idle("full_state_dict")
        keep = not rank0_only or self.rank == 0
        out: dict[str, torch.Tensor] = {}
        for pid, name in enumerate(self.param_names):
            full = self.layout.gather_full(pid, self.group, self.log)
            if keep:
                out[name] = full.view(self.shards[pid].shape).to("cpu", copy=True)
        if keep:
            out.update({name: b.detach().to("cpu", copy=True) for name, b in persistent_buffers(self.module).items()})
        return out

    # -- errors ---------------------------------------------------------------------------------------
    def _abort(self) -> None:
        """A forward raised: forget what was in progress, free what was gathered."""
        self.record.clear()
        self.hooks.reset()
        if self.watch.broken is not None:  # gathers in flight may never pair: leave them be
            self.coordinator.abandon_inflight()
        self.coordinator.release_all()
        self.coordinator.tracing = False
        self.trace.invalidate()

    def _watch_registrations(self) -> None:
        """Note any parameter or submodule registered on the model after
        initialize, through torch's global registration hooks, so that the
        full check runs only when something may have changed. The hooks hold
        the engine weakly and go away with it."""
        self._registrations_seen = False
        model_modules = {id(m) for m in self.module.modules()}
        engine = weakref.ref(self)

        def on_registration(owner: nn.Module, name: str, value: Any) -> None:
            live = engine()
            if live is not None and id(owner) in model_modules:
                live._registrations_seen = True

        from torch.nn.modules import module as module_registry

        for register in (
            module_registry.register_module_parameter_registration_hook,
            module_registry.register_module_module_registration_hook,
        ):
            weakref.finalize(self, register(on_registration).remove)

        def on_buffer(owner: nn.Module, name: str, value: Any) -> None:
            live = engine()
            if live is not None and id(owner) in model_modules:
                live._buffers_to_broadcast = None  # listed again at the next training forward

        weakref.finalize(self, module_registry.register_module_buffer_registration_hook(on_buffer).remove)

    def _check_parameters_unchanged(self) -> None:
        current = [(name, p) for name, p in self.module.named_parameters()]
        if len(current) == len(self._param_ids) and all(id(p) == i for (_, p), i in zip(current, self._param_ids)):
            self._registrations_seen = False
        else:
            known = set(self._param_ids)
            added = [name for name, p in current if id(p) not in known]
            raise RuntimeError(
                f"parameters changed after zero3.initialize (new: {added or 'none'}, "
                f"count {len(self._param_ids)} -> {len(current)}); ZeRO-3 shards parameters at initialize: "
                "add them before initialize, or remove them to keep training with this engine"
            )


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[attr] = value


def _twin_group(group: ProcessGroup) -> ProcessGroup:
    """A second process group over the same ranks and backend (collective over
    those ranks only), so that two kinds of traffic keep their own order."""
    if dist.get_world_size(group) == 1:
        return group
    twin: ProcessGroup | None = dist.new_group(
        ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group), use_local_synchronization=True
    )
    assert twin is not None
    return twin


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def _storage_numel(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes() // t.element_size()
    return sum(seen.values())


def _diff(now: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: {f: now[k][f] - before[k][f] for f in now[k]} for k in now}


def _check_optimizer(optimizer: Any, masters: list[nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    ours = {id(m) for m in masters}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in ours:
                raise ValueError(
                    "the optimizer holds a tensor that is not one of the master shards it was given; "
                    "build it from the factory's argument only"
                )


def _resolve_device(model: nn.Module, group: ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    device_type = _DEVICE_FOR_BACKEND.get(backend)
    if device_type is None:
        raise ValueError(f"process-group backend {backend!r} is not supported; use one of {sorted(_DEVICE_FOR_BACKEND)}")
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        module = torch.get_device_module(device_type)
        device = torch.device(device_type, module.current_device())
    for name, p in model.named_parameters():
        if p.device.type not in ("cpu", "meta", device_type):
            raise ValueError(
                f"parameter {name!r} is on {p.device}, but the process group's backend {backend!r} "
                f"communicates {device_type} tensors; move the model to {device_type} (or CPU) or use a "
                f"{BACKEND_FOR_DEVICE_TYPE.get(p.device.type, 'matching')} group"
            )
    return device


def initialize(
    model: nn.Module,
    optimizer: OptimizerFactory | None,
    config: Zero3Config | Mapping[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    *,
    trace: TraceRecorder | None = None,
    release_policy: ReleasePolicy | None = None,
    prefetch_limiter: PrefetchLimiter | None = None,
    param_init_fn: InitFn | None = None,
    init_seed: int | None = None,
    stream_pairs: Callable[[torch.device], StreamPairLike] = stream_pair_for,
) -> Zero3Engine:
    """Shard ``model`` over ``process_group`` (default: the world group) and
    return the engine that trains it.

    ``optimizer`` is a factory that receives this rank's fp32 master shards,
    or None for an inference-only engine (an RLHF reference model, say): no
    masters, no gradient buffers, every parameter frozen; ``step`` and
    ``backward`` are refused.
    ``config`` is a ``Zero3Config`` or a DeepSpeed config dict. ``trace``,
    ``release_policy`` and ``prefetch_limiter`` replace the stock policies
    (the config's knobs for them are then not used). Every argument is
    checked before the model is touched: a failed call changes nothing.

    A model built on the meta device is materialized one module at a time
    (see ``z3kit_recipes.zero3.materialize``): by ``param_init_fn(module)``
    when given (a Hugging Face model's ``_init_weights``), else by each
    module's ``reset_parameters()``, from ``init_seed`` (default: rank 0's
    ``torch.initial_seed()``), the same on every rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and (not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
        raise TypeError(
            "optimizer must be a factory, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3): "
            "it receives this rank's master shards (or None for an engine that only runs forwards)"
        )
    if config is None:
        config = Zero3Config()
    elif isinstance(config, Mapping):
        config = Zero3Config.from_deepspeed(config)
    elif not isinstance(config, Zero3Config):
        raise TypeError(f"config must be a Zero3Config or a DeepSpeed config dict, got {type(config).__name__}")
    if process_group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first, or pass process_group")
        process_group = dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to shard or train")
    if optimizer is not None and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"every parameter of {type(model).__name__} is frozen (requires_grad=False): there is nothing to "
            "optimize; pass optimizer=None for an engine that only runs forwards"
        )
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; ZeRO-3 trains floating-point parameters")
    device = _resolve_device(model, process_group)
    leaves = resolve_leaves(model, leaf_modules)
    if trace is None:
        trace = TraceRecorder()
    elif not isinstance(trace, TraceRecorder):
        raise TypeError(f"trace must be a TraceRecorder (or a subclass), got {type(trace).__name__}")
    plan = _plan_budget(model, config, leaves, dist.get_world_size(process_group))
    knobs = plan.knobs() if plan is not None else {name: getattr(config, name) for name in BUDGET_DERIVED}
    if release_policy is None:
        release_policy = StockReleasePolicy(
            max_reuse_distance=knobs["max_reuse_distance"],
            param_persistence_threshold=config.param_persistence_threshold,
            max_live_parameters=knobs["max_live_parameters"],
        )
    elif not isinstance(release_policy, ReleasePolicy):
        raise TypeError(f"release_policy must implement z3kit.release.ReleasePolicy, got {type(release_policy).__name__}")
    if prefetch_limiter is None:
        world = dist.get_world_size(process_group)
        padded_total = sum(shard_numel_for(p.numel(), world) * world for p in model.parameters())
        prefetch_limiter = PrefetchLimiter(
            max_live_parameters=knobs["max_live_parameters"],
            prefetch_bucket_size=min(knobs["prefetch_bucket_size"], transient_cap(padded_total, world)),
            max_inflight=config.max_inflight_gathers,
        )
    elif not isinstance(prefetch_limiter, PrefetchLimiter):
        raise TypeError(f"prefetch_limiter must be a PrefetchLimiter (or a subclass), got {type(prefetch_limiter).__name__}")
    meta_init = None
    if has_meta_tensors(model):
        check_materializable(model, param_init_fn)
        meta_init = MetaInit(param_init_fn, _agreed_seed(init_seed, process_group, device))
    return Zero3Engine(
        model, optimizer, config, process_group, device, leaves, trace, release_policy, prefetch_limiter, plan,
        meta_init, stream_pairs,
    )


def _agreed_seed(seed: int | None, group: ProcessGroup, device: torch.device) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()``: the same on every rank."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"init_seed must be an int, got {type(seed).__name__}")
        return seed
    value = torch.tensor([torch.initial_seed() % (1 << 62)], dtype=torch.int64, device=device)
    broadcast(value, 0, group)
    return int(value.item())


def _plan_budget(model: nn.Module, config: Zero3Config, leaves: list[nn.Module], world: int) -> MemoryPlan | None:
    """The knobs ``config.memory_budget`` stands for on this model, if it is set."""
    if config.memory_budget is None:
        return None
    params = [p for _, p in model.named_parameters()]
    groups = fetch_groups(model, params, leaves)
    return plan_memory(
        config.memory_budget,
        model_numel=sum(p.numel() for p in params),
        element_size=config.torch_dtype.itemsize,
        largest_fetch_numel=max(sum(params[p].numel() for p in pids) for pids in groups.values()),
        persistent_numel=sum(p.numel() for p in params if p.numel() < config.param_persistence_threshold),
        world=world,
        buckets=MAX_FLIGHTS + 1 if config.overlap_comm else 1,
    )
