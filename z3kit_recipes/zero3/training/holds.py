"""Who holds each parameter of the stock runtime: modules, and pins.

Note: holding.
    A module holds its parameters from fetch to release; a parameter held
    by any module (a parent and a child that share it, a module whose
    backward is still running) is never released. In forward a module
    holds from pre-forward to post-forward; in backward from its first
    pre-backward to its post-backward. Forwards seen during backward are
    checkpoint recomputations: they fetch, but leave the release to the
    module's post-backward, because backward is about to use what they
    gathered. A pin (``engine.gathered_parameters``) holds a parameter
    until it is undone, through every module exit and ``release_all``.

Pure bookkeeping over module objects and parameter ids: the
``ParamCoordinator`` (``zero3.training.params``) asks it what may be freed.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


class Holds:
    """How many holders each parameter has (see the Note on holding)."""

    def __init__(self, n_params: int) -> None:
        self._users = [0] * n_params
        #: parameters pinned by ``pin``, with their pin counts
        self._pins: dict[int, int] = {}
        #: modules between their fetch and their release
        self._holders: set[nn.Module] = set()

    def held(self, pid: int) -> bool:
        """Some module or pin holds ``pid``."""
        return self._users[pid] != 0

    def pinned(self, pid: int) -> bool:
        return pid in self._pins

    def hold(self, module: nn.Module, pids: Iterable[int]) -> None:
        """``module`` was fetched: it holds ``pids`` (once, however often it is fetched before its release)."""
        if module not in self._holders:
            self._holders.add(module)
            for p in pids:
                self._users[p] += 1

    def let_go(self, module: nn.Module, pids: Iterable[int]) -> None:
        """``module`` is released: it holds ``pids`` no more."""
        if module in self._holders:
            self._holders.discard(module)
            for p in pids:
                self._users[p] -= 1

    def joined(self, module: nn.Module, pid: int) -> None:
        """``pid`` joined ``module``'s parameters (used outside its own module):
        held with them if ``module`` holds them now."""
        if module in self._holders:
            self._users[pid] += 1

    def pin(self, pids: Iterable[int]) -> None:
        for p in pids:
            self._pins[p] = self._pins.get(p, 0) + 1
            self._users[p] += 1

    def unpin(self, pids: Iterable[int]) -> list[int]:
        """Undo one pin of each of ``pids``; returns those that nothing holds now."""
        free = []
        for p in pids:
            left = self._pins[p] - 1
            if left:
                self._pins[p] = left
            else:
                del self._pins[p]
            self._users[p] -= 1
            if self._users[p] == 0:
                free.append(p)
        return free

    def drop_modules(self) -> None:
        """Every module lets go at once (end of backward, an error): only pins hold."""
        self._holders.clear()
        self._users = [0] * len(self._users)
        for p, count in self._pins.items():
            self._users[p] = count
