"""``--plot``: step time against memory, one PNG per (workload, world).

x is the train peak memory per rank in units of the model's fp32 size, y
the median step time; one labelled point per runtime or configuration.
The points nearest the origin are the Pareto front: nothing is both
faster and smaller. matplotlib (the ``cli`` extra) is imported only here,
with the non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from z3kit_recipes.bench.spec import JSON


def plot_path(out: Path, case: JSON) -> Path:
    """Where ``case``'s PNG goes: next to the JSON report ``out``."""
    return out.with_name(f"{out.stem}-{case['workload']}-world{case['world']}.png")


def write_plots(report: JSON, out: Path) -> list[Path]:
    """One PNG per case with at least one successful run; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    for case in report["cases"]:
        ok = {name: r for name, r in case["runtimes"].items() if r["status"] == "ok"}
        if not ok:
            continue
        fig: Any
        ax: Any
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for name, r in ok.items():
            x, y = r["memory"]["train_peak_x_model"], r["median_s"]
            ax.scatter([x], [y])
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel("train peak memory per rank (x model fp32 size)")
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{case['workload']}, world {case['world']}")
        # room above and right of the highest and rightmost points for their labels
        ax.set_xlim(0, 1.2 * max(r["memory"]["train_peak_x_model"] for r in ok.values()))
        ax.set_ylim(0, 1.15 * max(r["median_s"] for r in ok.values()))
        ax.grid(True, alpha=0.3)
        path = plot_path(out, case)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
