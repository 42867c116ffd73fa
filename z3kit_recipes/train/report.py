"""The run's summary as typed records: built from what the run measured,
written as ``summary.json`` (``Summary.to_json``) and printed by
``render.render_summary``.

Each section is built by its own constructor from the data it comes from
(the gathered loss table, the engine's last ``Zero3Stats``, the captured
timeline), so the summary is one record of small ones rather than one
function of every figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Final

import attrs

from z3kit_recipes import zero3
from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train.checkpointing import CheckpointFigures
from z3kit_recipes.train.corpus import Corpus
from z3kit_recipes.train.loop import LoopResult, Tally
from z3kit_recipes.train.memory import MemoryFigures
from z3kit_recipes.train.spec import RunSpec
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.training.timeline import TimelineEvent

#: steps averaged for the loss at the start and at the end
LOSS_WINDOW: Final = 10


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def mean_over_ranks(loss_table: Sequence[Sequence[float]]) -> list[float]:
    """Each step's loss averaged over ranks (``loss_table[rank][step]``)."""
    return [mean([row[s] for row in loss_table]) for s in range(len(loss_table[0]))]


@attrs.frozen
class CorpusFigures:
    root: str
    files: int
    chars: int
    vocab_size: int
    sha256: str

    @classmethod
    def of(cls, corpus: Corpus, vocab_size: int) -> CorpusFigures:
        return cls(corpus.root, corpus.files, len(corpus.text), vocab_size, corpus.digest)


@attrs.frozen
class TrainingFigures:
    #: every step of the run, the resumed ones included
    steps: int
    #: the step this process started at (0, or the resumed checkpoint's); rates count the steps after it
    first_step: int
    batch_size_per_rank: int
    gradient_accumulation_steps: int
    tokens_per_step: int
    lr: float
    seed: int
    train_s: float
    total_s: float
    steps_per_s: float
    #: median wall time of the counted steps (see ``loop.Tally``); None when none was counted
    median_step_s: float | None
    tokens_per_s: float

    @classmethod
    def of(cls, spec: RunSpec, loop: LoopResult, world: int, total_s: float) -> TrainingFigures:
        steps, tokens = len(loop.losses), spec.tokens_per_step(world)
        run = steps - loop.first_step
        times = loop.tally.step_times
        return cls(
            steps=steps,
            first_step=loop.first_step,
            batch_size_per_rank=spec.batch_size,
            gradient_accumulation_steps=spec.micro_steps,
            tokens_per_step=tokens,
            lr=spec.lr,
            seed=spec.seed,
            train_s=loop.train_s,
            total_s=total_s,
            steps_per_s=run / loop.train_s,
            median_step_s=statistics.median(times) if times else None,
            tokens_per_s=run * tokens / loop.train_s,
        )


@attrs.frozen
class LossFigures:
    """Mean loss over ranks: of the first and last ``window`` steps, and of the first and last step."""

    window: int
    start: float
    end: float
    first: float
    last: float

    @classmethod
    def of(cls, loss_table: Sequence[Sequence[float]]) -> LossFigures:
        per_step = mean_over_ranks(loss_table)
        window = min(LOSS_WINDOW, len(per_step))
        return cls(window, mean(per_step[:window]), mean(per_step[-window:]), per_step[0], per_step[-1])


@attrs.frozen
class LiveFigures:
    """Gathered parameter elements: the high-water over the run (any rank) against the limit."""

    peak_live_numel: int
    max_live_parameters: int
    largest_fetch_numel: int
    model_numel: int

    @classmethod
    def of(cls, final: zero3.Zero3Stats, memory: MemoryFigures) -> LiveFigures:
        peak = max(r.peak_live_numel for r in memory.per_rank)
        return cls(peak, final.max_live_parameters, final.largest_fetch_numel, final.model_numel)


@attrs.frozen
class CollectiveFigures:
    """Collectives of the last optimizer step on rank 0, by kind (calls and bytes)."""

    per_step: dict[str, dict[str, int]]
    calls_per_step: int
    bytes_per_step: int

    @classmethod
    def of(cls, final: zero3.Zero3Stats) -> CollectiveFigures:
        used = {kind: dict(v) for kind, v in sorted(final.collectives.items()) if v.get("calls", 0) > 0}
        return cls(used, sum(v["calls"] for v in used.values()), sum(v.get("bytes", 0) for v in used.values()))


@attrs.frozen
class CommWait:
    """The share of the engine's step time spent blocked on communication, on ``rank``."""

    share: float
    wait_s: float
    step_s: float
    steps_counted: int
    rank: int = 0
    #: of the step time, the part spent on the ranks' agreement checks (``zero3.ranks.agreement``)
    rank_check_s: float = 0.0

    @classmethod
    def of(cls, tally: Tally, rank: int = 0) -> CommWait:
        share = tally.wait_s / tally.step_s if tally.step_s > 0 else 0.0
        return cls(share, tally.wait_s, tally.step_s, tally.counted, rank, tally.check_s)


@attrs.frozen
class TraceFigures:
    state: str
    invalidations: int


@attrs.frozen
class TimelineFigures:
    """Rank 0's parameter timeline of one step (the last; ``step`` None when none was captured)."""

    step: int | None
    events: int
    #: fetches that had to gather something themselves: what prefetch did not bring in time
    demand_gathers: int
    prefetches: int
    #: releases that freed something
    releases: int
    peak_live_numel: int

    @classmethod
    def of(cls, timeline: Sequence[TimelineEvent], steps: int) -> TimelineFigures:
        def count(kind: str) -> int:
            return sum(1 for e in timeline if e.kind == kind and e.numel > 0)

        return cls(
            step=steps - 1 if timeline else None,
            events=len(timeline),
            demand_gathers=count("fetch"),
            prefetches=count("prefetch"),
            releases=count("release"),
            peak_live_numel=max((e.live_numel for e in timeline), default=0),
        )


@attrs.frozen
class SampleFigures:
    prompt: str
    chars: int
    temperature: float
    #: the prompt and what the trained model wrote after it ("" without a sample)
    text: str
    seconds: float


@attrs.frozen
class ProfileFigures:
    #: the profiled steps; empty when there were too few steps
    steps: list[int]
    files: list[str]
    #: ranges of each engine label in rank 0's trace
    labels_rank0: dict[str, int]


@attrs.frozen
class Summary:
    """Everything rank 0 reports at the end of a run."""

    command: str
    out: str
    world: int
    backend: str
    device: str
    threads_per_rank: int
    corpus: CorpusFigures
    model: GPTConfig
    config_source: str
    config: Zero3Config
    training: TrainingFigures
    loss: LossFigures
    memory: MemoryFigures
    live: LiveFigures
    collectives: CollectiveFigures
    comm_wait: CommWait
    trace: TraceFigures
    timeline: TimelineFigures
    sample: SampleFigures
    profile: ProfileFigures | None
    files: list[str]
    #: --init-from, --resume, --save-every, --export
    checkpoints: CheckpointFigures

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON data (``summary.json``): the records as objects, bytes as ints."""
        return attrs.asdict(self)
