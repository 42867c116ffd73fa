"""What a DeepSpeed script reads on its engine, where z3kit can honour it.

``DeepSpeedSurface`` is ``DeepSpeedEngine``'s (0.19.8) names with its
meanings: the ranks (``global_rank``, ``local_rank``, ``world_size``,
``dp_world_size``), the counters (``global_steps``: optimizer steps,
skipped fp16 steps included; ``micro_steps``: ``step()`` calls;
``global_samples``: ``global_steps * train_batch_size()``;
``skipped_steps``), the batch sizes (``train_batch_size()``,
``train_micro_batch_size_per_gpu()``, ``gradient_accumulation_steps()``,
from the config), the optimizer's ``get_lr()``/``get_mom()`` and
``get_global_grad_norm()``, and the config's switches a script branches on.

A name of DeepSpeed's engine that z3kit cannot honour is refused by
``refused(name)``: an ``AttributeError`` (``hasattr`` stays False) that
names the engine and what to write in z3kit instead, where the model's
own ``'GPT2LMHeadModel' object has no attribute ...`` would say nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.runtime.progress import group_values, momenta

_NO_LOADER: Final = ("z3kit makes no data loader: build a torch DataLoader with a DistributedSampler "
                     "(rank=engine.global_rank, num_replicas=engine.world_size) and feed its batches to the engine")
_FIXED_BATCH: Final = ("the batch sizes are fixed by the config at initialize (train_micro_batch_size_per_gpu, "
                       "gradient_accumulation_steps): initialize a new engine with the new ones")

#: names of DeepSpeed's engine that z3kit does not have -> what to write instead
DEEPSPEED_ONLY: Final[Mapping[str, str]] = {
    "deepspeed_io": _NO_LOADER,
    "training_dataloader": _NO_LOADER,
    "set_train_batch_size": _FIXED_BATCH,
    "set_train_micro_batch_size": _FIXED_BATCH,
    "set_gradient_accumulation_boundary": (
        "the boundary is every gradient_accumulation_steps-th engine.step() call (engine.is_gradient_accumulation_"
        "boundary()); set gradient_accumulation_steps in the config"),
    "allreduce_gradients": "under ZeRO-3 each gradient is reduced as it arrives in backward: nothing to call",
    "clip_fp32_gradients": "set gradient_clipping in the config, or call engine.clip_grad_norm_(max_norm)",
    "save_fp16_model": "engine.save_16bit_model(save_dir, save_filename)",
    "module_state_dict": "engine.full_state_dict() (collective), or engine.module.state_dict()",
    "load_module_state_dict": "engine.load_pretrained(path), or engine.module.load_state_dict(state_dict)",
    "empty_partition_cache": "gathered parameters are released by the engine after each use; engine.synchronize() "
                             "waits for what is in flight",
    "offload_states": "set the config's offload_optimizer to offload the optimizer; z3kit does not move states later",
    "reload_states": "set the config's offload_optimizer to offload the optimizer; z3kit does not move states later",
    "get_batch_info": "engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), "
                      "engine.gradient_accumulation_steps()",
    "mpu": "z3kit has no model-parallel unit: every rank is a data-parallel rank (engine.global_rank)",
    "timers": "engine.stats() (printable) holds the step's times and communication",
    "wall_clock_breakdown": "engine.stats() (printable) holds the step's times and communication",
    "flops_profiler": "use torch.profiler around the steps; engine.synchronize() before stopping it",
    "compile": "compile the model's blocks before initialize (README: torch.compile)",
    "was_step_applied": "engine.step() returns whether the optimizer stepped; engine.last_step_skipped says "
                        "whether an fp16 overflow skipped it",
}


def refused(engine: Any, name: str) -> AttributeError:
    """The ``AttributeError`` for ``name``, which neither the engine nor its model has."""
    model = type(engine.__dict__.get("_modules", {}).get("module")).__name__
    message = f"'Zero3Engine' object has no attribute {name!r}, nor has the {model} it trains"
    if name in DEEPSPEED_ONLY:
        message = f"Zero3Engine has no {name!r} (DeepSpeed's engine has): {DEEPSPEED_ONLY[name]}"
    return AttributeError(message)


class DeepSpeedSurface(EngineCore):
    """DeepSpeed's engine attributes and methods, with DeepSpeed's meanings (see the module docstring)."""

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def world_size(self) -> int:
        return self.world

    @property
    def dp_world_size(self) -> int:
        return self.world

    @property
    def local_rank(self) -> int:
        """torchrun's ``LOCAL_RANK`` (what DeepSpeed reads); else the engine's device index."""
        given = os.environ.get("LOCAL_RANK")
        if given is not None:
            return int(given)
        if self.device.index is not None:
            return self.device.index
        if self.world == 1:
            return 0
        raise RuntimeError("engine.local_rank is torchrun's LOCAL_RANK, and it is not set: launch with torchrun "
                           "(or set LOCAL_RANK), or use engine.global_rank")

    @property
    def global_steps(self) -> int:
        return self.global_step

    @property
    def micro_steps(self) -> int:
        """``step()`` calls so far (backwards completed at the last one)."""
        return self.step_state.micro_at_step_call

    @property
    def global_samples(self) -> int:
        return self.global_step * self.train_batch_size()

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def train_micro_batch_size_per_gpu(self) -> int:
        micro = self.zero3_config.micro_batch_size
        if micro is None:
            raise ValueError("the engine knows no micro batch size: write train_micro_batch_size_per_gpu (or "
                             "train_batch_size) in the DeepSpeed config, or set Zero3Config(micro_batch_size=...)")
        return micro

    def gradient_accumulation_steps(self) -> int:
        return self.zero3_config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step over every rank: micro batch x accumulation x ranks."""
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world

    def steps_per_print(self) -> int | None:
        return self.zero3_config.steps_per_print

    def gradient_clipping(self) -> float:
        return self.zero3_config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return self.zero3_config.compute_dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.zero3_config.compute_dtype == "bf16"

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` call takes the optimizer step (DeepSpeed's rule)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[Any]:
        return group_values(self.optimizer, "lr")

    def get_mom(self) -> list[Any]:
        return momenta(self.optimizer)

    def get_global_grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm (``last_grad_norm``; None where not measured)."""
        return self.last_grad_norm
