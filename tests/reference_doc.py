"""docs/reference.md, generated from the primitives' signatures and docstrings.

Each module gets its docstring (where its invariants are written down);
each primitive in it gets its own docstring and a stub of its constructor
and public methods and properties with their docstrings, so the page says
what the code says. ``tests/test_reference.py`` checks the page equals this
output; after changing a primitive, regenerate it from the repository root:

    python -m tests.reference_doc > docs/reference.md
"""

from __future__ import annotations

import enum
import importlib
import inspect
from collections.abc import Callable
from typing import Any

#: (name, module), a module's primitives together, in the order of the README's reference table
PRIMITIVES: tuple[tuple[str, str], ...] = (
    ("ParamShard", "z3kit.shard"),
    ("gather_shards", "z3kit.shard"),
    ("ShardedTensor", "z3kit.sharded_param"),
    ("GatherHandle", "z3kit.shard"),
    ("ModuleHooks", "z3kit.hooks"),
    ("HookActions", "z3kit.hooks"),
    ("LeafModuleHook", "z3kit.leaf"),
    ("at_backward_end", "z3kit.hook_context"),
    ("on_grad_accumulated", "z3kit.grad_hooks"),
    ("FlatBucket", "z3kit.flat_bucket"),
    ("BucketFlush", "z3kit.flat_bucket"),
    ("GradPartitionBuffer", "z3kit.grad_partition"),
    ("StreamPair", "z3kit.streams"),
    ("SyncStreamPair", "z3kit.streams"),
    ("TraceRecorder", "z3kit.trace"),
    ("ReleasePolicy", "z3kit.release"),
    ("PrefetchLimiter", "z3kit.prefetch"),
    ("RecordedStep", "z3kit.recorded_step"),
    ("SchedulePlanner", "z3kit.schedule_plan"),
    ("SchedulePlan", "z3kit.schedule_plan"),
    ("check_plan", "z3kit.schedule_plan"),
    ("MatrixPlan", "z3kit.matrix_owners"),
    ("map_on_owners", "z3kit.matrix_owners"),
    ("ShardedMuon", "z3kit.sharded_muon"),
)

HEADER = """# Reference: the primitives

[Back to the README](../README.md#reference).

Generated from the code by `python -m tests.reference_doc > docs/reference.md`;
`tests/test_reference.py` fails when this page and the code differ. Each
module's docstring comes first (quoted: the invariants the module keeps),
then each of its primitives: its docstring, constructor and public methods
and properties, as a stub with their docstrings.
"""


def primitive(name: str, module: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or ""


def _annotation(annotation: Any) -> str:
    # under ``from __future__ import annotations`` an annotation is the source's own string
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _default(value: Any) -> str:
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)


def _signature(fn: Callable[..., Any]) -> str:
    """``fn``'s signature as its source spells it (an enum default by its name)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    parts: list[str] = []
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and (i == 0 or params[i - 1].kind not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)):
            parts.append("*")
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}" if p.annotation is not p.empty else f"={_default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    returns = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"({', '.join(parts)}){returns}"


def _stub_doc(doc: str, indent: str) -> list[str]:
    if not doc:
        return []
    lines = doc.replace('"""', "'''").splitlines()
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}', *(f"{indent}{line}" if line else "" for line in lines[1:]), f'{indent}"""']


def _function_stub(name: str, fn: Callable[..., Any], indent: str) -> list[str]:
    doc = _stub_doc(_doc(fn), indent + "    ")
    head = f"{indent}def {name}{_signature(fn)}:"
    return [head, *doc] if doc else [head + " ..."]


def _class_stub(cls: type) -> list[str]:
    lines = [f"class {cls.__name__}:", *_stub_doc(_doc(cls), "    ")]
    init = cls.__dict__.get("__init__")
    if init is not None and not getattr(cls, "_is_protocol", False):  # a Protocol's __init__ is typing's
        lines.append(f"    def __init__{_signature(init)}: ...")
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property) and value.fget is not None:
            lines += ["    @property", *_function_stub(attr, value.fget, "    ")]
        elif isinstance(value, (staticmethod, classmethod)):
            lines += [f"    @{type(value).__name__}", *_function_stub(attr, value.__func__, "    ")]
        elif inspect.isfunction(value):
            lines += _function_stub(attr, value, "    ")
    return lines


def section(name: str, module: str) -> str:
    obj = primitive(name, module)
    stub = _class_stub(obj) if inspect.isclass(obj) else _function_stub(name, obj, "")
    return "\n".join([f"### {name}", "", f"`from {module} import {name}`", "", "```python", *stub, "```", ""])


def module_section(module: str) -> str:
    doc = _doc(importlib.import_module(module))
    return "\n".join([f"## {module}", "", *(f"> {line}".rstrip() for line in doc.splitlines()), ""])


def render() -> str:
    parts, seen = [HEADER], set()
    for name, module in PRIMITIVES:
        if module not in seen:
            seen.add(module)
            parts.append(module_section(module))
        parts.append(section(name, module))
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
