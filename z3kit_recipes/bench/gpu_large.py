"""Large-model section of ``bench.gpu``: a Llama of about 1B parameters, bf16, at world 1.

Plain torch (fp32 parameters, ``torch.autocast`` to bf16), FSDP2
(``fully_shard`` per decoder layer and the root, ``MixedPrecisionPolicy``
bf16 parameters, fp32 reductions) and z3kit zero3 with its defaults
(``Zero3Config(compute_dtype="bf16")``) train the same Hugging Face
``LlamaForCausalLM`` built from ``LARGE_LLAMA`` on the same batches, each
with ``torch.optim.Adam``. Per step it reports tokens/s, MFU
(6 x parameters x tokens / step time / the device's dense bf16 peak,
``PEAK_BF16_FLOPS``), and whether the host stays ahead of the device: the
host time to issue the step (wall time until the step returns, every kernel
enqueued, before synchronizing) against the device time of the step (CUDA
events recorded around it). A host time at or above the device time means
the device waited for the host (or that the step waited for the device
inside: a host sync, which the host-sync section counts). Only at world 1; other worlds skip it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Final

import torch
from torch import nn

from z3kit_recipes.bench.gpu_rank import OnDevice, RankContext, Section, error_result
from z3kit_recipes.bench.runners import adam, engine_step
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.models import LLAMA_CONFIG, LlamaWorkload, Workload

#: about 1.1B parameters (1,104,218,112, 131M of them in the untied embeddings and head), Llama-style:
#: hidden 2048, 16 layers, 32 query heads and 8 key/value heads, MLP 8192, vocab 32000
LARGE_LLAMA: Final[dict[str, Any]] = {
    **LLAMA_CONFIG, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096,
}
#: dense bf16 peak FLOP/s by a substring of the device's name (no sparsity)
PEAK_BF16_FLOPS: Final[dict[str, float]] = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
RUNTIMES: Final = ("plain", "fsdp2", "z3kit")


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the named device, or None for a device not in ``PEAK_BF16_FLOPS``."""
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), None)


class _PlainAutocast:
    """The model alone, fp32 parameters, forward and loss under ``torch.autocast`` to bf16."""

    def __init__(self, wl: Workload, device: torch.device) -> None:
        self.wl, self.device = wl, device
        self.model = wl.build_model()
        self.opt = adam(list(self.model.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.wl.loss(self.model(x), y)
        loss.backward()
        self.opt.step()


def _fsdp2(ctx: RankContext, wl: Workload) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from z3kit_recipes.bench.runners.torch_native import FSDP2Runner

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return FSDP2Runner(wl, ctx.group, reshard_after_forward=True, mp_policy=policy)


def _z3kit(ctx: RankContext, wl: Workload) -> Any:
    from z3kit_recipes.zero3 import Zero3Config, initialize

    config = Zero3Config(compute_dtype="bf16", collective_timeout_s=0.9 * ctx.spec.timeout_s)
    engine = initialize(wl.build_model(), optimizer=adam, config=config, process_group=ctx.group)
    return _EngineStep(engine, wl)


class _EngineStep:
    """A DeepSpeed-style engine's step (z3kit's engine)."""

    def __init__(self, engine: Any, wl: Workload) -> None:
        self.engine, self.wl = engine, wl

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        engine_step(self.engine, self.wl, x, y)


def time_steps(ctx: RankContext, wl: Workload, runtime: str) -> JSON:
    """Warm-up steps, then ``timing_steps`` timed: per step the host's issue time, the device's
    time (CUDA events; on CPU the wall time), and the wall time to the end of the device's work."""
    runner: Any = (_PlainAutocast(wl, ctx.device) if runtime == "plain" else
                   _fsdp2(ctx, wl) if runtime == "fsdp2" else _z3kit(ctx, wl))
    cuda = ctx.device.type == "cuda"
    host, device, wall = [], [], []
    for step in range(ctx.sizes.warmup + ctx.sizes.timing_steps):
        x, y = wl.batch(ctx.rank, step)
        ctx.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        t0 = time.perf_counter()
        if start is not None:
            start.record()
        runner.step(x, y)
        if end is not None:
            end.record()
        t_issued = time.perf_counter()
        ctx.synchronize()
        t_done = time.perf_counter()
        if step >= ctx.sizes.warmup:
            host.append(t_issued - t0)
            wall.append(t_done - t0)
            device.append(start.elapsed_time(end) / 1e3 if start is not None and end is not None else t_done - t0)
    peak_mem = torch.cuda.max_memory_allocated(ctx.device) if cuda else None
    del runner  # before the next runtime is built (``ctx.free`` then returns its memory)
    return {"status": "ok", "host_s": statistics.median(host), "device_s": statistics.median(device),
            "wall_s": statistics.median(wall), "peak_allocated_bytes": peak_mem}


def run(ctx: RankContext) -> JSON:
    if ctx.world != 1:
        return {}
    s = ctx.sizes
    wl = OnDevice(LlamaWorkload(config=dict(s.large), batch_size=s.large_batch, seq_len=s.large_seq), ctx.device)
    cases: JSON = {}
    for runtime in RUNTIMES:
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        try:
            cases[runtime] = time_steps(ctx, wl, runtime)
        except Exception as exc:  # noqa: BLE001 - reported, and the next runtime runs
            cases[runtime] = error_result(exc)
        ctx.free()
    return cases


def merge(per_rank: list[JSON]) -> JSON:
    return per_rank[0]  # world 1 only


def _count_params(config: dict[str, Any]) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model: nn.Module = LlamaForCausalLM(LlamaConfig(**config))
    return sum(p.numel() for p in model.parameters())


def summarize(cases: JSON, ctx: RankContext) -> JSON:
    s = ctx.sizes
    if ctx.world != 1:
        return {"note": "world 1 only: skipped at this world size"}
    params = _count_params(dict(s.large))
    tokens = s.large_batch * s.large_seq
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    peak = peak_flops(name)
    for case in cases.values():
        if case["status"] == "ok":
            case["tokens_per_s"] = tokens / case["wall_s"]
            case["mfu"] = None if peak is None else 6 * params * tokens / case["wall_s"] / peak
            # on CPU the "device time" is the wall time: nothing to be ahead of
            case["host_ahead"] = case["host_s"] < case["device_s"] if ctx.device.type == "cuda" else None
    plain = cases.get("plain", {})
    for case in cases.values():
        if case["status"] == "ok" and plain.get("status") == "ok":
            case["tokens_per_s_x_plain"] = case["tokens_per_s"] / plain["tokens_per_s"]
    failed = [rt for rt, c in cases.items() if c["status"] != "ok"]
    return {
        **({"status": "error", "error": f"runtimes that raised: {', '.join(failed)}"} if failed else {}),
        "meaningful": ctx.meaningful,
        "note": "" if ctx.meaningful else "CPU dry run: a tiny Llama on shared cores; not meaningful",
        "params": params, "batch": s.large_batch, "seq": s.large_seq, "tokens_per_step": tokens, "dtype": "bf16",
        "device": name, "peak_bf16_flops": peak,
        "peak_source": "PEAK_BF16_FLOPS (dense bf16: H100/H200 989e12, A100 312e12)",
        "warmup_steps": s.warmup, "timed_steps": s.timing_steps,
    }


LARGE: Final = Section("large", run, merge, summarize)
