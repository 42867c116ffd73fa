"""Ranks that disagree get the same clear error, never a hang.

At the end of every backward the ranks compare, in one small all-gather,
where they are (optimizer step, micro-step), what they did (how many
gathers they issued, and a fingerprint of the modules they
fetched, in order), and which parameters got a gradient (and which got a
second one after their reduction was issued, ``zero3.grads``). Which parameters
got a gradient on some rank is what the optimizer then sees (the rest
have none, as after ``zero_grad(set_to_none=True)``); any other difference
means the ranks no longer run the same program, and every rank raises
``RanksDisagree`` with the same message: the first fetch at which they
differ, and what each rank did there. ``zero3.sideband`` covers the cases
where a rank cannot reach the check at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist

from z3kit.collectives import Blocker, Pending, ProcessGroup, all_gather

#: completes a collective while watching the other ranks (``z3kit.collectives.Blocker``)
Waiter = Blocker


class RankAgreement(Protocol):
    """How a parameter coordinator makes sure the ranks fetch alike."""

    def agree(self, index: int, fetch: tuple[str, int] | None) -> None:
        """Every rank is about to do forward fetch ``index`` the same way (collective)."""
        ...

    def left_trace(self, index: int, what: str) -> None:
        """This rank's forward fetch ``index`` departs from the recorded trace."""
        ...


#: words of the header every rank sends: step, micro-step, gathers, fetch count, fingerprint (not the
#: reductions: they follow a fixed plan, but how many of them a rank issued before the check varies)
HEADER_WORDS = 5
_MASK = (1 << 62) - 1
#: flag bits a rank sends per trainable parameter: its gradient arrived here
ARRIVED = 1
#: ... and a second one arrived after its reduction was issued (reduced after the check)
LATE = 2


class RanksDisagree(RuntimeError):
    """The ranks are not running the same training step; raised on every rank."""


@attrs.define
class StepRecord:
    """What one rank did in the current backward (and the forward before it)."""

    #: (module name, elements) of every fetch, in order
    fetches: list[tuple[str, int]] = attrs.field(factory=list)
    gathers: int = 0

    def fingerprint(self) -> int:
        # not hash(): string hashes differ between processes
        digest = hashlib.blake2b(repr(self.fetches).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & _MASK

    def clear(self) -> None:
        self.fetches.clear()
        self.gathers = 0


def start_step_check(
    group: ProcessGroup,
    device: torch.device,
    *,
    global_step: int,
    micro_step: int,
    record: StepRecord,
    flags: Sequence[int],
) -> StepCheck:
    """Begin comparing this backward across ranks (collective, in flight:
    the end of backward's last reductions overlap it); ``StepCheck.result``
    completes it."""
    world = dist.get_world_size(group)
    words = [global_step, micro_step, record.gathers, len(record.fetches), record.fingerprint()]
    packed = torch.zeros((len(flags) + 7) // 8 * 8, dtype=torch.uint8)  # one byte a parameter, eight to a word
    packed[: len(flags)] = torch.tensor(list(flags), dtype=torch.uint8)
    mine = torch.cat([torch.tensor(words, dtype=torch.int64), packed.view(torch.int64)]).to(device)
    everyone = mine.new_empty(world * mine.numel())
    pending = all_gather(everyone, mine, group, async_op=True)
    return StepCheck(group, pending, everyone, len(flags), list(record.fetches))


@attrs.frozen
class StepCheck:
    """A step check in flight (``start_step_check``)."""

    group: ProcessGroup
    pending: Pending
    everyone: torch.Tensor
    n_params: int
    fetches: list[tuple[str, int]]

    def result(self, waiter: Waiter) -> list[int]:
        """For each trainable parameter, the flags of every rank or'ed
        (``ARRIVED``: some rank gave it a gradient; ``LATE``: some rank holds
        a late one). Raises ``RanksDisagree`` on every rank when anything else differs."""
        waiter(self.pending.is_completed, self.pending.wait)
        table = self.everyone.view(dist.get_world_size(self.group), -1).cpu()
        headers = table[:, :HEADER_WORDS].tolist()
        if any(h != headers[0] for h in headers):
            _raise_disagreement(self.group, headers, self.fetches)
        flags_of_all = table[:, HEADER_WORDS:].contiguous().view(torch.uint8)[:, : self.n_params]
        if not self.n_params:
            return []
        out: list[int] = sum(((flags_of_all & bit).amax(dim=0) for bit in (ARRIVED, LATE)), torch.zeros(
            self.n_params, dtype=torch.uint8)).tolist()
        return out


def _raise_disagreement(group: ProcessGroup, headers: list[list[int]], mine: list[tuple[str, int]]) -> None:
    """Every rank learns every rank's fetches and raises the same message."""
    world = dist.get_world_size(group)
    fetches: list[list[tuple[str, int]] | None] = [None] * world
    dist.all_gather_object(fetches, mine, group=group)
    logs = [f or [] for f in fetches]
    steps = sorted({(h[0], h[1]) for h in headers})
    lines = [f"the ranks are not running the same step: at the end of backward they are at (optimizer step, "
             f"micro-step) {', '.join(f'rank {r} {tuple(h[:2])}' for r, h in enumerate(headers))}"]
    first = next((i for i in range(max(map(len, logs))) if len({tuple(log[i]) if i < len(log) else None
                                                              for log in logs}) > 1), None)
    if first is not None:
        did = [f"rank {r} fetched {log[first][0]!r} ({log[first][1]:,} elements)" if first < len(log)
               else f"rank {r} had no fetch #{first} (its step had {len(log)})" for r, log in enumerate(logs)]
        lines.append(f"first difference at fetch #{first} of the step: " + "; ".join(did))
    else:
        lines.append("they fetched the same modules; gathers issued: "
                     + ", ".join(f"rank {r} {h[2]}" for r, h in enumerate(headers)))
    if len(steps) > 1:
        lines.append("a rank skipped a micro-step, or ran one more: every rank must run the same number of "
                     "forward/backward passes between optimizer steps")
    else:
        lines.append("a module ran a different number of times, or on some ranks only; every rank must fetch "
                     "the same modules in the same order (mark a rank-dependent subtree as a leaf module, so "
                     "that it is gathered as one unit)")
    raise RanksDisagree("; ".join(lines))


def agree_on_fetch(
    group: ProcessGroup,
    device: torch.device,
    waiter: Waiter,
    *,
    micro_step: int,
    index: int,
    fetch: tuple[str, int] | None,
) -> None:
    """Before a forward fetch that no recorded trace vouches for: every rank
    must be about to fetch the same module (``fetch``: its name and
    elements; None: this rank's forward is over). Collective; raises
    ``RanksDisagree`` on every rank, before any gather could mismatch."""
    world = dist.get_world_size(group)
    name_hash = -1 if fetch is None else int.from_bytes(hashlib.blake2b(fetch[0].encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([micro_step, index, name_hash, -1 if fetch is None else fetch[1]], dtype=torch.int64, device=device)
    everyone = mine.new_empty(world * mine.numel())
    pending = all_gather(everyone, mine, group, async_op=True)
    waiter(pending.is_completed, pending.wait)
    rows = everyone.view(world, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    fetches: list[tuple[str, int] | None] = [None] * world
    dist.all_gather_object(fetches, fetch, group=group)
    did = [f"rank {r} fetches {f[0]!r} ({f[1]:,} elements)" if f else f"rank {r} has finished its forward"
           for r, f in enumerate(fetches)]
    raise RanksDisagree(
        f"the ranks are not running the same forward: at fetch #{index} of micro-step {micro_step}, "
        + "; ".join(did)
        + "; every rank must run the same modules in the same order while a trace is recorded (a "
        "rank-dependent subtree can be marked as a leaf module, gathered as one unit)"
    )
