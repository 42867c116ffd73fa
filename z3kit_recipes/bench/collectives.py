"""Collectives per step as seen by ``torch.profiler``, for any runtime.

Every ``c10d::`` operator a step dispatches on the calling thread is
counted, top-level ops only (so a coalesced op is one call), grouped by
kind. This sees DDP's C++ reducer as well as Python-level calls, and needs
no patching of the runtimes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

METHOD = "torch.profiler: top-level c10d:: ops dispatched in one step"

_KINDS = (
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("alltoall", "all_to_all"),
)


def collective_kind(op_name: str) -> str:
    """``c10d::allgather_into_tensor_coalesced_`` -> ``all_gather``; unknown names kept."""
    name = op_name.removeprefix("c10d::")
    for needle, kind in _KINDS:
        if needle in name:
            return kind
    return name


def count_collectives(events: Any) -> dict[str, int]:
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
            counts[collective_kind(ev.name)] += 1
    return dict(sorted(counts.items()))


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


def profiled_collectives(step: Callable[[], object], synchronize: Callable[[], None]) -> dict[str, int]:
    """Run ``step`` under the profiler; the collectives it dispatched, by kind.

    ``synchronize`` runs before the profiler stops: a gloo work issued under
    the profiler and completed after it stopped can crash the process.
    """
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():
        prof.start()
    try:
        step()
        synchronize()
    finally:
        with _quiet_stderr():
            prof.stop()
    return count_collectives(prof.events())
