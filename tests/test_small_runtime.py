"""The 60-line runtime of docs/runtime-tutorial.md (examples/small_runtime.py):
the tutorial shows the file's own code, and a user's plain ``loss.backward()``
trains to DDP's parameters, with one and with two backwards per step."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.dist_pool import PoolSet, WorkerContext

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "small_runtime.py"
TUTORIAL = ROOT / "docs" / "runtime-tutorial.md"
BEGIN, END = "# --- the runtime (shown in docs/runtime-tutorial.md) ---\n", "# --- end of the runtime ---\n"


def _example() -> ModuleType:
    """examples/small_runtime.py as a module (examples/ is no package)."""
    loaded = sys.modules.get("small_runtime_example")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("small_runtime_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _runtime_code() -> str:
    text = EXAMPLE.read_text(encoding="utf-8")
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)]


def test_the_tutorial_shows_the_example_runtime_verbatim() -> None:
    tutorial = TUTORIAL.read_text(encoding="utf-8")
    section = tutorial[tutorial.index("## A runtime in 60 lines") :]
    shown = re.search(r"^```python\n(.*?)^```$", section, re.M | re.S)
    assert shown is not None, "the section has no python block"
    assert shown.group(1) == _runtime_code(), "docs/runtime-tutorial.md shows other code than examples/small_runtime.py"
    lines = [line for line in _runtime_code().splitlines() if line.strip()]
    assert len(lines) <= 66, f"the '60-line' runtime has grown to {len(lines)} non-blank lines"


def _train(ctx: WorkerContext, name: str, micro_batches: int) -> dict[str, Any]:
    import torch

    example = _example()
    gap = example.train_beside_ddp(name, ctx.group, steps=3, micro_batches=micro_batches)
    # after a plain backward, nothing stays gathered and no full gradient is held
    torch.manual_seed(0)
    model, batch, loss_of = example.build(name)
    runtime = example.PerModuleZero3(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx.group)
    x = batch(ctx.rank, 0)
    loss_of(model(x), x).backward()
    return {
        "gap": gap,
        "gathered": [s.status.name for s in runtime.shards if s.status.name != "NOT_AVAILABLE"],
        "full_grads": [p.grad is not None for p in runtime.params].count(True),
        "partitions": runtime.grads.optimizer_grads().count(None),
        "resident": sum(p.numel() for p in runtime.params),
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one_backward", "two_backwards"])
def test_plain_backward_trains_to_ddp_parameters(pools: PoolSet, world: int, name: str, micro_batches: int) -> None:
    for result in pools.run(world, _train, name, micro_batches, timeout=120):
        assert result["gap"] < 1e-6, result  # DDP moved its parameters by ~1e-1: a runtime that missed a step is far off
        assert result["gathered"] == [], result
        assert result["full_grads"] == 0, result
        assert result["partitions"] == 0, result  # every partition got its reduced gradient from the end-of-backward reduce
        assert result["resident"] == 0, result  # param.data of a released parameter is empty


def _frozen(ctx: WorkerContext) -> str:
    import torch

    model = torch.nn.Linear(3, 3)
    model.bias.requires_grad_(False)
    try:
        _example().PerModuleZero3(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx.group)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_frozen_parameter_is_refused_by_name(pools: PoolSet) -> None:
    [message] = pools.run(1, _frozen)
    assert "trains every parameter" in message and "zero3" in message
