"""LeafModuleHook: an MoE block as one unit, on plain CPU modules with
recording actions and a recording reduction (no process group)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from z3kit.hooks import HookActions, ModuleHooks
from z3kit.leaf import LeafModuleHook, ParamGrads

D, EXPERTS, UNUSED = 4, 4, 2
#: token -> expert; expert 2 gets no tokens
ROUTE = torch.tensor([0, 1, 3, 0, 1, 3])


class MoE(nn.Module):
    """Router plus experts; ``route`` fixes which expert each token goes to,
    the router's gate weighs the expert's output (so the router gets grads)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(x[idx]) * gates[idx, e : e + 1])
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE()
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.moe(self.inp(x), route)))


class Setup:
    """A hooked model: ``events`` records every action and every reduction."""

    def __init__(self, model: nn.Module, leaf: nn.Module) -> None:
        self.model = model
        self.names = {m: (n or "root") for n, m in model.named_modules()}
        self.pnames = {p: n for n, p in model.named_parameters()}
        self.events: list[tuple[str, str]] = []
        #: one entry per reduction: (param name, grad clone) in the order given
        self.reduced: list[list[tuple[str, torch.Tensor | None]]] = []
        self.hooks = ModuleHooks(self.actions())
        self.unit = LeafModuleHook(leaf, self.actions(), self.reduce)
        for m in model.modules():
            if m is leaf:
                self.hooks.attach(m, self.unit.actions)
            elif m not in self.unit.submodules():
                self.hooks.attach(m)

    def actions(self) -> HookActions:
        def rec(point: str) -> Any:
            return lambda m, *_: self.events.append((point, self.names[m]))

        return HookActions(rec("pre_forward"), rec("post_forward"), rec("pre_backward"), rec("post_backward"))

    def reduce(self, grads: ParamGrads) -> None:
        self.events.append(("reduce", ""))
        self.reduced.append([(self.pnames[p], None if g is None else g.clone()) for p, g in grads])


def reference_grads(ref: nn.Module, run: Any) -> dict[str, torch.Tensor | None]:
    """Gradients of an unhooked copy (copied before hooking: a deep copy keeps hooks)."""
    for p in ref.parameters():
        p.grad = None
    run(ref).sum().backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def test_moe_reduce_once_with_none_for_unused_expert() -> None:
    torch.manual_seed(0)
    model = Net()
    model.moe.experts[3].bias.requires_grad_(False)  # frozen: not reduced
    x = torch.randn(len(ROUTE), D)
    expected = reference_grads(copy.deepcopy(model), lambda m: m(x, ROUTE))
    s = Setup(model, model.moe)

    model(x, ROUTE).sum().backward()
    assert len(s.reduced) == 1
    trainable = [n for n, p in model.moe.named_parameters(prefix="moe") if p.requires_grad]
    assert "moe.experts.3.bias" not in trainable
    assert [n for n, _ in s.reduced[0]] == trainable
    for name, grad in s.reduced[0]:
        ref = expected[name]
        if name.startswith(f"moe.experts.{UNUSED}."):
            assert ref is None and grad is None, name
        else:
            assert ref is not None and torch.equal(grad, ref), name

    # the unit's own post-backward came from autograd, after the reduction
    backward = s.events[s.events.index(("pre_backward", "root")) :]
    assert backward == [
        ("pre_backward", "root"),
        ("pre_backward", "out"),
        ("post_backward", "out"),
        ("pre_backward", "moe"),
        ("reduce", ""),
        ("post_backward", "moe"),
        ("pre_backward", "inp"),
    ]
    assert s.hooks.finish_backward() == [model.inp, model]
    assert len(s.reduced) == 1


def test_reduce_sees_the_gradients_of_each_backward() -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    s = Setup(model, model.moe)
    for step in range(2):
        x = torch.randn(len(ROUTE), D)
        for p in model.parameters():
            p.grad = None
        expected = reference_grads(reference, lambda m: m(x, ROUTE))
        model(x, ROUTE).sum().backward()
        s.hooks.finish_backward()
        assert len(s.reduced) == step + 1
        for name, grad in s.reduced[-1]:
            ref = expected[name]
            assert grad is ref if ref is None else (grad is not None and torch.equal(grad, ref)), name


def test_leaf_inputs_without_grad_reduced_by_finish_backward() -> None:
    torch.manual_seed(0)
    moe = MoE()
    x = torch.randn(len(ROUTE), D)
    expected = reference_grads(copy.deepcopy(moe), lambda m: m(x, ROUTE))
    s = Setup(moe, moe)
    moe(x, ROUTE).sum().backward()
    assert s.reduced == []
    assert s.events[-1] == ("pre_backward", "root")
    assert s.hooks.finish_backward() == [moe]
    assert s.events[-2:] == [("reduce", ""), ("post_backward", "root")]
    assert len(s.reduced) == 1
    assert [n for n, _ in s.reduced[0]] == [n for n, _ in moe.named_parameters()]
    for name, grad in s.reduced[0]:
        ref = expected[name]
        assert grad is ref if ref is None else (grad is not None and torch.equal(grad, ref)), name


def test_params_and_submodules() -> None:
    moe = MoE()
    moe.experts[1].weight = moe.experts[0].weight  # tied: listed once
    unit = LeafModuleHook(moe, HookActions(*[lambda *a: None] * 4), lambda grads: None)
    assert list(unit.params) == list(moe.parameters())
    assert len(unit.params) == 2 + 2 * EXPERTS - 1
    assert len({id(p) for p in unit.params}) == len(unit.params)
    subs = unit.submodules()
    assert moe not in subs
    assert subs == [moe.router, moe.experts, *moe.experts]


def test_unit_actions_keep_the_inner_ones() -> None:
    calls: list[str] = []
    inner = HookActions(
        lambda m: calls.append("pre_forward"),
        lambda m, o: calls.append("post_forward"),
        lambda m: calls.append("pre_backward"),
        lambda m: calls.append("post_backward"),
    )
    moe = MoE()
    unit = LeafModuleHook(moe, inner, lambda grads: calls.append(f"reduce {len(grads)}"))
    assert unit.actions.pre_forward is inner.pre_forward
    assert unit.actions.post_forward is inner.post_forward
    assert unit.actions.pre_backward is inner.pre_backward
    unit.actions.post_backward(moe)
    assert calls == [f"reduce {2 + 2 * EXPERTS}", "post_backward"]


def test_gradients_none_and_existing() -> None:
    moe = MoE()
    moe.router.bias.requires_grad_(False)
    moe.router.weight.grad = torch.ones_like(moe.router.weight)
    unit = LeafModuleHook(moe, HookActions(*[lambda *a: None] * 4), lambda grads: None)
    got = unit.gradients()
    assert [p for p, _ in got] == [p for p in moe.parameters() if p is not moe.router.bias]
    assert got[0][1] is moe.router.weight.grad
    assert [g for _, g in got[1:]] == [None] * (len(got) - 1)


def test_constructor_errors() -> None:
    actions = HookActions(*[lambda *a: None] * 4)
    with pytest.raises(ValueError):
        LeafModuleHook(nn.Sequential(nn.ReLU(), nn.Tanh()), actions, lambda grads: None)
    with pytest.raises(TypeError):
        LeafModuleHook(torch.zeros(2), actions, lambda grads: None)  # type: ignore[arg-type]
