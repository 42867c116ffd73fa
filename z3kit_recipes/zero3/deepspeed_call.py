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

from collections.abc import Mapping, Sequence
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
#: the module that takes ``deepspeed.initialize``'s call unchanged (``zero3.deepspeed``)
_DEEPSPEED_ENTRY: Final = "from z3kit_recipes.zero3 import deepspeed; deepspeed.initialize(model=..., ...)"

#: ``deepspeed.initialize``'s arguments that ``zero3.initialize`` does not take -> what it takes instead
_INSTEAD: Final[Mapping[str, str]] = {
    "model_parameters": (
        "z3kit builds the optimizer itself, on this rank's fp32 master shards of the trainable parameters: "
        f"drop model_parameters and pass a factory, {_FACTORY}, or put an optimizer section in the DeepSpeed "
        "config; parameters with requires_grad=False are not trained (set it before initialize to train a subset). "
        f"DeepSpeed's own call, 4-tuple and all, is {_DEEPSPEED_ENTRY}"
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
        "zero3.initialize does not initialize torch.distributed: call torch.distributed.init_process_group (or "
        "z3kit_recipes.zero3.deepspeed.init_distributed(), from torchrun's environment) first"
    ),
    "distributed_port": (
        "zero3.initialize does not initialize torch.distributed: call torch.distributed.init_process_group (or "
        "z3kit_recipes.zero3.deepspeed.init_distributed(), from torchrun's environment) first"
    ),
}


def check_deepspeed_arguments(given: Mapping[str, object]) -> None:
    """Refuse ``deepspeed.initialize`` arguments, each with what to pass instead;
    any other unknown keyword as Python refuses it."""
    unknown = sorted(name for name in given if name not in _INSTEAD)
    if unknown:
        raise TypeError(f"initialize() got an unexpected keyword argument {unknown[0]!r}")
    if given:
        lines = [f"{name}: {_instead(name, given[name])}" for name in sorted(given)]
        raise TypeError("zero3.initialize does not take deepspeed.initialize's " + "; ".join(lines))


def _instead(name: str, value: object) -> str:
    """What to write instead of argument ``name``; parameter groups keep their groups."""
    if name == "model_parameters" and isinstance(value, (list, tuple)) and any(isinstance(g, Mapping) for g in value):
        return f"it holds {len(value)} parameter groups: {per_group_factory_hint(len(value), settings=settings_of(value))}"
    return _INSTEAD[name]


def check_optimizer_argument(optimizer: object) -> None:
    """An optimizer factory or None; an optimizer instance refused with the factory that builds its like."""
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = type(optimizer)
        # torch.optim.AdamW rather than torch.optim.adamw.AdamW, where torch.optim exports it
        spelled = f"torch.optim.{kind.__name__}" if getattr(torch.optim, kind.__name__, None) is kind \
            else f"{kind.__module__}.{kind.__qualname__}"
        if len(optimizer.param_groups) > 1:  # a one-group factory would drop the user's groups
            raise TypeError(f"optimizer is a {spelled} instance with {len(optimizer.param_groups)} parameter groups, "
                            "built on the full parameters: " + per_group_factory_hint(
                                len(optimizer.param_groups), spelled, _group_settings(optimizer),
                                _keywords(optimizer.defaults)))
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


def per_group_factory_hint(groups: int, spelled: str = "torch.optim.AdamW",
                           settings: list[str] | None = None, keywords: str = "lr=...") -> str:
    """What keeps ``groups`` parameter groups: a factory that makes them from the master shards, by name."""
    shown = settings or ['"weight_decay": 0.1', '"weight_decay": 0.0']
    body = ", ".join(f'{{"params": [p for n, p in params.named() if <group {i}\'s names>]{", " if s else ""}{s}}}'
                     for i, s in enumerate(shown))
    return ("z3kit builds the optimizer on this rank's fp32 master shards, so it takes a factory, and one that "
            f"keeps your {groups} groups selects each group's shards by parameter name: optimizer=lambda params: "
            f"{spelled}([{body}], {keywords}) (params.named() gives (name, shard) pairs, params.full_shape(p) the "
            "parameter's shape); a one-group factory would train every parameter alike")


def settings_of(groups: Sequence[object]) -> list[str]:
    """Each parameter group's own numbers (a dict's entries besides ``params``), as dict entries."""
    return [", ".join(f'"{k}": {v!r}' for k, v in g.items()
                      if k != "params" and isinstance(v, (int, float, tuple)) and not isinstance(v, bool))
            if isinstance(g, Mapping) else "" for g in groups]


def _group_settings(optimizer: torch.optim.Optimizer) -> list[str]:
    """Each group's settings that differ from the optimizer's defaults, as dict entries."""
    out = []
    for group in optimizer.param_groups:
        changed = {k: v for k, v in group.items() if k != "params" and k in optimizer.defaults
                   and v != optimizer.defaults[k] and isinstance(v, (int, float, tuple))}
        out.append(", ".join(f'"{k}": {v!r}' for k, v in changed.items()))
    return out


def _keywords(defaults: Mapping[str, object]) -> str:
    """The optimizer's hyperparameters as keyword arguments (its numbers, not its internal switches)."""
    shown = {k: v for k, v in defaults.items() if isinstance(v, (int, float, tuple)) and not isinstance(v, bool)}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items()) or "..."
