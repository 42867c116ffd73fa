"""The main job's ``--config``: a DeepSpeed JSON as its user wrote it.

Hugging Face's documented ZeRO-3 JSON (every value "auto") trains with
``--config`` alone; a JSON's micro batch and optimizer replace the job's
defaults; a JSON that contradicts an option the user gave is one line and
status 2 before anything starts. And ``--help`` (and parsing) imports no
torch."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from z3kit_recipes import train
from z3kit_recipes.launch import free_port
from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train.defaults import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, warmup_steps
from z3kit_recipes.train.job_values import Contradiction, settle
from z3kit_recipes.train.options import parse_args

REPO = Path(__file__).resolve().parents[1]
HF_ZERO3 = REPO / "tests" / "data" / "ds_config_zero3.json"
TINY_RUN = ["--model-size", "tiny", "--sample-chars", "0", "--corpus-chars", "50000"]
MODEL = GPTConfig(vocab_size=90, width=32, n_layer=2, n_head=2, seq_len=32)
ZERO3 = {"zero_optimization": {"stage": 3}}


def _write(tmp_path: Path, obj: object, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


def _settled(argv: list[str], world: int = 2) -> Any:
    args = parse_args(argv)
    return settle(args, MODEL, world)


# --------------------------------------------------------------------------- #
# Settling the options and the JSON (no processes)
# --------------------------------------------------------------------------- #


def test_hf_json_autos_are_the_jobs_values(tmp_path: Path) -> None:
    """Every "auto" of Hugging Face's ZeRO-3 JSON takes the job's value: the options
    given, the job's defaults for the rest; the JSON's optimizer and scheduler are built."""
    hf = json.loads(HF_ZERO3.read_text())
    # the copy in tests/data adds "bf16": {"enabled": "auto"} to the one in Hugging Face's
    # DeepSpeed page (main_classes/deepspeed.md, "ZeRO-3 Example"): both settle alike
    documented = {k: v for k, v in hf.items() if k != "bf16"}
    for raw in (hf, documented):
        path = _write(tmp_path, raw)
        v = _settled(["--config", str(path)])
        assert (v.steps, v.batch_size, v.lr) == (train.DEFAULT_STEPS, 16, train.DEFAULT_LR)
        c = v.config
        assert c.optimizer is not None and c.lr_scheduler is not None
        assert (c.optimizer.lr, c.optimizer.betas, c.optimizer.eps, c.optimizer.weight_decay) == (
            train.DEFAULT_LR, ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY)  # fmt: skip
        assert (c.lr_scheduler.type, c.lr_scheduler.warmup_max_lr, c.lr_scheduler.warmup_num_steps) == (
            "WarmupLR", train.DEFAULT_LR, warmup_steps(train.DEFAULT_STEPS))  # fmt: skip
        assert (c.micro_batch_size, c.gradient_accumulation_steps, c.gradient_clipping, c.compute_dtype) == (
            16, 1, 0.0, "fp32")  # fmt: skip
        # the options given fill the same "auto"s
        v = _settled(["--config", str(path), "--lr", "0.01", "--batch-size", "4", "--steps", "60", "--dtype", "bf16"])
        assert (v.steps, v.batch_size, v.lr, v.config.compute_dtype) == (60, 4, 0.01, "bf16")
        assert v.config.optimizer.lr == v.config.lr_scheduler.warmup_max_lr == 0.01
        assert v.config.lr_scheduler.warmup_num_steps == warmup_steps(60)


@pytest.mark.parametrize(
    ("raw", "steps", "batch_size", "lr"),
    [
        ({**ZERO3, "train_micro_batch_size_per_gpu": 4}, train.DEFAULT_STEPS, 4, train.DEFAULT_LR),
        # DeepSpeed's derivation: 24 sequences over 2 ranks and 3 micro-steps
        ({**ZERO3, "train_batch_size": 24, "gradient_accumulation_steps": 3}, train.DEFAULT_STEPS, 4,
         train.DEFAULT_LR),
        ({**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}, train.DEFAULT_STEPS, 16, 5e-4),
        ({**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_max_lr": "auto"}}},
         50, 16, train.DEFAULT_LR),
        ({"micro_batch_size": 4}, train.DEFAULT_STEPS, 4, train.DEFAULT_LR),  # a z3kit JSON
    ],
)
def test_the_jsons_numbers_replace_the_jobs_defaults(
    tmp_path: Path, raw: dict[str, Any], steps: int, batch_size: int, lr: float
) -> None:
    v = _settled(["--config", str(_write(tmp_path, raw))])
    assert (v.steps, v.batch_size, v.lr) == (steps, batch_size, lr)


def test_options_that_agree_with_the_json_are_fine(tmp_path: Path) -> None:
    raw = {**ZERO3, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 5e-4}}}
    v = _settled(["--config", str(_write(tmp_path, raw)), "--batch-size", "4", "--lr", "0.0005"])
    assert (v.batch_size, v.lr) == (4, 5e-4)


# --------------------------------------------------------------------------- #
# A contradiction: one line, status 2, nothing started
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("raw", "option", "said"),
    [
        ({**ZERO3, "train_micro_batch_size_per_gpu": 4}, ["--batch-size", "8"],
         "train_micro_batch_size_per_gpu is 4 but --batch-size is 8"),
        ({**ZERO3, "train_batch_size": 24}, ["--batch-size", "8"],
         "train_batch_size is 24 but --batch-size 8 x gradient_accumulation_steps 1 x 2 ranks is 16"),
        ({**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}, ["--lr", "0.01"],
         "optimizer.params.lr is 0.0005 but --lr is 0.01"),
        ({**ZERO3, "bf16": {"enabled": True}}, ["--dtype", "fp32"], "bf16.enabled is True but --dtype is fp32"),
        ({**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}}, ["--steps", "20"],
         "scheduler.params.total_num_steps is 50 but --steps is 20"),
        ({"micro_batch_size": 4}, ["--batch-size", "8"], "micro_batch_size is 4 but --batch-size is 8"),
    ],
)
def test_a_contradiction_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: dict[str, Any], option: list[str], said: str
) -> None:
    path = _write(tmp_path, raw)
    with pytest.raises(Contradiction, match=said):
        _settled(["--config", str(path), *option])
    out = tmp_path / "out"
    assert train.main([*TINY_RUN, "--nproc", "2", "--config", str(path), *option, "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --config {path}: {said}") and "Drop the option" in line
    assert not out.exists() and not torch.distributed.is_initialized()


def test_two_contradictions_share_the_line(tmp_path: Path) -> None:
    raw = {**ZERO3, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}
    with pytest.raises(Contradiction) as exc:
        _settled(["--config", str(_write(tmp_path, raw)), "--batch-size", "8", "--lr", "0.01"])
    assert "\n" not in str(exc.value) and "--batch-size is 8" in str(exc.value) and "--lr is 0.01" in str(exc.value)


# --------------------------------------------------------------------------- #
# Training from the JSON (one gloo rank in this process, as under torchrun)
# --------------------------------------------------------------------------- #


def _train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    assert train.main([*TINY_RUN, "--steps", "3", *argv, "--out", str(out)]) == 0
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    with (out / "loss_history.csv").open() as f:
        summary["lrs"] = [float(row["lr"]) for row in csv.DictReader(f)]
    return summary


def test_trains_from_the_hf_zero3_json_unedited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    s = _train(tmp_path, monkeypatch, ["--config", str(HF_ZERO3)])
    assert s["config_source"] == str(HF_ZERO3) and s["training"]["steps"] == 3
    assert s["config"]["optimizer"]["lr"] == train.DEFAULT_LR
    assert s["config"]["offload_optimizer"]["device"] == "cpu"  # the JSON's offload_optimizer, on the host
    # DeepSpeed's WarmupLR (log warm-up over max(2, warmup_num_steps) steps) from 0 to the job's lr
    assert s["lrs"] == [0.0, 0.0, train.DEFAULT_LR]
    assert all(loss > 0 for loss in (s["loss"]["start"], s["loss"]["end"]))
    assert "--config's WarmupLR schedule" in capsys.readouterr().out


def test_trains_with_the_jsons_micro_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _train(tmp_path, monkeypatch, ["--config", str(_write(tmp_path, {**ZERO3, "train_micro_batch_size_per_gpu": 4}))])
    seq_len = train.MODEL_SIZES["tiny"][3]
    assert s["training"]["batch_size_per_rank"] == 4 and s["training"]["tokens_per_step"] == 4 * seq_len


def test_trains_with_the_jsons_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.1}}}
    s = _train(tmp_path, monkeypatch, ["--config", str(_write(tmp_path, raw))])
    assert s["training"]["lr"] == 5e-4
    assert s["config"]["optimizer"] == {"adamw": True, "lr": 5e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                        "weight_decay": 0.1}  # fmt: skip
    # no scheduler section: the job's warm-up and cosine decay, peaking at the JSON's lr
    assert s["lrs"] == [train.lr_at(step, 3, 5e-4) for step in range(3)]
    assert "AdamW lr 0.0005 (--config's optimizer, weight decay 0.1)" in capsys.readouterr().out


# --------------------------------------------------------------------------- #
# --help and parsing import no torch
# --------------------------------------------------------------------------- #


def test_help_imports_no_torch() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "z3kit_recipes.train", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m z3kit_recipes.train") and "--config" in done.stdout
    # -X importtime: one stderr line per imported module, "import time: self | cumulative | name"
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "z3kit_recipes.train.options" in imported  # the check can see what it looks for
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy", "transformers", "tokenizers"))
    assert not heavy, heavy


def test_parsing_imports_no_torch() -> None:
    code = ("import sys; from z3kit_recipes.train.options import parse_args; "
            "a = parse_args(['--steps', '3', '--width', '48', '--heads', '4']); "
            "assert (a.steps, a.lr, sorted(a.given)) == (3, 3e-3, ['steps']), a; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
