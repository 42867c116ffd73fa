"""Which subtrees are fetch units: gathered together on entry, released together.

A fetch unit is a module whose whole subtree's parameters one fetch
gathers; the modules inside it are not hooked, so a unit costs one forward
hook pair and one backward pair however many modules it holds. Every
module with parameters of its own outside a unit fetches its own, as
before (the per-module behaviour is the rule ``fetch_units=()``).

Note: the default rule (``fetch_units="auto"``).
    The blocks of a stack are units: a module that is not a container
    (``ModuleList``, ``Sequential``, ``ModuleDict``) whose class appears at
    least twice among the children of one module, whose subtree holds more
    than one module with parameters (or one, beside modules without: a
    ``Linear`` and its activation), and no such block of its own (a
    stack of stacks, T5's encoder and decoder, gets a unit per block, not
    per stack). An unmodified Hugging Face decoder gets one unit per
    decoder layer, and its embeddings, final norm and head fetch their own,
    as FSDP2 users wrap them. A user predicts it from the model's
    printout: the innermost repeated blocks.

Note: DeepSpeed's rule (``module_granularity_threshold`` > 0, the JSON's
``stage3_module_granularity_threshold``).
    A module's granularity is the elements of its subtree divided by the
    modules with parameters in it (counting itself, not counting
    containers); the outermost modules at or below the threshold are units
    (containers, modules without children, and subtrees over 1e9
    elements never are), as DeepSpeed's z3 leaf modules are chosen.

Note: the live limit.
    A unit is gathered at once, so one larger than ``max_live_parameters``
    could not be; it is split into its children (each a unit where it
    still holds several modules with parameters), and the split is
    reported (``UnitChoice.splits``). A unit never holds a leaf module
    (``leaf_modules``, which keep their own rules): one that would is not
    a unit, and its children are looked at instead.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Literal

import attrs
from torch import nn

from z3kit_recipes.zero3.training.hook_plan import LeafSpec, modules_named

UnitRule = Literal["auto"] | Iterable[LeafSpec]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
#: DeepSpeed's cap on a granularity unit's size (``Z3_MAX_LEAF_SIZE``)
_LARGEST_GRANULARITY_UNIT = 1_000_000_000


@attrs.frozen
class UnitChoice:
    """The fetch units' roots in model order, and the units split to fit the live limit."""

    roots: tuple[nn.Module, ...]
    #: "name (N elements)" of each unit split into its children
    splits: tuple[str, ...] = ()

    def notes(self) -> tuple[str, ...]:
        """What to tell the user at ``initialize``: the splits, if any."""
        if not self.splits:
            return ()
        return (f"fetch units split into their children to fit max_live_parameters: {', '.join(self.splits)}",)


class _Tree:
    """Sizes of the model's subtrees (parameters counted once, shared ones too)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {m: name or "<root>" for name, m in model.named_modules()}
        self._numel: dict[nn.Module, int] = {}
        self._owners: dict[nn.Module, int] = {}

    def numel(self, m: nn.Module) -> int:
        if m not in self._numel:
            self._numel[m] = sum(p.numel() for p in m.parameters())
        return self._numel[m]

    def worth_a_unit(self, m: nn.Module) -> bool:
        """More than one module with parameters, or one inside a block that holds
        other modules too (``Linear`` + ``Tanh``): hooked as one, the modules
        between its parameter owners' calls run inside it."""
        owners = self.owners(m)
        return owners > 1 or (owners == 1 and next(m.children(), None) is not None)

    def owners(self, m: nn.Module) -> int:
        """Modules with parameters of their own in ``m``'s subtree, containers not counted."""
        if m not in self._owners:
            self._owners[m] = sum(
                1 for x in m.modules()
                if not isinstance(x, _CONTAINERS) and next(x.parameters(recurse=False), None) is not None)
        return self._owners[m]


def choose_units(
    model: nn.Module, rule: UnitRule, leaves: Iterable[nn.Module], *, granularity_threshold: int,
    max_live_parameters: int,
) -> UnitChoice:
    """The fetch units of ``model`` under ``rule`` (see the module's Notes)."""
    tree, leaf_set = _Tree(model), set(leaves)
    holds_leaf = {m for leaf in leaf_set for m in model.modules() if any(x is leaf for x in m.modules())}
    if isinstance(rule, str):
        if rule != "auto":
            raise ValueError(f"fetch_units is 'auto', or module classes or instances, got {rule!r}")
        if granularity_threshold > 0:
            wanted = _by_granularity(model, tree, granularity_threshold)
        else:
            wanted = _repeated_blocks(model, tree)
    else:
        if granularity_threshold > 0:
            raise ValueError("fetch_units names the units and module_granularity_threshold chooses them: pass one")
        wanted = modules_named(model, rule, "fetch_units")
    roots: list[nn.Module] = []
    splits: list[str] = []
    pending = list(wanted)
    while pending:
        m = pending.pop(0)
        if m in holds_leaf:
            pending[:0] = [c for c in m.children() if tree.worth_a_unit(c)]
        elif tree.numel(m) > max_live_parameters:
            splits.append(f"{tree.names[m]} ({tree.numel(m):,} elements)")
            pending[:0] = [c for c in m.children() if tree.worth_a_unit(c)]
        elif tree.worth_a_unit(m) and m is not model:
            roots.append(m)
    inside = {x for m in roots for x in m.modules() if x is not m}
    return UnitChoice(tuple(m for m in roots if m not in inside), tuple(splits))


def _repeated_blocks(model: nn.Module, tree: _Tree) -> list[nn.Module]:
    def blocks(m: nn.Module) -> list[nn.Module]:
        """The units in ``m``'s subtree: the stacks' blocks that hold no such block themselves."""
        children = list(m.children())
        repeated = {cls for cls, n in collections.Counter(type(c) for c in children).items() if n > 1}
        found: list[nn.Module] = []
        for c in children:
            inner = blocks(c)
            if not inner and type(c) in repeated and not isinstance(c, _CONTAINERS) and tree.worth_a_unit(c):
                found.append(c)
            else:
                found.extend(inner)
        return found

    return blocks(model)


def _by_granularity(model: nn.Module, tree: _Tree, threshold: int) -> list[nn.Module]:
    found: list[nn.Module] = []
    layers: dict[nn.Module, int] = {}

    def count(m: nn.Module) -> int:
        """DeepSpeed's layers of ``m``: every module with parameters in its subtree, containers not counted."""
        if m not in layers:
            children = list(m.children())
            if tree.numel(m) == 0:
                layers[m] = 0
            elif not children:
                layers[m] = 1
            else:
                layers[m] = sum(count(c) for c in children) + (0 if isinstance(m, _CONTAINERS) else 1)
        return layers[m]

    def visit(m: nn.Module) -> None:
        if tree.numel(m) == 0:
            return
        eligible = (
            m is not model and not isinstance(m, _CONTAINERS) and next(m.children(), None) is not None
            and tree.numel(m) <= _LARGEST_GRANULARITY_UNIT
        )
        if eligible and tree.numel(m) // count(m) <= threshold:
            found.append(m)
            return
        for c in m.children():
            visit(c)

    visit(model)
    return found
