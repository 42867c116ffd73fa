"""fp16 loss scaling: the scale, the overflow check, and the skipped step.

``engine.backward(loss)`` backs ``loss * scale`` instead of ``loss``, so the
fp16 gradients keep small values representable; the reducer's partitions
then hold ``scale`` times the averaged gradient (accumulated in fp32).

Note: one collective and one host read per optimizer step.
    At the step, each rank's sum of squares of its reduced gradient
    partitions is all-reduced (the collective gradient clipping issues
    anyway; under fp16 it is issued with or without clipping). An inf or
    nan anywhere, on any rank's partition (a rank whose own gradients
    overflowed hands its inf or nan to the reduction), makes that global sum
    non-finite on every rank, so every rank reaches the same verdict from
    the same value: the ranks agree without a collective of their own. The
    verdict is read on the host once per optimizer step
    (``LossScaler.host_reads``): the optimizer and the learning-rate
    schedule are Python calls that must be skipped or run. That read is
    the only host sync fp16 adds to a step; fp32 and bf16 runs have none.

Note: what an overflow does.
    The optimizer step, the write-back to the fp16 shards and the
    learning-rate schedule's step are skipped on every rank and the
    window's gradients dropped; the step still counts (``global_step``, as
    DeepSpeed's ``global_steps`` does) and ``skipped`` counts it. The scale
    follows DeepSpeed's ``DynamicLossScaler`` (consecutive_hysteresis off):
    an overflow uses up one of ``hysteresis`` allowances, and the last one
    halves the scale (at least ``min_loss_scale``; an overflow at that
    floor raises, as DeepSpeed does); a step whose distance from the last
    overflow, less one, is a positive multiple of ``loss_scale_window``
    doubles it and restores the allowances. A static scale never changes,
    and an overflow with it still skips the step.
"""

from __future__ import annotations

from typing import Any

import torch

from z3kit.grad_partition import clip_coefficient
from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig
from z3kit_recipes.zero3.training.grads import GradReducer

_STATE_KEYS = ("scale", "iteration", "last_overflow", "hysteresis_left", "skipped")


class LossScaleAtMinimum(RuntimeError):
    """An overflow with the scale at ``min_loss_scale`` (DeepSpeed raises here too)."""


class LossScaler:
    """The loss scale of an fp16 engine, and what it does at each optimizer step."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = config.initial_scale
        #: optimizer steps taken or skipped so far (DeepSpeed's ``cur_iter``)
        self.iteration = 0
        self.last_overflow = -1
        self.hysteresis_left = config.hysteresis
        #: optimizer steps skipped for an overflow
        self.skipped = 0
        #: whether the last optimizer step was skipped
        self.last_skipped = False
        #: host reads of the overflow verdict (one per optimizer step)
        self.host_reads = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, reducer: GradReducer, clip: float) -> tuple[bool, torch.Tensor, float | torch.Tensor]:
        """Whether the window's gradients are finite on every rank (collective,
        see the Note), the unscaled global norm, and the factor finite
        gradients were multiplied by in place (unscaled, and clipped by that
        norm where ``clip > 0``)."""
        # the shard group's partitions are the whole gradient: HSDP's replicas hold the same ones, an
        # inf or nan of any rank included (it was all-reduced into every replica's partition)
        norm = reducer.global_norm() / self.scale
        self.host_reads += 1
        finite = bool(torch.isfinite(norm))
        factor: float | torch.Tensor = 1.0 / self.scale
        if finite:
            factor = factor * clip_coefficient(norm, clip) if clip > 0 else factor
            reducer.window.scale_(factor)
        return finite, norm, factor

    def update(self, overflow: bool) -> None:
        """Count the step and move the scale (see the Note on overflows);
        raises ``LossScaleAtMinimum``, changing nothing, where DeepSpeed would."""
        c = self.config
        if overflow and c.dynamic and (c.hysteresis == 1 or self.hysteresis_left == 1) and self.scale == c.min_loss_scale:
            raise LossScaleAtMinimum(
                f"the gradients overflowed with the loss scale already at min_loss_scale ({c.min_loss_scale}): the "
                "step was not taken and the scale cannot drop further. Lower min_loss_scale, check the model and "
                "data for infs and nans, or train in bf16 or fp32")
        self.last_skipped = overflow
        if overflow:
            self.skipped += 1
            if c.dynamic:
                if c.hysteresis == 1 or self.hysteresis_left == 1:
                    self.scale = max(self.scale / 2.0, c.min_loss_scale)
                else:
                    self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        elif c.dynamic:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % c.loss_scale_window == 0:
                self.hysteresis_left = c.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"the saved loss-scale state lacks {missing}; it was not written by this z3kit")
        for key in _STATE_KEYS:
            setattr(self, key, state[key])
        self.last_skipped = False
