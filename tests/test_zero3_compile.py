"""torch.compile with the zero3 runtime (``zero3.compile.compiled``), against DDP
running the same compiled model.

Each case trains one model for a few steps twice on every rank, with
``zero3.initialize`` and with DDP on a deep copy, both compiled the same way:
per block (``block.compile()``, or ``torch.compile(block)`` put into the
model) or whole (``model.compile()``, or ``torch.compile(model)``), before or
after ``initialize``. Losses must agree within 1e-5 at every step, and the
final parameters to fp32 rounding.

No recompilation: from the second compiled step on, the cases run under
``torch.compiler.set_stance("fail_on_recompile")`` (any recompilation
raises), and ``engine.stats().compile.last_step`` must count no new graph.
A counting backend proves that the engine's forward ran compiled graphs
(per block: exactly one per block call).

Backend: ``aot_eager`` (dynamo and AOTAutograd, eager kernels): it traces,
guards and splits graphs exactly as inductor does, and runs backward as
compiled graphs too, so it shows the same properties at a fraction of the
compile time (inductor needs a C++ compile per graph, seconds each on 2
cores). One case runs inductor itself; the whole Hugging Face model runs
dynamo's graphs without AOTAutograd (``counting_eager``), to halve its
compile time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.zero3_models import assert_params_match, hf_llama
from z3kit_recipes.models import GPT, GPTConfig, TinyMLP

SHARDED = {"param_persistence_threshold": 0}
STEPS = 4

#: forward graphs run through ``counting`` (on the rank's process)
GRAPH_CALLS = [0]


def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``aot_eager`` that counts each run of a compiled forward graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def fw_compiler(fw: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        run = boxed_nop(fw, inputs)

        def counted(args: list[Any]) -> Any:
            GRAPH_CALLS[0] += 1
            return run(args)

        counted._boxed_call = True  # type: ignore[attr-defined]
        return counted

    compiled: Callable[..., Any] = aot_autograd(fw_compiler=fw_compiler, bw_compiler=boxed_nop)(gm, example_inputs)
    return compiled


def counting_eager(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Dynamo's graphs run as they are (no AOTAutograd), counted."""

    def run(*args: Any) -> Any:
        GRAPH_CALLS[0] += 1
        return gm.forward(*args)

    return run


# --------------------------------------------------------------------------- #
# Workloads: a model, its blocks, its data and its loss
# --------------------------------------------------------------------------- #


def _gpt(tie_mode: str) -> nn.Module:
    return GPT(GPTConfig(vocab_size=61, width=16, n_layer=2, n_head=2, seq_len=8, tie_mode=tie_mode))  # type: ignore[arg-type]


def _token_batch(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    ids = torch.randint(0, 61, (2, 9), generator=g)
    return {"idx": ids[:, :-1].contiguous(), "tgt": ids[:, 1:].contiguous()}


def _token_loss(m: Any, b: dict[str, Any]) -> torch.Tensor:
    logits = m(b["idx"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["tgt"].reshape(-1))


def _hf_batch(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(104729 * rank + step)
    return {"ids": torch.randint(0, 128, (2, 16), generator=g)}


def _hf_loss(m: Any, b: dict[str, Any]) -> torch.Tensor:
    # no key/value cache in training: its layer index would make each layer a graph of its own
    loss: torch.Tensor = m(input_ids=b["ids"], labels=b["ids"], use_cache=False).loss
    return loss


def _mlp_batch(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(15485863 * rank + step)
    return {"x": torch.randn(6, 7, generator=g), "y": torch.randn(6, 7, generator=g)}


def _mlp_loss(m: Any, b: dict[str, Any]) -> torch.Tensor:
    return F.mse_loss(m(b["x"]), b["y"])


class _Mixer(nn.Module):
    """Owns a weight, and also uses one it is handed (the model's input projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 7) * 0.3)

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight) + F.linear(x, shared))


class _SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = _Mixer()
        self.out = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.mix(x, shared))
        return out


class _SharedNet(nn.Module):
    """Every block's inner ``_Mixer`` uses the input projection's weight: a
    parameter used outside its module, learned by the mixer's fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 7)
        self.blocks = nn.ModuleList(_SharedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, self.inp.weight)
        return x


#: name -> (build, blocks of the built model, batch(rank, step), loss(model, batch))
WORKLOADS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], nn.ModuleList], Any, Any]] = {
    # the benchmark's MLP: blocks of Linear + Tanh (a block class of its own: ``nn.Linear(...).compile()``
    # compiles nothing, since dynamo does not start a graph in torch.nn's own code)
    "mlp": (lambda: TinyMLP(depth=3, width=7), lambda m: m.blocks, _mlp_batch, _mlp_loss),
    "gpt": (lambda: _gpt("hf"), lambda m: m.blocks, _token_batch, _token_loss),
    # the root reads the token embedding's weight (F.linear): a parameter used outside its module
    "gpt_functional": (lambda: _gpt("functional"), lambda m: m.blocks, _token_batch, _token_loss),
    "hf_llama": (hf_llama, lambda m: m.model.layers, _hf_batch, _hf_loss),
    "shared": (_SharedNet, lambda m: m.blocks, _mlp_batch, _mlp_loss),
}


def compile_model(model: nn.Module, blocks: nn.ModuleList, how: str, backend: Any) -> nn.Module:
    """``model`` compiled ``how``; the model to use (a wrapper for ``torch.compile(model)``)."""
    if how == "block":
        for block in blocks:
            block.compile(backend=backend)
    elif how == "block_wrapper":
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], backend=backend)
    elif how == "whole":
        model.compile(backend=backend)
    elif how == "whole_wrapper":
        wrapped: nn.Module = torch.compile(model, backend=backend)  # type: ignore[assignment]
        return wrapped
    else:
        raise ValueError(how)
    return model


def run_compiled(
    ctx: Any, workload: str, how: str, *, after_initialize: bool = False, backend: str = "counting",
    eager_steps: tuple[int, ...] = (0,), evaluate: bool = False, compile_at_step: int = 0,
) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch._dynamo.reset()  # a fresh compile cache (and recompile limits) for every case
    chosen: Any = {"counting": counting, "counting_eager": counting_eager}.get(backend, backend)
    build, blocks_of, batch, loss_fn = WORKLOADS[workload]
    torch.manual_seed(1000)
    model = build()
    ref = copy.deepcopy(model)
    ref = compile_model(ref, blocks_of(ref), how, chosen)
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    if not after_initialize:
        model = compile_model(model, blocks_of(model), how, chosen)
    engine = zero3.initialize(model, lambda p: torch.optim.Adam(p, lr=1e-2), zero3.Zero3Config(**SHARDED), ctx.group)
    if after_initialize and not compile_at_step:
        compile_model(engine.module, blocks_of(engine.module), how, chosen)
    elif compile_at_step:
        assert after_initialize
    losses, ref_losses, graph_calls, compile_stats = [], [], [], []
    warm = max(eager_steps) + 2  # the first compiled step after the last eager one compiles
    for step in range(warm + STEPS - 2):
        if compile_at_step and step == compile_at_step:  # after some steps without compile
            compile_model(engine.module, blocks_of(engine.module), how, chosen)
        b = batch(ctx.rank, step)
        stance = torch.compiler.set_stance("fail_on_recompile" if step >= warm else "default")
        with stance:
            before = GRAPH_CALLS[0]
            loss = loss_fn(engine, b)
            graph_calls.append(GRAPH_CALLS[0] - before)
            engine.backward(loss)
            engine.step()
            ref_loss = loss_fn(ddp, b)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
        compile_stats.append(engine.stats().compile)
    evals: list[tuple[float, float]] = []
    if evaluate:  # no_grad forwards in eval mode: the first learns eagerly, the second runs compiled
        engine.eval()
        ref.eval()
        with torch.no_grad():
            for step in range(2):
                b = batch(ctx.rank, 100 + step)
                evals.append((float(loss_fn(engine, b)), float(loss_fn(ref, b))))
        engine.train()
    strip = "_orig_mod."
    return {
        "evals": evals,
        "eval_stats": engine.stats().compile,
        "losses": losses,
        "ref_losses": ref_losses,
        "graph_calls": graph_calls,
        "compile": compile_stats,
        "blocks": len(blocks_of(ref)),
        "eager_steps": eager_steps,
        "params": {n.replace(strip, ""): t for n, t in engine.full_state_dict().items()},
        "ref_params": {n.replace(strip, ""): p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)},
    }


def check(results: list[dict[str, Any]], how: str, backend_counts: bool = True) -> None:
    for rank, r in enumerate(results):
        got, want = torch.tensor(r["losses"], dtype=torch.float64), torch.tensor(r["ref_losses"], dtype=torch.float64)
        assert (got - want).abs().max().item() <= 1e-5, f"rank {rank}: losses {r['losses']} != DDP's {r['ref_losses']}"
        # Adam turns last-bit differences of near-zero gradients (reduced in another order) into more
        assert_params_match(r["params"], r["ref_params"], rtol=1e-4, atol=1e-5)
        for got_eval, want_eval in r["evals"]:
            assert abs(got_eval - want_eval) <= 1e-5, r["evals"]
        if r["evals"]:
            assert r["eval_stats"].eager_forwards == len(r["eager_steps"]) + 1
        stats = r["compile"]
        assert all(s is not None for s in stats), "engine.stats().compile is None although the model is compiled"
        eager = r["eager_steps"]
        for s in stats[max(eager) + 2:]:
            assert s.last_step.graphs == 0 and s.last_step.recompiles == 0, s
        # the steps that record a trace learn parameter uses eagerly; the others run compiled graphs
        assert stats[-1].eager_forwards == len(eager)
        calls = r["graph_calls"]
        if backend_counts:
            assert [calls[i] for i in eager] == [0] * len(eager), calls
            calls = [c for i, c in enumerate(calls) if i not in eager]
        if how.startswith("block"):
            assert len(stats[-1].units) == r["blocks"]
            assert stats[-1].total.graph_breaks == 0, stats[-1]
            if backend_counts:
                assert calls == [r["blocks"]] * len(calls), calls
        else:
            assert stats[-1].whole_model
            if backend_counts:
                assert calls[0] >= 1 and len(set(calls)) == 1, calls


PARITY = [
    # (workload, how, world); per block at world 1: test_inductor_per_block
    ("mlp", "block", 2), ("mlp", "whole", 1), ("mlp", "whole", 2),
    ("gpt", "block", 2), ("gpt", "whole", 2),
    # torch.compile(model) before initialize: the case that failed with "already tracked for mutation"
    ("hf_llama", "block", 2), ("hf_llama", "whole_wrapper", 1),
]


@pytest.mark.parametrize("workload, how, world", PARITY, ids=["-".join(map(str, p)) for p in PARITY])
def test_compiled_parity(pools: Any, workload: str, how: str, world: int) -> None:
    # the whole Hugging Face model is many graphs: dynamo's alone (no AOTAutograd) take half the time
    backend = "counting_eager" if workload == "hf_llama" and how.startswith("whole") else "counting"
    evaluate = workload == "mlp"
    check(pools.run(world, run_compiled, workload, how, backend=backend, evaluate=evaluate, timeout=120), how)


@pytest.mark.parametrize(
    "how, after",
    [("block_wrapper", False), ("whole_wrapper", False), ("block", True), ("whole", True)],
    ids=["torch.compile(block)", "torch.compile(model)", "block.compile()-after-initialize",
         "model.compile()-after-initialize"],
)
def test_compile_variants(pools: Any, how: str, after: bool) -> None:
    check(pools.run(2, run_compiled, "mlp", how, after_initialize=after, timeout=120), how)


def test_parameter_used_outside_its_module(pools: Any) -> None:
    """The root reads the token embedding's weight inside the compiled model:
    learned in the eager first step, gathered with the root from then on.
    The root's fetch changed, so the trace of step 0 is dropped in step 1
    and recorded again, eagerly, in step 2."""
    check(pools.run(2, run_compiled, "gpt_functional", "whole", eager_steps=(0, 2), timeout=120), "whole")


def test_blocks_compiled_after_training_keep_what_their_modules_learned(pools: Any) -> None:
    """Two steps without compile: each block's mixer learns that it uses the
    input projection's weight. Then the blocks are compiled: each becomes one
    unit that fetches the mixer's learned parameter too, so one eager step
    (recording the trace of the new units) is enough; a unit that had to
    learn it again would change its fetch and need a second one."""
    results = pools.run(
        2, run_compiled, "shared", "block", after_initialize=True, compile_at_step=2, eager_steps=(2,), timeout=120
    )
    for r in results:
        r["compile"] = r["compile"][2:]  # nothing is compiled before step 2
        r["graph_calls"] = r["graph_calls"][2:]
        r["eager_steps"] = (0,)
    check(results, "block")


def test_inductor_per_block(pools: Any) -> None:
    """Inductor's own kernels, per block, at parity with DDP running them too."""
    check(pools.run(1, run_compiled, "mlp", "block", backend="inductor", timeout=180), "block", backend_counts=False)
