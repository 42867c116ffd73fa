"""docs/reference.md is what the primitives' code and docstrings say, and
the README's reference table lists each primitive and links to its entry."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.reference_doc import PRIMITIVES, primitive, render

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference.md"


def test_the_reference_page_is_generated_from_the_code() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/reference.md differs from the code: run `python -m tests.reference_doc > docs/reference.md`"
    )


@pytest.mark.parametrize(("name", "module"), PRIMITIVES, ids=[name for name, _ in PRIMITIVES])
def test_every_primitive_states_its_contract(name: str, module: str) -> None:
    obj = primitive(name, module)
    assert inspect.getdoc(obj), f"{module}.{name} has no docstring: its contract would be missing from the reference"
    entry = render().split(f"\n### {name}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    assert f"{'class' if inspect.isclass(obj) else 'def'} {name}" in entry, entry[:200]


def test_the_readme_table_links_every_primitive_the_brief_names() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("\n## Reference\n") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    linked = set(re.findall(r"\[`(\w+)`\]\(docs/reference\.md#(\w+)\)", section))
    required = {"ParamShard", "gather_shards", "ModuleHooks", "LeafModuleHook", "at_backward_end", "FlatBucket",
                "GradPartitionBuffer", "StreamPair", "TraceRecorder", "ReleasePolicy", "PrefetchLimiter"}
    assert required <= {name for name, _ in linked}, required - {name for name, _ in linked}
    documented = {name for name, _ in PRIMITIVES}
    for name, anchor in linked:
        assert name in documented and anchor == name.lower(), (name, anchor)
