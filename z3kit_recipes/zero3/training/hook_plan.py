"""Which module gathers which parameters.

Every module that owns parameters is hooked and fetches its own
(``parameters(recurse=False)``); a leaf unit (an MoE block) fetches its
whole subtree at its root, and the modules inside it are not hooked. The
root is always hooked, with or without parameters of its own, so that the
runtime sees every forward start and end.

A fetch unit (``zero3.training.unit_rule``: by default each block of a
stack) fetches its whole subtree at its root in the same way.

A compiled submodule (``block.compile()``, or ``torch.compile(block)`` put
into the model) is a unit too: it fetches its whole subtree at its root, so
that the compiled code finds every parameter gathered and no hook inside it
breaks the graph (see ``zero3.compile.compiled``). Its gradients are reduced
parameter by parameter as usual; a leaf unit keeps its own rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from z3kit.dynamo import is_compiled
from z3kit.sharded_param import parameter_of

LeafSpec = type[nn.Module] | nn.Module


def modules_named(model: nn.Module, specs: Iterable[LeafSpec], argument: str) -> list[nn.Module]:
    """The model's modules that ``specs`` (classes or instances) name, in the
    order named, once each; ``argument`` names the caller's argument in messages."""
    modules = list(model.modules())
    chosen: list[nn.Module] = []
    for spec in specs:
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            found = [m for m in modules if isinstance(m, spec)]
            if not found:
                raise ValueError(f"{argument}: class {spec.__name__} matches no module of the model")
            chosen.extend(found)
        elif isinstance(spec, nn.Module):
            if not any(spec is m for m in modules):
                raise ValueError(f"{argument}: the {type(spec).__name__} instance is not part of the model")
            chosen.append(spec)
        else:
            raise TypeError(f"{argument} holds module classes or instances, got {type(spec).__name__}")
    return list(dict.fromkeys(chosen))


def resolve_leaves(model: nn.Module, specs: Iterable[LeafSpec]) -> list[nn.Module]:
    """The model's leaf-unit roots named by classes or instances (a leaf inside
    another leaf is part of the outer unit)."""
    unique = modules_named(model, specs, "leaf_modules")
    inner = {m for leaf in unique for m in leaf.modules() if m is not leaf}
    leaves = [m for m in unique if m not in inner]
    for leaf in leaves:
        if next(leaf.parameters(), None) is None:
            raise ValueError(f"leaf module {type(leaf).__name__} has no parameters")
    return leaves


def compiled_units(model: nn.Module, leaves: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The compiled submodules that fetch their whole subtree at their root:
    the outermost compiled module of each subtree, the root itself excluded
    (see ``zero3.compile.compiled``), and none that holds a leaf unit or
    lies inside one (a leaf unit already fetches its subtree as one)."""
    leaf_set = set(leaves)
    units: list[nn.Module] = []
    claimed: set[nn.Module] = set()
    for m in model.modules():
        if m in claimed:
            continue
        if m in leaf_set:
            claimed.update(m.modules())
            continue
        if m is model or not is_compiled(m):
            continue
        inner = set(m.modules())
        if inner & leaf_set:
            continue
        units.append(m)
        claimed.update(inner)
    return units


def fetch_groups(
    model: nn.Module, params: Sequence[nn.Parameter], leaves: Iterable[nn.Module], units: Iterable[nn.Module] = ()
) -> dict[nn.Module, list[int]]:
    """Hooked module -> ids (positions in ``params``) of the parameters it
    fetches. ``units`` are the fetch units (``zero3.training.unit_rule``); one
    that holds a compiled submodule gives way to it, so that no compiled
    code runs unhooked inside a unit."""
    index = {id(p): pid for pid, p in enumerate(params)}
    leaf_roots = set(leaves)
    compiled = set(compiled_units(model, leaf_roots))
    roots = leaf_roots | compiled | {u for u in units if not any(m in compiled for m in u.modules() if m is not u)}
    inside_leaf = {m for leaf in roots for m in leaf.modules() if m is not leaf}
    groups: dict[nn.Module, list[int]] = {}
    for m in model.modules():
        if m in inside_leaf:
            continue
        if m in roots:
            pids = list(dict.fromkeys(index[id(parameter_of(p))] for p in m.parameters()))
        else:
            pids = list(dict.fromkeys(index[id(parameter_of(p))] for p in m.parameters(recurse=False)))
        if pids or m is model:
            groups[m] = pids
    return groups
