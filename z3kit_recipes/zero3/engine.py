"""Zero3Engine: the stock ZeRO-3 runtime, one part per stage of the data flow.

    initialize  (zero3.initialize) arguments checked; (zero3.runtime.build) the parts
                made: full parameter -> ShardLayout (1/N shards, fp32 masters)
    forward     ParamCoordinator (zero3.training.params): pre-forward fetch (trace,
                agreement, prefetch through the Gatherer, zero3.training.gathers)
                -> compute -> post-forward release (ReleasePolicy)
    backward    BackwardPass (zero3.training.backward): pre-backward fetch -> compute
                -> grad-ready hook -> GradReducer (zero3.training.grads: FlatBucket ->
                reduce -> GradPartitionBuffer) -> post-backward release;
                end-of-backward epilogue (ranks compared, everything freed)
    step        OptimizerStep (zero3.training.optim_step): clip -> optimizer on the
                master shards -> write back to the shards
    stats       StepStats (zero3.runtime.step_stats) -> Zero3Stats (zero3.runtime.stats)

Every gather and reduction runs on a stream pair and is completed by its one
owner (the Gatherer, the GradReducer); see ``z3kit.streams``.

Note: the core and its features.
    ``EngineCore`` (``zero3.runtime.core``) runs forward, backward and step
    over the parts. The features (``zero3.weights``: checkpoints, Hugging
    Face weights, DeepSpeed import, full values; ``zero3.lockstep``:
    ``join``, ``generate``) are functions given that core; none of them
    imports this module. ``Zero3Engine`` is the core with one method per
    feature, each handing itself to its feature, so imports run one way:
    features -> core, and this facade -> both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from z3kit_recipes.zero3.accelerate_prepared import mark_prepared
from z3kit_recipes.zero3.deepspeed_call import NOT_A_TUPLE
from z3kit_recipes.zero3.deepspeed_surface import DeepSpeedSurface, refused
from z3kit_recipes.zero3.lockstep import generate as lockstep_generate
from z3kit_recipes.zero3.lockstep import join as lockstep_join
from z3kit_recipes.zero3.runtime.build import EngineParts
from z3kit_recipes.zero3.weights import (
    checkpoint,
    checkpoint_tags,
    dcp_state,
    deepspeed_import,
    full_values,
    pretrained,
    sixteen_bit,
)
from z3kit_recipes.zero3.weights.dcp_refusal import DcpRefusal
from z3kit_recipes.zero3.weights.model_state import ModelStateHooks
from z3kit_recipes.zero3.weights.export_layout import ExportLayout


class Zero3Engine(DeepSpeedSurface, nn.Module):
    """A model trained with ZeRO-3 sharding. Build it with ``zero3.initialize``.

    Forward, backward and step are the ``EngineCore``'s; the methods here are
    the features' (see the Note on the core and its features).

    Note: the engine is a module that wraps the model.
        As DeepSpeed's engine does: the model is its submodule ``module``, so
        ``train()``/``eval()``, ``parameters()``/``named_parameters()``
        (names prefixed ``module.``) and ``modules()`` reach the model, and
        an attribute the engine does not have is the model's
        (``engine.config`` is a Hugging Face model's config; the engine's
        own is ``zero3_config``); one neither has raises an
        ``AttributeError`` naming the engine, and what z3kit writes instead
        for DeepSpeed's engine names it does not have. DeepSpeed's names it
        does have (``global_rank``, ``global_steps``, ``train_batch_size()``,
        ...) are ``DeepSpeedSurface``'s (``zero3.deepspeed_surface``). Between uses a parameter holds no values
        (its shape is ``(0,)``); its full shape and size are
        ``param.ds_shape`` and ``param.ds_numel``, DeepSpeed's names, which
        Hugging Face reads. What torch, Hugging Face and PEFT read through
        the model is right or refuses: the model's own ``state_dict()`` and
        ``load_state_dict()`` gather into and write from the shards
        (``zero3.weights.model_state``), and a parameter's ``.grad`` between
        backward and step refuses to be read (``zero3.training.grad_stand_ins``;
        ``clip_grad_norm_`` here clips by the global norm). The engine's own
        ``state_dict``/``load_state_dict`` refuse, naming what to use
        (``full_state_dict``, ``save_checkpoint``, ``load_pretrained``), as do
        ``to``/``half``-style moves (the shards stay where ``initialize`` put them).
    """

    def __init__(self, parts: EngineParts) -> None:
        nn.Module.__init__(self)
        DeepSpeedSurface.__init__(self, parts)
        #: the model's own state_dict / load_state_dict, made honest (``zero3.weights.model_state``)
        self.model_state = ModelStateHooks(self)
        mark_prepared(self)  # accelerator.prepare returns the engine as it is (``zero3.accelerate_prepared``)
        if self.optimizer is not None:  # DCP's calls given engine.optimizer: refused by name (``zero3.weights.dcp_refusal``)
            DcpRefusal(self.optimizer)

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            # the model's own attributes (a Hugging Face config, generation_config, its methods)
            modules = self.__dict__.get("_modules", {})
            if name.startswith("__") or "module" not in modules:
                raise
        try:
            return getattr(modules["module"], name)
        except AttributeError:
            # neither has it: say so of the engine (and what z3kit spells it, for DeepSpeed's names)
            raise refused(self, name) from None

    def __iter__(self) -> NoReturn:
        # `engine, optimizer, _, scheduler = zero3.initialize(...)` (DeepSpeed's 4-tuple) comes here;
        # nothing iterates an engine otherwise (a module is not a container of its parameters)
        raise TypeError(NOT_A_TUPLE)

    # -- what would hand out empty shards -----------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "engine.state_dict() would hold the parameters' empty placeholders, not their values: use "
            "engine.full_state_dict() (collective; every rank calls it), engine.module.state_dict() (the model's, "
            "gathered; frozen parameters withheld), engine.save_pretrained(path) or engine.save_checkpoint(path); "
            "for DCP's get_state_dict/set_state_dict, hand them engine.dcp_view()"
        )

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "engine.load_state_dict() cannot write into sharded parameters: use engine.load_pretrained(path), "
            "engine.load_checkpoint(path), or change values inside engine.gathered_parameters(modifier_rank=0); "
            "for DCP's set_state_dict, hand it engine.dcp_view()"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> Zero3Engine:
        # every .to()/.cuda()/.half()/.float() comes here: one that changes nothing (the
        # engine's own device and compute dtype, as Trainer-style code asks) is let through
        probe = torch.empty(0, device=self.device, dtype=self.zero3_config.torch_dtype)
        moved = fn(probe)
        if moved.device == probe.device and moved.dtype == probe.dtype:
            return self
        raise RuntimeError(
            "the engine's parameters are sharded and stay on the device and dtype initialize chose "
            f"({self.device}, compute dtype {self.zero3_config.compute_dtype}): move or cast the model before "
            "zero3.initialize, or set Zero3Config(compute_dtype=...)"
        )

    # -- ranks with different numbers of batches -------------------------------------------------
    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Ranks with different numbers of batches (eval, or the last training
        ones), in the manner of ``torch.distributed.algorithms.Join``: wrap
        each rank's loop; a rank whose loop ends repeats its last forward of
        the kind the others run until every loop has ended (see ``zero3.lockstep.join``)."""
        with lockstep_join.joined(self):
            yield

    # -- full parameters on demand --------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(
        self, module: nn.Module | None = None, modifier_rank: int | None = None
    ) -> Iterator[list[nn.Parameter]]:
        """Full parameters of ``module`` (default: the whole model) inside the block.

        With ``modifier_rank``, changes that rank makes to them are
        broadcast on exit and written into every rank's shards (and fp32
        masters); without it, changes are discarded (see ``zero3.weights.full_values``).
        """
        with full_values.gathered(self, module, modifier_rank) as params:
            yield params

    # -- weights in and out (zero3.weights) ------------------------------------------------------
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full parameter values and persistent buffers by name, on CPU
        (collective; see ``zero3.weights.full_values``)."""
        return full_values.full_state_dict(self, rank0_only=rank0_only)

    def save_checkpoint(
        self, save_dir: str | os.PathLike[str], tag: str | int | None = None,
        client_state: dict[str, Any] | None = None, save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's call: write the training state to ``save_dir/tag`` (``tag``
        default ``global_step{N}``), each rank its own part, and, with
        ``save_latest``, the tag to ``save_dir/latest`` (collective; see
        ``zero3.weights.checkpoint_tags``). ``client_state`` is yours (a data
        position), returned by ``load_checkpoint``. Returns True, as DeepSpeed does."""
        if exclude_frozen_parameters is not False:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True): z3kit's checkpoint holds every "
                             "parameter, frozen ones included, so that it resumes the same model; drop the argument")
        checkpoint_tags.save_tagged(self, save_dir, tag, client_state, save_latest)
        return True

    def load_checkpoint(
        self, load_dir: str | os.PathLike[str], tag: str | int | None = None, load_module_strict: bool = True,
        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's call: resume from ``load_dir/tag`` (without a tag, what
        ``load_dir/latest`` names, or ``load_dir`` itself where it is a
        checkpoint), saved at any world size (collective); returns ``(path,
        client_state)``, or ``(None, None)`` where nothing was saved yet
        (see ``zero3.weights.checkpoint_tags``). The whole training state is
        restored: the other arguments are accepted at DeepSpeed's defaults only."""
        given = {"load_module_strict": (load_module_strict, True), "load_optimizer_states": (load_optimizer_states, True),
                 "load_lr_scheduler_states": (load_lr_scheduler_states, True),
                 "load_module_only": (load_module_only, False), "custom_load_fn": (custom_load_fn, None)}
        changed = [f"{k}={v!r}" for k, (v, default) in given.items() if v is not default]
        if changed:
            raise ValueError(f"load_checkpoint({', '.join(changed)}): z3kit restores the whole training state "
                             "(weights, optimizer, scheduler, counters) or nothing; for the weights alone, use "
                             "engine.load_pretrained(path) on a save_pretrained folder")
        return checkpoint_tags.load_tagged(self, load_dir, tag)

    def dcp_view(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer to hand ``torch.distributed.checkpoint``'s
        ``get_state_dict``/``set_state_dict`` (FSDP2 scripts' ``dcp.save``/``dcp.load``):
        parameters and optimizer state as this rank's flat DTensor slices under the
        model's names, resumable at any world size (see ``zero3.weights.dcp_state``)."""
        return dcp_state.dcp_view(self)

    def load_deepspeed_checkpoint(
        self, path: str | os.PathLike[str], *, tag: str | None = None, load_optimizer_hyperparameters: bool = False
    ) -> dict[str, Any]:
        """Load a DeepSpeed ZeRO-3 ``save_checkpoint`` directory, saved at any
        world size (collective; see ``zero3.weights.deepspeed_import``); returns its client state."""
        return deepspeed_import.load_deepspeed_checkpoint(
            self, path, tag=tag, load_optimizer_hyperparameters=load_optimizer_hyperparameters
        )

    def load_pretrained(self, path: str | os.PathLike[str], *, layout: ExportLayout | None = None) -> None:
        """Load a Hugging Face checkpoint directory into the shards (``layout``: names written
        under another architecture's names; see ``zero3.weights.pretrained``)."""
        pretrained.load_pretrained(self, path, layout=layout)

    def save_pretrained(
        self, path: str | os.PathLike[str], *, max_shard_bytes: int = pretrained.DEFAULT_MAX_SHARD_BYTES,
        dtype: torch.dtype | None = None, layout: ExportLayout | None = None,
    ) -> None:
        """Write the full model in the Hugging Face layout, one parameter at a time (collective;
        ``layout``: under another architecture's names, ``zero3.weights.export_layout``)."""
        pretrained.save_pretrained(self, path, max_shard_bytes=max_shard_bytes, dtype=dtype, layout=layout)

    def save_16bit_model(
        self, save_dir: str | os.PathLike[str], save_filename: str = sixteen_bit.DEFAULT_FILENAME,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's call, as DeepSpeed does it: rank 0 writes ``torch.save`` of the whole model's
        ``state_dict`` (each parameter under every name, in the compute dtype: bf16 or fp16 in such a
        run; persistent buffers) to ``save_dir/save_filename``; ``exclude_frozen_parameters`` leaves
        out parameters that do not train. Always written (DeepSpeed's needs
        ``stage3_gather_16bit_weights_on_model_save``); returns True (collective; ``zero3.weights.sixteen_bit``).
        For ``from_pretrained``, ``save_pretrained`` writes the Hugging Face layout."""
        return sixteen_bit.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def schedule_plan(self) -> str:
        """The schedule the steps follow, one line per fetch and exit: what is
        prefetched and released, and the elements gathered after each
        (``z3kit.schedule_plan.SchedulePlan.describe``), to print or diff."""
        return self.coordinator.plans.describe()

    def generate(self, *args: Any, rank: int | None = None, **kwargs: Any) -> Any:
        """The model's Hugging Face ``generate`` on every rank in lockstep
        (collective: call it on every rank). ``rank=r``: rank r's arguments
        and sampling seed are used everywhere, and only rank r gets the
        result (the others get None); see ``zero3.lockstep.generate``."""
        return lockstep_generate.generate(self, args, kwargs, rank)

