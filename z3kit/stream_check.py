"""A recording stream pair that checks accelerator stream order on CPU.

On CPU every stream pair is synchronous, so a runtime that forgets to make
compute wait on a communication's event works here and corrupts data on a
GPU. ``RecordingStreamPair`` has ``StreamPair``'s interface and runs inline
like ``SyncStreamPair``, but it models what an accelerator would allow: a
communication's ticket is "in flight" from ``communicate`` until
``complete``, and ``StreamOrderChecker.watching()`` installs a dispatch mode
that sees every tensor operation compute runs meanwhile and checks the two
rules of ``z3kit.streams``:

1. no compute operation reads or writes memory an in-flight communication
   writes (compute has not waited on its event);
2. no compute operation writes memory an in-flight communication reads, and
   no new tensor is allocated over memory a communication still uses.

Memory is compared as address ranges, so views, slices and coalesced
buffers are caught whatever tensor object refers to them. A breach raises
``StreamOrderError`` naming the operation and the communication. With
``delay_s`` each communication starts after a random pause, so ranks issue
their collectives at different times (FSDP2's tests delay collectives the
same way to show that nothing depends on timing).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from z3kit.streams import CommTicket

Span = tuple[int, int]


class StreamOrderError(RuntimeError):
    """Compute and communication touched the same memory in an order an accelerator would not keep."""


def _span(t: torch.Tensor) -> Span | None:
    """The bytes ``t`` can touch, as an address range (None: it holds none)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (sparse, functional wrappers)
        return None
    if base == 0:
        return None
    size = t.element_size()
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = base + int(t.storage_offset()) * size
    return start, start + int(extent) * size


def _overlaps(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class StreamOrderChecker:
    """What every recording pair it serves has in flight, and the check of compute against it."""

    def __init__(self) -> None:
        self._inflight: dict[int, tuple[CommTicket, list[Span], list[Span]]] = {}
        self._on_comm = 0
        #: (what, ticket number, label) for every issue and completion, in order
        self.events: list[tuple[str, int, str]] = []
        self.issued = self.completed = 0
        #: compute operations checked while watching
        self.checked_ops = 0
        #: tickets whose ``communicate`` block is running, innermost last: what a
        #: collective issued now may touch (a process-group test double checks it)
        self.open_tickets: list[CommTicket] = []

    def issue(self, ticket: CommTicket) -> int:
        reads = [s for s in map(_span, ticket.reads) if s is not None]
        writes = [s for s in map(_span, ticket.writes) if s is not None]
        for number, (other, other_reads, other_writes) in self._inflight.items():
            for span in writes:
                if any(_overlaps(span, o) for o in other_reads + other_writes):
                    raise StreamOrderError(
                        f"communication {ticket.label!r} writes memory that communication #{number} "
                        f"({other.label!r}) still uses: complete that one first"
                    )
            for span in reads:
                if any(_overlaps(span, o) for o in other_writes):
                    raise StreamOrderError(
                        f"communication {ticket.label!r} reads memory that communication #{number} "
                        f"({other.label!r}) is still writing: complete that one first"
                    )
        self.issued += 1
        number = self.issued
        self._inflight[number] = (ticket, reads, writes)
        self.events.append(("issue", number, ticket.label))
        return number

    def complete(self, number: int) -> None:
        ticket, _, _ = self._inflight.pop(number)
        self.completed += 1
        self.events.append(("complete", number, ticket.label))

    @contextlib.contextmanager
    def comm_side(self) -> Iterator[None]:
        """Operations in here run on the communication stream: not compute's."""
        self._on_comm += 1
        try:
            yield
        finally:
            self._on_comm -= 1

    def inflight(self) -> list[str]:
        return [ticket.label for ticket, _, _ in self._inflight.values()]

    def _watched(self, func: Any) -> bool:
        # a view reads no data: only what is later done with it counts
        return not self._on_comm and bool(self._inflight) and not getattr(func, "is_view", False)

    def check_inputs(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Before a compute op runs: it reads its inputs, and writes those its schema marks written."""
        if not self._watched(func):
            return
        self.checked_ops += 1
        written = _written_args(func, args, kwargs)
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._check(func, t, writes=any(t is w for w in written))

    def check_outputs(self, func: Any, out: Any) -> None:
        """After it ran: its outputs' memory was written (new memory must not be a communication's)."""
        if not self._watched(func):
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._check(func, t, writes=True)

    def _check(self, func: Any, t: torch.Tensor, *, writes: bool) -> None:
        span = _span(t)
        if span is None:
            return
        for number, (ticket, reads, comm_writes) in self._inflight.items():
            if any(_overlaps(span, w) for w in comm_writes):
                raise StreamOrderError(
                    f"compute ran {func} on memory that communication #{number} ({ticket.label!r}) writes, "
                    "before waiting on its event: complete the ticket first"
                )
            if writes and any(_overlaps(span, r) for r in reads):
                raise StreamOrderError(
                    f"compute ran {func}, writing memory that communication #{number} ({ticket.label!r}) "
                    "still reads: complete the ticket first"
                )

    @contextlib.contextmanager
    def watching(self) -> Iterator[StreamOrderChecker]:
        """Check every tensor operation run inside the block (forward and backward)."""
        with _CheckMode(self):
            yield self


def _written_args(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written: list[torch.Tensor] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class _CheckMode(TorchDispatchMode):
    def __init__(self, checker: StreamOrderChecker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.checker = checker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # checked before running (a read of unfinished data) and after (the outputs' memory)
        self.checker.check_inputs(func, args, kwargs)
        out = func(*args, **kwargs)
        self.checker.check_outputs(func, out)
        return out


class RecordingStreamPair:
    """``StreamPairLike`` for CPU that records and checks stream order (see the module docstring)."""

    def __init__(
        self,
        checker: StreamOrderChecker | None = None,
        *,
        device: torch.device | str = "cpu",
        delay_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.checker = StreamOrderChecker() if checker is None else checker
        self._device = torch.device(device)
        self._delay_s = delay_s
        self._random = random.Random(seed)
        self._numbers: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def communicate(
        self, *, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], label: str = ""
    ) -> Iterator[CommTicket]:
        if self._delay_s:
            time.sleep(self._random.uniform(0.0, self._delay_s))
        ticket = CommTicket(label, tuple(reads), tuple(writes))
        with self.checker.comm_side():
            self.checker.open_tickets.append(ticket)
            try:
                yield ticket
            finally:
                self.checker.open_tickets.remove(ticket)
        self._numbers[id(ticket)] = self.checker.issue(ticket)

    def complete(self, ticket: CommTicket, finish: Callable[[], object]) -> None:
        if ticket.completed:
            return
        number = self._numbers.get(id(ticket))
        if number is None:
            raise StreamOrderError(f"complete of a ticket ({ticket.label!r}) this pair did not issue")
        with self.checker.comm_side():
            finish()
        del self._numbers[id(ticket)]
        self.checker.complete(number)
        ticket.close()

    def synchronize(self) -> None:
        pass
