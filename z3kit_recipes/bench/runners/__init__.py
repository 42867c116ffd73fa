"""Runtimes under test, each wrapped as a ``Runner``: one model trained by
one runtime on one rank, built inside a spawned rank.

``build_runner`` picks the runner for a ``RunSpec``; ``available_runtimes``
says, in the parent, which runtimes can run here and why not.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import nn

from z3kit_recipes.bench.spec import JSON, LR, RuntimeName, RunSpec
from z3kit_recipes.models import Workload


@attrs.frozen
class CompileSpec:
    """What ``--compile`` compiles, the same for every runtime: each of the
    workload's blocks (``block.compile()``, in place) or the whole model
    (``model.compile()``), with one backend."""

    scope: str
    backend: str

    @classmethod
    def of(cls, spec: RunSpec) -> CompileSpec | None:
        return cls(spec.compile, spec.compile_backend) if spec.compile else None

    def apply(self, wl: Workload, model: nn.Module) -> None:
        if self.scope == "block":
            for block in wl.blocks(model):
                block.compile(backend=self.backend)
        elif self.scope == "model":
            model.compile(backend=self.backend)
        else:
            raise ValueError(f"unknown compile scope {self.scope!r}; expected 'block' or 'model'")


class Runner(Protocol):
    """One runtime wrapped around one model, on one rank."""

    #: elements of the model's parameters (counted before sharding)
    total_params: int
    #: how ``peak_live_params`` is obtained (shown in the JSON)
    peak_method: str

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the detached loss."""
        ...

    def synchronize(self) -> None:
        """Wait for communication this rank still has in flight (before a profiler stops)."""
        ...

    def start_probe(self) -> None:
        """Begin tracking live gathered parameters (untimed steps only)."""
        ...

    def stop_probe(self) -> None: ...

    def peak_live_params(self) -> int | None:
        """Peak gathered parameter elements seen while probing, if measurable."""
        ...

    def engine_report(self) -> JSON | None:
        """The runtime's own figures of its last step, if it has any."""
        ...

    def engine_collectives(self) -> dict[str, int] | None:
        """Collective calls per kind in the last step, by the runtime's own count."""
        ...


#: an optimizer from its parameters (any runtime's: a list, or z3kit's master shards)
OptimizerFn = Callable[[Any], torch.optim.Optimizer]


def adam(params: Any) -> torch.optim.Optimizer:
    """The optimizer of every run: ``torch.optim.Adam`` at the bench's learning rate."""
    return torch.optim.Adam(params, lr=LR)


def foreach_adam(params: Any) -> torch.optim.Optimizer:
    """``adam`` with the multi-tensor (``foreach``) implementation, torch's default on CUDA: the
    overhead bench steps every runtime with it, so that the optimizer costs the same per tensor
    on CPU as where users train."""
    return torch.optim.Adam(params, lr=LR, foreach=True)


def fused_adam(params: Any) -> torch.optim.Optimizer:
    """``adam`` with torch's fused kernel, which has a CPU version: an offloaded optimizer's step
    runs on the host, where the default Adam loops over the tensors one by one."""
    return torch.optim.Adam(params, lr=LR, fused=True)


def engine_step(engine: Any, wl: Workload, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step of a DeepSpeed-style engine (DeepSpeed's and z3kit's share the interface)."""
    loss = wl.loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def build_runner(spec: RunSpec, wl: Workload, group: dist.ProcessGroup) -> Runner:
    """The runner of ``spec.runtime``; builds the model and wraps it."""
    compiled = CompileSpec.of(spec)
    if spec.runtime == "ddp":
        from z3kit_recipes.bench.runners.torch_native import DDPRunner

        return DDPRunner(wl, group, compiled=compiled)
    if spec.runtime in ("fsdp2", "fsdp2-noreshard"):
        from z3kit_recipes.bench.runners.torch_native import FSDP2Runner

        return FSDP2Runner(wl, group, reshard_after_forward=spec.runtime == "fsdp2", compiled=compiled)
    if spec.runtime == "deepspeed":
        from z3kit_recipes.bench.runners.deepspeed_zero3 import DeepSpeedRunner

        return DeepSpeedRunner(wl, spec.world, spec.zero, compiled=compiled)
    if spec.runtime == "fsdp_blocks":
        from z3kit_recipes.bench.runners.fsdp_blocks import FsdpBlocksRunner

        return FsdpBlocksRunner(wl, group, compiled=compiled)
    from z3kit_recipes.bench.runners.z3kit_zero3 import Z3kitRunner, budget_config, muon_and_adam, shared_config

    config = budget_config(spec.zero, spec.budget) if spec.runtime == "z3kit-budget" else shared_config(spec.zero)
    if spec.runtime == "z3kit-divergent":
        config = attrs.evolve(config, divergent_graphs=True)
    if spec.runtime == "z3kit-muon":
        return Z3kitRunner(wl, group, config, compiled=compiled, optimizer=muon_and_adam)
    return Z3kitRunner(wl, group, config, compiled=compiled)


#: modules a runtime imports lazily, imported by a rank before its memory baseline
RUNTIME_MODULES: dict[RuntimeName, tuple[str, ...]] = {
    "ddp": ("torch.nn.parallel",),
    "fsdp2": ("torch.distributed.fsdp", "torch.distributed.device_mesh"),
    "fsdp2-noreshard": ("torch.distributed.fsdp", "torch.distributed.device_mesh"),
    "deepspeed": (
        "deepspeed",
        "deepspeed.runtime.zero.partitioned_param_coordinator",
        "deepspeed.runtime.zero.partition_parameters",
    ),
    "z3kit": ("z3kit_recipes.zero3",),
    "z3kit-budget": ("z3kit_recipes.zero3",),
    "z3kit-divergent": ("z3kit_recipes.zero3",),
    "z3kit-muon": ("z3kit_recipes.zero3", "z3kit.sharded_muon"),
    "fsdp_blocks": ("z3kit_recipes.fsdp_blocks",),
}


def _import_optional(name: str) -> tuple[Any | None, str]:
    """``(module, "")`` or ``(None, reason)`` without letting the error escape."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(exc).__name__}: {exc}"


def unavailable_reason(runtime: RuntimeName) -> str:
    """"" when ``runtime`` can run here, else the reason it cannot.

    Run in the parent process. DeepSpeed is imported here (with
    ``DS_ACCELERATOR=cpu`` unless set) so that a broken install is skipped
    with its error rather than failing inside the ranks.
    """
    if runtime in ("fsdp2", "fsdp2-noreshard"):
        fsdp, why = _import_optional("torch.distributed.fsdp")
        if fsdp is None or not hasattr(fsdp, "fully_shard"):
            return f"torch.distributed.fsdp.fully_shard unavailable ({why or 'no fully_shard'})"
    elif runtime == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _, why = _import_optional("deepspeed")
        if why:
            return f"deepspeed not importable ({why})"
    elif runtime in ("z3kit", "z3kit-budget", "z3kit-divergent", "z3kit-muon"):
        _, why = _import_optional("z3kit_recipes.zero3")
        if why:
            return f"z3kit_recipes.zero3 not importable ({why})"
    elif runtime == "fsdp_blocks":
        _, why = _import_optional("z3kit_recipes.fsdp_blocks")
        if why:
            return f"z3kit_recipes.fsdp_blocks not importable ({why})"
    return ""
