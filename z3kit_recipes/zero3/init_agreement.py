"""The ranks agree at ``zero3.initialize``: the same model, sharded the same way.

Every rank's engine must issue the same collectives, of the same sizes, in
the same order; what decides them is fixed at initialize: the resolved
configuration (bucket sizes, persistence threshold, compute dtype, the knobs
a ``memory_budget`` stands for), whether the engine trains (an optimizer
factory) or only runs forwards, the leaf units, the policy types, and the
model's parameters and buffers (names, order, shapes, dtypes, which ones
train and which stay gathered). ``summarize`` writes them down as plain
values, ``disagreement`` compares the ranks' summaries, and
``agree_at_init`` is the one collective that does it.

Note: one small collective, details only on a mismatch.
    Every rank gathers a 64-bit digest of its summary (and its default
    seed, which ``initialize`` needs for models built on the meta device:
    one collective carries both). Only when the digests differ do the
    ranks gather the summaries themselves, so that each rank builds the
    same message naming every difference (the first few, then a count).
    A difference found here would otherwise surface later as a gloo abort
    ("Received data size doesn't match expected size"), a timeout that names
    nothing, or, for a parameter of another shape with as many elements,
    silently wrong values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from z3kit.collectives import ProcessGroup, all_gather
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.runtime.build import Policies
from z3kit_recipes.zero3.training.materialize import InitFn

#: differences named in the message; the rest are counted
MAX_SHOWN = 5
_MASK = (1 << 62) - 1


class RanksDisagreeAtInit(RanksDisagree, ValueError):
    """The ranks called ``zero3.initialize`` with different models or settings;
    raised on every rank, before anything was changed. A ``ValueError`` as
    well: it is about initialize's arguments."""


@attrs.frozen
class InitSummary:
    """What must be alike on every rank, as plain values (picklable, comparable)."""

    #: "config.reduce_bucket_size" -> 500000000, "world size" -> 2, ...
    settings: dict[str, Any]
    #: "parameter 'fc.weight'" / "buffer 'norm.running_mean'" -> attribute -> value, in the model's order
    tensors: dict[str, dict[str, Any]]

    def digest(self) -> int:
        # not hash(): string hashes differ between processes
        text = repr((self.settings, self.tensors))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def summarize(
    model: nn.Module,
    config: Zero3Config,
    *,
    world: int,
    shard_size: int | None = None,
    hpz_size: int | None = None,
    training: bool,
    leaves: Sequence[nn.Module],
    units: Sequence[nn.Module] = (),
    policies: Policies,
    derived_knobs: Mapping[str, int] | None,
    init_seed: int | None,
    param_init_fn: InitFn | None,
) -> InitSummary:
    """This rank's summary for ``initialize`` (no collective). ``derived_knobs``:
    what ``config.memory_budget`` stands for on this model, when it is set."""
    settings: dict[str, Any] = {"world size": world, "shard group size": world if shard_size is None else shard_size,
                                "hpZ group size": hpz_size}
    for field in attrs.fields(Zero3Config):
        value = getattr(config, field.name)
        # 1 and 1.0 are the same clipping norm or timeout (not so for memory_budget: bytes or a fraction)
        settings[f"config.{field.name}"] = float(value) if field.type in ("float", float) else value
    # resolved: the environment can turn it on for one rank only
    settings["config.check_every_fetch"] = config.checks_every_fetch
    for name, value in (derived_knobs or {}).items():
        settings[f"config.{name} (from memory_budget)"] = value
    settings["optimizer"] = "a factory (training engine)" if training else "None (inference-only engine)"
    names = {id(m): name or "<the model>" for name, m in model.named_modules()}
    settings["leaf modules"] = [names.get(id(m), type(m).__qualname__) for m in leaves]
    settings["fetch units"] = [names.get(id(m), type(m).__qualname__) for m in units]
    settings["trace type"] = _type_name(policies.trace)
    settings["planner type"] = _type_name(policies.planner)
    settings["prefetch limiter type"] = _type_name(policies.limiter)
    settings["init_seed"] = init_seed
    settings["param_init_fn"] = None if param_init_fn is None else getattr(
        param_init_fn, "__qualname__", _type_name(param_init_fn)
    )
    tensors: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        tensors[f"parameter {name!r}"] = {
            "shape": list(p.shape), "dtype": str(p.dtype), "requires_grad": p.requires_grad,
            "persistent": policies.planner.is_persistent(p.numel()), "on meta": p.is_meta,
        }
    for name, b in model.named_buffers():  # every buffer: rank 0's are broadcast before training forwards
        tensors[f"buffer {name!r}"] = {"shape": list(b.shape), "dtype": str(b.dtype), "on meta": b.is_meta}
    return InitSummary(settings, tensors)


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 0, 2-3"."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], -2]:
        if r != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(runs)}"


def _by_rank(shown: Sequence[str]) -> str:
    """Each rank's value as shown, ranks alike together: "rank 0 'bf16', ranks 1-3 'fp32'"."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(shown):
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"{_ranks(ranks)} {shown}" for shown, ranks in groups.items())


def _keys(dicts: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every key, in the order the ranks list them (rank 0's first)."""
    return list(dict.fromkeys(key for d in dicts for key in d))


def differences(summaries: Sequence[InitSummary]) -> list[str]:
    """One line per difference between the ranks' summaries (index = rank); empty when alike."""
    lines = []
    for key in _keys(s.settings for s in summaries):
        shown = [repr(s.settings[key]) if key in s.settings else "<not given>" for s in summaries]
        if len(set(shown)) > 1:
            lines.append(f"{key}: {_by_rank(shown)}")
    present = True
    for key in _keys(s.tensors for s in summaries):
        entries = [s.tensors.get(key) for s in summaries]
        if any(e is None for e in entries):
            present = False
            lines.append(f"{key}: {_by_rank(['present' if e is not None else 'absent' for e in entries])}")
            continue
        for attr in _keys(e for e in entries if e is not None):
            shown = [repr(e.get(attr)) for e in entries if e is not None]
            if len(set(shown)) > 1:
                lines.append(f"{key} {attr}: {_by_rank(shown)}")
    orders = [list(s.tensors) for s in summaries]
    if present and any(order != orders[0] for order in orders):  # the same names, listed in another order
        at = next(i for i, names in enumerate(zip(*orders)) if len(set(names)) > 1)
        lines.append(f"model order at #{at}: {_by_rank([order[at] for order in orders])}")
    return lines


def disagreement(summaries: Sequence[InitSummary]) -> str | None:
    """The message every rank raises when the summaries differ, else None."""
    lines = differences(summaries)
    if not lines:
        return None
    more = f"; and {len(lines) - MAX_SHOWN} more difference(s)" if len(lines) > MAX_SHOWN else ""
    return (
        "zero3.initialize: the ranks were not given the same model and settings: "
        + "; ".join(lines[:MAX_SHOWN]) + more
        + ". Every rank must pass the same model (parameter and buffer names, shapes, dtypes, requires_grad), "
        "config (and Z3KIT_CHECK_EVERY_FETCH), optimizer factory (or None), leaf modules and policies; "
        "nothing was changed"
    )


def agree_at_init(summary: InitSummary, group: ProcessGroup, device: torch.device) -> int:
    """Raise ``RanksDisagreeAtInit`` on every rank when the ranks' summaries
    differ (see the module Note); otherwise return rank 0's default seed
    (``torch.initial_seed()``), the same on every rank. Collective."""
    world = dist.get_world_size(group)
    mine = torch.tensor([summary.digest(), torch.initial_seed() & _MASK], dtype=torch.int64, device=device)
    everyone = mine.new_empty(world * mine.numel())
    all_gather(everyone, mine, group)
    rows = everyone.view(world, -1).tolist()
    if any(row[0] != rows[0][0] for row in rows):
        summaries: list[InitSummary | None] = [None] * world
        dist.all_gather_object(summaries, summary, group=group)
        message = disagreement([s for s in summaries if s is not None])
        # equal digests of unequal text are not expected; the message says so if it happens
        raise RanksDisagreeAtInit(message or "zero3.initialize: the ranks' summaries differ in their digest only")
    return int(rows[0][1])
