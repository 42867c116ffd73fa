"""DeepSpeed's own entry points, answered by z3kit: a DeepSpeed script changes its import line only.

    import deepspeed                                 # before
    from z3kit_recipes.zero3 import deepspeed        # after: nothing else changes

    deepspeed.init_distributed()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config)

``initialize`` takes ``deepspeed.initialize``'s arguments and returns its
4-tuple, ``(engine, engine.optimizer, None, engine.lr_scheduler)``: the
engine is ``zero3.initialize``'s (``Zero3Engine``, with DeepSpeed's engine
surface, ``zero3.deepspeed_surface``), the optimizer and the scheduler the
config's sections built on the shards. What z3kit cannot take is refused
by name, with what to write instead (``zero3.deepspeed_call``): a training
data set (z3kit makes no data loader), an ``lr_scheduler`` argument, an
``mpu``. ``model_parameters`` must be what DeepSpeed trains under ZeRO-3,
the model's trainable parameters (``model.parameters()``, or those with
``requires_grad``): z3kit trains exactly those; parameter groups are
refused with the factory that keeps them.

``init_distributed`` makes the default process group as DeepSpeed's does
from a launcher's environment (torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` picks the device): the
accelerator's backend (nccl, hccl, xccl) or gloo on the CPU. It does
nothing where a group exists. Without that environment it refuses, naming
the launcher: DeepSpeed's MPI discovery is not done. ``initialize`` calls
it first, as DeepSpeed's does (``dist_init_required``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

from z3kit.device import accelerator_type, backend_for, use_device
from z3kit_recipes.zero3.deepspeed_call import check_deepspeed_arguments, per_group_factory_hint, settings_of
from z3kit_recipes.zero3.engine import Zero3Engine
from z3kit_recipes.zero3.initialize import initialize as zero3_initialize

#: torchrun's variables that ``init_distributed`` makes the group from
LAUNCHER_ENV: Final = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(
    dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
    verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
    dist_init_required: bool | None = None, config: Any = None, rank: int = -1, world_size: int = -1,
) -> None:
    """The default process group, made from the launcher's environment unless one exists
    (see the module docstring). ``dist_init_required=False`` only checks that one exists."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False, and torch.distributed is not initialized: call "
                           "deepspeed.init_distributed() (or torch.distributed.init_process_group) first")
    by_hand = init_method is not None and rank >= 0 and world_size >= 1
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing and not by_hand:
        raise RuntimeError(
            f"no process group, and the launcher's environment lacks {', '.join(missing)}: launch the script with "
            "torchrun (torchrun --nproc-per-node N script.py), or pass init_method=, rank= and world_size=, or "
            "call torch.distributed.init_process_group yourself; z3kit does not discover an MPI environment")
    device_type = accelerator_type()
    if device_type != "cpu":
        use_device(torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0"))))
    kwargs: dict[str, Any] = {"backend": dist_backend or backend_for(device_type)}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if by_hand:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


def initialize(
    args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
    training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
    dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Zero3Engine, torch.optim.Optimizer | None, None, Any]:
    """``deepspeed.initialize``, by ``zero3.initialize`` (see the module docstring)."""
    refused = {name: value for name, value in (("training_data", training_data), ("lr_scheduler", lr_scheduler),
                                               ("mpu", mpu), ("collate_fn", collate_fn), ("mesh_param", mesh_param))
               if value is not None}
    check_deepspeed_arguments(refused)
    if model is None:
        raise ValueError("deepspeed.initialize needs model=")
    if config is not None and config_params is not None:
        raise ValueError("pass config or config_params (DeepSpeed's older name for it), not both")
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("deepspeed.initialize needs the DeepSpeed config: config= (a dict or a JSON file path), "
                         "or args.deepspeed_config")
    _check_model_parameters(model, model_parameters)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine = zero3_initialize(model, optimizer, config)
    return engine, engine.optimizer, None, engine.lr_scheduler


def _check_model_parameters(model: nn.Module, given: Any) -> None:
    """``model_parameters`` is the model's trainable parameters (or None), as z3kit trains them."""
    if given is None:
        return
    if not isinstance(given, Iterable) or isinstance(given, (torch.Tensor, Mapping)):
        raise TypeError(f"model_parameters must be the model's parameters (model.parameters()), got "
                        f"{type(given).__name__}")
    listed = list(given)
    if any(isinstance(p, Mapping) for p in listed):
        raise TypeError(f"model_parameters holds parameter groups: "
                        f"{per_group_factory_hint(len(listed), settings=settings_of(listed))}")
    named = {id(p): n for n, p in model.named_parameters()}
    ids = {id(p) for p in listed}
    strangers = [p for p in listed if id(p) not in named]
    if strangers:
        raise ValueError(f"model_parameters holds {len(strangers)} tensor(s) that are not parameters of the "
                         f"{type(model).__name__}: pass model.parameters()")
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
    if left_out:
        raise ValueError(
            f"model_parameters leaves out {len(left_out)} trainable parameter(s) ({left_out[0]!r} first); z3kit "
            "trains every parameter with requires_grad: call requires_grad_(False) on those you do not train, "
            "before initialize, and pass model.parameters()")
