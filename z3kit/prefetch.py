"""PrefetchLimiter: how much may be gathered ahead of need.

Tracks live gathered elements (gathered or in flight), the fetches in
flight, and the high-water mark of live elements. A demand fetch (the
parameters the running module needs now) is always allowed; a prefetch
gets ``budget()`` elements: no more than ``prefetch_bucket_size`` in one
prefetch, no more than keeps live elements within ``max_live_parameters``,
and nothing while ``max_inflight`` fetches are outstanding. Plain counters:
no tensors, no process group.
"""

from __future__ import annotations

import attrs

from z3kit.validate import check_int, int_validator


@attrs.define
class PrefetchLimiter:
    """Budget for prefetching under the three limits."""

    max_live_parameters: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    prefetch_bucket_size: int = attrs.field(default=50_000_000, validator=int_validator(at_least=0))
    max_inflight: int = attrs.field(default=2, validator=int_validator(at_least=1))
    live_numel: int = attrs.field(default=0, init=False)
    inflight: int = attrs.field(default=0, init=False)
    high_water: int = attrs.field(default=0, init=False)

    def budget(self) -> int:
        """Elements one prefetch may gather now (0: do not prefetch)."""
        if self.inflight >= self.max_inflight:
            return 0
        return max(0, min(self.prefetch_bucket_size, self.max_live_parameters - self.live_numel))

    def on_gather(self, numel: int) -> None:
        """A gather of ``numel`` elements was issued (demand or prefetch)."""
        # A float or a bool would silently turn the integer counters into
        # something else; refuse it at the door.
        check_int("numel", numel, at_least=0)
        live = self.live_numel = self.live_numel + numel
        self.inflight += 1
        if live > self.high_water:  # an attribute set runs attrs' hooks: only when it changes
            self.high_water = live

    def on_gather_done(self) -> None:
        """A gather issued earlier was waited on."""
        if self.inflight == 0:
            raise ValueError("on_gather_done without a gather in flight")
        self.inflight -= 1

    def on_release(self, numel: int) -> None:
        """``numel`` gathered elements were released."""
        check_int("numel", numel, at_least=0)
        if numel > self.live_numel:
            raise ValueError(f"cannot release {numel} elements with {self.live_numel} live")
        self.live_numel -= numel

    def reset_high_water(self) -> None:
        self.high_water = self.live_numel
