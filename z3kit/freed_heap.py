"""Give the pages the C allocator keeps free back to the kernel, between optimizer steps.

Note: why a sharded step needs it.
    Each step of a ZeRO-3 engine allocates and frees the gathered
    parameters, the gradient buckets and their staging tensors on the host;
    DDP allocates its buckets once. glibc's malloc keeps what is freed on its
    heaps for reuse and gives memory back to the kernel only from the top of
    a heap (past ``M_TRIM_THRESHOLD``); the buffers of one step do not land
    where the last step's were, and the long-lived blocks allocated between
    them pin the tops, so the free part of the heaps grows with the run.
    Measured (issue 41, 2 gloo ranks, the main job's model): glibc's bytes
    in use stay at 113-115 MB while its free bytes grow 0.3 MB a step (37 ->
    259 MB over 800 steps) and the resident set with them (362 -> 590 MB);
    ``malloc_trim(0)`` at the end brings it back to 338 MB. Nothing is
    leaked (the same run's tracemalloc and glibc's in-use bytes are flat);
    the engine's own process group is not the cause either (the engine on
    the user's group grows the same).

Note: when it trims.
    ``malloc_trim(0)`` returns every free page of every heap, the ones the
    next step will reuse too, which that step then faults in again: 10 ms a
    trim there (31 ms at most), and the faults on top. So a process trims only once
    its resident set at a step's end has grown by ``margin`` (4 MiB, or
    1/128 of the resident set if larger) over the resident set at the end
    of the first step after the last trim (which holds the step's working
    set again). With a 16 MiB margin that run trimmed 46 and 50 times per
    rank in 800 steps and stayed at 375-392 MB, but the bench's 2,000 steps
    (``python -m z3kit_recipes.bench --long-run``) found its envelope
    growing 3.9 MB per 1,000 steps against DDP's 0.5; 4 MiB keeps it
    within DDP's plus 2 (docs/measurements.md). Memory that is really
    held (a growing cache of the user's) costs one trim per margin it
    grows, and no more.

    The price at 4 MiB, on that model: 18-30% of its 90 ms step (400 steps
    in 43.5 and 44.5 s against 37.0 and 34.1 s without), since each trim
    makes the next step fault its working set in again. A stopgap: a step
    that reuses its buffers would leave nothing to trim.

Where the C library is not glibc (musl, macOS, Windows), or it lacks
``malloc_trim``, this does nothing. No allocator setting is changed:
``MALLOC_MMAP_THRESHOLD_`` and friends stay the user's.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Final

#: the least growth of the resident set, in bytes, that a trim answers
MIN_MARGIN_BYTES: Final = 4 * 2**20
#: the margin as a fraction of the resident set, where that is larger
MARGIN_FRACTION: Final = 1 / 128
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set (``/proc/self/statm``), or None where there is no procfs."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def glibc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc or lacks it."""
    try:  # "glibc 2.35"; musl and macOS have no such name
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
    except (ValueError, OSError, AttributeError):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def run() -> None:
        trim(0)

    return run


class FreedHeap:
    """Decides, at each optimizer step's end, whether to give the free heap back (see the Notes)."""

    def __init__(self, trim: Callable[[], None] | None, read_resident: Callable[[], int | None] = resident_bytes) -> None:
        self._trim, self._read = trim, read_resident
        #: the resident set at the end of the first step after the last trim (None: take the next)
        self.reference: int | None = None
        #: trims done so far
        self.trims = 0
        self._lock = threading.Lock()  # engines of one process share it, each stepping from its own thread maybe

    def step_ended(self) -> bool:
        """Called after each optimizer step; True when it trimmed."""
        if self._trim is None:
            return False
        resident = self._read()
        if resident is None:
            return False
        with self._lock:
            if self.reference is None:
                self.reference = resident
                return False
            if resident <= self.reference + max(MIN_MARGIN_BYTES, int(self.reference * MARGIN_FRACTION)):
                return False
            self._trim()
            self.trims += 1
            self.reference = None
            return True


#: the process's heap is one, whatever the number of engines: they share this
PROCESS_HEAP: Final = FreedHeap(glibc_trim())
