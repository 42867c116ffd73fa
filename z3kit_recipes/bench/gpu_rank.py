"""What one rank of ``python -m z3kit_recipes.bench.gpu`` does.

``rank_main`` is the spawned entry point (imported from this module, never
from ``__main__``): it joins the process group, runs every section
(``SECTIONS``) on its own, and meets the other ranks after each one, where
the ranks' local results are merged; rank 0 writes the merged result to
``CheckSpec.out_path``. A section that raises is recorded as an error and
the next one runs. Each rank drives one device: ``cuda:<rank>`` over nccl,
or the CPU over gloo in a dry run.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from torch import nn

from z3kit_recipes.bench.runners.z3kit_zero3 import shared_config
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON
from z3kit_recipes.launch import leave_together, use_bytecode_cache
from z3kit_recipes.models import GPTConfig, GPTWorkload, LlamaWorkload, Workload
from z3kit_recipes.zero3 import Zero3Config

#: the models every section runs, in this order
MODELS: Final = ("gpt", "llama")
#: the compute dtypes of the parity, host-sync and memory sections (``Zero3Config.compute_dtype``)
DTYPES: Final = ("fp32", "bf16")


@attrs.frozen
class Sizes:
    """Models and step counts: the bench's on a GPU, tiny ones in a dry run."""

    gpt: GPTConfig
    gpt_batch: int
    #: ``transformers.LlamaConfig`` arguments
    llama: Mapping[str, Any] = attrs.field(hash=False)
    llama_batch: int
    llama_seq: int
    #: optimizer steps compared with the reference
    parity_steps: int
    #: steps before anything is counted or timed (the engine records its trace, Adam makes its state)
    warmup: int
    #: steps whose host syncs are counted
    sync_steps: int
    #: timed steps per runtime
    timing_steps: int
    #: the large-model section's Llama (``bench.gpu_large``): ``LlamaConfig`` arguments, micro-batch, sequence
    large: Mapping[str, Any] = attrs.field(hash=False)
    large_batch: int
    large_seq: int


@attrs.frozen
class CheckSpec:
    """One world's run, sent to every spawned rank."""

    world: int
    #: "cuda" (one GPU per rank, nccl) or "cpu" (gloo: the dry run)
    device_type: str
    sizes: Sizes
    port: int
    out_path: str
    threads: int
    #: the process group's timeout (the engine's ``collective_timeout_s`` is 90% of it)
    timeout_s: float
    pycache_dir: str

    @property
    def backend(self) -> str:
        return "gloo" if self.device_type == "cpu" else "nccl"


@attrs.frozen
class OnDevice:
    """A workload whose model and batches live on ``device`` (the bench's workloads build on CPU)."""

    inner: Workload
    device: torch.device

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def build_model(self) -> nn.Module:
        return self.inner.build_model().to(self.device)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner.batch(rank, step)
        return x.to(self.device), y.to(self.device)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(output, target)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return self.inner.blocks(model)


@attrs.frozen
class RankContext:
    """What a section needs on one rank."""

    spec: CheckSpec
    rank: int
    device: torch.device
    group: dist.ProcessGroup

    @property
    def world(self) -> int:
        return self.spec.world

    @property
    def sizes(self) -> Sizes:
        return self.spec.sizes

    @property
    def meaningful(self) -> bool:
        """Whether timing and memory figures mean anything (not on a shared CPU with tiny models)."""
        return self.device.type != "cpu"

    def workload(self, name: str) -> Workload:
        s = self.sizes
        if name == "gpt":
            return OnDevice(GPTWorkload(config=s.gpt, batch_size=s.gpt_batch), self.device)
        if name == "llama":
            return OnDevice(LlamaWorkload(config=dict(s.llama), batch_size=s.llama_batch, seq_len=s.llama_seq),
                            self.device)
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")

    def config(self, dtype: str) -> Zero3Config:
        """The bench's shared ZeRO-3 settings (every parameter sharded, 2M-element buckets)
        in ``dtype``; a rank that stops answering is named within the group's timeout."""
        return attrs.evolve(shared_config(DEFAULT_ZERO_CONFIG), compute_dtype=dtype,
                            collective_timeout_s=0.9 * self.spec.timeout_s)

    def synchronize(self) -> None:
        """Wait for the device's queued work (before reading a clock or the allocator's peak)."""
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def free(self) -> None:
        """Drop what the last case left (engines, runners): the next starts from the same memory."""
        gc.collect()
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).empty_cache()


def error_result(exc: BaseException) -> JSON:
    """A failed section or case, as JSON: what raised, and where."""
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}".strip()[:2000],
            "traceback": traceback.format_exc()[-4000:]}


def guarded(fn: Callable[[], JSON]) -> JSON:
    """``fn()``, or its exception as an error result: one case failing does not stop the others."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the output, and the check goes on
        return error_result(exc)
    result.setdefault("status", "ok")
    return result


def each_case(ctx: RankContext, case: Callable[[RankContext, Workload, str], JSON]) -> JSON:
    """``case`` for every model and compute dtype, by ``model/dtype``, each
    ``guarded`` and followed by ``ctx.free()``."""
    cases: JSON = {}
    for model in MODELS:
        wl = ctx.workload(model)
        for dtype in DTYPES:
            cases[f"{model}/{dtype}"] = guarded(functools.partial(case, ctx, wl, dtype))
            ctx.free()
    return cases


def merge_cases(per_rank: list[JSON], merge_case: Callable[[list[JSON]], JSON]) -> JSON:
    """Cases by name, each merged over ranks; a case that raised on some rank is that error."""
    out: JSON = {}
    for name in per_rank[0]:
        results = [r[name] for r in per_rank]
        failed = [(rank, r) for rank, r in enumerate(results) if r.get("status") != "ok"]
        if failed:
            rank, first = failed[0]
            out[name] = {**first, "rank": rank}
        else:
            out[name] = {"status": "ok", **merge_case(results)}
    return out


@attrs.frozen
class Section:
    """``run`` on every rank gives a rank's cases by name; ``merge`` one case's results over ranks."""

    name: str
    run: Callable[[RankContext], JSON]
    merge: Callable[[list[JSON]], JSON]
    #: fills the section's summary fields from its merged cases
    summarize: Callable[[JSON, RankContext], JSON]


def run_section(section: Section, ctx: RankContext) -> JSON:
    """The section on this rank, merged with the others'; an exception is its result."""
    t0 = time.perf_counter()
    try:
        local: JSON = {"status": "ok", "cases": section.run(ctx)}
    except Exception as exc:  # noqa: BLE001 - reported in the output, and the next section runs
        local = error_result(exc)
    ctx.free()
    # every rank gets here, whatever happened in the section: the ranks meet after each section
    everyone = ctx.gather(local)
    failed = [(rank, r) for rank, r in enumerate(everyone) if r["status"] != "ok"]
    if failed:
        rank, first = failed[0]
        merged: JSON = {**first, "rank": rank}
    else:
        cases = merge_cases([r["cases"] for r in everyone], section.merge)
        merged = {"status": "error" if any(c["status"] != "ok" for c in cases.values()) else "ok",
                  **section.summarize(cases, ctx), "cases": cases}
    merged["wall_s"] = time.perf_counter() - t0
    return merged


def sections() -> tuple[Section, ...]:
    """Every section, in the order they run: timing last, because DeepSpeed (timed at world 2)
    changes process-wide state when it starts (its communication backend, its logger), and the
    bench gives it processes of its own for that reason."""
    from z3kit_recipes.bench.gpu_large import LARGE
    from z3kit_recipes.bench.gpu_parity import PARITY
    from z3kit_recipes.bench.gpu_probes import HOST_SYNCS, MEMORY
    from z3kit_recipes.bench.gpu_timing import TIMING

    return PARITY, HOST_SYNCS, MEMORY, LARGE, TIMING


def rank_main(rank: int, spec: CheckSpec) -> None:
    """Entry point of a spawned rank: every section, then rank 0 writes the result."""
    use_bytecode_cache(spec.pycache_dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec.world), LOCAL_WORLD_SIZE=str(spec.world))
    # DeepSpeed picks its accelerator from this, once, at import
    os.environ["DS_ACCELERATOR"] = spec.device_type
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    torch.set_num_threads(spec.threads)
    device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type, rank)
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s),
                            device_id=None if device.type == "cpu" else device)
    group = dist.group.WORLD
    assert group is not None
    ctx = RankContext(spec, rank, device, group)
    t0 = time.perf_counter()
    results = {s.name: run_section(s, ctx) for s in sections()}
    if rank == 0:
        name = "CPU" if device.type == "cpu" else torch.get_device_module(device.type).get_device_name(device)
        Path(spec.out_path).write_text(json.dumps({
            "status": "ok", "world": spec.world, "backend": spec.backend, "device": name,
            "rank_wall_s": time.perf_counter() - t0, "sections": results,
        }))
    # torch 2.13's gloo can abort in destroy_process_group: meet, then os._exit(0)
    leave_together()
