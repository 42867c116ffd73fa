"""Which parameters form which unit, and the static prefetch order.

``make_plan`` turns the user's ``blocks`` (submodules, or module classes to
match) into units: one per block, in the order given (a class expands to
its matches in the model's module order), plus the root's unit of every
parameter no block owns alone. Everything is checked here, before the
runtime changes anything.

Note: parameters shared across units.
    A parameter reachable from two blocks, or from a block and from outside
    every block (tied embeddings: ``lm_head.weight is wte.weight``), belongs
    to the root unit. The root unit is gathered when the root's forward
    starts and released at the end of backward, so every use of a shared
    parameter, in any block and in any order, sees it gathered, and its
    gradient (summed by autograd over its uses) is reduced once.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

BlockSpec = nn.Module | type[nn.Module]


@attrs.frozen
class UnitPlan:
    """One unit: the module whose forward and backward gather it, and its parameters by name."""

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]


@attrs.frozen
class Plan:
    """The blocks in forward order and the root; forward prefetches ``i + 1``, backward ``i - 1``."""

    blocks: tuple[UnitPlan, ...]
    root: UnitPlan

    def forward_next(self, i: int) -> int | None:
        return i + 1 if i + 1 < len(self.blocks) else None

    def backward_next(self, i: int) -> int | None:
        return i - 1 if i > 0 else None


def _resolve(model: nn.Module, blocks: Sequence[BlockSpec]) -> list[tuple[str, nn.Module]]:
    if isinstance(blocks, (nn.Module, type)) or not isinstance(blocks, Sequence):
        raise TypeError("blocks must be a list of submodules of the model or of module classes, "
                        f"got {type(blocks).__name__}; e.g. blocks=list(model.layers)")
    if not blocks:
        raise ValueError("blocks is empty: name at least one submodule of the model (or a module class "
                         "to match), e.g. blocks=list(model.layers)")
    names = {id(m): n for n, m in model.named_modules()}
    chosen: dict[int, tuple[str, nn.Module]] = {}
    for i, spec in enumerate(blocks):
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            found = [(n, m) for n, m in model.named_modules() if isinstance(m, spec) and m is not model]
            if not found:
                raise ValueError(f"blocks[{i}]: the class {spec.__name__} matches no submodule of the model; "
                                 "pass a class the model's blocks are instances of, or the modules themselves")
            for n, m in found:
                chosen.setdefault(id(m), (n, m))
        elif isinstance(spec, nn.Module):
            if spec is model:
                raise ValueError(f"blocks[{i}] is the model itself: the root is always a unit of its own "
                                 "(the parameters no block holds); list its submodules instead")
            if id(spec) not in names:
                raise ValueError(f"blocks[{i}] ({type(spec).__name__}) is not a submodule of the model; "
                                 "pass modules the model holds (e.g. model.layers[0]), not copies")
            if id(spec) in chosen:
                raise ValueError(f"block {names[id(spec)]!r} is listed twice; list each block once")
            chosen[id(spec)] = (names[id(spec)], spec)
        else:
            raise TypeError(f"blocks[{i}] is a {type(spec).__name__}; expected a submodule of the model "
                            "or an nn.Module subclass")
    for outer_name, outer in chosen.values():
        for inner_name, inner in outer.named_modules(prefix=outer_name):
            if inner is not outer and id(inner) in chosen:
                raise ValueError(f"block {inner_name!r} is nested in block {outer_name!r}: blocks must not "
                                 "contain each other; list the outer block or the inner ones, not both")
    return list(chosen.values())


def make_plan(model: nn.Module, blocks: Sequence[BlockSpec]) -> Plan:
    """The units of ``model`` (see the module docstring); raises on bad input, changes nothing."""
    resolved = _resolve(model, blocks)
    # every place a parameter appears (tied ones appear more than once): which units hold it
    owners: dict[int, set[int]] = {}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        unit = next((i for i, (n, _) in enumerate(resolved) if qualified.startswith(n + ".")), -1)
        owners.setdefault(id(p), set()).add(unit)
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(resolved) + 1)]
    first: torch.nn.Parameter | None = None
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise TypeError(f"parameter {name!r} is {p.dtype}: fsdp_blocks trains fp32 parameters "
                            "(its shards are the optimizer's masters); call model.float() first")
        if first is not None and p.device != first.device:
            raise ValueError(f"parameter {name!r} is on {p.device}, others on {first.device}: move the model "
                             "to one device first")
        if first is None:
            first = p
        held_by = owners[id(p)]
        members[held_by.pop() if len(held_by) == 1 else -1].append((name, p))
    plans = tuple(UnitPlan(n, m, tuple(ps)) for (n, m), ps in zip(resolved, members))
    return Plan(plans, UnitPlan("<root>", model, tuple(members[-1])))
