"""``Zero3Trainer``: a real ``transformers.Trainer`` script under torchrun, against its DDP twin.

``examples/hf_trainer.py`` runs at 2 ranks (gloo): as plain Trainer
(DDP), as ``Zero3Trainer``, as ``Zero3Trainer`` resumed from its
``checkpoint-2``, and with Hugging Face's documented ``ds_config_zero3.json``
against DDP with the optimizer and schedule DeepSpeed builds from it. The z3kit run logs the same losses, gradient norms,
learning rates and eval losses as DDP; the resumed run continues exactly;
``save_model`` writes safetensors that ``from_pretrained`` loads with
DDP's weights. Settings the engine cannot honour are refused by name.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "hf_trainer.py"
DRIVER = REPO / "tests" / "hf_trainer_runs.py"
DS_JSON = REPO / "tests" / "data" / "ds_config_zero3.json"
MUON_JSON = REPO / "tests" / "data" / "ds_config_zero3_muon.json"


def _torchrun(script: Path, *args: str, timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def _curve(history: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    train = [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    return train + evals


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example's runs, in one launch (``tests/hf_trainer_runs.py``); the
    z3kit run alone is launched as a user runs the example, by its own ``main``."""
    root = tmp_path_factory.mktemp("hf_trainer")
    _torchrun(SCRIPT, "--out", str(root / "z3kit"), timeout=240)
    resumed = root / "resumed"
    steps = [
        ["--out", str(root / "ddp"), "--ddp"],
        ["copy", str(root / "z3kit"), str(resumed), "checkpoint-4", "history.json"],
        ["--out", str(resumed), "--resume"],
        # Hugging Face's documented ZeRO-3 JSON, unedited, against what DeepSpeed builds from it on DDP
        ["--out", str(root / "json"), "--json", str(DS_JSON)],
        ["--out", str(root / "json_ddp"), "--json", str(DS_JSON), "--ddp"],
        # a JSON whose optimizer is DeepSpeed's Muon
        ["--out", str(root / "muon"), "--json", str(MUON_JSON)],
    ]
    _torchrun(DRIVER, json.dumps(steps), timeout=400)
    return {"ddp": root / "ddp", "z3kit": root / "z3kit", "resumed": resumed, "json": root / "json",
            "json_ddp": root / "json_ddp", "muon": root / "muon"}


def test_the_loss_curve_matches_trainer_with_ddp(runs: dict[str, Path]) -> None:
    ddp = _curve(json.loads((runs["ddp"] / "history.json").read_text()))
    z3 = _curve(json.loads((runs["z3kit"] / "history.json").read_text()))
    assert len(z3) == len(ddp) == 6  # 4 logged steps, 2 evaluations
    for got, want in zip(z3, ddp):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len({entry[1] for entry in z3[:4]}) == 4  # the loss moves: the comparison is not of a constant


def test_the_documented_deepspeed_json_trains_at_parity(runs: dict[str, Path]) -> None:
    """Its optimizer (AdamW, decay on every parameter) and WarmupLR (DeepSpeed's own class on the DDP side)."""
    ddp = _curve(json.loads((runs["json_ddp"] / "history.json").read_text()))
    z3 = _curve(json.loads((runs["json"] / "history.json").read_text()))
    assert len(z3) == len(ddp) == 6
    for got, want in zip(z3, ddp):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert [entry[3] for entry in z3[:4]] == pytest.approx([0.0, 0.0, 5e-3, 5e-3])  # DeepSpeed's log warmup over 2 steps
    assert len({entry[1] for entry in z3[2:4]}) == 2


def test_a_json_with_muon_trains_and_saves(runs: dict[str, Path]) -> None:
    """DeepSpeed's ``"type": "Muon"`` through Zero3Trainer (its math is pinned bit for bit against
    ``torch.optim.Muon`` in ``tests/test_zero3_muon.py``): it trains, evaluates and saves."""
    z3 = _curve(json.loads((runs["muon"] / "history.json").read_text()))
    assert len(z3) == 6
    losses = [entry[1] for entry in z3[:4]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert (runs["muon"] / "model.safetensors").is_file()


def test_a_resumed_run_continues_exactly(runs: dict[str, Path]) -> None:
    assert (runs["z3kit"] / "checkpoint-2" / "z3kit").is_dir()  # the engine's sharded checkpoint, per rank
    whole = _curve(json.loads((runs["z3kit"] / "history.json").read_text()))
    resumed = _curve(json.loads((runs["resumed"] / "history.json").read_text()))
    after = [e for e in resumed if e[0] > 2]  # what the resumed run computed (steps 1-2 come from trainer_state.json)
    assert len(after) == 3
    for got, want in zip(after, [e for e in whole if e[0] > 2]):
        assert got == pytest.approx(want, rel=1e-6)


def test_save_model_loads_with_from_pretrained(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    z3 = AutoModelForCausalLM.from_pretrained(runs["z3kit"])
    ddp = AutoModelForCausalLM.from_pretrained(runs["ddp"])
    mine, theirs = z3.state_dict(), ddp.state_dict()
    assert sorted(mine) == sorted(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6)
    ids = torch.arange(8)[None]
    assert torch.equal(z3.generate(ids, max_new_tokens=6, do_sample=False),
                       ddp.generate(ids, max_new_tokens=6, do_sample=False))


def test_unsupported_settings_are_refused_by_name(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from z3kit_recipes.hf import Zero3Trainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], auto_find_batch_size=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as refused:
        Zero3Trainer(model=model, args=args, optimizers=(optimizer, None))
    message = str(refused.value)
    assert "optimizers=(...)" in message and "auto_find_batch_size" in message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing was sharded


#: a DeepSpeed JSON whose numbers disagree with the TrainingArguments below in seven places
MISMATCHED_JSON = {
    "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": "auto", "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "total_num_steps": 100}},
}
#: each disagreement, in the names the user set in TrainingArguments
MISMATCHES = [
    "gradient_clipping is 0.5 but max_grad_norm=1.0",
    "optimizer.params.lr is 0.001 but learning_rate=5e-05",
    "optimizer.params.betas is [0.9, 0.95] but adam_beta2=0.999",
    "optimizer.params.weight_decay is 0.0 but weight_decay=0.01",
    "scheduler.params.warmup_max_lr is 0.001 but learning_rate=5e-05",
    "scheduler.params.warmup_num_steps is 10 but warmup_steps=0",
    "scheduler.params.total_num_steps is 100 but max_steps=50",
]


def _args(tmp_path: Path, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_json_mismatches_are_named_by_training_arguments_all_at_once(tmp_path: Path) -> None:
    from z3kit_recipes.hf.json_arguments import mismatches
    from z3kit_recipes.hf.settings import json_schedule

    args = _args(tmp_path, weight_decay=0.01, max_steps=50)
    assert sorted(mismatches(MISMATCHED_JSON, args)) == sorted(MISMATCHES)  # adam_beta1 agrees: not named
    agreeing = _args(tmp_path, learning_rate=1e-3, adam_beta2=0.95, max_grad_norm=0.5, warmup_steps=10, max_steps=100)
    assert mismatches(MISMATCHED_JSON, agreeing) == []
    # a warmup ratio and no max_steps: the step counts are checked once train() knows them, by name again
    ratio = _args(tmp_path, learning_rate=1e-3, adam_beta2=0.95, max_grad_norm=0.5, warmup_steps=0.5)
    assert mismatches(MISMATCHED_JSON, ratio) == []
    with pytest.raises(ValueError) as late:
        json_schedule(MISMATCHED_JSON["scheduler"], ratio, 40)
    assert "warmup_num_steps is 10 but warmup_steps=0.5" in str(late.value)
    assert "total_num_steps is 100 but training steps (num_train_epochs x the data)=40" in str(late.value)


def test_zero3_trainer_reports_every_json_mismatch_in_one_error_before_sharding(tmp_path: Path) -> None:
    from z3kit_recipes.hf import Zero3Trainer

    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as refused:
        Zero3Trainer(model=model, args=_args(tmp_path, weight_decay=0.01, max_steps=50), z3kit_config=MISMATCHED_JSON)
    message = str(refused.value)
    assert message.startswith("the DeepSpeed JSON disagrees with TrainingArguments: ")
    for line in MISMATCHES:
        assert line in message
    assert "TrainingValues" not in message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("where", ["arguments", "json", "config"])
def test_fp16_is_refused_saying_what_to_use(tmp_path: Path, where: str) -> None:
    from z3kit_recipes import zero3
    from z3kit_recipes.hf import Zero3Trainer

    args = _args(tmp_path, fp16=where == "arguments")
    config: Any = {"json": {"fp16": {"enabled": True}, "gradient_clipping": "auto"},
                   "config": zero3.Zero3Config(compute_dtype="fp16"), "arguments": None}[where]
    with pytest.raises(ValueError) as refused:
        Zero3Trainer(model=_llama(), args=args, z3kit_config=config)
    message = str(refused.value)
    assert "use bf16=True" in message and "engine.backward(loss)" in message and "\"fp16\": {\"enabled\": false}" in message


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
