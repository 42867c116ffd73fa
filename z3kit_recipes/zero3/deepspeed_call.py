"""``deepspeed.initialize``'s call forms, answered with what ``zero3.initialize`` takes instead.

A DeepSpeed user's first call is DeepSpeed's:

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), model_parameters=model.parameters(),
        config=ds_config)

Three parts of it have no place in ZeRO-3 as z3kit does it, and would end
in a bare Python error (an unexpected keyword, a non-iterable unpacked):
the optimizer is built by z3kit on each rank's fp32 master shards (so it
takes a factory, not an optimizer already built on the full parameters),
which parameters train is ``requires_grad`` (so there is no
``model_parameters``), and ``initialize`` returns the engine alone (the
optimizer and the scheduler are its attributes). Each of them is refused
here with the z3kit spelling of the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch

#: the message of unpacking ``zero3.initialize``'s result as DeepSpeed's 4-tuple (``Zero3Engine.__iter__``)
NOT_A_TUPLE: Final = (
    "zero3.initialize returns the engine alone, not DeepSpeed's (engine, optimizer, training_dataloader, "
    "lr_scheduler) tuple: write engine = zero3.initialize(...); the optimizer is engine.optimizer and the "
    "scheduler (from the DeepSpeed config's scheduler section) is engine.lr_scheduler. The model is sharded by "
    "the engine this call made; in the same process, build the model again before calling initialize again"
)

_FACTORY: Final = "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"

#: ``deepspeed.initialize``'s arguments that ``zero3.initialize`` does not take -> what it takes instead
_INSTEAD: Final[Mapping[str, str]] = {
    "model_parameters": (
        "z3kit builds the optimizer itself, on this rank's fp32 master shards of the trainable parameters: "
        f"drop model_parameters and pass a factory, {_FACTORY}, or put an optimizer section in the DeepSpeed "
        "config; parameters with requires_grad=False are not trained (set it before initialize to train a subset)"
    ),
    "lr_scheduler": (
        "the scheduler comes from the DeepSpeed config's scheduler section (engine.lr_scheduler, stepped by "
        "engine.step()); or build your own on engine.optimizer after initialize and step it after engine.step()"
    ),
    "training_data": (
        "z3kit makes no data loader: build a torch DataLoader with a DistributedSampler and feed its batches to "
        "the engine"
    ),
    "collate_fn": "z3kit makes no data loader: pass collate_fn to your own torch DataLoader",
    "args": (
        "pass the DeepSpeed config itself as config= (a dict or a JSON file path), not an argparse namespace"
    ),
    "config_params": "pass the DeepSpeed config as config= (config_params is DeepSpeed's older name for it)",
    "mpu": "z3kit has no model-parallel unit: pass the data-parallel group as process_group= (or device_mesh=)",
    "mesh_param": "pass a 2-D DeviceMesh as device_mesh= (HSDP), or the config's mics_shard_size",
    "dist_init_required": (
        "z3kit never initializes torch.distributed: call torch.distributed.init_process_group first"
    ),
    "distributed_port": (
        "z3kit never initializes torch.distributed: call torch.distributed.init_process_group first"
    ),
}


def check_deepspeed_arguments(given: Mapping[str, object]) -> None:
    """Refuse ``deepspeed.initialize`` arguments, each with what to pass instead;
    any other unknown keyword as Python refuses it."""
    unknown = sorted(name for name in given if name not in _INSTEAD)
    if unknown:
        raise TypeError(f"initialize() got an unexpected keyword argument {unknown[0]!r}")
    if given:
        lines = [f"{name}: {_INSTEAD[name]}" for name in sorted(given)]
        raise TypeError("zero3.initialize does not take deepspeed.initialize's " + "; ".join(lines))


def check_optimizer_argument(optimizer: object) -> None:
    """An optimizer factory or None; an optimizer instance refused with the factory that builds its like."""
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = type(optimizer)
        # torch.optim.AdamW rather than torch.optim.adamw.AdamW, where torch.optim exports it
        spelled = f"torch.optim.{kind.__name__}" if getattr(torch.optim, kind.__name__, None) is kind \
            else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(
            f"optimizer is a {spelled} instance, built on the full parameters; z3kit builds the optimizer on "
            "this rank's fp32 master shards, so it takes a factory that it calls with them: "
            f"optimizer=lambda params: {spelled}(params, {_keywords(optimizer.defaults)}) "
            "(or optimizer=None and the DeepSpeed config's optimizer section)"
        )
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"optimizer must be a factory, e.g. {_FACTORY}: it receives this rank's master shards "
            f"(or None for the config's optimizer section, or an engine that only runs forwards); "
            f"got {type(optimizer).__name__}"
        )


def _keywords(defaults: Mapping[str, object]) -> str:
    """The optimizer's hyperparameters as keyword arguments (its numbers, not its internal switches)."""
    shown = {k: v for k, v in defaults.items() if isinstance(v, (int, float, tuple)) and not isinstance(v, bool)}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items()) or "..."
