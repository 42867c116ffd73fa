"""Step-time benchmark: DDP vs FSDP2 vs DeepSpeed ZeRO-3 vs z3kit zero3.

    python -m z3kit_recipes.bench [--workload tiny|gpt|all] [--world N]
        [--steps N] [--warmup N] [--runtimes ddp,fsdp2,deepspeed,z3kit]
        [--threads auto|N] [--trial-steps N] [--probe-steps N]
        [--tie-mode hf|functional] [--pycache-dir DIR] [--out bench.json]

Every runtime trains the same workload (:mod:`z3kit_recipes.models`): the same
seeded initial weights on every rank, the same per-rank data (seeded by rank
and step), Adam (lr 1e-3) in fp32, on ``--world`` local CPU processes over
gloo. Each (workload, runtime) pair runs in its own freshly spawned process
group (``torch.multiprocessing.spawn``), so no runtime leaves hooks, patches
or warmed caches behind for the next one.

What is measured, per rank and step:

- step time: wall time of one optimizer step (zero-grad, forward, loss,
  backward, optimizer step), ranks aligned by a barrier outside the timed
  region; a step's time is the slowest rank's; the figure is the median over
  the measured steps (warm-up steps excluded). Ratios are against DDP.
- after the timed steps, ``--probe-steps`` extra steps (not timed) are run
  instrumented:

  * collectives per step: every ``c10d::`` operator the step dispatches, seen
    by ``torch.profiler`` on the calling thread (top-level ops only, so a
    coalesced op is one call), grouped by kind. This sees DDP's C++ reducer
    as well as Python-level calls, and needs no patching of the runtimes.
  * peak live gathered parameters (elements): DDP keeps a full replica (all
    parameters, always). FSDP2: after each ``unshard``/``wait_for_unshard`` of
    each of the model's param groups, the elements of groups that are
    unsharded or have an all-gather in flight. DeepSpeed: after each
    ``fetch_sub_module``, the ``ds_numel`` of parameters whose ``ds_status``
    is AVAILABLE or INFLIGHT (persistent small parameters included, as they
    stay gathered). z3kit: its engine's own ``stats()``.

- loss: every step's loss averaged over ranks, so runs can be checked against
  DDP (same weights, data and optimizer: the curves should agree to
  round-off).

Threads: with ``--threads auto`` (default), DDP first runs a short trial
(``--trial-steps``) at each candidate number of intra-op threads per rank
(1, cores // world, cores; a candidate 3x slower than the best so far is
stopped early), then the full measurement at the fastest; every other
runtime of that workload uses the same number. On 2 cores with 2 ranks, 1
thread per rank wins by far: 2 threads per rank oversubscribe the cores.

Spawned ranks cache bytecode under ``--pycache-dir`` (see
``z3kit_recipes.launch.use_bytecode_cache``), so that the heavy lazy imports are compiled once
rather than in every rank of every run when ``PYTHONDONTWRITEBYTECODE`` is set.

DeepSpeed is optional: it is skipped with a note when not importable. Its
engine runs with ``DS_ACCELERATOR=cpu`` on the gloo group this benchmark
creates, ZeRO stage 3 with its defaults, and DeepSpeed's ``Adam`` type with
``torch_adam`` and ``adam_w_mode`` off, which is ``torch.optim.Adam``, and
``gradient_clipping`` 0 (DeepSpeed's own default clips to norm 1.0, which
the other runtimes do not do).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from z3kit_recipes.launch import PYCACHE_DIR, free_port, use_bytecode_cache
from z3kit_recipes.models import TIE_MODES, WORKLOAD_NAMES, TieMode, Workload, make_workload

RuntimeName = Literal["ddp", "fsdp2", "deepspeed", "z3kit"]
RUNTIMES: Final[tuple[RuntimeName, ...]] = ("ddp", "fsdp2", "deepspeed", "z3kit")
LR: Final = 1e-3
DEFAULT_STEPS: Final[dict[str, int]] = {"tiny": 30, "gpt": 15}
DEFAULT_WARMUP: Final[dict[str, int]] = {"tiny": 5, "gpt": 3}

JSON = dict[str, Any]

# torch's stubs leave these untyped; bind them once with the types used here.
_backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
_spawn: Callable[..., Any] = getattr(mp, "spawn")


# --------------------------------------------------------------------------- #
# Availability
# --------------------------------------------------------------------------- #


def _import_optional(name: str) -> tuple[Any | None, str]:
    """``(module, "")`` or ``(None, reason)`` without letting the error escape."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(exc).__name__}: {exc}"


def available_runtimes() -> dict[RuntimeName, str]:
    """Each runtime mapped to "" when it can run, else the reason it cannot.

    Run in the parent process. DeepSpeed is imported here (with
    ``DS_ACCELERATOR=cpu`` unless set) so that a broken install is skipped
    with its error rather than failing inside the ranks.
    """
    out: dict[RuntimeName, str] = {"ddp": "", "fsdp2": ""}
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:
        out["fsdp2"] = f"torch.distributed.fsdp.fully_shard unavailable: {exc}"
    if importlib.util.find_spec("deepspeed") is None:
        out["deepspeed"] = "deepspeed is not installed"
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ds, why = _import_optional("deepspeed")
        out["deepspeed"] = "" if ds is not None else f"deepspeed not importable ({why})"
    zero3, why = _import_optional("z3kit_recipes.zero3")
    if zero3 is None:
        out["z3kit"] = f"z3kit_recipes.zero3 not importable ({why})"
    elif not (hasattr(zero3, "initialize") and hasattr(zero3, "Zero3Config")):
        out["z3kit"] = "z3kit_recipes.zero3 lacks initialize/Zero3Config"
    else:
        out["z3kit"] = ""
    return out


# --------------------------------------------------------------------------- #
# Runners (built and used inside a worker rank)
# --------------------------------------------------------------------------- #


class _Runner(Protocol):
    """One runtime wrapped around one model, on one rank."""

    #: how ``peak_live_params`` is obtained (shown in the JSON).
    peak_method: str

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the detached loss."""
        ...

    def start_probe(self) -> None:
        """Begin tracking live gathered parameters (untimed steps only)."""
        ...

    def stop_probe(self) -> None: ...

    def peak_live_params(self) -> int | None:
        """Peak gathered parameter elements seen while probing, if measurable."""
        ...

    def engine_stats(self) -> JSON | None:
        """The runtime's own per-step figures, if it has any."""
        ...


def _numel(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _engine_step(engine: Any, wl: Workload, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step of a DeepSpeed-style engine (DeepSpeed's and z3kit's share the interface)."""
    loss = wl.loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.detach()


class _DDPRunner:
    peak_method = "full replica: every parameter is resident on every rank"

    def __init__(self, wl: Workload, group: dist.ProcessGroup) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.wl = wl
        model = wl.build_model()
        self.total = _numel(list(model.parameters()))
        self.model = DistributedDataParallel(model, process_group=group)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.wl.loss(self.model(x), y)
        _backward(loss)
        self.opt.step()
        return loss.detach()

    def start_probe(self) -> None:
        pass

    def stop_probe(self) -> None:
        pass

    def peak_live_params(self) -> int | None:
        return self.total

    def engine_stats(self) -> JSON | None:
        return None


class _FSDP2Runner:
    peak_method = (
        "sampled after every unshard/wait_for_unshard of the model's FSDPParamGroups: "
        "elements of groups unsharded or with an all-gather in flight"
    )

    def __init__(self, wl: Workload, group: dist.ProcessGroup, world: int) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.wl = wl
        model = wl.build_model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in wl.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=LR)
        # (param group, its unsharded elements) for every FSDP module of the model.
        self._groups: list[tuple[Any, int]] = []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                pg = m._get_fsdp_state()._fsdp_param_group
                if pg is not None:
                    n = sum(fp.sharded_param.size().numel() for fp in pg.fsdp_params)
                    self._groups.append((pg, n))
        self._peak = 0
        self._probing = False

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.wl.loss(self.model(x), y)
        _backward(loss)
        self.opt.step()
        return loss.detach()

    def _sample(self) -> None:
        live = sum(
            n for pg, n in self._groups if pg.is_unsharded or pg._all_gather_result is not None
        )
        self._peak = max(self._peak, live)

    def _wrap(self, pg: Any, name: str) -> None:
        orig: Callable[..., Any] = getattr(pg, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self._sample()
            return out

        setattr(pg, name, wrapped)  # instance attribute shadows the class method

    def start_probe(self) -> None:
        self._peak = 0
        self._sample()
        for pg, _ in self._groups:
            self._wrap(pg, "unshard")
            self._wrap(pg, "wait_for_unshard")

    def stop_probe(self) -> None:
        for pg, _ in self._groups:
            for name in ("unshard", "wait_for_unshard"):
                if name in vars(pg):
                    delattr(pg, name)

    def peak_live_params(self) -> int | None:
        return self._peak

    def engine_stats(self) -> JSON | None:
        return None


#: ZeRO-3 knobs given to both DeepSpeed and z3kit: DeepSpeed's defaults, except
#: that every parameter is sharded (with the default persistence threshold of
#: 1e5 elements every parameter of the tiny workload would stay gathered on
#: every rank, and resident memory would not be 1/N), and that buckets are
#: sized for these models: with the defaults (5e7-element prefetch, 5e8-element
#: reduce bucket) one bucket holds a whole 7.4M-parameter model, so neither
#: the gather nor the reduction can overlap any compute.
DEFAULT_ZERO_CONFIG: JSON = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 2_000_000,
    "reduce_bucket_size": 2_000_000,
}


def deepspeed_config(batch_size: int, world: int, zero: JSON | None = None) -> JSON:
    """The DeepSpeed config used: the shared ZeRO-3 knobs, fp32, torch.optim.Adam."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch_size * world,
        "zero_optimization": dict(zero if zero is not None else DEFAULT_ZERO_CONFIG),
        # DeepSpeed (0.19.8 here) clips to norm 1.0 by default; the other runtimes do not clip.
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            # torch_adam: torch.optim.Adam itself; adam_w_mode off: Adam, not AdamW.
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class _DeepSpeedRunner:
    peak_method = (
        "sampled after every PartitionedParameterCoordinator.fetch_sub_module: ds_numel of "
        "parameters AVAILABLE or INFLIGHT (persistent small parameters included)"
    )

    def __init__(self, wl: Workload, world: int, zero: JSON) -> None:
        import logging

        ds: Any = importlib.import_module("deepspeed")
        ds.utils.logger.setLevel(logging.WARNING)
        ds.init_distributed(dist_backend="gloo", verbose=False)
        self.wl = wl
        model = wl.build_model()
        self._params: list[Any] = list(model.parameters())
        if getattr(getattr(model, "config", None), "tie_mode", None) == "functional":
            # The root uses tok_emb.weight outside tok_emb: DeepSpeed needs to be told.
            ds.zero.register_external_parameter(model, getattr(model, "tok_emb").weight)
        engine, _, _, _ = ds.initialize(
            model=model,
            model_parameters=self._params,
            config=deepspeed_config(wl.batch_size, world, zero),
        )
        self.engine = engine
        ppc: Any = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
        pp: Any = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
        self._coord_cls = ppc.PartitionedParameterCoordinator
        self._live_states = (pp.ZeroParamStatus.AVAILABLE, pp.ZeroParamStatus.INFLIGHT)
        self._orig_fetch: Callable[..., Any] | None = None
        self._peak = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _engine_step(self.engine, self.wl, x, y)

    def _sample(self) -> None:
        live = sum(int(p.ds_numel) for p in self._params if p.ds_status in self._live_states)
        self._peak = max(self._peak, live)

    def start_probe(self) -> None:
        self._peak = 0
        self._sample()
        orig: Callable[..., Any] = self._coord_cls.fetch_sub_module
        self._orig_fetch = orig
        runner = self

        def fetch_sub_module(coord: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(coord, *args, **kwargs)
            runner._sample()
            return out

        self._coord_cls.fetch_sub_module = fetch_sub_module

    def stop_probe(self) -> None:
        if self._orig_fetch is not None:
            self._coord_cls.fetch_sub_module = self._orig_fetch
            self._orig_fetch = None

    def peak_live_params(self) -> int | None:
        return self._peak

    def engine_stats(self) -> JSON | None:
        return None


def _plain(obj: object) -> Any:
    """Best-effort conversion of a stats object to JSON-able plain data."""
    if attrs.has(type(obj)):
        return _plain(attrs.asdict(obj, recurse=False))  # type: ignore[arg-type]
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return _plain(dataclasses.asdict(obj))  # type: ignore[call-overload]
    if isinstance(obj, dict):
        return {str(getattr(k, "value", k)): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "value") and not isinstance(obj, (int, float, str)):  # enums
        return _plain(obj.value)
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return repr(obj)


def _find_number(tree: Any, *words: str) -> int | None:
    """The first int in a nested dict whose key contains every word, else None."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if all(w in k.lower() for w in words) and isinstance(v, (int, float)):
                return int(v)
        for v in tree.values():
            found = _find_number(v, *words)
            if found is not None:
                return found
    return None


def _find_collectives(tree: Any) -> dict[str, int] | None:
    """A ``{kind: calls}`` mapping from the first key mentioning collectives."""
    if not isinstance(tree, dict):
        return None
    for k, v in tree.items():
        if "collective" in k.lower() and isinstance(v, dict):
            out: dict[str, int] = {}
            for kind, n in v.items():
                if isinstance(n, (int, float)):
                    out[kind] = int(n)
                elif isinstance(n, dict) and isinstance(n.get("calls"), (int, float)):
                    out[kind] = int(n["calls"])
            if out:
                return {kind: n for kind, n in out.items() if n}
    for v in tree.values():
        found = _find_collectives(v)
        if found is not None:
            return found
    return None


class _Z3kitRunner:
    peak_method = "z3kit engine.stats()"

    def __init__(self, wl: Workload, group: dist.ProcessGroup, zero: JSON) -> None:
        zero3: Any = importlib.import_module("z3kit_recipes.zero3")
        self.wl = wl
        model = wl.build_model()

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=LR)

        self.engine: Any = zero3.initialize(
            model,
            optimizer=make_optimizer,
            config=zero3.Zero3Config.from_deepspeed({"zero_optimization": zero}),
            process_group=group,
        )
        self._last: JSON | None = None
        self._peak = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _engine_step(self.engine, self.wl, x, y)

    def start_probe(self) -> None:
        self._peak = 0

    def stop_probe(self) -> None:
        pass

    def after_probe_step(self) -> None:
        stats = _plain(self.engine.stats())
        self._last = stats if isinstance(stats, dict) else {"stats": stats}
        peak = _find_number(self._last, "peak", "live")
        if peak is not None:
            self._peak = max(self._peak, peak)

    def peak_live_params(self) -> int | None:
        if self._last is None or _find_number(self._last, "peak", "live") is None:
            return None
        return self._peak

    def engine_stats(self) -> JSON | None:
        return self._last


# --------------------------------------------------------------------------- #
# Collective counting
# --------------------------------------------------------------------------- #


def _collective_kind(op_name: str) -> str:
    name = op_name.removeprefix("c10d::")
    for needle, kind in (
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("all_gather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("barrier", "barrier"),
        ("alltoall", "all_to_all"),
    ):
        if needle in name:
            return kind
    return name


def _count_collectives(events: Any) -> dict[str, int]:
    """Top-level ``c10d::`` ops among profiler events, counted by kind."""
    counts: Counter[str] = Counter()
    for ev in events:
        if not ev.name.startswith("c10d::"):
            continue
        parent = ev.cpu_parent
        nested = False
        while parent is not None:
            if parent.name.startswith("c10d::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            counts[_collective_kind(ev.name)] += 1
    return dict(sorted(counts.items()))


# --------------------------------------------------------------------------- #
# Worker
# --------------------------------------------------------------------------- #


@attrs.frozen
class RunSpec:
    """One (workload, runtime) run, sent to every spawned rank."""

    workload: str
    tie_mode: TieMode
    runtime: RuntimeName
    world: int
    #: candidate threads per rank; with more than one, a short trial of each
    #: (``trial_steps`` timed steps) picks the fastest for the real run.
    threads: tuple[int, ...]
    steps: int
    warmup: int
    probe_steps: int
    trial_steps: int
    #: bytecode cache for the heavy lazy imports ('' for none).
    pycache_dir: str
    #: the ``zero_optimization`` section shared by DeepSpeed and z3kit
    zero: JSON
    port: int
    out_path: str


def _build_runner(spec: RunSpec, wl: Workload, group: dist.ProcessGroup) -> _Runner:
    if spec.runtime == "ddp":
        return _DDPRunner(wl, group)
    if spec.runtime == "fsdp2":
        return _FSDP2Runner(wl, group, spec.world)
    if spec.runtime == "deepspeed":
        return _DeepSpeedRunner(wl, spec.world, spec.zero)
    return _Z3kitRunner(wl, group, spec.zero)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints a line at every profiler start/stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profiled_step(runner: _Runner, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():
        prof.start()
    try:
        runner.step(x, y)
    finally:
        with _quiet_stderr():
            prof.stop()
    return _count_collectives(prof.events())


def _measure(
    spec: RunSpec,
    rank: int,
    group: dist.ProcessGroup,
    *,
    threads: int,
    steps: int,
    warmup: int,
    probe_steps: int,
    give_up_s: float | None = None,
) -> JSON:
    """Build, time ``steps`` steps after ``warmup``, probe; the summary on every rank.

    With ``give_up_s`` (thread trials), the run stops as soon as a step after
    the first takes longer than that on some rank; the slow step is then the
    only one timed, and ``gave_up`` is set.
    """
    torch.set_num_threads(threads)
    wl = make_workload(spec.workload, tie_mode=spec.tie_mode)
    dist.barrier(group=group)
    t_build = time.perf_counter()
    runner = _build_runner(spec, wl, group)
    build_s = time.perf_counter() - t_build

    times: list[float] = []
    losses: list[float] = []
    gave_up = False
    for step in range(warmup + steps):
        x, y = wl.batch(rank, step)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        loss = runner.step(x, y)
        dt = time.perf_counter() - t0
        losses.append(float(loss.item()))
        if step >= warmup:
            times.append(dt)
        if give_up_s is not None and step > 0:
            slowest = torch.tensor([dt])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            if float(slowest) > give_up_s:
                gave_up = True
                times = [dt]
                break

    # Instrumented, untimed steps: collectives and peak live gathered params.
    collectives: list[dict[str, int]] = []
    runner.start_probe()
    try:
        for i in range(probe_steps):
            x, y = wl.batch(rank, warmup + steps + i)
            dist.barrier(group=group)
            collectives.append(_profiled_step(runner, x, y))
            if isinstance(runner, _Z3kitRunner):
                runner.after_probe_step()
    finally:
        runner.stop_probe()

    local: JSON = {
        "times": times,
        "losses": losses,
        "collectives": collectives,
        "peak": runner.peak_live_params(),
        "build_s": build_s,
    }
    gathered: list[Any] = [None] * spec.world
    dist.all_gather_object(gathered, local, group=group)

    timed = min(len(r["times"]) for r in gathered)
    step_times = [max(r["times"][i] for r in gathered) for i in range(timed)]
    mean_losses = [
        statistics.fmean(r["losses"][i] for r in gathered) for i in range(len(losses))
    ]
    peaks = [r["peak"] for r in gathered]
    per_step = collectives[-1] if collectives else None
    result: JSON = {
        "status": "ok",
        "threads": threads,
        "steps": timed,
        "warmup": warmup,
        "gave_up": gave_up,
        "median_s": statistics.median(step_times),
        "mean_s": statistics.fmean(step_times),
        "min_s": min(step_times),
        "max_s": max(step_times),
        "step_times_s": step_times,
        "losses": mean_losses,
        "build_s": max(r["build_s"] for r in gathered),
        "peak_live_params": None if any(p is None for p in peaks) else max(peaks),
        "peak_live_params_per_rank": peaks,
        "peak_live_params_method": runner.peak_method,
        "total_params": sum(p.numel() for p in wl.build_model().parameters()),
        "collectives_per_step": per_step,
        "collectives_same_every_step_and_rank": all(
            c == per_step for r in gathered for c in r["collectives"]
        ),
        "collectives_method": "torch.profiler: top-level c10d:: ops dispatched in one step",
    }
    stats = runner.engine_stats()
    if stats is not None:
        result["engine_stats"] = stats
        engine_coll = _find_collectives(stats)
        if engine_coll is not None:
            result["engine_collectives_per_step"] = engine_coll
    return result


def _worker(rank: int, spec: RunSpec) -> None:
    use_bytecode_cache(spec.pycache_dir)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world),
        LOCAL_WORLD_SIZE=str(spec.world),
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    torch.set_num_threads(spec.threads[0])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        assert group is not None
        trials: dict[str, float] = {}
        stopped: list[int] = []
        best = spec.threads[0]
        if len(spec.threads) > 1:
            for t in spec.threads:
                # A candidate 3x slower than the best so far is dropped early.
                limit = 3 * min(trials.values()) if trials else None
                trial = _measure(spec, rank, group, threads=t, steps=spec.trial_steps,
                                 warmup=min(spec.warmup, 2), probe_steps=0, give_up_s=limit)
                trials[str(t)] = trial["median_s"]
                if trial["gave_up"]:
                    stopped.append(t)
            best = int(min(trials, key=lambda k: trials[k]))
        result = _measure(spec, rank, group, threads=best, steps=spec.steps,
                          warmup=spec.warmup, probe_steps=spec.probe_steps)
        if trials:
            result["threads_trials_median_s"] = trials
            result["threads_trial_steps"] = spec.trial_steps
            result["threads_trials_stopped_early"] = stopped
        if rank == 0:
            Path(spec.out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _omp_threads(threads: int) -> Iterator[None]:
    """``OMP_NUM_THREADS`` for the spawned ranks, restored afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _launch(spec_args: dict[str, Any]) -> JSON:
    """Spawn ``world`` ranks for one run; its result, or an error result."""
    fd, out_path = tempfile.mkstemp(prefix="z3bench-", suffix=".json")
    os.close(fd)
    spec = RunSpec(port=free_port(), out_path=out_path, **spec_args)
    t0 = time.perf_counter()
    try:
        with _omp_threads(spec.threads[0]):
            _spawn(_worker, args=(spec,), nprocs=spec.world, join=True)
        result: JSON = json.loads(Path(out_path).read_text())
    except Exception as exc:  # noqa: BLE001 - one runtime failing must not stop the rest
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result = {"status": "error", "note": lines[-1] if lines else repr(exc), "error": str(exc)}
    finally:
        Path(out_path).unlink(missing_ok=True)
    result["wall_s"] = time.perf_counter() - t0
    if result["status"] == "ok":
        print(
            f"    done in {result['wall_s']:.1f} s (setup {result['build_s']:.1f} s): "
            f"median {result['median_s']:.4f} s/step at {result['threads']} thread(s)/rank",
            flush=True,
        )
    else:
        print(f"    failed after {result['wall_s']:.1f} s: {result['note']}", flush=True)
    return result


# --------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------- #


def thread_candidates(world: int, cores: int) -> tuple[int, ...]:
    """Threads per rank worth trying: 1, an even split of the cores, all cores."""
    return tuple(sorted({1, max(1, cores // world), max(1, cores)}))


def _fmt_int(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n:,}"


def _fmt_coll(c: dict[str, int] | None) -> str:
    if c is None:
        return "n/a"
    if not c:
        return "0"
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}
    total = sum(c.values())
    return f"{total} (" + " ".join(f"{short.get(k, k)}:{v}" for k, v in c.items()) + ")"


def render_table(report: JSON) -> str:
    """The on-screen table for a finished report."""
    lines: list[str] = []
    header = (
        f"{'workload':<8} {'runtime':<10} {'thr':>3} {'median s/step':>13} {'min':>7} {'vs DDP':>7} "
        f"{'peak live params':>16} {'total params':>12}  {'max|dloss| vs DDP':>17}  collectives/step"
    )
    for wl_name, wl in report["workloads"].items():
        lines.append(header)
        lines.append("-" * len(header))
        for rt_name, r in wl["runtimes"].items():
            if r["status"] != "ok":
                lines.append(f"{wl_name:<8} {rt_name:<10} {r['status']}: {r.get('note', '')}")
                continue
            ratio = r.get("ratio_vs_ddp")
            dloss = r.get("loss_max_abs_diff_vs_ddp")
            coll = r.get("engine_collectives_per_step", r.get("collectives_per_step"))
            coll_txt = _fmt_coll(coll)
            if "engine_collectives_per_step" in r and coll != r.get("collectives_per_step"):
                coll_txt += f" [profiler: {_fmt_coll(r.get('collectives_per_step'))}]"
            lines.append(
                f"{wl_name:<8} {rt_name:<10} {r['threads']:>3} {r['median_s']:>13.4f} {r['min_s']:>7.4f} "
                f"{'n/a' if ratio is None else f'{ratio:.2f}x':>7} "
                f"{_fmt_int(r.get('peak_live_params')):>16} {_fmt_int(r.get('total_params')):>12}  "
                f"{'n/a' if dloss is None else f'{dloss:.2e}':>17}  {coll_txt}"
            )
        cal = wl.get("ddp_threads_calibration")
        if cal:
            lines.append(
                "  DDP threads/rank calibration (median s/step): "
                + ", ".join(
                    f"{t}: {s:.4f}"
                    + (" (stopped: >3x slower)" if int(t) in wl.get("ddp_threads_stopped_early", []) else "")
                    for t, s in cal.items()
                )
                + f" ({wl['runtimes']['ddp'].get('threads_trial_steps')} steps each)"
                + f" -> {wl['threads']} for every runtime"
            )
        lines.append("")
    lines += [
        "median s/step: slowest rank per step, median over the measured steps (warm-up excluded);",
        "  min: the fastest such step (less sensitive to other load on the machine).",
        "peak live params: gathered parameter elements at once on a rank; DDP: its full replica;",
        "  FSDP2/DeepSpeed: sampled at every gather (JSON: *_method); z3kit: engine.stats().",
        "collectives/step: z3kit from its engine log; others: c10d ops seen by torch.profiler",
        "  (AG all-gather, RS reduce-scatter, AR all-reduce, BC broadcast).",
        "max|dloss| vs DDP: largest difference of the rank-averaged loss over all steps.",
    ]
    return "\n".join(lines)


def _parse_runtimes(text: str) -> list[RuntimeName]:
    if text == "all":
        return list(RUNTIMES)
    out: list[RuntimeName] = []
    for part in text.split(","):
        part = part.strip()
        if part not in RUNTIMES:
            raise argparse.ArgumentTypeError(f"unknown runtime {part!r}; choose from {RUNTIMES}")
        out.append(part)  # checked against RUNTIMES above
    return out


def _parse_threads(text: str) -> int | None:
    if text == "auto":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("--threads must be 'auto' or >= 1")
    return n


def _parse_zero_config(text: str) -> JSON:
    try:
        zero = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--zero-config is not JSON: {exc}") from None
    if not isinstance(zero, dict) or zero.get("stage", 3) != 3:
        raise argparse.ArgumentTypeError("--zero-config is a JSON object for ZeRO stage 3")
    zero = {"stage": 3, **zero}
    try:  # refuse what z3kit would refuse, before any process starts
        from z3kit_recipes.zero3 import Zero3Config

        Zero3Config.from_deepspeed({"zero_optimization": zero})
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return zero


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m z3kit_recipes.bench",
        description="Median step time of DDP, FSDP2, DeepSpeed ZeRO-3 and z3kit zero3 on CPU/gloo.",
    )
    p.add_argument("--workload", choices=[*WORKLOAD_NAMES, "all"], default="all")
    p.add_argument("--world", type=int, default=2, help="ranks (local CPU processes, gloo)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"measured steps (default {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed warm-up steps first (default {DEFAULT_WARMUP})")
    p.add_argument("--probe-steps", type=int, default=2,
                   help="untimed instrumented steps after the measured ones (collectives, peaks)")
    p.add_argument("--runtimes", type=_parse_runtimes, default=list(RUNTIMES),
                   help="comma list of " + ",".join(RUNTIMES) + " (default: all available)")
    p.add_argument("--threads", type=_parse_threads, default=None,
                   help="intra-op threads per rank, or 'auto' (default): fastest for DDP")
    p.add_argument("--tie-mode", choices=TIE_MODES, default="hf",
                   help="GPT's tied embedding: hf (lm_head module) or functional (F.linear)")
    p.add_argument("--trial-steps", type=int, default=8,
                   help="timed steps of each DDP thread-count trial under --threads auto")
    p.add_argument("--pycache-dir", default=PYCACHE_DIR,
                   help="bytecode cache (sys.pycache_prefix) for the spawned ranks' lazy imports "
                        "(default %(default)s); '' to leave the interpreter's setting alone")
    p.add_argument("--zero-config", type=_parse_zero_config, default=DEFAULT_ZERO_CONFIG,
                   help="JSON of the zero_optimization section given to DeepSpeed and z3kit alike "
                        f"(default: {json.dumps(DEFAULT_ZERO_CONFIG)}; '{{\"stage\": 3}}' for DeepSpeed's defaults)")
    p.add_argument("--out", type=Path, default=Path("runs/bench.json"), help="JSON report path")
    return p


def run(args: argparse.Namespace) -> JSON:
    world: int = args.world
    if world < 1:
        raise SystemExit("--world must be >= 1")
    cores = os.cpu_count() or 1
    avail = available_runtimes()
    requested: list[RuntimeName] = args.runtimes
    if "ddp" not in requested:
        requested = ["ddp", *requested]  # the baseline (and the thread choice) needs it
    for rt in requested:
        if avail.get(rt):
            print(f"note: skipping {rt}: {avail[rt]}", flush=True)
    workloads = list(WORKLOAD_NAMES) if args.workload == "all" else [args.workload]
    ds_version = None
    if not avail.get("deepspeed"):
        from importlib.metadata import version

        ds_version = version("deepspeed")
    report: JSON = {
        "meta": {
            "world": world,
            "cpu_count": cores,
            "torch": torch.__version__,
            "deepspeed": ds_version,
            "python": sys.version.split()[0],
            "lr": LR,
            "dtype": "float32",
            "tie_mode": args.tie_mode,
            "probe_steps": args.probe_steps,
            "zero_optimization": args.zero_config,
            "deepspeed_config": deepspeed_config(0, world, args.zero_config) if ds_version else None,
        },
        "workloads": {},
    }
    load = os.getloadavg()[0]
    report["meta"]["loadavg_1min_start"] = load
    if load > 0.5:
        print(f"note: 1-min load average is {load:.1f} on {cores} cores before the first run; "
              "other processes compete for the CPUs and the timings will show it", flush=True)
    t_all = time.perf_counter()
    for wl_name in workloads:
        steps = args.steps if args.steps is not None else DEFAULT_STEPS[wl_name]
        warmup = args.warmup if args.warmup is not None else DEFAULT_WARMUP[wl_name]
        if steps < 1 or warmup < 0:
            raise SystemExit("--steps must be >= 1 and --warmup >= 0")
        common: dict[str, Any] = dict(
            workload=wl_name, tie_mode=args.tie_mode, world=world, steps=steps,
            warmup=warmup, probe_steps=max(1, args.probe_steps),
            trial_steps=min(steps, args.trial_steps), pycache_dir=args.pycache_dir,
            zero=args.zero_config,
        )
        wl_report: JSON = {"steps": steps, "warmup": warmup, "runtimes": {}}
        report["workloads"][wl_name] = wl_report

        cands = (args.threads,) if args.threads is not None else thread_candidates(world, cores)
        print(f"[{wl_name}] ddp (threads/rank: {', '.join(map(str, cands))}) ...", flush=True)
        ddp = _launch(dict(common, runtime="ddp", threads=cands))
        wl_report["runtimes"]["ddp"] = ddp
        threads: int = ddp["threads"] if ddp["status"] == "ok" else cands[0]
        wl_report["threads"] = threads
        if "threads_trials_median_s" in ddp:
            wl_report["ddp_threads_calibration"] = ddp["threads_trials_median_s"]
            wl_report["ddp_threads_stopped_early"] = ddp["threads_trials_stopped_early"]

        for rt in requested:
            if rt == "ddp":
                continue
            if avail.get(rt):
                wl_report["runtimes"][rt] = {"status": "skipped", "note": avail[rt]}
                continue
            print(f"[{wl_name}] {rt} (threads/rank: {threads}) ...", flush=True)
            wl_report["runtimes"][rt] = _launch(dict(common, runtime=rt, threads=(threads,)))

        base = wl_report["runtimes"]["ddp"]
        for r in wl_report["runtimes"].values():
            if r["status"] != "ok" or base["status"] != "ok":
                continue
            r["ratio_vs_ddp"] = r["median_s"] / base["median_s"]
            diffs = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
            r["loss_max_abs_diff_vs_ddp"] = max(diffs) if diffs else None
            if any(math.isnan(v) for v in r["losses"]):
                r["loss_max_abs_diff_vs_ddp"] = float("nan")
    report["meta"]["total_wall_s"] = time.perf_counter() - t_all
    report["meta"]["loadavg_1min_end"] = os.getloadavg()[0]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_bytecode_cache(args.pycache_dir)
    report = run(args)
    print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render_table(report))
    meta = report["meta"]
    print(
        f"total {meta['total_wall_s']:.1f} s; 1-min load average {meta['loadavg_1min_start']:.1f} "
        f"at the start, {meta['loadavg_1min_end']:.1f} at the end; report written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    # Run through the importable module so that the spawned ranks unpickle
    # ``z3kit_recipes.bench._worker`` rather than this ``__main__`` copy.
    from z3kit_recipes import bench as _bench

    raise SystemExit(_bench.main())
