"""``print(engine.stats())`` is a short table (``repr`` and the fields as
before); the errors every rank raises are importable from ``zero3``; a
missing folder passed to a load is called missing, by path, and the engine
is left as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.errors import unchanged
from z3kit_recipes.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=40, width=16, n_layer=2, n_head=2, seq_len=8)


def _engine(ctx: Any) -> Any:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    return zero3.initialize(GPT(CONFIG), torch.optim.AdamW, zero3.Zero3Config(param_persistence_threshold=0), ctx.group)


def run_stats(ctx: Any) -> tuple[Any, str, str]:
    engine = _engine(ctx)
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 40, (2, 8))).float().logsumexp(-1).mean())
        engine.step()
    stats = engine.stats()
    return stats, str(stats), repr(stats)


def test_stats_print_as_a_short_table(pools: Any) -> None:
    from z3kit_recipes.zero3 import Zero3Stats

    stats, text, rep = pools.run(2, run_stats)[0]
    assert isinstance(stats, Zero3Stats)
    lines = text.splitlines()
    assert lines[0] == f"Zero3Stats: step 2 (micro-step {stats.micro_step}), model {GPT(CONFIG).num_parameters() / 1000:.2f}k parameters"
    assert 10 <= len(lines) <= 25 and max(map(len, lines)) <= 120, text
    mem = stats.memory
    shards = next(line for line in lines if line.split()[0] == "param_shards")
    assert shards.split()[1:] == [f"{mem.current['param_shards'] / 1e6:.2f}", "MB", f"{mem.peak['param_shards'] / 1e6:.2f}", "MB"]
    assert "all_gather" in text and "in the last step" in text and "trace                 complete" in text
    # repr, fields and equality as they were
    assert rep == repr(stats) and rep.startswith("Zero3Stats(global_step=2, ") and "\n" not in rep
    assert text != rep and stats == attrs.evolve(stats) and stats.global_step == 2


def test_sizes_and_counts() -> None:
    from z3kit_recipes.zero3.runtime.stats import count, size

    assert [size(n) for n in (0, 1234, 5_600_000, 10**9, 12_345_678_901)] == [
        "0.00 MB", "0.00 MB", "5.60 MB", "1.00 GB", "12.35 GB"]  # fmt: skip
    assert [count(n) for n in (0, 999, 1000, 27_584, 1_050_000, 2 * 10**9)] == [
        "0", "999", "1.00k", "27.58k", "1.05M", "2.00G"]  # fmt: skip


def test_errors_are_importable_from_zero3() -> None:
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3.init_agreement import RanksDisagreeAtInit
    from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
    from z3kit_recipes.zero3.ranks.rank_watch import RankFailed

    assert (zero3.RanksDisagree, zero3.RankFailed, zero3.RanksDisagreeAtInit) == (
        RanksDisagree, RankFailed, RanksDisagreeAtInit)  # fmt: skip
    assert {"RanksDisagree", "RankFailed", "RanksDisagreeAtInit", "BackwardTwice", "SaveRefused"} <= set(zero3.__all__)
    assert all(hasattr(zero3, name) for name in zero3.__all__)
    assert issubclass(zero3.RankFailed, zero3.RanksDisagree) and issubclass(zero3.RanksDisagreeAtInit, ValueError)


# --------------------------------------------------------------------------- #
# A missing folder is called missing
# --------------------------------------------------------------------------- #


def run_missing(ctx: Any, path: str) -> dict[str, Any]:
    engine = _engine(ctx)
    before = engine.full_state_dict()
    errors = {}
    for name, call in (("load_deepspeed_checkpoint", engine.load_deepspeed_checkpoint),
                       ("load_checkpoint", engine.load_checkpoint), ("load_pretrained", engine.load_pretrained)):
        try:
            call(path)
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the test by type and message
            errors[name] = f"{type(e).__name__}: {e}"
    errors["unchanged"] = unchanged(before, engine.full_state_dict())
    # the engine is usable after them
    engine.backward(engine(torch.randint(0, 40, (2, 8))).float().mean())
    engine.step()
    return errors


def test_a_missing_folder_is_called_missing(pools: Any, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "checkpoint"
    for r in pools.run(2, run_missing, str(missing)):
        assert r.pop("unchanged") is True
        for name, error in r.items():
            assert error.startswith("FileNotFoundError: "), (name, error)
            assert str(missing) in error and ("does not exist" in error), (name, error)
            assert "latest" not in error and "holds neither" not in error, (name, error)


def test_a_file_is_not_a_deepspeed_folder(tmp_path: Path) -> None:
    from z3kit_recipes.zero3.weights.deepspeed_files import read_deepspeed_checkpoint

    (tmp_path / "ckpt").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file: pass the folder"):
        read_deepspeed_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="has no 'latest' file"):  # a folder without it: as before
        read_deepspeed_checkpoint(tmp_path)
