"""PyTorch's own runtimes: DDP (a full replica per rank) and FSDP2 (``fully_shard``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from z3kit_recipes.bench.runners import CompileSpec, OptimizerFn, adam
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.models import Workload

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# torch's stubs leave Tensor.backward untyped; bind it once with the type used here.
_backward: Callable[[torch.Tensor], None] = torch.Tensor.backward


class _TorchOptimizerStep:
    """Zero-grad, forward, loss, backward and optimizer step (``torch.optim.Adam``) of a wrapped model."""

    def __init__(self, wl: Workload, model: nn.Module, optimizer: OptimizerFn = adam) -> None:
        self.wl = wl
        self.model = model
        self.opt = optimizer(list(model.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.wl.loss(self.model(x), y)
        _backward(loss)
        self.opt.step()
        return loss.detach()

    def synchronize(self) -> None:
        """Nothing in flight: both runtimes wait for their collectives inside the step."""

    def engine_report(self) -> JSON | None:
        return None

    def engine_collectives(self) -> dict[str, int] | None:
        return None


class _FullReplica(_TorchOptimizerStep):
    """A runtime that keeps every parameter resident: nothing to probe, the whole model live."""

    total_params: int

    def start_probe(self) -> None:
        pass

    def stop_probe(self) -> None:
        pass

    def peak_live_params(self) -> int | None:
        return self.total_params


class PlainRunner(_FullReplica):
    """The model alone on one process, no runtime around it: the overhead bench's baseline."""

    peak_method = "the whole model: every parameter is resident"

    def __init__(self, wl: Workload, *, optimizer: OptimizerFn = adam) -> None:
        model = wl.build_model()
        self.total_params = sum(p.numel() for p in model.parameters())
        super().__init__(wl, model, optimizer)


class DDPRunner(_FullReplica):
    peak_method = "full replica: every parameter is resident on every rank"

    def __init__(
        self, wl: Workload, group: dist.ProcessGroup, *, compiled: CompileSpec | None = None,
        optimizer: OptimizerFn = adam,
    ) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = wl.build_model()
        self.total_params = sum(p.numel() for p in model.parameters())
        if compiled is not None:
            compiled.apply(wl, model)
        super().__init__(wl, DistributedDataParallel(model, process_group=group), optimizer)


class FSDP2Runner(_TorchOptimizerStep):
    """``fully_shard`` on each of the workload's blocks (or on each module ``shard_units(model)``
    lists, children before their parents), then on the root; ``units``: how many ``fully_shard`` calls.

    With ``reshard_after_forward=False`` a module's parameters stay gathered
    from its forward to its backward (ZeRO-2-like memory for parameters,
    no second all-gather in backward). ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (default: none,
    fp32 throughout). ``mesh``: FSDP2's device mesh (a 2-D
    ("replicate", "shard") one is HSDP); by default a 1-D mesh over ``group``.
    """

    peak_method = (
        "sampled after every unshard/wait_for_unshard of the model's FSDPParamGroups: "
        "elements of groups unsharded or with an all-gather in flight"
    )

    def __init__(
        self, wl: Workload, group: dist.ProcessGroup, *, reshard_after_forward: bool, compiled: CompileSpec | None = None,
        mesh: DeviceMesh | None = None, optimizer: OptimizerFn = adam,
        shard_units: Callable[[nn.Module], list[nn.Module]] | None = None, mp_policy: Any | None = None,
    ) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        model = wl.build_model()
        self.total_params = sum(p.numel() for p in model.parameters())
        if mesh is None:  # where the model lives: CPU under gloo, the rank's GPU under nccl (bench.gpu)
            mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
        units = shard_units(model) if shard_units is not None else wl.blocks(model)
        mp: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, **mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **mp)
        self.units = len(units) + 1
        if compiled is not None:  # after fully_shard, as FSDP2's documentation does it
            compiled.apply(wl, model)
        super().__init__(wl, model, optimizer)
        self._probe = _FSDP2LiveProbe(model)

    def start_probe(self) -> None:
        self._probe.start()

    def stop_probe(self) -> None:
        self._probe.stop()

    def peak_live_params(self) -> int | None:
        return self._probe.peak


class _FSDP2LiveProbe:
    """Peak unsharded elements, sampled whenever a param group unshards.

    Reads FSDP2 internals (``_get_fsdp_state``, ``_fsdp_param_group``,
    ``_all_gather_result``): FSDP2 has no public figure for this. They stay
    inside this class.
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        # (param group, its unsharded elements) for every FSDP module of the model.
        self._groups: list[tuple[Any, int]] = []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                pg = m._get_fsdp_state()._fsdp_param_group
                if pg is not None:
                    n = sum(fp.sharded_param.size().numel() for fp in pg.fsdp_params)
                    self._groups.append((pg, n))
        self.peak = 0

    def _sample(self) -> None:
        live = sum(n for pg, n in self._groups if pg.is_unsharded or pg._all_gather_result is not None)
        self.peak = max(self.peak, live)

    def _wrap(self, pg: Any, name: str) -> None:
        orig: Callable[..., Any] = getattr(pg, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self._sample()
            return out

        setattr(pg, name, wrapped)  # instance attribute shadows the class method

    def start(self) -> None:
        self.peak = 0
        self._sample()
        for pg, _ in self._groups:
            self._wrap(pg, "unshard")
            self._wrap(pg, "wait_for_unshard")

    def stop(self) -> None:
        for pg, _ in self._groups:
            for name in ("unshard", "wait_for_unshard"):
                if name in vars(pg):
                    delattr(pg, name)
