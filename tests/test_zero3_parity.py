"""Parity of the stock zero3 runtime with torch DDP, on gloo.

Each case trains one model (``tests/zero3_models.py``) for ten or more
optimizer steps twice, side by side on every rank: with
``zero3.initialize`` and with ``DistributedDataParallel`` on a deep copy of
the same initial model, on the same rank-local data and with the same
optimizer. Losses at every micro-step and the final full parameters must
agree to fp32 rounding (``rtol=1e-5, atol=1e-6``); bf16 compute (fp32
masters) must stay within bf16 tolerance of the fp32 DDP run.

Core cases run at world sizes 1, 2 and 4, the rest at 2. Most cases use
``param_persistence_threshold=0`` so that every parameter is really
sharded; one uses the default (everything persistent at these sizes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.zero3_models import Case, FrozenModel, PairResult, assert_pair, rel_norm_error, train_pair

SHARDED = {"param_persistence_threshold": 0}


def run_case(ctx: Any, case: Case) -> PairResult:
    return train_pair(ctx, case)


def run_world(pools: Any, world: int, case: Case) -> list[PairResult]:
    results = pools.run(world, run_case, case)
    assert len(results) == world
    return results


def assert_sharded(results: list[PairResult], world: int) -> None:
    """The engine really sharded the model (the comparison is not of two
    replicated runs): 1/N of the elements resident, nothing persistent."""
    stats = results[0].stats
    if world > 1:
        assert stats.resident_param_numel < stats.model_numel
    assert results[0].persistent_numel == 0
    assert all(g == 0 for r in results for g in r.gathered_after_step)


# --------------------------------------------------------------------------- #
# Core cases: world sizes 1, 2, 4
# --------------------------------------------------------------------------- #

CORE = {
    "mlp": Case("mlp", SHARDED),
    "transformer_tied_hf": Case("gpt_hf", SHARDED, optimizer="adamw"),
    "transformer_tied_functional": Case("gpt_functional", SHARDED, optimizer="adamw"),
    # experts without tokens on a rank (and at world 1 and 2 on every rank) each step
    "moe_leaf": Case("moe", SHARDED, find_unused=True, leaf=("MoE",)),
}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(CORE))
def test_core_parity(pools: Any, name: str, world: int) -> None:
    results = run_world(pools, world, CORE[name])
    assert_pair(results)
    assert_sharded(results, world)
    assert all(r.stepped == [True] * 10 for r in results)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradient_accumulation(pools: Any, world: int) -> None:
    """Four micro-steps per optimizer step: step() is True only at the
    boundary; the engine gets undivided losses, DDP losses / 4 under no_sync."""
    case = Case("mlp", {**SHARDED, "gradient_accumulation_steps": 4}, accumulation=4, steps=10)
    results = run_world(pools, world, case)
    assert_pair(results)
    for r in results:
        assert r.stepped == [False, False, False, True] * 10
        assert r.stats.global_step == 10 and r.stats.micro_step == 40


# --------------------------------------------------------------------------- #
# Model features: world size 2
# --------------------------------------------------------------------------- #

FEATURES = {
    "layer_reuse": Case("reuse", SHARDED),
    "branch": Case("branch", SHARDED, find_unused=True, steps=12),
    "frozen": Case("frozen", SHARDED),
    "param_unused_some_steps": Case("unused", SHARDED, find_unused=True),
    "checkpoint_reentrant": Case("ckpt_reentrant", SHARDED),
    "checkpoint_nonreentrant": Case("ckpt_nonreentrant", SHARDED),
    "returns_its_parameter": Case("returns_param", SHARDED),
    "parent_with_params": Case("parent", SHARDED),
    "two_forwards_one_backward": Case("mlp", SHARDED, forwards=2),
    "adamw": Case("mlp", SHARDED, optimizer="adamw"),
    "default_persistence": Case("gpt_hf", {}, optimizer="adamw"),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_parity(pools: Any, name: str) -> None:
    case = FEATURES[name]
    results = run_world(pools, 2, case)
    assert_pair(results)
    stats = results[0].stats
    if name == "default_persistence":
        # everything is under the default threshold: gathered once and kept
        assert results[0].persistent_numel == stats.model_numel
        # (in flight again after each step with overlap_comm: see the behaviour suite)
        assert stats.live_numel == stats.model_numel
    else:
        assert_sharded(results, 2)
    if name == "branch":
        # the branch is taken on steps 2, 5, 8, 11: each one breaks the frozen trace
        assert stats.trace_invalidations >= 3
    if name == "frozen":
        # frozen parameters have no gradient partition, and keep their initial values
        assert stats.resident_grad_numel < stats.resident_param_numel
        torch.manual_seed(1000 + case.seed)
        initial = {n: p.detach() for n, p in FrozenModel().named_parameters()}
        final = results[0].engine_params
        for frozen in ("mlp.layers.0.weight", "mlp.layers.0.bias", "mlp.layers.1.bias"):
            assert torch.equal(final[frozen], initial[frozen]), frozen
        assert not torch.equal(final["mlp.layers.1.weight"], initial["mlp.layers.1.weight"])


@pytest.mark.parametrize("world", [2, 4])
def test_sizes_not_divisible_by_world(pools: Any, world: int) -> None:
    """Linear(7, 5) and parameters smaller than the world size (a bias of 1 element)."""
    results = run_world(pools, world, Case("odd", SHARDED))
    assert_pair(results)
    sizes = [p.numel() for p in results[0].engine_params.values()]
    assert 35 in sizes and any(n < world for n in sizes)
    assert_sharded(results, world)


@pytest.mark.parametrize("bucket", [8, 500_000_000], ids=["smaller_than_a_param", "larger_than_model"])
def test_reduce_bucket_size(pools: Any, bucket: int) -> None:
    results = run_world(pools, 2, Case("gpt_hf", {**SHARDED, "reduce_bucket_size": bucket}))
    assert_pair(results)
    calls = results[0].stats.collectives["all_reduce"]["calls"]
    if bucket == 8:
        # every gradient is bigger than the bucket: one reduction each
        assert calls >= 10
    else:
        assert calls == 1


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_overlap_and_contiguous_gradients(pools: Any, overlap: bool, contiguous: bool) -> None:
    config = {**SHARDED, "overlap_comm": overlap, "contiguous_gradients": contiguous}
    assert_pair(run_world(pools, 2, Case("gpt_functional", config)))


def test_gradient_clipping(pools: Any) -> None:
    results = run_world(pools, 2, Case("mlp", {**SHARDED, "gradient_clipping": 0.5}, clip=0.5))
    assert_pair(results)
    for r in results:
        # clipping was active (the global norm exceeded the limit on some step), and the
        # engine's pre-clip norm is the one clip_grad_norm_ computed over the full gradients
        assert max(r.ddp_norms) > 0.5
        assert all(n is not None for n in r.engine_norms)
        torch.testing.assert_close(
            torch.tensor(r.engine_norms, dtype=torch.float64), torch.tensor(r.ddp_norms, dtype=torch.float64),
            rtol=1e-5, atol=1e-6,
        )


def test_gradient_clipping_with_accumulation(pools: Any) -> None:
    """The norm is taken over the gradient accumulated across four micro-steps."""
    config = {**SHARDED, "gradient_clipping": 0.25, "gradient_accumulation_steps": 4}
    results = run_world(pools, 2, Case("mlp", config, clip=0.25, accumulation=4))
    assert_pair(results)
    for r in results:
        assert max(r.ddp_norms) > 0.25
        torch.testing.assert_close(
            torch.tensor(r.engine_norms, dtype=torch.float64), torch.tensor(r.ddp_norms, dtype=torch.float64),
            rtol=1e-5, atol=1e-6,
        )


# --------------------------------------------------------------------------- #
# bf16 compute, fp32 masters
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("workload", ["mlp", "gpt_hf"])
def test_bf16_compute_close_to_fp32(pools: Any, workload: str) -> None:
    """The DDP side of the pair trains in fp32: the bf16 engine's losses stay
    within bf16 tolerance of it, and so do its parameters."""
    results = run_world(pools, 2, Case(workload, {**SHARDED, "compute_dtype": "bf16"}))
    for r in results:
        got = torch.tensor(r.engine_losses, dtype=torch.float64)
        want = torch.tensor(r.ddp_losses, dtype=torch.float64)
        rel = ((got - want).abs() / want.abs()).max().item()
        assert rel <= 3e-2, f"bf16 losses differ from fp32 by {rel:.3g} (relative)"
        assert rel > 0, "bf16 losses equal the fp32 ones exactly: was bf16 compute used at all?"
        assert rel_norm_error(r.engine_params, r.ddp_params) <= 3e-2
        # separate fp32 master shards exist (in fp32 the shards are the masters)
        assert r.stats.resident_master_numel > 0


# --------------------------------------------------------------------------- #
# Unmodified Hugging Face models (random weights, nothing downloaded)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("workload", ["hf_gpt2", "hf_llama"])
def test_huggingface_model(pools: Any, workload: str) -> None:
    pytest.importorskip("transformers")
    results = run_world(pools, 2, Case(workload, SHARDED, lr=3e-3))
    assert_pair(results)
    assert_sharded(results, 2)
    if workload == "hf_gpt2":
        # tied embeddings: one parameter, under both names as in the plain model's state_dict
        params = results[0].engine_params
        assert params["lm_head.weight"] is params["transformer.wte.weight"]
