"""A DeepSpeed user's JSON, unedited: Hugging Face's documented ``ds_config_zero3.json``
(``tests/data/ds_config_zero3.json``, verbatim) read with its ``"auto"`` values
filled from ``TrainingValues``, its optimizer and schedule built as DeepSpeed
builds them, and a model trained through it at parity with DDP + AdamW + the
same warmup written out from its formula.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from z3kit_recipes import zero3
from z3kit_recipes.zero3.config.json_optimizer import JsonOptimizer, implementation
from z3kit_recipes.zero3.config.lr_schedules import WarmupSchedule
from z3kit_recipes.zero3.config.offload import OffloadConfig

HF_JSON = Path(__file__).parent / "data" / "ds_config_zero3.json"
#: every field the HF JSON's "auto" needs (fp32: bf16 off, fp16 left to mean off)
VALUES = zero3.TrainingValues(
    lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=3, micro_batch_size=4,
    gradient_accumulation_steps=2, max_grad_norm=1.0, bf16=False)
HIDDEN = 8


def hf() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(HF_JSON.read_text())
    return data


def notes_of(fn: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen if issubclass(w.category, zero3.DeepSpeedNote)]


# -- reading the JSON ---------------------------------------------------------------------------
def test_the_hf_json_is_read_as_the_trainer_fills_it() -> None:
    c, notes = notes_of(lambda: zero3.Zero3Config.from_deepspeed(HF_JSON, hidden_size=HIDDEN, auto=VALUES, world=2))
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.compute_dtype, c.micro_batch_size) == (2, 1.0, "fp32", 4)
    assert c.optimizer == JsonOptimizer(adamw=True, lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert c.lr_scheduler == WarmupSchedule(type="WarmupLR", warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=3)
    assert c.param_persistence_threshold == 10 * HIDDEN and c.max_live_parameters == 1_000_000_000
    # one line, naming every key that changes nothing, and saying plainly that parameters are not offloaded
    assert len(notes) == 1
    assert c.steps_per_print == 2000  # the engine's progress line (zero3.runtime.progress)
    for key in ("wall_clock_breakdown", "fp16.loss_scale", "fp16.min_loss_scale",
                "zero_optimization.sub_group_size", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                "zero_optimization.offload_param"):
        assert key in notes[0]
    # the optimizer is offloaded for real (zero3.training.offload): not among the keys that change nothing
    assert "offload_optimizer" not in notes[0] and c.offload_optimizer == OffloadConfig(pin_memory=True, ratio=1.0)
    assert "z3kit does not offload" in notes[0] and "more device memory than under DeepSpeed" in notes[0]
    assert "\n" not in notes[0]
    # bf16 chosen: fp16 "auto" is off, and bf16 is the compute dtype
    bf16, again = notes_of(lambda: zero3.Zero3Config.from_deepspeed(HF_JSON, hidden_size=HIDDEN,
                                                                     auto=attrs.evolve(VALUES, bf16=True), world=2))
    assert bf16.compute_dtype == "bf16" and again == notes


def test_auto_without_a_value_is_refused_naming_the_key_and_the_field() -> None:
    with pytest.raises(ValueError) as info:
        zero3.Zero3Config.from_deepspeed(HF_JSON, hidden_size=HIDDEN, auto=zero3.TrainingValues(lr=0.1), world=2)
    msg = str(info.value)
    for key, field in [("train_micro_batch_size_per_gpu", "micro_batch_size"), ("gradient_clipping", "max_grad_norm"),
                       ("bf16.enabled", "bf16"), ("optimizer.params.betas", "betas"),
                       ("scheduler.params.warmup_num_steps", "warmup_steps"),
                       ("gradient_accumulation_steps", "gradient_accumulation_steps")]:
        assert f"{key} (TrainingValues.{field})" in msg
    assert "optimizer.params.lr" not in msg  # given
    # the size knobs still come from the model
    with pytest.raises(ValueError, match="hidden_size"):
        zero3.Zero3Config.from_deepspeed(HF_JSON, auto=VALUES, world=2)


def test_a_json_number_that_disagrees_with_training_values_is_refused() -> None:
    ds = {**hf(), "gradient_clipping": 0.5}
    with pytest.raises(ValueError, match=r"gradient_clipping is 0.5 but TrainingValues.max_grad_norm is 1.0"):
        zero3.Zero3Config.from_deepspeed(ds, hidden_size=HIDDEN, auto=VALUES, world=2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
         'zero_optimization.offload_param.device is "nvme"'),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type 'Lamb' is not supported; z3kit builds Adam, AdamW"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
        ({"scheduler": {"type": "OneCycle", "params": {}}},
         "scheduler.type 'OneCycle' is not supported; z3kit runs WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "WarmupDecayLR needs scheduler.params.total_num_steps"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "warmup_type must be one of log, linear"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ],
)
def test_what_would_change_the_result_is_refused_by_name(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zero3.Zero3Config.from_deepspeed({"gradient_clipping": 1.0, **change})


def test_deepspeed_optimizer_semantics() -> None:
    p = [nn.Parameter(torch.zeros(3))]
    assert JsonOptimizer.from_json("Adam", {}).adamw  # DeepSpeed: Adam means AdamW unless adam_w_mode is false
    adam = JsonOptimizer.from_json("adam", {"adam_w_mode": False, "weight_decay": 0.1})(p)
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["weight_decay"] == 0.1
    assert type(JsonOptimizer.from_json("AdamW", {"adam_w_mode": False})(p)) is torch.optim.AdamW
    defaults = JsonOptimizer.from_json("AdamW", {})(p).param_groups[0]
    # DeepSpeed's fused Adam's defaults, not torch AdamW's weight_decay=0.01
    assert (defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    # DeepSpeed steps it with a fused kernel: torch's, where torch has it for the masters' device, else foreach
    assert defaults["fused"] is True and not defaults["foreach"]
    assert implementation(p) == {"fused": True}
    assert implementation([torch.empty(3, device="meta"), *p]) == {"foreach": True}


def test_gradient_clipping_left_out_is_deepspeeds_default_said_once() -> None:
    c, notes = notes_of(lambda: zero3.Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3}}))
    assert c.gradient_clipping == 1.0 and zero3.Zero3Config().gradient_clipping == 0.0
    assert len(notes) == 1 and "DeepSpeed's default applies" in notes[0]


def test_batch_sizes_are_related_as_deepspeed_relates_them() -> None:
    with pytest.raises(ValueError, match=r"train_batch_size \(30\) must equal train_micro_batch_size_per_gpu \(4\) x "
                                         r"gradient_accumulation_steps \(2\) x the number of ranks \(2\)"):
        zero3.Zero3Config.from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                                          "gradient_accumulation_steps": 2, "gradient_clipping": 0}, world=2)
    derived = zero3.Zero3Config.from_deepspeed(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0}, world=2)
    assert (derived.gradient_accumulation_steps, derived.micro_batch_size) == (4, 4)


@pytest.mark.parametrize(
    ("type_", "params"),
    [
        ("WarmupLR", {"warmup_max_lr": 0.5, "warmup_num_steps": 5}),
        ("WarmupLR", {"warmup_min_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 0.3}),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_type": "linear"}),
    ],
)
def test_schedules_match_deepspeeds_own(type_: str, params: dict[str, Any]) -> None:
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")

    def lrs(make: Any) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        scheduler = make(optimizer)
        out = [optimizer.param_groups[0]["lr"]]
        for _ in range(14):
            optimizer.step()
            scheduler.step()
            out.append(optimizer.param_groups[0]["lr"])
        return out

    ours = lrs(WarmupSchedule.from_json(type_, params).build)
    theirs = lrs(lambda o: getattr(lr_schedules, type_)(o, **params))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


# -- initialize ---------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=HIDDEN)  # where "auto" sizes come from, as on a HF model
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.norm = nn.LayerNorm(2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.norm(self.up(x))))


def _reference_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (log warmup from 0 to lr over warmup_steps) for optimizer step ``step`` (0-based),
    written from its formula: the first step runs at the lr set at construction (the minimum)."""
    assert VALUES.lr is not None and VALUES.warmup_steps is not None
    i = step - 1
    if i < 0:
        return 0.0
    return VALUES.lr * (math.log(i + 1) / math.log(VALUES.warmup_steps) if i < VALUES.warmup_steps else 1.0)


def _parity_worker(ctx: WorkerContext, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    reference = nn.parallel.DistributedDataParallel(_Net(), process_group=ctx.group)
    reference.module.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = zero3.initialize(model, None, path, fresh_group(ctx), auto=VALUES)
    notes = [str(w.message) for w in seen if issubclass(w.category, zero3.DeepSpeedNote)]
    assert engine.lr_scheduler is not None and engine.optimizer is not None
    # DeepSpeed's JSON optimizer decays every parameter alike: one group
    assert len(engine.optimizer.param_groups) == 1
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    accum, micro = 2, 4
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    losses, ref_losses, lrs = [], [], []
    for step in range(6):
        for group in ref_opt.param_groups:
            group["lr"] = _reference_lr(step)
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        for _ in range(accum):
            x, y = torch.randn(micro, HIDDEN, generator=gen), torch.randn(micro, 1, generator=gen)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            ref_loss = nn.functional.mse_loss(reference(x), y)
            (ref_loss / accum).backward()  # DDP averages over ranks; the engine over micro-steps too
            ref_losses.append(ref_loss.item())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    full = engine.full_state_dict()
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in reference.module.named_parameters())
    return dict(notes=notes, losses=losses, ref_losses=ref_losses, lrs=lrs, worst=worst,
                global_step=engine.global_step)


def test_hf_json_trains_at_parity_with_ddp_adamw_and_warmup(pools: PoolSet) -> None:
    outs = pools.run(2, _parity_worker, str(HF_JSON))
    for rank, out in enumerate(outs):
        assert out["global_step"] == 6
        assert out["lrs"] == pytest.approx([_reference_lr(s) for s in range(6)], rel=1e-12, abs=1e-15)
        assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-5, abs=1e-6)
        assert out["worst"] < 1e-5
        # the accepted keys are said once, on rank 0 only
        assert len(out["notes"]) == (1 if rank == 0 else 0)
    assert "z3kit does not offload" in outs[0]["notes"][0]


def _refusals_worker(ctx: WorkerContext, path: str) -> dict[str, str]:
    out = {}
    attempts = {
        "both": lambda: zero3.initialize(_Net(), lambda p: torch.optim.SGD(p, lr=0.1), path, ctx.group, auto=VALUES),
        "scheduler_alone": lambda: zero3.initialize(
            _Net(), None, {"scheduler": {"type": "WarmupLR", "params": {}}, "gradient_clipping": 0}, ctx.group),
        "auto_without_json": lambda: zero3.initialize(_Net(), None, zero3.Zero3Config(), ctx.group, auto=VALUES),
        "batch": lambda: zero3.initialize(_Net(), None, {**hf(), "train_batch_size": 7}, ctx.group, auto=VALUES),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    return out


def test_initialize_refusals(pools: PoolSet) -> None:
    (out,) = pools.run(1, _refusals_worker, str(HF_JSON))
    assert "both an optimizer factory and the DeepSpeed config's optimizer section were given; pass one" in out["both"]
    assert "scheduler section but no optimizer" in out["scheduler_alone"]
    assert "auto= fills the \"auto\" values of a DeepSpeed config" in out["auto_without_json"]
    assert "train_batch_size (7) must equal train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2) x " \
           "the number of ranks (1)" in out["batch"]


def _batch_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}
    engine = zero3.initialize(_Net(), lambda p: torch.optim.SGD(p, lr=0.1), ds, fresh_group(ctx))
    assert engine.lr_scheduler is None  # no scheduler section
    try:
        engine(torch.randn(3, HIDDEN))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    with torch.no_grad():
        engine(torch.randn(3, HIDDEN))  # an eval forward is not a training batch
    engine.backward(engine(torch.randn(4, HIDDEN)).sum())  # the ranks are still together
    return dict(refused=refused, stepped=engine.step())


def test_a_batch_that_disagrees_with_the_json_is_refused_on_every_rank(pools: PoolSet) -> None:
    for out in pools.run(2, _batch_worker):
        assert "this training batch has 3 samples" in out["refused"]
        assert "train_micro_batch_size_per_gpu is 4" in out["refused"]
        assert out["stepped"] is True


def _named_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    model.down.bias.requires_grad_(False)  # unfrozen later: it must join the no-decay group
    seen: list[list[tuple[str, tuple[int, ...]]]] = []

    def factory(params: zero3.MasterShards) -> torch.optim.Optimizer:
        seen.append([(n, tuple(params.full_shape(p))) for n, p in params.named()])
        matrices = [p for _, p in params.named() if len(params.full_shape(p)) >= 2]
        rest = [p for n, p in params.named() if len(params.full_shape(p)) < 2]
        return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01)

    engine = zero3.initialize(model, factory, zero3.Zero3Config(), fresh_group(ctx))
    assert engine.optimizer is not None
    engine.backward(engine(torch.randn(2, HIDDEN)).sum())
    engine.step()
    model.down.bias.requires_grad_(True)
    engine.backward(engine(torch.randn(2, HIDDEN)).sum())
    engine.step()
    sizes = [len(g["params"]) for g in engine.optimizer.param_groups]
    return dict(seen=seen, sizes=sizes)


def test_factories_get_names_and_full_shapes(pools: PoolSet) -> None:
    (out,) = pools.run(1, _named_worker)
    first = out["seen"][0]
    assert first == [("up.weight", (16, 8)), ("up.bias", (16,)), ("norm.weight", (16,)), ("norm.bias", (16,)),
                     ("down.weight", (1, 16))]
    assert ("down.bias", (1,)) in out["seen"][-1]  # asked again with every master at the unfreeze
    assert out["sizes"] == [2, 4]  # the unfrozen bias joined the no-decay group


def _resume_worker(ctx: WorkerContext, path: str, folder: str) -> dict[str, Any]:
    """Six optimizer steps straight, against three, a checkpoint, and three more in a new engine."""

    def run(engine: Any, steps: range) -> list[float]:
        lrs = []
        for step in steps:
            gen = torch.Generator().manual_seed(1000 * step + ctx.rank)
            for _ in range(2):  # the JSON's accumulation (VALUES)
                x, y = torch.randn(4, HIDDEN, generator=gen), torch.randn(4, 1, generator=gen)
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()
            lrs.append(engine.optimizer.param_groups[0]["lr"])
        return lrs

    def build() -> Any:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zero3.DeepSpeedNote)
            return zero3.initialize(_Net(), None, path, fresh_group(ctx), auto=VALUES)

    whole = build()
    straight = run(whole, range(6))
    first = build()
    run(first, range(3))
    first.save_checkpoint(folder)
    resumed = build()
    resumed.load_checkpoint(folder)
    after = run(resumed, range(3, 6))
    a, b = whole.full_state_dict(), resumed.full_state_dict()
    return dict(straight=straight[3:], after=after, worst=max((a[n] - b[n]).abs().max().item() for n in a))


def test_a_resumed_run_continues_the_json_schedule(pools: PoolSet, tmp_path: Path) -> None:
    for out in pools.run(2, _resume_worker, str(HF_JSON), str(tmp_path / "ckpt")):
        assert out["after"] == out["straight"]  # the warmup goes on where it was, not from its start
        assert out["worst"] == 0.0


def _short_batch_on_one_rank_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}
    engine = zero3.initialize(_Net(), lambda p: torch.optim.SGD(p, lr=0.1), ds, fresh_group(ctx))
    started = time.monotonic()
    try:  # rank 1's last batch is short; rank 0 goes into its forward and gathers
        engine.backward(engine(torch.randn(3 if ctx.rank == 1 else 4, HIDDEN)).sum())
        error = ""
    except Exception as exc:  # noqa: BLE001 - the test reads which error each rank got
        error = f"{type(exc).__name__}: {exc}"
    return dict(error=error, seconds=time.monotonic() - started)


def test_a_batch_short_on_one_rank_stops_every_rank_in_seconds(pools: PoolSet) -> None:
    refused, stopped = pools.run(2, _short_batch_on_one_rank_worker)[::-1]
    assert refused["error"].startswith("ValueError: this training batch has 3 samples")
    assert stopped["error"].startswith("RankFailed") and "this training batch has 3 samples" in stopped["error"]
    assert max(refused["seconds"], stopped["seconds"]) < 30  # not the collective timeout


# -- keys that change nothing in DeepSpeed's ZeRO-3 either, and the monitors ---------------------------
#: a value of each key accepted whatever it holds, as users' JSONs write them
INERT = {
    "wall_clock_breakdown": False, "memory_breakdown": False, "dump_state": False,
    "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    "flops_profiler": {"enabled": True, "profile_step": 1}, "activation_checkpointing": {"partition_activations": True},
    "wandb": {"enabled": False}, "comet": {"enabled": False}, "comms_logger": {"enabled": False, "verbose": False},
    "tensorboard": {"enabled": False, "output_path": "tb/"}, "csv_monitor": {"enabled": False},
    # at DeepSpeed's default
    "prescale_gradients": False, "gradient_predivide_factor": 1, "sparse_gradients": False,
    "communication_data_type": None,
    "data_types": {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None},
    "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                   "parallel_write": {"pipeline_stage": False}},
}
INERT_ZERO = {
    "allgather_partitions": True, "allgather_bucket_size": 2e8, "round_robin_gradients": True,
    "ignore_unused_parameters": True, "use_multi_rank_bucket_allreduce": True,
    "stage3_model_persistence_threshold": 1e9,
    "stage3_use_all_reduce_for_fetch_params": True, "stage3_allgather_sequential": False,
    "memory_efficient_linear": False, "log_trace_cache_warnings": False, "enable_sanity_checks": False,
    "zero_quantized_weights": False, "zero_quantized_gradients": False, "elastic_checkpoint": False,
    "load_from_fp32_weights": True,
}


def test_keys_inert_in_deepspeeds_zero3_are_accepted_and_listed_in_the_one_note() -> None:
    base = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "reduce_scatter": False}}
    ds = {**base, **INERT, "zero_optimization": {**base["zero_optimization"], **INERT_ZERO}}
    c, notes = notes_of(lambda: zero3.Zero3Config.from_deepspeed(ds))
    assert c == zero3.Zero3Config.from_deepspeed(base)  # nothing changed by them
    assert len(notes) == 1 and "\n" not in notes[0]
    for key in [*(k for k in INERT if k not in ("data_types", "checkpoint")), *(f"zero_optimization.{k}" for k in INERT_ZERO),
                "data_types.grad_accum_dtype", "checkpoint.tag_validation", "checkpoint.parallel_write.pipeline_stage"]:
        assert key in notes[0], key
    assert c.monitors == () and "writes nothing" not in notes[0]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"prescale_gradients": True}, r"prescale_gradients \(only DeepSpeed's default, false: true changes the numbers\)"),
        ({"gradient_predivide_factor": 2.0}, r"gradient_predivide_factor \(only DeepSpeed's default, 1.0: 2.0"),
        ({"communication_data_type": "fp16"}, r"communication_data_type \(only DeepSpeed's default, null: \"fp16\""),
        ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
         r"zero_optimization.zero_quantized_gradients \(only DeepSpeed's default"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": 0}}, r"zero_quantized_weights .*: 0 changes"),
        ({"elasticity": {"enabled": True}}, r"unsupported DeepSpeed config keys: elasticity\."),
        ({"zero_optimization": {"stage": 3, "load_from_fp32_weights": False}},
         r"zero_optimization.load_from_fp32_weights \(only DeepSpeed's default, true: false changes"),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, r"data_types.grad_accum_dtype \(only DeepSpeed's default, null"),
        ({"checkpoint": {"load_universal": True}}, r"checkpoint.load_universal \(only DeepSpeed's default, false"),
        ({"csv_monitor": {"enabled": True, "team": "x"}}, r"csv_monitor.team"),
    ],
)
def test_keys_that_change_numbers_stay_refused_by_name(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zero3.Zero3Config.from_deepspeed({"gradient_clipping": 1.0, **change})


@pytest.mark.parametrize(
    ("misspelt", "meant"),
    [
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sizee": 5}},
         "zero_optimization.stage3_prefetch_bucket_sizee (did you mean zero_optimization.stage3_prefetch_bucket_size?)"),
        ({"steps_per_prnt": 10}, "steps_per_prnt (did you mean steps_per_print?)"),
        ({"data_types": {"grad_acum_dtype": None}}, "data_types.grad_acum_dtype (did you mean data_types.grad_accum_dtype?)"),
        ({"zero_optimization": {"stage": 3, "overlap_com": True}},
         "zero_optimization.overlap_com (did you mean zero_optimization.overlap_comm?)"),
        ({"elasticity": {"enabled": True}}, "elasticity. z3kit does not implement them"),  # nothing near: no guess
    ],
)
def test_an_unknown_key_is_refused_in_one_line_with_the_nearest_key(misspelt: dict[str, Any], meant: str) -> None:
    with pytest.raises(ValueError) as caught:
        zero3.Zero3Config.from_deepspeed({"gradient_clipping": 1.0, **misspelt})
    message = str(caught.value)
    assert message.startswith("unsupported DeepSpeed config keys: ") and meant in message, message
    assert "\n" not in message and len(message) < 300 and "docs/deepspeed.md" in message  # not every key z3kit reads


def test_monitor_sections_become_the_engines_monitors(tmp_path: Path) -> None:
    from z3kit_recipes.zero3.config.monitor import MonitorConfig

    ds = {"gradient_clipping": 1.0, "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
          "wandb": {"enabled": True, "project": "p"}}
    c, notes = notes_of(lambda: zero3.Zero3Config.from_deepspeed(ds))
    assert c.monitors == (MonitorConfig(kind="csv", output_path=str(tmp_path), job_name="run"),)
    assert c.monitors[0].log_dir == str(tmp_path / "run")
    assert "wandb enabled: z3kit writes nothing to it" in notes[0]
    assert MonitorConfig.from_json("csv_monitor", {}) is None  # DeepSpeed's default: off
    tensorboard = {"gradient_clipping": 1.0, "tensorboard": {"enabled": True}}
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ValueError, match=r"tensorboard: TensorBoard logging needs the tensorboard package.*pip "
                                             r"install tensorboard.*csv_monitor"):
            zero3.Zero3Config.from_deepspeed(tensorboard)
    else:
        assert zero3.Zero3Config.from_deepspeed(tensorboard).monitors[0].log_dir == "DeepSpeedJobName"


def _monitor_worker(ctx: WorkerContext, out_dir: str, tensorboard: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.05,
                                                     "warmup_type": "linear"}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv_job"},
    }
    if tensorboard:
        ds["tensorboard"] = {"enabled": True, "output_path": out_dir, "job_name": "tb_job"}
    engine = zero3.initialize(_Net(), config=ds, process_group=fresh_group(ctx))
    gen = torch.Generator().manual_seed(ctx.rank)
    losses, lrs = [], []
    for _ in range(3):
        window = []
        for _ in range(2):
            loss = engine(torch.randn(4, HIDDEN, generator=gen)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            window.append(loss.item())
        losses.append(sum(window) / 2)
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    return dict(losses=losses, lrs=lrs)


def _csv(path: Path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text().splitlines()]


def test_the_engine_writes_deepspeeds_monitor_files_from_rank_0(pools: PoolSet, tmp_path: Path) -> None:
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    rank0 = pools.run(2, _monitor_worker, str(tmp_path), tensorboard)[0]
    folder = tmp_path / "csv_job"
    assert sorted(p.name for p in folder.iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    loss, lr = _csv(folder / "Train_Samples_train_loss.csv"), _csv(folder / "Train_Samples_lr.csv")
    # one header, then one row per optimizer step (rank 0's alone) against the samples: 4 x 2 x 2 ranks a step
    assert loss[0] == ["step", "train_loss"] and lr[0] == ["step", "lr"]
    assert [int(r[0]) for r in loss[1:]] == [16, 32, 48] and [int(r[0]) for r in lr[1:]] == [16, 32, 48]
    assert [float(r[1]) for r in loss[1:]] == pytest.approx(rank0["losses"], rel=1e-6)
    assert [float(r[1]) for r in lr[1:]] == pytest.approx(rank0["lrs"], rel=1e-12)  # after the scheduler's step
    if tensorboard:  # the same numbers in the SummaryWriter's event file
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb_job"))
        events.Reload()
        written = events.Scalars("Train/Samples/train_loss")
        assert [e.step for e in written] == [16, 32, 48]
        assert [e.value for e in written] == pytest.approx(rank0["losses"], rel=1e-6)
        assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx(rank0["lrs"], rel=1e-6)


def test_the_granularity_threshold_chooses_the_fetch_units() -> None:
    """DeepSpeed's ``stage3_module_granularity_threshold`` is honoured (``zero3.training.unit_rule``), not inert."""
    ds = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 5000}}
    assert zero3.Zero3Config.from_deepspeed(ds).module_granularity_threshold == 5000
    _, notes = notes_of(lambda: zero3.Zero3Config.from_deepspeed(ds))
    assert not any("granularity" in note for note in notes)
