"""Memory probes: what one rank holds now, and its peak since a reset.

The same probe measures every runtime, so the figures compare runtimes
rather than their own bookkeeping (which only some of them have).

On CPU the probe reads the process's resident set from
``/proc/self/status``: ``VmRSS`` (now) and ``VmHWM`` (the peak). Two
settings make those figures follow tensors rather than the C allocator:

- glibc keeps freed memory for reuse instead of returning it to the
  kernel: small blocks stay on its heap below the trim threshold, and a
  large block is only ``mmap``-ed (and ``munmap``-ed on free) above the
  mmap threshold, which glibc raises dynamically up to 32 MiB as large
  blocks are freed. Then a freed 20 MiB gradient bucket stays resident and
  the next step's peak hides in memory already counted. With
  ``MALLOC_MMAP_THRESHOLD_=65536`` (fixed: setting it disables the dynamic
  raise) every tensor above 64 KiB is its own mapping and leaves the
  resident set when freed; with ``MALLOC_TRIM_THRESHOLD_=0`` the heap is
  trimmed after every free. glibc reads these variables once, at process
  start, so ``malloc_returns_freed_memory`` sets them in the parent
  before the ranks are spawned.
- ``VmHWM`` is the peak over the process's whole life (imports, earlier
  phases). Writing ``5`` to ``/proc/self/clear_refs`` resets it to the
  current resident set (Linux >= 4.0), so a peak can be taken over one
  phase: reset at its start, read ``VmHWM`` at its end.

On an accelerator the probe reads the allocator's own figures instead
(``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats``
of ``torch.get_device_module``): they count tensors exactly, with no
allocator in between.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Final, Protocol

import torch

from z3kit_recipes.launch import environment

STATUS: Final = Path("/proc/self/status")
CLEAR_REFS: Final = Path("/proc/self/clear_refs")
#: "5": reset the peak resident set (VmHWM) to the current one (proc(5))
_RESET_PEAK_RSS: Final = "5"

#: the glibc malloc settings under which the resident set follows tensors
GLIBC_MALLOC_ENV: Final[dict[str, str]] = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
}


class MemoryProbe(Protocol):
    """Bytes one process holds now, and at their peak since ``reset_peak``."""

    #: how the figures are obtained (shown in the report)
    method: str

    def current(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...


def read_status_kib(field: str, status: Path = STATUS) -> int:
    """One ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in KiB."""
    for line in status.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0])
    raise KeyError(f"{field} not in {status}")


def clear_refs_writable() -> bool:
    """Whether this process may reset its peak resident set."""
    try:
        with CLEAR_REFS.open("w") as f:
            f.write(_RESET_PEAK_RSS)
    except OSError:
        return False
    return True


class ResidentSetProbe:
    """``VmRSS`` / ``VmHWM`` of this process; the peak reset through ``clear_refs``.

    Where ``clear_refs`` cannot be written, ``peak`` is the peak since the
    process started, and ``method`` says so.
    """

    def __init__(self) -> None:
        self.can_reset = clear_refs_writable()
        self.method = (
            "process resident set (/proc/self/status VmRSS, peak VmHWM reset through "
            "/proc/self/clear_refs), glibc " + ", ".join(f"{k}={v}" for k, v in GLIBC_MALLOC_ENV.items())
        )
        if not self.can_reset:
            self.method += "; clear_refs not writable: peaks are since process start"

    def current(self) -> int:
        return read_status_kib("VmRSS") * 1024

    def peak(self) -> int:
        return read_status_kib("VmHWM") * 1024

    def reset_peak(self) -> None:
        if self.can_reset:
            CLEAR_REFS.write_text(_RESET_PEAK_RSS)


class AllocatorProbe:
    """The device allocator's allocated bytes and their peak, on one accelerator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module: Any = torch.get_device_module(device.type)
        self.method = f"{device.type} allocator: memory_allocated, max_memory_allocated"

    def current(self) -> int:
        return int(self._module.memory_allocated(self.device))

    def peak(self) -> int:
        return int(self._module.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        self._module.reset_peak_memory_stats(self.device)


def memory_probe(device: torch.device) -> MemoryProbe:
    """The probe for where the model's tensors live."""
    if device.type == "cpu":
        return ResidentSetProbe()
    return AllocatorProbe(device)


def malloc_returns_freed_memory() -> contextlib.AbstractContextManager[None]:
    """``GLIBC_MALLOC_ENV`` in ``os.environ`` for processes started inside, restored after.

    Only child processes see it: glibc read the variables when this process started.
    """
    return environment(GLIBC_MALLOC_ENV)
