"""``--profile``: a torch.profiler trace of a few steps per rank.

The traces (``trace_rank{r}.json``) open in Perfetto or chrome://tracing and
show the engine's labelled ranges (``z3kit.fetch <module>``,
``z3kit.release <module>``, ``z3kit.prefetch``, ``z3kit.reduce_bucket``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import torch

from z3kit_recipes.train.defaults import PROFILE_STEPS

#: label prefixes of the engine's profiler ranges
TRACE_LABELS: Final = ("z3kit.fetch", "z3kit.release", "z3kit.prefetch", "z3kit.reduce_bucket")


def profile_window(steps: int) -> tuple[int, int]:
    """Steps ``[first, end)`` whose forward and backward ``--profile`` records:
    ``PROFILE_STEPS`` steps near the end, after the first (which records the
    engine's trace), or ``(-1, -1)`` when there are too few steps.

    Note: where the profiler starts and stops.
        The profiler starts and stops between a backward and the optimizer
        step, where the engine has no collective in flight (``step()``
        issues the asynchronous re-gather of persistent parameters, which
        the next forward waits on). A trace therefore runs from the optimizer
        step before ``first`` to the backward of ``end - 1``.
    """
    first = max(1, steps - PROFILE_STEPS - 1)
    end = min(steps, first + PROFILE_STEPS)
    return (first, end) if first < end else (-1, -1)


def start_profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def stop_profiler(profiler: torch.profiler.profile, path: Path) -> None:
    profiler.stop()
    profiler.export_chrome_trace(str(path))


def trace_labels(path: Path) -> dict[str, int]:
    """How many ranges of each engine label a chrome trace holds (empty when there is no trace)."""
    if not path.is_file():
        return {}
    events = json.loads(path.read_text(encoding="utf-8")).get("traceEvents", [])
    counts = dict.fromkeys(TRACE_LABELS, 0)
    for event in events:
        name = event.get("name", "") if isinstance(event, dict) else ""
        for label in TRACE_LABELS:
            if isinstance(name, str) and name.startswith(label + " "):
                counts[label] += 1
    return counts
