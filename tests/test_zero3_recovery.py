"""After a rank fails: the process stays usable, the broken engine refuses
everything at once, and a new engine resumes from the last checkpoint.

The engine runs its collectives on a group of its own, made at
initialize over the same ranks (``zero3.ranks.topology``, "the engine's own
group"). A failure leaves collectives on that group that will never pair;
the user's default group stays paired (their metrics all-reduce in an
``except`` gives the right value), and ``zero3.initialize`` again makes a
new group, so ``load_checkpoint`` on the new engine resumes the run as if
nothing had happened. Gloo, 2 and 4 ranks, processes of their own: a test
that fails here may leave its processes' default group broken.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import DistPool
from tests.zero3_models import MLP, vec_batch

FAIL_AT = 2  # the step in whose forward rank 1 raises; a checkpoint was saved after step FAIL_AT - 1
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(7)
    return MLP()


def _engine() -> Any:
    from z3kit_recipes import zero3

    return zero3.initialize(_model(), torch.optim.Adam, zero3.Zero3Config(param_persistence_threshold=0))


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        b = vec_batch(rank, step, 0, 0)
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()


def _raise_bad_batch(module: nn.Module, args: Any) -> None:
    raise ValueError("this batch is corrupt")


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(path)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.rglob("*"))
            if f.is_file()}


def _refusals(engine: Any, rank: int, path: str) -> dict[str, tuple[str, float]]:
    """Every public call of a broken engine: what it raised and how long it took."""
    b = vec_batch(rank, FAIL_AT, 0, 0)
    with torch.no_grad():
        loss = F.mse_loss(nn.Linear(7, 5)(b["x"]), b["y"]).requires_grad_()

    def gathered() -> None:
        with engine.gathered_parameters():
            pass

    calls = {
        "forward": lambda: engine(b["x"]),
        "backward": lambda: engine.backward(loss),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(path, "after")),
        "load_checkpoint": lambda: engine.load_checkpoint(os.path.join(path, "before")),
        "full_state_dict": engine.full_state_dict,
        "gathered_parameters": gathered,
    }
    out = {}
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
            caught = "no error"
        except Exception as e:  # noqa: BLE001 - reported by type and message
            caught = f"{type(e).__name__}: {e}"
        out[name] = (caught, time.monotonic() - start)
    return out


def run_fail_and_resume(ctx: Any, path: str) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world
    out: dict[str, Any] = {}
    engine = _engine()
    _train(engine, rank, range(FAIL_AT))
    engine.save_checkpoint(os.path.join(path, "before"))
    dist.barrier()  # on the user's group: every rank's files are written
    out["files"] = _listing(Path(path))
    if rank == 1:
        engine.module.layers[1].register_forward_pre_hook(_raise_bad_batch)
    try:
        _train(engine, rank, range(FAIL_AT, FAIL_AT + 1))
        out["caught"] = "no error"
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        out["caught"] = f"{type(e).__name__}: {e}"
    # the user's own error handling, on the default group: pairs with the other ranks' only
    metric = torch.full((3,), float(rank + 1))
    dist.all_reduce(metric)
    out["metric"] = metric.tolist()
    out["expected_metric"] = [float(sum(range(1, world + 1)))] * 3
    out["refused"] = _refusals(engine, rank, path)
    dist.barrier()
    out["files_after"] = _listing(Path(path))
    # a new engine in the same process resumes from the checkpoint
    resumed = _engine()
    resumed.load_checkpoint(os.path.join(path, "before"))
    _train(resumed, rank, range(FAIL_AT, STEPS))
    got = resumed.full_state_dict()
    # the same run with nothing failing
    straight = _engine()
    _train(straight, rank, range(STEPS))
    want = straight.full_state_dict()
    out["same"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    out["moved"] = any(not torch.equal(got[k], v) for k, v in _model().state_dict().items())
    return out


@contextlib.contextmanager
def _pool(world: int) -> Iterator[DistPool]:
    pool = DistPool(world)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("world", [2, 4])
def test_a_new_engine_resumes_after_a_rank_failed_and_the_default_group_stays_usable(world: int, tmp_path: Path) -> None:
    with _pool(world) as pool:
        results = pool.run(run_fail_and_resume, str(tmp_path), timeout=240)
    assert results[1]["caught"].startswith("ValueError: this batch is corrupt"), results[1]
    for rank, r in enumerate(results):
        if rank != 1:
            assert r["caught"].startswith("RankFailed") and "rank 1 forward raised ValueError" in r["caught"], r
        assert r["metric"] == r["expected_metric"], (rank, r["metric"])
        for name, (caught, seconds) in r["refused"].items():
            assert caught.startswith("RankFailed") and "refused" in caught, (rank, name, caught)
            assert "rank 1 forward raised ValueError" in caught, (rank, name, caught)
            assert "with a new engine" in caught and "load_checkpoint" in caught, (rank, name, caught)
            assert seconds < 1.0, (rank, name, seconds)
        assert r["files_after"] == r["files"], rank  # nothing written, nothing lost
        assert r["same"] is True, rank
        assert r["moved"] is True, rank
