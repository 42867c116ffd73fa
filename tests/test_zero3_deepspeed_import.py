"""DeepSpeed ZeRO-3 checkpoints into z3kit engines (gloo): a real DeepSpeed
run on two ranks saves a checkpoint; engines of 1, 2 and 4 ranks load it and
must hold DeepSpeed's fp32 parameters and Adam state bit for bit, then train
on as DeepSpeed does.

DeepSpeed runs in a private pair of processes, closed after it: it leaves
process-wide state (its communication backend, accelerator, loggers) in the
ranks that ran it, which the session's shared pools must not inherit. The
z3kit loads run in the session's pools with ``deepspeed`` made unimportable,
which shows that the reader does not need it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.errors import error_of, unchanged

if importlib.util.find_spec("deepspeed") is None:
    print("test_zero3_deepspeed_import: skipped, deepspeed is not installed")
    pytest.skip("deepspeed is not installed", allow_module_level=True)

GLOBAL_BATCH, SEQ, VOCAB = 12, 4, 11  # 12 rows split evenly over 1, 2, 3, 4 ranks
SAVED_STEPS = 2
LR, DECAY = 1e-2, 1e-2
#: DeepSpeed's second param group: biases, the gain, the buffer-like frozen row
NO_DECAY = ("a.bias", "b.bias", "gain")
NO_DECAY_LR = 5e-3
#: flat groups of at most this many elements: the trainable parameters span several
SUB_GROUP_SIZE = 60


class Net(nn.Module):
    """Tied embedding and head, sizes not divisible by 2 or 4, a one-element
    parameter, a frozen parameter and a persistent buffer."""

    def __init__(self, b_out: int = 5, extra: bool = False, gain: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 7)
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, b_out)
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        # shape (1,), not (): DeepSpeed 0.19's _broadcast_model cannot view a 0-dim tensor as bytes
        self.gain = nn.Parameter(torch.tensor([1.3])) if gain else None
        self.frozen = nn.Parameter(torch.linspace(-1.0, 1.0, b_out), requires_grad=False)
        self.extra = nn.Parameter(torch.ones(3)) if extra else None
        self.register_buffer("scale", torch.tensor([0.5, 3.0]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        y = self.b(torch.tanh(self.a(x))) * self.frozen
        logits = self.head(x).logsumexp(-1)
        if self.gain is not None:
            logits = logits * self.gain
        return (logits + y.sum(-1)) * self.scale[0]


def local_rows(step: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    per = GLOBAL_BATCH // world
    return rows[rank * per : (rank + 1) * per]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def param_groups(named: list[tuple[str, Any]], lr: float, decay: float, no_decay_lr: float) -> list[dict[str, Any]]:
    return [
        {"params": [p for n, p in named if n not in NO_DECAY], "lr": lr, "weight_decay": decay},
        {"params": [p for n, p in named if n in NO_DECAY], "lr": no_decay_lr, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------- #
# The DeepSpeed run (private processes)
# --------------------------------------------------------------------------- #


def run_deepspeed_importable(ctx: Any) -> str:
    """"" when deepspeed imports in this rank, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install skips the tests
        return f"deepspeed is not importable ({type(e).__name__}: {e})"
    return ""


def run_deepspeed(ctx: Any, root: str, bf16: bool = False) -> dict[str, Any]:
    """Train ``SAVED_STEPS`` steps, save, then two more steps; the reference figures."""
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from z3kit_recipes.bench.runners.deepspeed_zero3 import skip_cpu_shm_comm_build

    deepspeed.utils.logger.setLevel(logging.WARNING)
    skip_cpu_shm_comm_build()  # a compile that only inference uses
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(7)
    model = Net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // ctx.world,
        "gradient_accumulation_steps": 1,
        "train_batch_size": GLOBAL_BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": SUB_GROUP_SIZE},
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": DECAY, "torch_adam": True,
                                                  "adam_w_mode": False}},
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": bf16},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(named, LR, DECAY, NO_DECAY_LR), config=config
    )
    losses = []

    def step(i: int) -> None:
        loss = loss_of(engine(local_rows(i, ctx.rank, ctx.world)))
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()

    for i in range(SAVED_STEPS):
        step(i)
    engine.save_checkpoint(root, client_state={"epoch": 4})
    torch.distributed.barrier()
    saved = {n: t.clone() for n, t in get_fp32_state_dict_from_zero_checkpoint(root).items()}
    optim = {}
    for n, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            optim[f"{n}.{key}"] = safe_get_full_optimizer_state(p, key).detach().reshape(-1).clone()
    step(SAVED_STEPS)
    after = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in named}
    step(SAVED_STEPS + 1)
    return {"saved": saved, "optim": optim, "losses": losses, "after_one_step": after}


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.dist_pool import DistPool

    root = tmp_path_factory.mktemp("deepspeed") / "ckpt"
    pool = DistPool(2)
    try:
        unavailable = pool.run(run_deepspeed_importable)[0]
        if unavailable:
            print(f"test_zero3_deepspeed_import: skipped, {unavailable}")
            pytest.skip(unavailable)
        ref = reference(pool.run(run_deepspeed, str(root), timeout=200.0), root)
        ref["bf16"] = reference(pool.run(run_deepspeed, str(root.with_name("bf16")), True, timeout=200.0),
                                root.with_name("bf16"))
    finally:
        if not pool.broken:
            pool.close()
    yield ref


def reference(results: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    ref = results[0]
    # each rank's loss is its rows' mean; the global loss is their mean (equal splits)
    ref["global_losses"] = [sum(r["losses"][i] for r in results) / len(results) for i in range(len(ref["losses"]))]
    ref["root"] = str(root)
    return ref


# --------------------------------------------------------------------------- #
# z3kit loads (session pools)
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def deepspeed_unimportable() -> Iterator[None]:
    hidden = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    for k in hidden:
        del sys.modules[k]
    sys.modules["deepspeed"] = None  # type: ignore[assignment]  # import deepspeed now raises
    try:
        yield
    finally:
        del sys.modules["deepspeed"]
        sys.modules.update(hidden)


def new_engine(ctx: Any, model: nn.Module, lr: float = LR, decay: float = DECAY, no_decay_lr: float = NO_DECAY_LR,
               config: dict[str, Any] | None = None) -> Any:
    from z3kit_recipes import zero3

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return zero3.initialize(
        model,
        lambda masters: torch.optim.Adam(param_groups(list(zip(names, masters)), lr, decay, no_decay_lr)),
        zero3.Zero3Config(**(config if config is not None else {"param_persistence_threshold": 0})),
        ctx.group,
    )


def sharded_state(engine: Any) -> dict[str, Any]:
    """Full optimizer state and parameters (collective), and whether every
    rank's padding (shards, masters, per-element state) is zero."""
    from z3kit.collectives import all_gather

    optim: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    padding_zero = True
    for pid, master in zip(engine.trainable, engine.masters):
        name, shard = engine.param_names[pid], engine.shards[pid]
        start, stop = engine.layout.local_range(pid)
        padding_zero &= bool((shard.shard[stop - start :] == 0).all() and (master[stop - start :] == 0).all())
        for key, value in sorted(engine.optimizer.state[master].items()):
            if key == "step":
                steps[name] = float(value)
                assert value.dtype == torch.float32 and value.device.type == "cpu" and value.dim() == 0
                continue
            assert value.shape == master.shape and value.dtype == torch.float32
            padding_zero &= bool((value[stop - start :] == 0).all())
            whole = value.new_empty(value.numel() * engine.world)
            all_gather(whole, value.detach().contiguous(), engine.group)
            optim[f"{name}.{key}"] = whole[: shard.numel].clone()
    step_tensors = [engine.optimizer.state[m]["step"] for m in engine.masters]
    distinct_steps = len({id(t) for t in step_tensors}) == len(step_tensors)  # Adam counts each in place
    return {"params": engine.full_state_dict(), "optim": optim, "steps": steps, "padding_zero": padding_zero,
            "distinct_steps": distinct_steps}


def global_loss(ctx: Any, loss: torch.Tensor) -> float:
    value = loss.detach().clone().reshape(1)
    torch.distributed.all_reduce(value, group=ctx.group)
    return float(value) / ctx.world


def run_load(ctx: Any, root: str) -> dict[str, Any]:
    torch.manual_seed(1234)  # other initial values: everything must come from the checkpoint
    engine = new_engine(ctx, Net())
    with deepspeed_unimportable():
        client = engine.load_deepspeed_checkpoint(root)
    out = sharded_state(engine)
    out.update(client=client, progress=engine.progress(), buffer=engine.module.scale.clone(),
               groups=[(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups])
    losses = []
    for i in (SAVED_STEPS, SAVED_STEPS + 1):
        loss = loss_of(engine(local_rows(i, ctx.rank, ctx.world)))
        losses.append(global_loss(ctx, loss))
        engine.backward(loss)
        engine.step()
        if i == SAVED_STEPS:
            out["after_one_step"] = engine.full_state_dict()
    out["losses"] = losses
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_deepspeed_checkpoint_loads_at_any_world_size(pools: Any, world: int, deepspeed_run: dict[str, Any]) -> None:
    ref = deepspeed_run
    for r in pools.run(world, run_load, ref["root"]):
        # parameters: DeepSpeed's own reconstruction, bit for bit (frozen and tied ones included),
        # and the persistent buffer, which full_state_dict includes
        # (the tied head.weight under its own name too, as the model's state_dict lists it)
        assert r["params"].keys() == {"emb.weight", "a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "gain",
                                      "frozen", "scale"}
        for name, value in r["params"].items():
            assert torch.equal(value, ref["saved"][name]), name
        assert torch.equal(ref["saved"]["head.weight"], ref["saved"]["emb.weight"])
        assert torch.equal(r["buffer"], ref["saved"]["scale"])
        # Adam: DeepSpeed's full state, bit for bit; step per parameter, each its own tensor
        assert r["optim"].keys() == ref["optim"].keys()
        for key, value in r["optim"].items():
            assert torch.equal(value, ref["optim"][key]), key
        assert set(r["steps"].values()) == {float(SAVED_STEPS)} and r["distinct_steps"]
        assert r["padding_zero"]
        assert r["progress"] == (SAVED_STEPS, SAVED_STEPS)
        assert r["client"] == {"epoch": 4}
        assert r["groups"] == [(LR, DECAY), (NO_DECAY_LR, 0.0)]
        # and it trains on as DeepSpeed did
        want = ref["global_losses"][SAVED_STEPS:]
        assert r["losses"] == pytest.approx(want, rel=1e-6)
        for name, value in ref["after_one_step"].items():
            torch.testing.assert_close(r["after_one_step"][name], value, rtol=1e-5, atol=1e-6)


def run_load_inside_a_window(ctx: Any, root: str) -> dict[str, Any]:
    """Flat ZeRO-3 and hpZ (2 "nodes" of 2) load the checkpoint after a micro-step
    that kept hpZ's slices of other weights, then train on: the load makes them stale."""
    out = {}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        for name, extra in (("flat", {}), ("hpz", {"hpz_partition_size": 2})):
            torch.manual_seed(1234)
            engine = new_engine(ctx, Net(), config={"param_persistence_threshold": 0, "max_reuse_distance": 0,
                                                    "gradient_accumulation_steps": 2, **extra})
            engine.backward(loss_of(engine(local_rows(0, ctx.rank, ctx.world))))
            assert not engine.step()  # the window is open: hpZ keeps its slices of the initial weights
            with deepspeed_unimportable():
                engine.load_deepspeed_checkpoint(root)
            losses = []
            for i in range(SAVED_STEPS, SAVED_STEPS + 4):
                loss = loss_of(engine(local_rows(i, ctx.rank, ctx.world)))
                losses.append(float(loss))
                engine.backward(loss)
                engine.step()
            out[name] = {"losses": losses, "params": engine.full_state_dict()}
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return out


def test_a_load_inside_a_window_leaves_no_stale_hpz_slice(pools: Any, deepspeed_run: dict[str, Any]) -> None:
    for r in pools.run(4, run_load_inside_a_window, deepspeed_run["root"]):
        assert r["hpz"]["losses"] == r["flat"]["losses"]
        assert all(torch.equal(r["hpz"]["params"][k], v) for k, v in r["flat"]["params"].items())


def run_hyperparameters(ctx: Any, root: str) -> dict[str, Any]:
    # the default config: small parameters stay gathered, and the load must refresh them
    engine = new_engine(ctx, Net(), lr=1.0, decay=0.5, no_decay_lr=2.0, config={})
    for i in range(2):  # a step, and a backward whose gradients the load must discard
        engine.backward(loss_of(engine(local_rows(50 + i, ctx.rank, ctx.world))))
        if i == 0:
            engine.step()
    engine.load_deepspeed_checkpoint(root, tag=f"global_step{SAVED_STEPS}")
    kept = [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]
    engine.load_deepspeed_checkpoint(root, load_optimizer_hyperparameters=True)
    loaded = [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in engine.optimizer.param_groups]
    loss = loss_of(engine(local_rows(SAVED_STEPS, ctx.rank, ctx.world)))
    engine.backward(loss)
    engine.step()
    return {"kept": kept, "loaded": loaded, "loss": global_loss(ctx, loss_of(engine(local_rows(SAVED_STEPS + 1, ctx.rank, ctx.world))))}


def test_optimizer_hyperparameters_only_when_asked(pools: Any, deepspeed_run: dict[str, Any]) -> None:
    for r in pools.run(2, run_hyperparameters, deepspeed_run["root"]):
        assert r["kept"] == [(1.0, 0.5), (2.0, 0.0)]
        assert r["loaded"] == [(LR, DECAY, (0.9, 0.999), 1e-8), (NO_DECAY_LR, 0.0, (0.9, 0.999), 1e-8)]
        assert r["loss"] == pytest.approx(deepspeed_run["global_losses"][SAVED_STEPS + 1], rel=1e-6)


def run_mismatch(ctx: Any, root: str) -> dict[str, Any]:
    engine = new_engine(ctx, Net(b_out=6, extra=True, gain=False))
    before = engine.full_state_dict()
    error = error_of(engine.load_deepspeed_checkpoint, root)
    return {"error": error, "unchanged": unchanged(before, engine.full_state_dict()),
            "optimizer_state": len(engine.optimizer.state), "progress": engine.progress()}


def test_mismatched_model_is_reported_by_name_before_anything_changes(
    pools: Any, deepspeed_run: dict[str, Any], tmp_path: Path
) -> None:
    for r in pools.run(2, run_mismatch, deepspeed_run["root"]):
        err = r["error"]
        assert err.startswith("ValueError: ")
        assert "does not match the model, nothing was loaded" in err
        assert "missing (1): extra" in err and "unexpected (1): gain" in err
        assert "b.weight [5, 13] (the model's is [6, 13])" in err and "b.bias [5]" in err and "frozen [5]" in err
        assert r["unchanged"] and r["optimizer_state"] == 0 and r["progress"] == (0, 0)
    for err in pools.run(1, run_load_error, str(tmp_path)):
        assert err.startswith("ValueError: ") and "no 'latest' file" in err


def run_load_error(ctx: Any, root: str) -> str:
    return error_of(new_engine(ctx, Net()).load_deepspeed_checkpoint, root)


def run_bf16_load(ctx: Any, root: str) -> dict[str, Any]:
    from z3kit_recipes import zero3

    model = Net()
    engine = zero3.initialize(model, lambda masters: torch.optim.Adam(masters, lr=LR),
                              zero3.Zero3Config(param_persistence_threshold=0, compute_dtype="bf16"), ctx.group)
    engine.load_deepspeed_checkpoint(root)
    out = sharded_state(engine)
    shards = {}
    with engine.gathered_parameters() as params:
        for name, p in zip(engine.param_names, params):
            shards[name] = p.detach().clone()
    loss = loss_of(engine(local_rows(SAVED_STEPS, ctx.rank, ctx.world)))
    engine.backward(loss)
    engine.step()
    out.update(shards=shards, loss=global_loss(ctx, loss))
    return out


def test_bf16_checkpoint_loads_into_a_bf16_engine(pools: Any, deepspeed_run: dict[str, Any]) -> None:
    ref = deepspeed_run["bf16"]
    assert any(p.name.startswith("bf16_") for p in Path(ref["root"]).glob("*/*_optim_states.pt"))
    for r in pools.run(4, run_bf16_load, ref["root"]):
        for name, value in r["params"].items():  # fp32 masters; the frozen one in bf16, as saved
            if name == "scale":
                continue  # the buffer: the engine holds floating-point buffers in the compute dtype
            assert value.dtype == ref["saved"][name].dtype and torch.equal(value, ref["saved"][name]), name
            if name in r["shards"]:  # head.weight is emb.weight's, under another name
                assert torch.equal(r["shards"][name], ref["saved"][name].to(torch.bfloat16)), name
        for key, value in r["optim"].items():
            assert torch.equal(value, ref["optim"][key]), key
        assert r["padding_zero"] and set(r["steps"].values()) == {float(SAVED_STEPS)}
        assert r["loss"] == pytest.approx(ref["global_losses"][SAVED_STEPS], rel=1e-2)
