"""The conformance table: torch functions and user habits on a sharded model's parameters.

Each row is applied to the engine's model between uses (and some between
backward and step) and to a plain twin holding the same values; the test
(``tests/test_zero3_honest_params.py``) asserts that the engine's answer is
the twin's, or that it is refused with a z3kit error. The table in
``docs/your-code-and-the-model.md`` is generated from these rows:
``python -m tests.honest_params_table`` prints it.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

#: what a row is expected to give
SAME = "same as unsharded"
REFUSED = "refused (z3kit error)"
WRITES = "written into the shards, same as unsharded"


@attrs.frozen
class Row:
    habit: str
    expect: str
    #: applied to (model, probe input): returns the value compared (or writes, for WRITES rows)
    run: Callable[[nn.Module, torch.Tensor], Any]


def _w(m: nn.Module) -> torch.Tensor:
    return m.get_parameter("body.weight")


def _head(m: nn.Module) -> torch.Tensor:
    return m.get_parameter("head.weight")


def _params(m: nn.Module) -> list[torch.Tensor]:
    return list(m.parameters())


def _no_grad(fn: Callable[[nn.Module, torch.Tensor], Any]) -> Callable[[nn.Module, torch.Tensor], Any]:
    def run(m: nn.Module, x: torch.Tensor) -> Any:
        with torch.no_grad():
            return fn(m, x)
    return run


class _Fused(torch.autograd.Function):
    """A fused linear + log-softmax that takes the weight itself (the TRL / Liger pattern)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        return torch.log_softmax(h @ w.t(), dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h, w = ctx.saved_tensors
        logits = h @ w.t()
        p = torch.softmax(logits, dim=-1)
        dlogits = g - p * g.sum(-1, keepdim=True)
        return dlogits @ w, dlogits.t() @ h


#: read between uses: every value the same as the unsharded model's
READS = [
    Row("p.shape, p.dtype, p.device", SAME, lambda m, x: [(tuple(p.shape), p.dtype, p.device) for p in _params(m)]),
    Row("p.numel(), p.dim(), p.size(0), len(p)", SAME,
        lambda m, x: [(p.numel(), p.dim(), p.size(0), len(p)) for p in _params(m)]),
    Row("sum(p.numel() for p in model.parameters())", SAME, lambda m, x: sum(p.numel() for p in m.parameters())),
    Row("isinstance(p, nn.Parameter), p.requires_grad, p.is_leaf", SAME,
        lambda m, x: [(isinstance(p, nn.Parameter), p.requires_grad, p.is_leaf) for p in _params(m)]),
    Row("p.sum()", SAME, _no_grad(lambda m, x: [p.sum() for p in _params(m)])),
    Row("p.norm() (a per-parameter norm logger)", SAME, _no_grad(lambda m, x: [p.norm() for p in _params(m)])),
    Row("p.pow(2).sum() under autograd (an L2 penalty)", SAME, lambda m, x: sum(p.pow(2).sum() for p in _params(m))),
    Row("torch.linalg.vector_norm(p)", SAME, _no_grad(lambda m, x: torch.linalg.vector_norm(_w(m)))),
    Row("p.abs().max(), p.mean(), p.std()", SAME, _no_grad(lambda m, x: [_w(m).abs().max(), _w(m).mean(), _w(m).std()])),
    Row("parameters_to_vector(model.parameters())", SAME,
        _no_grad(lambda m, x: torch.nn.utils.parameters_to_vector(m.parameters()))),
    Row("torch.cat([p.flatten() for p in ...])", SAME, _no_grad(lambda m, x: torch.cat([p.flatten() for p in _params(m)]))),
    Row("F.linear(x, w, b) outside the module", SAME,
        lambda m, x: F.linear(x, _w(m), m.get_parameter("body.bias"))),
    Row("x @ w.t(), torch.matmul", SAME, lambda m, x: [x @ _w(m).t(), torch.matmul(x, _w(m).t())]),
    Row("torch.einsum('bi,oi->bo', x, w)", SAME, lambda m, x: torch.einsum("bi,oi->bo", x, _w(m))),
    Row("a custom autograd.Function taking the weight (fused linear loss)", SAME,
        lambda m, x: _Fused.apply(torch.tanh(x @ _w(m).t()), _head(m))),
    Row("p.t(), p.view(-1), p.reshape(...), p.flatten()", SAME,
        _no_grad(lambda m, x: [_w(m).t(), _w(m).view(-1), _w(m).reshape(-1, 1), _w(m).flatten()])),
    Row("p[0], p[:, 1] (indexing)", SAME, _no_grad(lambda m, x: [_w(m)[0], _w(m)[:, 1]])),
    Row("p.max(dim=0), p.argmax()", SAME, _no_grad(lambda m, x: [_w(m).max(dim=0).values, _w(m).argmax()])),
    Row("(p > 0).sum(), p.eq(0).any()", SAME, _no_grad(lambda m, x: [(_w(m) > 0).sum(), _w(m).eq(0).any()])),
    Row("torch.where(p > 0, p, 0).sum()", SAME, _no_grad(lambda m, x: torch.where(_w(m) > 0, _w(m), 0.0).sum())),
    Row("p.tolist()", SAME, _no_grad(lambda m, x: torch.tensor(_w(m).tolist()))),
    Row("p.cpu(), p.to('cpu', torch.float64)", SAME, _no_grad(lambda m, x: [_w(m).cpu(), _w(m).to("cpu", torch.float64)])),
    Row("p.clone() / p.detach().clone(), then a reduction", SAME,
        _no_grad(lambda m, x: [_w(m).clone().sum(), _w(m).detach().clone().norm()])),
    Row("p * 2 + 1, then its sum (elementwise on the shards)", SAME, _no_grad(lambda m, x: (_w(m) * 2 + 1).sum())),
    Row("p.data.norm(), p.data.sum()", SAME, _no_grad(lambda m, x: [_w(m).data.norm(), _w(m).data.sum()])),
    Row("p.half().float().sum(), p.double().sum()", SAME,
        _no_grad(lambda m, x: [_w(m).half().float().sum(), _w(m).double().sum()])),
    Row("torch.allclose(p, p.detach() * 1.0), torch.equal(p, p)", SAME,
        _no_grad(lambda m, x: [torch.tensor(torch.allclose(_w(m), _w(m).detach() * 1.0)),
                               torch.tensor(torch.equal(_w(m), _w(m)))])),
    Row("torch.stack([p, p]), torch.zeros_like(p).sum()", SAME,
        _no_grad(lambda m, x: [torch.stack([_w(m), _w(m)]), torch.zeros_like(_w(m)).sum()])),
    Row("copy.deepcopy(p), then its values", SAME, _no_grad(lambda m, x: copy.deepcopy(_w(m)).sum())),
    Row("p.float() of an fp32 parameter is p", SAME, lambda m, x: _w(m).float() is _w(m)),
    Row("model.float(), model.to('cpu') (nothing changes), then the parameters' values", SAME,
        lambda m, x: [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                      for p in m.to("cpu").float().parameters()]),
]

#: written between uses (under torch.no_grad, as an EMA or an init would): the model's values afterwards compared
WRITES_ROWS = [
    Row("p.mul_(0.5)", WRITES, _no_grad(lambda m, x: _w(m).mul_(0.5))),
    Row("p.add_(1.0), p.sub_(0.25)", WRITES, _no_grad(lambda m, x: _w(m).add_(1.0).sub_(0.25))),
    Row("p.copy_(values of the full shape)", WRITES,
        _no_grad(lambda m, x: _head(m).copy_(torch.arange(_head(m).numel(), dtype=torch.float32).view(_head(m).shape)))),
    Row("p.lerp_(target, 0.1) (an EMA step)", WRITES,
        _no_grad(lambda m, x: _w(m).lerp_(torch.ones(_w(m).shape), 0.1))),
    Row("torch._foreach_mul_(params, 0.9); torch._foreach_add_(params, 0.01)", WRITES,
        _no_grad(lambda m, x: (torch._foreach_mul_(_params(m), 0.9), torch._foreach_add_(_params(m), 0.01)))),
    Row("p.data.clamp_(-0.2, 0.2)", WRITES, _no_grad(lambda m, x: _w(m).data.clamp_(-0.2, 0.2))),
    Row("p.masked_fill_(p > 0.1, 0.0)", WRITES, _no_grad(lambda m, x: _w(m).masked_fill_(_w(m).detach() > 0.1, 0.0))),
    Row("p.zero_() of a bias", WRITES, _no_grad(lambda m, x: m.get_parameter("body.bias").zero_())),
]


def _save(t: Any) -> None:
    torch.save(t, io.BytesIO())


#: refused on a sharded parameter between uses, naming what to use
REFUSALS = [
    Row("pickle.dumps(p)", REFUSED, lambda m, x: pickle.dumps(_w(m))),
    Row("torch.save(p) / torch.save(p.detach())", REFUSED, lambda m, x: _save(_w(m).detach())),
    Row("p.untyped_storage()", REFUSED, lambda m, x: _w(m).untyped_storage()),
    Row("p.normal_() (a random re-init)", REFUSED, _no_grad(lambda m, x: _w(m).normal_())),
    Row("p.data = tensor", REFUSED, lambda m, x: setattr(_w(m), "data", torch.zeros(_w(m).shape))),
    Row("model.half(), model.to(torch.bfloat16) after initialize", REFUSED, lambda m, x: m.half()),
    Row("p.index_fill_(0, idx, 0.0) (in place, not elementwise)", REFUSED,
        _no_grad(lambda m, x: _w(m).index_fill_(0, torch.tensor([0]), 0.0))),
    Row("p.mul_(2) under autograd (in place on a leaf that requires grad, as torch refuses)", REFUSED,
        lambda m, x: _w(m).mul_(2)),
    Row("p[0] = 0.0 (item assignment)", REFUSED,
        _no_grad(lambda m, x: _w(m).__setitem__(0, 0.0))),
    Row("torch.add(a, b, out=p)", REFUSED, _no_grad(lambda m, x: torch.add(_w(m), 1.0, out=_w(m)))),
    Row("torch._foreach_mul_(params, 0.9) under autograd (as torch refuses)", REFUSED,
        lambda m, x: torch._foreach_mul_(_params(m), 0.9)),
    Row("torch._foreach_add_(params, [a tensor of another shape] * n) (in place, not elementwise)", REFUSED,
        _no_grad(lambda m, x: torch._foreach_add_(_params(m), [torch.ones(1, 1, 2)] * len(_params(m))))),
]

#: between a backward and the optimizer step: values read as above; gradients are the engine's partitions
AFTER_BACKWARD = [
    Row("after backward: p.sum(), p.norm()", SAME, _no_grad(lambda m, x: [[p.sum(), p.norm()] for p in _params(m)])),
    Row("after backward: p.grad is None", SAME, lambda m, x: [p.grad is None for p in _params(m)]),
    Row("after backward: p.grad.norm() (a gradient logger)", REFUSED, lambda m, x: [p.grad.norm() for p in _params(m)]),
    Row("after backward: clip_grad_norm_(model.parameters(), 1.0)", REFUSED,
        lambda m, x: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
]

ROWS = READS + WRITES_ROWS + REFUSALS + AFTER_BACKWARD


def markdown() -> str:
    """The docs' table."""
    lines = ["| your code, on a parameter between uses | what happens |", "| --- | --- |"]
    lines += [f"| `{r.habit}` | {r.expect} |" for r in ROWS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
