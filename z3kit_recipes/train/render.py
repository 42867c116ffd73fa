"""The summary and the run's header as text (what rank 0 prints)."""

from __future__ import annotations

from z3kit.device import DeviceInfo
from z3kit_recipes.train.checkpointing import CheckpointFigures
from z3kit_recipes.zero3 import Zero3Stats
from z3kit_recipes.zero3.config.json_muon import JsonMuon
from z3kit_recipes.train.corpus import CharVocab, Corpus
from z3kit_recipes.train.memory import KINDS, MemoryFigures
from z3kit_recipes.train.report import Summary
from z3kit_recipes.train.spec import RunSpec


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} kB"
    return f"{int(n)} B"


def render_summary(s: Summary) -> str:
    """The summary as text."""
    t, lo, live, cw, m = s.training, s.loss, s.live, s.comm_wait, s.model
    ran = f"{t.steps} steps" if not t.first_step else f"steps {t.first_step}-{t.steps - 1} of {t.steps} (resumed)"
    lines = [
        "",
        f"z3kit zero3: {s.world} ranks ({s.backend}, {s.device}), GPT {m.n_layer} layers x {m.width} "
        f"wide ({s.memory.model_numel:,} parameters), {ran} in {t.train_s:.1f} s "
        f"({t.steps_per_s:.2f} steps/s, {t.tokens_per_s:,.0f} tokens/s); {t.total_s:.1f} s in all",
        f"loss            {lo.start:.3f} -> {lo.end:.3f}  (mean of the first / last {lo.window} steps, "
        "averaged over ranks)",
        *render_memory(s.memory),
        f"live gathered   peak {live.peak_live_numel:,} elements against max_live_parameters "
        f"{live.max_live_parameters:,} (largest single fetch {live.largest_fetch_numel:,}; "
        f"whole model {live.model_numel:,})",
    ]
    coll = s.collectives
    parts = [f"{kind} {v['calls']} x ({fmt_bytes(v.get('bytes', 0))})" for kind, v in coll.per_step.items()]
    lines.append(
        f"collectives     {coll.calls_per_step} per step, {fmt_bytes(coll.bytes_per_step)}: " + ", ".join(parts)
    )
    lines.append(
        f"comm wait       {cw.share:.1%} of step time on rank {cw.rank} ({cw.wait_s:.2f} of {cw.step_s:.2f} s "
        f"over {cw.steps_counted} steps); rank checks {cw.rank_check_s / cw.step_s if cw.step_s else 0.0:.2%} "
        f"({cw.rank_check_s * 1e3:.1f} ms)"
    )
    lines.append(f"trace           {s.trace.state}, {s.trace.invalidations} invalidation(s)")
    if s.profile is not None and not s.profile.steps:
        lines.append("profile         none: too few steps (the first one records the engine's trace)")
    elif s.profile is not None:
        labels = ", ".join(f"{k} {v}" for k, v in s.profile.labels_rank0.items())
        steps = s.profile.steps
        lines.append(f"profile         steps {steps[0]}-{steps[-1]}: {labels} ranges in rank 0's trace")
    lines += render_checkpoints(s.checkpoints)
    if s.sample.text:
        lines += ["sample:", "-" * 60, s.sample.text, "-" * 60]
    lines.append(f"written to {s.out}: {', '.join(s.files)}")
    return "\n".join(lines)


def render_checkpoints(c: CheckpointFigures) -> list[str]:
    """What the run loaded and wrote (nothing without those options)."""
    lines = []
    if c.init_from is not None:
        lines.append(f"initialized     from {c.init_from}")
    if c.resumed_from is not None:
        lines.append(f"resumed         from {c.resumed_from} at step {c.resumed_at_step} "
                     f"(saved at {c.resumed_world} ranks)")  # fmt: skip
    if c.saved:
        seconds = sum(x.seconds for x in c.saved)
        steps = ", ".join(str(x.step) for x in c.saved)
        lines.append(f"checkpoints     {len(c.saved)} saved (steps {steps}; {seconds:.1f} s), the last {c.saved[-1].path}")
    if c.export is not None:
        lines.append(f"exported        to {c.export} ({c.export_s or 0.0:.1f} s)")
    return lines


def render_memory(mem: MemoryFigures) -> list[str]:
    """The memory table: a row per buffer kind, a column per rank (after the
    last step / peak over it), and one unsharded replica for comparison."""
    ranks = mem.per_rank
    cells = {k: [f"{fmt_bytes(r.current[k])} / {fmt_bytes(r.peak[k])}" for r in ranks] for k in KINDS}
    cells["total"] = [f"{fmt_bytes(r.current_total)} / {fmt_bytes(r.peak_total)}" for r in ranks]
    cells["process peak RSS"] = [fmt_bytes(r.peak_rss) for r in ranks]
    if any(r.device_peak is not None for r in ranks):
        cells["device peak"] = [fmt_bytes(r.device_peak) for r in ranks]
    replica = {k: fmt_bytes(v) if v else "-" for k, v in mem.replica.bytes.items()}
    replica["total"] = fmt_bytes(mem.replica.total)
    width = max(len(c) for c in [*(c for row in cells.values() for c in row), f"rank {len(ranks) - 1}"]) + 3
    # the longest label (a kind's name, host_optimizer_state) and a gap: no label runs into its value
    label_width = max(len(label) for label in cells) + 3

    def row(label: str, values: list[str], last: str = "") -> str:
        return (f"  {label:<{label_width}}" + "".join(f"{v:<{width}}" for v in values) + last).rstrip()

    lines = [
        "memory per rank  the engine's buffers by kind: after the last step / peak over it (total: the peak of the "
        "sum); process and device peaks: over the whole run",
        "                 unsharded replica: the whole model on one rank (parameters, fp32 masters when the compute "
        "dtype is not fp32, fp32 gradients, AdamW's two moments)",
        row("", [f"rank {r.rank}" for r in ranks], "unsharded replica"),
    ]
    lines += [row(label, values, replica.get(label, "")) for label, values in cells.items()]
    lines.append(
        f"  rank 0 peaks at {mem.peak_share_of_replica(0):.1%} of one replica "
        f"({fmt_bytes(mem.per_rank[0].peak_total)} of {fmt_bytes(mem.replica.total)} for {mem.model_numel:,} parameters)"
    )
    if mem.plan is not None:
        lines.append(f"memory plan     {mem.plan}")
    return lines


def _optimizer(spec: RunSpec) -> str:
    """The optimizer and its schedule: the job's, or the --config JSON's sections."""
    c = spec.config
    if c.optimizer is None and spec.optimizer == "muon":
        said = f"Muon (match_rms_adamw) on the blocks' matrices and AdamW on the rest, lr {spec.lr:g}"
    elif c.optimizer is None:
        said = f"AdamW lr {spec.lr:g}"
    elif isinstance(c.optimizer, JsonMuon):
        said = f"Muon lr {c.optimizer.muon_lr:g} and AdamW lr {c.optimizer.adam_lr:g} (--config's optimizer, weight " \
            f"decay {c.optimizer.weight_decay:g})"
    else:
        said = f"{'AdamW' if c.optimizer.adamw else 'Adam'} lr {spec.lr:g} (--config's optimizer, weight decay " \
            f"{c.optimizer.weight_decay:g})"
    if c.lr_scheduler is None:
        return f"{said}, warm-up then cosine decay"
    return f"{said}, --config's {c.lr_scheduler.type} schedule"


def render_header(
    spec: RunSpec, corpus: Corpus, vocab: CharVocab, stats: Zero3Stats, world: int, info: DeviceInfo, out: str
) -> str:
    """What rank 0 prints before training (``stats``: the engine's, before the first step)."""
    m, c = spec.model, spec.config
    if stats.memory_plan is None:
        sizes = (
            f"prefetch {c.prefetch_bucket_size:,}, reduce bucket {c.reduce_bucket_size:,}, "
            f"reuse distance {c.max_reuse_distance:,}, max live {c.max_live_parameters:,}"
        )
    else:  # the plan replaces the four size knobs of the config
        sizes = stats.memory_plan.describe()
    return (
        f"corpus: {len(corpus.text):,} characters of {corpus.files} standard-library files under {corpus.root}, "
        f"{len(vocab)} distinct characters\n"
        f"model: GPT {m.n_layer} layers, width {m.width}, {m.n_head} heads, seq {m.seq_len}: "
        f"{stats.model_numel:,} parameters\n"
        f"run: {world} ranks ({info.backend} on {info.device.type}), {spec.steps} steps of "
        f"{spec.batch_size} x {m.seq_len} tokens per rank, {_optimizer(spec)}, {c.compute_dtype}\n"
        f"zero3 config ({spec.config_source}): persistence < {c.param_persistence_threshold:,}, {sizes}\n"
        f"output: {out}"
    )
