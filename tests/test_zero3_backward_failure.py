"""A backward that raises on one rank is named, as that, on every rank.

The other ranks wait in a collective of the backward that the failed rank
left. Whether the backward ran through ``engine.backward`` (which catches
the exception and posts it) or a plain ``loss.backward()`` (where no
engine call is around it: the engine learns of it at its next call), each
rank's message must say that rank 1's backward raised, with the
exception, and not that rank 1 left the recorded trace (whose advice, to
mark a leaf module, is wrong here).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import fresh_group
from tests.zero3_models import MLP, vec_batch


class _Breaks(torch.autograd.Function):
    """Identity; its backward raises (a user's custom op that fails in backward on one rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected backward failure")


class Breaking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = MLP(), MLP(width=7, depth=1)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = _Breaks.apply(h) if self.broken else h
        return self.second(F.pad(h, (0, 2)))


def run_backward_raises(ctx: Any, how: str) -> dict[str, Any]:
    from z3kit_recipes import zero3

    group = fresh_group(ctx)
    torch.manual_seed(1)
    model = Breaking()
    config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=20.0)
    engine = zero3.initialize(model, torch.optim.Adam, config, group)
    out: dict[str, Any] = {"caught": [], "setup": ""}
    for step in range(3):
        b = vec_batch(ctx.rank, step, 0, 0)
        model.broken = ctx.rank == 1 and step == 1
        try:
            loss = F.mse_loss(engine(b["x"]), b["y"])
            if how == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
        except Exception as e:  # noqa: BLE001 - what each rank sees is the result
            out["caught"].append(f"step {step}: {type(e).__name__}: {e}")
    return out


@pytest.mark.parametrize("how", ["engine", "plain"])
def test_a_backward_that_raised_is_named_on_every_rank(pools: Any, how: str) -> None:
    waiting, failed = pools.run(2, run_backward_raises, how, timeout=120)
    assert failed["caught"][0].startswith("step 1: RuntimeError: injected backward failure"), failed
    first = waiting["caught"][0]
    assert first.startswith("step 1: RankFailed"), waiting
    if how == "engine":  # the exception, as engine.backward caught it
        named = "rank 1 backward raised RuntimeError: injected backward failure"
    else:  # rank 1 learns at its next call that its backward never ended, and says so
        named = "rank 1 backward raised BackwardLost: loss.backward() did not reach its end on this rank: it raised"
    assert named in first, waiting
    assert "left the recorded step" not in first and "leaf module" not in first, waiting
    # from then on, every call refuses on every rank, naming the same failure
    for r in (waiting, failed):
        for later in r["caught"][1:]:
            assert "RankFailed" in later and named in later, r
