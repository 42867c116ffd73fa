"""Ctrl-C: the ranks stop together at a step's end, and the command says in
one line where the run can be resumed from.

Note: how a run stops.
    Each rank answers SIGINT by setting a flag (``StopRequest``), and the
    loop asks every rank, in one small collective before each step, whether
    any has one (``requested_anywhere``). So a Ctrl-C that reaches every
    rank (a terminal's, or torchrun's, which also forwards its own) and one
    that reaches a single rank stop the run alike: every rank finishes the
    step it is in, checkpoints saved so far stay as they are, and the
    ranks leave together with status 130. The launching process (the
    spawning parent, or torchrun's rank 0) then prints one line: the last
    checkpoint and the command that resumes from it, or that there is none
    (:func:`interrupted_line`); the run folder goes if the run created it
    and left nothing in it (``run_folder.remove_if_empty``).

    More SIGINTs within :data:`GRACE_S` of the first are the same request
    (the terminal's and the forwarded one arrive together); one after that
    stops the rank at once, for a run that does not reach a step's end.
"""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from z3kit_recipes.train.run_folder import CHECKPOINT_NAME, complete_checkpoints

#: the exit status of an interrupted run (128 + SIGINT, as a shell reports it)
INTERRUPTED: Final = 130
#: seconds after the first SIGINT during which more are the same request
GRACE_S: Final = 5.0

#: options that say where a run starts, replaced by ``--resume`` in the resume command
_START_OPTIONS: Final = ("--resume", "--init-from")


class StopRequest:
    """This process's SIGINT, as a flag (see the module's Note)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self._previous: Any = signal.SIG_DFL
        #: the run folder, once the job knows it (what a second Ctrl-C reports from)
        self.run_dir: Path | None = None

    @property
    def requested(self) -> bool:
        return self.at is not None

    def install(self) -> None:
        """Answer SIGINT from now on (in the main thread), until ``uninstall``."""
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def uninstall(self) -> None:
        """SIGINT as it was answered before ``install`` (the process goes on: torchrun's rank returns from main)."""
        signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.at is None:
            self.at = now
        elif now - self.at > GRACE_S:
            raise KeyboardInterrupt


def resume_command(argv: Sequence[str], checkpoint: Path, *, torchrun: bool) -> str:
    """The command that continues the run of ``argv`` from ``checkpoint``:
    the same options, with ``--resume checkpoint`` for where it started."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _START_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(o + "=" for o in _START_OPTIONS)):
            continue
        kept.append(arg)
    launcher = "torchrun [your torchrun options] -m z3kit_recipes.train" if torchrun else "python -m z3kit_recipes.train"
    return f"{launcher} {shlex.join([*kept, '--resume', str(checkpoint)])}"


def last_checkpoint(out: Path, resumed_from: str | None) -> tuple[int, Path] | None:
    """(step, folder) of the checkpoint to resume from after an interruption:
    the run folder's latest complete one, or the one the run resumed from
    when that is later (or the folder has none)."""
    found = complete_checkpoints(out)
    candidates = [found[-1]] if found else []
    if resumed_from is not None and (match := CHECKPOINT_NAME.fullmatch(Path(resumed_from).name)):
        candidates.append((int(match.group(1)), Path(resumed_from)))
    return max(candidates, key=lambda c: c[0]) if candidates else None


def interrupted_line(
    last: tuple[int, Path] | None, argv: Sequence[str], *, removed: Path | None, torchrun: bool
) -> str:
    """What the command prints when Ctrl-C stopped it: ``last`` is the
    (step, folder) to resume from, None when there is none; ``removed`` the
    run folder deleted because the run left nothing in it."""
    gone = f"; removed the empty run folder {removed}" if removed is not None else ""
    if last is None:
        return f"interrupted: no checkpoint was saved (--save-every N saves one every N steps), nothing to resume{gone}"
    step, folder = last
    return (f"interrupted: the last checkpoint is {folder} (step {step}); resume with: "
            f"{resume_command(argv, folder, torchrun=torchrun)}{gone}")  # fmt: skip
