"""A DeepSpeed script with one line changed (``zero3.deepspeed``), and DeepSpeed's engine surface.

* ``tests/data/deepspeed_tutorial.py`` (GPT-2 from a transformers config, a
  ZeRO-3 JSON with explicit numbers, ``deepspeed.init_distributed()``,
  ``deepspeed.initialize(model=, model_parameters=, config=)``,
  ``engine.global_rank``, ``backward``/``step``, ``steps_per_print``,
  ``save_checkpoint(dir, tag="final", client_state=...)`` and
  ``load_checkpoint(dir, tag="final")`` returning ``(path, client_state)``)
  runs under DeepSpeed as written and under z3kit with its import line
  changed and nothing else, at 2 ranks: the losses (before and after the
  reload), the counters, the learning rates and the progress lines
  ``steps_per_print`` logs are DeepSpeed's. Measured: the losses are equal
  bit for bit (both reduce fp32 gradients in the same order here); the
  tolerance, rtol 1e-6, leaves room for a reduction order that differs
  (fp32 sums of 2 ranks' terms differ by a rounding, ~1e-7 relative).
* The engine's surface where it cannot follow DeepSpeed: a refusal that
  names the engine and z3kit's spelling; tags and the ``latest`` file;
  ``init_distributed`` without a launcher's environment.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.errors import raised

SCRIPT = Path(__file__).parent / "data" / "deepspeed_tutorial.py"
Z3KIT_IMPORT = "from z3kit_recipes.zero3 import deepspeed"


class Lines(logging.Handler):
    """The progress lines a logger logs (DeepSpeed's ``[Rank 0] step=...``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("[Rank 0] step="):
            self.lines.append(record.getMessage())


def _run_script(path: str, save_dir: str, logger: str) -> dict[str, Any]:
    """Import the script at ``path`` and run its ``main``, keeping ``logger``'s progress lines."""
    lines, log = Lines(), logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    try:
        spec = importlib.util.spec_from_file_location(f"tutorial_{Path(path).stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out: dict[str, Any] = module.main(save_dir)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    out["lines"] = lines.lines
    return out


def run_under_deepspeed(ctx: WorkerContext, save_dir: str) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world))
    from z3kit_recipes.bench.runners.deepspeed_zero3 import skip_cpu_shm_comm_build

    skip_cpu_shm_comm_build()  # a compile that only inference uses
    for handler in logging.getLogger("DeepSpeed").handlers:  # its INFO lines kept, not printed
        handler.setLevel(logging.WARNING)
    return _run_script(str(SCRIPT), save_dir, "DeepSpeed")


def run_under_z3kit(ctx: WorkerContext, path: str, save_dir: str) -> dict[str, Any]:
    return _run_script(path, save_dir, "z3kit.progress")


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """The script under DeepSpeed, in a private pair of processes (it leaves process-wide state behind)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    from tests.dist_pool import DistPool

    pool = DistPool(2)
    try:
        yield pool.run(run_under_deepspeed, str(tmp_path_factory.mktemp("ds") / "ckpt"), timeout=200.0)
    finally:
        if not pool.broken:
            pool.close()


def test_a_deepspeed_script_with_its_import_changed_trains_as_deepspeed(
    pools: PoolSet, deepspeed_run: list[dict[str, Any]], tmp_path: Path
) -> None:
    source = SCRIPT.read_text(encoding="utf-8")
    changed = source.replace("\nimport deepspeed\n", f"\n{Z3KIT_IMPORT}\n")
    diff = [line for line in difflib.unified_diff(source.splitlines(), changed.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert diff == ["-import deepspeed", f"+{Z3KIT_IMPORT}"]  # one line changed
    script = tmp_path / "tutorial_z3kit.py"
    script.write_text(changed, encoding="utf-8")
    ours = pools.run(2, run_under_z3kit, str(script), str(tmp_path / "ckpt"))
    for theirs, mine in zip(deepspeed_run, ours):
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=0)
        assert mine["resumed_loss"] == pytest.approx(theirs["resumed_loss"], rel=1e-6, abs=0)
        for key in ("rank", "world", "global_steps", "global_samples", "micro_steps", "train_batch_size", "micro",
                    "accumulation", "lr", "scheduler_lr", "optimizer_lr"):
            assert mine[key] == theirs[key], key
        # DeepSpeed adds its own keys to the client state; the script's come back from both
        assert mine["client_state"] == {"next_step": 4} and theirs["client_state"]["next_step"] == 4
        assert mine["path"] == str(tmp_path / "ckpt" / "final")  # DeepSpeed's names its rank's file in that folder
        assert Path(theirs["path"]).parent.name == "final"
        assert mine["lines"] == theirs["lines"]  # rank 0's progress lines, DeepSpeed's text
    assert len(deepspeed_run[0]["lines"]) == 3 and deepspeed_run[1]["lines"] == []  # step 0, 2, 4, on rank 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "final"


# --------------------------------------------------------------------------- #
# Tags, latest, refusals
# --------------------------------------------------------------------------- #


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


JSON = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def run_surface(ctx: WorkerContext, root: str) -> dict[str, Any]:
    from z3kit_recipes.zero3 import deepspeed

    out: dict[str, Any] = {}
    model = _model()
    out["subset"] = raised(deepspeed.initialize, model=model, model_parameters=[model[0].weight], config=JSON)
    out["groups"] = raised(deepspeed.initialize, model=model, config=JSON,
                             model_parameters=[{"params": [model[0].weight]}, {"params": [model[2].weight]}])
    out["training_data"] = raised(deepspeed.initialize, model=model, config=JSON, training_data=[1, 2])
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                config=JSON)
    out["tuple"] = (optimizer is engine.optimizer, loader, scheduler)
    out["no_attribute"] = raised(lambda: engine.no_such_thing)
    out["deepspeed_only"] = raised(lambda: engine.deepspeed_io)
    out["hasattr"] = hasattr(engine, "deepspeed_io") or hasattr(engine, "no_such_thing")
    for step in range(2):
        engine.backward(engine(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum())
        engine.step()
    out["surface"] = (engine.global_rank, engine.world_size, engine.global_steps, engine.micro_steps,
                      engine.global_samples, engine.train_batch_size(), engine.is_gradient_accumulation_boundary())
    if ctx.rank == 0:
        Path(root, "empty").mkdir(parents=True)
    torch.distributed.barrier(ctx.group)
    out["nothing_yet"] = engine.load_checkpoint(os.path.join(root, "empty"))  # DeepSpeed's (None, None)
    out["missing"] = raised(engine.load_checkpoint, os.path.join(root, "misspelt"))
    engine.save_checkpoint(root, client_state={"at": 2})  # tag global_step2
    engine.save_checkpoint(root, tag=7, client_state={"at": 7}, save_latest=False)
    out["latest"] = Path(root, "latest").read_text().strip()
    out["loaded"] = engine.load_checkpoint(root)
    out["tagged"] = engine.load_checkpoint(root, tag=7)[1]
    out["optimizer_only"] = raised(engine.load_checkpoint, root, load_optimizer_states=False)
    out["tags_differ"] = raised(engine.save_checkpoint, root, tag=f"rank{ctx.rank}")
    out["bad_tag"] = raised(engine.save_checkpoint, root, tag="a/b")
    blocked = Path(root, "blocked")
    if ctx.rank == 0:
        (blocked / "latest").mkdir(parents=True)  # a folder named latest: not the save's to replace
    torch.distributed.barrier(ctx.group)
    out["latest_folder"] = raised(engine.save_checkpoint, blocked)
    # the custom-loop fp16 recipe: GradScaler's unscale_ reads the optimizer's (sharded) gradients
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(engine(torch.randn(3, 4)).sum()).backward()
    out["gradscaler"] = raised(scaler.unscale_, engine.optimizer)
    return out


def test_tags_latest_and_refusals_name_the_engine(pools: PoolSet, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    outs = pools.run(2, run_surface, str(root))
    for rank, out in enumerate(outs):
        assert out["subset"].startswith("ValueError: model_parameters leaves out 3 trainable parameter(s) ('0.bias'")
        assert out["groups"].startswith("TypeError: model_parameters holds parameter groups: ")
        assert "params.named()" in out["groups"] and "keeps your 2 groups" in out["groups"]
        assert "training_data: z3kit makes no data loader" in out["training_data"]
        assert out["tuple"] == (True, None, None)
        assert out["no_attribute"] == ("AttributeError: 'Zero3Engine' object has no attribute 'no_such_thing', nor has "
                                  "the Sequential it trains")
        assert out["deepspeed_only"].startswith("AttributeError: Zero3Engine has no 'deepspeed_io' (DeepSpeed's "
                                                "engine has): z3kit makes no data loader")
        assert out["hasattr"] is False
        assert out["surface"] == (rank, 2, 2, 2, 12, 6, True)
        assert out["nothing_yet"] == (None, None)
        assert out["missing"].startswith("FileNotFoundError: no checkpoint at ") and "misspelt" in out["missing"]
        assert out["latest"] == "global_step2"  # the tag=7 save did not touch it
        assert out["loaded"] == (str(root / "global_step2"), {"at": 2})
        assert out["tagged"] == {"at": 7}
        assert "load_optimizer_states=False" in out["optimizer_only"] and "load_pretrained" in out["optimizer_only"]
        assert out["tags_differ"].startswith("ValueError: save_checkpoint: the ranks passed different tags ('rank0', "
                                             "'rank1')"), out["tags_differ"]
        assert "tag 'a/b' must name one folder" in out["bad_tag"]
        assert out["latest_folder"].startswith("SaveRefused: save_checkpoint(") and "nothing was written" in \
            out["latest_folder"]
        assert "GradScaler" in out["gradscaler"] and 'compute_dtype="fp16"' in out["gradscaler"] and \
            "engine.backward(loss)" in out["gradscaler"], out["gradscaler"]
    assert sorted(p.name for p in root.iterdir()) == ["7", "blocked", "empty", "global_step2", "latest"]
    assert sorted(p.name for p in (root / "blocked").iterdir()) == ["latest"]  # nothing written beside it


def test_the_progress_line_prints_to_stdout_unless_the_logger_is_configured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from z3kit_recipes.zero3.runtime import progress

    log = progress.LOGGER
    saved = (list(log.handlers), log.level, log.propagate)
    log.handlers.clear()
    log.setLevel(logging.NOTSET)
    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.9)
        progress.report_progress(10, 1, optimizer, 0)
        assert capsys.readouterr().out == "[Rank 0] step=10, skipped=1, lr=[0.5], mom=[0.9]\n"
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]


def test_init_distributed_makes_the_group_from_torchruns_environment() -> None:
    from z3kit_recipes.launch import free_port

    code = ("import torch.distributed as dist\nfrom z3kit_recipes.zero3 import deepspeed\n"
            "deepspeed.init_distributed()\nprint(dist.get_backend(), dist.get_world_size(), dist.get_rank())\n"
            "deepspeed.init_distributed()  # once made, nothing\nimport os; os._exit(0)\n")
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={
        **os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RANK": "0", "LOCAL_RANK": "0",
        "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert made.returncode == 0 and made.stdout.strip() == "gloo 1 0", made.stdout + made.stderr


def test_init_distributed_without_a_launcher_names_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from z3kit_recipes.zero3 import deepspeed

    assert not dist.is_initialized()  # this process: the pools' ranks are others
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"^no process group, and the launcher's environment lacks RANK, WORLD_SIZE, "
                                           r"MASTER_ADDR, MASTER_PORT: launch the script with torchrun"):
        deepspeed.init_distributed()
    with pytest.raises(RuntimeError, match=r"dist_init_required=False, and torch.distributed is not initialized"):
        deepspeed.init_distributed(dist_init_required=False)
    assert not dist.is_initialized()
