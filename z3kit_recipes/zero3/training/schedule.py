"""The backward fetches of a step, the same on every rank.

A module's pre-backward fires only where a gradient reaches its output: a
branch that feeds the loss on some ranks only fires on those. Gathering on
those ranks alone would be a collective the others never join. So backward
does not gather module by module as hooks fire; it walks a schedule fixed
by the forward every rank ran alike: the modules fetched in forward, in
the reverse of the order their forwards finished (an outer module's
output gradient arrives before those of the modules inside it), without those whose outputs needed no gradient (they have no
backward anywhere). A pre-backward takes the schedule up to its module;
entries it passes over are fetched all the same (ghosts: held until the
end of backward, in case their pre-backward comes late), and the end of
backward fetches whatever is left. Every rank then gathers the same
parameters in the same order, whatever its graph did; where every rank's
hooks fire in schedule order, as in a chain of layers, nothing extra is
fetched at all.

Pure bookkeeping over module objects: no tensors, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class BackwardSchedule:
    """Reverse of a step's forward fetches (in the order they finished); a cursor through them."""

    def __init__(self, forward: Sequence[nn.Module]) -> None:
        self.entries: list[nn.Module] = list(reversed(forward))
        self.cursor = 0

    def advance_to(self, module: nn.Module) -> list[nn.Module] | None:
        """The entries up to and including ``module``'s next one (those
        before it are ghosts: passed over); None when ``module`` has no entry
        ahead."""
        for i in range(self.cursor, len(self.entries)):
            if self.entries[i] is module:
                out = self.entries[self.cursor : i + 1]
                self.cursor = i + 1
                return out
        return None

    def rest(self) -> list[nn.Module]:
        """What is left (fetched as ghosts at the end of backward)."""
        out = self.entries[self.cursor :]
        self.cursor = len(self.entries)
        return out


class ForwardLog:
    """A step's forward fetches, in the order they happened and finished, and
    which of them had no backward: what the ``BackwardSchedule`` is made from."""

    def __init__(self) -> None:
        self.fetches: list[nn.Module] = []
        self._open: dict[nn.Module, list[int]] = {}
        self._finished: list[int] = []
        self._no_backward: set[int] = set()

    def __len__(self) -> int:
        return len(self.fetches)

    def fetched(self, module: nn.Module) -> int:
        """``module``'s forward began; returns the fetch's index."""
        index = len(self.fetches)
        self._open.setdefault(module, []).append(index)
        self.fetches.append(module)
        return index

    def finished(self, module: nn.Module, *, needs_grad: bool) -> None:
        """``module``'s innermost open forward call returned; an output that
        needs no gradient means no backward for the call, on any rank."""
        calls = self._open.get(module)
        if calls:
            index = calls.pop()
            self._finished.append(index)
            if not needs_grad:
                self._no_backward.add(index)

    def schedule(self) -> BackwardSchedule:
        # calls that never finished (still open) come first, as the outermost
        finished = set(self._finished)
        order = [i for i in range(len(self.fetches)) if i not in finished] + self._finished
        return BackwardSchedule([self.fetches[i] for i in order if i not in self._no_backward])
