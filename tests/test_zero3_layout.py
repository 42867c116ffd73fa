"""The layout of ``z3kit_recipes.zero3``: sub-packages in layers, imports one way.

Every module under ``z3kit_recipes/zero3`` is parsed (nothing is imported),
and every import statement in it counts: at module level, inside functions,
and under ``if TYPE_CHECKING:``. A package's ``__init__`` is a module of its
own; the implicit import of a parent package that Python does first is not
counted. The checks:

- no import cycle between modules, however it is broken at run time;
- the layers below, each sub-package importing only from itself and the
  layers beneath it (packages of one layer do not import each other);
- ``z3kit`` (the primitives) never imports ``z3kit_recipes``.

There is no line cap: one concept per module, and a concept stays whole
however long it is (FSDP2's ``_fsdp_param_group.py`` is over 1,100 lines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ZERO3 = "z3kit_recipes.zero3"

#: sub-package of ``zero3`` -> its layer; a module imports only from its own
#: package and from lower layers. "" is the top: the package's own modules
#: (the public ``Zero3Engine`` facade, ``initialize``), which compose the rest.
LAYERS = {
    "config": 0,  # Zero3Config, "auto", the memory budget, timeouts
    "step": 1,  # the step's state: what every part above consults
    "ranks": 2,  # rank agreement, the notice board and its waits
    "training": 3,  # the data path's parts: parameters, gradients, backward, step
    "compile": 4,  # torch.compile support around the forward
    "runtime": 5,  # the parts assembled and run: build, root hooks, EngineCore, stats
    "weights": 6,  # features over the core: checkpoints, Hugging Face weights, DeepSpeed import
    "lockstep": 6,  # features over the core: engine.join(), engine.generate()
    "": 7,
}


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``root``."""
    base = root.joinpath(*package.split("."))
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_names(name: str, path: Path, modules: set[str]) -> list[str]:
    """Every module name ``path`` imports, at any depth: ``from a import b``
    names ``a.b`` when that is a module of ``modules``, else ``a``."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                out.append(submodule if submodule in modules else source)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``zero3`` it imports."""
    modules = module_files(root, ZERO3)
    return {
        name: {m for m in imported_names(name, path, set(modules)) if m in modules and m != name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """The sub-package of ``zero3`` a module belongs to ("" for the top's own modules)."""
    rest = module.removeprefix(ZERO3).lstrip(".").split(".")
    return rest[0] if len(rest) > 1 or rest[0] in LAYERS else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for source in sorted(graph):
        mine = package_of(source)
        if mine not in LAYERS:
            problems.append(f"{source} is in sub-package {mine!r}, which has no layer (add it to LAYERS)")
            continue
        for target in sorted(graph[source]):
            theirs = package_of(target)
            if theirs == mine or theirs not in LAYERS:
                continue
            if LAYERS[theirs] > LAYERS[mine]:
                problems.append(f"{source} (layer {LAYERS[mine]}) imports {target} (layer {LAYERS[theirs]}, above it)")
            elif LAYERS[theirs] == LAYERS[mine]:
                problems.append(f"{source} imports {target}: packages of one layer do not import each other")
    return problems


def primitives_importing_recipes(root: Path) -> list[str]:
    out = []
    modules = module_files(root, "z3kit")
    for name, path in modules.items():
        for imported in imported_names(name, path, set(modules)):
            if imported == "z3kit_recipes" or imported.startswith("z3kit_recipes."):
                out.append(f"{name} imports {imported}")
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING and relative imports are edges; a sub-package's parent is not."""
    pkg = tmp_path / "z3kit_recipes" / "zero3"
    (pkg / "training").mkdir(parents=True)
    (tmp_path / "z3kit_recipes" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from z3kit_recipes.zero3.engine import Engine\n")
    (pkg / "engine.py").write_text("from z3kit_recipes.zero3.training import parts\n")
    (pkg / "training" / "__init__.py").write_text('"""The data path."""\n')
    (pkg / "training" / "parts.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from z3kit_recipes.zero3.engine import Engine\n"
        "def f():\n    from . import other\n"
    )
    (pkg / "training" / "other.py").write_text("")
    g = import_graph(tmp_path)
    assert g == {
        "z3kit_recipes.zero3": {"z3kit_recipes.zero3.engine"},
        "z3kit_recipes.zero3.engine": {"z3kit_recipes.zero3.training.parts"},
        "z3kit_recipes.zero3.training": set(),
        "z3kit_recipes.zero3.training.parts": {"z3kit_recipes.zero3.engine", "z3kit_recipes.zero3.training.other"},
        "z3kit_recipes.zero3.training.other": set(),
    }
    assert cycles(g) == [["z3kit_recipes.zero3.engine", "z3kit_recipes.zero3.training.parts"]]
    assert layering_violations(g) == [
        "z3kit_recipes.zero3.training.parts (layer 3) imports z3kit_recipes.zero3.engine (layer 7, above it)"
    ]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_imports_flow_down_the_layers(graph: dict[str, set[str]]) -> None:
    assert layering_violations(graph) == []


def test_every_sub_package_has_a_layer() -> None:
    base = REPO / "z3kit_recipes" / "zero3"
    found = {p.name for p in base.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(LAYERS) - {""}


def test_the_primitives_never_import_the_recipes() -> None:
    assert primitives_importing_recipes(REPO) == []
