"""``z3kit.dynamo``: the private torch names of compile support, pinned on
the installed torch (see the module docstring). Each case runs in a rank
process of its own pool, so that dynamo's process-wide state (its caches,
counters and callbacks) never reaches the test process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _double_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum()


def _with_a_break(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    print(end="")  # a graph break: dynamo compiles the two halves as two graphs
    return y.sum()


def run_compile_events(ctx: Any) -> dict[str, Any]:
    from z3kit.dynamo import compile_totals, on_frame_compiled

    torch._dynamo.reset()
    seen: list[int] = []
    remove = on_frame_compiled(seen.append)
    graphs0, breaks0 = compile_totals()
    f = torch.compile(_double_sum, backend="eager", dynamic=False)
    f(torch.ones(3, requires_grad=True)).backward()
    f(torch.ones(4, requires_grad=True)).backward()  # another shape: a recompile
    f(torch.ones(3, dtype=torch.float64))  # another dtype: one more
    graphs1, breaks1 = compile_totals()
    torch.compile(_with_a_break, backend="eager")(torch.ones(3))
    graphs2, breaks2 = compile_totals()
    remove()
    f(torch.ones(5))  # compiled, not seen
    torch._dynamo.reset()  # clears every callback: removing again is a no-op
    remove()
    return {"seen": seen, "graphs": (graphs1 - graphs0, graphs2 - graphs1), "breaks": (breaks1 - breaks0, breaks2 - breaks1)}


def test_frame_compiles_are_reported_with_their_compile_number(pools: Any) -> None:
    (r,) = pools.run(1, run_compile_events)
    # the first compile, two recompiles, then the function with a break: its frame and the resumed one
    assert r["seen"][:3] == [0, 1, 2], r
    assert r["seen"][3:] and all(n == 0 for n in r["seen"][3:]), r
    assert r["graphs"] == (3, 2), r  # one graph per compile; a break splits a function into two
    assert r["breaks"][0] == 0 and r["breaks"][1] >= 1, r


def test_compiled_modules_are_told_apart() -> None:
    from z3kit.dynamo import is_compile_wrapper, is_compiled

    plain, in_place = nn.Linear(2, 2), nn.Linear(2, 2)
    in_place.compile(backend="eager")
    wrapper = torch.compile(plain, backend="eager")  # compiling is lazy: nothing runs here
    assert not is_compiled(plain) and not is_compile_wrapper(plain)
    assert is_compiled(in_place) and not is_compile_wrapper(in_place)
    assert is_compiled(wrapper) and is_compile_wrapper(wrapper)


def test_the_current_function_mode_is_the_top_of_the_stack() -> None:
    from z3kit.dynamo import current_function_mode

    outer, inner = TorchFunctionMode(), TorchFunctionMode()
    assert current_function_mode() is None
    with outer:
        assert current_function_mode() is outer
        with inner:
            assert current_function_mode() is inner
        assert current_function_mode() is outer
    assert current_function_mode() is None
