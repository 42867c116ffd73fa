"""Build a model larger than one rank: parameters made on the meta device
(``with torch.device("meta"): model = Model(cfg)``) become shards one module
at a time, so no rank ever holds more than its shards and one module.

For each module that owns meta parameters or buffers, in ``model.modules()``
order: its own parameters and buffers get real, empty storage on the
engine's device; the module initializes itself (``param_init_fn(module)``,
or its ``reset_parameters()``); each rank keeps its shard of every new
parameter and frees the rest at once. Parameters keep their identity
(``torch.utils.swap_tensors``): tied weights and anything else that holds
a parameter still holds the same object.

Note: the same values on every rank.
    Every rank runs every module's initialization from one generator,
    seeded with the same seed (``init_seed``, or rank 0's
    ``torch.initial_seed()``), in the same order, on the same kind of
    device: all ranks compute the same full values and no broadcast is
    needed. The caller's random state is left as it was.

Note: how the values relate to an unsharded build.
    They equal those of an unsharded model that is initialized the same
    way: ``torch.manual_seed(seed)``, then the same initialization applied
    to each module in ``model.modules()`` order, on the same device. For
    models built from torch's layers (``nn.Linear``, ``nn.Embedding``, ...)
    that is exactly what their constructors do under ``torch.manual_seed``.
    Models whose constructors draw random numbers and then initialize again
    (Hugging Face's ``post_init``) get values from the same distributions,
    not the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from z3kit_recipes.zero3.training.layout import ShardLayout

#: initializes one module's own parameters and buffers in place (e.g. a Hugging Face model's ``_init_weights``)
InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_materializable(model: nn.Module, init_fn: InitFn | None) -> None:
    """Refuse, before anything is changed, a model with meta tensors in a
    module that nothing can initialize."""
    if init_fn is not None:
        if not callable(init_fn):
            raise TypeError(f"param_init_fn must be a function of a module, got {type(init_fn).__name__}")
        return
    for name, module in model.named_modules():
        metas = [n for n, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)) if t.is_meta]
        if metas and not callable(getattr(module, "reset_parameters", None)):
            where = f"{name}." if name else ""
            raise ValueError(
                f"{', '.join(where + n for n in metas)} on the meta device, and {type(module).__name__} has no "
                "reset_parameters() to initialize them: pass param_init_fn= (a function of one module; for a "
                "Hugging Face model, model._init_weights), or build this module on a real device"
            )


def materialize(
    model: nn.Module,
    layout: ShardLayout,
    init_fn: InitFn | None,
    seed: int,
    device: torch.device,
) -> None:
    """Fill the shards of the model's meta parameters (and materialize its
    meta buffers) module by module; see the module docstring."""
    index = {id(s.param): pid for pid, s in enumerate(layout.shards)}
    accelerators = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=accelerators, device_type=device.type):
        torch.manual_seed(seed)
        for module in model.modules():
            pending = list(dict.fromkeys(index[id(p)] for p in module.parameters(recurse=False) if p.is_meta))
            buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b.is_meta]
            if not pending and not buffers:
                continue
            for pid in pending:
                _give_storage(layout.shards[pid].param, device)
            for name, buffer in buffers:
                setattr(module, name, torch.empty_like(buffer, device=device))  # keeps it persistent or not
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(module)
                else:
                    module.reset_parameters()  # type: ignore[operator]
            # no name holds the values: each is freed as its shard is filled
            layout.fill(pending, [layout.shards[p].param.detach().reshape(-1) for p in pending])


def _give_storage(param: nn.Parameter, device: torch.device) -> None:
    """Real, empty storage for a meta parameter, keeping the parameter object."""
    real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)

