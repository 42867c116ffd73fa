"""What z3kit needs of a process group that torch offers only privately.

Every private ``torch.distributed`` name z3kit uses lives here, behind a
function that says what it gives and what it does when torch lacks it;
``tests/test_process_group.py`` pins each one's behaviour, so that a torch
release that changes one fails there first.

- ``shared_store()``: the rendezvous store every process of the job
  shares (the notice board of ``z3kit.sideband`` lives in it);
- ``timeout_of(group)``: the process group's own timeout, after which its
  backend gives up on a collective (NCCL's watchdog aborts the
  communicator and, by default, the process);
- ``abort(group)``: tear the group's communicators down, so that work in
  flight and a host blocked on it fail instead of waiting.

Also ``waits_on_host(group)``: whether the backend's ``Work.wait()``
blocks the host (gloo, MPI) or only orders the device's streams (NCCL,
HCCL and other accelerator backends). See ``z3kit.collectives``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: backends whose ``Work.wait()`` blocks the host until the collective is done
HOST_WAITING_BACKENDS = frozenset({"gloo", "mpi"})


def waits_on_host(group: dist.ProcessGroup) -> bool:
    """True where ``Work.wait()`` blocks the calling thread until the
    collective finished; False where it makes the current stream wait and
    returns at once (accelerator backends)."""
    return str(dist.get_backend(group)).lower() in HOST_WAITING_BACKENDS


def shared_store() -> Any | None:
    """The store every process of the job shares, or None where there is none
    (no default group, or a torch without the lookup)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None


def timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group``'s backend applies to its collectives, or None
    where torch does not say."""
    for device_type in ("cuda", "npu", "xpu", "cpu"):
        try:
            backend = group._get_backend(torch.device(device_type))
        except (RuntimeError, ValueError, AttributeError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def abort(group: dist.ProcessGroup) -> bool:
    """Abort ``group``'s communicators (work in flight fails, later
    collectives on it raise). Returns False where this torch cannot."""
    method = getattr(group, "abort", None)
    if method is None:
        return False
    try:
        method()
    except RuntimeError:
        return False
    return True
