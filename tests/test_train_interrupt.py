"""The training command under Ctrl-C, ``--resume RUN_DIR`` and ``--keep-last``,
driven through the command line as a user runs it (2 spawned gloo ranks, the
tiny model): SIGINT to the whole process group (a terminal's Ctrl-C, which
reaches every rank) and to one rank alone."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from z3kit_recipes.launch import free_port
from z3kit_recipes.train.interrupt import INTERRUPTED

TINY = ["--model-size", "tiny", "--sample-chars", "0", "--corpus-chars", "50000", "--steps", "100000"]
COMMAND = [sys.executable, "-m", "z3kit_recipes.train"]


def _start(argv: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with (log.with_suffix(".out")).open("wb") as out, (log.with_suffix(".err")).open("wb") as err:
        return subprocess.Popen([*COMMAND, *argv], cwd=cwd, stdout=out, stderr=err, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})


def _wait_for(what: str, done: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the command ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _ranks(proc: subprocess.Popen[bytes]) -> list[int]:
    """The spawned ranks' process ids (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _finish(proc: subprocess.Popen[bytes], log: Path) -> tuple[str, str]:
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def _interrupt(
    argv: list[str], cwd: Path, log: Path, ready: Callable[[subprocess.Popen[bytes], str, str], bool],
    send: Callable[[subprocess.Popen[bytes]], None], env: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Run the command until ``ready(process, stdout, stderr)``, ``send`` the
    signal, and return what it printed and its one ``interrupted`` line."""
    proc = _start(argv, cwd, log, env)
    try:
        _wait_for("the moment to interrupt", lambda: ready(proc, log.with_suffix(".out").read_text(),
                                                           log.with_suffix(".err").read_text()), proc)
        send(proc)
    finally:
        out, err = _finish(proc, log)
    assert proc.returncode == INTERRUPTED, err
    return out, _interrupted_line(err)


def _interrupted_line(err: str) -> str:
    assert "Traceback" not in err and "Terminating process" not in err, err
    (line,) = [line for line in err.splitlines() if "interrupted" in line]
    return line.strip()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through /proc")
def test_ctrl_c_names_the_checkpoint_and_resume_takes_the_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # A: Ctrl-C at the terminal (SIGINT to the parent and every rank), after --keep-last has rotated
    out, line = _interrupt([*TINY, "--save-every", "2", "--keep-last", "2", "--out", str(run)], tmp_path, tmp_path / "a",
                           lambda _, out, __: "deleted checkpoint-000004" in out,  # a rotated checkpoint
                           lambda proc: os.killpg(proc.pid, signal.SIGINT))
    kept = sorted(p.name for p in run.iterdir())
    # only this run's newest two: each save deleted the oldest beyond two, and nothing else is there
    assert len(kept) == 2 and all(re.fullmatch(r"checkpoint-\d{6}", k) for k in kept), kept
    first, last = (int(k.split("-")[1]) for k in kept)
    assert last == first + 2 and last >= 6
    assert f"saved checkpoint {run / kept[1]} (step {last})" in out
    assert f"deleted checkpoint-{first - 2:06d} (--keep-last 2)" in out
    again = [*TINY, "--save-every", "2", "--keep-last", "2", "--out", str(run), "--resume", str(run / kept[1])]
    resume = f"python -m z3kit_recipes.train {shlex.join(again)}"
    assert line == f"interrupted: the last checkpoint is {run / kept[1]} (step {last}); resume with: {resume}"

    # B: --resume the run folder (its latest checkpoint), no --save-every, no --out; SIGINT to one rank only
    cwd = tmp_path / "b"
    cwd.mkdir()
    resumed = f"resumed from {run / kept[1]} at step {last}"
    out, line = _interrupt([*TINY, "--resume", str(run)], cwd, tmp_path / "b",
                           lambda proc, out, _: resumed in out and len(_ranks(proc)) == 2,
                           lambda proc: os.kill(_ranks(proc)[-1], signal.SIGINT))
    assert f"--resume {run}: taking its latest checkpoint, {kept[1]} (step {last}, the newest of 2)" in out
    assert line.startswith(f"interrupted: the last checkpoint is {run / kept[1]} (step {last}); resume with: ")
    made = re.search(r"^output: (\S+)$", out, re.M)
    assert made is not None and Path(made[1]).parent == Path("runs")
    assert line.endswith(f" --resume {run / kept[1]}; removed the empty run folder {made[1]}")
    assert list(cwd.iterdir()) == []  # runs/<timestamp> and runs/, both this run's, are gone
    assert sorted(p.name for p in run.iterdir()) == kept  # A's checkpoints untouched


def test_ctrl_c_under_torchrun_without_a_checkpoint_leaves_no_run_folder(tmp_path: Path) -> None:
    """As torchrun starts a rank (its variables set; one rank here, in this
    process): SIGINT to it, no --save-every, no --out: the line says there is
    nothing to resume, and runs/<timestamp> (and runs/) are gone."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out, line = _interrupt(TINY, tmp_path, tmp_path / "t", lambda _, __, err: "step/s" in err,  # the progress bar
                           lambda proc: os.kill(proc.pid, signal.SIGINT), env)
    made = re.search(r"^output: (\S+)$", out, re.M)
    assert made is not None
    assert line == ("interrupted: no checkpoint was saved (--save-every N saves one every N steps), "
                    f"nothing to resume; removed the empty run folder {made[1]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.err", "t.out"]
