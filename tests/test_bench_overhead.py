"""The overhead bench (``python -m z3kit_recipes.bench --overhead``): its slope, its pairing of
runs, its unit counts and its table, on a small real run at world 1. No timing is asserted."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from z3kit_recipes.bench.cli import build_parser
from z3kit_recipes.bench.overhead import (
    OVERHEAD_RUNTIMES, merge_processes, paired_overheads, per_module_units, slope, unit_slopes,
)
from z3kit_recipes.bench.overhead_cli import OverheadSettings, render, run_overhead
from z3kit_recipes.models import GPT, LLAMA_CONFIG, GPTConfig

SMALL_GPT = GPTConfig(vocab_size=128, width=32, n_layer=2, n_head=2, seq_len=16)
SMALL_LLAMA = {**LLAMA_CONFIG, "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 64}
#: every runtime but DeepSpeed, which would leave its global state in the shared worker pool
RUNTIMES = tuple(rt for rt in OVERHEAD_RUNTIMES if rt != "deepspeed")


def test_slope_is_the_least_squares_slope() -> None:
    assert slope([32, 96, 256], [1.0 + 2.5 * n for n in (32, 96, 256)]) == pytest.approx(2.5)
    # off the line: sum((x - 2)(y - 3)) / sum((x - 2)^2) = (-1 * -2 + 0 + 1 * 2) / 2 = 2
    assert slope([1, 2, 3], [1.0, 4.0, 5.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two distinct x"):
        slope([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="one y per x"):
        slope([1, 2], [1.0])


def test_unit_slopes_take_the_plain_cost_and_each_overhead_over_the_depths() -> None:
    def case(n: int) -> dict[str, Any]:
        return {"runtimes": {
            "plain": {"cpu_s": 1e-4 * n, "wall_s": 2e-4 * n},
            "z3kit": {"overhead_cpu_s": 0.01 + 3e-5 * n, "overhead_wall_s": 4e-5 * n},
        }}

    out = unit_slopes([case(2), case(4), case(8)], [2, 4, 8])
    assert out["plain"]["cpu_s"] == pytest.approx(1e-4) and out["plain"]["wall_s"] == pytest.approx(2e-4)
    assert out["z3kit"]["cpu_s"] == pytest.approx(3e-5) and out["z3kit"]["wall_s"] == pytest.approx(4e-5)


def test_pairs_alternate_plain_and_each_runtime() -> None:
    calls: list[str] = []

    def stepper(name: str) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            return x

        return step

    batch = (torch.zeros(1), torch.zeros(1))
    out = paired_overheads(stepper("p"), {"a": stepper("a"), "b": stepper("b")}, [batch] * 2, repeats=2, warmup=1)
    assert "".join(calls) == "pab" + "ppaappbb" * 2  # warm-up, then plain before each runtime's chunk
    assert set(out) == {"plain", "a", "b"}
    assert set(out["a"]) == {"cpu_s", "wall_s", "plain_cpu_s", "plain_wall_s", "overhead_cpu_s", "overhead_wall_s"}


def test_merged_processes_keep_each_runtime_beside_its_own_plain_torch() -> None:
    def run(rt: str, plain: float, overhead_per_block: float) -> dict[str, Any]:
        def case(n: int) -> dict[str, Any]:
            own = {"cpu_s": plain * n, "wall_s": plain * n}
            return {"depth": n, "runtimes": {"plain": own, rt: {
                "cpu_s": (plain + overhead_per_block) * n, "wall_s": (plain + overhead_per_block) * n,
                "plain_cpu_s": plain * n, "plain_wall_s": plain * n,
                "overhead_cpu_s": overhead_per_block * n, "overhead_wall_s": overhead_per_block * n, "units": n}}}

        return {"tiny": [case(2), case(4)], "gpt": case(10)}

    # a process whose runtime slowed plain torch too (3e-4 a block there, 1e-4 elsewhere)
    out = merge_processes([run("a", 1e-4, 5e-5), run("b", 3e-4, 2e-5), run("c", 1e-4, 1e-5)], [2, 4])
    assert set(out) == {"tiny", "per_block", "gpt"} and [c["depth"] for c in out["tiny"]] == [2, 4]
    assert out["per_block"]["plain"]["cpu_s"] == pytest.approx(1e-4)  # the median process's plain torch
    assert {rt: out["per_block"][rt]["cpu_s"] for rt in "abc"} == pytest.approx({"a": 5e-5, "b": 2e-5, "c": 1e-5})
    gpt = out["gpt"]["runtimes"]
    assert gpt["b"]["plain_cpu_s"] == pytest.approx(3e-3) and gpt["plain"]["cpu_s"] == pytest.approx(1e-3)
    table = render({"runtimes": ["a", "b", "c"], "results": {**out, "llama": out["gpt"]}})
    assert "| b | 20 | 0.2 (1.07x) | 0.2 (1.07x) | 4 / 10 / 10 |" in table  # b's ratio is to the plain torch it ran beside
    with pytest.raises(ValueError, match="at least one run"):
        merge_processes([], [2, 4])


def test_fsdp2_per_module_leaves_the_tied_head_to_the_root_and_shards_children_first() -> None:
    model = GPT(SMALL_GPT)
    units = per_module_units(model)
    tied = {id(model.tok_emb), id(model.lm_head)}
    assert not tied & {id(m) for m in units}
    assert all(next(m.parameters(recurse=False), None) is not None for m in units)
    order = {id(m): i for i, m in enumerate(model.modules())}
    assert [order[id(m)] for m in units] == sorted((order[id(m)] for m in units), reverse=True)


def test_overhead_options_parse() -> None:
    args = build_parser().parse_args(["--overhead", "--depths", "2,4", "--repeats", "1", "--json", "x.json"])
    assert args.overhead and args.depths == "2,4" and args.repeats == 1 and str(args.out) == "x.json"


def _small_run(ctx: WorkerContext) -> dict[str, Any]:
    settings = OverheadSettings(runtimes=RUNTIMES, depths=(2, 4), steps=2, repeats=1, warmup=1,
                                gpt=SMALL_GPT, llama=dict(SMALL_LLAMA))
    return run_overhead(settings, ctx.group)


def test_a_small_run_reports_every_runtime_its_units_and_a_table(pools: PoolSet) -> None:
    (res,) = pools.run(1, _small_run, timeout=180)
    assert [c["depth"] for c in res["tiny"]] == [2, 4]
    for case in [*res["tiny"], res["gpt"], res["llama"]]:
        figs = case["runtimes"]
        assert set(figs) == {"plain", *RUNTIMES}
        assert figs["plain"]["cpu_s"] > 0 and figs["plain"]["wall_s"] > 0
        for rt in RUNTIMES:
            assert figs[rt]["cpu_s"] > 0 and math.isfinite(figs[rt]["overhead_cpu_s"])
    for rt in ("plain", *RUNTIMES):
        assert all(math.isfinite(v) for v in res["per_block"][rt].values())
    tiny4 = res["tiny"][1]["runtimes"]
    # 4 blocks: DDP hooks no unit; FSDP2 and fsdp_blocks a group per block (one Linear each) and the root's;
    # z3kit a fetch per block (by default, as leaves, or per module) and the root's
    assert {rt: tiny4[rt]["units"] for rt in RUNTIMES} == {
        "ddp": 0, "fsdp2-block": 5, "fsdp2-module": 5, "z3kit": 5, "z3kit-per-module": 5, "z3kit-leaf": 5,
        "fsdp_blocks": 5,
    }
    gpt = res["gpt"]["runtimes"]
    # 2 blocks and the root; per module: every Linear / LayerNorm / the position embedding, the root's
    assert gpt["fsdp2-block"]["units"] == 3 and gpt["fsdp_blocks"]["units"] == 3
    assert gpt["fsdp2-module"]["units"] == len(per_module_units(GPT(SMALL_GPT))) + 1
    assert gpt["z3kit"]["units"] < gpt["z3kit-per-module"]["units"]
    table = render({"runtimes": list(RUNTIMES), "results": res})
    assert table.count("\n") == 2 + 1 + len(RUNTIMES)  # title, header, rule, plain, runtimes
    for rt in RUNTIMES:
        assert f"| {rt} |" in table
