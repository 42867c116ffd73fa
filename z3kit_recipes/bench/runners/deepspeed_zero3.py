"""DeepSpeed ZeRO-3 (``deepspeed.initialize``) on the benchmark's gloo group.

The engine runs with ``DS_ACCELERATOR=cpu``, ZeRO stage 3 with the shared
``zero_optimization`` section, and DeepSpeed's ``Adam`` type with
``torch_adam`` and ``adam_w_mode`` off, which is ``torch.optim.Adam``, and
``gradient_clipping`` 0 (DeepSpeed's own default clips to norm 1.0, which
the other runtimes do not do).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from z3kit_recipes.bench.runners import CompileSpec, engine_step
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON, LR
from z3kit_recipes.models import Workload


def skip_cpu_shm_comm_build() -> None:
    """Keep ``deepspeed.init_distributed`` from compiling its CPU shared-memory all-reduce.

    Note: on the CPU accelerator, DeepSpeed's ``TorchBackend`` JIT-compiles the
    ``deepspeed_shm_comm`` extension at every ``init_distributed`` whose torch
    extension cache has no build for this exact environment (a fresh venv, or
    another venv sharing ``~/.cache/torch_extensions``): 35-50 s on 2 cores.
    Only ``inference_all_reduce`` uses that op; training's collectives go
    through the process group (gloo here) either way. Marking the op not
    compatible, as DeepSpeed does itself off Linux, skips the build and changes
    nothing that a training step runs. ``deepspeed.ops`` keeps the probed dict
    in the module on purpose, so the edit holds for the process.
    """
    ops: Any = importlib.import_module("deepspeed.ops")
    ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(batch_size: int, world: int, zero: JSON | None = None, *, foreach: bool | None = None) -> JSON:
    """The DeepSpeed config used: the shared ZeRO-3 knobs, fp32, torch.optim.Adam (``foreach=True``:
    its multi-tensor implementation, which DeepSpeed passes on with ``torch_adam``)."""
    params: JSON = {"lr": LR, "torch_adam": True, "adam_w_mode": False}
    if foreach is not None:
        params["foreach"] = foreach
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch_size * world,
        "zero_optimization": dict(zero if zero is not None else DEFAULT_ZERO_CONFIG),
        # DeepSpeed (0.19.8 here) clips to norm 1.0 by default; the other runtimes do not clip.
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            # torch_adam: torch.optim.Adam itself; adam_w_mode off: Adam, not AdamW.
            "params": params,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedRunner:
    peak_method = (
        "sampled after every PartitionedParameterCoordinator.fetch_sub_module: ds_numel of "
        "parameters AVAILABLE or INFLIGHT (persistent small parameters included)"
    )

    def __init__(
        self, wl: Workload, world: int, zero: JSON, *, compiled: CompileSpec | None = None, foreach: bool | None = None,
    ) -> None:
        ds: Any = importlib.import_module("deepspeed")
        ds.utils.logger.setLevel(logging.WARNING)
        skip_cpu_shm_comm_build()
        ds.init_distributed(dist_backend="gloo", verbose=False)
        self.wl = wl
        model = wl.build_model()
        params = list(model.parameters())
        self.total_params = sum(p.numel() for p in params)
        if getattr(getattr(model, "config", None), "tie_mode", None) == "functional":
            # The root uses tok_emb.weight outside tok_emb: DeepSpeed needs to be told.
            ds.zero.register_external_parameter(model, getattr(model, "tok_emb").weight)
        if compiled is not None:  # the model's own blocks, compiled in place before DeepSpeed wraps it
            compiled.apply(wl, model)
        engine, _, _, _ = ds.initialize(
            model=model, model_parameters=params, config=deepspeed_config(wl.batch_size, world, zero, foreach=foreach)
        )
        self.engine = engine
        self._probe = _DeepSpeedLiveProbe(params)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return engine_step(self.engine, self.wl, x, y)

    def synchronize(self) -> None:
        """Nothing to call: DeepSpeed has no public way to wait for its communication."""

    def start_probe(self) -> None:
        self._probe.start()

    def stop_probe(self) -> None:
        self._probe.stop()

    def peak_live_params(self) -> int | None:
        return self._probe.peak

    def engine_report(self) -> JSON | None:
        return None

    def engine_collectives(self) -> dict[str, int] | None:
        return None


class _DeepSpeedLiveProbe:
    """Peak gathered elements, sampled after every ``fetch_sub_module``.

    Patches the class ``PartitionedParameterCoordinator`` while probing and
    reads the ``ds_status`` / ``ds_numel`` DeepSpeed attaches to each
    parameter: DeepSpeed has no public figure for this. Both stay inside
    this class.
    """

    def __init__(self, params: list[Any]) -> None:
        ppc: Any = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
        pp: Any = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
        self._params = params
        self._coord_cls = ppc.PartitionedParameterCoordinator
        self._live_states = (pp.ZeroParamStatus.AVAILABLE, pp.ZeroParamStatus.INFLIGHT)
        self._orig_fetch: Callable[..., Any] | None = None
        self.peak = 0

    def _sample(self) -> None:
        live = sum(int(p.ds_numel) for p in self._params if p.ds_status in self._live_states)
        self.peak = max(self.peak, live)

    def start(self) -> None:
        self.peak = 0
        self._sample()
        orig: Callable[..., Any] = self._coord_cls.fetch_sub_module
        self._orig_fetch = orig
        probe = self

        def fetch_sub_module(coord: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(coord, *args, **kwargs)
            probe._sample()
            return out

        self._coord_cls.fetch_sub_module = fetch_sub_module

    def stop(self) -> None:
        if self._orig_fetch is not None:
            self._coord_cls.fetch_sub_module = self._orig_fetch
            self._orig_fetch = None
