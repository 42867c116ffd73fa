"""Host-sync and memory sections of ``bench.gpu``.

Host syncs: after ``warmup`` steps, each of ``sync_steps`` steps runs the
engine's three calls (forward, backward, step) each inside its own
``z3kit.host_sync.HostSyncCounter``: only the engine's calls are watched
(the loss, the batch and the reading of the loss are the user's). The
counter is the count; ``SyncSites`` says where in the code each watched
Python call was made (on CUDA the sync debug mode also sees syncs that no
Python call of ``SYNCING_CALLS`` makes, which then have no site).

Memory: after ``warmup`` steps (so that Adam's state exists), one more step
is run phase by phase (forward with the loss, backward, step); for each
phase the allocator's peak (``max_memory_allocated`` reset at the phase's
start; the process's resident set on CPU) is set next to what the engine's
``MemoryLedger`` says each kind held at its peak in the same phase. The
ledger counts the engine's own buffers only: the difference is activations,
inputs, the loss and temporaries.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch
from torch.overrides import TorchFunctionMode

import z3kit_recipes
from z3kit.host_sync import SYNCING_CALLS, HostSyncCounter
from z3kit_recipes.bench.gpu_rank import RankContext, Section, each_case
from z3kit_recipes.bench.runners import adam
from z3kit_recipes.bench.rss import memory_probe
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.models import Workload
from z3kit_recipes.zero3 import Zero3Engine, initialize

T = TypeVar("T")

#: the engine calls a training step makes, in order
ENGINE_CALLS: Final = ("forward", "backward", "step")
#: frames in these directories are not a sync's site: torch's own, and this module's
_TORCH_DIR: Final = os.path.dirname(torch.__file__)
_REPO_ROOT: Final = os.path.dirname(os.path.dirname(z3kit_recipes.__file__))


def _where(frame: Any) -> str:
    path: str = frame.f_code.co_filename
    if path.startswith(_REPO_ROOT + os.sep):
        path = os.path.relpath(path, _REPO_ROOT)
    elif "site-packages" + os.sep in path:  # an installed package: from its own name on
        path = path.rsplit("site-packages" + os.sep, 1)[1]
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _site() -> str:
    """``path:line in function`` of the innermost frame that is neither torch's, nor
    a ``__torch_function__`` passing the call on (z3kit's own modes), nor this
    module's; with the innermost torch frame, when torch made the call itself
    (an optimizer reading its step count, say)."""
    frame = sys._getframe(1)
    via = None
    while frame.f_back is not None:
        name = frame.f_code.co_filename
        if name.startswith(_TORCH_DIR):
            via = via or frame
        elif name != __file__ and frame.f_code.co_name != "__torch_function__":
            break
        frame = frame.f_back
    return _where(frame) + ("" if via is None else f" (via {_where(via)})")


class SyncSites(TorchFunctionMode):
    """Where each call of ``SYNCING_CALLS`` inside the block was made.

    Entered inside a ``HostSyncCounter``, so it sees each call first and
    passes it on: the counter still counts it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in SYNCING_CALLS:
            self.sites.append(f"{getattr(func, '__qualname__', func)} at {_site()}")
        return func(*args, **(kwargs or {}))


def _watched(ctx: RankContext, into: dict[str, Any], call: str, fn: Callable[[], T]) -> T:
    """``fn()`` with its host syncs counted (and their sites) under ``into[call]``."""
    with HostSyncCounter(ctx.device) as counter, SyncSites() as sites:
        out = fn()
    into[call] = {"count": counter.count, "calls": list(counter.calls), "sites": list(sites.sites)}
    return out


def _train_step(engine: Zero3Engine, wl: Workload, rank: int, step: int) -> None:
    x, y = wl.batch(rank, step)
    engine.backward(wl.loss(engine(x), y))
    engine.step()


def _engine(ctx: RankContext, wl: Workload, dtype: str) -> Zero3Engine:
    engine = initialize(wl.build_model(), adam, ctx.config(dtype), ctx.group)
    for step in range(ctx.sizes.warmup):
        _train_step(engine, wl, ctx.rank, step)
    return engine


def host_sync_case(ctx: RankContext, wl: Workload, dtype: str) -> JSON:
    engine = _engine(ctx, wl, dtype)
    steps: list[dict[str, Any]] = []
    waits: list[int] = []  # the engine's own reads that waited on the device (``Zero3Stats.host_waits``)
    for i in range(ctx.sizes.sync_steps):
        x, y = wl.batch(ctx.rank, ctx.sizes.warmup + i)
        calls: dict[str, Any] = {}
        before = engine.stats().host_waits
        out = _watched(ctx, calls, "forward", lambda: engine(x))
        loss = wl.loss(out, y)
        _watched(ctx, calls, "backward", lambda: engine.backward(loss))
        _watched(ctx, calls, "step", engine.step)
        steps.append(calls)
        waits.append(engine.stats().host_waits - before)
    return {
        "per_step": [sum(c["count"] for c in s.values()) for s in steps],
        "engine_host_waits_per_step": waits,
        "per_call_per_step": {call: [s[call]["count"] for s in steps] for call in ENGINE_CALLS},
        # totals over the counted steps, by engine call: what synchronized, and from where
        "calls": {call: dict(collections.Counter(c for s in steps for c in s[call]["calls"])) for call in ENGINE_CALLS},
        "sites": {call: dict(collections.Counter(c for s in steps for c in s[call]["sites"])) for call in ENGINE_CALLS},
    }


def merge_host_syncs(per_rank: list[JSON]) -> JSON:
    """The worst step of any rank (an int), each rank's counts, rank 0's calls and sites."""
    return {
        "syncs_per_step": max(max(r["per_step"], default=0) for r in per_rank),
        "per_step_per_rank": [r["per_step"] for r in per_rank],
        "engine_host_waits_per_step": max(max(r["engine_host_waits_per_step"], default=0) for r in per_rank),
        "per_call_per_step_rank0": per_rank[0]["per_call_per_step"],
        "calls_rank0": per_rank[0]["calls"],
        "sites_rank0": per_rank[0]["sites"],
    }


def summarize_host_syncs(cases: JSON, ctx: RankContext) -> JSON:
    counted = [c["syncs_per_step"] for c in cases.values() if c["status"] == "ok"]
    return {
        # the worst case's worst step; None when no case ran
        "syncs_per_step": max(counted) if counted else None,
        "expected": 0,
        "warmup_steps": ctx.sizes.warmup,
        "counted_steps": ctx.sizes.sync_steps,
        "method": ("cuda sync debug mode (set_sync_debug_mode('warn'))" if ctx.device.type != "cpu" else
                   "CPU stand-in: a TorchFunctionMode counting the calls that synchronize on an accelerator"),
    }


def memory_case(ctx: RankContext, wl: Workload, dtype: str) -> JSON:
    engine = _engine(ctx, wl, dtype)
    probe = memory_probe(ctx.device)
    x, y = wl.batch(ctx.rank, ctx.sizes.warmup)
    phases: JSON = {}

    def phase(name: str, fn: Callable[[], T]) -> T:
        ctx.synchronize()
        # a window of ledger peaks per phase (the engine's own window spans forward to step)
        engine.memory.reset_peaks()
        at_start = engine.memory.report().current
        start = probe.current()
        probe.reset_peak()
        out = fn()
        ctx.synchronize()
        peak, end = probe.peak(), probe.current()
        ledger = engine.memory.report()
        phases[name] = {
            "allocator_start_bytes": start, "allocator_peak_bytes": peak, "allocator_end_bytes": end,
            "allocator_peak_above_start_bytes": peak - start,
            "ledger_start_bytes": dict(at_start), "ledger_peak_bytes": dict(ledger.peak),
            "ledger_end_bytes": dict(ledger.current), "ledger_peak_total_bytes": ledger.peak_total,
            # what the allocator held at its peak beyond the engine's own buffers at theirs
            "outside_ledger_at_peak_bytes": peak - ledger.peak_total,
        }
        return out

    loss = phase("forward", lambda: wl.loss(engine(x), y))
    phase("backward", lambda: engine.backward(loss))
    del loss
    phase("step", engine.step)
    stats = engine.stats()
    return {"method": probe.method, "probe": "process RSS" if ctx.device.type == "cpu" else "max_memory_allocated",
            "model_numel": stats.model_numel, "phases": phases,
            "engine_stats_memory": {"current_bytes": dict(stats.memory.current), "peak_bytes": dict(stats.memory.peak),
                                    "peak_total_bytes": stats.memory.peak_total,
                                    "device_peak_bytes": stats.memory.device_peak}}


def merge_memory(per_rank: list[JSON]) -> JSON:
    """Rank 0's figures, and every rank's."""
    return {**per_rank[0], "per_rank": [r["phases"] for r in per_rank]}


def summarize_memory(cases: JSON, ctx: RankContext) -> JSON:
    note = ("" if ctx.meaningful else
            "CPU dry run: process resident set of tiny models, shared cores; not meaningful")
    return {"meaningful": ctx.meaningful, "note": note}


HOST_SYNCS: Final = Section("host_syncs", lambda ctx: each_case(ctx, host_sync_case), merge_host_syncs,
                            summarize_host_syncs)
MEMORY: Final = Section("memory", lambda ctx: each_case(ctx, memory_case), merge_memory, summarize_memory)

__all__ = ["ENGINE_CALLS", "HOST_SYNCS", "MEMORY", "SyncSites"]
