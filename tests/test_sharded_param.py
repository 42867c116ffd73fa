"""``z3kit.sharded_param`` alone: no process group, a runtime double that knows the whole value.

Rank 1 of 3 holds its slice of a 5x7 matrix (35 elements: 12 a rank, one of
padding on the last); the double's ``full_values`` answers with the whole
matrix as a gather would, and counts the gathers, so each rule shows what
it communicates: elementwise functions none, whole-value functions one.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from z3kit.partition import partition_of
from z3kit.sharded_param import ShardedParam, ShardedTensor, ShardedValueError, ShardSpec, take_accumulated_grad, write_shard

FULL = torch.arange(35, dtype=torch.float32).view(5, 7) / 10


class Owner:
    """The runtime double: the whole value is ``FULL`` with this rank's shard spliced in."""

    def __init__(self) -> None:
        self.gathers = 0
        self.writes = 0

    def full_values(self, t: ShardedTensor) -> torch.Tensor:
        self.gathers += 1
        whole = FULL.clone().reshape(-1)
        n = t.spec.shard_numel
        start = t.spec.rank * n
        stop = min(start + n, t.spec.numel)
        whole[start:stop] = t.local[: stop - start]
        return whole.view(t.spec.shape)

    def in_forward(self, t: ShardedTensor) -> torch.Tensor | None:
        return None

    def write(self, t: ShardedTensor, apply: Callable[[torch.Tensor], None]) -> None:
        self.writes += 1
        write_shard(t, apply, None)

    def parameter(self, t: ShardedTensor) -> nn.Parameter | None:
        return None

    def master(self, t: ShardedTensor) -> torch.Tensor | None:
        return None


def _param(owner: Owner) -> ShardedParam:
    spec = ShardSpec(FULL.shape, rank=1, world=3)
    return ShardedParam(spec, partition_of(FULL.reshape(-1), 1, 3), owner, requires_grad=True)


def test_the_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        ShardSpec(torch.Size([5, 7]), rank=3, world=3)
    with pytest.raises(ValueError, match="has 12 elements"):
        ShardedParam(ShardSpec(torch.Size([5, 7]), rank=0, world=3), torch.zeros(11), Owner())


def test_metadata_is_logical_and_needs_no_gather() -> None:
    owner = Owner()
    p = _param(owner)
    assert isinstance(p, nn.Parameter) and p.shape == (5, 7) and p.numel() == 35 and p.dim() == 2
    assert p.requires_grad and p.is_leaf and p.dtype == torch.float32 and p.stride() == (7, 1)
    assert "shard 1 of 3" in repr(p) and owner.gathers == 0


def test_elementwise_runs_on_the_shard_without_a_gather() -> None:
    owner = Owner()
    p = _param(owner)
    with torch.no_grad():
        p.mul_(2).add_(torch.ones(5, 7))  # a full-shape operand: this rank's slice of it
        doubled = p * 3  # out of place: a sharded result
        torch._foreach_lerp_([p], [torch.zeros(5, 7)], 0.5)
    assert owner.gathers == 0 and owner.writes == 3
    assert isinstance(doubled, ShardedTensor) and not isinstance(doubled, nn.Parameter)
    want = (FULL * 2 + 1) * 0.5
    torch.testing.assert_close(p.local, partition_of(want.reshape(-1), 1, 3))
    torch.testing.assert_close(doubled.local, partition_of(((FULL * 2 + 1) * 3).reshape(-1), 1, 3))


def test_whole_value_functions_gather_and_send_the_gradient_to_the_shard() -> None:
    owner = Owner()
    p = _param(owner)
    x = torch.randn(2, 7)
    out = torch.nn.functional.linear(x, p)
    assert owner.gathers == 1
    torch.testing.assert_close(out, x @ FULL.t())
    out.pow(2).sum().backward()
    grad = take_accumulated_grad(p)
    assert grad is not None and grad.shape == (5, 7)
    torch.testing.assert_close(grad, (2 * out).t() @ x)
    assert take_accumulated_grad(p) is None  # taken out


def test_what_cannot_be_right_is_refused() -> None:
    owner = Owner()
    p = _param(owner)
    for refused in (lambda: pickle.dumps(p), lambda: p.untyped_storage(), lambda: setattr(p, "data", FULL)):
        with pytest.raises(ShardedValueError, match="gathered_parameters"):
            refused()
    with torch.no_grad(), pytest.raises(ShardedValueError, match="modifier_rank"):
        p.normal_()
    with torch.no_grad(), pytest.raises(ShardedValueError, match="not elementwise"):
        p.index_fill_(0, torch.tensor([0]), 0.0)
    with pytest.raises(RuntimeError, match="in-place"):
        p.mul_(2)  # a leaf that requires grad, under autograd: refused as torch refuses it
    assert owner.gathers == 0


def test_deepcopy_is_an_independent_shard() -> None:
    owner = Owner()
    p = _param(owner)
    q = copy.deepcopy(p)
    assert isinstance(q, ShardedParam) and q.requires_grad and q.local.data_ptr() != p.local.data_ptr()
    with torch.no_grad():
        q.zero_()
    assert p.local.abs().sum() > 0 and q.local.abs().sum() == 0
