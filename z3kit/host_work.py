"""Host work a runtime does per step, counted where it happens.

Time on the host decides whether a runtime keeps ahead of its device, but
timing it in a test fails on a loaded machine and passes on a fast one.
What makes the time can be counted instead: the Python hooks torch calls
into the runtime (module forward hooks, backward hooks through autograd
Functions, gradient-ready hooks), the autograd Functions the runtime
applies, and the calls its ``TorchFunctionMode`` sees. Each is one plain
integer add at the place it happens; a reader takes differences across a
step (``HostWork.since``). A change that adds work per module then changes
the counts, on any machine.
"""

from __future__ import annotations

import attrs


@attrs.define
class HostWork:
    """Running totals since the runtime was built."""

    #: Python hooks torch called into the runtime (forward pre/post, backward pre/post, gradient ready)
    hooks: int = 0
    #: autograd ``Function.apply`` calls made by the runtime
    functions: int = 0
    #: ``__torch_function__`` calls of the runtime's mode
    torch_functions: int = 0

    def snapshot(self) -> HostWork:
        return attrs.evolve(self)

    def since(self, before: HostWork) -> dict[str, int]:
        """Each count's growth since ``before`` (a ``snapshot``)."""
        then = attrs.asdict(before)
        return {name: count - then[name] for name, count in attrs.asdict(self).items()}


__all__ = ["HostWork"]
