"""FSDP2 scripts' checkpoints: ``torch.distributed.checkpoint``'s own
``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` on an engine.

An FSDP2 script saves and resumes with DCP's calls; on z3kit the model and
optimizer it hands them are ``engine.dcp_view()``::

    model, optimizer = engine.dcp_view()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # resume, at any world size: a new engine, then
    model_sd, optim_sd = get_state_dict(model, optimizer)     # what dcp.load reads into
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Note: why a view, and not the model and ``engine.optimizer``.
    DCP keys the optimizer's state by the model's parameter names: it pairs
    each parameter of ``optimizer.param_groups`` with one of
    ``model.named_parameters()`` by identity. ``engine.optimizer`` steps
    this rank's fp32 master shards, which are not the model's parameters
    (torch then fails with ``KeyError: 0``), and ``model.state_dict()``
    gathers whole parameters in the compute dtype (a whole model on every
    rank, and not the masters). The view is to DCP what FSDP2's model and
    optimizer are, over the engine's public objects (its model, layout,
    shards and optimizer) and DCP's public calls only:

    - ``ShardedModelView``: the model's own modules, parameters and buffers
      under their own names (it shares the model's tree and is registered
      nowhere), whose ``state_dict()`` holds each parameter as this rank's
      slice of it, a DTensor of the flattened shape ``(numel,)`` over its
      fp32 master (a frozen one: over its shard), as ``engine.save_checkpoint``
      lays it out (``zero3.weights.flat_shards``), and the persistent buffers.
      ``load_state_dict`` writes such entries, or whole tensors (flat or
      shaped), into the shards and masters.
    - ``ShardedOptimizerView``: ``engine.optimizer`` with each master named
      by its model parameter in ``param_groups`` and ``state``, and its
      state tensors shaped like a master as such DTensors.

    DCP reshards flat DTensors, so what is saved at N ranks resumes at M.
    ``get_state_dict`` hands out views of the engine's buffers (as FSDP2's
    DTensors are its parameters): ``dcp.save`` copies nothing, and ``dcp.load``
    writes into the masters and the optimizer state in place;
    ``set_state_dict`` then writes the shards from the masters.

Note: what the view carries, and what it refuses.
    Parameters, buffers, optimizer state and hyperparameters, as FSDP2's
    pair does. Step counters, RNG states, an LR scheduler and the data
    position are the script's to save, as under FSDP2 (``engine.save_checkpoint``
    saves all of them). An open accumulation window (backwards since the
    window's last optimizer step) is refused, naming ``engine.save_checkpoint``,
    which saves it. A ``set_state_dict`` with a missing, unexpected (strict)
    or misshapen entry is refused on every rank before anything is written;
    DCP loads the optimizer before the model, so a refused model load puts
    back what the optimizer load just replaced. Before the optimizer's first
    step its state does not exist: the view's ``state_dict()`` makes it as
    DCP does under FSDP2, with a step of zero gradients at learning rate 0
    (the masters put back after it, bit for bit), and the view's ``state``
    is never empty, so that DCP itself never sets the model's gradients.
"""

from __future__ import annotations

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.dcp_model import ShardedModelView
from z3kit_recipes.zero3.weights.dcp_optimizer import ReplacedState, ShardedOptimizerView


def dcp_view(engine: EngineCore) -> tuple[ShardedModelView, ShardedOptimizerView]:
    """The model and optimizer to hand DCP's ``get_state_dict`` / ``set_state_dict`` (see the module Notes)."""
    replaced = ReplacedState()
    return ShardedModelView(engine, replaced), ShardedOptimizerView(engine, replaced)
