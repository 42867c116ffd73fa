"""Fetch units (``zero3.training.unit_rule``): a subtree gathered on entry and
released together, with one hook pair for the whole subtree.

The rule is checked on models as they are (no process group): the blocks
of each stack by default, DeepSpeed's granularity rule, units named by
class or instance, leaf units kept whole, and a split that fits the live
limit. Training with units is at DDP parity and needs fewer gathers than a
fetch per module.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from tests.zero3_models import Case, MoE, MoEModel, assert_pair, hf_llama, train_pair
from z3kit_recipes.models import GPT, GPTConfig
from z3kit_recipes.zero3.training.unit_rule import choose_units

BIG = 10**12


def _names(model: nn.Module, roots: tuple[nn.Module, ...]) -> list[str]:
    names = {m: n for n, m in model.named_modules()}
    return [names[m] for m in roots]


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, width=16, n_layer=3, n_head=2, seq_len=8))


def test_auto_makes_each_block_of_a_stack_a_unit() -> None:
    gpt = _gpt()
    assert _names(gpt, choose_units(gpt, "auto", [], granularity_threshold=0, max_live_parameters=BIG).roots) == [
        "blocks.0", "blocks.1", "blocks.2"]
    llama = hf_llama()
    assert _names(llama, choose_units(llama, "auto", [], granularity_threshold=0, max_live_parameters=BIG).roots) == [
        "model.layers.0", "model.layers.1"]


def test_a_stack_of_single_modules_or_of_containers_adds_no_unit() -> None:
    """A unit must save hooks: a Linear is already one fetch, and containers are looked into."""
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert choose_units(flat, "auto", [], granularity_threshold=0, max_live_parameters=BIG).roots == ()
    nested = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    assert choose_units(nested, "auto", [], granularity_threshold=0, max_live_parameters=BIG).roots == ()


def test_named_units_and_per_module() -> None:
    gpt = _gpt()
    by_class = choose_units(gpt, [type(gpt.blocks[0].attn)], [], granularity_threshold=0, max_live_parameters=BIG)
    assert _names(gpt, by_class.roots) == [f"blocks.{i}.attn" for i in range(3)]
    by_instance = choose_units(gpt, [gpt.blocks[1]], [], granularity_threshold=0, max_live_parameters=BIG)
    assert _names(gpt, by_instance.roots) == ["blocks.1"]
    assert choose_units(gpt, (), [], granularity_threshold=0, max_live_parameters=BIG).roots == ()
    with pytest.raises(ValueError, match="matches no module"):
        choose_units(gpt, [nn.Conv2d], [], granularity_threshold=0, max_live_parameters=BIG)
    with pytest.raises(ValueError, match="pass one"):
        choose_units(gpt, [nn.Linear], [], granularity_threshold=10, max_live_parameters=BIG)
    with pytest.raises(TypeError, match="classes or instances"):
        choose_units(gpt, ["blocks"], [], granularity_threshold=0, max_live_parameters=BIG)  # type: ignore[list-item]


def test_a_unit_too_large_for_the_live_limit_is_split_and_reported() -> None:
    gpt = _gpt()
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    attn = sum(p.numel() for p in gpt.blocks[0].attn.parameters())
    choice = choose_units(gpt, "auto", [], granularity_threshold=0, max_live_parameters=block - 1)
    assert attn <= block - 1
    assert all(not n.startswith("blocks.0") or n.count(".") == 2 for n in _names(gpt, choice.roots))
    assert "blocks.0" not in _names(gpt, choice.roots)
    assert len(choice.splits) == 3 and choice.splits[0] == f"blocks.0 ({block:,} elements)"
    assert "max_live_parameters" in choice.notes()[0]


def test_a_unit_never_holds_a_leaf_module() -> None:
    model = MoEModel()
    leaves = [m for m in model.modules() if isinstance(m, MoE)]
    choice = choose_units(model, [type(model)], leaves, granularity_threshold=0, max_live_parameters=BIG)
    inside = {x for r in choice.roots for x in r.modules()}
    assert not any(leaf in inside for leaf in leaves)


def test_deepspeeds_granularity_rule() -> None:
    """Granularity = subtree elements // (modules with parameters in it, the module itself counted, containers
    not): DeepSpeed's ``_get_granularity_recursively``. The outermost at or below the threshold is a unit."""
    gpt = _gpt()
    block = gpt.blocks[0]
    # a GPT block: two LayerNorms, attention (two Linears) and an MLP (two Linears); each non-leaf module counts
    layers = sum(1 for m in block.modules() if next(m.parameters(), None) is not None
                 and not isinstance(m, (nn.ModuleList, nn.Sequential)))
    granularity = sum(p.numel() for p in block.parameters()) // layers
    at = choose_units(gpt, "auto", [], granularity_threshold=granularity, max_live_parameters=BIG)
    assert _names(gpt, at.roots) == ["blocks.0", "blocks.1", "blocks.2"]
    below = choose_units(gpt, "auto", [], granularity_threshold=granularity - 1, max_live_parameters=BIG)
    assert "blocks.0" not in _names(gpt, below.roots)


def _units_and_gathers(ctx: Any, workload: str, units: Any) -> Any:
    # no prefetch: every fetch is a gather of its own, so the gathers count the fetches
    case = Case(workload, {"param_persistence_threshold": 0, "prefetch_bucket_size": 0}, steps=3)
    result = train_pair(ctx, case, fetch_units=units)
    return result, result.stats.fetch_units, result.stats.collectives["all_gather"]["calls"]


@pytest.mark.parametrize("workload", ["hf_llama", "gpt_hf"])
def test_units_train_at_ddp_parity_with_fewer_gathers(pools: Any, workload: str) -> None:
    auto = pools.run(2, _units_and_gathers, workload, "auto")
    per_module = pools.run(2, _units_and_gathers, workload, ())
    assert_pair([r for r, _, _ in auto])
    assert_pair([r for r, _, _ in per_module])
    for (_, units, gathers), (_, modules, module_gathers) in zip(auto, per_module):
        assert units < modules and gathers < module_gathers
    if workload == "hf_llama":  # the root, the embedding, two decoder layers, the final norm and the head
        assert auto[0][1] == 6


def test_a_stack_of_stacks_gets_a_unit_per_block() -> None:
    """T5's encoder and decoder are two of one class: the units are their blocks, not the stacks."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=2,
                                             num_decoder_layers=2, num_heads=2, decoder_start_token_id=0))
    roots = choose_units(t5, "auto", [], granularity_threshold=0, max_live_parameters=BIG).roots
    assert _names(t5, roots) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


def test_each_gradient_has_one_hand_over() -> None:
    """A parameter one module fetches goes over with that module's post-backward; one that two fetch (it
    joined another unit) gets a hook of its own, and keeps it; a leaf unit's parameters are the unit's."""
    from z3kit_recipes.zero3.training.fetch_units import FetchUnits
    from z3kit_recipes.zero3.training.grad_owners import GradOwners

    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    a, b, leaf = root[0], root[1], root[2]
    units = FetchUnits({root: [], a: [0, 1], b: [2, 3], leaf: [4, 5]}, [4, 2, 4, 2, 4, 2])
    owners = GradOwners(units, frozenset({4, 5}))
    assert owners.add_trainable([0, 1, 2, 3, 4, 5]) == []
    assert owners.by_module[a] == [0, 1] and owners.by_module[leaf] == [] and owners.module_handed == [0, 1, 2, 3]
    units.join(b, 0)  # b uses a's weight: only a hook sees when both contributions are in
    assert owners.sync() == [0]
    assert owners.by_module[a] == [1] and owners.by_module[b] == [2, 3] and owners.module_handed == [1, 2, 3]
    assert owners.sync() == []  # nothing changed since
    units.regroup({root: [], a: [0, 1], b: [2, 3], leaf: [4, 5]})
    assert owners.sync() == [] and owners.by_module[a] == [1]  # a hooked parameter keeps its hook
