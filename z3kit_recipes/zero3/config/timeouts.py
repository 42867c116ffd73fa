"""How long the engine waits for the other ranks, against the process group's own timeout.

The engine names a rank that failed or went quiet (``zero3.ranks.rank_watch``) only if
it gives up before the backend does: past the process group's timeout, NCCL's
watchdog aborts the communicator and ends the process with a message of its
own, and gloo raises a bare connection error on some ranks.
"""

from __future__ import annotations

from z3kit import process_group
from z3kit.collectives import ProcessGroup

#: ``collective_timeout_s`` where torch does not tell the process group's timeout
FALLBACK_TIMEOUT_S = 1800.0


def collective_timeout(asked: float | None, group: ProcessGroup) -> float:
    """``Zero3Config.collective_timeout_s`` against the process group's own
    timeout: the engine must give up first, so that every rank gets its
    message rather than the backend's watchdog ending the process."""
    limit = process_group.timeout_of(group)
    if asked is None:
        return FALLBACK_TIMEOUT_S if limit is None else 0.9 * limit.total_seconds()
    if limit is not None and asked >= limit.total_seconds():
        raise ValueError(
            f"Zero3Config.collective_timeout_s ({asked:g} s) must be shorter than the process group's timeout "
            f"({limit.total_seconds():g} s), or the backend gives up first (NCCL's watchdog ends the process) and "
            "the ranks never learn why; lower it, leave it unset (90% of the group's timeout), or pass a longer "
            "timeout= to torch.distributed.init_process_group / new_group")
    return asked
