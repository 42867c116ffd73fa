"""``Zero3Trainer``: Hugging Face's ``Trainer`` on the stock ZeRO-3 runtime.

    from z3kit_recipes.hf import Zero3Trainer
    trainer = Zero3Trainer(model=model, args=args, train_dataset=..., z3kit_config="ds_config_zero3.json")

A Trainer script switches by its class (and by moving a DeepSpeed JSON from
``TrainingArguments(deepspeed=...)`` to ``z3kit_config``); everything else,
its arguments, datasets, callbacks, ``train(resume_from_checkpoint=...)``,
``evaluate`` and ``save_model``, stays as it is.

Note: who does what.
    Trainer keeps the loop: the data (sharded over the ranks by Accelerate),
    where an accumulation window ends, the loss scaling for accumulation,
    the LR scheduler, logging, evaluation and checkpoint folders. The engine
    does what DDP and the optimizer did: the model is sharded at
    construction, ``loss.backward()`` reduces gradients into the engine, and
    at the end of each window the engine steps (clipping at
    ``max_grad_norm`` on the device). The engine's own accumulation is one
    micro-step, so that Trainer alone divides the loss, as it does for
    DeepSpeed. Accelerate is told the model is prepared already
    (``prepare_model(..., evaluation_mode=True)``, what transformers does
    for models sharded at load), so it is not wrapped in DDP; the optimizer
    Trainer sees is the engine's, with ``step``/``zero_grad`` left to the
    engine (as Accelerate's DeepSpeed wrapper does).

Note: TRL.
    TRL's trainers are Trainers: ``class T(Zero3Trainer, SFTTrainer)`` (or
    ``DPOTrainer``) runs them on the engine. Their fused losses take
    ``lm_head.weight`` into their own ``autograd.Function``, which the
    model's sharded parameters answer as an unsharded weight would
    (``zero3.runtime.between_uses``); a frozen reference model in
    ``ref_model`` is sharded too, by an engine of its own that only runs
    forwards.

Note: saving.
    ``save_model`` gathers the full weights (every rank calls it, as
    Trainer scripts do) and writes Hugging Face safetensors from rank 0;
    each ``checkpoint-N`` folder also gets the engine's sharded checkpoint
    in ``z3kit/`` (every rank writes its part), which
    ``train(resume_from_checkpoint=...)`` loads with the scheduler's state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from z3kit_recipes import zero3
from z3kit_recipes.hf.settings import engine_settings, json_schedule, refuse_unsupported, trainer_optimizer_factory

#: the engine's sharded checkpoint inside a Trainer ``checkpoint-N`` folder
CHECKPOINT_SUBDIR = "z3kit"


class EngineOptimizer(AcceleratedOptimizer):
    """The engine's optimizer as Trainer and Accelerate hold it: the LR
    scheduler drives its param groups; stepping and clearing are the engine's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True

    def step(self, closure: Any = None) -> Any:
        """The engine stepped already, at the end of the window (``Zero3Trainer.training_step``)."""

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """The engine clears its gradients when it steps."""


class Zero3Trainer(Trainer):
    """``transformers.Trainer`` with the model sharded by ``zero3.initialize`` (see the module Notes).

    ``z3kit_config``: a ``Zero3Config``, or a DeepSpeed config (dict, or the
    path of its JSON) whose ``"auto"`` values are filled from the
    ``TrainingArguments`` as Trainer fills them for DeepSpeed; default:
    ``Zero3Config()``.
    """

    def __init__(self, *args: Any, z3kit_config: zero3.Zero3Config | Mapping[str, Any] | str | os.PathLike[str]
                 | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refuse_unsupported(self.args, self.optimizer, self.lr_scheduler)
        model = self.model
        if not isinstance(model, torch.nn.Module):
            raise ValueError("Zero3Trainer needs the model (model=...); model_init is not supported")
        settings = engine_settings(z3kit_config, self.args, model)
        #: the DeepSpeed JSON's scheduler section, built once Trainer knows its steps (``create_scheduler``)
        self.json_scheduler = settings.json_scheduler
        # the JSON's optimizer section, where it has one (DeepSpeed's meaning); else Trainer's own
        factory = None if settings.config.optimizer is not None else trainer_optimizer_factory(self, model)
        self.engine = zero3.initialize(model, factory, settings.config)
        #: TRL's trainers (DPO, and others with a frozen reference): the reference model sharded too, by an
        #: engine of its own that only runs forwards (``initialize(ref, None)``); None without one
        self.ref_engine: zero3.Zero3Engine | None = None
        reference = getattr(self, "ref_model", None)
        if isinstance(reference, torch.nn.Module) and reference is not model:
            self.ref_engine = zero3.initialize(reference, None, settings.config)
        # prepared already: Accelerate must not wrap the sharded model in DDP, nor move it
        self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        self.optimizer = EngineOptimizer(self.engine.require_optimizer("Zero3Trainer"))
        # for Trainer's FLOP count, asked every step: the model's size does not change
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        self._non_embedding_numel = sum(
            int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if id(p) not in embeddings)

    # -- the model stays where initialize put it ----------------------------------------------------
    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Nothing to move: the engine placed the shards (Trainer moves the model before and after wrapping)."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        return self.engine_optimizer

    @property
    def engine_optimizer(self) -> EngineOptimizer:
        assert isinstance(self.optimizer, EngineOptimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Trainer's scheduler, or the DeepSpeed JSON's (Trainer steps it after each optimizer step)."""
        if self.json_scheduler is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        schedule = json_schedule(self.json_scheduler, self.args, num_training_steps)
        self.lr_scheduler = cast(Any, schedule.build(self.engine_optimizer.optimizer))  # Trainer annotates LambdaLR
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- a step ------------------------------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # the end of Trainer's accumulation window
            self.engine.step()
        return loss

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """The engine clipped in its step; this is the norm it measured (Trainer logs it as ``grad_norm``)."""
        return self.engine.last_grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return self.engine.last_grad_norm if grad_norm is None else grad_norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Trainer's estimate (6 x tokens x non-embedding parameters), from the parameters' full sizes."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return 0
        return 6 * ids.numel() * self._non_embedding_numel

    # -- saving and resuming -----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Full weights as Hugging Face safetensors (collective: every rank calls it; rank 0 writes)."""
        state = self.engine.full_state_dict(rank0_only=True)
        self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_SUBDIR, save_latest=False)  # output_dir/CHECKPOINT_SUBDIR
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """The weights come with the engine's checkpoint (``_load_optimizer_and_scheduler``)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_SUBDIR)):
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {CHECKPOINT_SUBDIR}/ folder: it was not saved by Zero3Trainer; "
                "resume from a checkpoint-N folder this trainer wrote"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.engine.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_SUBDIR))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None:
            self.engine.load_pretrained(best)
