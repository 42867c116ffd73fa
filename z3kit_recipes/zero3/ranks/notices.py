"""What ranks say to each other on the notice board, and how a message quotes it.

Each notice starts with its kind: a rank that failed, one that waits in a
collective (or stopped waiting), a note that explains a failure should one
follow, and a rank that left the run the others follow at a point (a
departure from the recorded trace, an eval forward, a collective call).
``RankWatch`` (``zero3.ranks.rank_watch``) posts and reads them.
"""

from __future__ import annotations

from z3kit.sideband import Notice

FAILED = "failed: "
NOTE = "note: "
WAITING = "waiting: "
#: a rank left the recorded trace of a step: "left: <micro-step> <fetch index> <what it does>"
LEFT = "left: "
#: how long a rank that found trouble gives the others to post their side
ANSWER_S = 3.0
#: how long a rank waits at a meeting before it warns that some ranks have not come
PATIENCE_S = 10.0
#: what trace departures (index >= 0) advise
TRACE_ADVICE = ("every rank must run the same modules in the same order (a rank-dependent subtree can be marked as a "
                 "leaf module, gathered as one unit)")


def departure_place(where: tuple[int, int]) -> str:
    """Where a rank left the run the others follow: a forward fetch of a
    micro-step, or (a negative index) a point before that micro-step's
    forward: an unfreeze, an eval forward (``zero3.ranks.uneven``)."""
    micro, index = where
    if index >= 0:
        return f"left the recorded step at fetch #{index} of micro-step {micro}"
    return f"after {micro} backward(s)"


#: what works after a failure (the engine's group can no longer pair; the user's default group still does)
RECOVER = ("This engine is done: resume from the last checkpoint with a new engine (zero3.initialize, which makes "
           "a group of its own, then engine.load_checkpoint), or exit non-zero so that torchrun --max-restarts "
           "restarts the job")


def quoted(notice: Notice) -> str:
    """A notice as part of a message: its rank, then what it said (which may name the rank already)."""
    said = notice.message.split(": ", 1)[1]
    return said if said.startswith(f"rank {notice.rank} ") else f"rank {notice.rank} {said}"
