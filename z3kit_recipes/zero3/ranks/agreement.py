"""Ranks that disagree get the same clear error, never a hang.

At the end of every backward the ranks compare, in one small all-gather,
where they are (optimizer step, micro-step), what they did (how many
gathers they issued, and a fingerprint of the modules they
fetched, in order), and which parameters got a gradient (and which got a
second one after their reduction was issued, ``zero3.training.grads``). Which parameters
got a gradient on some rank is what the optimizer then sees (the rest
have none, as after ``zero_grad(set_to_none=True)``); any other difference
means the ranks no longer run the same program, and every rank raises
``RanksDisagree`` with the same message: the first fetch at which they
differ, and what each rank did there. ``z3kit.sideband`` covers the cases
where a rank cannot reach the check at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from z3kit.collectives import Blocker, Pending, ProcessGroup, all_gather
from z3kit.host_copy import HostCopy, to_device

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

    def agree_untraced(self, fetch: tuple[str, int]) -> None:
        """Every rank is about to gather for the same fetch of an eval or
        no_grad forward (collective where that forward's fetches are checked)."""
        ...

    def forget(self) -> None:
        """A forward or backward raised: its comparisons in flight are not read."""
        ...


#: words of the header every rank sends: step, micro-step, gathers, fetch count, fingerprint (not the
#: reductions: they follow a fixed plan, but how many of them a rank issued before the check varies)
HEADER_WORDS = 5
_MASK = (1 << 62) - 1
#: flag bits a rank sends per trainable parameter: its gradient arrived here
ARRIVED = 1
#: ... and a second one arrived after its reduction was issued (reduced after the check)
LATE = 2
#: its gradient (or a leaf unit's word that it has none) came during backward, not filled in at its end
HANDED = 4


#: how ``StepRecord.note_discarded`` names gradients set to None among the fetches
DISCARDED = "gradients set to None by zero_grad()"


class RanksDisagree(RuntimeError):
    """The ranks are not running the same training step; raised on every rank."""


@attrs.define
class StepRecord:
    """What one rank did in the current backward (and the forward before it)."""

    #: (module name, elements) of every fetch, in order
    fetches: list[tuple[str, int]] = attrs.field(factory=list)
    gathers: int = 0

    def note_discarded(self, names: Sequence[str]) -> None:
        """The user's code set these parameters' gradients to None before this step's
        passes: compared with the fetches, so that ranks that cleared different ones disagree."""
        digest = hashlib.blake2b(repr(list(names)).encode(), digest_size=4).digest()
        self.fetches.append((f"{DISCARDED} ({len(names)} parameters)", int.from_bytes(digest, "little")))

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
    """Begin comparing this backward across ranks (collective, in flight);
    ``StepCheck.stage`` and ``StepCheck.result`` complete it. Nothing here
    waits for the device: the values go up through pinned memory."""
    world = dist.get_world_size(group)
    words = [global_step, micro_step, record.gathers, len(record.fetches), record.fingerprint()]
    packed = bytearray((len(flags) + 7) // 8 * 8)  # one byte a parameter, eight to a word
    packed[: len(flags)] = bytes(flags)
    words += [int.from_bytes(packed[i : i + 8], "little", signed=True) for i in range(0, len(packed), 8)]
    mine = to_device(words, torch.int64, device)
    everyone = mine.new_empty(world * mine.numel())
    pending = all_gather(everyone, mine, group, async_op=True)
    return StepCheck(group, pending, everyone, len(flags), list(record.fetches), global_step)


@attrs.frozen
class CheckOutcome:
    """What a step check found, per trainable parameter (in ``flags`` order)."""

    #: every rank's header: (optimizer step, micro-step, gathers, fetches, fingerprint)
    headers: list[list[int]]
    #: each rank's flags, ``flags[rank][i]``
    flags: list[list[int]]

    def any_rank(self, bit: int) -> list[bool]:
        return [any(f[i] & bit for f in self.flags) for i in range(len(self.flags[0]))] if self.flags else []

    def ranks_with(self, i: int, bit: int) -> list[int]:
        return [r for r, f in enumerate(self.flags) if f[i] & bit]


@attrs.define(eq=False)
class StepCheck:
    """A step check in flight (``start_step_check``)."""

    group: ProcessGroup
    pending: Pending
    everyone: torch.Tensor
    n_params: int
    fetches: list[tuple[str, int]]
    #: the optimizer step it was started in
    global_step: int
    _copy: HostCopy | None = None
    _outcome: CheckOutcome | None = None

    def stage(self, waiter: Waiter) -> None:
        """Order the copy of the result to the host behind the collective,
        without waiting (on a backend whose waits block the host, nothing is
        done: ``result`` waits)."""
        if self._copy is None and not self.pending.waits_on_host:
            waiter(self.pending.is_completed, self.pending.wait)  # a stream wait
            self._copy = HostCopy(self.everyone)

    @property
    def read(self) -> bool:
        return self._outcome is not None

    @property
    def waited(self) -> bool:
        """Reading it had to wait for the device (a host sync of the engine's own)."""
        return self._copy is not None and self._copy.blocked

    def result(self, waiter: Waiter) -> CheckOutcome:
        """Every rank's header and flags. Raises ``RanksDisagree`` on every
        rank (collective: call it where every rank reads its check) when
        the headers differ."""
        outcome = self.peek(waiter)
        headers = outcome.headers
        if any(h != headers[0] for h in headers):
            _raise_disagreement(self.group, headers, self.fetches)
        return outcome

    def peek(self, waiter: Waiter) -> CheckOutcome:
        """``result`` without the collective that explains a disagreement."""
        if self._outcome is None:
            if self._copy is None:
                waiter(self.pending.is_completed, self.pending.wait)
                self._copy = HostCopy(self.everyone)
            world = dist.get_world_size(self.group)
            words = self._copy.tolist()
            per_rank = len(words) // world
            rows = [words[r * per_rank : (r + 1) * per_rank] for r in range(world)]
            headers = [row[:HEADER_WORDS] for row in rows]
            flags = [list(b"".join(w.to_bytes(8, "little", signed=True) for w in row[HEADER_WORDS:]))[: self.n_params]
                     for row in rows]
            self._outcome = CheckOutcome(headers, flags)
        return self._outcome


def _what_rank_did(rank: int, log: list[tuple[str, int]], index: int) -> str:
    if index >= len(log):
        return f"rank {rank} had no fetch #{index} (its step had {len(log)})"
    name, elements = log[index]
    if name.startswith(DISCARDED):  # its number is a digest of the names, not a size
        return f"rank {rank}: {name}"
    return f"rank {rank} fetched {name!r} ({elements:,} elements)"


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
        did = [_what_rank_did(r, log, first) for r, log in enumerate(logs)]
        lines.append(f"first difference at fetch #{first} of the step: " + "; ".join(did))
    else:
        lines.append("they fetched the same modules; gathers issued: "
                     + ", ".join(f"rank {r} {h[2]}" for r, h in enumerate(headers)))
    if first is not None and any(first < len(log) and log[first][0].startswith(DISCARDED) for log in logs):
        lines.append("some ranks set gradients to None (model.zero_grad(), optimizer.zero_grad()) that others "
                     "kept: every rank must clear the same gradients between the same passes")
    elif len(steps) > 1:
        lines.append("a rank skipped a micro-step, or ran one more: every rank must run the same number of "
                     "forward/backward passes between optimizer steps")
    else:
        lines.append("a module ran a different number of times, or on some ranks only; every rank must fetch "
                     "the same modules in the same order (mark a rank-dependent subtree as a leaf module, so "
                     "that it is gathered as one unit)")
    raise RanksDisagree("; ".join(lines))


@attrs.frozen
class FetchCheck:
    """One forward fetch's agreement in flight (``issue_fetch_check``)."""

    micro_step: int
    index: int
    fetch: tuple[str, int] | None
    pending: Pending
    everyone: torch.Tensor
    #: a fetch of an eval or no_grad forward (numbered within it), not of a training step
    untraced: bool = False


def issue_fetch_check(
    group: ProcessGroup,
    device: torch.device,
    *,
    micro_step: int,
    index: int,
    fetch: tuple[str, int] | None,
    untraced: bool = False,
) -> FetchCheck:
    """Start agreeing that every rank is about to do forward fetch ``index``
    the same way (``fetch``: its name and elements; None: this rank's
    forward is over; ``untraced``: of an eval or no_grad forward). Collective;
    ``settle_fetch_checks`` reads it."""
    world = dist.get_world_size(group)
    name_hash = -1 if fetch is None else int.from_bytes(hashlib.blake2b(fetch[0].encode(), digest_size=7).digest(), "little")
    words = [micro_step, index, name_hash, -1 if fetch is None else fetch[1], int(untraced)]
    mine = to_device(words, torch.int64, device)
    everyone = mine.new_empty(world * mine.numel())
    return FetchCheck(micro_step, index, fetch, all_gather(everyone, mine, group, async_op=True), everyone, untraced)


def settle_fetch_checks(
    group: ProcessGroup, waiter: Waiter, checks: Sequence[FetchCheck], *, exchange_names: bool = True
) -> bool:
    """Read ``checks`` in one copy to the host; raises ``RanksDisagree`` on
    every rank at the first fetch the ranks did differently (collective:
    every rank settles the same checks at the same point; the names the
    ranks fetched there are exchanged in one more, unless ``exchange_names``
    is False: read late, the ranks' collectives may no longer pair, and the
    message names the others' fetches by size). Returns whether the read
    had to wait for the device."""
    if not checks:
        return False
    for check in checks:
        waiter(check.pending.is_completed, check.pending.wait)
    world = dist.get_world_size(group)
    copy = HostCopy(torch.cat([c.everyone for c in checks]))
    words = copy.tolist()
    per_check = len(words) // len(checks)
    for n, check in enumerate(checks):
        table = words[n * per_check : (n + 1) * per_check]
        rows = [table[r * (per_check // world) : (r + 1) * (per_check // world)] for r in range(world)]
        if any(row != rows[0] for row in rows):
            _explain_fetch(group, check, rows if not exchange_names else None)
    return copy.blocked


def _explain_fetch(group: ProcessGroup, check: FetchCheck, rows: list[list[int]] | None) -> None:
    world = dist.get_world_size(group)
    fetches: list[tuple[str, int] | None] = [None] * world
    if rows is None:
        dist.all_gather_object(fetches, check.fetch, group=group)
    else:  # (micro-step, index, name hash, elements, untraced) of each rank: this rank's name, the others' sizes
        fetches[dist.get_rank(group)] = check.fetch
    did = [f"rank {r} fetches {f[0]!r} ({f[1]:,} elements)" if f else
           f"rank {r} has finished its forward" if rows is None or rows[r][3] < 0 else
           f"rank {r} fetches another module ({rows[r][3]:,} elements)" for r, f in enumerate(fetches)]
    if check.untraced:
        raise RanksDisagree(
            f"the ranks are not running the same eval or no_grad forward: at its fetch #{check.index} (after "
            f"{check.micro_step} backward(s)), " + "; ".join(did) + "; every rank must run the same modules in the "
            "same order in an eval forward too, since each gathers parameters collectively (an exit that depends on "
            "a rank's data: take it on every rank alike, or set Zero3Config(divergent_graphs=True); a rank-dependent "
            "subtree can be marked as a leaf module, gathered as one unit)")
    raise RanksDisagree(
        f"the ranks are not running the same forward: at fetch #{check.index} of micro-step {check.micro_step}, "
        + "; ".join(did)
        + "; every rank must run the same modules in the same order while a trace is recorded (a "
        "rank-dependent subtree can be marked as a leaf module, gathered as one unit)"
    )


def agree_on_fetch(
    group: ProcessGroup,
    device: torch.device,
    waiter: Waiter,
    *,
    micro_step: int,
    index: int,
    fetch: tuple[str, int] | None,
) -> None:
    """``issue_fetch_check`` and ``settle_fetch_checks`` at once: before a
    forward fetch that no recorded trace vouches for, raise
    ``RanksDisagree`` on every rank before any gather could mismatch."""
    settle_fetch_checks(group, waiter, [issue_fetch_check(group, device, micro_step=micro_step, index=index, fetch=fetch)])
