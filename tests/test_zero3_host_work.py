"""The host work of a training step, counted, not timed (``z3kit.host_work``).

A ZeRO-3 runtime's time on the host is the work in its hooks times the
units it hooks. These counts pin that work for the bench's GPT and Llama
(``z3kit_recipes.models``), at one and two ranks, with the default config
(fetch units: one per block): the Python hooks torch calls into the engine,
the autograd Functions it applies, its ``__torch_function__`` calls, and
the collectives. A change that adds host work per module or per
parameter changes them, on any machine, without a timing.

When a change alters them on purpose, say why in its commit and update
the figures here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

from tests.dist_pool import WorkerContext
from z3kit_recipes import zero3
from z3kit_recipes.models import LLAMA_CONFIG, LlamaWorkload, Workload, make_workload

#: the bench's Llama at a twelfth of its width: the same modules, parameters and ops, in a second a step less
NARROW_LLAMA = {**LLAMA_CONFIG, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                "num_attention_heads": 4, "num_key_value_heads": 2}


#: every way torch lets code hook a module or a tensor: (owner, name, whether it is a method taking self first)
_REGISTRATIONS = [
    *((torch.nn.Module, name, True) for name in ("register_forward_pre_hook", "register_forward_hook",
                                                 "register_full_backward_pre_hook", "register_full_backward_hook")),
    (torch.Tensor, "register_hook", True),
    (torch.Tensor, "register_post_accumulate_grad_hook", True),
    *((torch.nn.modules.module, name, False) for name in (
        "register_module_forward_pre_hook", "register_module_forward_hook",
        "register_module_full_backward_pre_hook", "register_module_full_backward_hook")),
]


@contextlib.contextmanager
def hook_calls_counted() -> Iterator[list[int]]:
    """Counts the calls of every module and tensor hook registered inside it, whoever registers them
    and whether or not the engine counts them itself: a hook added per module anywhere shows here."""
    calls = [0]

    def counting(register: Any, method: bool) -> Any:
        @functools.wraps(register)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            at = 1 if method else 0  # the hook follows the module or tensor
            hook = args[at]

            @functools.wraps(hook)
            def counted(*hook_args: Any, **hook_kwargs: Any) -> Any:
                calls[0] += 1
                return hook(*hook_args, **hook_kwargs)

            return register(*args[:at], counted, *args[at + 1:], **kwargs)

        return wrapped

    with contextlib.ExitStack() as stack:
        for owner, name, method in _REGISTRATIONS:
            stack.enter_context(mock.patch.object(owner, name, counting(getattr(owner, name), method)))
        yield calls


def _counts(ctx: WorkerContext, name: str) -> dict[str, Any]:
    workload: Workload = make_workload("gpt") if name == "gpt" else LlamaWorkload(config=NARROW_LLAMA)
    with hook_calls_counted() as hook_calls:
        engine = zero3.initialize(workload.build_model(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), None, ctx.group)
        for step in range(2):  # the first records the trace; the second is a steady step
            hook_calls[0] = 0
            x, y = workload.batch(ctx.rank, step)
            engine.backward(workload.loss(engine(x), y))
            engine.step()
    stats = engine.stats()
    model = engine.module
    return {
        "fetch_units": stats.fetch_units,
        "parameters": sum(1 for _ in model.parameters()),
        **stats.host_work,
        "torch_hook_calls": hook_calls[0],
    }


#: (workload, world) -> the last step's counts. The hooks: a pre- and post-forward per fetch unit (13 x 2 on the GPT,
#: 12 x 2 on the Llama), a pre-backward per unit (a pre-hook on its output's node), one post-backward from the one
#: call whose input is no chained unit's output (13 + 1, 12 + 1: ``z3kit.hooks``' Note on chains), and a
#: gradient-ready hook per parameter that two units fetch (the GPT's tied embedding and head: 1); every other
#: gradient goes over with its unit's post-backward (``zero3.training.grad_owners``). Functions: that one call's
#: ``_PostBackward`` and the root's ``_PreBackward`` (it returns the head's output as it is). Torch hook calls:
#: every module and tensor hook torch called, counted from outside the engine (``hook_calls_counted``; torch offers
#: no way to wrap a node's pre-hooks from outside, which the engine's own ``hooks`` count): the units' forward
#: pairs, the root's pair and its three other forward hooks (backward-once, uneven batches), the tied gradient's
#: hook (GPT: 26 + 2 + 3 + 1; Llama: 24 + 2 + 3).
_GPT = {"fetch_units": 13, "parameters": 100, "hooks": 41, "functions": 2, "torch_functions": 176,
        "torch_hook_calls": 32}
_LLAMA = {"fetch_units": 12, "parameters": 75, "hooks": 37, "functions": 2, "torch_functions": 591,
          "torch_hook_calls": 29}
EXPECTED: dict[tuple[str, int], dict[str, int]] = {
    # one rank: none (a gather only points each parameter at its shard: z3kit.shard's Note at world 1)
    ("gpt", 1): {**_GPT, "collectives": 0},
    ("llama", 1): {**_LLAMA, "collectives": 0},
    # two ranks: the gradient buckets' reductions and the rank checks on top
    ("gpt", 2): {**_GPT, "collectives": 15},
    ("llama", 2): {**_LLAMA, "collectives": 3},
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_host_work_per_step_is_pinned(pools: Any, name: str, world: int) -> None:
    counts = pools.run(world, _counts, name)
    assert counts[0] == counts[-1]  # every rank does the same work
    assert counts[0] == EXPECTED[(name, world)]
