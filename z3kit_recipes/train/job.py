"""What one rank does, from reading the corpus to the summary: the job that
``launch`` runs in every process once the process group is up."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from z3kit.device import DeviceInfo
from z3kit.sharded_muon import ShardedMuon
from z3kit_recipes import zero3
from z3kit_recipes.models import GPT
from z3kit_recipes.train import checkpointing
from z3kit_recipes.train.checkpointing import CheckpointFigures, Checkpointer
from z3kit_recipes.train.corpus import CharVocab, Corpus, load_corpus
from z3kit_recipes.train.interrupt import INTERRUPTED, StopRequest, interrupted_line, last_checkpoint
from z3kit_recipes.train.defaults import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY
from z3kit_recipes.train.loop import LoopResult, LoopStart, train_steps
from z3kit_recipes.train.memory import MemoryFigures, RankMemory, Replica, peak_rss_bytes
from z3kit_recipes.train.outputs import shared_out_dir, write_history
from z3kit_recipes.train.plots import write_plots
from z3kit_recipes.train.profile import trace_labels
from z3kit_recipes.train.render import render_header, render_summary
from z3kit_recipes.train.run_folder import remove_if_empty
from z3kit_recipes.train.report import (
    CollectiveFigures,
    CommWait,
    CorpusFigures,
    LiveFigures,
    LossFigures,
    ProfileFigures,
    SampleFigures,
    Summary,
    TimelineFigures,
    TraceFigures,
    TrainingFigures,
)
from z3kit_recipes.train.sample import generate
from z3kit_recipes.train.spec import RunSpec
from z3kit_recipes.zero3.training.timeline import TimelineEvent
from z3kit_recipes.zero3.training.trainable import MasterShards


@attrs.frozen
class _Trained:
    """What every rank knows after the last step, gathered where it is per rank."""

    loop: LoopResult
    #: this rank's engine figures at the end of the last step (the summary reports rank 0's)
    final: zero3.Zero3Stats
    #: ``loss_table[rank][step]``
    loss_table: list[list[float]]
    memory: list[RankMemory]
    timeline: list[TimelineEvent]
    sample: SampleFigures
    checkpoints: CheckpointFigures


def muon_and_adamw(params: MasterShards, lr: float) -> torch.optim.Optimizer:
    """``--optimizer muon``: Muon on the blocks' matrices, with Moonshot's ``match_rms_adamw``
    scaling so that AdamW's lr and weight decay carry over, and the job's AdamW on the rest."""
    named = params.named()
    on_muon = [len(params.full_shape(p)) == 2 and name.startswith("blocks.") for name, p in named]
    groups: list[dict[str, Any]] = [
        {"params": [p for (_, p), m in zip(named, on_muon) if m]},
        {"params": [p for (_, p), m in zip(named, on_muon) if not m], "use_muon": False, "betas": ADAM_BETAS,
         "eps": ADAM_EPS},
    ]
    return ShardedMuon(groups, params, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw",
        adamw={"lr": lr, "weight_decay": WEIGHT_DECAY})


def run_job(
    spec: RunSpec, rank: int, world: int, info: DeviceInfo, started: float, stop: StopRequest, *, spawned: bool
) -> int:
    """Train, gather every rank's figures, and (rank 0) write and print the
    summary; 0, or :data:`INTERRUPTED` when Ctrl-C stopped the run (see
    ``interrupt``: under torchrun rank 0 says so, a spawning parent itself)."""
    device = info.device
    out, made = shared_out_dir(spec.out, rank, device)
    stop.run_dir = out
    corpus = load_corpus(spec.corpus_chars)
    check_same_corpus(corpus, spec, device)
    vocab = CharVocab.from_text(corpus.text)
    if len(vocab) != spec.model.vocab_size:
        raise RuntimeError(f"vocabulary has {len(vocab)} characters, the model {spec.model.vocab_size}")
    data = vocab.tokens(corpus.text)

    torch.manual_seed(spec.seed)
    lr = spec.lr
    # the --config JSON's optimizer section, when it has one, is the optimizer (initialize builds it)
    factory = None if spec.config.optimizer is not None else (
        (lambda params: muon_and_adamw(params, lr)) if spec.optimizer == "muon" else
        (lambda params: torch.optim.AdamW(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)))
    engine = zero3.initialize(GPT(spec.model), factory, spec.config)
    said: list[str] = []
    start, resumed_world = LoopStart(), None
    if spec.init_from is not None:
        said.append(checkpointing.init_from(engine, spec.init_from, spec.model))
    if spec.resume is not None:
        start, resumed_world, message = checkpointing.resume(engine, spec, checkpointing.vocab_digest(vocab), spec.resume)
        said.append(message)
    if rank == 0:
        print("\n".join([render_header(spec, corpus, vocab, engine.stats(), world, info, str(out)), *said]), flush=True)
    trained = _train_and_gather(engine, data, spec, vocab, rank, world, out, start, resumed_world, stop)
    if trained is None:
        dist.barrier()  # every rank has stopped writing
        if rank == 0 and not spawned:
            removed = remove_if_empty(made)
            line = interrupted_line(last_checkpoint(out, spec.resume), spec.argv,
                                    removed=removed[0] if removed else None, torchrun=True)  # fmt: skip
            print(line, file=sys.stderr, flush=True)
        return INTERRUPTED
    if rank == 0:
        _report(spec, corpus, vocab, world, info, out, trained, total_s=time.perf_counter() - started)
    return 0


def _stop_check(stop: StopRequest, engine: zero3.Zero3Engine) -> bool:
    """Whether any rank was asked to stop (collective: the loop asks every rank before each step)."""
    flag = torch.tensor([int(stop.requested)], dtype=torch.int32, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=engine.group)
    return bool(flag.item())


def _train_and_gather(
    engine: zero3.Zero3Engine,
    data: torch.Tensor,
    spec: RunSpec,
    vocab: CharVocab,
    rank: int,
    world: int,
    out: Path,
    start: LoopStart,
    resumed_world: int | None,
    stop: StopRequest,
) -> _Trained | None:
    """The training and every rank's figures; None when the run was interrupted."""
    saver = Checkpointer(engine, spec, out, checkpointing.vocab_digest(vocab), start, resumed_world)
    loop = train_steps(engine, data, spec, rank, world, out, start, saver.after_step, lambda: _stop_check(stop, engine))
    if loop.interrupted:
        return None
    # read before anything else runs: the engine's peaks cover the last step,
    # and the full state dict below would add a whole model to the resident set
    final = engine.stats()
    mine = RankMemory.of(rank, final.memory, peak_rss=peak_rss_bytes(), peak_live_numel=loop.tally.peak_live)
    said = saver.finish(loop.losses, loop.lrs)  # the last checkpoint, --export
    if rank == 0 and said:
        print("\n".join(said), flush=True)
    device = engine.device
    # float64: every rank's losses exactly as the loop kept them (Python floats)
    losses = gather_rows(torch.tensor(loop.losses, dtype=torch.float64, device=device), world)
    memory = gather_rows(mine.to_row().to(device), world)

    # full weights on every rank (collective), generated on rank 0
    text, sample_s = "", 0.0
    if spec.sample_chars > 0:
        t_sample = time.perf_counter()
        state = engine.full_state_dict()
        if rank == 0:
            text = generate(spec, vocab, state)
        sample_s = time.perf_counter() - t_sample
    return _Trained(
        loop=loop,
        final=final,
        loss_table=[[float(v) for v in row.tolist()] for row in losses],
        memory=[RankMemory.from_row(r, [int(v) for v in row.tolist()]) for r, row in enumerate(memory)],
        timeline=list(engine.timeline),
        sample=SampleFigures(spec.prompt, spec.sample_chars, spec.temperature, text, sample_s),
        checkpoints=saver.figures(),
    )


def _report(
    spec: RunSpec,
    corpus: Corpus,
    vocab: CharVocab,
    world: int,
    info: DeviceInfo,
    out: Path,
    trained: _Trained,
    *,
    total_s: float,
) -> None:
    """Rank 0: the output files, ``summary.json`` and the printed summary."""
    final, loop = trained.final, trained.loop
    write_history(out / "loss_history.csv", trained.loss_table, loop.lrs)
    files = ["loss_history.csv", *(f"{Path(c.path).name}/" for c in trained.checkpoints.saved)]
    if spec.plot:
        files += write_plots(out, trained.loss_table, trained.timeline, final.max_live_parameters, final.model_numel)
    profile: ProfileFigures | None = None
    if spec.profile:
        traces = [t.name for t in sorted(out.glob("trace_rank*.json"))]
        files += traces
        steps = list(range(*loop.profile_window))
        profile = ProfileFigures(steps, traces, trace_labels(out / "trace_rank0.json"))
    memory = MemoryFigures(
        model_numel=final.model_numel,
        per_rank=trained.memory,
        replica=Replica.of(final.model_numel, spec.config.torch_dtype),
        plan=None if final.memory_plan is None else final.memory_plan.describe(),
    )
    summary = Summary(
        command="python -m z3kit_recipes.train " + " ".join(spec.argv),
        out=str(out),
        world=world,
        backend=info.backend,
        device=str(info.device),
        threads_per_rank=torch.get_num_threads(),
        corpus=CorpusFigures.of(corpus, len(vocab)),
        model=spec.model,
        config_source=spec.config_source,
        config=spec.config,
        training=TrainingFigures.of(spec, loop, world, total_s),
        loss=LossFigures.of(trained.loss_table),
        memory=memory,
        live=LiveFigures.of(final, memory),
        collectives=CollectiveFigures.of(final),
        comm_wait=CommWait.of(loop.tally),
        trace=TraceFigures(final.trace_state, final.trace_invalidations),
        timeline=TimelineFigures.of(trained.timeline, len(loop.losses)),
        sample=trained.sample,
        profile=profile,
        checkpoints=trained.checkpoints,
        files=[*files, "summary.json"],
    )
    (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n", encoding="utf-8")
    print(render_summary(summary), flush=True)


def check_same_corpus(corpus: Corpus, spec: RunSpec, device: torch.device) -> None:
    """Every rank must train on rank 0's corpus (the parent's, when spawned)."""
    mine = torch.tensor(list(bytes.fromhex(corpus.digest)[:8]), dtype=torch.int64, device=device)
    ref = mine.clone()
    dist.broadcast(ref, 0)
    expected = spec.corpus_digest == corpus.digest
    if not (bool(torch.equal(mine, ref)) and expected):
        raise RuntimeError(
            f"rank {dist.get_rank()} read a different corpus from {corpus.root} than rank 0 "
            "(different Python installations?); run every rank with the same Python"
        )


def gather_rows(row: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's ``row`` (same length and dtype on all ranks), by rank, on the CPU."""
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return [r.cpu() for r in rows]
