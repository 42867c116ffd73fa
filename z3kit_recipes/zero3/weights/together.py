"""Steps of a save or a load that the ranks take together: an error on any
rank is raised on every rank, with the same message.

A collective save has steps that one rank does alone (rank 0 checks the
target, writes the manifest, renames the folder) and steps that can fail on
one rank only (a full disk, a file that vanished). Ended by a bare barrier,
such a step leaves the ranks that did not fail waiting for the one that
raised, forever. Here every step ends in one small exchange of each rank's
outcome instead, and when any rank failed every rank raises the same error,
naming the rank. The exchanges (and the save's other blocking collectives)
run through ``call``: for an engine, ``RankWatch.call``, so that a rank that
dies gives ``RankFailed`` on the others within seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.target import SaveRefused

T = TypeVar("T")

#: error types raised again as themselves on every rank; any other becomes a RuntimeError (the types
#: travel by name, and these are the ones a save or load raises that take one message)
_KEPT: dict[str, type[Exception]] = {t.__name__: t for t in (
    ValueError, OSError, FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
    SaveRefused,
)}


def _plain(fn: Callable[[], Any]) -> Any:
    return fn()


@attrs.frozen
class Together:
    """The ranks of one save or load (``group=None``: one process on its own)."""

    group: ProcessGroup | None
    #: completes one blocking collective call (``RankWatch.call`` for an engine)
    call: Callable[[Callable[[], Any]], Any] = _plain

    @classmethod
    def of(cls, engine: EngineCore) -> Together:
        return cls(engine.group, engine.watch.call)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank (collective)."""
        if self.group is None:
            return [obj]
        everyone: list[Any] = [None] * self.world
        self.call(lambda: dist.all_gather_object(everyone, obj, group=self.group))
        return everyone

    def agreed(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (local work, no collectives) on every rank, then raise on
        every rank if it failed on any; returns this rank's result."""
        result: list[T] = []  # empty when fn raised
        failure: tuple[str, str] | None = None
        try:
            result.append(fn())
        except RanksDisagree:
            raise  # every rank's already
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            failure = (type(exc).__name__, str(exc))
        failed = [(rank, f) for rank, f in enumerate(self.exchange(failure)) if f is not None]
        if failed:
            first_type = failed[0][1][0]
            details = "; ".join(f"on rank {rank}: {name}: {message}" for rank, (name, message) in failed)
            raise _error_type(first_type)(f"{what} failed {details}")
        return result[0]

    def decided(self, fn: Callable[[], T], what: str | None = None) -> T:
        """Run ``fn`` on rank 0 only (a decision, or a step of its own) and hand
        every rank its result, or raise its error on every rank: as ``what``
        failed on rank 0, or, without ``what``, with rank 0's own message (a
        decision that names what it refuses)."""
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except RanksDisagree:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                outcome = (type(exc).__name__, str(exc))
        status, value = self.exchange(outcome)[0]
        if status != "ok":
            raise _error_type(status)(value if what is None else f"{what} failed on rank 0: {status}: {value}")
        out: T = value
        return out


def _error_type(name: str) -> type[Exception]:
    return _KEPT.get(name, RuntimeError)
