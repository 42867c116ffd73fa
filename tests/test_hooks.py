"""ModuleHooks: the four lifecycle points, driven on plain CPU modules with
recording actions (no process group)."""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from z3kit.hook_context import in_backward
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.nested import iter_tensors, map_tensors

Event = tuple[str, str]


class Recorder:
    """Records ``(point, module name)`` for every action call."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.events: list[Event] = []
        self.names: dict[nn.Module, str] = {}
        if model is not None:
            self.name_all(model)

    def name_all(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            self.names[module] = name or "root"

    def name(self, module: nn.Module) -> str:
        return self.names.get(module, type(module).__name__)

    def actions(self, tag: str = "") -> HookActions:
        def rec(point: str) -> Any:
            return lambda module, *_: self.events.append((tag + point, self.name(module)))

        return HookActions(rec("pre_forward"), rec("post_forward"), rec("pre_backward"), rec("post_backward"))

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out


def hook_one(model: nn.Module) -> tuple[Recorder, ModuleHooks]:
    """``model`` alone hooked, recorded as "m"."""
    rec = Recorder()
    rec.names[model] = "m"
    hooks = ModuleHooks(rec.actions())
    hooks.attach(model)
    return rec, hooks


def hook_all(model: nn.Module, rec: Recorder) -> ModuleHooks:
    hooks = ModuleHooks(rec.actions())
    for module in model.modules():
        hooks.attach(module)
    return hooks


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys()
    for name in ga:
        x, y = ga[name], gb[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            assert torch.equal(x, y), name


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


# -- order of events ---------------------------------------------------------------


def test_nested_model_event_order() -> None:
    torch.manual_seed(0)
    model = Parent()
    rec = Recorder(model)
    hooks = hook_all(model, rec)
    x = torch.randn(3, 4, requires_grad=True)
    y = model(x)
    assert rec.take() == [
        ("pre_forward", "root"),
        ("pre_forward", "a"),
        ("post_forward", "a"),
        ("pre_forward", "b"),
        ("post_forward", "b"),
        ("post_forward", "root"),
    ]
    y.sum().backward()
    assert rec.take() == [
        ("pre_backward", "root"),
        ("pre_backward", "b"),
        ("post_backward", "b"),
        ("pre_backward", "a"),
        ("post_backward", "a"),
        ("post_backward", "root"),
    ]
    assert hooks.finish_backward() == []
    assert rec.take() == []
    assert hooks.active == [] and hooks.open_modules() == []


class _Probe(torch.autograd.Function):
    """Identity whose backward records the state seen at that moment."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[Any], tag: str, state: dict[str, Any]) -> torch.Tensor:
        ctx.log, ctx.tag, ctx.state = log, tag, state
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.log.append((ctx.tag, ctx.state["gathered"]))
        return grad, None, None, None


def test_pre_backward_before_module_ops_post_backward_after_input_grads() -> None:
    log: list[Any] = []
    state = {"gathered": False}

    class Probed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = _Probe.apply(x, log, "input_grad_computed", state)  # its backward is the module's last op
            return _Probe.apply(self.lin(x), log, "first_op", state)  # its backward is the module's first op

    model = Probed()

    def pre_backward(m: nn.Module) -> None:
        log.append(("pre_backward", state["gathered"], model.lin.weight.grad is None))
        state["gathered"] = True

    def post_backward(m: nn.Module) -> None:
        log.append(("post_backward", state["gathered"], model.lin.weight.grad is not None))
        state["gathered"] = False

    hooks = ModuleHooks(HookActions(lambda m: None, lambda m, o: None, pre_backward, post_backward))
    hooks.attach(model)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert log == [
        ("pre_backward", False, True),  # before any op, no parameter gradient yet
        ("first_op", True),
        ("input_grad_computed", True),
        ("post_backward", True, True),  # after the input gradient, parameter gradients done
    ]
    assert x.grad is not None


# -- reference counting -----------------------------------------------------------


def test_module_called_three_times_sequentially() -> None:
    model = nn.Linear(4, 4)
    rec = Recorder()
    rec.names[model] = "m"
    hooks = hook_all(model, rec)
    x = torch.randn(2, 4, requires_grad=True)
    y = model(model(model(x)))
    assert rec.take() == [("pre_forward", "m"), ("post_forward", "m")] * 3
    y.sum().backward()
    assert rec.take() == [("pre_backward", "m"), ("post_backward", "m")] * 3
    assert hooks.finish_backward() == []


def test_module_called_three_times_first_input_without_grad() -> None:
    model = nn.Linear(4, 4)
    rec = Recorder()
    rec.names[model] = "m"
    hooks = hook_all(model, rec)
    y = model(model(model(torch.randn(2, 4))))
    rec.take()
    y.sum().backward()
    # the first call's input needs no grad: it stays open until finish_backward
    assert rec.take() == [("pre_backward", "m"), ("post_backward", "m")] * 2 + [("pre_backward", "m")]
    assert hooks.open_modules() == [model]
    assert hooks.finish_backward() == [model]
    assert rec.take() == [("post_backward", "m")]


def test_two_calls_summed() -> None:
    model = nn.Linear(4, 4)
    rec = Recorder()
    rec.names[model] = "m"
    hooks = hook_all(model, rec)
    x1 = torch.randn(2, 4, requires_grad=True)
    x2 = torch.randn(2, 4, requires_grad=True)
    y = model(x1) + model(x2)
    rec.take()
    y.sum().backward()
    events = rec.take()
    assert events.count(("pre_backward", "m")) == 2
    # every post-backward comes when no call is open: as many pre as post so far
    pending = 0
    for point, _ in events:
        pending += {"pre_backward": 1, "post_backward": -1}[point]
        assert pending >= 0
        if point == "post_backward":
            assert pending == 0
    assert pending == 0
    assert hooks.finish_backward() == [] and hooks.open_modules() == []


class SelfCalling(nn.Module):
    """``f(x, k) = lin(x) + f(x, k - 1)``: the calls' outputs are summed and
    their backwards nest (the outer call's input gradient waits for the inner
    call's), so the calls are open at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        out = self.lin(x)
        if depth > 0:
            out = out + self(x, depth - 1)
        return out


def test_interleaved_calls_post_backward_once_after_all() -> None:
    torch.manual_seed(0)
    model = SelfCalling()
    reference = copy.deepcopy(model)  # before attaching: a deep copy keeps hooks
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = model(x, 2)
    assert rec.take() == [("pre_forward", "m")] * 3 + [("post_forward", "m")] * 3
    y.sum().backward()
    assert rec.take() == [("pre_backward", "m")] * 3 + [("post_backward", "m")]
    assert hooks.finish_backward() == []
    reference(xr, 2).sum().backward()
    assert_same_grads(model, reference)
    assert x.grad is not None and xr.grad is not None and torch.equal(x.grad, xr.grad)


def test_retain_graph_second_backward_fires_again() -> None:
    model = Parent()
    rec = Recorder(model)
    hooks = hook_all(model, rec)
    y = model(torch.randn(2, 4, requires_grad=True)).sum()
    rec.take()
    y.backward(retain_graph=True)
    first = rec.take()
    assert hooks.finish_backward() == []
    y.backward()
    assert rec.take() == first
    assert hooks.finish_backward() == []


# -- inputs that need no gradient -------------------------------------------------


def test_inputs_without_grad_released_by_finish_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    rec = Recorder(model)
    hooks = hook_all(model, rec)
    model(torch.randn(2, 4)).sum().backward()
    # the root's and the first layer's inputs are plain tensors: autograd never closes them
    assert rec.take()[8:] == [
        ("pre_backward", "root"),
        ("pre_backward", "2"),
        ("post_backward", "2"),
        ("pre_backward", "1"),
        ("post_backward", "1"),
        ("pre_backward", "0"),
    ]
    assert set(hooks.open_modules()) == {model, model[0]}
    assert hooks.finish_backward() == [model[0], model]
    assert rec.take() == [("post_backward", "0"), ("post_backward", "root")]
    assert hooks.finish_backward() == []
    assert rec.take() == []


# -- output containers ------------------------------------------------------------


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extra: torch.Tensor
    label: str = "out"
    count: int = 7


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    hidden: torch.Tensor
    note: tuple[int, ...] = (1, 2)


Pair = namedtuple("Pair", ["hidden", "tag"])


def _structures(h: torch.Tensor, e: torch.Tensor) -> dict[str, Any]:
    return {
        "tensor": h,
        "tuple": (h, 3, "s", None, e),
        "list": [h, 2.5, e],
        "dict": {"h": h, "n": 1, "e": e, "s": "x"},
        "dataclass": Out(h, e),
        "frozen_dataclass": FrozenOut(h),
        "namedtuple": Pair(h, "tag"),
        "nested": {"a": [(h, "k"), Out(e, h, "n", 3)], "b": Pair((h, {"z": e}), None), "c": 5},
    }


class Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return _structures(h, h * 2)[self.kind]


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a marker: types and non-tensor members only."""
    return map_tensors(lambda t: "T", obj)


@pytest.mark.parametrize("kind", list(_structures(torch.zeros(1), torch.zeros(1))))
def test_output_containers_preserved(kind: str) -> None:
    torch.manual_seed(0)
    model = Returns(kind)
    reference = copy.deepcopy(model)
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    expected = reference(x.detach().clone().requires_grad_())

    assert type(out) is type(expected)
    assert _skeleton(out) == _skeleton(expected)
    got, want = list(iter_tensors(out)), list(iter_tensors(expected))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
        assert type(g.grad_fn) is type(w.grad_fn)  # returned as made: pre-backward hangs on its node

    sum(t.sum() for t in got).backward()
    sum(t.sum() for t in want).backward()
    assert rec.take()[2:] == [("pre_backward", "m"), ("post_backward", "m")]
    assert_same_grads(model, reference)


def test_hugging_face_model_output() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    BaseModelOutput = modeling_outputs.BaseModelOutput

    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            h = self.lin(x)
            return BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))

    model = HF()
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    assert type(out) is BaseModelOutput
    assert out.attentions is None and "attentions" not in out
    assert list(out.keys()) == ["last_hidden_state", "hidden_states"]
    # attribute, key and index access all see the same wrapped tensor
    assert out.last_hidden_state is out["last_hidden_state"] is out[0]
    assert type(out.last_hidden_state.grad_fn).__name__ == "AddmmBackward0"  # the Linear's own output
    assert out.hidden_states[1] is out.last_hidden_state
    assert isinstance(out.hidden_states, tuple)
    out.last_hidden_state.sum().backward()
    assert rec.take()[2:] == [("pre_backward", "m"), ("post_backward", "m")]


# -- gradients --------------------------------------------------------------------


def test_inplace_op_on_hooked_output() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4), nn.ReLU(inplace=True))
    reference = copy.deepcopy(model)
    rec = Recorder(model)
    hook_all(model, rec)
    x = torch.randn(5, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = model(x)
    assert torch.equal(y, reference(xr))
    y.pow(2).sum().backward()
    reference(xr).pow(2).sum().backward()
    assert_same_grads(model, reference)
    assert x.grad is not None and xr.grad is not None and torch.equal(x.grad, xr.grad)
    assert ("post_backward", "0") in rec.events


def test_bad_inplace_op_on_hooked_output_still_caught() -> None:
    class Sig(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(x)  # sigmoid saves its output for backward

    model = Sig()
    hooks = ModuleHooks(Recorder().actions())
    hooks.attach(model)
    y = model(torch.randn(3, requires_grad=True))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_mlp_grads_equal_unhooked_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    hooks = hook_all(model, Recorder(model))
    x = torch.randn(8, 6, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    for _ in range(2):  # accumulate over two micro-steps
        model(x).square().mean().backward()
        hooks.finish_backward()
        reference(xr).square().mean().backward()
    assert_same_grads(model, reference)
    assert x.grad is not None and xr.grad is not None and torch.equal(x.grad, xr.grad)


def test_unused_output_and_input_get_no_gradient() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.side = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, ignored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), self.side * 2

    torch.manual_seed(0)
    model = Two()
    reference = copy.deepcopy(model)
    hooks = ModuleHooks(Recorder().actions())
    hooks.attach(model)
    x, ignored = torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    model(x, ignored)[0].sum().backward()
    reference(x.detach(), ignored.detach())[0].sum().backward()
    assert model.side.grad is None and ignored.grad is None  # not zeros
    assert_same_grads(model, reference)


def test_parameters_in_outputs_and_inputs_not_wrapped() -> None:
    seen: list[Any] = []

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            seen.append(w)
            return self.lin(x) @ w, self.lin.weight, {"bias": self.lin.bias}

    model = Tied()
    other = nn.Parameter(torch.randn(4, 4))
    hooks = ModuleHooks(Recorder().actions())
    hooks.attach(model)
    out, weight, extras = model(torch.randn(2, 4, requires_grad=True), other)
    assert seen == [other] and seen[0] is other
    assert weight is model.lin.weight
    assert extras["bias"] is model.lin.bias
    assert type(out.grad_fn).__name__ != "_PreBackwardBackward"  # returned as made


def test_no_grad_fires_forward_points_only() -> None:
    seen: list[torch.Tensor] = []

    class Seeing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return self.lin(x)

    model = Seeing()
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        y = model(x)
    assert seen[0] is x  # the input was not wrapped
    assert y.grad_fn is None and not y.requires_grad
    assert rec.take() == [("pre_forward", "m"), ("post_forward", "m")]
    assert hooks.open_modules() == [] and hooks.finish_backward() == [] and hooks.active == []
    assert rec.take() == []


# -- activation checkpointing -----------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing(use_reentrant: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Parent(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    names = {m: (n or "root") for n, m in model.named_modules()}
    events: list[tuple[str, str, bool]] = []

    def rec(point: str) -> Any:
        return lambda m, *_: events.append((point, names[m], in_backward()))

    hooks = ModuleHooks(HookActions(rec("pre_forward"), rec("post_forward"), rec("pre_backward"), rec("post_backward")))
    for m in model.modules():
        hooks.attach(m)

    def run(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = net[0](x)
        h = checkpoint(net[1], h, use_reentrant=use_reentrant)
        return net[2](h)

    x = torch.randn(3, 4)
    for step in range(2):
        events.clear()
        run(model, x).sum().backward()
        hooks.finish_backward()
        assert hooks.active == [] and hooks.open_modules() == []
        forward = [e for e in events if not e[2]]
        assert [(p, n) for p, n, _ in forward if p.endswith("forward")] == [
            ("pre_forward", "0"),
            ("post_forward", "0"),
            ("pre_forward", "1"),
            ("pre_forward", "1.a"),
            ("post_forward", "1.a"),
            ("pre_forward", "1.b"),
            ("post_forward", "1.b"),
            ("post_forward", "1"),
            ("pre_forward", "2"),
            ("post_forward", "2"),
        ]
        recomputed = [(p, n) for p, n, inside in events if inside and p.endswith("forward")]
        assert ("pre_forward", "1") in recomputed and ("pre_forward", "1.a") in recomputed
        assert all(n.startswith("1") for _, n in recomputed)
        backward = [(p, n) for p, n, _ in events if p.endswith("backward")]
        for name in ["0", "1", "1.a", "1.b", "2"]:
            assert backward.count(("pre_backward", name)) == 1, name
            assert backward.count(("post_backward", name)) == 1, name
            assert backward.index(("pre_backward", name)) < backward.index(("post_backward", name))
        for child in ["1.a", "1.b"]:
            assert backward.index(("post_backward", child)) < backward.index(("post_backward", "1"))
        assert backward.index(("post_backward", "2")) < backward.index(("pre_backward", "1"))
        assert backward.index(("post_backward", "1")) < backward.index(("pre_backward", "0"))
        run(reference, x).sum().backward()
        assert_same_grads(model, reference)


# -- attach, detach, reset, active ------------------------------------------------


def test_attach_errors() -> None:
    hooks = ModuleHooks(Recorder().actions())
    model = nn.Linear(2, 2)
    hooks.attach(model)
    with pytest.raises(ValueError):
        hooks.attach(model)
    with pytest.raises(TypeError):
        hooks.attach(torch.zeros(2))  # type: ignore[arg-type]
    assert hooks.modules == [model]


def test_attach_with_own_actions() -> None:
    rec = Recorder()
    model = Parent()
    rec.name_all(model)
    hooks = ModuleHooks(rec.actions())
    hooks.attach(model)
    hooks.attach(model.a, rec.actions("own_"))
    model(torch.randn(1, 4)).sum().backward()
    hooks.finish_backward()
    assert rec.take() == [
        ("pre_forward", "root"),
        ("own_pre_forward", "a"),
        ("own_post_forward", "a"),
        ("post_forward", "root"),
        ("pre_backward", "root"),
        ("own_pre_backward", "a"),
        ("own_post_backward", "a"),
        ("post_backward", "root"),
    ]


def test_detach_removes_hooks() -> None:
    model = Parent()
    rec = Recorder(model)
    hooks = hook_all(model, rec)
    hooks.detach(model.a)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert hooks.finish_backward() == []
    assert all(name != "a" for _, name in rec.take())
    assert hooks.modules == [model, model.b]
    hooks.detach_all()
    assert hooks.modules == []
    y = model(x)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ != "_PreBackwardBackward"
    y.sum().backward()
    assert hooks.finish_backward() == [] and rec.take() == []
    hooks.attach(model.a)  # can be attached again after detach
    model(x)
    assert rec.take() == [("pre_forward", "a"), ("post_forward", "a")]


def test_active_stack_in_nested_forwards() -> None:
    snapshots: list[tuple[str, list[nn.Module]]] = []
    hooks: ModuleHooks

    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            snapshots.append(("child", list(hooks.active)))
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = Child(), Child()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            snapshots.append(("outer", list(hooks.active)))
            x = self.c1(x)
            snapshots.append(("between", list(hooks.active)))
            return self.c2(x)

    model = Outer()
    hooks = ModuleHooks(Recorder().actions())
    for m in [model, model.c1, model.c2]:
        hooks.attach(m)
    model(torch.randn(1, 2))
    assert snapshots == [
        ("outer", [model]),
        ("child", [model, model.c1]),
        ("between", [model]),
        ("child", [model, model.c2]),
    ]
    assert hooks.active == []


def test_reset_after_failed_forward() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    rec = Recorder(model)
    hooks = hook_all(model, rec)
    y = model[0](torch.randn(1, 2))
    y.sum().backward()  # leaves model[0] open (its input needs no grad)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(1, 2))
    assert hooks.active == [model, model[1]]
    assert hooks.open_modules() == [model[0]]
    rec.take()
    hooks.reset()
    assert hooks.active == [] and hooks.open_modules() == []
    assert hooks.finish_backward() == [] and rec.take() == []
    model[0](torch.randn(1, 2))
    assert hooks.active == []


def test_forwards_without_a_backward_do_not_pile_up_watched_outputs() -> None:
    model = nn.Linear(4, 4)
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    kept = [model(x) for _ in range(3)]  # outputs still alive stay watched
    for _ in range(3 * 4096):
        model(x)  # each output dies at once
    assert 3 <= hooks.watched_outputs <= 4096 + 1
    rec.take()
    sum(t.sum() for t in kept).backward()
    assert rec.take() == [("pre_backward", "m"), ("post_backward", "m")] * 3  # each kept call, by its own node
    assert hooks.finish_backward() == []


def test_a_module_given_a_container_of_one_tensor_gets_its_wrapper() -> None:
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = self.lin(inputs["x"])
            return out

    model = Takes()
    rec, hooks = hook_one(model)
    x = torch.randn(2, 4, requires_grad=True)
    model({"x": x}).sum().backward()
    assert x.grad is not None and rec.take()[2:] == [("pre_backward", "m"), ("post_backward", "m")]
