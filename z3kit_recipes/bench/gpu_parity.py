"""Parity section of ``bench.gpu``: the stock engine against plain training.

For each model and compute dtype, one rank trains two copies of the same
model for ``parity_steps`` steps side by side on the same batches:

- the engine: ``zero3.initialize`` with the bench's shared settings
  (``RankContext.config``), ``torch.optim.Adam``;
- the reference (``PlainTraining``): plain PyTorch on the same device, a
  deep copy of the model taken before ``initialize``, no sharding and no
  communication. At world N it runs every rank's batch of the step and
  averages their gradients, which is what the engine's reduction computes.
  In bf16 it is set up the way the engine is: parameters and floating-point
  buffers in bf16 for compute (floating inputs cast too), the ranks'
  gradients summed in bf16 (the engine reduces in the compute dtype), fp32
  master copies that Adam updates, copied back into the bf16 parameters
  after each step.

Reported: each step's relative loss difference (this rank's batch), and
after the last step the largest difference of any parameter (the engine's
fp32 masters, ``full_state_dict``, against the reference's) and the norm of
all differences relative to the norm of the update the reference made
(``||engine - ref|| / ||ref - initial||``): a run that diverged, or an
engine that did not step, is near 1 there whatever the learning rate.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Final

import attrs
import torch
from torch import nn

from z3kit_recipes.bench.gpu_rank import RankContext, Section, each_case
from z3kit_recipes.bench.runners import adam
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.models import Workload
from z3kit_recipes.zero3 import initialize

# torch's stubs leave Tensor.backward untyped; bind it once with the type used here.
_backward: Callable[[torch.Tensor], None] = torch.Tensor.backward


@attrs.frozen
class Tolerance:
    #: largest relative loss difference at any step
    loss_rel: float
    #: largest ``||engine - ref|| / ||ref - initial||`` over all parameters after the last step
    param_rel: float


#: fp32: both sides compute the same thing, only kernels that are not bitwise
#: deterministic on a GPU (attention backward) may differ; bf16: the same bf16
#: computation, but one rounding to bf16 of a slightly different value shifts
#: every later step a little.
TOLERANCES: Final[dict[str, Tolerance]] = {
    "fp32": Tolerance(loss_rel=1e-4, param_rel=1e-3),
    "bf16": Tolerance(loss_rel=1e-2, param_rel=5e-2),
}

REFERENCE: Final = (
    "plain PyTorch on the same device: a deep copy of the model, the same batches (at world N each rank's "
    "reference trains on all N ranks' batches and averages their gradients), torch.optim.Adam, no sharding; "
    "bf16: bf16 parameters and buffers for compute, gradients summed over the batches in bf16, fp32 master "
    "copies updated by Adam and copied back (as Zero3Config(compute_dtype='bf16') does)"
)


class PlainTraining:
    """The reference run (see the module docstring)."""

    def __init__(self, model: nn.Module, wl: Workload, dtype: torch.dtype) -> None:
        self.model, self.wl, self.dtype = model, wl, dtype
        self.names = [name for name, _ in model.named_parameters()]
        # masters from the fp32 values, before the cast: the engine's masters are the fp32 parameters
        self.masters = [p.detach().clone() if dtype != torch.float32 else p for _, p in model.named_parameters()]
        model.to(dtype)
        self.params = [p for _, p in model.named_parameters()]
        self.opt = adam(self.masters)

    @property
    def separate_masters(self) -> bool:
        return self.dtype != torch.float32

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One optimizer step over ``batches`` (gradients averaged); each batch's loss."""
        losses = []
        for x, y in batches:
            loss = self.wl.loss(self.model(self._cast(x)), y)
            _backward(loss / len(batches))
            losses.append(loss.detach())
        if self.separate_masters:
            # the ranks' gradients were summed in bf16 (autograd accumulates in the
            # parameter's dtype), as the engine reduces them in the compute dtype
            for master, p in zip(self.masters, self.params, strict=True):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.separate_masters:
            with torch.no_grad():
                for master, p in zip(self.masters, self.params, strict=True):
                    p.copy_(master)
        return losses

    def values(self) -> dict[str, torch.Tensor]:
        """The fp32 (master) value of every parameter, by name, on CPU."""
        return {n: m.detach().float().to("cpu", copy=True) for n, m in zip(self.names, self.masters, strict=True)}


def _finite_or_inf(x: float) -> float:
    """``x``, or inf where it is NaN (which every comparison would let through)."""
    return x if math.isfinite(x) else math.inf


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def parity_case(ctx: RankContext, wl: Workload, dtype: str) -> JSON:
    config = ctx.config(dtype)
    model = wl.build_model()
    reference = PlainTraining(copy.deepcopy(model), wl, config.torch_dtype)
    initial = reference.values()
    engine = initialize(model, adam, config, ctx.group)
    losses: list[tuple[float, float]] = []
    for step in range(ctx.sizes.parity_steps):
        x, y = wl.batch(ctx.rank, step)
        loss = wl.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref = reference.step([wl.batch(r, step) for r in range(ctx.world)])
        losses.append((float(loss.detach()), float(ref[ctx.rank])))
    full = engine.full_state_dict()
    final = reference.values()
    missing = sorted(set(final) - set(full))
    if missing:
        raise KeyError(f"engine.full_state_dict() lacks parameters {missing[:5]}")
    diff_sq = update_sq = max_abs = 0.0
    for name, ref_value in final.items():
        delta = full[name].float().reshape(ref_value.shape) - ref_value
        diff_sq += float(delta.pow(2).sum())
        update_sq += float((ref_value - initial[name]).pow(2).sum())
        max_abs = max(max_abs, _finite_or_inf(float(delta.abs().max())))
    return {
        "steps": len(losses),
        "losses": {"z3kit": [a for a, _ in losses], "reference": [b for _, b in losses]},
        "loss_rel_diff": [_rel(a, b) for a, b in losses],
        "max_param_abs_diff": max_abs,
        "param_diff_rel_to_update": _finite_or_inf(math.sqrt(diff_sq) / max(math.sqrt(update_sq), 1e-30)),
        "update_norm": math.sqrt(update_sq),
    }


def merge(per_rank: list[JSON]) -> JSON:
    """Worst over ranks: each step's loss difference; the parameters are the same full values on every rank."""
    first = per_rank[0]
    steps = first["steps"]
    loss_rel = [max(r["loss_rel_diff"][i] for r in per_rank) for i in range(steps)]
    return {
        "steps": steps,
        "loss_rel_diff": loss_rel,
        "max_loss_rel_diff": max(loss_rel, default=0.0),
        "max_param_abs_diff": max(r["max_param_abs_diff"] for r in per_rank),
        "param_diff_rel_to_update": max(r["param_diff_rel_to_update"] for r in per_rank),
        "update_norm": first["update_norm"],
        "losses_rank0": first["losses"],
    }


def summarize(cases: JSON, ctx: RankContext) -> JSON:
    """Pass or fail per case against ``TOLERANCES`` (a case that raised fails)."""
    for name, case in cases.items():
        tol = TOLERANCES[name.rsplit("/", 1)[1]]
        case["tolerance"] = attrs.asdict(tol)
        case["passed"] = case["status"] == "ok" and (
            case["max_loss_rel_diff"] <= tol.loss_rel and case["param_diff_rel_to_update"] <= tol.param_rel
        )
    return {"passed": all(c["passed"] for c in cases.values()), "reference": REFERENCE,
            "steps": ctx.sizes.parity_steps}


PARITY: Final = Section("parity", lambda ctx: each_case(ctx, parity_case), merge, summarize)

__all__ = ["PARITY", "REFERENCE", "TOLERANCES", "PlainTraining", "Tolerance"]
