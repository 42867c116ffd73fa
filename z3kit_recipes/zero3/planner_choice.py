"""Which planner schedules the parameters: the stock one from the config's
knobs, the user's ``planner``, or one made from the user's ``release_policy``
and ``prefetch_limiter`` (``z3kit.policy_planner.PolicyPlanner``).

The config's scheduling knobs are the stock planner's arguments. A planner
of the user's replaces it, so knobs the config sets away from their
defaults are then not used: ``initialize`` says so in a warning rather
than letting them look applied.
"""

from __future__ import annotations

import warnings

import attrs

from z3kit.policy_planner import PolicyPlanner, StockPlanner
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import ReleasePolicy, StockReleasePolicy
from z3kit.schedule_plan import SchedulePlanner
from z3kit.trace import TraceRecorder
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.runtime.build import Policies

#: the config's knobs each replaced part stands for
_RELEASE_KNOBS = ("max_live_parameters", "max_reuse_distance", "param_persistence_threshold")
_LIMITER_KNOBS = ("max_live_parameters", "prefetch_bucket_size", "max_inflight_gathers")


def choose_planner(
    config: Zero3Config,
    knobs: dict[str, int],
    prefetch_bucket: int,
    trace: TraceRecorder,
    *,
    planner: SchedulePlanner | None,
    release_policy: ReleasePolicy | None,
    prefetch_limiter: PrefetchLimiter | None,
) -> Policies:
    """The trace, the planner and the limiter that counts live elements
    (``knobs``: the scheduling knobs as used, a memory budget's included;
    ``prefetch_bucket``: the stock prefetch size, capped)."""
    if planner is not None and (release_policy is not None or prefetch_limiter is not None):
        raise ValueError("pass planner, or release_policy / prefetch_limiter, not both: a planner makes the whole "
                         "schedule (z3kit.policy_planner.PolicyPlanner turns a policy and a limiter into one)")
    if planner is not None and not isinstance(planner, SchedulePlanner):
        raise TypeError(f"planner must implement z3kit.schedule_plan.SchedulePlanner (is_persistent and plan), "
                        f"got {type(planner).__name__}")
    if release_policy is not None and not isinstance(release_policy, ReleasePolicy):
        raise TypeError(f"release_policy must implement z3kit.release.ReleasePolicy, got {type(release_policy).__name__}")
    if prefetch_limiter is not None and not isinstance(prefetch_limiter, PrefetchLimiter):
        raise TypeError(f"prefetch_limiter must be a PrefetchLimiter (or a subclass), got {type(prefetch_limiter).__name__}")
    stock_limiter = PrefetchLimiter(knobs["max_live_parameters"], prefetch_bucket, config.max_inflight_gathers)
    if planner is None and release_policy is None and prefetch_limiter is None:
        stock = StockPlanner(knobs["max_live_parameters"], knobs["max_reuse_distance"],
                             config.param_persistence_threshold, prefetch_bucket, config.max_inflight_gathers,
                             config.overlap_comm)
        return Policies(trace, stock, stock_limiter)
    if planner is not None:
        _warn_unused(config, type(planner).__name__, (*_RELEASE_KNOBS, *_LIMITER_KNOBS))
        return Policies(trace, planner, stock_limiter)
    unused = (*(_RELEASE_KNOBS if release_policy is not None else ()),
              *(_LIMITER_KNOBS if prefetch_limiter is not None else ()))
    _warn_unused(config, "release_policy/prefetch_limiter", unused)
    if release_policy is None:
        release_policy = StockReleasePolicy(knobs["max_reuse_distance"], config.param_persistence_threshold,
                                            knobs["max_live_parameters"])
    limiter = stock_limiter if prefetch_limiter is None else prefetch_limiter
    return Policies(trace, PolicyPlanner(release_policy, limiter, config.overlap_comm), limiter)


def _warn_unused(config: Zero3Config, what: str, knobs: tuple[str, ...]) -> None:
    defaults = {f.name: f.default for f in attrs.fields(Zero3Config)}
    set_here = sorted({k for k in knobs if getattr(config, k) != defaults[k]})
    if config.memory_budget is not None:
        set_here.append("memory_budget")
    if set_here:
        warnings.warn(f"{what} replaces the stock planner, whose arguments the config's {', '.join(set_here)} "
                      "are: they are not used", stacklevel=3)
