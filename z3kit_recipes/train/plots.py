"""``--plot``: the loss curve and the live gathered parameters of one step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from z3kit_recipes.train.extras import optional_module
from z3kit_recipes.train.report import LOSS_WINDOW, mean, mean_over_ranks
from z3kit_recipes.zero3.training.timeline import TimelineEvent


def write_plots(
    out: Path, loss_table: Sequence[Sequence[float]], timeline: Sequence[TimelineEvent], max_live: int, model_numel: int
) -> list[str]:
    """``loss.png`` and, when a step's timeline was captured, ``live_params.png``
    in ``out``; returns the names written."""
    matplotlib = optional_module("matplotlib", "--plot")
    matplotlib.use("Agg")  # files only: no display needed, none opened
    plt = optional_module("matplotlib.pyplot", "--plot")
    written = [_plot_loss(plt, out, loss_table)]
    if timeline:
        written.append(_plot_live(plt, out, timeline, max_live, model_numel))
    return written


def _plot_loss(plt: Any, out: Path, loss_table: Sequence[Sequence[float]]) -> str:
    world, steps = len(loss_table), len(loss_table[0])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = list(range(steps))
    for r in range(world):
        ax.plot(xs, loss_table[r], lw=0.6, alpha=0.35, label=f"rank {r}" if world <= 8 else None)
    per_step = mean_over_ranks(loss_table)
    k = max(1, min(LOSS_WINDOW, steps // 10))
    smooth = [mean(per_step[max(0, i - k + 1) : i + 1]) for i in xs]
    ax.plot(xs, smooth, lw=2.0, color="black", label=f"mean over ranks, {k}-step average")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return "loss.png"


def _plot_live(plt: Any, out: Path, timeline: Sequence[TimelineEvent], max_live: int, model_numel: int) -> str:
    """Live gathered elements event by event, fetches, prefetches and releases
    marked, the forward and backward halves labelled at the root's fetches."""
    fig, ax = plt.subplots(figsize=(max(10.0, min(30.0, len(timeline) * 0.12)), 5.5))
    idx = list(range(len(timeline)))
    live = [e.live_numel for e in timeline]
    ax.step(idx, live, where="post", color="0.3", lw=1.2, label="live gathered elements")
    styles = {"fetch": ("tab:blue", "o"), "prefetch": ("tab:green", "^"), "release": ("tab:red", "v")}
    for kind, (color, marker) in styles.items():
        pts = [(i, e.live_numel) for i, e in zip(idx, timeline) if e.kind == kind and (e.numel > 0 or kind == "fetch")]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, s=22, zorder=3, label=kind)
    for i, e in zip(idx, timeline):
        if e.kind == "prefetch":
            ax.axvline(i, color="tab:green", alpha=0.25, lw=0.8)
    roots = [i for i, e in zip(idx, timeline) if e.kind == "fetch" and e.module == "<root>"]
    on_top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    if roots:
        ax.text(roots[0], 0.98, "forward", transform=on_top, va="top", fontsize=9, style="italic")
    if len(roots) >= 2:
        ax.axvline(roots[1] - 0.5, color="black", ls=":", lw=1.0)
        ax.text(roots[1], 0.98, "backward", transform=on_top, va="top", fontsize=9, style="italic")
    top = max(live, default=0)
    # reference lines only when they fit the scale of the curve
    limit_fits = 0 < max_live <= 2 * max(top, 1)
    if limit_fits:
        ax.axhline(max_live, color="tab:orange", ls="--", lw=1.0, label=f"max_live_parameters {max_live:,}")
    if model_numel <= 2 * max(top, 1):
        ax.axhline(model_numel, color="tab:purple", ls="-.", lw=1.0, label=f"whole model {model_numel:,}")
    fetch_ticks = [(i, e.module) for i, e in zip(idx, timeline) if e.kind == "fetch"]
    stride = max(1, math.ceil(len(fetch_ticks) / 80))
    ticks = fetch_ticks[::stride]
    ax.set_xticks([t[0] for t in ticks])
    ax.set_xticklabels([t[1] for t in ticks], rotation=90, fontsize=6)
    ax.set_xlabel("event of one training step (ticks: module fetched)")
    ax.set_ylabel("gathered parameter elements")
    ax.set_title("live gathered parameters over one training step (rank 0)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    ax.set_ylim(0, max(top, max_live if limit_fits else 0) * 1.12 + 1)
    fig.tight_layout()
    fig.savefig(out / "live_params.png", dpi=120)
    plt.close(fig)
    return "live_params.png"
