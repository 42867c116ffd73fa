"""``z3kit.hook_context``: the end-of-backward callback (the one adapter over
torch's private ``queue_callback``) and the backward test, pinned."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from z3kit.hook_context import at_backward_end, in_backward, outside_graphs


def test_the_callback_runs_once_after_every_gradient_of_its_backward() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    seen: list[str] = []

    def ended() -> None:
        seen.append(f"end grad={w.grad.tolist() if w.grad is not None else None} in_backward={in_backward()}")

    def queue(grad: torch.Tensor) -> torch.Tensor:
        seen.append("hook")
        at_backward_end(ended)
        return grad

    x = torch.ones(3, requires_grad=True)
    h = x * 2
    h.register_hook(queue)
    (h * w).sum().backward()
    # the callback runs after the parameter's gradient is in, still in the graph task
    assert seen[0] == "hook" and seen[-1].startswith("end grad=[2.0, 2.0, 2.0]")
    assert all("in_backward=True" in s for s in seen if s.startswith("end"))
    seen.clear()
    (h.detach() * w).sum().backward()  # no hook of ours in this backward: nothing runs
    assert seen == []


def test_queued_inside_a_reentrant_checkpoint_it_runs_at_the_inner_backwards_end() -> None:
    """Which is why a runtime queues it from the first hook of the outermost backward."""
    w = torch.nn.Parameter(torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    order: list[str] = []

    def note(what: str) -> None:
        order.append(f"{what} x.grad={None if x.grad is None else x.grad.tolist()}")

    def segment(t: torch.Tensor) -> torch.Tensor:
        out = t * w
        if out.requires_grad:  # the recomputation, inside the outer backward (the first run is under no_grad)
            out.register_hook(lambda g: (at_backward_end(lambda: note("inner end")), g)[1])
        return out

    y = checkpoint(segment, x * 3, use_reentrant=True)
    y.register_hook(lambda g: (at_backward_end(lambda: note("outer end")), g)[1])
    y.sum().backward()
    assert order == ["inner end x.grad=None", "outer end x.grad=[3.0, 3.0]"]


def test_outside_a_backward_it_refuses() -> None:
    with pytest.raises(RuntimeError, match="inside a backward"):
        at_backward_end(lambda: None)


def test_outside_graphs_keeps_a_body_and_its_callees_out_of_compiled_code() -> None:
    # pins what outside_graphs borrows from dynamo: its frame-callback query and
    # the markers of torch.compiler.disable (see the Note in z3kit.hook_context)
    from torch._dynamo.testing import CompileCounter

    seen: list[bool] = []

    def callee(x: torch.Tensor) -> torch.Tensor:  # compiled as a frame of its own if reached with dynamo's callback on
        seen.append(torch.compiler.is_compiling())
        return x + 1

    @outside_graphs
    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return callee(x)

    def step(x: torch.Tensor) -> torch.Tensor:
        return body(x * 2) * 3

    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counter)
    x = torch.ones(3)
    assert torch.equal(compiled(x), step(x))
    assert seen == [False] * 4  # the body and its callee ran eagerly, compiled or not
    assert counter.frame_count == 2  # the graphs before and after the body: the callee was not compiled
    torch._dynamo.reset()
