"""What one benchmark run is: the runtimes, the shared settings, and ``RunSpec``."""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

from z3kit_recipes.models import TieMode

JSON = dict[str, Any]

RuntimeName = Literal[
    "ddp", "fsdp2", "fsdp2-noreshard", "deepspeed", "z3kit", "z3kit-budget", "z3kit-divergent", "fsdp_blocks",
    "z3kit-muon",
]
RUNTIMES: Final[tuple[RuntimeName, ...]] = (
    "ddp", "fsdp2", "fsdp2-noreshard", "deepspeed", "z3kit", "z3kit-budget", "z3kit-divergent", "fsdp_blocks",
    "z3kit-muon",
)
#: what ``--runtimes`` runs when not given (z3kit-divergent measures an opt-in mode's price, z3kit-muon
#: another optimizer: ask for them)
DEFAULT_RUNTIMES: Final[tuple[RuntimeName, ...]] = tuple(
    r for r in RUNTIMES if r not in ("z3kit-divergent", "z3kit-muon"))
#: what each runtime name stands for (the report's legend)
RUNTIME_DESCRIPTIONS: Final[dict[RuntimeName, str]] = {
    "ddp": "DistributedDataParallel: a full replica on every rank",
    "fsdp2": "fully_shard on every block and the root (reshard after forward)",
    "fsdp2-noreshard": "fully_shard with reshard_after_forward=False (parameters stay gathered "
                       "from forward to backward)",
    "deepspeed": "DeepSpeed ZeRO-3 with the shared zero_optimization section",
    "z3kit": "z3kit zero3 with the shared zero_optimization section",
    "z3kit-budget": "z3kit zero3 with Zero3Config(memory_budget=--budget) deriving the bucket "
                    "and live-parameter knobs",
    "z3kit-divergent": "z3kit zero3 with Zero3Config(divergent_graphs=True): every gather a round "
                       "in which the ranks agree on what to gather (the price of rank-divergent graphs)",
    "fsdp_blocks": "z3kit fsdp_blocks: sharded by the workload's blocks (as fsdp2), static prefetch of "
                   "the next block, per-block reduce-scatter",
    "z3kit-muon": "z3kit zero3 with the shared section and Muon (z3kit.sharded_muon, lr MUON_LR) on the hidden "
                  "matrices, Adam on the embeddings, head, norms and biases (another optimizer: its losses differ)",
}

#: Adam's learning rate in every runtime
LR: Final = 1e-3
#: z3kit-muon's Muon learning rate (torch.optim.Muon's other defaults)
MUON_LR: Final = 0.02
#: the workloads ``--workload all`` runs (llama only when asked: a step takes seconds)
DEFAULT_WORKLOADS: Final[tuple[str, ...]] = ("tiny", "gpt")
DEFAULT_STEPS: Final[dict[str, int]] = {"tiny": 30, "gpt": 15, "llama": 3}
DEFAULT_WARMUP: Final[dict[str, int]] = {"tiny": 5, "gpt": 3, "llama": 1}
#: ``--compile``'s scopes: the workload's blocks (the same ones FSDP2 shards), or the whole model
COMPILE_SCOPES: Final[tuple[str, ...]] = ("block", "model")
#: warm-up steps under ``--compile`` at least: z3kit runs its first step eagerly (it learns
#: which parameters each module uses) and compiles in its second; the others compile in their first
MIN_COMPILE_WARMUP: Final = 2
#: ``--budget``: one eighth of the model's size in the compute dtype
DEFAULT_BUDGET: Final = 0.125

#: ZeRO-3 knobs given to both DeepSpeed and z3kit: DeepSpeed's defaults, except
#: that every parameter is sharded (with the default persistence threshold of
#: 1e5 elements every parameter of the tiny workload would stay gathered on
#: every rank, and resident memory would not be 1/N), and that buckets are
#: sized for these models: with the defaults (5e7-element prefetch, 5e8-element
#: reduce bucket) one bucket holds a whole 7.4M-parameter model, so neither
#: the gather nor the reduction can overlap any compute.
DEFAULT_ZERO_CONFIG: Final[JSON] = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 2_000_000,
    "reduce_bucket_size": 2_000_000,
}


@attrs.frozen
class RunSpec:
    """One (workload, runtime, world) run, sent to every spawned rank."""

    workload: str
    tie_mode: TieMode
    runtime: RuntimeName
    world: int
    #: threads per rank; with more than one candidate the run only calibrates:
    #: a short trial of each (``trial_steps`` timed steps) picks the fastest,
    #: and the measured run is launched afresh with it, so that every measured
    #: run starts from a new process (memory baselines alike).
    threads: tuple[int, ...]
    steps: int
    warmup: int
    probe_steps: int
    trial_steps: int
    #: bytecode cache for the heavy lazy imports ('' for none).
    pycache_dir: str
    #: the ``zero_optimization`` section shared by DeepSpeed and z3kit
    zero: JSON
    #: ``z3kit-budget``'s ``memory_budget``: bytes (int) or a fraction of the model (float)
    budget: int | float
    port: int
    out_path: str
    #: torch.compile for every runtime: "" (none), "block" (each of the workload's blocks,
    #: ``block.compile()``) or "model" (``model.compile()``); see ``runners.CompileSpec``
    compile: str = ""
    compile_backend: str = "inductor"
