"""TRL's SFTTrainer and DPOTrainer on z3kit against TRL on DDP (``examples/trl_trainers.py``).

Both train at 2 ranks (gloo) with ``class T(Zero3Trainer, SFTTrainer)``:
TRL's fused log-prob loss hands ``lm_head.weight`` to its own
``autograd.Function``, and DPO's reference model is sharded by an engine of
its own. Losses and final weights match TRL's run on DDP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_hf_trainer import DRIVER, REPO, _torchrun

pytest.importorskip("trl")
EXAMPLE = REPO / "examples" / "trl_trainers.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trl")
    steps = [["--trainer", t, "--out", str(root / f"{t}_{m}"), *(["--ddp"] if m == "ddp" else [])]
             for t in ("sft", "dpo") for m in ("ddp", "z3kit")]
    _torchrun(DRIVER, json.dumps(steps), str(EXAMPLE), timeout=400)
    return root


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trl_trainer_matches_ddp(runs: Path, trainer: str) -> None:
    def history(mode: str) -> list[float]:
        log = json.loads((runs / f"{trainer}_{mode}" / "history.json").read_text())
        return [e["loss"] for e in log if "loss" in e]

    ddp, ours = history("ddp"), history("z3kit")
    assert len(ours) == len(ddp) == 3
    assert ours == pytest.approx(ddp, rel=1e-5)
    want = torch.load(runs / f"{trainer}_ddp" / "weights.pt")
    got = torch.load(runs / f"{trainer}_z3kit" / "weights.pt")
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert ours[0] != ours[-1]  # it trained
    run = json.loads((runs / f"{trainer}_z3kit" / "run.json").read_text())
    assert run["reference_sharded"] is (trainer == "dpo")
