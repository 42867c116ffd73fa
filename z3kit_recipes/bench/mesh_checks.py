"""The targets of issue 21 checked on a ``--mesh`` report, and their lines.

- HSDP: what crosses nodes per rank and step is at most ``2 * model bytes / S``
  (one all-reduce of the rank's 1/S gradient partition across the replicas);
- hpZ: backward gathers add no inter-node bytes: outside backward's gathers
  hpZ moves across nodes what flat moves, and in them only the ranks' small
  agreement gathers, which flat has too (``LinkCounter`` splits a step by
  phase and kind);
- parity: every layout's losses against flat ZeRO-3's (max abs difference);
- memory: what each runtime holds between steps against the analytic bound
  (within ``tolerance``);
- the counter: on z3kit's layouts, the bytes counted from the c10d operators
  equal the engine's own count of the same step (so FSDP2's counted figures
  and hpZ's check rest on a count that agrees with z3kit's).
"""

from __future__ import annotations

from typing import Final

from z3kit_recipes.bench.mesh_spec import PARAM_BYTES, Z3KIT_LAYOUTS, MeshShape, hsdp_inter_node_bound_bytes
from z3kit_recipes.bench.spec import JSON

#: hpZ's figures may differ from flat's by this share (rounding per call)
HPZ_SLACK: Final = 0.01


def _ok(report: JSON, layout: str) -> JSON | None:
    r = report["layouts"].get(layout)
    return r if r is not None and r["status"] == "ok" else None


def _hsdp(report: JSON, shape: MeshShape) -> JSON:
    r = _ok(report, "hsdp")
    if r is None:
        return {"status": "not run"}
    psi = r["total_params"]
    bound = hsdp_inter_node_bound_bytes(psi, shape)
    return {"status": "ok" if r["inter_node_bytes_per_step"] <= bound else "failed",
            "inter_node_bytes": r["inter_node_bytes_per_step"], "bound_bytes": bound,
            # the direct-exchange model's figure for an unpadded partition: 2 (R - 1) / R of it
            "model_bytes": 2 * (shape.replicas - 1) * PARAM_BYTES * psi / (shape.replicas * shape.shard_size)}


def _hpz(report: JSON) -> JSON:
    """Both sides from ``LinkCounter``'s count of one step, so that what the engine does not
    log (the ranks' small agreement gathers, which are backward gathers across all ranks in
    both layouts) is on both sides alike: outside backward's gathers hpZ moves what flat
    moves, and backward's gathers across nodes drop to those agreement bytes."""
    flat = _ok(report, "flat")
    if flat is None:
        return {"status": "not run (needs flat)"}
    flat_backward = flat["counted"]["backward_gather_inter_node_bytes"]
    out: JSON = {"flat_inter_node_bytes": flat["counted"]["inter_node_bytes"],
                 "flat_backward_gather_inter_node_bytes": flat_backward,
                 "expected_inter_node_bytes_less_backward_gathers": flat["counted"]["inter_node_bytes"] - flat_backward}
    hpz = report["layouts"].get("hpz")
    if hpz is None or hpz["status"] != "ok":
        return {**out, "status": "not run" if hpz is None else f"{hpz['status']}: {hpz['note']}"}
    backward = hpz["counted"]["backward_gather_inter_node_bytes"]
    rest = hpz["counted"]["inter_node_bytes"] - backward
    expected = out["expected_inter_node_bytes_less_backward_gathers"]
    ok = abs(rest - expected) <= HPZ_SLACK * expected and backward <= HPZ_SLACK * flat_backward
    return {**out, "status": "ok" if ok else "failed", "inter_node_bytes": hpz["counted"]["inter_node_bytes"],
            "inter_node_bytes_less_backward_gathers": rest, "backward_gather_inter_node_bytes": backward}


def _parity(report: JSON) -> JSON:
    flat = _ok(report, "flat")
    if flat is None:
        return {}
    out: JSON = {}
    for layout, r in report["layouts"].items():
        if layout != "flat" and r["status"] == "ok":
            out[layout] = max(abs(a - b) for a, b in zip(r["losses"], flat["losses"]))
    return out


def check_targets(report: JSON, shape: MeshShape, *, tolerance: float) -> JSON:
    """Every target's figures and ``status`` ("ok", "failed", or why it was not checked)."""
    memory = {layout: {"ledger_over_bound": r["ledger_over_bound"],
                       "status": "ok" if r["ledger_over_bound"] <= tolerance else "failed"}
              for layout, r in report["layouts"].items() if r["status"] == "ok"}
    counter: JSON = {}
    for layout, r in report["layouts"].items():
        engine = r.get("counted", {}).get("engine_same_step") if r["status"] == "ok" else None
        if layout in Z3KIT_LAYOUTS and engine is not None:
            same = (r["counted"]["inter_node_bytes"], r["counted"]["intra_node_bytes"])
            counter[layout] = {"counted": same, "engine": (engine["inter_node"], engine["intra_node"])}
    return {"hsdp_inter_node": _hsdp(report, shape), "hpz_inter_node": _hpz(report),
            "loss_max_abs_diff_vs_flat": _parity(report), "resident_vs_bound": memory,
            "bound_tolerance": tolerance, "counter_vs_engine": counter}


def render_checks(checks: JSON) -> list[str]:
    """One line per target."""
    lines: list[str] = []
    h = checks["hsdp_inter_node"]
    if "bound_bytes" in h:
        lines.append(f"- HSDP inter-node bytes/step {h['inter_node_bytes']:,.0f} <= 2*model/S = "
                     f"{h['bound_bytes']:,.0f} ({h['status']}; the model's all-reduce of an unpadded "
                     f"partition is {h['model_bytes']:,.0f})")
    p = checks["hpz_inter_node"]
    if "flat_inter_node_bytes" in p:
        line = (f"- hpZ inter-node bytes in one step (c10d count): flat moves {p['flat_inter_node_bytes']:,.0f}, "
                f"{p['flat_backward_gather_inter_node_bytes']:,.0f} of them in backward's gathers")
        if "inter_node_bytes" in p:
            line += (f"; hpZ moves {p['inter_node_bytes']:,.0f}, {p['backward_gather_inter_node_bytes']:,.0f} in "
                     f"backward's gathers (the ranks' agreement gathers) and "
                     f"{p['inter_node_bytes_less_backward_gathers']:,.0f} outside them, where flat moves "
                     f"{p['expected_inter_node_bytes_less_backward_gathers']:,.0f} ({p['status']})")
        else:
            line += f" ({p['status']})"
        lines.append(line)
    parity = checks["loss_max_abs_diff_vs_flat"]
    if parity:
        lines.append("- losses vs flat ZeRO-3, max abs diff: " + ", ".join(f"{k} {v:.2e}" for k, v in parity.items()))
    memory = checks["resident_vs_bound"]
    if memory:
        lines.append(f"- resident (ledger) vs analytic bound, within {checks['bound_tolerance']}x: " + ", ".join(
            f"{k} {v['ledger_over_bound']:.3f}x ({v['status']})" for k, v in memory.items()))
    counter = checks["counter_vs_engine"]
    if counter:
        lines.append("- c10d count vs engine count (inter, intra; same step, mean over ranks): " + ", ".join(
            f"{k} {tuple(f'{x:,.0f}' for x in v['counted'])} vs {tuple(f'{x:,.0f}' for x in v['engine'])}"
            for k, v in counter.items()))
    return lines
