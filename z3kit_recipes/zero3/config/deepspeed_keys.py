"""The DeepSpeed JSON keys that change nothing in a ZeRO-3 step, and why (checked against DeepSpeed 0.19.8).

``deepspeed_json`` accepts these and lists them in its one note
(``DeepSpeedNote``). A key is here only when DeepSpeed itself computes the
same numbers whatever it says, under ZeRO stage 3: it configures logging,
profiling or a gate on what DeepSpeed lets through, or it is read only by
ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``, which a stage-3 engine
never builds), or it trades memory or speed for the same values. A key
that would change a number stays refused by name (``deepspeed_json``).

Some keys change numbers at one value only: at DeepSpeed's default they
are inert, and are accepted then (``DEFAULT_ONLY``); any other value is
refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

_STAGES_1_2: Final = "read only by ZeRO stages 1 and 2 (DeepSpeedZeroOptimizer); stage 3 never receives it"

#: top-level keys accepted whatever they hold -> why they change nothing
INERT_TOP_LEVEL: Final[Mapping[str, str]] = {
    "wall_clock_breakdown": "timers DeepSpeed prints",
    "memory_breakdown": "memory printouts (see_memory_usage)",
    "dump_state": "prints the engine's configuration once",
    "zero_allow_untested_optimizer": "DeepSpeed's gate on optimizers it has not tested; z3kit steps whatever the "
                                     "factory builds",
    "zero_force_ds_cpu_optimizer": "DeepSpeed's gate on a client optimizer under offload; z3kit's host step runs "
                                   "the optimizer it is given",
    "flops_profiler": "a profiler: it measures, changes nothing",
    "activation_checkpointing": "read only by deepspeed.checkpointing.configure, which a model calls itself; the "
                                "engine never reads it (torch.utils.checkpoint works under z3kit)",
    "wandb": "a monitor: what the engine logs, not what it computes",
    "comet": "a monitor: what the engine logs, not what it computes",
    "comms_logger": "DeepSpeed's log of its collectives: it prints, changes nothing",
}

#: ``zero_optimization`` keys accepted whatever they hold -> why they change nothing
INERT_ZERO: Final[Mapping[str, str]] = {
    "sub_group_size": "how many elements the optimizer steps at a time: the same update",
    "stage3_gather_16bit_weights_on_model_save": "whether DeepSpeed's save_16bit_model writes; z3kit's always does",
    "stage3_gather_fp16_weights_on_model_save": "the older name of stage3_gather_16bit_weights_on_model_save",
    "allgather_partitions": _STAGES_1_2,
    "allgather_bucket_size": _STAGES_1_2,
    "round_robin_gradients": _STAGES_1_2,
    "ignore_unused_parameters": _STAGES_1_2,
    "use_multi_rank_bucket_allreduce": _STAGES_1_2,
    "stage3_model_persistence_threshold": "a cap on how many elements stay gathered: memory, not values",
    "model_persistence_threshold": "a cap on how many elements stay gathered: memory, not values",
    "stage3_use_all_reduce_for_fetch_params": "gathers by all-reduce instead of all-gather: the same values",
    "stage3_allgather_sequential": "gathers one at a time: speed, not values",
    "memory_efficient_linear": "DeepSpeed's linear that saves less for backward under zero.Init: memory, not "
                               "values (z3kit runs the model's own linear, as DeepSpeed does with false)",
    "log_trace_cache_warnings": "logging",
    "enable_sanity_checks": "DeepSpeed's own consistency checks",
}

#: keys inert only at DeepSpeed's default (the value here); any other value changes numbers and is refused
DEFAULT_ONLY: Final[Mapping[str, object]] = {
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "communication_data_type": None,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.elastic_checkpoint": False,
    # z3kit's masters are always loaded from the checkpoint's fp32 values
    "zero_optimization.load_from_fp32_weights": True,
    # gradients accumulate in fp32 partitions; parameters and buffers in the dtypes DeepSpeed's defaults give
    "data_types.grad_accum_dtype": None,
    "data_types.param_dtype": None,
    "data_types.buffer_dtype": None,
    "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False,
    "checkpoint.parallel_write.pipeline_stage": False,
}

#: sections whose keys are each read as a dotted key (``data_types.grad_accum_dtype``): at DeepSpeed's
#: default (``DEFAULT_ONLY``) or inert (``INERT_IN_SECTIONS``)
DOTTED_SECTIONS: Final = ("data_types", "checkpoint")

#: dotted keys of ``DOTTED_SECTIONS`` accepted whatever they hold -> why they change nothing
INERT_IN_SECTIONS: Final[Mapping[str, str]] = {
    "checkpoint.tag_validation": "how DeepSpeed reacts to ranks saving under different tags; z3kit always "
                                 "refuses them (save_checkpoint)",
}

#: monitor sections the engine writes to when enabled (``zero3.runtime.monitor``)
WRITTEN_MONITORS: Final = ("tensorboard", "csv_monitor")


def default_only(name: str, value: object, inert: list[str], unsupported: list[str]) -> bool:
    """Whether ``name`` (a dotted key) is one of ``DEFAULT_ONLY``; if so it is
    put in ``inert`` at the default, else in ``unsupported`` with why."""
    if name not in DEFAULT_ONLY:
        return False
    default = DEFAULT_ONLY[name]
    if _same(value, default):
        inert.append(name)
    else:
        unsupported.append(f"{name} (only DeepSpeed's default, {_spelled(default)}: {_spelled(value)} changes "
                           "the numbers)")
    return True


def section_keys(name: str, value: object, inert: list[str], unsupported: list[str]) -> None:
    """Each key of the section ``name`` (one of ``DOTTED_SECTIONS``), nested ones
    dotted, into ``inert`` (inert, or at DeepSpeed's default) or ``unsupported``."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    for key, inner in value.items():
        dotted = f"{name}.{key}"
        if isinstance(inner, Mapping) and any(k.startswith(dotted + ".") for k in DEFAULT_ONLY):
            section_keys(dotted, inner, inert, unsupported)
        elif dotted in INERT_IN_SECTIONS:
            inert.append(dotted)
        elif not default_only(dotted, inner, inert, unsupported):
            unsupported.append(dotted)


def _same(value: object, default: object) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(default, bool) or default is None or isinstance(value, bool):
        return value is default
    return bool(value == default)


def _spelled(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
